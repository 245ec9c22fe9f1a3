"""The snapshot file formats and their reader: a snapshot mapped read-only, checked as far as it is read.

snapshot.py writes snapshots, restore.py and fill.py read them through `Snapshot`.
Version 4, the manifest persist writes into the snapshot directory now, is laid
out in manifest.py (its columns, key blob, lookup table and sections); the older
versions, still read and restored::

Snapshot format, version 6: the self-contained file `persist --output` writes (versions 2 and 1 are still
read: version 6 is version 2 with the policy state between the configuration block and the records; a
reader of versions 1-4 refuses it by its version number).  All integers little-endian::

    file header  FILE_HEAD (320 bytes)
      0   8s  magic b"CRTXSNAP"
      8   u32 version (6; 2 has no policy state, 1 no configuration block either)
      12  u32 header size (320)
      16  f64 created (wall clock of the persist)
      24  u64 pool data size      32  u64 block size     40  u64 max entries
      48  u32 policy id           52  u32 pool flags     56  u32 mode     60 u32 reserved
      64  u64 lfu period
      72  64s pool name (NUL padded)
      136 u64 x 8 counters: seq, hits, misses, puts, deletes, evictions, expirations, bytes evicted
      200 u32 configuration block length (versions 2, 5; 0 in version 1)
      204 u64 policy state length (version 6; 0: none.  Version 4: where its section table is)
      212 100 bytes reserved (zero)
      312 u64 xxh3_64 of bytes 0..311
    configuration block (versions 2, 6): that many bytes of UTF-8 JSON, the rest of
      the pool's configuration (config.encode: reserve, keep, disk tier, remote
      tier), covered by the file checksum
    policy state (version 6): that many bytes, policy_state.py's blob (its own
      layout and xxh3_64), covered by the file checksum too: a blob that fails its
      own checks in a file that passes (written so) costs the restored pool its
      policy state (restore ignores it and says why), never its entries
    records, one per live entry: REC_HEAD (104 bytes), key, value
      0   4s  magic b"CREC"       4  u32 key length      8  u32 flags (bit 0: str key)
      12  u32 reserved            16 u64 value length
      24  f64 created             32 f64 last access     40 f64 expiry (0 = never)
      48  u64 insert seq          56 u64 access seq      64 u64 access count (aged)
      72  i64 priority            80 u64 xxh3_64 of the value
      88  u64 reserved
      96  u64 xxh3_64 of bytes 0..95 of this head plus the key
    trailer TRAILER (32 bytes)
      0   8s  magic b"CRTXEND\\0"  8 u64 record count    16 u64 value bytes
      24  u64 xxh3_64 of every byte of the file before the trailer

Version 3, the incremental snapshot (a manifest) that persist wrote into the
snapshot directory before version 4.  The values are not in the file but in pack files beside
it (packs.py), shared with the other snapshots of the pool::

    file header  FILE_HEAD, version 3;  configuration block, as version 2
    pack table   PACK_TABLE (8 bytes): u32 packs, u32 reserved; then per pack
      PACK_ENTRY (24 bytes): u64 pack id, u64 file size, u32 name length,
      u32 reserved; then the name (UTF-8: a file in this file's directory)
    records, one per live entry: MAN_REC (104 bytes), key
      as REC_HEAD, magic b"CMRC", and the two reserved words used:
      12  u32 index of the value's pack in the pack table
      88  u64 offset of the value's record in that pack
      96  u64 xxh3_64 of bytes 0..95 of this head plus the key
    trailer      TRAILER, as version 2 (the checksum covers this file only;
                 each value is checked against its own checksum when read)
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import xxhash

from . import config, manifest, packs, safefs, snapdelta
from .copyhash import gather_hash
from .core import GUARD
from .errors import (
    OUT_OF_FILES,
    CortexCacheError,
    PermissionDenied,
    SnapshotCorrupt,
    SnapshotNotFound,
    StorageIOError,
    UsageError,
    too_many_open_files,
)
from .layout import MAX_KEY_BYTES, Geometry
from .policy_names import POLICY_IDS
from .units import plural

MAGIC = b"CRTXSNAP"
VERSION = 6  # a self-contained file (persist --output): version 2 and the policy state (5: snapdelta's)
PLAIN = 2  # the self-contained file before version 6: no policy state
SELF_CONTAINED = (1, PLAIN, VERSION)
MANIFEST_VERSION = manifest.VERSION  # an incremental snapshot in the snapshot directory (4), its values in packs
LEGACY_MANIFEST = 3  # the incremental snapshot before version 4: records one after another
DELTA_VERSION = snapdelta.DELTA_VERSION  # an incremental snapshot recording what changed since a full one (5)
MANIFESTS = (LEGACY_MANIFEST, MANIFEST_VERSION, DELTA_VERSION)
READS = (1, 2, 3, 4, DELTA_VERSION, VERSION)  # versions this code restores
REC_MAGIC = b"CREC"
MAN_MAGIC = b"CMRC"
END_MAGIC = b"CRTXEND\0"
SUFFIX = ".ccsnap"

FILE_HEAD = struct.Struct("<8sIId QQQ IIII Q 64s 8Q I 108x")
HEAD_CHECK = struct.Struct("<Q")
REC_HEAD = struct.Struct("<4sIII Q ddd QQQ q Q Q")
REC_CHECK = struct.Struct("<Q")
TRAILER = struct.Struct("<8sQQQ")
PACK_TABLE = struct.Struct("<II")
PACK_ENTRY = struct.Struct("<QQI4x")
POLICY_AT = struct.Struct("<Q")  # version 6, at byte POLICY_AT_OFFSET of the file header: the policy state's length
POLICY_AT_OFFSET = 204
assert FILE_HEAD.size + HEAD_CHECK.size == 320 and REC_HEAD.size + REC_CHECK.size == 104 and TRAILER.size == 32

VERIFY_BYTES = 8 << 20  # values read and checked per call by verify (version 4)
COUNTERS = ("seq", "hits", "misses", "puts", "deletes", "evictions", "expirations", "bytes_evicted")
_STAMP_RE = r"\d{8}T\d{6}\.\d{6}Z"

def os_error(e: OSError, what: str) -> CortexCacheError:
    if e.errno in OUT_OF_FILES:
        return too_many_open_files(what, e)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"permission denied {what}: {e.strerror}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageIOError(f"no space left {what}")
    return StorageIOError(f"I/O error {what}: {e.strerror or e}")



@dataclass
class SnapshotHeader:
    created: float
    size: int
    block_size: int
    max_entries: int
    policy: str
    flags: int
    mode: int
    lfu_period: int
    name: str
    counters: dict[str, int]
    version: int = VERSION
    # The rest of the configuration (config.decode); a version 1 file has
    # none: no tiers, default retention.
    config: dict[str, Any] | None = None


@dataclass
class Record:
    key: bytes
    flags: int
    value: memoryview
    created: float
    last_access: float
    expiry: float
    insert_seq: int
    access_seq: int
    access_count: int
    priority: int
    checksum: int


class Snapshot:
    """A snapshot file, mapped read-only and verified whole on open.

    Raises SnapshotNotFound (66), SnapshotCorrupt (65: truncated, damaged,
    foreign or of a newer version), PermissionDenied (77).
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True, private: bool | str = False,
                 base: bool = True) -> None:
        """Map `path` and check its header; with `verify` (default) check the whole file now.

        Without `verify` only the header and the trailer's place are checked:
        the caller must then read every record through `records(hasher=...)`
        and call `check_trailer` before trusting anything it read.  Anything
        but a regular file (a FIFO, a device) is refused before a read could
        block on it; with `private` (a file of our snapshot directory) so is
        a symbolic link or a file that is not ours (PermissionDenied, 77);
        safefs.FOLLOWED: the stricter rules of safefs.open_read, for its packs too.
        `untrusted` says why the file may not be this user's own word (None:
        it is ours, in a directory of ours, and nobody else may write either),
        for restore to decide whether to attach the tiers it names.  The file
        and its packs are mapped fenced against SIGBUS: one cut short while it
        is read gives zeros, and `check_whole` says so.  A delta manifest
        (version 5, snapdelta.py) is read with its base, as one snapshot
        (`base=False`: the delta file alone, as compaction rewrites it).
        """
        self.path = Path(path)
        self._mv = self._guard = None
        try:
            fd = safefs.open_read(self.path, private, "snapshot")
        except CortexCacheError:
            raise
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {str(self.path)!r}") from None
        except IsADirectoryError:
            raise UsageError(f"{str(self.path)!r} is a directory, not a snapshot") from None
        except OSError as e:
            raise os_error(e, f"reading {str(self.path)!r}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"{str(self.path)!r} is not a regular file, so not a snapshot")
            self.file_mode = stat.S_IMODE(st.st_mode)
            self.file_gid = st.st_gid
            # Why what this file says may not come from this user (None: only this user could have written it).
            self.untrusted = safefs.written_by_us(fd, self.path)
            size = st.st_size
            if size < FILE_HEAD.size + HEAD_CHECK.size + TRAILER.size:
                raise SnapshotCorrupt(f"{str(self.path)!r} is not a cortex snapshot (too short: {size} bytes)")
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            self._guard = GUARD(self._mm) if GUARD is not None else None
        finally:
            os.close(fd)
        self._mv = memoryview(self._mm)
        self.size = size
        self.private = private
        self.pack_refs: list[packs.PackRef] = []  # versions 3 and 4: the packs its values are in
        self._packs: dict[int, packs.PackReader] = {}
        self.v4: Any = None  # version 4: its sections, columns and lookup table (manifest.Reader; a delta's
        # with its base: snapdelta.Combined)
        self.base: Snapshot | None = None  # a delta's base, open
        try:
            self.header = self._read_header()
            end = self.size - TRAILER.size
            magic, self.entries, self.value_bytes, self._file_check = TRAILER.unpack_from(self._mv, end)
            if magic != END_MAGIC:
                raise self._corrupt(self._why_no_trailer())
            self.positions = self.entries  # positions of the fill's order (a delta's: its own and its base's)
            if self.header.version in (MANIFEST_VERSION, DELTA_VERSION):
                self._open_v4()
            if self.header.version == DELTA_VERSION and base:
                self._open_base()
            if verify:
                self.verify()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        base, self.base = getattr(self, "base", None), None
        if base is not None:
            base.close()
        for reader in getattr(self, "_packs", {}).values():
            reader.close()
        self._packs = {}
        guard, self._guard = getattr(self, "_guard", None), None
        if guard is not None:
            guard.close()  # before the unmap: its addresses may be reused
        if self._mv is not None:
            mv, self._mv = self._mv, None
            try:
                mv.release()
                self._mm.close()
            except BufferError:
                # A record's value view is still alive (say, in a traceback):
                # the mapping goes when the last view does.
                pass

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _why_no_trailer(self) -> str:
        """The file does not end in a trailer: cut short, or bytes added after its end (an append,
        a copy that wrote too much)?  A trailer whose own words check out further in tells which."""
        at = self._mm.rfind(END_MAGIC, FILE_HEAD.size)
        while at >= 0:
            if at + TRAILER.size <= self.size:
                _, n, value_bytes, _ = TRAILER.unpack_from(self._mv, at)
                # A real trailer counts no more entries and value bytes than the file could hold.
                if n <= at and value_bytes <= at:
                    extra = self.size - at - TRAILER.size
                    return (f"{plural(extra, 'byte', 'bytes')} follow its trailer (added after it was written); "
                            f"its first {at + TRAILER.size} bytes may be the snapshot")
            at = self._mm.rfind(END_MAGIC, FILE_HEAD.size, at)
        return "truncated (no trailer)"

    def _corrupt(self, why: str) -> SnapshotCorrupt:
        return SnapshotCorrupt(f"snapshot {str(self.path)!r} is damaged: {why}")

    def _read_header(self) -> SnapshotHeader:
        mv = self._mv
        if bytes(mv[:8]) != MAGIC:
            raise SnapshotCorrupt(f"{str(self.path)!r} is not a cortex snapshot")
        fields = FILE_HEAD.unpack_from(mv, 0)
        (_, version, hsize, created, size, bsize, max_entries, policy, flags, mode, _r, lfu_period, name,
         *counters, config_len) = fields
        if version not in READS:
            raise SnapshotCorrupt(
                f"snapshot {str(self.path)!r} has format version {version}; this cortex_cache reads versions "
                + ", ".join(map(str, READS))
            )
        (check,) = HEAD_CHECK.unpack_from(mv, FILE_HEAD.size)
        if hsize != FILE_HEAD.size + HEAD_CHECK.size or check != xxhash.xxh3_64_intdigest(mv[: FILE_HEAD.size]):
            raise self._corrupt("header checksum mismatch")
        if policy >= len(POLICY_IDS):
            raise self._corrupt(f"unknown policy {policy}")
        try:
            Geometry.compute(size, bsize, max_entries)
            pool_name = name.rstrip(b"\0").decode()
        except (CortexCacheError, UnicodeDecodeError):
            raise self._corrupt("impossible pool configuration") from None
        self.records_off = FILE_HEAD.size + HEAD_CHECK.size
        cfg = None
        if version >= 2:
            if config_len > min(config.MAX_CONFIG_BYTES, self.size - self.records_off - TRAILER.size):
                raise self._corrupt("impossible configuration length")
            cfg = config.decode(bytes(mv[self.records_off : self.records_off + config_len]), str(self.path))
            self.records_off += config_len
        elif config_len:
            raise self._corrupt("header checksum mismatch")
        self.policy_at = (self.records_off, 0)  # (offset, length) of the policy state (version 6)
        if version == VERSION:
            (state_len,) = POLICY_AT.unpack_from(mv, POLICY_AT_OFFSET)
            if state_len > self.size - self.records_off - TRAILER.size:
                raise self._corrupt("impossible policy state length")
            self.policy_at = (self.records_off, state_len)
            self.records_off += state_len
        if version == LEGACY_MANIFEST:
            self.records_off = self._read_pack_table(self.records_off)
        return SnapshotHeader(created, size, bsize, max_entries, POLICY_IDS[policy], flags, mode & 0o777,
                              lfu_period or 1024, pool_name, dict(zip(COUNTERS, counters)), version, cfg)

    def _open_v4(self) -> None:
        """Version 4: the section table (where the header says), checked against the trailer's checksum, which
        covers the header, the configuration block and the section table; then the pack table.  O(1): no
        column, key or value is read (manifest.py)."""
        table_off, count = manifest.SECTIONS_AT.unpack_from(self._mv, manifest.SECTIONS_AT_OFFSET)
        end = self.size - TRAILER.size
        if not 0 < count <= manifest.MAX_SECTIONS or table_off < self.records_off or \
                table_off + count * manifest.SECTION.size != end:
            raise self._corrupt("impossible section table")
        if self.entries > self.header.max_entries:
            raise self._corrupt(f"{self.entries} entries in a pool of {self.header.max_entries}")
        h = xxhash.xxh3_64(self._mv[: self.records_off])
        h.update(self._mv[table_off:end])
        if h.intdigest() != self._file_check:
            raise self._corrupt("header checksum mismatch (its section table)")
        self.v4 = manifest.Reader(self._mv, end, self.entries, table_off, count, self._corrupt)
        table = self.v4.section("packs")
        assert table is not None
        if self._read_pack_table(self.v4.places["packs"].offset, self.v4.places["packs"].offset + len(table)) != \
                self.v4.places["packs"].offset + len(table):
            raise self._corrupt("pack table cut short")

    def _open_base(self) -> None:
        """A delta: its base, checked to be the full manifest it names (same pool and shape, the ident it
        was written against, the entries it counted), opened as this file was; then the two as one."""
        delta = self.v4
        view = delta.section("base")
        dropped = delta.section("dropped")
        if view is None or dropped is None:
            raise self._corrupt("a delta manifest without its base or dropped section")
        ident, nb, live, live_bytes, name = snapdelta.read_base(view, self._corrupt)
        where = self.path.parent / name
        try:
            base = Snapshot(where, verify=False, private=self.private, base=False)
        except SnapshotNotFound:
            raise self._corrupt(f"its base {name!r} is missing") from None
        except CortexCacheError as e:
            raise self._corrupt(f"its base {name!r} cannot be read ({e})") from None
        try:
            bh, h = base.header, self.header
            own = base.section(snapdelta.IDENT) if base.v4 is not None else None
            if bh.version != MANIFEST_VERSION or own is None:
                raise self._corrupt(f"its base {name!r} is not a full manifest")
            if (bh.name, bh.size, bh.block_size, bh.max_entries) != (h.name, h.size, h.block_size, h.max_entries):
                raise self._corrupt(f"its base {name!r} is a snapshot of another pool")
            if bytes(own) != ident or base.entries != nb:
                raise self._corrupt(f"its base {name!r} is another snapshot than the one it was written against")
        except BaseException:
            base.close()
            raise
        shift = len(base.pack_refs)
        self.v4 = snapdelta.Combined(delta, base.v4, dropped, shift, self._corrupt)
        self.pack_refs = [*base.pack_refs, *self.pack_refs]
        self._packs = {k + shift: r for k, r in self._packs.items()}
        self.base = base
        self.entries, self.value_bytes, self.positions = live, live_bytes, delta.n + nb

    def prefix(self) -> bytes:
        """The file header and configuration block, as they are in the file."""
        return bytes(self._mv[: self.records_off])

    def policy_state(self) -> bytes | None:
        """The pool's policy state (policy_state.py's blob) as this snapshot carries it: version 4, its
        "policy" section (checksum checked: SnapshotCorrupt); version 6, the bytes after the configuration
        block (covered by the file checksum; the blob checks itself again when applied); None when it has
        none (older versions, or empty)."""
        if self.v4 is not None:
            view = self.v4.section("policy")
            out = bytes(view) if view is not None else b""
            if view is not None:
                view.release()
        else:
            off, n = self.policy_at
            out = bytes(self._mv[off : off + n])
        return out or None

    def _digest(self) -> int:
        """The xxh3_64 the trailer holds for a file of records (versions 1, 2, 3, 6): every byte before it."""
        return xxhash.xxh3_64_intdigest(self._mv[: self.size - TRAILER.size])

    def section(self, name: str) -> memoryview | None:
        """Version 4: the bytes of section `name` (a view of the mapping: release it before `close`), its
        checksum checked (SnapshotCorrupt); None when there is no such section (or the file is older)."""
        return self.v4.section(name) if self.v4 is not None else None

    def position(self, kb: bytes, kh: int) -> int | None:
        """Version 4: the fill position of key `kb` (`kh` its xxh3_64), or None (manifest.Reader.position)."""
        return self.v4.position(kb, kh) if self.v4 is not None else None

    def _read_pack_table(self, pos: int, end: int | None = None) -> int:
        """Versions 3 and 4: read the pack table at `pos` into `pack_refs`; where it ends."""
        self.pack_table_off = pos
        mv, end = self._mv, self.size - TRAILER.size if end is None else end
        if end - pos < PACK_TABLE.size:
            raise self._corrupt("no pack table")
        count, _ = PACK_TABLE.unpack_from(mv, pos)
        pos += PACK_TABLE.size
        if count > (end - pos) // PACK_ENTRY.size:
            raise self._corrupt("impossible pack table")
        for _ in range(count):
            if end - pos < PACK_ENTRY.size:
                raise self._corrupt("pack table cut short")
            pack_id, size, nlen = PACK_ENTRY.unpack_from(mv, pos)
            pos += PACK_ENTRY.size
            if not 0 < nlen <= 512 or nlen > end - pos:
                raise self._corrupt("impossible pack name")
            try:
                name = bytes(mv[pos : pos + nlen]).decode()
            except UnicodeDecodeError:
                raise self._corrupt("impossible pack name") from None
            if "/" in name or name in (".", "..") or not name.endswith(packs.PACK_SUFFIX):
                raise self._corrupt(f"pack name {name!r} is not a file beside the snapshot")
            pos += nlen
            self.pack_refs.append(packs.PackRef(name, pack_id, size))
        return pos

    def _pack(self, index: int) -> packs.PackReader:
        """The reader of pack `index` of the pack table, opened (and its header checked) on first use."""
        reader = self._packs.get(index)
        if reader is None:
            if index >= len(self.pack_refs):
                raise self._corrupt(f"a record names pack {index}; the table has {len(self.pack_refs)}")
            reader = packs.PackReader(self.path.parent, self.pack_refs[index], self.path, self.private, GUARD)
            self._packs[index] = reader
        return reader

    @property
    def file_check(self) -> int:
        """The trailer's checksum of the file: what names this snapshot in a pool's fill mark (fill.py)."""
        return self._file_check

    def check_whole(self) -> None:
        """SnapshotCorrupt (65) naming the file -- this one or a pack -- that was cut short while it was read
        (a read of its mapping met its end, and read zeros): nothing read from this snapshot is to be used."""
        cut = [str(self.path)] if self._guard is not None and self._guard.gone else []
        if self.base is not None and self.base.check_cut():
            cut.append(str(self.base.path))
        cut += [str(r.path) for r in self._packs.values() if r.cut_short()]
        if cut:
            raise SnapshotCorrupt(f"snapshot {str(self.path)!r}: {cut[0]!r} was cut short while it was read "
                                  "(truncated by another process?); nothing read from it is used")

    def check_cut(self) -> bool:
        """Was this file (or a delta's base; not the packs) cut short while mapped (reads of it since may be
        zeros)?"""
        if self.base is not None and self.base.check_cut():
            return True
        return self._guard is not None and self._guard.gone

    def pack_reader(self, index: int) -> packs.PackReader:
        """Version 3: the reader of pack `index` (opened and checked on first use)."""
        return self._pack(index)

    def pack_fd(self, index: int) -> int:
        """Version 3: a descriptor of pack `index` of its own (the caller closes it)."""
        return os.dup(self._pack(index).fd)

    def open_packs(self) -> None:
        """Open every pack now (versions 3, 4): a missing or damaged one is refused before anything is read."""
        for n in range(len(self.pack_refs)):
            self._pack(n).advise_sequential()

    def check_manifest_file(self) -> None:
        """Versions 3, 4: check the manifest's own checksum (every byte of it; not its records one by one;
        version 4: every section's checksum)."""
        if self.v4 is not None:
            self.v4.verify_sections()
            return
        if self._digest() != self._file_check:
            raise self._corrupt("file checksum mismatch")

    def verify_manifest(self) -> None:
        """Versions 3, 4: check the manifest alone (its checksum, every record's structure), not the packs."""
        self.check_manifest_file()
        if self.v4 is not None:
            self._check_v4_columns()
            return
        count = total = 0
        for rec, _pack, _off in self.references(verify=True):
            count += 1
            total += rec.length
        if count != self.entries or total != self.value_bytes:
            raise self._corrupt(f"trailer says {self.entries} entries / {self.value_bytes} bytes, found {count} / {total}")

    def references(self, verify: bool = False) -> Iterator[tuple["Reference", packs.PackRef, int]]:
        """Version 3: every record of the manifest, with the pack and offset of its value (nothing read from
        the packs); with `verify`, each record's checksum checked."""
        mv = self._mv
        pos = self.records_off
        end = self.size - TRAILER.size
        while pos < end:
            if end - pos < REC_HEAD.size + REC_CHECK.size:
                raise self._corrupt(f"record at byte {pos} is cut short")
            (magic, klen, flags, pack, vlen, created, last_access, expiry, iseq, aseq, count, prio, checksum,
             off) = REC_HEAD.unpack_from(mv, pos)
            kpos = pos + REC_HEAD.size + REC_CHECK.size
            if magic != MAN_MAGIC or not 0 < klen <= MAX_KEY_BYTES or klen > end - kpos:
                raise self._corrupt(f"no record at byte {pos}")
            if pack >= len(self.pack_refs):
                raise self._corrupt(f"record at byte {pos} names pack {pack}; the table has {len(self.pack_refs)}")
            key = bytes(mv[kpos : kpos + klen])
            if verify:
                (rcheck,) = REC_CHECK.unpack_from(mv, pos + REC_HEAD.size)
                if rcheck != xxhash.xxh3_64_intdigest(bytes(mv[pos : pos + REC_HEAD.size]) + key):
                    raise self._corrupt(f"record at byte {pos} fails its checksum")
            yield (Reference(key, flags, vlen, created, last_access, expiry, iseq, aseq, count, prio, checksum, pack),
                   self.pack_refs[pack], off)
            pos = kpos + klen

    def _check_v4_columns(self) -> None:
        """Version 4: what the fill relies on, vectorised: keys inside the blob, packs in the table, the
        entries and bytes the trailer counts (the sections' checksums are checked apart)."""
        v4 = self.v4
        assert v4 is not None
        if isinstance(v4, snapdelta.Combined):
            v4.check_key_blob()
        else:
            manifest.check_key_blob(v4)
        c = v4.cols
        if v4.n and int(c["pack"].max()) >= len(self.pack_refs):
            raise self._corrupt(f"an entry names a pack beyond the table's {len(self.pack_refs)}")
        if isinstance(v4, snapdelta.Combined):  # the bytes of the entries it holds: its base's dropped ones not
            total = int(c["length"][~v4.dropped_mask()].sum(dtype=np.uint64))
        else:
            total = int(c["length"].sum(dtype=np.uint64)) if v4.n else 0
        if total != self.value_bytes:
            raise self._corrupt(f"trailer says {self.value_bytes} value bytes, the entries hold {total}")

    def verify(self) -> None:
        try:
            if self.v4 is not None:
                self.verify_manifest()
                self._verify_v4_values()
                return
            if self.header.version in MANIFESTS:
                self.verify_manifest()
                for _ in self.records(verify=True):  # every value read from its pack and checked
                    pass
                return
            if self._digest() != self._file_check:
                raise self._corrupt("file checksum mismatch")
            # The file hash covers every byte, and the writer checked each value
            # against its checksum before writing it: here only the structure
            # (magic, lengths, header checksums) is left to check.
            self.check_trailer(sum(1 for _ in self.records(verify=True, values=False)), None)
        finally:
            self.check_whole()  # zeros read from a file cut short: say that, not what they looked like

    def _verify_v4_values(self) -> None:
        """Version 4: every value read from its pack and checked against its checksum, a pack at a time in
        the order of its bytes, thousands of values per call (gather_hash: C), no Python per entry."""
        c = self.v4.cols
        held = np.arange(self.v4.n)
        gone = getattr(self.v4, "dropped_mask", None)  # entries a reader has but does not hold (records skips them)
        if gone is not None:
            held = np.flatnonzero(~gone())
        pack = c["pack"][held].astype(np.int64)
        buf = mmap.mmap(-1, VERIFY_BYTES)
        try:
            for index in np.unique(pack).tolist():
                reader = self._pack(index)
                sel = held[pack == index]
                sel = sel[np.argsort(c["offset"][sel], kind="stable")]
                offs, lens = c["offset"][sel].astype(np.uint64), c["length"][sel].astype(np.uint64)
                size = np.uint64(reader.ref.size)
                bad = (offs < np.uint64(packs.HEAD_SIZE)) | (offs > size) | (lens > size - np.minimum(offs, size))
                if bad.any():
                    k = int(np.argmax(bad))
                    raise reader.corrupt(self.path, f"no value of {int(lens[k])} bytes at byte {int(offs[k])}")
                ends = np.cumsum(lens.astype(np.int64))
                k = 0
                while k < sel.size:
                    start = int(ends[k - 1]) if k else 0
                    stop = max(k + 1, int(np.searchsorted(ends, start + VERIFY_BYTES, side="right")))
                    if int(ends[stop - 1]) - start > len(buf):  # one value larger than the buffer
                        buf.close()
                        buf = mmap.mmap(-1, int(ends[stop - 1]) - start)
                    got = np.zeros(stop - k, np.uint64)
                    gather_hash(buf, reader.mv, offs[k:stop], lens[k:stop], got)
                    wrong = got != c["checksum"][sel[k:stop]]
                    if wrong.any():
                        at = int(offs[k + int(np.argmax(wrong))])
                        raise reader.corrupt(self.path, f"the value at byte {at} fails its checksum")
                    k = stop
        finally:
            buf.close()

    def check_trailer(self, count: int, hasher: Any | None) -> None:
        """Compare what a full pass over the records found with the trailer."""
        total = sum(len(r.value) for r in self.records()) if hasher is None else self._seen_bytes
        if self.v4 is not None:
            hasher = None  # its sections' checksums were checked by the pass (records)
        if hasher is not None and hasher.intdigest() != self._file_check:
            raise self._corrupt("file checksum mismatch")
        if count != self.entries or total != self.value_bytes:
            raise self._corrupt(
                f"trailer says {self.entries} entries / {self.value_bytes} bytes, found {count} / {total}"
            )

    def records(self, verify: bool = False, values: bool = True, hasher: Any | None = None) -> Iterator[Record]:
        """The records in file order; with `verify`, check every checksum and length
        (with `values=False`, all but the values' own checksums: the file hash
        covers them -- except in version 3, whose values are in packs and
        always checked).  A `hasher` (xxh3_64) is fed every byte before the
        trailer, for `check_trailer`."""
        if self.v4 is not None:
            yield from self._v4_records(verify)
            return
        if self.header.version == LEGACY_MANIFEST:
            yield from self._pack_records(verify, hasher)
            return
        mv = self._mv
        pos = self.records_off
        end = self.size - TRAILER.size
        self._seen_bytes = 0
        if hasher is not None:
            hasher.update(mv[:pos])
        while pos < end:
            if end - pos < REC_HEAD.size + REC_CHECK.size:
                raise self._corrupt(f"record at byte {pos} is cut short")
            (magic, klen, flags, _r, vlen, created, last_access, expiry, iseq, aseq, count, prio, checksum,
             _r2) = REC_HEAD.unpack_from(mv, pos)
            if magic != REC_MAGIC:
                raise self._corrupt(f"no record at byte {pos}")
            kpos = pos + REC_HEAD.size + REC_CHECK.size
            if not 0 < klen <= MAX_KEY_BYTES or vlen > end - kpos - klen:
                raise self._corrupt(f"record at byte {pos} has impossible lengths")
            key = bytes(mv[kpos : kpos + klen])
            value = mv[kpos + klen : kpos + klen + vlen]
            if verify:
                (rcheck,) = REC_CHECK.unpack_from(mv, pos + REC_HEAD.size)
                if rcheck != xxhash.xxh3_64_intdigest(bytes(mv[pos : pos + REC_HEAD.size]) + key):
                    raise self._corrupt(f"record at byte {pos} fails its checksum")
                if values and xxhash.xxh3_64_intdigest(value) != checksum:
                    raise self._corrupt(f"value of record at byte {pos} fails its checksum")
            if hasher is not None:
                hasher.update(mv[pos : kpos + klen + vlen])
            self._seen_bytes += vlen
            yield Record(key, flags, value, created, last_access, expiry, iseq, aseq, count, prio, checksum)
            pos = kpos + klen + vlen


    def _pack_records(self, verify: bool, hasher: Any | None) -> Iterator[Record]:
        mv = self._mv
        self._seen_bytes = 0
        if hasher is not None:
            hasher.update(mv[: self.records_off])
        pos = self.records_off
        for ref, _pack, off in self.references(verify=verify):
            value = self._pack(ref.pack).value(off, ref.key, ref.length, ref.checksum, self.path, check_value=verify)
            if hasher is not None:
                n = REC_HEAD.size + REC_CHECK.size + len(ref.key)
                hasher.update(mv[pos : pos + n])
                pos += n
            self._seen_bytes += ref.length
            yield Record(ref.key, ref.flags, value, ref.created, ref.last_access, ref.expiry, ref.insert_seq,
                         ref.access_seq, ref.access_count, ref.priority, ref.checksum)

    def _v4_records(self, verify: bool) -> Iterator[Record]:
        """Version 4: the entries in fill order, each value read from its pack (and with `verify` checked);
        the manifest's sections are checked first."""
        v4 = self.v4
        assert v4 is not None
        self.verify_manifest()
        self._seen_bytes = 0
        dropped = v4.dropped_mask() if isinstance(v4, snapdelta.Combined) else None
        for p in range(v4.n):
            if dropped is not None and dropped[p]:
                continue  # a base entry this delta says is gone
            r = v4.row(p)
            key = v4.key(p)
            if key is None:
                raise self._corrupt(f"entry {p}'s key lies outside the key blob")
            value = self._pack(r["pack"]).raw_value(r["offset"], r["length"], r["checksum"], self.path, verify)
            self._seen_bytes += r["length"]
            yield Record(key, r["flags"], value, r["created"], r["last_access"], r["expiry"], r["insert_seq"],
                         r["access_seq"], r["access_count"], r["priority"], r["checksum"])

    def extents(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """Versions 3, 4: every value record this snapshot refers to in its packs, as arrays: (the pack names,
        and per record its pack -- an index into those names -- offset and bytes; version 4: the value's
        bytes alone).  Version 4 reads its columns as they are (no per-entry Python: 1,000,000 entries in
        milliseconds); version 3 walks its records."""
        names = [r.name for r in self.pack_refs]
        if self.v4 is not None:
            c = self.v4.cols
            if self.v4.n and int(c["pack"].max()) >= len(names):
                raise self._corrupt("an entry names a pack beyond the table")
            return (names, c["pack"].astype(np.int64), c["offset"].astype(np.uint64),
                    c["length"].astype(np.uint64))
        rows = [(index, off, packs.REC_SIZE + len(ref.key) + ref.length)
                for ref, _pack, off in self.references() for index in (ref.pack,)]
        got = np.array(rows, np.uint64).reshape(-1, 3)
        return names, got[:, 0].astype(np.int64), got[:, 1], got[:, 2]

    def shared_bytes(self) -> dict[str, int]:
        """Versions 3, 4: the record bytes this snapshot refers to in each pack (by pack name)."""
        names, pack, _off, n = self.extents()
        per = np.bincount(pack, weights=n, minlength=len(names)) if n.size else np.zeros(len(names))
        return {name: int(per[k]) for k, name in enumerate(names) if per[k]}


def followed(path: str) -> Snapshot:
    """The snapshot another process's word names (a pool's fill mark: fill.follow), opened as safefs.FOLLOWED
    (its packs too), and only if it is named as persist names snapshots."""
    name = os.path.basename(path)
    if not name.endswith(SUFFIX) or name.startswith("."):
        raise UsageError(f"{path!r} is not named as a snapshot")
    return Snapshot(path, verify=False, private=safefs.FOLLOWED)


class Reference(NamedTuple):
    """A version 3 manifest's record: an entry's key and metadata, its value in pack `pack` (an index)."""

    key: bytes
    flags: int
    length: int
    created: float
    last_access: float
    expiry: float
    insert_seq: int
    access_seq: int
    access_count: int
    priority: int
    checksum: int
    pack: int


__all__ = ["Snapshot", "SnapshotHeader", "Record", "Reference", "followed", "os_error", "MAGIC", "VERSION", "PLAIN",
           "SELF_CONTAINED", "POLICY_AT", "POLICY_AT_OFFSET",
           "MANIFEST_VERSION", "LEGACY_MANIFEST", "MANIFESTS", "DELTA_VERSION", "READS", "FILE_HEAD", "HEAD_CHECK", "REC_HEAD",
           "REC_CHECK", "TRAILER", "PACK_TABLE", "PACK_ENTRY", "COUNTERS", "SUFFIX", "END_MAGIC", "REC_MAGIC"]
