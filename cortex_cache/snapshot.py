"""Writing snapshots of a pool: `persist`'s writer, in the snapshot directory or to one file.

`persist.py` holds the public entry points (`persist`, `restore`), restore.py
builds pools from what snapfile.py reads; this module works on a pool's core
(core.py) only, so it sits below `pool.py`.  The formats are documented where
they are defined: versions 1-3 and the file header in snapfile.py, the
manifest (version 4) in manifest.py, packs in packs.py; where the files go in
snapplaces.py, and retention in retention.py (all re-exported here).

Writing: a temp file in the target directory (mode 0600, O_EXCL), fsync,
rename over the target, fsync of the directory: a crash at any point leaves
the previous snapshot whole.  The entries are read as capture.py says: their
metadata a chunk of slots per lock hold, their values copied without the lock
and checked against their checksums, so writers never wait for a value.
Reading checks every length against the file's size and every checksum
before a pool anyone can see changes (restore.py, fill.py).
"""

from __future__ import annotations

import functools
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import xxhash

from . import basepos, capture, config, deltaplan, fill, interrupts, manifest, packs, policy_state, safefs, snapdelta, snapplaces
from .copyhash import gather_hash
from .core import GUARD, Core
from .errors import CannotCreate, CortexCacheError, PermissionDenied, PersistBusy, SnapshotCorrupt, UsageError
from .layout import FLAG_MULTI_THREADED
from .lock import PERSIST_BYTE, RecordLock
from .retention import (  # noqa: F401 (re-exported)
    SPACE_BOUND,
    bases as retention_bases,
    list_snapshots,
    prune,
    retain,
    snapshot_space,
    snapshot_usage,
    snapshots_and_space,
)
from .snapfile import (  # noqa: F401 (re-exported: the format's tables too)
    COUNTERS,
    END_MAGIC,
    FILE_HEAD,
    HEAD_CHECK,
    LEGACY_MANIFEST,
    MAGIC,
    DELTA_VERSION,
    MANIFEST_VERSION,
    MANIFESTS,
    PACK_ENTRY,
    PACK_TABLE,
    PLAIN,
    POLICY_AT,
    POLICY_AT_OFFSET,
    READS,
    REC_CHECK,
    REC_HEAD,
    REC_MAGIC,
    SUFFIX,
    TRAILER,
    VERSION,
    Record,
    Reference,
    Snapshot,
    SnapshotHeader,
    followed,
    os_error,
)
from .snapplaces import (  # noqa: F401 (re-exported)
    DEFAULT_KEEP,
    SNAPSHOT_DIR_ENV,
    TEMP_RE,
    checked_snapshot_dir,
    clean_stale_temps,
    fsync_dir,
    latest_path,
    link_latest,
    namespaced,
    snapshot_dir,
    snapshot_file_mode,
    snapshot_places,
    snapshots_of,
    stamp,
    timestamped,
    timestamped_files,
)


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
        target = timestamped(core.name, directory, now)
    else:
        target = Path(path)
        directory = target.parent if str(target.parent) else Path(".")
        safefs.refuse_existing(str(target), replace)  # a directory, or a file not to be replaced
    pool_mode = core.seg.stat().st_mode & 0o777
    if path is None:  # our own directory: make it (private), and refuse one others could plant files in
        checked_snapshot_dir(pool_mode, make=True)
    elif not directory.is_dir():
        raise CannotCreate(f"cannot create {str(target)!r}: no directory {str(directory)!r}")
    clean_stale_temps(directory, namespaced(core.name), target.name)
    if path is None:
        packs.sweep_temps(namespaced(core.name), directory)
    tmp = directory / f".{target.name}.tmp-{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise os_error(e, f"writing in {str(directory)!r}") from None
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
                entries, nbytes, skipped = incremental.write(f, configuration, progress)
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
                snapplaces.link_latest(target, latest_path(core.name, directory))
            fsync_dir(directory)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and not isinstance(e, CortexCacheError):
            raise os_error(e, f"writing {str(target)!r}") from None
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


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    """libc's sync_file_range as a callable, or None where it is not available (looked up once: finding libc
    runs ldconfig, ~5 ms, which a delta persist's two writers paid each time)."""
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


def policy_blob(core: Core) -> bytes:
    """The pool's policy state as a snapshot keeps it (the manifest's "policy" section, a self-contained
    file's bytes before its records: policy_state.py's blob, taken in short lock holds of its own beside
    the entries' listing; it is keyed by the keys' hashes, so an entry put or evicted between the two is
    simply not matched at the restore)."""
    return policy_state.capture(core)


def _file_head(core: Core, configuration, now: float, version: int, sections_at: tuple[int, int] | None = None,
               policy_len: int = 0) -> tuple[bytes, bytes]:
    """The file header (with its checksum) and the configuration block of a snapshot of `core`'s pool; for
    version 4 the header says where its section table is (`sections_at`: offset, count), for version 6 how
    long its policy state is (`policy_len`)."""
    cfg = core.locked(pool_config, core)
    block = config.encode({**core.locked(configuration), "created": float(core.header[0]["created"])})
    return _pack_head(cfg, now, version, block, sections_at, policy_len), block


def _pack_head(cfg: dict[str, Any], now: float, version: int, block: bytes, sections_at: tuple[int, int] | None,
               policy_len: int = 0) -> bytes:
    head = bytearray(FILE_HEAD.pack(
        MAGIC, version, FILE_HEAD.size + HEAD_CHECK.size, now,
        cfg["size"], cfg["block_size"], cfg["max_entries"], cfg["policy"], cfg["flags"], cfg["mode"], 0,
        cfg["lfu_period"], cfg["name"], *[cfg["counters"][c] for c in COUNTERS], len(block),
    ))
    if sections_at is not None:
        manifest.SECTIONS_AT.pack_into(head, manifest.SECTIONS_AT_OFFSET, *sections_at)
    if policy_len:
        POLICY_AT.pack_into(head, POLICY_AT_OFFSET, policy_len)
    return bytes(head) + HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(head))


def _rehead(prefix: bytes, sections_at: tuple[int, int]) -> bytes:
    """A version 4 file's header and configuration block, with its section table moved to `sections_at`."""
    head = bytearray(prefix[: FILE_HEAD.size])
    manifest.SECTIONS_AT.pack_into(head, manifest.SECTIONS_AT_OFFSET, *sections_at)
    return bytes(head) + HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(head)) + prefix[FILE_HEAD.size + HEAD_CHECK.size:]


def _write_manifest(f: Any, prefix_fn: Callable[[tuple[int, int]], bytes], prefix_len: int,
                    sections: list[tuple[str, Any]], entries: int, value_bytes: int) -> None:
    """Write a version 4 manifest to `f`: the prefix (`prefix_fn(sections_at)`: header and configuration
    block), the sections, the section table, the trailer (manifest.py)."""
    places, table_off = manifest.layout(prefix_len, sections)
    prefix = prefix_fn((table_off, len(sections)))
    assert len(prefix) == prefix_len
    table = manifest.section_table(places, sections)
    f.write(prefix)
    manifest.write_sections(f.write, prefix_len, places, sections)
    f.write(table)
    h = xxhash.xxh3_64(prefix)
    h.update(table)
    f.write(TRAILER.pack(END_MAGIC, entries, value_bytes, h.intdigest()))


def _v4_sections(live: capture.Live, pack_idx: np.ndarray, offset: np.ndarray, table: list[packs.PackRef],
                 policy: bytes) -> tuple[list[tuple[str, Any]], int, np.ndarray]:
    """The sections of a version 4 manifest of `live`'s entries (values at `pack_idx`/`offset` in `table`'s
    packs), put in fill order; the value bytes; and the order (position p holds live entry order[p])."""
    c = live.cols
    order = manifest.fill_order(c["access_seq"], c["value_len"], pack_idx, offset, newest_first=True)
    cols = {"key_off": c["key_off"], "key_len": c["key_len"], "flags": c["flags"], "length": c["value_len"],
            "pack": pack_idx, "offset": offset, **{k: c[k] for k in capture.FIELDS if k not in ("value_len", "flags")}}
    cols = {k: v[order] for k, v in cols.items()}
    sections: list[tuple[str, Any]] = [("packs", _pack_table(table))]
    sections += manifest.columns_sections(cols)
    sections += [("keys", live.keys), ("table", manifest.build_table(cols["key_hash"])), ("policy", policy)]
    return sections, int(cols["length"].sum(dtype=np.uint64)) if live.n else 0, order


def _pack_table(table: list[packs.PackRef]) -> bytes:
    out = bytearray(PACK_TABLE.pack(len(table), 0))
    for ref in table:
        name = ref.name.encode()
        out += PACK_ENTRY.pack(ref.pack_id, ref.size, len(name)) + name
    return bytes(out)


def _live_good(core: Core, progress, write_values: Callable[[capture.Gathered], None],
               live: capture.Live, which: np.ndarray | None) -> tuple[np.ndarray, int]:
    """Gather the values of `live`'s entries where `which` (all: None), hand each batch to `write_values`;
    (which entries' copies matched, how many of the others were damaged in memory)."""
    good = np.ones(live.n, bool)
    total = int(live.cols["value_len"][which].sum() if which is not None else live.cols["value_len"].sum())
    done = 0
    idx = np.arange(live.n) if which is None else np.flatnonzero(which)
    for g in capture.gather(core, live, which):
        write_values(g)
        good[idx[g.first : g.first + g.count]] = g.good
        done += g.nbytes
        if progress is not None:
            progress(done, total)
    return good, capture.damaged(core, live, np.flatnonzero(~good))


def _write_snapshot(core: Core, configuration, f, now: float, progress) -> tuple[int, int, int]:
    """Write a self-contained snapshot (version 6) to `f`; return (entries, value bytes, skipped).  A record
    per entry, packed here (a self-contained file is not the hot path: the snapshot directory's is).  The
    policy state goes before the records (snapfile.py): it is taken just before the entries are listed,
    keyed by the keys' hashes, so an entry put or evicted between is simply not matched at the restore (as
    the manifest's, taken just after)."""
    file_hash = xxhash.xxh3_64()

    def out(data) -> None:
        f.write(data)
        file_hash.update(data)

    state = policy_blob(core)
    head, block = _file_head(core, configuration, now, VERSION, policy_len=len(state))
    out(head)
    out(block)
    out(state)
    live = capture.capture(core)
    c = live.cols
    entries = nbytes = 0
    keys = live.keys

    def records(g: capture.Gathered) -> None:
        nonlocal entries, nbytes
        mv = memoryview(g.data)
        at = 0
        for k in range(g.first, g.first + g.count):
            n = int(c["value_len"][k])
            if g.good[k - g.first]:
                ko = int(c["key_off"][k])
                key = keys[ko : ko + int(c["key_len"][k])].tobytes()
                rec = REC_HEAD.pack(REC_MAGIC, len(key), int(c["flags"][k]), 0, n, float(c["created"][k]),
                                    float(c["last_access"][k]), float(c["expiry"][k]), int(c["insert_seq"][k]),
                                    int(c["access_seq"][k]), int(c["access_count"][k]), int(c["priority"][k]),
                                    int(c["checksum"][k]), 0)
                out(rec + REC_CHECK.pack(xxhash.xxh3_64_intdigest(rec + key)) + key)
                out(mv[at : at + n])
                entries += 1
                nbytes += n
            at += n

    _good, skipped = _live_good(core, progress, records, live, None)
    f.write(TRAILER.pack(END_MAGIC, entries, nbytes, file_hash.intdigest()))
    return entries, nbytes, skipped


class _Kept(NamedTuple):
    """A kept incremental snapshot, read: its file and version, its packs, and where each of its values is
    (pack index, offset of the value itself, length, checksum: arrays)."""

    path: Path
    version: int
    table: list
    pack: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    checksum: np.ndarray


def _read_kept(paths: list[Path], directory: Path) -> list[_Kept]:
    """The incremental snapshots among `paths` that check out (the manifest whole, every pack there with the
    size it gives and its header whole); the others are left as they are: not shared from, not rewritten.
    The values in the packs are not read here: a value damaged on disk after it was written is found when
    a snapshot naming it is restored or checked (`cortex cache snapshots NAME --verify`)."""
    out = []
    for path in paths:
        try:
            with Snapshot(path, verify=False, private=True, base=False) as snap:  # a delta: its own entries
                if snap.header.version not in MANIFESTS:
                    continue
                if snap.v4 is not None:  # the sections sharing reads (the rest is checked when it is restored)
                    snap.v4.verify_sections(("packs", "pack", "offset", "length", "checksum"))
                else:
                    snap.verify_manifest()
                if not all(_pack_there(directory, r) for r in snap.pack_refs):
                    continue
                snap.open_packs()  # each pack's header checked (its values are checked when read back)
                if snap.v4 is not None:
                    c = snap.v4.cols
                    if snap.v4.n and int(c["pack"].max()) >= len(snap.pack_refs):
                        continue
                    out.append(_Kept(path, snap.header.version, list(snap.pack_refs), c["pack"].astype(np.int64),
                                     c["offset"].copy(), c["length"].copy(), c["checksum"].copy()))
                    continue
                refs = list(snap.references())  # version 3: its records, one by one (once, after an upgrade)
                out.append(_Kept(path, LEGACY_MANIFEST, list(snap.pack_refs),
                                 np.array([r.pack for r, _, _ in refs], np.int64),
                                 np.array([o + packs.REC_SIZE + len(r.key) for r, _, o in refs], np.uint64),
                                 np.array([r.length for r, _, _ in refs], np.uint64),
                                 np.array([r.checksum for r, _, _ in refs], np.uint64)))
        except CortexCacheError:
            continue
    return out


def _pack_there(directory: Path, ref: packs.PackRef) -> bool:
    try:
        st = (directory / ref.name).stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == ref.size and st.st_uid == os.geteuid()


class _Incremental:
    """One incremental persist into the snapshot directory (version 4), in the order that keeps every kept
    snapshot restorable whatever the kill point:

    1. `write`: the live values no kept snapshot holds, and the values of mostly dead packs that the
       snapshots kept after this one still need (compaction), go into a new pack, flushed to disk and
       renamed into place, the directory flushed; then the manifest, which `write` writes to the caller's
       file, which it flushes and renames into place;
    2. `after`: each kept snapshot that pointed into a compacted pack is rewritten (temp file, flush,
       rename) to point at the copies; retention then deletes the snapshots beyond `keep` and every pack
       no kept snapshot names.

    A value is held by a kept snapshot when one records a value of the same length and checksum: the bytes
    are the same (and are checked against that checksum whenever read).  Packs that a kept version 3
    manifest names are never compacted (it could not name the copies); they go once it is rotated away.
    """

    def __init__(self, core: Core, directory: Path, now: float, full: bool, mode: int, keep: int) -> None:
        self.core, self.directory, self.now, self.full, self.mode, self.keep = core, directory, now, full, mode, keep
        self.stem = namespaced(core.name)
        self.new_ref = packs.PackRef(packs.pack_name(self.stem, stamp(now)), int(round(now * 1e6)), 0)
        self.remap: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # compacted pack -> (old offsets, new)
        self.staying: list[_Kept] = []
        self.written = 0
        self.stamp: tuple | None = None  # a full manifest's (slots, insert_seqs, positions, ident): basepos.stamp

    def write(self, f: Any, configuration, progress) -> tuple[int, int, int]:
        """Write the new pack (durable) and the manifest into `f`; (entries, value bytes, skipped)."""
        core, directory = self.core, self.directory
        files = timestamped_files(self.stem, directory)
        if not self.full:
            delta = deltaplan.plan(core, directory, files)
            if delta is not None:
                return self._write_delta(f, configuration, progress, delta, files)
        # Shared from: every snapshot there (one that retention deletes after this persist leaves the packs
        # the new one names).  Compacted for: those retention keeps beside the new one, and the bases that
        # the kept deltas among them read.
        survivors = set(files[-(self.keep - 1):] if self.keep > 1 else [])
        survivors |= {directory / n for n in retention_bases(survivors)}
        live, table, pack_idx, offset, skipped = self._pack_values(
            capture.capture(core), _read_kept(files, directory), survivors, set(), progress)
        sections, nbytes, order = _v4_sections(live, pack_idx, offset, table, policy_blob(core))
        ident = secrets.token_bytes(basepos.IDENT_BYTES)  # what names it as a base (snapdelta.py)
        sections.append((snapdelta.IDENT, ident))
        positions = np.empty(live.n, np.int64)
        positions[order] = np.arange(live.n)
        seq = int(live.cols["insert_seq"].max()) if live.n else 0
        self.stamp = (live.cols["slot"], live.cols["insert_seq"], positions, ident, seq)
        self._manifest(f, configuration, MANIFEST_VERSION, sections, live.n, nbytes)
        return live.n, nbytes, skipped

    def _pack_values(self, live: capture.Live, kept: list[_Kept], survivors: set[Path], pinned: set[str],
                     progress) -> tuple[capture.Live, list[packs.PackRef], np.ndarray, np.ndarray, int]:
        """Point `live`'s entries at the values `kept` snapshots hold (unless `full`), write the others into
        the new pack with compaction's copies for the `survivors` (packs `pinned` are never compacted), the
        pack durable under its name; (the entries whose values checked out, the packs the manifest names,
        each entry's index there and offset, how many were damaged in memory)."""
        core = self.core
        self.staying = [k for k in kept if k.path in survivors]
        names: list[packs.PackRef] = []  # every pack the new manifest may name; the new one first
        by_name: dict[str, int] = {}
        for k in kept:
            for r in k.table:
                if r.name not in by_name:
                    by_name[r.name] = len(names) + 1
                    names.append(r)
        pack_of = np.zeros(live.n, np.int64)  # 0: the new pack; else 1 + index into `names`
        offset = np.zeros(live.n, np.uint64)
        if not self.full and kept and live.n:
            self._share(kept, by_name, live, pack_of, offset)
        writer: packs.PackWriter | None = None
        try:
            new = pack_of == 0
            if new.any():
                writer = self._writer()
            new_idx = np.flatnonzero(new)

            def into_pack(g: capture.Gathered) -> None:
                assert writer is not None
                at = writer.add(memoryview(g.data)[: g.nbytes], g.count)
                lens = live.cols["value_len"][new_idx[g.first : g.first + g.count]].astype(np.uint64)
                offset[new_idx[g.first : g.first + g.count]] = np.uint64(at) + np.cumsum(lens) - lens
                self.written += g.nbytes

            good, skipped = _live_good(core, progress, into_pack, live, new) if writer is not None else \
                (np.ones(live.n, bool), 0)
            live, pack_of, offset = live.take(good), pack_of[good], offset[good]
            writer = self._compact(names, pack_of, offset, live, writer, pinned)
            if writer is not None:
                writer.finish()
                self.new_ref.size = writer.size
                fsync_dir(self.directory)  # the pack's name is on disk before any manifest that names it
        except BaseException:
            if writer is not None:
                writer.discard()
            raise
        # Index 0 was the new pack, j the j-th of `names`: as _moved counts them, the new pack last.
        idx = np.where(pack_of == 0, len(names), pack_of - 1)
        table, pack_idx, offset = self._moved(names, idx, offset)
        return live, table, pack_idx, offset, skipped

    def _manifest(self, f: Any, configuration, version: int, sections: list, entries: int, nbytes: int) -> None:
        core = self.core
        cfg = core.locked(pool_config, core)
        block = config.encode({**core.locked(configuration), "created": float(core.header[0]["created"])})
        prefix_len = FILE_HEAD.size + HEAD_CHECK.size + len(block)
        _write_manifest(f, lambda at: _pack_head(cfg, self.now, version, block, at) + block, prefix_len,
                        sections, entries, nbytes)

    def _write_delta(self, f: Any, configuration, progress, plan: deltaplan.Plan,
                     files: list[Path]) -> tuple[int, int, int]:
        """A delta manifest against `plan`'s base (snapdelta.py), as a full one is written but of the changed
        entries alone: shared from, and compacted for, the kept deltas of the same base (small: their own
        entries), so that a persist after nothing changed writes nothing and their packs stay within the
        space bound.  The base's packs are never compacted here (that would need its columns: a full
        persist does it)."""
        same_base = deltaplan.deltas_of(files, plan.ident)
        survivors = set(files[-(self.keep - 1):] if self.keep > 1 else [])
        live, table, pack_idx, offset, skipped = self._pack_values(
            capture.capture(self.core, plan.split.changed),
            _read_kept([p for p in files if p.name in same_base], self.directory),
            survivors, set(plan.base_packs), progress)
        sections, nbytes, _order = _v4_sections(live, pack_idx, offset, table, policy_blob(self.core))
        entries, total = live.n + plan.split.kept, nbytes + plan.kept_bytes
        sections += [("base", snapdelta.base_section(plan.ident, plan.nb, entries, total, plan.base_name)),
                     ("dropped", snapdelta.dropped_section(plan.split.dropped))]
        self._manifest(f, configuration, snapdelta.DELTA_VERSION, sections, live.n, nbytes)
        return entries, total, skipped

    def _share(self, kept: list[_Kept], by_name: dict[str, int], live: capture.Live, pack_of: np.ndarray,
               offset: np.ndarray) -> None:
        """Point each live entry whose value a kept snapshot holds (its length and checksum) at it: the
        newest snapshot first, then the older ones for what is left (one sort of each one's checksums)."""
        # The live entries in checksum order: each search starts where the last one ended (numpy does so for
        # sorted keys), instead of a cache miss per entry.
        left = np.argsort(live.cols["checksum"], kind="stable")
        for k in reversed(kept):
            if not len(left) or not len(k.checksum):
                continue
            order = np.argsort(k.checksum, kind="stable")
            ck = k.checksum[order]
            want = live.cols["checksum"][left]
            pos = np.minimum(np.searchsorted(ck, want), len(ck) - 1)
            at = order[pos]
            hit = (ck[pos] == want) & (k.length[at] == live.cols["value_len"][left])
            names = np.array([by_name[r.name] for r in k.table], np.int64)
            pack_of[left[hit]] = names[k.pack[at[hit]]]
            offset[left[hit]] = k.offset[at[hit]]
            left = left[~hit]

    def _writer(self) -> packs.PackWriter:
        return packs.PackWriter(self.directory / self.new_ref.name, self.new_ref.pack_id, self.now, self.mode,
                                WriteBehind)

    def _compact(self, names: list[packs.PackRef], pack_of: np.ndarray, offset: np.ndarray, live: capture.Live,
                 writer: packs.PackWriter | None, pinned: set[str]) -> packs.PackWriter | None:
        """Copy into the new pack the values still needed of every pack that the snapshots kept after this
        persist refer to for less than packs.COMPACT_BELOW of its bytes, so that it can go.  A pack one of
        whose values does not check out is left as it is (the snapshots naming it keep naming it)."""
        needed: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}  # name -> [(offsets, lengths, sums)]
        sizes = {r.name: r for r in names}
        pinned = pinned | {r.name for k in self.staying if k.version == LEGACY_MANIFEST for r in k.table}
        lens, sums = live.cols["value_len"], live.cols["checksum"]
        for j, r in enumerate(names, start=1):
            sel = pack_of == j
            if sel.any():
                needed.setdefault(r.name, []).append((offset[sel], lens[sel], sums[sel]))
        for k in self.staying:
            for j, r in enumerate(k.table):
                sel = k.pack == j
                if sel.any():
                    needed.setdefault(r.name, []).append((k.offset[sel], k.length[sel], k.checksum[sel]))
        for name in sorted(needed):
            if name in pinned:
                continue
            o, first = np.unique(np.concatenate([x[0] for x in needed[name]]), return_index=True)
            ln = np.concatenate([x[1] for x in needed[name]])[first].astype(np.uint64)
            ck = np.concatenate([x[2] for x in needed[name]])[first]
            if int(ln.sum()) >= packs.COMPACT_BELOW * max(1, sizes[name].size - packs.HEAD_SIZE):
                continue
            try:
                reader = packs.PackReader(self.directory, sizes[name], self.directory / name, True, GUARD)
            except CortexCacheError:
                continue
            try:
                buf = bytearray(int(ln.sum()))
                got = np.zeros(len(o), np.uint64)
                try:
                    gather_hash(buf, reader.mv, o.astype(np.uint64), ln, got)
                except ValueError:
                    continue  # a value outside the pack: left as it is
                if reader.cut_short() or not (got == ck).all():
                    continue  # what it copied may be zeros, or a value is damaged: left as it is
                if writer is None:
                    writer = self._writer()
                at = writer.add(buf, len(o))
                self.remap[name] = (o.astype(np.uint64), np.uint64(at) + np.cumsum(ln) - ln)
                self.written += len(buf)
            finally:
                reader.close()
        return writer

    def _moved(self, table: list[packs.PackRef], pack: np.ndarray, offset: np.ndarray) -> tuple[list, np.ndarray, np.ndarray]:
        """Entries at (index `pack` in `table`, `offset`) with those in compacted packs pointed at their copies
        in the new pack: (the packs they name now, oldest first; each entry's index there; offsets)."""
        pack, offset = pack.copy(), offset.copy()
        moved = np.zeros(len(pack), bool)
        for j, r in enumerate(table):
            if r.name in self.remap:
                sel = pack == j
                old, new = self.remap[r.name]
                offset[sel] = new[np.searchsorted(old, offset[sel])]
                moved |= sel
        everyone = [*table, self.new_ref]
        pack[moved] = len(table)
        used = sorted(set(pack.tolist()), key=lambda j: everyone[j].pack_id)
        index = np.full(len(everyone), -1, np.int64)
        index[used] = np.arange(len(used))
        return [everyone[j] for j in used], index[pack].astype(np.uint32), offset

    def after(self) -> None:
        """Once the new manifest is in place: a full one is the pool's base from now on (basepos.py); point the
        kept snapshots at the compacted copies, then retention."""
        directory = self.directory
        if self.stamp is not None:
            basepos.stamp(self.core, *self.stamp)
        if self.remap:
            for kept in self.staying:
                if kept.version in (MANIFEST_VERSION, DELTA_VERSION) and any(r.name in self.remap for r in kept.table):
                    try:
                        self._rewrite(kept)
                    except SnapshotCorrupt:
                        # A section damaged since it was read: never rewritten with fresh checksums over the
                        # damage.  It keeps naming the compacted pack, which retention then keeps for it.
                        continue
            fsync_dir(directory)  # the rewritten snapshots are on disk before the packs they left go
        retain(self.core.name, directory, self.keep)

    def _rewrite(self, kept: _Kept) -> None:
        """Rewrite kept version 4 manifest `kept` (temp file, flush, rename) with its values in compacted
        packs pointed at their copies; every other section as it was."""
        directory = self.directory
        with Snapshot(kept.path, verify=False, private=True, base=False) as snap:
            v4 = snap.v4
            assert v4 is not None
            table, pack, offset = self._moved(kept.table, kept.pack, kept.offset)
            new = {"packs": _pack_table(table), "pack": pack, "offset": offset}
            sections = [(name, new[name] if name in new else bytes(v4.section(name))) for name in v4.places]
            prefix, entries, nbytes = snap.prefix(), snap.entries, snap.value_bytes
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
            with os.fdopen(fd, "wb", buffering=1 << 20) as f:
                _write_manifest(f, lambda at: _rehead(prefix, at), len(prefix), sections, entries, nbytes)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, kept.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise


__all__ = ["write", "Snapshot", "Record", "Reference", "PersistResult", "WriteBehind", "snapshot_dir", "latest_path",
           "snapshots_of", "list_snapshots", "snapshot_usage", "snapshot_space", "snapshots_and_space", "SPACE_BOUND",
           "MANIFEST_VERSION", "namespaced", "pool_config", "COUNTERS", "snapshot_places", "checked_snapshot_dir",
           "followed", "snapshot_file_mode", "check_settings_owner", "TEMP_RE", "busy", "RESTORE_BYTE", "policy_blob",
           "prune"]
