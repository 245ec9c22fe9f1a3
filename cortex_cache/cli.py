"""`cortex cache ...`: the operator CLI.

The CLI parses, calls the library, renders.  This module holds the Typer
app and its commands; how results look is cli_render.py, reading values and
writing output, errors and exit codes cli_io.py.  It imports the library (and
so numpy) only inside commands, so `cortex --help` stays fast.  Every error
ends as one line on stderr and a documented exit code (sysexits); `--debug`
or CORTEX_CACHE_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import os
import sys
from enum import Enum
from typing import Optional

import typer

from . import cli_io, interrupts
from .cli_render import (
    WATCH_HEADER, Output, console, fmt_rate, fmt_size, json_key, key_table, keys_table, pools_table, print_json, print_status,
    print_table, prometheus, run_with_progress, say, say_created, say_published, say_restored, show_key,
    snapshots_table,
    warn,
    watch_line,
)
from .errors import EX_PROBLEM, KeyNotFound, PoolNotFound, SnapshotCorrupt, UsageError
from .policy_names import DEFAULT_POLICY, POLICY_HELP, POLICY_IDS
from .units import entries, plural

EXIT_CODES_HELP = (
    "Exit status: 0 ok; 1 verify found a problem; 2 usage error; 65 corrupt or "
    "incompatible data; 66 no such pool, key or snapshot; 69 service unavailable; "
    "70 internal error; 73 cannot create (exists, not enough memory); 74 I/O error; "
    "75 temporary failure (lock held, out of file descriptors); 77 permission denied; 130 interrupted by SIGINT; "
    "143 interrupted by SIGTERM (what the command had made is removed)."
)


def _set_quiet(value: bool) -> bool:
    # Any -q on the line (before or after the command) makes the whole run quiet.
    if value:
        Output.quiet = True
    return value


QUIET_HELP = "Print no confirmations or progress bars; data, --json output, warnings and errors still appear."
QUIET_OPT = typer.Option(False, "--quiet", "-q", help=QUIET_HELP, callback=_set_quiet)
# main() takes --debug off the line wherever it stands (before a "--") before Typer parses it; the
# option is declared on every command so that each --help, the man page and the completions show it.
DEBUG_OPT = typer.Option(False, "--debug", help="Show the traceback of an error (also CORTEX_CACHE_DEBUG=1); accepted anywhere before a -- argument.")
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}


app = typer.Typer(
    name="cortex",
    help="cortex-cache: named KV-cache pools in POSIX shared memory.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=HELP_OPTIONS,
)
cache = typer.Typer(
    name="cache",
    help="Create, inspect, use and remove KV-cache pools.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=HELP_OPTIONS,
)
app.add_typer(cache, name="cache")


def _read_path() -> str:
    """Which read path pools opened here use (docs/internals.md, "The fast path"); without importing
    numpy, which `--version` does not need."""
    from importlib.util import find_spec

    if find_spec("cortex_cache._fastpath") is None:
        return "pure-Python path: the C fast path was not built"
    if os.environ.get("CORTEX_CACHE_PURE_PYTHON", "") not in ("", "0"):
        return "pure-Python path: CORTEX_CACHE_PURE_PYTHON is set"
    return "C fast path"


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("cortex-cache")
        except PackageNotFoundError:  # run from a source tree that was never installed
            v = "unknown"
        sys.stdout.write(f"cortex-cache {v} ({_read_path()})\n")
        raise typer.Exit(0)


VERSION_OPT = typer.Option(False, "--version", help="Print the version and exit.", callback=_show_version, is_eager=True)


@app.callback()
def _root(quiet: bool = QUIET_OPT, version: bool = VERSION_OPT, debug: bool = DEBUG_OPT) -> None:
    pass


@cache.callback()
def _cache(quiet: bool = QUIET_OPT, version: bool = VERSION_OPT, debug: bool = DEBUG_OPT) -> None:
    pass


# Typer writes a required argument as {NAME} in usage lines; the man page and
# every other tool write NAME.
def _usage_name(self) -> str:  # type: ignore[no-untyped-def]
    name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
    return name + ("..." if self.nargs != 1 else "")


if hasattr(typer.core.TyperArgument, "_usage_display_name"):
    typer.core.TyperArgument._usage_display_name = _usage_name  # type: ignore[method-assign]


Policy = Enum("Policy", {name: name for name in POLICY_IDS}, type=str)  # type: ignore[misc]


class Tier(str, Enum):
    cpu = "cpu"
    disk = "disk"


class DiskWrite(str, Enum):
    back = "back"
    through = "through"


class WhichTier(str, Enum):
    memory = "memory"
    disk = "disk"
    all = "all"
    remote = "remote"


class Format(str, Enum):
    table = "table"
    json = "json"
    prometheus = "prometheus"


NAME_ARG = typer.Argument(..., metavar="NAME", help="Pool name: 1-64 of A-Z a-z 0-9 . _ -, starting with a letter or digit.", show_default=False)
JSON_OPT = typer.Option(False, "--json", help="Print one JSON document on stdout.")


def _parse_mode(text: str) -> int:
    t = text.lower().removeprefix("0o")
    try:
        mode = int(t, 8)
    except ValueError:
        raise UsageError(f"invalid mode {text!r}: give octal permission bits like 0600 or 0660") from None
    if mode & ~0o777 or mode & 0o600 != 0o600:
        raise UsageError(f"invalid mode {text!r}: must be within 0777 and include owner read/write (0600)")
    return mode


# ---------------------------------------------------------------- commands


@cache.command()
def create(
    name: str = NAME_ARG,
    size: str = typer.Option(..., "--size", "-s", metavar="SIZE", help="Data capacity, e.g. 16G, 512MiB, 1.5G (K/M/G/T = powers of 1024, KB/MB/GB = 1000)."),
    tier: Tier = typer.Option(Tier.cpu, "--tier", metavar="TIER", help="Storage tiers: cpu (shared memory only) or disk (shared memory plus a disk tier)."),
    block_size: str = typer.Option("64K", "--block-size", metavar="SIZE", help="Allocation unit; a power of two."),
    policy: Policy = typer.Option(DEFAULT_POLICY, "--policy", metavar="POLICY", help="Eviction policy: " + "; ".join(f"{k}: {v}" for k, v in POLICY_HELP.items()) + "."),
    max_entries: Optional[int] = typer.Option(None, "--max-entries", metavar="N", help="Index capacity (default: one entry per block, at most 1,048,576)."),
    mode: str = typer.Option("0600", "--mode", metavar="MODE", help="Permission bits of the segment (octal)."),
    no_reserve: bool = typer.Option(False, "--no-reserve", help="Do not reserve and pre-fault memory (sparse pool; writes can fail with SIGBUS if /dev/shm fills)."),
    multi_threaded: bool = typer.Option(False, "--multi-threaded", help="Make handles thread-safe by default."),
    disk_path: Optional[str] = typer.Option(None, "--disk-path", metavar="DIR", help="Directory of the disk tier (implies --tier disk; default: a folder 'disk/NAME' next to the snapshot directory). A directory that already holds this pool's tier is taken over and its entries found again."),
    disk_size: Optional[str] = typer.Option(None, "--disk-size", metavar="SIZE", help="Capacity of the disk tier, reserved now (default: 4x --size, or the existing tier's)."),
    disk_write: Optional[DiskWrite] = typer.Option(None, "--disk-write", metavar="MODE", help="back (default): entries evicted from memory go to disk; through: every put also goes to disk."),
    disk_o_direct: bool = typer.Option(False, "--disk-o-direct", help="Read and write the disk tier with O_DIRECT (bypassing the page cache) where the filesystem allows it."),
    disk_max_entries: Optional[int] = typer.Option(None, "--disk-max-entries", min=1, metavar="N", help="Disk index capacity (default: one entry per block of disk, at most 2,097,152)."),
    remote: Optional[str] = typer.Option(None, "--remote", metavar="URL", help="A Valkey/Redis server as a tier below memory and disk, shared by pools of this name on every host: redis://[:PASSWORD@]HOST:PORT/DB, rediss://..., unix:///PATH?db=N."),
    remote_cluster: bool = typer.Option(False, "--remote-cluster", help="The --remote URL names a node of a Valkey/Redis cluster."),
    keep: Optional[int] = typer.Option(None, "--keep", metavar="N", help="Snapshots of this pool that persist keeps (stored with the pool; default 3)."),
    tier_admit: int = typer.Option(1, "--tier-admit", metavar="N", help="Admission to the disk and remote tiers: 1 (default) every entry memory evicts goes to a write-back disk tier and every put to the remote; 2: only entries seen at least twice (read since their put; under s3fifo, arc and auto also put again while remembered as a ghost), when memory evicts them (stored with the pool)."),
    if_missing: bool = typer.Option(False, "--if-missing", help="Exit 0 if a pool of this name and configuration exists already (73, naming each difference, if its configuration differs; 77 if it is neither yours nor root's)."),
    allow_other_owner: bool = typer.Option(False, "--allow-other-owner", help="With --if-missing: accept an existing pool of another user (by default only your own or root's: another user may have taken the name first)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Create a pool.

    Example: cortex cache create llama --size 16G --policy lru --tier disk --disk-size 64G
    """
    from .pool import Pool
    from .units import parse_size

    if disk_write is not None and tier is Tier.cpu and disk_path is None:
        raise UsageError("--disk-write needs --tier disk (or --disk-path)")
    if keep is not None and keep < 1:
        raise UsageError(f"--keep must be at least 1, not {keep}")
    from . import segment

    existed = if_missing and segment.exists(name)
    p = Pool.create(
        name,
        parse_size(size),
        block_size=parse_size(block_size),
        policy=policy.value,
        max_entries=max_entries,
        mode=_parse_mode(mode),
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


@cache.command("list")
def list_(as_json: bool = JSON_OPT, quiet: bool = QUIET_OPT, debug: bool = DEBUG_OPT) -> None:
    """List every pool under the current prefix (CORTEX_CACHE_SHM_PREFIX).

    Segments that are damaged, of another format version, or not readable by
    you are listed with their state instead of their figures.

    Example: cortex cache list --json
    """
    from . import admin

    rows = admin.all_pool_summaries()
    if as_json:
        print_json({"pools": rows})
        return
    if rows:
        print_table(pools_table(rows))
    else:
        say("no pools", stderr=True)


@cache.command()
def status(
    name: Optional[str] = typer.Argument(None, metavar="NAME", help="Pool name (default: every pool).", show_default=False),
    as_json: bool = JSON_OPT,
    fmt: Optional[Format] = typer.Option(None, "--format", metavar="FORMAT", help="table (default), json, or prometheus (text exposition format)."),
    watch: Optional[float] = typer.Option(None, "--watch", metavar="SECONDS", help="Print one line of rates (puts/s, gets/s, hit ratio, evictions/s, disk spills and promotions/s) every SECONDS (default 1) until Ctrl-C; needs NAME."),
    count: Optional[int] = typer.Option(None, "--count", min=1, metavar="N", help="With --watch: stop after N lines."),
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Show usage, entries, counters and policy of one pool or all pools.

    A pool that is missing exits 66, except with --format prometheus, which
    prints cortex_cache_up{pool="NAME"} 0 for it (a scrape must not come back
    empty).

    Example: cortex cache status llama --json
    """
    from . import admin

    if as_json and fmt not in (None, Format.json):
        raise UsageError(f"--json and --format {fmt.value} contradict each other: give one")
    fmt = Format.json if as_json else (fmt or Format.table)
    if count is not None and watch is None:
        raise UsageError("--count goes with --watch")
    if watch is not None:
        if name is None:
            raise UsageError("--watch needs a pool NAME")
        if fmt is Format.prometheus:
            raise UsageError("--watch prints rates as a table or JSON lines, not prometheus")
        if not watch > 0:
            raise UsageError(f"--watch needs a positive number of seconds, not {watch}")
        _watch(name, watch, count, fmt is Format.json)
        return
    if name is not None:
        rows = [admin.pool_status(name, missing_ok=fmt is Format.prometheus)]
    else:
        rows = admin.all_pool_statuses()
    if fmt is Format.json:
        print_json(rows[0] if name is not None else {"pools": rows})
        return
    if fmt is Format.prometheus:
        sys.stdout.write(prometheus(rows))
        return
    if not rows:
        say("no pools", stderr=True)
        return
    print_status(rows)


def _watch(name: str, interval: float, count: int | None, as_json: bool) -> None:
    from . import watch as w
    from .pool import Pool

    def sample() -> dict:
        # Attached only while it reads: between samples nothing is mapped, so `delete` does not count
        # the watch as a user, and a pool replaced under the name is the one watched next.  A pool
        # deleted ends the watch as PoolNotFound (66).
        try:
            with Pool.open(name, lock_timeout=5, snapshot_tier=False) as p:  # stats only
                return p.stats()
        except PoolNotFound:
            if n == 0:
                raise
            raise PoolNotFound(f"pool {name!r} is gone: it was deleted while watched") from None

    n = 0
    try:
        for r in w.watch(sample, interval, count):
            if as_json:
                print_json({"pool": name, **r})
            else:
                if n % 20 == 0:
                    sys.stdout.write(WATCH_HEADER + "\n")
                sys.stdout.write(watch_line(r))
            sys.stdout.flush()
            n += 1
    except (KeyboardInterrupt, interrupts.Interrupted):  # the way to stop it (Ctrl-C, SIGTERM): not an error
        pass


@cache.command()
def delete(
    name: str = NAME_ARG,
    force: bool = typer.Option(False, "--force", "-f", help="Delete even while other processes have the pool mapped, and remove its disk tier too."),
    disk_path: Optional[str] = typer.Option(None, "--disk-path", metavar="DIR", help="With --force, for a pool that is gone: remove the disk tier it left in DIR (no live pool may use it)."),
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
        say(f"removed {gone.squatter} at {segment.shm_path(name)}", stderr=True)
        return
    tier = gone.disk_tier
    if gone.orphan:
        say(f"removed the orphaned disk tier {tier} of pool {name} (its segment was already gone)")
        return
    say(f"deleted pool {name}")
    if tier is None:
        return
    if gone.tier_removed:
        say(f"removed disk tier {tier}", stderr=True)
    else:
        say(f"kept disk tier {tier}: a pool created with --disk-path {tier} finds its entries; "
            "`delete --force` removes it", stderr=True)


@cache.command()
def put(
    name: str = NAME_ARG,
    key: str = typer.Argument(..., metavar="KEY", help="Key (UTF-8 string).", show_default=False),
    source: Optional[str] = typer.Argument(None, metavar="FILE|-", help="Read the value from FILE, or from stdin with '-'.", show_default=False),
    ttl: Optional[float] = typer.Option(None, "--ttl", metavar="SECONDS", help="Seconds until the entry expires."),
    priority: int = typer.Option(0, "--priority", metavar="N", help="Priority (the priority policy evicts lowest first)."),
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Store a value under a key.

    At most the pool's size is read: a longer input (an endless pipe,
    /dev/zero) stops there and exits 2, storing nothing.

    Example: echo hello | cortex cache put llama greeting -
    """
    from .pool import Pool

    with Pool.open(name, lock_timeout=10) as p:
        data = cli_io.read_value(source, p.geometry.data_size)
        p.put(key, data, ttl=ttl, priority=priority)


@cache.command()
def get(
    name: str = NAME_ARG,
    key: str = typer.Argument(..., metavar="KEY", help="Key to read.", show_default=False),
    output: Optional[str] = typer.Option(None, "--output", "-o", metavar="FILE", help="Write the value to this file (mode 0600) instead of stdout ('-': stdout); an existing file is refused unless --force."),
    force: bool = typer.Option(False, "--force", "-f", help="With -o: replace an existing file (atomically: the old one stays whole until the new one is)."),
    peek: bool = typer.Option(False, "--peek", help="Read from memory without counting a hit or miss or changing the eviction order (tiers below memory are not looked at)."),
    verify: bool = typer.Option(False, "--verify", help="Check the value against the checksum taken at put; exit 65 (and write nothing) if it does not match. CORTEX_CACHE_VERIFY_READS=1 turns it on too."),
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Write a value to stdout (or a file).  Exit 66 if the key is absent.

    With -o the file appears whole or not at all: an existing one exits 73
    (--force replaces it), output that cannot be written (a full disk)
    exits 74 and leaves nothing.  An entry whose metadata is impossible
    (damaged, or changed by another writer) exits 65.

    Example: cortex cache get llama greeting -o greeting.bin
    """
    from .pool import Pool

    if output == "-":
        output = None
    if force and output is None:
        raise UsageError("--force replaces the file -o names; there is none")
    out = cli_io.OutputFile(output, replace=force) if output is not None else None
    try:
        with Pool.open(name, lock_timeout=10, verify_reads=verify or None) as p:
            value = p.peek(key) if peek else p.get(key)
        if value is None:
            raise KeyNotFound(f"no key {key!r} in pool {name!r}")
    except BaseException:
        if out is not None:
            out.discard()
        raise
    if out is None:
        cli_io.write_stdout(value)
    else:
        out.write(value)


@cache.command()
def keys(
    name: str = NAME_ARG,
    prefix: Optional[str] = typer.Option(None, "--prefix", metavar="PREFIX", help="Only keys starting with this."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, metavar="N", help="At most this many keys."),
    long: bool = typer.Option(False, "--long", "-l", help="Show size, age, TTL, accesses and priority."),
    tier: WhichTier = typer.Option(WhichTier.memory, "--tier", metavar="TIER", help="memory (default), disk (reads each key from its record), all (memory and disk), or remote (this pool's keys on the remote server, in key order)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """List keys of live entries, oldest first, one a line.

    A backslash shows as \\\\ and every byte that is not printable text (a
    newline, an escape sequence, a byte that is not UTF-8) as \\xNN, so each
    line names exactly one key.  --json adds key_type (str or bytes) and,
    for bytes keys, key_hex.

    Example: cortex cache keys llama --prefix user42/ --limit 20
    """
    from .pool import Pool

    with Pool.open(name, lock_timeout=10) as p:
        if tier in (WhichTier.disk, WhichTier.all) and p.disk_path is None:
            raise UsageError(f"pool {name!r} has no disk tier")
        if tier is WhichTier.remote:  # the server's listing carries size and TTL already
            infos = p.remote_entries(prefix=prefix, limit=limit)
            ks = [inf["key"] for inf in infos]
        else:
            ks = p.keys(prefix=prefix, limit=limit, tier=tier.value)
            infos = []
            for k in ks if long or as_json else []:
                try:
                    infos.append(p.info(k))
                except KeyNotFound:  # removed meanwhile
                    continue
    if as_json:
        print_json({"keys": [json_key(inf) for inf in infos]})
        return
    if not long:
        sys.stdout.write("".join(show_key(k) + "\n" for k in ks))
        return
    print_table(keys_table(infos))


@cache.command()
def info(
    name: str = NAME_ARG,
    key: str = typer.Argument(..., metavar="KEY", help="Key to describe.", show_default=False),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Show one entry: its tier, size and blocks, times, accesses, priority, TTL, checksum and pins.

    Counts no access and changes no eviction order.  Exit 66 if the key is
    in no tier of the pool.

    Example: cortex cache info llama greeting
    """
    from .pool import Pool

    with Pool.open(name, lock_timeout=10) as p:
        doc = p.info(key)
    if as_json:
        print_json({"pool": name, **json_key(doc)})
    else:
        print_table(key_table(doc))


@cache.command()
def evict(
    name: str = NAME_ARG,
    percent: Optional[float] = typer.Option(None, "--percent", metavar="PERCENT", help="Evict this percentage of the stored bytes, by policy."),
    nbytes: Optional[str] = typer.Option(None, "--bytes", metavar="SIZE", help="Evict at least this many value bytes, by policy (e.g. 1G)."),
    expired: bool = typer.Option(False, "--expired", help="Evict expired entries only."),
    key: Optional[list[str]] = typer.Option(None, "--key", metavar="KEY", help="Evict this key; repeat the option for more keys (--key a --key b)."),
    prefix: Optional[str] = typer.Option(None, "--prefix", metavar="PREFIX", help="Evict every key starting with this."),
    all_: bool = typer.Option(False, "--all", help="Evict everything."),
    tier: WhichTier = typer.Option(WhichTier.memory, "--tier", metavar="TIER", help="memory (default; with a disk tier, evicted entries move to disk), disk (removed from the disk tier, oldest first for --percent/--bytes), all (removed from both), or remote (deleted from the remote server, for every host; --key, --prefix or --all only)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Evict entries now and report what was freed.  Give exactly one selector.

    Several keys: repeat the option, --key a --key b.

    Example: cortex cache evict llama --percent 25
    """
    from .pool import Pool, check_selector

    check_selector(percent, nbytes, expired, key or None, prefix, all_,
                   names=("--percent", "--bytes", "--expired", "--key", "--prefix", "--all"))
    with Pool.open(name, lock_timeout=10) as p:
        count, freed = p.evict(
            percent=percent, nbytes=nbytes, expired=expired, keys=key or None, prefix=prefix, all=all_,
            tier=tier.value,
        )
    if as_json:
        print_json({"pool": name, "tier": tier.value, "entries": count, "bytes": freed})
    else:
        where = " from the remote server" if tier is WhichTier.remote else ""
        say(f"evicted {entries(count)}, {fmt_size(freed)} ({freed} bytes){where}")


@cache.command()
def verify(
    name: str = NAME_ARG,
    repair: bool = typer.Option(False, "--repair", help="Fix what is found (drops entries that cannot be trusted)."),
    no_checksums: bool = typer.Option(False, "--no-checksums", help="Check metadata only, not every value's checksum."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Check a pool's consistency; exit 1 if a problem was found (even if --repair fixed it).

    Without --repair it only reports: nothing in the pool changes (pins of
    dead processes, say, stay until --repair or the next write that needs
    their room).

    Example: cortex cache verify llama --repair
    """
    from .pool import Pool

    with Pool.open(name, lock_timeout=10) as p:
        report = p.verify(repair=repair, checksums=not no_checksums)
    if as_json:
        print_json({"pool": name, **report})
    else:
        con = console()
        if report["ok"]:
            disk = f", {report['disk_checked']} disk records verified" if "disk_checked" in report else ""
            say(f"pool {name}: ok ({entries(report['entries'])}, {plural(report['checked'], 'checksum', 'checksums')} verified{disk})")
        for prob in report["problems"]:
            con.print(f"pool {name}: {prob}" + (" [repaired]" if report["repaired"] else ""), markup=False)
        if report["problems"] and not report["repaired"]:
            say(f"nothing was changed; `cortex cache verify {name} --repair` fixes these")
    if not report["ok"]:
        raise typer.Exit(EX_PROBLEM)


@cache.command()
def persist(
    name: str = NAME_ARG,
    output: Optional[str] = typer.Option(None, "--output", "-o", metavar="FILE", help="Write the snapshot to this file instead of the snapshot directory."),
    keep: Optional[int] = typer.Option(None, "--keep", min=1, metavar="N", help="Keep the newest N snapshots of the pool in the snapshot directory, now and at every later persist (stored with the pool, so only its owner or root may set it: 77 for anyone else; default 3)."),
    full: bool = typer.Option(False, "--full", help="Write every value again, sharing nothing with the snapshots kept (in the snapshot directory; --output always writes a whole file)."),
    force: bool = typer.Option(False, "--force", "-f", help="With --output: replace an existing file (atomically: the old one stays whole until the new one is)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Write an atomic, checksummed snapshot of a pool's live entries.

    Without --output the snapshot goes to the snapshot directory
    (CORTEX_CACHE_SNAPSHOT_DIR) as NAME-<UTC time>.ccsnap, and NAME.ccsnap
    always names the newest.  It is incremental: only the values that no
    kept snapshot holds are written, into a pack file beside it
    (NAME-<UTC time>.ccpack); packs no kept snapshot needs are deleted.
    --output writes one self-contained file (to copy to another host); an
    existing file is refused (73) unless --force, as with get -o.  A second
    persist of the same pool while one runs exits 75 at once.

    Example: cortex cache persist llama --keep 5
    """
    from . import persist as snap
    from .pool import Pool

    if force and output is None:
        raise UsageError("--force replaces the file --output names; there is none (the snapshot directory's "
                         "snapshots are never replaced)")
    if output is not None:
        from . import safefs

        safefs.refuse_existing(output, force)  # before the pool is opened; persist checks again at the end
    with Pool.open(name, lock_timeout=10) as p:
        result = run_with_progress(f"persist {name}", lambda cb: snap.persist(p, output, keep=keep, progress=cb,
                                                                               full=full, replace=force))
    doc = {"pool": name, **result.as_dict()}
    if as_json:
        print_json(doc)
    else:
        wrote = f", {fmt_size(doc['written_bytes'])} of it written" if doc["incremental"] else ""
        say(
            f"persisted {entries(doc['entries'])}, {fmt_size(doc['bytes'])} of {name}{wrote} to {doc['path']} "
            f"in {doc['seconds']:.2f}s ({fmt_rate(doc['bytes'], doc['seconds'])})"
        )
        if result.skipped_corrupt:
            console(stderr=True).print(
                f"cortex: warning: {entries(result.skipped_corrupt)} failed their checksum in memory and were left out"
            )


@cache.command()
def restore(
    name: str = NAME_ARG,
    input_: Optional[str] = typer.Option(None, "--input", "-i", metavar="FILE", help="Snapshot file (default: NAME.ccsnap in the snapshot directory)."),
    replace: bool = typer.Option(False, "--replace", help="Replace an existing pool: a new one with its size, policy and tiers is filled from the snapshot and swapped in atomically (its disk tier is emptied; a remote tier is left alone)."),
    if_missing: bool = typer.Option(False, "--if-missing", help="Exit 0 and change nothing if the pool exists; restore it if it does not (exit 66 without a snapshot)."),
    mode: Optional[str] = typer.Option(None, "--mode", metavar="MODE", help="Permission bits of the restored segment (octal; default 0600, with --replace the replaced pool's); never wider than the snapshot file's."),
    allow_other_owner: bool = typer.Option(False, "--allow-other-owner", help="With --if-missing or --replace: accept an existing pool of another user (by default only your own or root's: another user may have taken the name first)."),
    trust_tiers: bool = typer.Option(False, "--trust-tiers", help="Attach the snapshot's disk and remote tiers and retention even from a file another user could have written (by default only from snapshots this user wrote)."),
    background: bool = typer.Option(False, "--background", help="Return as soon as the pool is published; a process of its own fills it (status shows how far it got). What the boot line and the systemd unit use."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Rebuild a pool from a snapshot.

    A missing pool restored from the snapshot directory serves at once: it
    is published with the snapshot's whole configuration (size, policy,
    retention, counters) and its tiers attached again (the disk tier's
    records that check out are found again, the remote tier is used again)
    before any value is in, and the values come in afterwards, most recently
    used first, each checked against its checksum, while every process may
    use the pool (an entry not loaded yet is read from the snapshot when asked
    for, checked).  The command returns
    when the fill is done, or at once with --background.  A restore killed
    while it fills leaves the pool with what it loaded: the next restore
    --if-missing (or restore NAME) finishes it; persist waits until then.
    A missing or damaged pack is refused (65) before anything is made; a
    value that fails its checksum is left out and the command exits 65
    naming the file.  A self-contained file (--input of a persist --output
    file) is verified whole while its pool is built under a temporary name,
    and appears only when complete.  An existing pool is only replaced with
    --replace, built aside and swapped in atomically (other processes see
    the old pool or the new one, never a mix; processes attached to the old
    one keep it until they reopen).  A snapshot whose entries do not all fit
    exits 73 and changes nothing.  Expired entries are not restored.  A
    FIFO or device exits 2.  Tiers and retention come back only from a
    snapshot this user wrote (the file and its directory theirs, writable by
    nobody else, as persist makes them) or with --trust-tiers; from another
    file the entries come back and one line names what was not attached.

    Example: cortex cache restore llama --if-missing --background
    """
    from . import persist as snap

    if input_ is not None and os.path.isdir(input_):
        # Opening a directory read-only succeeds; say what is wrong before the reader tries to map it.
        raise UsageError(f"{input_!r} is a directory, not a snapshot")
    if background and replace:
        raise UsageError("--background is for a pool that is missing: --replace swaps in a complete pool")
    def run(cb):
        return snap.restore(input_, name=name, replace=replace, progress=cb, if_missing=if_missing,
                            mode=_parse_mode(mode) if mode is not None else None, trust_tiers=trust_tiers,
                            allow_other_owner=allow_other_owner, detach=background)

    # --background forks the filler: no progress bar (its refresh thread) may be running then.
    pool, report = run(None) if background else run_with_progress(f"restore {name}", run)
    if pool is None:  # --if-missing, and the pool is there
        if as_json:
            print_json(report)
        else:
            say(f"pool {name} exists; nothing restored" + (" (another restore is filling it)"
                                                            if report.get("filling") else ""))
        return
    pool.close()
    if report.get("filler_pid"):
        if as_json:
            print_json(report)
        else:
            say_published(report)
        return
    secs = report["seconds"]
    report["gbps"] = round(report["bytes"] / secs / 1e9, 3) if secs > 0 else 0.0
    if as_json:
        print_json(report)
    else:
        say_restored(report)
        left = report.get("not_attached")
        if left:
            what = ", ".join(
                f"{label} {left[k]}" for k, label in (("disk", "disk tier"), ("remote", "remote tier"),
                                                      ("keep", "retention")) if k in left
            )
            console(stderr=True).print(
                f"cortex: warning: not attached: {what} ({left['why']}); restore --trust-tiers attaches them"
            )


@cache.command()
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


@cache.command()
def snapshots(
    name: str = NAME_ARG,
    verify: bool = typer.Option(False, "--verify", help="Also read every value back and check it against its checksum; exit 65 if a snapshot is damaged or misses a pack."),
    prune: bool = typer.Option(False, "--prune", help="Remove all but the newest --keep snapshots (and the packs only they used), then list what is left."),
    keep: Optional[int] = typer.Option(None, "--keep", min=0, metavar="N", help="With --prune: how many to keep (default: as many as the pool keeps, 3 for a pool that is gone; 0 removes every one, NAME.ccsnap too)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """List every snapshot of a pool in the snapshot directory, oldest first.

    Shows each one's time, entries and value bytes, the bytes on disk that
    are its own and those it shares with the others (the packs of
    incremental snapshots), and which one NAME.ccsnap (what restore reads by
    default) names; then what they take on disk together.  Reads the
    snapshot files, not the values, unless --verify.  --prune removes the
    older ones first, as persist's retention does (the pool need not
    exist; while it does, a persist, restore or fill running exits 75).

    Example: cortex cache snapshots llama --prune --keep 2
    """
    from . import persist as snap
    from . import segment

    segment.validate_name(name)
    if keep is not None and not prune:
        raise UsageError("--keep goes with --prune (persist --keep sets what a pool keeps)")
    pruned = None
    if prune:
        pruned = _prune_snapshots(name, keep)
        say(f"removed {plural(len(pruned['removed']), 'file', 'files')} of {name}'s snapshots, "
            f"{fmt_size(pruned['freed_bytes'])}; {plural(pruned['kept'], 'snapshot', 'snapshots')} kept",
            stderr=True)
    rows, space = snap.snapshots_and_space(name, verify=verify)
    bad = [r for r in rows if "error" in r]
    if as_json:
        print_json({"pool": name, "directory": str(snap.snapshot_dir()), "snapshots": rows, "space": space,
                    **({"pruned": pruned} if pruned is not None else {})})
    elif not rows:
        say(f"no snapshots of {name} in {snap.snapshot_dir()}", stderr=True)
    else:
        print_table(snapshots_table(rows))
        ratio = f", {space['ratio']:.2f}x the largest" if space["ratio"] else ""
        say(f"on disk: {fmt_size(space['total_bytes'])} ({fmt_size(space['pack_bytes'])} in packs){ratio}"
            + (f"; {len(rows) - len(bad)} of {len(rows)} verified whole" if verify else ""))
    if verify and bad:
        raise typer.Exit(SnapshotCorrupt.exit_code)


def _prune_snapshots(name: str, keep: int | None) -> dict:
    from . import persist as snap
    from . import segment
    from .pool import Pool

    if not segment.exists(name):
        return snap.prune(name, snap.DEFAULT_KEEP if keep is None else keep)
    with Pool.open(name, lock_timeout=10) as p:
        return p.prune_snapshots(keep)


@cache.command()
def doctor(
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Check this host's set-up; exit 1 if something is wrong, each finding with what to do.

    Looks at /dev/shm (size against the pools, huge pages), the snapshot and
    disk-tier directories (owner, mode, free space), the remote tiers
    (redis-py installed, server answering), restore staging segments and
    what else killed restores, persists and deletes left behind (each with
    the command that sweeps it), and which `cortex` a cron job would run.
    Changes nothing.

    Example: cortex cache doctor
    """
    from . import doctor as doc

    running = sys.argv[0] if os.path.basename(sys.argv[0]) == "cortex" else None
    findings = doc.diagnose(running=os.path.abspath(running) if running else None)
    bad = [f for f in findings if not f["ok"]]
    if as_json:
        print_json({"ok": not bad, "findings": findings})
    else:
        for f in findings:
            line = f"{'FAIL' if not f['ok'] else 'warn' if f.get('warning') else 'ok  '} {f['message']}"
            sys.stdout.write(line + (f"\n     fix: {f['fix']}" if f["fix"] else "") + "\n")
    if bad:
        raise typer.Exit(EX_PROBLEM)


# ---------------------------------------------------------------- entry point


COMPLETE_VAR = "_CORTEX_COMPLETE"


def _watch_default(args: list[str]) -> list[str]:
    """`--watch` takes an optional SECONDS (like `redis-cli --stat`): supply 1 where none follows."""
    out = []
    for i, a in enumerate(args):
        out.append(a)
        if a == "--":  # what follows is data (a KEY), not options
            return out + args[i + 1 :]
        if a == "--watch":
            nxt = args[i + 1] if i + 1 < len(args) else None
            try:
                float(nxt)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                out.append("1")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return (and exit with) its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    Output.quiet = False
    if os.environ.get(COMPLETE_VAR):
        # A shell asking for completions the Typer way (e.g. _CORTEX_COMPLETE=complete_bash):
        # register Typer's shell classes, which add_completion=False leaves out.
        from typer.completion import completion_init

        completion_init()
    debug = os.environ.get("CORTEX_CACHE_DEBUG", "") not in ("", "0")
    # --debug is accepted anywhere before a "--" separator.
    options = args[: args.index("--")] if "--" in args else args
    if "--debug" in options:
        debug = True
        args.remove("--debug")
    as_json = "--json" in options  # errors, too, are JSON then (on stderr)
    args = _watch_default(args)
    # SIGINT and SIGTERM interrupt a command as an error would, its cleanup included (interrupts.py);
    # the CLI's own process (argv None) keeps the handlers to its exit.
    with interrupts.handled(keep=argv is None):
        return cli_io.run_guarded(
            lambda: typer.main.get_command(app).main(
                args=args, prog_name="cortex", complete_var=COMPLETE_VAR, standalone_mode=False
            ),
            debug,
            as_json,
        )


def run() -> None:
    sys.exit(main())


__all__ = ["app", "main", "run"]
