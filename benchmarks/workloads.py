"""Synthetic access patterns for comparing eviction policies, each a named class with a fixed seed.

    from workloads import CLASSES, generate
    keys = generate("loop", capacity=1000)   # numpy int64 keys, one access each

Each class stands for a pattern the adaptive-caching literature (ARC, LIRS, S3-FIFO, CACHEUS) tells
policies apart with, sized by the cache's capacity C (in entries) so a class means the same at every
capacity.  An access is replayed as a get (a hit refreshes the key) followed, on a miss, by a put.
Keys never collide across classes' parts: each part draws from its own range.
"""

from __future__ import annotations

import numpy as np

SEED = 20240601
ROUNDS = 20  # requests per class: ROUNDS x the capacity


def _zipf_ranks(rng: np.random.Generator, n_keys: int, alpha: float, size: int) -> np.ndarray:
    """`size` draws of ranks 0..n_keys-1 with P(rank r) ~ 1 / (r + 1) ** alpha."""
    w = 1.0 / np.arange(1, n_keys + 1, dtype=np.float64) ** alpha
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(size)), n_keys - 1)


def _fresh(start: int, size: int) -> np.ndarray:
    return np.arange(start, start + size, dtype=np.int64)


ONE_SHOT = 1 << 40  # keys from here on are read once (noise, scans)


def loop(c: int, rng: np.random.Generator) -> np.ndarray:
    """Many users or agents cycling through their contexts: a loop over 1.25 C keys, and 20% of the
    accesses one-shot keys between its steps."""
    n = ROUNDS * c
    span = int(1.25 * c)
    noise = rng.random(n) < 0.2
    out = np.empty(n, dtype=np.int64)
    out[~noise] = np.arange(int((~noise).sum())) % span
    out[noise] = _fresh(ONE_SHOT, int(noise.sum()))
    return out


def zipf_scan(c: int, rng: np.random.Generator) -> np.ndarray:
    """A Zipf hot set (alpha 0.8 over 4 C keys) broken every 4 C accesses by a one-shot scan of C keys."""
    parts, start = [], ONE_SHOT
    for _ in range(ROUNDS // 5):
        parts.append(_zipf_ranks(rng, 4 * c, 0.8, 4 * c))
        parts.append(_fresh(start, c))
        start += c
    return np.concatenate(parts)


def zipf_shift(c: int, rng: np.random.Generator) -> np.ndarray:
    """Zipf (alpha 0.9 over 4 C keys) whose key space moves to new keys every 15 C accesses, three
    times: popular contexts going out of fashion."""
    n, phase = 60 * c, 15 * c
    ranks = _zipf_ranks(rng, 4 * c, 0.9, n)
    return ranks + (np.arange(n) // phase) * (4 * c)


def short_reuse(c: int, rng: np.random.Generator) -> np.ndarray:
    """Recency at its plainest: each new key re-read 1-3 times within the next ~0.3 C accesses, then
    never (a conversation's turns)."""
    n = ROUNDS * c
    out = np.full(n, -1, dtype=np.int64)
    key = 0
    for t in range(n):
        if out[t] >= 0:
            continue
        out[t] = key
        for _ in range(rng.integers(1, 4)):
            u = t + 1 + int(rng.exponential(0.1 * c))
            while u < n and out[u] >= 0:
                u += 1
            if u < n:
                out[u] = key
        key += 1
    return out


def zipf(c: int, rng: np.random.Generator) -> np.ndarray:
    """Frequency-heavy: a steady Zipf (alpha 1.0) over 10 C keys."""
    return _zipf_ranks(rng, 10 * c, 1.0, ROUNDS * c)


def recency(c: int, rng: np.random.Generator) -> np.ndarray:
    """Recency-heavy: each access re-reads the key at LRU stack distance d (geometric, mean 0.4 C) or, one
    time in five, a new key; a stack-distance model in which LRU is optimal among demand policies."""
    n = ROUNDS * c
    stack: list[int] = []
    out = np.empty(n, dtype=np.int64)
    key = 0
    dists = rng.geometric(1.0 / (0.4 * c), n)
    new = rng.random(n) < 0.2
    for t in range(n):
        d = int(dists[t])
        if new[t] or d > len(stack):
            k = key
            key += 1
        else:
            k = stack.pop(-d)
        stack.append(k)
        if len(stack) > 8 * c:
            del stack[: len(stack) - 4 * c]
        out[t] = k
    return out


def mixed(c: int, rng: np.random.Generator) -> np.ndarray:
    """Mixed hot sets: a Zipf hot set of 0.5 C keys read throughout, beside a second set of 0.7 C keys
    that is read in bursts (a batch job's working set), and 10% one-shot keys."""
    n = ROUNDS * c
    out = _zipf_ranks(rng, c // 2, 0.7, n)
    burst = ((np.arange(n) // (2 * c)) % 2 == 1) & (rng.random(n) < 0.5)
    out[burst] = (1 << 30) + rng.integers(0, int(0.7 * c), int(burst.sum()))
    noise = rng.random(n) < 0.1
    out[noise] = _fresh(ONE_SHOT, int(noise.sum()))
    return out


def loop_zipf(c: int, rng: np.random.Generator) -> np.ndarray:
    """Phases: a Zipf hot set (alpha 0.9 over 4 C keys) for 4 C accesses, then 4 C of a loop over
    1.25 C keys with 20% one-shot keys between its steps: the policy must change its mind both ways."""
    parts, start = [], ONE_SHOT
    for r in range(ROUNDS // 8):
        parts.append(_zipf_ranks(rng, 4 * c, 0.9, 4 * c))
        lp = (1 << 30) + np.arange(4 * c) % int(1.25 * c)
        noise = rng.random(4 * c) < 0.2
        lp[noise] = _fresh(start, int(noise.sum()))
        start += int(noise.sum())
        parts.append(lp)
    return np.concatenate(parts)


CLASSES = {
    "loop": loop,
    "zipf+scan": zipf_scan,
    "zipf-shift": zipf_shift,
    "short-reuse": short_reuse,
    "zipf": zipf,
    "recency": recency,
    "mixed": mixed,
    "loop/zipf": loop_zipf,
}


def generate(name: str, capacity: int, seed: int = SEED) -> np.ndarray:
    """The accesses of class `name` for a cache of `capacity` entries (the same for the same arguments)."""
    rng = np.random.default_rng([seed, capacity, list(CLASSES).index(name)])
    return CLASSES[name](capacity, rng)


__all__ = ["CLASSES", "generate"]
