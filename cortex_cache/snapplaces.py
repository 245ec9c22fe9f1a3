"""Where snapshots live and what they are called: the snapshot directory, file names, atomic links.

Files, in the snapshot directory, for the pool whose namespaced name is STEM
(`namespaced`)::

    STEM-<UTC time>.ccsnap            a snapshot (its manifest), timestamped
    STEM.ccsnap                       a second name (hard link) of the newest
    .STEM[-<time>].ccsnap.tmp-XXXX    one being written (swept by the next persist)
    STEM-<UTC time>.ccpack            a pack of values (packs.py)
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from . import packs, safefs, segment
from .snapfile import SUFFIX

SNAPSHOT_DIR_ENV = "CORTEX_CACHE_SNAPSHOT_DIR"
DEFAULT_KEEP = 3
STAMP_RE = r"\d{8}T\d{6}\.\d{6}Z"

def snapshot_dir() -> Path:
    """CORTEX_CACHE_SNAPSHOT_DIR, else $XDG_STATE_HOME/cortex-cache/snapshots, else /var/lib/... for root."""
    return snapshot_places()[1]


def snapshot_places() -> tuple[Path, Path]:
    """(anchor, snapshot directory): the directory, and where the part of its path that must be ours begins.

    Below the anchor every component is checked without following symlinks
    (safefs.check_tree): the state directory itself may be shared (a
    world-writable XDG_STATE_HOME), `cortex-cache/snapshots` in it may not.
    An explicit CORTEX_CACHE_SNAPSHOT_DIR is the operator's path: only its
    last component is checked so.
    """
    env = os.environ.get(SNAPSHOT_DIR_ENV)
    if env:
        d = Path(os.path.abspath(env))
        return d.parent, d
    if os.geteuid() == 0 and not os.environ.get("XDG_STATE_HOME"):
        state = "/var/lib"
    else:
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state), Path(state) / "cortex-cache" / "snapshots"


def checked_snapshot_dir(mode: int = 0o600, make: bool = False) -> Path:
    """The snapshot directory, once every component of it below its anchor checked out (safefs.check_tree).

    A component that is a symlink or not ours alone is PermissionDenied
    (77), one that is not a directory CannotCreate (73).  `mode`: the
    pool's mode (a group pool's directory may be group-writable).  With
    `make`, missing components are made (the last one private: every pool of
    this user shares it), then checked again.
    """
    anchor, directory = snapshot_places()
    safefs.check_tree(anchor, directory, mode, "snapshot directory")
    if make and not os.path.lexists(directory):
        # Every pool of this user shares it, so it is made private whatever this pool's mode: a group
        # pool that made it 0770 would lock every private pool out of it.  A directory the operator
        # opened to the group is still accepted for a group pool.
        safefs.make_dir(directory, 0o600, "snapshot directory")
        safefs.check_tree(anchor, directory, mode, "snapshot directory")
    return directory


def snapshot_file_mode(pool_mode: int) -> int:
    """A snapshot file's mode for a pool of `pool_mode`: 0600, plus read for whom the pool lets read.

    Never writable by anyone but us (a snapshot only we can write is one
    restore trusts), and readable as the pool is, so that restore can bring
    a group pool back with its mode (restore never makes a pool readable by
    more users than its snapshot file is).
    """
    return 0o600 | (pool_mode & 0o044)


def namespaced(name: str) -> str:
    """The stem of what pool `name` owns on disk (snapshots, default disk tier).

    Namespaced like the segment: under another CORTEX_CACHE_SHM_PREFIX than
    the default, the prefix comes first, so two deployments with a pool of
    the same name never share (or rotate away) each other's files.  Under the
    default prefix the stem is the bare name, as it always was.
    """
    p = segment.prefix()
    return name if p == segment.DEFAULT_PREFIX else p + name


def latest_path(name: str, directory: Path | None = None) -> Path:
    """The stable name of pool `name`'s newest snapshot in the snapshot directory."""
    return (directory or snapshot_dir()) / f"{namespaced(name)}{SUFFIX}"


def stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def timestamped(name: str, directory: Path, now: float) -> Path:
    return directory / f"{namespaced(name)}-{stamp(now)}{SUFFIX}"


def snapshots_of(name: str, directory: Path | None = None) -> list[Path]:
    """Timestamped snapshots of pool `name` in the directory, oldest first."""
    return timestamped_files(namespaced(name), directory or snapshot_dir())


def timestamped_files(stem: str, directory: Path) -> list[Path]:
    pattern = re.compile(r"^" + re.escape(stem) + r"-" + STAMP_RE + re.escape(SUFFIX) + r"$")
    try:
        return sorted(p for p in directory.iterdir() if pattern.match(p.name))
    except (FileNotFoundError, NotADirectoryError):  # none yet, or a file in the way (persist says so: 73)
        return []


TEMP_RE = re.compile(r"^\.(?P<stem>.+?)(?:-" + STAMP_RE + r")?(?:" + re.escape(SUFFIX) + "|" + re.escape(packs.PACK_SUFFIX)
                     + r")\.tmp-[0-9a-f]{12}$")


def clean_stale_temps(directory: Path, pool_name: str, target_name: str) -> None:
    """Remove temp files that a killed persist of this pool left (we hold its persist lock).

    `pool_name` is the namespaced stem of the pool's files."""
    tmp = r"\.tmp-[0-9a-f]{12}$"
    patterns = [
        re.compile(r"^\." + re.escape(target_name) + tmp),  # an explicit --output
        re.compile(r"^\." + re.escape(pool_name) + "-" + STAMP_RE + re.escape(SUFFIX) + tmp),  # timestamped
        re.compile(r"^\." + re.escape(pool_name) + re.escape(SUFFIX) + tmp),  # the latest link
    ]
    try:
        for entry in os.scandir(directory):
            if any(p.match(entry.name) for p in patterns):
                try:
                    if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                        continue  # not ours (a shared --output directory): never touched
                    os.unlink(entry.path)  # a symlink goes itself, never what it points at
                except OSError:
                    pass
    except OSError:
        pass


def link_latest(target: Path, latest: Path) -> None:
    """Point the stable name at `target` atomically (a hard link renamed into place)."""
    tmp = latest.parent / f".{latest.name}.tmp-{secrets.token_hex(6)}"
    os.link(target, tmp)
    try:
        os.rename(tmp, latest)
    except BaseException:
        os.unlink(tmp)
        raise


def fsync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


__all__ = ["SNAPSHOT_DIR_ENV", "DEFAULT_KEEP", "STAMP_RE", "TEMP_RE", "snapshot_dir", "snapshot_places",
           "checked_snapshot_dir", "snapshot_file_mode", "namespaced", "latest_path", "stamp", "timestamped",
           "snapshots_of", "timestamped_files", "clean_stale_temps", "link_latest", "fsync_dir"]
