"""The disk tier's index in the segment, and this process's handle on its files (disktier.py is the tier).

Storage is a `DiskLog` (disklog.py): a ring of preallocated files of
checksummed records.  The index of what is on disk lives in the pool's
segment (the disk-index regions of layout.py), so every attached process
sees the same tier, and it is guarded by the pool lock like the rest of the
metadata.  The records are the truth: the index is rebuilt from a scan of the
files when a pool is created on a directory that already holds a tier (the
restart case), and repair rebuilds its chains from the disk slots.

How the two tiers relate:

- write-back (default): an entry evicted from memory (not expired) is
  spilled by the evicting process in two steps.  Under the pool lock its
  bytes are copied aside, room in the ring is reserved and the key is
  indexed as PENDING; the lock is let go, the record is written (as a
  pending record, disklog.PENDING_MAGIC), and under the lock again it is
  confirmed and made LIVE -- unless the key was deleted, replaced or dropped
  meanwhile, which removed the PENDING entry; then the record stays pending,
  which no read and no restart scan accepts.  A reader that meets a PENDING
  entry waits for it (Tiers.settled).  A spiller that dies leaves a PENDING
  entry that reads as a miss until its key is written again, the ring or a
  repair drops it.  A disk hit
  is copied back into memory and its record killed (the tiers are
  exclusive, so the disk holds what memory does not).
- write-through: every put also writes a record (before it takes the lock
  for the memory put), and a disk hit leaves its record in place (the tiers
  are inclusive).  An entry evicted from memory whose record the ring has
  already overwritten is written again, as in write-back.

The disk's own eviction is the ring: when the append cursor enters a file,
the entries in it are dropped (`drop_file`), oldest written first -- which is
least recently used, since a disk hit moves an entry to memory and it comes
back to disk at the head of the ring.  Deleting or replacing a key kills its
record on disk, so a restart never brings back a value that was removed.

Every method here runs with the pool lock held unless it says otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from xxhash import xxh3_64_intdigest

from .chains import build_chains, chain_members, unchain
from .stats import hit_stats
from .disklog import DiskLog, Location
from .errors import CortexCacheError, SegmentCorrupt, StorageIOError
from .lower import BUSY
from .layout import (
    DFREE, DISK_O_DIRECT, DISK_ON, DISK_WRITE_THROUGH, HEADER_DTYPE, DLIVE, DPENDING, DSLOT_COLUMNS,
    H_DFREE_SLOT, H_DISK_BYTES_READ, H_DISK_BYTES_WRITTEN, H_DISK_CORRUPT, H_DISK_DROPPED, H_DISK_ENTRIES,
    H_DISK_ERRORS, H_DISK_EVICTIONS, H_DISK_HITS, H_DISK_MISSES, H_DISK_PROMOTIONS, H_DISK_SPILLS,
    H_DISK_VALUE_BYTES, MV_FORMAT,
    Geometry,
)

KEY_SEED2 = 0x9E3779B97F4A7C15  # seed of the second key hash (64 + 64 bits tell keys apart)
MAX_DEFAULT_DSLOTS = 1 << 21
_DROP_BATCH = 64  # a full disk index drops its oldest 1/64th at once


def key_hash2(kb: bytes) -> int:
    return xxh3_64_intdigest(kb, KEY_SEED2)


def default_disk_entries(capacity: int, block_size: int) -> int:
    """Index rows for a tier: one per record of a block (records are at least 4 KiB)."""
    return max(16, min(capacity // max(block_size, 4096), MAX_DEFAULT_DSLOTS))


SPILLING = BUSY  # what a lookup answers for a key whose spill is being written right now (Tiers.settled asks again)


@dataclass(frozen=True)
class Spill:
    """A spill begun under the lock, to be written outside it and then finished under it."""

    slot: int
    loc: Location
    key: bytes
    value: bytes
    expiry: float
    priority: int
    flags: int
    checksum: int


@dataclass(frozen=True)
class DiskHit:
    """A memory miss found in the disk index: where to read it, and how to check it is still there."""

    slot: int
    seq: int
    loc: Location
    value_len: int
    expiry: float
    priority: int
    flags: int


class DiskIndex:
    """The disk index in a pool's segment plus this process's handle on the tier's files."""

    def __init__(
        self, mm: Any, mv: memoryview, hdr: tuple, geometry: Geometry, flags: int, path: str,
        log: DiskLog | None, unavailable: str | None, clock: Callable[[], float],
        unavailable_error: type | None = None,
    ) -> None:
        self._hu64, self._hi64 = hdr
        self.path = path
        self.write_through = bool(flags & DISK_WRITE_THROUGH)
        self.o_direct = bool(flags & DISK_O_DIRECT)
        self.log = log
        self.unavailable = unavailable  # why this process could not open the files, or None
        # The error class of that failure (PermissionDenied, StorageIOError...): what a spill refused
        # for it raises (`writable`).  None while the files are open, or when they are gone altogether
        # (no process can spill then, and the pool goes on from memory alone, each lost spill counted).
        self.unavailable_error = unavailable_error
        self.clock = clock
        g = geometry
        self._n = g.n_dslots
        self._mask = g.n_dbuckets - 1
        offs = g.dslot_columns()
        self.cols = {name: np.frombuffer(mm, fmt, g.n_dslots, offs[name]) for name, fmt in DSLOT_COLUMNS}
        self.buckets = np.frombuffer(mm, np.int32, g.n_dbuckets, g.dbuckets_off)
        views = {}
        for name, fmt in DSLOT_COLUMNS:
            size = np.dtype(fmt).itemsize
            views[name] = mv[offs[name] : offs[name] + g.n_dslots * size].cast(MV_FORMAT[fmt])
        self._views = list(views.values())
        self._state, self._klen, self._file = views["state"], views["key_len"], views["file"]
        self._flags, self._next = views["flags"], views["next"]
        self._kh, self._kh2, self._vlen = views["key_hash"], views["key_hash2"], views["value_len"]
        self._off, self._len, self._seq = views["offset"], views["length"], views["seq"]
        self._expiry, self._prio, self._spilled = views["expiry"], views["priority"], views["spilled"]
        self._bkt = mv[g.dbuckets_off : g.dbuckets_off + g.n_dbuckets * 4].cast("i")
        self._views.append(self._bkt)

    def close(self) -> None:
        for v in self._views:
            v.release()
        self._views = []
        self.cols = None  # type: ignore[assignment]
        self.buckets = None  # type: ignore[assignment]
        if self.log is not None:
            self.log.close()
            self.log = None

    @staticmethod
    def initialise(mm: Any, g: Geometry, flags: int, log: DiskLog, path: str) -> None:
        """Empty index of a new segment (every disk slot on the free list) and the tier's header fields."""
        nxt = np.frombuffer(mm, np.int32, g.n_dslots, g.dslot_columns()["next"])
        nxt[:-1] = np.arange(1, g.n_dslots, dtype=np.int32)
        nxt[-1] = -1
        np.frombuffer(mm, np.int32, g.n_dbuckets, g.dbuckets_off)[:] = -1
        del nxt
        h = np.frombuffer(mm, HEADER_DTYPE, 1, 0)[0]
        h["dfree_slot"] = 0
        h["disk_flags"] = flags
        h["disk_size"] = log.capacity
        h["disk_path"] = path.encode("utf-8", "surrogateescape")
        del h

    @classmethod
    def attach(cls, mm: Any, core: Any, log: DiskLog | None = None) -> "DiskIndex | None":
        """The disk tier of the pool whose core is `core` (this process's handle on its files; `log` if
        already open), or None when the pool has none."""
        h = core.fields
        flags = int(h.disk_flags[0])
        if not flags & DISK_ON:
            return None
        path = bytes(h.disk_path[0]).decode("utf-8", "surrogateescape")
        why = err = None
        if log is None:
            log, e = _open_log(path, bool(flags & DISK_O_DIRECT))
            if e is not None:
                why, err = str(e), type(e) if isinstance(e, CortexCacheError) else StorageIOError
                if _tier_gone(path):
                    err = None  # nobody can spill to a tier that is gone: the pool works from memory alone
        return cls(mm, core.mv, (core.counters, core.signed_counters), core.geometry, flags, path, log, why,
                   core.clock, err)

    # ------------------------------------------------------------------ index

    def find(self, kh: int, kh2: int, klen: int) -> int:
        """Disk slot of the key with these hashes and length, or -1."""
        d = self._bkt[kh & self._mask]
        steps = 0
        while d >= 0:
            if self._kh[d] == kh and self._kh2[d] == kh2 and self._klen[d] == klen:
                return d
            d = self._next[d]
            steps += 1
            if steps > self._n:
                raise SegmentCorrupt("disk index: hash chain loop; run `cortex cache verify --repair`")
        return -1

    def hit(self, d: int) -> DiskHit:
        loc = Location(self._file[d], self._off[d], self._len[d], self._seq[d])
        return DiskHit(d, self._seq[d], loc, self._vlen[d], self._expiry[d], self._prio[d], self._flags[d])

    def is_live(self, d: int, seq: int) -> bool:
        return self._state[d] == DLIVE and self._seq[d] == seq

    def still(self, hit: DiskHit) -> bool:
        """Is disk slot `hit.slot` still the record we looked up?"""
        d = hit.slot
        return self._state[d] == DLIVE and self._seq[d] == hit.seq

    def _alloc(self) -> int:
        hi64 = self._hi64
        d = hi64[H_DFREE_SLOT]
        if d < 0:
            self._drop_oldest()
            d = hi64[H_DFREE_SLOT]
        hi64[H_DFREE_SLOT] = self._next[d]
        self._next[d] = -1
        return d

    def _drop_oldest(self) -> None:
        """The index is full: forget the oldest written entries (their records stay until the ring reaches them)."""
        seq = self.cols["seq"]
        live = np.flatnonzero(self.cols["state"] != DFREE)
        k = max(1, live.size // _DROP_BATCH)
        oldest = live[np.argpartition(seq[live], k - 1)[:k]] if k < live.size else live
        for d in map(int, oldest):
            self._drop(d)
        self._hu64[H_DISK_DROPPED] += len(oldest)

    def insert(self, kh: int, kh2: int, klen: int, flags: int, loc: Location, vlen: int,
               expiry: float, priority: int, state: int = DLIVE) -> int:
        """Index a record just written (or, DPENDING, about to be); an older record of the key is killed."""
        old = self.find(kh, kh2, klen)
        if old >= 0:
            self.forget_slot(old)
        d = self._alloc()
        self._kh[d], self._kh2[d], self._klen[d], self._flags[d] = kh, kh2, klen, flags
        self._file[d], self._off[d], self._len[d], self._seq[d] = loc.file, loc.offset, loc.length, loc.seq
        self._vlen[d], self._expiry[d], self._prio[d] = vlen, expiry, priority
        self._spilled[d] = self.clock()
        b = kh & self._mask
        self._next[d] = self._bkt[b]
        self._bkt[b] = d
        self._state[d] = state
        hu64 = self._hu64
        hu64[H_DISK_ENTRIES] += 1
        hu64[H_DISK_VALUE_BYTES] += vlen
        return d

    def _drop(self, d: int) -> None:
        """Take disk slot `d` out of the index (its record stays on disk)."""
        unchain(self._bkt, self._next, self._kh[d] & self._mask, d)
        self._state[d] = DFREE
        hu64, hi64 = self._hu64, self._hi64
        hu64[H_DISK_ENTRIES] -= 1
        hu64[H_DISK_VALUE_BYTES] -= self._vlen[d]
        self._next[d] = hi64[H_DFREE_SLOT]
        hi64[H_DFREE_SLOT] = d

    def kill_slot(self, d: int) -> None:
        """Drop `d` and kill its record on disk, so no restart finds it again."""
        loc = Location(self._file[d], self._off[d], self._len[d], self._seq[d])
        self._drop(d)
        if self.log is not None:
            try:
                self.log.kill(loc)
            except OSError:
                self._hu64[H_DISK_ERRORS] += 1

    def forget_slot(self, d: int) -> None:
        """Remove an entry from the tier on purpose (delete, replace, evict): counted."""
        self.kill_slot(d)
        self._hu64[H_DISK_EVICTIONS] += 1

    def forget(self, kb: bytes, kh: int) -> bool:
        """Remove `kb`'s entry from the tier, if it has one."""
        d = self.find(kh, key_hash2(kb), len(kb))
        if d < 0:
            return False
        self.forget_slot(d)
        return True

    def drop_file(self, file: int) -> None:
        """The ring entered `file`: every entry in it is about to be overwritten."""
        cols = self.cols
        gone = np.flatnonzero((cols["state"] != DFREE) & (cols["file"] == file))
        for d in map(int, gone):
            self._drop(d)
        self._hu64[H_DISK_DROPPED] += gone.size

    # ------------------------------------------------------------------ writes

    def writable(self, what: str) -> None:
        """Raise (the tier's own error class: PermissionDenied, StorageIOError...) if this process has no
        handle on the tier's files, so `what` -- an eviction whose entries would go to disk -- is refused
        before anything leaves memory (docs/tiers.md, "When the disk tier cannot be written")."""
        if self.log is not None or self.unavailable_error is None:
            return  # a tier whose files are gone (for every process) is no tier: evictions drop, counted
        cls = self.unavailable_error
        raise cls(f"{what} refused: this process cannot write the pool's disk tier ({self.unavailable}); "
                  "the entries stay in memory (evict with --tier all to drop them without spilling)")

    def reserve(self, length: int, strict: bool = False) -> tuple[int, int, int] | None:
        """Room for a record of `length` bytes: (file, offset, seq), or None (counted) when impossible.

        `strict` (a spill, whose entry is still in memory): a tier that cannot be written raises
        (StorageIOError, or why the tier is unavailable) instead, so the eviction is refused."""
        log = self.log
        if log is None:
            if strict:
                self.writable("evicting to the disk tier")
            self._hu64[H_DISK_ERRORS] += 1
            return None
        if length > log.file_size:
            self._hu64[H_DISK_DROPPED] += 1  # larger than a tier file: it cannot go to disk
            return None
        try:
            file, off, seq = log.reserve(length)
        except OSError as e:
            self._hu64[H_DISK_ERRORS] += 1
            if strict:
                raise _spill_error(self.path, e) from None
            return None
        if off == 0:
            self.drop_file(file)
        return file, off, seq

    def _spill_place(self, kb: bytes, kh: int, vlen: int) -> tuple[int, tuple[int, int, int] | None] | None:
        """(second key hash, reserved (file, offset, seq) or None if there is no room) for a spill;
        None when there is nothing to write (write-through already has the key's record)."""
        kh2 = key_hash2(kb)
        if self.write_through and self.find(kh, kh2, len(kb)) >= 0:
            return None
        return kh2, self.reserve(DiskLog.record_length(len(kb), vlen), strict=True)

    def begin_spill(self, kb: bytes, kh: int, flags: int, value: memoryview, expiry: float, priority: int,
                    checksum: int) -> Spill | None:
        """Start spilling an entry leaving memory: copy it aside, reserve its record, index it PENDING.

        None when there is nothing to write or no room (a record larger than a tier file: counted as
        dropped); raises when the tier cannot be written (`reserve`), so the entry stays."""
        place = self._spill_place(kb, kh, value.nbytes)
        if place is None or place[1] is None:
            return None
        kh2, (file, off, seq) = place
        vlen = value.nbytes
        loc = Location(file, off, DiskLog.record_length(len(kb), vlen), seq)
        d = self.insert(kh, kh2, len(kb), flags, loc, vlen, expiry, priority, state=DPENDING)
        self._spilled[d] = os.getpid()  # while PENDING, `spilled` names the writer (readers check it lives)
        return Spill(d, loc, kb, value.tobytes(), expiry, priority, flags, checksum)

    def spill_now(self, kb: bytes, kh: int, flags: int, value: memoryview, expiry: float, priority: int,
                  checksum: int) -> None:
        """Write an entry leaving memory to disk right here, under the lock (when copying it aside
        would hold too much memory, for an explicit eviction, or after a spill failed: see disktier.DiskTier.evicted).
        A write that fails raises StorageIOError before the entry leaves memory."""
        place = self._spill_place(kb, kh, value.nbytes)
        if place is None or place[1] is None:
            return
        kh2, where = place
        try:
            loc = self.log.write(*where, kb, value, expiry, priority, flags, checksum=checksum)  # type: ignore[union-attr]
        except OSError as e:
            self._hu64[H_DISK_ERRORS] += 1
            raise _spill_error(self.path, e) from None
        self.note_written(kh, kh2, len(kb), flags, loc, value.nbytes, expiry, priority)

    def write_spill(self, sp: Spill) -> bool:
        """Write a begun spill's record, as pending (no lock held).  False if the write failed."""
        log = self.log
        if log is None:
            return False
        try:
            log.write(sp.loc.file, sp.loc.offset, sp.loc.seq, sp.key, sp.value, sp.expiry, sp.priority, sp.flags,
                      pending=True, checksum=sp.checksum)
        except OSError:
            return False
        return True

    def finish_spill(self, sp: Spill, written: bool) -> bool:
        """Confirm a written spill if its entry is still the PENDING one it made; else leave it pending.

        False when the entry is still current but its record could not be written or confirmed: its
        index entry is dropped, and the caller must put the value back in memory or report it lost."""
        d = sp.slot
        if self._state[d] != DPENDING or self._seq[d] != sp.loc.seq:
            return True  # deleted, replaced or dropped meanwhile: the pending record is never read
        if written:
            try:
                self.log.confirm(sp.loc)  # type: ignore[union-attr]
            except OSError:
                written = False
        if not written:
            self._hu64[H_DISK_ERRORS] += 1
            self._drop(d)
            return False
        self._state[d] = DLIVE
        self._spilled[d] = self.clock()
        hu64 = self._hu64
        hu64[H_DISK_SPILLS] += 1
        hu64[H_DISK_BYTES_WRITTEN] += sp.loc.length
        return True

    def spill_orphaned(self, d: int) -> bool:
        """Is PENDING slot `d` a spill whose writer died (so it will never be written)?"""
        from .procs import alive

        return not alive(int(self._spilled[d]), 0)

    def note_written(self, kh: int, kh2: int, klen: int, flags: int, loc: Location, vlen: int,
                     expiry: float, priority: int) -> None:
        self.insert(kh, kh2, klen, flags, loc, vlen, expiry, priority)
        hu64 = self._hu64
        hu64[H_DISK_SPILLS] += 1
        hu64[H_DISK_BYTES_WRITTEN] += loc.length

    def count(self, field: int, n: int = 1) -> None:
        self._hu64[field] += n

    # ------------------------------------------------------------------ reads

    def lookup(self, kb: bytes, kh: int) -> DiskHit | None:
        """The disk entry for a memory miss, or None (counted as a disk miss)."""
        d = self.find(kh, key_hash2(kb), len(kb))
        if d >= 0:
            e = self._expiry[d]
            if e > 0 and e <= self.clock():
                self.kill_slot(d)
                d = -1
            elif self._state[d] == DPENDING:
                if not self.spill_orphaned(d):
                    return SPILLING  # not counted: the caller asks again once the record is written
                self._drop(d)  # its writer died: it will never be written
                d = -1
        if d < 0:
            self._hu64[H_DISK_MISSES] += 1
            return None
        return self.hit(d)

    def contains(self, kb: bytes, kh: int) -> bool:
        d = self.find(kh, key_hash2(kb), len(kb))
        if d < 0:
            return False
        e = self._expiry[d]
        return not (e > 0 and e <= self.clock())

    def after_failed_read(self, kb: bytes, kh: int, hit: DiskHit, corrupt: bool) -> DiskHit | None:
        """A read found the record gone (or damaged): fix the index; the entry to try next, or None."""
        if self.still(hit):
            if corrupt:
                self._hu64[H_DISK_CORRUPT] += 1
                self.kill_slot(hit.slot)
            else:
                self._drop(hit.slot)  # overwritten behind the index's back
                self._hu64[H_DISK_DROPPED] += 1
            self._hu64[H_DISK_MISSES] += 1
            return None
        # The index moved on while we read (a newer record, or the entry is gone): look again.
        d = self.find(kh, key_hash2(kb), len(kb))
        if d < 0 or self._state[d] == DPENDING:
            self._hu64[H_DISK_MISSES] += 1
            return None
        return self.hit(d)

    def info(self, d: int) -> dict[str, Any]:
        e = float(self._expiry[d])
        now = self.clock()
        return {
            "tier": "disk",
            "size": int(self._vlen[d]),
            "disk_file": int(self._file[d]),
            "disk_offset": int(self._off[d]),
            "disk_bytes": int(self._len[d]),
            # While a spill is being written, `spilled` holds its writer's pid, not a time.
            "spilled": None if self._state[d] == DPENDING else float(self._spilled[d]),
            "spilling": bool(self._state[d] == DPENDING),
            "priority": int(self._prio[d]),
            "expires": e if e > 0 else None,
            "ttl_remaining": max(0.0, e - now) if e > 0 else None,
        }

    # ------------------------------------------------------------------ scans

    def records(self) -> list[tuple[int, int, Location, int, int]]:
        """(slot, seq, location, key length, flags) of every live unexpired entry, oldest written first."""
        c = self.cols
        idx = self.live_slots()
        e = c["expiry"][idx]
        idx = idx[(e == 0) | (e > self.clock())]
        idx = idx[np.argsort(c["seq"][idx], kind="stable")]
        return [(int(d), int(c["seq"][d]), self.hit(int(d)).loc, int(c["key_len"][d]), int(c["flags"][d]))
                for d in idx]

    def forget_slots(self, slots: list[int]) -> tuple[int, int]:
        """Remove these entries (their records are killed); (entries, value bytes)."""
        freed = 0
        for d in slots:
            freed += self._vlen[d]
            self.forget_slot(d)
        return len(slots), freed

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.cols["state"] == DLIVE)

    def indexed_slots(self) -> np.ndarray:
        """Live entries and spills being written."""
        return np.flatnonzero(self.cols["state"] != DFREE)

    def stats(self) -> dict[str, Any]:
        h = self._hu64
        out: dict[str, Any] = {
            "path": self.path,
            "available": self.log is not None,
            "write": "through" if self.write_through else "back",
            "o_direct": self.o_direct,
            "capacity_bytes": self.log.capacity if self.log is not None else None,
            "entries": h[H_DISK_ENTRIES],
            "max_entries": self._n,
            "value_bytes": h[H_DISK_VALUE_BYTES],
            **hit_stats(h[H_DISK_HITS], h[H_DISK_MISSES]),
            "spills": h[H_DISK_SPILLS],
            "promotions": h[H_DISK_PROMOTIONS],
            "bytes_written": h[H_DISK_BYTES_WRITTEN],
            "bytes_read": h[H_DISK_BYTES_READ],
            "corrupt": h[H_DISK_CORRUPT],
            "dropped": h[H_DISK_DROPPED],
            "errors": h[H_DISK_ERRORS],
            "evictions": h[H_DISK_EVICTIONS],
        }
        if self.log is not None:
            u = self.log.usage()
            # Bytes the ring has written since it last went round, a proxy for use.
            out["ring_file"] = u["cursor_file"]
            out["ring_offset"] = u["cursor_offset"]
        else:
            out["error"] = self.unavailable
        return out

    def rebuild_from_scan(self) -> int:
        """Fill an empty index from the records on disk (newest record of each key wins)."""
        assert self.log is not None
        found = list(self.log.scan())
        found.sort(key=lambda r: r.loc.seq, reverse=True)
        now = self.clock()
        n = 0
        for r in found:
            if n >= self._n:
                self._hu64[H_DISK_DROPPED] += 1
                continue
            if r.expiry and r.expiry <= now:
                continue
            kh, kh2 = xxh3_64_intdigest(r.key), key_hash2(r.key)
            if self.find(kh, kh2, len(r.key)) >= 0:
                continue  # an older record of a key already indexed
            self.insert(kh, kh2, len(r.key), r.flags, r.loc, r.value_len, r.expiry, r.priority)
            n += 1
        self._hu64[H_DISK_CORRUPT] += self.log.last_scan_corrupt
        return n


def _spill_error(path: str, e: OSError) -> Exception:
    return StorageIOError(f"cannot write the disk tier in {path!r} ({e.strerror or e}): the entry stays in memory")


def _tier_gone(path: str) -> bool:
    """Is there no tier in `path` at all (its directory or meta file does not exist)?  A tier this
    process only cannot reach (EACCES, a descriptor limit) is not gone: other processes may write it."""
    from .disklog import META_NAME

    try:
        os.lstat(os.path.join(path, META_NAME))
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def open_log(path: str, o_direct: bool) -> tuple[DiskLog | None, str | None]:
    """This process's handle on a pool's tier files, or None and why not."""
    log, e = _open_log(path, o_direct)
    return log, None if e is None else str(e)


def _open_log(path: str, o_direct: bool) -> tuple[DiskLog | None, Exception | None]:
    try:
        return DiskLog.open(path, o_direct=o_direct), None
    except (CortexCacheError, OSError) as e:
        return None, e


__all__ = ["DiskIndex", "DiskHit", "Spill", "SPILLING", "key_hash2", "default_disk_entries", "open_log", "analyse_index"]


def analyse_index(tier: DiskIndex, fix: bool) -> list[str]:
    """Check (and with `fix`, rebuild) the disk index: chains, free list, counters (pool lock held).

    The disk slots are the truth here, as the memory slots are for the memory
    index; a slot that cannot describe a record is dropped (its record stays
    on disk and a later restart finds it again).
    """
    from .disklog import ALIGN, FILES

    c = tier.cols
    n = tier._n
    problems: list[str] = []
    state = c["state"].copy()
    bad = np.flatnonzero(state > DPENDING)
    if bad.size:
        problems.append(f"{bad.size} disk slot(s) with an invalid state")
        state[bad] = DFREE
    pending = np.flatnonzero(state == DPENDING)
    orphans = np.array([d for d in map(int, pending) if tier.spill_orphaned(d)], dtype=np.int64)
    if orphans.size:
        # Spills whose writer died: never written, or written and never confirmed (nothing reads those).
        problems.append(f"{orphans.size} unfinished spill(s) of dead processes dropped")
        state[orphans] = DFREE
        pending = np.setdiff1d(pending, orphans)
    file_size = tier.log.file_size if tier.log is not None else None
    live = np.flatnonzero(state == DLIVE)
    length, off = c["length"][live], c["offset"][live]
    ok = (c["file"][live] < FILES) & (length >= ALIGN) & (length % ALIGN == 0) & (off % ALIGN == 0)
    ok &= (c["key_len"][live] >= 1) & (c["value_len"][live] < length)
    if file_size is not None:
        ok &= (length <= file_size) & (off <= file_size - np.minimum(length, file_size))
    if not ok.all():
        problems.append(f"{int((~ok).sum())} disk entr(y/ies) with an impossible position dropped")
        state[live[~ok]] = DFREE
    # One entry per key: keep the newest record.
    live = np.flatnonzero(state == DLIVE)
    keys = np.stack([c["key_hash"][live], c["key_hash2"][live], c["key_len"][live].astype(np.uint64)], axis=1)
    order = np.lexsort((-c["seq"][live].astype(np.float64), keys[:, 2], keys[:, 1], keys[:, 0]))
    ks = keys[order]
    dup = np.r_[False, (ks[1:] == ks[:-1]).all(axis=1)] if ks.size else np.zeros(0, dtype=bool)
    if dup.any():
        problems.append(f"{int(dup.sum())} duplicate disk entr(y/ies) of one key dropped")
        state[live[order[dup]]] = DFREE
    live = np.flatnonzero(state == DLIVE)
    free = np.flatnonzero(state == DFREE).astype(np.int32)
    indexed = np.sort(np.concatenate([live, pending]))  # pending spills are in the chains too
    buckets, nxt = build_chains(indexed, c["key_hash"][indexed], tier._mask, tier.buckets.size, n, free)
    entries, value_bytes = indexed.size, int(c["value_len"][indexed].sum())
    hu64, hi64 = tier._hu64, tier._hi64
    if not fix and not problems:
        if not np.array_equal(chain_members(tier.buckets, c["next"]), indexed):
            problems.append("disk index chains out of step with the disk entries")
        elif hu64[H_DISK_ENTRIES] != entries or hu64[H_DISK_VALUE_BYTES] != value_bytes:
            problems.append("disk entry counters out of step")
    if fix:
        c["state"][:] = state
        tier.buckets[:] = buckets
        c["next"][:] = nxt
        hi64[H_DFREE_SLOT] = int(free[0]) if free.size else -1
        hu64[H_DISK_ENTRIES] = entries
        hu64[H_DISK_VALUE_BYTES] = value_bytes
    return problems
