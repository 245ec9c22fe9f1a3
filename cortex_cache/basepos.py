"""Base positions: what an incremental persist may leave to the full manifest before it (docs/design.md).

An incremental persist writes a delta manifest (snapdelta.py): only the
entries put or changed since a BASE -- a full version 4 manifest of the pool
in the snapshot directory -- and a bit per base position that is no longer
part of the snapshot.  To know which live entries are still the base's
without reading each of them in Python, or the base's columns from disk, the
segment keeps, per slot, the position + 1 of its entry in the base (0: none),
in a region of its own (layout.py, base_off; BASE_HEAD first)::

    base_off + 0   u8[16] ident of the base (its "ident" section); zeros: no base
    base_off + 16  u64 entries of the base
    base_off + 24  u64 seq: every entry the base holds has an insert_seq <= seq
    base_off + 32  32 bytes zero
    base_off + 64  n_slots x u32: position + 1 of the slot's entry in the base, 0 none

Stamped by persist once a full manifest is durably in place (`stamp`): the
ident is zeroed first, the positions written a chunk of slots per lock hold
for the slots whose entry is still the one captured (same insert_seq), the
ident last, so a persister killed in between leaves no base (the next persist
writes a full manifest).  Nothing on the hot paths clears a position: a slot
counts as unchanged while its position is set and its entry's insert_seq is
<= seq (`split`).  Every put, in-place overwrite (the C path too) and reuse of
a slot gives its entry the header's next sequence number, which only grows in
a segment, so above seq; only core.restore_meta gives an entry an older one,
and it runs in new pools (restore, resize: their regions are zero) or in a
fill, which forgets the base first (`forget`, from fill.mark).  Expiry is set
only with a new insert_seq too; an entry expired since is not live, so dropped.
A pool made before the region (base_off 0) has no base: its persists write
full manifests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .layout import BASE_HEAD_SIZE, SEALED

if TYPE_CHECKING:
    from .core import Core

IDENT_BYTES = 16
CHUNK_SLOTS = 1 << 17  # slots stamped per lock hold (a few ms)


def present(core: "Core") -> bool:
    return bool(core.geometry.base_off)


def _head(core: "Core") -> np.ndarray:
    return np.frombuffer(core.mv, np.uint8, BASE_HEAD_SIZE, core.geometry.base_off)


def _positions(core: "Core") -> np.ndarray:
    return np.frombuffer(core.mv, np.uint32, core.geometry.n_slots, core.geometry.base_off + BASE_HEAD_SIZE)


def base_of(core: "Core") -> tuple[bytes, int, int] | None:
    """(ident, entries, seq) of the base the pool's positions name, or None (no region, or no base)."""
    if not present(core):
        return None
    head = _head(core)
    ident = head[:IDENT_BYTES].tobytes()
    if ident == bytes(IDENT_BYTES):
        return None
    words = head[16:32].view(np.uint64)
    return ident, int(words[0]), int(words[1])


def forget(core: "Core") -> None:
    """Lock held (or the pool not published): no base any more; the next persist writes a full manifest."""
    if present(core):
        _head(core)[:IDENT_BYTES] = 0


def clear(core: "Core") -> None:
    """The pool not published yet (a fill's mark): no base, and no slot's position set."""
    if present(core):
        forget(core)
        _positions(core)[:] = 0


def set_positions(core: "Core", slots: np.ndarray, positions: np.ndarray) -> None:
    """Lock held, in the hold that sealed them: the entries a fill just loaded at `slots` are at `positions`
    of the base it fills from (named at its end: `name`)."""
    if present(core) and len(slots):
        _positions(core)[slots] = (positions + 1).astype(np.uint32)


def name(core: "Core", ident: bytes, entries: int, seq: int) -> None:
    """Lock held: the positions set are those of the full manifest `ident` of `entries` entries, every one
    put at a sequence number <= `seq` (the ident last: until then, no base)."""
    if present(core):
        assert len(ident) == IDENT_BYTES and ident != bytes(IDENT_BYTES)
        head = _head(core)
        head[16:32] = np.frombuffer(np.array([entries, seq], np.uint64).tobytes(), np.uint8)
        head[:IDENT_BYTES] = np.frombuffer(ident, np.uint8)


def stamp(core: "Core", slots: np.ndarray, insert_seq: np.ndarray, positions: np.ndarray, ident: bytes,
          seq: int) -> None:
    """A full manifest of `len(slots)` entries named `ident` is durably in place: the entry captured at
    `slots[k]` (its `insert_seq[k]`) is at `positions[k]` in it.  Stamp the slots whose entry is still that
    one; the ident last (a kill before it leaves no base).  `seq`: the capture's sequence number (every
    captured entry's insert_seq is <= it, every later put's above).  (A fill by columns sets positions as
    it seals and names its manifest at its end: `set_positions`, `name`.)"""
    if not present(core):
        return
    assert len(ident) == IDENT_BYTES and ident != bytes(IDENT_BYTES)
    core.locked(forget, core)
    pos = _positions(core)
    n = core.geometry.n_slots
    for a in range(0, n, CHUNK_SLOTS):
        core.locked(_zero, pos, a, min(n, a + CHUNK_SLOTS))
    order = np.argsort(slots, kind="stable")  # chunks of slots in slot order: each hold touches a range
    slots, insert_seq, positions = slots[order], insert_seq[order], positions[order]
    for a in range(0, len(slots), CHUNK_SLOTS):
        core.locked(_stamp_chunk, core, pos, slots[a : a + CHUNK_SLOTS], insert_seq[a : a + CHUNK_SLOTS],
                    positions[a : a + CHUNK_SLOTS])
    core.locked(name, core, ident, len(slots), seq)


def _zero(pos: np.ndarray, a: int, b: int) -> None:
    pos[a:b] = 0


def _stamp_chunk(core: "Core", pos: np.ndarray, slots: np.ndarray, insert_seq: np.ndarray,
                 positions: np.ndarray) -> None:
    c = core.columns
    same = (c["state"][slots] == SEALED) & (c["insert_seq"][slots] == insert_seq)
    pos[slots[same]] = (positions[same] + 1).astype(np.uint32)


class Split(NamedTuple):
    """The live entries against a base: `changed` slots (most recently used first) to write, `dropped` base
    positions (bool per base position) no longer in the pool, how many base entries stay and their bytes."""

    changed: np.ndarray
    dropped: np.ndarray
    kept: int
    kept_bytes: int
    changed_bytes: int


def split(core: "Core", nb: int, seq: int) -> Split:
    """Which live entries are the base's (`nb` entries, all put at sequence numbers <= `seq`) and which
    changed: elementwise numpy over the slot columns in one lock hold (no gather of the live entries:
    ~10 ns a slot), the changed ones' order outside it."""
    def look() -> tuple[np.ndarray, ...]:
        c = core.columns
        live = core.live_mask()
        pos = _positions(core)
        ok = live & (pos > 0) & (pos <= nb) & (c["insert_seq"] <= np.uint64(seq))
        changed = np.flatnonzero(live & ~ok)
        vlen = c["value_len"]
        return (pos[ok], int(ok.sum()), int(vlen[ok].sum(dtype=np.uint64)), changed, c["access_seq"][changed],
                int(vlen[changed].sum(dtype=np.uint64)))

    kept_pos, kept, kept_bytes, changed, aseq, changed_bytes = core.locked(look)  # copies, not views
    dropped = np.ones(nb, bool)
    dropped[kept_pos.astype(np.int64) - 1] = False
    changed = changed[np.argsort(aseq, kind="stable")[::-1]]  # most recently used first
    return Split(changed, dropped, kept, kept_bytes, changed_bytes)


__all__ = ["IDENT_BYTES", "present", "base_of", "forget", "clear", "set_positions", "name", "stamp", "split",
           "Split"]
