"""How many leading chunks of a request a pool holds: one lock hold, and remembered per request.

Engines ask it for every waiting request at every scheduling step, and a
prompt of 128k tokens is 512 chunks of 256 tokens or 8192 of 16.  Hashing
the whole prompt and probing every key each time costs 1-17 ms a request a
step; `LookupMemo` makes a repeat cost a few microseconds (figures in
docs/python-api.md, "Leading-chunk lookups"; `python -m benchmarks --only lookup`).

`leading` is the pool-level probe: keys in order, one lock hold, stopping at
the first key that is not live in memory or on disk (what `contains_many`
says of each key, without looking past the first miss).

`LookupMemo` remembers, per request id: the request's chain digests and the
keys made from them (a longer prompt of the same request hashes and encodes
only its new chunks), and the answer of its last lookup -- chunks [lo, hi)
were live in memory -- with the pool header's `gone_seq` read in the same
lock hold and the earliest expiry among those chunks.  `gone_seq`
(docs/design.md) is bumped, in the shared header, whenever a sealed entry
leaves memory in any process (delete, eviction, expiry, replacement, an
in-place overwrite) and by every repair.  So while it is unchanged, and no
chunk of [lo, hi) has reached its expiry (expiry is lazy: an expired entry
is not live although nothing removed it), those chunks are still there,
and a repeat looks up only from chunk hi on -- usually one probe of the
first absent chunk.  Chunks added since are found by that probe.  When
nothing is left to probe the repeat takes no lock at all: it reads
`gone_seq` and the dirty mark (a holder that died mid-change leaves the
mark set, and the repair it calls for bumps `gone_seq`; a set mark sends
the repeat through the lock).

Entries on a disk tier below are looked up again at every call (their
removal does not bump `gone_seq`); only chunks live in memory are
remembered.

A request id names one token sequence that only grows (as the engines'
requests do).  The digests passed for a request must extend those passed
before; the memo checks the last one it has against them (a chain digest
names its whole prefix) and starts afresh when it differs.  `forget` a
request when it finishes; at most `capacity` requests are remembered,
least recently used first out.  A memo may be used from many threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Protocol, Sequence

import numpy as np
from xxhash import xxh3_64_intdigest

from .core import Core
from .errors import UsageError
from .layout import H_GONE_SEQ, H_HITS, H_MISSES, MAX_KEY_BYTES
from .tiers import Tiers
from .values import key_bytes


class Attached(Protocol):
    """What a lookup uses of a pool handle (a Pool is one): its core and its tiers.  Named here, not
    imported from pool.py, which is above this module."""

    core: Core
    tiers: Tiers

DEFAULT_CAPACITY = 4096

Encoded = tuple  # (key bytes, key hash), or (None, 0) for a key that cannot be stored (never present)


def encode(keys: Sequence[Any]) -> list[Encoded]:
    """(key bytes, xxh3 hash) of every key; a bad key is (None, 0): absent, as contains_many says."""
    out: list[Encoded] = []
    for k in keys:
        if k.__class__ is str and k.isascii() and 0 < len(k) <= MAX_KEY_BYTES:
            kb = k.encode()
        else:
            try:
                kb = key_bytes(k)[0]
            except UsageError:
                out.append((None, 0))
                continue
        out.append((kb, xxh3_64_intdigest(kb)))
    return out


def probe_locked(core: Core, tiers: Tiers, enc: Sequence[Encoded], start: int, stop: int,
                 known: tuple[int, int, float] | None = None) -> tuple[int, int, int, int, float]:
    """Of `enc[start:stop]`, the leading run that is there (lock held).

    `known` = (gone_seq, hi, expiry) of an earlier answer that chunks
    [start, hi) were live in memory: while the header's gone_seq is still
    that and the clock before `expiry` (0: none), the probe starts at hi.
    Returns (first chunk probed, chunks there from it on, of those the leading ones live in memory,
    gone_seq read in this hold, earliest expiry among the ones live in memory or 0.0)."""
    seq = int(core.counters[H_GONE_SEQ])
    a = start
    if known is not None and known[0] == seq and (not known[2] or core.clock() < known[2]):
        a = known[1]
    find = core.find
    slots = []
    i = a
    while i < stop:
        kb, kh = enc[i]
        if kb is None:
            break
        s = find(kb, kh)
        if s < 0:
            break
        slots.append(s)
        i += 1
    mem = len(slots)
    expiry = 0.0
    if slots:
        exp = core.columns["expiry"][slots]
        if exp.any():
            dead = np.flatnonzero((exp > 0) & (exp <= core.clock()))
            if dead.size:  # expired, not yet removed: not live (Core.find_live)
                mem = int(dead[0])
                exp = exp[:mem]
            live = exp[exp > 0]
            expiry = float(live.min()) if live.size else 0.0
    n = mem
    if tiers.answer_contains:  # the disk tier, the snapshot a fill still brings back
        while a + n < stop and enc[a + n][0] is not None and tiers.contains(*enc[a + n]):
            n += 1
    return a, n, mem, seq, expiry


def leading(core: Core, tiers: Tiers, keys: Sequence[Any]) -> int:
    """Pool.leading: how many leading `keys` are live in memory or on disk, in one lock hold that stops at
    the first that is not (a bad key is not there)."""
    enc = encode(keys)
    return core.locked(probe_locked, core, tiers, enc, 0, len(enc))[1]


def count_lookups(pool: Attached, hits: int, misses: int) -> None:
    """Add `hits` and `misses` to the pool's own counters (one lock hold), for a lookup that went through
    `leading` or a `LookupMemo`: those only probe the index and count nothing, so an engine's lookups
    would otherwise be missing from the pool's hit ratio (`cortex cache status`, `--watch`, the exporter).
    Raises UsageError for a negative count."""
    if hits < 0 or misses < 0:
        raise UsageError(f"hits and misses are counts, not {hits} and {misses}")
    counters = pool.core.counters

    def add() -> None:
        counters[H_HITS] += hits
        counters[H_MISSES] += misses

    pool.core.locked(add)


class _Request:
    """What a memo keeps of one request; `state` is replaced whole, so a reader sees one answer."""

    __slots__ = ("digests", "enc", "state")

    def __init__(self) -> None:
        self.digests: list[bytes] = []
        self.enc: list[Encoded] = []  # (prefix + hex(digest), its hash), as far as they were needed
        # (core, lo, hi, gone_seq, expiry): chunks [lo, hi) were live in memory of that core's pool
        self.state: tuple[Any, int, int, int, float] | None = None


class LookupMemo:
    """Leading-chunk lookups of requests over one pool (or pools in turn), remembered per request id.

    `prefix`: the key of a chunk is `prefix + digest.hex()`.  `check`: an
    optional test of chunks found in the index, `check(pool, keys) -> list
    of bool` (keys as bytes; the KV layer's header check); only leading
    chunks that pass are counted and remembered.  See the module doc for when a repeat is exact.
    """

    def __init__(self, prefix: str, capacity: int = DEFAULT_CAPACITY,
                 check: Callable[[Attached, list[str]], list[bool]] | None = None) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise UsageError(f"capacity must be a positive integer, not {capacity!r}")
        self.prefix = prefix
        self._pb = prefix.encode()
        if not self._pb.isascii():
            raise UsageError(f"prefix {prefix!r} is not ASCII")
        self.capacity = capacity
        self._check = check
        self._lock = threading.Lock()
        self._reqs: OrderedDict[Any, _Request] = OrderedDict()

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs

    def forget(self, request_id: Any) -> None:
        """Drop what is remembered of `request_id` (nothing if none)."""
        with self._lock:
            self._reqs.pop(request_id, None)

    def clear(self) -> None:
        with self._lock:
            self._reqs.clear()

    def digests(self, request_id: Any) -> list[bytes]:
        """The chain digests last passed for `request_id` (empty if none): the caller extends them."""
        r = self._reqs.get(request_id)
        return r.digests if r is not None else []

    def _request(self, request_id: Any, digests: Sequence[bytes], stop: int) -> _Request:
        """The request's record, made afresh if `digests` do not extend its own; keys made up to `stop`."""
        with self._lock:
            r = self._reqs.get(request_id)
            if r is None:
                r = self._reqs[request_id] = _Request()
                if len(self._reqs) > self.capacity:
                    self._reqs.popitem(last=False)
            else:
                self._reqs.move_to_end(request_id)
                k = len(r.enc)
                if r.digests is not digests and k and (len(digests) < k or digests[k - 1] != r.digests[k - 1]):
                    r = self._reqs[request_id] = _Request()
            r.digests = digests if isinstance(digests, list) else list(digests)
            k = len(r.enc)
            if stop > k:
                pb, h = self._pb, xxh3_64_intdigest
                for d in digests[k:stop]:
                    kb = pb + d.hex().encode()
                    r.enc.append((kb, h(kb)) if len(kb) <= MAX_KEY_BYTES else (None, 0))
            return r

    def leading(self, pool: Attached, request_id: Any, digests: Sequence[bytes], start: int = 0,
                stop: int | None = None) -> int:
        """How many of `digests[start:stop]`, from the first, have their chunk in `pool` (live in memory or
        on disk, and passing `check`); what `Pool.leading` over their keys says, looking up only what
        may have changed since the last lookup of `request_id`."""
        stop = len(digests) if stop is None else min(stop, len(digests))
        if start >= stop:
            return 0
        core, tiers = pool.core, pool.tiers
        r = self._request(request_id, digests, stop)
        st = r.state
        known = None
        if st is not None and st[0] is core and st[1] <= start <= st[2]:
            known = (st[3], st[2], st[4])
            if st[2] >= stop and _unchanged(core, st[3]) and (not st[4] or core.clock() < st[4]):
                return stop - start  # nothing can have left, nothing to look up
        a, n, mem, seq, expiry = core.locked(probe_locked, core, tiers, r.enc, start, stop, known)
        ok = n
        if n and self._check is not None:
            passed = self._check(pool, [kb for kb, _ in r.enc[a : a + n]])
            ok = passed.index(False) if False in passed else n
        hi = a + min(mem, ok)
        if a > start:  # the remembered run was still there: it grows by what was found after it
            lo, old = st[1], st[4]  # type: ignore[index]
            expiry = min(old, expiry) if old and expiry else (old or expiry)
        else:
            lo = start
        with self._lock:
            if self._reqs.get(request_id) is r:
                r.state = (core, lo, hi, seq, expiry)
        return a - start + ok


def _unchanged(core: Core, seq: int) -> bool:
    """Is the pool's gone_seq still `seq`, read without the lock?  Not when the dirty mark is set (a
    change under way, or a holder that died mid-change: its repair bumps gone_seq) or the handle
    cannot be used (the locked path raises what it should)."""
    if core.closed or core.forked or (core.guard is not None and core.guard.gone):
        return False
    return not core.fields.dirty[0] and int(core.counters[H_GONE_SEQ]) == seq


__all__ = ["DEFAULT_CAPACITY", "LookupMemo", "count_lookups", "encode", "leading", "probe_locked"]
