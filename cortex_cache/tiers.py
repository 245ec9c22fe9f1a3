"""Tier orchestration: what memory does with the disk and remote tiers below it (docs/design.md, "Layers").

One place for every way the tiers meet: spill on evict (the core's
`on_evict` hook begins a spill under the lock; `after_unlock` writes it),
promote on a miss (disk, then remote), write-through puts, and the remote
tier's write queue.  The memory tier is the core (core.py); the disk tier's
index and files are disktier.py and disklog.py; the remote tier is remote.py.
`Tiers` calls their interfaces only.  Without a disk or remote tier the hot
paths skip all of this (`Tiers.disk is None`, `Tiers.remote is None`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
from xxhash import xxh3_64_intdigest

from . import fill
from .copyhash import copy_hash
from .core import COPY_IN_LOCK, Core, Pinned
from .disklog import DiskLog
from .disktier import SPILLING, DiskHit, DiskTier, Spill, analyse_index, key_hash2
from .errors import (
    CortexCacheError, PermissionDenied, PoolFull, SpillLost, StorageIOError, TooManyOpenFiles, UsageError,
)
from .layout import ADMIT_REUSED, H_DISK_ERRORS, H_TIER_REFUSED, SLOT_FLAG_STR_KEY
from .lower import DiskBelow, Fetched, Lower, RemoteBelow
from .snaptier import SnapshotBelow

# How long a reader waits for a key whose spill to disk another process is writing (normally
# microseconds to milliseconds); past it the key reads as a miss, since its writer may have died.
SPILL_WAIT = 2.0
# At most this many bytes of spills are copied aside in one lock hold; beyond, they are written in place.
SPILL_ASIDE = 64 << 20
spill_pause = time.sleep  # the pause between looks (tests replace it to act at that moment)

# What an eviction refused because its entry cannot go to the disk tier raises (see Tiers._spill).
REFUSED = (StorageIOError, PermissionDenied, TooManyOpenFiles)

# A write-through put's record on disk, indexed when its memory entry is sealed:
# (location, second key hash, value length, expiry, priority, flags).
Written = tuple


def copy_hashing(mv: memoryview, off: int, vb: memoryview) -> int:
    """Copy `vb` into the segment at `off`, hashing what landed as it goes (copyhash.py); its xxh3_64."""
    return copy_hash(mv[off : off + vb.nbytes], vb)


class Tiers:
    """Memory (a Core) with the tiers below it, each a `lower.Lower`, asked in order on a miss: the disk tier
    (optional), the snapshot the pool is still being filled from (while its fill runs: snaptier.py), the
    remote tier (optional)."""

    def __init__(self, core: Core, disk: DiskTier | None, remote: Any, snapshot: bool = True) -> None:
        self.core = core
        self.below: list[Lower] = []
        self.takes_puts: list[Lower] = []  # the tiers that want every put (the remote, without admission)
        self.takes_deletes: list[Lower] = []  # ... and every delete (the remote)
        # Admission (`tier_admit` 2): the tiers below take only evicted entries read since their put (seen
        # twice); the remote then gets them when memory lets them go (`_admit`), not at every put.
        self.admit = int(core.header[0]["tier_admit"]) >= ADMIT_REUSED
        self.answer_contains: list[Lower] = []
        self._indexed: Lower | None = None  # the tier looked up in memory's lock hold (the disk)
        self._disk = disk
        self._remote = remote  # remote.RemoteTier or None
        # `snapshot=False`: a handle that only reads stats does not index the snapshot (Pool.open).
        self._snapshot = SnapshotBelow(core) if snapshot and fill.running(core) else None
        self._arrange()
        self._spills: list[Spill] = []  # begun under the lock; written after it (`_write_spills`)
        self._spill_bytes = 0  # bytes copied aside in `_spills`
        # An explicit eviction (`evict`) writes its records under the lock, before each entry leaves
        # memory: a kill at any instant leaves the entry in one tier or the other (a spill copied
        # aside is lost with its writer).  Evictions that make room for a put copy aside, to keep
        # the lock short.
        self.spill_in_place = False
        # Set once a spill written outside the lock failed: from then on this process spills in place,
        # so the next failure refuses its eviction instead of losing the entry; cleared by a success.
        self.spill_failing = False
        self._no_evict = False  # set while a failed spill's entry is put back: no eviction may make room
        if disk is not None:
            core.on_evict = self._spill if not self.admit else self._admit
            core.repair_hooks.append(lambda fix: analyse_index(disk, fix))
        elif remote is not None and self.admit:
            core.on_evict = self._admit

    def _arrange(self) -> None:
        below: list[Lower] = []
        if self._disk is not None:
            below.append(DiskBelow(self.core, self._disk))
        if self._snapshot is not None:
            below.append(self._snapshot)
        if self._remote is not None:
            below.append(RemoteBelow(self._remote))
        self.below = below
        self._indexed = next((t for t in below if t.in_segment), None)
        self.takes_deletes = [t for t in below if type(t).offer_delete is not Lower.offer_delete]
        self.takes_puts = [t for t in below if type(t).offer_put is not Lower.offer_put and not self.admit]
        # Tiers that say whether they hold a key in memory's lock hold (`in`, the lookups' leading runs).
        self.answer_contains = [t for t in below if type(t).contains is not Lower.contains]

    @property
    def disk(self) -> DiskTier | None:
        return self._disk

    @disk.setter
    def disk(self, disk: DiskTier | None) -> None:
        self._disk = disk
        self._arrange()

    @property
    def remote(self) -> Any:
        return self._remote

    @remote.setter
    def remote(self, remote: Any) -> None:
        self._remote = remote
        self._arrange()

    def close(self) -> None:
        """Close the tiers (the remote's queue drains first, a few seconds at most); safe twice."""
        remote, self.remote = self.remote, None
        if remote is not None:
            remote.close()
        disk, self.disk = self.disk, None
        if disk is not None:
            disk.close()
        snap, self._snapshot = self._snapshot, None
        if snap is not None:
            snap.close()
            self._arrange()

    def offer_put(self, kb: bytes, value: Any, flags: int, ttl: float | None) -> None:
        """A put to memory, told to each tier that wants every put (the remote: queued, never waited on)."""
        for t in self.takes_puts:
            t.offer_put(kb, value, flags, ttl)

    def offer_delete(self, kb: bytes) -> None:
        for t in self.takes_deletes:
            t.offer_delete(kb)

    # ------------------------------------------------------------------ writes

    def put(self, kb: bytes, kh: int, flags: int, vb: memoryview, nblk: int, ttl: float | None, priority: int,
            checksum: int | None = None) -> None:
        """Store in memory (and, write-through, on disk); `checksum`: the value's xxh3_64 if already known."""
        core = self.core
        d = self.disk
        written = None
        if d is not None and d.write_through:
            written = self.write_record(kb, flags, vb, core.clock() + ttl if ttl else 0.0, priority)
            if checksum is None:
                checksum = xxh3_64_intdigest(vb)
        try:
            if vb.nbytes <= COPY_IN_LOCK:
                if checksum is None:
                    checksum = xxh3_64_intdigest(vb)
                if d is None:
                    core.locked(core.put_small, kb, kh, flags, vb, nblk, checksum, ttl, priority)
                else:
                    core.locked(self._put_small, kb, kh, flags, vb, nblk, checksum, ttl, priority, written)
                return
            i, off = core.locked(core.reserve, kb, kh, flags, vb.nbytes, nblk)
            if checksum is None:
                core.fill(i, lambda: copy_hashing(core.mv, off, vb), self.seal, kb, kh, ttl, priority, written)
            else:
                def copy() -> int:
                    core.mv[off : off + vb.nbytes] = vb
                    return checksum  # type: ignore[return-value]
                core.fill(i, copy, self.seal, kb, kh, ttl, priority, written)
        except CortexCacheError as e:
            if written is not None and not isinstance(e, SpillLost):
                d.log.kill(written[0])  # type: ignore[union-attr]  # the put failed: no record may come back
            raise

    def _put_small(self, kb: bytes, kh: int, flags: int, vb: memoryview, nblk: int, checksum: int,
                   ttl: float | None, priority: int, written: Written | None) -> None:
        self.core.put_small(kb, kh, flags, vb, nblk, checksum, ttl, priority)
        self._sealed_on_disk(kb, kh, written)

    def seal(self, i: int, checksum: int, kb: bytes, kh: int, ttl: float | None, priority: int,
             written: Written | None = None) -> None:
        """Seal reserved slot `i` as `kb`'s value (lock held), and tell the disk tier (`written`: the record a
        write-through put wrote)."""
        if not self.core.is_writing(i):
            return  # a repair took the reservation back
        self.core.seal(i, kb, kh, checksum, ttl, priority)
        if self.disk is not None:
            self._sealed_on_disk(kb, kh, written)

    def _sealed_on_disk(self, kb: bytes, kh: int, written: Written | None) -> None:
        """A new memory value of `kb` (lock held): index its write-through record, or drop a stale disk copy."""
        d = self.disk
        assert d is not None
        if written is None:
            d.forget(kb, kh)
        else:
            loc, kh2, vlen, expiry, priority, flags = written
            d.note_written(kh, kh2, len(kb), flags, loc, vlen, expiry, priority)

    def write_record(self, kb: bytes, flags: int, value: memoryview, expiry: float, priority: int) -> Written | None:
        """Write-through: put a record on disk (outside the lock); what `seal` indexes, or None."""
        d = self.disk
        assert d is not None
        core = self.core
        where = core.locked(d.reserve, DiskLog.record_length(len(kb), value.nbytes))
        if where is None:
            return None
        try:
            loc = d.log.write(*where, kb, value, expiry, priority, flags)  # type: ignore[union-attr]
        except OSError:
            core.locked(d.count, H_DISK_ERRORS)
            return None
        return (loc, key_hash2(kb), value.nbytes, expiry, priority, flags)

    def commit(self, i: int, kb: bytes, kh: int, flags: int, mv: memoryview, checksum: int, ttl: float | None,
               priority: int) -> None:
        """Seal a value written in place (Pool.reserve_write), write-through first; queue it for the remote."""
        d = self.disk
        written = None
        core = self.core
        try:
            if d is not None and d.write_through:
                written = self.write_record(kb, flags, mv, core.clock() + ttl if ttl else 0.0, priority)
            if d is None:
                core.seal_many([(i, kb, kh, checksum, ttl, priority)])  # False (taken back): as seal's silence
            else:
                core.locked(self.seal, i, checksum, kb, kh, ttl, priority, written)
        except BaseException:
            core.locked(core.abort, i)
            raise
        if self.takes_puts:
            self.offer_put(kb, mv.tobytes(), flags, ttl)

    def _admit(self, i: int) -> None:
        """`on_evict` with admission: only an entry read since its put goes to the tiers below (lock held)."""
        core = self.core
        if not core.reused(i):
            core.counters[H_TIER_REFUSED] += 1
            return
        if self.disk is not None:
            self._spill(i)
        if self.remote is not None:
            off, vlen = core.value_at(i)
            e = float(core.columns["expiry"][i])
            ttl = e - core.clock() if e else None
            if ttl is None or ttl > 0:  # queued: the server is written after the lock is let go
                self.remote.put(core.key_bytes(i), core.mv[off : off + vlen].tobytes(),
                                int(core.columns["flags"][i]) & SLOT_FLAG_STR_KEY, ttl)

    def _spill(self, i: int) -> None:
        """`on_evict`: begin spilling sealed entry `i`, about to leave memory (lock held): its bytes are
        copied aside and its disk entry made PENDING here; `_write_spills` writes it once the lock is free.

        An entry whose spill cannot happen never leaves memory: when this process cannot write the tier
        (it cannot open its files, a reservation or an in-place write fails), this raises and the
        eviction is refused -- an explicit `evict` fails, and so does a put that needed the room
        (docs/tiers.md, "When the disk tier cannot be written")."""
        core = self.core
        d = self.disk
        assert d is not None
        if self._no_evict:
            raise StorageIOError(f"pool {core.name!r}: no room to put back an entry its disk tier could not take")
        d.writable(f"pool {core.name!r}: evicting to the disk tier")
        off, vlen = core.value_at(i)  # each field read once and checked: impossible ones are SegmentCorrupt
        c = core.columns
        args = (core.key_bytes(i), int(c["key_hash"][i]), int(c["flags"][i]) & SLOT_FLAG_STR_KEY,
                core.mv[off : off + vlen], float(c["expiry"][i]), int(c["priority"][i]), core.checksum(i))
        if self.spill_in_place or self.spill_failing or self._spill_bytes + vlen > SPILL_ASIDE:
            # One lock hold evicting a lot (evict --all of a big pool): write in place instead of
            # holding copies of it all.  A write that fails raises here, before the entry leaves memory.
            d.spill_now(*args)
            self.spill_failing = False
            return
        sp = d.begin_spill(*args)
        if sp is not None:
            if not self._spills:
                core.after_unlock.append(self._write_spills)
            self._spills.append(sp)
            self._spill_bytes += vlen

    def _write_spills(self) -> None:
        """Write the records of spills begun under the lock, without it; then finish them under it.

        The victims' bytes were copied aside, so the lock is free while the disk works: other
        processes go on, and a reader of a key being spilled waits for it (`settled`)."""
        spills, self._spills, self._spill_bytes = self._spills, [], 0
        d = self.disk
        if d is None or not spills:
            return
        written = [d.write_spill(sp) for sp in spills]
        lost: list[Spill] = []

        def finish() -> None:
            for sp, ok in zip(spills, written):
                if not d.finish_spill(sp, ok) and not self._put_back(sp):
                    lost.append(sp)

        try:
            self.core.locked(finish)
        except Exception:  # noqa: BLE001
            # The caller's own operation is done; this is the tier's business.  Entries left
            # PENDING read as misses once this process is gone, or go when their key is written.
            pass
        if not all(written):
            self.spill_failing = True  # spill in place from now on: the next failure refuses its eviction
        if lost:
            n = len(lost)
            raise SpillLost(
                f"pool {self.core.name!r}: {n} {'entry' if n == 1 else 'entries'} evicted to make room could not "
                f"be written to the disk tier in {d.path!r} and {'was' if n == 1 else 'were'} lost "
                f"(first: {lost[0].key[:60]!r}); the operation itself completed, and later evictions by this "
                "process are refused while the tier cannot be written"
            )

    def _put_back(self, sp: Spill) -> bool:
        """A spill whose record could not be written: put its value back in memory if there is room
        without evicting anything else (lock held).  False if it could not be (the entry is lost)."""
        core = self.core
        kb = sp.key
        kh = xxh3_64_intdigest(kb)
        if core.find(kb, kh) >= 0:
            return True  # written again meanwhile: nothing was lost
        if sp.expiry and sp.expiry <= core.clock():
            return True  # it expired meanwhile: gone anyway
        vlen = len(sp.value)
        self._no_evict = True
        try:
            i, off = core.reserve(kb, kh, sp.flags, vlen, core.blocks_or_raise(vlen))
        except CortexCacheError:
            return False
        finally:
            self._no_evict = False
        core.mv[off : off + vlen] = sp.value
        core.seal(i, kb, kh, sp.checksum, None, sp.priority, False, sp.expiry)
        return True

    # ------------------------------------------------------------------ reads

    def read(self, kb: bytes, kh: int, out: memoryview | None) -> bytes | int | Pinned | DiskHit | None:
        """`Core.read`, and on a memory miss the disk tier's entry (a DiskHit to read outside the lock)."""
        r = self.core.read(kb, kh, out)
        if r is None and self._indexed is not None:
            return self._indexed.lookup(kb, kh)
        return r

    def pin_live(self, kb: bytes, kh: int) -> Pinned | DiskHit | None:
        """`Core.pin_live`, and on a memory miss the disk tier's entry."""
        r = self.core.pin_live(kb, kh)
        if r is None and self._indexed is not None:
            return self._indexed.lookup(kb, kh)
        return r

    def settled(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`core.locked(fn, *args)` for a lookup, asked again while the answer is SPILLING (a record
        being written by another process or thread); a miss after SPILL_WAIT seconds (its writer
        may have died)."""
        r = self.core.locked(fn, *args)
        if r is not SPILLING:
            return r
        deadline = time.monotonic() + SPILL_WAIT
        delay = 20e-6
        while r is SPILLING:
            if time.monotonic() > deadline:
                return None
            spill_pause(delay)
            delay = min(delay * 2, 1e-3)
            r = self.core.locked(fn, *args)
        return r

    def from_below(self, kb: bytes, kh: int, hit: DiskHit | None, room: int | None = None) -> bytes | None:
        """A memory miss: ask each tier below in order (`hit`: what the disk tier's index said in memory's lock
        hold); promote what the first that has it returns; its bytes.  `room`: the caller's buffer size
        (BufferTooSmall for a larger value)."""
        for t in self.below:
            got = t.fetch(kb, kh, hit if t.in_segment else None, room)
            if got is None:
                continue
            promoted = self._promote(t, kb, kh, got)
            t.served(got, promoted)
            value = got.value
            return value if value.__class__ is bytes else bytes(value)
        snap = self._snapshot
        if snap is not None and snap.ended:  # its fill is over: memory has all it will get from it
            self._snapshot = None
            self._arrange()
        return None

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
        self.core.seal(i, kb, kh, got.checksum, None, got.priority, False, got.expiry)
        tier.promoted(got)
        if self.disk is not None and not tier.in_segment:
            self.disk.forget(kb, kh)  # a stale disk copy of the key, as a put drops it
        if self.admit and tier.in_segment:
            self.core.mark_read(i)  # read from disk: it earned its place there, and goes back when evicted

    # ------------------------------------------------------------------ delete, membership, metadata

    def delete(self, kb: bytes, kh: int) -> bool:
        """Remove `kb` from memory and disk (lock held); True if it was in either."""
        below = [t.forget(kb, kh) for t in self.below]  # every tier forgets it
        return self.core.delete(kb, kh, any(below))

    def contains(self, kb: bytes, kh: int) -> bool:
        """Is `kb` live in memory or on disk?  (Lock held.)"""
        if self.core.find_live(kb, kh) >= 0:
            return True
        return any(t.contains(kb, kh) for t in self.below)

    def info(self, kb: bytes, kh: int) -> dict[str, Any] | None:
        """Metadata of `kb`'s entry in memory, else on disk, else None (lock held)."""
        core = self.core
        i = core.find_live(kb, kh)
        if i >= 0:
            return core.info(i)
        d = self.disk
        if d is not None and d.contains(kb, kh):
            return d.info(d.find(kh, key_hash2(kb), len(kb)))
        return None

    def keys(self, pb: bytes, limit: int | None, tier: str) -> list[str | bytes]:
        """Pool.keys for tier "memory" (live entries, oldest insert first, in one lock hold), "disk" or
        "all" (memory, then disk-only keys), of those starting with `pb`."""
        if tier != "memory":
            mem = [] if tier == "disk" else self.keys(pb, limit, "memory")
            if limit is not None and len(mem) >= limit:
                return mem
            seen = set(mem)
            more = [k for k in self.disk_keys(pb) if k not in seen]
            out = mem + more
            return out[:limit] if limit is not None else out
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

    def disk_keys(self, pb: bytes = b"", with_slots: bool = False) -> list[Any]:
        """Keys on disk (read from the records, outside the lock) starting with `pb`, oldest written first."""
        d = self.disk
        if d is None or d.log is None:
            return []
        out: list[Any] = []
        for ds, seq, loc, klen, flags in self.core.locked(d.records):
            try:
                kb = d.log.read_key(loc, klen)
            except OSError:
                continue
            if kb is None or not kb.startswith(pb):
                continue  # overwritten since, or not a match
            k = kb.decode("utf-8", "surrogateescape") if flags & SLOT_FLAG_STR_KEY else kb
            out.append((ds, seq, kb, k) if with_slots else k)
        return out

    # ------------------------------------------------------------------ eviction

    def evict_memory(self, keys: list[bytes] | None, prefix: bytes | None, all: bool, expired: bool,
                     percent: float | None, target: int | None, spill: bool) -> tuple[int, int]:
        """Evict from memory now (Pool.evict's one selector); with `spill` and a disk tier, what has not
        expired moves to disk as any eviction's does.  (entries, value bytes) freed."""
        core = self.core
        # With admission, what memory evicts goes to the remote too (Tiers._admit), disk tier or not.
        spill = spill and (self.disk is not None or (self.admit and self.remote is not None))
        if spill and self.disk is not None and not (expired and not all and keys is None and prefix is None):
            # Refused before anything leaves memory when this process cannot write the tier; expired
            # entries are dropped, not spilled, so `--expired` needs no tier.
            self.disk.writable(f"pool {core.name!r}: evicting to the disk tier")  # type: ignore[union-attr]

        def in_place(fn: Callable[..., tuple[int, int]], *args: Any) -> tuple[int, int]:
            # Set under the lock: each record is written before its entry leaves memory (see _spill).
            self.spill_in_place = spill
            try:
                return fn(*args)
            except StorageIOError as e:  # a record could not be written: that entry and the rest stay
                raise StorageIOError(f"pool {core.name!r}: evicting stopped: {e}; entries evicted before it "
                                     "went to disk (evict with --tier all to drop them without spilling)") from None
            finally:
                self.spill_in_place = False

        if keys is not None:
            return core.locked(in_place, core.evict_keys, [(kb, xxh3_64_intdigest(kb)) for kb in keys], spill)
        if all:  # an empty pool means empty: a fill still bringing the snapshot back stops (fill.py)
            core.locked(fill.stop, core)
        if expired or all or prefix is not None:
            return core.locked(in_place, core.evict_matching, expired, prefix, spill)
        return core.locked(in_place, core.evict_amount, percent, target, spill)

    def evict_disk(self, keys: list[bytes] | None, prefix: bytes | None, all: bool, expired: bool,
                   percent: float | None, target: int | None) -> tuple[int, int]:
        """Remove entries from the disk tier by one selector (their records are killed); (entries, bytes)."""
        d = self.disk
        if d is None:
            return 0, 0
        core = self.core
        if keys is not None:
            def by_key() -> list[int]:
                slots = (d.find(xxh3_64_intdigest(kb), key_hash2(kb), len(kb)) for kb in keys)
                return [s for s in slots if s >= 0]

            return core.locked(lambda: d.forget_slots(by_key()))
        if prefix is not None:
            chosen = [(s, seq) for s, seq, _, _ in self.disk_keys(prefix, with_slots=True)]
            return core.locked(lambda: d.forget_slots([s for s, seq in chosen if d.is_live(s, seq)]))

        def select() -> list[int]:
            c = d.cols
            if all:  # spills being written too, or they would land after the tier was emptied
                return list(map(int, d.indexed_slots()))
            idx = d.live_slots()
            if expired:
                e = c["expiry"][idx]
                return list(map(int, idx[(e > 0) & (e <= core.clock())]))
            idx = idx[np.argsort(c["seq"][idx], kind="stable")]  # oldest written first
            goal = target if target is not None else int(np.ceil(int(c["value_len"][idx].sum()) * percent / 100))
            sizes = np.cumsum(c["value_len"][idx].astype(np.int64))
            n = int(np.searchsorted(sizes, goal, side="left")) + 1 if goal > 0 else 0
            return list(map(int, idx[:n]))

        return core.locked(lambda: d.forget_slots(select()))

    def evict_remote(self, keys: list[bytes] | None, prefix: bytes | None) -> tuple[int, int]:
        if self.remote is None:
            raise UsageError(f"pool {self.core.name!r} has no remote tier")
        if keys is not None:
            return self.remote.evict(keys=keys)
        return self.remote.evict(prefix=prefix or b"")

    def stats(self) -> dict[str, Any]:
        return {
            "disk": self.disk.stats() if self.disk is not None else None,
            "remote": self.remote.stats() if self.remote is not None else None,
        }


__all__ = ["Tiers", "COPY_IN_LOCK", "SPILL_WAIT", "SPILL_ASIDE", "copy_hashing"]
