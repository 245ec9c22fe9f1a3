"""The snapshot a restored pool is being filled from, as a read-only tier below memory (lower.py, fill.py).

While a pool's fill runs (or was interrupted: its mark says FILL_RUNNING), a
get that misses memory looks the key up in the snapshot the mark names and,
when the fill has not come to it yet, reads its value from its pack, checks
it against its checksum and promotes it, as the disk tier's misses are: the
entry an engine asks for is there at once instead of when the fill reaches
it, and the fill then skips it as present.  An entry the fill has come to
(loaded, then perhaps evicted or deleted since; or skipped) is never brought
back from the snapshot: the fill's mark (fill_done, advanced in the lock hold
that seals each batch) says where that line is.

Each process that opens the pool while its fill runs maps the snapshot's
manifest read-only -- only if it would trust that snapshot itself
(fill.follow: the mark is in the segment, which another member of a group
pool may write); otherwise it has no snapshot tier -- and drops it once the
fill has ended.  A version 4 manifest is used in place: opening it reads its
header and section table, a lookup probes its table (manifest.py) and reads
the one entry's columns, every number bounds-checked, so attaching costs the
same at ten thousand entries as at ten million, and the page cache's copy of
the manifest is shared by every process.  A version 3 manifest (persisted by
an older cortex_cache) is still indexed per process, as it was: its key ->
place in the fill's order, which every process computes alike
(fill.manifest_items), from the manifest checked whole first.  With it, `in` and the
lookups' leading runs (engines' prefix matches) count the entries the fill
will still bring as there.  A snapshot that cannot be read, has changed since
the fill began, or a record that fails its checksum is a miss.
"""

from __future__ import annotations

import threading
from typing import Any

from xxhash import xxh3_64_intdigest

from . import fill
from .errors import CortexCacheError
from .layout import FILL_RUNNING, SLOT_FLAG_STR_KEY
from .lower import Context, Fetched, Lower, too_small
from .snapshot import Snapshot, followed


class SnapshotBelow(Lower):
    """The filling snapshot of one pool, read only; `ended` once its fill is over (tiers.py drops it)."""

    name = "snapshot"
    distance = 1  # after the disk tier (in the segment), before the server

    def __init__(self, core: Any) -> None:
        self.core = core
        self.ended = False
        self._gen: int | None = None  # the fill generation the index is for
        self._snap: Snapshot | None = None
        self._index: dict[bytes, tuple[int, fill.Item]] = {}  # a version 3 manifest's, built per process
        self._lock = threading.Lock()
        with self._lock:  # built now, outside every lock hold: `contains` answers from it
            self._load(int(core.header[0]["fill_gen"]))

    @classmethod
    def attach(cls, core: Any, ctx: Context) -> "SnapshotBelow | None":
        """While the pool's fill runs, for a handle that indexes it (`ctx.snapshot`)."""
        return cls(core) if ctx.snapshot and fill.running(core) else None

    def fetch(self, kb: bytes, kh: int, found: Any, room: int | None) -> Fetched | None:
        h = self.core.header[0]
        with self._lock:  # one index build per process; and no close while a thread reads a pack's mapping
            if int(h["fill_state"]) != FILL_RUNNING:
                self.ended = True
                self._close()
                return None
            gen = int(h["fill_gen"])
            if gen != self._gen:
                self._load(gen)
            snap = self._snap
            pos = self._position(kb, kh)
            if pos is None or snap is None:
                return None
            if pos < int(h["fill_done"]):
                return None  # the fill came to it: loaded (perhaps evicted or deleted since) or skipped
            it = self._item(pos, kb)
            if it is None or 0 < it.meta[2] <= self.core.clock():
                return None  # damaged, or expired
            too_small(room, it.length)
            pack, off = it.where
            try:
                # Copied out of the pack's mapping, then checked against the manifest's checksum: what is
                # checked is what is served, even if the pack is cut short meanwhile (its reads are zeros).
                reader = snap.pack_reader(pack)
                if snap.v4 is not None:
                    value = bytes(reader.raw_value(off, it.length, it.checksum, snap.path, False))
                else:
                    value = bytes(reader.value(off, it.key, it.length, it.checksum, snap.path, False))
                if reader.cut_short() or xxh3_64_intdigest(value) != it.checksum:
                    return None
            except (CortexCacheError, OSError, ValueError):
                return None  # a damaged record, or a pack gone: a miss, never wrong bytes
        return Fetched(value, it.flags & SLOT_FLAG_STR_KEY, it.checksum, it.meta[2], it.priority, (gen, pos))

    def position(self, kb: bytes, kh: int) -> int | None:
        """The fill position of key `kb` (`kh`: its xxh3_64) in the snapshot this pool is filled from, whether
        or not the fill has come to it; None if the snapshot does not hold it (or none is followed).  The
        pool's lock may be held: a probe of the mapped manifest (or of a version 3 manifest's index), no I/O
        beyond the mapping."""
        if int(self.core.header[0]["fill_gen"]) != self._gen:
            return None
        return self._position(kb, kh)

    def _position(self, kb: bytes, kh: int) -> int | None:
        snap = self._snap
        if snap is None:
            return None
        if snap.v4 is not None:
            pos = snap.position(kb, kh)
            # A manifest cut short while mapped reads zeros: nothing read from it is used.
            return None if pos is None or snap.check_cut() else pos
        place = self._index.get(kb)
        return None if place is None else place[0]

    def _item(self, pos: int, kb: bytes) -> fill.Item | None:
        """The snapshot's entry at fill position `pos` (key `kb`), as the fill would load it."""
        snap = self._snap
        assert snap is not None
        if snap.v4 is None:
            return self._index[kb][1]
        r = snap.v4.row(pos)
        if r["pack"] >= len(snap.pack_refs):
            return None
        return fill.Item(kb, r["flags"], r["length"], r["checksum"], r["priority"],
                         (r["created"], r["last_access"], r["expiry"], r["insert_seq"], r["access_seq"],
                          r["access_count"]), (r["pack"], r["offset"]))

    def contains(self, kb: bytes, kh: int) -> bool:
        """Lock held: does the snapshot still hold `kb` for this pool (the fill has not come to it)?  Answered
        from the index built when the pool was opened (never built here, under the pool's lock)."""
        h = self.core.header[0]
        if int(h["fill_state"]) != FILL_RUNNING or int(h["fill_gen"]) != self._gen:
            return False
        pos = self._position(kb, kh)
        if pos is None or pos < int(h["fill_done"]):
            return False
        it = self._item(pos, kb)
        return it is not None and not 0 < it.meta[2] <= self.core.clock()

    def still(self, got: Fetched) -> bool:
        """Lock held: the fill is still the same one and has not come to this entry (it would have loaded it,
        or skipped it as deleted or put meanwhile)."""
        h = self.core.header[0]
        gen, pos = got.token
        return int(h["fill_state"]) == FILL_RUNNING and int(h["fill_gen"]) == gen and pos >= int(h["fill_done"])

    def _load(self, gen: int) -> None:
        """The index of the snapshot the mark names, for fill generation `gen` (empty when it cannot be read)."""
        self._close()
        self._gen = gen
        snap, _why = fill.follow(self.core, followed)  # only a snapshot this process would trust itself
        if snap is None:
            return
        if snap.v4 is not None:  # used in place: nothing is read or built here
            self._snap = snap
            return
        try:
            self._index = {it.key: (n, it) for n, it in enumerate(fill.manifest_items(snap))}
        except (CortexCacheError, OSError, ValueError):
            snap.close()
            self._index = {}
            return
        self._snap = snap

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        snap, self._snap = self._snap, None
        self._index = {}
        if snap is not None:
            snap.close()


__all__ = ["SnapshotBelow"]
