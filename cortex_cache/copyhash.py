"""Copy a value and take its xxh3_64 in one pass over memory.

Each cache-sized step is hashed where it landed while it is still in the CPU
cache, so a checksummed copy reads the source once.  The C build
(`_fastpath.copy_hash`: xxHash vendored under third_party/, AVX2 where the CPU
has it) copies and hashes a whole value with the GIL let go, so copy threads
run side by side; the Python loop here is the fallback (no C compiler at
install, or CORTEX_CACHE_PURE_PYTHON set) and gives the same checksum.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import xxhash

from .core_fast import C_COPY_HASH, C_COPY_HASH_ISA, C_COPY_HASH_MANY, C_GATHER_HASH, PURE_PYTHON_ENV

HASH_CHUNK = 256 * 1024  # the Python loop's step: a copy and a hash call per step, each without the GIL


def _bytes(buf: Any) -> np.ndarray:
    return np.frombuffer(memoryview(buf).cast("B"), np.uint8)


def _copy_hashing(h: Any, d: np.ndarray, s: np.ndarray) -> None:
    # numpy's copy and xxhash's update each let the GIL go, a step at a time.
    for c in range(0, s.nbytes, HASH_CHUNK):
        np.copyto(d[c : c + HASH_CHUNK], s[c : c + HASH_CHUNK])
        h.update(d[c : c + HASH_CHUNK])


def copy_hash_py(dst: Any, src: Any, head: bytes = b"") -> int:
    """Copy buffer `src` into buffer `dst` (the same length) and return xxh3_64 of `head` + the copy."""
    d, s = _bytes(dst), _bytes(src)
    if not d.flags.writeable:
        raise TypeError("copy_hash: dst is read-only")
    if d.nbytes != s.nbytes:
        raise ValueError(f"copy_hash: dst holds {d.nbytes} bytes, src {s.nbytes}")
    h = xxhash.xxh3_64(head)
    _copy_hashing(h, d, s)
    return h.intdigest()


def copy_hash_many_py(dsts: Sequence[Any], srcs: Sequence[Any], head: bytes = b"") -> int:
    """Copy each of `srcs` into its buffer of `dsts` (pairs of the same length) and return xxh3_64 of
    `head` followed by every copy, in order: a value gathered from (or scattered to) pieces."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_hash_many: {len(dsts)} dsts, {len(srcs)} srcs")
    pairs = [(_bytes(d), _bytes(s)) for d, s in zip(dsts, srcs)]
    for i, (d, s) in enumerate(pairs):  # every pair checked before a byte is copied
        if not d.flags.writeable:
            raise TypeError(f"copy_hash_many: dst {i} is read-only")
        if d.nbytes != s.nbytes:
            raise ValueError(f"copy_hash_many: dst {i} holds {d.nbytes} bytes, src {s.nbytes}")
    h = xxhash.xxh3_64(head)
    for d, s in pairs:
        _copy_hashing(h, d, s)
    return h.intdigest()


def gather_hash_py(dst: Any, src: Any, offsets: np.ndarray, lengths: np.ndarray, sums: np.ndarray) -> int:
    """Copy the pieces `src[offsets[i] : offsets[i] + lengths[i]]` into `dst` back to back and put each one's
    xxh3_64 into `sums[i]` (u64 arrays); the bytes copied.  Every piece is checked first (ValueError)."""
    d, s = _bytes(dst), _bytes(src)
    offs, lens = np.asarray(offsets, np.uint64), np.asarray(lengths, np.uint64)
    if not (len(offs) == len(lens) == len(sums)):
        raise ValueError("gather_hash: offsets, lengths and sums must be u64 buffers of one length")
    total = int(lens.sum()) if len(lens) else 0
    if len(offs) and (int((offs + lens).max()) > s.nbytes or (offs > s.nbytes).any()) or total > d.nbytes:
        raise ValueError("gather_hash: a piece is outside src or dst")
    at = 0
    for n, (o, ln) in enumerate(zip(offs.tolist(), lens.tolist())):
        d[at : at + ln] = s[o : o + ln]
        sums[n] = xxhash.xxh3_64_intdigest(d[at : at + ln])
        at += ln
    return total


_PURE = C_COPY_HASH is None or os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")
# copy_hash(dst, src, head=b"") -> int, as copy_hash_py; chosen once, at import.
copy_hash: Any = copy_hash_py if _PURE else C_COPY_HASH
# copy_hash_many(dsts, srcs, head=b"") -> int, as copy_hash_many_py.
copy_hash_many: Any = copy_hash_many_py if _PURE else C_COPY_HASH_MANY
# gather_hash(dst, src, offsets, lengths, sums) -> int, as gather_hash_py: one call for a batch of values.
gather_hash: Any = gather_hash_py if _PURE or C_GATHER_HASH is None else C_GATHER_HASH
ISA: str = "python" if _PURE else str(C_COPY_HASH_ISA)  # what runs it: "avx2", "baseline" or "python"

__all__ = ["HASH_CHUNK", "ISA", "copy_hash", "copy_hash_many", "copy_hash_many_py", "copy_hash_py", "gather_hash",
           "gather_hash_py"]
