"""The gone marks of a background fill: what the snapshot must never bring back (docs/design.md, "Gone marks").

While a restored pool fills (fill.py), the snapshot it fills from is a tier
below memory (snaptier.py).  A key deleted, overwritten, evicted or expired
after the publish must never come back from it, whether or not the fill has
reached it, whichever process wrote it and whoever is killed when.  The mark
for that is in the segment, one byte per slot (layout.py, gone_off):

- bit POSITION of byte p: the snapshot's entry at position p of the fill's
  order (fill.manifest_items) is no longer the answer.  Set by the fill when
  it loads or skips p, by the promotion of p (memory answers now), and by a
  put or delete of p's key, in the lock hold that changes memory and before
  it does: a process killed in that hold leaves the key gone, never back.
  An eviction needs no mark: whatever memory holds already marked its
  position (an entry the fill loaded, promoted or a put sealed).
- bit HASH of byte kh % n_slots: a key of hash kh was put or deleted by a
  process that cannot find positions (a handle opened without the snapshot
  tier, or a process that does not follow the fill mark: fill.follow).
  Every snapshot entry of that bucket counts as gone: a few misses more,
  never a wrong answer.

Expiry needs no mark: the snapshot's own expiry is checked at each lookup
and by the fill.  A snapshot never has more positions than the region has
bytes (fill.follow refuses it otherwise): one per slot, and in a pool with
base positions a quarter more (layout.gone_room), for a delta manifest's
entries beside its base's (snapdelta.py).  The marks are cleared when a new
fill is marked (fill.mark, before the pool is published) -- and a delta's
dropped base positions set there, in the same step -- only ever set afterwards, and every set is made with the pool lock held;
readers outside it check again inside it (snaptier.SnapshotBelow.still).
A pool made before the region (gone_off 0) keeps no marks: its fill behaves
as it did then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .core import Core

POSITION = 1 << 0  # byte p: the snapshot's entry at fill position p is gone
HASH = 1 << 1  # byte kh % n: a key of that hash was written without a position lookup


class GoneMarks:
    """One process's view of a pool's gone marks (all writes with the pool lock held)."""

    def __init__(self, core: "Core") -> None:
        g = core.geometry
        self.n = g.n_slots  # the hash marks' buckets
        self.room = g.gone_len  # positions: a slot's worth each, and a delta's room (layout.gone_room)
        self.present = bool(g.gone_off)
        # A typed memoryview: a byte read or set costs tens of nanoseconds, not numpy's scalar overhead.
        self._bytes = core.mv[g.gone_off : g.gone_off + self.room] if self.present else memoryview(b"")

    def clear(self) -> None:
        """A new fill is marked (fill.mark, the pool not published yet): nothing is gone from its snapshot."""
        if self.present:
            np.frombuffer(self._bytes, np.uint8)[:] = 0

    def gone(self, pos: int, kh: int) -> bool:
        """Is the snapshot's entry at `pos` (of key hash `kh`) no longer the answer?"""
        if not self.present:
            return False  # a pool made before the marks: as its fill always did
        if not 0 <= pos < self.room:
            return True  # never (fill.follow bounds the snapshot by the slots): a miss, never a wrong answer
        b = self._bytes
        return bool(b[pos] & POSITION or b[kh % self.n] & HASH)

    def mark(self, pos: int) -> None:
        """Lock held: the snapshot's entry at `pos` is gone."""
        if self.present and 0 <= pos < self.room:
            self._bytes[pos] |= POSITION

    def mark_all(self, positions: np.ndarray) -> None:
        """Lock held (or the pool not published): the snapshot's entries at `positions` are gone."""
        if self.present and len(positions):
            positions = positions[(positions >= 0) & (positions < self.room)]
            np.frombuffer(self._bytes, np.uint8)[positions] |= POSITION

    def mark_hash(self, kh: int) -> None:
        """Lock held: a key of hash `kh` was written by a process that cannot find its position."""
        if self.present:
            self._bytes[kh % self.n] |= HASH

    def count(self) -> int:
        """Positions marked gone (for tests and `status`: a read of n bytes)."""
        if not self.present:
            return 0
        return int(np.count_nonzero(np.frombuffer(self._bytes, np.uint8) & POSITION))

    def close(self) -> None:
        self._bytes.release()


__all__ = ["GoneMarks", "POSITION", "HASH"]
