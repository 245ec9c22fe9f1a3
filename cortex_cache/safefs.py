"""Files and directories another user may have planted: open them without trusting them.

The disk tier and the snapshot directory hold users' prompts.  A directory
someone else can write lets them swap a file we are about to open for a
symlink to any file we may write (or a file of theirs we would then read as
ours).  So every file of ours is opened with O_NOFOLLOW and checked on the
open descriptor (regular file, owned by us), and every directory is checked
before use (owned by us, not writable by others, by the group only where the
pool's mode shares it with the group).  Refusals are PermissionDenied (77);
a file where a directory should be is CannotCreate (73).
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import (
    OUT_OF_FILES, CannotCreate, OutputExists, PermissionDenied, StorageIOError, UsageError, too_many_open_files,
)


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
        raise os_error(e, f"cannot inspect {what} {os.fspath(path)!r}") from None
    p = os.fspath(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CannotCreate(f"{what} {p!r} is not a directory: a file is in the way")
    if st.st_uid != os.geteuid():
        raise PermissionDenied(f"{what} {p!r} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}): refused")
    allowed = 0o020 if mode & 0o060 else 0
    loose = st.st_mode & 0o022 & ~allowed
    if loose:
        raise PermissionDenied(
            f"{what} {p!r} is writable by {'others' if loose & 0o002 else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): refused; chmod it {dir_mode(mode):04o}"
        )


def check_tree(anchor: str | os.PathLike, path: str | os.PathLike, mode: int = 0o600,
               what: str = "directory") -> None:
    """Refuse (PermissionDenied) `path` if a component of it below `anchor` is a symlink or not ours alone.

    `anchor` is where the trusted part of the path ends (the state
    directory, which may be shared with other users if it is sticky, like
    /tmp: one writable by others without the sticky bit is refused): each
    component from there down to `path` is opened without following
    symlinks and checked on its descriptor, owned by us and writable by
    nobody else (the last one by the group too where `mode` shares the pool
    with it).  A component that is not a directory is CannotCreate (73),
    whether it is `path` itself or one of its parents.  Missing components
    pass: the caller creates them (and checks again) or finds nothing there.
    """
    a = os.path.abspath(os.fspath(anchor))
    p = os.path.abspath(os.fspath(path))
    rel = os.path.relpath(p, a)
    if rel == ".":
        parts: list[str] = []
    elif rel.startswith(".."):
        raise ValueError(f"{p!r} is not below {a!r}")
    else:
        parts = rel.split(os.sep)
    try:
        fd = os.open(a, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise CannotCreate(f"{what} {p!r}: {a!r} is not a directory: a file is in the way") from None
    except OSError as e:
        raise os_error(e, f"cannot inspect {what} {p!r}") from None
    here = a
    try:
        if not parts:
            _check_dir_fd(fd, p, p, mode, what)
        else:
            st = os.fstat(fd)
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                # Shared like /tmp is fine (sticky: nobody may rename what is ours in it); shared without
                # the sticky bit, anyone could swap our directory in it for a symlink after we checked it.
                raise PermissionDenied(
                    f"{what} {p!r}: {a!r} is writable by others without the sticky bit "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}): refused; chmod it o-w or +t"
                )
        for i, part in enumerate(parts):
            here = os.path.join(here, part)
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise os_error(e, f"cannot inspect {what} {p!r}") from None
                try:
                    link = stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
                except OSError:
                    link = False
                if link:
                    raise PermissionDenied(f"{what} {p!r}: {here!r} is a symbolic link: refused") from None
                raise CannotCreate(f"{what} {p!r}: {here!r} is not a directory: a file is in the way") from None
            os.close(fd)
            fd = nxt
            _check_dir_fd(fd, here, p, mode if i == len(parts) - 1 else 0o600, what)
    finally:
        os.close(fd)


def _check_dir_fd(fd: int, here: str, path: str, mode: int, what: str) -> None:
    st = os.fstat(fd)
    where = f"{what} {path!r}" + ("" if here == path else f": {here!r}")
    if st.st_uid != os.geteuid():
        raise PermissionDenied(f"{where} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}): refused")
    loose = st.st_mode & 0o022 & ~(0o020 if mode & 0o060 else 0)
    if loose:
        raise PermissionDenied(
            f"{where} is writable by {'others' if loose & 0o002 else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): refused; chmod it {dir_mode(mode):04o}"
        )


def written_by_us(fd: int, path: str | os.PathLike, root_too: bool = False) -> str | None:
    """None if the open file `fd` (found at `path`) is one only this user could have written; else why not.

    Only this user: the file is ours and writable by nobody else, and so is
    the directory that holds it (read again now: `path`'s directory as it
    resolves, checked on a descriptor of its own).  What such a file says
    this user said; anything else may come from another user.  `root_too`:
    root's files and directories pass as well (root can change ours anyway).
    """
    st = os.fstat(fd)
    me = os.geteuid()
    owners = (me, 0) if root_too else (me,)
    if st.st_uid not in owners:
        return f"it belongs to uid {st.st_uid}, not to us (uid {me})"
    if st.st_mode & 0o022:
        return f"others may write it (mode {stat.S_IMODE(st.st_mode):04o})"
    d = os.path.dirname(os.path.realpath(os.fspath(path)))
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return f"its directory {d!r} cannot be inspected ({e.strerror})"
    try:
        dst = os.fstat(dfd)
        try:
            again = os.stat(os.path.basename(os.path.realpath(os.fspath(path))), dir_fd=dfd, follow_symlinks=False)
        except OSError:
            again = None
    finally:
        os.close(dfd)
    if again is None or (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
        return f"it is no longer in {d!r}"
    if dst.st_uid not in owners:
        return f"its directory {d!r} belongs to uid {dst.st_uid}"
    if dst.st_mode & 0o022:
        return f"others may write its directory {d!r} (mode {stat.S_IMODE(dst.st_mode):04o})"
    return None


# Directories that are never a pool's own (a disk tier fills its directory with files of its own).
SYSTEM_DIRS = frozenset({
    "/", "/bin", "/boot", "/dev", "/dev/shm", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media",
    "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/usr/bin", "/usr/lib",
    "/usr/local", "/usr/sbin", "/usr/share", "/var", "/var/lib", "/var/log", "/var/tmp", "/var/cache", "/var/run",
})


def unsafe_dir(path: str) -> str | None:
    """Why the absolute, normalised `path` must never hold a pool's files (a system directory, a home), or None."""
    if path in SYSTEM_DIRS:
        return f"{path!r} is a system directory"
    home = os.path.expanduser("~")
    if home not in ("", "/") and path == os.path.normpath(home):
        return f"{path!r} is a home directory"
    return None


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
            raise os_error(e, f"cannot create {what} {d!r}") from None
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


def open_file(path: str | os.PathLike, flags: int, mode: int = 0o600, what: str = "file",
              root_too: bool = False) -> int:
    """`os.open` that never follows a symlink and returns only a regular file owned by us (or by root, with
    `root_too`).

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
        check_fd(fd, p, what, root_too)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_fd(fd: int, path: str, what: str = "file", root_too: bool = False) -> os.stat_result:
    """Refuse an open descriptor that is not a regular file owned by us (or by root, with `root_too`)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise PermissionDenied(f"{what} {path!r} is not a regular file: refused")
    if st.st_uid != os.geteuid() and not (root_too and st.st_uid == 0):
        raise PermissionDenied(f"{what} {path!r} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}): refused")
    return st


# `private` of open_read (snapshot.Snapshot, packs.PackReader): a file that another process's word names (a
# pool's fill mark, fill.py), followed only if this process would trust it as its own.
FOLLOWED = "followed"


def open_read(path: str | os.PathLike, private: bool | str, what: str) -> int:
    """Open a snapshot's file to read (O_NONBLOCK: a FIFO's open would wait for a writer).  `private`: False
    any file; True one of ours, never through a symlink; FOLLOWED one of ours or root's, never through a
    symlink, that nobody else may write, in a directory nobody else may write (written_by_us): otherwise
    PermissionDenied (77).  The OSErrors of `os.open` pass through."""
    flags = os.O_RDONLY | os.O_NONBLOCK
    if not private:
        return os.open(path, flags | os.O_CLOEXEC)
    followed = private == FOLLOWED
    fd = open_file(path, flags, 0, what, root_too=followed)
    why = written_by_us(fd, path, root_too=True) if followed else None
    if why:
        os.close(fd)
        raise PermissionDenied(f"{what} {os.fspath(path)!r} is not followed: {why}")
    return fd


def os_error(e: OSError, what: str) -> Exception:
    """The library's error for a failed file operation on our own files (disklog.py uses it too)."""
    if e.errno in OUT_OF_FILES:
        return too_many_open_files(what, e)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"{what}: {e.strerror}")
    return StorageIOError(f"{what}: {e.strerror}")


def refuse_existing(path: str, replace: bool) -> None:
    """OutputExists (73) for a name that is taken, unless `replace`.  A directory, a device or a FIFO is
    never replaced (UsageError): a rename over /dev/null would replace the device itself."""
    try:
        st = os.stat(path)  # what a write would reach, through a symbolic link
    except FileNotFoundError:  # nothing there, or a dangling link (which `replace` replaces)
        st = None
    except OSError as e:
        raise os_error(e, f"cannot inspect {path!r}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path!r} is a directory; give a file name")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path!r} is not a regular file; give a file name")
    if not replace and os.path.lexists(path):
        raise OutputExists(f"{path!r} already exists; remove it first or give --force to replace it")


def publish(tmp: str, path: str, replace: bool) -> None:
    """Give the complete file `tmp` the name `path`: rename over it with `replace`, else a hard link that
    fails if the name was taken meanwhile (no window in which a file made by someone else is replaced)."""
    if replace:
        os.rename(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise OutputExists(f"{path!r} already exists; remove it first or give --force to replace it") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        # A filesystem without hard links (vfat, some FUSE): checked just now, then renamed.
        refuse_existing(path, False)
        os.rename(tmp, path)
        return
    os.unlink(tmp)


__all__ = ["check_dir", "check_tree", "written_by_us", "unsafe_dir", "SYSTEM_DIRS", "make_dir", "remove_dirs",
           "open_file", "open_read", "FOLLOWED", "check_fd", "dir_mode", "os_error", "refuse_existing", "publish"]
