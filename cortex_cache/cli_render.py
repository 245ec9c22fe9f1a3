"""How the CLI shows what a command found: the console, tables, JSON, Prometheus text.

Everything a person or a scraper reads on stdout (and notes on stderr) is
shaped here: one-line JSON documents with the time they were made, rich
tables without trailing padding off a terminal, sizes, times and ages, keys
escaped so each line names exactly one, the Prometheus exposition of
`status`, the lines of `status --watch`, progress bars.  Commands (cli.py)
decide what to show; this module decides how it looks.  Errors and exit
codes live in cli_io.py.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

from .units import entries, plural


class Output:
    """Process-wide output settings; cli.main() resets them for every run."""

    quiet = False


def console(stderr: bool = False):  # rich is imported by typer already
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal rich assumes 80 columns and would cut names and keys:
    # a pipe or file gets whole lines instead.
    width = None if stream.isatty() else 1 << 16
    # markup=False: our text holds brackets ("cortex-cache[remote]") that are no rich markup.
    return Console(stderr=stderr, highlight=False, soft_wrap=width is not None, width=width, markup=False)


def print_table(table, con=None) -> None:
    """Print a rich table; off a terminal, without the padding rich leaves at line ends."""
    con = con or console()
    if con.is_terminal:
        con.print(table)
        return
    with con.capture() as cap:
        con.print(table)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in cap.get().splitlines()))


def now_iso() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


# The version of every --json document's shape (docs/cli.md, "JSON output"): a field may be added in any
# release without changing it; a field removed or renamed, or one whose type or meaning changes, raises it.
JSON_SCHEMA = 1


def print_json(doc: Any) -> None:
    """One JSON document on one line (fit for a log), with the time it was made (UTC, ISO 8601) and the
    version of its shape (`schema`)."""
    if isinstance(doc, dict):
        doc = {"time": now_iso(), "schema": JSON_SCHEMA, **doc}
    sys.stdout.write(json.dumps(doc, separators=(",", ":")) + "\n")


def say(msg: str, stderr: bool = False) -> None:
    """A confirmation or note for a person: silenced by -q/--quiet."""
    if not Output.quiet:
        console(stderr=stderr).print(msg)


def warn(msg: str) -> None:
    """A warning: one line on stderr, shown even with -q/--quiet and --json (what was asked is done anyway)."""
    console(stderr=True).print(f"cortex: warning: {msg}", markup=False, highlight=False, soft_wrap=True)


def fmt_size(n: int | float) -> str:
    from .units import format_size

    return format_size(n)


def fmt_time(ts: float | None) -> str:
    if not ts:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt_age(ts: float | None) -> str:
    if not ts:
        return "-"
    return fmt_duration(time.time() - ts)


def fmt_duration(seconds: float) -> str:
    """A span as a person reads it: `42s`, `12.5m`, `3.2h`, `6.0d`, `31.7y` (a year of 365.25 days)."""
    s = max(0.0, seconds)
    units = (("y", 365.25 * 86400), ("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0))
    for i, (unit, n) in enumerate(units):
        if s < n and unit != "s":
            continue
        shown = f"{s:.0f}" if unit == "s" else f"{s / n:.1f}"
        if i and float(shown) * n >= units[i - 1][1]:  # 3599.9 s rounds to 60.0m: say 1.0h
            unit, n = units[i - 1]
            shown = f"{s / n:.1f}"
        return shown + unit
    return "0s"  # pragma: no cover - the loop always returns


def show_key(k: str | bytes) -> str:
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


def shown(text: str) -> str:
    """A name read from a pool's header (a path, a URL: any writer of the pool may have put it there) fit for a
    table: control characters and escape sequences as \\xNN (show_key), and no rich markup."""
    from rich.markup import escape

    return escape(show_key(text))


def json_key(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (an entry's info) with its key made JSON: shown as text, typed, and exact in hex if bytes."""
    k = doc["key"]
    doc["key"] = show_key(k)
    doc["key_type"] = "str" if isinstance(k, str) else "bytes"
    if not isinstance(k, str):
        doc["key_hex"] = bytes(k).hex()
    return doc


# ---------------------------------------------------------------- confirmations


def say_created(name: str, st: dict[str, Any]) -> None:
    """`create`'s confirmation: the new pool's geometry and its tiers."""
    say(
        f"created pool {name}: {fmt_size(st['size_bytes'])} in {plural(st['blocks_total'], 'block', 'blocks')} of "
        f"{fmt_size(st['block_size'])}, policy {st['policy']}, mode {st['mode']}"
    )
    d = st["disk"]
    if d is not None:
        found = f", {entries(d['entries'])} found on it" if d["entries"] else ""
        say(f"disk tier: {fmt_size(d['capacity_bytes'])} in {d['path']}, write-{d['write']}{found}")
    r = st["remote"]
    if r is not None:
        say(f"remote tier: {r['url']}" + (" (cluster)" if r["cluster"] else ""))


def say_restored(report: dict[str, Any]) -> None:
    """`restore`'s confirmation: what came back from where, and what each tier did."""
    published = report.get("published_seconds")
    say(
        ("finished the fill of " if report.get("resumed") else "restored ")
        + f"{entries(report['entries'])}, {fmt_size(report['bytes'])} into {report['pool']} "
        f"from {report['path']} in {report['seconds']:.2f}s"
        + (f" (serving after {published:.2f}s)" if published is not None and not report.get("resumed") else "")
        + (f"; {entries(report['expired_skipped'], 'expired entries')} skipped" if report["expired_skipped"] else "")
        + (f"; {entries(report['present_skipped'])} skipped, there already or gone (put, read early, "
           "deleted or evicted meanwhile)"
           if report.get("present_skipped") else "")
    )
    if report.get("ended") == "stopped":
        say("the fill stopped early: the pool filled up with newer entries, or was emptied or deleted meanwhile")
    if report.get("reserve_failed"):
        say(f"warning: the pool's memory could not all be reserved ({report['reserve_failed']}): it is not reserved")
    for tier, what in report["tiers"].items():
        say(f"{tier} tier: {what}")


def say_published(report: dict[str, Any]) -> None:
    """`restore --background`'s confirmation: the pool serves, and who fills it."""
    what = "resumed the fill of" if report.get("resumed") else "published"
    say(f"{what} {report['pool']} from {report['path']} in {report['seconds']:.2f}s; filling it in the background "
        f"(pid {report['filler_pid']}): `cortex cache status {report['pool']}` shows how far it got")
    for tier, what in report.get("tiers", {}).items():
        say(f"{tier} tier: {what}")


# ---------------------------------------------------------------- tables


def pools_table(rows: list[dict[str, Any]]):
    """`list`: one line per pool, or its state when it could not be read."""
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for col in ("NAME", "SIZE", "USED", "ENTRIES", "POLICY", "MODE", "STATE"):
        t.add_column(col, justify="right" if col in ("SIZE", "USED", "ENTRIES") else "left")
    for r in rows:
        if r["status"] != "ok":
            t.add_row(r["name"], "-", "-", "-", "-", "-", r["status"])
            continue
        used = r["used_bytes"] / r["size_bytes"] * 100
        t.add_row(r["name"], fmt_size(r["size_bytes"]), f"{used:.1f}%", str(r["entries"]), r["policy"], r["mode"], "ok")
    return t


def show_attached(procs_: list[dict[str, Any]]) -> str:
    return ", ".join(f"{a['pid']} ({a['command'] or '?'}, uid {a['uid'] if a['uid'] is not None else '?'})"
                     for a in procs_) or "none"


def print_status(rows: list[dict[str, Any]]) -> None:
    """`status` as tables: one per pool, a line for one that could not be read."""
    from rich.table import Table

    con = console()
    for r in rows:
        if r["status"] != "ok":
            con.print(f"{r['name']}: {r['status']} ({r['error']})")
            continue
        t = Table(title=f"pool {r['name']}", box=None, show_header=False, pad_edge=False, title_justify="left")
        t.add_column("field", style="bold")
        t.add_column("value")
        used_pct = r["used_bytes"] / r["size_bytes"] * 100
        t.add_row("size", f"{fmt_size(r['size_bytes'])} ({r['size_bytes']} bytes; segment {fmt_size(r['segment_bytes'])})")
        t.add_row("used", f"{fmt_size(r['used_bytes'])} ({used_pct:.1f}%), values {fmt_size(r['value_bytes'])} "
                  f"(fill {r['fill_ratio']:.3f})")
        t.add_row("largest run", f"{fmt_size(r['largest_free_bytes'])} free")
        t.add_row("entries", f"{r['entries']} of {r['max_entries']}")
        t.add_row("blocks", f"{r['blocks_used']} / {r['blocks_total']} of {fmt_size(r['block_size'])}")
        t.add_row("policy", r["policy"] + (", multi-threaded" if r["multi_threaded"] else ""))
        if r.get("tier_admit", 1) > 1:
            t.add_row("tier admission", f"entries seen at least {r['tier_admit']} times; {r['tier_refused']} "
                      "evicted entries not admitted below")
        t.add_row("hits / misses", f"{r['hits']} / {r['misses']} (hit ratio {r['hit_ratio']:.3f})")
        t.add_row("puts / deletes", f"{r['puts']} / {r['deletes']}")
        t.add_row("evictions", f"{r['evictions']} ({fmt_size(r['bytes_evicted'])}), expirations {r['expirations']}")
        t.add_row("attached", show_attached(r["attached"]))
        if r.get("attached_old"):  # still on a segment the name had before (replaced or deleted)
            t.add_row("on old copies", show_attached(r["attached_old"]) + " (they move here at their next "
                      "operation that checks, or hold the old copy until they exit)")
        t.add_row("owner / mode", f"uid {r['uid']} gid {r['gid']}, {r['mode']}")
        t.add_row("created", fmt_time(r["created"]))
        t.add_row("last snapshot", fmt_time(r["last_snapshot"]) + (f" ({fmt_age(r['last_snapshot'])} ago)" if r["last_snapshot"] else ""))
        sn = r["snapshots"]
        t.add_row("snapshots", f"{sn['count']}, {fmt_size(sn['bytes'])} in {sn['directory']}")
        if r.get("fill"):
            t.add_row("fill", fill_line(r["fill"], r["name"]))
        if r["repairs"]:
            t.add_row("repairs", str(r["repairs"]))
        d = r.get("disk")
        if d is not None:
            t.add_row("disk tier", f"{shown(d['path'])} (write-{d['write']}{', O_DIRECT' if d['o_direct'] else ''})")
            if not d["available"]:
                t.add_row("disk state", f"unavailable: {d['error']}")
            else:
                t.add_row("disk used", f"{d['entries']} of {d['max_entries']} entries, values {fmt_size(d['value_bytes'])} "
                          f"of {fmt_size(d['capacity_bytes'])}")
            t.add_row("disk hits / misses", f"{d['hits']} / {d['misses']} (hit ratio {d['hit_ratio']:.3f})")
            t.add_row("disk written / read", f"{fmt_size(d['bytes_written'])} in {d['spills']} records / "
                      f"{fmt_size(d['bytes_read'])}, {d['promotions']} promoted")
            t.add_row("disk lost", f"{d['dropped']} dropped, {d['evictions']} evicted, {d['corrupt']} corrupt, "
                      f"{d['errors']} I/O errors")
        rm = r.get("remote")
        if rm is not None:
            t.add_row("remote tier", shown(rm["url"]) + (" (cluster)" if rm["cluster"] else "")
                      + ("" if rm["available"] else f" - unavailable: {rm.get('error')}"))
            t.add_row("remote hits / misses", f"{rm['hits']} / {rm['misses']} (hit ratio {rm['hit_ratio']:.3f}), "
                      f"{rm['promotions']} promoted, {rm['corrupt']} corrupt")
            t.add_row("remote writes", f"{rm['writes_done']} done of {rm['writes_sent']} sent, {rm['writes_dropped']} "
                      f"dropped, {fmt_size(rm['bytes_written'])} written, {fmt_size(rm['bytes_read'])} read")
            t.add_row("remote errors", str(rm["errors"]) + (f" (last: {rm['last_error']})" if rm.get("last_error") else ""))
        print_table(t, con)


def fill_line(f: dict[str, Any], name: str) -> str:
    """`status`'s line on a restored pool's background fill (fill.py)."""
    pct = 100.0 * f["bytes_loaded"] / f["bytes_total"] if f["bytes_total"] else 100.0
    done = (f"{pct:.0f}%: {fmt_size(f['bytes_loaded'])} of {fmt_size(f['bytes_total'])}, "
            f"{f['entries_done']} of {f['entries_total']} entries")
    # Skipped: entries the fill found in the pool already or gone (put, deleted or evicted meanwhile, or read
    # from the snapshot when asked for before the fill came to them) or expired by then; damaged: failed their
    # checksum, left out.
    extra = "".join(f", {f[k]} {what}" for k, what in (
        ("skipped", "skipped (there already or gone: put, read early, deleted; or expired)"),
        ("corrupt", "damaged (failed their checksum: left out)")) if f[k])
    state = f["state"]
    if state == "filling":
        return f"filling {done}{extra}, from {shown(f['snapshot'])}"
    if state == "interrupted":
        return f"interrupted at {done}{extra}: `cortex cache restore {name} --if-missing` finishes it"
    took = f" in {f['ended'] - f['started']:.1f}s" if f["ended"] else ""
    how = {"done": "complete", "stopped": "stopped early (the pool filled up, or was emptied or deleted)",
           "failed": "failed (the snapshot could not be read)"}[state]
    return (f"{how}{took}: {fmt_size(f['bytes_loaded'])} loaded, {f['entries_done']} of {f['entries_total']} "
            f"entries{extra}, from {shown(f['snapshot'])}")


WATCH_HEADER = f"{'time':8} {'puts/s':>9} {'gets/s':>9} {'hit%':>6} {'evict/s':>8} {'spill/s':>8} {'promo/s':>8} {'disk w/s':>9} {'disk r/s':>9} {'entries':>8} {'used':>9}"


def watch_line(r: dict[str, Any]) -> str:
    """One interval of `status --watch` (watch.rates) as a line under WATCH_HEADER."""
    hit = "-" if r["hit_ratio"] is None else f"{100 * r['hit_ratio']:.1f}"
    return (
        f"{time.strftime('%H:%M:%S')} {r['puts_per_s']:9.1f} {r['gets_per_s']:9.1f} {hit:>6} "
        f"{r['evictions_per_s']:8.1f} {r['spills_per_s']:8.1f} {r['promotions_per_s']:8.1f} "
        f"{fmt_size(r['disk_write_bytes_per_s']):>9} {fmt_size(r['disk_read_bytes_per_s']):>9} "
        f"{r['entries']:8d} {fmt_size(r['used_bytes']):>9}\n"
    )


def keys_table(infos: list[dict[str, Any]]):
    """`keys --long`: one line per entry."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for col in ("KEY", "TIER", "SIZE", "AGE", "TTL", "ACCESSES", "PRIORITY"):
        t.add_column(col, justify="left" if col in ("KEY", "TIER") else "right")
    for inf in infos:
        ttl = "-" if inf["ttl_remaining"] is None else fmt_duration(inf["ttl_remaining"])
        age = fmt_age(inf.get("created") or inf.get("spilled"))
        prio = "-" if inf["priority"] is None else str(inf["priority"])
        t.add_row(escape(show_key(inf["key"])), inf["tier"], str(inf["size"]), age, ttl, str(inf.get("access_count", "-")), prio)
    return t


def key_table(inf: dict[str, Any]):
    """`info NAME KEY`: one entry, a field a line."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(box=None, pad_edge=False, show_header=False)
    t.add_column(style="bold")
    t.add_column()
    size = f"{fmt_size(inf['size'])} ({inf['size']} bytes)"
    if inf.get("blocks") is not None:
        size += f" in {plural(inf['blocks'], 'block', 'blocks')} from block {inf['first_block']}"
    rows = [("key", escape(show_key(inf["key"]))), ("tier", inf["tier"]), ("size", size)]
    if inf.get("created") is not None:
        rows.append(("created", f"{fmt_time(inf['created'])} ({fmt_age(inf['created'])} ago)"))
    if inf.get("last_access") is not None:
        rows.append(("last access", f"{fmt_time(inf['last_access'])} ({fmt_age(inf['last_access'])} ago)"))
    if inf.get("spilled") is not None:  # an entry of the disk tier: when memory let it go, and where it is
        rows.append(("spilled", f"{fmt_time(inf['spilled'])} ({fmt_age(inf['spilled'])} ago)"))
    if inf.get("disk_file") is not None:
        rows.append(("on disk", f"file {inf['disk_file']} at offset {inf['disk_offset']}, "
                                f"{fmt_size(inf['disk_bytes'])}"))
    if inf.get("access_count") is not None:
        rows.append(("accesses", str(inf["access_count"])))
    if inf.get("priority") is not None:
        rows.append(("priority", str(inf["priority"])))
    ttl = inf.get("ttl_remaining")
    rows.append(("expires", "never" if ttl is None else f"{fmt_time(inf['expires'])} (in {fmt_duration(ttl)})"))
    for field in ("checksum", "pins"):
        if inf.get(field) is not None:
            rows.append((field, str(inf[field])))
    for k, v in rows:
        t.add_row(k, v)
    return t


def snapshots_table(rows: list[dict[str, Any]]):
    """`snapshots`: one line per file, oldest first."""
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    numbers = ("ENTRIES", "VALUES", "OWN", "SHARED")
    for col in ("TIME", "AGE", *numbers, "LATEST", "PATH"):
        t.add_column(col, justify="right" if col in numbers else "left")
    for r in rows:
        if "error" in r:
            t.add_row("-", "-", "-", "-", "-", "-", "", f"{r['path']} ({r['error']})")
            continue
        t.add_row(fmt_time(r["time"]), fmt_age(r["time"]), str(r["entries"]), fmt_size(r["value_bytes"]),
                  fmt_size(r["own_bytes"]), fmt_size(r["shared_bytes"]), "yes" if r["latest"] else "", r["path"])
    return t


# ---------------------------------------------------------------- Prometheus


def prometheus(rows: list[dict[str, Any]]) -> str:
    metrics = [
        ("size_bytes", "gauge", "Data capacity of the pool in bytes."),
        ("used_bytes", "gauge", "Bytes of blocks in use."),
        ("value_bytes", "gauge", "Bytes of stored values."),
        ("fill_ratio", "gauge", "Value bytes per byte of blocks in use (low: blocks too large for the values)."),
        ("largest_free_bytes", "gauge", "Bytes of the longest run of free blocks."),
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
        ("tier_refused", "counter", "Evicted entries the disk and remote tiers were not offered (tier admission)."),
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
        ("last_snapshot_timestamp_seconds", "last_snapshot", "gauge",
         "When the pool's latest snapshot was taken (its last persist, or the snapshot it was restored from: "
         "status's last snapshot), seconds since the epoch (0: never); alert when it gets old."),
        ("last_snapshot_bytes", "latest_value_bytes", "gauge",
         "Value bytes the latest snapshot holds, what a restore of it loads (0: none)."),
    ]
    with_snaps = [r for r in ok if r.get("snapshots")]
    for metric, key, kind, help_ in snap_metrics if with_snaps else []:
        name = f"cortex_cache_{metric}"
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for r in with_snaps:
            # A pool never persisted has no latest snapshot: 0, not NaN, so that the staleness alert
            # (time() - cortex_cache_last_snapshot_timestamp_seconds > interval) fires for it too.
            v = r[key] if key == "last_snapshot" else r["snapshots"][key]  # the first: what status says
            out.append(f'{name}{{pool="{r["name"]}"}} {v if v is not None else 0}')
    fill_metrics = [
        ("fill_running", "gauge", "1 while the pool is still being filled from its snapshot after a restore "
         "(or its fill was interrupted: see status), else 0."),
        ("fill_bytes_loaded", "gauge", "Value bytes the fill has loaded so far."),
        ("fill_bytes_total", "gauge", "Value bytes of the snapshot the pool is filled from."),
    ]
    with_fill = [r for r in ok if r.get("fill")]
    for key, kind, help_ in fill_metrics if with_fill else []:
        name = f"cortex_cache_{key}"
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for r in with_fill:
            f = r["fill"]
            v = int(f["state"] in ("filling", "interrupted")) if key == "fill_running" else f[key[len("fill_"):]]
            out.append(f'{name}{{pool="{r["name"]}"}} {v}')
    out.append("# HELP cortex_cache_up 1 if the pool could be opened and read, else 0.")
    out.append("# TYPE cortex_cache_up gauge")
    for r in rows:
        out.append(f'cortex_cache_up{{pool="{r["name"]}"}} {1 if r["status"] == "ok" else 0}')
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- progress


def progress_bar(description: str):
    """A rich progress bar on stderr when it is a terminal; else None (silent)."""
    if Output.quiet or not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn(description), BarColumn(), DownloadColumn(binary_units=True), TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(), console=console(stderr=True), transient=True,
    )


def fmt_rate(nbytes: int | float, seconds: float) -> str:
    """A transfer rate in the units sizes are shown in (binary: `1.2GiB/s`), never MB/s beside MiB."""
    return f"{fmt_size(nbytes / seconds)}/s" if seconds > 0 else "-"


def run_with_progress(description: str, fn: Callable[[Any], Any]) -> Any:
    bar = progress_bar(description)
    if bar is None:
        return fn(None)
    with bar:
        task = bar.add_task(description, total=None, rate="")
        t0 = time.monotonic()

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, rate=fmt_rate(done, time.monotonic() - t0))

        return fn(update)


__all__ = [
    "Output", "console", "print_table", "now_iso", "JSON_SCHEMA", "print_json", "say", "fmt_size", "fmt_time", "fmt_age",
    "show_key", "json_key", "warn", "fmt_rate", "key_table", "say_created", "say_restored", "say_published", "pools_table", "show_attached", "print_status",
    "WATCH_HEADER", "watch_line", "keys_table", "snapshots_table", "prometheus", "progress_bar", "run_with_progress",
]
