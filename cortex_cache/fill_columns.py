"""A background fill's batches by columns, in C: the fill of a version 4 (or delta) manifest at memory speed.

fill.py says what a fill is and keeps every rule; this module does its
per-entry work for the common case -- a manifest whose columns are used in
place (manifest.Reader, snapdelta.Combined) and a pool with the C fast path
-- without an object per entry:

- **Reading** (ColumnReader, a thread of its own): a batch is a range of fill
  positions; its values are read with one pread per run of values that lie
  back to back (or nearly) in one pack -- a persist writes them in fill order,
  so a batch is usually one run -- into a reused buffer, and posix_fadvise
  keeps fill.READAHEAD bytes of the coming runs in flight.
- **Loading** (fill_batch): the same two lock holds and copy between them as
  fill.py's Python batch, each a call into _fastpath_fill.c over the batch's
  columns (numpy views of the manifest): `fill_reserve` (skip expired, gone or
  present; reserve, never evicting), `fill_copy` (checksum in the read buffer,
  pwrite into the reservation; no lock, no GIL), `fill_seal` (mark gone,
  seal with the snapshot's metadata or give back).  Where the C code stops at
  an entry it leaves to Python (no room: PoolFull ends the fill; a field it
  does not trust), that one entry takes core.py's path and C goes on after it.

Measured in docs/performance.md ("The fill by columns").
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import numpy as np
import xxhash

from . import basepos
from .errors import PoolFull, SnapshotCorrupt, StorageIOError, ValueTooLarge
from .gone import GoneMarks
from .layout import FILL_RUNNING, MAX_KEY_BYTES

if TYPE_CHECKING:
    from .core import Core

BATCH_ENTRIES = 2048  # a lock hold reserves or seals at most this many (~0.3-1 ms at 2 KiB values)
BATCH_BYTES = 8 << 20
READAHEAD = 64 << 20
RUN_GAP = 64 << 10  # values this close in one pack are read in one pread, the bytes between them too
UNREAD = np.uint64(0xFFFFFFFFFFFFFFFF)  # a value's buffer offset when its read failed
SKIP_EXPIRED, SKIP_PRESENT = -1, -2  # _fastpath_fill.c's slot codes


class Ended(Exception):
    """The fill was stopped by someone else (its generation changed)."""


class At(NamedTuple):
    """Where a batch is in the fill: its generation, the position of its first entry, the gone marks; and
    from which position on the snapshot's entries are those of the full manifest the fill makes the pool's
    base (basepos.py: a delta's base's come after its own), -1 none."""

    gen: int
    first: int
    marks: GoneMarks
    base_from: int = -1


def usable(core: "Core", snap: Any) -> bool:
    """Does this module fill `snap` into `core`'s pool (a columns manifest, the C fast path there)?"""
    return snap.v4 is not None and core.fast is not None and hasattr(snap.v4, "key_blob")


class Batch(NamedTuple):
    """Fill positions first .. first + n - 1, their values in `buf` at `src` (UNREAD: its read failed, the
    reason in `errors`)."""

    first: int
    n: int
    buf: Any
    src: np.ndarray
    errors: dict[int, SnapshotCorrupt]


def _runs(pack: np.ndarray, off: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Indexes where a new pread starts: another pack, an earlier offset, or a gap over RUN_GAP."""
    if len(off) == 0:
        return np.zeros(0, np.int64)
    end = off[:-1] + length[:-1]
    brk = (pack[1:] != pack[:-1]) | (off[1:] < end) | (off[1:] - np.minimum(off[1:], end) > RUN_GAP)
    return np.concatenate([[0], np.flatnonzero(brk) + 1])


class ReaderThread:
    """A thread reading a fill's batches ahead of the one loading them (fill.py's and this module's readers):
    batches come out in the fill's order through a queue of DEPTH; give each buffer back with `done`.  Its
    buffers are anonymous mappings (no zeroing pass: their pages come with the first pread into them), at
    most DEPTH + 2 (DEPTH queued, one loaded from, one read into).  A subclass sets what `_run` needs, then
    calls this __init__, which starts the thread."""

    DEPTH = 2

    def __init__(self, snap: Any) -> None:
        self.snap = snap
        self.fds: dict[int, int] = {}
        self.queue: queue.Queue = queue.Queue(self.DEPTH)
        self.free: queue.Queue = queue.Queue()  # buffers loaded from, to read into again
        self.made = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cortex-fill-reader", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def fd(self, pack: int) -> int:
        fd = self.fds.get(pack)
        if fd is None:
            fd = self.fds[pack] = self.snap.pack_fd(pack)
        return fd

    def batches(self) -> Iterator[Any]:
        while True:
            got = self.queue.get()
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            yield got

    def done(self, buf: Any) -> None:
        self.free.put(buf)

    def _buffer(self, nbytes: int) -> Any:
        if self.made < self.DEPTH + 2 and self.free.empty():
            self.made += 1
            return mmap.mmap(-1, max(nbytes, 1 << 20))
        buf = self.free.get()
        if len(buf) < nbytes:  # the old one goes with the last view of it
            buf = mmap.mmap(-1, nbytes)
        return buf

    def _put(self, what: Any) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(what, timeout=0.1)
                return
            except queue.Full:
                pass

    def _failed(self, e: BaseException) -> None:
        """An I/O error: the fill stops, resumable."""
        self._put(StorageIOError(f"reading snapshot {str(self.snap.path)!r}: {getattr(e, 'strerror', None) or e}"))

    def close(self) -> None:
        self.stopping.set()
        while self.thread.is_alive():  # unblock a put waiting for room, then let it see `stopping`
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self.thread.join()
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class ColumnReader(ReaderThread):
    """Reads the fill's batches from position `start` on, by runs of values (Batch).  The first batch is one
    entry (the most recent, there within milliseconds of the publish), each next twice the bytes of the
    last, up to BATCH_BYTES and BATCH_ENTRIES, never across a part of the manifest (a delta's and its
    base's positions: manifest.Reader.part_end)."""

    def __init__(self, snap: Any, start: int) -> None:
        self.v4 = snap.v4
        c = self.v4.cols
        self.pack, self.off, self.length = c["pack"], c["offset"], c["length"]
        self.n = self.v4.n
        self.start = start
        self.ahead = start  # positions before it have had their readahead asked for
        self.asked = 0
        super().__init__(snap)

    def _run(self) -> None:
        try:
            pos, limit = self.start, 1
            while pos < self.n and not self.stopping.is_set():
                stop = min(self.n, self.v4.part_end(pos), pos + BATCH_ENTRIES)
                sums = np.cumsum(self.length[pos:stop], dtype=np.uint64)
                count = min(stop - pos, int(np.searchsorted(sums, np.uint64(limit), "left")) + 1)
                limit = min(BATCH_BYTES, max(limit, 1 << 20) * 2)
                batch = self._read(pos, count)
                self._readahead(pos + count, int(sums[count - 1]))
                self._put(batch)
                pos += count
        except BaseException as e:
            self._failed(e)
            return
        self._put(None)

    def _read(self, a: int, n: int) -> Batch:
        pack, off, length = self.pack[a : a + n], self.off[a : a + n], self.length[a : a + n]
        starts = _runs(pack, off, length)
        ends = np.append(starts[1:], n)
        spans = [(int(s), int(e), int(off[s]), int((off[s:e] + length[s:e]).max())) for s, e in zip(starts, ends)]
        buf = self._buffer(sum(last - first for _s, _e, first, last in spans))
        mv = memoryview(buf)
        src = np.empty(n, np.uint64)
        errors: dict[int, SnapshotCorrupt] = {}
        at = 0
        for s, e, first, last in spans:
            p = int(pack[s])
            span = last - first
            src[s:e] = off[s:e] - np.uint64(first) + np.uint64(at)
            try:
                reader = self.snap.pack_reader(p)
                got = os.preadv(self.fd(p), [mv[at : at + span]], first) if span else 0
                if got != span:  # the file is cut short: what lies past its end was not read
                    for j in range(s, e):
                        if int(off[j]) + int(length[j]) > first + got:
                            src[j] = UNREAD
                            errors[j] = reader.corrupt(self.snap.path, f"the record at byte {int(off[j])} is cut short")
            except SnapshotCorrupt as err:
                src[s:e] = UNREAD
                errors.update((j, err) for j in range(s, e))
            at += span
        mv.release()
        return Batch(a, n, buf, src, errors)

    def _readahead(self, pos: int, consumed: int) -> None:
        """Ask for the runs from position `pos` on, up to READAHEAD bytes ahead of what was read."""
        self.asked = max(0, self.asked - consumed)
        self.ahead = max(self.ahead, pos)
        while self.ahead < self.n and self.asked < READAHEAD:
            b = min(self.n, self.ahead + 4096)
            sums = np.cumsum(self.length[self.ahead : b], dtype=np.uint64)  # no more than READAHEAD ahead
            b = self.ahead + min(b - self.ahead, int(np.searchsorted(sums, np.uint64(READAHEAD - self.asked))) + 1)
            pack, off, length = self.pack[self.ahead : b], self.off[self.ahead : b], self.length[self.ahead : b]
            starts = _runs(pack, off, length)
            for s, e in zip(starts, np.append(starts[1:], b - self.ahead)):
                first = int(off[s])
                span = int((off[s:e] + length[s:e]).max()) - first
                try:
                    os.posix_fadvise(self.fd(int(pack[s])), first, span, os.POSIX_FADV_WILLNEED)
                except (OSError, SnapshotCorrupt):
                    pass
            self.asked += int(length.sum())
            self.ahead = b


# ---------------------------------------------------------------- loading


class _Cols(NamedTuple):
    """A batch's columns (views of the manifest) and the key blob they index."""

    blob: memoryview
    key_off: np.ndarray
    key_len: np.ndarray
    flags: np.ndarray
    length: np.ndarray
    expiry: np.ndarray
    checksum: np.ndarray
    meta: tuple  # priority, created, last_access, expiry, insert_seq, access_seq, access_count

    def key(self, j: int) -> bytes:
        """Entry j's key; SnapshotCorrupt if its place is impossible (the C code stopped there for that)."""
        off, n = int(self.key_off[j]), int(self.key_len[j])
        if not 0 < n <= MAX_KEY_BYTES or off + n > len(self.blob):
            raise SnapshotCorrupt("a key of the snapshot's manifest lies outside its key blob")
        return bytes(self.blob[off : off + n])


def _columns(v4: Any, a: int, n: int) -> _Cols:
    c = {name: col[a : a + n] for name, col in v4.cols.items()}
    return _Cols(v4.key_blob(a), c["key_off"], c["key_len"], c["flags"], c["length"], c["expiry"], c["checksum"],
                 (c["priority"], c["created"], c["last_access"], c["expiry"], c["insert_seq"], c["access_seq"],
                  c["access_count"]))


def fill_batch(core: "Core", reader: ColumnReader, batch: Batch, at: At, report: dict) -> bool:
    """Load one batch; True if the pool had no free room left for one of its entries (the fill ends)."""
    cols = _columns(reader.v4, batch.first, batch.n)
    n = batch.n
    kh = np.zeros(n, np.uint64)
    slots = np.full(n, SKIP_PRESENT, np.int64)
    offs = np.zeros(n, np.uint64)
    processed, full = core.locked(_reserve, core, cols, at, core.clock(), kh, slots, offs)
    try:
        ok = _write(core, batch, cols, slots[:processed], offs[:processed])
    except BaseException:
        core.locked(_abort, core, slots[:processed])
        raise
    bad = np.flatnonzero((slots[:processed] >= 0) & (ok == 0))
    for j in bad.tolist():
        if report["corrupt_why"] is None:
            report["corrupt_why"] = str(batch.errors.get(j) or _value_corrupt(reader, batch.first + j))
    report["corrupt"] += len(bad)
    core.locked(_seal, core, cols, kh, slots, ok, processed, at, report, len(bad))
    return full


def _write(core: "Core", batch: Batch, cols: _Cols, slots: np.ndarray, offs: np.ndarray) -> np.ndarray:
    """No lock: check each reserved entry's value against its checksum and write it into its reservation
    (C, the GIL let go); 1 per entry written."""
    n = len(slots)
    ok = np.zeros(n, np.uint8)
    if n:
        core.fast.fill_copy(batch.buf, batch.src[:n], cols.length[:n], slots, offs, cols.checksum[:n], ok)
    return ok


def _value_corrupt(reader: ColumnReader, p: int) -> SnapshotCorrupt:
    pack, off = int(reader.pack[p]), int(reader.off[p])
    return reader.snap.pack_reader(pack).corrupt(reader.snap.path, f"the value of the record at byte {off} fails "
                                                                   "its checksum")


def _still_running(core: "Core", at: At) -> bool:
    h = core.header[0]
    return int(h["fill_gen"]) == at.gen and int(h["fill_state"]) == FILL_RUNNING


def _no_victim() -> None:
    return None


def _reserve(core: "Core", cols: _Cols, at: At, now: float, kh: np.ndarray, slots: np.ndarray,
             offs: np.ndarray) -> tuple[int, bool]:
    """Lock held: reserve the batch's entries (C), one at a time in Python where C stops.  (entries
    processed, no room left)."""
    if not _still_running(core, at):
        raise Ended
    n, j = len(slots), 0
    while j < n:
        j = core.fast.fill_reserve(cols.blob, cols.key_off, cols.key_len, cols.flags, cols.length, cols.expiry, j,
                                   at.first, now, kh, slots, offs)
        if j >= n:
            break
        key = cols.key(j)  # C stopped here: no room, a value larger than the pool, or a field it does not trust
        h = kh[j] = xxhash.xxh3_64_intdigest(key)
        if at.marks.gone(at.first + j, h) or core.find(key, h) >= 0:
            slots[j] = SKIP_PRESENT
            j += 1
            continue
        core.evict_one = _no_victim  # this instance's allocations find no victim: PoolFull instead
        try:
            length = int(cols.length[j])
            slots[j], offs[j] = core.reserve(key, h, int(cols.flags[j]) & 1, length,
                                             core.blocks_or_raise(length, "snapshot entry"))
        except (PoolFull, ValueTooLarge):
            return j, True
        finally:
            del core.evict_one
        j += 1
    return n, False


def _abort(core: "Core", slots: np.ndarray) -> None:
    for i in slots[slots >= 0].tolist():
        core.abort(i)


def _seal(core: "Core", cols: _Cols, kh: np.ndarray, slots: np.ndarray, ok: np.ndarray, processed: int, at: At,
          report: dict, bad: int) -> None:
    """Lock held: seal what was checked and written, give the rest back, mark each entry processed gone and
    advance the mark (C; one entry at a time in Python where C stops)."""
    h = core.header[0]
    if not _still_running(core, at):
        _abort(core, slots[:processed])
        raise Ended
    sealed = np.zeros(processed, np.uint8)
    counts = np.zeros(3, np.uint64)  # loaded, bytes, skipped as present while read
    meta = tuple(col[:processed] for col in cols.meta) + (cols.checksum[:processed], sealed)
    blob, koff, klen = cols.blob, cols.key_off[:processed], cols.key_len[:processed]
    j = 0
    while j < processed:
        j = core.fast.fill_seal(blob, koff, klen, kh[:processed], slots[:processed], ok, j, processed, at.first, meta,
                                counts)
        if j < processed:  # C stopped here (a chain it does not walk, a slot out of range): core.py's way
            counts += _seal_one(core, cols, int(kh[j]), int(slots[j]), bool(ok[j]), j, at, sealed)
            j += 1
    expired = int(np.count_nonzero(slots[:processed] == SKIP_EXPIRED))
    present = int(np.count_nonzero(slots[:processed] == SKIP_PRESENT)) + int(counts[2])
    loaded, nbytes = int(counts[0]), int(counts[1])
    _advance(h, processed, nbytes, expired + present, bad)
    report["entries"] += loaded
    report["bytes"] += nbytes
    report["expired_skipped"] += expired
    report["present_skipped"] += present
    if at.base_from >= 0:  # where each entry sealed is in the base: the next persist may write a delta
        loaded = np.flatnonzero(sealed) + at.first
        loaded = loaded[loaded >= at.base_from]
        basepos.set_positions(core, slots[loaded - at.first], loaded - at.base_from)
    expiring = (sealed == 1) & (cols.expiry[:processed] > 0)
    if expiring.any():
        report["expiring"].extend(zip(cols.expiry[:processed][expiring].tolist(),
                                      cols.length[:processed][expiring].tolist()))


def _advance(h: Any, processed: int, nbytes: int, skipped: int, bad: int) -> None:
    """Lock held, in the hold that sealed: the fill's mark moves past the batch."""
    h["fill_done"] = int(h["fill_done"]) + processed
    h["fill_bytes"] = int(h["fill_bytes"]) + nbytes
    h["fill_skipped"] = int(h["fill_skipped"]) + skipped
    h["fill_corrupt"] = int(h["fill_corrupt"]) + bad


def _seal_one(core: "Core", cols: _Cols, kh: int, i: int, ok: bool, j: int, at: At, sealed: np.ndarray) -> np.ndarray:
    """fill._seal_batch's step for entry j (lock held): what it adds to the counts."""
    pos = at.first + j
    gone = at.marks.gone(pos, kh)
    at.marks.mark(pos)  # before memory changes: a filler killed from here on never loads it again
    if not ok or not core.is_writing(i):
        core.abort(i)
        return np.zeros(3, np.uint64)
    key = cols.key(j)
    if gone or core.find(key, kh) >= 0:
        core.abort(i)
        return np.array([0, 0, 1], np.uint64)
    prio, created, last_access, expiry, iseq, aseq, count = (int(c[j]) if c.dtype.kind in "iu" else float(c[j])
                                                             for c in cols.meta)
    core.seal(i, key, kh, int(cols.checksum[j]), None, prio, False)
    core.restore_meta(i, created, last_access, expiry, iseq, aseq, count)
    sealed[j] = 1
    return np.array([1, int(cols.length[j]), 0], np.uint64)


__all__ = ["Ended", "At", "Batch", "ReaderThread", "ColumnReader", "usable", "fill_batch", "BATCH_ENTRIES", "BATCH_BYTES",
           "READAHEAD"]
