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
import math
import os
import struct
import threading
import time

from .errors import LockTimeout, UsageError

# struct flock on Linux/x86_64 and aarch64: short l_type, short l_whence,
# off_t l_start, off_t l_len, pid_t l_pid (must be 0 for OFD locks), padded to 32.
_FLOCK = struct.Struct("@hhqqi4x")

METADATA_BYTE = 0
DEFAULT_TIMEOUT = 30.0  # seconds a library call waits for a lock before LockTimeout (exit 75)
TIMEOUT_ENV = "CORTEX_CACHE_LOCK_TIMEOUT"
_SPIN = 20  # non-blocking attempts before a blocking wait (~1 us each)
_YIELDS = 200  # with a timeout: attempts after giving up the core, before sleeping between them
PERSIST_BYTE = 1
# How long a lock that a killed process held may take to go (RecordLock.take_soon): the kernel drops it
# with the last reference to the file, which can come a few milliseconds after the process is reaped.
GONE_HOLDER = 0.1


def default_timeout() -> float:
    """Seconds to wait for a pool's lock when the caller gave no `lock_timeout`.

    CORTEX_CACHE_LOCK_TIMEOUT (seconds; "inf" waits for ever), else 30.
    A holder that stops (SIGSTOP, a debugger, a frozen cgroup) keeps its
    lock; the wait is bounded so the caller gets LockTimeout, not a hang.
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"invalid {TIMEOUT_ENV} {raw!r}: give seconds (> 0), or inf")
    return value


def _flock(kind: int, byte: int) -> bytes:
    return _FLOCK.pack(kind, 0, byte, 1, 0)


class RecordLock:
    """An exclusive OFD lock on one byte of `fd`."""

    __slots__ = ("_fd", "_lock", "_unlock")

    def __init__(self, fd: int, byte: int = METADATA_BYTE) -> None:
        self._fd = fd
        self._lock = _flock(fcntl.F_WRLCK, byte)
        self._unlock = _flock(fcntl.F_UNLCK, byte)

    def take_soon(self) -> bool:
        """Try for a moment (GONE_HOLDER seconds): held, or False if another holder keeps it.  For locks a
        killed process may have held: the kernel can let such a lock go a few milliseconds after the
        process is reaped (when its last reference to the file, its mapping, is dropped in a kernel
        thread), and the one who waited for the kill must not be told the dead one still runs."""
        try:
            self.acquire(GONE_HOLDER)
        except LockTimeout:
            return False
        return True

    def acquire(self, timeout: float | None = None) -> None:
        """Block until held; with `timeout` (seconds), raise LockTimeout after it.

        `timeout=None` waits for ever: only for locks whose holder is this
        process's own code (a creator finishing its pool).  Everyone else
        passes a finite timeout (`default_timeout()`), so a holder that was
        stopped (SIGSTOP, a debugger, a frozen cgroup) costs a LockTimeout,
        never a hang.
        """
        # Critical sections last a few microseconds and the holder is
        # usually running on another core: retrying briefly beats going
        # to sleep in the kernel and paying a wake-up per hand-over.
        for _ in range(_SPIN):
            if self.try_acquire():
                return
        if timeout is None or timeout == math.inf:
            # fcntl releases the GIL while it waits.
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, self._lock)
            return
        deadline = time.monotonic() + timeout
        # The kernel offers no timed wait on record locks.  First yield the
        # core a while (the holder may be waiting for it: hand-overs stay in
        # microseconds), then poll, backing off to 2 ms, so a long wait costs
        # little CPU.
        for _ in range(_YIELDS):
            os.sched_yield()
            if self.try_acquire():
                return
        delay = 50e-6
        while True:
            time.sleep(delay)
            if self.try_acquire():
                return
            if time.monotonic() >= deadline:
                raise LockTimeout(
                    f"lock not acquired within {timeout:g}s (held by another process, "
                    f"perhaps stopped; {TIMEOUT_ENV} sets the wait)"
                )
            delay = min(delay * 2, 0.002)

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


__all__ = ["RecordLock", "PoolLock", "METADATA_BYTE", "PERSIST_BYTE", "DEFAULT_TIMEOUT", "TIMEOUT_ENV", "default_timeout"]
