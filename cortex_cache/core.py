"""The core: one pool segment mapped, and the invariants that keep it whole (docs/design.md, "Layers").

`Core` owns the mapping and everything in it that the memory tier needs: the
lock and dirty-mark protocol, the slot table, hash chains, block map and key
arena, pin records, and the entry life cycle (reserve -> copy -> seal, or
abort; find/touch; remove; evict-one; reaping of dead processes' leftovers).
It knows nothing of tiers, snapshots, the CLI or torch: what they need happens
through its interface below and two hooks,

- `on_evict(slot)`: called with the lock held for an entry about to leave
  memory by eviction (not by expiry or delete), while its bytes are still there;
- `after_unlock`: callables run once the lock is let go, in order (work begun
  under the lock and finished outside it: a disk spill).

Core is one class in four files: this one (the mapping, locking, the entry
life cycle, lookups, generations), core_alloc.py (room: slots, blocks, key
cells, eviction, dead processes' leftovers), core_pins.py (pin records) and
core_fast.py (the binding to the C fast path, and the names it exports).

Locking: `locked(fn, *args)` runs `fn` with the pool lock held and the dirty
mark set (docs/design.md, "Invariants" 3).  Every method documented "lock
held" may only be called inside such a section; a batch of operations can run
in one section.  The raw tables (`columns`, `header`, `block_map`, `key_map`,
`buckets`, `pin_records`) are for repair and vectorised scans, also lock held.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import numpy as np
from xxhash import xxh3_64_intdigest

from . import core_fast, procs, queues, segment
from .chains import unchain
from .core_alloc import Allocation
from .core_fast import (  # re-exported for the layers above (__all__)
    C_COPY_HASH,
    C_COPY_HASH_ISA,
    C_COPY_HASH_MANY,
    COPY_IN_LOCK,
    GET_COPY_IN_LOCK,
    GUARD,
    PIN,
    PURE_PYTHON_ENV,
    READ_COUNTED,
    READ_HITS,
    READ_QUIET,
    SEQLOCK_COPIES,
    SLOW,
)
from .core_pins import Pinned, Pins
from .errors import (
    BufferTooSmall,
    CortexCacheError,
    PoolClosed,
    PoolSuperseded,
    SegmentCorrupt,
    UsageError,
    ValueCorrupt,
    ValueTooLarge,
)
from .eviction import VictimCache, policy_by_id
from .layout import (
    CANDIDATES, FLAG_MULTI_THREADED, FLAG_SUPERSEDED, HEADER_DTYPE, HEADER_SIZE, KEY_CELL, MV_FORMAT,
    PIN_DTYPE, PIN_SIZE, SEALED, SLOT_COLUMNS, SLOT_FLAG_STR_KEY, VICTIM_COLUMNS, WRITING, ZOMBIE,
    H_DELETES, H_DIRTY, H_EXPIRATIONS, H_HITS, H_LFU_EPOCH, H_LFU_PERIOD, H_MISSES, H_N_ENTRIES, H_OPS, H_PUTS,
    H_REPAIRS, H_SEQ, H_GONE_SEQ, H_FLAGS,
    Geometry, blocks_for,
)
from .lock import PoolLock, default_timeout as default_lock_timeout
from .units import format_size

POPULATE_CHUNK = 32 << 20  # Core.populate's step: about 4 ms of page-table work
# What damaged metadata raises under the lock (an index out of range, a counter at its limit).
METADATA_ERRORS = (IndexError, ValueError, OverflowError, ZeroDivisionError)


class _Fields:
    """Attribute access to the fields of a one-record structured array (views, not copies)."""

    def __init__(self, arr: np.ndarray) -> None:
        for name in arr.dtype.names:
            setattr(self, name, arr[name])


class Core(Allocation, Pins):
    """One pool segment, mapped, with its invariants (see the module docstring).  Its room (slots, blocks,
    key cells, eviction: core_alloc.py) and its pins (core_pins.py) are mixed in; the C fast path over it
    is bound in core_fast.py."""

    # Half-built handles close cleanly (a failed attach leaves these).
    closed = False
    fast: Any = None
    guard: Any = None
    queues: Any = None
    _typed_views: list = []

    def __init__(
        self,
        seg: segment.Segment,
        *,
        multi_threaded: bool | None,
        clock: Callable[[], float] | None,
        lock_timeout: float | None,
        repairer: Callable[["Core", bool], list[str]],
        verify_reads: bool = False,
    ) -> None:
        """Attach to a validated segment.  `repairer(core, fix)` checks (and with `fix` repairs) the memory
        tier's metadata, lock held (repair.analyse); `repair_hooks` add checks of regions above it.
        `verify_reads`: every value read is checked against its checksum (`check_copy`)."""
        self.verify_reads = verify_reads
        self.seg = seg
        self.name = seg.name
        self._repairer = repairer
        self.repair_hooks: list[Callable[[bool], list[str]]] = []
        self._on_evict: Callable[[int], None] | None = None
        self.after_unlock: list[Callable[[], None]] = []
        self.forked = False  # set in a forked child: its OFD lock would be its parent's
        mm = seg.mm
        # The mapping fenced against SIGBUS (a segment truncated by another process, a --no-reserve pool
        # on a full /dev/shm): `gone` then, and every later call a SegmentCorrupt (_fastpath_guard.c).
        self.guard = core_fast.guard(mm)
        self.mv = mv = memoryview(mm)
        hdr = np.frombuffer(mm, HEADER_DTYPE, 1, 0)
        self.header = hdr
        self.fields = _Fields(hdr)
        g = Geometry.from_header(hdr)
        self.geometry = g
        self._bs, self._n_blocks, self._data_off = g.block_size, g.n_blocks, g.data_off
        self._mask = g.n_buckets - 1
        self.buckets = np.frombuffer(mm, np.int32, g.n_buckets, g.buckets_off)
        self.block_map = np.frombuffer(mm, np.uint8, g.n_blocks, g.blockmap_off)
        self.key_map = np.frombuffer(mm, np.uint8, g.n_kcells, g.keymap_off)
        self.pin_records = np.frombuffer(mm, PIN_DTYPE, g.n_pins, g.pins_off)
        offs = g.slot_columns()
        self.columns = {name: np.frombuffer(mm, fmt, g.n_slots, offs[name]) for name, fmt in SLOT_COLUMNS}
        self._pin_hint = 0
        self._n_slots, self._n_pins, self._n_kcells, self._keys_off = g.n_slots, g.n_pins, g.n_kcells, g.keys_off
        # Typed memoryviews over the same bytes for the hot paths, where a
        # memoryview item costs ~0.04 us against numpy's ~0.2 us.
        views = {}
        for name, fmt in SLOT_COLUMNS:
            size = np.dtype(fmt).itemsize
            views[name] = mv[offs[name] : offs[name] + g.n_slots * size].cast(MV_FORMAT[fmt])
        self._c_state, self._c_pins, self._c_klen = views["state"], views["pins"], views["key_len"]
        self._c_flags, self._c_opid, self._c_next = views["flags"], views["owner_pid"], views["next"]
        self._c_khash, self._c_vlen, self._c_first = views["key_hash"], views["value_len"], views["first_block"]
        self._c_nblk, self._c_cks, self._c_created = views["n_blocks"], views["checksum"], views["created"]
        self._c_lastacc, self._c_expiry, self._c_iseq = views["last_access"], views["expiry"], views["insert_seq"]
        self._c_aseq, self._c_acount, self._c_lfuep = views["access_seq"], views["access_count"], views["lfu_epoch"]
        self._c_prio, self._c_ostart, self._c_kcell = views["priority"], views["owner_start"], views["key_cell"]
        hdr_mv = mv[:HEADER_SIZE]
        # The header's words: `counters[H_*]` (layout.py names them); public for the tiers' counters.
        self.counters, self.signed_counters, self._hu32, self._hf64 = (hdr_mv.cast(f) for f in "QqId")
        self.header_words = self._hu32  # its u32 words: Pool reads the superseded flag (H_FLAGS) from here
        self._hu64, self._hi64 = self.counters, self.signed_counters
        pins_mv = mv[g.pins_off : g.pins_off + g.n_pins * PIN_SIZE]
        self._pu32, self._pi32, self._pu64 = pins_mv.cast("I"), pins_mv.cast("i"), pins_mv.cast("Q")
        self._bkt = mv[g.buckets_off : g.buckets_off + g.n_buckets * 4].cast("i")
        self._bmap = mv[g.blockmap_off : g.blockmap_off + g.n_blocks]
        self._kmap = mv[g.keymap_off : g.keymap_off + g.n_kcells]
        self._typed_views = [*views.values(), hdr_mv, pins_mv, self._hu64, self._hi64, self._hu32, self._hf64,
                             self._pu32, self._pi32, self._pu64, self._bkt, self._bmap, self._kmap]
        flags = int(self.fields.flags[0])
        if multi_threaded is None:
            multi_threaded = bool(flags & FLAG_MULTI_THREADED)
        self.multi_threaded = multi_threaded
        self.lock = PoolLock(seg.fd, multi_threaded)
        self.lock_timeout = lock_timeout if lock_timeout is not None else default_lock_timeout()
        self.clock: Callable[[], float] = clock or time.time
        pol = policy_by_id(int(self.fields.policy[0]))
        assert pol is not None  # checked when the segment was opened (header.py)
        self.policy = pol.name
        vo = g.victim_columns()
        victims = {name: np.frombuffer(mm, fmt, CANDIDATES, vo[name]) for name, fmt in VICTIM_COLUMNS}
        hdr_views = (self._hu32, self._hu64, self._hf64)
        # A queue policy's two queues (queues.py), or None: the hooks below cost one test for the others.
        self.queues: queues.QueueVictims | None = None
        # header.py checked that a queue policy's pool has its queue region (and rings of its sizes), and
        # that no other pool has one: nothing here may raise with views of the mapping made.
        if pol.queues:
            self.queues = queues.build(pol, mv, g, hdr, self.columns, views, hdr_views, victims, self.clock,
                                       self._typed_views)
            self.victims = self.queues  # type: ignore[assignment]  # the same interface, over two lists
            self.repair_hooks.append(self.queues.repair)
        else:
            self.victims = VictimCache(pol, hdr, self.columns, victims, self.clock, hdr_views, views)
        self.fast = self._fast_path(offs) if clock is None else None  # it reads the real clock
        if self.queues is not None and self.fast is not None:
            self.queues.evicted = self.fast.evicted  # type: ignore[method-assign]  # the same, in C

    def _fast_path(self, slot_offsets: dict[str, int]) -> Any:
        """The C fast path over this mapping, or None: not built, or turned off (core_fast.bind)."""
        return core_fast.bind(self.seg, self.geometry, self.victims, slot_offsets, queued=self.queues is not None,
                              verify_reads=self.verify_reads, thread_lock=self.lock.thread, guard=self.guard,
                              hooks={"free_entry": self._free_entry, "late_unpin": self._unpin_late,
                                     "reserve_hook": self.reserve_or_corrupt, "evict_hook": self.evict_or_corrupt,
                                     "refill_hook": self.refill_or_corrupt})

    def refill_or_corrupt(self, q: int) -> bool:
        """Fill victim list `q` again (VictimCache.fill), for the C victim choice (lock held, taken by C);
        damaged metadata is a SegmentCorrupt, as in `evict_or_corrupt`."""
        try:
            return (self.queues.lists[q] if self.queues is not None else self.victims).fill()
        except METADATA_ERRORS as e:
            raise self.damaged(e) from e

    @property
    def on_evict(self) -> Callable[[int], None] | None:
        """Called with the lock held for an entry about to leave memory by eviction (the module docstring)."""
        return self._on_evict

    @on_evict.setter
    def on_evict(self, fn: Callable[[int], None] | None) -> None:
        self._on_evict = fn
        if self.fast is not None:  # the C victim choice leaves a spilling pool's evictions to Python
            self.fast.spill = fn is not None

    def close(self) -> None:
        """Unmap.  Safe to call twice, and on a half-built handle."""
        if self.closed:
            return
        self.closed = True
        retired = self.superseded  # read while the header is still mapped
        if self.fast is not None:
            self.fast.close()  # lets the mapping go (after any call still copying in another thread)
            self.fast = None
        if self.queues is not None:
            self.queues.__dict__.pop("evicted", None)  # the fast path's: no cycle left through it
        self.repair_hooks = []  # bound to the queues' and tiers' views of the mapping: they must go with it
        self.victims = None  # type: ignore[assignment]
        self.queues = None
        self.columns = None  # type: ignore[assignment]
        self.fields = None  # type: ignore[assignment]
        for attr in [a for a, v in vars(self).items() if isinstance(v, np.ndarray)]:
            setattr(self, attr, None)
        for v in reversed(self._typed_views):
            v.release()
        self._typed_views = []
        self.mv.release()
        if self.guard is not None:
            self.guard.close()  # before the unmap: its addresses may be reused
        if retired and not sys.is_finalizing():  # (no thread starts once the interpreter is exiting)
            # A segment that lost its name is freed with its last mapping: the unmap that drops it frees
            # all its memory (~0.3 s per GiB), on a thread of its own (the GIL let go), so that a handle
            # moving to the pool now under the name (Pool.reopen, the engine adapters) never waits for it.
            # Its descriptors go with it (the segment's, and the one mmap keeps): `wait_unmapped` waits.
            if segment.unmap_in_background(self.seg):
                return
        self.seg.unmap()

    def data_region(self) -> tuple[int, int]:
        """(address, length) of the data region in this process's mapping (for cudaHostRegister)."""
        a = np.frombuffer(self.seg.mm, np.uint8, 1, self._data_off)
        addr = a.ctypes.data
        del a
        return addr, self.geometry.data_size

    def populate(self, stop: Any = None) -> bool:
        """Map the whole segment into this process's page tables, POPULATE_CHUNK at a time (the GIL let go
        between chunks, and within them where the fast path is built); False where the kernel cannot.
        `stop`: a threading.Event that ends it early (Pool.close of a background populate)."""
        size = self.seg.size
        for off in range(0, size, POPULATE_CHUNK):
            if stop is not None and stop.is_set():
                break
            n = min(POPULATE_CHUNK, size - off)
            fast = self.fast
            if not (fast.populate(off, n) if fast is not None else self.seg.populate(off, n)):
                return False
        return True

    def value_array(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable numpy array over `nbytes` of the segment at `offset` (a pinned or reserved value)."""
        return np.frombuffer(self.seg.mm, np.uint8, nbytes, offset)

    # ------------------------------------------------------------------ locking

    def locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` holding the pool lock, with the dirty mark set; then run `after_unlock`."""
        if self.closed:
            raise PoolClosed(f"pool {self.name!r} is closed")
        if self.forked:
            raise UsageError(f"pool {self.name!r} was opened before fork(): open it again in this process")
        guard = self.guard
        if guard is not None and guard.gone:
            raise self.gone_error()
        lock = self.lock
        lock.acquire(self.lock_timeout)
        hu32 = self._hu32
        try:
            if hu32[H_DIRTY]:
                self.repair()
            hu32[H_DIRTY] = 1
            result = fn(*args)
        except SegmentCorrupt:
            self._release(lock, clean=False)  # damage was seen: the dirty mark stays, so the next holder repairs
            raise
        except CortexCacheError:
            self._release(lock, clean=True)  # expected errors leave the metadata consistent
            raise
        except METADATA_ERRORS as e:
            # Only damaged metadata gets here (an index out of range, a counter
            # at its limit): a clean error now, and a repair by the next holder.
            self._release(lock, clean=False)
            raise self.damaged(e) from e
        except BaseException:
            # Anything else may have stopped a change half-way: leave the
            # dirty mark so the next holder repairs.
            self._release(lock, clean=False)
            raise
        if guard is not None and guard.gone:  # a SIGBUS met during this call: what it did is unreliable
            self._release(lock, clean=False)
            raise self.gone_error()
        self._release(lock, clean=True)
        return result

    def damaged(self, e: Exception) -> SegmentCorrupt:
        """The error for one of METADATA_ERRORS met under the lock."""
        return SegmentCorrupt(
            f"pool {self.name!r} has damaged metadata ({type(e).__name__}: {e}); "
            f"it is repaired on its next use, or with `cortex cache verify {self.name} --repair`"
        )

    def gone_error(self) -> SegmentCorrupt:
        """The error of every call once this handle's mapping met a SIGBUS."""
        return SegmentCorrupt(
            f"pool {self.name!r}: its shared memory can no longer be read (the segment was truncated by "
            "another process, or /dev/shm is full under a pool made with --no-reserve); open it again"
        )

    def _release(self, lock: Any, clean: bool) -> None:
        if clean:
            self._hu32[H_DIRTY] = 0
        lock.release()
        if self.after_unlock:
            work, self.after_unlock = self.after_unlock, []
            for fn in work:
                fn()

    def inspect(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` holding the pool lock as it is: no repair of a dirty mark first, none set
        (verify looks at a pool a dead process left, and repairs it only if asked)."""
        if self.closed:
            raise PoolClosed(f"pool {self.name!r} is closed")
        self.lock.acquire(self.lock_timeout)
        try:
            return fn(*args)
        finally:
            self.lock.release()

    def _analyse(self, fix: bool) -> list[str]:
        problems = self._repairer(self, fix)
        for hook in self.repair_hooks:
            problems += hook(fix)
        return problems

    def repair(self) -> list[str]:
        """Rebuild every derived structure from the slot records (lock held); what was wrong."""
        self._hu32[H_DIRTY] = 1
        fixed = self._analyse(True)
        self._hu64[H_REPAIRS] += 1
        self._hu64[H_GONE_SEQ] += 1  # a repair may drop entries without Core.remove
        self._hu32[H_DIRTY] = 0
        return fixed

    def check(self) -> list[str]:
        """What is inconsistent in the metadata, changing nothing (lock held)."""
        return self._analyse(False)

    # ------------------------------------------------------------------ writing entries

    def blocks_or_raise(self, vlen: int, what: str = "value") -> int:
        """Blocks a value of `vlen` bytes occupies (layout.blocks_for); ValueTooLarge beyond the pool."""
        nblk = blocks_for(vlen, self._bs)
        if nblk > self._n_blocks:
            raise ValueTooLarge(
                f"{what} of {format_size(vlen)} does not fit in pool {self.name!r} "
                f"({format_size(self.geometry.data_size)})"
            )
        return nblk

    def fits(self, vlen: int) -> bool:
        return blocks_for(vlen, self._bs) <= self._n_blocks

    def reserve(self, kb: bytes, kh: int, flags: int, vlen: int, nblk: int) -> tuple[int, int]:
        """Take a slot, key cells and `nblk` blocks for a new entry of key `kb` (state WRITING, invisible);
        evicts for room.  Returns (slot, data offset of the value).  Lock held."""
        i = self._alloc_slot()
        klen = len(kb)
        try:
            kcell = self._alloc_kcells(klen)
            try:
                first = self._alloc_blocks(nblk)
            except BaseException:
                self._free_kcells(kcell, klen)
                raise
        except BaseException:
            self._free_slot(i)
            raise
        koff = self._keys_off + kcell * KEY_CELL
        self.mv[koff : koff + klen] = kb
        pid, start = procs.me()
        self._c_kcell[i] = kcell
        self._c_klen[i] = klen
        self._c_flags[i] = flags
        self._c_pins[i] = 0
        self._c_opid[i] = pid
        self._c_khash[i] = kh
        self._c_vlen[i] = vlen
        self._c_first[i] = first
        self._c_nblk[i] = nblk
        self._c_ostart[i] = start
        self._c_state[i] = WRITING
        return i, self._data_off + first * self._bs

    def reserve_or_corrupt(self, kb: bytes, kh: int, flags: int, vlen: int, nblk: int) -> tuple[int, int]:
        """`reserve`, for the C write path when it needs an eviction (lock held, taken by C): damaged
        metadata is a SegmentCorrupt, as `locked` makes it, so that C leaves the dirty mark for a repair."""
        try:
            return self.reserve(kb, kh, flags, vlen, nblk)
        except METADATA_ERRORS as e:
            raise self.damaged(e) from e

    def reserve_many(self, items: list[tuple[bytes, int, int, int, int]]) -> list[Any]:
        """Reserve every (key bytes, key hash, flags, nbytes, blocks) in one lock hold, through the C write
        path where it runs: per item its (slot, offset) or the error it met (PoolFull: what was reserved so
        far stays consistent).  Takes the lock itself."""
        fast = self.fast
        got = fast.reserve_many(items) if fast is not None and items else SLOW
        if got is not SLOW:
            return got

        def reserve_all() -> list[Any]:
            out: list[Any] = []
            for kb, kh, flags, nbytes, nblk in items:
                try:
                    out.append(self.reserve(kb, kh, flags, nbytes, nblk))
                except CortexCacheError as e:
                    out.append(e)
            return out

        return self.locked(reserve_all) if items else []

    def seal_many(self, items: list[tuple[int, bytes, int, int, float | None, int]]) -> list[bool]:
        """Seal every reserved (slot, key bytes, key hash, checksum, ttl, priority) in one lock hold, each
        replacing its key's old value, through the C write path where it runs; per item whether it was
        sealed (False: a repair took the reservation back).  Memory only: callers with a disk tier seal
        through Tiers.seal.  Takes the lock itself."""
        fast = self.fast
        got = fast.seal_many(items) if fast is not None and items else SLOW
        if got is SLOW:
            got = [SLOW] * len(items)
        left = [n for n, r in enumerate(got) if r is SLOW]
        if left:
            def seal_all() -> None:
                for n in left:
                    i, kb, kh, checksum, ttl, prio = items[n]
                    got[n] = self.is_writing(i)
                    if got[n]:
                        self.seal(i, kb, kh, checksum, ttl, prio)

            self.locked(seal_all)
        return got

    def evict_or_corrupt(self) -> tuple[int, int] | None:
        """`evict_one`, for the C write path making room (lock held, taken by C); damaged metadata is a
        SegmentCorrupt, as in `reserve_or_corrupt`."""
        try:
            return self.evict_one()
        except METADATA_ERRORS as e:
            raise self.damaged(e) from e

    def put_small(self, kb: bytes, kh: int, flags: int, vb: memoryview, nblk: int, checksum: int,
                  ttl: float | None, priority: int) -> int:
        """Store a value in one lock hold (lock held); its slot."""
        # Replacing a key: free the old value first, so a full pool reuses its
        # blocks instead of evicting an unrelated entry.  (Readers holding a
        # pin keep the old bytes; if the new value then cannot be placed,
        # PoolFull leaves the key absent.)
        old = self.find(kb, kh)
        if old >= 0:
            if self._c_nblk[old] == nblk and not self._c_pins[old]:
                # The same key into the same room, and nobody reading it: write over it.  The
                # lock is held throughout, so no reader sees it half-written, and the new
                # sequence numbers make it a new entry for the victim list.
                off = self._data_off + self._c_first[old] * self._bs
                # A reader copying this value outside the lock (the fast path's seqlock) checks
                # insert_seq after its copy: change it before the bytes, so that it reads again.
                self._c_iseq[old] = 0
                self._hu64[H_GONE_SEQ] += 1  # its old value leaves memory (layout.py, gone_seq)
                self.mv[off : off + vb.nbytes] = vb
                self._c_vlen[old] = vb.nbytes
                self._c_flags[old] = flags
                self._stamp(old, checksum, ttl, priority, None)
                return old
            self.remove(old)
        i, off = self.reserve(kb, kh, flags, vb.nbytes, nblk)
        self.mv[off : off + vb.nbytes] = vb
        self.seal(i, kb, kh, checksum, ttl, priority, False)
        return i

    def seal(self, i: int, kb: bytes, kh: int, checksum: int, ttl: float | None, priority: int,
             replace: bool = True, expiry: float | None = None) -> None:
        """Make WRITING slot `i` the visible entry for its key, replacing any old one (lock held).

        `replace=False`: the caller already removed it in this same lock hold.
        `expiry` overrides `ttl` with an absolute time.
        """
        old = self.find(kb, kh) if replace else -1
        if old >= 0:
            self.remove(old)
        self._stamp(i, checksum, ttl, priority, expiry)
        b = kh & self._mask
        bkt = self._bkt
        self._c_next[i] = bkt[b]
        bkt[b] = i
        self._c_state[i] = SEALED
        self._hu64[H_N_ENTRIES] += 1

    def _stamp(self, i: int, checksum: int, ttl: float | None, priority: int, expiry: float | None) -> None:
        """Give slot `i` the metadata of a new put (counted), and tell the victim list its score and expiry
        (the list checks an entry's state when it hands it out, so this may come before the seal)."""
        hu64 = self._hu64
        now = self.clock()
        e = now + ttl if ttl and expiry is None else (expiry or 0.0)
        seq = hu64[H_SEQ] + 1
        hu64[H_SEQ] = seq
        self._c_cks[i] = checksum
        self._c_created[i] = now
        self._c_lastacc[i] = now
        self._c_expiry[i] = e
        self._c_iseq[i] = seq
        self._c_aseq[i] = seq
        self._c_acount[i] = 1
        self._c_lfuep[i] = self._tick()
        self._c_prio[i] = priority
        self._c_ostart[i] = 0
        self._c_opid[i] = 0
        hu64[H_PUTS] += 1
        v = self.victims
        if not v.policy.monotone:
            v.on_score_change(i)
        elif self.queues is not None:
            self.queues.admit(i)
        if e:
            v.on_expiry_set(e)

    def fill(self, i: int, copy: Callable[[], int], seal: Callable[..., Any], *args: Any) -> None:
        """The end of every put whose value is copied outside the lock, for reserved slot `i`: run `copy()`
        (no lock; it returns the value's checksum), then `seal(i, checksum, *args)` under the lock.  A copy
        that fails gives the reservation back."""
        try:
            checksum = copy()
        except BaseException:
            self.locked(self.abort, i)
            raise
        self.locked(seal, i, checksum, *args)

    def is_writing(self, i: int) -> bool:
        """Is slot `i` still a reservation (not taken back by a repair)?  Lock held."""
        return self._c_state[i] == WRITING

    def abort(self, i: int) -> None:
        """Give a reservation back (lock held); nothing if a repair already did."""
        if self._c_state[i] == WRITING:
            self._free_entry(i)

    def restore_meta(self, i: int, created: float, last_access: float, expiry: float, insert_seq: int,
                     access_seq: int, access_count: int) -> None:
        """Give a just-sealed entry the metadata a snapshot recorded (lock held); not counted as a put."""
        self._hu64[H_PUTS] -= 1
        self._c_created[i] = created
        self._c_lastacc[i] = last_access
        self._c_expiry[i] = expiry
        self._c_iseq[i] = insert_seq
        self._c_aseq[i] = access_seq
        self._c_acount[i] = max(1, access_count)
        if access_seq > self._hu64[H_SEQ]:
            self._hu64[H_SEQ] = access_seq
        self.victims.invalidate()  # the scores just changed behind its back
        if expiry:
            self.victims.on_expiry_set(expiry)

    def _tick(self) -> int:
        """Count one put or hit; return the LFU epoch after it."""
        hu64 = self._hu64
        ops = hu64[H_OPS] + 1
        hu64[H_OPS] = ops
        if ops % hu64[H_LFU_PERIOD] == 0:
            hu64[H_LFU_EPOCH] += 1
        return hu64[H_LFU_EPOCH]

    # ------------------------------------------------------------------ lookup and removal

    def find(self, kb: bytes, kh: int) -> int:
        """Slot of the sealed entry for key `kb` (hash `kh`), or -1 (lock held)."""
        i = self._bkt[kh & self._mask]
        klen = len(kb)
        steps = 0
        while i >= 0:
            if self._c_khash[i] == kh and self._c_klen[i] == klen:
                off = self._keys_off + self._c_kcell[i] * KEY_CELL
                if self.mv[off : off + klen] == kb:
                    return i
            i = self._c_next[i]
            steps += 1
            if steps > self._n_slots:
                raise SegmentCorrupt(f"pool {self.name!r}: hash chain loop; run `cortex cache verify {self.name} --repair`")
        return -1

    def remove(self, i: int) -> None:
        """Take sealed entry `i` out of the index; free it now, or at its last unpin (lock held)."""
        unchain(self._bkt, self._c_next, self._c_khash[i] & self._mask, i)
        if self.queues is not None:
            self.queues.removed(i)
        hu64 = self._hu64
        hu64[H_N_ENTRIES] -= 1
        hu64[H_GONE_SEQ] += 1  # a memoized lookup may have counted it (layout.py, gone_seq)
        if self._c_pins[i]:
            self._c_state[i] = ZOMBIE
        else:
            self._free_entry(i)

    def reused(self, i: int) -> bool:
        """Was entry `i` seen at least twice: read since its put (a hit moves access_seq past insert_seq), or,
        under a queue policy, in queue 1 (read, or put again while its key was a ghost: seen before)?"""
        return self._c_aseq[i] != self._c_iseq[i] or (self.queues is not None and self.queues.in_queue1(i))

    def mark_read(self, i: int) -> None:
        """Count entry `i` as read since its put (a promotion from disk), without counting a hit (lock held)."""
        seq = self._hu64[H_SEQ] + 1
        self._hu64[H_SEQ] = seq
        self._c_aseq[i] = seq

    def expired(self, i: int) -> bool:
        e = self._c_expiry[i]
        return e > 0 and e <= self.clock()

    def touch(self, i: int) -> None:
        """Count a hit on entry `i` (lock held)."""
        hu64 = self._hu64
        seq = hu64[H_SEQ] + 1
        hu64[H_SEQ] = seq
        self._c_aseq[i] = seq
        self._c_lastacc[i] = self.clock()
        epoch = self._tick()
        age = epoch - self._c_lfuep[i]
        self._c_acount[i] = (self._c_acount[i] >> (age if age < 63 else 63)) + 1
        self._c_lfuep[i] = epoch
        hu64[H_HITS] += 1
        v = self.victims
        if not v.policy.monotone:
            v.on_score_change(i)
        elif self.queues is not None:
            self.queues.hit(i)

    def lookup_live(self, kb: bytes, kh: int) -> int:
        """Find a live entry, counting the miss (and expiring it) when there is none (lock held)."""
        i = self.find(kb, kh)
        if i >= 0 and self.expired(i):
            self._hu64[H_EXPIRATIONS] += 1
            self.remove(i)
            i = -1
        if i < 0:
            self._hu64[H_MISSES] += 1
        return i

    def find_live(self, kb: bytes, kh: int) -> int:
        """Slot of the live (unexpired) entry of `kb`, or -1; counts nothing (lock held)."""
        i = self.find(kb, kh)
        return -1 if i >= 0 and self.expired(i) else i

    def value_at(self, i: int) -> tuple[int, int]:
        """(offset, length) of entry `i`'s value, for a read (lock held).

        Another process that can write the segment may change a slot's fields at any moment, even under
        the lock (docs/reliability.md, "Trust model"): each is read once, checked, and only what was
        checked is used.  Raises SegmentCorrupt (and the next lock holder repairs) when they are
        impossible: outside the data region, or not filling exactly the entry's blocks (repair.py's rule).
        """
        first, nblk, vlen = self._c_first[i], self._c_nblk[i], self._c_vlen[i]
        bs = self._bs
        if first + nblk > self._n_blocks or vlen > nblk * bs or (nblk and vlen <= (nblk - 1) * bs):
            raise SegmentCorrupt(
                f"pool {self.name!r}: entry {i} has impossible metadata (block {first} + {nblk}, "
                f"{vlen} bytes); it is repaired on the pool's next use, or with `cortex cache verify {self.name} --repair`"
            )
        return self._data_off + first * bs, vlen

    def read(self, kb: bytes, kh: int, out: memoryview | None) -> bytes | int | Pinned | None:
        """Look `kb` up and count the hit or miss (lock held).

        A value up to GET_COPY_IN_LOCK bytes is copied now: into `out` (its
        length returned), or returned as bytes; a larger one is pinned for the
        caller to copy outside the lock (a Pinned).  None on a miss.
        """
        i = self.lookup_live(kb, kh)
        if i < 0:
            return None
        off, vlen = self.value_at(i)
        if out is not None and out.nbytes < vlen:
            raise BufferTooSmall(f"buffer of {out.nbytes} bytes is too small for a value of {vlen} bytes")
        self.touch(i)
        if vlen <= GET_COPY_IN_LOCK and not self.verify_reads:  # verified reads are pinned: check_copy
            if out is None:
                return self.mv[off : off + vlen].tobytes()
            out[:vlen] = self.mv[off : off + vlen]
            return vlen
        return Pinned(self.pin(i), i, off, vlen)

    def check_copy(self, pinned: Pinned, copy: Any) -> None:
        """With `verify_reads`: raise ValueCorrupt unless `copy` (the bytes just copied from pinned entry
        `pinned`) matches the checksum its entry records.  Not lock held: the pin keeps the entry."""
        if self.verify_reads and xxh3_64_intdigest(copy) != self._c_cks[pinned.slot]:
            raise self.value_corrupt()

    def value_corrupt(self) -> ValueCorrupt:
        """The error of a read whose value does not match its checksum."""
        return ValueCorrupt(
            f"pool {self.name!r}: a value does not match its checksum (its slot points at other bytes, or "
            f"they were changed in place); `cortex cache verify {self.name} --repair` drops such entries"
        )

    def pin_live(self, kb: bytes, kh: int, count_miss: bool = True) -> Pinned | None:
        """Pin the live entry of `kb` and count the hit (and, with `count_miss`, a miss); lock held."""
        i = self.lookup_live(kb, kh) if count_miss else self.find_live(kb, kh)
        if i < 0:
            return None
        off, vlen = self.value_at(i)
        self.touch(i)
        return Pinned(self.pin(i), i, off, vlen)

    def pin_quietly(self, kb: bytes, kh: int) -> Pinned | None:
        """Pin the live entry of `kb` counting nothing and leaving its place in the eviction order
        (Pool.peek); None if there is none.  Lock held."""
        i = self.find_live(kb, kh)
        if i < 0:
            return None
        off, vlen = self.value_at(i)
        return Pinned(self.pin(i), i, off, vlen)

    def delete(self, kb: bytes, kh: int, counted: bool) -> bool:
        """Remove `kb`'s entry if it is in memory; count a delete if it was or `counted` (lock held)."""
        i = self.find(kb, kh)
        if i >= 0:
            self.remove(i)
        if i < 0 and not counted:
            return False
        self._hu64[H_DELETES] += 1
        return True

    # ------------------------------------------------------------------ entries

    def value_offset(self, i: int) -> int:
        """Offset of slot `i`'s value in the segment."""
        return self._data_off + self._c_first[i] * self._bs

    def key_bytes(self, i: int) -> bytes:
        """The key of slot `i`, from the key arena."""
        off = self._keys_off + self._c_kcell[i] * KEY_CELL
        return self.mv[off : off + self._c_klen[i]].tobytes()

    def key_of(self, i: int) -> str | bytes:
        """The key of slot `i` as it was given (str or bytes)."""
        kb = self.key_bytes(i)
        if self._c_flags[i] & SLOT_FLAG_STR_KEY:
            return kb.decode("utf-8", "surrogateescape")
        return kb

    def checksum(self, i: int) -> int:
        return self._c_cks[i]

    def insert_seq(self, i: int) -> int:
        return self._c_iseq[i]

    def is_sealed(self, i: int) -> bool:
        return self._c_state[i] == SEALED

    def live_mask(self) -> np.ndarray:
        """Which slots hold live (sealed, unexpired) entries (lock held)."""
        e = self.columns["expiry"]
        return (self.columns["state"] == SEALED) & ((e == 0) | (e > self.clock()))

    def live_in_insert_order(self) -> np.ndarray:
        live = np.flatnonzero(self.live_mask())
        return live[np.argsort(self.columns["insert_seq"][live], kind="stable")]

    def live_most_recent_first(self) -> np.ndarray:
        """Live slots, the most recently used (put or read) first (lock held): the order persist writes, so
        that restore's fill, which loads in that order (fill.py), reads a snapshot's pack front to back."""
        live = np.flatnonzero(self.live_mask())
        return live[np.argsort(self.columns["access_seq"][live], kind="stable")[::-1]]

    def info(self, i: int) -> dict[str, Any]:
        """Metadata of live entry `i` (lock held)."""
        now = self.clock()
        e = float(self._c_expiry[i])
        return {
            "key": self.key_of(i),
            "tier": "memory",
            "size": self._c_vlen[i],
            "blocks": self._c_nblk[i],
            "first_block": self._c_first[i],
            "created": self._c_created[i],
            "last_access": self._c_lastacc[i],
            "access_count": self._c_acount[i],
            "priority": self._c_prio[i],
            "expires": e if e > 0 else None,
            "ttl_remaining": max(0.0, e - now) if e > 0 else None,
            "checksum": f"{self._c_cks[i]:016x}",
            "pins": self._c_pins[i],
        }

    # ------------------------------------------------------------------ generations

    @property
    def superseded(self) -> bool:
        """Was this segment replaced under its name, or deleted (one load of the header's flags word)?"""
        return bool(self._hu32[H_FLAGS] & FLAG_SUPERSEDED)

    def mark_superseded(self) -> None:
        """Say in the segment that it no longer is the pool of its name (lock held).  `retire` does, in the
        lock hold that takes the name away."""
        self._hu32[H_FLAGS] |= FLAG_SUPERSEDED

    def retire(self, take_name: Callable[[], None]) -> None:
        """Mark this segment superseded, then `take_name()` (the rename of its replacement over its name, or
        the unlink of its name), in one lock hold (held): a process killed at any point leaves the mark
        either unset or set with the name gone or -- killed between the two -- set with the name still
        here, which a handle that finds it confirms by name, and clears (Pool.superseded).  So no handle
        is ever left writing to a copy nobody can find without being told.  The mark goes again if
        `take_name` fails."""
        self._hu32[H_FLAGS] |= FLAG_SUPERSEDED
        try:
            take_name()
        except BaseException:
            self._hu32[H_FLAGS] &= ~FLAG_SUPERSEDED
            raise

    def lost_name(self) -> bool:
        """Is this segment really no longer the pool of its name?  For a handle that found the mark set (the
        one-load check); a mark whose segment still has the name was left by a replace or delete killed
        between `retire`'s two steps, and is cleared here (under the lock: a live `retire` holds it across
        both).  A stat and an fstat; the lock only in that rare case."""
        if not self.superseded:
            return False
        if not segment.still_named(self.seg):
            return True
        return bool(self.locked(self._stale_mark))

    def _stale_mark(self) -> bool:
        if not self.superseded:
            return False
        if segment.still_named(self.seg):
            self._hu32[H_FLAGS] &= ~FLAG_SUPERSEDED
            return False
        return True

    def superseded_error(self, did: str = "") -> PoolSuperseded:
        """The error of an operation on a handle whose pool lost its name; `did`: what the call may have done
        to the old copy all the same."""
        return PoolSuperseded(f"pool {self.name!r} was replaced (restore --replace, resize) or deleted since this "
                              f"handle opened it{did}: reopen() it")


__all__ = ["Core", "Pinned", "GET_COPY_IN_LOCK", "COPY_IN_LOCK", "PIN", "GUARD", "SLOW", "READ_COUNTED", "READ_HITS",
           "READ_QUIET", "PURE_PYTHON_ENV", "C_COPY_HASH", "C_COPY_HASH_ISA", "C_COPY_HASH_MANY", "SEQLOCK_COPIES"]
