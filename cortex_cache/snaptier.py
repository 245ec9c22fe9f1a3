"""The snapshot a restored pool is being filled from, as a read-only tier below memory (lower.py, fill.py).

While a pool's fill runs (or was interrupted: its mark says FILL_RUNNING), a
get that misses memory looks the key up in the snapshot the mark names and,
while its entry is not gone (gone.py: the fill loaded or skipped it, it was
promoted, or its key was put or deleted since the publish), reads its value
from its pack, checks it against its checksum and promotes it, as the disk
tier's misses are: the entry an engine asks for is there at once instead of
when the fill reaches it, and the fill then skips it as gone.  A gone entry
is never brought back from the snapshot, by this tier or by the fill.

Each process that opens the pool while its fill runs maps the snapshot's
manifest read-only -- only if it would trust that snapshot itself
(fill.follow: the mark is in the segment, which another member of a group
pool may write); otherwise its tier is blind (below) -- and drops it once the
fill has ended.  A version 4 manifest is used in place: opening it reads its
header and section table, a lookup probes its table (manifest.py) and reads
the one entry's columns, every number bounds-checked, so attaching costs the
same at ten thousand entries as at ten million, and the page cache's copy of
the manifest is shared by every process.  A version 3 manifest (persisted by
an older cortex_cache) is still indexed per process, as it was: its key ->
place in the fill's order, which every process computes alike
(fill.manifest_items), from the manifest checked whole first.  With it, `in` and the
lookups' leading runs (engines' prefix matches) count the entries the fill
will still bring as there, and each put or delete of a key marks its
position gone (`position`, in the lock hold that changes memory, before it
does).  A process without it (a handle opened with snapshot_tier=False, or
one that does not follow the mark) still has this tier, blind: it serves
nothing, and its puts and deletes mark the key's hash gone instead (a few
more misses for the other keys of that bucket, never a wrong answer).
While the tier is attached memory's writes go through Python (Tiers.fast_ok
is False), so the C write path never skips a mark -- but a put of a key the
snapshot has no entry of (`never_holds`) has nothing to mark, and takes it
(Tiers.fast_put).  A snapshot that cannot be read, has changed since the
fill began, or a record that fails its checksum is a miss.
"""

from __future__ import annotations

import threading
from typing import Any

from xxhash import xxh3_64_intdigest

from . import fill
from .errors import CortexCacheError
from .gone import GoneMarks
from .layout import FILL_RUNNING, H_FILL_DONE, H_FILL_GEN, H_FILL_STATE, SLOT_FLAG_STR_KEY
from .lower import Context, Fetched, Lower, Selector, too_small
from .snapshot import Snapshot, followed


class SnapshotBelow(Lower):
    """The filling snapshot of one pool, read only; `ended` once its fill is over (tiers.py drops it)."""

    name = "snapshot"
    distance = 1  # after the disk tier (in the segment), before the server
    supersedes = True  # told before memory takes a new value of a key: its position goes (gone.py)

    def __init__(self, core: Any, indexed: bool = True) -> None:
        self.core = core
        self.ended = False
        self.marks = GoneMarks(core)
        self._indexed = indexed  # False: a handle that only reads stats builds no index (blind)
        self._gen: int | None = None  # the fill generation the index is for
        self._snap: Snapshot | None = None
        self._index: dict[bytes, tuple[int, fill.Item]] = {}  # a version 3 manifest's, built per process
        self._lock = threading.Lock()
        with self._lock:  # built now, outside every lock hold: `contains` answers from it
            self._load(int(core.header[0]["fill_gen"]))

    @classmethod
    def attach(cls, core: Any, ctx: Context) -> "SnapshotBelow | None":
        """While the pool's fill runs: indexed for a handle that asks for it (`ctx.snapshot`), else blind."""
        return cls(core, ctx.snapshot) if fill.running(core) else None

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
            if pos < int(h["fill_done"]) or self.marks.gone(pos, kh):
                return None  # loaded or skipped by the fill, promoted, put or deleted since the publish
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
        return Fetched(value, it.flags & SLOT_FLAG_STR_KEY, it.checksum, it.meta[2], it.priority, (gen, pos, kh))

    def _entry(self, kb: bytes, kh: int) -> tuple[int, fill.Item] | None:
        """(position in the fill's order, entry) of `kb` in the snapshot this process follows, or None.  The
        one place the snapshot is asked by key (lock may be held: a probe of the mapping, no I/O)."""
        pos = self._position(kb, kh)
        if pos is None:
            return None
        it = self._item(pos, kb)
        return None if it is None else (pos, it)

    def never_holds(self, kb: bytes) -> bool:
        """Outside the lock: the snapshot this process follows has no entry of `kb` (it never changes while
        the fill runs; a blind tier cannot tell)."""
        return self._snap is not None and self._position(kb, xxh3_64_intdigest(kb)) is None

    def _held(self, kb: bytes, kh: int) -> int | None:
        """Lock held: `kb`'s position if the snapshot is still its answer (the fill runs, has not come to it,
        it is not gone and has not expired), else None."""
        core = self.core
        words = core.header_words  # typed words, not numpy's scalars: this runs in every put's lock hold
        if words[H_FILL_STATE] != FILL_RUNNING or words[H_FILL_GEN] != self._gen:
            return None
        place = self._entry(kb, kh)
        if place is None:
            return None
        pos, it = place
        if pos < core.counters[H_FILL_DONE] or self.marks.gone(pos, kh):
            return None
        return None if 0 < it.meta[2] <= core.clock() else pos

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
        """Lock held: does the snapshot still hold `kb` for this pool?  Answered from the index built when the
        pool was opened (never built here, under the pool's lock)."""
        return self._held(kb, kh) is not None

    def still(self, got: Fetched) -> bool:
        """Lock held: the fill is still the same one, has not come to this entry (it would have loaded it, or
        skipped it), and nobody put, deleted or promoted its key meanwhile."""
        h = self.core.header[0]
        gen, pos, kh = got.token
        return (int(h["fill_state"]) == FILL_RUNNING and int(h["fill_gen"]) == gen and pos >= int(h["fill_done"])
                and not self.marks.gone(pos, kh))

    def forget(self, kb: bytes, kh: int) -> bool:
        """Lock held, before memory drops `kb` (a delete): the snapshot's copy goes too, whether or not the
        fill has come to it.  True if the snapshot still held it."""
        return self._gone(kb, kh)

    def supersede(self, kb: bytes, kh: int) -> None:
        """Lock held, before memory seals a new value of `kb` (a put, a promotion): the snapshot's copy is no
        longer the answer."""
        self._gone(kb, kh)

    def remove(self, sel: Selector) -> tuple[int, int]:
        """`evict --tier all` of keys or a prefix: the snapshot's copies of them are gone, whether or not the
        fill has come to them (an eviction by amount, or of the expired, leaves the snapshot as it is: the
        fill never evicts, and expiry is checked at each lookup)."""
        core = self.core
        if sel.keys is not None:
            keys = sel.keys
        elif sel.prefix is not None:
            pb = sel.prefix
            with self._lock:  # outside the pool lock: the index is not rebuilt meanwhile
                snap = self._snap
                if snap is not None and snap.v4 is not None:  # every key of the manifest, read in place
                    keys = [kb for kb in snap.v4.keys(0, snap.v4.n) if kb is not None and kb.startswith(pb)]
                else:
                    keys = [kb for kb in self._index if kb.startswith(pb)]
        else:
            return 0, 0

        def mark_all() -> tuple[int, int]:
            count = freed = 0
            for kb in keys:
                if self._gone(kb, xxh3_64_intdigest(kb)):
                    count += 1
                    freed += self._entry(kb, xxh3_64_intdigest(kb))[1].length  # type: ignore[index]  # held: has one
            return count, freed

        return core.locked(mark_all)

    def _gone(self, kb: bytes, kh: int) -> bool:
        words = self.core.header_words
        if words[H_FILL_STATE] != FILL_RUNNING:
            self.ended = True  # the fill is over: nothing comes from the snapshot any more (Tiers drops it)
            return False
        if self._snap is None or words[H_FILL_GEN] != self._gen:  # blind: no position, so the hash bucket
            self.marks.mark_hash(kh)
            return False
        pos = self._held(kb, kh)
        at = self.position(kb, kh) if pos is None else pos
        if at is not None:
            self.marks.mark(at)
        return pos is not None

    def _load(self, gen: int) -> None:
        """The index of the snapshot the mark names, for fill generation `gen` (empty when it cannot be read)."""
        self._close()
        self._gen = gen
        if not self._indexed:
            return
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
            self.marks.close()

    def _close(self) -> None:
        snap, self._snap = self._snap, None
        self._index = {}
        if snap is not None:
            snap.close()


__all__ = ["SnapshotBelow"]
