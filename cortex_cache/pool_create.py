"""Creating a pool: `Pool.create` (pool.py) and its checks, and where a pool's tier files go by default.

`create` validates what it is asked (name, sizes, policy, mode, the tiers'
options through config.py and tiers.plan), reserves the segment, initialises
its header and the tiers' regions under the record lock that openers wait on,
and attaches a handle of the class it is given (`cls`: Pool).  With
`exist_ok`, a pool that exists is opened and checked against what was asked
(`_open_as_asked`).  Everything it made is undone if any step fails.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import config, header, segment, snapshot
from .errors import NoSpace, PoolExists, PoolNotFound, UsageError
from .eviction import DEFAULT_POLICY, POLICIES, POLICY_IDS
from .layout import ADMIT_ALL, ADMIT_REUSED, HEADER_DTYPE, Geometry
from .lock import RecordLock
from .lower import Creating
from .tiers import plan as tiers_plan
from .units import format_size, parse_size


def create(
    cls: Any,
    name: str,
    size: int | str,
    *,
    block_size: int | str = 64 * 1024,
    policy: str | None = None,
    max_entries: int | None = None,
    mode: int = 0o600,
    reserve: bool = True,
    multi_threaded: bool = False,
    lfu_period: int | None = None,
    clock: Callable[[], float] | None = None,
    lock_timeout: float | None = None,
    prefault: bool = True,
    keep: int | None = None,
    tier_admit: int = 1,
    exist_ok: bool = False,
    allow_other_owner: bool = False,
    _reserve_later: bool = False,
    **tier_options: Any,
) -> Any:
    """Create pool `name` whose data region holds `size` bytes and attach to it.

    Raises InvalidName, InvalidSize, UsageError (policy, mode), PoolExists,
    NoSpace (not enough free shared memory, exit 73), PermissionDenied.
    With `reserve` (default) the memory is allocated and pre-faulted now,
    so later writes can never hit SIGBUS on a full /dev/shm; `prefault=False`
    keeps the reservation but skips mapping every page now (restore does,
    since it writes the pages through the file anyway).

    The tiers below memory take their own keywords (`tier_options`; each
    tier's OPTIONS, tier_table.py):

    Disk tier (disktier.py): `tier="disk"` (default "cpu") or a
    `disk_path` adds one.  `disk_path` defaults to
    `<snapshot dir>/../disk/<name>`, `disk_size` to 4x `size` (its space is
    reserved now: NoSpace, exit 73, if the disk lacks it); `disk_write` is
    "back" (entries evicted from memory go to disk, the default) or
    "through" (every put also goes to disk); `disk_o_direct`,
    `disk_max_entries` (the index rows).  A directory that already holds a
    tier is taken over and its entries found again.

    Remote tier (remote.py): `remote` is a Valkey/Redis URL (redis://,
    rediss://, unix://, with password and database in it;
    `remote_cluster=True` for a cluster).  redis-py must be installed (the
    `remote` extra): ServiceUnavailable (69) if it is not.

    `tier_admit`: 1 (default) sends every entry memory evicts to the disk tier (write-back) and every
    put to the remote; 2 only entries read since their put (seen at least twice), to both, when memory
    evicts them -- fewer bytes written below, for the entries likely to be read again.

    `keep`: how many snapshots `persist` keeps of this pool (stored with
    it; default 3).  `policy`: default DEFAULT_POLICY.  `exist_ok`: a pool
    of this name that exists is opened and returned if it is configured as
    asked (what the call gives explicitly, defaults for the rest of size,
    block size and index; its policy only when `policy` is given: a pool
    restored from a snapshot keeps the policy it had); PoolExists naming
    each difference if not.  Such a pool must be
    this user's or root's (its segment's owner, by fstat): another user may
    have taken the name first under the shared prefix, and what its header
    says (mode included) is theirs to forge.  PermissionDenied (77) for
    another owner's, unless `allow_other_owner`.
    """
    segment.validate_name(name)
    nbytes = parse_size(size)
    bsize = parse_size(block_size)
    opts = config.tier_options(tier_options)
    if keep is not None and not 1 <= keep < 2**32:
        raise UsageError(f"keep must be at least 1, not {keep}")
    if tier_admit not in (ADMIT_ALL, ADMIT_REUSED):
        raise UsageError(f"tier admission must be 1 (every entry) or 2 (entries seen twice), not {tier_admit!r}")
    wants = config.wanted(opts, lambda tier: tier_home(name, tier), tier_admit)
    if exist_ok and segment.exists(name):
        return _open_as_asked(cls, name, nbytes, bsize, policy, max_entries, mode, multi_threaded, keep, wants,
                                  clock, lock_timeout, allow_other_owner)
    asked_policy, policy = policy, policy or DEFAULT_POLICY
    if policy not in POLICIES:
        raise UsageError(f"unknown policy {policy!r}: choose one of {', '.join(POLICY_IDS)}")
    if not isinstance(mode, int) or mode & ~0o777 or not mode & 0o600 == 0o600:
        raise UsageError(f"invalid mode {mode!r}: give permission bits like 0o600 or 0o660, owner rw included")
    ghosts = POLICIES[policy].ghosts if POLICIES[policy].queues else None  # type: ignore[attr-defined]
    geo = Geometry.compute(nbytes, bsize, max_entries, ghosts=ghosts)
    if lfu_period is not None and lfu_period < 1:
        raise UsageError("lfu_period must be at least 1")
    plans = tiers_plan(wants, opts, Creating(name, segment.shm_path(name), mode, geo.data_size, bsize))
    if plans:
        regions = {k: v for p in plans.values() for k, v in p.geometry().items()}
        geo = Geometry.compute(nbytes, bsize, max_entries, ghosts=ghosts, **regions)
    try:
        if reserve and _reserve_later:
            # restore's background fill reserves the memory as it goes (fill.py): the room is
            # checked now, so a pool that cannot have it is refused before anyone sees it.
            free = segment.shm_free_bytes()
            if geo.segment_size > free:
                raise NoSpace(f"not enough shared memory for pool {name!r}: needs "
                              f"{format_size(geo.segment_size)}, {segment.SHM_DIR} has {format_size(free)} free")
        seg = segment.Segment.create(name, geo.segment_size, mode=mode, reserve=reserve and not _reserve_later,
                                     reserve_head=geo.data_off)
    except BaseException as e:
        for plan in plans.values():
            plan.undo()
        if exist_ok and isinstance(e, PoolExists):  # another process created it meanwhile
            return _open_as_asked(cls, name, nbytes, bsize, asked_policy, max_entries, mode, multi_threaded, keep,
                                      wants, clock, lock_timeout, allow_other_owner)
        raise
    init_lock = RecordLock(seg.fd)
    pool = None
    # A tier with work once attached (the disk tier taken over: its records found again) does it
    # before the magic goes in, so that no process ever sees the tier half-found.
    later = any(plan.finishes for plan in plans.values())
    try:
        # Openers that find no magic yet wait on this lock until we are done.
        init_lock.acquire()
        if reserve and prefault and not _reserve_later:
            seg.prefault()
        header.initialise(seg, geo, name, policy, mode, reserve, multi_threaded, lfu_period, complete=not later)
        h = np.frombuffer(seg.mm, HEADER_DTYPE, 1, 0)
        if keep is not None:
            h["snapshot_keep"] = keep
        if tier_admit != ADMIT_ALL:
            h["tier_admit"] = tier_admit
        del h
        for plan in plans.values():
            plan.initialise(seg.mm, geo)
        if not later:
            init_lock.release()
        pool = cls(seg, multi_threaded=multi_threaded, clock=clock, lock_timeout=lock_timeout, _plans=plans)
        if later:
            for tier_name, plan in plans.items():
                plan.finish(pool.tiers.named(tier_name))
            header.publish(seg)
            init_lock.release()
        return pool
    except BaseException:
        if pool is not None:
            pool.close()
        else:
            seg.close()
        try:
            segment.unlink(name)
        except PoolNotFound:
            pass
        for plan in plans.values():
            plan.undo()
        raise


def _open_as_asked(cls: Any, name: str, nbytes: int, bsize: int, policy: str | None, max_entries: int | None, mode: int,
                   multi_threaded: bool, keep: int | None, wants: dict[str, Any], clock: Any,
                   lock_timeout: float | None, allow_other_owner: bool) -> Any:
    """create(exist_ok=True) of a pool that exists: open it, and check it is what was asked."""
    geo = Geometry.compute(nbytes, bsize, max_entries)
    want = config.requested(geo, policy, mode, multi_threaded, keep, wants)
    pool = cls.open(name, clock=clock, lock_timeout=lock_timeout, require_owner=not allow_other_owner)
    try:
        config.require_same(name, pool.configuration(), want)
    except BaseException:
        pool.close()
        raise
    return pool


def tier_home(name: str, tier: str) -> str:
    """Where a tier that keeps files keeps pool `name`'s when no directory is given: `<tier>/<name>` next to
    the snapshot directory, namespaced by CORTEX_CACHE_SHM_PREFIX like the segment (snapshot.namespaced)."""
    return str(snapshot.snapshot_dir().parent / tier / snapshot.namespaced(name))


def default_disk_path(name: str) -> str:
    """Where `--tier disk` puts a pool's tier when no path is given (tier_home)."""
    return tier_home(name, "disk")


__all__ = ["create", "tier_home", "default_disk_path"]
