"""Atomic, checksummed snapshots of a pool: the file format, its writer and its reader.

`persist.py` holds the public entry points (`persist`, `restore`), and
restore.py builds pools from what this module reads; this module works on a
pool's core (core.py) only, so it sits below `pool.py`.

Snapshot format, version 2 (version 1 is still read).  All integers little-endian::

    file header  FILE_HEAD (320 bytes)
      0   8s  magic b"CRTXSNAP"
      8   u32 version (2; 1 has no configuration block)
      12  u32 header size (320)
      16  f64 created (wall clock of the persist)
      24  u64 pool data size      32  u64 block size     40  u64 max entries
      48  u32 policy id           52  u32 pool flags     56  u32 mode     60 u32 reserved
      64  u64 lfu period
      72  64s pool name (NUL padded)
      136 u64 x 8 counters: seq, hits, misses, puts, deletes, evictions, expirations, bytes evicted
      200 u32 configuration block length (version 2; 0 in version 1)
      204 108 bytes reserved (zero)
      312 u64 xxh3_64 of bytes 0..311
    configuration block (version 2): that many bytes of UTF-8 JSON, the rest of
      the pool's configuration (config.encode: reserve, keep, disk tier, remote
      tier), covered by the file checksum
    records, one per live entry: REC_HEAD (104 bytes), key, value
      0   4s  magic b"CREC"       4  u32 key length      8  u32 flags (bit 0: str key)
      12  u32 reserved            16 u64 value length
      24  f64 created             32 f64 last access     40 f64 expiry (0 = never)
      48  u64 insert seq          56 u64 access seq      64 u64 access count (aged)
      72  i64 priority            80 u64 xxh3_64 of the value
      88  u64 reserved
      96  u64 xxh3_64 of bytes 0..95 of this head plus the key
    trailer TRAILER (32 bytes)
      0   8s  magic b"CRTXEND\\0"  8 u64 record count    16 u64 value bytes
      24  u64 xxh3_64 of every byte of the file before the trailer

Version 3, the incremental snapshot (a manifest): what persist writes into the
snapshot directory.  The values are not in the file but in pack files beside
it (packs.py), shared with the other snapshots of the pool::

    file header  FILE_HEAD, version 3;  configuration block, as version 2
    pack table   PACK_TABLE (8 bytes): u32 packs, u32 reserved; then per pack
      PACK_ENTRY (24 bytes): u64 pack id, u64 file size, u32 name length,
      u32 reserved; then the name (UTF-8: a file in this file's directory)
    records, one per live entry: MAN_REC (104 bytes), key
      as REC_HEAD, magic b"CMRC", and the two reserved words used:
      12  u32 index of the value's pack in the pack table
      88  u64 offset of the value's record in that pack
      96  u64 xxh3_64 of bytes 0..95 of this head plus the key
    trailer      TRAILER, as version 2 (the checksum covers this file only;
                 each value is checked against its own checksum when read)

Writing: a temp file in the target directory (mode 0600, O_EXCL), fsync,
rename over the target, fsync of the directory: a crash at any point leaves
the previous snapshot whole.  Entries are pinned in small batches and copied
without the pool lock, so writers are never blocked for more than the
metadata of one batch.  Reading checks every length against the file's size
and every checksum before a pool anyone can see changes: a new pool is
filled under a temporary name in the same pass and linked under its real
name only when the whole file checked out; an existing pool (replace) is
emptied only after a verification pass of its own.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import xxhash

from . import config, fill, interrupts, packs, safefs, segment
from .core import GUARD, Core
from .errors import (
    OUT_OF_FILES,
    CannotCreate,
    CortexCacheError,
    PermissionDenied,
    PersistBusy,
    PoolBusy,
    SegmentCorrupt,
    SnapshotCorrupt,
    SnapshotNotFound,
    StorageIOError,
    UsageError,
    too_many_open_files,
)
from .layout import FLAG_MULTI_THREADED, MAX_KEY_BYTES, Geometry
from .lock import PERSIST_BYTE, RecordLock
from .policy_names import POLICY_IDS
from .units import plural

MAGIC = b"CRTXSNAP"
VERSION = 2  # a self-contained file (persist --output)
MANIFEST_VERSION = 3  # an incremental snapshot in the snapshot directory, its values in packs
READS = (1, 2, 3)  # versions this code restores
REC_MAGIC = b"CREC"
MAN_MAGIC = b"CMRC"
END_MAGIC = b"CRTXEND\0"
SUFFIX = ".ccsnap"
SNAPSHOT_DIR_ENV = "CORTEX_CACHE_SNAPSHOT_DIR"
DEFAULT_KEEP = 3

FILE_HEAD = struct.Struct("<8sIId QQQ IIII Q 64s 8Q I 108x")
HEAD_CHECK = struct.Struct("<Q")
REC_HEAD = struct.Struct("<4sIII Q ddd QQQ q Q Q")
REC_CHECK = struct.Struct("<Q")
TRAILER = struct.Struct("<8sQQQ")
PACK_TABLE = struct.Struct("<II")
PACK_ENTRY = struct.Struct("<QQI4x")
assert FILE_HEAD.size + HEAD_CHECK.size == 320 and REC_HEAD.size + REC_CHECK.size == 104 and TRAILER.size == 32

COUNTERS = ("seq", "hits", "misses", "puts", "deletes", "evictions", "expirations", "bytes_evicted")
_BATCH_ENTRIES = 64
_BATCH_BYTES = 64 << 20
_STAMP_RE = r"\d{8}T\d{6}\.\d{6}Z"


# ---------------------------------------------------------------- places


def snapshot_dir() -> Path:
    """CORTEX_CACHE_SNAPSHOT_DIR, else $XDG_STATE_HOME/cortex-cache/snapshots, else /var/lib/... for root."""
    return snapshot_places()[1]


def snapshot_places() -> tuple[Path, Path]:
    """(anchor, snapshot directory): the directory, and where the part of its path that must be ours begins.

    Below the anchor every component is checked without following symlinks
    (safefs.check_tree): the state directory itself may be shared (a
    world-writable XDG_STATE_HOME), `cortex-cache/snapshots` in it may not.
    An explicit CORTEX_CACHE_SNAPSHOT_DIR is the operator's path: only its
    last component is checked so.
    """
    env = os.environ.get(SNAPSHOT_DIR_ENV)
    if env:
        d = Path(os.path.abspath(env))
        return d.parent, d
    if os.geteuid() == 0 and not os.environ.get("XDG_STATE_HOME"):
        state = "/var/lib"
    else:
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state), Path(state) / "cortex-cache" / "snapshots"


def checked_snapshot_dir(mode: int = 0o600, make: bool = False) -> Path:
    """The snapshot directory, once every component of it below its anchor checked out (safefs.check_tree).

    A component that is a symlink or not ours alone is PermissionDenied
    (77), one that is not a directory CannotCreate (73).  `mode`: the
    pool's mode (a group pool's directory may be group-writable).  With
    `make`, missing components are made (the last one private: every pool of
    this user shares it), then checked again.
    """
    anchor, directory = snapshot_places()
    safefs.check_tree(anchor, directory, mode, "snapshot directory")
    if make and not os.path.lexists(directory):
        # Every pool of this user shares it, so it is made private whatever this pool's mode: a group
        # pool that made it 0770 would lock every private pool out of it.  A directory the operator
        # opened to the group is still accepted for a group pool.
        safefs.make_dir(directory, 0o600, "snapshot directory")
        safefs.check_tree(anchor, directory, mode, "snapshot directory")
    return directory


def snapshot_file_mode(pool_mode: int) -> int:
    """A snapshot file's mode for a pool of `pool_mode`: 0600, plus read for whom the pool lets read.

    Never writable by anyone but us (a snapshot only we can write is one
    restore trusts), and readable as the pool is, so that restore can bring
    a group pool back with its mode (restore never makes a pool readable by
    more users than its snapshot file is).
    """
    return 0o600 | (pool_mode & 0o044)


def namespaced(name: str) -> str:
    """The stem of what pool `name` owns on disk (snapshots, default disk tier).

    Namespaced like the segment: under another CORTEX_CACHE_SHM_PREFIX than
    the default, the prefix comes first, so two deployments with a pool of
    the same name never share (or rotate away) each other's files.  Under the
    default prefix the stem is the bare name, as it always was.
    """
    p = segment.prefix()
    return name if p == segment.DEFAULT_PREFIX else p + name


def latest_path(name: str, directory: Path | None = None) -> Path:
    """The stable name of pool `name`'s newest snapshot in the snapshot directory."""
    return (directory or snapshot_dir()) / f"{namespaced(name)}{SUFFIX}"


def _stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def _timestamped(name: str, directory: Path, now: float) -> Path:
    return directory / f"{namespaced(name)}-{_stamp(now)}{SUFFIX}"


def _os_error(e: OSError, what: str) -> CortexCacheError:
    if e.errno in OUT_OF_FILES:
        return too_many_open_files(what, e)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"permission denied {what}: {e.strerror}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageIOError(f"no space left {what}")
    return StorageIOError(f"I/O error {what}: {e.strerror or e}")


# ---------------------------------------------------------------- persist


@dataclass
class PersistResult:
    path: Path
    entries: int
    bytes: int  # value bytes the snapshot holds
    seconds: float
    skipped_corrupt: int = 0
    written: int | None = None  # value bytes this persist wrote (an incremental one); None: all of them
    incremental: bool = False

    def as_dict(self) -> dict[str, Any]:
        gbps = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        written = self.bytes if self.written is None else self.written
        return {"path": str(self.path), "entries": self.entries, "bytes": self.bytes,
                "seconds": round(self.seconds, 6), "gbps": round(gbps, 3), "skipped_corrupt": self.skipped_corrupt,
                "written_bytes": written, "incremental": self.incremental}


# Persists running in this process, by pool name: an OFD lock does not
# exclude two threads that share one pool handle (one open file description).
_running: set[str] = set()
_running_guard = threading.Lock()


def write(
    core: Core,
    configuration: Callable[[], dict[str, Any]],
    path: str | os.PathLike | None = None,
    keep: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    full: bool = False,
    replace: bool = True,
) -> PersistResult:
    """Write a snapshot of the live entries of the pool of `core`.

    `configuration()` (run with the lock held) gives the pool's whole
    configuration as `Pool.configuration` does; its rest beyond the file
    header goes into the configuration block.  With `path`, write exactly
    that file (self-contained, version 2).  Without, write an incremental
    snapshot (version 3) in the snapshot directory: a timestamped manifest
    and a pack of the values no kept snapshot holds (`full`: of every value,
    sharing nothing), point `<name>.ccsnap` at it and keep the newest
    timestamped snapshots of the pool: as many as the pool keeps (its
    header's `snapshot_keep`, default 3), with the packs they refer to.  A `keep` given here is stored with the pool first, so every
    later persist keeps as many.  A `path` that exists is replaced
    atomically, or with `replace=False` refused (OutputExists, 73: the
    CLI's rule for -o).  Raises PersistBusy
    (exit 75) if another persist of this pool is running, PermissionDenied,
    StorageIOError (disk full, I/O error); on any error the previous snapshot
    is untouched and no temp file is left.
    """
    if keep is not None and keep < 1:
        raise UsageError(f"--keep must be at least 1, not {keep}")
    if path is not None and keep is not None:
        raise UsageError("--keep applies to the snapshot directory; it cannot be combined with --output")
    if path is not None and full:
        raise UsageError("--output always writes a complete, self-contained snapshot; --full is for the snapshot "
                         "directory")
    if keep is not None:
        check_settings_owner(core, "change its retention (--keep)", f"it keeps {int(core.fields.snapshot_keep[0]) or DEFAULT_KEEP}")
    with _running_guard:
        if core.name in _running:
            raise PersistBusy(f"a persist of pool {core.name!r} is already running")
        _running.add(core.name)
    try:
        lock = RecordLock(core.seg.fd, PERSIST_BYTE)
        if not lock.take_soon():  # another process persists (or restores) this pool
            raise busy(core.seg.fd, core.name, "persist")
        try:
            waiting = fill.busy_reason(core, followed)
            if waiting is not None:
                raise PersistBusy(waiting)
            if keep is not None:
                core.fields.snapshot_keep[0] = keep
            return _persist_locked(core, configuration, path, progress, full, replace)
        finally:
            lock.release()
    finally:
        with _running_guard:
            _running.discard(core.name)


# Held by a restore --replace beside PERSIST_BYTE (which excludes persists and other restores), so
# that whoever finds PERSIST_BYTE taken can say which of the two runs.
RESTORE_BYTE = 2


def busy(fd: int, name: str, doing: str) -> PersistBusy:
    """The error for a `doing` (persist, restore) of pool `name` (its segment's `fd`) that found PERSIST_BYTE taken."""
    probe = RecordLock(fd, RESTORE_BYTE)
    if probe.try_acquire():
        probe.release()
        running = "a persist"
    else:
        running = "a restore"
    return PersistBusy(f"{running} of pool {name!r} is already running; {doing} it again when it is done")


def is_owner(core: Core) -> bool:
    """Whether this process's user owns the pool's segment (read on its descriptor), or is root."""
    return os.geteuid() in (0, core.seg.stat().st_uid)


def check_settings_owner(core: Core, what: str, instead: str) -> None:
    """PermissionDenied (77) unless this process's user owns the pool's segment (or is root).

    Settings stored in the pool's header outlive the command and bind
    every user of the pool: only its owner may change them (root may too:
    it can write the header anyway).  The owner is read on the segment's
    descriptor, never from the header, which any writer of the pool can forge.
    """
    if not is_owner(core):
        owner, me = core.seg.stat().st_uid, os.geteuid()
        raise PermissionDenied(
            f"only the owner of pool {core.name!r} (uid {owner}) may {what}; you are uid {me} ({instead})"
        )


def _persist_locked(core: Core, configuration, path, progress, full: bool = False,
                    replace: bool = True) -> PersistResult:
    t0 = time.perf_counter()
    now = time.time()
    if path is None:
        directory = snapshot_dir()
        target = _timestamped(core.name, directory, now)
    else:
        target = Path(path)
        directory = target.parent if str(target.parent) else Path(".")
        safefs.refuse_existing(str(target), replace)  # a directory, or a file not to be replaced
    pool_mode = core.seg.stat().st_mode & 0o777
    if path is None:  # our own directory: make it (private), and refuse one others could plant files in
        checked_snapshot_dir(pool_mode, make=True)
    elif not directory.is_dir():
        raise CannotCreate(f"cannot create {str(target)!r}: no directory {str(directory)!r}")
    _clean_stale_temps(directory, namespaced(core.name), target.name)
    if path is None:
        packs.sweep_temps(namespaced(core.name), directory)
    tmp = directory / f".{target.name}.tmp-{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise _os_error(e, f"writing in {str(directory)!r}") from None
    try:
        if snapshot_file_mode(pool_mode) != 0o600:
            os.fchmod(fd, snapshot_file_mode(pool_mode))  # a group pool's snapshot is readable by its group
            gid = core.seg.stat().st_gid
            if pool_mode & 0o060 and gid != os.fstat(fd).st_gid:
                try:  # and in its group, which restore gives the pool back
                    os.fchown(fd, -1, gid)
                except PermissionError:
                    pass
        incremental = None
        with os.fdopen(fd, "wb", buffering=1 << 20) as raw:
            f = WriteBehind(raw)
            if path is None:
                incremental = _Incremental(core, directory, now, full, snapshot_file_mode(pool_mode),
                                           int(core.fields.snapshot_keep[0]) or DEFAULT_KEEP)
                data, entries, nbytes, skipped = incremental.write(configuration, progress)
                f.write(data)
            else:
                entries, nbytes, skipped = _write_snapshot(core, configuration, f, now, progress)
            f.finish()
            os.fsync(raw.fileno())
        with interrupts.commit():  # renamed into place: a signal now waits, and the persist reports success
            if path is None:
                os.rename(tmp, target)
            else:
                safefs.publish(str(tmp), str(target), replace)
            if path is None:
                _link_latest(target, latest_path(core.name, directory))
            _fsync_dir(directory)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and not isinstance(e, CortexCacheError):
            raise _os_error(e, f"writing {str(target)!r}") from None
        raise
    if incremental is not None:
        incremental.after()

    def note() -> None:
        core.header["last_snapshot"] = now

    if is_owner(core):  # another user's snapshot (in their directory) is not the owner's last one
        core.locked(note)
    written = None if incremental is None else incremental.written
    return PersistResult(target, entries, nbytes, time.perf_counter() - t0, skipped, written, path is None)


class WriteBehind:
    """A file writer that starts writeback as it goes (Linux `sync_file_range`).

    Every WINDOW bytes it asks the kernel to start writing the window just
    filled, waits for the one before it, and drops that one from the page
    cache.  The disk then works while we still hash and copy, the final fsync
    has little left to do, and a multi-GiB snapshot does not flood the page
    cache.  Where `sync_file_range` is missing it is a plain buffered writer.

    At most two windows are handed to the disk and not yet written: what a
    read by any other process (a command starting, its modules not in the
    page cache) may queue behind.  64 MiB windows made that up to 128 MiB --
    a second `persist` or a `status` started during a long persist waited
    seconds for its own imports on a slow disk (p90 read latency 10-11 ms
    here, on a 2 GB/s disk); 8 MiB windows wait 1.9 ms and write as fast.
    """

    WINDOW = 8 << 20
    _START, _WAIT = 2, 1 | 2 | 4  # SYNC_FILE_RANGE_WRITE; WAIT_BEFORE | WRITE | WAIT_AFTER

    def __init__(self, raw) -> None:
        self.raw = raw
        self.fd = raw.fileno()
        self.written = 0
        self.started = 0  # bytes handed to writeback so far
        self._sfr = _sync_file_range()

    def write(self, data) -> None:
        self.raw.write(data)
        self.written += len(data)
        if self._sfr is not None and self.written - self.started >= self.WINDOW:
            self.raw.flush()
            end = self.written - self.written % self.WINDOW
            if self.started >= self.WINDOW:  # the previous window: finish it, forget it
                prev = self.started - self.WINDOW
                self._sfr(self.fd, prev, self.WINDOW, self._WAIT)
                os.posix_fadvise(self.fd, prev, self.WINDOW, os.POSIX_FADV_DONTNEED)
            self._sfr(self.fd, self.started, end - self.started, self._START)
            self.started = end

    def finish(self) -> None:
        self.raw.flush()


def _sync_file_range():
    """libc's sync_file_range as a callable, or None where it is not available."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def call(fd: int, offset: int, nbytes: int, flags: int) -> None:
        if fn(fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return call


def pool_config(core: Core) -> dict[str, Any]:
    """The pool configuration a snapshot records (lock held)."""
    h = core.header[0]
    return {
        "name": core.name.encode(),
        "size": core.geometry.data_size,
        "block_size": core.geometry.block_size,
        "max_entries": core.geometry.n_slots,
        "policy": int(h["policy"]),
        "flags": int(h["flags"]) & FLAG_MULTI_THREADED,
        "mode": core.seg.stat().st_mode & 0o777,
        "lfu_period": int(h["lfu_period"]),
        "counters": {c: int(h[c]) for c in COUNTERS},
    }


class SnapshotEntry(NamedTuple):
    """What a snapshot records of one pinned live entry."""

    pin: int
    slot: int
    key: bytes
    flags: int
    offset: int
    length: int
    created: float
    last_access: float
    expiry: float
    insert_seq: int
    access_seq: int
    access_count: int  # aged to the current LFU epoch
    priority: int
    checksum: int
    copy: bytes | None = None  # the value, copied under the lock when no pin record was free (pin -1)


def _pin_entries(core: Core, slots: list[int]) -> list[SnapshotEntry]:
    """Pin the still-live entries among `slots`; what a snapshot records of each (lock held)."""
    out = []
    c = core.columns
    epoch = int(core.fields.lfu_epoch[0])
    for i in slots:
        if not core.is_sealed(i) or core.expired(i):
            continue
        age = epoch - int(c["lfu_epoch"][i])
        try:
            off, vlen = core.value_at(i)  # each field read once and checked
        except SegmentCorrupt:
            continue  # impossible metadata (damage, or a writer of the segment): not snapshotted
        try:
            pin, copy = core.pin(i), None
        except PoolBusy:
            # Every pin record is taken (a process holding many views, or records forged by a writer of
            # the segment): copy this value now, under the lock, so a persist never depends on the pin
            # table having room.  Writers wait for one value's copy, as they may for a pinned one's.
            pin, copy = -1, bytes(core.mv[off : off + vlen])
        out.append(SnapshotEntry(
            pin, i, core.key_bytes(i), int(c["flags"][i]), off, vlen,
            float(c["created"][i]), float(c["last_access"][i]), float(c["expiry"][i]), int(c["insert_seq"][i]),
            int(c["access_seq"][i]), int(c["access_count"][i]) >> min(63, age), int(c["priority"][i]),
            core.checksum(i), copy,
        ))
    return out


def _record_head(e: SnapshotEntry) -> bytes:
    return REC_HEAD.pack(
        REC_MAGIC, len(e.key), e.flags, 0, e.length, e.created, e.last_access, e.expiry, e.insert_seq,
        e.access_seq, e.access_count, e.priority, e.checksum, 0,
    )


def _file_head(core: Core, configuration, now: float, version: int) -> tuple[bytes, bytes]:
    """The file header (with its checksum) and the configuration block of a snapshot of `core`'s pool."""
    cfg = core.locked(pool_config, core)
    block = config.encode({**core.locked(configuration), "created": float(core.header[0]["created"])})
    head = FILE_HEAD.pack(
        MAGIC, version, FILE_HEAD.size + HEAD_CHECK.size, now,
        cfg["size"], cfg["block_size"], cfg["max_entries"], cfg["policy"], cfg["flags"], cfg["mode"], 0,
        cfg["lfu_period"], cfg["name"], *[cfg["counters"][c] for c in COUNTERS], len(block),
    )
    return head + HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(head)), block


class _Skipped:
    count = 0


def _live_values(core: Core, skipped: _Skipped, held: Any = None) -> Iterator[tuple[SnapshotEntry, Any]]:
    """Every live entry at the start, the most recently used first (the fill's order), with its value (a view of the pinned bytes, good
    until the next item): entries put later are not part of the snapshot, entries deleted meanwhile are
    skipped, and so (counted in `skipped`) are values whose bytes fail their checksum in memory.  An entry
    whose (key, length, checksum) is in `held` comes with None: a snapshot already has its bytes, checked
    against that checksum when written (and again when read back), so they are neither read nor hashed."""
    def live() -> tuple[Any, Any]:
        order = core.live_most_recent_first()
        return order, core.columns["value_len"][order].copy()

    order, sizes = core.locked(live)
    k = 0
    while k < len(order):
        batch_slots = []
        batch_bytes = 0
        while k < len(order) and len(batch_slots) < _BATCH_ENTRIES and batch_bytes < _BATCH_BYTES:
            batch_slots.append(int(order[k]))
            batch_bytes += int(sizes[k])
            k += 1
        batch = core.locked(_pin_entries, core, batch_slots)
        try:
            for e in batch:
                if held is not None and (e.key, e.length, e.checksum) in held:
                    yield e, None
                    continue
                value = core.mv[e.offset : e.offset + e.length] if e.copy is None else e.copy
                if xxhash.xxh3_64_intdigest(value) != e.checksum:
                    skipped.count += 1  # bytes damaged in memory: never write them as good
                    continue
                yield e, value
        finally:
            core.locked(core.unpin_batch, [e for e in batch if e.pin >= 0])


def _live_total(core: Core) -> int:
    return int(core.locked(lambda: core.columns["value_len"][core.live_mask()].sum()))


def _write_snapshot(core: Core, configuration, f, now: float, progress) -> tuple[int, int, int]:
    """Write a self-contained snapshot (version 2) to `f`; return (entries, value bytes, skipped)."""
    file_hash = xxhash.xxh3_64()

    def out(data) -> None:
        f.write(data)
        file_hash.update(data)

    head, block = _file_head(core, configuration, now, VERSION)
    out(head)
    out(block)
    total = _live_total(core) if progress is not None else 0
    entries = nbytes = 0
    skipped = _Skipped()
    for e, value in _live_values(core, skipped):
        head_bytes = _record_head(e)
        out(head_bytes + REC_CHECK.pack(xxhash.xxh3_64_intdigest(head_bytes + e.key)))
        out(e.key)
        out(value)
        entries += 1
        nbytes += e.length
        if progress is not None:
            progress(nbytes, total)
    f.write(TRAILER.pack(END_MAGIC, entries, nbytes, file_hash.intdigest()))
    return entries, nbytes, skipped.count


class _Kept(NamedTuple):
    """A kept incremental snapshot, read: its file, the bytes before its pack table (header and
    configuration, kept as they are when it is rewritten), and its records with where their values are."""

    path: Path
    prefix: bytes
    refs: list  # (Reference, PackRef, offset)


def _read_kept(paths: list[Path], directory: Path) -> list[_Kept]:
    """The incremental snapshots among `paths` that check out (the manifest whole, every pack there with the
    size it gives and its header whole); the others are left as they are: not shared from, not rewritten.
    The values in the packs are not read here: a value damaged on disk after it was written is found when
    a snapshot naming it is restored or checked (`cortex cache snapshots NAME --verify`)."""
    out = []
    for path in paths:
        try:
            with Snapshot(path, verify=False, private=True) as snap:
                if snap.header.version != MANIFEST_VERSION:
                    continue
                snap.verify_manifest()
                if not all(_pack_there(directory, r) for r in snap.pack_refs):
                    continue
                snap.open_packs()  # each pack's header checked (its values are checked when read back)
                out.append(_Kept(path, bytes(snap._mv[: snap.pack_table_off]), list(snap.references())))
        except CortexCacheError:
            continue
    return out


def _pack_there(directory: Path, ref: packs.PackRef) -> bool:
    try:
        st = (directory / ref.name).stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == ref.size and st.st_uid == os.geteuid()


def _manifest(prefix: bytes, records: list[tuple[Any, packs.PackRef, int]]) -> bytes:
    """A version 3 file: `prefix` (file header and configuration block), the pack table of the packs the
    records name, the records (an entry's fields -- a SnapshotEntry or a Reference -- its pack and the offset
    of its value's record there), the trailer."""
    index: dict[str, int] = {}
    table: list[packs.PackRef] = []
    body = bytearray()
    nbytes = 0
    for e, ref, off in records:
        if ref.name not in index:
            index[ref.name] = len(table)
            table.append(ref)
        length = e.length
        head = REC_HEAD.pack(
            MAN_MAGIC, len(e.key), e.flags, index[ref.name], length, e.created, e.last_access, e.expiry,
            e.insert_seq, e.access_seq, e.access_count, e.priority, e.checksum, off,
        )
        body += head + REC_CHECK.pack(xxhash.xxh3_64_intdigest(head + e.key)) + e.key
        nbytes += length
    out = bytearray(prefix)
    out += PACK_TABLE.pack(len(table), 0)
    for ref in table:
        name = ref.name.encode()
        out += PACK_ENTRY.pack(ref.pack_id, ref.size, len(name)) + name
    out += body
    out += TRAILER.pack(END_MAGIC, len(records), nbytes, xxhash.xxh3_64_intdigest(out))
    return bytes(out)


class _Incremental:
    """One incremental persist into the snapshot directory (version 3), in the order that keeps every kept
    snapshot restorable whatever the kill point:

    1. `write`: the live values no kept snapshot holds, and the records of mostly dead packs that the
       snapshots kept after this one still need (compaction), go into a new pack, flushed to disk and
       renamed into place, the directory flushed; then the manifest's bytes, which the caller writes,
       flushes and renames into place;
    2. `after`: each kept snapshot that pointed into a compacted pack is rewritten (temp file, flush,
       rename) to point at the copies; retention then deletes the snapshots beyond `keep` and every pack
       no kept snapshot names.
    """

    def __init__(self, core: Core, directory: Path, now: float, full: bool, mode: int, keep: int) -> None:
        self.core, self.directory, self.now, self.full, self.mode, self.keep = core, directory, now, full, mode, keep
        self.stem = namespaced(core.name)
        self.remap: dict[tuple[str, int], int] = {}  # (compacted pack, offset) -> offset in the new pack
        self.new_ref = packs.PackRef(packs.pack_name(self.stem, _stamp(now)), int(round(now * 1e6)), 0)
        self.staying: list[_Kept] = []
        self.written = 0

    def write(self, configuration, progress) -> tuple[bytes, int, int, int]:
        """(manifest bytes, entries, value bytes, skipped), the new pack durable."""
        core, directory = self.core, self.directory
        # Shared from: every snapshot there (one that retention deletes after this persist leaves the packs
        # the new one names).  Compacted for: those retention keeps beside the new one.
        kept = _read_kept(_timestamped_files(self.stem, directory), directory)
        survivors = set(_timestamped_files(self.stem, directory)[-(self.keep - 1):] if self.keep > 1 else [])
        self.staying = [k for k in kept if k.path in survivors]
        held: dict[tuple[bytes, int, int], tuple[packs.PackRef, int]] = {}
        if not self.full:
            for k in reversed(kept):  # the newest first
                for ref, pack, off in k.refs:
                    held.setdefault((ref.key, ref.length, ref.checksum), (pack, off))
        writer: packs.PackWriter | None = None
        records: list[tuple[Any, packs.PackRef, int]] = []
        total = _live_total(core) if progress is not None else 0
        nbytes = 0
        skipped = _Skipped()
        try:
            for e, value in _live_values(core, skipped, held):
                h = None if value is not None else held[(e.key, e.length, e.checksum)]
                if h is None:
                    if writer is None:
                        writer = self._writer()
                    records.append((e, self.new_ref, writer.add(e.key, value, e.checksum)))
                    self.written += e.length
                else:
                    records.append((e, *h))
                nbytes += e.length
                if progress is not None:
                    progress(nbytes, total)
            writer = self._compact(records, writer)
            if writer is not None:
                writer.finish()
                self.new_ref.size = writer.size
                _fsync_dir(directory)  # the pack's name is on disk before any manifest that names it
        except BaseException:
            if writer is not None:
                writer.discard()
            raise
        head, block = _file_head(core, configuration, self.now, MANIFEST_VERSION)
        return _manifest(head + block, self._remapped(records)), len(records), nbytes, skipped.count

    def _writer(self) -> packs.PackWriter:
        return packs.PackWriter(self.directory / self.new_ref.name, self.new_ref.pack_id, self.now, self.mode,
                                WriteBehind)

    def _compact(self, records: list, writer: packs.PackWriter | None) -> packs.PackWriter | None:
        """Copy into the new pack the records still needed of every pack that the snapshots kept after this
        persist refer to for less than packs.COMPACT_BELOW of its bytes, so that it can go.  A pack one of
        whose records does not check out is left as it is (the snapshots naming it keep naming it)."""
        needed: dict[str, dict[int, Any]] = {}  # pack -> offset -> the record's fields
        sizes: dict[str, packs.PackRef] = {}
        for rows in [records] + [k.refs for k in self.staying]:
            for e, pack, off in rows:
                if pack is not self.new_ref:
                    needed.setdefault(pack.name, {})[off] = e
                    sizes[pack.name] = pack
        used = {name: sum(packs.REC_SIZE + len(e.key) + e.length for e in offs.values())
                for name, offs in needed.items()}
        share = packs.live_share({n: r.size for n, r in sizes.items()}, used)
        for name in sorted(n for n, f in share.items() if f < packs.COMPACT_BELOW):
            try:
                reader = packs.PackReader(self.directory, sizes[name], self.directory / name, True, GUARD)
            except CortexCacheError:
                continue
            copies: list = []
            try:
                copies = [(off, e, reader.value(off, e.key, e.length, e.checksum, reader.path, check_value=True))
                          for off, e in sorted(needed[name].items())]
                if writer is None:
                    writer = self._writer()
                for off, e, value in copies:
                    self.remap[(name, off)] = writer.add(e.key, value, e.checksum)
                    self.written += e.length
                if reader.cut_short():  # what it copied may be zeros: those copies are never pointed at
                    self.remap = {k: v for k, v in self.remap.items() if k[0] != name}
            except CortexCacheError:
                continue
            finally:
                del copies
                reader.close()
        return writer

    def _remapped(self, records: list) -> list:
        return [(e, self.new_ref, self.remap[(pack.name, off)]) if (pack.name, off) in self.remap else (e, pack, off)
                for e, pack, off in records]

    def after(self) -> None:
        """Once the new manifest is in place: point the kept snapshots at the compacted copies, then retention."""
        directory = self.directory
        if self.remap:
            for kept in self.staying:
                if not any((pack.name, off) in self.remap for _, pack, off in kept.refs):
                    continue
                data = _manifest(kept.prefix, self._remapped(kept.refs))
                tmp = directory / f".{kept.path.name}.tmp-{secrets.token_hex(6)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    st = kept.path.stat()
                    os.fchmod(fd, stat.S_IMODE(st.st_mode))  # as persist made it: the pool's group may read it
                    if st.st_gid != os.fstat(fd).st_gid:
                        try:
                            os.fchown(fd, -1, st.st_gid)
                        except PermissionError:
                            pass
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.rename(tmp, kept.path)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except FileNotFoundError:
                        pass
                    raise
            _fsync_dir(directory)  # the rewritten snapshots are on disk before the packs they left go
        _prune(self.core.name, directory, self.keep)


# A temp file of a persist in our snapshot directory: ".STEM[-STAMP].ccsnap.tmp-XXXXXXXXXXXX" or a pack's
# ".STEM-STAMP.ccpack.tmp-XXXXXXXXXXXX" (STEM the
# namespaced pool name): what `_clean_stale_temps` sweeps for one pool, and `doctor` reports for all.
TEMP_RE = re.compile(r"^\.(?P<stem>.+?)(?:-" + _STAMP_RE + r")?(?:" + re.escape(SUFFIX) + "|" + re.escape(packs.PACK_SUFFIX)
                     + r")\.tmp-[0-9a-f]{12}$")


def _clean_stale_temps(directory: Path, pool_name: str, target_name: str) -> None:
    """Remove temp files that a killed persist of this pool left (we hold its persist lock).

    `pool_name` is the namespaced stem of the pool's files."""
    tmp = r"\.tmp-[0-9a-f]{12}$"
    patterns = [
        re.compile(r"^\." + re.escape(target_name) + tmp),  # an explicit --output
        re.compile(r"^\." + re.escape(pool_name) + "-" + _STAMP_RE + re.escape(SUFFIX) + tmp),  # timestamped
        re.compile(r"^\." + re.escape(pool_name) + re.escape(SUFFIX) + tmp),  # the latest link
    ]
    try:
        for entry in os.scandir(directory):
            if any(p.match(entry.name) for p in patterns):
                try:
                    if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                        continue  # not ours (a shared --output directory): never touched
                    os.unlink(entry.path)  # a symlink goes itself, never what it points at
                except OSError:
                    pass
    except OSError:
        pass


def _link_latest(target: Path, latest: Path) -> None:
    """Point the stable name at `target` atomically (a hard link renamed into place)."""
    tmp = latest.parent / f".{latest.name}.tmp-{secrets.token_hex(6)}"
    os.link(target, tmp)
    try:
        os.rename(tmp, latest)
    except BaseException:
        os.unlink(tmp)
        raise


def _fsync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def snapshots_of(name: str, directory: Path | None = None) -> list[Path]:
    """Timestamped snapshots of pool `name` in the directory, oldest first."""
    return _timestamped_files(namespaced(name), directory or snapshot_dir())


def _timestamped_files(stem: str, directory: Path) -> list[Path]:
    pattern = re.compile(r"^" + re.escape(stem) + r"-" + _STAMP_RE + re.escape(SUFFIX) + r"$")
    try:
        return sorted(p for p in directory.iterdir() if pattern.match(p.name))
    except (FileNotFoundError, NotADirectoryError):  # none yet, or a file in the way (persist says so: 73)
        return []


def list_snapshots(name: str, directory: Path | None = None, verify: bool = False) -> list[dict[str, Any]]:
    """Every snapshot of pool `name` in the snapshot directory, oldest first.

    Each: path, time (of the persist), bytes (the file's size: a manifest's,
    for an incremental snapshot), entries, value_bytes, own_bytes (on disk
    for this snapshot alone: its file and the pack records no other snapshot
    refers to), shared_bytes (pack records it shares with others), latest
    (what `NAME.ccsnap` names), version and configuration (the remote URL
    redacted); a file that cannot be read has "error" instead of the figures.
    Manifests are read (not the packs, nor the values of version 2 files): this
    never touches a pool.  With `verify`, every snapshot is also read whole and
    each value checked ("verified": True, or "error" saying what is damaged).
    """
    return snapshots_and_space(name, directory, verify)[0]


def snapshot_space(name: str, directory: Path | None = None) -> dict[str, Any]:
    """What pool `name`'s snapshots take on disk: their files (manifests, version 2 files), the packs,
    the total; what the kept snapshots need of it (their files and every pack record one of them refers
    to); the largest kept snapshot as a self-contained file would be; and total / needed ("waste_ratio",
    which compaction keeps within SPACE_BOUND) and total / largest ("ratio")."""
    return snapshots_and_space(name, directory)[1]


def snapshots_and_space(name: str, directory: Path | None = None,
                        verify: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`list_snapshots` and `snapshot_space` from one reading of the manifests."""
    directory = directory or snapshot_dir()
    latest = latest_path(name, directory)
    try:
        latest_ino = latest.stat().st_ino
    except OSError:
        latest_ino = None
    rows: list[dict[str, Any]] = []
    refs: list[set[tuple[str, int, int]]] = []  # per row: (pack, offset, record bytes) it refers to
    for path in snapshots_of(name, directory):
        row: dict[str, Any] = {"path": str(path)}
        mine: set[tuple[str, int, int]] = set()
        try:
            st = path.stat()
            row["bytes"] = st.st_size
            row["latest"] = st.st_ino == latest_ino
            with Snapshot(path, verify=False) as snap:
                h = snap.header
                row.update(time=h.created, entries=snap.entries, value_bytes=snap.value_bytes, version=h.version,
                           size_bytes=h.size, policy=h.policy,
                           configuration=config.redacted(h.config) if h.config else None)
                if h.version == MANIFEST_VERSION:
                    for rec, pack, off in snap.references():
                        mine.add((pack.name, off, packs.REC_SIZE + len(rec.key) + rec.length))
                if verify:
                    snap.verify()
                    row["verified"] = True
        except SnapshotNotFound:
            continue  # rotated away meanwhile
        except (CortexCacheError, OSError) as e:
            row["error"] = str(e)
        rows.append(row)
        refs.append(mine)
    counts: dict[tuple[str, int, int], int] = {}
    for mine in refs:
        for r in mine:
            counts[r] = counts.get(r, 0) + 1
    for row, mine in zip(rows, refs):
        if "error" not in row:
            row["own_bytes"] = row["bytes"] + sum(r[2] for r in mine if counts[r] == 1)
            row["shared_bytes"] = sum(r[2] for r in mine if counts[r] > 1)
    files = sum(r.get("bytes", 0) for r in rows)
    pack_bytes = sum(_size(p) for p in packs.packs_of(namespaced(name), directory))
    largest = max((r["own_bytes"] + r["shared_bytes"] for r in rows if "error" not in r), default=0)
    needed = files + sum(r[2] for r in counts)
    total = files + pack_bytes
    return rows, {"snapshot_file_bytes": files, "pack_bytes": pack_bytes, "total_bytes": total,
                  "needed_bytes": needed, "largest_bytes": largest, "ratio": total / largest if largest else None,
                  "waste_ratio": total / needed if needed else None}


# Disk used by a pool's snapshots over what they need: compaction keeps it within this (doctor flags more).
SPACE_BOUND = 1.5


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def snapshot_usage(name: str, directory: Path | None = None) -> dict[str, Any]:
    """Count and total bytes of pool `name`'s snapshots (with the packs they keep), and the latest one's
    time and bytes (None: none).

    From the directory listing alone (no file is read): cheap enough for every `status`.
    """
    directory = directory or snapshot_dir()
    files = snapshots_of(name, directory)
    total = sum(_size(f) for f in files) + sum(_size(p) for p in packs.packs_of(namespaced(name), directory))
    try:
        st = latest_path(name, directory).stat()
        last_time, last_bytes = st.st_mtime, st.st_size
    except OSError:
        last_time = last_bytes = None
    return {"directory": str(directory), "count": len(files), "bytes": total, "latest_time": last_time,
            "latest_bytes": last_bytes}


def prune(name: str, keep: int, core: Core | None = None) -> dict[str, Any]:
    """Remove pool `name`'s snapshots in the snapshot directory but the newest `keep`, then every pack no
    remaining one refers to; `keep=0` removes them all, `NAME.ccsnap` too (nothing is left to restore).
    What a persist's retention does, asked for by hand: for snapshots piled up under an older retention,
    or left by a pool that is gone.

    `core`: the pool, when it exists; the work then runs under its persist lock, so no persist, restore
    or fill of it runs meanwhile (PersistBusy, 75).  Returns removed (paths), kept (how many) and
    freed_bytes.  Only this user's files are removed."""
    if keep < 0:
        raise UsageError(f"--keep must be at least 0, not {keep}")
    directory = checked_snapshot_dir()
    if not directory.is_dir():
        return {"removed": [], "kept": 0, "freed_bytes": 0}
    lock = None
    if core is not None:
        lock = RecordLock(core.seg.fd, PERSIST_BYTE)
        if not lock.take_soon():
            raise PersistBusy(f"a persist or restore of pool {name!r} is running; prune its snapshots when it is done")
    try:
        if core is not None:
            waiting = fill.busy_reason(core, followed)
            if waiting is not None:
                raise PersistBusy(waiting)
        stem = namespaced(name)
        latest = latest_path(name, directory)
        names = [*snapshots_of(name, directory), *packs.packs_of(stem, directory)]
        # NAME.ccsnap is a second name of the newest snapshot: listed when it goes, its bytes counted once.
        before = {p: _size(p) for p in names} | ({latest: 0} if latest.exists() else {})
        if keep == 0 and latest.exists():
            _unlink_ours(latest)
        if keep == 0:
            for old in snapshots_of(name, directory):
                _unlink_ours(old)
            packs.remove_unreferenced(stem, directory, ())
        else:
            _prune(name, directory, keep)
        _fsync_dir(directory)
        after = {*snapshots_of(name, directory), *packs.packs_of(stem, directory), *[latest] * latest.exists()}
    finally:
        if lock is not None:
            lock.release()
    removed = sorted(p for p in before if p not in after)
    return {"removed": [str(p) for p in removed], "kept": len(snapshots_of(name, directory)),
            "freed_bytes": sum(before[p] for p in removed)}


def _unlink_ours(path: Path) -> None:
    try:
        if path.lstat().st_uid == os.geteuid():
            path.unlink()
    except FileNotFoundError:
        pass


def _prune(name: str, directory: Path, keep: int) -> None:
    """Retention: the newest `keep` snapshots stay; then every pack that no manifest a name reaches -- a kept
    one, or whatever `NAME.ccsnap` names -- refers to goes.  A pack is deleted only once no such manifest
    names it, so a kill anywhere in here leaves every kept snapshot whole (what it did not get to, the next
    persist does).  A persist killed between renaming its manifest into place and linking `NAME.ccsnap` to it
    left that name on an older snapshot: it is pointed at the newest first (what the persist meant)."""
    latest = latest_path(name, directory)
    stamped = snapshots_of(name, directory)
    if stamped:
        _repair_latest(stamped[-1], latest)
    for old in stamped[:-keep]:
        try:
            old.unlink()
        except FileNotFoundError:
            pass
    referenced: set[str] = set()
    for path in [*snapshots_of(name, directory), latest]:
        try:
            with Snapshot(path, verify=False, private=True) as snap:
                referenced.update(r.name for r in snap.pack_refs)
        except SnapshotNotFound:
            continue
        except CortexCacheError:
            # A kept manifest that cannot be read: keep every pack (what it names cannot be known).
            return
    packs.remove_unreferenced(namespaced(name), directory, referenced)


def _repair_latest(newest: Path, latest: Path) -> None:
    """Point `latest` (NAME.ccsnap) at `newest`, the newest timestamped snapshot, if it names none or an older
    one and `newest` is a whole manifest of ours (it was renamed into place only once written and flushed)."""
    try:
        if latest.exists() and latest.stat().st_ino == newest.stat().st_ino:
            return
        with Snapshot(newest, verify=False, private=True) as snap:
            snap.check_manifest_file()
        _link_latest(newest, latest)
    except (CortexCacheError, OSError):
        pass  # left as it is: retention then keeps what it names


# ---------------------------------------------------------------- read and verify


@dataclass
class SnapshotHeader:
    created: float
    size: int
    block_size: int
    max_entries: int
    policy: str
    flags: int
    mode: int
    lfu_period: int
    name: str
    counters: dict[str, int]
    version: int = VERSION
    # The rest of the configuration (config.decode); a version 1 file has
    # none: no tiers, default retention.
    config: dict[str, Any] | None = None


@dataclass
class Record:
    key: bytes
    flags: int
    value: memoryview
    created: float
    last_access: float
    expiry: float
    insert_seq: int
    access_seq: int
    access_count: int
    priority: int
    checksum: int


class Snapshot:
    """A snapshot file, mapped read-only and verified whole on open.

    Raises SnapshotNotFound (66), SnapshotCorrupt (65: truncated, damaged,
    foreign or of a newer version), PermissionDenied (77).
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True, private: bool | str = False) -> None:
        """Map `path` and check its header; with `verify` (default) check the whole file now.

        Without `verify` only the header and the trailer's place are checked:
        the caller must then read every record through `records(hasher=...)`
        and call `check_trailer` before trusting anything it read.  Anything
        but a regular file (a FIFO, a device) is refused before a read could
        block on it; with `private` (a file of our snapshot directory) so is
        a symbolic link or a file that is not ours (PermissionDenied, 77);
        safefs.FOLLOWED: the stricter rules of safefs.open_read, for its packs too.
        `untrusted` says why the file may not be this user's own word (None:
        it is ours, in a directory of ours, and nobody else may write either),
        for restore to decide whether to attach the tiers it names.  The file
        and its packs are mapped fenced against SIGBUS: one cut short while it
        is read gives zeros, and `check_whole` says so.
        """
        self.path = Path(path)
        self._mv = self._guard = None
        try:
            fd = safefs.open_read(self.path, private, "snapshot")
        except CortexCacheError:
            raise
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {str(self.path)!r}") from None
        except IsADirectoryError:
            raise UsageError(f"{str(self.path)!r} is a directory, not a snapshot") from None
        except OSError as e:
            raise _os_error(e, f"reading {str(self.path)!r}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"{str(self.path)!r} is not a regular file, so not a snapshot")
            self.file_mode = stat.S_IMODE(st.st_mode)
            self.file_gid = st.st_gid
            # Why what this file says may not come from this user (None: only this user could have written it).
            self.untrusted = safefs.written_by_us(fd, self.path)
            size = st.st_size
            if size < FILE_HEAD.size + HEAD_CHECK.size + TRAILER.size:
                raise SnapshotCorrupt(f"{str(self.path)!r} is not a cortex snapshot (too short: {size} bytes)")
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            self._guard = GUARD(self._mm) if GUARD is not None else None
        finally:
            os.close(fd)
        self._mv = memoryview(self._mm)
        self.size = size
        self.private = private
        self.pack_refs: list[packs.PackRef] = []  # version 3: the packs its values are in
        self._packs: dict[int, packs.PackReader] = {}
        try:
            self.header = self._read_header()
            end = self.size - TRAILER.size
            magic, self.entries, self.value_bytes, self._file_check = TRAILER.unpack_from(self._mv, end)
            if magic != END_MAGIC:
                raise self._corrupt(self._why_no_trailer())
            if verify:
                self.verify()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for reader in getattr(self, "_packs", {}).values():
            reader.close()
        self._packs = {}
        guard, self._guard = getattr(self, "_guard", None), None
        if guard is not None:
            guard.close()  # before the unmap: its addresses may be reused
        if self._mv is not None:
            mv, self._mv = self._mv, None
            try:
                mv.release()
                self._mm.close()
            except BufferError:
                # A record's value view is still alive (say, in a traceback):
                # the mapping goes when the last view does.
                pass

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _why_no_trailer(self) -> str:
        """The file does not end in a trailer: cut short, or bytes added after its end (an append,
        a copy that wrote too much)?  A trailer whose own words check out further in tells which."""
        at = self._mm.rfind(END_MAGIC, FILE_HEAD.size)
        while at >= 0:
            if at + TRAILER.size <= self.size:
                _, n, value_bytes, _ = TRAILER.unpack_from(self._mv, at)
                # A real trailer counts no more entries and value bytes than the file could hold.
                if n <= at and value_bytes <= at:
                    extra = self.size - at - TRAILER.size
                    return (f"{plural(extra, 'byte', 'bytes')} follow its trailer (added after it was written); "
                            f"its first {at + TRAILER.size} bytes may be the snapshot")
            at = self._mm.rfind(END_MAGIC, FILE_HEAD.size, at)
        return "truncated (no trailer)"

    def _corrupt(self, why: str) -> SnapshotCorrupt:
        return SnapshotCorrupt(f"snapshot {str(self.path)!r} is damaged: {why}")

    def _read_header(self) -> SnapshotHeader:
        mv = self._mv
        if bytes(mv[:8]) != MAGIC:
            raise SnapshotCorrupt(f"{str(self.path)!r} is not a cortex snapshot")
        fields = FILE_HEAD.unpack_from(mv, 0)
        (_, version, hsize, created, size, bsize, max_entries, policy, flags, mode, _r, lfu_period, name,
         *counters, config_len) = fields
        if version not in READS:
            raise SnapshotCorrupt(
                f"snapshot {str(self.path)!r} has format version {version}; this cortex_cache reads versions "
                + ", ".join(map(str, READS))
            )
        (check,) = HEAD_CHECK.unpack_from(mv, FILE_HEAD.size)
        if hsize != FILE_HEAD.size + HEAD_CHECK.size or check != xxhash.xxh3_64_intdigest(mv[: FILE_HEAD.size]):
            raise self._corrupt("header checksum mismatch")
        if policy >= len(POLICY_IDS):
            raise self._corrupt(f"unknown policy {policy}")
        try:
            Geometry.compute(size, bsize, max_entries)
            pool_name = name.rstrip(b"\0").decode()
        except (CortexCacheError, UnicodeDecodeError):
            raise self._corrupt("impossible pool configuration") from None
        self.records_off = FILE_HEAD.size + HEAD_CHECK.size
        cfg = None
        if version >= 2:
            if config_len > min(config.MAX_CONFIG_BYTES, self.size - self.records_off - TRAILER.size):
                raise self._corrupt("impossible configuration length")
            cfg = config.decode(bytes(mv[self.records_off : self.records_off + config_len]), str(self.path))
            self.records_off += config_len
        elif config_len:
            raise self._corrupt("header checksum mismatch")
        if version == MANIFEST_VERSION:
            self.records_off = self._read_pack_table(self.records_off)
        return SnapshotHeader(created, size, bsize, max_entries, POLICY_IDS[policy], flags, mode & 0o777,
                              lfu_period or 1024, pool_name, dict(zip(COUNTERS, counters)), version, cfg)

    def _read_pack_table(self, pos: int) -> int:
        """Version 3: read the pack table at `pos` into `pack_refs`; where the records begin."""
        self.pack_table_off = pos
        mv, end = self._mv, self.size - TRAILER.size
        if end - pos < PACK_TABLE.size:
            raise self._corrupt("no pack table")
        count, _ = PACK_TABLE.unpack_from(mv, pos)
        pos += PACK_TABLE.size
        if count > (end - pos) // PACK_ENTRY.size:
            raise self._corrupt("impossible pack table")
        for _ in range(count):
            if end - pos < PACK_ENTRY.size:
                raise self._corrupt("pack table cut short")
            pack_id, size, nlen = PACK_ENTRY.unpack_from(mv, pos)
            pos += PACK_ENTRY.size
            if not 0 < nlen <= 512 or nlen > end - pos:
                raise self._corrupt("impossible pack name")
            try:
                name = bytes(mv[pos : pos + nlen]).decode()
            except UnicodeDecodeError:
                raise self._corrupt("impossible pack name") from None
            if "/" in name or name in (".", "..") or not name.endswith(packs.PACK_SUFFIX):
                raise self._corrupt(f"pack name {name!r} is not a file beside the snapshot")
            pos += nlen
            self.pack_refs.append(packs.PackRef(name, pack_id, size))
        return pos

    def _pack(self, index: int) -> packs.PackReader:
        """The reader of pack `index` of the pack table, opened (and its header checked) on first use."""
        reader = self._packs.get(index)
        if reader is None:
            if index >= len(self.pack_refs):
                raise self._corrupt(f"a record names pack {index}; the table has {len(self.pack_refs)}")
            reader = packs.PackReader(self.path.parent, self.pack_refs[index], self.path, self.private, GUARD)
            self._packs[index] = reader
        return reader

    @property
    def file_check(self) -> int:
        """The trailer's checksum of the file: what names this snapshot in a pool's fill mark (fill.py)."""
        return self._file_check

    def check_whole(self) -> None:
        """SnapshotCorrupt (65) naming the file -- this one or a pack -- that was cut short while it was read
        (a read of its mapping met its end, and read zeros): nothing read from this snapshot is to be used."""
        cut = [str(self.path)] if self._guard is not None and self._guard.gone else []
        cut += [str(r.path) for r in self._packs.values() if r.cut_short()]
        if cut:
            raise SnapshotCorrupt(f"snapshot {str(self.path)!r}: {cut[0]!r} was cut short while it was read "
                                  "(truncated by another process?); nothing read from it is used")

    def pack_reader(self, index: int) -> packs.PackReader:
        """Version 3: the reader of pack `index` (opened and checked on first use)."""
        return self._pack(index)

    def pack_fd(self, index: int) -> int:
        """Version 3: a descriptor of pack `index` of its own (the caller closes it)."""
        return os.dup(self._pack(index).fd)

    def open_packs(self) -> None:
        """Open every pack now (version 3): a missing or damaged one is refused before anything is read."""
        for n in range(len(self.pack_refs)):
            self._pack(n).advise_sequential()

    def check_manifest_file(self) -> None:
        """Version 3: check the manifest's own checksum (every byte of it; not its records one by one)."""
        end = self.size - TRAILER.size
        if xxhash.xxh3_64_intdigest(self._mv[:end]) != self._file_check:
            raise self._corrupt("file checksum mismatch")

    def verify_manifest(self) -> None:
        """Version 3: check the manifest alone (its checksum, every record's structure), not the packs."""
        self.check_manifest_file()
        count = total = 0
        for rec, _pack, _off in self.references(verify=True):
            count += 1
            total += rec.length
        if count != self.entries or total != self.value_bytes:
            raise self._corrupt(f"trailer says {self.entries} entries / {self.value_bytes} bytes, found {count} / {total}")

    def references(self, verify: bool = False) -> Iterator[tuple["Reference", packs.PackRef, int]]:
        """Version 3: every record of the manifest, with the pack and offset of its value (nothing read from
        the packs); with `verify`, each record's checksum checked."""
        mv = self._mv
        pos = self.records_off
        end = self.size - TRAILER.size
        while pos < end:
            if end - pos < REC_HEAD.size + REC_CHECK.size:
                raise self._corrupt(f"record at byte {pos} is cut short")
            (magic, klen, flags, pack, vlen, created, last_access, expiry, iseq, aseq, count, prio, checksum,
             off) = REC_HEAD.unpack_from(mv, pos)
            kpos = pos + REC_HEAD.size + REC_CHECK.size
            if magic != MAN_MAGIC or not 0 < klen <= MAX_KEY_BYTES or klen > end - kpos:
                raise self._corrupt(f"no record at byte {pos}")
            if pack >= len(self.pack_refs):
                raise self._corrupt(f"record at byte {pos} names pack {pack}; the table has {len(self.pack_refs)}")
            key = bytes(mv[kpos : kpos + klen])
            if verify:
                (rcheck,) = REC_CHECK.unpack_from(mv, pos + REC_HEAD.size)
                if rcheck != xxhash.xxh3_64_intdigest(bytes(mv[pos : pos + REC_HEAD.size]) + key):
                    raise self._corrupt(f"record at byte {pos} fails its checksum")
            yield (Reference(key, flags, vlen, created, last_access, expiry, iseq, aseq, count, prio, checksum, pack),
                   self.pack_refs[pack], off)
            pos = kpos + klen

    def verify(self) -> None:
        try:
            if self.header.version == MANIFEST_VERSION:
                self.verify_manifest()
                for _ in self.records(verify=True):  # every value read from its pack and checked
                    pass
                return
            end = self.size - TRAILER.size
            if xxhash.xxh3_64_intdigest(self._mv[:end]) != self._file_check:
                raise self._corrupt("file checksum mismatch")
            # The file hash covers every byte, and the writer checked each value
            # against its checksum before writing it: here only the structure
            # (magic, lengths, header checksums) is left to check.
            self.check_trailer(sum(1 for _ in self.records(verify=True, values=False)), None)
        finally:
            self.check_whole()  # zeros read from a file cut short: say that, not what they looked like

    def check_trailer(self, count: int, hasher: Any | None) -> None:
        """Compare what a full pass over the records found with the trailer."""
        total = sum(len(r.value) for r in self.records()) if hasher is None else self._seen_bytes
        if hasher is not None and hasher.intdigest() != self._file_check:
            raise self._corrupt("file checksum mismatch")
        if count != self.entries or total != self.value_bytes:
            raise self._corrupt(
                f"trailer says {self.entries} entries / {self.value_bytes} bytes, found {count} / {total}"
            )

    def records(self, verify: bool = False, values: bool = True, hasher: Any | None = None) -> Iterator[Record]:
        """The records in file order; with `verify`, check every checksum and length
        (with `values=False`, all but the values' own checksums: the file hash
        covers them -- except in version 3, whose values are in packs and
        always checked).  A `hasher` (xxh3_64) is fed every byte before the
        trailer, for `check_trailer`."""
        if self.header.version == MANIFEST_VERSION:
            yield from self._pack_records(verify, hasher)
            return
        mv = self._mv
        pos = self.records_off
        end = self.size - TRAILER.size
        self._seen_bytes = 0
        if hasher is not None:
            hasher.update(mv[:pos])
        while pos < end:
            if end - pos < REC_HEAD.size + REC_CHECK.size:
                raise self._corrupt(f"record at byte {pos} is cut short")
            (magic, klen, flags, _r, vlen, created, last_access, expiry, iseq, aseq, count, prio, checksum,
             _r2) = REC_HEAD.unpack_from(mv, pos)
            if magic != REC_MAGIC:
                raise self._corrupt(f"no record at byte {pos}")
            kpos = pos + REC_HEAD.size + REC_CHECK.size
            if not 0 < klen <= MAX_KEY_BYTES or vlen > end - kpos - klen:
                raise self._corrupt(f"record at byte {pos} has impossible lengths")
            key = bytes(mv[kpos : kpos + klen])
            value = mv[kpos + klen : kpos + klen + vlen]
            if verify:
                (rcheck,) = REC_CHECK.unpack_from(mv, pos + REC_HEAD.size)
                if rcheck != xxhash.xxh3_64_intdigest(bytes(mv[pos : pos + REC_HEAD.size]) + key):
                    raise self._corrupt(f"record at byte {pos} fails its checksum")
                if values and xxhash.xxh3_64_intdigest(value) != checksum:
                    raise self._corrupt(f"value of record at byte {pos} fails its checksum")
            if hasher is not None:
                hasher.update(mv[pos : kpos + klen + vlen])
            self._seen_bytes += vlen
            yield Record(key, flags, value, created, last_access, expiry, iseq, aseq, count, prio, checksum)
            pos = kpos + klen + vlen


    def _pack_records(self, verify: bool, hasher: Any | None) -> Iterator[Record]:
        mv = self._mv
        self._seen_bytes = 0
        if hasher is not None:
            hasher.update(mv[: self.records_off])
        pos = self.records_off
        for ref, _pack, off in self.references(verify=verify):
            value = self._pack(ref.pack).value(off, ref.key, ref.length, ref.checksum, self.path, check_value=verify)
            if hasher is not None:
                n = REC_HEAD.size + REC_CHECK.size + len(ref.key)
                hasher.update(mv[pos : pos + n])
                pos += n
            self._seen_bytes += ref.length
            yield Record(ref.key, ref.flags, value, ref.created, ref.last_access, ref.expiry, ref.insert_seq,
                         ref.access_seq, ref.access_count, ref.priority, ref.checksum)

    def shared_bytes(self) -> dict[str, int]:
        """Version 3: the record bytes this snapshot refers to in each pack (by pack name)."""
        used: dict[str, int] = {}
        for ref, pack, _off in self.references():
            used[pack.name] = used.get(pack.name, 0) + packs.REC_SIZE + len(ref.key) + ref.length
        return used


def followed(path: str) -> Snapshot:
    """The snapshot another process's word names (a pool's fill mark: fill.follow), opened as safefs.FOLLOWED
    (its packs too), and only if it is named as persist names snapshots."""
    name = os.path.basename(path)
    if not name.endswith(SUFFIX) or name.startswith("."):
        raise UsageError(f"{path!r} is not named as a snapshot")
    return Snapshot(path, verify=False, private=safefs.FOLLOWED)


class Reference(NamedTuple):
    """A version 3 manifest's record: an entry's key and metadata, its value in pack `pack` (an index)."""

    key: bytes
    flags: int
    length: int
    created: float
    last_access: float
    expiry: float
    insert_seq: int
    access_seq: int
    access_count: int
    priority: int
    checksum: int
    pack: int


__all__ = ["write", "Snapshot", "Record", "Reference", "PersistResult", "WriteBehind", "snapshot_dir", "latest_path",
           "snapshots_of", "list_snapshots", "snapshot_usage", "snapshot_space", "snapshots_and_space", "SPACE_BOUND", "MANIFEST_VERSION", "namespaced", "pool_config", "COUNTERS",
           "snapshot_places", "checked_snapshot_dir", "followed", "snapshot_file_mode", "check_settings_owner", "TEMP_RE", "busy", "RESTORE_BYTE"]
