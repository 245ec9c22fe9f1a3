"""Pinning a pool's memory in pieces, on a thread of its own: CUDA host registration (gpu.pin_memory) and mlock.

Pinning a mapping costs about 0.1 s per GiB (the kernel faults in and locks
every page), so pinning a whole pool in one call would block the process that
attaches for minutes on a pool of a terabyte, and one `cudaHostRegister` of
512 GiB or more fails outright (NVIDIA drivers from r580 build one page table
per call, capped at 2 GiB). So a `Pinning` registers this handle's mapping of
the pool's data region piece by piece (`PIECE`, 1 GiB, by default), in address
order, on a thread of its own, and the caller goes on at once:

- `pinned_bytes` of `total_bytes` are pinned so far (always a prefix of the
  data region: pieces go in order); `covers(off, n)` says whether a range of
  the segment is; `done` once the thread has finished (all pieces, or stopped
  by an error or by close), `complete` if every piece is pinned, `error` the
  one-line reason it stopped early, `wait(timeout)` blocks until done.
- Each piece is usable as soon as it is registered. A copy must not span two
  pieces (CUDA refuses a copy over memory partly registered and partly not,
  and batched copies over two registrations), so `cuts(off, n)` splits a range
  where pieces meet; gpu.py's copies go through it. A copy of a piece not yet
  registered is a pageable copy: correct, slower.
- A piece that fails (`cudaErrorMemoryAllocation`, mlock over RLIMIT_MEMLOCK)
  stops the thread: the error is recorded and logged once, the pieces before
  it stay pinned and usable, and nothing is raised into the engine's threads.
  (A failed cudaHostRegister also leaves a pending error on the thread that
  called it; here that is the pinning thread, never one of the engine's.)
- `close()` (run by `pool.close()`, before the unmap) stops the thread after
  the piece it is on, waits for it, and unregisters every piece registered,
  in reverse order, and nothing else.

`mlock(pool)` is the host's equivalent, with the same machinery: it keeps the
pool's pages in RAM (tmpfs pages can be swapped out) and maps them into this
process. It is opt-in: an unprivileged process may lock only RLIMIT_MEMLOCK
bytes (`ulimit -l`, often 8 MiB) unless it has CAP_IPC_LOCK. Mapping the pool
without locking it is `Pool.populate(background=True)`, which the engine
adapters already run at attach; it has nothing to undo and no limit to hit,
so it needs none of this. cudaHostRegister and mlock fault in the pages they
pin themselves.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import resource
import threading
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from .errors import PoolClosed, ServiceUnavailable, UsageError
from .layout import PAGE
from .units import format_size

if TYPE_CHECKING:  # pragma: no cover
    from .pool import Pool

logger = logging.getLogger(__name__)

PIECE = 1 << 30  # bytes a piece: ~0.1 s of pinning, far below any per-call limit


class Backend(Protocol):
    """What pins one piece: `register` raises on failure (nothing of that piece stays pinned)."""

    what: str  # "cudaHostRegister", "mlock": names the registration in messages and the per-pool table
    error: type  # raised by a caller that waits (background=False) when a piece fails

    def register(self, addr: int, nbytes: int) -> None: ...

    def unregister(self, addr: int, nbytes: int) -> None: ...


class Pinning:
    """One pool handle's data region, pinned piece by piece on a thread of its own (see the module)."""

    # Class-level defaults: close() works on an object whose __init__ failed half-way.
    _closed = False
    _thread: threading.Thread | None = None

    def __init__(self, pool_name: str, core: Any, data_off: int, addr: int, total: int, piece: int,
                 backend: Backend) -> None:
        self.what = backend.what
        self.pool_name = pool_name
        self.total_bytes = total
        self.piece_bytes = piece
        self._backend = backend
        self._off = data_off  # the data region's offset in the segment (what views' offsets count from)
        self._addr = addr  # ... and its address in this process's mapping
        self._core: Any = core  # keeps the mapping alive while the thread works on it
        self._lock = threading.Lock()
        self._pieces: list[tuple[int, int]] = []  # (address, bytes) registered, in order
        self._pinned = 0
        self._error: str | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._pid = os.getpid()

    # ------------------------------------------------------------------ state

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned so far: the first `pinned_bytes` of the data region."""
        return self._pinned

    @property
    def done(self) -> bool:
        """The thread has finished: every piece pinned, or stopped by an error or by close()."""
        return self._done.is_set()

    @property
    def complete(self) -> bool:
        """Every piece is pinned (and not yet unpinned by close())."""
        return self._done.is_set() and not self._closed and self._pinned == self.total_bytes

    @property
    def error(self) -> str | None:
        """Why the thread stopped before the end (one line), or None."""
        return self._error

    @property
    def closed(self) -> bool:
        return self._closed

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the thread is done (or `timeout` seconds); True if it is."""
        return self._done.wait(timeout)

    def covers(self, off: int, nbytes: int) -> bool:
        """True if [off, off+nbytes) of the segment lies in pinned pieces (a copy of it is a pinned copy)."""
        start = off - self._off
        return start >= 0 and nbytes >= 0 and start + nbytes <= self._pinned and not self._closed

    def cuts(self, off: int, nbytes: int) -> list[tuple[int, int]]:
        """[off, off+nbytes) of the segment as (start, stop) offsets into it, split where pieces meet.

        One range when it lies in one piece (or outside the data region); a
        copy of each range then runs over memory that is wholly pinned or
        wholly not, whatever the thread has done so far."""
        start = off - self._off
        if start < 0 or start + nbytes > self.total_bytes:
            return [(0, nbytes)]
        out = []
        at = 0
        edge = (start // self.piece_bytes + 1) * self.piece_bytes - start  # the next piece boundary
        while edge < nbytes:
            out.append((at, edge))
            at, edge = edge, edge + self.piece_bytes
        out.append((at, nbytes))
        return out

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._error else "done" if self.done else "running"
        return (f"Pinning({self.what}, pool {self.pool_name!r}, {format_size(self._pinned)} of "
                f"{format_size(self.total_bytes)} in pieces of {format_size(self.piece_bytes)}, {state})")

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None or self._closed:
            return
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"cortex-{self.what}-{self.pool_name}")
        self._thread.start()

    def _plan(self) -> list[tuple[int, int]]:
        return [(self._addr + at, min(self.piece_bytes, self.total_bytes - at))
                for at in range(0, self.total_bytes, self.piece_bytes)]

    def _run(self) -> None:
        try:
            for addr, n in self._plan():
                if self._stop.is_set():
                    break
                try:
                    self._backend.register(addr, n)
                except Exception as e:
                    self._fail(addr - self._addr, n, e)
                    break
                with self._lock:
                    self._pieces.append((addr, n))
                    self._pinned += n
        finally:
            self._core = None
            self._done.set()

    def _fail(self, at: int, n: int, e: Exception) -> None:
        self._error = (f"{self.what} of pool {self.pool_name!r} stopped at the piece of {n} bytes at +{at}: {e}; "
                       f"the first {format_size(self._pinned)} of {format_size(self.total_bytes)} stay pinned, "
                       "the rest is not")
        logger.warning("cortex_cache: %s", self._error)

    def cancel(self) -> None:
        """Ask the thread to stop after the piece it is on; returns at once (what is pinned stays pinned)."""
        self._stop.set()

    def close(self) -> None:
        """Stop the thread (after its current piece), wait for it, unpin every piece pinned.  Never raises;
        safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        forked = os.getpid() != self._pid
        thread = self._thread
        if thread is not None and not forked and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            pieces, self._pieces = self._pieces, []
            self._pinned = 0
        if forked:
            return  # the registrations were the parent's (a child does not inherit them)
        failed = None
        for addr, n in reversed(pieces):
            try:
                self._backend.unregister(addr, n)
            except Exception as e:
                failed = failed or e
        if failed is not None:
            logger.warning("cortex_cache: undoing %s of pool %r: %s", self.what, self.pool_name, failed)


# ------------------------------------------------------------------ one per pool handle and kind


# This process's pinnings, by pool handle and kind (each closed by its handle's close).
_pinnings: "weakref.WeakKeyDictionary[Pool, dict[str, Pinning]]" = weakref.WeakKeyDictionary()
_start_lock = threading.Lock()


def piece_size(pool: "Pool", piece: int) -> int:
    """`piece` rounded up to whole pages and blocks (a block never spans two pieces)."""
    if isinstance(piece, bool) or not isinstance(piece, int) or piece <= 0:
        raise UsageError(f"a piece is a positive number of bytes, not {piece!r}")
    align = math.lcm(PAGE, pool.geometry.block_size)
    return -(-piece // align) * align


def pin(pool: "Pool", backend: Backend, *, piece: int = PIECE, background: bool = False) -> Pinning:
    """This handle's `backend.what` pinning of the pool's data region, started if it was not.

    Once per handle and kind: a second call returns the first's Pinning.
    `background=False` waits for it and raises `backend.error` if a piece
    failed (the pieces before it stay pinned until close); `background=True`
    returns at once and never raises for a piece.  Raises UsageError for a
    bad `piece`, PoolClosed for a closed handle.
    """
    n = piece_size(pool, piece)
    core = pool.core
    if core.closed:
        raise PoolClosed(f"pool {pool.name!r} is closed")
    if core.forked:
        raise UsageError(f"pool {pool.name!r} was opened before fork(): open it again in this process")
    with _start_lock:
        kinds = _pinnings.setdefault(pool, {})
        p = kinds.get(backend.what)
        if p is None or p.closed:
            addr, total = core.data_region()
            p = Pinning(pool.name, core, pool.geometry.data_off, addr, total, n, backend)
            kinds[backend.what] = p
            pool.add_close_hook(p.close)
            p.start()
    if not background:
        p.wait()
        if p.error is not None:
            raise backend.error(p.error)
    return p


def pinning_of(pool: "Pool", what: str) -> Pinning | None:
    """This handle's pinning of kind `what` ("cudaHostRegister", "mlock"), or None."""
    p = _pinnings.get(pool, {}).get(what)
    return p if p is not None and not p.closed else None


def active(pool: "Pool") -> bool:
    """True if this handle has a pinning (under way or done) that close() has not undone."""
    return any(not p.closed for p in tuple(_pinnings.get(pool, {}).values()))  # a copy: pin() may add one


def cuts(pool: "Pool", off: int, nbytes: int) -> list[tuple[int, int]]:
    """[off, off+nbytes) of the segment split where the pieces of any of this handle's pinnings meet."""
    kinds = _pinnings.get(pool)
    if not kinds:
        return [(0, nbytes)]
    edges = {0, nbytes}
    for p in tuple(kinds.values()):  # a copy: pin() may add one meanwhile
        if not p.closed:
            edges.update(b for _, b in p.cuts(off, nbytes))
    e = sorted(edges)
    return list(zip(e, e[1:])) or [(0, nbytes)]


# ------------------------------------------------------------------ mlock


class _Mlock:
    what = "mlock"
    error = ServiceUnavailable

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)  # ctypes lets the GIL go during the call
        for fn in (self.libc.mlock, self.libc.munlock):
            fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
            fn.restype = ctypes.c_int

    def register(self, addr: int, nbytes: int) -> None:
        if self.libc.mlock(addr, nbytes) != 0:
            err = ctypes.get_errno()
            soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            raise OSError(err, f"{os.strerror(err)} (RLIMIT_MEMLOCK is {limit}: ulimit -l, or CAP_IPC_LOCK)")

    def unregister(self, addr: int, nbytes: int) -> None:
        if self.libc.munlock(addr, nbytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))


def mlock(pool: "Pool", *, piece: int = PIECE, background: bool = False) -> Pinning:
    """Lock this handle's mapping of the pool's data region in RAM (mlock), in pieces; unlocked at close.

    As `pin` (once per handle; `background=True` returns at once). Raises
    ServiceUnavailable (69) when waiting and the host refuses a piece
    (RLIMIT_MEMLOCK without CAP_IPC_LOCK).
    """
    return pin(pool, _Mlock(), piece=piece, background=background)


__all__ = ["PIECE", "Backend", "Pinning", "pin", "pinning_of", "active", "cuts", "mlock", "piece_size"]
