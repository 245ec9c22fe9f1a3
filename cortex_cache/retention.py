"""Retention of a pool's snapshots: listing them, what they take on disk, and pruning.

A persist keeps the newest snapshots of its pool (its retention) and removes
every pack no kept manifest names; `snapshots` lists them and `snapshots
--prune` asks for the same by hand.  Manifests are read here (their pack
tables and where their values are), never a pool.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from . import config, fill, packs, snapdelta, snapplaces
from .core import Core
from .errors import CortexCacheError, PersistBusy, SnapshotCorrupt, SnapshotNotFound, StorageIOError, UsageError
from .lock import PERSIST_BYTE, RecordLock
from .snapfile import DELTA_VERSION, MANIFESTS, Snapshot, followed
from .snapplaces import checked_snapshot_dir, fsync_dir, latest_path, namespaced, snapshot_dir, snapshots_of


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
    # Per row: the pack records it refers to, as (keys, record bytes) arrays (_extent_keys), each record once.
    refs: list[tuple[np.ndarray, np.ndarray]] = []
    pack_ids: dict[str, int] = {}  # every pack name seen, numbered
    for path in snapshots_of(name, directory):
        row: dict[str, Any] = {"path": str(path)}
        mine = _NO_EXTENTS
        try:
            st = path.stat()
            row["bytes"] = st.st_size
            row["latest"] = st.st_ino == latest_ino
            with Snapshot(path, verify=False) as snap:
                h = snap.header
                row.update(time=h.created, entries=snap.entries, value_bytes=snap.value_bytes, version=h.version,
                           size_bytes=h.size, policy=h.policy,
                           configuration=config.redacted(h.config) if h.config else None)
                if h.version in MANIFESTS:
                    mine = _extent_keys(snap, pack_ids)
                if verify:
                    snap.verify()
                    row["verified"] = True
        except SnapshotNotFound:
            continue  # rotated away meanwhile
        except (CortexCacheError, OSError) as e:
            row["error"] = str(e)
        rows.append(row)
        refs.append(mine)
    # How many rows refer to each record: sorted keys, counted (numpy: a million records in a second, where
    # sets of tuples took six).
    every = np.concatenate([k for k, _ in refs]) if refs else _NO_EXTENTS[0]
    every_bytes = np.concatenate([n for _, n in refs]) if refs else _NO_EXTENTS[1]
    records, first, counts = np.unique(every, return_index=True, return_counts=True)
    for row, (keys, nbytes) in zip(rows, refs):
        if "error" not in row:
            alone = counts[np.searchsorted(records, keys)] == 1
            row["own_bytes"] = row["bytes"] + int(nbytes[alone].sum())
            row["shared_bytes"] = int(nbytes[~alone].sum())
    files = sum(r.get("bytes", 0) for r in rows)
    pack_bytes = sum(_size(p) for p in packs.packs_of(namespaced(name), directory))
    largest = max((r["own_bytes"] + r["shared_bytes"] for r in rows if "error" not in r), default=0)
    needed = files + int(every_bytes[first].sum())
    total = files + pack_bytes
    return rows, {"snapshot_file_bytes": files, "pack_bytes": pack_bytes, "total_bytes": total,
                  "needed_bytes": needed, "largest_bytes": largest, "ratio": total / largest if largest else None,
                  "waste_ratio": total / needed if needed else None}


_NO_EXTENTS = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
_OFFSET_BITS = 40  # a record's key: its pack's number above, its offset (< 1 TiB) below


def _extent_keys(snap: Snapshot, pack_ids: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """The pack records `snap` refers to, each once: (keys -- pack number, numbered in `pack_ids` by name,
    and offset in one uint64 --, record bytes)."""
    names, pack, offset, nbytes = snap.extents()
    if not pack.size:
        return _NO_EXTENTS
    ids = np.array([pack_ids.setdefault(n, len(pack_ids)) for n in names], np.uint64)
    if int(offset.max()) >> _OFFSET_BITS or len(pack_ids) >> (64 - _OFFSET_BITS):
        raise StorageIOError(f"snapshot {str(snap.path)!r} refers to a pack record past 1 TiB")
    keys, first = np.unique((ids[pack] << np.uint64(_OFFSET_BITS)) | offset, return_index=True)
    return keys, nbytes[first]


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
            retain(name, directory, keep)
        fsync_dir(directory)
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


def retain(name: str, directory: Path, keep: int) -> None:
    """Retention: the newest `keep` snapshots stay; then every pack that no manifest a name reaches -- a kept
    one, or whatever `NAME.ccsnap` names -- refers to goes.  A pack is deleted only once no such manifest
    names it, so a kill anywhere in here leaves every kept snapshot whole (what it did not get to, the next
    persist does).  A persist killed between renaming its manifest into place and linking `NAME.ccsnap` to it
    left that name on an older snapshot: it is pointed at the newest first (what the persist meant)."""
    latest = latest_path(name, directory)
    stamped = snapshots_of(name, directory)
    if stamped:
        _repair_latest(stamped[-1], latest)
    needed = bases(stamped[-keep:])  # the base a kept delta reads stays with it (snapdelta.py)
    for old in stamped[:-keep]:
        if old.name in needed:
            continue
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


def bases(paths: Any) -> set[str]:
    """The file names of the bases that the delta manifests among `paths` read (a delta that cannot be read
    names none: restoring it fails whatever is kept)."""
    out: set[str] = set()
    for path in paths:
        try:
            with Snapshot(path, verify=False, private=True, base=False) as snap:
                view = snap.section("base") if snap.header.version == DELTA_VERSION else None
                if view is not None:
                    out.add(snapdelta.read_base(view, SnapshotCorrupt)[4])
                    del view
        except (CortexCacheError, OSError):
            continue
    return out


def _repair_latest(newest: Path, latest: Path) -> None:
    """Point `latest` (NAME.ccsnap) at `newest`, the newest timestamped snapshot, if it names none or an older
    one and `newest` is a whole manifest of ours (it was renamed into place only once written and flushed)."""
    try:
        if latest.exists() and latest.stat().st_ino == newest.stat().st_ino:
            return
        with Snapshot(newest, verify=False, private=True) as snap:
            snap.check_manifest_file()
        snapplaces.link_latest(newest, latest)
    except (CortexCacheError, OSError):
        pass  # left as it is: retention then keeps what it names


__all__ = ["list_snapshots", "snapshot_space", "snapshots_and_space", "snapshot_usage", "prune", "retain", "SPACE_BOUND",
           "bases"]
