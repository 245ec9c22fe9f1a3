"""The handles a pool gives out: a pinned view of a value, and a reserved entry being written in place."""

from __future__ import annotations

from xxhash import xxh3_64_intdigest

from .core import Core, Pinned
from .errors import UsageError
from .tiers import Tiers


class EntryView:
    """A pinned, read-only view of one entry's value; use as a context manager."""

    def __init__(self, core: Core, views: set, pinned: Pinned, checksum: int = 0) -> None:
        self._core = core
        self._views = views  # the pool handle's open views, which its close() releases
        self._pinned = pinned
        self.offset = pinned.offset  # of the value in the segment
        self.memoryview: memoryview | None = core.mv[pinned.offset : pinned.offset + pinned.length].toreadonly()
        self.checksum = checksum  # xxh3_64 of the value taken at put: `verify()` compares against it

    def verify(self) -> bool:
        """Do the bytes still match the checksum taken when they were put?  (One hash pass.)"""
        assert self.memoryview is not None
        return xxh3_64_intdigest(self.memoryview) == self.checksum

    def __enter__(self) -> memoryview:
        assert self.memoryview is not None
        return self.memoryview

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # A view dropped without release() would hold its pin until this
        # process exits; give it back now.
        try:
            self.release()
        except Exception:
            pass

    def detach(self) -> None:
        """Leave this view's release to its holder: `pool.close()` will not release it (gpu.py's tensors)."""
        self._views.discard(self)

    def release(self) -> None:
        """Release the view and unpin the entry; safe to call twice."""
        mv, self.memoryview = self.memoryview, None
        if mv is None:
            return
        mv.release()
        self._views.discard(self)
        core = self._core
        if not core.closed:
            core.locked(core.unpin, self._pinned.pin, self._pinned.slot)


class EntryWriter:
    """A reserved, still invisible entry that the caller fills in place (`Pool.reserve_write`).

    `memoryview` is writable and `nbytes` long; `commit()` checksums it and
    makes it the key's value atomically, `abort()` gives the space back.  As a
    context manager it commits on a clean exit and aborts on an exception.
    Until it is committed no reader can see it; if this process dies first,
    the space is reclaimed like any unfinished put.
    """

    def __init__(self, tiers: Tiers, slot: int, kb: bytes, kh: int, flags: int, off: int, nbytes: int,
                 ttl: float | None, priority: int) -> None:
        self._tiers = tiers
        self._slot = slot
        self._args = (kb, kh, flags, ttl, priority)
        self.offset = off  # of the value in the segment
        self.nbytes = nbytes
        self.memoryview: memoryview | None = tiers.core.mv[off : off + nbytes]

    def __enter__(self) -> memoryview:
        assert self.memoryview is not None
        return self.memoryview

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __del__(self) -> None:
        try:
            self.abort()
        except Exception:
            pass

    def commit(self, checksum: int | None = None) -> None:
        """Make the entry visible.  `checksum`: the value's xxh3_64, if the caller already took it."""
        mv, self.memoryview = self.memoryview, None
        if mv is None:
            raise UsageError("this entry writer was already committed or aborted")
        kb, kh, flags, ttl, priority = self._args
        if checksum is None:
            checksum = xxh3_64_intdigest(mv)
        try:
            self._tiers.commit(self._slot, kb, kh, flags, mv, checksum, ttl, priority)
        finally:
            mv.release()

    def abort(self) -> None:
        mv, self.memoryview = self.memoryview, None
        if mv is None:
            return
        mv.release()
        core = self._tiers.core
        if not core.closed:
            core.locked(core.abort, self._slot)


__all__ = ["EntryView", "EntryWriter"]
