"""Pools by name, as an operator sees them: what `list`, `status` and `delete` do.

A pool's figures, or the state of one that cannot be read (corrupt, of
another format, not yours); who has it mapped and its snapshots; deleting
it, or whatever squats on its name, and its disk tier.  The CLI calls these
and only renders what they return.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import header, interrupts, procs, segment
from . import persist as snap
from .disklog import META_NAME, DiskLog
from .errors import CortexCacheError, PermissionDenied, PoolBusy, PoolNotFound, SegmentCorrupt, UsageError
from .pool import Pool, disk_tier_of, unlink_marked


def status_word(e: CortexCacheError) -> str:
    """The state of a pool that could not be read, in one word or two."""
    if isinstance(e, SegmentCorrupt):
        return "corrupt"
    if isinstance(e, PermissionDenied):
        return "no permission"
    if isinstance(e, PoolNotFound):
        return "gone"
    return "unavailable"


def open_listed(name: str) -> Pool:
    """Pool.open for a listing: a segment still without its header is reported at once, never waited for
    (hundreds of planted empty segments must not cost a wait each)."""
    seg = header.open_segment(name, wait=False)
    try:
        return Pool(seg, lock_timeout=5, snapshot_tier=False)  # stats only: no index of a filling snapshot
    except BaseException:
        seg.close()
        raise


def pool_summary(name: str) -> dict[str, Any]:
    """Pool `name`'s stats with "status": "ok", or its name, state and error when it cannot be read."""
    try:
        with open_listed(name) as p:
            st = p.stats()
        st["status"] = "ok"
        return st
    except CortexCacheError as e:
        return {"name": name, "status": status_word(e), "error": str(e)}


def listed_names() -> list[str]:
    """The pools `list` and `status` show: every segment under the prefix but restore's staging ones
    (not pools yet; `doctor` reports those left behind, and anyone may plant such a name) and the pools of
    a longer prefix (`nc.sd.`'s pool `x` is the segment `nc.sd.x`, which `nc.` would list as `sd.x`: the
    header's prefix mark says whose it is)."""
    return [e.name for e in segment.scan()
            if not e.name.startswith(snap.STAGING_PREFIX) and not header.made_under_another_prefix(e.name)]


def all_pool_summaries() -> list[dict[str, Any]]:
    """pool_summary of every pool under the current prefix (restore's staging segments left out)."""
    return [pool_summary(n) for n in listed_names()]


def others_attached(name: str, attached: dict[str, list[int]] | None = None) -> list[int]:
    """Pids that have the pool mapped, this process (which may just have read it) aside; `attached`:
    segment.attached_map() read once for many pools."""
    pids = attached.get(name, []) if attached is not None else segment.attached_pids(name)
    return [p for p in pids if p != os.getpid()]


def others_on_old_copies(name: str, old: dict[str, list[int]] | None = None) -> list[int]:
    """Pids that still map a segment the name had before (replaced by restore --replace, or deleted): they
    move to the pool now under the name at their next operation that checks (Pool.superseded), or hold the
    old copy until they exit.  `old`: segment.mapped_generations()[1] read once for many pools."""
    pids = old.get(name, []) if old is not None else segment.mapped_generations()[1].get(name, [])
    return [p for p in pids if p != os.getpid()]


def add_operating_facts(row: dict[str, Any], attached: dict[str, list[int]] | None = None,
                        described: dict[int, dict[str, Any]] | None = None,
                        old: dict[str, list[int]] | None = None) -> None:
    """What status adds to a pool's stats: who has it mapped (and who still maps a copy it replaced), and its
    snapshots (`attached`, `old`, `described`: what was read of /proc once for many pools)."""
    if attached is None:
        attached, old = segment.mapped_generations()
    row["attached_pids"] = others_attached(row["name"], attached)
    row["attached_old_pids"] = others_on_old_copies(row["name"], old or {})
    if described is None:
        described = {}
    for p in row["attached_pids"] + row["attached_old_pids"]:
        if p not in described:
            described[p] = procs.describe(p)
    row["attached"] = [dict(described[p]) for p in row["attached_pids"]]
    row["attached_old"] = [dict(described[p]) for p in row["attached_old_pids"]]
    row["snapshots"] = snap.snapshot_usage(row["name"])
    row["snapshots"]["latest_value_bytes"] = latest_value_bytes(row["name"])


def latest_value_bytes(name: str) -> int | None:
    """The value bytes pool `name`'s latest snapshot (NAME.ccsnap) holds, what a restore of it loads, from
    the file's trailer (its manifest's, for an incremental snapshot, whose values are in packs: the file
    alone is a small part of them); None without one, or one that cannot be read."""
    try:
        with snap.Snapshot(snap.latest_path(name), verify=False, private=True) as s:
            return int(s.value_bytes)
    except (CortexCacheError, OSError):
        return None


def pool_status(name: str, missing_ok: bool = False) -> dict[str, Any]:
    """What `status NAME` shows: the pool's stats and operating facts, "status": "ok".  A missing pool
    is PoolNotFound, or with `missing_ok` a row saying it is gone (a Prometheus scrape must not be empty)."""
    try:
        with Pool.open(name, lock_timeout=5, snapshot_tier=False) as p:  # stats only
            st = p.stats()
    except PoolNotFound as e:
        if not missing_ok:
            raise
        return {"name": name, "status": "gone", "error": str(e)}
    st["status"] = "ok"
    add_operating_facts(st)
    return st


def all_pool_statuses() -> list[dict[str, Any]]:
    """What `status` shows of every pool: pool_summary, with the operating facts of those that could be read."""
    rows = all_pool_summaries()
    attached, old = segment.mapped_generations()  # /proc read once, not once per pool
    described: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["status"] == "ok":
            add_operating_facts(r, attached, described, old)
    return rows


@dataclass
class Deleted:
    """What delete_pool removed."""

    squatter: str | None  # what squatted on the name instead of a pool ("a symlink"), removed; None for a pool
    disk_tier: str | None  # the deleted pool's disk tier directory
    tier_removed: bool = False  # `force`: the tier's files went too (else it is still in place)
    orphan: bool = False  # there was no segment, only a tier of the name that a killed delete left


def delete_pool(name: str, force: bool = False, disk_path: str | None = None) -> Deleted:
    """Remove pool `name`'s segment; its disk tier stays (a pool created again on it finds its entries),
    unless `force`, which removes the tier first, then the segment, as one step that SIGINT and SIGTERM
    wait for (interrupts.commit): a delete killed in between leaves the segment, and running it again
    finishes it.  With `force` and no segment, an orphaned tier of the name at the default place
    (`orphaned_tier`: what a delete killed by an older version left) is removed.

    `disk_path` (with `force`, when no segment of the name exists): the directory of a disk tier the pool
    left there (`Pool.unlink` leaves the tier), removed if it is ours and no live pool uses it.

    Processes that have the pool mapped keep their mapping; without `force` such a pool is PoolBusy.
    Something else on the name (a symlink, a directory...) is SegmentCorrupt, and removed with `force`."""
    segment.validate_name(name)
    if disk_path is not None and not force:
        raise UsageError("--disk-path goes with --force: it removes a disk tier whose pool is gone")
    if disk_path is not None and segment.exists(name):
        raise UsageError(f"pool {name!r} exists: `delete {name} --force` removes it with its own disk tier")
    if not segment.exists(name):
        orphan = orphaned_tier(name) if force else None
        if disk_path is not None:
            orphan = _orphan_at(name, disk_path)
        if orphan is not None:
            with interrupts.commit():
                DiskLog.destroy(orphan)
            return Deleted(squatter=None, disk_tier=orphan, tier_removed=True, orphan=True)
        raise PoolNotFound(f"no pool named {name!r}")
    squatter = segment.squatter_kind(name)
    if squatter:  # a symlink, a directory...: not a pool, so nothing maps it and there is no tier
        if not force:
            raise SegmentCorrupt(f"{segment.shm_path(name)} is {squatter}, not a pool; `delete --force` removes it")
        return Deleted(squatter=segment.remove_squatter(name), disk_tier=None)
    live, old = segment.mapped_generations()
    users = others_attached(name, live)
    on_old = others_on_old_copies(name, old)
    if (users or on_old) and not force:
        also = f"{', ' if users else ''}and on a copy it replaced by pid {', '.join(map(str, on_old))}" if on_old else ""
        raise PoolBusy(f"pool {name!r} is in use{' by pid ' + ', '.join(map(str, users)) if users else ''}"
                       f"{also}{_filling_note(name)}; use --force to delete it anyway")
    tier = disk_tier_of(name)
    removed = force and tier is not None
    with interrupts.commit():
        if removed:
            DiskLog.destroy(tier)  # type: ignore[arg-type]
        unlink_marked(name)  # marked in the lock hold that unlinks: processes attached learn it is gone
    return Deleted(squatter=None, disk_tier=tier, tier_removed=removed)


def _filling_note(name: str) -> str:
    """For a delete refused because the pool is in use: say if one of its users is the process filling it
    from a snapshot (restore --background's: its pid means nothing to whoever asks), which --force stops."""
    from .fill import filler_alive

    try:
        with Pool.open(name) as p:
            if filler_alive(p.core):
                return " (a restore is filling it from its snapshot: --force stops the fill too)"
    except CortexCacheError:
        pass
    return ""


def _orphan_at(name: str, path: str) -> str:
    """`path` if it holds a disk tier of ours that no live pool uses (delete NAME --force --disk-path)."""
    from .disktier import live_owner

    path = os.path.abspath(path)
    if not DiskLog.exists(path):
        raise PoolNotFound(f"no pool named {name!r}, and no disk tier in {path!r}")
    try:
        st = os.lstat(os.path.join(path, META_NAME))
    except OSError as e:
        raise PoolNotFound(f"no disk tier in {path!r}: {e.strerror}") from None
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        raise PermissionDenied(f"the disk tier in {path!r} is uid {st.st_uid}'s, not yours")
    owner = live_owner(path, segment.shm_path(name))
    if owner is not None:
        raise PoolBusy(f"{path!r} is the disk tier of the live pool {owner}; delete that pool instead")
    return path


def remove_disk_tier(path: str) -> None:
    """Remove a disk tier's files and directory (delete --force)."""
    DiskLog.destroy(path)


def orphaned_tier(name: str) -> str | None:
    """The default disk tier directory of pool `name` (pool.default_disk_path) if it holds tier files
    while no segment of the name exists: ours (owner checked, no symlink), left by a killed delete or
    create.  None otherwise."""
    import stat

    from .disklog import FILES, META_NAME
    from .pool import default_disk_path

    if segment.exists(name):
        return None
    path = default_disk_path(name)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return None
    names = {META_NAME, *(f"tier-{i:02d}.log" for i in range(FILES))}
    try:
        found = any(e.name in names for e in os.scandir(path))
    except OSError:
        return None
    return path if found else None


__all__ = ["status_word", "pool_summary", "all_pool_summaries", "others_attached", "others_on_old_copies", "add_operating_facts",
           "pool_status", "all_pool_statuses", "listed_names", "latest_value_bytes", "open_listed", "disk_tier_of", "Deleted", "delete_pool", "remove_disk_tier",
           "orphaned_tier"]
