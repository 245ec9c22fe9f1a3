"""POSIX shared-memory segments: names, create, open, map, unlink, list.

This module knows nothing of the layout inside a segment; it turns a pool name
into an shm object, makes the memory real before anyone relies on it, and maps
every OSError it meets into the library's exceptions.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass

import posix_ipc

from .errors import (
    OUT_OF_FILES,
    InvalidName,
    NoSpace,
    PermissionDenied,
    PoolExists,
    PoolNotFound,
    SegmentCorrupt,
    ServiceUnavailable,
    StorageIOError,
    UsageError,
    too_many_open_files,
)
from .units import format_size

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "cortex-cache."
PREFIX_ENV = "CORTEX_CACHE_SHM_PREFIX"
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap does not name it

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # shm_open's, and never a symlink or FIFO


def validate_name(name: str) -> str:
    """Return `name` if it is a valid pool name, else raise InvalidName."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidName(
            f"invalid pool name {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


def prefix() -> str:
    """The segment name prefix in force (CORTEX_CACHE_SHM_PREFIX)."""
    p = os.environ.get(PREFIX_ENV, DEFAULT_PREFIX)
    if p == "":
        # An empty prefix would make every segment in /dev/shm (other programs' too) look like a pool
        # to `list`, and `delete --force` could remove them.
        raise UsageError(f"{PREFIX_ENV} is set but empty: unset it for the default ({DEFAULT_PREFIX}), "
                         "or give 1-128 characters from A-Z a-z 0-9 . _ -")
    if not _PREFIX_RE.fullmatch(p):
        raise UsageError(f"invalid {PREFIX_ENV} {p!r}: use 1-128 characters from A-Z a-z 0-9 . _ -")
    return p


def shm_name(name: str) -> str:
    return "/" + prefix() + validate_name(name)


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, prefix() + validate_name(name))


def _check_shm_available() -> None:
    if not os.path.isdir(SHM_DIR):
        raise ServiceUnavailable(f"{SHM_DIR} is not available on this machine")


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


@dataclass
class Segment:
    """An open, mapped shared-memory segment."""

    name: str
    fd: int
    mm: mmap.mmap
    size: int

    @classmethod
    def create(
        cls, name: str, size: int, mode: int = 0o600, reserve: bool = True, reserve_head: int = 0
    ) -> "Segment":
        """Create and map a new segment of `size` bytes; its memory is reserved unless `reserve` is False
        (then only its first `reserve_head` bytes, the metadata the creator writes, are).

        On any failure the segment is unlinked before the error is raised; a
        size the system cannot give (too large for the address space, or the
        memory) is NoSpace (73).
        """
        _check_shm_available()
        if reserve:
            free = shm_free_bytes()
            if size > free:
                raise NoSpace(
                    f"not enough shared memory for pool {name!r}: needs {format_size(size)}, "
                    f"{SHM_DIR} has {format_size(free)} free"
                )
        try:
            # What shm_open(O_CREAT | O_EXCL) does, with an errno to tell a full descriptor table by.
            fd = os.open(shm_path(name), _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, mode & 0o777)
        except FileExistsError:
            raise PoolExists(f"pool {name!r} already exists") from None
        except OSError as e:
            raise _open_error(e, name, f"cannot create pool {name!r}") from None
        try:
            os.fchmod(fd, mode & 0o777)  # shm_open applies the umask; we want exactly `mode`
            if reserve:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise NoSpace(
                            f"not enough shared memory for pool {name!r}: needs {format_size(size)}"
                        ) from None
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.ftruncate(fd, size)
            else:
                os.ftruncate(fd, size)
                if reserve_head:
                    # Even a sparse pool's metadata is real memory: create writes it now, and a
                    # page it could not get would be a SIGBUS inside create.
                    _reserve_range(fd, min(reserve_head, size), name)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as e:
            os.close(fd)
            _unlink_quietly(shm_name(name))
            if isinstance(e, (OverflowError, ValueError)) or (
                isinstance(e, OSError) and e.errno in (errno.ENOMEM, errno.EFBIG, errno.ENOSPC, errno.EINVAL)
            ):
                raise NoSpace(f"cannot create pool {name!r} of {format_size(size)}: {_why(e)}") from None
            if isinstance(e, OSError) and not isinstance(e, (NoSpace, PermissionDenied)):
                raise StorageIOError(f"cannot create pool {name!r}: {e.strerror or e}") from e
            raise
        return cls(name, fd, mm, size)

    @classmethod
    def open(cls, name: str) -> "Segment":
        """Open and map an existing segment (its layout is checked by the caller).

        PoolNotFound (66), PermissionDenied (77), SegmentCorrupt (65) for
        something that is not a regular file (a symlink, a directory, a FIFO),
        TooManyOpenFiles (75) when out of file descriptors.  Its owner is not
        checked here: see `check_owner`.
        """
        _check_shm_available()
        squatter = squatter_kind(name)
        if squatter:
            raise SegmentCorrupt(
                f"{shm_path(name)} is {squatter}, not a pool segment; remove it with `cortex cache delete --force {name}`"
            )
        try:
            fd = os.open(shm_path(name), _OPEN_FLAGS)
        except OSError as e:
            raise _open_error(e, name, f"cannot open pool {name!r}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # swapped for something else since we looked
                raise SegmentCorrupt(f"{shm_path(name)} is not a regular file, not a pool segment")
            size = st.st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        except OSError as e:
            os.close(fd)
            if e.errno in OUT_OF_FILES:
                raise too_many_open_files(f"cannot map pool {name!r}", e) from None
            raise StorageIOError(f"cannot map pool {name!r}: {e.strerror or e}") from e
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mm, size)  # type: ignore[arg-type]

    def prefault(self) -> None:
        """Fault every page in for writing now, so first puts run at memory speed."""
        try:
            self.mm.madvise(MADV_POPULATE_WRITE)
        except OSError:
            # Older kernels: touch one byte per page (the segment is still all zeros).
            import numpy as np

            view = np.frombuffer(self.mm, dtype=np.uint8)
            view[:: mmap.PAGESIZE] = 0
            del view

    def populate(self, off: int, length: int) -> bool:
        """Map [off, off+length) into this process's page tables now, contents untouched (the pages exist: a
        reserved segment); False where the kernel cannot (before 5.14), leaving first touches to fault.
        Holds the GIL throughout: Core.populate prefers the fast path's, which lets it go."""
        try:
            self.mm.madvise(MADV_POPULATE_WRITE, off, length)
        except OSError:
            return False
        return True

    def stat(self) -> os.stat_result:
        return os.fstat(self.fd)

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None  # type: ignore[assignment]
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def unmap(self) -> None:
        """`close`, where a buffer exported from the mapping may still be alive somewhere (a numpy array made
        from a view): then the descriptor goes now and the mapping when that buffer does."""
        try:
            self.close()
        except BufferError:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


def _open_error(e: OSError, name: str, what: str) -> Exception:
    """The library's error for an open(2) of pool `name`'s path that failed with `e`."""
    if e.errno == errno.ENOENT:
        return PoolNotFound(f"no pool named {name!r}")
    if e.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"permission denied: {what}")
    if e.errno in OUT_OF_FILES:
        return too_many_open_files(what, e)
    if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENOTDIR):  # swapped since we looked
        return SegmentCorrupt(f"{shm_path(name)} is not a pool segment ({_why(e)})")
    if e.errno in (errno.ENOSPC, errno.ENOMEM):
        return NoSpace(f"{what}: {_why(e)}")
    return StorageIOError(f"{what}: {_why(e)}")


def _why(e: BaseException) -> str:
    if isinstance(e, OverflowError):
        return "larger than this system can address"
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def _reserve_range(fd: int, nbytes: int, name: str) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise NoSpace(f"not enough shared memory for pool {name!r}: {SHM_DIR} is full") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def squatter_kind(name: str) -> str | None:
    """What sits on pool `name`'s path if it is not a regular file (a symlink, a directory...); else None."""
    try:
        st = os.lstat(shm_path(name))
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"unreadable ({_why(e)})"
    if stat.S_ISREG(st.st_mode):
        return None
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    return "not a regular file"


def remove_squatter(name: str) -> str:
    """Remove what squats on pool `name`'s path (a symlink, a directory, ...) if it is ours; say what it was.

    Only the name goes: a symlink is unlinked, never followed; a directory is
    removed only when empty.  PermissionDenied (77) if another user's.
    """
    path = shm_path(name)
    kind = squatter_kind(name) or "a file"
    st = os.lstat(path)
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        raise PermissionDenied(f"{path} is {kind} of uid {st.st_uid}, not ours: not removed")
    try:
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            raise PermissionDenied(f"cannot remove {path}: {e.strerror}") from None
        raise StorageIOError(f"cannot remove {path} ({kind}): {e.strerror}") from None
    return kind


def _unlink_quietly(path: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(path)
    except posix_ipc.ExistentialError:
        pass


def unlink(name: str) -> None:
    """Remove the segment of pool `name`; PoolNotFound if there is none."""
    _check_shm_available()
    try:
        posix_ipc.unlink_shared_memory(shm_name(name))
    except posix_ipc.ExistentialError:
        raise PoolNotFound(f"no pool named {name!r}") from None
    except posix_ipc.PermissionsError:
        raise PermissionDenied(f"permission denied removing pool {name!r}") from None


def publish(staging: str, name: str) -> None:
    """Give segment `staging` the name `name` as well, atomically; PoolExists if taken.

    A hard link in /dev/shm (POSIX has no shm rename): the new name appears
    with the complete pool behind it, or not at all.  The caller unlinks
    `staging` afterwards.
    """
    try:
        os.link(shm_path(staging), shm_path(name))
    except FileExistsError:
        raise PoolExists(f"pool {name!r} already exists") from None
    except PermissionError:
        raise PermissionDenied(f"permission denied creating pool {name!r}") from None


def replace(staging: str, name: str) -> None:
    """Give segment `staging` the name `name` in place of the segment there now, atomically.

    A rename within /dev/shm: a process opening `name` finds the old segment
    or the new one, never neither and never a mix.  Processes that have the
    old one mapped keep it (as after `unlink`) until they close it.
    """
    try:
        os.rename(shm_path(staging), shm_path(name))
    except PermissionError:
        raise PermissionDenied(f"permission denied replacing pool {name!r}") from None
    except OSError as e:
        raise StorageIOError(f"cannot replace pool {name!r}: {e.strerror or e}") from None


def still_named(seg: "Segment") -> bool:
    """Is the open segment still the one under its name (not replaced by a rename, nor unlinked)?  A stat of
    the name against an fstat of the descriptor: for the rare moment a handle finds its segment marked
    superseded (Pool.superseded), never on a hot path."""
    try:
        named = os.stat(shm_path(seg.name))
    except OSError:
        return False
    here = os.fstat(seg.fd)
    return (named.st_dev, named.st_ino) == (here.st_dev, here.st_ino)


def exists(name: str) -> bool:
    """Whether anything, pool or not, holds pool `name`'s path (a dangling symlink included)."""
    return os.path.lexists(shm_path(name))


def attached_pids(name: str) -> list[int]:
    """Pids of processes that have pool `name` mapped (as lsof would find them).

    Only processes whose /proc/PID/maps this user may read are seen.  For
    many pools at once use `attached_map`, which reads /proc once.
    """
    validate_name(name)
    return attached_map().get(name, [])


def attached_map() -> dict[str, list[int]]:
    """{pool name: pids that have it mapped} for every segment under the current prefix, from one pass
    over /proc (a pass per pool would cost O(pools x processes x mappings))."""
    return mapped_generations()[0]


def mapped_generations() -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """({pool name: pids that have the segment now under the name mapped}, {pool name: pids that still map
    a segment the name had before: replaced by restore --replace, or deleted}), from one pass over /proc."""
    needle = (SHM_DIR + "/" + prefix()).encode()
    live: dict[str, set[int]] = {}
    old: dict[str, set[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/maps", "rb") as f:
                data = f.read()
        except OSError:
            continue
        pid = int(entry.name)
        at = data.find(needle)
        while at >= 0:
            end = data.find(b"\n", at)
            if end < 0:
                end = len(data)
            rest = data[at + len(needle) : end].rstrip()
            if data[at - 1 : at] == b" " and rest:
                # A mapping of an unlinked segment ends " (deleted)": a generation the name had before.
                name, _, tail = rest.partition(b" ")
                if not tail:
                    live.setdefault(name.decode("utf-8", "replace"), set()).add(pid)
                elif tail == b"(deleted)":
                    old.setdefault(name.decode("utf-8", "replace"), set()).add(pid)
            at = data.find(needle, end)
    return ({n: sorted(p) for n, p in live.items()}, {n: sorted(p) for n, p in old.items()})


@dataclass(frozen=True)
class Listed:
    """A segment under the current prefix, as `scan` found it (lstat, never followed)."""

    name: str
    uid: int
    mtime: float
    ctime: float

    @property
    def ours(self) -> bool:
        return self.uid == os.geteuid()


def scan() -> list[Listed]:
    """Every regular file under the current prefix whose rest is a valid pool name, sorted by name:
    one directory pass, no segment opened."""
    _check_shm_available()
    p = prefix()
    out = []
    for entry in os.scandir(SHM_DIR):
        if entry.name.startswith(p) and _NAME_RE.fullmatch(entry.name[len(p):]):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed while we looked
                continue
            if stat.S_ISREG(st.st_mode):
                out.append(Listed(entry.name[len(p):], st.st_uid, st.st_mtime, st.st_ctime))
    return sorted(out, key=lambda e: e.name)


def list_names() -> list[str]:
    """Names of every segment under the current prefix that is a valid pool name."""
    return [e.name for e in scan()]


# ---------------------------------------------------------------- whose pool is it


def trusted_owner(uid: int) -> bool:
    """Whether a segment of `uid` may be used on this user's behalf unasked: it is ours, or root's.

    Root's pools are trusted because root can change any of ours anyway, and a
    service run as root that makes a 0660/0666 pool for its users is a real use.
    """
    return uid == os.geteuid() or uid == 0


def _user(uid: int) -> str:
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _refuse_owner(name: str, uid: int) -> PermissionDenied:
    return PermissionDenied(
        f"pool {name!r} belongs to {_user(uid)}, not to you: not used on your behalf (another user may have "
        f"taken the name first); delete it, use your own {PREFIX_ENV}, or pass --allow-other-owner "
        "(allow_other_owner=True) if you trust that user"
    )


def check_owner(seg: "Segment", allow_other_owner: bool = False) -> None:
    """PermissionDenied (77) unless the open segment (fstat of its descriptor) is ours or root's, or
    `allow_other_owner`.  For the paths that open a pool by name on a user's behalf (create --if-missing,
    restore, the engine adapters); a plain open of a named pool (a group pool, 0660) is not checked."""
    uid = os.fstat(seg.fd).st_uid
    if not allow_other_owner and not trusted_owner(uid):
        raise _refuse_owner(seg.name, uid)


def check_owner_of(name: str, allow_other_owner: bool = False) -> None:
    """check_owner for pool `name` without mapping it (restore --if-missing, which leaves a pool alone).

    Nothing there, or not a regular file: nothing to check (the caller's own
    open says what is wrong)."""
    if allow_other_owner:
        return
    try:
        fd = os.open(shm_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in OUT_OF_FILES:
            raise too_many_open_files(f"cannot open pool {name!r}", e) from None
        try:  # unreadable to us: its owner by name (it is not ours to use either way)
            st = os.lstat(shm_path(name))
        except OSError:
            return
        if stat.S_ISREG(st.st_mode) and not trusted_owner(st.st_uid):
            raise _refuse_owner(name, st.st_uid) from None
        return
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if stat.S_ISREG(st.st_mode) and not trusted_owner(st.st_uid):
        raise _refuse_owner(name, st.st_uid)


# Unmaps left to threads (unmap_in_background) that may still run: wait_unmapped joins them.
_UNMAPPING: set[threading.Thread] = set()
_UNMAPPING_LOCK = threading.Lock()


def _unmap_and_forget(seg: Segment) -> None:
    try:
        seg.unmap()
    finally:
        with _UNMAPPING_LOCK:
            _UNMAPPING.discard(threading.current_thread())


def unmap_in_background(seg: Segment) -> bool:
    """Unmap `seg` on a thread of its own (Core.close of a segment that lost its name: the unmap that frees
    its memory takes ~0.3 s per GiB); False if no thread can start (the interpreter is shutting down)."""
    unmapping = threading.Thread(target=_unmap_and_forget, args=(seg,), name="cortex-unmap", daemon=True)
    with _UNMAPPING_LOCK:
        _UNMAPPING.add(unmapping)
    try:
        unmapping.start()
    except RuntimeError:
        with _UNMAPPING_LOCK:
            _UNMAPPING.discard(unmapping)
        return False
    return True


def wait_unmapped(timeout: float | None = None) -> bool:
    """Wait until the unmaps `unmap_in_background` started are done (a process that checks it no longer maps
    an old copy: the tests, a tool reading /proc); False if `timeout` ran out."""
    with _UNMAPPING_LOCK:
        running = list(_UNMAPPING)
    for t in running:
        t.join(timeout)
    return not any(t.is_alive() for t in running)


__all__ = ["Segment", "validate_name", "prefix", "shm_name", "shm_path", "unlink", "replace", "still_named", "exists", "squatter_kind", "remove_squatter", "list_names", "attached_pids",
           "attached_map", "mapped_generations", "Listed", "scan", "trusted_owner", "check_owner", "check_owner_of",
           "unmap_in_background", "wait_unmapped"]
