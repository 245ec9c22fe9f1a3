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

from . import config, interrupts, safefs, segment
from .core import Core
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

MAGIC = b"CRTXSNAP"
VERSION = 2
READS = (1, 2)  # versions this code restores
REC_MAGIC = b"CREC"
END_MAGIC = b"CRTXEND\0"
SUFFIX = ".ccsnap"
SNAPSHOT_DIR_ENV = "CORTEX_CACHE_SNAPSHOT_DIR"
DEFAULT_KEEP = 3

FILE_HEAD = struct.Struct("<8sIId QQQ IIII Q 64s 8Q I 108x")
HEAD_CHECK = struct.Struct("<Q")
REC_HEAD = struct.Struct("<4sIII Q ddd QQQ q Q Q")
REC_CHECK = struct.Struct("<Q")
TRAILER = struct.Struct("<8sQQQ")
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


def _timestamped(name: str, directory: Path, now: float) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
    return directory / f"{namespaced(name)}-{stamp}{SUFFIX}"


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
    bytes: int
    seconds: float
    skipped_corrupt: int = 0

    def as_dict(self) -> dict[str, Any]:
        gbps = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return {"path": str(self.path), "entries": self.entries, "bytes": self.bytes,
                "seconds": round(self.seconds, 6), "gbps": round(gbps, 3), "skipped_corrupt": self.skipped_corrupt}


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
) -> PersistResult:
    """Write a snapshot of the live entries of the pool of `core`.

    `configuration()` (run with the lock held) gives the pool's whole
    configuration as `Pool.configuration` does; its rest beyond the file
    header goes into the configuration block.  With `path`, write exactly
    that file.  Without, write a timestamped file in the snapshot directory,
    point `<name>.ccsnap` at it and keep the newest timestamped snapshots of
    the pool: as many as the pool keeps (its header's `snapshot_keep`,
    default 3).  A `keep` given here is stored with the pool first, so every
    later persist keeps as many.  Raises PersistBusy
    (exit 75) if another persist of this pool is running, PermissionDenied,
    StorageIOError (disk full, I/O error); on any error the previous snapshot
    is untouched and no temp file is left.
    """
    if keep is not None and keep < 1:
        raise UsageError(f"--keep must be at least 1, not {keep}")
    if path is not None and keep is not None:
        raise UsageError("--keep applies to the snapshot directory; it cannot be combined with --output")
    if keep is not None:
        check_settings_owner(core, "change its retention (--keep)", f"it keeps {int(core.fields.snapshot_keep[0]) or DEFAULT_KEEP}")
    with _running_guard:
        if core.name in _running:
            raise PersistBusy(f"a persist of pool {core.name!r} is already running")
        _running.add(core.name)
    try:
        lock = RecordLock(core.seg.fd, PERSIST_BYTE)
        if not lock.try_acquire():  # another process persists (or restores) this pool
            raise busy(core.seg.fd, core.name, "persist")
        try:
            if keep is not None:
                core.fields.snapshot_keep[0] = keep
            return _persist_locked(core, configuration, path, progress)
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


def _persist_locked(core: Core, configuration, path, progress) -> PersistResult:
    t0 = time.perf_counter()
    now = time.time()
    if path is None:
        directory = snapshot_dir()
        target = _timestamped(core.name, directory, now)
    else:
        target = Path(path)
        directory = target.parent if str(target.parent) else Path(".")
        if target.is_dir():
            raise UsageError(f"{str(target)!r} is a directory; give a file name")
    pool_mode = core.seg.stat().st_mode & 0o777
    if path is None:  # our own directory: make it (private), and refuse one others could plant files in
        checked_snapshot_dir(pool_mode, make=True)
    elif not directory.is_dir():
        raise CannotCreate(f"cannot create {str(target)!r}: no directory {str(directory)!r}")
    _clean_stale_temps(directory, namespaced(core.name), target.name)
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
        with os.fdopen(fd, "wb", buffering=1 << 20) as raw:
            f = WriteBehind(raw)
            entries, nbytes, skipped = _write_snapshot(core, configuration, f, now, progress)
            f.finish()
            os.fsync(raw.fileno())
        with interrupts.commit():  # renamed into place: a signal now waits, and the persist reports success
            os.rename(tmp, target)
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
    if path is None:
        _prune(core.name, directory, int(core.fields.snapshot_keep[0]) or DEFAULT_KEEP)

    def note() -> None:
        core.header["last_snapshot"] = now

    if is_owner(core):  # another user's snapshot (in their directory) is not the owner's last one
        core.locked(note)
    return PersistResult(target, entries, nbytes, time.perf_counter() - t0, skipped)


class WriteBehind:
    """A file writer that starts writeback as it goes (Linux `sync_file_range`).

    Every WINDOW bytes it asks the kernel to start writing the window just
    filled, waits for the one before it, and drops that one from the page
    cache.  The disk then works while we still hash and copy, the final fsync
    has little left to do, and a multi-GiB snapshot does not flood the page
    cache.  Where `sync_file_range` is missing it is a plain buffered writer.
    """

    WINDOW = 64 << 20
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


def _write_snapshot(core: Core, configuration, f, now: float, progress) -> tuple[int, int, int]:
    """Write header, records and trailer to `f`; return (entries, value bytes, skipped)."""
    file_hash = xxhash.xxh3_64()

    def out(data) -> None:
        f.write(data)
        file_hash.update(data)

    cfg = core.locked(pool_config, core)
    block = config.encode(core.locked(configuration))
    head = FILE_HEAD.pack(
        MAGIC, VERSION, FILE_HEAD.size + HEAD_CHECK.size, now,
        cfg["size"], cfg["block_size"], cfg["max_entries"], cfg["policy"], cfg["flags"], cfg["mode"], 0,
        cfg["lfu_period"], cfg["name"], *[cfg["counters"][c] for c in COUNTERS], len(block),
    )
    out(head + HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(head)))
    out(block)
    # Live entries at the start, oldest insert first; entries put later are
    # not part of this snapshot, entries deleted meanwhile are skipped.
    def live() -> tuple[Any, Any]:
        order = core.live_in_insert_order()
        return order, core.columns["value_len"][order].copy()

    order, sizes = core.locked(live)
    total = int(sizes.sum()) if len(order) else 0
    entries = nbytes = skipped = 0
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
                vlen = e.length
                value = core.mv[e.offset : e.offset + vlen] if e.copy is None else e.copy
                if xxhash.xxh3_64_intdigest(value) != e.checksum:
                    skipped += 1  # bytes damaged in memory: never write them as good
                    continue
                head_bytes = _record_head(e)
                rh = head_bytes + REC_CHECK.pack(xxhash.xxh3_64_intdigest(head_bytes + e.key))
                out(rh)
                out(e.key)
                out(value)
                entries += 1
                nbytes += vlen
                if progress is not None:
                    progress(nbytes, total)
        finally:
            core.locked(core.unpin_batch, [e for e in batch if e.pin >= 0])
    out_trailer = TRAILER.pack(END_MAGIC, entries, nbytes, file_hash.intdigest())
    f.write(out_trailer)
    return entries, nbytes, skipped


# A temp file of a persist in our snapshot directory: ".STEM[-STAMP].ccsnap.tmp-XXXXXXXXXXXX" (STEM the
# namespaced pool name): what `_clean_stale_temps` sweeps for one pool, and `doctor` reports for all.
TEMP_RE = re.compile(r"^\.(?P<stem>.+?)(?:-" + _STAMP_RE + r")?" + re.escape(SUFFIX) + r"\.tmp-[0-9a-f]{12}$")


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
    directory = directory or snapshot_dir()
    pattern = re.compile(r"^" + re.escape(namespaced(name)) + r"-" + _STAMP_RE + re.escape(SUFFIX) + r"$")
    try:
        return sorted(p for p in directory.iterdir() if pattern.match(p.name))
    except (FileNotFoundError, NotADirectoryError):  # none yet, or a file in the way (persist says so: 73)
        return []


def list_snapshots(name: str, directory: Path | None = None) -> list[dict[str, Any]]:
    """Every snapshot of pool `name` in the snapshot directory, oldest first.

    Each: path, time (of the persist), bytes (file size), entries, value_bytes,
    latest (what `NAME.ccsnap` names), and configuration (the remote URL
    redacted); a file that cannot be read has "error" instead of the figures.
    Only headers and trailers are read: this is cheap and never touches a pool.
    """
    directory = directory or snapshot_dir()
    latest = latest_path(name, directory)
    try:
        latest_ino = latest.stat().st_ino
    except OSError:
        latest_ino = None
    out = []
    for path in snapshots_of(name, directory):
        row: dict[str, Any] = {"path": str(path)}
        try:
            st = path.stat()
            row["bytes"] = st.st_size
            row["latest"] = st.st_ino == latest_ino
            with Snapshot(path, verify=False) as snap:
                h = snap.header
                row.update(time=h.created, entries=snap.entries, value_bytes=snap.value_bytes, version=h.version,
                           size_bytes=h.size, policy=h.policy,
                           configuration=config.redacted(h.config) if h.config else None)
        except SnapshotNotFound:
            continue  # rotated away meanwhile
        except (CortexCacheError, OSError) as e:
            row["error"] = str(e)
        out.append(row)
    return out


def snapshot_usage(name: str, directory: Path | None = None) -> dict[str, Any]:
    """Count and total bytes of pool `name`'s snapshots, and the latest one's time and bytes (None: none).

    From the directory listing alone (no file is read): cheap enough for every `status`.
    """
    directory = directory or snapshot_dir()
    files = snapshots_of(name, directory)
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            pass
    try:
        st = latest_path(name, directory).stat()
        last_time, last_bytes = st.st_mtime, st.st_size
    except OSError:
        last_time = last_bytes = None
    return {"directory": str(directory), "count": len(files), "bytes": total, "latest_time": last_time,
            "latest_bytes": last_bytes}


def _prune(name: str, directory: Path, keep: int) -> None:
    for old in snapshots_of(name, directory)[:-keep]:
        try:
            old.unlink()
        except FileNotFoundError:
            pass


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

    def __init__(self, path: str | os.PathLike, verify: bool = True, private: bool = False) -> None:
        """Map `path` and check its header; with `verify` (default) check the whole file now.

        Without `verify` only the header and the trailer's place are checked:
        the caller must then read every record through `records(hasher=...)`
        and call `check_trailer` before trusting anything it read.  Anything
        but a regular file (a FIFO, a device) is refused before a read could
        block on it; with `private` (a file of our snapshot directory) so is
        a symbolic link or a file that is not ours (PermissionDenied, 77).
        `untrusted` says why the file may not be this user's own word (None:
        it is ours, in a directory of ours, and nobody else may write either),
        for restore to decide whether to attach the tiers it names.
        """
        self.path = Path(path)
        self._mv = None
        flags = os.O_RDONLY | os.O_NONBLOCK  # a FIFO's open would wait for a writer
        try:
            if private:
                fd = safefs.open_file(self.path, flags, 0, "snapshot")
            else:
                fd = os.open(self.path, flags | os.O_CLOEXEC)
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
        finally:
            os.close(fd)
        self._mv = memoryview(self._mm)
        self.size = size
        try:
            self.header = self._read_header()
            end = self.size - TRAILER.size
            magic, self.entries, self.value_bytes, self._file_check = TRAILER.unpack_from(self._mv, end)
            if magic != END_MAGIC:
                raise self._corrupt("truncated (no trailer)")
            if verify:
                self.verify()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
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
        return SnapshotHeader(created, size, bsize, max_entries, POLICY_IDS[policy], flags, mode & 0o777,
                              lfu_period or 1024, pool_name, dict(zip(COUNTERS, counters)), version, cfg)

    def verify(self) -> None:
        end = self.size - TRAILER.size
        if xxhash.xxh3_64_intdigest(self._mv[:end]) != self._file_check:
            raise self._corrupt("file checksum mismatch")
        # The file hash covers every byte, and the writer checked each value
        # against its checksum before writing it: here only the structure
        # (magic, lengths, header checksums) is left to check.
        self.check_trailer(sum(1 for _ in self.records(verify=True, values=False)), None)

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
        (with `values=False`, all but the values' own checksums).  A `hasher`
        (xxh3_64) is fed every byte before the trailer, for `check_trailer`."""
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


__all__ = ["write", "Snapshot", "Record", "PersistResult", "WriteBehind", "snapshot_dir", "latest_path",
           "snapshots_of", "list_snapshots", "snapshot_usage", "namespaced", "pool_config", "COUNTERS",
           "snapshot_places", "checked_snapshot_dir", "snapshot_file_mode", "check_settings_owner", "TEMP_RE", "busy", "RESTORE_BYTE"]
