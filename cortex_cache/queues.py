"""The queue policies' machinery: two queues, two victim lists, two ghost rings (docs/internals.md, "Queue policies").

S3-FIFO, ARC and auto (eviction.QueuePolicy says what each is) keep every
sealed entry in one of two queues, and pick a victim from one queue or the
other.  That fits the shared victim list of every other policy once the list
is kept per queue: each queue is ordered by one monotone slot field (qseq, the
time the entry joined the queue's tail, or access_seq), so each queue's
victim list is an ordinary monotone VictimCache over the entries of that
queue, filled by the same vectorised scan and handing out rows the same way.
What is left, and lives here, is small and O(1) per operation:

- `admit`: a new entry (a put, lock held) joins queue 1 if its key is a ghost
  of either queue, else queue 0; with `adapt`, a ghost moves queue 0's target
  (auto: weighted by the ghost's depth, and its regime first: `_auto_admit`);
- `hit`: ARC moves an entry read in queue 0 to queue 1; S3-FIFO and auto
  count the read (at most 3);
- `next_victim`: an expired head of either list first; else queue 0's head
  while queue 0 holds more than its target, else queue 1's; with
  `second_chance` a head read since it was queued moves on instead (to queue
  1, or round queue 1 with one read less -- auto outside its frequency
  regime: with none), and the next head is looked at;
- `evicted`: the victim's key hash goes into its queue's ghost ring.

All of it is shared state in the segment's queue region: its header
(layout.QUEUE_HEADER_FIELDS: the queue counts, the target, the clock, the
rings' windows, queue 1's victim list), the queue columns (queue, freq,
qseq) and the two rings, changed
under the pool lock with the dirty mark set like every other field, so a
process killed half-way is repaired by the next lock holder (`repair`).
The C fast path does all of it itself for its puts (_fastpath_entries.h,
touch; _fastpath_put.c, queue_admit, ghost_add, remove_entry;
_fastpath_evict.c, next_victim), in the same order of operations, so both
paths choose the same victims and leave the same bits
(tests/test_fast_evict.py); what it leaves here is the scan that fills a
list again (VictimCache.fill) and the evictions of a pool whose tier sees
each victim first.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .chains import build_chains, unchain
from .eviction import QueuePolicy, VictimCache
from .layout import (
    GHOST_COLUMNS, MV_FORMAT, QSLOT_COLUMNS, QUEUE_HEADER_DTYPE, QUEUE_HEADER_SIZE, VICTIM_LIST_WORDS, Geometry,
    ghost_buckets, H_HITS, H_N_ENTRIES, Q_COUNT0, Q_COUNT1, Q_G0_HEAD, Q_G0_LIVE, Q_G0_TAIL, Q_G1_HEAD,
    Q_G1_LIVE, Q_G1_TAIL, Q_GHOST_RATE, Q_HIT_RATE, Q_HITS_SEEN, Q_REGIME, Q_SEQ, Q_TARGET, SEALED,
)

MAX_FREQ = 3  # S3-FIFO's cap on an entry's read count
AUTO_ADAPTIVE, AUTO_LOOP = 0, 1  # auto's regimes in the queue header's q_regime (the share tells the other two)


class Ghosts:
    """One ring of key hashes: the keys its queue evicted lately, found by hash (lock held throughout).

    A ghost is remembered while fewer than `factor` x the pool's entries (at the time) were added after
    it; taking it back (its key is put again) forgets it.  The ring has
    `factor` x max entries places, so the window always fits; places are chained by hash like the index.
    """

    def __init__(self, hashes: np.ndarray, nxt: np.ndarray, buckets: np.ndarray, views: tuple, factor: int,
                 qu64: memoryview, words: tuple[int, int, int]) -> None:
        self.hashes, self.nxt_arr, self.buckets_arr = hashes, nxt, buckets
        self._h, self._next, self._bkt = views
        self.n = hashes.size
        self._mask = buckets.size - 1
        self.factor = factor
        self._qu64 = qu64
        self._w_head, self._w_tail, self._w_live = words

    @property
    def live(self) -> int:
        return self._qu64[self._w_live]

    def _find(self, kh: int) -> int:
        p = self._bkt[kh & self._mask]
        steps = 0
        while p >= 0 and steps <= self.n:
            if self._h[p] == kh:
                return p
            p = self._next[p]
            steps += 1
        return -1

    def _forget(self, p: int) -> None:
        kh = self._h[p]
        unchain(self._bkt, self._next, kh & self._mask, p)
        self._h[p] = 0
        self._next[p] = -1
        self._qu64[self._w_live] -= 1

    def take(self, kh: int) -> int:
        """Forget `kh` if it is a ghost here: its depth (how many ghosts were added after it), else -1."""
        if not self.n:
            return -1
        p = self._find(kh or 1)
        if p < 0:
            return -1
        self._forget(p)
        # Place p holds the ghost whose sequence number s has s % n == p, the last such one before head.
        return (self._qu64[self._w_head] - 1 - p) % self.n

    def __contains__(self, kh: int) -> bool:
        return self.n > 0 and self._find(kh or 1) >= 0

    def add(self, kh: int, entries: int) -> None:
        """Remember `kh`, forgetting what falls out of the window of `factor` x `entries` ghosts.  The key of
        an entry being evicted is not looked for first: its put took it back from both rings (`admit`), so
        it is never a ghost here (but for keys sharing all 64 bits of a hash: both are remembered, the later
        found first, the other forgotten at the tail)."""
        if not self.n:
            return
        kh = kh or 1  # 0 marks an empty place
        qu64 = self._qu64
        head, tail = qu64[self._w_head], qu64[self._w_tail]
        window = min(self.n, self.factor * max(1, entries))
        while head + 1 - tail > window:
            q = tail % self.n
            if self._h[q]:
                self._forget(q)
            tail += 1
        qu64[self._w_tail] = tail
        p = head % self.n
        b = kh & self._mask
        self._h[p] = kh
        self._next[p] = self._bkt[b]
        self._bkt[b] = p
        qu64[self._w_head] = head + 1
        qu64[self._w_live] += 1

    def repair(self, fix: bool) -> list[str]:
        """Check (and with `fix` rebuild) the ring: its window, its count and its chains (lock held)."""
        qu64 = self._qu64
        head, tail = qu64[self._w_head], qu64[self._w_tail]
        problems = []
        pos = np.arange(self.n, dtype=np.int64)
        if tail > head or head - tail > self.n:
            problems.append("a ghost ring's window is impossible: its ghosts forgotten")
            inside = np.zeros(self.n, dtype=bool)
            tail = head
        else:
            # Place p holds sequence number s with s % n == p; the window is [tail, head).
            first = tail % self.n if self.n else 0
            span = head - tail
            inside = ((pos - first) % max(1, self.n)) < span
        keep = inside & (self.hashes != 0)
        live = int(np.count_nonzero(keep))
        if live != qu64[self._w_live] and not problems:
            problems.append("a ghost ring's count was out of step")
        if fix:
            self.hashes[~keep] = 0
            members = np.flatnonzero(keep)
            bkt, nxt = build_chains(members, self.hashes[members], self._mask, self.buckets_arr.size, self.n,
                                    np.empty(0, dtype=np.int64))
            self.buckets_arr[:] = bkt
            self.nxt_arr[:] = nxt
            qu64[self._w_tail] = tail
            qu64[self._w_live] = live
        return problems


def _auto_weight(pol: QueuePolicy, depth: int, n: float, boost: float) -> float:
    """How much a ghost `depth` deep in its ring moves auto's share (times the ratio, over n): falling from 1 to
    0 over TAPER x n, times 1 + `boost` falling to 1 over NEAR x n (a key back at once counts most)."""
    far = max(0.0, 1.0 - depth / (pol.TAPER * n))  # type: ignore[attr-defined]
    near = max(0.0, 1.0 - depth / (pol.NEAR * n))  # type: ignore[attr-defined]
    return far * (1.0 + boost * near)


class QueueVictims:
    """The victim choice of a queue policy: the interface of VictimCache, over two of them (lock held)."""

    def __init__(self, policy: QueuePolicy, lists: tuple[VictimCache, VictimCache], ghosts: tuple[Ghosts, Ghosts],
                 cols: dict[str, np.ndarray], views: dict[str, memoryview],
                 hdr_views: tuple[memoryview, memoryview, memoryview],
                 q_views: tuple[memoryview, memoryview, memoryview], header: np.ndarray,
                 clock: Callable[[], float]) -> None:
        self.policy = policy
        self.second_chance = policy.second_chance
        self.arc = policy.adapt == "arc"
        self.auto = policy.adapt == "auto"
        self.lists = lists
        self.ghosts = ghosts
        self.cols = cols
        self._queue, self._freq, self._qseq = views["queue"], views["freq"], views["qseq"]
        self._state, self._khash, self._expiry = views["state"], views["key_hash"], views["expiry"]
        self._hu64 = hdr_views[1]  # the pool header's (n_entries)
        self._qu32, self._qu64, self._qf64 = q_views  # the queue header's (Q_* words)
        self.header = header  # the queue header as a record (inspection, tests)
        self.clock = clock

    # ---- the VictimCache interface
    def invalidate(self) -> None:
        for lst in self.lists:
            lst.invalidate()

    def on_score_change(self, i: int) -> None:  # pragma: no cover - queue policies are monotone
        pass

    def on_unpin(self, i: int) -> None:
        self.lists[self._queue[i] & 1].on_unpin(i)

    def on_expiry_set(self, expiry: float) -> None:
        for lst in self.lists:
            lst.on_expiry_set(expiry)

    def next_victim(self) -> tuple[int, bool]:
        """(slot, expired) of the next entry to evict, or (-1, False) if none can be."""
        lists, qu64 = self.lists, self._qu64
        while True:
            n0, n1 = qu64[Q_COUNT0], qu64[Q_COUNT1]
            if (n0 and lists[0].may_expire()) or (n1 and lists[1].may_expire()):
                i, q = self._expired_first(n0, n1)
                if i < 0 or q < 0:
                    return i, q < 0
            else:
                # The queue the rule picks, or the other when the rule's has nothing to give (all pinned,
                # or empty: an empty queue is not scanned, which a list finding nothing would do each time).
                q = 0 if n0 and (not n1 or self._from_queue0(n0, n1)) else 1
                i = lists[q].peek()[0] if (n0, n1)[q] else -1
                if i < 0:
                    q = 1 - q
                    i = lists[q].peek()[0] if (n0, n1)[q] else -1
                    if i < 0:
                        return -1, False
            lists[q].take()
            if not (self.second_chance and self._freq[i]):
                return i, False
            # Read since it was queued: it moves on, and the next head is looked at.
            if q == 0:
                self._move(i, 0, 1)
                self._freq[i] = 0
            elif self.frequency_regime():
                self._freq[i] -= 1
            else:
                self._freq[i] = 0
            self._qseq[i] = self._tick()

    def _expired_first(self, n0: int, n1: int) -> tuple[int, int]:
        """next_victim's choice when a list may hold an expired entry: (slot, queue) of the soonest expired
        head, taken off its list, with queue -1; else of the rule's choice (not taken); (-1, 0) if none."""
        l0, l1 = self.lists
        none = (-1, False)
        i0, e0 = l0.peek() if n0 else none
        i1, e1 = l1.peek() if n1 else none
        if e0 or e1:  # expired entries go before any policy victim: the soonest of both heads
            exp = self._expiry
            lst, i = (l0, i0) if e0 and not (e1 and exp[i1] < exp[i0]) else (l1, i1)
            lst.take()
            return i, -1
        if i0 < 0 and i1 < 0:
            return -1, 0
        if i1 < 0 or (i0 >= 0 and self._from_queue0(n0, n1)):
            return i0, 0
        return i1, 1

    # ---- what the core tells the policy
    def admit(self, i: int) -> None:
        """Queue slot `i`, just given a new value (Core._stamp): queue 1 if its key is a ghost, else 0."""
        if self._state[i] == SEALED:  # written over in place: it leaves its queue first
            self.removed(i)
        g0, g1 = self.ghosts
        kh = self._khash[i]
        entries = self._hu64[H_N_ENTRIES]
        live0, live1 = g0.live, g1.live
        if self.auto:
            q = self._auto_admit(kh, entries, live0, live1)
        else:
            q = 1
            if g0.take(kh) >= 0:
                self._adapt_arc(1, live1, live0, entries)
            elif g1.take(kh) >= 0:
                self._adapt_arc(-1, live0, live1, entries)
            else:
                q = 0
        self._queue[i] = q
        self._freq[i] = 0
        self._qseq[i] = self._tick()
        self._qu64[Q_COUNT0 + q] += 1

    def _auto_admit(self, kh: int, entries: int, live0: int, live1: int) -> int:
        """auto's admission of key hash `kh` (eviction.Auto; _fastpath_put.h's auto_admit does the same, in
        the same order of operations, so both paths leave the same bits): the regime first, from the two
        rates; then the queue, and in the adaptive regimes the move of queue 0's share."""
        pol, qu32, qu64, qf64 = self.policy, self._qu32, self._qu64, self._qf64
        g0, g1 = self.ghosts
        n = float(max(1, entries))
        ghost = 1.0 if kh in g0 or kh in g1 else 0.0
        hits = self._hu64[H_HITS]
        seen = qu64[Q_HITS_SEEN]
        fresh = float(hits - seen) if hits >= seen else 0.0  # a counter reset is no burst of hits
        qu64[Q_HITS_SEEN] = hits
        rate = qf64[Q_GHOST_RATE] + (ghost - qf64[Q_GHOST_RATE]) / n
        hit_rate = qf64[Q_HIT_RATE] + (fresh - qf64[Q_HIT_RATE]) / n
        qf64[Q_GHOST_RATE], qf64[Q_HIT_RATE] = rate, hit_rate
        if qu32[Q_REGIME] == AUTO_LOOP:
            if rate < pol.LOOP_LEAVE:
                qu32[Q_REGIME] = AUTO_ADAPTIVE
        elif rate > pol.LOOP_ENTER and hit_rate < rate:
            qu32[Q_REGIME] = AUTO_LOOP
        d0 = g0.take(kh)
        d1 = g1.take(kh) if d0 < 0 else -1
        if qu32[Q_REGIME] == AUTO_LOOP:
            return 1 if d0 >= 0 else 0
        t = qf64[Q_TARGET]
        if d0 >= 0:
            w = _auto_weight(pol, d0, n, pol.NEAR_BOOST[0]) * max(1.0, live1 / max(1, live0))
            qf64[Q_TARGET] = min(1.0, t + w / n)
            return 1
        if d1 >= 0:
            w = _auto_weight(pol, d1, n, pol.NEAR_BOOST[1]) * max(1.0, live0 / max(1, live1))
            t = max(0.0, t - w / n)
            qf64[Q_TARGET] = t
            return 1 if t < pol.RECENCY else 0
        return 0

    def hit(self, i: int) -> None:
        """A read of sealed slot `i` (Core.touch; _fastpath.c's touch does the same)."""
        if self.second_chance:
            if self._freq[i] < MAX_FREQ:
                self._freq[i] += 1
        elif self._queue[i] == 0:
            self._move(i, 0, 1)

    def in_queue1(self, i: int) -> bool:
        return self._queue[i] == 1

    def removed(self, i: int) -> None:
        """Sealed slot `i` leaves the index (Core.remove)."""
        w = Q_COUNT0 + (self._queue[i] & 1)
        if self._qu64[w]:
            self._qu64[w] -= 1

    def evicted(self, i: int) -> None:
        """Slot `i` is evicted by the policy (not expired, not deleted): remember its key."""
        self.ghosts[self._queue[i] & 1].add(self._khash[i], self._hu64[H_N_ENTRIES])

    # ---- the rules
    def share(self) -> float:
        """Queue 0's target as a share of the entries (s3fifo, auto): auto's loop regime holds its own."""
        if self.auto and self._qu32[Q_REGIME] == AUTO_LOOP:
            return self.policy.LOOP_SHARE
        return self._qf64[Q_TARGET]

    def frequency_regime(self) -> bool:
        """Whether a read earns up to MAX_FREQ rounds of queue 1 (s3fifo always; auto in one regime)."""
        if not self.auto:
            return True
        return self._qu32[Q_REGIME] != AUTO_LOOP and self._qf64[Q_TARGET] < self.policy.RECENCY

    def _from_queue0(self, n0: int, n1: int) -> bool:
        """The rule: queue 0 while it holds more than its target."""
        if self.arc:
            return n0 > self._qf64[Q_TARGET]
        return n0 >= self.share() * (n0 + n1)

    def _adapt_arc(self, sign: int, other: int, this: int, entries: int) -> None:
        """ARC's rule: a ghost of queue 0 grows p, one of queue 1 shrinks it, by max(1, other/this) entries."""
        if self.arc:  # p in entries, integer steps (Megiddo and Modha's)
            qf64 = self._qf64
            step = max(1, other // max(1, this))
            qf64[Q_TARGET] = min(float(entries), max(0.0, qf64[Q_TARGET] + sign * step))

    def _move(self, i: int, a: int, b: int) -> None:
        self._queue[i] = b
        if self._qu64[Q_COUNT0 + a]:
            self._qu64[Q_COUNT0 + a] -= 1
        self._qu64[Q_COUNT0 + b] += 1
        # Queue b's list was filled without it: its expiry must still make that list look again.
        self.lists[b].on_expiry_set(self._expiry[i])

    def _tick(self) -> int:
        seq = self._qu64[Q_SEQ] + 1
        self._qu64[Q_SEQ] = seq
        return seq

    # ---- repair
    def repair(self, fix: bool) -> list[str]:
        """Check (with `fix`: rebuild) the queue counts, queue numbers and ghost rings from the slots (lock held)."""
        problems = []
        state, queue = self.cols["state"], self.cols["queue"]
        bad = queue > 1
        if bad.any():
            problems.append(f"{int(bad.sum())} entr(y/ies) in no queue put in queue 0")
        sealed = state == SEALED
        n1 = int(np.count_nonzero(sealed & (queue == 1)))
        n0 = int(np.count_nonzero(sealed)) - n1
        qu64, qf64 = self._qu64, self._qf64
        if (qu64[Q_COUNT0], qu64[Q_COUNT1]) != (n0, n1) and not problems:
            problems.append("queue counts out of step with the entries")
        t = qf64[Q_TARGET]
        limit = float(self.cols["state"].size) if self.policy.adapt == "arc" else 1.0
        if not 0.0 <= t <= limit:  # NaN too
            problems.append("queue target out of range")
        regime_ok = self._regime_sound()
        if not regime_ok:
            problems.append("auto's regime or rates out of range")
        for g in self.ghosts:
            problems += g.repair(fix)
        if fix:
            queue[bad] = 0
            self.cols["freq"][self.cols["freq"] > MAX_FREQ] = MAX_FREQ
            qu64[Q_COUNT0], qu64[Q_COUNT1] = n0, n1
            if not 0.0 <= t <= limit:
                qf64[Q_TARGET] = self.policy.target
            if not regime_ok:  # learnt again from the next puts, as at create
                self._qu32[Q_REGIME] = AUTO_ADAPTIVE
                qf64[Q_GHOST_RATE] = qf64[Q_HIT_RATE] = 0.0
            self.invalidate()
        return problems

    def _regime_sound(self) -> bool:
        """auto's regime is one of its two and its rates are rates (zero for the other policies)."""
        qf64 = self._qf64
        if not self.auto:
            return self._qu32[Q_REGIME] == 0 and qf64[Q_GHOST_RATE] == 0.0 and qf64[Q_HIT_RATE] == 0.0
        return (self._qu32[Q_REGIME] in (AUTO_ADAPTIVE, AUTO_LOOP) and 0.0 <= qf64[Q_GHOST_RATE] <= 1.0
                and 0.0 <= qf64[Q_HIT_RATE] < float("inf"))


def build(policy: QueuePolicy, mv: memoryview, geometry: Geometry, header: np.ndarray,
          columns: dict[str, np.ndarray], views: dict[str, memoryview], hdr_views: tuple,
          victims: dict[str, np.ndarray], clock: Callable[[], float], typed: list) -> QueueVictims:
    """The QueueVictims over a queue pool's mapping `mv`: `columns`/`views` are the slot columns (numpy and
    typed views), `victims` the victim-list columns, whose rows the two lists share half and half.
    `typed` collects the memoryviews made here, for Core.close to release."""
    g = geometry
    mm = mv.obj  # numpy arrays over the mapping itself, as the core's are (close releases `mv` after them)
    cols, vws = dict(columns), dict(views)
    qo = g.qslot_columns()
    for name, fmt in QSLOT_COLUMNS:
        size = np.dtype(fmt).itemsize
        cols[name] = np.frombuffer(mm, fmt, g.n_slots, qo[name])
        vws[name] = mv[qo[name] : qo[name] + g.n_slots * size].cast(MV_FORMAT[fmt])
        typed.append(vws[name])
    qoff = g.qslots_off
    qmv = mv[qoff : qoff + QUEUE_HEADER_SIZE]
    q_views = (qmv.cast("I"), qmv.cast("Q"), qmv.cast("d"))
    typed.extend(q_views)
    typed.append(qmv)
    qheader = np.frombuffer(mm, QUEUE_HEADER_DTYPE, 1, qoff)
    half = victims["slot"].size // 2
    lists = tuple(
        VictimCache(policy, header, cols, {k: c[q * half : (q + 1) * half] for k, c in victims.items()},
                    clock, hdr_views, vws, VICTIM_LIST_WORDS[q], (cols["queue"], q),
                    None if q == 0 else q_views)
        for q in (0, 1)
    )
    rings = []
    for q, words in ((0, (Q_G0_HEAD, Q_G0_TAIL, Q_G0_LIVE)), (1, (Q_G1_HEAD, Q_G1_TAIL, Q_G1_LIVE))):
        offs, n, boff = g.ghost_columns(q)
        nb = max(1, ghost_buckets(n))
        if n:
            hashes, nxt = (np.frombuffer(mm, fmt, n, offs[name]) for name, fmt in GHOST_COLUMNS)
            bkt = np.frombuffer(mm, np.int32, nb, boff)
            vs = tuple(mv[offs[name] : offs[name] + n * np.dtype(fmt).itemsize].cast(MV_FORMAT[fmt])
                       for name, fmt in GHOST_COLUMNS) + (mv[boff : boff + nb * 4].cast("i"),)
            typed.extend(vs)
        else:  # s3fifo keeps no ghosts of its main queue
            hashes, nxt, bkt = np.zeros(0, np.uint64), np.zeros(0, np.int32), np.full(1, -1, np.int32)
            vs = (memoryview(hashes), memoryview(nxt), memoryview(bkt))
        rings.append(Ghosts(hashes, nxt, bkt, vs, policy.ghosts[q], q_views[1], words))
    return QueueVictims(policy, lists, (rings[0], rings[1]), cols, vws, hdr_views, q_views, qheader, clock)


__all__ = ["Ghosts", "QueueVictims", "build", "MAX_FREQ", "AUTO_ADAPTIVE", "AUTO_LOOP"]
