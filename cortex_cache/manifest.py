"""Snapshot manifest version 4: fixed-width columns in fill order and a lookup table, used in place.

A restore publishes a pool before its values are in, and every process that
opens the pool while it fills serves the entries the fill has not reached from
the snapshot (snaptier.py).  Version 3 made each of them parse the whole
manifest into an index first (seconds at a million entries); version 4 is laid
out so that nobody parses it: persist computes the fill's order once (numpy),
writes one array per field in that order, and a hash table over them, and a
reader maps the file read-only and keeps numpy views.  Opening one checks a
few hundred bytes (header, section table); a lookup is a probe (table ->
position -> key compare in the key blob); every offset read from the file is
bounds-checked, so a damaged or forged manifest gives misses, never wrong
bytes (values are still checked against their checksums when read).

Version 4.  All integers little-endian; sections start on 64-byte boundaries::

    file header  FILE_HEAD (320 bytes), as version 2 (snapfile.py), version 4;
                 two of its reserved words are used (covered by its checksum):
      204 u64 offset of the section table      212 u32 sections in it
    configuration block, as version 2 (config_len bytes after the header)
    sections, in any order, zero bytes between them (alignment):
      "packs"      the pack table, as version 3: PACK_TABLE, then per pack
                   PACK_ENTRY and its name (packs.py: version 1 packs, records
                   with a head and key, or version 2, the values back to back)
      a column per field, N values each (N: the trailer's entry count), the
      entries in FILL ORDER (position p is the p-th entry the fill loads):
        key_off u64 (into "keys")  key_len u16   flags u8 (bit 0: str key)
        length u64 (value bytes)   pack u32 (index in the pack table)
        offset u64 (of the VALUE's first byte in its pack, whatever the
                    pack's version)
        checksum u64 (xxh3_64 of the value)   key_hash u64 (xxh3_64 of the key)
        expiry f64 (0 = never)    priority i64   created f64   last_access f64
        insert_seq u64  access_seq u64  access_count u64 (aged to the persist)
      "keys"       the key blob: each key at its key_off, key_len bytes
      "table"      the lookup table: 2^k u32 cells (2^k >= 2N), each 0 (empty)
                   or position + 1; a key whose hash is h is at the first cell
                   from h & (2^k - 1) on (wrapping) whose position's key_hash
                   and key bytes are its own, at most MAX_PROBE cells on; an
                   empty cell before it means it is not there
      "policy"     opaque bytes of the pool's policy state (may be empty)
      any other name: opaque, ignored by readers that do not know it
    section table  per section SECTION (40 bytes): 16s name (NUL padded),
                   u64 offset, u64 length, u64 xxh3_64 of its bytes
    trailer      TRAILER, as version 2: magic, entries, value bytes, and
                 xxh3_64 of the file header, the configuration block and the
                 section table (each section is covered by its own checksum)

Fill order: the most recently used first, in bands of fill.BAND_BYTES inside
which values go in (pack, offset) order, so the disk reads long runs; the
most recent entry alone first.  Who checks what: opening checks the header,
the trailer's checksum and that every section lies inside the file with the
size its kind needs (O(1)); the fill checks the sections it reads
(`verify_sections`) before it loads anything, in the background; a lookup
bounds-checks what it reads.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np
import xxhash

from .layout import MAX_KEY_BYTES

VERSION = 4
ALIGN = 64
SECTIONS_AT = struct.Struct("<QI")  # at byte 204 of the file header: section table offset, sections
SECTIONS_AT_OFFSET = 204
SECTION = struct.Struct("<16sQQQ")
MAX_SECTIONS = 64
MAX_PROBE = 256  # a lookup gives up after this many cells (the writer keeps every key within it)
BAND_BYTES = 64 << 20  # the fill's bands (fill.py reads it from here)
# (name, numpy type) of each column, in the order persist writes them.
COLUMNS: list[tuple[str, str]] = [
    ("key_off", "<u8"), ("key_len", "<u2"), ("flags", "<u1"), ("length", "<u8"), ("pack", "<u4"),
    ("offset", "<u8"), ("checksum", "<u8"), ("key_hash", "<u8"), ("expiry", "<f8"), ("priority", "<i8"),
    ("created", "<f8"), ("last_access", "<f8"), ("insert_seq", "<u8"), ("access_seq", "<u8"),
    ("access_count", "<u8"),
]
COLUMN_TYPES = dict(COLUMNS)
# The sections a version 4 manifest must have (others may follow: "policy", and what later versions add).
REQUIRED = ("packs", *COLUMN_TYPES, "keys", "table")


def _pad(n: int) -> int:
    return -n % ALIGN


def fill_order(access_seq: np.ndarray, length: np.ndarray, pack: np.ndarray, offset: np.ndarray,
               newest_first: bool = False) -> np.ndarray:
    """The fill's order of entries given by their columns: a permutation.  The most recently used first,
    by bands of BAND_BYTES read in (pack, offset) order; the newest entry alone first.  `newest_first`:
    the entries are in that order already (persist captures them so), which saves a sort."""
    n = len(access_seq)
    if n == 0:
        return np.zeros(0, np.int64)
    mru = np.arange(n) if newest_first else np.argsort(-access_seq.astype(np.float64), kind="stable")
    band = np.empty(n, np.int64)
    band[mru] = np.cumsum(length[mru].astype(np.int64)) // BAND_BYTES + 1
    band[mru[0]] = 0  # the most recent entry alone first: the first hit should not wait for a band
    off = offset.astype(np.uint64)
    if int(band.max()) < 1 << 12 and int(pack.max()) < 1 << 12 and int(off.max()) < 1 << 40:
        # One u64 key (band, pack, offset), one sort: what a persist of a million entries saves is a
        # three-key lexsort (~0.2 s).
        key = (band.astype(np.uint64) << np.uint64(52)) | (pack.astype(np.uint64) << np.uint64(40)) | off
        return np.argsort(key, kind="stable")
    return np.lexsort((offset, pack, band))


def table_bits(n: int) -> int:
    """k: the lookup table of n entries has 2^k cells, 2^k >= 2n (at least 2)."""
    return max(1, int(2 * n - 1).bit_length()) if n else 1


def build_table(key_hash: np.ndarray) -> np.ndarray:
    """The lookup table for entries whose key hashes are `key_hash` (by position): linear probing, built in
    rounds with numpy (round d places, at home + d, the entries that found every cell before it taken, one
    per free cell), so every key's cells from its home to its own are full.  Grown until no key sits more
    than MAX_PROBE cells from its home."""
    n = len(key_hash)
    bits = table_bits(n)
    while True:
        size = 1 << bits
        table = np.zeros(size, np.uint32)
        home = (key_hash & np.uint64(size - 1)).astype(np.int64)
        left = np.arange(n, dtype=np.int64)
        d = 0
        while len(left) and d < MAX_PROBE:
            cell = (home[left] + d) & (size - 1)
            free = table[cell] == 0
            cand, cells = left[free], cell[free]
            # One entry per free cell this round: several may write one cell, one of them stays there
            # (which one numpy leaves does not matter); reading the cells back says who.
            table[cells] = (cand + 1).astype(np.uint32)
            won = table[cells] == (cand + 1).astype(np.uint32)
            placed = np.zeros(len(left), bool)
            placed[np.flatnonzero(free)[won]] = True
            left = left[~placed]
            d += 1
        if not len(left):
            return table
        bits += 1


def layout(prefix_len: int, sections: list[tuple[str, Any]]) -> tuple[list[tuple[str, int, int]], int]:
    """Where each section goes after a prefix of `prefix_len` bytes: [(name, offset, length)], and the offset
    of the section table."""
    at = prefix_len + _pad(prefix_len)
    places = []
    for name, data in sections:
        n = memoryview(data).nbytes
        places.append((name, at, n))
        at += n + _pad(n)
    return places, at


def section_table(places: list[tuple[str, int, int]], sections: list[tuple[str, Any]]) -> bytes:
    """The section table's bytes: each section's name, place and checksum."""
    out = bytearray()
    for (name, off, n), (_, data) in zip(places, sections):
        out += SECTION.pack(name.encode(), off, n, xxhash.xxh3_64_intdigest(memoryview(data).cast("B")))
    return bytes(out)


def write_sections(write: Any, prefix_len: int, places: list[tuple[str, int, int]],
                   sections: list[tuple[str, Any]]) -> None:
    """Write the sections where `layout` placed them (zero padding between), after `prefix_len` bytes."""
    at = prefix_len
    for (name, off, n), (_, data) in zip(places, sections):
        if off > at:
            write(bytes(off - at))
        write(memoryview(data).cast("B"))
        at = off + n
    pad = _pad(at)
    if pad:
        write(bytes(pad))


def columns_sections(cols: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """The columns, each as the type the format gives it, in the format's order."""
    return [(name, np.ascontiguousarray(cols[name], dtype=fmt)) for name, fmt in COLUMNS]


class Place(NamedTuple):
    offset: int
    length: int
    checksum: int


class Reader:
    """A version 4 manifest mapped read-only (`mv`: the file's mapping, `size` bytes): its section table
    read and checked against the file (O(1): no column is read), numpy views of the columns and the table,
    and the probe.  `corrupt(why)` makes the error that names the file."""

    def __init__(self, mv: memoryview, size: int, entries: int, table_off: int, count: int, corrupt: Any) -> None:
        self.mv, self.n, self.corrupt = mv, entries, corrupt
        if not (0 < count <= MAX_SECTIONS) or table_off % ALIGN or table_off + count * SECTION.size > size:
            raise corrupt("impossible section table")
        self.table_off, self.table_len = table_off, count * SECTION.size
        self.places: dict[str, Place] = {}
        for k in range(count):
            raw, off, length, check = SECTION.unpack_from(mv, table_off + k * SECTION.size)
            name = raw.rstrip(b"\0").decode("ascii", "replace")
            if name in self.places or off % ALIGN or off > table_off or length > table_off - off:
                raise corrupt(f"impossible section {name!r}")
            self.places[name] = Place(off, length, check)
        for name in REQUIRED:
            if name not in self.places:
                raise corrupt(f"no section {name!r}")
        n = entries
        if n > (1 << 32) - 2:
            raise corrupt("impossible entry count")
        for name, fmt in COLUMNS:
            if self.places[name].length != n * np.dtype(fmt).itemsize:
                raise corrupt(f"section {name!r} holds {self.places[name].length} bytes, not {n} values")
        tbytes = self.places["table"].length
        cells = tbytes // 4
        if tbytes % 4 or cells < 2 * n or cells & (cells - 1) or cells == 0:
            raise corrupt("impossible lookup table")
        self.cols = {name: np.frombuffer(mv, fmt, n, self.places[name].offset) for name, fmt in COLUMNS}
        self.table = np.frombuffer(mv, np.uint32, cells, self.places["table"].offset)
        self.mask = cells - 1
        keys = self.places["keys"]
        self.keys_off, self.keys_len = keys.offset, keys.length

    def section(self, name: str, check: bool = True) -> memoryview | None:
        """The bytes of section `name` (a view of the mapping), its checksum checked (SnapshotCorrupt); None
        when the manifest has no such section."""
        p = self.places.get(name)
        if p is None:
            return None
        view = self.mv[p.offset : p.offset + p.length]
        if check and xxhash.xxh3_64_intdigest(view) != p.checksum:
            raise self.corrupt(f"section {name!r} fails its checksum")
        return view

    def verify_sections(self, names: Any = None) -> None:
        """Check the checksums of sections `names` (all: None); SnapshotCorrupt naming the first that fails."""
        for name in (self.places if names is None else names):
            self.section(name)

    def position(self, kb: bytes, kh: int) -> int | None:
        """The fill position of key `kb` (its xxh3_64 `kh`), or None.  Every number read from the file is
        checked before it is used: a damaged table or column is a miss."""
        table, mask, n = self.table, self.mask, self.n
        khs, koffs, klens = self.cols["key_hash"], self.cols["key_off"], self.cols["key_len"]
        klen, kh = len(kb), kh & 0xFFFFFFFFFFFFFFFF
        h = kh & mask
        for d in range(MAX_PROBE):
            v = int(table[(h + d) & mask])
            if v == 0:
                return None
            p = v - 1
            if p >= n or int(khs[p]) != kh or int(klens[p]) != klen:
                continue
            off = int(koffs[p])
            if off > self.keys_len - klen:
                continue
            at = self.keys_off + off
            if self.mv[at : at + klen] == kb:
                return p
        return None

    def row(self, p: int) -> dict[str, Any]:
        """Every column's value at position `p`, as Python numbers."""
        return {name: col[p].item() for name, col in self.cols.items()}

    def key(self, p: int) -> bytes | None:
        """The key at position `p` (None: its place in the blob is impossible)."""
        off, klen = int(self.cols["key_off"][p]), int(self.cols["key_len"][p])
        if not 0 < klen <= MAX_KEY_BYTES or off > self.keys_len - klen:
            return None
        return bytes(self.mv[self.keys_off + off : self.keys_off + off + klen])

    def keys(self, start: int, stop: int) -> list[bytes | None]:
        return [self.key(p) for p in range(start, stop)]

    def key_blob(self, p: int) -> memoryview:
        """The key blob that position `p`'s key_off indexes (fill_columns.py reads keys there in C)."""
        return self.mv[self.keys_off : self.keys_off + self.keys_len]

    def part_end(self, p: int) -> int:
        """The end of the run of positions from `p` whose keys share one blob: all of them here."""
        return self.n


def check_key_blob(reader: Reader) -> None:
    """Every key's place inside the key blob and its length possible (the fill's check, vectorised)."""
    c = reader.cols
    klen = c["key_len"].astype(np.uint64)
    room = np.uint64(reader.keys_len)
    bad = (klen == 0) | (klen > MAX_KEY_BYTES) | (klen > room)
    if reader.n and (bad.any() or (c["key_off"] > room - np.minimum(klen, room)).any()):
        raise reader.corrupt("a key lies outside the key blob")


__all__ = ["VERSION", "COLUMNS", "COLUMN_TYPES", "REQUIRED", "SECTION", "SECTIONS_AT", "SECTIONS_AT_OFFSET",
           "MAX_PROBE", "BAND_BYTES", "fill_order", "build_table", "layout", "section_table", "write_sections",
           "columns_sections", "Reader", "check_key_blob", "table_bits"]
