"""The pool lock: an OFD record lock on the segment, plus an optional thread lock.

Why an open-file-description lock (`F_OFD_SETLKW`) and not a POSIX semaphore:
the kernel drops an OFD lock the moment its holder dies, so a process killed
while holding it can never wedge the pool, whereas a semaphore stays taken
forever.  OFD locks belong to an open file description, not to a process, so
two `Pool` handles in one process exclude each other; threads sharing one
handle share its description, which is why multi-threaded mode puts a
`threading.Lock` in front.

Different byte offsets of the segment serve as independent locks: byte 0 is
the metadata lock; byte 1 is reserved for persist (one at a time per pool).
"""

from __future__ import annotations

import errno
import fcntl
import struct
import threading
import time

from .errors import LockTimeout

# struct flock on Linux/x86_64 and aarch64: short l_type, short l_whence,
# off_t l_start, off_t l_len, pid_t l_pid (must be 0 for OFD locks), padded to 32.
_FLOCK = struct.Struct("@hhqqi4x")

METADATA_BYTE = 0
_SPIN = 20  # non-blocking attempts before a blocking wait (~1 us each)
PERSIST_BYTE = 1


def _flock(kind: int, byte: int) -> bytes:
    return _FLOCK.pack(kind, 0, byte, 1, 0)


class RecordLock:
    """An exclusive OFD lock on one byte of `fd`."""

    __slots__ = ("_fd", "_lock", "_unlock")

    def __init__(self, fd: int, byte: int = METADATA_BYTE) -> None:
        self._fd = fd
        self._lock = _flock(fcntl.F_WRLCK, byte)
        self._unlock = _flock(fcntl.F_UNLCK, byte)

    def acquire(self, timeout: float | None = None) -> None:
        """Block until held; with `timeout` (seconds), raise LockTimeout after it."""
        if timeout is None:
            # Critical sections last a few microseconds and the holder is
            # usually running on another core: retrying briefly beats going
            # to sleep in the kernel and paying a wake-up per hand-over.
            for _ in range(_SPIN):
                try:
                    fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, self._lock)
                    return
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
            # fcntl releases the GIL while it waits.
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, self._lock)
            return
        if self.try_acquire():
            return
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            # The kernel offers no timed wait on record locks; poll with
            # a short backoff.  Only callers that asked for a timeout pay this.
            time.sleep(delay)
            if self.try_acquire():
                return
            if time.monotonic() >= deadline:
                raise LockTimeout(f"lock not acquired within {timeout:g}s (held by another process)")
            delay = min(delay * 2, 0.05)

    def try_acquire(self) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, self._lock)
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise

    def release(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, self._unlock)


class PoolLock:
    """Metadata lock of one pool handle: thread lock (optional) then record lock."""

    __slots__ = ("record", "thread")

    def __init__(self, fd: int, multi_threaded: bool) -> None:
        self.record = RecordLock(fd, METADATA_BYTE)
        self.thread = threading.Lock() if multi_threaded else None

    def acquire(self, timeout: float | None = None) -> None:
        t = self.thread
        if t is not None:
            if not t.acquire(timeout=-1 if timeout is None else timeout):
                raise LockTimeout(f"lock not acquired within {timeout:g}s (held by another thread)")
        try:
            self.record.acquire(timeout)
        except BaseException:
            if t is not None:
                t.release()
            raise

    def release(self) -> None:
        self.record.release()
        if self.thread is not None:
            self.thread.release()


__all__ = ["RecordLock", "PoolLock", "METADATA_BYTE", "PERSIST_BYTE"]
