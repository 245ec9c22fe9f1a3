"""Eviction policies and the shared victim cache.

Each policy orders live entries by a score (primary, secondary); the entry
with the smallest score goes first.  The secondary key is the entry's
`access_seq` (the pool's logical clock at its last put or hit), so ties break
towards the least recently used entry, and every score is unique.

Policies only *score*.  Choosing victims is shared: the pool keeps the
CANDIDATES best victims, found by one vectorised scan, in its header (so every
attached process evicts from the same list), and hands them out in order.
A cached victim is used only if it is untouched since the scan (same state,
no pins, same identity sequence number); the cache is dropped when a change
could put some other entry ahead of the cached ones:

- an entry's new score sorts before the last cached victim's score;
- an entry expires that was alive at the scan (`cand_next_expiry`);
- the LFU aging epoch advances.

That keeps eviction exact for every policy while costing O(1) per victim in
the steady state.  Expired entries are always reclaimed before any policy
victim.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .layout import CANDIDATES, SEALED
from .policy_names import DEFAULT_POLICY, POLICY_HELP, POLICY_IDS

INF = math.inf


class Policy:
    """Base: subclasses define `primary` over arrays of slot fields."""

    name = ""
    # True when every put or hit gives its entry a score above every existing
    # score, so no change can ever jump ahead of the cached victims.
    monotone = False
    # Which slot field identifies "the same entry with the same score" for a
    # cached victim.  A hit changes access_seq, which is right for every
    # policy whose order a hit changes.
    identity = "access_seq"

    def primary(self, s: np.ndarray, idx: np.ndarray, epoch: int) -> np.ndarray:
        """Primary score of slots `idx` of the slot table `s`."""
        return np.zeros(idx.size)

    def primary_one(self, s: np.ndarray, i: int, epoch: int) -> float:
        return float(self.primary(s, np.array([i]), epoch)[0])


class LRU(Policy):
    name = "lru"
    monotone = True


class FIFO(Policy):
    name = "fifo"
    monotone = True
    identity = "insert_seq"  # hits do not change FIFO order

    def primary(self, s, idx, epoch):
        return s["insert_seq"][idx].astype(np.float64)


class LFU(Policy):
    name = "lfu"

    def primary(self, s, idx, epoch):
        age = np.minimum(epoch - s["lfu_epoch"][idx], 63).astype(np.uint64)
        return np.right_shift(s["access_count"][idx], age).astype(np.float64)

    def primary_one(self, s, i, epoch):
        return float(int(s["access_count"][i]) >> min(63, epoch - int(s["lfu_epoch"][i])))


class PriorityPolicy(Policy):
    name = "priority"

    def primary(self, s, idx, epoch):
        return s["priority"][idx].astype(np.float64)

    def primary_one(self, s, i, epoch):
        return float(s["priority"][i])


class TTLPolicy(Policy):
    name = "ttl"

    def primary(self, s, idx, epoch):
        e = s["expiry"][idx]
        return np.where(e > 0, e, INF)

    def primary_one(self, s, i, epoch):
        e = float(s["expiry"][i])
        return e if e > 0 else INF


class SizePolicy(Policy):
    name = "size"

    def primary(self, s, idx, epoch):
        return -(s["value_len"][idx].astype(np.float64))

    def primary_one(self, s, i, epoch):
        return -float(s["value_len"][i])


# The one table of policy implementations.  Names, help and segment ids live
# in policy_names.py (numpy-free, for the CLI); this must cover exactly those.
POLICIES: dict[str, Policy] = {p.name: p for p in (LRU(), LFU(), FIFO(), PriorityPolicy(), TTLPolicy(), SizePolicy())}
assert list(POLICIES) == POLICY_IDS, "eviction.POLICIES and policy_names.POLICY_IDS disagree"


def policy_by_id(pid: int) -> Policy | None:
    return POLICIES[POLICY_IDS[pid]] if 0 <= pid < len(POLICY_IDS) else None


class VictimCache:
    """The header's candidate list, interpreted for one policy.

    All methods run under the pool lock; `h` is the header record array,
    `s` the slot table, `clock` the pool's clock.
    """

    def __init__(self, policy: Policy, h: np.ndarray, s: np.ndarray, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.h = h
        self.s = s
        self.clock = clock
        self._ident = s[policy.identity]
        self._state = s["state"]
        self._pins = s["pins"]

    def invalidate(self) -> None:
        self.h["cand_valid"] = 0

    def on_score_change(self, i: int) -> None:
        """Call after a put or hit changed slot `i`'s score."""
        h = self.h
        if self.policy.monotone or not h["cand_valid"][0]:
            return
        p = self.policy.primary_one(self.s, i, int(h["lfu_epoch"][0]))
        mp = float(h["cand_max_primary"][0])
        if p < mp or (p == mp and int(self.s["access_seq"][i]) < int(h["cand_max_secondary"][0])):
            h["cand_valid"] = 0

    def on_expiry_set(self, expiry: float) -> None:
        h = self.h
        if expiry > 0 and expiry < h["cand_next_expiry"][0]:
            h["cand_next_expiry"] = expiry

    def next_victim(self) -> tuple[int, bool]:
        """(slot, expired) of the next entry to evict, or (-1, False) if none can be."""
        h = self.h
        for attempt in range(2):
            if not h["cand_valid"][0] or self.clock() >= h["cand_next_expiry"][0] or (
                h["cand_epoch"][0] != h["lfu_epoch"][0]
            ):
                if not self._fill():
                    return -1, False
            slots, seqs = h["cand_slots"][0], h["cand_seqs"][0]
            pos, count = int(h["cand_pos"][0]), int(h["cand_count"][0])
            while pos < count:
                i = int(slots[pos])
                pos += 1
                if self._state[i] == SEALED and self._pins[i] == 0 and self._ident[i] == seqs[pos - 1]:
                    h["cand_pos"] = pos
                    e = float(self.s["expiry"][i])
                    return i, (0 < e <= self.clock())
            h["cand_pos"] = pos
            h["cand_valid"] = 0
        return -1, False

    def _fill(self) -> bool:
        """Scan all live entries and cache the best CANDIDATES victims; False if none."""
        h, s = self.h, self.s
        now = self.clock()
        epoch = int(h["lfu_epoch"][0])
        live = np.flatnonzero((self._state == SEALED) & (self._pins == 0))
        h["cand_epoch"] = epoch
        h["cand_pos"] = 0
        if live.size == 0:
            h["cand_valid"] = 0
            h["cand_count"] = 0
            return False
        exp = s["expiry"][live]
        is_expired = (exp > 0) & (exp <= now)
        expired = live[is_expired]
        expired = expired[np.argsort(exp[is_expired], kind="stable")][:CANDIDATES]
        rest = live[~is_expired]
        future = exp[~is_expired]
        future = future[future > 0]
        next_expiry = float(future.min()) if future.size else INF
        room = CANDIDATES - expired.size
        chosen = rest[:0]
        max_p, max_s = -INF, 0
        if room > 0 and rest.size:
            prim = self.policy.primary(s, rest, epoch)
            sec = s["access_seq"][rest]
            if rest.size > room:
                # O(n) preselection of the `room` smallest (primary, secondary)
                # pairs: everything strictly below the cutoff primary, then the
                # least recent of the entries tied at the cutoff.
                cutoff = prim[np.argpartition(prim, room - 1)[room - 1]]
                below = np.flatnonzero(prim < cutoff)
                ties = np.flatnonzero(prim == cutoff)
                need = room - below.size
                if ties.size > need:
                    ties = ties[np.argpartition(sec[ties], need - 1)[:need]]
                pool = np.concatenate([below, ties])
            else:
                pool = np.arange(rest.size)
            order = pool[np.lexsort((sec[pool], prim[pool]))][:room]
            chosen = rest[order]
            max_p, max_s = float(prim[order[-1]]), int(sec[order[-1]])
        victims = np.concatenate([expired, chosen]).astype(np.int32)
        n = victims.size
        h["cand_slots"][0, :n] = victims
        h["cand_seqs"][0, :n] = s[self.policy.identity][victims]
        h["cand_count"] = n
        h["cand_max_primary"] = max_p
        h["cand_max_secondary"] = max_s
        h["cand_next_expiry"] = next_expiry
        h["cand_valid"] = 1
        return True


__all__ = ["Policy", "POLICIES", "POLICY_IDS", "POLICY_HELP", "DEFAULT_POLICY", "policy_by_id", "VictimCache"]
