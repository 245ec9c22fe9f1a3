"""Room for entries in a pool segment: part of `Core` (core.py), as the mixin `Allocation`.

Where an entry's room comes from and where it goes back: the free list of
slots, next-fit runs of blocks and of key cells (allocator.py finds them),
giving an entry's room back (`_free_entry`), eviction by policy when there is
no room (`evict_one`, and the explicit evictions of `cortex cache evict`), and
reclaiming what dead processes left (`reap_dead`).  Every method here runs
with the pool lock held (core.py, "Locking").  It works on Core's views of the
mapping (the `_c_*` slot columns, the header words `_hu64`/`_hi64`, the maps
`_bmap`/`_kmap`) and calls back into Core for what an eviction does to an
entry (`remove`, `expired`, `key_bytes`) and to the hooks (`on_evict`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import procs
from .allocator import find_run, run_around
from .errors import PoolFull
from .layout import (
    FREE, KEY_CELL, SEALED, WRITING, ZOMBIE,
    H_ALLOC_HINT, H_BYTES_EVICTED, H_EVICTIONS, H_EXPIRATIONS, H_FREE_SLOT, H_KEY_HINT, H_USED_BLOCKS,
    H_USED_KCELLS,
    key_cells,
)

_ONES = b"\x01" * 256  # map filler for runs of up to 256 cells
_ZEROS = memoryview(bytes(256))  # ... and its opposite (a view: slicing it copies nothing)


class Allocation:
    """Slots, blocks and key cells of entries, eviction and reclaiming (see the module docstring).  Mixed
    into Core, whose attributes and methods it uses."""

    name: str
    geometry: Any
    block_map: np.ndarray
    key_map: np.ndarray
    on_evict: Callable[[int], None] | None
    victims: Any
    queues: Any
    columns: Any
    pin_records: Any
    clock: Callable[[], float]

    # Core's: the index, and what leaving it does to an entry.
    find: Callable[[bytes, int], int]
    remove: Callable[[int], None]
    expired: Callable[[int], bool]
    key_bytes: Callable[[int], bytes]

    # ------------------------------------------------------------------ allocation

    def _alloc_slot(self) -> int:
        hi64 = self._hi64
        i = hi64[H_FREE_SLOT]
        while i < 0:
            if self.evict_one() is None:
                raise PoolFull(
                    f"pool {self.name!r} has no free entry slot ({self.geometry.n_slots} max entries) "
                    "and nothing can be evicted"
                )
            i = hi64[H_FREE_SLOT]
        hi64[H_FREE_SLOT] = self._c_next[i]
        self._c_next[i] = -1
        return i

    def _free_slot(self, i: int) -> None:
        self._c_state[i] = FREE
        self._c_pins[i] = 0
        # Forget who it was: a damaged state word must not bring a deleted entry back.
        self._c_khash[i] = 0
        self._c_cks[i] = 0
        hi64 = self._hi64
        self._c_next[i] = hi64[H_FREE_SLOT]
        hi64[H_FREE_SLOT] = i

    def _alloc_blocks(self, k: int) -> int:
        hu64 = self._hu64
        hint = hu64[H_ALLOC_HINT]
        bmap = self._bmap
        # Fast path: the run at the cursor is free (empty pool, or the blocks
        # an eviction or delete just freed).  Else a vectorised scan.
        if hint + k <= self._n_blocks and bmap[hint : hint + k] == (_ZEROS[:k] if k <= 256 else bytes(k)):
            first = hint
        else:
            # A full pool (the steady state of a cache) cannot have a run:
            # skip the scan and go straight to eviction.
            first = find_run(self.block_map, k, hint) if hu64[H_USED_BLOCKS] + k <= self._n_blocks else -1
            while first < 0:
                freed = self.evict_one()
                if freed is None:
                    raise PoolFull(
                        f"pool {self.name!r} is full: no run of {k} free blocks, "
                        "and every entry is pinned, being written, or already evicted"
                    )
                vfirst, vn = freed
                # The victim's own run is enough when it is as long (the common
                # case of equal-sized KV chunks); else look at its neighbours.
                if vn >= k:
                    first = vfirst
                elif vn > 0:
                    first = run_around(self.block_map, vfirst, vn, k)
                else:
                    first = find_run(self.block_map, k, 0)
        bmap[first : first + k] = _ONES[:k] if k <= len(_ONES) else b"\x01" * k
        hu64[H_USED_BLOCKS] += k
        nxt = first + k
        hu64[H_ALLOC_HINT] = nxt if nxt < self._n_blocks else 0
        return first

    def _alloc_kcells(self, klen: int) -> int:
        """First cell of a run of free cells for a key of `klen` bytes, evicting for room (docs/design.md, "Keys")."""
        k = (klen + KEY_CELL - 1) // KEY_CELL  # layout.key_cells, inlined on the hot path
        hu64 = self._hu64
        hint = hu64[H_KEY_HINT]
        kmap = self._kmap
        if hint + k <= self._n_kcells and kmap[hint : hint + k] == (_ZEROS[:k] if k <= 256 else bytes(k)):
            first = hint
        else:
            first = find_run(self.key_map, k, hint)
            while first < 0:
                if self.evict_one() is None:
                    raise PoolFull(
                        f"pool {self.name!r} is full: no room for a key of {k * KEY_CELL} bytes, "
                        "and every entry is pinned, being written, or already evicted"
                    )
                first = find_run(self.key_map, k, 0)
        kmap[first : first + k] = _ONES[:k] if k <= len(_ONES) else b"\x01" * k
        hu64[H_USED_KCELLS] += k
        nxt = first + k
        hu64[H_KEY_HINT] = nxt if nxt < self._n_kcells else 0
        return first

    def _free_kcells(self, first: int, klen: int) -> None:
        k = key_cells(klen)
        self._kmap[first : first + k] = _ZEROS[:k]  # keys are at most 4 KiB: 128 cells
        hu64 = self._hu64
        hu64[H_USED_KCELLS] -= k
        hu64[H_KEY_HINT] = first

    def _free_entry(self, i: int) -> None:
        """Give slot `i`'s blocks, key cells and the slot itself back."""
        first, n = self._c_first[i], self._c_nblk[i]
        self._bmap[first : first + n] = _ZEROS[:n] if n <= 256 else bytes(n)
        hu64 = self._hu64
        hu64[H_USED_BLOCKS] -= n
        # Reuse freed blocks first: they are likely still in the CPU cache.
        hu64[H_ALLOC_HINT] = first
        kf = self._c_kcell[i]
        k = (self._c_klen[i] + KEY_CELL - 1) // KEY_CELL  # as _free_kcells, inlined on the hot path
        self._kmap[kf : kf + k] = _ZEROS[:k]
        hu64[H_USED_KCELLS] -= k
        hu64[H_KEY_HINT] = kf
        self._free_slot(i)

    # ------------------------------------------------------------------ eviction

    def evict_one(self) -> tuple[int, int] | None:
        """Evict one victim by policy (expired entries first), or reclaim what dead processes left (lock held).

        Returns the run of blocks freed, (first, count) -- count 0 when dead
        processes' leftovers were reclaimed, wherever they were -- or None when
        nothing could be freed.  `on_evict` sees a victim that has not expired.
        """
        i, expired = self.victims.next_victim()
        if i < 0:
            return (0, 0) if self.reap_dead() else None
        first, n = self._c_first[i], self._c_nblk[i]
        if not expired and self.on_evict is not None:
            self.on_evict(i)  # first: a spill that refuses leaves the entry, and the counters, as they were
        self._count_eviction(i, expired)
        if not expired and self.queues is not None:
            self.queues.evicted(i)
        self.remove(i)
        return first, n

    def _count_eviction(self, i: int, expired: bool) -> None:
        hu64 = self._hu64
        if expired:
            hu64[H_EXPIRATIONS] += 1
        else:
            hu64[H_EVICTIONS] += 1
            hu64[H_BYTES_EVICTED] += self._c_vlen[i]

    def evict_slots(self, slots: Any, spill: bool, count_expired: bool = True) -> tuple[int, int]:
        """Evict the sealed entries `slots` (lock held); `spill`: offer unexpired ones to `on_evict`;
        `count_expired`: count an expired one as an expiration (else as an eviction).
        Returns (entries, value bytes)."""
        count = freed = 0
        for i in slots:
            if self._c_state[i] != SEALED:
                continue
            count += 1
            freed += self._c_vlen[i]
            gone = self.expired(i)
            if spill and not gone and self.on_evict is not None:
                self.on_evict(i)  # first: a spill that refuses leaves the entry, and the counters, as they were
            self._count_eviction(i, gone and count_expired)
            self.remove(i)
        return count, freed

    def evict_keys(self, encoded: list[tuple[bytes, int]], spill: bool) -> tuple[int, int]:
        """Evict the entries of these (key, hash) pairs that are in memory (lock held)."""
        return self.evict_slots([i for i in (self.find(kb, kh) for kb, kh in encoded) if i >= 0], spill, False)

    def evict_matching(self, expired_only: bool, prefix: bytes | None, spill: bool) -> tuple[int, int]:
        """Evict every sealed entry, or the expired ones, or those whose key starts with `prefix` (lock held)."""
        idx = np.flatnonzero(self.columns["state"] == SEALED)
        if expired_only:
            e = self.columns["expiry"][idx]
            idx = idx[(e > 0) & (e <= self.clock())]
        slots = map(int, idx)
        if prefix is not None:
            slots = (i for i in slots if self.key_bytes(i).startswith(prefix))
        return self.evict_slots(list(slots), spill)

    def evict_amount(self, percent: float | None, target: int | None, spill: bool) -> tuple[int, int]:
        """Evict by policy until `target` value bytes (or `percent` of them) are freed (lock held)."""
        if percent is not None:
            live = self.columns["state"] == SEALED
            target = int(np.ceil(int(self.columns["value_len"][live].sum()) * percent / 100))
        assert target is not None
        count = freed = 0
        while freed < target:
            i, expired = self.victims.next_victim()
            if i < 0:
                break
            count += 1
            freed += self._c_vlen[i]
            if spill and not expired and self.on_evict is not None:
                self.on_evict(i)  # first: a spill that refuses leaves the entry, and the counters, as they were
            self._count_eviction(i, expired)
            if not expired and self.queues is not None:
                self.queues.evicted(i)
            self.remove(i)
        return count, freed

    # ------------------------------------------------------------------ dead processes


    def reap_dead(self) -> bool:
        """Reclaim reservations of dead writers and pins of dead readers (lock held); True if anything was freed
        or can be evicted again."""
        freed = False
        alive = procs.alive_checker()
        ppid, pslot, pstart = self.pin_records["pid"], self.pin_records["slot"], self.pin_records["start"]
        pins, state = self.columns["pins"], self.columns["state"]
        for j in map(int, np.flatnonzero(ppid != 0)):
            if not alive(int(ppid[j]), int(pstart[j])):
                i = int(pslot[j])
                ppid[j] = 0
                pslot[j] = -1
                if 0 <= i < self._n_slots and pins[i] > 0:
                    pins[i] -= 1
                    if pins[i] == 0 and state[i] == ZOMBIE:
                        self._free_entry(i)
                    # A zombie's blocks are free now; a sealed entry can be evicted again (the victim list
                    # passed it over while pinned): either way the caller looking for room looks again.
                    freed = freed or pins[i] == 0
        opid, ostart = self.columns["owner_pid"], self.columns["owner_start"]
        for i in map(int, np.flatnonzero(state == WRITING)):
            if not alive(int(opid[i]), int(ostart[i])):
                self._free_entry(i)
                freed = True
        if freed:
            self.victims.invalidate()
        return freed


__all__ = ["Allocation"]
