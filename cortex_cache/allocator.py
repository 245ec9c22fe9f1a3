"""Find contiguous runs of free blocks in the block map (one byte per block).

Next-fit: the search starts at a cursor kept in the header and wraps around,
so an empty or steadily-evicting pool allocates in O(run length), and a full
scan (vectorised, O(n_blocks) in numpy) happens only when the neighbourhood
of the cursor is taken.
"""

from __future__ import annotations

import numpy as np

_CHUNK = 1 << 20  # blocks scanned per numpy pass


def _first_run(free: np.ndarray, k: int) -> int:
    """Index of the first run of `k` True values in `free`, or -1."""
    if k == 1:
        i = int(free.argmax())
        return i if free[i] else -1
    padded = np.empty(free.size + 2, dtype=np.int8)
    padded[0] = padded[-1] = 0
    padded[1:-1] = free
    edges = np.diff(padded)
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    long_enough = np.flatnonzero(ends - starts >= k)
    return int(starts[long_enough[0]]) if long_enough.size else -1


def find_run(blockmap: np.ndarray, k: int, hint: int = 0) -> int:
    """First block of a free run of `k` blocks at or after `hint` (wrapping), or -1."""
    n = blockmap.size
    if k > n or k < 1:
        return -1
    if hint + k <= n and not blockmap[hint : hint + k].any():
        return hint
    # Scan [hint, n) then [0, hint + k - 1), in chunks that overlap by k - 1
    # so runs crossing a chunk edge are found.
    for lo, hi in ((hint, n), (0, min(n, hint + k - 1))):
        start = lo
        while start + k <= hi:
            stop = min(hi, start + _CHUNK + k - 1)
            i = _first_run(blockmap[start:stop] == 0, k)
            if i >= 0:
                return start + i
            start = stop - k + 1
    return -1


def run_around(blockmap: np.ndarray, first: int, count: int, k: int) -> int:
    """After freeing [first, first+count): start of a free run of `k` blocks touching it, or -1.

    Cheap check used during eviction, so that each victim costs O(k), not a scan.
    """
    n = blockmap.size
    lo = max(0, first - (k - 1))
    hi = min(n, first + count + (k - 1))
    i = _first_run(blockmap[lo:hi] == 0, k)
    return lo + i if i >= 0 else -1


def largest_run(blockmap: np.ndarray) -> int:
    """Length of the longest run of free blocks (what the largest value that fits without eviction needs)."""
    padded = np.empty(blockmap.size + 2, dtype=np.int8)
    padded[0] = padded[-1] = 0
    padded[1:-1] = blockmap == 0
    edges = np.diff(padded)
    lengths = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    return int(lengths.max(initial=0))


__all__ = ["find_run", "run_around", "largest_run"]
