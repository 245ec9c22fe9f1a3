"""Whether an incremental persist writes a delta manifest (snapdelta.py), and against which base.

A delta is written when the pool's base positions (basepos.py) name a full
manifest that is still in the snapshot directory -- found by its "ident"
section among the pool's timestamped snapshots, whole where the split reads
it (its insert_seq, checksum, expiry and length columns' checksums), its
packs there -- of at least MIN_BASE entries, and when the delta stays small: its entries (put or changed
since the base) and the base's dropped ones (deleted, overwritten, evicted or
expired since) each at most MAX_CHANGED of the base's entries, and the
positions of both (the delta's entries, then the base's) within the gone
marks' room (layout.gone_room: a quarter more than the slots); and while
the pool's packs, with the delta's new values, stay within SPACE_BOUND of
the bytes the new snapshot holds -- what the kept snapshots need is at least
that, so the space bound holds after a delta too.  A delta never compacts the
base's packs (that would read the base's columns); the full persist this
sends to does.  Otherwise (`plan` gives None) the persist writes a full manifest,
which becomes the next base.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple


from . import basepos, packs, snapdelta, snapplaces
from .errors import CortexCacheError, SnapshotCorrupt
from .retention import SPACE_BOUND
from .snapfile import MANIFEST_VERSION, Snapshot

if TYPE_CHECKING:
    from .core import Core

MAX_CHANGED = 0.25  # of the base's entries changed or dropped: beyond it, a full manifest
MIN_BASE = 64  # a base of fewer entries is simply rewritten whole: a delta would save nothing worth a second file


class Plan(NamedTuple):
    base_name: str
    ident: bytes
    nb: int
    split: basepos.Split
    kept_bytes: int  # value bytes of the base's entries the delta keeps
    base_packs: tuple[str, ...]  # the packs the base names


def plan(core: "Core", directory: Path, files: list[Path]) -> Plan | None:
    """The delta to write for `core`'s pool in `directory` (its timestamped snapshots `files`), or None."""
    named = basepos.base_of(core)
    if named is None:
        return None
    ident, nb, seq = named
    if nb < MIN_BASE:
        return None
    for path in reversed(files):
        try:
            with Snapshot(path, verify=False, private=True, base=False) as snap:
                if snap.header.version != MANIFEST_VERSION or snap.entries != nb:
                    continue
                own = snap.section(snapdelta.IDENT)
                if own is None or bytes(own) != ident:
                    continue
                if not all(_there(directory, r.name, r.size) for r in snap.pack_refs):
                    return None
                snap.open_packs()  # each pack's header whole (a damaged one: a full manifest, sharing nothing)
                split = basepos.split(core, nb, seq)
                nd, ndrop = len(split.changed), nb - split.kept
                g = core.geometry
                if nd + nb > (g.gone_len if g.gone_off else g.n_slots) or max(nd, ndrop) > MAX_CHANGED * nb:
                    return None
                held = split.kept_bytes + split.changed_bytes
                if _pack_bytes(directory, snapplaces.namespaced(core.name)) + split.changed_bytes > SPACE_BOUND * held:
                    return None
                return Plan(path.name, ident, nb, split, split.kept_bytes, tuple(r.name for r in snap.pack_refs))
        except (CortexCacheError, OSError):
            continue  # not readable: not the base (and a damaged base gives a full manifest)
    return None


def deltas_of(files: list[Path], ident: bytes) -> set[str]:
    """The names of the delta manifests among `files` written against the base named `ident`."""
    out = set()
    for path in files:
        try:
            with Snapshot(path, verify=False, private=True, base=False) as snap:
                view = snap.section("base") if snap.header.version == snapdelta.DELTA_VERSION else None
                if view is not None and snapdelta.read_base(view, SnapshotCorrupt)[0] == ident:
                    out.add(path.name)
                del view
        except (CortexCacheError, OSError):
            continue
    return out


def _pack_bytes(directory: Path, stem: str) -> int:
    """The bytes of the packs of pool files `stem` in `directory`."""
    total = 0
    for p in packs.packs_of(stem, directory):
        try:
            total += p.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


def _there(directory: Path, name: str, size: int) -> bool:
    try:
        st = (directory / name).stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size and st.st_uid == os.geteuid()


__all__ = ["plan", "Plan", "MAX_CHANGED", "deltas_of"]
