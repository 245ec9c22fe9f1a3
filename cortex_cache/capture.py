"""What a persist reads of a pool: its live entries as arrays, and their values gathered in batches.

A persist used to pin each entry, copy it and pack its record one at a time:
18 us of Python per entry, where the bytes cost a fraction of that.  Here the
metadata of the live entries is copied out of the slot columns with numpy, a
chunk of slots per lock hold (writers wait for a few milliseconds of copying,
never for the values), and the keys out of the key arena cell by cell, in the
same holds.  The values are then copied without the lock and without pins, a
batch of thousands per call (copyhash.gather_hash: one pass that copies each
value and takes its xxh3_64): a value whose copy does not match the checksum
its entry was sealed with was freed and its blocks reused meanwhile (the entry
was deleted or replaced after the persist began: left out, as an entry deleted
before its batch always was) or is damaged in memory (its slot unchanged, looked
at again in one lock hold: left out and counted).  A sealed value is never
written in place, so a copy that matches is the value the entry was sealed with.
"""

from __future__ import annotations

import mmap
from typing import Any, Iterator, NamedTuple

import numpy as np

from .copyhash import gather_hash
from .core import Core
from .layout import KEY_CELL, MAX_KEY_BYTES, SEALED

CHUNK_ENTRIES = 32768  # slots whose metadata one lock hold copies (about 2 ms)
GATHER_BYTES = 8 << 20  # values copied per gather call
# The fields a snapshot records of an entry, by their slot column (manifest.py's columns take these names).
FIELDS = ("flags", "value_len", "checksum", "key_hash", "expiry", "priority", "created", "last_access",
          "insert_seq", "access_seq", "access_count")


class Live(NamedTuple):
    """The live entries of a pool at a persist's start, most recently used first, one array per field
    (`cols`: FIELDS, plus slot, first_block, key_off -- into `keys` -- key_len, value_off in the segment),
    and the key blob (each key at its key_off, in cells of KEY_CELL bytes, the rest of a cell zero)."""

    cols: dict[str, np.ndarray]
    keys: np.ndarray

    @property
    def n(self) -> int:
        return len(self.cols["slot"])

    def take(self, keep: np.ndarray) -> "Live":
        """These entries but those where `keep` is False (the key blob as it is)."""
        return Live({k: v[keep] for k, v in self.cols.items()}, self.keys)


def capture(core: Core, slots: np.ndarray | None = None) -> Live:
    """The pool's live entries now, most recently used first (Live); with `slots`, those of the entries at
    these slots (in this order) that are still live (an incremental persist's changed ones: basepos.py).
    Entries put after this call began are not part of it; one deleted before its chunk's lock hold is
    left out."""
    def start() -> tuple[np.ndarray, np.ndarray, int]:
        # Dead processes' pins and reservations back first (O(pin records)): a persist used to when its own
        # pins ran out; it takes none now, and a pool it found littered should not stay so.
        core.reap_dead()
        live = np.flatnonzero(core.live_mask())
        return live, core.columns["access_seq"][live].copy(), int(core.fields.seq[0])

    if slots is None:
        live, recency, seq = core.locked(start)
        order = live[np.argsort(recency, kind="stable")[::-1]]  # sorted outside the lock
    else:
        order, seq = slots, core.locked(lambda: int(core.fields.seq[0]))
    parts = [core.locked(_chunk, core, order[k : k + CHUNK_ENTRIES], seq) for k in range(0, len(order), CHUNK_ENTRIES)]
    if not parts:
        empty = {name: np.zeros(0, core.columns[name].dtype) for name in FIELDS}
        empty.update(slot=np.zeros(0, np.int64), first_block=np.zeros(0, np.uint64), key_off=np.zeros(0, np.uint64),
                     key_len=np.zeros(0, np.uint32), value_off=np.zeros(0, np.uint64))
        return Live(empty, np.zeros(0, np.uint8))
    cols = {name: np.concatenate([p[0][name] for p in parts]) for name in parts[0][0]}
    # Each chunk's key offsets are into its own cells: moved past the chunks before it.
    base = np.cumsum([0] + [len(p[1]) for p in parts[:-1]], dtype=np.uint64)
    cols["key_off"] = np.concatenate([p[0]["key_off"] + b for p, b in zip(parts, base)])
    return Live(cols, np.concatenate([p[1] for p in parts]))


def _chunk(core: Core, slots: np.ndarray, seq: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Lock held: the fields and keys of the entries at `slots` that are still the live entries they were
    (sealed, not expired, put no later than `seq`), with possible metadata (as Core.value_at checks it)."""
    c, g = core.columns, core.geometry
    state, expiry, iseq = c["state"][slots], c["expiry"][slots], c["insert_seq"][slots]
    first, nblk, vlen = c["first_block"][slots], c["n_blocks"][slots], c["value_len"][slots]
    kcell, klen = c["key_cell"][slots], c["key_len"][slots].astype(np.uint64)
    now = core.clock()
    bs = np.uint64(g.block_size)
    ncell = (klen + np.uint64(KEY_CELL - 1)) // np.uint64(KEY_CELL)
    ok = (state == SEALED) & ((expiry == 0) | (expiry > now)) & (iseq <= np.uint64(seq))
    ok &= (nblk <= np.uint64(g.n_blocks)) & (first <= np.uint64(g.n_blocks) - nblk) & (vlen <= nblk * bs)
    ok &= ~((nblk > 0) & (vlen <= (nblk - np.uint64(1)) * bs))
    ok &= (klen > 0) & (klen <= MAX_KEY_BYTES) & (kcell <= np.uint64(g.n_kcells)) & (ncell <= np.uint64(g.n_kcells) - kcell)
    sel = slots[ok]
    out = {name: c[name][sel].copy() for name in FIELDS}
    age = np.clip(int(core.fields.lfu_epoch[0]) - c["lfu_epoch"][sel].astype(np.int64), 0, 63)
    out["access_count"] = out["access_count"] >> age.astype(np.uint64)
    out["slot"] = sel.astype(np.int64)
    out["first_block"] = first[ok]
    out["value_off"] = np.uint64(g.data_off) + first[ok] * bs
    out["key_len"] = klen[ok].astype(np.uint32)
    ncell, kcell = ncell[ok].astype(np.int64), kcell[ok].astype(np.int64)
    start = np.cumsum(ncell) - ncell  # each key's first cell in this chunk's blob
    out["key_off"] = (start * KEY_CELL).astype(np.uint64)
    total = int(ncell.sum())
    arena = np.frombuffer(core.mv, np.uint8, g.n_kcells * KEY_CELL, g.keys_off).reshape(g.n_kcells, KEY_CELL)
    src = np.repeat(kcell - start, ncell) + np.arange(total)
    cells = arena[src]  # a copy
    del arena
    rem = (out["key_len"] % KEY_CELL).astype(np.int64)
    tail = rem > 0  # zero the rest of each key's last cell: no byte of another key goes into a snapshot
    if tail.any():
        last = (start + ncell - 1)[tail]
        cells[last] *= (np.arange(KEY_CELL)[None, :] < rem[tail][:, None])
    return out, cells.reshape(-1)


class Gathered(NamedTuple):
    """One batch of values copied out of the pool: `data[:nbytes]` holds entries `first`..`first+count` (of
    the Live given) back to back; `good` says which of them matched their checksums."""

    first: int
    count: int
    data: Any
    nbytes: int
    good: np.ndarray


def gather(core: Core, live: Live, which: np.ndarray | None = None) -> Iterator[Gathered]:
    """The values of `live`'s entries (those where `which` is True; all: None), in order, a batch of about
    GATHER_BYTES at a time, copied without the lock (each batch's buffer is reused by the next: write it
    before asking for the next).  A value that did not match its checksum is not `good`; `recheck` says
    which of those were damaged in memory rather than freed."""
    lengths, offs, sums = live.cols["value_len"], live.cols["value_off"], live.cols["checksum"]
    idx = np.arange(live.n) if which is None else np.flatnonzero(which)
    buf: Any = None
    k = 0
    ends = np.cumsum(lengths[idx].astype(np.int64))
    while k < len(idx):
        start = int(ends[k - 1]) if k else 0
        stop = max(k + 1, int(np.searchsorted(ends, start + GATHER_BYTES, side="right")))
        sel = idx[k:stop]
        need = int(ends[stop - 1]) - start
        if buf is None or len(buf) < need:
            buf = mmap.mmap(-1, max(need, GATHER_BYTES))  # no zeroing pass: its pages come with the copy
        got = np.zeros(len(sel), np.uint64)
        n = gather_hash(buf, core.mv, np.ascontiguousarray(offs[sel]), np.ascontiguousarray(lengths[sel]), got)
        yield Gathered(k, len(sel), buf, n, got == sums[sel])
        k = stop


def damaged(core: Core, live: Live, positions: np.ndarray) -> int:
    """Of `live`'s entries at `positions` (whose copies did not match), how many still hold the same value
    slot (in one lock hold): damaged in memory, not freed meanwhile.  Counted by persist as skipped."""
    if not len(positions):
        return 0
    slots = live.cols["slot"][positions]

    def look() -> int:
        c = core.columns
        same = (c["state"][slots] == SEALED) & (c["insert_seq"][slots] == live.cols["insert_seq"][positions])
        same &= c["first_block"][slots] == live.cols["first_block"][positions]
        return int(same.sum())

    return core.locked(look)


__all__ = ["Live", "Gathered", "capture", "gather", "damaged", "FIELDS", "CHUNK_ENTRIES", "GATHER_BYTES"]
