"""Delta manifests: an incremental persist that records only what changed since a full manifest.

A full version 4 manifest (manifest.py) of a million entries is ~170 MB of
columns and table: rewriting it is what an incremental persist after 1% of
changes cost.  A delta manifest (file header version 5, DELTA_VERSION, so a
reader of version 4 only refuses it) has the layout of version 4 -- header,
configuration block, sections, section table, trailer -- but its columns,
keys and lookup table hold only the entries put or changed since its BASE, a
full manifest of the same pool in the same directory, and two more sections:

  "base"     BASE_HEAD: u8[16] the base's ident (its "ident" section), u64 the
             base's entries Nb, u64 the snapshot's live entries, u64 their value
             bytes, u16 length of the base's file name; then the name (a file
             beside the delta)
  "dropped"  ceil(Nb / 8) bytes, bit p (little-endian bit order) of byte p // 8
             set: the base's entry at position p is not part of this snapshot
             (deleted, overwritten, evicted or expired since the base)

Its trailer counts its own entries and value bytes (a compaction rewrites it
as any version 4 file).  A full manifest carries "ident": 16 random bytes,
which a compaction's rewrite keeps (it changes only packs, pack and offset:
never positions), so a delta names its base whatever rewrote it.  Deltas are
always against a full manifest, never a chain.

Read as one snapshot (`Combined`): positions 0..Nd-1 are the delta's
entries (the most recently changed, in their own fill order), Nd + p the
base's position p.  Dropped positions are never an answer: a lookup misses
them, the fill finds them gone (fill.mark marks them), `records` skips them.
The pack table is the base's followed by the delta's own (a delta row's pack
index is shifted by the base's count).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from . import manifest

DELTA_VERSION = 5
BASE_HEAD = struct.Struct("<16sQQQH")
IDENT = "ident"


def base_section(ident: bytes, nb: int, live_entries: int, live_bytes: int, name: str) -> bytes:
    raw = name.encode()
    return BASE_HEAD.pack(ident, nb, live_entries, live_bytes, len(raw)) + raw


def read_base(view: memoryview, corrupt: Any) -> tuple[bytes, int, int, int, str]:
    """(ident, Nb, live entries, live bytes, base file name) of a "base" section."""
    if len(view) < BASE_HEAD.size:
        raise corrupt("impossible base section")
    ident, nb, entries, nbytes, nlen = BASE_HEAD.unpack_from(view, 0)
    if len(view) != BASE_HEAD.size + nlen or not 0 < nlen <= 512:
        raise corrupt("impossible base section")
    try:
        name = bytes(view[BASE_HEAD.size :]).decode()
    except UnicodeDecodeError:
        raise corrupt("impossible base file name") from None
    if "/" in name or name.startswith("."):
        raise corrupt(f"base {name!r} is not a file beside the snapshot")
    return ident, nb, entries, nbytes, name


def dropped_section(dropped: np.ndarray) -> bytes:
    return np.packbits(dropped.astype(bool), bitorder="little").tobytes()


class Combined:
    """A delta (`delta`, manifest.Reader) and its base (`base`) read as one version 4 manifest: the surface
    of manifest.Reader that the fill, the snapshot tier and verify use (n, cols, position, row, key, keys,
    section, verify_sections), positions as the module says."""

    def __init__(self, delta: manifest.Reader, base: manifest.Reader, dropped: memoryview, shift: int,
                 corrupt: Any) -> None:
        if len(dropped) != (base.n + 7) // 8:
            raise corrupt("its dropped section does not match its base's entries")
        self.delta, self.base, self.shift, self.corrupt = delta, base, shift, corrupt
        self.nd, self.nb = delta.n, base.n
        self.n = self.nd + self.nb
        self._bits = np.frombuffer(dropped, np.uint8)
        self._cols: dict[str, np.ndarray] | None = None

    def is_dropped(self, q: int) -> bool:
        """Is the base's position `q` not part of this snapshot?"""
        return bool(self._bits[q >> 3] >> (q & 7) & 1)

    def dropped_mask(self) -> np.ndarray:
        """A bool per combined position: dropped (never the delta's own)."""
        out = np.zeros(self.n, bool)
        out[self.nd :] = np.unpackbits(self._bits, count=self.nb, bitorder="little").astype(bool)
        return out

    @property
    def cols(self) -> dict[str, np.ndarray]:
        """The columns of every position (copied once: O(entries); the fill and verify read them whole)."""
        if self._cols is None:
            d = dict(self.delta.cols)
            d["pack"] = d["pack"] + np.uint32(self.shift)
            self._cols = {name: np.concatenate([d[name], self.base.cols[name]]) for name, _ in manifest.COLUMNS}
        return self._cols

    def position(self, kb: bytes, kh: int) -> int | None:
        p = self.delta.position(kb, kh)
        if p is not None:
            return p
        q = self.base.position(kb, kh)
        return None if q is None or self.is_dropped(q) else self.nd + q

    def row(self, p: int) -> dict[str, Any]:
        if p < self.nd:
            r = self.delta.row(p)
            r["pack"] += self.shift
            return r
        return self.base.row(p - self.nd)

    def key(self, p: int) -> bytes | None:
        return self.delta.key(p) if p < self.nd else self.base.key(p - self.nd)

    def keys(self, start: int, stop: int) -> list[bytes | None]:
        return [self.key(p) for p in range(start, stop)]

    def key_blob(self, p: int) -> memoryview:
        """The key blob of position `p`: the delta's for its own positions, else the base's."""
        return self.delta.key_blob(0) if p < self.nd else self.base.key_blob(0)

    def part_end(self, p: int) -> int:
        """The delta's positions come first, then the base's: each part's keys are in its own blob."""
        return self.nd if p < self.nd else self.n

    def section(self, name: str, check: bool = True) -> memoryview | None:
        """The delta's own section `name` (its policy state, ...)."""
        return self.delta.section(name, check)

    def verify_sections(self, names: Any = None) -> None:
        """The checksums of sections `names` (all: None) of the delta, and of those the base has."""
        self.delta.verify_sections(names)
        self.base.verify_sections(None if names is None else [n for n in names if n in self.base.places])

    def check_key_blob(self) -> None:
        manifest.check_key_blob(self.delta)
        manifest.check_key_blob(self.base)


__all__ = ["DELTA_VERSION", "BASE_HEAD", "IDENT", "base_section", "read_base", "dropped_section", "Combined"]
