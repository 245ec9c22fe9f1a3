"""`cortex cache create`, `delete`, `resize`: making, removing and resizing pools.

The pool-admin commands.  Each parses, calls the library (imported inside
the command, so `--help` loads no numpy) and says what it did; how that
looks is cli_render.py.
"""

from __future__ import annotations

import inspect
from typing import Optional

import typer

from .cli_options import (
    DEBUG_OPT, JSON_OPT, MAX_DISK_ENTRIES, MAX_KEEP, NAME_ARG, QUIET_OPT, DiskWrite, Policy, Tier, parse_mode,
    path_given,
)
from .cli_render import fmt_size, print_json, say, say_created, warn
from .errors import UsageError
from .policy_names import DEFAULT_POLICY, IF_UNSURE, policy_list
from .units import entries, plural

def create(
    name: str = NAME_ARG,
    size: str = typer.Option(..., "--size", "-s", metavar="SIZE", help="Data capacity, e.g. 16G, 512MiB, 1.5G (K/M/G/T = powers of 1024, KB/MB/GB = 1000)."),
    tier: Tier = typer.Option(Tier.cpu, "--tier", metavar="TIER", case_sensitive=False, help="Storage tiers: cpu (shared memory only) or disk (shared memory plus a disk tier)."),
    block_size: str = typer.Option("64K", "--block-size", metavar="SIZE", help="Allocation unit; a power of two."),
    policy: Optional[Policy] = typer.Option(None, "--policy", metavar="POLICY", case_sensitive=False, help=f"Eviction policy, in any case: see the policies above (default {DEFAULT_POLICY}; with --if-missing, a pool that exists may have any policy unless this is given)."),
    max_entries: Optional[int] = typer.Option(None, "--max-entries", metavar="N", help="Index capacity (default: one entry per block, at most 1,048,576)."),
    mode: str = typer.Option("0600", "--mode", metavar="MODE", help="Permission bits of the segment (octal)."),
    no_reserve: bool = typer.Option(False, "--no-reserve", help="Do not reserve and pre-fault memory (sparse pool; writes can fail with SIGBUS if /dev/shm fills)."),
    multi_threaded: bool = typer.Option(False, "--multi-threaded", help="Make handles thread-safe by default."),
    disk_path: Optional[str] = typer.Option(None, "--disk-path", metavar="DIR", help="Directory of the disk tier (implies --tier disk; default: a folder 'disk/NAME' next to the snapshot directory). A directory that already holds this pool's tier is taken over and its entries found again."),
    disk_size: Optional[str] = typer.Option(None, "--disk-size", metavar="SIZE", help="Capacity of the disk tier, reserved now (default: 4x --size, or the existing tier's)."),
    disk_write: Optional[DiskWrite] = typer.Option(None, "--disk-write", metavar="MODE", case_sensitive=False, help="back (default): entries evicted from memory go to disk; through: every put also goes to disk."),
    disk_o_direct: bool = typer.Option(False, "--disk-o-direct", help="Read and write the disk tier with O_DIRECT (bypassing the page cache) where the filesystem allows it."),
    disk_max_entries: Optional[int] = typer.Option(None, "--disk-max-entries", min=1, max=MAX_DISK_ENTRIES, metavar="N", help="Disk index capacity (default: one entry per block of disk, at most 2,097,152)."),
    remote: Optional[str] = typer.Option(None, "--remote", metavar="URL", help="A Valkey/Redis server as a tier below memory and disk, shared by pools of this name on every host: redis://[:PASSWORD@]HOST:PORT/DB, rediss://..., unix:///PATH?db=N."),
    remote_cluster: bool = typer.Option(False, "--remote-cluster", help="The --remote URL names a node of a Valkey/Redis cluster."),
    keep: Optional[int] = typer.Option(None, "--keep", min=1, max=MAX_KEEP, metavar="N", help="Snapshots of this pool that persist keeps (stored with the pool; default 3)."),
    tier_admit: int = typer.Option(1, "--tier-admit", min=1, max=2, metavar="N", help="Admission to the disk and remote tiers: 1 (default) every entry memory evicts goes to a write-back disk tier and every put to the remote; 2: only entries seen at least twice (read since their put; under s3fifo, arc and auto also put again while remembered as a ghost), when memory evicts them (stored with the pool)."),
    if_missing: bool = typer.Option(False, "--if-missing", help="Exit 0 if a pool of this name and configuration exists already (73, naming each difference, if its configuration differs; its policy only if --policy is given; 77 if it is neither yours nor root's)."),
    allow_other_owner: bool = typer.Option(False, "--allow-other-owner", help="With --if-missing: accept an existing pool of another user (by default only your own or root's: another user may have taken the name first)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Create a pool.

    {policies}

    {if_unsure}

    Example: cortex cache create llama --size 16G --policy lru --tier disk --disk-size 64G
    """
    from .pool import Pool
    from .units import parse_size

    if disk_write is not None and tier is Tier.cpu and disk_path is None:
        raise UsageError("--disk-write needs --tier disk (or --disk-path)")
    from . import segment

    existed = if_missing and segment.exists(name)
    p = Pool.create(
        name,
        parse_size(size),
        block_size=parse_size(block_size),
        policy=policy.value if policy is not None else None,
        max_entries=max_entries,
        mode=parse_mode(mode),
        reserve=not no_reserve,
        multi_threaded=multi_threaded,
        tier=tier.value,
        disk_path=disk_path,
        disk_size=parse_size(disk_size) if disk_size is not None else None,
        disk_write=disk_write.value if disk_write is not None else "back",
        disk_o_direct=disk_o_direct,
        disk_max_entries=disk_max_entries,
        remote=remote,
        remote_cluster=remote_cluster,
        keep=keep,
        tier_admit=tier_admit,
        exist_ok=if_missing,
        allow_other_owner=allow_other_owner,
    )
    with p:
        st = p.stats()
    if not existed:
        _warn_on_create(size, parse_size(size), st, no_reserve)
    if as_json:
        # `created` stays the pool's creation time (as in status --json); whether this run made it is `existed`.
        print_json({**st, "existed": existed})
    elif existed:
        say(f"pool {name} exists with this configuration; nothing to do")
    else:
        say_created(name, st)


# The list of policies and the line for the undecided, made from policy_names.py (the one place to change them).
create.__doc__ = inspect.cleandoc(create.__doc__ or "").format(policies=policy_list(), if_unsure=IF_UNSURE)


def _warn_on_create(asked_text: str, asked: int, st: dict, no_reserve: bool) -> None:
    """What a new pool's settings do that its creator may not have meant; the pool is made all the same."""
    from . import segment

    if st["size_bytes"] != asked:
        warn(f"--size {asked_text} is not a whole number of {fmt_size(st['block_size'])} blocks: the pool holds "
             f"{fmt_size(st['size_bytes'])} ({plural(st['blocks_total'], 'block', 'blocks')})")
    mode = int(st["mode"], 8)
    if mode & 0o006:
        warn(f"mode {st['mode']} lets every user of this host read{' and write' if mode & 0o002 else ''} the "
             "pool's values (users' prompts); 0600, or 0660 with a group, keeps them private")
    if no_reserve:
        free = segment.shm_free_bytes()
        if st["segment_bytes"] > free:
            warn(f"with --no-reserve the pool's {fmt_size(st['segment_bytes'])} segment is larger than the "
                 f"{fmt_size(free)} free in /dev/shm: puts fail once /dev/shm is full")


def delete(
    name: str = NAME_ARG,
    force: bool = typer.Option(False, "--force", "-f", help="Delete even while other processes have the pool mapped, and remove its disk tier too."),
    disk_path: Optional[str] = typer.Option(None, "--disk-path", metavar="DIR", callback=path_given, help="With --force, for a pool that is gone: remove the disk tier it left in DIR (no live pool may use it)."),
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Remove a pool.

    Processes that still have it mapped keep their mapping until they close
    it; without --force such a pool is not deleted.  A disk tier is kept
    (a pool created again on it finds its entries) unless --force is given;
    --force also removes a tier left at the default place by a delete that
    was killed after its segment went, and --force --disk-path DIR one left
    elsewhere (by Pool.unlink, or a pool deleted without --force).

    Example: cortex cache delete llama
    """
    from . import admin, segment

    gone = admin.delete_pool(name, force=force, disk_path=disk_path)
    if gone.squatter is not None:
        say(f"removed {gone.squatter} at {segment.shm_path(name)}")
        return
    tier = gone.disk_tier
    if gone.orphan:
        say(f"removed the orphaned disk tier {tier} of pool {name} (its segment was already gone)")
        return
    say(f"deleted pool {name}")
    if tier is None:
        return
    if gone.tier_removed:
        say(f"removed disk tier {tier}")
    else:
        say(f"kept disk tier {tier}: a pool created with --disk-path {tier} finds its entries; "
            "`delete --force` removes it")


def resize(
    name: str = NAME_ARG,
    size: str = typer.Option(..., "--size", metavar="SIZE", help="The pool's new size (data bytes, e.g. 8G); larger or smaller than now."),
    allow_other_owner: bool = typer.Option(False, "--allow-other-owner", help="Accept a pool of another user (by default only your own or root's)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Grow or shrink a live pool, keeping its most recently used entries first.

    A new pool of SIZE with the pool's configuration is filled while the old
    one serves, then swapped in under the name in one lock hold that also
    brings what was put or deleted meanwhile; entries that do not fit are the
    least recently used, left out (and counted).  Processes attached to the
    old pool see it replaced and move to the new one (the engine adapters at
    their next call).  A pool with a disk tier is refused for now (exit 2);
    a persist, restore or fill of the pool running exits 75.

    Example: cortex cache resize llama --size 16G
    """
    from .pool import Pool

    report = Pool.resize(name, size, allow_other_owner=allow_other_owner)
    if as_json:
        print_json(report)
        return
    left = f"; {entries(report['left_out'])} left out (least recently used)" if report["left_out"] else ""
    say(f"resized {name} from {fmt_size(report['old_size'])} to {fmt_size(report['size'])}: "
        f"{entries(report['entries'])}, {fmt_size(report['bytes'])} kept{left} in {report['seconds']:.2f}s")
