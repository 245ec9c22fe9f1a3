"""Memory and the tiers below it, behind one entry point (docs/design.md, "One tier contract").

`Tiers` holds the tiers a pool has -- each a `lower.Lower`: the configured
ones (tier_table.py: disk, remote) and, while a restore's fill runs, the
snapshot it fills from (snaptier.py) -- and drives them: promote on a miss
(each tier asked in order), every put, delete and eviction offered to the
tiers that take them, write-through records indexed as memory seals them.
It names no tier: what a tier does is its own module's.

Above it nothing names a tier either.  The hot paths ask `fast_ok` (no tier
takes part in memory's lock holds: the C paths and a plain `Core.read` may
be used), `fast_put` (may this key's put take the C path anyway) and
`look_below` (a memory miss is looked up below).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from xxhash import xxh3_64_intdigest

from . import fill, header, repair
from .copyhash import copy_hash
from .core import COPY_IN_LOCK, Core
from .errors import (
    CortexCacheError, PermissionDenied, PoolFull, SpillLost, StorageIOError, TooManyOpenFiles, UsageError,
)
from .layout import ADMIT_REUSED, H_TIER_REFUSED
from .lower import BUSY, Configured, Context, Creating, Fetched, Lower, Plan, Selector
from .snaptier import SnapshotBelow
from .tier_table import TIERS

# Every tier a pool may have: those it is created with and, while a restore's fill runs, the snapshot it fills
# from (attached by its own rule: fill.py's mark says whether a fill runs).
KINDS: tuple[type[Lower], ...] = (*TIERS, SnapshotBelow)

# How long a reader waits for a key a tier is still writing (BUSY: another process's spill to disk, normally
# microseconds to milliseconds); past it the key reads as a miss, since its writer may have died.
SPILL_WAIT = 2.0
spill_pause = time.sleep  # the pause between looks (tests replace it to act at that moment)

# What an eviction refused because its entry cannot go below raises (a tier's `evicted`).
REFUSED = (StorageIOError, PermissionDenied, TooManyOpenFiles)


def copy_hashing(mv: memoryview, off: int, vb: memoryview) -> int:
    """Copy `vb` into the segment at `off`, hashing what landed as it goes (copyhash.py); its xxh3_64."""
    return copy_hash(mv[off : off + vb.nbytes], vb)


class Tiers:
    """Memory (a Core) with the tiers below it, asked in order of `distance` on a miss."""

    def __init__(self, core: Core, snapshot: bool = True, plans: dict[str, Any] | None = None,
                 in_segment_only: bool = False, owns_core: bool = False) -> None:
        """Attach every tier the pool has (KINDS).  `snapshot=False`: a handle that only reads stats does not
        index the snapshot a fill brings back (Pool.open); `plans`: a pool being created, its tiers' files
        (lower.Plan); `in_segment_only`: only the tiers in the segment (a handle for counters, whose
        repairs must know every region); `owns_core`: `close` closes the core too."""
        self.core = core
        self._owns_core = owns_core
        # Admission (`tier_admit` 2): the tiers below take only evicted entries read since their put (seen
        # twice); a tier that takes puts then gets them when memory lets them go, not at every put.
        self.admit = int(core.header[0]["tier_admit"]) >= ADMIT_REUSED
        ctx = Context(plans or {}, self.reopen, snapshot)
        self.attached: list[Lower] = []
        try:
            for kind in KINDS:
                if in_segment_only and not kind.in_segment:
                    continue
                t = kind.attach(core, ctx)
                if t is not None:
                    self.attached.append(t)
        except BaseException:
            for t in self.attached:
                t.close()
            raise
        self.explicit = False  # an `evict` runs (lock held): tiers write what they take before it leaves
        self._ended: list[Lower] = []  # dropped once their time was over, closed with the handle
        self._arrange()
        if self._evict_takers:
            core.on_evict = self._on_evict

    def _arrange(self) -> None:
        below = sorted(self.attached, key=lambda t: t.distance)
        self.below = below
        self.configured: list[Configured] = [t for t in below if isinstance(t, Configured)]
        indexed = [t for t in below if t.in_segment]
        assert len(indexed) <= 1, "one tier at most looked up in memory's lock hold"
        self._indexed = indexed[0] if indexed else None
        # In memory's lock holds: told of every value sealed (the C write path steps aside for them).
        self.sealers = indexed
        # Told before memory seals a new value (the snapshot a fill brings back: its copy of the key goes).
        self.superseders = [t for t in below if t.supersedes]
        self._writers = [t for t in below if t.writes_first]
        self.takes_puts = [t for t in below if t.takes_puts and not self.admit]
        self.takes_deletes = [t for t in below if t.takes_deletes]
        self._evict_takers = [t for t in below if t.takes_evictions or (self.admit and t.takes_puts)]
        # Tiers that say whether they hold a key in memory's lock hold (`in`, the lookups' leading runs).
        self.answer_contains = [t for t in below if type(t).contains is not Lower.contains]
        # What the hot paths ask: may the C paths run (no tier in memory's lock holds)?  Is a miss looked
        # up below?  Does a put write a tier's record before memory seals it?
        self.fast_ok = not indexed and not self.superseders
        # ... and for a put of one key, when the only tiers in the way supersede (the snapshot a fill brings
        # back) and none of them holds the key at all: nothing of it there to mark gone.
        self._fast_unless_held = self.superseders if not indexed else []
        self.look_below = bool(below)
        self.writes_first = bool(self._writers)

    def fast_put(self, kb: bytes) -> bool:
        """May a put of `kb` take the C write path?  Always when `fast_ok`; while a fill runs, when no tier
        that supersedes could hold `kb` (its index has no such key: a new key, an engine's next block)."""
        if self.fast_ok:
            return True
        held = self._fast_unless_held
        return bool(held) and all(t.never_holds(kb) for t in held)

    def named(self, name: str) -> Configured | None:
        """The pool's tier called `name`, or None."""
        return next((t for t in self.configured if t.name == name), None)

    def directory(self) -> str | None:
        """The directory a tier of this pool keeps its files in (the disk tier's), or None."""
        return next((t.directory for t in self.configured if t.directory is not None), None)

    def reopen(self) -> "Tiers":
        """Another handle on this pool, for a tier's own thread (the remote tier's writer counts there): a core
        of its own (a thread shares no OFD lock with its caller's handle) with the tiers in the segment, whose
        checks a repair it starts must run; `close` closes both."""
        seg = header.open_segment(self.core.name)
        try:
            core = Core(seg, multi_threaded=False, clock=None, lock_timeout=None, repairer=repair.analyse)
        except BaseException:
            seg.close()
            raise
        try:
            return Tiers(core, snapshot=False, in_segment_only=True, owns_core=True)
        except BaseException:
            core.close()
            raise

    def stop(self, forked: bool = False) -> None:
        """The handle is closing: each tier finishes its background work (a forked child's abandons it)."""
        for t in self.attached:
            t.stop(forked)

    def close(self) -> None:
        """Close the tiers; safe twice."""
        attached, self.attached = [*self.attached, *self._ended], []
        self._ended = []
        for t in attached:
            t.close()
        self._arrange()
        if self._owns_core:
            self.core.close()

    def offer_put(self, kb: bytes, value: Any, flags: int, ttl: float | None) -> None:
        """A put to memory, told to each tier that wants every put (the remote: queued, never waited on)."""
        for t in self.takes_puts:
            t.offer_put(kb, value, flags, ttl)

    def offer_delete(self, kb: bytes) -> None:
        for t in self.takes_deletes:
            t.offer_delete(kb)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until this handle's queued writes to the tiers below were sent; False on timeout."""
        return all([t.flush(timeout) for t in self.configured])

    # ------------------------------------------------------------------ writes

    def put(self, kb: bytes, kh: int, flags: int, vb: memoryview, nblk: int, ttl: float | None, priority: int,
            checksum: int | None = None) -> None:
        """Store in memory (and write-through below); `checksum`: the value's xxh3_64 if already known."""
        core = self.core
        written = None
        if self._writers:
            written = self._write_first(kb, flags, vb, ttl, priority)
            if checksum is None:
                checksum = xxh3_64_intdigest(vb)
        try:
            if vb.nbytes <= COPY_IN_LOCK:
                if checksum is None:
                    checksum = xxh3_64_intdigest(vb)
                if self.fast_ok:
                    core.locked(core.put_small, kb, kh, flags, vb, nblk, checksum, ttl, priority)
                else:
                    core.locked(self._put_small, kb, kh, flags, vb, nblk, checksum, ttl, priority, written)
            else:
                self._put_large(kb, kh, flags, vb, nblk, ttl, priority, checksum, written)
        except CortexCacheError as e:
            if written is not None and not isinstance(e, SpillLost):
                for t, token in written.items():  # the put failed: no record may come back
                    t.unwrite(token)
            raise
        if self.superseders:
            self.drop_ended()

    def _put_large(self, kb: bytes, kh: int, flags: int, vb: memoryview, nblk: int, ttl: float | None,
                   priority: int, checksum: int | None, written: dict[Lower, Any] | None) -> None:
        """Reserve in one lock hold, copy outside it, seal in another (Core.fill)."""
        core = self.core
        i, off = core.locked(core.reserve, kb, kh, flags, vb.nbytes, nblk)
        if checksum is None:
            core.fill(i, lambda: copy_hashing(core.mv, off, vb), self.seal, kb, kh, ttl, priority, written)
        else:
            def copy() -> int:
                core.mv[off : off + vb.nbytes] = vb
                return checksum  # type: ignore[return-value]
            core.fill(i, copy, self.seal, kb, kh, ttl, priority, written)

    def _write_first(self, kb: bytes, flags: int, vb: memoryview, ttl: float | None,
                     priority: int) -> dict[Lower, Any]:
        expiry = self.core.clock() + ttl if ttl else 0.0
        return {t: t.write_first(kb, flags, vb, expiry, priority) for t in self._writers}

    def _put_small(self, kb: bytes, kh: int, flags: int, vb: memoryview, nblk: int, checksum: int,
                   ttl: float | None, priority: int, written: dict[Lower, Any] | None) -> None:
        for t in self.superseders:
            t.supersede(kb, kh)
        self.core.put_small(kb, kh, flags, vb, nblk, checksum, ttl, priority)
        self._sealed(kb, kh, written)

    def seal(self, i: int, checksum: int, kb: bytes, kh: int, ttl: float | None, priority: int,
             written: dict[Lower, Any] | None = None) -> None:
        """Seal reserved slot `i` as `kb`'s value (lock held), and tell the tiers in the segment (`written`: the
        records a write-through put wrote)."""
        if not self.core.is_writing(i):
            return  # a repair took the reservation back
        for t in self.superseders:
            t.supersede(kb, kh)
        self.core.seal(i, kb, kh, checksum, ttl, priority)
        if self.sealers:
            self._sealed(kb, kh, written)

    def _sealed(self, kb: bytes, kh: int, written: dict[Lower, Any] | None) -> None:
        """A new memory value of `kb` (lock held): each tier in the segment indexes its write-through record,
        or drops a stale copy."""
        for t in self.sealers:
            t.sealed(kb, kh, written.get(t) if written is not None else None)

    def commit(self, i: int, kb: bytes, kh: int, flags: int, mv: memoryview, checksum: int, ttl: float | None,
               priority: int) -> None:
        """Seal a value written in place (Pool.reserve_write), write-through first; offer it to the tiers."""
        written = None
        core = self.core
        try:
            if self._writers:
                written = self._write_first(kb, flags, mv, ttl, priority)
            if self.fast_ok:
                core.seal_many([(i, kb, kh, checksum, ttl, priority)])  # False (taken back): as seal's silence
            else:
                core.locked(self.seal, i, checksum, kb, kh, ttl, priority, written)
        except BaseException:
            core.locked(core.abort, i)
            raise
        if self.takes_puts:
            self.offer_put(kb, mv.tobytes(), flags, ttl)

    def _on_evict(self, i: int) -> None:
        """`core.on_evict`: memory's sealed entry `i` is about to leave (lock held).  With admission only an
        entry read since its put goes below; each tier that takes evictions gets it (a tier raising refuses
        the eviction)."""
        core = self.core
        if self.admit and not core.reused(i):
            core.counters[H_TIER_REFUSED] += 1
            return
        for t in self._evict_takers:
            t.evicted(i, self.explicit)

    # ------------------------------------------------------------------ reads

    def read(self, kb: bytes, kh: int, out: memoryview | None) -> Any:
        """`Core.read`, and on a memory miss what the tier in the segment found (for `from_below`)."""
        r = self.core.read(kb, kh, out)
        if r is None and self._indexed is not None:
            return self._indexed.lookup(kb, kh)
        return r

    def pin_live(self, kb: bytes, kh: int) -> Any:
        """`Core.pin_live`, and on a memory miss what the tier in the segment found."""
        r = self.core.pin_live(kb, kh)
        if r is None and self._indexed is not None:
            return self._indexed.lookup(kb, kh)
        return r

    def settled(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`core.locked(fn, *args)` for a lookup, asked again while the answer is BUSY (a record being written
        by another process or thread); a miss after SPILL_WAIT seconds (its writer may have died)."""
        r = self.core.locked(fn, *args)
        if r is not BUSY:
            return r
        deadline = time.monotonic() + SPILL_WAIT
        delay = 20e-6
        while r is BUSY:
            if time.monotonic() > deadline:
                return None
            spill_pause(delay)
            delay = min(delay * 2, 1e-3)
            r = self.core.locked(fn, *args)
        return r

    def from_below(self, kb: bytes, kh: int, found: Any, room: int | None = None) -> bytes | None:
        """A memory miss: ask each tier below in order (`found`: what the tier in the segment found in memory's
        lock hold); promote what the first that has it returns; its bytes.  `room`: the caller's buffer size
        (BufferTooSmall for a larger value)."""
        for t in self.below:
            got = t.fetch(kb, kh, found if t.in_segment else None, room)
            if got is None:
                continue
            promoted = self._promote(t, kb, kh, got)
            t.served(got, promoted)
            value = got.value
            return value if value.__class__ is bytes else bytes(value)
        self.drop_ended()
        return None

    def drop_ended(self) -> None:
        """Drop the tiers whose time is over (the snapshot's, once its fill is over: memory has all it will
        get from it); the C write path may run again once no tier takes part in memory's lock holds."""
        if any(t.ended for t in self.attached):
            self._ended += [t for t in self.attached if t.ended]
            self.attached = [t for t in self.attached if not t.ended]
            self._arrange()

    def _promote(self, tier: Lower, kb: bytes, kh: int, got: Fetched) -> bool:
        """Copy a value a tier below had back into memory, if it is still that tier's current one and memory
        has no newer value; True if it was (or is being) promoted."""
        core = self.core
        vlen = memoryview(got.value).nbytes
        if vlen <= COPY_IN_LOCK or not core.fits(vlen):
            return core.locked(self._promote_locked, tier, kb, kh, got, vlen, True) is not None
        r = core.locked(self._promote_locked, tier, kb, kh, got, vlen, False)
        if r is None:
            return False
        i, off = r

        def copy() -> int:
            core.mv[off : off + vlen] = got.value
            return got.checksum

        core.fill(i, copy, self._promote_seal, tier, kb, kh, got)
        return True

    def _promote_locked(self, tier: Lower, kb: bytes, kh: int, got: Fetched, vlen: int,
                        copy_now: bool) -> tuple[int, int] | bool | None:
        core = self.core
        if not tier.still(got) or core.find(kb, kh) >= 0 or not core.fits(vlen):
            return None  # deleted, replaced or already promoted while we read
        if got.expiry and got.expiry <= core.clock():
            return None
        try:
            i, off = core.reserve(kb, kh, got.flags, vlen, core.blocks_or_raise(vlen))
        except (PoolFull, *REFUSED):
            return None  # everything in memory is pinned, or cannot be spilled: served from below this once
        if not copy_now:
            return i, off
        core.mv[off : off + vlen] = got.value
        self._seal_promoted(tier, i, kb, kh, got)
        return True

    def _promote_seal(self, i: int, checksum: int, tier: Lower, kb: bytes, kh: int, got: Fetched) -> None:
        if not self.core.is_writing(i):
            return  # a repair took the reservation back
        if not tier.still(got) or self.core.find(kb, kh) >= 0:
            self.core.abort(i)
            return
        self._seal_promoted(tier, i, kb, kh, got)

    def _seal_promoted(self, tier: Lower, i: int, kb: bytes, kh: int, got: Fetched) -> None:
        for t in self.superseders:  # the snapshot's copy goes before memory has the value (its own promotion too)
            t.supersede(kb, kh)
        self.core.seal(i, kb, kh, got.checksum, None, got.priority, False, got.expiry)
        tier.promoted(got)
        for t in self.sealers:
            if t is not tier:
                t.sealed(kb, kh, None)  # a stale copy of the key there goes, as a put drops it
        if self.admit and tier.promotes_as_read:
            self.core.mark_read(i)  # it earned its place below, and goes back when evicted

    # ------------------------------------------------------------------ delete, membership, metadata

    def delete(self, kb: bytes, kh: int) -> bool:
        """Remove `kb` from memory and the tiers that keep it here (lock held); True if it was in any."""
        below = [t.forget(kb, kh) for t in self.below]  # every tier forgets it, before memory does
        found = self.core.delete(kb, kh, any(below))
        if self.superseders:
            self.drop_ended()
        return found

    def contains(self, kb: bytes, kh: int) -> bool:
        """Is `kb` live in memory or a tier that answers here (the disk)?  (Lock held.)"""
        if self.core.find_live(kb, kh) >= 0:
            return True
        return any(t.contains(kb, kh) for t in self.below)

    def info(self, kb: bytes, kh: int) -> dict[str, Any] | None:
        """Metadata of `kb`'s entry in memory, else in the first tier below that has it, else None (lock held)."""
        core = self.core
        i = core.find_live(kb, kh)
        if i >= 0:
            return core.info(i)
        for t in self.below:
            r = t.info(kb, kh)
            if r is not None:
                return r
        return None

    def tier_names(self) -> list[str]:
        """What `keys` and `evict` take for `tier`: memory, each local tier, all, each shared one."""
        return ["memory", *(k.name for k in TIERS if not k.shared), "all", *(k.name for k in TIERS if k.shared)]

    def check_tier(self, tier: str) -> None:
        names = self.tier_names()
        if tier not in names:
            raise UsageError(f"unknown tier {tier!r}: choose {', '.join(names[:-1])} or {names[-1]}")

    def tier(self, name: str) -> Configured:
        """The pool's tier `name`; UsageError without one."""
        t = self.named(name)
        if t is None:
            raise UsageError(f"pool {self.core.name!r} has no {name} tier")
        return t

    def keys(self, pb: bytes, limit: int | None, tier: str) -> list[str | bytes]:
        """Pool.keys for tier "memory" (live entries, oldest insert first, in one lock hold), "all" (memory,
        then the keys only the tiers here hold) or a tier's name (a local tier the pool lacks has none), of
        those starting with `pb`."""
        if tier == "memory":
            return self._memory_keys(pb, limit)
        if tier == "all":
            out = self._memory_keys(pb, limit)
            if limit is not None and len(out) >= limit:
                return out
            seen = set(out)
            for t in self.below:
                if isinstance(t, Configured) and not t.shared:
                    more = [k for k in t.keys(pb, None) if k not in seen]
                    seen.update(more)
                    out += more
            return out[:limit] if limit is not None else out
        t = self.named(tier)
        if t is None:
            if next(k for k in TIERS if k.name == tier).shared:
                raise UsageError(f"pool {self.core.name!r} has no {tier} tier")
            return []
        out = t.keys(pb, limit)
        return out[:limit] if limit is not None else out

    def _memory_keys(self, pb: bytes, limit: int | None) -> list[str | bytes]:
        core = self.core

        def collect() -> list[str | bytes]:
            out: list[str | bytes] = []
            for i in map(int, core.live_in_insert_order()):
                if pb and not core.key_bytes(i).startswith(pb):
                    continue
                out.append(core.key_of(i))
                if limit is not None and len(out) >= limit:
                    break
            return out

        return core.locked(collect)

    # ------------------------------------------------------------------ eviction

    def evict(self, sel: Selector, tier: str) -> tuple[int, int]:
        """Pool.evict: from memory (what has not expired goes to the tiers that take evictions, as any
        eviction's does), from every tier here but the shared ones ("all": nothing goes below), or from one
        tier by name.  (entries, value bytes) freed."""
        if tier == "memory":
            return self._evict_memory(sel, True)
        if tier != "all":
            return self.tier(tier).remove(sel)
        count, freed = self._evict_memory(sel, False)
        for t in self.below:  # the snapshot a fill brings back too: what is evicted from all never comes back
            if not t.shared:
                c, b = t.remove(sel)
                count, freed = count + c, freed + b
        return count, freed

    def _evict_memory(self, sel: Selector, spill: bool) -> tuple[int, int]:
        core = self.core
        spill = spill and bool(self._evict_takers)
        if spill and not sel.expired:
            # Refused before anything leaves memory when this process cannot write a tier that takes the
            # entries; expired entries are dropped, not spilled, so `--expired` needs no tier.
            for t in self._evict_takers:
                t.ready_to_take()

        def explicitly(fn: Callable[..., tuple[int, int]], *args: Any) -> tuple[int, int]:
            # Set under the lock: each tier writes what it takes before the entry leaves memory.
            self.explicit = spill
            try:
                return fn(*args)
            finally:
                self.explicit = False

        if sel.keys is not None:
            return core.locked(explicitly, core.evict_keys, [(kb, xxh3_64_intdigest(kb)) for kb in sel.keys], spill)
        if sel.all:  # an empty pool means empty: a fill still bringing the snapshot back stops (fill.py)
            core.locked(fill.stop, core)
        if sel.expired or sel.all or sel.prefix is not None:
            return core.locked(explicitly, core.evict_matching, sel.expired, sel.prefix, spill)
        return core.locked(explicitly, core.evict_amount, sel.percent, sel.target, spill)

    def stats(self) -> dict[str, Any]:
        """Each configured tier's stats under its name (None for a tier the pool lacks)."""
        out: dict[str, Any] = {}
        for kind in TIERS:
            t = self.named(kind.name)
            out[kind.name] = t.stats() if t is not None else None
        return out

    def verify(self, fix: bool, checksums: bool) -> dict[str, Any]:
        """Pool.verify: memory's metadata and checksums, then what each tier below holds (repair.py)."""
        return repair.verify(self.core, repair=fix, checksums=checksums, below=self.below)


def plan(wants: dict[str, Any], opts: dict[str, Any], pool: Creating) -> dict[str, Plan]:
    """Pool.create: each tier asked for (`wants`: config.wanted) checks what it needs and makes its files; their
    `Plan`s by name.  On a failure, what the ones before made is undone."""
    plans: dict[str, Plan] = {}
    try:
        for kind in TIERS:
            want = wants[kind.name]
            if want is not None:
                plans[kind.name] = kind.plan(want, opts, pool)
    except BaseException:
        for p in plans.values():
            p.undo()
        raise
    return plans


__all__ = ["Tiers", "COPY_IN_LOCK", "SPILL_WAIT", "copy_hashing", "plan"]
