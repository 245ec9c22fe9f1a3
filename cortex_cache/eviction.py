"""Eviction policies and the shared victim cache.

Each policy orders live entries by a score (primary, secondary); the entry
with the smallest score goes first.  The secondary key is the entry's
`access_seq` (the pool's logical clock at its last put or hit), so ties break
towards the least recently used entry, and every score is unique.

Policies only *score*.  Choosing victims is shared: the pool keeps the
CANDIDATES best victims, found by one vectorised scan of the slot columns, in
a region of the segment (so every attached process evicts from the same
list), and hands them out in order.  A listed victim is used only if it is
untouched since it was listed (still sealed, no pins, same identity sequence
number).  Between scans the list stays exact:

- an entry whose new score sorts before the last listed victim (a put or hit
  under a non-monotone policy, or a pinned entry released) is inserted into
  the list, which drops its last row when full;
- the list is rebuilt when an entry expires that was alive at the scan
  (`cand_next_expiry`), when the LFU aging epoch advances, and when it runs out.

So eviction is exact for every policy and costs O(1) per victim in the
steady state, plus one O(n) scan per CANDIDATES victims.  Expired entries are
always reclaimed before any policy victim.

The C fast path does the same for its puts (_fastpath_evict.c: peek, take,
may_expire; _fastpath_entries.h: offer), calling `VictimCache.fill` here for
the scan; tests/test_fast_evict.py holds the two to the same victims.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .errors import UsageError
from .layout import H_LFU_EPOCH, SEALED, VICTIM_LIST_WORDS
from .policy_names import DEFAULT_POLICY, POLICY_HELP, POLICY_IDS
from .units import parse_size

INF = math.inf


def _fold(prim: np.ndarray, sec: np.ndarray) -> np.ndarray | None:
    """One uint64 per entry that sorts like (prim, sec), or None if it cannot fit.

    prim holds whole numbers; both are shifted to start at 0, and prim goes
    in the high bits above as many bits as the secondary range needs.
    """
    pi = prim.astype(np.int64)
    pmin, smin = int(pi.min()), int(sec.min())
    bits = (int(sec.max()) - smin).bit_length()
    if (int(pi.max()) - pmin).bit_length() + bits > 63:
        return None
    return ((pi - pmin).astype(np.uint64) << np.uint64(bits)) | (sec - np.uint64(smin))


def _expiry_key(expiry):
    """Secondary key of an expired entry: its expiry time, soonest first.

    The bits of a positive float64 read as uint64 sort like the floats, so
    expired entries (primary -inf) order by expiry within the one u64 column.
    """
    return np.asarray(expiry, dtype=np.float64).view(np.uint64)


class Policy:
    """Base: subclasses define `primary` over arrays of slot fields."""

    name = ""
    # True when every put or hit gives its entry a score above every existing
    # score, so no change can ever jump ahead of the cached victims.
    monotone = False
    # True when the primary score is the same for every entry (order by the
    # secondary key alone), which lets a scan skip a selection pass.
    constant_primary = False
    # True when primary scores are whole numbers: a scan can then fold
    # (primary, secondary) into one exact uint64 key and select once.
    integer_primary = False
    # Which slot field identifies "the same entry with the same score" for a
    # cached victim.  A hit changes access_seq, which is right for every
    # policy whose order a hit changes.
    identity = "access_seq"
    # The slot field that orders entries of equal primary score (and breaks every tie).
    secondary = "access_seq"
    # A queue policy (QueuePolicy below): entries in two queues, victims chosen by queues.py.
    queues = False

    def primary(self, s: dict, idx, epoch: int) -> np.ndarray:
        """Primary scores (float64) of slots `idx` (an index array or a slice) of the columns `s`."""
        return np.zeros(s["state"][idx].shape[0])

    def primary_one(self, m: dict, i: int, epoch: int) -> float:
        """Primary score of slot `i`; `m` maps field names to the slot columns
        (memoryviews on the hot path: one scalar read, no numpy)."""
        return 0.0


class LRU(Policy):
    name = "lru"
    monotone = True
    constant_primary = True


class FIFO(Policy):
    name = "fifo"
    monotone = True
    identity = "insert_seq"  # hits do not change FIFO order

    def primary(self, s, idx, epoch):
        return s["insert_seq"][idx].astype(np.float64)

    def primary_one(self, m, i, epoch):
        return float(m["insert_seq"][i])


class LFU(Policy):
    name = "lfu"
    integer_primary = True

    def primary(self, s, idx, epoch):
        age = np.minimum(epoch - s["lfu_epoch"][idx], 63).astype(np.uint64)
        return np.right_shift(s["access_count"][idx], age).astype(np.float64)

    def primary_one(self, m, i, epoch):
        return float(m["access_count"][i] >> min(63, epoch - m["lfu_epoch"][i]))


class PriorityPolicy(Policy):
    name = "priority"
    integer_primary = True

    def primary(self, s, idx, epoch):
        return s["priority"][idx].astype(np.float64)

    def primary_one(self, m, i, epoch):
        return float(m["priority"][i])


class TTLPolicy(Policy):
    name = "ttl"

    def primary(self, s, idx, epoch):
        e = s["expiry"][idx]
        return np.where(e > 0, e, INF)

    def primary_one(self, m, i, epoch):
        e = m["expiry"][i]
        return e if e > 0 else INF


class SizePolicy(Policy):
    name = "size"
    integer_primary = True

    def primary(self, s, idx, epoch):
        return -(s["value_len"][idx].astype(np.float64))

    def primary_one(self, m, i, epoch):
        return -float(m["value_len"][i])


class QueuePolicy(Policy):
    """A policy of two queues (queues.py does the work; this is its data).

    Every sealed entry is in queue 0 (new entries: S3-FIFO's small queue, ARC's T1) or queue 1 (entries
    seen again: the main queue, T2).  Each queue is ordered by `secondary`: "qseq", the time it joined
    the queue's tail (FIFO), or "access_seq" (LRU).  A victim comes from queue 0 while it holds more
    than its target (`target`: a share of the entries, or ARC's p in entries), else from queue 1.
    With `second_chance`, a victim read since it joined its queue is not evicted but moves on: from
    queue 0 to queue 1's tail, or round queue 1 again with one read less (reads count up to 3).
    Evicted keys are remembered in ghost rings, `ghosts[q]` x the entries the pool holds for queue q;
    a new key found there joins queue 1 directly, and with `adapt` moves queue 0's target towards the
    queue that lost it: "arc" by ARC's rule (max(1, other ghosts / these ghosts) entries of p), "auto"
    by auto's (Auto below).
    """

    monotone = True  # within a queue, a put or a hit puts its entry last
    constant_primary = True
    queues = True
    second_chance = False
    adapt = ""  # "", "arc" (p, in entries, integer steps) or "auto" (a share of the entries; Auto)
    target = 0.0  # queue 0's target at create
    ghosts = (1, 0)  # ghost ring places per slot, for queue 0 and queue 1 (also each window's length)

    def __init__(self, order: str) -> None:
        self.secondary = self.identity = order


class S3FIFO(QueuePolicy):
    name = "s3fifo"
    second_chance = True
    target = 0.1
    ghosts = (1, 0)

    def __init__(self) -> None:
        super().__init__("qseq")


class ARC(QueuePolicy):
    name = "arc"
    adapt = "arc"
    ghosts = (1, 1)

    def __init__(self) -> None:
        super().__init__("access_seq")


class Auto(QueuePolicy):
    """S3-FIFO that learns online which of three regimes the workload is in (docs/internals.md, "auto").

    It keeps S3-FIFO's queues (FIFO, reads counted, second chances) with a longer memory of keys seen
    once (ghosts of queue 0 for 3x the entries, of queue 1 for 1x), and moves queue 0's share of the
    entries on ghost hits as ARC moves p, by max(1, other ghosts / these) / entries, weighted by how
    recently the ghost was lost: a weight falling from 1 to 0 over TAPER x the entries, times
    (1 + NEAR_BOOST[q]) falling to 1 over NEAR x the entries (a key back just after it was evicted says
    most clearly that its queue was too short).  The share decides two regimes:

    - frequency (share < RECENCY): a victim read since it was queued gets up to three more rounds of
      queue 1, and a key back from queue 1's ghosts rejoins queue 1 (S3-FIFO with ARC's adaptation);
    - recency (share >= RECENCY): one round per read, and keys back from queue 1's ghosts start over in
      queue 0 (close to LRU, which such workloads favour).

    A third, loop, is told by two rates kept per put over about a pool's worth of puts: the share of
    puts whose key is a ghost, and the hits per put.  When more than LOOP_ENTER of the puts bring ghosts
    back and they outnumber the hits, the pool is cycling through more keys than it holds, and growing
    either queue cannot help: it holds queue 0 at LOOP_SHARE, gives one round per read, sends keys back
    from queue 1's ghosts to queue 0 (so queue 1 keeps what it has instead of trading it for what comes
    round next), and leaves the share alone, until fewer than LOOP_LEAVE of the puts are ghosts.
    benchmarks/sim_eviction.py holds the same rules written out plainly, and bench_policies.py measures
    them against LRU, S3-FIFO and ARC (docs/performance.md).
    """

    name = "auto"
    second_chance = True
    adapt = "auto"
    target = 0.1
    ghosts = (3, 1)
    TAPER = 3.0  # a ghost's weight falls to 0 at this many x the entries deep in its ring
    NEAR = 0.05  # ... and is boosted while fewer than this x the entries deep
    NEAR_BOOST = (12.0, 4.0)  # by up to this much, for ghosts of queue 0 and of queue 1
    RECENCY = 0.3  # queue 0's share at which the recency regime starts
    LOOP_ENTER, LOOP_LEAVE = 0.5, 0.4  # ghosts per put that start and end the loop regime
    LOOP_SHARE = 0.05  # queue 0's share in the loop regime

    def __init__(self) -> None:
        super().__init__("qseq")


# The one table of policy implementations.  Names, help and segment ids live
# in policy_names.py (numpy-free, for the CLI); this must cover exactly those.
POLICIES: dict[str, Policy] = {p.name: p for p in (LRU(), LFU(), FIFO(), PriorityPolicy(), TTLPolicy(), SizePolicy(),
                                                   S3FIFO(), ARC(), Auto())}
assert list(POLICIES) == POLICY_IDS, "eviction.POLICIES and policy_names.POLICY_IDS disagree"


def policy_by_id(pid: int) -> Policy | None:
    return POLICIES[POLICY_IDS[pid]] if 0 <= pid < len(POLICY_IDS) else None


class VictimCache:
    """A shared victim list, interpreted for one policy.

    All methods run under the pool lock.  `h` is the header record array,
    `s` the slot columns, `v` the victim-list columns (its rows), `clock` the
    pool's clock.  Rows [pos, count) of the list are the best victims known,
    best first; every live entry not in those rows scores at least as high as
    the last of them (max_primary, max_secondary).  `words`: the list's header
    words (layout.VICTIM_LIST_WORDS), indices into `list_views` (default: the
    header's, `hdr_views`); `member`: (column, value) to list only
    the entries whose column holds the value (a queue pool lists each queue
    apart: queues.py).
    """

    def __init__(
        self, policy: Policy, h: np.ndarray, s: dict[str, np.ndarray], v: dict[str, np.ndarray],
        clock: Callable[[], float], hdr_views: tuple[memoryview, memoryview, memoryview],
        col_views: dict[str, memoryview], words: tuple[int, ...] = VICTIM_LIST_WORDS[0],
        member: tuple[np.ndarray, int] | None = None,
        list_views: tuple[memoryview, memoryview, memoryview] | None = None,
    ) -> None:
        self.policy = policy
        self.h = h
        self.s = s
        self.clock = clock
        self.rows = v["slot"].size
        self.member = member
        # numpy for the scans; memoryviews for the per-eviction scalars.
        self._ident = s[policy.identity]
        self._sec = s[policy.secondary]
        self._state = s["state"]
        self._pins = s["pins"]
        self._vslot, self._vident = v["slot"], v["ident"]
        self._vprim, self._vsec = v["primary"], v["secondary"]
        self._hu64 = hdr_views[1]  # the pool header's (lfu_epoch)
        # The views the list's own words index: the pool header's, or (queue pools' list 1) the queue header's.
        self._lu32, self._lu64, self._lf64 = list_views if list_views is not None else hdr_views
        (self._w_valid, self._w_count, self._w_pos, self._w_next_expiry, self._w_max_primary,
         self._w_max_secondary, self._w_epoch) = words
        self._m_state, self._m_pins = col_views["state"], col_views["pins"]
        self._m_ident, self._m_expiry = col_views[policy.identity], col_views["expiry"]
        self._m_sec = col_views[policy.secondary]
        self._m = col_views

    def invalidate(self) -> None:
        self._lu32[self._w_valid] = 0

    def _score(self, i: int) -> tuple[float, int]:
        e = self._m_expiry[i]
        if 0 < e <= self.clock():
            return -INF, int(_expiry_key(e))
        return self.policy.primary_one(self._m, i, self._hu64[H_LFU_EPOCH]), self._m_sec[i]

    def on_score_change(self, i: int) -> None:
        """Call after a put or hit gave slot `i` a new score (non-monotone policies)."""
        if not self._lu32[self._w_valid]:
            return
        # Fast exit for the usual case, an unexpired entry scoring above the
        # last listed victim: one primary score, one comparison.
        e = self._m_expiry[i]
        if (e == 0 or e > self.clock()) and self.policy.primary_one(
            self._m, i, self._hu64[H_LFU_EPOCH]
        ) > self._lf64[self._w_max_primary]:
            return
        self._offer(i)

    def on_unpin(self, i: int) -> None:
        """Call when sealed slot `i` loses its last pin: the list may have skipped it."""
        if not self._lu32[self._w_valid]:
            return
        pos, count = self._lu32[self._w_pos], self._lu32[self._w_count]
        rows = np.flatnonzero(self._vslot[pos:count] == i)
        if rows.size and self._vident[pos + rows[0]] == self._ident[i]:
            return  # still listed, and unchanged
        self._offer(i)
        self.on_expiry_set(float(self.s["expiry"][i]))

    def _offer(self, i: int) -> None:
        """Put slot `i` into the list if it scores below the last listed victim, where it sorts; the fewer rows
        move: those before it up into the row taken last, or those after it down (a full list dropping its
        last row).  _fastpath_entries.h's offer does the same in C."""
        hu32 = self._lu32
        p, sec = self._score(i)
        mp, ms = self._lf64[self._w_max_primary], self._lu64[self._w_max_secondary]
        if not (p < mp or (p == mp and sec < ms)):
            return
        pos, count = hu32[self._w_pos], hu32[self._w_count]
        prim, vsec = self._vprim[pos:count], self._vsec[pos:count]
        after = np.flatnonzero((prim > p) | ((prim == p) & (vsec > sec)))
        if not after.size:
            return  # the list is used up: the next eviction rescans anyway
        k = pos + int(after[0])
        if pos > 0 and k - pos < count - k:  # fewer rows before it: they move up into the row taken last
            for col in (self._vslot, self._vident, self._vprim, self._vsec):
                col[pos - 1 : k - 1] = col[pos:k].copy()
            k -= 1
            hu32[self._w_pos] = pos - 1
        else:
            end = count if count < self.rows else count - 1  # a full list drops its last row
            for col in (self._vslot, self._vident, self._vprim, self._vsec):
                col[k + 1 : end + 1] = col[k:end].copy()
            count = end + 1
            hu32[self._w_count] = count
        self._vslot[k], self._vident[k] = i, self._ident[i]
        self._vprim[k], self._vsec[k] = p, sec
        self._lf64[self._w_max_primary] = float(self._vprim[count - 1])
        self._lu64[self._w_max_secondary] = int(self._vsec[count - 1])

    def on_expiry_set(self, expiry: float) -> None:
        if 0 < expiry < self._lf64[self._w_next_expiry]:
            self._lf64[self._w_next_expiry] = expiry

    def peek(self) -> tuple[int, bool]:
        """(slot, expired) of the next entry to evict, left at the head of the list, or (-1, False)."""
        hu32, hu64 = self._lu32, self._hu64
        for attempt in range(2):
            if not hu32[self._w_valid] or self.clock() >= self._lf64[self._w_next_expiry] or (
                self._lu64[self._w_epoch] != hu64[H_LFU_EPOCH]
            ):
                if not self.fill():
                    return -1, False
            pos, count = hu32[self._w_pos], hu32[self._w_count]
            vslot, vident = self._vslot, self._vident
            state, pins, ident = self._m_state, self._m_pins, self._m_ident
            while pos < count:
                i = int(vslot[pos])
                # Skipped rows (pinned, changed, gone) come back through
                # on_unpin / on_score_change if they still belong here.
                if state[i] == SEALED and pins[i] == 0 and ident[i] == vident[pos]:
                    hu32[self._w_pos] = pos
                    e = self._m_expiry[i]
                    return i, (0 < e <= self.clock())
                pos += 1
            hu32[self._w_pos] = pos
            hu32[self._w_valid] = 0
        return -1, False

    def may_expire(self) -> bool:
        """Could `peek` give an expired entry?  (The list is stale, an entry expired since the scan, or
        the scan listed expired entries, which come first: one header word and one row to look at.)"""
        hu32 = self._lu32
        if not hu32[self._w_valid] or self.clock() >= self._lf64[self._w_next_expiry]:
            return True
        pos = hu32[self._w_pos]
        return pos < hu32[self._w_count] and self._vprim[pos] == -INF

    def take(self) -> None:
        """Take the entry `peek` just gave off the list."""
        self._lu32[self._w_pos] += 1

    def next_victim(self) -> tuple[int, bool]:
        """(slot, expired) of the next entry to evict, taken off the list, or (-1, False) if none can be."""
        i, expired = self.peek()
        if i >= 0:
            self._lu32[self._w_pos] += 1
        return i, expired

    def fill(self) -> bool:
        """Scan all live entries and list the best `rows` victims; False if none.

        In the steady state of a full cache every entry is live and none has
        expired: then the scan works on the columns themselves (views), with
        no index gathers, which halves its cost.
        """
        s = self.s
        hu32, hu64, hf64 = self._lu32, self._hu64, self._lf64
        now = self.clock()
        epoch = int(hu64[H_LFU_EPOCH])
        self._lu64[self._w_epoch] = epoch
        hu32[self._w_pos] = 0
        live_mask = (self._state == SEALED) & (self._pins == 0)
        if self.member is not None:
            live_mask &= self.member[0] == self.member[1]
        n_live = int(np.count_nonzero(live_mask))
        if n_live == 0:
            hu32[self._w_valid] = 0
            hu32[self._w_count] = 0
            return False
        # `live`: slot numbers of live entries, or None for "every slot".
        live = None if n_live == live_mask.size else np.flatnonzero(live_mask)
        exp = s["expiry"] if live is None else s["expiry"][live]
        sec_all = self._sec if live is None else self._sec[live]
        expired = np.empty(0, dtype=np.int64)
        rest = None  # positions (within live) of unexpired entries; None for all
        next_expiry = INF
        if exp.any():
            is_expired = (exp > 0) & (exp <= now)
            expired = np.flatnonzero(is_expired)
            expired = expired[np.argsort(exp[expired], kind="stable")][: self.rows]
            if expired.size:
                rest = np.flatnonzero(~is_expired)
            future = exp[exp > now]
            next_expiry = float(future.min()) if future.size else INF
        n_rest = n_live if rest is None else rest.size
        room = self.rows - expired.size
        chosen = np.empty(0, dtype=np.int64)  # positions within live
        prim_chosen = np.empty(0)
        if room > 0 and n_rest:
            if rest is None:
                prim = self.policy.primary(s, slice(None) if live is None else live, epoch)
                sec = sec_all
            else:
                prim = self.policy.primary(s, rest if live is None else live[rest], epoch)
                sec = sec_all[rest]
            if n_rest > room and self.policy.constant_primary:
                pool = np.argpartition(sec, room - 1)[:room]
            elif n_rest > room and self.policy.integer_primary and (folded := _fold(prim, sec)) is not None:
                pool = np.argpartition(folded, room - 1)[:room]
            elif n_rest > room:
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
                pool = np.arange(n_rest)
            order = pool[np.lexsort((sec[pool], prim[pool]))][:room]
            chosen = order if rest is None else rest[order]
            prim_chosen = prim[order]
        rows = np.concatenate([expired, chosen])
        n = rows.size
        victims = rows if live is None else live[rows]
        self._vslot[:n] = victims
        self._vident[:n] = self._ident[victims]
        self._vprim[:n] = np.concatenate([np.full(expired.size, -INF), prim_chosen])
        self._vsec[:n] = np.concatenate([_expiry_key(exp[expired]), sec_all[chosen]])
        hu32[self._w_count] = n
        hf64[self._w_max_primary] = self._vprim[n - 1]
        self._lu64[self._w_max_secondary] = int(self._vsec[n - 1])
        hf64[self._w_next_expiry] = next_expiry
        hu32[self._w_valid] = 1
        return True


def check_selector(percent: Any, nbytes: Any, expired: bool, keys: Any, prefix: Any, all: bool,
                   names: tuple[str, ...] | None = None) -> int | None:
    """Check that exactly one eviction selector is given (the CLI's rule too: `names` spells its options);
    return the byte target of `nbytes`."""
    chosen = [percent is not None, nbytes is not None, bool(expired), keys is not None, prefix is not None, bool(all)]
    if sum(chosen) != 1:
        if names:
            raise UsageError(f"give exactly one of {', '.join(names)}")
        raise UsageError("evict needs exactly one of: percent, nbytes, expired, keys, prefix, all")
    if percent is not None and not 0 < percent <= 100:
        raise UsageError(f"percent must be in (0, 100], not {percent!r}")
    return parse_size(nbytes) if nbytes is not None else None


__all__ = ["Policy", "QueuePolicy", "POLICIES", "POLICY_IDS", "POLICY_HELP", "DEFAULT_POLICY", "policy_by_id", "VictimCache", "check_selector"]
