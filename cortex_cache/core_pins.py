"""Pin records of a pool segment: part of `Core` (core.py), as the mixin `Pins`.

A pin keeps an entry's blocks while a process copies or views its value
outside the lock: a record (pid, slot, process start) in the segment's pin
table, and a count in the entry's slot.  An entry removed while pinned is a
zombie, freed at its last unpin; the pins of dead readers are reclaimed
(`reap_dead`, core_alloc.py).  The fast path pins and unpins in C over the
same records (`_unpin_late` is its hook for a Pin dropped unreleased).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from . import procs
from .errors import BufferTooSmall, PoolBusy, SegmentCorrupt
from .layout import P32, P64, P_PID, P_SLOT, P_START, SEALED, ZOMBIE


class Pinned(NamedTuple):
    """A pinned entry whose value is copied outside the lock: unpin with `Core.unpin(pin, slot)`."""

    pin: int
    slot: int
    offset: int  # of the value in the segment
    length: int


class Pins:
    """Pinning and unpinning entries (see the module docstring).  Mixed into Core, whose attributes and
    methods it uses; every method but `release_pins` runs with the pool lock held."""

    name: str
    closed: bool
    fast: Any
    victims: Any
    pin_records: Any

    # Core's: the entry's lookup and metadata, the lock, and its room (core_alloc.py).
    lookup_live: Callable[[bytes, int], int]
    find_live: Callable[[bytes, int], int]
    value_at: Callable[[int], tuple[int, int]]
    touch: Callable[[int], None]
    locked: Callable[..., Any]
    reap_dead: Callable[[], bool]
    _free_entry: Callable[[int], None]

    def pin(self, i: int) -> int:
        """Pin entry `i` for this process (lock held): its blocks stay until `unpin`.  The pin record."""
        pu32 = self._pu32
        j = self._pin_hint
        if pu32[j * P32 + P_PID] != 0:
            ppid = self.pin_records["pid"]
            free = np.flatnonzero(ppid == 0)
            if free.size == 0:
                self.reap_dead()  # dead readers' records come back (it says True only when it freed an entry)
                free = np.flatnonzero(ppid == 0)
            if free.size == 0:
                raise PoolBusy(
                    f"pool {self.name!r}: all {self._n_pins} pin records are in use "
                    "(too many concurrent large reads or open views)"
                )
            j = int(free[0])
        pid, start = procs.me()
        self._pi32[j * P32 + P_SLOT] = i
        self._pu64[j * P64 + P_START] = start
        pu32[j * P32 + P_PID] = pid
        self._c_pins[i] += 1
        self._pin_hint = (j + 1) % self._n_pins
        return j

    def unpin(self, j: int, i: int) -> None:
        """Release pin record `j` on entry `i` (lock held); a deleted entry's blocks go at its last unpin."""
        pu32, pi32 = self._pu32, self._pi32
        if pu32[j * P32 + P_PID] != procs.me()[0] or pi32[j * P32 + P_SLOT] != i:
            return  # already reclaimed by a repair (should not happen while we live)
        pu32[j * P32 + P_PID] = 0
        pi32[j * P32 + P_SLOT] = -1
        pins = self._c_pins[i]
        if pins > 0:
            pins -= 1
            self._c_pins[i] = pins
        if pins == 0:
            if self._c_state[i] == ZOMBIE:
                self._free_entry(i)
            elif self._c_state[i] == SEALED:
                self.victims.on_unpin(i)

    def pin_batch(self, slots: list[int]) -> list[Pinned]:
        """Pin the sealed entries among `slots` whose metadata is possible (lock held)."""
        out = []
        for i in slots:
            if self._c_state[i] != SEALED:
                continue
            try:
                off, vlen = self.value_at(i)
            except SegmentCorrupt:
                continue  # verify's structural pass reports it; nothing to pin
            try:
                out.append(Pinned(self.pin(i), i, off, vlen))
            except BaseException:
                self.unpin_batch(out)  # PoolBusy part-way: no pins left behind
                raise
        return out

    def pin_many(self, encoded: list[tuple[bytes, int]], rooms: list[int] | None, count_miss: bool) -> list[Any]:
        """Pin the live entries of many keys in this one lock hold (the batched reads' bookkeeping).

        Per key: a Pinned, None (absent), or the error for that key (BufferTooSmall when `rooms[n]` is
        smaller than the value, PoolBusy when the pin records run out).  On any other error what was
        pinned is unpinned before it propagates: a batch never leaves pins behind.
        """
        out: list[Any] = []
        try:
            for n, (kb, kh) in enumerate(encoded):
                i = self.lookup_live(kb, kh) if count_miss else self.find_live(kb, kh)
                if i < 0:
                    out.append(None)
                    continue
                off, vlen = self.value_at(i)
                if rooms is not None and rooms[n] < vlen:
                    out.append(BufferTooSmall(f"buffer of {rooms[n]} bytes is too small for a value of {vlen} bytes"))
                    continue
                self.touch(i)
                try:
                    out.append(Pinned(self.pin(i), i, off, vlen))
                except PoolBusy as e:
                    out.append(e)
        except BaseException:
            self.unpin_batch([p for p in out if p.__class__ is Pinned])
            raise
        return out

    def _unpin_late(self, pin: int, slot: int) -> None:
        """A fast-path Pin's last user is gone (or it was dropped unreleased): unpin it; never raises."""
        try:
            if not self.closed:
                self.release_pins([(pin, slot)])
        except Exception:
            pass  # the pin goes with this process (its record is reclaimed when it exits)

    def release_pins(self, pinned: list) -> None:
        """Unpin `pinned` (records with `pin` and `slot`) in one lock hold: through the fast path when it
        can take the lock at once, else `locked(unpin_batch)`.  (Not lock held.)"""
        fast = self.fast
        if fast is None or not fast.unpin_many(pinned):
            self.locked(self.unpin_batch, pinned)

    def unpin_batch(self, pinned: list) -> None:
        """Unpin what `pin_batch` pinned, or any list of records with `pin` and `slot`, or (pin, slot)
        pairs (lock held)."""
        for p in pinned:
            if p.__class__ is tuple:
                self.unpin(*p)
            else:
                self.unpin(p.pin, p.slot)


__all__ = ["Pinned", "Pins"]
