"""auto's online choice of regime (eviction.Auto, queues.QueueVictims._auto_admit): the decisions on small
crafted sequences, the same bits from the C and the Python write paths, and the direction of the figures
on a small version of every class of benchmarks/workloads.py (hit rates, never time).

Pools hold 64-byte blocks, one entry each, so a pool of n entries evicts exactly one victim per put
once full; they use the real clock (and so the C fast path) unless a test turns it off.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import workloads
from cortex_cache.core import PURE_PYTHON_ENV
from cortex_cache.eviction import Auto
from cortex_cache.queues import AUTO_ADAPTIVE, AUTO_LOOP

BS = 64
V = b"v" * 16


@pytest.fixture
def pool(make_pool):
    def factory(n: int, policy: str = "auto", **kw):
        return make_pool(n * BS, block_size=BS, max_entries=n, policy=policy, **kw)

    return factory


def replay(p, keys) -> float:
    """Hit rate of `keys` as single-key requests: a get, and on a miss a put."""
    hits = 0
    for k in keys:
        kb = b"%d" % k
        if p.get(kb) is not None:
            hits += 1
        else:
            p.put(kb, V)
    return hits / len(keys)


def header(p):
    return p.core.queues.header[0]


def loop_keys(n: int, laps: int, noise: float = 0.2, seed: int = 1) -> list[int]:
    """A loop over 1.25 n keys, `laps` times, with a share `noise` of one-shot keys between its steps."""
    rng = np.random.default_rng(seed)
    span, out, fresh = int(1.25 * n), [], 1 << 40
    for i in range(laps * span):
        while rng.random() < noise:
            out.append(fresh)
            fresh += 1
        out.append(i % span)
    return out


def test_a_loop_longer_than_the_pool_turns_on_the_loop_regime_which_keeps_part_of_it(pool):
    """A loop over more keys than the pool holds brings back a ghost with nearly every put and hits almost
    never: auto takes the loop regime (a 5% small queue, queue 1 keeping what it has), and from then on
    keeps hitting a steady part of the loop, where LRU keeps nothing."""
    n = 200
    keys = loop_keys(n, 12)
    a, lru = pool(n), pool(n, "lru")
    warm = len(keys) // 3
    replay(a, keys[:warm])
    replay(lru, keys[:warm])
    h = header(a)
    assert int(h["q_regime"]) == AUTO_LOOP and float(h["q_ghost_rate"]) > Auto.LOOP_LEAVE
    late_auto, late_lru = replay(a, keys[warm:]), replay(lru, keys[warm:])
    assert late_lru == 0.0 and late_auto > 0.3
    assert int(h["q_regime"]) == AUTO_LOOP and a.verify()["ok"]


def test_the_loop_regime_ends_when_the_loop_does(pool):
    """Once the loop stops, and a small hot set is read over and over between keys read once, the puts
    (the one-shot keys) bring no ghosts back: auto leaves the loop regime and adapts its share again.
    (The rates move with puts only: a pool that only hits keeps its regime, which costs nothing.)"""
    n = 200
    a = pool(n)
    replay(a, loop_keys(n, 6))
    assert int(header(a)["q_regime"]) == AUTO_LOOP
    rng = np.random.default_rng(2)
    hot = rng.integers(1 << 20, (1 << 20) + n // 2, 20 * n)
    hot[rng.random(hot.size) < 0.3] = -1
    one_shot = iter(range(1 << 30, 1 << 31))
    rate = replay(a, [k if k >= 0 else next(one_shot) for k in hot.tolist()])
    assert int(header(a)["q_regime"]) == AUTO_ADAPTIVE
    assert float(header(a)["q_ghost_rate"]) < Auto.LOOP_LEAVE and rate > 0.6


def test_a_scan_of_one_shot_keys_does_not_flush_the_hot_set(pool):
    """A hot set read again and again sits in queue 1; a scan of twice the pool's worth of keys never read
    again goes through the small queue and out, so the hot set is still there after it (LRU loses it),
    and the scan's ghosts, never coming back, leave the regime alone."""
    n = 200
    hot = [(1 << 20) + i for i in range(n // 2)]
    a, lru = pool(n), pool(n, "lru")
    for p in (a, lru):
        for _ in range(4):
            replay(p, hot)
    scan = list(range(1 << 30, (1 << 30) + 2 * n))
    replay(a, scan)
    replay(lru, scan)
    kept = sum(b"%d" % k in a for k in hot)
    assert kept >= 0.9 * len(hot) and not any(b"%d" % k in lru for k in hot)
    assert int(header(a)["q_regime"]) == AUTO_ADAPTIVE and float(header(a)["q_target"]) < Auto.RECENCY


def test_keys_back_just_after_they_went_move_the_share_into_the_recency_regime(pool):
    """Each new key read again soon after its put, but only after a few more puts than the small queue
    holds: every one comes back from queue 0's ghosts at once, which says loudest that the small queue is
    too short; the share grows past RECENCY (LRU-like: one round per read)."""
    n = 200
    a = pool(n)
    keys, k = [], 0
    for _ in range(40 * n):
        keys.append(k)
        if k >= 40:
            keys.append(k - 40)  # a read-back 40 puts later: past a 10% small queue
        k += 1
    replay(a, keys)
    h = header(a)
    assert float(h["q_target"]) >= Auto.RECENCY and int(h["q_regime"]) == AUTO_ADAPTIVE
    assert a.core.queues.frequency_regime() is False


def test_a_ghost_moves_the_share_by_its_weight(pool):
    """One ghost hit, worked out by hand.  Fill n entries (all in queue 0); a put evicts the small queue's
    head k0 (ghost 0 of ring 0); putting k0 back first evicts k1 (ghost 1), then finds k0 one ghost deep,
    with n - 1 entries: the share grows by far x (1 + NEAR_BOOST[0] x near) x max(1, live1 / live0) / (n - 1),
    where far = 1 - 1 / (TAPER (n - 1)) and near = 1 - 1 / (NEAR (n - 1)); k0 joins queue 1."""
    n = 100
    a = pool(n)
    for i in range(n):
        a.put(f"k{i}", V)
    h = header(a)
    assert float(h["q_target"]) == 0.1 and int(h["q_count0"]) == n
    a.put("new", V)
    assert "k0" not in a and int(h["g0_live"]) == 1
    a.put("k0", V)
    entries, depth = n - 1, 1
    far = 1.0 - depth / (Auto.TAPER * entries)
    near = 1.0 - depth / (Auto.NEAR * entries)
    assert float(h["q_target"]) == pytest.approx(0.1 + far * (1.0 + Auto.NEAR_BOOST[0] * near) / entries, rel=1e-12)
    assert "k1" not in a and int(h["q_count1"]) == 1 and int(h["g0_live"]) == 1  # k1 still a ghost


@pytest.mark.parametrize("cls", list(workloads.CLASSES))
def test_auto_is_near_the_best_classic_policy_on_every_class(pool, cls):
    """The direction of docs/performance.md's workload table, on a small version of each class (200 entries):
    auto within 0.015 of the best of lru, s3fifo and arc (small pools are noisier than the benchmark's)."""
    n = 200
    keys = workloads.generate(cls, n).tolist()
    rates = {policy: replay(pool(n, policy), keys) for policy in ("lru", "s3fifo", "arc", "auto")}
    best = max(rates[p] for p in ("lru", "s3fifo", "arc"))
    assert rates["auto"] >= best - 0.015, rates


def test_both_write_paths_take_the_same_decisions(pool, monkeypatch):
    """A loop, then short reuse, then a hot set: through the C write path and the Python one, the queue
    header (regime, rates, share, counts, rings) and the queue columns come out bit for bit the same."""
    n = 100
    keys = loop_keys(n, 6) + [k for i in range(2000) for k in ((1 << 32) + i, (1 << 32) + max(0, i - 15))]
    keys += np.random.default_rng(3).integers(1 << 34, (1 << 34) + n, 10 * n).tolist()
    fast = pool(n)
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    slow = pool(n)
    assert fast.core.fast is not None and slow.core.fast is None
    regimes = set()
    for start in range(0, len(keys), 500):
        assert replay(fast, keys[start : start + 500]) == replay(slow, keys[start : start + 500])
        regimes.add(int(header(fast)["q_regime"]))
    assert regimes == {AUTO_ADAPTIVE, AUTO_LOOP}, "the sequence missed a regime: the test missed its point"
    hf, hs = header(fast), header(slow)
    for name in hf.dtype.names:
        assert hf[name] == hs[name] or (np.isnan(hf[name]) and np.isnan(hs[name])), name
    for name in ("queue", "freq", "qseq"):
        assert np.array_equal(fast.core.queues.cols[name], slow.core.queues.cols[name]), name
    for gf, gs in zip(fast.core.queues.ghosts, slow.core.queues.ghosts):
        assert np.array_equal(gf.hashes, gs.hashes)


@pytest.mark.parametrize("field, value", [("q_regime", 7), ("q_ghost_rate", float("nan")), ("q_hit_rate", -1.0),
                                          ("q_ghost_rate", 2.0)])
def test_a_damaged_regime_is_found_and_learnt_again(pool, field, value):
    """The regime and its rates are learnt state: verify finds them out of range, repair starts them over
    (adaptive, rates zero, as at create), and the next puts learn them again."""
    n = 100
    a = pool(n)
    replay(a, loop_keys(n, 4))
    h = header(a)
    h[field] = value
    rep = a.verify()
    assert not rep["ok"] and any("regime" in x for x in rep["problems"])
    a.verify(repair=True)
    assert a.verify()["ok"]
    assert (int(h["q_regime"]), float(h["q_ghost_rate"]), float(h["q_hit_rate"])) == (AUTO_ADAPTIVE, 0.0, 0.0)
    replay(a, loop_keys(n, 6, seed=4))
    assert int(h["q_regime"]) == AUTO_LOOP and a.verify()["ok"]
