"""Hash chains in a segment: rebuilt from their members, and walked (the memory and the disk index share them)."""

from __future__ import annotations

import numpy as np


def build_chains(members: np.ndarray, hashes: np.ndarray, mask: int, n_buckets: int, n: int,
                 free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hash chains of `members` (slot numbers, with their key hashes) and the free list, built anew.

    Returns (bucket heads, next links); shared by the memory and the disk index.
    """
    buckets = np.full(n_buckets, -1, dtype=np.int32)
    nxt = np.full(n, -1, dtype=np.int32)
    b = (hashes & np.uint64(mask)).astype(np.int64)
    o = np.argsort(b, kind="stable")
    sb, ss = b[o], members[o].astype(np.int32)
    if ss.size:
        same = sb[:-1] == sb[1:]
        nxt[ss[:-1][same]] = ss[1:][same]
        heads = np.flatnonzero(np.r_[True, ~same])
        buckets[sb[heads]] = ss[heads]
    if free.size:
        nxt[free[:-1]] = free[1:]
    return buckets, nxt


def chain_members(buckets: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """Slots reachable through the chains, sorted; [-1] for a loop or a link out of range (bounded walk)."""
    seen: list[int] = []
    limit = nxt.size
    for b in map(int, np.flatnonzero(buckets >= 0)):
        i = int(buckets[b])
        steps = 0
        while 0 <= i < limit and steps <= limit:
            seen.append(i)
            i = int(nxt[i])
            steps += 1
        if steps > limit or i >= limit:
            return np.array([-1])
    return np.sort(np.array(seen, dtype=np.int64))


def unchain(bkt: memoryview, nxt: memoryview, b: int, i: int) -> None:
    """Take member `i` out of the chain of bucket `b` (typed views of the bucket heads and next links)."""
    j = bkt[b]
    if j == i:
        bkt[b] = nxt[i]
        return
    while j >= 0:
        nj = nxt[j]
        if nj == i:
            nxt[j] = nxt[i]
            return
        j = nj


__all__ = ["build_chains", "chain_members", "unchain"]
