#!/usr/bin/env python
"""Exact simulations of eviction policies on the Mooncake traces, to iterate on ideas quickly.

    python benchmarks/sim_eviction.py [--data DIR] [--policies lru,s3fifo,arc,auto] [--caps 2000,6000,20000]

Block hit rate as in benchmarks/traces/README.md: requests replayed in order, each block looked up in
turn (a cached block is a hit for the policy, counted only while the request's leading blocks all
hit), and every block missing is inserted.  Capacity is in blocks.  Each policy is a small class
with `get(key) -> bool` (a hit also refreshes the key) and `put(key)` (a miss: insert, evicting as
needed), written as the papers define them, so the pool's implementations (cortex_cache/eviction.py)
can be compared with them victim by victim.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parent / "traces"


class LRU:
    def __init__(self, cap: int) -> None:
        self.cap, self.d = cap, OrderedDict()

    def get(self, k) -> bool:
        if k in self.d:
            self.d.move_to_end(k)
            return True
        return False

    def put(self, k) -> None:
        self.d[k] = None
        if len(self.d) > self.cap:
            self.d.popitem(last=False)


class PaperS3FIFO:
    """S3-FIFO as its paper gives it (Yang et al., SOSP'23): a small FIFO (`small` of the capacity) for
    new keys, a main FIFO with lazy promotion (a key read since it was queued goes round again, its
    count less one), a ghost FIFO of the keys evicted from the small queue, as many as the cache holds
    (what reproduces the issue's table): a ghost comes back straight into the main queue.  Counts are
    capped at 3."""

    def __init__(self, cap: int, small: float = 0.1) -> None:
        self.cap = cap
        self.s_cap = max(1, int(cap * small))
        self.S: OrderedDict = OrderedDict()  # key -> reads; first = oldest
        self.M: OrderedDict = OrderedDict()
        self.G: OrderedDict = OrderedDict()

    def get(self, k) -> bool:
        for q in (self.S, self.M):
            if k in q:
                q[k] = min(q[k] + 1, 3)
                return True
        return False

    def put(self, k) -> None:
        while len(self.S) + len(self.M) >= self.cap:
            self._evict()
        if k in self.G:
            del self.G[k]
            self.M[k] = 0
        else:
            self.S[k] = 0

    def _evict(self) -> None:
        if len(self.S) >= self.s_cap or not self.M:
            k, f = self.S.popitem(last=False)
            if f > 0:
                self.M[k] = 0
            else:
                self.G[k] = None
                if len(self.G) > self.cap:
                    self.G.popitem(last=False)
            return
        while True:
            k, f = self.M.popitem(last=False)
            if f == 0:
                return
            self.M[k] = f - 1


class PaperARC:
    """ARC as its paper gives it (Megiddo and Modha, FAST'03), with integer p and integer steps: T1
    holds keys seen once recently, T2 keys seen at least twice, each LRU; B1 and B2 are ghosts of what
    each lost, |T1| + |B1| <= c and all four <= 2c.  A miss found in B1 grows T1's target p, one found
    in B2 shrinks it; replacement takes T1's LRU key while T1 is above p."""

    def __init__(self, cap: int) -> None:
        self.c, self.p = cap, 0
        self.T1: OrderedDict = OrderedDict()
        self.T2: OrderedDict = OrderedDict()
        self.B1: OrderedDict = OrderedDict()
        self.B2: OrderedDict = OrderedDict()

    def get(self, k) -> bool:
        if k in self.T1:
            del self.T1[k]
            self.T2[k] = None
            return True
        if k in self.T2:
            self.T2.move_to_end(k)
            return True
        return False

    def _replace(self, in_b2: bool) -> None:
        t1 = len(self.T1)
        if t1 and (t1 > self.p or (in_b2 and t1 == self.p)):
            k, _ = self.T1.popitem(last=False)
            self.B1[k] = None
        else:
            k, _ = self.T2.popitem(last=False)
            self.B2[k] = None

    def put(self, k) -> None:
        c = self.c
        if k in self.B1:
            self.p = min(c, self.p + max(len(self.B2) // len(self.B1), 1))
            self._replace(False)
            del self.B1[k]
            self.T2[k] = None
            return
        if k in self.B2:
            self.p = max(0, self.p - max(len(self.B1) // len(self.B2), 1))
            self._replace(True)
            del self.B2[k]
            self.T2[k] = None
            return
        l1 = len(self.T1) + len(self.B1)
        if l1 == c:
            if len(self.T1) < c:
                self.B1.popitem(last=False)
                self._replace(False)
            else:
                self.T1.popitem(last=False)
        else:
            total = l1 + len(self.T2) + len(self.B2)
            if total >= c:
                if total == 2 * c:
                    self.B2.popitem(last=False)
                self._replace(False)
        self.T1[k] = None


class Ghosts:
    """A ghost ring as the pool keeps one (queues.Ghosts): a key is remembered while fewer than
    `factor` x the entries (at the time) were added after it; taking it back or adding it again
    forgets the old one.  `take` answers the ghost's depth: how many ghosts were added after it."""

    def __init__(self, factor: int) -> None:
        self.factor, self.d, self.head = factor, OrderedDict(), 0  # key -> sequence number

    def add(self, key, entries: int) -> None:
        if not self.factor:
            return
        self.d.pop(key, None)
        self.d[key] = self.head
        self.head += 1
        window = self.factor * max(1, entries)
        while self.d:
            k0, s0 = next(iter(self.d.items()))
            if self.head - s0 <= window:
                break
            del self.d[k0]

    def take(self, key) -> int | None:
        s = self.d.pop(key, None)
        return None if s is None else self.head - 1 - s

    def __contains__(self, key) -> bool:
        return key in self.d

    def __len__(self) -> int:
        return len(self.d)


# auto's constants (eviction.Auto and queues.py hold the pool's; these must equal them).
AUTO = dict(target=0.1, taper=3.0, near=0.05, boost=(12.0, 4.0), recency=0.3, loop_enter=0.5, loop_leave=0.4,
            loop_share=0.05)


class Queues:
    """The pool's queue policies (eviction.QueuePolicy, queues.py), written out plainly: s3fifo, arc, auto.

    Queue 0 takes new keys and queue 1 keys found in a ghost ring; a victim comes from queue 0 while it
    holds more than its target (arc: p entries; the others: a share of the entries), else from queue 1.
    arc: both queues LRU, a read in queue 0 moves the key to queue 1.  s3fifo and auto: both FIFO, reads
    counted (at most 3); a victim read since it was queued moves on (queue 0 -> queue 1, or round queue 1
    with one read less).  arc moves p on ghost hits by max(1, other ghosts / these).  auto: see `_auto_put`.
    """

    KINDS = {"s3fifo": (0.1, (1, 0)), "arc": (0.0, (1, 1)), "auto": (AUTO["target"], (3, 1))}

    def __init__(self, cap: int, kind: str) -> None:
        self.cap, self.kind = cap, kind
        self.t, factors = self.KINDS[kind]
        self.Q = [OrderedDict(), OrderedDict()]  # key -> reads; first = next victim
        self.G = [Ghosts(factors[0]), Ghosts(factors[1])]
        # auto's regime: adaptive, or loop (LOOP_SHARE, no readmission); its two rates, per put.
        self.loop, self.ghost_rate, self.hit_rate, self.hits = False, 0.0, 0.0, 0
        self.hits_seen = 0

    def __len__(self) -> int:
        return len(self.Q[0]) + len(self.Q[1])

    def get(self, k) -> bool:
        q0, q1 = self.Q
        for q in (q0, q1):
            if k in q:
                self.hits += 1
                if self.kind != "arc":
                    q[k] = min(3, q[k] + 1)
                elif q is q0:
                    del q0[k]
                    q1[k] = 0
                else:
                    q1.move_to_end(k)
                return True
        return False

    def put(self, k) -> None:
        while len(self) >= self.cap:
            self.evict()
        if self.kind == "auto":
            self.Q[self._auto_put(k)][k] = 0
            return
        g0, g1 = self.G
        live0, live1, entries = len(g0), len(g1), len(self)
        if g0.take(k) is not None:
            if self.kind == "arc":
                self.t = min(float(entries), max(0.0, self.t + max(1, live1 // max(1, live0))))
            self.Q[1][k] = 0
        elif g1.take(k) is not None:
            if self.kind == "arc":
                self.t = min(float(entries), max(0.0, self.t - max(1, live0 // max(1, live1))))
            self.Q[1][k] = 0
        else:
            self.Q[0][k] = 0

    def _auto_put(self, k) -> int:
        """auto's admission of key k (a miss): its queue.  Two rates, kept per put over about a pool's
        worth of puts, tell the regime: the share of puts whose key is a ghost, and the hits per put.  When
        most puts bring back ghosts and they outnumber the hits, the pool is cycling through more than it
        holds (a loop): it keeps a fixed small queue and sends keys back from queue 1's ghosts to queue 0,
        so the main queue keeps what it has.  Otherwise a ghost moves queue 0's share as ARC moves p, by
        max(1, other ghosts / these) / entries, weighted by its depth d: (1 - d / (TAPER n)) falling with
        age, and (1 + BOOST) for one lost just now (d < NEAR n, tapering)."""
        a = AUTO
        g0, g1 = self.G
        live0, live1, n = len(g0), len(g1), max(1, len(self))
        ghost = k in g0 or k in g1
        self.ghost_rate += ((1.0 if ghost else 0.0) - self.ghost_rate) / n
        self.hit_rate += ((self.hits - self.hits_seen) - self.hit_rate) / n
        self.hits_seen = self.hits
        if self.loop and self.ghost_rate < a["loop_leave"]:
            self.loop = False
        elif not self.loop and self.ghost_rate > a["loop_enter"] and self.hit_rate < self.ghost_rate:
            self.loop = True
        d0 = g0.take(k)
        d1 = None if d0 is not None else g1.take(k)
        if self.loop:
            return 1 if d0 is not None else 0
        if d0 is not None:
            w = self._weight(d0, n, a["boost"][0]) * max(1.0, live1 / max(1, live0))
            self.t = min(1.0, self.t + w / n)
            return 1
        if d1 is not None:
            w = self._weight(d1, n, a["boost"][1]) * max(1.0, live0 / max(1, live1))
            self.t = max(0.0, self.t - w / n)
            return 1 if self.t < a["recency"] else 0
        return 0

    @staticmethod
    def _weight(d: int, n: int, boost: float) -> float:
        a = AUTO
        return max(0.0, 1.0 - d / (a["taper"] * n)) * (1.0 + boost * max(0.0, 1.0 - d / (a["near"] * n)))

    def regime(self) -> str:
        """auto's regime: loop, recency (queue 0's share at least RECENCY) or frequency."""
        return "loop" if self.loop else "recency" if self.t >= AUTO["recency"] else "frequency"

    def share(self) -> float:
        """Queue 0's target as a share of the entries (auto's regime decides it)."""
        return AUTO["loop_share"] if self.kind == "auto" and self.loop else self.t

    def _from_queue0(self) -> bool:
        n0, n1 = len(self.Q[0]), len(self.Q[1])
        if not n0 or not n1:
            return bool(n0)
        return n0 > self.t if self.kind == "arc" else n0 >= self.share() * (n0 + n1)

    def evict(self):
        """Evict one key; return it."""
        while True:
            q = 0 if self._from_queue0() else 1
            k, f = self.Q[q].popitem(last=False)
            if f and self.kind != "arc":  # read since it was queued: it moves on
                # auto outside its frequency regime gives queue 1 one round per read, not three.
                again = 0 if q == 0 or (self.kind == "auto" and self.regime() != "frequency") else f - 1
                self.Q[1][k] = again
                continue
            self.G[q].add(k, len(self) + 1)
            return k


POLICIES = {
    "lru": LRU,
    "s3fifo": lambda cap: Queues(cap, "s3fifo"),
    "arc": lambda cap: Queues(cap, "arc"),
    "auto": lambda cap: Queues(cap, "auto"),
    "s3fifo-paper": PaperS3FIFO,
    "arc-paper": PaperARC,
}


def load(path: Path) -> list[list[int]]:
    with path.open() as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def replay(policy, reqs: list[list[int]]) -> float:
    hits = total = 0
    get, put = policy.get, policy.put
    for ids in reqs:
        matching = True
        for b in ids:
            total += 1
            if get(b):
                hits += matching
            else:
                matching = False
                put(b)
    return hits / total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--caps", default="2000,6000,20000")
    ap.add_argument("--traces", default="conversation,synthetic")
    args = ap.parse_args(argv)
    names = args.policies.split(",")
    caps = [int(c) for c in args.caps.split(",")]
    print(f"{'trace':<14}{'capacity':>9}" + "".join(f"{n:>9}" for n in names))
    for trace in args.traces.split(","):
        reqs = load(args.data / f"mooncake_{trace}_trace.jsonl")
        for cap in caps:
            rates = [replay(POLICIES[n](cap), reqs) for n in names]
            print(f"{trace:<14}{cap:>9,}" + "".join(f"{r:>9.4f}" for r in rates), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
