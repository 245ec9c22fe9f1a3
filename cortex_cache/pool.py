"""The pool: a named KV-cache in shared memory that any process can attach to.

Concurrency model (DESIGN §3):

- One lock per pool (lock.py) guards all metadata: header, slots, hash
  chains, block map, pin records.  Every critical section sets the header's
  `dirty` mark on entry and clears it on a clean exit, so a process killed
  while holding the lock leaves `dirty` set and the next holder repairs.
- Values are copied outside the lock when they are large.  A writer reserves
  a slot and its blocks (state WRITING, invisible), copies, then seals.
  A reader pins the entry (a pin record naming its pid), copies, then unpins;
  eviction and delete never free a pinned entry's blocks (it becomes a ZOMBIE
  until the last pin goes).
- Dead writers' reservations and dead readers' pins are reclaimed by
  `_reap_dead` (when room runs short) and by repair.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import xxhash
from xxhash import xxh3_64_intdigest

from . import procs, segment
from .allocator import find_run, run_around
from .disklog import CORRUPT, DiskLog, Found
from .disktier import SPILLING, DiskHit, DiskTier, Spill, check_disk_path, default_disk_entries, key_hash2, open_log
from .errors import (
    BufferTooSmall,
    CannotCreate,
    CortexCacheError,
    IncompatibleVersion,
    KeyNotFound,
    PoolBusy,
    PoolClosed,
    PoolExists,
    PoolFull,
    PoolNotFound,
    SegmentCorrupt,
    ServiceUnavailable,
    UsageError,
    ValueTooLarge,
)
from .eviction import DEFAULT_POLICY, POLICIES, POLICY_IDS, VictimCache, policy_by_id
from .layout import (
    H_ALLOC_HINT, H_BYTES_EVICTED, H_DELETES, H_DIRTY, H_EVICTIONS, H_EXPIRATIONS, H_FREE_SLOT, H_HITS,
    H_LFU_EPOCH, H_LFU_PERIOD, H_MISSES, H_N_ENTRIES, H_OPS, H_PUTS, H_REPAIRS, H_SEQ, H_USED_BLOCKS,
    H_DISK_BYTES_READ, H_DISK_ERRORS, H_DISK_HITS, H_DISK_PROMOTIONS, H_SNAPSHOT_KEEP,
    DISK_O_DIRECT, DISK_ON, DISK_WRITE_THROUGH, REMOTE_CLUSTER, REMOTE_ON,
    P32, P64, P_PID, P_SLOT, P_START,
    FLAG_MULTI_THREADED,
    FLAG_RESERVED,
    FORMAT_VERSION,
    FREE,
    HEADER_DTYPE,
    HEADER_SIZE,
    MAGIC,
    PIN_DTYPE,
    PIN_SIZE,
    SEALED,
    SLOT_COLUMNS,
    VICTIM_COLUMNS,
    CANDIDATES,
    WRITING,
    ZOMBIE,
    Geometry,
)
from .lock import PoolLock, RecordLock, default_timeout as default_lock_timeout
from .units import format_size, parse_size
from .values import as_byte_view, key_bytes

# Values up to this size are copied while holding the lock: two extra lock
# round trips (pin, unpin) would cost more than the copy itself.
COPY_IN_LOCK = 256 * 1024
# Reads copy inside the lock only up to 32 KiB: above that, readers in other
# processes gain more from overlapping their copies than the two extra lock
# round trips cost one of them (64 KiB, two reader processes: 0.8x -> 1.8x
# of one; one reader alone: -17% ops/s; benchmarks/bench_peers.py).
GET_COPY_IN_LOCK = 32 * 1024
# Large values are copied and checksummed in chunks that stay in cache.
_HASH_CHUNK = 256 * 1024
# How long a reader waits for a key whose spill to disk another process is writing (normally
# microseconds to milliseconds); past it the key reads as a miss, since its writer may have died.
SPILL_WAIT = 2.0
# At most this many bytes of spills are copied aside in one lock hold; beyond, they are written in place.
SPILL_ASIDE = 64 << 20
_spill_pause = time.sleep  # the pause between looks (tests replace it to act at that moment)
_MV_FORMAT = {"<u4": "I", "<i4": "i", "<u8": "Q", "<i8": "q", "<f8": "d"}
_ONES = b"\x01" * 256  # block-map filler for runs of up to 256 blocks
SLOT_FLAG_STR_KEY = 1  # the key was given as str: keys() returns it as str
_OPEN_WAIT = 10.0  # seconds to wait for a pool that is still being created

_live_pools: "weakref.WeakSet[Pool]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child shares its parent's open file description, hence its
    # OFD lock: the two would not exclude each other.  Refuse to use it.
    for p in list(_live_pools):
        p._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Fields:
    """Attribute access to the fields of a one-record structured array (views, not copies)."""

    def __init__(self, arr: np.ndarray) -> None:
        for name in arr.dtype.names:
            setattr(self, name, arr[name])


class EntryView:
    """A pinned, read-only view of one entry's value; use as a context manager."""

    def __init__(self, pool: "Pool", pin: int, slot: int, mv: memoryview, checksum: int = 0) -> None:
        self._pool = pool
        self._pin = pin
        self._slot = slot
        self.memoryview: memoryview | None = mv
        self.checksum = checksum  # xxh3_64 of the value taken at put: `verify()` compares against it

    def verify(self) -> bool:
        """Do the bytes still match the checksum taken when they were put?  (One hash pass.)"""
        assert self.memoryview is not None
        return xxh3_64_intdigest(self.memoryview) == self.checksum

    def __enter__(self) -> memoryview:
        assert self.memoryview is not None
        return self.memoryview

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # A view dropped without release() would hold its pin until this
        # process exits; give it back now.
        try:
            self.release()
        except Exception:
            pass

    def release(self) -> None:
        """Release the view and unpin the entry; safe to call twice."""
        mv, self.memoryview = self.memoryview, None
        if mv is None:
            return
        mv.release()
        pool = self._pool
        pool._views.discard(self)
        if not pool._closed:
            pool._locked(pool._unpin, self._pin, self._slot)


class EntryWriter:
    """A reserved, still invisible entry that the caller fills in place (`Pool.reserve_write`).

    `memoryview` is writable and `nbytes` long; `commit()` checksums it and
    makes it the key's value atomically, `abort()` gives the space back.  As a
    context manager it commits on a clean exit and aborts on an exception.
    Until it is committed no reader can see it; if this process dies first,
    the space is reclaimed like any unfinished put.
    """

    def __init__(self, pool: "Pool", slot: int, kb: bytes, kh: int, flags: int, off: int, nbytes: int,
                 ttl: float | None, priority: int) -> None:
        self._pool = pool
        self._slot = slot
        self._args = (kb, kh, flags, ttl, priority)
        self.offset = off  # of the value in the segment
        self.nbytes = nbytes
        self.memoryview: memoryview | None = pool._mv[off : off + nbytes]

    def __enter__(self) -> memoryview:
        assert self.memoryview is not None
        return self.memoryview

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __del__(self) -> None:
        try:
            self.abort()
        except Exception:
            pass

    def commit(self, checksum: int | None = None) -> None:
        """Make the entry visible.  `checksum`: the value's xxh3_64, if the caller already took it."""
        mv, self.memoryview = self.memoryview, None
        if mv is None:
            raise UsageError("this entry writer was already committed or aborted")
        pool = self._pool
        kb, kh, flags, ttl, priority = self._args
        if checksum is None:
            checksum = xxh3_64_intdigest(mv)
        written = None
        t = pool._tier
        try:
            if t is not None and t.write_through:
                written = pool._write_record(kb, flags, mv, pool.clock() + ttl if ttl else 0.0, priority)
            pool._locked(pool._seal, self._slot, kb, kh, checksum, ttl, priority, True, written)
        except BaseException:
            mv.release()
            pool._locked(pool._abort, self._slot)
            raise
        if pool._remote is not None:
            pool._remote.put(kb, mv.tobytes(), flags, ttl)
        mv.release()

    def abort(self) -> None:
        mv, self.memoryview = self.memoryview, None
        if mv is None:
            return
        mv.release()
        if not self._pool._closed:
            self._pool._locked(self._pool._abort, self._slot)


class Pool:
    """A named KV-cache pool in POSIX shared memory.

    Create one with :meth:`create`, attach from any process with :meth:`open`.
    A handle is not inherited across `fork`: open the pool again in the child.
    Unless the pool (or this handle) is multi-threaded, use a handle from one
    thread at a time.
    """

    # ------------------------------------------------------------------ lifecycle

    def __init__(
        self,
        seg: segment.Segment,
        *,
        multi_threaded: bool | None = None,
        clock: Callable[[], float] | None = None,
        lock_timeout: float | None = None,
        _disk_log: DiskLog | None = None,
    ) -> None:
        self._seg = seg
        self._tier: DiskTier | None = None
        self._remote: Any = None  # remote.RemoteTier
        self._close_hooks: list[Callable[[], None]] = []  # run before the mapping goes (gpu.py unpins there)
        self._closed = False
        self._forked = False
        self._views: set[EntryView] = set()
        self.name = seg.name
        mm = seg.mm
        self._mv = memoryview(mm)
        hdr = np.frombuffer(mm, HEADER_DTYPE, 1, 0)
        self._hdr = hdr
        self._h = _Fields(hdr)
        g = Geometry.from_header(hdr)
        self.geometry = g
        self._bs = g.block_size
        self._n_blocks = g.n_blocks
        self._data_off = g.data_off
        self._mask = g.n_buckets - 1
        self._buckets = np.frombuffer(mm, np.int32, g.n_buckets, g.buckets_off)
        self._map = np.frombuffer(mm, np.uint8, g.n_blocks, g.blockmap_off)
        self._pinrec = np.frombuffer(mm, PIN_DTYPE, g.n_pins, g.pins_off)
        # The slot table, by column: numpy arrays for vectorised scans ...
        offs = g.slot_columns()
        s = {name: np.frombuffer(mm, fmt, g.n_slots, offs[name]) for name, fmt in SLOT_COLUMNS}
        self._slots = s
        self._state, self._pins, self._klen = s["state"], s["pins"], s["key_len"]
        self._sflags, self._khash, self._vlen = s["flags"], s["key_hash"], s["value_len"]
        self._first, self._nblk, self._cks = s["first_block"], s["n_blocks"], s["checksum"]
        self._expiry, self._iseq = s["expiry"], s["insert_seq"]
        self._opid, self._ostart = s["owner_pid"], s["owner_start"]
        self._ppid, self._pslot, self._pstart = self._pinrec["pid"], self._pinrec["slot"], self._pinrec["start"]
        self._pin_hint = 0
        self._reserved_slot = -1
        self._spills: list[Spill] = []  # begun under the lock; written and finished after it (_locked)
        self._spill_bytes = 0  # bytes copied aside in `_spills`
        self._n_slots, self._n_pins = g.n_slots, g.n_pins
        # ... and typed memoryviews over the same bytes for the hot paths,
        # where a memoryview item costs ~0.04 us against numpy's ~0.2 us.
        mv = self._mv
        views = {}
        for name, fmt in SLOT_COLUMNS:
            size = np.dtype(fmt).itemsize
            views[name] = mv[offs[name] : offs[name] + g.n_slots * size].cast(_MV_FORMAT[fmt])
        self._c_state, self._c_pins, self._c_klen = views["state"], views["pins"], views["key_len"]
        self._c_flags, self._c_opid, self._c_next = views["flags"], views["owner_pid"], views["next"]
        self._c_khash, self._c_vlen, self._c_first = views["key_hash"], views["value_len"], views["first_block"]
        self._c_nblk, self._c_cks, self._c_created = views["n_blocks"], views["checksum"], views["created"]
        self._c_lastacc, self._c_expiry, self._c_iseq = views["last_access"], views["expiry"], views["insert_seq"]
        self._c_aseq, self._c_acount, self._c_lfuep = views["access_seq"], views["access_count"], views["lfu_epoch"]
        self._c_prio, self._c_ostart = views["priority"], views["owner_start"]
        hdr_mv = mv[:HEADER_SIZE]
        self._hu64, self._hi64, self._hu32 = hdr_mv.cast("Q"), hdr_mv.cast("q"), hdr_mv.cast("I")
        pins_mv = mv[g.pins_off : g.pins_off + g.n_pins * PIN_SIZE]
        self._pu32, self._pi32, self._pu64 = pins_mv.cast("I"), pins_mv.cast("i"), pins_mv.cast("Q")
        self._bkt = mv[g.buckets_off : g.buckets_off + g.n_buckets * 4].cast("i")
        self._bmap = mv[g.blockmap_off : g.blockmap_off + g.n_blocks]
        self._typed_views = [*views.values(), hdr_mv, pins_mv, self._hu64, self._hi64, self._hu32,
                             self._pu32, self._pi32, self._pu64, self._bkt, self._bmap]
        flags = int(self._h.flags[0])
        if multi_threaded is None:
            multi_threaded = bool(flags & FLAG_MULTI_THREADED)
        self.multi_threaded = multi_threaded
        self._lock = PoolLock(seg.fd, multi_threaded)
        self._lock_timeout = lock_timeout if lock_timeout is not None else default_lock_timeout()
        self.clock: Callable[[], float] = clock or time.time
        pol = policy_by_id(int(self._h.policy[0]))
        assert pol is not None  # checked by _validate
        self.policy = pol.name
        vo = g.victim_columns()
        victims = {name: np.frombuffer(mm, fmt, CANDIDATES, vo[name]) for name, fmt in VICTIM_COLUMNS}
        self._hf64 = hdr_mv.cast("d")
        self._typed_views.append(self._hf64)
        self._victims = VictimCache(
            pol, hdr, s, victims, self.clock, (self._hu32, self._hu64, self._hf64), views
        )
        dflags = int(self._h.disk_flags[0])
        if dflags & DISK_ON:
            path = bytes(self._h.disk_path[0]).decode("utf-8", "surrogateescape")
            log, why = (_disk_log, None) if _disk_log is not None else open_log(path, bool(dflags & DISK_O_DIRECT))
            self._tier = DiskTier(mm, mv, (self._hu64, self._hi64), g, dflags, path, log, why, self.clock)
        rflags = int(self._h.remote_flags[0])
        if rflags & REMOTE_ON:
            from .remote import RemoteTier

            url = bytes(self._h.remote_url[0]).decode("utf-8", "replace")
            self._remote = RemoteTier(url, bool(rflags & REMOTE_CLUSTER), self)
        _live_pools.add(self)

    @classmethod
    def create(
        cls,
        name: str,
        size: int | str,
        *,
        block_size: int | str = 64 * 1024,
        policy: str = DEFAULT_POLICY,
        max_entries: int | None = None,
        mode: int = 0o600,
        reserve: bool = True,
        multi_threaded: bool = False,
        lfu_period: int | None = None,
        clock: Callable[[], float] | None = None,
        lock_timeout: float | None = None,
        prefault: bool = True,
        tier: str = "cpu",
        disk_path: str | os.PathLike | None = None,
        disk_size: int | str | None = None,
        disk_write: str = "back",
        disk_o_direct: bool = False,
        disk_max_entries: int | None = None,
        remote: str | None = None,
        remote_cluster: bool = False,
        keep: int | None = None,
        exist_ok: bool = False,
    ) -> "Pool":
        """Create pool `name` whose data region holds `size` bytes and attach to it.

        Raises InvalidName, InvalidSize, UsageError (policy, mode), PoolExists,
        NoSpace (not enough free shared memory, exit 73), PermissionDenied.
        With `reserve` (default) the memory is allocated and pre-faulted now,
        so later writes can never hit SIGBUS on a full /dev/shm; `prefault=False`
        keeps the reservation but skips mapping every page now (restore does,
        since it writes the pages through the file anyway).

        Disk tier: `tier="disk"` or a `disk_path` adds one (disktier.py).
        `disk_path` defaults to `<snapshot dir>/../disk/<name>`, `disk_size` to
        4x `size` (its space is reserved now: NoSpace, exit 73, if the disk
        lacks it); `disk_write` is "back" (entries evicted from memory go to
        disk) or "through" (every put also goes to disk).  A directory that
        already holds a tier is taken over and its entries found again.

        Remote tier: `remote` is a Valkey/Redis URL (redis://, rediss://,
        unix://, with password and database in it; `remote_cluster` for a
        cluster); see remote.py.  redis-py must be installed (the `remote`
        extra): ServiceUnavailable (69) if it is not.

        `keep`: how many snapshots `persist` keeps of this pool (stored with
        it; default 3).  `exist_ok`: a pool of this name that exists is opened
        and returned if it is configured as asked (what the call gives
        explicitly, defaults for the rest of size, block size, policy and
        index); PoolExists naming each difference if not.
        """
        segment.validate_name(name)
        nbytes = parse_size(size)
        bsize = parse_size(block_size)
        if keep is not None and not 1 <= keep < 2**32:
            raise UsageError(f"keep must be at least 1, not {keep}")
        if exist_ok and segment.exists(name):
            return cls._open_as_asked(
                name, nbytes, bsize, policy, max_entries, mode, multi_threaded, keep, tier, disk_path, disk_size,
                disk_write, disk_o_direct, disk_max_entries, remote, remote_cluster, clock, lock_timeout,
            )
        if policy not in POLICIES:
            raise UsageError(f"unknown policy {policy!r}: choose one of {', '.join(POLICY_IDS)}")
        if not isinstance(mode, int) or mode & ~0o777 or not mode & 0o600 == 0o600:
            raise UsageError(f"invalid mode {mode!r}: give permission bits like 0o600 or 0o660, owner rw included")
        geo = Geometry.compute(nbytes, bsize, max_entries)
        if lfu_period is not None and lfu_period < 1:
            raise UsageError("lfu_period must be at least 1")
        if remote is not None:
            from .remote import check_url, redis_missing

            check_url(remote)
            why = redis_missing()
            if why:
                raise ServiceUnavailable(f"pool {name!r} cannot have a remote tier: {why}")
        elif remote_cluster:
            raise UsageError("remote_cluster needs a remote URL")
        if tier not in ("cpu", "disk"):
            raise UsageError(f"unknown tier {tier!r}: choose cpu (shared memory) or disk (shared memory + disk)")
        with_disk = tier == "disk" or disk_path is not None
        if not with_disk and (disk_size is not None or disk_max_entries is not None or disk_o_direct):
            raise UsageError("disk tier options need --tier disk (or a disk path)")
        log = None
        made_tier = False
        dflags = 0
        if with_disk:
            if disk_write not in ("back", "through"):
                raise UsageError(f"unknown disk write mode {disk_write!r}: choose back or through")
            if disk_max_entries is not None and not 1 <= disk_max_entries < 2**31 - 1:
                raise UsageError(f"invalid disk max entries {disk_max_entries}")
            dpath = check_disk_path(disk_path if disk_path is not None else default_disk_path(name))
            dsize = parse_size(disk_size) if disk_size is not None else None
            log, made_tier = _open_or_make_tier(dpath, dsize, 4 * geo.data_size, disk_o_direct, name, mode)
            dflags = DISK_ON | (DISK_WRITE_THROUGH if disk_write == "through" else 0)
            dflags |= DISK_O_DIRECT if disk_o_direct else 0
            n_d = disk_max_entries or default_disk_entries(log.capacity, bsize)
            geo = Geometry.compute(nbytes, bsize, max_entries, disk_entries=n_d)
        try:
            seg = segment.Segment.create(name, geo.segment_size, mode=mode, reserve=reserve, reserve_head=geo.data_off)
        except BaseException as e:
            if log is not None:
                log.close()
                if made_tier:
                    DiskLog.destroy(dpath)
            if exist_ok and isinstance(e, PoolExists):  # another process created it meanwhile
                return cls._open_as_asked(
                    name, nbytes, bsize, policy, max_entries, mode, multi_threaded, keep, tier, disk_path, disk_size,
                    disk_write, disk_o_direct, disk_max_entries, remote, remote_cluster, clock, lock_timeout,
                )
            raise
        init_lock = RecordLock(seg.fd)
        pool = None
        try:
            # Openers that find no magic yet wait on this lock until we are done.
            init_lock.acquire()
            if reserve and prefault:
                seg.prefault()
            cls._initialise(seg, geo, name, policy, mode, reserve, multi_threaded, lfu_period)
            if keep is not None:
                np.frombuffer(seg.mm, HEADER_DTYPE, 1, 0)[0]["snapshot_keep"] = keep
            if remote is not None:
                h = np.frombuffer(seg.mm, HEADER_DTYPE, 1, 0)[0]
                h["remote_flags"] = REMOTE_ON | (REMOTE_CLUSTER if remote_cluster else 0)
                h["remote_url"] = remote.encode()
                del h
            if log is not None:
                h = np.frombuffer(seg.mm, HEADER_DTYPE, 1, 0)[0]
                h["disk_flags"] = dflags
                h["disk_size"] = log.capacity
                h["disk_path"] = dpath.encode("utf-8", "surrogateescape")
                del h
                log.set_owner(segment.shm_path(name))
                # The index is filled before the magic goes in, so no process
                # ever sees the tier half-found.
                pool = cls(seg, multi_threaded=multi_threaded, clock=clock, lock_timeout=lock_timeout,
                           _disk_log=log)
                log = None  # the pool owns it now
                if not made_tier:
                    pool._tier.rebuild_from_scan()  # type: ignore[union-attr]
                np.frombuffer(seg.mm, np.uint8, 8, 0)[:] = np.frombuffer(MAGIC, np.uint8)
                init_lock.release()
                return pool
            init_lock.release()
            return cls(seg, multi_threaded=multi_threaded, clock=clock, lock_timeout=lock_timeout)
        except BaseException:
            if log is not None:
                log.close()
            if pool is not None:
                pool.close()
            else:
                seg.close()
            try:
                segment.unlink(name)
            except PoolNotFound:
                pass
            if made_tier:
                DiskLog.destroy(dpath)
            raise

    @property
    def disk_path(self) -> str | None:
        """Directory of this pool's disk tier, or None without one."""
        return self._tier.path if self._tier is not None else None

    @classmethod
    def _open_as_asked(cls, name, nbytes, bsize, policy, max_entries, mode, multi_threaded, keep, tier, disk_path,
                       disk_size, disk_write, disk_o_direct, disk_max_entries, remote, remote_cluster, clock,
                       lock_timeout) -> "Pool":
        """create(exist_ok=True) of a pool that exists: open it, and check it is what was asked."""
        from .config import require_same

        geo = Geometry.compute(nbytes, bsize, max_entries)
        want: dict[str, Any] = {"size": geo.data_size, "block_size": geo.block_size, "max_entries": geo.n_slots,
                                "policy": policy, "mode": mode, "multi_threaded": multi_threaded}
        if keep is not None:
            want["keep"] = keep
        if tier == "disk" or disk_path is not None:
            d: dict[str, Any] = {"path": check_disk_path(disk_path if disk_path is not None else default_disk_path(name)),
                                 "write": disk_write, "o_direct": disk_o_direct}
            if disk_size is not None:
                from .disklog import DiskLog

                d["size"] = DiskLog.capacity_for(parse_size(disk_size))
            if disk_max_entries is not None:
                d["max_entries"] = disk_max_entries
            want["disk"] = d
        else:
            want["disk"] = None
        want["remote"] = {"url": remote, "cluster": remote_cluster} if remote is not None else None
        pool = cls.open(name, clock=clock, lock_timeout=lock_timeout)
        try:
            require_same(pool, want)
        except BaseException:
            pool.close()
            raise
        return pool

    def configuration(self) -> dict[str, Any]:
        """Everything the pool was created with, as `create` takes it (the remote URL whole).

        Keys: size, block_size, max_entries, policy, mode, multi_threaded,
        reserve, lfu_period, keep (None: the default), disk (None, or path,
        size, write, o_direct, max_entries) and remote (None, or url, cluster).
        `config.redacted()` gives the form to show.
        """
        h = self._hdr[0]
        flags = int(h["flags"])
        dflags, rflags = int(h["disk_flags"]), int(h["remote_flags"])
        disk = None
        if dflags & DISK_ON:
            disk = {
                "path": bytes(h["disk_path"]).decode("utf-8", "surrogateescape"),
                "size": int(h["disk_size"]),
                "write": "through" if dflags & DISK_WRITE_THROUGH else "back",
                "o_direct": bool(dflags & DISK_O_DIRECT),
                "max_entries": int(h["n_dslots"]),
            }
        remote = None
        if rflags & REMOTE_ON:
            remote = {"url": bytes(h["remote_url"]).decode("utf-8", "replace"), "cluster": bool(rflags & REMOTE_CLUSTER)}
        return {
            "size": self.geometry.data_size,
            "block_size": self._bs,
            "max_entries": self._n_slots,
            "policy": self.policy,
            "mode": int(h["mode"]) & 0o777,
            "multi_threaded": bool(flags & FLAG_MULTI_THREADED),
            "reserve": bool(flags & FLAG_RESERVED),
            "lfu_period": int(h["lfu_period"]),
            "keep": self.snapshot_keep,
            "disk": disk,
            "remote": remote,
        }

    def _set_remote(self, url: str, cluster: bool) -> None:
        """Record a remote tier in the header (restore: for handles opened later, not this one)."""
        self._hdr["remote_url"] = url.encode()
        self._hdr["remote_flags"] = REMOTE_ON | (REMOTE_CLUSTER if cluster else 0)

    @property
    def snapshot_keep(self) -> int | None:
        """How many snapshots `persist` keeps of this pool; None: the default (3)."""
        return int(self._hu32[H_SNAPSHOT_KEEP]) or None

    def set_snapshot_keep(self, keep: int) -> None:
        """Store how many snapshots `persist` keeps of this pool (for every later persist, from any process)."""
        if not 1 <= keep < 2**32:
            raise UsageError(f"keep must be at least 1, not {keep}")
        self._hu32[H_SNAPSHOT_KEEP] = keep

    @staticmethod
    def _initialise(seg, geo, name, policy, mode, reserve, multi_threaded, lfu_period) -> None:
        mm = seg.mm
        hdr = np.frombuffer(mm, HEADER_DTYPE, 1, 0)
        h = hdr[0]
        h["version"] = FORMAT_VERSION
        h["header_size"] = HEADER_SIZE
        for f in ("segment_size", "block_size", "n_blocks", "n_slots", "n_buckets", "n_pins",
                  "slots_off", "buckets_off", "blockmap_off", "pins_off", "victims_off", "data_off",
                  "n_dslots", "n_dbuckets", "dslots_off", "dbuckets_off"):
            h[f] = getattr(geo, f)
        h["policy"] = POLICY_IDS.index(policy)
        h["flags"] = (FLAG_MULTI_THREADED if multi_threaded else 0) | (FLAG_RESERVED if reserve else 0)
        h["created"] = time.time()
        h["mode"] = mode
        h["name"] = name.encode()
        h["lfu_period"] = lfu_period or max(1024, geo.n_slots)
        h["cand_next_expiry"] = np.inf
        nxt = np.frombuffer(mm, np.int32, geo.n_slots, geo.slot_columns()["next"])
        nxt[:-1] = np.arange(1, geo.n_slots, dtype=np.int32)
        nxt[-1] = -1
        h["free_slot"] = 0
        np.frombuffer(mm, np.int32, geo.n_buckets, geo.buckets_off)[:] = -1
        del nxt
        if geo.n_dslots:
            DiskTier.initialise(mm, geo)
            h["dfree_slot"] = 0
            del h, hdr
            return  # create() writes the magic once the disk index is filled
        h["magic"] = MAGIC  # last: the pool is now complete
        del h, hdr

    @classmethod
    def open(
        cls,
        name: str,
        *,
        multi_threaded: bool | None = None,
        clock: Callable[[], float] | None = None,
        lock_timeout: float | None = None,
    ) -> "Pool":
        """Attach to existing pool `name`.

        Raises PoolNotFound (exit 66), PermissionDenied (77), SegmentCorrupt or
        IncompatibleVersion (65) for a segment that is not a usable pool.
        `multi_threaded=None` uses the pool's default chosen at create.
        `lock_timeout`: seconds an operation waits for the pool's lock before
        LockTimeout (75); default CORTEX_CACHE_LOCK_TIMEOUT, else 30 s.
        """
        seg = _open_complete_segment(name)
        try:
            _validate(seg)
            return cls(seg, multi_threaded=multi_threaded, clock=clock, lock_timeout=lock_timeout)
        except BaseException:
            seg.close()
            raise

    @staticmethod
    def unlink(name: str) -> None:
        """Destroy pool `name` (processes still attached keep their mapping until they close)."""
        segment.unlink(name)

    @staticmethod
    def exists(name: str) -> bool:
        return segment.exists(name)

    @staticmethod
    def list() -> list[str]:
        """Names of the segments under the current prefix (each may still fail to open)."""
        return segment.list_names()

    def close(self) -> None:
        """Unmap this handle; the pool itself lives on.  Safe to call twice."""
        if self._closed:
            return
        if self._remote is not None and not self._forked:
            remote, self._remote = self._remote, None
            remote.close()  # lets queued writes finish (a few seconds at most)
        for v in list(self._views):
            v.release()
        for hook in reversed(self._close_hooks):
            try:
                hook()
            except Exception:
                pass
        self._close_hooks = []
        self._closed = True
        _live_pools.discard(self)
        if self._tier is not None:
            self._tier.close()
            self._tier = None
        # Drop every numpy array over the mapping, or munmap would be refused.
        self._victims = None  # type: ignore[assignment]
        self._slots = None  # type: ignore[assignment]
        for attr in [a for a, v in vars(self).items() if isinstance(v, np.ndarray)]:
            setattr(self, attr, None)
        self._h = None  # type: ignore[assignment]
        for v in reversed(self._typed_views):
            v.release()
        self._typed_views = []
        self._mv.release()
        try:
            self._seg.close()
        except BufferError:
            # A buffer exported from the mapping is still alive somewhere
            # (a numpy array made from a view): the mapping goes when it does.
            os.close(self._seg.fd)
            self._seg.fd = -1

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self._closed:
            return f"Pool({self.name!r}, closed)"
        return f"Pool({self.name!r}, size={format_size(self.geometry.data_size)}, entries={self._hu64[H_N_ENTRIES]})"

    # ------------------------------------------------------------------ locking

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` holding the pool lock, with the dirty mark set."""
        if self._closed:
            raise PoolClosed(f"pool {self.name!r} is closed")
        if self._forked:
            raise UsageError(f"pool {self.name!r} was opened before fork(): open it again in this process")
        lock = self._lock
        lock.acquire(self._lock_timeout)
        hu32 = self._hu32
        try:
            if hu32[H_DIRTY]:
                self._repair()
            hu32[H_DIRTY] = 1
            result = fn(*args)
        except SegmentCorrupt:
            self._release(lock, clean=False)  # damage was seen: the dirty mark stays, so the next holder repairs
            raise
        except CortexCacheError:
            self._release(lock, clean=True)  # expected errors leave the metadata consistent
            raise
        except (IndexError, ValueError, OverflowError, ZeroDivisionError) as e:
            # Only damaged metadata gets here (an index out of range, a counter
            # at its limit): a clean error now, and a repair by the next holder.
            self._release(lock, clean=False)
            raise SegmentCorrupt(
                f"pool {self.name!r} has damaged metadata ({type(e).__name__}: {e}); "
                "it is repaired on its next use, or with `cortex cache verify --repair`"
            ) from e
        except BaseException:
            # Anything else may have stopped a change half-way: leave the
            # dirty mark so the next holder repairs.
            self._release(lock, clean=False)
            raise
        self._release(lock, clean=True)
        return result

    def _release(self, lock: Any, clean: bool) -> None:
        """Let the pool lock go (`clean`: clearing the dirty mark); then write the spills begun meanwhile."""
        spills = self._spills
        if spills:
            self._spills = []
            self._spill_bytes = 0
        if clean:
            self._hu32[H_DIRTY] = 0
        lock.release()
        if spills:
            self._write_spills(spills)

    def _write_spills(self, spills: list[Spill]) -> None:
        """Write the records of spills begun under the lock, without it; then finish them under it.

        The victims' bytes were copied aside, so the lock is free while the disk works: other
        processes go on, and a reader of a key being spilled waits for it (`_settled`)."""
        t = self._tier
        assert t is not None
        written = [t.write_spill(sp) for sp in spills]

        def finish() -> None:
            for sp, ok in zip(spills, written):
                t.finish_spill(sp, ok)

        try:
            self._locked(finish)
        except Exception:  # noqa: BLE001
            # The caller's own operation is done; this is the tier's business.  Entries left
            # PENDING read as misses once this process is gone, or go when their key is written.
            pass

    def _settled(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`self._locked(fn, *args)` for a lookup, asked again while the answer is SPILLING (a record
        being written by another process or thread); a miss after SPILL_WAIT seconds (its writer
        may have died)."""
        r = self._locked(fn, *args)
        if r is not SPILLING:
            return r
        deadline = time.monotonic() + SPILL_WAIT
        delay = 20e-6
        while r is SPILLING:
            if time.monotonic() > deadline:
                return None
            _spill_pause(delay)
            delay = min(delay * 2, 1e-3)
            r = self._locked(fn, *args)
        return r

    # ------------------------------------------------------------------ put

    def put(self, key: str | bytes, value: Any, *, ttl: float | None = None, priority: int = 0) -> None:
        """Store `value` under `key`, replacing any previous value atomically.

        `value`: bytes-like, contiguous numpy array or torch CPU tensor.
        `ttl`: seconds until the entry expires (never returned after that).
        Evicts by the pool's policy when full.  Raises ValueTooLarge when the
        value (plus key) exceeds the pool, PoolFull when eviction cannot make
        room (everything else pinned or being written).
        """
        kb, is_str = key_bytes(key)
        vb = as_byte_view(value)
        if ttl is not None and not ttl > 0:
            raise UsageError(f"ttl must be a positive number of seconds, not {ttl!r}")
        if priority.__class__ is not int and not isinstance(priority, (int, np.integer)) or not (
            -(2**63) <= priority < 2**63
        ):
            raise UsageError(f"priority must be a 64-bit integer, not {priority!r}")
        vlen, klen = vb.nbytes, len(kb)
        nblk = max(1, -(-(vlen + klen) // self._bs))
        if nblk > self._n_blocks:
            raise ValueTooLarge(
                f"value of {format_size(vlen)} does not fit in pool {self.name!r} "
                f"({format_size(self.geometry.data_size)})"
            )
        kh = xxh3_64_intdigest(kb)
        flags = SLOT_FLAG_STR_KEY if is_str else 0
        self._put_local(kb, kh, flags, vb, nblk, ttl, int(priority))
        if self._remote is not None:  # queued; the caller never waits on the network
            self._remote.put(kb, value if value.__class__ is bytes else vb, flags, ttl)

    def _put_local(self, kb, kh, flags, vb, nblk, ttl, priority, checksum: int | None = None) -> None:
        """Store in memory (and, write-through, on disk); `checksum`: the value's xxh3_64 if already known."""
        vlen, klen = vb.nbytes, len(kb)
        t = self._tier
        if t is not None and t.write_through:
            self._put_through(kb, kh, flags, vb, nblk, ttl, int(priority))
            return
        if vlen <= COPY_IN_LOCK:
            if checksum is None:
                checksum = xxh3_64_intdigest(vb)
            self._locked(self._put_small, kb, kh, flags, vb, nblk, checksum, ttl, int(priority))
            return
        i, off = self._locked(self._reserve_entry, kb, flags, vlen, nblk, kh)
        try:
            mv = self._mv
            if checksum is not None:
                mv[off : off + vlen] = vb
            else:
                hasher = xxhash.xxh3_64()
                for c in range(0, vlen, _HASH_CHUNK):
                    chunk = vb[c : c + _HASH_CHUNK]
                    mv[off + c : off + c + len(chunk)] = chunk
                    hasher.update(chunk)
                checksum = hasher.intdigest()
            mv[off + vlen : off + vlen + klen] = kb
        except BaseException:
            self._locked(self._abort, i)
            raise
        self._locked(self._seal, i, kb, kh, checksum, ttl, int(priority))

    def _put_through(self, kb, kh, flags, vb, nblk, ttl, priority) -> None:
        """A write-through put: the record goes to disk first (outside the lock), then memory and index."""
        t = self._tier
        assert t is not None
        vlen = vb.nbytes
        written = self._write_record(kb, flags, vb, self.clock() + ttl if ttl else 0.0, priority)
        try:
            checksum = xxh3_64_intdigest(vb)
            if vlen <= COPY_IN_LOCK:
                self._locked(self._put_small, kb, kh, flags, vb, nblk, checksum, ttl, priority, None, 0, written)
                return
            i, off = self._locked(self._reserve_entry, kb, flags, vlen, nblk, kh)
            try:
                self._mv[off : off + vlen] = vb
                self._mv[off + vlen : off + vlen + len(kb)] = kb
            except BaseException:
                self._locked(self._abort, i)
                raise
            self._locked(self._seal, i, kb, kh, checksum, ttl, priority, True, written)
        except CortexCacheError:
            if written is not None:  # the put failed: its record must not come back after a restart
                t.log.kill(written[0])  # type: ignore[union-attr]
            raise

    def _write_record(self, kb: bytes, flags: int, value: memoryview, expiry: float, priority: int) -> Any:
        """Write-through: put a record on disk (outside the lock); what `_seal` indexes, or None."""
        t = self._tier
        assert t is not None
        where = self._locked(t.reserve, DiskLog.record_length(len(kb), value.nbytes))
        if where is None:
            return None
        try:
            loc = t.log.write(*where, kb, value, expiry, priority, flags)  # type: ignore[union-attr]
        except OSError:
            self._locked(t.count, H_DISK_ERRORS)
            return None
        return (loc, key_hash2(kb), value.nbytes, expiry, priority, flags)

    def reserve_write(
        self, key: str | bytes, nbytes: int, *, ttl: float | None = None, priority: int = 0
    ) -> EntryWriter:
        """Reserve room for an `nbytes` value of `key` and return a writer to fill it in place.

        The zero-copy put: copy straight into `writer.memoryview` (a device-to-host
        copy into the pool, say), then `commit()`.  Same errors as `put`.
        """
        kb, is_str = key_bytes(key)
        if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise UsageError(f"nbytes must be a non-negative integer, not {nbytes!r}")
        if ttl is not None and not ttl > 0:
            raise UsageError(f"ttl must be a positive number of seconds, not {ttl!r}")
        if not isinstance(priority, (int, np.integer)) or not -(2**63) <= priority < 2**63:
            raise UsageError(f"priority must be a 64-bit integer, not {priority!r}")
        nbytes = int(nbytes)
        nblk = max(1, -(-(nbytes + len(kb)) // self._bs))
        if nblk > self._n_blocks:
            raise ValueTooLarge(
                f"value of {format_size(nbytes)} does not fit in pool {self.name!r} "
                f"({format_size(self.geometry.data_size)})"
            )
        kh = xxh3_64_intdigest(kb)
        flags = SLOT_FLAG_STR_KEY if is_str else 0
        i, off = self._locked(self._reserve_entry, kb, flags, nbytes, nblk, kh)
        self._mv[off + nbytes : off + nbytes + len(kb)] = kb
        return EntryWriter(self, i, kb, kh, flags, off, nbytes, ttl, int(priority))

    def _data_region(self) -> tuple[int, int]:
        """(address, length) of the data region in this process's mapping (for cudaHostRegister)."""
        a = np.frombuffer(self._seg.mm, np.uint8, 1, self._data_off)
        addr = a.ctypes.data
        del a
        return addr, self.geometry.data_size

    def _reserve_entry(self, kb: bytes, flags: int, vlen: int, nblk: int, kh: int) -> tuple[int, int]:
        """`_reserve` for callers outside the lock: (slot, data offset)."""
        off = self._reserve(kb, flags, vlen, nblk, kh)
        return self._reserved_slot, off

    def _put_small(self, kb, kh, flags, vb, nblk, checksum, ttl, priority, rec=None, base=0, disk=None) -> None:
        """Store a small value in one lock hold (`rec`: a snapshot record being restored)."""
        # Replacing a key: free the old value first, so a full pool reuses its
        # blocks instead of evicting an unrelated entry.  (Readers holding a
        # pin keep the old bytes; if the new value then cannot be placed,
        # PoolFull leaves the key absent.)
        old = self._find(kb, kh)
        if old >= 0:
            self._remove(old)
        off = self._reserve(kb, flags, vb.nbytes, nblk, kh)
        vlen = vb.nbytes
        mv = self._mv
        mv[off : off + vlen] = vb
        mv[off + vlen : off + vlen + len(kb)] = kb
        if rec is None:
            self._seal(self._reserved_slot, kb, kh, checksum, ttl, priority, False, disk)
        else:
            self._seal_restored(self._reserved_slot, rec, kh, base, replace=False)

    def _reserve(self, kb: bytes, flags: int, vlen: int, nblk: int, kh: int) -> int:
        """Take a slot and a run of blocks for a new entry (state WRITING).

        Returns the data offset; the slot is left in `self._reserved_slot`.
        """
        i = self._alloc_slot()
        try:
            first = self._alloc_blocks(nblk)
        except BaseException:
            self._free_slot(i)
            raise
        pid, start = procs.me()
        self._c_klen[i] = len(kb)
        self._c_flags[i] = flags
        self._c_pins[i] = 0
        self._c_opid[i] = pid
        self._c_khash[i] = kh
        self._c_vlen[i] = vlen
        self._c_first[i] = first
        self._c_nblk[i] = nblk
        self._c_ostart[i] = start
        self._c_state[i] = WRITING
        self._reserved_slot = i
        return self._data_off + first * self._bs

    def _seal(
        self, i: int, kb: bytes, kh: int, checksum: int, ttl: float | None, priority: int, replace: bool = True,
        disk: Any = None, expiry: float | None = None,
    ) -> None:
        """Make WRITING slot `i` the visible entry for its key, replacing any old one
        (`replace=False`: the caller already removed it under this same lock hold).

        With a disk tier: `disk` is the record a write-through put wrote (indexed
        now), a DiskHit for a promotion, or None (any disk copy of the key is
        stale now and is removed).  `expiry` overrides `ttl` with an absolute time.
        """
        hu64 = self._hu64
        now = self.clock()
        old = self._find(kb, kh) if replace else -1
        if old >= 0:
            self._remove(old)
        t = self._tier
        if t is not None:
            self._seal_disk(t, kb, kh, disk)
        if expiry is not None:
            ttl = None
        seq = hu64[H_SEQ] + 1
        hu64[H_SEQ] = seq
        self._c_cks[i] = checksum
        self._c_created[i] = now
        self._c_lastacc[i] = now
        self._c_expiry[i] = now + ttl if ttl else (expiry or 0.0)
        self._c_iseq[i] = seq
        self._c_aseq[i] = seq
        self._c_acount[i] = 1
        self._c_lfuep[i] = self._tick()
        self._c_prio[i] = priority
        self._c_ostart[i] = 0
        self._c_opid[i] = 0
        b = kh & self._mask
        bkt = self._bkt
        self._c_next[i] = bkt[b]
        bkt[b] = i
        self._c_state[i] = SEALED
        hu64[H_N_ENTRIES] += 1
        hu64[H_PUTS] += 1
        v = self._victims
        if not v.policy.monotone:
            v.on_score_change(i)
        if ttl:
            v.on_expiry_set(now + ttl)
        elif expiry:
            v.on_expiry_set(expiry)

    def _seal_disk(self, t: DiskTier, kb: bytes, kh: int, disk: Any) -> None:
        if disk is None:
            t.forget(kb, kh)
        elif disk.__class__ is DiskHit:
            t.count(H_DISK_PROMOTIONS)
            if not t.write_through and t.still(disk):
                t.kill_slot(disk.slot)  # exclusive tiers: the entry lives in memory now
        else:
            loc, kh2, vlen, expiry, priority, flags = disk
            t.note_written(kh, kh2, len(kb), flags, loc, vlen, expiry, priority)

    def _abort(self, i: int) -> None:
        if self._c_state[i] == WRITING:
            self._free_blocks(i)
            self._free_slot(i)

    def _tick(self) -> int:
        """Count one put or hit; return the LFU epoch after it."""
        hu64 = self._hu64
        ops = hu64[H_OPS] + 1
        hu64[H_OPS] = ops
        if ops % hu64[H_LFU_PERIOD] == 0:
            hu64[H_LFU_EPOCH] += 1
        return hu64[H_LFU_EPOCH]

    # ------------------------------------------------------------------ allocation

    def _alloc_slot(self) -> int:
        hi64 = self._hi64
        i = hi64[H_FREE_SLOT]
        while i < 0:
            if not self._evict_one():
                raise PoolFull(
                    f"pool {self.name!r} has no free entry slot ({self.geometry.n_slots} max entries) "
                    "and nothing can be evicted"
                )
            i = hi64[H_FREE_SLOT]
        hi64[H_FREE_SLOT] = self._c_next[i]
        self._c_next[i] = -1
        return i

    def _free_slot(self, i: int) -> None:
        self._c_state[i] = FREE
        self._c_pins[i] = 0
        # Forget who it was: a damaged state word must not bring a deleted entry back.
        self._c_khash[i] = 0
        self._c_cks[i] = 0
        hi64 = self._hi64
        self._c_next[i] = hi64[H_FREE_SLOT]
        hi64[H_FREE_SLOT] = i

    def _alloc_blocks(self, k: int) -> int:
        hu64 = self._hu64
        hint = hu64[H_ALLOC_HINT]
        bmap = self._bmap
        # Fast path: the run at the cursor is free (empty pool, or the blocks
        # an eviction or delete just freed).  Else a vectorised scan.
        if hint + k <= self._n_blocks and bmap[hint : hint + k] == bytes(k):
            first = hint
        else:
            # A full pool (the steady state of a cache) cannot have a run:
            # skip the scan and go straight to eviction.
            first = find_run(self._map, k, hint) if hu64[H_USED_BLOCKS] + k <= self._n_blocks else -1
            while first < 0:
                victim = self._evict_one(want_blocks=k)
                if victim is None:
                    raise PoolFull(
                        f"pool {self.name!r} is full: no run of {k} free blocks, "
                        "and every entry is pinned, being written, or already evicted"
                    )
                first = victim
        bmap[first : first + k] = _ONES[:k] if k <= len(_ONES) else b"\x01" * k
        hu64[H_USED_BLOCKS] += k
        nxt = first + k
        hu64[H_ALLOC_HINT] = nxt if nxt < self._n_blocks else 0
        return first

    def _free_blocks(self, i: int) -> None:
        first, n = self._c_first[i], self._c_nblk[i]
        self._bmap[first : first + n] = bytes(n)
        self._hu64[H_USED_BLOCKS] -= n
        # Reuse freed blocks first: they are likely still in the CPU cache.
        self._hu64[H_ALLOC_HINT] = first

    def _evict_one(self, want_blocks: int = 0) -> Any:
        """Evict one victim by policy (expired entries first).

        With `want_blocks`, return the start of a free run of that many blocks
        that the eviction opened (or -1 when it opened none yet), and None when
        nothing can be evicted.  Without, return True/False.
        """
        i, expired = self._victims.next_victim()
        if i < 0:
            if not self._reap_dead():
                return None if want_blocks else False
            if want_blocks:
                return find_run(self._map, want_blocks, 0)
            return self._hi64[H_FREE_SLOT] >= 0
        first, n = self._c_first[i], self._c_nblk[i]
        self._count_eviction(i, expired)
        if self._tier is not None and not expired:
            self._spill(i)
        self._remove(i)
        if want_blocks:
            # The victim's own run is enough when it is as long (the common
            # case of equal-sized KV chunks); else look at its neighbours.
            return first if n >= want_blocks else run_around(self._map, first, n, want_blocks)
        return True

    def _spill(self, i: int) -> None:
        """Begin spilling sealed entry `i`, about to leave memory (lock held): its bytes are copied
        aside and its disk entry made PENDING here; `_locked` writes it after letting the lock go."""
        vlen, klen = self._c_vlen[i], self._c_klen[i]
        off = self._data_off + self._c_first[i] * self._bs
        mv = self._mv
        kb = mv[off + vlen : off + vlen + klen].tobytes()
        args = (kb, self._c_khash[i], self._c_flags[i] & SLOT_FLAG_STR_KEY, mv[off : off + vlen],
                self._c_expiry[i], self._c_prio[i], int(self._c_cks[i]))
        if self._spill_bytes + vlen > SPILL_ASIDE:
            # One lock hold evicting a lot (evict --all of a big pool): write in place instead of
            # holding copies of it all.
            self._tier.spill_now(*args)  # type: ignore[union-attr]
            return
        sp = self._tier.begin_spill(*args)  # type: ignore[union-attr]
        if sp is not None:
            self._spills.append(sp)
            self._spill_bytes += vlen

    def _count_eviction(self, i: int, expired: bool) -> None:
        hu64 = self._hu64
        if expired:
            hu64[H_EXPIRATIONS] += 1
        else:
            hu64[H_EVICTIONS] += 1
            hu64[H_BYTES_EVICTED] += self._c_vlen[i]

    # ------------------------------------------------------------------ lookup and removal

    def _find(self, kb: bytes, kh: int) -> int:
        """Slot of the sealed entry for key `kb`, or -1."""
        i = self._bkt[kh & self._mask]
        klen = len(kb)
        steps = 0
        while i >= 0:
            if self._c_khash[i] == kh and self._c_klen[i] == klen:
                off = self._data_off + self._c_first[i] * self._bs + self._c_vlen[i]
                if self._mv[off : off + klen] == kb:
                    return i
            i = self._c_next[i]
            steps += 1
            if steps > self._n_slots:
                raise SegmentCorrupt(f"pool {self.name!r}: hash chain loop; run `cortex cache verify --repair`")
        return -1

    def _unchain(self, i: int) -> None:
        b = self._c_khash[i] & self._mask
        bkt = self._bkt
        j = bkt[b]
        if j == i:
            bkt[b] = self._c_next[i]
            return
        while j >= 0:
            nj = self._c_next[j]
            if nj == i:
                self._c_next[j] = self._c_next[i]
                return
            j = nj

    def _remove(self, i: int) -> None:
        """Take sealed entry `i` out of the index; free it now, or at its last unpin."""
        self._unchain(i)
        self._hu64[H_N_ENTRIES] -= 1
        if self._c_pins[i]:
            self._c_state[i] = ZOMBIE
        else:
            self._free_blocks(i)
            self._free_slot(i)

    def _expired(self, i: int) -> bool:
        e = self._c_expiry[i]
        return e > 0 and e <= self.clock()

    def _touch(self, i: int) -> None:
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
        v = self._victims
        if not v.policy.monotone:
            v.on_score_change(i)

    def _lookup_live(self, kb: bytes, kh: int) -> int:
        """Find a live entry, counting the miss (and expiring it) when there is none."""
        i = self._find(kb, kh)
        if i >= 0 and self._expired(i):
            self._hu64[H_EXPIRATIONS] += 1
            self._remove(i)
            i = -1
        if i < 0:
            self._hu64[H_MISSES] += 1
        return i

    # ------------------------------------------------------------------ pins

    def _pin(self, i: int) -> int:
        pu32 = self._pu32
        j = self._pin_hint
        if pu32[j * P32 + P_PID] != 0:
            free = np.flatnonzero(self._ppid == 0)
            if free.size == 0 and self._reap_dead():
                free = np.flatnonzero(self._ppid == 0)
            if free.size == 0:
                raise PoolBusy(
                    f"pool {self.name!r}: all {self._n_pins} pin records are in use "
                    "(too many concurrent large reads or open views)"
                )
            j = int(free[0])
        pid, start = procs.me()
        self._pi32[j * P32 + P_SLOT] = i
        self._pu64[j * P64 + P_START] = start
        pu32[j * P32 + P_PID] = pid
        self._c_pins[i] += 1
        self._pin_hint = (j + 1) % self._n_pins
        return j

    def _unpin(self, j: int, i: int) -> None:
        pu32, pi32 = self._pu32, self._pi32
        if pu32[j * P32 + P_PID] != procs.me()[0] or pi32[j * P32 + P_SLOT] != i:
            return  # already reclaimed by a repair (should not happen while we live)
        pu32[j * P32 + P_PID] = 0
        pi32[j * P32 + P_SLOT] = -1
        pins = self._c_pins[i]
        if pins > 0:
            pins -= 1
            self._c_pins[i] = pins
        if pins == 0:
            if self._c_state[i] == ZOMBIE:
                self._free_blocks(i)
                self._free_slot(i)
            elif self._c_state[i] == SEALED:
                self._victims.on_unpin(i)

    # ------------------------------------------------------------------ get

    def _get_locked(self, kb: bytes, kh: int, out: memoryview | None) -> Any:
        i = self._lookup_live(kb, kh)
        if i < 0:
            t = self._tier
            return None if t is None else t.lookup(kb, kh)
        vlen = self._c_vlen[i]
        if out is not None and out.nbytes < vlen:
            raise BufferTooSmall(f"buffer of {out.nbytes} bytes is too small for a value of {vlen} bytes")
        self._touch(i)
        off = self._data_off + self._c_first[i] * self._bs
        if vlen <= GET_COPY_IN_LOCK:
            if out is None:
                return self._mv[off : off + vlen].tobytes()
            out[:vlen] = self._mv[off : off + vlen]
            return vlen
        return (self._pin(i), i, off, vlen)

    def get(self, key: str | bytes, default: Any = None) -> bytes | Any:
        """The value stored under `key` as bytes, or `default` if absent or expired."""
        kb, _ = key_bytes(key)
        kh = xxh3_64_intdigest(kb)
        r = self._settled(self._get_locked, kb, kh, None)
        if r.__class__ is bytes:
            return r
        if r is None or r.__class__ is DiskHit:
            value = None if r is None else self._from_disk(kb, kh, r)
            if value is None and self._remote is not None:
                value = self._from_remote(kb, kh)
            return default if value is None else value
        j, i, off, vlen = r
        try:
            return self._mv[off : off + vlen].tobytes()
        finally:
            self._locked(self._unpin, j, i)

    def peek(self, key: str | bytes, default: Any = None) -> bytes | Any:
        """The value under `key` in memory, read without disturbing the pool.

        Unlike `get`, counts no hit or miss, leaves the entry's place in the
        eviction order (access time and count) as it was, expires nothing and
        does not look in, or promote from, the tiers below memory.
        """
        kb, _ = key_bytes(key)
        kh = xxh3_64_intdigest(kb)

        def find() -> Any:
            i = self._find(kb, kh)
            if i < 0 or self._expired(i):
                return None
            return self._pin(i), i, self._data_off + self._c_first[i] * self._bs, self._c_vlen[i]

        r = self._locked(find)
        if r is None:
            return default
        j, i, off, vlen = r
        try:
            return self._mv[off : off + vlen].tobytes()
        finally:
            self._locked(self._unpin, j, i)

    def get_into(self, key: str | bytes, out: Any) -> int | None:
        """Copy the value of `key` into the writable buffer `out`; return its length, or None if absent.

        Raises BufferTooSmall if `out` is smaller than the value.
        """
        kb, _ = key_bytes(key)
        try:
            omv = memoryview(out)
        except TypeError:
            raise UsageError("get_into needs a writable buffer (bytearray, numpy array, ...)") from None
        if omv.readonly:
            raise UsageError("get_into needs a writable buffer, not a read-only one")
        if omv.format != "B" or omv.ndim != 1:
            if not omv.c_contiguous:
                raise UsageError("get_into needs a contiguous buffer")
            omv = omv.cast("B")
        kh = xxh3_64_intdigest(kb)
        r = self._settled(self._get_locked, kb, kh, omv)
        if r.__class__ is int:
            return r
        if r is None or r.__class__ is DiskHit:
            if r is not None and omv.nbytes < r.value_len:
                raise BufferTooSmall(
                    f"buffer of {omv.nbytes} bytes is too small for a value of {r.value_len} bytes"
                )
            value = None if r is None else self._from_disk(kb, kh, r)
            if value is None and self._remote is not None:
                value = self._from_remote(kb, kh, omv.nbytes)
            if value is None:
                return None
            omv[: len(value)] = value
            return len(value)
        j, i, off, vlen = r
        try:
            omv[:vlen] = self._mv[off : off + vlen]
        finally:
            self._locked(self._unpin, j, i)
        return vlen

    def _view_locked(self, kb: bytes, kh: int, count_miss: bool = True) -> Any:
        if count_miss:
            i = self._lookup_live(kb, kh)
        else:
            i = self._find(kb, kh)
            i = -1 if i >= 0 and self._expired(i) else i
        if i < 0:
            t = self._tier
            return None if t is None or not count_miss else t.lookup(kb, kh)
        self._touch(i)
        return self._pin(i), i, self._data_off + self._c_first[i] * self._bs, self._c_vlen[i]

    def view(self, key: str | bytes) -> EntryView:
        """A zero-copy, read-only view of `key`'s value, pinned until released.

        Use as `with pool.view(key) as mv: ...`.  Raises KeyNotFound.
        """
        kb, _ = key_bytes(key)
        kh = xxh3_64_intdigest(kb)
        r = self._settled(self._view_locked, kb, kh)
        if r is None and self._remote is not None:
            r = None if self._from_remote(kb, kh) is None else self._locked(self._view_locked, kb, kh, False)
        elif r.__class__ is DiskHit:
            # A view maps memory: bring the entry in from disk first.
            r = None if self._from_disk(kb, kh, r) is None else self._locked(self._view_locked, kb, kh, False)
            if r is None and kb in self:
                raise PoolFull(f"pool {self.name!r}: {_show_key(key)} is on disk and could not be brought "
                               "into memory to view (the pool is full of pinned entries)")
        if r is None:
            raise KeyNotFound(f"no key {_show_key(key)} in pool {self.name!r}")
        j, i, off, vlen = r
        # The entry is pinned: its slot (and checksum) cannot change under us.
        ev = EntryView(self, j, i, self._mv[off : off + vlen].toreadonly(), self._c_cks[i])
        self._views.add(ev)
        return ev

    # ------------------------------------------------------------------ remote tier reads

    def _from_remote(self, kb: bytes, kh: int, room: int | None = None) -> bytes | None:
        """Look a miss of memory and disk up on the server; promote what comes back; its bytes."""
        got = self._remote.get(kb)
        if got is None:
            return None
        value, flags, checksum = got
        if room is not None and value.nbytes > room:
            raise BufferTooSmall(f"buffer of {room} bytes is too small for a value of {value.nbytes} bytes")
        nblk = max(1, -(-(value.nbytes + len(kb)) // self._bs))
        promoted = 0
        if nblk <= self._n_blocks:
            try:
                # The record's checksum is the pool's (xxh3_64 of the value), already verified.
                self._put_local(kb, kh, flags & SLOT_FLAG_STR_KEY, value, nblk, None, 0, checksum)
                promoted = 1
            except (PoolFull, ValueTooLarge):
                pass  # served from the server this once; memory is full of pinned entries
        self._remote.count_hit(value.nbytes, promoted)
        return value.tobytes()

    def flush_remote(self, timeout: float | None = None) -> bool:
        """Wait until this handle's queued remote writes were sent; False on timeout (True without a remote)."""
        return True if self._remote is None else self._remote.flush(timeout)

    # ------------------------------------------------------------------ disk tier reads

    def _from_disk(self, kb: bytes, kh: int, hit: DiskHit) -> bytes | None:
        """Read a memory miss from the disk tier (outside the lock), promote it, return its value."""
        t = self._tier
        assert t is not None
        for _ in range(4):  # the index can move on while we read; then look again
            log = t.log
            if log is None:
                self._locked(t.count, H_DISK_ERRORS)
                return None
            try:
                found = log.read(hit.loc, kb)
            except OSError:
                self._locked(t.count, H_DISK_ERRORS)
                return None
            if found.__class__ is Found and len(found.value) == hit.value_len:  # type: ignore[union-attr]
                self._promote(kb, kh, hit, found)  # type: ignore[arg-type]
                return found.value  # type: ignore[union-attr]
            bad = found == CORRUPT or found.__class__ is Found
            hit = self._locked(t.after_failed_read, kb, kh, hit, bad)
            if hit is None:
                return None
        return None

    def _promote(self, kb: bytes, kh: int, hit: DiskHit, found: Found) -> None:
        """Copy a value read from disk back into memory (if it is still the current one)."""
        vlen = len(found.value)
        nblk = max(1, -(-(vlen + len(kb)) // self._bs))
        if vlen <= COPY_IN_LOCK or nblk > self._n_blocks:
            self._locked(self._promote_locked, kb, kh, hit, found, nblk, True)
            return
        r = self._locked(self._promote_locked, kb, kh, hit, found, nblk, False)
        if r is None:
            return
        i, off = r
        try:
            self._mv[off : off + vlen] = found.value
            self._mv[off + vlen : off + vlen + len(kb)] = kb
        except BaseException:
            self._locked(self._abort, i)
            raise
        self._locked(self._promote_seal, i, kb, kh, hit, found)

    def _promote_locked(self, kb, kh, hit, found, nblk, copy_now) -> tuple[int, int] | None:
        t = self._tier
        t.count(H_DISK_HITS)
        t.count(H_DISK_BYTES_READ, hit.loc.length)
        if not t.still(hit) or self._find(kb, kh) >= 0 or nblk > self._n_blocks:
            return None  # deleted, replaced or already promoted while we read
        if found.expiry and found.expiry <= self.clock():
            return None
        try:
            off = self._reserve(kb, hit.flags, len(found.value), nblk, kh)
        except PoolFull:
            return None  # everything in memory is pinned: serve from disk, promote later
        i = self._reserved_slot
        if not copy_now:
            return i, off
        vlen = len(found.value)
        self._mv[off : off + vlen] = found.value
        self._mv[off + vlen : off + vlen + len(kb)] = kb
        self._seal(i, kb, kh, found.checksum, None, found.priority, False, hit, found.expiry)
        return None

    def _promote_seal(self, i: int, kb: bytes, kh: int, hit: DiskHit, found: Found) -> None:
        if self._c_state[i] != WRITING:
            return  # a repair took the reservation back
        if not self._tier.still(hit) or self._find(kb, kh) >= 0:  # type: ignore[union-attr]
            self._abort(i)
            return
        self._seal(i, kb, kh, found.checksum, None, found.priority, False, hit, found.expiry)

    # ------------------------------------------------------------------ delete, membership

    def _delete_locked(self, kb: bytes, kh: int) -> bool:
        i = self._find(kb, kh)
        if i >= 0:
            self._remove(i)
        on_disk = self._tier is not None and self._tier.forget(kb, kh)
        if i < 0 and not on_disk:
            return False
        self._hu64[H_DELETES] += 1
        return True

    def delete(self, key: str | bytes) -> bool:
        """Remove `key` (from every tier); True if it was in memory or on disk.

        Readers already copying finish safely; the server's copy, if any, is
        deleted in the background.
        """
        kb, _ = key_bytes(key)
        found = self._locked(self._delete_locked, kb, xxh3_64_intdigest(kb))
        if self._remote is not None:
            self._remote.delete(kb)
        return found

    def _contains_locked(self, kb: bytes, kh: int) -> bool:
        i = self._find(kb, kh)
        if i >= 0 and not self._expired(i):
            return True
        return self._tier is not None and self._tier.contains(kb, kh)

    def __contains__(self, key: object) -> bool:
        try:
            kb, _ = key_bytes(key)  # type: ignore[arg-type]
        except UsageError:
            return False
        return self._locked(self._contains_locked, kb, xxh3_64_intdigest(kb))

    def _live_mask(self) -> np.ndarray:
        e = self._expiry
        return (self._state == SEALED) & ((e == 0) | (e > self.clock()))

    def __len__(self) -> int:
        """Number of live (sealed, unexpired) entries."""
        return int(self._locked(lambda: int(np.count_nonzero(self._live_mask()))))

    def _key_of(self, i: int) -> str | bytes:
        off = self._data_off + int(self._first[i]) * self._bs + int(self._vlen[i])
        kb = bytes(self._mv[off : off + int(self._klen[i])])
        if int(self._sflags[i]) & SLOT_FLAG_STR_KEY:
            return kb.decode("utf-8", "surrogateescape")
        return kb

    def keys(
        self, prefix: str | bytes | None = None, limit: int | None = None, tier: str = "memory"
    ) -> list[str | bytes]:
        """Keys of live entries, oldest insert first (str keys come back as str).

        `tier`: "memory" (default), "disk" (read from the tier's records,
        oldest written first), "all" (memory, then disk-only keys) or "remote"
        (this pool's keys on the remote server, in key order; see `remote_entries`).
        """
        if tier not in ("memory", "disk", "all", "remote"):
            raise UsageError(f"unknown tier {tier!r}: choose memory, disk, all or remote")
        if tier == "remote":
            return [e["key"] for e in self.remote_entries(prefix, limit)]
        pb = key_bytes(prefix)[0] if prefix else b""
        if tier != "memory":
            mem = [] if tier == "disk" else self.keys(prefix, limit)
            if limit is not None and len(mem) >= limit:
                return mem
            seen = set(mem)
            more = [k for k in self._disk_keys(pb) if k not in seen]
            out = mem + more
            return out[:limit] if limit is not None else out

        def collect() -> list[str | bytes]:
            idx = np.flatnonzero(self._live_mask())
            idx = idx[np.argsort(self._iseq[idx], kind="stable")]
            out: list[str | bytes] = []
            for i in idx:
                k = self._key_of(int(i))
                if pb and not (k.encode("utf-8", "surrogateescape") if isinstance(k, str) else k).startswith(pb):
                    continue
                out.append(k)
                if limit is not None and len(out) >= limit:
                    break
            return out

        return self._locked(collect)

    def remote_entries(self, prefix: str | bytes | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """This pool's entries on the remote server (key, size, ttl_remaining), in key order.

        Asks the server (a SCAN of every primary, then each record's header): UsageError without
        a remote tier, ServiceUnavailable (69) if the server cannot be reached.
        """
        return self._remote_tier().entries(key_bytes(prefix)[0] if prefix else b"", limit)

    def _remote_tier(self) -> Any:
        """The remote tier, for an operator's request; UsageError without one."""
        if self._closed:
            raise PoolClosed(f"pool {self.name!r} is closed")
        if self._remote is None:
            raise UsageError(f"pool {self.name!r} has no remote tier")
        return self._remote

    def __iter__(self) -> Iterator[str | bytes]:
        return iter(self.keys())

    def _disk_records(self) -> list[tuple[int, int, Any, int, int]]:
        """(slot, seq, location, key length, flags) of every live disk entry, oldest first (lock held)."""
        t = self._tier
        if t is None:
            return []
        c = t.cols
        idx = t.live_slots()
        e = c["expiry"][idx]
        idx = idx[(e == 0) | (e > self.clock())]
        idx = idx[np.argsort(c["seq"][idx], kind="stable")]
        return [(int(d), int(c["seq"][d]), t.hit(int(d)).loc, int(c["key_len"][d]), int(c["flags"][d]))
                for d in idx]

    def _disk_keys(self, pb: bytes = b"", with_slots: bool = False) -> list[Any]:
        """Keys on disk (read from the records, outside the lock) starting with `pb`."""
        t = self._tier
        if t is None or t.log is None:
            return []
        out: list[Any] = []
        for d, seq, loc, klen, flags in self._locked(self._disk_records):
            try:
                kb = t.log.read_key(loc, klen)
            except OSError:
                continue
            if kb is None or not kb.startswith(pb):
                continue  # overwritten since, or not a match
            k = kb.decode("utf-8", "surrogateescape") if flags & SLOT_FLAG_STR_KEY else kb
            out.append((d, seq, kb, k) if with_slots else k)
        return out

    def _info_of(self, i: int) -> dict[str, Any]:
        now = self.clock()
        e = float(self._expiry[i])
        return {
            "key": self._key_of(i),
            "tier": "memory",
            "size": int(self._vlen[i]),
            "blocks": int(self._nblk[i]),
            "first_block": int(self._first[i]),
            "created": self._c_created[i],
            "last_access": self._c_lastacc[i],
            "access_count": self._c_acount[i],
            "priority": self._c_prio[i],
            "expires": e if e > 0 else None,
            "ttl_remaining": max(0.0, e - now) if e > 0 else None,
            "checksum": f"{int(self._cks[i]):016x}",
            "pins": int(self._pins[i]),
        }

    def info(self, key: str | bytes) -> dict[str, Any]:
        """Metadata of `key`'s entry (does not count as an access).  Raises KeyNotFound."""
        kb, _ = key_bytes(key)
        kh = xxh3_64_intdigest(kb)

        def get_info() -> dict[str, Any] | None:
            i = self._find(kb, kh)
            if i >= 0 and not self._expired(i):
                return self._info_of(i)
            t = self._tier
            if t is not None and t.contains(kb, kh):
                return {"key": key, **t.info(t.find(kh, key_hash2(kb), len(kb)))}
            return None

        r = self._locked(get_info)
        if r is None:
            raise KeyNotFound(f"no key {_show_key(key)} in pool {self.name!r}")
        return r

    # ------------------------------------------------------------------ eviction

    def evict(
        self,
        *,
        percent: float | None = None,
        nbytes: int | str | None = None,
        expired: bool = False,
        keys: list[str | bytes] | None = None,
        prefix: str | bytes | None = None,
        all: bool = False,
        tier: str = "memory",
    ) -> tuple[int, int]:
        """Evict entries now; return (entries, value bytes) freed.

        Exactly one selector: `percent` of the used value bytes or `nbytes`
        (victims chosen by the pool's policy, expired ones first), `expired`
        entries only, the given `keys`, every key starting with `prefix`, or
        `all`.  Pinned entries leave the index at once and free their memory
        when their last reader lets go.

        `tier`: "memory" (default; with a disk tier, evicted entries that have
        not expired move to disk as any eviction does), "disk" (removed from
        the disk tier; by age, oldest written first, for percent/nbytes) or
        "all" (removed from both tiers, nothing spilled), or "remote" (deleted
        from the remote server now, for every host sharing it: `keys`, `prefix`
        or `all` only, since the server evicts by its own memory policy; raises
        ServiceUnavailable if the server cannot be reached).  "all" never
        touches the remote tier: other hosts share it.
        """
        if tier not in ("memory", "disk", "all", "remote"):
            raise UsageError(f"unknown tier {tier!r}: choose memory, disk, all or remote")
        if tier == "remote":
            return self._evict_remote(percent, nbytes, expired, keys, prefix, all)
        if tier != "memory" and self._tier is None:
            if tier == "disk":
                raise UsageError(f"pool {self.name!r} has no disk tier")
            tier = "memory"
        if tier == "all":
            sel = dict(percent=percent, nbytes=nbytes, expired=expired, keys=keys, prefix=prefix, all=all)
            c1, b1 = self._evict_memory(**sel, spill=False)
            c2, b2 = self._evict_disk(**sel)
            return c1 + c2, b1 + b2
        if tier == "disk":
            return self._evict_disk(percent=percent, nbytes=nbytes, expired=expired, keys=keys, prefix=prefix,
                                    all=all)
        return self._evict_memory(percent=percent, nbytes=nbytes, expired=expired, keys=keys, prefix=prefix,
                                  all=all, spill=True)

    def _evict_remote(self, percent, nbytes, expired, keys, prefix, all) -> tuple[int, int]:
        self._check_selector(percent, nbytes, expired, keys, prefix, all)
        remote = self._remote_tier()
        if percent is not None or nbytes is not None or expired:
            raise UsageError("the remote tier evicts by --key, --prefix or --all "
                             "(the server expires and evicts by its own policy)")
        if keys is not None:
            return remote.evict(keys=[key_bytes(k)[0] for k in keys])
        return remote.evict(prefix=key_bytes(prefix)[0] if prefix is not None else b"")

    @staticmethod
    def _check_selector(percent, nbytes, expired, keys, prefix, all) -> int | None:
        """Check that exactly one selector is given; return the byte target of `nbytes`."""
        chosen = [percent is not None, nbytes is not None, bool(expired), keys is not None, prefix is not None, bool(all)]
        if sum(chosen) != 1:
            raise UsageError("evict needs exactly one of: percent, nbytes, expired, keys, prefix, all")
        if percent is not None and not 0 < percent <= 100:
            raise UsageError(f"percent must be in (0, 100], not {percent!r}")
        return parse_size(nbytes) if nbytes is not None else None

    def _evict_memory(self, percent, nbytes, expired, keys, prefix, all, spill) -> tuple[int, int]:
        target = self._check_selector(percent, nbytes, expired, keys, prefix, all)
        spill = spill and self._tier is not None
        if keys is not None:
            encoded = [(kb, xxh3_64_intdigest(kb)) for kb, _ in map(key_bytes, keys)]
            return self._locked(self._evict_keys, encoded, spill)
        if expired or all or prefix is not None:
            pb = key_bytes(prefix)[0] if prefix is not None else None
            return self._locked(self._evict_matching, expired, pb, spill)
        return self._locked(self._evict_amount, percent, target, spill)

    def _evict_keys(self, encoded: list[tuple[bytes, int]], spill: bool = False) -> tuple[int, int]:
        count = freed = 0
        for kb, kh in encoded:
            i = self._find(kb, kh)
            if i >= 0:
                count += 1
                freed += int(self._vlen[i])
                self._count_eviction(i, False)
                if spill and not self._expired(i):
                    self._spill(i)
                self._remove(i)
        return count, freed

    def _evict_matching(self, expired_only: bool, prefix: bytes | None, spill: bool = False) -> tuple[int, int]:
        idx = np.flatnonzero(self._state == SEALED)
        if expired_only:
            e = self._expiry[idx]
            idx = idx[(e > 0) & (e <= self.clock())]
        count = freed = 0
        for i in map(int, idx):
            if prefix is not None:
                k = self._key_of(i)
                kb = k.encode("utf-8", "surrogateescape") if isinstance(k, str) else k
                if not kb.startswith(prefix):
                    continue
            count += 1
            freed += int(self._vlen[i])
            gone = self._expired(i)
            self._count_eviction(i, gone)
            if spill and not gone:
                self._spill(i)
            self._remove(i)
        return count, freed

    def _evict_amount(self, percent: float | None, target: int | None, spill: bool = False) -> tuple[int, int]:
        if percent is not None:
            live = self._state == SEALED
            target = int(np.ceil(int(self._vlen[live].sum()) * percent / 100))
        assert target is not None
        count = freed = 0
        while freed < target:
            i, expired = self._victims.next_victim()
            if i < 0:
                break
            count += 1
            freed += int(self._vlen[i])
            self._count_eviction(i, expired)
            if spill and not expired:
                self._spill(i)
            self._remove(i)
        return count, freed

    def _evict_disk(self, percent, nbytes, expired, keys, prefix, all) -> tuple[int, int]:
        """Remove entries from the disk tier (their records are killed)."""
        target = self._check_selector(percent, nbytes, expired, keys, prefix, all)
        t = self._tier
        if t is None:
            return 0, 0
        if keys is not None:
            encoded = [(kb, xxh3_64_intdigest(kb)) for kb, _ in map(key_bytes, keys)]

            def by_key() -> list[int]:
                slots = (t.find(kh, key_hash2(kb), len(kb)) for kb, kh in encoded)
                return [d for d in slots if d >= 0]

            return self._locked(lambda: self._forget_disk_slots(by_key()))
        if prefix is not None:
            pb = key_bytes(prefix)[0]
            chosen = [(d, seq) for d, seq, _, _ in self._disk_keys(pb, with_slots=True)]
            return self._locked(lambda: self._forget_disk_slots(
                [d for d, seq in chosen if t.is_live(d, seq)]))

        def select() -> list[int]:
            c = t.cols
            if all:  # spills being written too, or they would land after the tier was emptied
                return list(map(int, t.indexed_slots()))
            idx = t.live_slots()
            if expired:
                e = c["expiry"][idx]
                return list(map(int, idx[(e > 0) & (e <= self.clock())]))
            idx = idx[np.argsort(c["seq"][idx], kind="stable")]  # oldest written first
            goal = target if target is not None else int(np.ceil(int(c["value_len"][idx].sum()) * percent / 100))
            sizes = np.cumsum(c["value_len"][idx].astype(np.int64))
            n = int(np.searchsorted(sizes, goal, side="left")) + 1 if goal > 0 else 0
            return list(map(int, idx[:n]))

        return self._locked(lambda: self._forget_disk_slots(select()))

    def _forget_disk_slots(self, slots: list[int]) -> tuple[int, int]:
        t = self._tier
        assert t is not None
        freed = 0
        for d in slots:
            freed += int(t._vlen[d])
            t.forget_slot(d)
        return len(slots), freed

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """Counters and usage, with the field names of `cortex cache status --json`."""
        return self._locked(self._stats_locked)

    def _stats_locked(self) -> dict[str, Any]:
        h = self._hdr[0]
        g = self.geometry
        sealed = self._state == SEALED
        hits, misses = int(h["hits"]), int(h["misses"])
        st = self._seg.stat()
        last = float(h["last_snapshot"])
        return {
            "name": self.name,
            "format_version": int(h["version"]),
            "policy": self.policy,
            "multi_threaded": bool(int(h["flags"]) & FLAG_MULTI_THREADED),
            "reserved": bool(int(h["flags"]) & FLAG_RESERVED),
            "size_bytes": g.data_size,
            "segment_bytes": g.segment_size,
            "block_size": g.block_size,
            "blocks_total": g.n_blocks,
            "blocks_used": int(h["used_blocks"]),
            "used_bytes": int(h["used_blocks"]) * g.block_size,
            "value_bytes": int(self._vlen[sealed].sum()),
            "entries": int(h["n_entries"]),
            "max_entries": g.n_slots,
            "hits": hits,
            "misses": misses,
            "hit_ratio": hits / (hits + misses) if hits + misses else 0.0,
            "puts": int(h["puts"]),
            "deletes": int(h["deletes"]),
            "evictions": int(h["evictions"]),
            "expirations": int(h["expirations"]),
            "bytes_evicted": int(h["bytes_evicted"]),
            "repairs": int(h["repairs"]),
            "pinned_entries": int(np.count_nonzero(self._pins)),
            "writing_entries": int(np.count_nonzero(self._state == WRITING)),
            "created": float(h["created"]),
            "last_snapshot": last if last > 0 else None,
            "mode": f"{st.st_mode & 0o777:04o}",
            "uid": st.st_uid,
            "gid": st.st_gid,
            "disk": self._tier.stats() if self._tier is not None else None,
            "remote": self._remote.stats() if self._remote is not None else None,
        }

    # ------------------------------------------------------------------ snapshots (persist.py)

    def persist(
        self,
        path: str | os.PathLike | None = None,
        progress: Callable[[int, int], None] | None = None,
        keep: int | None = None,
    ) -> "os.PathLike":
        """Write an atomic, checksummed snapshot of the live entries; return its path.

        Without `path` it goes to the snapshot directory (CORTEX_CACHE_SNAPSHOT_DIR)
        as a timestamped file, `<name>.ccsnap` names the newest, and the newest
        `keep` (default 3) are kept.  Raises PersistBusy if one is already running.
        """
        from . import persist as _persist

        return _persist.persist(self, path, keep=keep, progress=progress).path

    @classmethod
    def restore(
        cls,
        path: str | os.PathLike | None = None,
        name: str | None = None,
        replace: bool = False,
        progress: Callable[[int, int], None] | None = None,
        mode: int | None = None,
    ) -> "Pool":
        """Rebuild a pool from a snapshot (verified whole first) and return it open.

        Creates the pool from the snapshot's configuration when it does not
        exist; an existing pool only with `replace`, swapped in atomically
        (persist.restore).  `mode` defaults to 0600 (with `replace`, the old
        pool's).  Raises SnapshotCorrupt (65), SnapshotNotFound (66),
        PoolExists and NoSpace (73), PermissionDenied (77).
        """
        from . import persist as _persist

        return _persist.restore(path, name=name, replace=replace, progress=progress, mode=mode)[0]

    def _note_snapshot(self, when: float) -> None:
        self._hdr["last_snapshot"] = when

    def _snapshot_config(self) -> dict[str, Any]:
        h = self._hdr[0]
        from .persist import COUNTERS

        return {
            "name": self.name.encode(),
            "size": self.geometry.data_size,
            "block_size": self._bs,
            "max_entries": self._n_slots,
            "policy": int(h["policy"]),
            "flags": int(h["flags"]) & FLAG_MULTI_THREADED,
            "mode": self._seg.stat().st_mode & 0o777,
            "lfu_period": int(h["lfu_period"]),
            "counters": {c: int(h[c]) for c in COUNTERS},
        }

    def _pin_for_snapshot(self, slots: list[int]) -> list[tuple]:
        """Pin the still-live entries among `slots`; return what the writer needs for each."""
        from .persist import REC_HEAD, REC_MAGIC

        out = []
        epoch = self._hu64[H_LFU_EPOCH]
        for i in slots:
            if self._c_state[i] != SEALED or self._expired(i):
                continue
            vlen, klen = self._c_vlen[i], self._c_klen[i]
            off = self._data_off + self._c_first[i] * self._bs
            key = self._mv[off + vlen : off + vlen + klen].tobytes()
            age = epoch - self._c_lfuep[i]
            head = REC_HEAD.pack(
                REC_MAGIC, klen, self._c_flags[i], 0, vlen, self._c_created[i], self._c_lastacc[i],
                self._c_expiry[i], self._c_iseq[i], self._c_aseq[i], self._c_acount[i] >> min(63, age),
                self._c_prio[i], self._c_cks[i], 0,
            )
            out.append((head, key, off, vlen, self._c_cks[i], self._pin(i), i))
        return out

    def _unpin_snapshot_batch(self, batch: list[tuple]) -> None:
        for *_, j, i in batch:
            self._unpin(j, i)

    def _restore_begin(self, counters: dict[str, int] | None) -> int:
        """Start a restore: return the offset added to the snapshot's sequence numbers."""
        return 0 if counters is not None else self._hu64[H_SEQ]

    def _restore_entry(self, rec: Any, base: int) -> None:
        """Insert one snapshot record with its metadata (like put, outside-lock copy for large values)."""
        kb, vb = rec.key, rec.value
        vlen, klen = len(vb), len(kb)
        nblk = max(1, -(-(vlen + klen) // self._bs))
        if nblk > self._n_blocks:
            raise ValueTooLarge(f"snapshot entry of {format_size(vlen)} does not fit in pool {self.name!r}")
        kh = xxh3_64_intdigest(kb)
        flags = rec.flags & SLOT_FLAG_STR_KEY
        if vlen <= COPY_IN_LOCK:
            self._locked(self._put_small, kb, kh, flags, vb, nblk, rec.checksum, None, rec.priority, rec, base)
            return
        i, off = self._locked(self._reserve_entry, kb, flags, vlen, nblk, kh)
        try:
            # Through the segment's fd, not the mapping: the kernel fills the
            # pages without a page fault each (~1.5x faster into fresh memory).
            done = 0
            while done < vlen:
                done += os.pwrite(self._seg.fd, vb[done:], off + done)
            self._mv[off + vlen : off + vlen + klen] = kb
        except BaseException:
            self._locked(self._abort, i)
            raise
        self._locked(self._seal_restored, i, rec, kh, base)

    def _seal_restored(self, i: int, rec: Any, kh: int, base: int, replace: bool = True) -> None:
        self._seal(i, rec.key, kh, rec.checksum, None, rec.priority, replace)
        self._hu64[H_PUTS] -= 1  # a restore is not a put
        self._c_created[i] = rec.created
        self._c_lastacc[i] = rec.last_access
        self._c_expiry[i] = rec.expiry
        self._c_iseq[i] = base + rec.insert_seq
        self._c_aseq[i] = base + rec.access_seq
        self._c_acount[i] = max(1, rec.access_count)
        if base + rec.access_seq > self._hu64[H_SEQ]:
            self._hu64[H_SEQ] = base + rec.access_seq
        self._victims.invalidate()  # the scores just changed behind its back
        if rec.expiry:
            self._victims.on_expiry_set(rec.expiry)

    def _restore_end(self, counters: dict[str, int] | None) -> None:
        if counters:
            for c, v in counters.items():
                if c != "seq":
                    self._hdr[c] = v
        self._victims.invalidate()

    # ------------------------------------------------------------------ repair and verify

    def _reap_dead(self) -> bool:
        """Reclaim reservations of dead writers and pins of dead readers; True if anything was freed."""
        freed = False
        alive = procs.alive_checker()

        for j in map(int, np.flatnonzero(self._ppid != 0)):
            if not alive(int(self._ppid[j]), int(self._pstart[j])):
                i = int(self._pslot[j])
                self._ppid[j] = 0
                self._pslot[j] = -1
                if 0 <= i < self._n_slots and self._pins[i] > 0:
                    self._pins[i] -= 1
                    if self._pins[i] == 0 and self._state[i] == ZOMBIE:
                        self._free_blocks(i)
                        self._free_slot(i)
                        freed = True
        for i in map(int, np.flatnonzero(self._state == WRITING)):
            if not alive(int(self._opid[i]), int(self._ostart[i])):
                self._free_blocks(i)
                self._free_slot(i)
                freed = True
        if freed:
            self._victims.invalidate()
        return freed

    def _repair(self) -> list[str]:
        """Rebuild every derived structure from the slot records (lock held)."""
        from .repair import repair

        fixed = repair(self)
        self._hu64[H_REPAIRS] += 1
        self._hu32[H_DIRTY] = 0
        return fixed

    def verify(self, repair: bool = False, checksums: bool = True) -> dict[str, Any]:
        """Check the pool's consistency (and fix it with `repair`).

        Returns {"ok": bool, "problems": [...], "repaired": bool, "entries": n}.
        Checksums of all sealed entries are verified unless `checksums=False`;
        with `repair`, an entry whose bytes no longer match is dropped.
        """
        from .repair import verify

        return verify(self, repair=repair, checksums=checksums)


def default_disk_path(name: str) -> str:
    """Where `--tier disk` puts a pool's tier when no path is given: next to the snapshot directory,
    namespaced by CORTEX_CACHE_SHM_PREFIX like the segment (persist.namespaced)."""
    from .persist import namespaced, snapshot_dir

    return str(snapshot_dir().parent / "disk" / namespaced(name))


def _open_or_make_tier(path: str, size: int | None, default_size: int, o_direct: bool, name: str, mode: int = 0o600):
    """Open the tier in `path` (taking it over from a pool that is gone) or make one; (log, made)."""
    if not DiskLog.exists(path):
        return DiskLog.create(path, size if size is not None else default_size, o_direct=o_direct, mode=mode), True
    log = DiskLog.open(path, o_direct=o_direct)
    try:
        if size is not None and DiskLog.capacity_for(size) != log.capacity:
            raise UsageError(
                f"{path!r} holds a disk tier of {log.capacity} bytes; give that --disk-size "
                "(or none) to use it, or remove it with `cortex cache delete --force`"
            )
        owner = log.owner()
        mine = segment.shm_path(name)
        if owner and owner != mine and owner.startswith("/dev/shm/") and os.path.exists(owner):
            raise CannotCreate(f"{path!r} is the disk tier of another pool ({owner}); choose another --disk-path")
        return log, False
    except BaseException:
        log.close()
        raise


def _show_key(key: object) -> str:
    s = repr(key)
    return s if len(s) <= 80 else s[:77] + "..."


def _open_complete_segment(name: str) -> segment.Segment:
    """Open `name`, waiting (bounded) for a creator that is still initialising it."""
    deadline = time.monotonic() + _OPEN_WAIT
    attempts = 0
    while True:
        seg = segment.Segment.open(name)
        if seg.size >= HEADER_SIZE and bytes(seg.mm[0:8]) == MAGIC:
            return seg
        # No magic yet: the creator holds the record lock until it writes it.
        lock = RecordLock(seg.fd)
        try:
            lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            lock.release()
        except CortexCacheError:
            seg.close()
            raise SegmentCorrupt(f"pool {name!r} is still being created (or its creator hung)") from None
        again = os.fstat(seg.fd).st_size
        complete = again >= HEADER_SIZE and seg.size == again and bytes(seg.mm[0:8]) == MAGIC
        if complete:
            return seg
        seg.close()
        if again >= HEADER_SIZE and again == seg.size:
            raise SegmentCorrupt(
                f"segment of pool {name!r} is not a cortex pool, or its creator died mid-create; "
                "delete it with `cortex cache delete`"
            )
        # Nobody held the lock and there is no header: either a creator sits
        # in the microseconds between shm_open and taking the lock, or it
        # died there.  Retry briefly, then call it what it is.
        attempts += 1
        if attempts >= 5:
            raise SegmentCorrupt(
                f"segment of pool {name!r} is empty: its creator died mid-create; "
                "delete it with `cortex cache delete`"
            )
        time.sleep(0.01)


def _validate(seg: segment.Segment) -> None:
    # A copy, not a view: an exception's traceback must not pin the mapping.
    hdr = np.frombuffer(seg.mm[:HEADER_SIZE], HEADER_DTYPE, 1, 0)
    h = hdr[0]
    if bytes(h["magic"]) != MAGIC:
        raise SegmentCorrupt(f"segment of pool {seg.name!r} is not a cortex pool")
    version = int(h["version"])
    if version != FORMAT_VERSION:
        raise IncompatibleVersion(
            f"pool {seg.name!r} has format version {version}; this cortex_cache reads version {FORMAT_VERSION}"
        )
    if int(h["header_size"]) != HEADER_SIZE:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header (header size)")
    why = Geometry.from_header(hdr).check(seg.size)
    if why:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header: {why}")
    if policy_by_id(int(h["policy"])) is None:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header: unknown policy {int(h['policy'])}")
    if int(h["disk_flags"]) & DISK_ON and int(h["n_dslots"]) == 0:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header: a disk tier without a disk index")


__all__ = ["Pool", "EntryView", "EntryWriter"]
