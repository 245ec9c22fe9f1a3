"""Files and directories another user may have planted: open them without trusting them.

The disk tier and the snapshot directory hold users' prompts.  A directory
someone else can write lets them swap a file we are about to open for a
symlink to any file we may write (or a file of theirs we would then read as
ours).  So every file of ours is opened with O_NOFOLLOW and checked on the
open descriptor (regular file, owned by us), and every directory is checked
before use (owned by us, not writable by others, by the group only where the
pool's mode shares it with the group).  Refusals are PermissionDenied (77).
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import PermissionDenied, StorageIOError


def dir_mode(mode: int) -> int:
    """Permission bits for a directory we create for a pool of `mode`: 0700, or 0770 when shared with the group."""
    return 0o770 if mode & 0o060 else 0o700


def check_dir(path: str | os.PathLike, mode: int = 0o600, what: str = "directory") -> None:
    """Refuse (PermissionDenied) a directory not owned by us, or writable by others beyond `mode`.

    `mode` is the pool's mode: with group bits in it the group may write the
    directory too; others never may.  A missing directory passes (the caller
    creates it, or fails to find it, as it would anyway).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise _os_error(e, f"cannot inspect {what} {os.fspath(path)!r}") from None
    p = os.fspath(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionDenied(f"{what} {p!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise PermissionDenied(f"{what} {p!r} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}): refused")
    allowed = 0o020 if mode & 0o060 else 0
    loose = st.st_mode & 0o022 & ~allowed
    if loose:
        raise PermissionDenied(
            f"{what} {p!r} is writable by {'others' if loose & 0o002 else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): refused; chmod it {dir_mode(mode):04o}"
        )


def make_dir(path: str | os.PathLike, mode: int = 0o600, what: str = "directory") -> list[str]:
    """Create `path` (and missing parents) with `dir_mode(mode)`, then `check_dir` it.

    Returns the directories it created, deepest first, so a caller that fails
    later can remove them again.
    """
    p = os.path.abspath(os.fspath(path))
    made: list[str] = []
    q = p
    while not os.path.lexists(q):
        made.append(q)
        q = os.path.dirname(q)
    for d in reversed(made):
        try:
            # Parents get ordinary permissions; the leaf is ours alone (or our group's).
            os.mkdir(d, dir_mode(mode) if d == p else 0o755)
        except FileExistsError:
            continue  # made meanwhile by someone else: check_dir judges it
        except OSError as e:
            remove_dirs(made)
            raise _os_error(e, f"cannot create {what} {d!r}") from None
    if p in made:
        os.chmod(p, dir_mode(mode))  # mkdir applied the umask
    try:
        check_dir(p, mode, what)
    except BaseException:
        remove_dirs(made)
        raise
    return made


def remove_dirs(dirs: list[str]) -> None:
    """Remove directories we created (deepest first), as long as they are empty."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            return


def open_file(path: str | os.PathLike, flags: int, mode: int = 0o600, what: str = "file") -> int:
    """`os.open` that never follows a symlink and returns only a regular file owned by us.

    Raises PermissionDenied for a symlink, a non-regular file or another
    user's file; the OSErrors of `os.open` itself (FileNotFoundError,
    FileExistsError, ...) pass through for the caller to name.
    """
    p = os.fspath(path)
    try:
        fd = os.open(p, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionDenied(f"{what} {p!r} is a symbolic link: refused") from None
        raise
    try:
        check_fd(fd, p, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_fd(fd: int, path: str, what: str = "file") -> os.stat_result:
    """Refuse an open descriptor that is not a regular file owned by us."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise PermissionDenied(f"{what} {path!r} is not a regular file: refused")
    if st.st_uid != os.geteuid():
        raise PermissionDenied(f"{what} {path!r} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}): refused")
    return st


def _os_error(e: OSError, what: str) -> Exception:
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"{what}: {e.strerror}")
    return StorageIOError(f"{what}: {e.strerror}")


__all__ = ["check_dir", "make_dir", "remove_dirs", "open_file", "check_fd", "dir_mode"]
