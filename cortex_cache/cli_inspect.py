"""`cortex cache list`, `status`, `verify`, `doctor`: looking at pools and at the host.

The inspection commands: they change nothing (verify only with --repair).
`status --watch` samples a pool's counters (watch.py makes the rates).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from . import interrupts
from .cli_options import DEBUG_OPT, JSON_OPT, NAME_ARG, QUIET_OPT, Format
from .cli_render import (
    WATCH_HEADER, console, pools_table, print_json, print_status, print_table, prometheus, say, watch_line,
)
from .errors import EX_PROBLEM, PoolNotFound, UsageError
from .units import entries, plural

# The interval of `status --watch`: shorter would spin on the pool's lock, longer is not watching.
MIN_WATCH, MAX_WATCH = 0.01, 86400.0

def list_pools(as_json: bool = JSON_OPT, quiet: bool = QUIET_OPT, debug: bool = DEBUG_OPT) -> None:
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


def status(
    name: Optional[str] = typer.Argument(None, metavar="NAME", help="Pool name (default: every pool).", show_default=False),
    as_json: bool = JSON_OPT,
    fmt: Optional[Format] = typer.Option(None, "--format", metavar="FORMAT", case_sensitive=False, help="table (default), json, or prometheus (text exposition format)."),
    watch: Optional[float] = typer.Option(None, "--watch", metavar="SECONDS", help=f"Print one line of rates (puts/s, gets/s, hit ratio, evictions/s, disk spills and promotions/s) every SECONDS (default 1, from {MIN_WATCH} to {MAX_WATCH:.0f}) until Ctrl-C; needs NAME."),
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
        if not MIN_WATCH <= watch <= MAX_WATCH:  # nan too: it compares false
            raise UsageError(f"--watch needs from {MIN_WATCH} to {MAX_WATCH:.0f} seconds, not {watch}")
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
