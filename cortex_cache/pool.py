"""The pool: a named KV-cache in shared memory that any process can attach to.

`Pool` is the public facade (docs/design.md, "Layers"): it checks arguments,
turns keys into bytes and hashes, and calls the layers below -- the core
(core.py: the mapped segment, its lock and its invariants), the tiers below
memory (tiers.py, the one entry point to them: no tier is named here), the
batched calls (batch.py), the configuration (config.py), snapshots
(snapshot.py), repair (repair.py) and creation (pool_create.py: `create` and
its checks).  It holds no state of its own beyond its handles.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Iterator

import numpy as np
from xxhash import xxh3_64_intdigest

from . import repair as _repair
from . import batch, config, header, lookups, pool_create, segment, snapshot
from .core import COPY_IN_LOCK, PIN, READ_COUNTED, READ_HITS, READ_QUIET, SLOW, Core, Pinned
from .errors import CortexCacheError, KeyNotFound, PoolClosed, PoolFull, UsageError
from .eviction import check_selector
from .layout import FLAG_SUPERSEDED, H_FLAGS
from .lower import Plan, Selector
from .pool_create import default_disk_path, tier_home  # noqa: F401 (re-exported: defined with create)
from .restore import resize as resize_pool
from .restore import restore as restore_snapshot
from .handles import EntryView, EntryWriter
from .stats import memory_stats
from .tiers import Tiers
from .units import format_size, parse_size
from .values import as_byte_view, key_bytes, put_args, show_key, valid_nbytes, writable_bytes

_live_pools: "weakref.WeakSet[Pool]" = weakref.WeakSet()


def disk_tier_of(name: str) -> str | None:
    """The disk tier directory of pool `name` if it has one (None if it cannot be read)."""
    try:
        with Pool.open(name, lock_timeout=5) as p:
            return p.disk_path
    except CortexCacheError:
        return None


def _after_fork_in_child() -> None:
    # A forked child shares its parent's open file description, hence its
    # OFD lock: the two would not exclude each other.  Refuse to use it.
    for p in list(_live_pools):
        if not p.core.closed:
            p.core.forked = True
            p.core.fast = None


os.register_at_fork(after_in_child=_after_fork_in_child)


# Pool.open(verify_reads=None) takes its default from here (docs/reliability.md, "Trust model").
VERIFY_READS_ENV = "CORTEX_CACHE_VERIFY_READS"


def unlink_marked(name: str) -> None:
    """Unlink pool `name`, marking it superseded in the same lock hold (Core.retire), so the processes
    attached to it learn it is gone whatever the kill point; a segment that cannot be opened as a pool
    (corrupt, half made) has no handle on it to tell, and is unlinked unmarked."""
    try:
        pool = Pool.open(name, snapshot_tier=False)
    except (CortexCacheError, OSError):
        segment.unlink(name)
        return
    try:
        pool.core.locked(pool.core.retire, lambda: segment.unlink(name))
    finally:
        pool.close()


def _copy_out(core: Core, pinned: Pinned) -> bytes:
    """The value of a pinned entry, copied out as bytes outside the lock, checked (with verify_reads) and
    unpinned."""
    _, _, off, n = pinned  # unpacked: cheaper than attribute lookups on the hot path
    try:
        value = core.mv[off : off + n].tobytes()
        core.check_copy(pinned, value)
        return value
    finally:
        core.release_pins([pinned])


# A closed handle's header words: never marked superseded (its operations raise PoolClosed).
_CLOSED_WORDS = memoryview(bytes(4 * (H_FLAGS + 1))).cast("I")


class Pool:
    """A named KV-cache pool in POSIX shared memory.

    Create one with :meth:`create`, attach from any process with :meth:`open`.
    A handle is not inherited across `fork`: open the pool again in the child.
    Unless the pool (or this handle) is multi-threaded, use a handle from one
    thread at a time.  `core` is the layer below (core.py), for the library's
    own modules (snapshots, GPU staging).
    """

    _closed = True  # until __init__ is done: a half-built handle closes cleanly
    _words = _CLOSED_WORDS  # ... and is never superseded

    # ------------------------------------------------------------------ lifecycle

    def __init__(
        self,
        seg: segment.Segment,
        *,
        multi_threaded: bool | None = None,
        clock: Callable[[], float] | None = None,
        lock_timeout: float | None = None,
        _plans: dict[str, Plan] | None = None,
        verify_reads: bool | None = None,
        snapshot_tier: bool = True,
    ) -> None:
        if verify_reads is None:
            verify_reads = os.environ.get(VERIFY_READS_ENV, "") not in ("", "0")
        core = Core(seg, multi_threaded=multi_threaded, clock=clock, lock_timeout=lock_timeout,
                    repairer=_repair.analyse, verify_reads=verify_reads)
        self.core = core
        # The superseded flag, one load away (`superseded`): checked by every operation, as it starts
        # (reads) or once it is done (writes: what it did may have gone to a copy nobody can find).
        self._words = core.header_words
        # How this handle was opened: `reopen` opens the pool under its name again alike.
        self._open_kw: dict[str, Any] = {"multi_threaded": multi_threaded, "clock": clock,
                                         "lock_timeout": lock_timeout, "verify_reads": verify_reads,
                                         "snapshot_tier": snapshot_tier}
        self._views: set[EntryView] = set()
        self._close_hooks: list[Callable[[], None]] = []
        self.name = core.name
        self.geometry = core.geometry
        self.multi_threaded = core.multi_threaded
        self.clock = core.clock
        self.policy = core.policy
        try:
            self.tiers = Tiers(core, snapshot=snapshot_tier, plans=_plans)
        except BaseException:
            core.close()  # the caller closes the segment
            raise
        self._closed = False
        _live_pools.add(self)

    # Pool.create (pool_create.py: the checks, the segment, the tiers' regions).
    create = classmethod(pool_create.create)

    @property
    def disk_path(self) -> str | None:
        """Directory of this pool's disk tier, or None without one."""
        return self.tiers.directory()

    def populate(self, *, background: bool = False) -> bool:
        """Map the whole pool into this process now, so that no first access to a block pays a page fault.

        A process that attaches to a pool maps its memory lazily: the first
        touch of each page costs a fault, which makes a fresh process's first
        pass over the pool two to three times slower than later ones.  This
        does that work up front (madvise MADV_POPULATE_WRITE, contents
        untouched; about 0.1 s per GiB), on a thread of its own with
        `background=True` (close() stops it).  Engine adapters call it once
        when they attach.  True if done or started; False for a pool created
        with reserve=False (populating would allocate its memory) or a kernel
        before 5.14.
        """
        if not self.configuration()["reserve"]:
            return False
        if not background:
            return self.core.populate()
        stop = threading.Event()
        worker = threading.Thread(target=self.core.populate, args=(stop,), daemon=True,
                                  name=f"cortex-populate-{self.name}")

        def halt() -> None:
            stop.set()
            worker.join()

        self.add_close_hook(halt)
        worker.start()
        return True

    def configuration(self) -> dict[str, Any]:
        """Everything the pool was created with, as `create` takes it (the remote URL whole).

        Keys: size, block_size, max_entries, policy, mode, multi_threaded,
        reserve, lfu_period, keep (None: the default), disk (None, or path,
        size, write, o_direct, max_entries) and remote (None, or url, cluster).
        `config.redacted()` gives the form to show.
        """
        return config.read(self.core)

    @property
    def snapshot_keep(self) -> int | None:
        """How many snapshots `persist` keeps of this pool; None: the default (3)."""
        return int(self.core.fields.snapshot_keep[0]) or None

    def set_snapshot_keep(self, keep: int) -> None:
        """Store how many snapshots `persist` keeps of this pool (for every later persist, from any process).

        Only the pool's owner (or root) may: PermissionDenied (77) for anyone else."""
        if not 1 <= keep < 2**32:
            raise UsageError(f"keep must be at least 1, not {keep}")
        snapshot.check_settings_owner(self.core, "change its retention", f"it keeps {self.snapshot_keep or 3}")
        self.core.fields.snapshot_keep[0] = keep

    def prune_snapshots(self, keep: int | None = None) -> dict[str, Any]:
        """Remove this pool's snapshots in the snapshot directory but the newest `keep` (default: as many as
        it keeps), with the packs only they used, as persist's retention does; under the pool's persist
        lock (PersistBusy, 75, while a persist, restore or fill runs).  `keep=0` removes them all.  Returns
        removed (paths), kept and freed_bytes.  For a pool that is gone: `cortex_cache.persist.prune`."""
        return snapshot.prune(self.name, (self.snapshot_keep or snapshot.DEFAULT_KEEP) if keep is None else keep,
                              core=self.core)

    @classmethod
    def open(
        cls,
        name: str,
        *,
        multi_threaded: bool | None = None,
        clock: Callable[[], float] | None = None,
        lock_timeout: float | None = None,
        require_owner: bool = False,
        verify_reads: bool | None = None,
        snapshot_tier: bool = True,
    ) -> "Pool":
        """Attach to existing pool `name`.

        Raises PoolNotFound (exit 66), PermissionDenied (77), SegmentCorrupt or
        IncompatibleVersion (65) for a segment that is not a usable pool,
        TooManyOpenFiles (75) when out of file descriptors.
        `multi_threaded=None` uses the pool's default chosen at create.
        `lock_timeout`: seconds an operation waits for the pool's lock before
        LockTimeout (75); default CORTEX_CACHE_LOCK_TIMEOUT, else 30 s.
        `require_owner`: refuse (PermissionDenied) a pool whose segment belongs
        to neither this user nor root, checked on the open descriptor before
        anything in it is used: for code that opens a pool by a configured name
        on a user's behalf (the engine adapters, create(exist_ok=True),
        restore).  A plain open (a group member's, of a 0660 pool) does not.
        `verify_reads`: check every value this handle reads (get, get_into,
        peek, views and their batches) against the checksum taken at put, and
        raise ValueCorrupt (65) instead of returning bytes that do not match;
        for a pool shared with writers you do not fully trust (docs/reliability.md,
        "Trust model").  None: CORTEX_CACHE_VERIFY_READS=1 in the environment.
        `snapshot_tier=False`: while the pool is being filled from a snapshot,
        do not index that snapshot (the index costs about 0.5 s per 100,000
        entries at every open); entries the fill has not come to are then
        misses for this handle, and each key it puts or deletes meanwhile
        marks its hash bucket gone from the snapshot (gone.py).  For a handle
        that only reads `stats()` (`status`, `list`, `--watch`).
        """
        seg = header.open_segment(name)
        try:
            if require_owner:
                segment.check_owner(seg)
            pool = cls(seg, multi_threaded=multi_threaded, clock=clock, lock_timeout=lock_timeout,
                       verify_reads=verify_reads, snapshot_tier=snapshot_tier)
        except BaseException:
            seg.close()
            raise
        pool._open_kw["require_owner"] = require_owner
        return pool

    @staticmethod
    def unlink(name: str) -> str | None:
        """Destroy pool `name` (processes still attached keep their mapping until they close).

        Its disk tier stays, as after `cortex cache delete` without --force (a pool created again on it
        finds its entries): returns that tier's directory, or None without one.  Remove it with
        `cortex cache delete NAME --force --disk-path DIR`."""
        tier = disk_tier_of(name) if segment.exists(name) else None
        unlink_marked(name)
        return tier

    @staticmethod
    def exists(name: str) -> bool:
        return segment.exists(name)

    @staticmethod
    def list() -> list[str]:
        """Names of the segments under the current prefix (each may still fail to open)."""
        return segment.list_names()

    @property
    def superseded(self) -> bool:
        """True once the pool this handle maps is no longer the pool of its name: it was replaced
        (`restore --replace`, `resize`) or deleted.  From then on every operation of this handle raises
        PoolSuperseded (a write: once it is done, for it may have gone to the old copy); the old segment
        lives on, nameless, until every process closes it, and `reopen` gives a handle on the pool now
        under the name.  One load of a header word while it is not marked: cheap enough to ask on every
        operation (a mark whose segment still has the name, left by a replace or delete killed before it
        took it, is confirmed by name and cleared)."""
        return bool(self._words[H_FLAGS] & FLAG_SUPERSEDED) and self.core.lost_name()

    def _moved(self, did: str = "") -> None:
        """Raise PoolSuperseded if this handle's pool lost its name (the one-load check found the mark)."""
        if self.core.lost_name():
            raise self.core.superseded_error(did)

    def _read_key(self, key: str | bytes) -> tuple[bytes, int]:
        """The opening of every read of one key: PoolSuperseded if this handle's pool lost its name (the
        one-load check first), then the key's bytes and hash (UsageError for a bad key)."""
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        kb, _ = key_bytes(key)
        return kb, xxh3_64_intdigest(kb)

    def _read_slow(self, kb: bytes, kh: int, out: memoryview | None) -> Any:
        """A read the fast path left (not built, or SLOW): Core.read under the lock, or through the tiers when
        one takes part (Tiers.read, settled while a tier below is busy with the key)."""
        tiers = self.tiers
        if tiers.fast_ok:
            return self.core.locked(self.core.read, kb, kh, out)
        return tiers.settled(tiers.read, kb, kh, out)

    def reopen(self) -> "Pool":
        """A new handle on the pool now named as this one, opened with the same options (PoolNotFound if
        there is none).  This handle stays open: close it once its views are released."""
        return Pool.open(self.name, **self._open_kw)

    def add_close_hook(self, fn: Callable[[], None]) -> None:
        """Run `fn()` when this handle closes, before the mapping goes (gpu.py unregisters CUDA memory there)."""
        self._close_hooks.append(fn)

    def close(self) -> None:
        """Unmap this handle; the pool itself lives on.  Safe to call twice."""
        if self._closed:
            return
        core = self.core
        tiers = self.tiers
        tiers.stop(forked=core.forked)  # queued writes to the tiers below finish (a few seconds at most)
        for v in list(self._views):
            try:
                v.release()
            except BufferError:
                pass  # an array still reads it: the pin stays with this process (reaped when it exits)
        for hook in reversed(self._close_hooks):
            try:
                hook()
            except Exception:
                pass
        self._close_hooks = []
        self._closed = True
        self._words = _CLOSED_WORDS
        _live_pools.discard(self)
        tiers.close()
        core.close()

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
        return f"Pool({self.name!r}, size={format_size(self.geometry.data_size)}, entries={self.core.fields.n_entries[0]})"

    # ------------------------------------------------------------------ put

    def put(self, key: str | bytes, value: Any, *, ttl: float | None = None, priority: int = 0) -> None:
        """Store `value` under `key`, replacing any previous value atomically.

        `value`: bytes-like, contiguous numpy array or torch CPU tensor.
        `ttl`: seconds until the entry expires (never returned after that).
        Evicts by the pool's policy when full.  Raises ValueTooLarge when the
        value exceeds the pool, PoolFull when eviction cannot make room
        (everything else pinned or being written).
        """
        kb, is_str = key_bytes(key)
        vb = as_byte_view(value)
        kh, flags, nblk = put_args(self.core, kb, is_str, vb.nbytes, ttl, priority)
        tiers = self.tiers
        core = self.core
        fast = core.fast
        r = SLOW
        if fast is not None and (tiers.fast_ok or tiers.fast_put(kb)):  # the C write path (_fastpath_put.h)
            r = fast.put(kb, kh, flags, vb, nblk, ttl, int(priority))
            if r.__class__ is tuple:  # copied; the lock was busy for the seal
                core.locked(tiers.seal, r[0], r[1], kb, kh, ttl, int(priority))
        if r is not SLOW:
            pass
        elif tiers.fast_ok and vb.nbytes <= COPY_IN_LOCK:  # the common case, in one lock hold
            core.locked(core.put_small, kb, kh, flags, vb, nblk, xxh3_64_intdigest(vb), ttl, int(priority))
        else:
            tiers.put(kb, kh, flags, vb, nblk, ttl, int(priority))
        if tiers.takes_puts:  # a tier that takes every put (the remote: queued, never waited on)
            tiers.offer_put(kb, value if value.__class__ is bytes else vb, flags, ttl)
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved(": the value went to the old copy")

    def reserve_write(
        self, key: str | bytes, nbytes: int, *, ttl: float | None = None, priority: int = 0
    ) -> EntryWriter:
        """Reserve room for an `nbytes` value of `key` and return a writer to fill it in place.

        The zero-copy put: copy straight into `writer.memoryview` (a device-to-host
        copy into the pool, say), then `commit()`.  Same errors as `put`.
        """
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        kb, is_str = key_bytes(key)
        nbytes = valid_nbytes(nbytes)
        kh, flags, nblk = put_args(self.core, kb, is_str, nbytes, ttl, priority)
        r = self.core.reserve_many([(kb, kh, flags, nbytes, nblk)])[0]
        if isinstance(r, Exception):
            raise r
        return EntryWriter(self.tiers, r[0], kb, kh, flags, r[1], nbytes, ttl, int(priority))

    # ------------------------------------------------------------------ get

    def get(self, key: str | bytes, default: Any = None) -> bytes | Any:
        """The value stored under `key` as bytes, or `default` if absent or expired."""
        kb, kh = self._read_key(key)
        tiers = self.tiers
        core = self.core
        fast = core.fast
        if fast is not None:
            r = fast.read(kb, kh, None, READ_COUNTED if tiers.fast_ok else READ_HITS)
            if r is not SLOW:
                if r is not None:
                    return r
                value = tiers.from_below(kb, kh, None)  # a miss counted: a tier below may have it
                return default if value is None else value
        r = self._read_slow(kb, kh, None)
        if r.__class__ is bytes:
            return r
        if r.__class__ is Pinned:
            return _copy_out(core, r)
        value = tiers.from_below(kb, kh, r)
        return default if value is None else value

    def peek(self, key: str | bytes, default: Any = None) -> bytes | Any:
        """The value under `key` in memory, read without disturbing the pool.

        Unlike `get`, counts no hit or miss, leaves the entry's place in the
        eviction order (access time and count) as it was, expires nothing and
        does not look in, or promote from, the tiers below memory.
        """
        kb, kh = self._read_key(key)
        core = self.core
        fast = core.fast
        if fast is not None:
            r = fast.read(kb, kh, None, READ_QUIET)
            if r is not SLOW:
                return default if r is None else r
        r = core.locked(core.pin_quietly, kb, kh)
        return default if r is None else _copy_out(core, r)

    def get_into(self, key: str | bytes, out: Any) -> int | None:
        """Copy the value of `key` into the writable buffer `out`; return its length, or None if absent.

        Raises BufferTooSmall if `out` is smaller than the value.
        """
        kb, kh = self._read_key(key)
        omv = writable_bytes(out)
        tiers = self.tiers
        core = self.core
        fast = core.fast
        if fast is not None:
            r = fast.read(kb, kh, omv, READ_COUNTED if tiers.fast_ok else READ_HITS)
            if r is not SLOW:
                return r if r is not None else batch.finish_read_into(core, tiers, kb, kh, None, omv)
        r = self._read_slow(kb, kh, omv)
        return batch.finish_read_into(core, tiers, kb, kh, r, omv)

    def view(self, key: str | bytes) -> EntryView:
        """A zero-copy, read-only view of `key`'s value, pinned until released.

        Use as `with pool.view(key) as mv: ...`.  Raises KeyNotFound.
        """
        kb, kh = self._read_key(key)
        tiers = self.tiers
        core = self.core
        if core.fast is not None and not tiers.look_below:
            got = batch.pin_many(core, [(kb, kh)], True)[0]
            if got is None:
                raise KeyNotFound(f"no key {show_key(key)} in pool {self.name!r}")
            if isinstance(got, Exception):
                raise got  # PoolBusy: out of pin records
            ev = EntryView(core, self._views, *((got, got.checksum) if got.__class__ is PIN else got))
            self._views.add(ev)
            return batch.verified(core, ev)
        r = tiers.settled(tiers.pin_live, kb, kh)
        if r.__class__ is not Pinned:
            # A view maps memory: bring the entry in from below first.
            came = tiers.from_below(kb, kh, r) is not None
            r = core.locked(core.pin_live, kb, kh, False) if came else None
            if r is None and came and kb in self:
                raise PoolFull(f"pool {self.name!r}: {show_key(key)} is in a tier below and could not be brought "
                               "into memory to view (the pool is full of pinned entries)")
        if r is None:
            raise KeyNotFound(f"no key {show_key(key)} in pool {self.name!r}")
        # The entry is pinned: its slot (and checksum) cannot change under us.
        ev = EntryView(core, self._views, r, core.checksum(r.slot))
        self._views.add(ev)
        return batch.verified(core, ev)

    def flush_remote(self, timeout: float | None = None) -> bool:
        """Wait until this handle's queued remote writes were sent; False on timeout (True without a remote)."""
        return self.tiers.flush(timeout)

    # ------------------------------------------------------------------ batches (batch.py)

    def put_many(self, items: Any, *, ttl: float | None = None, priority: int = 0) -> list[Exception | None]:
        """Store many (key, value) pairs (a dict or an iterable of pairs) as `put` would.

        Small values (up to 256 KiB) go in first, in one lock hold; larger
        ones are then reserved in one, copied outside it, and sealed in one
        (with a disk tier, key by key).  Returns, per
        pair, None when stored or the error that key met (PoolFull,
        ValueTooLarge, UsageError for a bad key or value).
        """
        out = batch.put_many(self.core, self.tiers, items, ttl, priority)
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved(": what it put went to the old copy")
        return out

    def reserve_write_many(self, items: Any, *, ttl: float | None = None,
                           priority: int = 0) -> list[EntryWriter | Exception]:
        """Reserve room for many values at once (one lock hold): `items` is (key, nbytes) pairs.

        The batched zero-copy put.  Returns, per pair, an EntryWriter to fill
        in place, or the error that key met (PoolFull, ValueTooLarge,
        UsageError for a bad key or size); then `commit_many` the writers (or
        `abort_many` them).  A bad `ttl` or `priority` raises before anything
        is reserved.
        """
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        return batch.reserve_write_many(self.core, self.tiers, items, ttl, priority)

    def commit_many(self, writers: Any, checksums: Any = None) -> list[Exception | None]:
        """Make many reserved values visible in one lock hold (checksums are taken outside it).

        `checksums`: one xxh3_64 per writer, or None per writer (or for all) to
        have them taken here.  Returns, per writer, None when committed or its
        error (PoolBusy if a repair reclaimed the reservation, UsageError if
        already committed or aborted).
        """
        out = batch.commit_many(self.core, self.tiers, writers, checksums)
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved(": what it committed went to the old copy")
        return out

    def abort_many(self, writers: Any) -> None:
        """Give back the space of many uncommitted writers in one lock hold (others are skipped)."""
        batch.abort_many(self.core, writers)

    def get_many_into(self, keys: Any, outs: Any) -> list[int | None | Exception]:
        """Copy the values of many keys into the matching writable buffers of `outs`.

        Returns, per key, the value's length, None if absent, or its error
        (BufferTooSmall, PoolBusy).  Memory hits are pinned in one lock hold,
        copied, and unpinned in one; misses are looked up below (disk, remote)
        key by key.
        """
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        return batch.get_many_into(self.core, self.tiers, keys, outs)

    def view_many(self, keys: Any) -> list[EntryView | None | Exception]:
        """Zero-copy views of many keys, pinned in one lock hold: per key an EntryView, None if absent,
        or its error (PoolBusy: out of pin records).  Release them with `release_many` (one lock hold)
        or one by one."""
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        return batch.view_many(self.core, self.tiers, self._views, self.view, keys)

    def release_many(self, views: Any) -> None:
        """Release many views (those of `view_many`; Nones and errors among them are skipped) in one lock
        hold."""
        batch.release_many(self.core, views)

    def contains_many(self, keys: Any) -> list[bool]:
        """Is each key live in memory or on disk?  One lock hold for all."""
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        return batch.contains_many(self.core, self.tiers, keys)

    def leading(self, keys: Any) -> int:
        """How many leading keys are live in memory or on disk: `contains_many`'s answer up to its first
        False, in one lock hold that stops at the first key not there (a bad key is not there).  A
        `cortex_cache.LookupMemo` remembers such answers per request (docs/python-api.md)."""
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        return lookups.leading(self.core, self.tiers, keys)

    def delete_many(self, keys: Any) -> list[bool]:
        """Remove many keys (from every tier) in one lock hold; per key, True if it was in memory or on disk."""
        out = batch.delete_many(self.core, self.tiers, keys)
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved(": what it deleted was the old copy's")
        return out

    # ------------------------------------------------------------------ delete, membership

    def delete(self, key: str | bytes) -> bool:
        """Remove `key` (from every tier); True if it was in memory or on disk.

        Readers already copying finish safely; the server's copy, if any, is
        deleted in the background.
        """
        kb, _ = key_bytes(key)
        tiers = self.tiers
        found = self.core.locked(tiers.delete, kb, xxh3_64_intdigest(kb))
        if tiers.takes_deletes:
            tiers.offer_delete(kb)
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved(": what it deleted was the old copy's")
        return found

    def __contains__(self, key: object) -> bool:
        try:
            kb, _ = key_bytes(key)  # type: ignore[arg-type]
        except UsageError:
            return False
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        return self.core.locked(self.tiers.contains, kb, xxh3_64_intdigest(kb))

    def __len__(self) -> int:
        """Number of live (sealed, unexpired) entries."""
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        core = self.core
        return int(core.locked(lambda: int(np.count_nonzero(core.live_mask()))))

    def keys(
        self, prefix: str | bytes | None = None, limit: int | None = None, tier: str = "memory"
    ) -> list[str | bytes]:
        """Keys of live entries, oldest insert first (str keys come back as str).

        `tier`: "memory" (default), "disk" (read from the tier's records,
        oldest written first), "all" (memory, then disk-only keys) or "remote"
        (this pool's keys on the remote server, in key order; see `remote_entries`).
        """
        self.tiers.check_tier(tier)
        if tier not in ("memory", "all"):
            self._check_open()
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()
        return self.tiers.keys(key_bytes(prefix)[0] if prefix else b"", limit, tier)

    def remote_entries(self, prefix: str | bytes | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """This pool's entries on the remote server (key, size, ttl_remaining), in key order.

        Asks the server (a SCAN of every primary, then each record's header): UsageError without
        a remote tier, ServiceUnavailable (69) if the server cannot be reached.
        """
        self._check_open()
        return self.tiers.tier("remote").entries(key_bytes(prefix)[0] if prefix else b"", limit)  # type: ignore[attr-defined]

    def _check_open(self) -> None:
        """PoolClosed for a request to a tier below made through a closed handle (its tiers are closed)."""
        if self._closed:
            raise PoolClosed(f"pool {self.name!r} is closed")

    def __iter__(self) -> Iterator[str | bytes]:
        return iter(self.keys())

    def info(self, key: str | bytes) -> dict[str, Any]:
        """Metadata of `key`'s entry (does not count as an access).  Raises KeyNotFound."""
        kb, kh = self._read_key(key)
        r = self.core.locked(self.tiers.info, kb, kh)
        if r is None:
            raise KeyNotFound(f"no key {show_key(key)} in pool {self.name!r}")
        if r["tier"] != "memory":
            r = {"key": key, **r}
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
        self.tiers.check_tier(tier)
        target = check_selector(percent, nbytes, expired, keys, prefix, all)
        kbs = [key_bytes(k)[0] for k in keys] if keys is not None else None
        pb = key_bytes(prefix)[0] if prefix is not None else None
        if tier != "memory":
            self._check_open()
        done = self.tiers.evict(Selector(kbs, pb, all, expired, percent, target), tier)
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved(": what it evicted was the old copy's")
        return done

    # ------------------------------------------------------------------ stats, snapshots, verify

    def stats(self) -> dict[str, Any]:
        """Counters and usage, with the field names of `cortex cache status --json`."""
        core = self.core
        return core.locked(lambda: {**memory_stats(core), **self.tiers.stats()})

    def persist(
        self,
        path: str | os.PathLike | None = None,
        progress: Callable[[int, int], None] | None = None,
        keep: int | None = None,
        full: bool = False,
        replace: bool = True,
    ) -> "os.PathLike":
        """Write an atomic, checksummed snapshot of the live entries; return its path.

        Without `path` it goes to the snapshot directory (CORTEX_CACHE_SNAPSHOT_DIR)
        as a timestamped file, `<name>.ccsnap` names the newest, and as many as
        the pool keeps (`snapshot_keep`, default 3) are kept; a `keep` given
        here is stored with the pool first.  There it is incremental: only the
        values that no kept snapshot holds are written, into a pack beside it
        (`full`: all of them).  With `path`, one self-contained file, which
        replaces one there atomically (`replace=False`: OutputExists, 73,
        instead).  Raises PersistBusy if one is already running.
        """
        if self._words[H_FLAGS] & FLAG_SUPERSEDED:
            self._moved()  # a snapshot of the old copy under the name would retire the pool's own
        return snapshot.write(self.core, self.configuration, path, keep=keep, progress=progress, full=full,
                              replace=replace).path

    @classmethod
    def restore(
        cls,
        path: str | os.PathLike | None = None,
        name: str | None = None,
        replace: bool = False,
        progress: Callable[[int, int], None] | None = None,
        mode: int | None = None,
        trust_tiers: bool = False,
        allow_other_owner: bool = False,
    ) -> "Pool":
        """Rebuild a pool from a snapshot (verified whole first) and return it open.

        Creates the pool from the snapshot's configuration when it does not
        exist; an existing pool only with `replace`, swapped in atomically
        (restore.py).  The snapshot's disk tier, remote tier and retention
        are attached only from a file this user wrote (theirs, in a
        directory of theirs that nobody else may write) or with
        `trust_tiers`; from any other file the entries alone come back.
        `mode` defaults to 0600 (with `replace`, the old pool's).  A pool
        replaced must be this user's or root's unless `allow_other_owner`.
        Raises SnapshotCorrupt (65), SnapshotNotFound (66), PoolExists and
        NoSpace (73), PermissionDenied (77).
        """
        return restore_snapshot(cls, path, name=name, replace=replace, progress=progress, mode=mode,
                                trust_tiers=trust_tiers, allow_other_owner=allow_other_owner)[0]

    @classmethod
    def resize(cls, name: str, size: int | str, *, allow_other_owner: bool = False,
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Grow or shrink live pool `name` to `size` bytes of data; its most recently used entries are kept
        first (those that do not fit are left out).  Built beside it and swapped in whole: the processes
        on it see it superseded and move (`superseded`, `reopen`).  Returns a report (entries, bytes,
        left_out, old_size, size, seconds).  Raises PoolNotFound (66), PersistBusy (75: a persist, restore
        or fill of it runs), NoSpace (73), UsageError (a pool with a disk tier; a bad size)."""
        return resize_pool(cls, name, parse_size(size), allow_other_owner=allow_other_owner, progress=progress)

    def verify(self, repair: bool = False, checksums: bool = True) -> dict[str, Any]:
        """Check the pool's consistency (and fix it with `repair`).

        Returns {"ok": bool, "problems": [...], "repaired": bool, "entries": n}.
        Checksums of all sealed entries are verified unless `checksums=False`;
        with `repair`, an entry whose bytes no longer match is dropped.
        """
        return self.tiers.verify(repair, checksums)



__all__ = ["Pool", "EntryView", "EntryWriter", "check_selector", "default_disk_path", "tier_home", "unlink_marked"]
