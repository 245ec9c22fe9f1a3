"""`cortex cache put`, `get`, `keys`, `info`, `evict`: the entries of a pool.

Values come in from a file or stdin and go out to stdout or a file
(cli_io.py: bounded reads, files written whole or not at all); keys are
shown escaped, one a line (cli_render.show_key).
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from . import cli_io
from .cli_options import DEBUG_OPT, JSON_OPT, NAME_ARG, QUIET_OPT, WhichTier, path_given
from .cli_render import fmt_size, json_key, key_table, keys_table, print_json, print_table, say, show_key
from .errors import KeyNotFound, UsageError
from .units import entries

def put(
    name: str = NAME_ARG,
    key: str = typer.Argument(..., metavar="KEY", help="Key (UTF-8 string).", show_default=False),
    source: Optional[str] = typer.Argument(None, metavar="FILE|-", callback=path_given, help="Read the value from FILE, or from stdin with '-'.", show_default=False),
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


def get(
    name: str = NAME_ARG,
    key: str = typer.Argument(..., metavar="KEY", help="Key to read.", show_default=False),
    output: Optional[str] = typer.Option(None, "--output", "-o", metavar="FILE", callback=path_given, help="Write the value to this file (mode 0600) instead of stdout ('-': stdout); an existing file is refused unless --force."),
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


def keys(
    name: str = NAME_ARG,
    prefix: Optional[str] = typer.Option(None, "--prefix", metavar="PREFIX", help="Only keys starting with this."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, metavar="N", help="At most this many keys."),
    long: bool = typer.Option(False, "--long", "-l", help="Show size, age, TTL, accesses and priority."),
    tier: WhichTier = typer.Option(WhichTier.memory, "--tier", metavar="TIER", case_sensitive=False, help="memory (default), disk (reads each key from its record), all (memory and disk), or remote (this pool's keys on the remote server, in key order)."),
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


def evict(
    name: str = NAME_ARG,
    percent: Optional[float] = typer.Option(None, "--percent", metavar="PERCENT", help="Evict this percentage of the stored bytes, by policy."),
    nbytes: Optional[str] = typer.Option(None, "--bytes", metavar="SIZE", help="Evict at least this many value bytes, by policy (e.g. 1G)."),
    expired: bool = typer.Option(False, "--expired", help="Evict expired entries only."),
    key: Optional[list[str]] = typer.Option(None, "--key", metavar="KEY", help="Evict this key; repeat the option for more keys (--key a --key b)."),
    prefix: Optional[str] = typer.Option(None, "--prefix", metavar="PREFIX", help="Evict every key starting with this."),
    all_: bool = typer.Option(False, "--all", help="Evict everything."),
    tier: WhichTier = typer.Option(WhichTier.memory, "--tier", metavar="TIER", case_sensitive=False, help="memory (default; with a disk tier, evicted entries move to disk), disk (removed from the disk tier, oldest first for --percent/--bytes), all (removed from both), or remote (deleted from the remote server, for every host; --key, --prefix or --all only)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """Evict entries now and report what was freed.  Give exactly one selector.

    Several keys: repeat the option, --key a --key b.  A key given with
    --key that is not in the tier is named on stderr and the command exits
    66, as get does, after evicting the keys that were there (--json: their
    document, with the keys not found as "missing").

    Example: cortex cache evict llama --percent 25
    """
    from .pool import Pool, check_selector

    check_selector(percent, nbytes, expired, key or None, prefix, all_,
                   names=("--percent", "--bytes", "--expired", "--key", "--prefix", "--all"))
    missing: list[str] = []
    with Pool.open(name, lock_timeout=10) as p:
        if key:
            # One key at a time, so that each one not there can be named.
            count = freed = 0
            for k in dict.fromkeys(key):
                c, b = p.evict(keys=[k], tier=tier.value)
                count, freed = count + c, freed + b
                if not c:
                    missing.append(k)
        else:
            count, freed = p.evict(percent=percent, nbytes=nbytes, expired=expired, prefix=prefix, all=all_,
                                   tier=tier.value)
    if as_json:
        print_json({"pool": name, "tier": tier.value, "entries": count, "bytes": freed,
                    **({"missing": [show_key(k) for k in missing]} if key else {})})
    elif count or not missing:
        where = " from the remote server" if tier is WhichTier.remote else ""
        say(f"evicted {entries(count)}, {fmt_size(freed)} ({freed} bytes){where}")
    if missing:
        shown = ", ".join(f"'{show_key(k)}'" for k in missing)
        one = len(missing) == 1
        raise KeyNotFound(f"no key{'' if one else 's'} {shown} in pool {name!r} ({tier.value} tier): nothing to "
                          f"evict for {'it' if one else 'them'}")
