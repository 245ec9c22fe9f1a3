"""Restoring a pool from a snapshot: built aside under a staging name, published whole, or nothing.

Below `pool.py`: the pool class is handed in (`persist.restore` and
`Pool.restore` do), and the pool's core (core.py) takes the entries.  The
file itself is read by snapshot.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import xxhash

from . import fill, interrupts, policy_state, procs, safefs, segment
from .core import Core
from .errors import (
    CortexCacheError,
    NoSpace,
    PermissionDenied,
    PoolExists,
    PoolFull,
    PersistBusy,
    SnapshotCorrupt,
    UsageError,
    ValueTooLarge,
)
from .layout import FLAG_MULTI_THREADED
from .lock import PERSIST_BYTE, RecordLock
from .lower import Selector
from .policy_names import POLICY_IDS
from .resize import resize  # noqa: F401 (re-exported: Pool.resize calls it from here)
from .snapshot import (
    RESTORE_BYTE,
    Snapshot,
    busy,
    checked_snapshot_dir,
    followed,
    latest_path,
    pool_config,
    snapshots_of,
)
from .staging import (  # noqa: F401 (STAGING_PREFIX, TMP_PREFIX, stale_tmp_dirs re-exported)
    STAGING_PREFIX,
    STAGING_STALE_AFTER,
    TMP_PREFIX,
    create_staging,
    discard,
    restore_end,
    restore_entry,
    stale_tmp_dirs,
    staging_name,
    sweep_stale_staging,
    sweep_stale_tmp,
    tier_header,
)
from .tier_table import TIERS
from .units import entries

if TYPE_CHECKING:
    from .staging import PoolClass, PoolHandle


def restore(
    pools: "PoolClass",
    path: str | os.PathLike | None,
    name: str | None = None,
    replace: bool = False,
    progress: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] | None = None,
    mode: int | None = None,
    if_missing: bool = False,
    trust_tiers: bool = False,
    allow_other_owner: bool = False,
    detach: bool = False,
) -> tuple["PoolHandle | None", dict[str, Any]]:
    """Rebuild a pool from a snapshot with the pool class `pools`; return (pool, report).

    A pool that is gone, restored from the snapshot directory's incremental
    snapshots, is published at once and filled afterwards
    (fill.py): it is built under a temporary name with the snapshot's
    configuration and counters, appears under its real name before any
    value is in, and the values come in most recently used first while
    every process may use it (an entry not loaded yet is a miss).  This
    call fills it and returns when the fill ended; with `detach` (the CLI's
    --background) it forks a process that fills it and returns once the pool
    is published (the report's "filler_pid"; call it from a program with no
    other threads, as fork requires).  A fill that was interrupted (its process killed) is finished by
    the next restore of the pool without `replace`, from where it stopped;
    the report's "resumed" says so.  A self-contained file (persist
    --output), and a snapshot whose path does not fit the pool's header
    (FILL_PATH_BYTES), are restored the old way: built whole aside, verified,
    and published complete.  A missing pool is created with the snapshot's
    whole configuration: its disk tier is attached again (the records still
    on disk that check out are found again; a tier that is gone is made
    anew), and so are its remote tier and its retention.  An existing one is
    refused (PoolExists) unless `replace`, which builds the new pool with the
    existing one's size, policy and tiers and swaps it in by an atomic
    rename (its disk tier is emptied afterwards; a remote tier is left as it
    is: other hosts share it).  Processes attached to a replaced pool keep
    the old one, as after a delete, until they open it again.  The report's
    "tiers" says what happened to each tier.

    Whose word the tiers are: a snapshot names directories and servers the
    restoring process would then write every entry to, so a new pool gets
    the snapshot's disk tier, remote tier and retention only from a file
    this user wrote (ours, writable by nobody else, in a directory of ours
    nobody else may write: what persist makes), or with `trust_tiers`.
    From any other file the entries come back and those settings do not;
    the report's "not_attached" names them and says why ("trusted": False).
    Whatever the file says is checked as the command line's options are
    (config.decode): a snapshot asking for what `create` refuses is
    SnapshotCorrupt (65), with or without `trust_tiers`.

    `if_missing`: a pool that exists is left alone, and (None, a report with
    "skipped": True) returned.  A pool that exists must be this user's or
    root's, for `if_missing` and `replace` alike (the segment's owner, by
    fstat): under the shared prefix another user may have taken the name
    first.  PermissionDenied (77) for another owner's, unless
    `allow_other_owner`.  `mode`: the new segment's permission bits
    (default 0600; with `replace`, the replaced pool's); PermissionDenied
    (77) if it would let more users read the data than the snapshot file
    does.  Raises NoSpace (73), and changes nothing, when the entries do not
    all fit.  Expired entries are skipped.  `path` None means the stable
    latest snapshot of `name` in the snapshot directory, which must be ours
    (safefs).
    """
    Pool = pools
    if replace and if_missing:
        raise UsageError("--if-missing and --replace contradict each other: give one")
    private = path is None
    if path is None:
        if name is None:
            raise UsageError("restore needs a snapshot path or a pool name")
        path = latest_path(segment.validate_name(name))
    if name is not None:
        segment.validate_name(name)
        if not replace and segment.exists(name):
            done = _resume(Pool, name, None if private else path, progress, clock, allow_other_owner, detach,
                           if_missing)
            if done is not None:
                return done
            if if_missing:
                return None, _skipped(name, path)
    if private:
        checked_snapshot_dir(mode if mode is not None else _pool_mode(name) if replace else 0o600)
    if mode is not None and (not isinstance(mode, int) or mode & ~0o777 or mode & 0o600 != 0o600):
        raise UsageError(f"invalid mode {mode!r}: give permission bits like 0o600 or 0o660, owner rw included")
    t0 = time.perf_counter()
    with Snapshot(path, verify=False, private=private) as snap:
        h = snap.header
        target = name or segment.validate_name(h.name)
        if segment.exists(target):
            if if_missing:
                segment.check_owner_of(target, allow_other_owner)
                return None, _skipped(target, path)
            if not replace:
                raise PoolExists(f"pool {target!r} exists; use --replace to overwrite it from the snapshot")
            pool, report = _replace(Pool, target, snap, mode, progress, clock, allow_other_owner)
            report["tiers"] = _tiers_kept(pool)
            report["not_attached"] = None  # the pool's own configuration is kept, not the snapshot's
        else:
            try:
                pool, report = _restore_new(Pool, snap, target, mode, progress, clock, trust_tiers, private, detach,
                                              t0)
            except PoolExists:
                if not if_missing or not segment.exists(target):
                    raise
                return None, _skipped(target, path)  # another restore (a second boot line) published it first
        report["trusted"] = snap.untrusted is None
    report["seconds"] = round(time.perf_counter() - t0, 6)
    report["path"] = str(Path(path))
    report["pool"] = target
    report["skipped"] = False
    return pool, report


def _skipped(name: str, path, filling: bool = False) -> dict[str, Any]:
    return {"pool": name, "path": str(Path(path)), "skipped": True, "entries": 0, "bytes": 0,
            "expired_skipped": 0, "seconds": 0.0, "tiers": {}, "not_attached": None, "trusted": None,
            "filling": filling}


def _resume(Pool: "PoolClass", name: str, path, progress, clock, allow_other_owner: bool, detach: bool,
            if_missing: bool) -> tuple["PoolHandle | None", dict[str, Any]] | None:
    """Finish the fill of existing pool `name` if it was interrupted (fill.py); None if it has none to
    finish.  `path` None: the pool's own snapshot in the snapshot directory (the mark must name one of
    them); else the file given, which must be the one the mark names."""
    try:
        segment.check_owner_of(name, allow_other_owner)
    except PermissionDenied:
        if if_missing:
            raise
        return None  # restore of another user's pool: PoolExists, as before
    try:
        pool = Pool.open(name, clock=clock, require_owner=not allow_other_owner)
    except CortexCacheError:
        return None  # a damaged or half-made pool has no fill to finish
    try:
        core = pool.core
        if not fill.running(core):
            pool.close()
            return None
        st = fill.state(core)
        assert st is not None
        marked = st["snapshot"]
        if st["running"]:
            pool.close()
            if if_missing:
                return None, _skipped(name, marked, filling=True)
            raise PersistBusy(f"pool {name!r} is being filled from {marked!r} by another restore; "
                              "status shows how far it got")
        if path is not None:  # the operator names the file, which must be the one the mark names
            if not _same_file(path, marked):
                if if_missing:
                    pool.close()
                    return None, {**_skipped(name, path), "fill_not_resumed": f"it is being filled from {marked!r}"}
                raise UsageError(f"pool {name!r} is being filled from {marked!r}, not from {str(path)!r}: give "
                                 "that file (or none), or start again with --replace")
            snap = Snapshot(path, verify=False)
        else:  # the mark's word alone: followed only to a snapshot of the pool's this process trusts
            snap, why = fill.follow(core, followed)
            if snap is not None and not any(_same_file(p, snap.path) for p in snapshots_of(name)):
                snap.close()
                snap, why = None, (f"{marked!r} is not one of its snapshots in the snapshot directory (give it "
                                   "with --input)")
            if snap is None:
                pool.close()
                if if_missing:  # a boot line: the pool is there, and a mark it does not follow holds nothing up
                    return None, {**_skipped(name, latest_path(name)), "fill_not_resumed": why}
                raise UsageError(f"pool {name!r} was being filled from a snapshot this restore does not follow "
                                 f"({why}): start again with --replace")
        t0 = time.perf_counter()
        with snap:
            if snap.file_check != int(core.header[0]["fill_check"]):
                raise SnapshotCorrupt(f"snapshot {marked!r} has changed since pool {name!r} began filling from it: "
                                      f"the fill cannot go on (the pool keeps its {entries(pool.stats()['entries'])}); "
                                      "start again with restore --replace")
            _check_before_publish(snap)
            report = {"entries": 0, "bytes": 0, "expired_skipped": 0, "filling": True, "published_seconds": 0.0,
                      "path": marked, "pool": name, "skipped": False, "resumed": True, "tiers": {},
                      "not_attached": None, "trusted": path is None or None}
            lock = RecordLock(core.seg.fd, fill.FILL_BYTE)
            if not lock.try_acquire():
                raise PersistBusy(f"pool {name!r} is being filled by another restore")
            if detach:
                # The filler inherits the pool's descriptor, and with it the lock (OFD locks belong to
                # the open file): this process lets go of its copy without releasing it.
                report["filler_pid"] = _detached_fill(lambda: Pool.open(name, clock=clock), snap)
            else:
                try:
                    report.update(_run_fill(core, snap, progress))
                finally:
                    lock.release()
        report["seconds"] = round(time.perf_counter() - t0, 6)
        return pool, report
    except BaseException:
        pool.close()
        raise


def _detached_fill(opener: Callable[[], "PoolHandle"], snap: Snapshot, quiet: contextlib.ExitStack | None = None) -> int:
    """Fork a process that fills the pool (a handle of its own from `opener`: one is not inherited across
    fork) and exits; its pid.

    It holds the fill lock through the descriptors it inherits, runs in a
    session of its own with no terminal (stdin, stdout and stderr are
    /dev/null: status and the fill's header fields say how it goes), and
    SIGTERM stops it as it stops any restore, leaving the fill resumable."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        if quiet is not None:
            quiet.close()  # signals that waited for the publish reach the filler now
        pool = opener()  # kept referenced: a collected handle closes its pool
        _run_fill(pool.core, snap, None)
    except interrupts.Interrupted as e:
        code = e.exit_code
    except CortexCacheError as e:
        code = e.exit_code
    except BaseException:
        code = 70
    finally:
        os._exit(code)


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_before_publish(snap: Snapshot) -> None:
    """What is checked before a pool anyone can see is filled from `snap`: every pack it names (there, the
    right size, its header whole) and, for a version 3 manifest, its own checksum.  A version 4 manifest's
    header, trailer and section table were checked when it was opened (O(1)); its sections are checked by
    the fill before it reads them, after the publish.  Each record and value is checked as the fill reaches
    it."""
    if snap.header.version == 3:
        snap.check_manifest_file()
    if snap.header.version in (3, 4, 5):
        snap.open_packs()


def _run_fill(core: Core, snap: Snapshot, progress) -> dict[str, Any]:
    """fill.run, with its outcome turned into restore's report (a damaged value: reported, not raised)."""
    try:
        out = fill.run(core, snap, progress)
    except interrupts.Interrupted as e:
        st = fill.state(core) or {"entries_done": 0, "entries_total": 0}
        e.kept = (f"pool {core.name!r} stays, with the entries loaded so far ({st['entries_done']} of "
                  f"{st['entries_total']} processed); `cortex cache restore {core.name} --if-missing` finishes it")
        raise
    except SnapshotCorrupt as e:  # the manifest's records or a file's structure: nothing more can be read
        core.locked(_fill_failed, core)
        raise SnapshotCorrupt(f"{e}; the pool keeps the entries loaded before it") from None
    if out["corrupt"]:
        raise SnapshotCorrupt(
            f"{out['corrupt_why']}: pool {core.name!r} was restored without the {entries(out['corrupt'], 'values')} "
            f"that fail their checksums ({entries(out['entries'])} loaded)"
        )
    return {"entries": out["entries"], "bytes": out["bytes"], "expired_skipped": out["expired_skipped"],
            "present_skipped": out["present_skipped"], "corrupt": out["corrupt"], "corrupt_why": out["corrupt_why"],
            "ended": out["ended"], "reserve_failed": out["reserve_failed"], "filling": False,
            "policy_state": out.get("policy_state")}


def _fill_failed(core: Core) -> None:
    h = core.header[0]
    if int(h["fill_state"]) == fill.FILL_RUNNING:
        h["fill_state"] = fill.FILL_FAILED
        h["fill_ended"] = time.time()


def _pool_mode(name: str | None) -> int:
    """The permission bits of pool `name`'s segment (what restore --replace gives its replacement); 0600 if none."""
    if name is None:
        return 0o600
    try:
        return os.stat(segment.shm_path(name)).st_mode & 0o777
    except OSError:
        return 0o600


def _untrusted_settings(snap: Snapshot, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """What of the snapshot's configuration is not applied from a file this user may not have written."""
    out: dict[str, Any] = {}
    for kind in TIERS:
        if cfg[kind.name] is not None:
            out[kind.name] = kind.describe(cfg[kind.name])
    if cfg["keep"] is not None:
        out["keep"] = cfg["keep"]
    if not out:
        return None
    out["why"] = f"snapshot {str(snap.path)!r} may not be this user's: {snap.untrusted}"
    return out


def _tiers_kept(pool: "PoolHandle") -> dict[str, str]:
    """What restore --replace did to an existing pool's tiers (it keeps the pool's configuration)."""
    return {t.name: t.replaced() for t in pool.tiers.configured}


def _restore_new(Pool: "PoolClass", snap: Snapshot, target: str, mode: int | None, progress,
                 clock, trust_tiers: bool = False, private: bool = False, detach: bool = False,
                 t0: float = 0.0) -> tuple["PoolHandle", dict[str, Any]]:
    """Create pool `target` from the snapshot's whole configuration, under a staging name first; publish
    it before its values are in and fill it (fill.py), or, for a snapshot whose path the fill mark cannot
    hold, fill it whole first."""
    h = snap.header
    later = snap.header.version in (3, 4, 5) and fill.fits_mark(snap.path)
    if later:
        _check_before_publish(snap)
    cfg = h.config or {"reserve": True, "keep": None, **{kind.name: None for kind in TIERS}}
    not_attached = None
    if snap.untrusted is not None and not trust_tiers:
        not_attached = _untrusted_settings(snap, cfg)
        cfg = {**cfg, **{kind.name: None for kind in TIERS}, "keep": None}
    # How each tier of the snapshot's configuration comes back (lower.Configured.restoring): created with
    # the pool, recorded once it has its real name, or not attached (the report says why).
    tiers: dict[str, str] = {}
    coming: list[tuple[Any, dict[str, Any], Any]] = []  # (tier class, its configuration, how)
    tier_kw: dict[str, Any] = {}
    for kind in TIERS:
        part = cfg[kind.name]
        if part is None:
            continue
        how = kind.restoring(part, target)
        if how.note is not None:
            tiers[kind.name] = how.note
            continue
        coming.append((kind, part, how))
        tier_kw.update(how.create)
    new_mode = _restored_mode(snap, 0o600 if mode is None else mode)
    sweep_stale_staging()
    staging = staging_name()
    pool = create_staging(
        Pool, target, staging, h.size, block_size=h.block_size, policy=h.policy, max_entries=h.max_entries,
        mode=new_mode, multi_threaded=bool(h.flags & FLAG_MULTI_THREADED), lfu_period=h.lfu_period, clock=clock,
        prefault=False, reserve=cfg["reserve"], keep=cfg["keep"], tier_admit=cfg.get("tier_admit", 1),
        _reserve_later=later, **tier_kw,
    )
    lock_fd = -1
    quiet = contextlib.ExitStack()
    try:
        _came_from(pool.core, snap, h.config.get("created") if h.config else None)
        if new_mode & 0o060 and snap.untrusted is None and snap.file_gid != os.getegid():
            # A group pool comes back in the group its snapshot was persisted for (persist gives the
            # file the pool's group); where we may not give it that group, it stays in ours.
            try:
                os.fchown(pool.core.seg.fd, -1, snap.file_gid)
            except PermissionError:
                pass
        for kind, part, how in coming:
            if not how.later:
                tiers[kind.name] = kind.restored(part, how.create, pool.tiers.named(kind.name))
        if later:
            core = pool.core
            core.locked(restore_end, core, h.counters)
            if h.counters is not None:
                core.header["seq"] = h.counters["seq"]  # new puts are more recent than every entry to come
            fill.mark(core, snap, private)
            # Held from before the publish to the fill's end (by the filler, when detached), so that
            # nobody ever sees this fill without its filler.
            lock_fd = os.open(segment.shm_path(staging), os.O_RDWR | os.O_CLOEXEC)
            RecordLock(lock_fd, fill.FILL_BYTE).acquire()
            report = {"entries": 0, "bytes": 0, "expired_skipped": 0}
        else:
            report = _fill_pool(pool, snap, h.counters, progress, xxhash.xxh3_64())
        pool.core.header["name"] = target.encode()
        for kind, part, how in coming:
            if how.later:  # under the real name only (the staging handle must never talk to a server)
                kind.record(pool.core.header, part)
                tiers[kind.name] = kind.restored(part, how.create, None)
        for t in pool.tiers.configured:
            t.renamed(segment.shm_path(target))
        if later:
            # Published, but the restore goes on (the fill): signals wait only until the fill starts.
            quiet.enter_context(interrupts.atomic())
            segment.publish(staging, target)
        else:
            with interrupts.commit():  # published: a signal now waits, and the restore reports success
                segment.publish(staging, target)
    except BaseException:
        quiet.close()
        if lock_fd >= 0:
            os.close(lock_fd)
        discard(Pool, pool, staging)
        if not segment.exists(target):
            for kind, _, how in coming:
                kind.restore_failed(how.create)  # what this restore made anew goes with it
        raise
    pool.close()
    segment.unlink(staging)  # the second name of the published pool (not Pool.unlink: that marks it gone)
    report["tiers"] = tiers
    report["not_attached"] = not_attached
    report["published_seconds"] = None
    try:
        if later:
            report["published_seconds"] = round(time.perf_counter() - t0, 6)
            report["filling"] = True
            if detach:  # before this process opens the pool (a remote tier would start a thread)
                report["filler_pid"] = _detached_fill(lambda: Pool.open(target, clock=clock), snap, quiet)
        out = Pool.open(target, clock=clock)
        try:
            if later and not detach:
                try:
                    quiet.close()  # a signal that waited for the publish interrupts now
                except interrupts.Interrupted as e:
                    e.kept = (f"pool {target!r} stays, published with none of its values yet; "
                              f"`cortex cache restore {target} --if-missing` fills it")
                    raise
                report.update(_run_fill(out.core, snap, progress))
        except BaseException:
            out.close()
            raise
    finally:
        quiet.close()
        if lock_fd >= 0:
            os.close(lock_fd)  # the fill lock goes with it (or stays the filler's, when detached)
    return out, report


def check_snapshot_dir(directory: Path, mode: int = 0o600) -> None:
    """Refuse a snapshot directory another user owns or may write (PermissionDenied, 77)."""
    safefs.check_dir(directory, mode, "snapshot directory")


def _restored_mode(snap: "Snapshot", mode: int) -> int:
    """`mode`, unless it lets someone read what the snapshot file does not let them read.

    Read bits only: a snapshot is never writable by others (persist writes a
    group pool's as 0640), and who may write the pool is the operator's
    choice; who may read its data is bounded by who could read the file."""
    wider = mode & 0o044 & ~snap.file_mode
    if wider:
        raise PermissionDenied(
            f"mode {mode:04o} would let more users read pool data than snapshot {str(snap.path)!r} "
            f"(mode {snap.file_mode:04o}) does: give --mode {mode & ~(wider | wider >> 1) & 0o666:04o} or narrower"
        )
    return mode


def _replace(Pool: "PoolClass", target: str, snap: "Snapshot", mode: int | None, progress,
             clock, allow_other_owner: bool = False) -> tuple["PoolHandle", dict[str, Any]]:
    """Build the snapshot's pool beside `target` with target's configuration, then rename it over target.

    Held meanwhile: target's persist lock, so no persist or second restore of
    it runs.  The disk tier stays where it is: the new pool is built with a
    throw-away tier of the same index size and pointed at the real one just
    before the swap; the old pool's records there are killed after it (a
    kill in between leaves only unreachable records, which a later restart
    scan could find again).
    """
    snap.verify()  # the cheap refusal first: a damaged file never costs a staging pool
    old = Pool.open(target, clock=clock, require_owner=not allow_other_owner)
    try:
        lock = RecordLock(old.core.seg.fd, PERSIST_BYTE)
        if not lock.take_soon():
            raise busy(old.core.seg.fd, target, "restore")
        running = RecordLock(old.core.seg.fd, RESTORE_BYTE)  # says "a restore" to whoever waits on PERSIST_BYTE
        running.try_acquire()
        try:
            old.core.locked(fill.stop, old.core)  # a fill of the pool replaced stops: its pool is going
            cfg = old.core.locked(pool_config, old.core)
            keep = tier_header(old.core)
            st = old.core.seg.stat()
            new_mode = _restored_mode(snap, cfg["mode"] if mode is None else mode)
            tier_kw: dict[str, Any] = {}
            tmp_tier = None
            try:
                # A tier whose index is in the segment: the new pool gets a throw-away one of its size.
                stand_ins = [t for t in old.tiers.configured if t.in_segment]
                if stand_ins:
                    sweep_stale_tmp()
                    pid, start = procs.me()  # in the name, so the next restore knows a killed one's leftovers
                    with interrupts.atomic():  # made and noted as one step (the finally below removes it)
                        tmp_tier = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{pid}-{start}-")
                    for t in stand_ins:
                        tier_kw.update(t.stand_in(tmp_tier))
                sweep_stale_staging()
                staging = staging_name()
                pool = create_staging(
                    Pool, target, staging, cfg["size"], block_size=cfg["block_size"], policy=POLICY_IDS[cfg["policy"]],
                    max_entries=cfg["max_entries"], mode=new_mode,
                    multi_threaded=bool(cfg["flags"] & FLAG_MULTI_THREADED),
                    lfu_period=cfg["lfu_period"], clock=clock, prefault=False, **tier_kw,
                )
                try:
                    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                        try:
                            os.fchown(pool.core.seg.fd, st.st_uid, st.st_gid)  # the replaced pool's owners keep it
                        except PermissionError:
                            raise PermissionDenied(
                                f"cannot give the restored pool the owner of {target!r} (uid {st.st_uid} "
                                f"gid {st.st_gid}); restore it as that user or as root"
                            ) from None
                    report = _fill_pool(pool, snap, cfg["counters"], progress, None)
                    _came_from(pool.core, snap, float(old.core.header[0]["created"]))
                    pool.core.header["name"] = target.encode()
                    for field, value in keep.items():
                        pool.core.header[field] = value
                    pool.close()
                    with interrupts.commit():  # swapped in: a signal now waits, and the restore reports success
                        # Marked superseded and renamed over in one lock hold of the old segment (Core.retire):
                        # whatever the kill point, no process is left on a copy nobody can find untold.
                        old.core.locked(old.core.retire, lambda: segment.replace(staging, target))
                except BaseException:
                    discard(Pool, pool, staging)
                    raise
            finally:
                if tmp_tier is not None:
                    for kind in TIERS:
                        kind.remove_stand_in(tmp_tier)
                    os.rmdir(tmp_tier)
            for t in old.tiers.configured:
                if not t.shared:
                    try:  # the old pool's records would come back on a restart scan of the tier
                        old.tiers.evict(Selector(None, None, True, False, None, None), t.name)  # (old is superseded)
                    except CortexCacheError:
                        pass
        finally:
            running.release()
            lock.release()
    finally:
        old.close()
    return Pool.open(target, clock=clock), report


def _came_from(core: Core, snap: Snapshot, created: float | None) -> None:
    """A restored pool's header says when the pool was first created (`created`: the snapshot's record of it,
    or the replaced pool's; else the snapshot's own time, the pool was there then) and that its last
    snapshot is the one it came from: status, --json and the Prometheus gauge all say so."""
    h = core.header[0]
    h["created"] = created or snap.header.created
    h["last_snapshot"] = snap.header.created


def _fill_pool(pool: "PoolHandle", snap: Snapshot, counters, progress, hasher) -> dict[str, Any]:
    """Put every live record of `snap` into a new, empty pool; NoSpace if they do not all stay."""
    core = pool.core
    lock = RecordLock(core.seg.fd, PERSIST_BYTE)
    if not lock.take_soon():
        raise busy(core.seg.fd, pool.name, "restore")
    try:
        now = core.clock()
        restored = expired = nbytes = 0
        # Sequence numbers of a snapshot restored into a pool in use go after the pool's own.
        base = 0 if counters is not None else core.locked(lambda: int(core.fields.seq[0]))
        count = 0
        evictions_before = pool.stats()["evictions"]
        expiring: list[tuple[float, int]] = []  # (expiry, bytes) of restored entries with a TTL
        try:
            for rec in snap.records(verify=hasher is not None, values=False, hasher=hasher):
                count += 1
                if 0 < rec.expiry <= now:
                    expired += 1
                    continue
                try:
                    restore_entry(core, rec, base)
                except (ValueTooLarge, PoolFull) as e:
                    raise NoSpace(f"snapshot {str(snap.path)!r} does not fit: {e}; nothing was changed") from None
                restored += 1
                nbytes += len(rec.value)
                if rec.expiry:
                    expiring.append((rec.expiry, len(rec.value)))
                if progress is not None:
                    progress(nbytes, snap.value_bytes)
            if hasher is not None:
                snap.check_trailer(count, hasher)
        except OSError as e:
            if e.errno != errno.EFAULT:  # a copy out of a mapping cut short (the kernel's read of it)
                raise
            raise SnapshotCorrupt(f"snapshot {str(snap.path)!r} was cut short while it was read (truncated by "
                                  "another process?); nothing read from it is used") from None
        finally:
            snap.check_whole()  # zeros read from a file cut short (the SIGBUS fence): never published
        # An entry the pool evicted to make room for a later one was not restored.  Evictions are
        # counted apart from expirations, so an entry whose TTL ran out during the restore (it
        # would be gone anyway) is not mistaken for one that did not fit.
        st = pool.stats()
        if st["evictions"] != evictions_before:
            raise NoSpace(
                f"snapshot {str(snap.path)!r} does not fit: {restored} live entries ({nbytes} bytes), "
                f"of which a pool of {st['size_bytes']} bytes and {st['max_entries']} entries keeps "
                f"{st['entries']}; nothing was changed"
            )
        # The policy state the snapshot carries (versions 4 and 6), laid over the entries in the hold that
        # ends the restore, as a fill's end does (fill._finish): before the pool is published.
        state = snap.policy_state() if counters is not None else None
        ready = policy_state.prepare(core, state) if state else None  # outside the hold, as the fill does
        applied = core.locked(_end_restore, core, counters, state, ready)
        end = core.clock()
        ran_out = [n for expiry, n in expiring if expiry <= end]
        return {"entries": restored - len(ran_out), "bytes": nbytes - sum(ran_out),
                "expired_skipped": expired + len(ran_out), "policy_state": applied}
    finally:
        lock.release()


def _end_restore(core: Core, counters: dict[str, int] | None, state: bytes | None,
                 ready: "policy_state.Prepared | None" = None) -> dict[str, Any] | None:
    """Lock held: the counters, then the policy state (policy_state.apply's report; None without one;
    `ready`: its prepare, made before the hold)."""
    restore_end(core, counters)
    return policy_state.apply(core, state, ready) if state else None


__all__ = ["restore", "resize", "check_snapshot_dir", "STAGING_PREFIX", "STAGING_STALE_AFTER", "TMP_PREFIX", "stale_tmp_dirs"]
