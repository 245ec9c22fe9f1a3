"""`cortex cache persist`, `restore`, `snapshots`: a pool to disk and back.

Snapshots go to the snapshot directory (incremental, with retention) or to
one self-contained file; restore publishes a pool before its values are in
and fills it (at once, or in a process of its own with --background);
`snapshots` lists, verifies and prunes what is on disk.
"""

from __future__ import annotations

import os
from typing import Optional

import typer

from . import cli_io
from .cli_options import DEBUG_OPT, JSON_OPT, MAX_KEEP, NAME_ARG, QUIET_OPT, parse_mode, path_given
from .cli_render import (
    Output, fmt_rate, fmt_size, print_json, print_table, run_with_progress, say, say_published, say_restored,
    snapshots_table, warn,
)
from .errors import EX_NOINPUT, SnapshotCorrupt, SnapshotNotFound, UsageError
from .units import entries, plural

def persist(
    name: str = NAME_ARG,
    output: Optional[str] = typer.Option(None, "--output", "-o", metavar="FILE", callback=path_given, help="Write the snapshot to this file instead of the snapshot directory."),
    keep: Optional[int] = typer.Option(None, "--keep", min=1, max=MAX_KEEP, metavar="N", help="Keep the newest N snapshots of the pool in the snapshot directory, now and at every later persist (stored with the pool, so only its owner or root may set it: 77 for anyone else; default 3)."),
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
    if output == "-":  # elsewhere (get -o -, put -) the standard streams: never a file named "-" by surprise
        raise UsageError("--output - would be stdout, and a snapshot is written to a file and renamed into place: "
                         "give a file name (./- for a file named '-')")
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
            warn(f"{entries(result.skipped_corrupt)} failed their checksum in memory and were left out")


def restore(
    name: str = NAME_ARG,
    input_: Optional[str] = typer.Option(None, "--input", "-i", metavar="FILE", callback=path_given, help="Snapshot file (default: NAME.ccsnap in the snapshot directory)."),
    replace: bool = typer.Option(False, "--replace", help="Replace an existing pool: a new one with its size, policy and tiers is filled from the snapshot and swapped in atomically (its disk tier is emptied; a remote tier is left alone)."),
    if_missing: bool = typer.Option(False, "--if-missing", help="Exit 0 and change nothing if the pool exists; restore it if it does not; without a snapshot of it (a first boot) exit 66 with a note, not an error."),
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

    if input_ == "-":  # elsewhere (put -) stdin: never a file named "-" by surprise
        raise UsageError("--input - would be stdin, and a snapshot is read from a file it maps: give a file name "
                         "(./- for a file named '-')")
    if input_ is not None and os.path.isdir(input_):
        # Opening a directory read-only succeeds; say what is wrong before the reader tries to map it.
        raise UsageError(f"{input_!r} is a directory, not a snapshot")
    if background and replace:
        raise UsageError("--background is for a pool that is missing: --replace swaps in a complete pool")
    def run(cb):
        return snap.restore(input_, name=name, replace=replace, progress=cb, if_missing=if_missing,
                            mode=parse_mode(mode) if mode is not None else None, trust_tiers=trust_tiers,
                            allow_other_owner=allow_other_owner, detach=background)

    try:
        # --background forks the filler: no progress bar (its refresh thread) may be running then.
        pool, report = run(None) if background else run_with_progress(f"restore {name}", run)
    except SnapshotNotFound:
        if not (if_missing and input_ is None) or os.path.lexists(snap.latest_path(name)):
            raise
        # The boot line on a first boot: no fault, so a note, not an error; exit 66 all the same, for the
        # `|| create --if-missing` after it (and systemd's SuccessExitStatus=66).
        if as_json or not Output.quiet:
            cli_io.error(f"no snapshot of {name} in {snap.snapshot_dir()} yet: nothing to restore (a first boot; "
                         f"`cortex cache create {name} ... --if-missing` makes the pool)", EX_NOINPUT, as_json,
                         kind="note")
        raise typer.Exit(EX_NOINPUT) from None
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
        state = report.get("policy_state")
        if state and not state["applied"]:  # the entries are all there; only the policy's order starts anew
            warn(f"policy state not restored ({state['note']}): the pool evicts as a freshly filled one would")
        left = report.get("not_attached")
        if left:
            what = ", ".join(
                f"{label} {left[k]}" for k, label in (("disk", "disk tier"), ("remote", "remote tier"),
                                                      ("keep", "retention")) if k in left
            )
            warn(f"not attached: {what} ({left['why']}); restore --trust-tiers attaches them")


def snapshots(
    name: str = NAME_ARG,
    verify: bool = typer.Option(False, "--verify", help="Also read every value back and check it against its checksum; exit 65 if a snapshot is damaged or misses a pack."),
    prune: bool = typer.Option(False, "--prune", help="Remove all but the newest --keep snapshots (and the packs only they used), then list what is left."),
    keep: Optional[int] = typer.Option(None, "--keep", min=0, max=MAX_KEEP, metavar="N", help="With --prune: how many to keep (default: as many as the pool keeps, 3 for a pool that is gone; 0 removes every one, NAME.ccsnap too)."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
    debug: bool = DEBUG_OPT,
) -> None:
    """List every snapshot of a pool in the snapshot directory, oldest first.

    Shows each one's time, entries and value bytes, the bytes on disk that
    are its own and those it shares with the others (the packs of
    incremental snapshots), and which one NAME.ccsnap (what restore reads by
    default) names; then what they take on disk together, and that over
    what the kept snapshots need (their files and every pack record one of
    them names): above 1.00x is bytes in packs that no kept snapshot needs
    any more, which a persist's compaction keeps within 1.5x (doctor flags
    more).  Reads the snapshot files, not the values, unless --verify.
    --prune removes the
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
        if not as_json:  # the JSON document carries it as "pruned"
            say(f"removed {plural(len(pruned['removed']), 'file', 'files')} of {name}'s snapshots, "
                f"{fmt_size(pruned['freed_bytes'])}; {plural(pruned['kept'], 'snapshot', 'snapshots')} kept")
    rows, space = snap.snapshots_and_space(name, verify=verify)
    bad = [r for r in rows if "error" in r]
    # One ratio: the bytes on disk over what the kept snapshots need, which compaction bounds (SPACE_BOUND)
    # and doctor checks; on disk over the largest snapshot says nothing of waste (two --full snapshots: 2x).
    space = {k: v for k, v in space.items() if k != "ratio"}
    if as_json:
        print_json({"pool": name, "directory": str(snap.snapshot_dir()), "snapshots": rows, "space": space,
                    **({"pruned": pruned} if pruned is not None else {})})
    elif not rows:
        say(f"no snapshots of {name} in {snap.snapshot_dir()}", stderr=True)
    else:
        print_table(snapshots_table(rows))
        ratio = (f", {space['waste_ratio']:.2f}x what the kept snapshots need (at most {snap.SPACE_BOUND}x "
                 "after a persist)" if space["waste_ratio"] else "")
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
