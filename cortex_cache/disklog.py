"""Storage for the disk tier: a bounded ring of preallocated files of checksummed records.

This is the disk tier's storage engine; disktier.py puts it under a pool
(spill on eviction, promote on a miss, the shared index in the segment).

Directory layout (a fixed number of files, whatever the number of entries)::

    DIR/cortex-tier.meta    META (4096 bytes): magic, version, file count and
                            size, alignment, then the shared append cursor;
                            at 64 the owner (the shm name of the pool, NUL padded)
    DIR/tier-00.log ...     FILES data files of file_size bytes each,
                            reserved with posix_fallocate at create

Every record starts on an ALIGN (4096) boundary, so the files can also be
written with O_DIRECT::

    0   4s  magic b"CDSK"      4  u16 version (1)   6 u16 flags (bit 0: str key)
    8   u32 key length         12 u32 reserved
    16  u64 value length       24 u64 seq (unique, increasing across the log)
    32  f64 expiry (0 never)   40 i64 priority
    48  u64 xxh3_64 of the value
    56  u64 xxh3_64 of bytes 0..55 plus the key
    64  key, value, zero padding to the next ALIGN boundary

Appends go round the files in order.  The cursor (file, offset, next seq)
lives in the meta file and is advanced under an OFD lock on it, so any
number of processes can append; each then writes its record outside the
lock.  When the cursor enters a file, that file's old records are gone: the
ring drops what was spilled longest ago (entries read back are promoted to
memory and spilled again later, so it is least-recently-used by spill).
A location handed out earlier is checked on every read (magic, seq, key,
checksums): an overwritten one reads as stale, a damaged one as corrupt;
neither ever returns wrong bytes.  `scan` finds every intact record again
after a restart.  A record whose entry was deleted, replaced or promoted is
killed (its magic becomes b"CDSX"), so a restart never brings it back.
A spill is written with the magic b"CDSP" (pending) and confirmed (b"CDSK")
only once its index entry is still current; the header checksum is always
computed with b"CDSK", so confirming rewrites 4 bytes and nothing else.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import xxhash

from . import safefs
from .errors import CannotCreate, CortexCacheError, NoSpace, SegmentCorrupt, StorageIOError, UsageError
from .layout import MAX_KEY_BYTES
from .lock import RecordLock, default_timeout

META_NAME = "cortex-tier.meta"
META_MAGIC = b"CRTXTIER"
META = struct.Struct("<8sIIQQ QQQ")  # magic, version, files, file_size, align | cursor file, offset, next seq
META_SIZE = 4096
CURSOR_OFF = struct.calcsize("<8sIIQQ")  # where the cursor (file, offset, next seq) starts
VERSION = 1
FILES = 16
ALIGN = 4096
REC_MAGIC = b"CDSK"
DEAD_MAGIC = b"CDSX"  # a killed record: skipped by scan, stale to read
# A spill written outside the pool lock, not yet confirmed under it: skipped by scan and stale to
# read until `confirm` turns it into REC_MAGIC, so a record whose entry was deleted while it was
# being written never comes back after a restart, even if its writer died before it could say so.
PENDING_MAGIC = b"CDSP"
OWNER_OFF, OWNER_BYTES = 64, 256
_SCAN_CHUNK = 4 << 20
REC = struct.Struct("<4sHHII QQ dq Q")
REC_CHECK = struct.Struct("<Q")
HEAD = REC.size + REC_CHECK.size
assert HEAD == 64


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Location:
    """Where a record was written: file number, offset, length on disk, its seq."""

    file: int
    offset: int
    length: int
    seq: int


@dataclass(frozen=True)
class Found:
    key: bytes
    value: bytes
    seq: int
    expiry: float
    priority: int
    flags: int = 0
    checksum: int = 0  # xxh3_64 of the value, as checked


@dataclass(frozen=True)
class Scanned:
    """One record found by `scan`."""

    key: bytes
    loc: Location
    expiry: float
    priority: int
    flags: int
    value_len: int


class _Window:
    """Reads a file through a large buffer, so a scan does not pread 64 bytes at a time."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.base, self.buf = 0, memoryview(b"")

    def get(self, off: int, n: int) -> memoryview:
        if not (self.base <= off and off + n <= self.base + len(self.buf)):
            self.base = off
            self.buf = memoryview(os.pread(self.fd, max(n, min(_SCAN_CHUNK, self.size - off)), off))
        return self.buf[off - self.base : off - self.base + n]


STALE = "stale"  # the location was overwritten since: an ordinary miss
CORRUPT = "corrupt"  # the bytes there fail their checksums: a counted, reported miss


class DiskLog:
    """A disk tier directory, open in this process."""

    def __init__(self, directory: Path, meta_fd: int, files: int, file_size: int, o_direct: bool) -> None:
        self.directory = directory
        self._meta_fd = meta_fd
        self.files = files
        self.file_size = file_size
        self._lock = RecordLock(meta_fd, 0)
        self._fds: list[tuple[int, bool]] = []
        self._plain: list[int] = []
        try:
            for i in range(files):
                self._fds.append(self._open_data(i, o_direct))
                size = os.fstat(self._fds[-1][0]).st_size
                if size != file_size:  # a damaged meta file must not send a scan past the end
                    raise SegmentCorrupt(
                        f"disk tier in {str(directory)!r}: tier-{i:02d}.log has {size} bytes, its meta file says "
                        f"{file_size}"
                    )
        except BaseException:
            self.close()
            raise
        self.o_direct = o_direct and all(d for _, d in self._fds)  # _plain: buffered fds, opened when needed
        self.last_scan_corrupt = 0

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls, directory: str | os.PathLike, capacity: int, o_direct: bool = False, mode: int = 0o600
    ) -> "DiskLog":
        """Make a new tier of `capacity` bytes in `directory`; reserve the space now.

        The directory is created 0700 (0770 and files 0660 when `mode`, the
        pool's, shares it with the group); an existing one must be ours and
        not writable by others (safefs.check_dir).  Raises NoSpace (exit 73)
        when the filesystem lacks the room, PermissionDenied (77) for a
        directory or file another user controls, UsageError when the
        directory already holds a tier or the capacity is too small.
        """
        d = Path(directory)
        file_size = DiskLog.capacity_for(capacity) // FILES
        if capacity < FILES * ALIGN * 2:
            raise UsageError(f"disk tier of {capacity} bytes is too small: at least {FILES * ALIGN * 2}")
        new_dirs = safefs.make_dir(d, mode, "disk tier directory")  # removed again if we fail
        st = os.statvfs(d)
        if st.f_bavail * st.f_frsize < file_size * FILES:
            safefs.remove_dirs(new_dirs)
            raise NoSpace(f"not enough disk in {str(d)!r} for a {capacity}-byte tier")
        fmode = mode & 0o660
        try:
            meta_fd = safefs.open_file(d / META_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL, fmode, "disk tier file")
        except CortexCacheError:
            safefs.remove_dirs(new_dirs)
            raise
        except FileExistsError:
            raise UsageError(f"{str(d)!r} already holds a disk tier; open it instead") from None
        except OSError as e:
            safefs.remove_dirs(new_dirs)
            raise safefs.os_error(e, f"cannot create a disk tier in {str(d)!r}") from None
        made = [d / META_NAME]
        try:
            for i in range(FILES):
                path = d / f"tier-{i:02d}.log"
                try:
                    fd = safefs.open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, fmode, "disk tier file")
                except CortexCacheError:
                    raise
                except FileExistsError:
                    raise CannotCreate(
                        f"{str(d)!r} holds a stray {path.name} but no tier: remove it, or choose another --disk-path"
                    ) from None
                except OSError as e:
                    raise safefs.os_error(e, f"cannot create {str(path)!r}") from None
                made.append(path)
                try:
                    os.fchmod(fd, fmode)  # O_CREAT applied the umask
                    _reserve(fd, file_size)
                finally:
                    os.close(fd)
            os.fchmod(meta_fd, fmode)
            header = META.pack(META_MAGIC, VERSION, FILES, file_size, ALIGN, 0, 0, 1)
            os.pwrite(meta_fd, header.ljust(META_SIZE, b"\0"), 0)
            os.fsync(meta_fd)
        except BaseException as e:
            os.close(meta_fd)
            for p in made:
                p.unlink(missing_ok=True)
            safefs.remove_dirs(new_dirs)
            if isinstance(e, OSError) and not isinstance(e, CortexCacheError):
                raise safefs.os_error(e, f"cannot create a disk tier in {str(d)!r}") from None
            raise
        try:
            return cls(d, meta_fd, FILES, file_size, o_direct)
        except BaseException:  # out of descriptors opening the files, say: a failed create leaves nothing
            for p in made:  # (the handle closed meta_fd)
                p.unlink(missing_ok=True)
            safefs.remove_dirs(new_dirs)
            raise

    @classmethod
    def open(cls, directory: str | os.PathLike, o_direct: bool = False) -> "DiskLog":
        """Open an existing tier; SegmentCorrupt (65) if it is not one of ours, PermissionDenied (77)
        if another user owns or can write its directory or files."""
        d = Path(directory)
        try:
            meta_fd = safefs.open_file(d / META_NAME, os.O_RDWR, 0, "disk tier file")
        except CortexCacheError:
            raise
        except FileNotFoundError:
            raise StorageIOError(f"no disk tier in {str(d)!r}") from None
        except OSError as e:
            raise safefs.os_error(e, f"cannot open the disk tier in {str(d)!r}") from None
        try:
            # The meta file's mode says whether the tier was made shared with the group.
            safefs.check_dir(d, os.fstat(meta_fd).st_mode & 0o777, "disk tier directory")
            raw = os.pread(meta_fd, META.size, 0)
        except BaseException:
            os.close(meta_fd)
            raise
        if len(raw) < META.size or raw[:8] != META_MAGIC:
            os.close(meta_fd)
            raise SegmentCorrupt(f"{str(d)!r} does not hold a cortex disk tier")
        _, version, files, file_size, align, *_ = META.unpack(raw)
        if version != VERSION or files != FILES or align != ALIGN or file_size % ALIGN or file_size < 2 * ALIGN:
            os.close(meta_fd)
            raise SegmentCorrupt(f"disk tier in {str(d)!r} has an unknown layout (version {version})")
        return cls(d, meta_fd, files, file_size, o_direct)

    @staticmethod
    def exists(directory: str | os.PathLike) -> bool:
        return os.path.lexists(Path(directory) / META_NAME)  # a planted symlink counts: open refuses it

    def owner(self) -> str:
        raw = os.pread(self._meta_fd, OWNER_BYTES, OWNER_OFF)
        return raw.rstrip(b"\0").decode("utf-8", "replace")

    def set_owner(self, owner: str) -> None:
        raw = owner.encode()[:OWNER_BYTES]
        os.pwrite(self._meta_fd, raw.ljust(OWNER_BYTES, b"\0"), OWNER_OFF)
        os.fsync(self._meta_fd)

    @property
    def capacity(self) -> int:
        return self.files * self.file_size

    @staticmethod
    def capacity_for(size: int) -> int:
        """The capacity `create(size)` gives (whole aligned files)."""
        return _round_up(size // FILES) * FILES

    @staticmethod
    def destroy(directory: str | os.PathLike) -> None:
        """Remove a tier's files (and its directory if that leaves it empty)."""
        d = Path(directory)
        for i in range(FILES):
            (d / f"tier-{i:02d}.log").unlink(missing_ok=True)
        (d / META_NAME).unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:
            pass  # not empty: someone else's files live there too

    def _open_data(self, i: int, o_direct: bool) -> tuple[int, bool]:
        path = self.directory / f"tier-{i:02d}.log"
        if o_direct and hasattr(os, "O_DIRECT"):
            try:
                return self._open_file(path, os.O_RDWR | os.O_DIRECT), True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: the filesystem has no O_DIRECT
                    raise safefs.os_error(e, f"cannot open {str(path)!r}") from None
        return self._open_file(path, os.O_RDWR), False

    @staticmethod
    def _open_file(path: Path, flags: int) -> int:
        try:
            return safefs.open_file(path, flags, 0, "disk tier file")
        except CortexCacheError:
            raise
        except FileNotFoundError:
            raise SegmentCorrupt(f"disk tier file {str(path)!r} is missing") from None
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise
            raise safefs.os_error(e, f"cannot open {str(path)!r}") from None

    def close(self) -> None:
        for fd, _ in self._fds:
            os.close(fd)
        for fd in self._plain:
            os.close(fd)
        self._fds, self._plain = [], []
        if self._meta_fd >= 0:
            os.close(self._meta_fd)
            self._meta_fd = -1

    def __enter__(self) -> "DiskLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ append

    @staticmethod
    def record_length(key_len: int, value_len: int) -> int:
        """Bytes a record of this key and value takes on disk."""
        return _round_up(HEAD + key_len + value_len)

    def reserve(self, length: int) -> tuple[int, int, int]:
        """Advance the shared cursor by `length`; return (file, offset, seq).

        An offset of 0 means the cursor just entered that file: every record
        still in it is about to be overwritten, so forget them first.
        """
        if length > self.file_size:
            raise UsageError(f"record of {length} bytes is larger than a disk tier file ({self.file_size})")
        self._lock.acquire(default_timeout())  # a stopped appender costs a LockTimeout, never a hang
        try:
            cur_file, cur_off, seq = struct.unpack("<QQQ", os.pread(self._meta_fd, 24, CURSOR_OFF))
            if cur_off + length > self.file_size:
                cur_file, cur_off = (cur_file + 1) % self.files, 0  # the next file's old records go
            if cur_file >= self.files:  # a damaged cursor: start over rather than write out of bounds
                cur_file, cur_off = 0, 0
            os.pwrite(self._meta_fd, struct.pack("<QQQ", cur_file, cur_off + length, seq + 1), CURSOR_OFF)
            return cur_file, cur_off, seq
        finally:
            self._lock.release()

    def write(
        self, file: int, off: int, seq: int, key: bytes, value, expiry: float = 0.0, priority: int = 0,
        flags: int = 0, pending: bool = False, checksum: int | None = None,
    ) -> Location:
        """Write one record at a place `reserve` handed out (`pending`: as PENDING_MAGIC, for `confirm`).

        `checksum`: the value's xxh3_64 when the caller knows it already."""
        value = memoryview(value).cast("B")
        length = _round_up(HEAD + len(key) + value.nbytes)
        if checksum is None:
            checksum = xxhash.xxh3_64_intdigest(value)
        head = REC.pack(REC_MAGIC, VERSION, flags, len(key), 0, value.nbytes, seq, expiry, priority, checksum)
        head += REC_CHECK.pack(xxhash.xxh3_64_intdigest(head + key))
        if pending:
            head = PENDING_MAGIC + head[4:]
        fd, direct = self._fds[file]
        if direct:
            buf = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT needs
            try:
                buf[: HEAD + len(key)] = head + key
                buf[HEAD + len(key) : HEAD + len(key) + value.nbytes] = value
                _pwrite_all(fd, memoryview(buf), off)
            finally:
                buf.close()
        else:
            _pwrite_all(fd, memoryview(head + key), off)
            _pwrite_all(fd, value, off + HEAD + len(key))
        return Location(file, off, length, seq)

    def append(self, key: bytes, value, expiry: float = 0.0, priority: int = 0, flags: int = 0) -> Location:
        """Reserve and write one record; return its location.  Safe from many processes at once."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise UsageError(f"keys must be 1 to {MAX_KEY_BYTES} bytes long")
        nbytes = memoryview(value).nbytes
        length = _round_up(HEAD + len(key) + nbytes)
        if length > self.file_size:
            raise UsageError(f"value of {nbytes} bytes is larger than a disk tier file ({self.file_size})")
        file, off, seq = self.reserve(length)
        return self.write(file, off, seq, key, value, expiry, priority, flags)

    def kill(self, loc: Location) -> None:
        """Mark the record at `loc` dead (if it is still that record), so no scan finds it again."""
        if not (0 <= loc.file < self.files and 0 <= loc.offset and loc.offset + HEAD <= self.file_size):
            return
        fd = self._plain_fd(loc.file)
        head = os.pread(fd, HEAD, loc.offset)
        if len(head) == HEAD and head[:4] == REC_MAGIC and REC.unpack_from(head)[6] == loc.seq:
            # The magic and the header checksum both go: one damaged byte cannot revive the record.
            os.pwrite(fd, DEAD_MAGIC + head[4 : REC.size] + bytes(REC_CHECK.size), loc.offset)

    def confirm(self, loc: Location) -> None:
        """Turn the pending record at `loc` into a live one (its writer checked, under the pool lock,
        that the place is still its own)."""
        os.pwrite(self._plain_fd(loc.file), REC_MAGIC, loc.offset)

    def _plain_fd(self, file: int) -> int:
        fd, direct = self._fds[file]
        if not direct:
            return fd
        if not self._plain:
            self._plain = [self._open_file(self.directory / f"tier-{i:02d}.log", os.O_RDWR)
                           for i in range(self.files)]
        return self._plain[file]

    # ------------------------------------------------------------------ read

    def read(self, loc: Location, key: bytes | None) -> Found | str:
        """The record at `loc` if it is still `key`'s and intact; else STALE or CORRUPT.

        `key=None` accepts whatever key the record holds (verify uses it)."""
        if not (0 <= loc.file < self.files and 0 <= loc.offset and loc.offset + loc.length <= self.file_size):
            return CORRUPT
        fd, direct = self._fds[loc.file]
        if direct:
            buf = mmap.mmap(-1, loc.length)
            try:
                n = os.preadv(fd, [buf], loc.offset)
                data = bytes(buf[:n])
            finally:
                buf.close()
        else:
            data = os.pread(fd, loc.length, loc.offset)
        return _parse(data, loc.seq, key)

    def read_key(self, loc: Location, key_len: int) -> bytes | None:
        """The key of the record at `loc` if it is still there and its header checks out."""
        if not (0 <= loc.file < self.files and 0 <= loc.offset and loc.offset + loc.length <= self.file_size):
            return None
        data = os.pread(self._plain_fd(loc.file), HEAD + key_len, loc.offset)
        if len(data) < HEAD + key_len or data[:4] != REC_MAGIC:
            return None
        fields = REC.unpack_from(data)
        (hcheck,) = REC_CHECK.unpack_from(data, REC.size)
        if fields[6] != loc.seq or fields[3] != key_len:
            return None
        if hcheck != xxhash.xxh3_64_intdigest(data[: REC.size] + data[HEAD : HEAD + key_len]):
            return None
        return data[HEAD : HEAD + key_len]

    # ------------------------------------------------------------------ recovery

    def scan(self) -> Iterator["Scanned"]:
        """Every intact, live record in the tier, file by file (reads the whole tier once).

        Records that fail their checksums are skipped and counted in
        `last_scan_corrupt`; killed records are skipped silently.
        """
        self.last_scan_corrupt = 0
        for file in range(self.files):
            win = _Window(self._plain_fd(file), self.file_size)
            off = 0
            while off + HEAD <= self.file_size:
                head = win.get(off, HEAD)
                magic = head[:4]
                if magic != REC_MAGIC and magic != DEAD_MAGIC and magic != PENDING_MAGIC:
                    off += ALIGN  # never written, or torn: look at the next boundary
                    continue
                _, version, flags, klen, _, vlen, seq, expiry, prio, vcheck = REC.unpack_from(head)
                (hcheck,) = REC_CHECK.unpack_from(head, REC.size)
                length = _round_up(HEAD + klen + vlen)
                if not 0 < klen <= MAX_KEY_BYTES or off + length > self.file_size or version != VERSION:
                    off += ALIGN
                    continue
                if magic == DEAD_MAGIC:
                    # Killed: its checksum is gone on purpose; step over it by its length.
                    off += length if hcheck == 0 else ALIGN
                    continue
                key = bytes(win.get(off + HEAD, klen))
                if hcheck != xxhash.xxh3_64_intdigest(REC_MAGIC + bytes(head[4 : REC.size]) + key):
                    off += ALIGN  # a stray magic inside some value, or a torn header
                    continue
                if magic == PENDING_MAGIC:
                    off += length  # never confirmed: its entry may have been deleted meanwhile
                    continue
                if xxhash.xxh3_64_intdigest(win.get(off + HEAD + klen, vlen)) != vcheck:
                    self.last_scan_corrupt += 1
                else:
                    yield Scanned(key, Location(file, off, length, seq), expiry, prio, flags, vlen)
                off += length

    def usage(self) -> dict[str, int]:
        cur_file, cur_off, seq = struct.unpack("<QQQ", os.pread(self._meta_fd, 24, CURSOR_OFF))
        return {"capacity": self.files * self.file_size, "files": self.files, "file_size": self.file_size,
                "cursor_file": cur_file, "cursor_offset": cur_off, "next_seq": seq}


def _parse(data: bytes, seq: int, key: bytes | None) -> Found | str:
    if len(data) < HEAD or data[:4] != REC_MAGIC:
        return STALE  # overwritten, or killed
    _, version, rflags, klen, _, vlen, rseq, expiry, prio, vcheck = REC.unpack_from(data)
    if key is None:  # a check of whatever record is there (verify)
        key = data[HEAD : HEAD + klen]
    if rseq != seq or klen != len(key):
        return STALE  # another record lives here now
    (hcheck,) = REC_CHECK.unpack_from(data, REC.size)
    if version != VERSION or HEAD + klen + vlen > len(data):
        return CORRUPT
    if hcheck != xxhash.xxh3_64_intdigest(data[: REC.size] + data[HEAD : HEAD + klen]):
        return CORRUPT
    if data[HEAD : HEAD + klen] != key:
        return STALE
    value = data[HEAD + klen : HEAD + klen + vlen]
    if xxhash.xxh3_64_intdigest(value) != vcheck:
        return CORRUPT
    return Found(key, value, rseq, expiry, prio, rflags, vcheck)


def _pwrite_all(fd: int, data: memoryview, off: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], off + done)


def _reserve(fd: int, size: int) -> None:
    """Allocate `size` bytes for real (so a full disk fails now, not mid-spill)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(f"not enough disk for the tier ({size} bytes per file)") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise StorageIOError(f"cannot reserve disk tier space: {e.strerror}") from None
        os.ftruncate(fd, size)  # a filesystem without fallocate: sparse, best effort


__all__ = ["DiskLog", "Location", "Found", "Scanned", "STALE", "CORRUPT", "FILES", "ALIGN"]

