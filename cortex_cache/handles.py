"""The handles a pool gives out: a pinned view of a value, and a reserved entry being written in place."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import numpy as np
from xxhash import xxh3_64_intdigest

from .core import PIN, Core, Pinned
from .errors import UsageError
from .tiers import Tiers


class EntryView:
    """A pinned, read-only view of one entry's value; use as a context manager."""

    __slots__ = ("_core", "_views", "_pinned", "_arr", "_finaliser", "offset", "checksum", "memoryview",
                 "__weakref__")

    def __init__(self, core: Core, views: set, pinned: Any, checksum: int = 0) -> None:
        """`pinned`: a Pinned (the Python path), or the fast path's Pin, which exports the bytes itself."""
        self._core = core
        self._views = views  # the pool handle's open views, which its close() releases
        self._pinned = pinned
        self.offset = pinned.offset  # of the value in the segment
        self.checksum = checksum  # xxh3_64 of the value taken at put: `verify()` compares against it
        if pinned.__class__ is not Pinned:
            # The Pin counts who uses its bytes; it unpins at its last user's end (see drop_memoryview).
            self._arr = self._finaliser = None
            self.memoryview: memoryview | None = pinned.view()
            return
        # The memoryview is exported by a read-only array of our own: whatever is made from it (numpy
        # arrays, slices) holds that array, so `release` can tell whether the memory is still used.
        arr = core.value_array(pinned.offset, pinned.length)
        arr.flags.writeable = False
        self._arr: np.ndarray | None = arr
        self._finaliser = weakref.finalize(arr, _unpin_late, core, pinned)
        self.memoryview = memoryview(arr)

    @classmethod
    def of_pins(cls, core: Core, views: set, got: list) -> list:
        """`got` (batch.pin_many's answer) with an EntryView, added to `views`, for every pinned key."""
        out = []
        made = []
        pin_type = PIN
        for r in got:
            if r.__class__ is pin_type:  # the fast path's Pin, built here without __init__'s checks
                ev = cls.__new__(cls)
                ev._core = core
                ev._views = views
                ev._pinned = r
                ev.offset = r.offset
                ev.checksum = r.checksum
                ev._arr = ev._finaliser = None
                ev.memoryview = r.view()
            elif r.__class__ is tuple:  # (Pinned, checksum): the Python path
                ev = cls(core, views, r[0], r[1])
            else:  # None (absent) or the key's error
                out.append(r)
                continue
            out.append(ev)
            made.append(ev)
        views.update(made)
        return out

    @staticmethod
    def drop_all(views: Any) -> list:
        """`drop_memoryview` of every EntryView among `views` (others skipped): the pins to release now."""
        pinned = []
        view_type = EntryView
        for v in views:
            if v.__class__ is view_type or isinstance(v, view_type):
                if v._finaliser is None and v.memoryview is not None:  # a Pin: dropped inline
                    mv, v.memoryview = v.memoryview, None
                    mv.release()
                    v._views.discard(v)
                    p = v._pinned
                    if p.drop():
                        pinned.append(p)
                    continue
                p = v.drop_memoryview()
                if p is not None:
                    pinned.append(p)
        return pinned

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
        if self.memoryview is not None:
            try:
                self.release()
            except Exception:
                pass

    def detach(self) -> None:
        """Leave this view's release to its holder: `pool.close()` will not release it (gpu.py's tensors)."""
        self._views.discard(self)

    def drop_memoryview(self) -> Any:
        """Give up the memoryview; the pin to release now, or None if already released or if an object
        made from the memoryview still uses the memory (then the entry's last such user unpins it)."""
        mv, self.memoryview = self.memoryview, None
        if mv is None:
            return None
        mv.release()
        self._views.discard(self)
        pinned = self._pinned
        if self._finaliser is None:
            return pinned if pinned.drop() else None
        arr, self._arr = self._arr, None
        # A numpy array or slice made from the memoryview shares its buffer, hence holds `arr`:
        # more references than this local and the call's argument mean one is alive.
        if sys.getrefcount(arr) > 2:
            return None  # the finaliser unpins when the last of them goes
        self._finaliser.detach()
        return pinned

    def release(self) -> None:
        """Release the view and unpin the entry; safe to call twice.

        An array or slice made from the view's memoryview keeps the entry
        pinned until it is gone itself (as `gpu.entry_tensor` does), so no
        object can read memory the pool has reused."""
        p = self.drop_memoryview()
        core = self._core
        if p is not None and not core.closed:
            core.release_pins([p])


def _unpin_late(core: Core, pinned: Pinned) -> None:
    """A released view's memory was still used by a derived object; that object is gone now."""
    try:
        if not core.closed:
            core.release_pins([pinned])
    except Exception:
        pass  # the pin goes with this process


class EntryWriter:
    """A reserved, still invisible entry that the caller fills in place (`Pool.reserve_write`).

    `memoryview` is writable and `nbytes` long; `commit()` checksums it and
    makes it the key's value atomically, `abort()` gives the space back.  As a
    context manager it commits on a clean exit and aborts on an exception.
    Until it is committed no reader can see it; if this process dies first,
    the space is reclaimed like any unfinished put.
    """

    # An engine reserves a request's chunks together (Pool.reserve_write_many): slots make each cheaper.
    __slots__ = ("_tiers", "slot", "args", "offset", "nbytes", "memoryview")

    def __init__(self, tiers: Tiers, slot: int, kb: bytes, kh: int, flags: int, off: int, nbytes: int,
                 ttl: float | None, priority: int) -> None:
        self._tiers = tiers
        self.slot = slot  # the reserved slot (batch.commit_many seals it)
        self.args = (kb, kh, flags, ttl, priority)
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
        kb, kh, flags, ttl, priority = self.args
        if checksum is None:
            checksum = xxh3_64_intdigest(mv)
        try:
            self._tiers.commit(self.slot, kb, kh, flags, mv, checksum, ttl, priority)
        finally:
            mv.release()
        core = self._tiers.core
        if core.superseded and core.lost_name():  # committed to a copy that lost its name (Pool.superseded)
            raise core.superseded_error(": the value went to the old copy")

    def abort(self) -> None:
        mv, self.memoryview = self.memoryview, None
        if mv is None:
            return
        mv.release()
        core = self._tiers.core
        if not core.closed:
            core.locked(core.abort, self.slot)

    def take(self) -> memoryview | None:
        """Take this writer's memoryview for a batched commit or abort (batch.py); None if already done."""
        mv, self.memoryview = self.memoryview, None
        return mv


__all__ = ["EntryView", "EntryWriter"]
