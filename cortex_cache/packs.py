"""Pack files: the value bytes of incremental snapshots, written once and shared between them.

A persist into the snapshot directory (snapshot.py) writes a manifest -- every
live entry's key and metadata, each pointing at its value's bytes in a pack --
and a pack of the values that no snapshot it keeps already holds.  A value is
held when a kept manifest records the same key, length and checksum.  Packs
are never changed once written: a persist adds one (or none), retention
deletes the packs no kept manifest refers to, and compaction stops reusing a
pack that is mostly bytes no kept snapshot refers to any more: the records
still needed are copied into the new pack, the kept manifests rewritten to
point at the copies, and the old pack deleted (snapshot.py, `_Incremental`).

Pack format, versions 1 and 2.  All integers little-endian::

    pack header  PACK_HEAD (64 bytes)
      0   8s  magic b"CRTXPACK"   8  u32 version (2; 1)   12 u32 header size (64)
      16  f64 created             24 u64 pack id (the persist's time, microseconds)
      32  24 bytes reserved (zero)
      56  u64 xxh3_64 of bytes 0..55
    records, anywhere after the header (manifests give their offsets):
      PACK_REC (32 bytes), key, value
      0   4s  magic b"CPRC"       4  u32 key length     8  u64 value length
      16  u64 xxh3_64 of the value
      24  u64 xxh3_64 of bytes 0..23 of this head plus the key
    version 2 (what persist writes since manifest version 4): the values alone,
      back to back after the header; a version 4 manifest gives each value's
      offset, length and checksum (manifest.py), and a version 4 manifest may
      name values in version 1 packs too (by the offset of the value itself)

A pack has no trailer: it is complete when a manifest that names it (with its
size) is in place, and a manifest is renamed into place only after its packs
were written, flushed to disk and renamed into place themselves.  Reading a
version 1 record checks its head against what the manifest says (key, length,
checksum); every value is checked against its checksum.

Files, in the snapshot directory, for the pool whose namespaced name is STEM::

    STEM-<UTC time>.ccpack          a pack (the time of the persist that wrote it)
    .STEM-<UTC time>.ccpack.tmp-XX  one being written (swept by the next persist)
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import xxhash

from . import safefs
from .errors import CortexCacheError, SnapshotCorrupt
from .layout import MAX_KEY_BYTES

PACK_MAGIC = b"CRTXPACK"
PACK_VERSION = 2  # what is written: values back to back
PACK_READS = (1, 2)
PACK_SUFFIX = ".ccpack"
PACK_HEAD = struct.Struct("<8sII d Q 24x")
PACK_HEAD_CHECK = struct.Struct("<Q")
PACK_REC = struct.Struct("<4sI Q Q")
PACK_REC_CHECK = struct.Struct("<Q")
REC_MAGIC = b"CPRC"
assert PACK_HEAD.size + PACK_HEAD_CHECK.size == 64 and PACK_REC.size + PACK_REC_CHECK.size == 32
HEAD_SIZE = 64
REC_SIZE = 32

# A pack that the snapshots kept after a persist refer to for less than this share of its bytes is
# compacted by that persist: the records they need are copied into its new pack, they are pointed at the
# copies, and the pack goes.  So no more than a third of any pack is bytes nothing refers to, and the space
# stays within 1.5x of what the kept snapshots hold.  The price is writes: measured with keep 3 and a
# random 5% of the values replaced between persists, 2.5x the changed bytes on average (0.5: 1.7x, but
# up to 1.75x the space).
COMPACT_BELOW = 2 / 3
_STAMP_RE = r"\d{8}T\d{6}\.\d{6}Z"


def pack_name(stem: str, stamp: str) -> str:
    """The file name of the pack a persist stamped `stamp` writes for pool files `stem`."""
    return f"{stem}-{stamp}{PACK_SUFFIX}"


def packs_of(stem: str, directory: Path) -> list[Path]:
    """The packs of pool files `stem` in `directory`, oldest first."""
    pattern = re.compile(r"^" + re.escape(stem) + "-" + _STAMP_RE + re.escape(PACK_SUFFIX) + r"$")
    try:
        return sorted(p for p in directory.iterdir() if pattern.match(p.name))
    except (FileNotFoundError, NotADirectoryError):
        return []


def temp_pattern(stem: str) -> re.Pattern:
    """Temp files of packs being written for pool files `stem` (a killed persist's leftovers)."""
    return re.compile(r"^\." + re.escape(stem) + "-" + _STAMP_RE + re.escape(PACK_SUFFIX) + r"\.tmp-[0-9a-f]{12}$")


class PackWriter:
    """A pack being written: records appended, then `finish` (flush, fsync, rename into place) or `discard`."""

    def __init__(self, path: Path, pack_id: int, created: float, mode: int, writer_class: Any) -> None:
        self.path = path
        self.tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(6)}"
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        if mode != 0o600:
            os.fchmod(fd, mode)
        self._raw = os.fdopen(fd, "wb", buffering=1 << 20)
        self._out = writer_class(self._raw)  # snapshot.WriteBehind: writeback started as it goes
        head = PACK_HEAD.pack(PACK_MAGIC, PACK_VERSION, HEAD_SIZE, created, pack_id)
        self._out.write(head + PACK_HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(head)))
        self.size = HEAD_SIZE
        self.records = 0

    def add(self, values: Any, count: int) -> int:
        """Append `count` values, back to back in `values` (a buffer: the caller knows each one's length and
        checksum); the offset of the first."""
        off = self.size
        n = memoryview(values).nbytes
        self._out.write(values)
        self.size += n
        self.records += count
        return off

    def finish(self) -> None:
        """Make the pack durable under its real name (the caller fsyncs the directory before any manifest
        that names it is renamed into place)."""
        self._out.finish()
        os.fsync(self._raw.fileno())
        self._raw.close()
        os.rename(self.tmp, self.path)

    def discard(self) -> None:
        try:
            self._raw.close()
        except OSError:
            pass
        for p in (self.tmp, self.path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


@dataclass
class PackRef:
    """A pack as a manifest names it: its file (in the manifest's directory), id and size."""

    name: str
    pack_id: int
    size: int


class PackReader:
    """A pack mapped read-only, its header and size checked against what its manifest says."""

    def __init__(self, directory: Path, ref: PackRef, manifest: Path, private: bool | str, guard: Any = None) -> None:
        """`private`: as safefs.open_read takes it.  `guard`: the type that fences a mapping against SIGBUS
        (core.GUARD; None: unfenced), so that a pack cut short while it is read gives zeros and `cut_short`,
        never a dead process."""
        self.path = directory / ref.name
        self.ref = ref
        self._guard = None
        try:
            fd = safefs.open_read(self.path, private, "snapshot pack")
        except CortexCacheError:
            raise
        except FileNotFoundError:
            raise SnapshotCorrupt(f"snapshot {str(manifest)!r} is missing its pack {str(self.path)!r}") from None
        except OSError as e:
            raise SnapshotCorrupt(f"snapshot {str(manifest)!r}: cannot read its pack {str(self.path)!r}: "
                                  f"{e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != ref.size or ref.size < HEAD_SIZE:
                raise self.corrupt(manifest, f"its size is {st.st_size} bytes, the manifest says {ref.size}")
            self.untrusted = safefs.written_by_us(fd, self.path)
            self._mm = mmap.mmap(fd, ref.size, access=mmap.ACCESS_READ)
            self._guard = guard(self._mm) if guard is not None else None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd  # kept for the background fill's preads (fill.py)
        self.mv = memoryview(self._mm)
        head = bytes(self.mv[: PACK_HEAD.size])
        magic, version, hsize, _created, pack_id = PACK_HEAD.unpack(head)
        self.version = version
        (check,) = PACK_HEAD_CHECK.unpack_from(self.mv, PACK_HEAD.size)
        if magic != PACK_MAGIC or version not in PACK_READS or hsize != HEAD_SIZE or pack_id != ref.pack_id or \
                check != xxhash.xxh3_64_intdigest(head):
            self.close()
            raise self.corrupt(manifest, "its header is damaged or belongs to another pack")

    def corrupt(self, manifest: Path, why: str) -> SnapshotCorrupt:
        return SnapshotCorrupt(f"snapshot {str(manifest)!r}: pack {str(self.path)!r} is damaged ({why})")

    def value(self, off: int, key: bytes, vlen: int, checksum: int, manifest: Path, check_value: bool) -> memoryview:
        """The value of the record at `off`, which must be `key`'s, `vlen` bytes, with `checksum`."""
        end = self.ref.size
        if off < HEAD_SIZE or off > end - REC_SIZE:
            raise self.corrupt(manifest, f"no record at byte {off}")
        if vlen > end - off - REC_SIZE - len(key):
            raise self.corrupt(manifest, f"the record at byte {off} is not the one the manifest names")
        self.check_head(self.mv[off : off + REC_SIZE + len(key)], off, key, vlen, checksum, manifest)
        kpos = off + REC_SIZE
        value = self.mv[kpos + len(key) : kpos + len(key) + vlen]
        if check_value and xxhash.xxh3_64_intdigest(value) != checksum:
            raise self.corrupt(manifest, f"the value of the record at byte {off} fails its checksum")
        return value

    def raw_value(self, off: int, vlen: int, checksum: int, manifest: Path, check_value: bool) -> memoryview:
        """The `vlen` value bytes at `off` (a version 4 manifest's word: the value itself, in a pack of either
        version), bounds-checked; with `check_value` checked against `checksum`."""
        if off < HEAD_SIZE or off > self.ref.size or vlen > self.ref.size - off:
            raise self.corrupt(manifest, f"no value of {vlen} bytes at byte {off}")
        value = self.mv[off : off + vlen]
        if check_value and xxhash.xxh3_64_intdigest(value) != checksum:
            raise self.corrupt(manifest, f"the value at byte {off} fails its checksum")
        return value

    def check_head(self, head: Any, off: int, key: bytes, vlen: int, checksum: int, manifest: Path) -> None:
        """Check the record head and key in `head` (the bytes at `off`) against what the manifest says."""
        magic, klen, rvlen, rcks = PACK_REC.unpack_from(head, 0)
        if magic != REC_MAGIC or klen != len(key) or rvlen != vlen or rcks != checksum or \
                not 0 < klen <= MAX_KEY_BYTES:
            raise self.corrupt(manifest, f"the record at byte {off} is not the one the manifest names")
        (hcheck,) = PACK_REC_CHECK.unpack_from(head, PACK_REC.size)
        if bytes(head[REC_SIZE : REC_SIZE + klen]) != key or \
                hcheck != xxhash.xxh3_64_intdigest(bytes(head[: PACK_REC.size]) + key):
            raise self.corrupt(manifest, f"the record at byte {off} fails its checksum")

    def cut_short(self) -> bool:
        """Did a read of this pack's mapping meet its end (the file truncated since it was opened)?  What was
        read from it since may be zeros: the caller throws it away."""
        g = self._guard
        if g is not None and g.gone:
            return True
        try:  # a read the kernel made for us (a pwrite from the mapping) fails with EFAULT instead: look
            return self.fd >= 0 and os.fstat(self.fd).st_size < self.ref.size
        except OSError:
            return True

    def advise_sequential(self) -> None:
        try:
            self._mm.madvise(mmap.MADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)
        guard, self._guard = getattr(self, "_guard", None), None
        if guard is not None:
            guard.close()  # before the unmap: its addresses may be reused
        mv, self.mv = getattr(self, "mv", None), None
        if mv is not None:
            try:
                mv.release()
                self._mm.close()
            except BufferError:
                pass  # a value view is still alive: the mapping goes when the last one does


def live_share(sizes: dict[str, int], referenced: dict[str, int]) -> dict[str, float]:
    """Per pack name, the share of its record bytes that `referenced` (record bytes by pack) covers."""
    return {name: referenced.get(name, 0) / max(1, size - HEAD_SIZE) for name, size in sizes.items()}


def remove_unreferenced(stem: str, directory: Path, referenced: Iterable[str]) -> int:
    """Delete the packs of `stem` that no name in `referenced` names; the bytes freed.  Runs under the
    pool's persist lock, after retention: every kept manifest's packs are in `referenced`."""
    keep = set(referenced)
    freed = 0
    for p in packs_of(stem, directory):
        if p.name in keep:
            continue
        try:
            st = p.stat(follow_symlinks=False)
            if st.st_uid != os.geteuid():
                continue  # not ours: never touched
            p.unlink()
            freed += st.st_size
        except OSError:
            pass
    return freed


def sweep_temps(stem: str, directory: Path) -> None:
    """Remove the temp packs a killed persist of this pool left (under its persist lock)."""
    pattern = temp_pattern(stem)
    try:
        for entry in os.scandir(directory):
            if pattern.match(entry.name):
                try:
                    if entry.stat(follow_symlinks=False).st_uid == os.geteuid():
                        os.unlink(entry.path)
                except OSError:
                    pass
    except OSError:
        pass


__all__ = ["PACK_HEAD", "PACK_REC", "PACK_SUFFIX", "COMPACT_BELOW", "PackRef", "PackReader", "PackWriter",
           "live_share", "pack_name", "packs_of", "remove_unreferenced", "sweep_temps"]
