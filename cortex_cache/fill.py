"""The background fill: a restored pool serves at once, and its values come in afterwards.

restore.py publishes a pool that is gone, restored from an incremental
snapshot (the snapshot directory's, version 4 or 3: what the boot line restores),
as soon as its configuration is in place (an empty pool with the snapshot's
size, policy, tiers and counters) and a fill mark in its header (the fill_*
fields, layout.py); this module then loads the snapshot's values into it
while every process may use it.  A self-contained file (persist --output)
is still verified whole before its pool appears (restore.py).

- **Order**: most recently used first (the snapshot's access sequence
  numbers, newest first), in bands of BAND_BYTES inside which values are read
  in file order: the entries engines want come back first, and the disk
  still reads long runs.  A version 4 manifest is written in that order
  (persist computed it: manifest.py), and its columns are read a chunk at a
  time as the fill reaches them, once the fill has checked the sections'
  checksums (in the background: the pool was published before); a version 3
  manifest is read whole and sorted here first.
- **Batches**: one lock hold reserves room for a batch (never by evicting: an
  entry that finds no free room ends the fill, since what is left is older
  than everything the pool holds), the values are read and checked against
  their checksums without the lock, and one lock hold seals them, marks them
  gone and advances the mark.  An entry the pool already holds (put
  meanwhile) or that is gone (gone.py: put, deleted or read early since the
  publish, by any process) is skipped, and so is one put or deleted while its
  value was being read: the newer value, or none, stays.  A
  value that fails its checksum is not loaded; it is counted (fill_corrupt)
  and the fill goes on.  The first batch is one entry, so the most recent
  entry is there within milliseconds of the publish.
- **By columns, in C** (fill_columns.py): a version 4 or 5 manifest filled by
  a handle with the C fast path (every restore but a test's with its own
  clock, or CORTEX_CACHE_PURE_PYTHON=1) does the three steps of each batch
  in C over the manifest's columns, with every rule here; the Item batches
  below are for version 3 manifests and handles without the fast path.
- **A pipeline on three threads**: one reads the coming batches' records with
  pread into reused buffers (posix_fadvise WILLNEED keeping READAHEAD bytes
  of them in flight, so the disk never waits), the filling thread checks each
  value there and writes it into its reservation with pwrite (no page fault
  per 4 KiB, as a copy into the mapping takes), and for a pool that reserves
  its memory a third one posix_fallocates the data region ahead of the
  copies for the part of the pool the fill does not write (the fill's pwrites
  allocate their own pages), so the publish does not wait for seconds of
  posix_fallocate either.
- **Crashes**: the mark is advanced in the lock hold that seals, so a filler
  killed at any point leaves its loaded entries and a mark from which the
  next `restore --if-missing` (or `restore NAME`) goes on, skipping what is
  gone; the killed one's reservations are taken back as any dead writer's
  are.

A get of an entry not loaded yet does not wait for it: the snapshot is a
read-only tier below memory meanwhile (snaptier.py), which serves the
entries the fill has not come to yet and that are not gone (the mark's
fill_done and the gone marks, by position in the order `manifest_items`
gives every process alike).  Persist refuses
while the fill runs or was interrupted (a snapshot of half the pool would
retire the whole one); `evict --all` and `restore --replace` stop it.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Protocol

import numpy as np
import xxhash

from . import basepos, fill_columns, manifest, packs, policy_state
from .errors import CortexCacheError, PoolFull, SnapshotCorrupt, ValueTooLarge
from .gone import GoneMarks
from .layout import (
    FILL_DONE,
    FILL_FAILED,
    FILL_NONE,
    FILL_PATH_BYTES,
    FILL_PRIVATE,
    FILL_RUNNING,
    FILL_STOPPED,
    FLAG_RESERVED,
    SLOT_FLAG_STR_KEY,
)
from .lock import RecordLock

if TYPE_CHECKING:
    from .core import Core


class Source(Protocol):
    """What a fill reads of a snapshot (snapfile.Snapshot is one).  Named here, not imported: snapfile.py is
    above this module (a persist asks it whether a fill runs)."""

    path: Any
    entries: int
    positions: int  # of the fill's order: entries, and a delta's dropped base positions (snapdelta.py)
    value_bytes: int
    file_check: int
    header: Any
    v4: Any  # a version 4 manifest's columns (manifest.py), None for older versions

    def close(self) -> None: ...
    def verify_manifest(self) -> None: ...
    def references(self, verify: bool = ...) -> Iterator[Any]: ...
    def check_whole(self) -> None: ...
    def pack_fd(self, pack: Any) -> int: ...
    def pack_reader(self, pack: Any) -> Any: ...


FILL_BYTE = 3  # held by the process filling the pool, for as long as it fills (lock.py's bytes)
BAND_BYTES = manifest.BAND_BYTES
READAHEAD = 64 << 20
BATCH_ENTRIES = 64
BATCH_BYTES = 8 << 20
PREPARE_STEP = 32 << 20
FILL_STATES = {FILL_NONE: None, FILL_RUNNING: "filling", FILL_DONE: "done", FILL_STOPPED: "stopped",
               FILL_FAILED: "failed"}


class Item(NamedTuple):
    """One snapshot entry to load: its key and metadata, and where its value is."""

    key: bytes
    flags: int
    length: int
    checksum: int
    priority: int
    meta: tuple  # created, last_access, expiry, insert_seq, access_seq, access_count
    where: Any  # (pack index, record offset) in a manifest's packs, or the value's view in a file


# ---------------------------------------------------------------- the mark


def mark(core: "Core", snap: "Source", private: bool) -> None:
    """Put a new fill's mark into a pool not published yet (restore.py; no lock needed: nobody else sees it)."""
    path = str(Path(snap.path).resolve()).encode()
    h = core.header[0]
    h["fill_gen"] = (int(h["fill_gen"]) + 1) & 0xFFFFFFFF
    h["fill_done"] = h["fill_bytes"] = h["fill_corrupt"] = h["fill_skipped"] = 0
    h["fill_total"] = snap.positions
    h["fill_bytes_total"] = snap.value_bytes
    h["fill_check"] = snap.file_check
    h["fill_started"] = time.time()
    h["fill_ended"] = 0.0
    h["fill_path"] = path
    h["fill_flags"] = FILL_PRIVATE if private else 0
    marks = GoneMarks(core)
    marks.clear()  # nothing is gone from the new fill's snapshot yet
    dropped = getattr(snap.v4, "dropped_mask", None)
    if dropped is not None:  # but a delta's dropped base positions never were in it (snapdelta.py)
        marks.mark_all(np.flatnonzero(dropped()))
    marks.close()
    basepos.clear(core)  # the fill seals entries with the snapshot's insert_seqs: no base until its end (_base)
    h["fill_state"] = FILL_RUNNING


def fits_mark(snap_path: str | os.PathLike) -> bool:
    """Can the mark name this snapshot (its absolute path fits the header field)?"""
    return len(str(Path(snap_path).resolve()).encode()) < FILL_PATH_BYTES


def state(core: "Core") -> dict[str, Any] | None:
    """The fill as `status` shows it (lock held or not: a few words read once), None for a pool never
    filled from a snapshot.  "running" says whether a filler holds it now (else it was interrupted)."""
    h = core.header[0]
    st = int(h["fill_state"])
    if st == FILL_NONE or st not in FILL_STATES:
        return None
    out = {
        "state": FILL_STATES[st],
        "snapshot": bytes(h["fill_path"]).rstrip(b"\0").decode(errors="replace"),
        "entries_done": int(h["fill_done"]),
        "entries_total": int(h["fill_total"]),
        "bytes_loaded": int(h["fill_bytes"]),
        "bytes_total": int(h["fill_bytes_total"]),
        "corrupt": int(h["fill_corrupt"]),
        "skipped": int(h["fill_skipped"]),
        "started": float(h["fill_started"]),
        "ended": float(h["fill_ended"]) or None,
        "running": False,
    }
    if st == FILL_RUNNING:
        out["running"] = filler_alive(core)
        if not out["running"]:
            out["state"] = "interrupted"
    return out


def filler_alive(core: "Core") -> bool:
    """Does a process hold the pool's fill lock (is a fill running right now)?"""
    probe = RecordLock(core.seg.fd, FILL_BYTE)
    if probe.try_acquire():
        probe.release()
        return False
    return True


def running(core: "Core") -> bool:
    """Is a fill running or interrupted (the mark says FILL_RUNNING)?"""
    return int(core.header[0]["fill_state"]) == FILL_RUNNING


def stop(core: "Core") -> None:
    """End a running or interrupted fill here (lock held): its filler stops at its next batch, and the
    entries loaded so far stay.  For `evict --all` and restore --replace."""
    h = core.header[0]
    if int(h["fill_state"]) == FILL_RUNNING:
        h["fill_gen"] = (int(h["fill_gen"]) + 1) & 0xFFFFFFFF
        h["fill_state"] = FILL_STOPPED
        h["fill_ended"] = time.time()


def follow(core: "Core", opener: Callable[[str], "Source"]) -> tuple["Source | None", str | None]:
    """(the snapshot the pool's fill mark names, None), if this process would trust that snapshot as its own;
    else (None, why not).  The one place a process decides to follow a mark.

    The mark lives in the segment's header: whoever may write the pool (a
    member of a 0660 pool's group) may write it, and every process that
    opens the pool reads it.  So it is followed only to a manifest of this
    user or root, named as persist names them, opened without following a
    symlink, in a directory nobody else may write (`opener`: snapshot.py's
    `followed`, which this module, below it, is handed); of the pool's own
    geometry (what it indexes is then bounded by what the pool can hold);
    and with the entries, value bytes and file checksum the mark says.
    Nothing here waits: a FIFO or device is refused before it is read.
    Whatever was read from the header is read once, into locals.
    """
    h = core.header[0]
    if int(h["fill_state"]) != FILL_RUNNING:
        return None, "no fill runs"
    raw = bytes(h["fill_path"]).split(b"\0", 1)[0]
    check, total, nbytes = int(h["fill_check"]), int(h["fill_total"]), int(h["fill_bytes_total"])
    no = "the fill mark's snapshot is not followed: "
    try:
        path = raw.decode()
    except UnicodeDecodeError:
        return None, no + "its path is not text"
    if not (path.startswith("/") and os.path.normpath(path) == path and path.isprintable()):
        return None, no + "its path is not an absolute path of printable characters"
    try:
        snap = opener(path)
    except (CortexCacheError, OSError) as e:
        return None, no + (str(e) if isinstance(e, CortexCacheError) else f"{path!r}: {e.strerror or e}")
    g, sh = core.geometry, snap.header
    why = None
    if sh.version not in (3, 4, 5):
        why = "it is not an incremental snapshot"
    elif sh.version == 5 and not core.geometry.gone_off:
        why = "it is a delta manifest, and the pool keeps no gone marks to skip its dropped entries"
    elif (sh.size, sh.block_size, sh.max_entries) != (g.data_size, g.block_size, g.n_slots) or \
            snap.positions > (g.gone_len if g.gone_off else g.n_slots):
        why = "it is a snapshot of a pool of another size or shape"
    elif (snap.file_check, snap.positions, snap.value_bytes) != (check, total, nbytes):
        why = "it is not the snapshot the fill began from (its checksum, entries or bytes differ from the mark's)"
    if why is not None:
        snap.close()
        return None, f"{no}{path!r}: {why}"
    return snap, None


def busy_reason(core: "Core", opener: Callable[[str], "Source"]) -> str | None:
    """Why a persist of this pool must wait for its fill (None: no fill in the way).  A fill whose mark this
    process would not follow (`follow`, `opener` its opener) is none of its business: it never holds it up."""
    if not running(core):
        return None
    snap, _why = follow(core, opener)
    if snap is None:
        return None
    snap.close()
    st = state(core)
    assert st is not None
    pct = 100.0 * st["bytes_loaded"] / st["bytes_total"] if st["bytes_total"] else 100.0
    if st["running"]:
        return (f"pool {core.name!r} is still being filled from snapshot {st['snapshot']!r} ({pct:.0f}% loaded); "
                "persist it when the fill is done (status shows it)")
    return (f"pool {core.name!r} was being filled from snapshot {st['snapshot']!r} and its restore was stopped "
            f"at {pct:.0f}%; finish it with `cortex cache restore {core.name} --if-missing` first (or empty the "
            "pool with `evict --all` to give the fill up)")


# ---------------------------------------------------------------- the order


class Positions:
    """A version 4 manifest's entries in fill order (its columns' order), as Items made a chunk at a time as
    the fill comes to them: a sequence from position `start` on."""

    CHUNK = 4096
    KEEP = 64  # chunks kept made: enough for READAHEAD bytes of 2 KiB values between the two cursors

    def __init__(self, snap: "Source", start: int = 0) -> None:
        assert snap.v4 is not None
        self.snap, self.v4, self.start = snap, snap.v4, start
        self._chunks: dict[int, list[Item]] = {}  # made chunks, by first position: the read cursor and the
        # readahead's (64 MiB further on) each keep theirs

    def __len__(self) -> int:
        return max(0, self.v4.n - self.start)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            if k.step not in (None, 1) or k.stop is not None:
                raise ValueError("Positions: only [start:] slices")
            return Positions(self.snap, self.start + (k.start or 0))
        if not 0 <= k < len(self):
            raise IndexError(k)
        p = self.start + k
        at = p - p % self.CHUNK
        items = self._chunks.get(at)
        if items is None:
            if len(self._chunks) >= self.KEEP:
                del self._chunks[min(self._chunks)]  # both cursors only move forward
            items = self._chunks[at] = self._make(at, min(self.v4.n, at + self.CHUNK))
        return items[p - at]

    def __iter__(self) -> Iterator[Item]:
        for k in range(len(self)):
            yield self[k]

    def _make(self, a: int, b: int) -> list[Item]:
        c = {name: col[a:b].tolist() for name, col in self.v4.cols.items()}
        keys = self.v4.keys(a, b)
        return [Item(k, f, n, ck, pr, (cr, la, ex, iseq, aseq, cnt), (pk, off))
                for k, f, n, ck, pr, cr, la, ex, iseq, aseq, cnt, pk, off in zip(
                    keys, c["flags"], c["length"], c["checksum"], c["priority"], c["created"], c["last_access"],
                    c["expiry"], c["insert_seq"], c["access_seq"], c["access_count"], c["pack"], c["offset"])]

    def blocks_bytes(self, block: int) -> int:
        """The pool memory (whole blocks of `block` bytes) the values from `start` on take."""
        lengths = self.v4.cols["length"][self.start :]
        return int(((lengths + np.uint64(block - 1)) // np.uint64(block)).sum()) * block if len(lengths) else 0


def manifest_items(snap: "Source") -> "list[Item] | Positions":
    """A snapshot's entries in fill order: most recently used first, by bands of BAND_BYTES read in pack and
    offset order.  Version 4 is stored in that order: its sections are checked against their checksums
    (and its keys and packs against the blob and the table) and its columns used in place (Positions).
    Version 3: every record is checked against its own checksum, and sorted here -- a function of the
    manifest alone, so that the snapshot tier of every process attached (snaptier.py) computes the same
    order, and reads the fill's progress (fill_done) against it."""
    if snap.v4 is not None:
        snap.verify_manifest()
        snap.check_whole()  # read through a mapping: zeros from a file cut short are never used
        return Positions(snap)
    # No more records than the trailer counts: what a process indexes is bounded by what the file says
    # (and `follow` bounds that by what the pool can hold).
    refs = [(ref, off) for ref, _pack, off in itertools.islice(snap.references(verify=True), snap.entries + 1)]
    if len(refs) != snap.entries:
        raise SnapshotCorrupt(f"snapshot {str(snap.path)!r} is damaged: its trailer says {snap.entries} entries, "
                              f"it holds {'more' if len(refs) > snap.entries else len(refs)}")
    snap.check_whole()  # read through a mapping: zeros from a file cut short are never indexed
    if not refs:
        return []
    aseq = np.fromiter((r.access_seq for r, _ in refs), np.uint64, len(refs))
    lengths = np.fromiter((r.length for r, _ in refs), np.int64, len(refs))
    pack = np.fromiter((r.pack for r, _ in refs), np.int64, len(refs))
    offs = np.fromiter((o for _, o in refs), np.int64, len(refs))
    mru = np.argsort(-aseq.astype(np.float64), kind="stable")  # newest first
    band = np.empty(len(refs), np.int64)
    band[mru] = np.cumsum(lengths[mru]) // BAND_BYTES
    band[mru[0]] = -1  # the most recent entry alone first: the first hit should not wait for a band
    order = np.lexsort((offs, pack, band))
    out = []
    for n in order.tolist():
        r, off = refs[n]
        out.append(Item(r.key, r.flags, r.length, r.checksum, r.priority,
                        (r.created, r.last_access, r.expiry, r.insert_seq, r.access_seq, r.access_count),
                        (r.pack, off)))
    return out


# ---------------------------------------------------------------- reading


class _Reader(fill_columns.ReaderThread):
    """Reads the fill's batches of Items (version 3, or a handle without the C fast path) on a thread of its
    own, ahead of the one that copies them into the pool (fill_columns.ReaderThread).

    Each batch is (items, values, buffer): every value a view of a reused
    buffer holding its record, whose head was checked against the manifest,
    or the SnapshotCorrupt that says why it could not be used.  The first
    batch is one entry; each next one twice the bytes of the last, up to
    BATCH_BYTES.  posix_fadvise WILLNEED keeps READAHEAD bytes of the coming
    records in flight, so the disk never waits for the copy; the preads let
    the GIL go.
    """

    def __init__(self, snap: "Source", items: "list[Item] | Positions") -> None:
        self.items = items
        self.raw = snap.v4 is not None  # version 4: a value's offset is the value's own, no record head
        self.ahead = 0  # items[:ahead] have had their readahead asked for
        self.asked = 0  # bytes asked for ahead of the read cursor
        super().__init__(snap)

    def _run(self) -> None:
        try:
            pos, limit, items = 0, 1, self.items
            while pos < len(items) and not self.stopping.is_set():
                batch: list[Item] = []
                nbytes = 0
                while pos < len(items) and len(batch) < BATCH_ENTRIES and nbytes < limit:
                    it = items[pos]
                    batch.append(it)
                    nbytes += self._span(it)
                    pos += 1
                limit = min(BATCH_BYTES, max(limit, 1 << 20) * 2)
                buf = self._buffer(nbytes)
                self._readahead(pos, nbytes)
                values = self._read(batch, buf)
                self._put((batch, values, buf))
        except BaseException as e:
            self._failed(e)
            return
        self._put(None)

    def _span(self, it: Item) -> int:
        """The bytes read for `it`: its value (version 4), or its record (head, key, value)."""
        return it.length if self.raw else packs.REC_SIZE + len(it.key) + it.length

    def _readahead(self, pos: int, consumed: int) -> None:
        """Ask for the records from items[pos] on, up to READAHEAD bytes ahead of what was read."""
        items = self.items
        self.asked -= consumed
        self.ahead = max(self.ahead, pos)
        while self.ahead < len(items) and self.asked < READAHEAD:
            it = items[self.ahead]
            pack, off = it.where
            n = self._span(it)
            try:
                os.posix_fadvise(self.fd(pack), off, n, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            self.ahead += 1
            self.asked += n

    def _read(self, batch: list[Item], buf: Any) -> list[Any]:
        out: list[Any] = []
        mv = memoryview(buf)
        at = 0
        for it in batch:
            pack, off = it.where
            klen = len(it.key)
            n = self._span(it)
            view = mv[at : at + n]
            at += n
            try:
                reader = self.snap.pack_reader(pack)
                got = os.preadv(self.fd(pack), [view], off) if n else 0
                if got != n:
                    raise reader.corrupt(self.snap.path, f"the record at byte {off} is cut short")
                if not self.raw:
                    reader.check_head(view, off, it.key, it.length, it.checksum, self.snap.path)
            except SnapshotCorrupt as e:
                out.append(e)
                continue
            out.append(view if self.raw else view[packs.REC_SIZE + klen :])
        return out

    def value_corrupt(self, it: Item) -> SnapshotCorrupt:
        pack, off = it.where
        return self.snap.pack_reader(pack).corrupt(self.snap.path, f"the value of the record at byte {off} fails "
                                                                   "its checksum")



# ---------------------------------------------------------------- the fill


_Ended = fill_columns.Ended  # the fill was stopped by someone else (its generation changed)

def run(core: "Core", snap: "Source", progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Fill `core`'s pool from `snap` as its mark says, from where the mark says the fill got to.

    The caller holds FILL_BYTE and checked that the mark names `snap`.
    Returns the report restore gives: entries loaded, bytes, skipped,
    corrupt (and the first damaged file's message), and how it ended
    ("done", "stopped": the pool filled up with newer entries or was emptied).
    Raises StorageIOError if the snapshot cannot be read (the mark stays:
    the fill can be resumed), after taking back its own reservations.
    """
    h = core.header[0]
    core.locked(core.reap_dead)  # a killed filler's reservations: their room is this fill's
    gen = int(h["fill_gen"])
    start = int(h["fill_done"])
    items = manifest_items(snap)
    block = core.geometry.block_size
    rest = items[start:]
    extent = rest.blocks_bytes(block) if isinstance(rest, Positions) else sum(-(-it.length // block) for it in rest) * block
    prepare = _Prepare(core, extent)
    report = {"entries": 0, "bytes": 0, "expired_skipped": 0, "present_skipped": 0, "corrupt": 0,
              "corrupt_why": None, "ended": "done", "expiring": []}
    # The policy's state (policy_state.py), laid over the entries in the lock hold that ends the fill; read
    # now (its section's checksum checked), copied out of the manifest's mapping.  Older formats: none.
    blob = snap.section("policy") if snap.v4 is not None else None
    policy = bytes(blob) if blob else None
    # By columns in C where it can (fill_columns.py), else an Item at a time here.
    reader: "_Reader | fill_columns.ColumnReader"
    base: tuple[bytes, int, int, int] | None = None
    if fill_columns.usable(core, snap):
        reader, step = fill_columns.ColumnReader(snap, start), _fill_columns
        base = _base(core, snap)
    else:
        reader, step = _Reader(snap, rest), _fill_items
    marks = GoneMarks(core)
    pos = start  # the fill position of each batch's first entry: the batches come in the fill's order
    try:
        for got in reader.batches():
            full, n = step(core, reader, got, _Batch(gen, pos, marks, base[3] if base else -1), report)
            pos += n
            if progress is not None:
                progress(int(h["fill_bytes"]), int(h["fill_bytes_total"]))
            if full or os.fstat(core.seg.fd).st_nlink == 0:  # no room left, or the pool was deleted
                report["ended"] = "stopped"
                break
        prepare.finish()
        if base is not None:  # the positions set as it sealed are the base's now (persists still refused)
            core.locked(basepos.name, core, *base[:3])
        # The blob parsed and matched to the slots before the hold (apply checks the match there).
        ready = policy_state.prepare(core, policy) if policy else None
        report["policy_state"] = core.locked(_finish, core, gen, FILL_DONE if report["ended"] == "done" else FILL_STOPPED,
                                             policy, ready)
    except _Ended:
        report["ended"] = "stopped"
        prepare.finish()
    finally:
        reader.close()
        prepare.stop()  # interrupted: the next fill of the pool reserves the rest
        marks.close()
    report["reserve_failed"] = prepare.failed
    # A delta's dropped base positions were marked gone before the publish (`mark`): the fill passed them as
    # gone, but nothing happened to them meanwhile -- they were never part of the snapshot.  Not "skipped".
    dropped = getattr(snap.v4, "dropped_mask", None) if snap.v4 is not None else None
    if dropped is not None:
        passed = int(np.count_nonzero(dropped()[start : int(h["fill_done"])]))
        report["present_skipped"] = max(0, report["present_skipped"] - passed)
    # An entry whose TTL ran out while the fill ran is gone anyway: counted as expired, not as restored.
    end = core.clock()
    ran_out = [n for expiry, n in report.pop("expiring") if expiry <= end]
    report["entries"] -= len(ran_out)
    report["bytes"] -= sum(ran_out)
    report["expired_skipped"] += len(ran_out)
    return report


def _base(core: "Core", snap: "Source") -> tuple[bytes, int, int, int] | None:
    """(ident, entries, seq, first position) of the full manifest a fill by columns makes the pool's base
    (basepos.py), as a persist does after writing one, so that the pool's first persist can be a delta: the
    manifest filled from, or a delta's base (whose positions follow the delta's own); None if it has no
    ident or the pool no base positions.  A fill resumed by a process filling in Python sets no positions
    for its part: those entries count as changed, never wrongly as kept."""
    counters = snap.header.counters
    if not counters or not basepos.present(core) or snap.v4 is None:
        return None
    base = getattr(snap.v4, "base", snap.v4)
    view = base.section("ident")
    if view is None:
        return None
    ident = bytes(view)
    view.release()  # a view of the manifest's mapping: it must not outlive the snapshot's close
    if len(ident) != basepos.IDENT_BYTES or ident == bytes(basepos.IDENT_BYTES):
        return None
    return ident, base.n, int(counters["seq"]), getattr(snap.v4, "nd", 0)


_Batch = fill_columns.At  # where a batch is in the fill: its generation, first position, the gone marks

def _fill_items(core: "Core", reader: Any, got: Any, at: _Batch, report: dict) -> tuple[bool, int]:
    """One batch of Items (_Reader): (no room left, entries in it)."""
    batch, values, buf = got
    full = _fill_batch(core, reader, batch, values, at, report)
    reader.done(buf)
    return full, len(batch)


def _fill_columns(core: "Core", reader: Any, got: Any, at: _Batch, report: dict) -> tuple[bool, int]:
    """One batch by columns (fill_columns.py): (no room left, entries in it)."""
    full = fill_columns.fill_batch(core, reader, got, at, report)
    reader.done(got.buf)
    return full, got.n


def _fill_batch(core: "Core", reader: _Reader, batch: list[Item], values: list[Any], at: _Batch,
                report: dict) -> bool:
    """Load one batch read by `reader`; True if the pool had no free room left for one of its entries (the
    fill ends).  Each value is checked in its buffer, then written into its reservation, invisible until
    sealed."""
    now = core.clock()
    slots, full = core.locked(_reserve_batch, core, batch, at, now)
    checks: list[int | None] = [None] * len(batch)
    bad = 0
    fd, xxh3 = core.seg.fd, xxhash.xxh3_64_intdigest
    try:
        for n, (it, where, value) in enumerate(zip(batch, slots, values)):
            if where is None or where is _EXPIRED or where is _PRESENT:
                continue
            _i, off = where
            try:
                if isinstance(value, SnapshotCorrupt):
                    raise value
                if xxh3(value) != it.checksum:
                    raise reader.value_corrupt(it)
            except SnapshotCorrupt as e:
                report["corrupt"] += 1
                bad += 1
                report["corrupt_why"] = report["corrupt_why"] or str(e)
                continue
            _store(fd, value, off)
            checks[n] = it.checksum
    except BaseException:
        core.locked(_abort_batch, core, slots)
        raise
    core.locked(_seal_batch, core, batch, slots, checks, at, report, bad)
    return full


def _store(fd: int, value: memoryview, off: int) -> None:
    """Write a checked value into its reservation through the segment's descriptor: no page fault per
    4 KiB, as a copy into the mapping takes."""
    done, total = 0, len(value)
    while done < total:
        done += os.pwrite(fd, value[done:], off + done)


_EXPIRED = object()
_PRESENT = object()


def _no_victim() -> None:
    return None


def _reserve_batch(core: "Core", batch: list[Item], at: _Batch, now: float) -> tuple[list[Any], bool]:
    """Reserve room for the batch's entries (lock held), never evicting.  Per entry (slot, offset),
    _EXPIRED, _PRESENT (held by memory, or gone: put, deleted or promoted since the publish), or None past
    the first that found no room; and whether one did not."""
    h = core.header[0]
    if int(h["fill_gen"]) != at.gen or int(h["fill_state"]) != FILL_RUNNING:
        raise _Ended
    out: list[Any] = []
    full = False
    core.evict_one = _no_victim  # this instance's allocations find no victim: PoolFull instead
    try:
        for n, it in enumerate(batch):
            if full:
                out.append(None)
                continue
            expiry = it.meta[2]
            if 0 < expiry <= now:
                out.append(_EXPIRED)
                continue
            kh = xxhash.xxh3_64_intdigest(it.key)
            if at.marks.gone(at.first + n, kh) or core.find(it.key, kh) >= 0:
                out.append(_PRESENT)
                continue
            try:
                nblk = core.blocks_or_raise(it.length, "snapshot entry")
                out.append(core.reserve(it.key, kh, it.flags & SLOT_FLAG_STR_KEY, it.length, nblk))
            except (PoolFull, ValueTooLarge):  # no free room (a damaged segment's error goes up)
                full = True
                out.append(None)
    finally:
        del core.evict_one
    return out, full


def _abort_batch(core: "Core", slots: list[Any]) -> None:
    for where in slots:
        if isinstance(where, tuple):
            core.abort(where[0])


def _seal_batch(core: "Core", batch: list[Item], slots: list[Any], checks: list[int | None], at: _Batch,
                report: dict, bad: int) -> None:
    """Seal what was read and checked, give the rest back, mark each entry processed gone and advance the
    mark (lock held)."""
    h = core.header[0]
    if int(h["fill_gen"]) != at.gen or int(h["fill_state"]) != FILL_RUNNING:
        _abort_batch(core, slots)
        raise _Ended
    loaded = nbytes = skipped = 0
    processed = 0
    for n, (it, where, checksum) in enumerate(zip(batch, slots, checks)):
        if where is None:
            break  # no room from here on: these entries are not processed
        processed += 1
        if where is _EXPIRED or where is _PRESENT:
            at.marks.mark(at.first + n)
            skipped += 1
            report["expired_skipped" if where is _EXPIRED else "present_skipped"] += 1
            continue
        i = where[0]
        kh = xxhash.xxh3_64_intdigest(it.key)
        gone = at.marks.gone(at.first + n, kh)
        at.marks.mark(at.first + n)  # before memory changes: a filler killed from here on never loads it again
        if checksum is None or not core.is_writing(i):
            core.abort(i)
            continue
        if gone or core.find(it.key, kh) >= 0:
            core.abort(i)  # put, deleted or read early while we read: the snapshot's copy is not the answer
            skipped += 1
            report["present_skipped"] += 1
            continue
        core.seal(i, it.key, kh, checksum, None, it.priority, False)
        core.restore_meta(i, *it.meta)
        if it.meta[2]:
            report["expiring"].append((it.meta[2], it.length))
        loaded += 1
        nbytes += it.length
    h["fill_done"] = int(h["fill_done"]) + processed
    h["fill_bytes"] = int(h["fill_bytes"]) + nbytes
    h["fill_skipped"] = int(h["fill_skipped"]) + skipped
    h["fill_corrupt"] = int(h["fill_corrupt"]) + bad
    report["entries"] += loaded
    report["bytes"] += nbytes


def _finish(core: "Core", gen: int, end: int, policy: bytes | None = None,
            ready: "policy_state.Prepared | None" = None) -> dict[str, Any] | None:
    """Lock held: end the fill; lay the snapshot's policy state (if it has one; `ready`: its prepare) over
    what the fill loaded, in the same hold, so that no put sees the entries without it.  Returns
    policy_state.apply's report."""
    h = core.header[0]
    if int(h["fill_gen"]) != gen or int(h["fill_state"]) != FILL_RUNNING:
        raise _Ended
    applied = policy_state.apply(core, policy, ready) if policy else None
    h["fill_state"] = end
    h["fill_ended"] = time.time()
    return applied


class _Prepare:
    """Reserves the memory of a pool that reserves it beyond what the fill writes (posix_fallocate,
    PREPARE_STEP at a time, on a thread of its own beside the copies).  The fill's own pages are
    allocated by its pwrites, which zero nothing they fill: fallocating them first would zero them,
    and serialise with the pwrites on the file's lock, for nothing (measured: 8-9 s of a 8 GiB fill's
    13-19 s here, against 4-5 s).  Allocations of an empty pool go from the start of the data region,
    so the fill writes about its first `extent` bytes."""

    def __init__(self, core: "Core", extent: int) -> None:
        self.core = core
        self.fd = core.seg.fd
        self.reserve = bool(int(core.header[0]["flags"]) & FLAG_RESERVED)
        self.end = core.geometry.data_off + core.geometry.data_size
        self.start = min(self.end, core.geometry.data_off + extent)
        self.failed: str | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cortex-fill-prepare", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cursor = self.start
        while cursor < self.end and self.reserve and not self.stopping.is_set():
            n = min(PREPARE_STEP, self.end - cursor)
            try:
                os.posix_fallocate(self.fd, cursor, n)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    self.failed = e.strerror or str(e)
                return
            cursor += n

    def finish(self) -> None:
        """Wait for it (the fill is done); say the truth in the header if the memory could not all be had."""
        self.thread.join()
        if self.failed:
            self.core.locked(_unreserved, self.core)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def _unreserved(core: "Core") -> None:
    h = core.header[0]
    h["flags"] = int(h["flags"]) & ~FLAG_RESERVED


__all__ = ["FILL_BYTE", "Item", "Positions", "mark", "fits_mark", "state", "filler_alive", "running", "stop", "follow", "busy_reason",
           "manifest_items", "run"]
