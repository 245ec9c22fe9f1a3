"""`cortex cache ...`: the operator CLI.

The CLI parses, calls the library, renders.  It imports the library (and so
numpy) only inside commands, so `cortex --help` stays fast.  Every error ends
as one line on stderr and a documented exit code (sysexits); `--debug` or
CORTEX_CACHE_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import time
from enum import Enum
from typing import Any, Optional

import typer

from .errors import EX_IOERR, EX_PROBLEM, EX_SOFTWARE, EX_USAGE, CortexCacheError, KeyNotFound, UsageError
from .policy_names import DEFAULT_POLICY, POLICY_HELP, POLICY_IDS

EXIT_CODES_HELP = (
    "Exit status: 0 ok; 1 verify found a problem; 2 usage error; 65 corrupt or "
    "incompatible data; 66 no such pool, key or snapshot; 69 service unavailable; "
    "70 internal error; 73 cannot create (exists, not enough memory); 74 I/O error; "
    "75 temporary failure (lock held); 77 permission denied."
)


class _Output:
    """Process-wide output settings; main() resets them for every run."""

    quiet = False


def _set_quiet(value: bool) -> bool:
    # Any -q on the line (before or after the command) makes the whole run quiet.
    if value:
        _Output.quiet = True
    return value


QUIET_HELP = "Print no confirmations or progress bars; data, --json output, warnings and errors still appear."
QUIET_OPT = typer.Option(False, "--quiet", "-q", help=QUIET_HELP, callback=_set_quiet)


app = typer.Typer(
    name="cortex",
    help="cortex-cache: named KV-cache pools in POSIX shared memory.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
cache = typer.Typer(
    name="cache",
    help="Create, inspect, use and remove KV-cache pools.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(cache, name="cache")


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("cortex-cache")
        except PackageNotFoundError:  # run from a source tree that was never installed
            v = "unknown"
        sys.stdout.write(f"cortex-cache {v}\n")
        raise typer.Exit(0)


VERSION_OPT = typer.Option(False, "--version", help="Print the version and exit.", callback=_show_version, is_eager=True)


@app.callback()
def _root(quiet: bool = QUIET_OPT, version: bool = VERSION_OPT) -> None:
    pass


@cache.callback()
def _cache(quiet: bool = QUIET_OPT, version: bool = VERSION_OPT) -> None:
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


# ---------------------------------------------------------------- output helpers


def _console(stderr: bool = False):  # rich is imported by typer already
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal rich assumes 80 columns and would cut names and keys:
    # a pipe or file gets whole lines instead.
    width = None if stream.isatty() else 1 << 16
    # markup=False: our text holds brackets ("cortex-cache[remote]") that are no rich markup.
    return Console(stderr=stderr, highlight=False, soft_wrap=width is not None, width=width, markup=False)


def _print_table(table, console=None) -> None:
    """Print a rich table; off a terminal, without the padding rich leaves at line ends."""
    con = console or _console()
    if con.is_terminal:
        con.print(table)
        return
    with con.capture() as cap:
        con.print(table)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in cap.get().splitlines()))


def _now_iso() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def _print_json(doc: Any) -> None:
    """One JSON document on one line (fit for a log), with the time it was made (UTC, ISO 8601)."""
    if isinstance(doc, dict):
        doc = {"time": _now_iso(), **doc}
    sys.stdout.write(json.dumps(doc, separators=(",", ":")) + "\n")


def _say(msg: str, stderr: bool = False) -> None:
    """A confirmation or note for a person: silenced by -q/--quiet."""
    if not _Output.quiet:
        _console(stderr=stderr).print(msg)


def _fmt_size(n: int | float) -> str:
    from .units import format_size

    return format_size(n)


def _fmt_time(ts: float | None) -> str:
    if not ts:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _fmt_age(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


def _parse_mode(text: str) -> int:
    t = text.lower().removeprefix("0o")
    try:
        mode = int(t, 8)
    except ValueError:
        raise UsageError(f"invalid mode {text!r}: give octal permission bits like 0600 or 0660") from None
    if mode & ~0o777 or mode & 0o600 != 0o600:
        raise UsageError(f"invalid mode {text!r}: must be within 0777 and include owner read/write (0600)")
    return mode


def _show_key(k: str | bytes) -> str:
    """A key as one line of text that names it exactly: printable characters as they are, a backslash
    doubled, anything else (newlines, escape sequences, bytes that are not UTF-8) as \\xNN per byte."""
    text = k if isinstance(k, str) else k.decode("utf-8", "surrogateescape")
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c.isprintable():
            out.append(c)
        else:
            out.append("".join(f"\\x{b:02x}" for b in c.encode("utf-8", "surrogateescape")))
    return "".join(out)


def _json_key(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (an entry's info) with its key made JSON: shown as text, typed, and exact in hex if bytes."""
    k = doc["key"]
    doc["key"] = _show_key(k)
    doc["key_type"] = "str" if isinstance(k, str) else "bytes"
    if not isinstance(k, str):
        doc["key_hex"] = bytes(k).hex()
    return doc


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
    if_missing: bool = typer.Option(False, "--if-missing", help="Exit 0 if a pool of this name and configuration exists already (73, naming each difference, if its configuration differs)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
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
        exist_ok=if_missing,
    )
    with p:
        st = p.stats()
    if as_json:
        _print_json({**st, "created": not existed} if if_missing else st)
    elif existed:
        _say(f"pool {name} exists with this configuration; nothing to do")
    else:
        _say(
            f"created pool {name}: {_fmt_size(st['size_bytes'])} in {st['blocks_total']} blocks of "
            f"{_fmt_size(st['block_size'])}, policy {st['policy']}, mode {st['mode']}"
        )
        d = st["disk"]
        if d is not None:
            found = f", {d['entries']} entries found on it" if d["entries"] else ""
            _say(f"disk tier: {_fmt_size(d['capacity_bytes'])} in {d['path']}, write-{d['write']}{found}")
        r = st["remote"]
        if r is not None:
            _say(f"remote tier: {r['url']}" + (" (cluster)" if r["cluster"] else ""))


def _pool_summary(name: str) -> dict[str, Any]:
    from .pool import Pool

    try:
        with Pool.open(name, lock_timeout=5) as p:
            st = p.stats()
        st["status"] = "ok"
        return st
    except CortexCacheError as e:
        return {"name": name, "status": _status_word(e), "error": str(e)}


def _status_word(e: CortexCacheError) -> str:
    from .errors import PermissionDenied, PoolNotFound, SegmentCorrupt

    if isinstance(e, SegmentCorrupt):
        return "corrupt"
    if isinstance(e, PermissionDenied):
        return "no permission"
    if isinstance(e, PoolNotFound):
        return "gone"
    return "unavailable"


@cache.command("list")
def list_(as_json: bool = JSON_OPT, quiet: bool = QUIET_OPT) -> None:
    """List every pool under the current prefix (CORTEX_CACHE_SHM_PREFIX).

    Segments that are damaged, of another format version, or not readable by
    you are listed with their state instead of their figures.

    Example: cortex cache list --json
    """
    from . import segment

    rows = [_pool_summary(n) for n in segment.list_names()]
    if as_json:
        _print_json({"pools": rows})
        return
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for col in ("NAME", "SIZE", "USED", "ENTRIES", "POLICY", "MODE", "STATE"):
        t.add_column(col, justify="right" if col in ("SIZE", "USED", "ENTRIES") else "left")
    for r in rows:
        if r["status"] != "ok":
            t.add_row(r["name"], "-", "-", "-", "-", "-", r["status"])
            continue
        used = r["used_bytes"] / r["size_bytes"] * 100
        t.add_row(r["name"], _fmt_size(r["size_bytes"]), f"{used:.1f}%", str(r["entries"]), r["policy"], r["mode"], "ok")
    if rows:
        _print_table(t)
    else:
        _say("no pools", stderr=True)


def _prometheus(rows: list[dict[str, Any]]) -> str:
    metrics = [
        ("size_bytes", "gauge", "Data capacity of the pool in bytes."),
        ("used_bytes", "gauge", "Bytes of blocks in use."),
        ("value_bytes", "gauge", "Bytes of stored values."),
        ("entries", "gauge", "Live entries."),
        ("max_entries", "gauge", "Index capacity."),
        ("blocks_total", "gauge", "Blocks in the data region."),
        ("blocks_used", "gauge", "Blocks in use."),
        ("hits", "counter", "Lookups that found a live entry."),
        ("misses", "counter", "Lookups that found nothing (or an expired entry)."),
        ("puts", "counter", "Values stored."),
        ("deletes", "counter", "Entries deleted by key."),
        ("evictions", "counter", "Entries evicted to make room or on request."),
        ("expirations", "counter", "Expired entries reclaimed."),
        ("bytes_evicted", "counter", "Value bytes evicted."),
        ("repairs", "counter", "Repairs after a process died inside the pool lock."),
    ]
    out = []
    ok = [r for r in rows if r["status"] == "ok"]
    for key, kind, help_ in metrics:
        name = f"cortex_cache_{key}" + ("_total" if kind == "counter" else "")
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for r in ok:
            out.append(f'{name}{{pool="{r["name"]}"}} {r[key]}')
    disk_metrics = [
        ("entries", "gauge", "Entries in the disk tier."),
        ("value_bytes", "gauge", "Bytes of values in the disk tier."),
        ("capacity_bytes", "gauge", "Capacity of the disk tier's files."),
        ("hits", "counter", "Memory misses found in the disk tier."),
        ("misses", "counter", "Memory misses not in the disk tier either."),
        ("spills", "counter", "Records written to the disk tier."),
        ("promotions", "counter", "Disk hits copied back into memory."),
        ("bytes_written", "counter", "Bytes written to the disk tier."),
        ("bytes_read", "counter", "Bytes read from the disk tier."),
        ("corrupt", "counter", "Disk records that failed their checksums (counted as misses)."),
        ("dropped", "counter", "Disk entries lost to the ring going round or a full disk index."),
        ("errors", "counter", "I/O errors of the disk tier."),
        ("evictions", "counter", "Entries removed from the disk tier by evict, delete or replace."),
    ]
    remote_metrics = [
        ("hits", "counter", "Misses of memory and disk found on the remote server."),
        ("misses", "counter", "Remote lookups that found nothing usable."),
        ("promotions", "counter", "Remote hits copied into memory."),
        ("errors", "counter", "Failed remote commands and connections."),
        ("corrupt", "counter", "Remote values that failed their checks."),
        ("writes_done", "counter", "Remote writes that succeeded."),
        ("writes_dropped", "counter", "Remote writes dropped (queue full, or abandoned at close)."),
        ("bytes_written", "counter", "Bytes written to the remote server."),
        ("bytes_read", "counter", "Bytes read from the remote server."),
    ]
    with_remote = [r for r in ok if r.get("remote")]
    for key, kind, help_ in remote_metrics if with_remote else []:
        name = f"cortex_cache_remote_{key}" + ("_total" if kind == "counter" else "")
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for r in with_remote:
            out.append(f'{name}{{pool="{r["name"]}"}} {r["remote"][key]}')
    with_disk = [r for r in ok if r.get("disk")]
    for key, kind, help_ in disk_metrics if with_disk else []:
        name = f"cortex_cache_disk_{key}" + ("_total" if kind == "counter" else "")
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for r in with_disk:
            v = r["disk"][key]
            out.append(f'{name}{{pool="{r["name"]}"}} {v if v is not None else "NaN"}')
    snap_metrics = [
        ("snapshots", "count", "gauge", "Timestamped snapshots of the pool in the snapshot directory."),
        ("snapshot_bytes", "bytes", "gauge", "Bytes of those snapshots."),
        ("last_snapshot_timestamp_seconds", "latest_time", "gauge",
         "When the latest snapshot (NAME.ccsnap) was written, seconds since the epoch; alert when it gets old."),
        ("last_snapshot_bytes", "latest_bytes", "gauge", "Size of the latest snapshot."),
    ]
    with_snaps = [r for r in ok if r.get("snapshots")]
    for metric, key, kind, help_ in snap_metrics if with_snaps else []:
        name = f"cortex_cache_{metric}"
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for r in with_snaps:
            v = r["snapshots"][key]
            out.append(f'{name}{{pool="{r["name"]}"}} {v if v is not None else "NaN"}')
    out.append("# HELP cortex_cache_up 1 if the pool could be opened and read, else 0.")
    out.append("# TYPE cortex_cache_up gauge")
    for r in rows:
        out.append(f'cortex_cache_up{{pool="{r["name"]}"}} {1 if r["status"] == "ok" else 0}')
    return "\n".join(out) + "\n"


def _others_attached(name: str) -> list[int]:
    """Pids that have the pool mapped, this `cortex` process (which just read it) aside."""
    from . import segment

    return [p for p in segment.attached_pids(name) if p != os.getpid()]


def _add_operating(row: dict[str, Any]) -> None:
    """What status adds to a pool's stats: who has it mapped, and its snapshots."""
    from . import persist as snap
    from . import procs

    row["attached_pids"] = _others_attached(row["name"])
    row["attached"] = [procs.describe(p) for p in row["attached_pids"]]
    row["snapshots"] = snap.snapshot_usage(row["name"])


def _show_attached(procs_: list[dict[str, Any]]) -> str:
    return ", ".join(f"{a['pid']} ({a['command'] or '?'}, uid {a['uid'] if a['uid'] is not None else '?'})"
                     for a in procs_) or "none"


@cache.command()
def status(
    name: Optional[str] = typer.Argument(None, metavar="NAME", help="Pool name (default: every pool).", show_default=False),
    as_json: bool = JSON_OPT,
    fmt: Optional[Format] = typer.Option(None, "--format", metavar="FORMAT", help="table (default), json, or prometheus (text exposition format)."),
    watch: Optional[float] = typer.Option(None, "--watch", metavar="SECONDS", help="Print one line of rates (puts/s, gets/s, hit ratio, evictions/s, disk spills and promotions/s) every SECONDS (default 1) until Ctrl-C; needs NAME."),
    count: Optional[int] = typer.Option(None, "--count", min=1, metavar="N", help="With --watch: stop after N lines."),
    quiet: bool = QUIET_OPT,
) -> None:
    """Show usage, entries, counters and policy of one pool or all pools.

    A pool that is missing exits 66, except with --format prometheus, which
    prints cortex_cache_up{pool="NAME"} 0 for it (a scrape must not come back
    empty).

    Example: cortex cache status llama --json
    """
    from . import segment
    from .errors import PoolNotFound
    from .pool import Pool

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
        try:
            with Pool.open(name, lock_timeout=5) as p:
                st = p.stats()
        except PoolNotFound as e:
            if fmt is not Format.prometheus:
                raise
            st = {"name": name, "status": "gone", "error": str(e)}
        else:
            st["status"] = "ok"
            _add_operating(st)
        rows = [st]
    else:
        rows = [_pool_summary(n) for n in segment.list_names()]
        for r in rows:
            if r["status"] == "ok":
                _add_operating(r)
    if fmt is Format.json:
        _print_json(rows[0] if name is not None else {"pools": rows})
        return
    if fmt is Format.prometheus:
        sys.stdout.write(_prometheus(rows))
        return
    if not rows:
        _say("no pools", stderr=True)
        return
    from rich.table import Table

    con = _console()
    for r in rows:
        if r["status"] != "ok":
            con.print(f"{r['name']}: {r['status']} ({r['error']})")
            continue
        t = Table(title=f"pool {r['name']}", box=None, show_header=False, pad_edge=False, title_justify="left")
        t.add_column("field", style="bold")
        t.add_column("value")
        used_pct = r["used_bytes"] / r["size_bytes"] * 100
        t.add_row("size", f"{_fmt_size(r['size_bytes'])} ({r['size_bytes']} bytes; segment {_fmt_size(r['segment_bytes'])})")
        t.add_row("used", f"{_fmt_size(r['used_bytes'])} ({used_pct:.1f}%), values {_fmt_size(r['value_bytes'])}")
        t.add_row("entries", f"{r['entries']} of {r['max_entries']}")
        t.add_row("blocks", f"{r['blocks_used']} / {r['blocks_total']} of {_fmt_size(r['block_size'])}")
        t.add_row("policy", r["policy"] + (", multi-threaded" if r["multi_threaded"] else ""))
        t.add_row("hits / misses", f"{r['hits']} / {r['misses']} (hit ratio {r['hit_ratio']:.3f})")
        t.add_row("puts / deletes", f"{r['puts']} / {r['deletes']}")
        t.add_row("evictions", f"{r['evictions']} ({_fmt_size(r['bytes_evicted'])}), expirations {r['expirations']}")
        t.add_row("attached", _show_attached(r["attached"]))
        t.add_row("owner / mode", f"uid {r['uid']} gid {r['gid']}, {r['mode']}")
        t.add_row("created", _fmt_time(r["created"]))
        t.add_row("last snapshot", _fmt_time(r["last_snapshot"]) + (f" ({_fmt_age(r['last_snapshot'])} ago)" if r["last_snapshot"] else ""))
        sn = r["snapshots"]
        t.add_row("snapshots", f"{sn['count']}, {_fmt_size(sn['bytes'])} in {sn['directory']}")
        if r["repairs"]:
            t.add_row("repairs", str(r["repairs"]))
        d = r.get("disk")
        if d is not None:
            t.add_row("disk tier", f"{d['path']} (write-{d['write']}{', O_DIRECT' if d['o_direct'] else ''})")
            if not d["available"]:
                t.add_row("disk state", f"unavailable: {d['error']}")
            else:
                t.add_row("disk used", f"{d['entries']} of {d['max_entries']} entries, values {_fmt_size(d['value_bytes'])} "
                          f"of {_fmt_size(d['capacity_bytes'])}")
            t.add_row("disk hits / misses", f"{d['hits']} / {d['misses']} (hit ratio {d['hit_ratio']:.3f})")
            t.add_row("disk written / read", f"{_fmt_size(d['bytes_written'])} in {d['spills']} records / "
                      f"{_fmt_size(d['bytes_read'])}, {d['promotions']} promoted")
            t.add_row("disk lost", f"{d['dropped']} dropped, {d['evictions']} evicted, {d['corrupt']} corrupt, "
                      f"{d['errors']} I/O errors")
        rm = r.get("remote")
        if rm is not None:
            t.add_row("remote tier", rm["url"] + (" (cluster)" if rm["cluster"] else "")
                      + ("" if rm["available"] else f" - unavailable: {rm.get('error')}"))
            t.add_row("remote hits / misses", f"{rm['hits']} / {rm['misses']} (hit ratio {rm['hit_ratio']:.3f}), "
                      f"{rm['promotions']} promoted, {rm['corrupt']} corrupt")
            t.add_row("remote writes", f"{rm['writes_done']} done of {rm['writes_sent']} sent, {rm['writes_dropped']} "
                      f"dropped, {_fmt_size(rm['bytes_written'])} written, {_fmt_size(rm['bytes_read'])} read")
            t.add_row("remote errors", str(rm["errors"]) + (f" (last: {rm['last_error']})" if rm.get("last_error") else ""))
        _print_table(t, con)


def _watch(name: str, interval: float, count: int | None, as_json: bool) -> None:
    from . import watch as w
    from .pool import Pool

    header = f"{'time':8} {'puts/s':>9} {'gets/s':>9} {'hit%':>6} {'evict/s':>8} {'spill/s':>8} {'promo/s':>8} {'disk w/s':>9} {'disk r/s':>9} {'entries':>8} {'used':>9}"
    n = 0
    with Pool.open(name, lock_timeout=5) as p:
        try:
            for r in w.watch(p, interval, count):
                if as_json:
                    _print_json({"pool": name, **r})
                else:
                    if n % 20 == 0:
                        sys.stdout.write(header + "\n")
                    hit = "-" if r["hit_ratio"] is None else f"{100 * r['hit_ratio']:.1f}"
                    sys.stdout.write(
                        f"{time.strftime('%H:%M:%S')} {r['puts_per_s']:9.1f} {r['gets_per_s']:9.1f} {hit:>6} "
                        f"{r['evictions_per_s']:8.1f} {r['spills_per_s']:8.1f} {r['promotions_per_s']:8.1f} "
                        f"{_fmt_size(r['disk_write_bytes_per_s']):>9} {_fmt_size(r['disk_read_bytes_per_s']):>9} "
                        f"{r['entries']:8d} {_fmt_size(r['used_bytes']):>9}\n"
                    )
                sys.stdout.flush()
                n += 1
        except KeyboardInterrupt:  # the way to stop it: not an error
            pass


@cache.command()
def delete(
    name: str = NAME_ARG,
    force: bool = typer.Option(False, "--force", "-f", help="Delete even while other processes have the pool mapped, and remove its disk tier too."),
    quiet: bool = QUIET_OPT,
) -> None:
    """Remove a pool.

    Processes that still have it mapped keep their mapping until they close
    it; without --force such a pool is not deleted.  A disk tier is kept
    (a pool created again on it finds its entries) unless --force is given.

    Example: cortex cache delete llama
    """
    from . import segment
    from .errors import PoolBusy

    segment.validate_name(name)
    if not segment.exists(name):
        from .errors import PoolNotFound

        raise PoolNotFound(f"no pool named {name!r}")
    squatter = segment.squatter_kind(name)
    if squatter:  # a symlink, a directory...: not a pool, so nothing maps it and there is no tier
        from .errors import SegmentCorrupt

        if not force:
            raise SegmentCorrupt(f"{segment.shm_path(name)} is {squatter}, not a pool; `delete --force` removes it")
        _say(f"removed {segment.remove_squatter(name)} at {segment.shm_path(name)}", stderr=True)
        return
    users = [p for p in segment.attached_pids(name) if p != os.getpid()]
    if users and not force:
        raise PoolBusy(f"pool {name!r} is in use by pid {', '.join(map(str, users))}; use --force to delete it anyway")
    tier = _disk_tier_of(name)
    segment.unlink(name)
    _say(f"deleted pool {name}")
    if tier is None:
        return
    if force:
        from .disklog import DiskLog

        DiskLog.destroy(tier)
        _say(f"removed disk tier {tier}", stderr=True)
    else:
        _say(f"kept disk tier {tier}: a pool created with --disk-path {tier} finds its entries; "
             "`delete --force` removes it", stderr=True)


def _disk_tier_of(name: str) -> str | None:
    """The disk tier directory of pool `name` if it has one (None if it cannot be read)."""
    from .pool import Pool

    try:
        with Pool.open(name, lock_timeout=5) as p:
            return p.disk_path
    except CortexCacheError:
        return None


def _read_value(source: Optional[str], limit: int) -> bytes:
    """The value from FILE or stdin, read up to `limit` bytes: one byte more is ValueTooLarge, so
    /dev/zero or an endless pipe costs a pool's size of memory at most."""
    from .errors import ValueTooLarge

    def bounded(f) -> bytes:
        data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueTooLarge(f"the value is larger than the pool's {limit} bytes; nothing was stored")
        return data

    if source is None or source == "-":
        if source is None and sys.stdin.isatty():
            raise UsageError("give a FILE, or '-' and pipe the value on stdin")
        return bounded(sys.stdin.buffer)
    try:
        with open(source, "rb") as f:
            return bounded(f)
    except FileNotFoundError:
        from .errors import PoolNotFound  # exit 66: no such input

        raise PoolNotFound(f"no such file {source!r}") from None
    except IsADirectoryError:
        raise UsageError(f"{source!r} is a directory") from None
    except PermissionError:
        from .errors import PermissionDenied

        raise PermissionDenied(f"permission denied reading {source!r}") from None


@cache.command()
def put(
    name: str = NAME_ARG,
    key: str = typer.Argument(..., metavar="KEY", help="Key (UTF-8 string).", show_default=False),
    source: Optional[str] = typer.Argument(None, metavar="FILE|-", help="Read the value from FILE, or from stdin with '-'.", show_default=False),
    ttl: Optional[float] = typer.Option(None, "--ttl", metavar="SECONDS", help="Seconds until the entry expires."),
    priority: int = typer.Option(0, "--priority", metavar="N", help="Priority (the priority policy evicts lowest first)."),
    quiet: bool = QUIET_OPT,
) -> None:
    """Store a value under a key.

    At most the pool's size is read: a longer input (an endless pipe,
    /dev/zero) stops there and exits 2, storing nothing.

    Example: echo hello | cortex cache put llama greeting -
    """
    from .pool import Pool

    with Pool.open(name, lock_timeout=10) as p:
        data = _read_value(source, p.geometry.data_size)
        p.put(key, data, ttl=ttl, priority=priority)


@cache.command()
def get(
    name: str = NAME_ARG,
    key: str = typer.Argument(..., metavar="KEY", help="Key to read.", show_default=False),
    output: Optional[str] = typer.Option(None, "--output", "-o", metavar="FILE", help="Write the value to this new file (mode 0600) instead of stdout ('-': stdout)."),
    peek: bool = typer.Option(False, "--peek", help="Read from memory without counting a hit or miss or changing the eviction order (tiers below memory are not looked at)."),
    quiet: bool = QUIET_OPT,
) -> None:
    """Write a value to stdout (or a file).  Exit 66 if the key is absent.

    Output that cannot be written (a full disk, /dev/full) exits 74, and
    with -o the file is removed rather than left short.

    Example: cortex cache get llama greeting -o greeting.bin
    """
    from .pool import Pool

    fd = -1
    if output == "-":
        output = None
    if output is not None:
        # Create the output first, so a bad path changes nothing in the pool.
        try:
            fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            from .errors import PoolExists

            raise PoolExists(f"{output!r} already exists; remove it first") from None
        except FileNotFoundError:
            from .errors import CannotCreate

            raise CannotCreate(f"cannot create {output!r}: no such directory") from None
        except OSError as e:
            from .errors import StorageIOError

            raise StorageIOError(f"cannot create {output!r}: {e.strerror}") from None
    try:
        with Pool.open(name, lock_timeout=10) as p:
            value = p.peek(key) if peek else p.get(key)
        if value is None:
            raise KeyNotFound(f"no key {key!r} in pool {name!r}")
    except BaseException:
        if fd >= 0:
            os.close(fd)
            os.unlink(output)  # type: ignore[arg-type]
        raise
    if fd < 0:
        sys.stdout.buffer.write(value)
        sys.stdout.flush()
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(value)
            f.flush()
            os.fsync(f.fileno())  # a full disk shows here, not later as a short file
    except OSError as e:
        os.unlink(output)  # type: ignore[arg-type]  # never a truncated file left behind
        from .errors import StorageIOError

        raise StorageIOError(f"cannot write {output!r}: {e.strerror or e}; nothing was written") from None


@cache.command()
def keys(
    name: str = NAME_ARG,
    prefix: Optional[str] = typer.Option(None, "--prefix", metavar="PREFIX", help="Only keys starting with this."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, metavar="N", help="At most this many keys."),
    long: bool = typer.Option(False, "--long", "-l", help="Show size, age, TTL, accesses and priority."),
    tier: WhichTier = typer.Option(WhichTier.memory, "--tier", metavar="TIER", help="memory (default), disk (reads each key from its record), all (memory and disk), or remote (this pool's keys on the remote server, in key order)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
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
        _print_json({"keys": [_json_key(inf) for inf in infos]})
        return
    if not long:
        sys.stdout.write("".join(_show_key(k) + "\n" for k in ks))
        return
    from rich.markup import escape
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for col in ("KEY", "TIER", "SIZE", "AGE", "TTL", "ACCESSES", "PRIORITY"):
        t.add_column(col, justify="left" if col in ("KEY", "TIER") else "right")
    for inf in infos:
        ttl = "-" if inf["ttl_remaining"] is None else f"{inf['ttl_remaining']:.0f}s"
        age = _fmt_age(inf.get("created") or inf.get("spilled"))
        prio = "-" if inf["priority"] is None else str(inf["priority"])
        t.add_row(escape(_show_key(inf["key"])), inf["tier"], str(inf["size"]), age, ttl, str(inf.get("access_count", "-")), prio)
    _print_table(t)


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
) -> None:
    """Evict entries now and report what was freed.  Give exactly one selector.

    Several keys: repeat the option, --key a --key b.

    Example: cortex cache evict llama --percent 25
    """
    from .pool import Pool

    chosen = [percent is not None, nbytes is not None, expired, bool(key), prefix is not None, all_]
    if sum(chosen) != 1:
        raise UsageError("give exactly one of --percent, --bytes, --expired, --key, --prefix, --all")
    with Pool.open(name, lock_timeout=10) as p:
        count, freed = p.evict(
            percent=percent, nbytes=nbytes, expired=expired, keys=key or None, prefix=prefix, all=all_,
            tier=tier.value,
        )
    if as_json:
        _print_json({"pool": name, "tier": tier.value, "entries": count, "bytes": freed})
    else:
        where = " from the remote server" if tier is WhichTier.remote else ""
        _say(f"evicted {count} entries, {_fmt_size(freed)} ({freed} bytes){where}")


@cache.command()
def verify(
    name: str = NAME_ARG,
    repair: bool = typer.Option(False, "--repair", help="Fix what is found (drops entries that cannot be trusted)."),
    no_checksums: bool = typer.Option(False, "--no-checksums", help="Check metadata only, not every value's checksum."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Check a pool's consistency; exit 1 if a problem was found (even if --repair fixed it).

    Example: cortex cache verify llama --repair
    """
    from .pool import Pool

    with Pool.open(name, lock_timeout=10) as p:
        report = p.verify(repair=repair, checksums=not no_checksums)
    if as_json:
        _print_json({"pool": name, **report})
    else:
        con = _console()
        if report["ok"]:
            disk = f", {report['disk_checked']} disk records verified" if "disk_checked" in report else ""
            _say(f"pool {name}: ok ({report['entries']} entries, {report['checked']} checksums verified{disk})")
        for prob in report["problems"]:
            con.print(f"pool {name}: {prob}" + (" [repaired]" if report["repaired"] else ""))
    if not report["ok"]:
        raise typer.Exit(EX_PROBLEM)


def _progress_bar(description: str):
    """A rich progress bar on stderr when it is a terminal; else None (silent)."""
    if _Output.quiet or not sys.stderr.isatty():
        return None
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )

    return Progress(
        TextColumn(description), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
        TimeRemainingColumn(), console=_console(stderr=True), transient=True,
    )


def _run_with_progress(description: str, fn):
    bar = _progress_bar(description)
    if bar is None:
        return fn(None)
    with bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return fn(update)


@cache.command()
def persist(
    name: str = NAME_ARG,
    output: Optional[str] = typer.Option(None, "--output", "-o", metavar="FILE", help="Write the snapshot to this file instead of the snapshot directory."),
    keep: Optional[int] = typer.Option(None, "--keep", min=1, metavar="N", help="Keep the newest N snapshots of the pool in the snapshot directory, now and at every later persist (stored with the pool; default 3)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Write an atomic, checksummed snapshot of a pool's live entries.

    Without --output the snapshot goes to the snapshot directory
    (CORTEX_CACHE_SNAPSHOT_DIR) as NAME-<UTC time>.ccsnap, and NAME.ccsnap
    always names the newest.  A second persist of the same pool while one
    runs exits 75 at once.

    Example: cortex cache persist llama --keep 5
    """
    from . import persist as snap
    from .pool import Pool

    with Pool.open(name, lock_timeout=10) as p:
        result = _run_with_progress(f"persist {name}", lambda cb: snap.persist(p, output, keep=keep, progress=cb))
    doc = {"pool": name, **result.as_dict()}
    if as_json:
        _print_json(doc)
    else:
        _say(
            f"persisted {doc['entries']} entries, {_fmt_size(doc['bytes'])} of {name} to {doc['path']} "
            f"in {doc['seconds']:.2f}s ({doc['gbps']:.2f} GB/s)"
        )
        if result.skipped_corrupt:
            _console(stderr=True).print(
                f"cortex: warning: {result.skipped_corrupt} entries failed their checksum in memory and were left out"
            )


@cache.command()
def restore(
    name: str = NAME_ARG,
    input_: Optional[str] = typer.Option(None, "--input", "-i", metavar="FILE", help="Snapshot file (default: NAME.ccsnap in the snapshot directory)."),
    replace: bool = typer.Option(False, "--replace", help="Replace an existing pool: a new one with its size, policy and tiers is filled from the snapshot and swapped in atomically (its disk tier is emptied; a remote tier is left alone)."),
    if_missing: bool = typer.Option(False, "--if-missing", help="Exit 0 and change nothing if the pool exists; restore it if it does not (exit 66 without a snapshot)."),
    mode: Optional[str] = typer.Option(None, "--mode", metavar="MODE", help="Permission bits of the restored segment (octal; default 0600, with --replace the replaced pool's); never wider than the snapshot file's."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Rebuild a pool from a snapshot, verified whole before anything changes.

    The pool is built under a temporary name and appears only when complete:
    a missing pool is created with the snapshot's whole configuration
    (size, policy, retention) and its tiers attached again (the disk tier's
    records that check out are found again, the remote tier is used again);
    an existing one is only replaced with --replace, by an atomic swap (other
    processes see the old pool or the new one, never a mix; processes
    attached to the old one keep it until they reopen).  A snapshot whose
    entries do not all fit exits 73 and changes nothing.  Expired entries
    are not restored.  A damaged, truncated or foreign file exits 65; a
    FIFO or device exits 2.

    Example: cortex cache restore llama --if-missing
    """
    from . import persist as snap

    if input_ is not None and os.path.isdir(input_):
        # Opening a directory read-only succeeds; say what is wrong before the reader tries to map it.
        raise UsageError(f"{input_!r} is a directory, not a snapshot")
    pool, report = _run_with_progress(
        f"restore {name}",
        lambda cb: snap.restore(input_, name=name, replace=replace, progress=cb, if_missing=if_missing,
                                mode=_parse_mode(mode) if mode is not None else None),
    )
    if pool is None:  # --if-missing, and the pool is there
        if as_json:
            _print_json(report)
        else:
            _say(f"pool {name} exists; nothing restored")
        return
    pool.close()
    secs = report["seconds"]
    report["gbps"] = round(report["bytes"] / secs / 1e9, 3) if secs > 0 else 0.0
    if as_json:
        _print_json(report)
    else:
        _say(
            f"restored {report['entries']} entries, {_fmt_size(report['bytes'])} into {report['pool']} "
            f"from {report['path']} in {secs:.2f}s"
            + (f"; {report['expired_skipped']} expired entries skipped" if report["expired_skipped"] else "")
        )
        for tier, what in report["tiers"].items():
            _say(f"{tier} tier: {what}")


@cache.command()
def snapshots(
    name: str = NAME_ARG,
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """List every snapshot of a pool in the snapshot directory, oldest first.

    Shows each file's time, size and entries, and which one NAME.ccsnap (what
    restore reads by default) names.  Reads only the files' headers.

    Example: cortex cache snapshots llama
    """
    from . import persist as snap
    from . import segment

    segment.validate_name(name)
    rows = snap.list_snapshots(name)
    if as_json:
        _print_json({"pool": name, "directory": str(snap.snapshot_dir()), "snapshots": rows})
        return
    if not rows:
        _say(f"no snapshots of {name} in {snap.snapshot_dir()}", stderr=True)
        return
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for col in ("TIME", "AGE", "SIZE", "ENTRIES", "LATEST", "PATH"):
        t.add_column(col, justify="right" if col in ("SIZE", "ENTRIES") else "left")
    for r in rows:
        if "error" in r:
            t.add_row("-", "-", "-", "-", "", f"{r['path']} ({r['error']})")
            continue
        t.add_row(_fmt_time(r["time"]), _fmt_age(r["time"]), _fmt_size(r["bytes"]), str(r["entries"]),
                  "yes" if r["latest"] else "", r["path"])
    _print_table(t)


@cache.command()
def doctor(
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Check this host's set-up; exit 1 if something is wrong, each finding with what to do.

    Looks at /dev/shm (size against the pools, huge pages), the snapshot and
    disk-tier directories (owner, mode, free space), the remote tiers
    (redis-py installed, server answering), restore staging segments left
    behind, and which `cortex` a cron job would run.  Changes nothing.

    Example: cortex cache doctor
    """
    from . import doctor as doc

    running = sys.argv[0] if os.path.basename(sys.argv[0]) == "cortex" else None
    findings = doc.diagnose(running=os.path.abspath(running) if running else None)
    bad = [f for f in findings if not f["ok"]]
    if as_json:
        _print_json({"ok": not bad, "findings": findings})
    else:
        for f in findings:
            line = f"{'ok  ' if f['ok'] else 'FAIL'} {f['message']}"
            sys.stdout.write(line + (f"\n     fix: {f['fix']}" if f["fix"] else "") + "\n")
    if bad:
        raise typer.Exit(EX_PROBLEM)


# ---------------------------------------------------------------- entry point


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _error(msg: str, code: int, as_json: bool) -> None:
    """An error: one line on stderr; with --json a JSON document {"time", "error", "exit"}."""
    if as_json:
        sys.stderr.write(json.dumps({"time": _now_iso(), "error": msg, "exit": code}, separators=(",", ":")) + "\n")
    else:
        sys.stderr.write(f"cortex: error: {msg}\n")


def _usage_words(msg: str) -> str:
    """The parser's message in our words: no validation-library phrasing ("Input should be ...")."""
    msg = _one_line(msg)
    return re.sub(r"Input should be (greater|less) than or equal to (\S+)", r"must be at \1 \2", msg).replace(
        "at greater", "at least").replace("at less", "at most")


def _is_usage_error(e: BaseException) -> bool:
    # Typer vendors its parser's exception classes privately; recognise them
    # by name instead of importing a private module.
    return any(c.__name__ in ("UsageError", "ClickException") for c in type(e).__mro__) and hasattr(
        e, "format_message"
    )


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
    _Output.quiet = False
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
    code = 0
    try:
        rc = typer.main.get_command(app).main(
            args=args, prog_name="cortex", complete_var=COMPLETE_VAR, standalone_mode=False
        )
        # Without standalone mode, the parser turns `raise typer.Exit(n)` into a return value.
        if isinstance(rc, int):
            code = rc
        sys.stdout.flush()  # a full disk or /dev/full shows here, as exit 74, not at interpreter exit
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        code = 130
    except CortexCacheError as e:
        if debug:
            import traceback

            traceback.print_exc()
        _error(f"{_one_line(str(e))}", e.exit_code, as_json)
        code = e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("cortex: interrupted\n")
        code = 130
    except BrokenPipeError:
        # Reader went away (e.g. `| head`): not an error worth a message.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0
    except OSError as e:
        if e.errno not in _IO_ERRNOS:
            raise
        # Writing our output failed (a full disk, /dev/full, a dead device): an I/O error, exit 74.
        if debug:
            import traceback

            traceback.print_exc()
        _error(f"I/O error writing output: {e.strerror or e}", EX_IOERR, as_json)
        _drop_stdout()
        code = EX_IOERR
    except Exception as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `cortex` / `cortex cache`: show help
            sys.stderr.write(e.format_message() + "\n")  # type: ignore[attr-defined]
            return EX_USAGE
        if _is_usage_error(e):
            # The parser's own errors (unknown option, bad choice): one line, exit 2.
            _error(f"{_usage_words(e.format_message())} (see --help)", EX_USAGE, as_json)  # type: ignore[attr-defined]
            return EX_USAGE
        # Anything else is a bug: say so in one line, traceback with --debug.
        if debug:
            import traceback

            traceback.print_exc()
        if as_json:
            _error(f"internal error: {_one_line(f'{type(e).__name__}: {e}')}", EX_SOFTWARE, True)
        else:
            sys.stderr.write(f"cortex: internal error: {_one_line(f'{type(e).__name__}: {e}')} (rerun with --debug for a traceback)\n")
        code = EX_SOFTWARE
    return code


_IO_ERRNOS = {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.ENXIO}


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what could not be written stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except OSError:
        pass


def run() -> None:
    sys.exit(main())


__all__ = ["app", "main", "run"]
