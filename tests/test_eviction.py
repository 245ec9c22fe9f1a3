"""Eviction: every policy's victim order, expiry, pins, fragmentation,
targeted eviction, cross-process eviction state and the stats counters.

Most tests use a pool of 8 blocks of 4 KiB where every value (plus its key)
takes exactly one block, so the pool holds exactly 8 entries and each put
into a full pool evicts exactly one victim.  Time comes from a FakeClock
(time is injected, never slept for); no test sleeps.
"""

from __future__ import annotations

import contextlib
import json
import random

import numpy as np
import pytest

import cortex_cache
from cortex_cache import Pool, PoolFull, UsageError
from tests.helpers import run_py, spawn_py

BS = 4096
NBLOCKS = 8
V = b"v" * 100  # one block with any short key


class FakeClock:
    """A clock the test moves by hand (seconds; starts far from zero)."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def now(self) -> float:
        return self.t

    def tick(self, dt: float = 1.0) -> None:
        self.t += dt


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def small(make_pool, clock):
    """Factory: an 8-block pool (8 entries of one block each) on the fake clock."""

    def factory(policy: str = "lru", **kw) -> Pool:
        return make_pool(NBLOCKS * BS, block_size=BS, policy=policy, clock=clock, **kw)

    return factory


def fill(p: Pool, n: int = NBLOCKS, **kw) -> list[str]:
    keys = [f"k{i}" for i in range(n)]
    for k in keys:
        p.put(k, V, **kw)
    return keys


def present(p: Pool) -> set:
    """Live keys (reading them this way is not an access)."""
    return set(p.keys())


def gone(p: Pool, universe) -> set:
    return set(universe) - present(p)


# --------------------------------------------------------------------------- 1. policies


def test_lru_evicts_least_recently_read_or_written(small):
    p = small("lru")
    keys = fill(p)
    assert len(p) == NBLOCKS and p.stats()["blocks_used"] == NBLOCKS
    assert p.get("k0") == V and p.get("k2") == V  # reads refresh k0, k2
    p.put("a", V)
    assert gone(p, keys) == {"k1"}
    p.put("b", V)
    p.put("c", V)
    assert gone(p, keys) == {"k1", "k3", "k4"}
    # A write refreshes too: "a" was written after k5..k7 and k0/k2 were read.
    p.get("k5")
    p.put("d", V)  # order now k6 k7 k0 k2 a b c k5
    assert gone(p, keys + ["a"]) == {"k1", "k3", "k4", "k6"}
    st = p.stats()
    assert st["evictions"] == 4 and st["bytes_evicted"] == 4 * len(V)
    assert st["expirations"] == 0 and st["entries"] == NBLOCKS


def test_fifo_evicts_oldest_insert_regardless_of_reads(small):
    p = small("fifo")
    keys = fill(p)
    for _ in range(3):
        assert p.get("k0") == V  # hits do not save the oldest insert
    p.put("a", V)
    assert gone(p, keys) == {"k0"}
    p.get("k1")
    p.put("b", V)
    p.put("c", V)
    assert gone(p, keys) == {"k0", "k1", "k2"}
    st = p.stats()
    assert st["evictions"] == 3 and st["bytes_evicted"] == 3 * len(V) and st["hits"] == 4


def test_priority_lowest_first_least_recent_among_equals(small):
    p = small("priority")
    prios = [5, 1, 5, 1, 3, 3, 1, 9]
    keys = [f"k{i}" for i in range(NBLOCKS)]
    for k, pr in zip(keys, prios):
        p.put(k, V, priority=pr)
    p.get("k1")  # k1 becomes the most recent of the priority-1 entries
    for n in ("a", "b", "c"):
        p.put(n, V, priority=7)
    assert gone(p, keys) == {"k3", "k6", "k1"}  # all priority 1, least recent first
    p.get("k4")
    p.put("d", V, priority=7)
    assert gone(p, keys) == {"k3", "k6", "k1", "k5"}  # priority 3: k5 is now less recent than k4
    # A fresh entry with a low priority is the next victim, newest or not.
    p.put("e", V, priority=-1)  # evicts k4, the last priority-3 entry
    p.put("f", V, priority=7)
    assert "e" not in p and "f" in p
    assert gone(p, keys) == {"k3", "k6", "k1", "k5", "k4"}
    st = p.stats()
    assert st["evictions"] == 6 and st["bytes_evicted"] == 6 * len(V)


def test_ttl_policy_soonest_expiry_first_no_ttl_last(small, clock):
    p = small("ttl")
    ttls = [None, 50, 30, None, 40, 30, None, 100]
    keys = [f"k{i}" for i in range(NBLOCKS)]
    for k, t in zip(keys, ttls):
        p.put(k, V, ttl=t)
    p.get("k2")  # k2 and k5 expire together: k5 is now the less recent
    clock.tick(10)  # nothing has expired yet
    order = []
    for n in ("a", "b", "c", "d", "e", "f", "g"):
        before = present(p)
        p.put(n, V)
        (victim,) = before - present(p)
        order.append(victim)
    # Soonest expiry first, then the entries without a TTL, least recent first.
    assert order == ["k5", "k2", "k4", "k1", "k7", "k0", "k3"]
    st = p.stats()
    assert st["evictions"] == 7 and st["expirations"] == 0 and st["bytes_evicted"] == 7 * len(V)


def test_size_policy_largest_value_first(small):
    p = small("size")
    sizes = [100, 3000, 500, 3000, 200, 4000, 50, 1000]
    keys = [f"k{i}" for i in range(NBLOCKS)]
    for k, n in zip(keys, sizes):
        p.put(k, b"s" * n)
    assert p.stats()["blocks_used"] == NBLOCKS  # each value is one block
    p.put("a", b"x" * 10)
    assert gone(p, keys) == {"k5"}
    p.get("k1")  # k1 and k3 are equally large: k3 is now the less recent
    p.put("b", b"x" * 10)
    assert gone(p, keys) == {"k5", "k3"}
    p.put("c", b"x" * 10)
    p.put("d", b"x" * 10)
    assert gone(p, keys) == {"k5", "k3", "k1", "k7"}
    st = p.stats()
    assert st["evictions"] == 4 and st["bytes_evicted"] == 4000 + 3000 + 3000 + 1000


def test_lfu_fewest_accesses_least_recent_among_equals(small):
    p = small("lfu")  # default aging period (>= 1024 ops): no aging in this test
    keys = fill(p)
    for k, n in [("k0", 3), ("k1", 2), ("k2", 1), ("k3", 1), ("k4", 1), ("k5", 1), ("k6", 1)]:
        for _ in range(n):
            p.get(k)
    # counts: k0 4, k1 3, k2..k6 2, k7 1
    p.put("a", V)
    assert gone(p, keys) == {"k7"}
    # The newcomer has the fewest accesses of all, so it is the next victim.
    p.put("b", V)
    assert gone(p, keys + ["a"]) == {"k7", "a"}
    for _ in range(3):
        p.get("b")
    p.get("k2")  # k2 3; k3..k6 tie at 2: k3 is the least recent
    p.put("c", V)
    p.put("d", V)
    assert gone(p, keys + ["a", "b"]) == {"k7", "a", "k3"}
    assert "c" not in p  # evicted by "d": count 1, the fewest
    st = p.stats()
    assert st["evictions"] == 4 and st["bytes_evicted"] == 4 * len(V)


def _lfu_once_hot_trace(put, get, live) -> list[str]:
    """Make "hot" very popular, then never touch it again while the others stay warm.

    Runs on a pool or on the reference Model (below); returns the victim of
    each put after the hot phase.
    """
    put("hot")
    for _ in range(20):
        get("hot")
    for i in range(NBLOCKS - 1):
        put(f"w{i}")
    victims = []
    for r in range(12):
        for k in sorted(live() - {"hot"}):
            get(k)
            get(k)
        before = live()
        put(f"new{r}")
        victims.extend(before - live())
    return victims


def _on_pool(p: Pool):
    return (lambda k: p.put(k, V)), p.get, (lambda: present(p))


def _on_model(m: "Model"):
    return (lambda k: m.put(k, len(V), None, 0)), m.get, (lambda: set(m.e))


def test_lfu_aging_lets_a_once_hot_entry_go(small, clock):
    # With a short aging period counts halve every 16 puts+hits: "hot" decays
    # while the warm entries are re-read, and is evicted.
    p = small("lfu", lfu_period=16)
    victims = _lfu_once_hot_trace(*_on_pool(p))
    assert "hot" in victims and "hot" not in p
    # Not at once: aged only a little, it still outranks the fresh entries.
    assert victims.index("hot") >= 2
    # Exactly the victims of the definition.
    assert victims == _lfu_once_hot_trace(*_on_model(Model("lfu", NBLOCKS, 16, clock)))


def test_lfu_without_aging_keeps_the_once_hot_entry(small):
    # The control for the test above: the same trace, no aging within it.
    p = small("lfu", lfu_period=1_000_000)
    victims = _lfu_once_hot_trace(*_on_pool(p))
    assert "hot" not in victims and "hot" in p
    assert len(victims) == 12


def test_lfu_aging_exact_counts(small):
    """An entry's count is shifted right by the epochs since its last access, then +1."""
    p = small("lfu", lfu_period=4)
    p.put("x", V)  # op 1, epoch 0: count 1
    p.get("x")  # op 2: 2
    p.get("x")  # op 3: 3
    p.get("x")  # op 4: epoch 1 -> (3 >> 1) + 1 = 2
    assert p.info("x")["access_count"] == 2
    for i in range(8):  # ops 5..12: epochs 2 and 3 pass
        p.put(f"f{i % 2}", V)
    p.get("x")  # op 13, epoch 3: (2 >> 2) + 1 = 1
    assert p.info("x")["access_count"] == 1
    p.get("x")  # op 14: 2
    p.get("x")  # op 15: 3
    assert p.info("x")["access_count"] == 3
    p.put("x", V)  # op 16: a put starts over at 1
    assert p.info("x")["access_count"] == 1


# ---- a reference model of every policy, compared victim by victim on random traces


class Model:
    """The policy definitions, written out plainly (one block per entry)."""

    ttls = True  # look for expired entries at every eviction

    def __init__(self, policy: str, cap: int, period: int, clock: FakeClock) -> None:
        self.policy, self.cap, self.period, self.clock = policy, cap, period, clock
        self.e: dict[str, dict] = {}
        self.seq = self.ops = self.epoch = 0
        self.stats = dict(hits=0, misses=0, evictions=0, expirations=0, bytes_evicted=0)

    def _tick(self) -> int:
        self.ops += 1
        if self.ops % self.period == 0:
            self.epoch += 1
        return self.epoch

    def _expired(self, m: dict) -> bool:
        return 0 < m["expiry"] <= self.clock()

    def _score(self, m: dict):
        pol = self.policy
        if pol == "lru":
            p = 0
        elif pol == "fifo":
            p = m["iseq"]
        elif pol == "lfu":
            p = m["count"] >> min(63, self.epoch - m["ep"])
        elif pol == "priority":
            p = m["prio"]
        elif pol == "ttl":
            p = m["expiry"] if m["expiry"] > 0 else float("inf")
        else:
            p = -m["size"]
        return (p, m["aseq"])

    def _evict_one(self) -> None:
        exp = [k for k, m in self.e.items() if self._expired(m)] if self.ttls else []
        if exp:
            k = min(exp, key=lambda k: self.e[k]["expiry"])
            self.stats["expirations"] += 1
        else:
            k = min(self.e, key=lambda k: self._score(self.e[k]))
            self.stats["evictions"] += 1
            self.stats["bytes_evicted"] += self.e[k]["size"]
        del self.e[k]

    def put(self, k: str, size: int, ttl, prio: int) -> None:
        assert k not in self.e
        while len(self.e) >= self.cap:
            self._evict_one()
        self.seq += 1
        now = self.clock()
        self.e[k] = dict(size=size, iseq=self.seq, aseq=self.seq, count=1, ep=self._tick(), prio=prio,
                         expiry=now + ttl if ttl else 0.0)

    def get(self, k: str) -> bool:
        m = self.e.get(k)
        if m is not None and self._expired(m):
            del self.e[k]
            self.stats["expirations"] += 1
            m = None
        if m is None:
            self.stats["misses"] += 1
            return False
        self.seq += 1
        m["aseq"] = self.seq
        ep = self._tick()
        m["count"] = (m["count"] >> min(63, ep - m["ep"])) + 1
        m["ep"] = ep
        self.stats["hits"] += 1
        return True


class QueueModel(Model):
    """The queue policies (s3fifo, arc, auto: eviction.QueuePolicy), written out plainly with TTLs.

    Queue 0 takes new keys, queue 1 keys found in a ghost ring; victims come from queue 0 while it
    holds more than its target, else from queue 1; expired entries first (soonest first).  arc: LRU
    queues, a read in queue 0 moves the key to queue 1.  s3fifo and auto: FIFO queues, reads counted
    up to 3, a victim read since it was queued moves on.  A ghost is remembered while fewer than
    factor x the entries were added to its ring after it; arc and auto move the target on ghost hits
    (auto: weighted by the ghost's depth, with its regimes; eviction.Auto).
    """

    KINDS = {"s3fifo": (0.1, (1, 0)), "arc": (0.0, (1, 1)), "auto": (0.1, (3, 1))}

    def __init__(self, policy: str, cap: int, clock: FakeClock) -> None:
        super().__init__(policy, cap, 1 << 30, clock)
        self.target, self.factors = self.KINDS[policy]
        self.q: list[dict] = [{}, {}]  # key -> reads, in queue order (dicts keep insertion order)
        self.ghosts: list[dict] = [{}, {}]  # key -> sequence number, oldest first
        self.ghost_seq = [0, 0]
        self.ttls = False  # no entry had a TTL yet: no expired ones to look for
        self.loop, self.ghost_rate, self.hit_rate, self.hits_seen = False, 0.0, 0.0, 0  # auto's regime

    def _ghost_add(self, r: int, k: str) -> None:
        if not self.factors[r]:
            return
        g = self.ghosts[r]
        g.pop(k, None)
        g[k] = self.ghost_seq[r]
        self.ghost_seq[r] += 1
        window = self.factors[r] * max(1, len(self.e))
        while self.ghost_seq[r] - next(iter(g.values())) > window:  # oldest first: dicts keep their order
            del g[next(iter(g))]

    def _drop(self, k: str) -> None:
        del self.e[k]
        for q in self.q:
            q.pop(k, None)

    def _from_queue0(self) -> bool:
        n0, n1 = len(self.q[0]), len(self.q[1])
        if not n0 or not n1:
            return bool(n0)
        share = 0.05 if self.loop else self.target
        return n0 > self.target if self.policy == "arc" else n0 >= share * (n0 + n1)

    def _rounds(self, f: int) -> int:
        """The reads a victim of queue 1 read since it was queued keeps as it goes round again."""
        if self.policy == "auto" and (self.loop or self.target >= 0.3):
            return 0
        return f - 1

    def _evict_one(self) -> None:
        exp = [k for k, m in self.e.items() if self._expired(m)] if self.ttls else []
        if exp:
            k = min(exp, key=lambda k: self.e[k]["expiry"])
            self.stats["expirations"] += 1
            self._drop(k)
            return
        while True:
            r = 0 if self._from_queue0() else 1
            k = next(iter(self.q[r]))
            f = self.q[r].pop(k)
            if f and self.policy != "arc":
                self.q[1][k] = 0 if r == 0 else self._rounds(f)
                continue
            self.stats["evictions"] += 1
            self.stats["bytes_evicted"] += self.e[k]["size"]
            self._ghost_add(r, k)
            del self.e[k]
            return

    def put(self, k: str, size: int, ttl, prio: int) -> None:
        assert k not in self.e
        while len(self.e) >= self.cap:
            self._evict_one()
        now = self.clock()
        self.e[k] = dict(size=size, expiry=now + ttl if ttl else 0.0)
        self.ttls = self.ttls or bool(ttl)
        g0, g1 = self.ghosts
        live0, live1, entries = len(g0), len(g1), len(self.e) - 1
        if self.policy == "auto":
            self.q[self._auto_queue(k, live0, live1, entries)][k] = 0
            return
        r = 1
        if g0.pop(k, None) is not None:
            self._adapt(1, live1, live0, entries)
        elif g1.pop(k, None) is not None:
            self._adapt(-1, live0, live1, entries)
        else:
            r = 0
        self.q[r][k] = 0

    def _adapt(self, sign: int, other: int, this: int, entries: int) -> None:
        if self.policy == "arc":
            self.target = min(float(entries), max(0.0, self.target + sign * max(1, other // this)))

    def _auto_queue(self, k: str, live0: int, live1: int, entries: int) -> int:
        n = float(max(1, entries))
        g0, g1 = self.ghosts
        self.ghost_rate += ((1.0 if k in g0 or k in g1 else 0.0) - self.ghost_rate) / n
        self.hit_rate += (float(self.stats["hits"] - self.hits_seen) - self.hit_rate) / n
        self.hits_seen = self.stats["hits"]
        if self.loop:
            self.loop = self.ghost_rate >= 0.4
        else:
            self.loop = self.ghost_rate > 0.5 and self.hit_rate < self.ghost_rate
        depth = [None, None]
        for r in (0, 1):
            s = self.ghosts[r].pop(k, None)
            if s is not None:
                depth[r] = self.ghost_seq[r] - 1 - s
                break
        if self.loop:
            return 1 if depth[0] is not None else 0

        def weight(d: int, boost: float) -> float:
            return max(0.0, 1.0 - d / (3.0 * n)) * (1.0 + boost * max(0.0, 1.0 - d / (0.05 * n)))

        if depth[0] is not None:
            self.target = min(1.0, self.target + weight(depth[0], 12.0) * max(1.0, live1 / max(1, live0)) / n)
            return 1
        if depth[1] is not None:
            self.target = max(0.0, self.target - weight(depth[1], 4.0) * max(1.0, live0 / max(1, live1)) / n)
            return 1 if self.target < 0.3 else 0
        return 0

    def get(self, k: str) -> bool:
        m = self.e.get(k)
        if m is not None and self._expired(m):
            self._drop(k)
            self.stats["expirations"] += 1
            m = None
        if m is None:
            self.stats["misses"] += 1
            return False
        self.stats["hits"] += 1
        q0, q1 = self.q
        r = q0 if k in q0 else q1
        if self.policy != "arc":
            r[k] = min(3, r[k] + 1)
        else:
            del r[k]
            q1[k] = 0  # queue 1's most recent
        return True


QUEUE_POLICIES = ["s3fifo", "arc", "auto"]


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority", "ttl", "size"] + QUEUE_POLICIES)
def test_policy_matches_reference_model_on_random_trace(small, clock, policy):
    """Victim by victim, the pool evicts what the plain definition says (exercises the victim cache)."""
    period = 7
    p = small(policy, lfu_period=period)
    model = QueueModel(policy, NBLOCKS, clock) if policy in QUEUE_POLICIES else Model(policy, NBLOCKS, period, clock)
    rng = random.Random(f"eviction-{policy}")
    universe = [f"u{i}" for i in range(24)]
    for step in range(600):
        clock.tick(1.0)
        k = rng.choice(universe)
        if k in model.e and not model._expired(model.e[k]) or rng.random() < 0.55:
            hit = model.get(k)
            assert (p.get(k) is not None) == hit, (step, k)
            continue
        if k in model.e:  # expired: drop it in both before the fresh put
            assert p.get(k) is None and not model.get(k)
        size = rng.choice([40, 100, 400, 1000, 2000, 3900])
        # Distinct expiries (ties among expired entries have no defined order).
        ttl = rng.choice([None, 5 + step / 1000, 20 + step / 1000, 60 + step / 1000])
        prio = rng.choice([0, 1, 2])
        model.put(k, size, ttl, prio)
        p.put(k, b"z" * size, ttl=ttl, priority=prio)
        live = {k for k, m in model.e.items() if not model._expired(m)}
        assert present(p) == live, step
    st = p.stats()
    assert {f: st[f] for f in model.stats} == model.stats
    assert st["evictions"] > 50  # the trace really exercised eviction


# --------------------------------------------------------------------------- 2. TTL under LRU


def test_expired_entry_is_not_returned_and_is_counted(small, clock):
    p = small("lru")
    p.put("t", V, ttl=10)
    clock.tick(9.5)
    assert p.get("t") == V
    clock.tick(1)
    assert p.get("t") is None
    assert "t" not in p and len(p) == 0
    with pytest.raises(cortex_cache.KeyNotFound):
        p.info("t")
    st = p.stats()
    assert (st["hits"], st["misses"], st["expirations"], st["evictions"]) == (1, 1, 1, 0)
    assert st["entries"] == 0 and st["blocks_used"] == 0  # its block was reclaimed
    assert p.get("t") is None  # a second miss, not a second expiration
    st = p.stats()
    assert (st["misses"], st["expirations"]) == (2, 1)


def test_expired_entry_reclaimed_before_lru_victim(small, clock):
    p = small("lru")
    keys = [f"k{i}" for i in range(NBLOCKS)]
    for k in keys:
        p.put(k, V, ttl=10 if k == "k5" else None)
    p.get("k0")  # LRU order: k1 k2 k3 k4 k5 k6 k7 k0
    p.put("a", V)  # fills the victim cache before anything expires
    assert gone(p, keys) == {"k1"}
    clock.tick(11)  # k5 expires: it goes before the LRU victim k2
    p.put("b", V)
    assert gone(p, keys) == {"k1", "k5"}
    st = p.stats()
    assert (st["evictions"], st["expirations"], st["bytes_evicted"]) == (1, 1, len(V))
    p.put("c", V)  # then the LRU order again
    assert gone(p, keys) == {"k1", "k5", "k2"}
    assert p.get("k5") is None
    st = p.stats()
    assert (st["evictions"], st["expirations"], st["misses"]) == (2, 1, 1)


def test_expired_entries_go_first_under_every_policy(make_pool, clock):
    for policy in ("lfu", "fifo", "priority", "size"):
        p = make_pool(NBLOCKS * BS, name=f"exp-{policy}", block_size=BS, policy=policy, clock=clock)
        keys = [f"k{i}" for i in range(NBLOCKS)]
        for k in keys:
            # k6 is the worst victim by every policy's own order.
            hot = k == "k6"
            p.put(k, b"q" * (50 if hot else 100), ttl=5 if hot else None, priority=9 if hot else 0)
            if hot:
                for _ in range(5):
                    p.get(k)
        p.put("a", V)
        assert "k6" in p, policy
        clock.tick(6)
        p.put("b", V)
        assert "k6" not in p, policy
        assert p.stats()["expirations"] == 1, policy
        clock.tick(-6)


# --------------------------------------------------------------------------- 3. pins


def test_pinned_entry_survives_eviction_pressure(small):
    p = small("lru")
    payload = bytes(range(256)) * 8  # 2 KiB, recognisable
    p.put("keep", payload)
    fill(p, NBLOCKS - 1)
    with p.view("keep") as mv:
        for i in range(40):
            p.put(f"x{i}", V)
        assert "keep" in p
        assert bytes(mv) == payload
        assert p.stats()["evictions"] == 40  # 7 others + 33 of the newcomers
    assert p.get("keep") == payload
    assert p.verify()["ok"]


def test_view_survives_forced_eviction_and_frees_at_release(small):
    """evict(all=True) takes a viewed entry out of the index, but its bytes stay until release."""
    p = small("lru")
    payload = b"P" * 3000
    p.put("keep", payload)
    p.put("other", V)
    with p.view("keep") as mv:
        assert p.evict(all=True) == (2, len(payload) + len(V))
        assert "keep" not in p and len(p) == 0
        for i in range(20):  # pressure cannot reuse the viewed block
            p.put(f"x{i}", V)
        assert bytes(mv) == payload
        assert p.stats()["blocks_used"] == NBLOCKS
    assert p.stats()["blocks_used"] == NBLOCKS - 1  # the zombie's block is free again
    assert p.verify()["ok"]


def test_all_pinned_put_raises_pool_full_and_pool_stays_usable(small):
    p = small("lru")
    keys = fill(p)
    with contextlib.ExitStack() as stack:
        views = [stack.enter_context(p.view(k)) for k in keys]
        with pytest.raises(PoolFull):
            p.put("x", V)
        st = p.stats()
        assert (st["entries"], st["evictions"], st["pinned_entries"]) == (NBLOCKS, 0, NBLOCKS)
        assert "x" not in p
        assert p.verify()["ok"]
        assert all(bytes(v) == V for v in views)
        assert p.get("k3") == V  # reads still work
    p.put("x", V)  # room again once the views go; k0 is the least recently viewed
    assert gone(p, keys) == {"k0"}
    assert p.get("x") == V
    assert p.verify()["ok"]


def test_all_but_one_pinned_evicts_the_unpinned_one(small):
    p = small("lru")
    keys = fill(p)
    with contextlib.ExitStack() as stack:
        for k in keys:
            if k != "k6":
                stack.enter_context(p.view(k))
        p.put("x", V)
        assert gone(p, keys) == {"k6"}
        with pytest.raises(PoolFull):  # 3 blocks: evicting every unpinned entry cannot make a run
            p.put("y", b"y" * (2 * BS))
        assert "y" not in p
    assert p.verify()["ok"]


@pytest.mark.parametrize(
    "policy, first_victim_kw",
    [
        ("fifo", {}),  # k0 is the oldest insert
        ("priority", {"priority": -5}),
        ("ttl", {"ttl": 50}),
        ("size", {"size": 4000}),
    ],
)
def test_unpinned_entry_rejoins_the_eviction_order(small, policy, first_victim_kw):
    """An entry pinned while victims were chosen is the next victim once unpinned.

    Pins exclude an entry from eviction only while they are held; the victim
    order afterwards is the policy's, exactly.
    """
    p = small(policy)
    kw = dict(first_victim_kw)
    size = kw.pop("size", 100)
    p.put("k0", b"0" * size, **kw)
    others = [f"k{i}" for i in range(1, NBLOCKS)]
    for k in others:
        p.put(k, V, priority=5, ttl=100 if policy == "ttl" else None)
    with p.view("k0"):
        p.put("a", V, priority=9)  # k0 is pinned: the next-best victim k1 goes
    assert gone(p, ["k0"] + others) == {"k1"}
    p.put("b", V, priority=9)  # unpinned, k0 is again the policy's first victim
    assert gone(p, ["k0"] + others) == {"k1", "k0"}


def test_entry_that_expired_while_pinned_is_reclaimed_first(small, clock):
    p = small("lru")
    keys = [f"k{i}" for i in range(NBLOCKS)]
    for k in keys:
        p.put(k, V, ttl=10 if k == "k7" else None)
    with p.view("k7"):
        p.put("a", V)  # k0 goes (LRU); k7 is pinned and not yet expired
        clock.tick(20)
    p.put("b", V)  # k7 has expired and is unpinned: reclaim it, keep k1
    assert "k1" in p
    st = p.stats()
    assert (st["evictions"], st["expirations"]) == (1, 1)


def test_replacing_a_key_in_a_full_pool_evicts_nothing(small):
    """A same-size replacement needs no extra room: no other entry is lost."""
    p = small("lru")
    keys = fill(p)
    p.put("k3", b"w" * 100)
    assert present(p) == set(keys)
    assert p.get("k3") == b"w" * 100
    assert p.stats()["evictions"] == 0


# --------------------------------------------------------------------------- 4. multi-block runs


def _fragmented(p: Pool) -> list[str]:
    keys = fill(p)
    for k in ("k1", "k3", "k5", "k7"):
        assert p.delete(k)
    # Free blocks are now 1, 3, 5, 7: no run of 2 anywhere.
    st = p.stats()
    assert (st["blocks_used"], st["entries"]) == (4, 4)
    return ["k0", "k2", "k4", "k6"]


def test_multi_block_value_in_fragmented_pool(small):
    p = small("lru")
    _fragmented(p)
    big = bytes(random.Random(1).randbytes(3 * BS - 64))  # 3 blocks with its key
    p.put("big", big)
    # LRU order k0 k2 k4 k6: evicting k0 opens blocks 0-1 (2 < 3), then k2
    # opens 0-3.  Nothing beyond what the run needed is evicted.
    assert present(p) == {"k4", "k6", "big"}
    assert p.get("big") == big
    st = p.stats()
    assert (st["evictions"], st["bytes_evicted"], st["blocks_used"]) == (2, 2 * len(V), 5)
    assert p.info("big")["blocks"] == 3
    assert p.verify()["ok"]


def test_multi_block_value_stops_at_the_first_victim_that_opens_a_run(small):
    p = small("lru")
    _fragmented(p)
    p.get("k0")  # LRU order k2 k4 k6 k0: evicting k2 alone opens blocks 1-3
    big = bytes(random.Random(2).randbytes(3 * BS - 64))
    p.put("big", big)
    assert present(p) == {"k0", "k4", "k6", "big"}
    assert p.get("big") == big
    assert p.stats()["evictions"] == 1
    assert p.verify()["ok"]


def test_multi_block_value_needing_the_whole_pool(small):
    p = small("lru")
    fill(p)
    whole = bytes(random.Random(3).randbytes(NBLOCKS * BS - 8))
    p.put("w", whole)
    assert present(p) == {"w"}
    assert p.get("w") == whole
    st = p.stats()
    assert (st["evictions"], st["blocks_used"]) == (NBLOCKS, NBLOCKS)
    with pytest.raises(cortex_cache.ValueTooLarge):  # one byte more than the pool (keys take no data blocks)
        p.put("w2", b"x" * (NBLOCKS * BS + 1))
    assert p.get("w") == whole


# --------------------------------------------------------------------------- 5. pool.evict


@pytest.fixture
def evpool(make_pool, clock):
    """16 blocks; k0..k9 of 1000 bytes each, LRU order k0 first."""
    p = make_pool(16 * BS, block_size=BS, policy="lru", clock=clock)
    for i in range(10):
        p.put(f"k{i}", bytes([i]) * 1000)
    return p


def test_evict_percent_of_value_bytes(evpool):
    # 25 % of 10,000 bytes is 2,500: three LRU victims.
    assert evpool.evict(percent=25) == (3, 3000)
    assert gone(evpool, [f"k{i}" for i in range(10)]) == {"k0", "k1", "k2"}
    # At least the percentage: 10.01 % of 7,000 is 700.7 bytes, one entry.
    assert evpool.evict(percent=10.01) == (1, 1000)
    # 16.67 % of 6,000 is 1,000.2 bytes: one 1,000-byte entry is not enough.
    assert evpool.evict(percent=16.67) == (2, 2000)
    assert evpool.evict(percent=100) == (4, 4000)
    assert len(evpool) == 0
    st = evpool.stats()
    assert (st["evictions"], st["bytes_evicted"], st["blocks_used"], st["value_bytes"]) == (10, 10000, 0, 0)


def test_evict_nbytes(evpool):
    evpool.get("k0")
    assert evpool.evict(nbytes=1500) == (2, 2000)  # k1, k2
    assert evpool.evict(nbytes=1000) == (1, 1000)  # exactly one: k3
    assert evpool.evict(nbytes="1K") == (2, 2000)  # 1024 bytes need two: k4, k5
    assert gone(evpool, [f"k{i}" for i in range(10)]) == {"k1", "k2", "k3", "k4", "k5"}
    assert evpool.evict(nbytes=10**9) == (5, 5000)  # more than there is: all, no error
    assert evpool.evict(nbytes=1) == (0, 0)
    st = evpool.stats()
    assert (st["evictions"], st["bytes_evicted"]) == (10, 10000)


def test_evict_expired_only(evpool, clock):
    evpool.put("e1", b"e" * 300, ttl=5)
    evpool.put("e2", b"e" * 400, ttl=5)
    evpool.put("e3", b"e" * 500, ttl=100)
    assert evpool.evict(expired=True) == (0, 0)
    clock.tick(6)
    assert evpool.evict(expired=True) == (2, 700)
    assert present(evpool) == {f"k{i}" for i in range(10)} | {"e3"}
    st = evpool.stats()
    assert (st["expirations"], st["evictions"], st["bytes_evicted"], st["entries"]) == (2, 0, 0, 11)


def test_evict_keys(evpool):
    assert evpool.evict(keys=["k5", "nope", "k6", "k5"]) == (2, 2000)
    assert evpool.evict(keys=[]) == (0, 0)
    assert evpool.evict(keys=[b"k7"]) == (1, 1000)
    assert gone(evpool, [f"k{i}" for i in range(10)]) == {"k5", "k6", "k7"}
    st = evpool.stats()
    assert (st["evictions"], st["bytes_evicted"], st["entries"]) == (3, 3000, 7)


def test_evict_prefix_and_all(evpool):
    evpool.put("ab1", b"a" * 10)
    evpool.put("ab2", b"a" * 20)
    evpool.put("ac", b"a" * 40)
    assert evpool.evict(prefix="ab") == (2, 30)
    assert evpool.evict(prefix="zz") == (0, 0)
    assert "ac" in evpool and "ab1" not in evpool
    assert evpool.evict(prefix=b"k") == (10, 10000)
    assert present(evpool) == {"ac"}
    evpool.put("x", b"x" * 7)
    assert evpool.evict(all=True) == (2, 47)
    assert evpool.evict(all=True) == (0, 0)
    st = evpool.stats()
    assert (st["evictions"], st["bytes_evicted"], st["entries"], st["blocks_used"]) == (14, 10077, 0, 0)
    assert evpool.verify()["ok"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"percent": 10, "nbytes": 100},
        {"all": True, "prefix": "k"},
        {"expired": True, "keys": ["k1"]},
        {"all": True, "expired": True},
        {"percent": 0},
        {"percent": -5},
        {"percent": 100.5},
        {"nbytes": 0},
        {"nbytes": -1},
        {"nbytes": "lots"},
    ],
)
def test_evict_invalid_selectors_raise_usage_error(evpool, kwargs):
    with pytest.raises(UsageError):
        evpool.evict(**kwargs)
    assert len(evpool) == 10
    st = evpool.stats()
    assert st["evictions"] == 0 and st["entries"] == 10


# --------------------------------------------------------------------------- 6. two processes

_CHILD_READS = """
    import sys
    from cortex_cache import Pool
    name, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with Pool.open(name) as p:
        for _ in range(n):
            assert p.get(key) is not None
"""


def _cross_process_trace(make_pool, policy: str, name: str, child_reads: int) -> set:
    """Fill, evict once (the shared victim cache is now filled), maybe let a child read k1, put again."""
    p = make_pool(NBLOCKS * BS, name=name, block_size=BS, policy=policy)
    keys = fill(p)
    if policy == "lfu":
        for k in keys[2:]:
            p.get(k)  # counts: k0 1, k1 1, k2..k7 2
    p.put("x", V)
    assert gone(p, keys) == {"k0"}
    if policy == "lfu":
        p.get("x")
        p.get("x")  # x 3: not a victim below
    if child_reads:
        run_py(_CHILD_READS, name, "k1", str(child_reads))
    p.put("y", V)
    return gone(p, keys)


@pytest.mark.parametrize("policy, reads", [("lru", 1), ("lfu", 3), ("s3fifo", 1), ("arc", 1), ("auto", 1)])
def test_reads_in_another_process_change_the_victim(make_pool, policy, reads):
    # Without the child's reads, k1 is the victim ...
    assert _cross_process_trace(make_pool, policy, f"xp-{policy}-a", 0) == {"k0", "k1"}
    # ... with them, k1 is saved and the next in line (k2) goes instead.
    assert _cross_process_trace(make_pool, policy, f"xp-{policy}-b", reads) == {"k0", "k2"}


def test_put_in_another_process_evicts_by_shared_order(make_pool):
    """A child's put evicts what the parent's reads made least recent."""
    p = make_pool(NBLOCKS * BS, block_size=BS, policy="lru")
    keys = fill(p)
    for k in ("k0", "k1", "k2"):
        p.get(k)  # LRU order: k3 k4 k5 k6 k7 k0 k1 k2
    run_py(
        """
        import sys
        from cortex_cache import Pool
        with Pool.open(sys.argv[1]) as p:
            p.put("c1", b"c" * 100)
            p.put("c2", b"c" * 100)
        """,
        p.name,
    )
    assert gone(p, keys) == {"k3", "k4"}
    assert p.stats()["evictions"] == 2


# --------------------------------------------------------------------------- 7. stats


def test_stats_counters_exact_after_known_sequence(small, clock):
    p = small("lru")
    keys = fill(p)  # 8 puts
    assert p.get("k0") == V  # hit
    assert p.get("nope") is None  # miss
    assert p.get("k1") == V and p.get("k1") == V  # 2 hits
    p.put("t", b"t" * 250, ttl=5)  # evicts k2 (100 bytes)
    p.put("a", b"a" * 300)  # evicts k3
    clock.tick(6)
    assert p.get("t") is None  # miss + expiration
    p.put("b", V)  # room was freed by the expiration: no eviction
    p.put("c", V)  # evicts k4
    assert p.delete("k5")
    assert not p.delete("k5")
    st = p.stats()
    assert {f: st[f] for f in ("hits", "misses", "evictions", "expirations", "bytes_evicted", "puts", "deletes")} == {
        "hits": 3, "misses": 2, "evictions": 3, "expirations": 1, "bytes_evicted": 300, "puts": 12, "deletes": 1,
    }
    assert st["hit_ratio"] == pytest.approx(3 / 5)
    assert st["entries"] == 7 and st["blocks_used"] == 7
    assert st["value_bytes"] == 4 * 100 + 300 + 100 + 100
    assert gone(p, keys) == {"k2", "k3", "k4", "k5"}


_WORKER = """
    import json, sys
    from cortex_cache import Pool
    name, me, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hits = misses = 0
    with Pool.open(name) as p:
        for i in range(n):
            p.put(f"{me}-{i}", bytes([i % 256]) * 100)
            for k in (f"{me}-{i}", f"{me}-{i // 2}", f"absent-{me}-{i}"):
                if p.get(k) is None:
                    misses += 1
                else:
                    hits += 1
    print(json.dumps({"hits": hits, "misses": misses, "puts": n}))
"""


def test_stats_sum_over_concurrent_processes(make_pool):
    """Three processes put and get at once; the shared counters add up exactly."""
    p = make_pool(16 * BS, block_size=BS, policy="lru")
    n = 150
    procs = [spawn_py(_WORKER, p.name, f"w{j}", str(n)) for j in range(3)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))
    st = p.stats()
    assert st["hits"] == sum(r["hits"] for r in results)
    assert st["misses"] == sum(r["misses"] for r in results)
    assert st["hits"] + st["misses"] == 3 * 3 * n
    assert st["misses"] >= 3 * n  # every absent-* key missed
    assert st["puts"] == 3 * n
    # No deletes, no TTLs, no pins: every put beyond the 16 that fit evicted one entry.
    assert st["entries"] == 16
    assert st["evictions"] == 3 * n - 16 and st["expirations"] == 0
    assert st["bytes_evicted"] == 100 * st["evictions"]
    assert p.verify()["ok"]


# --------------------------------------------------------------------------- large pools: the scan's fast paths


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority", "ttl", "size"])
def test_victim_order_is_exact_in_a_pool_larger_than_the_victim_list(make_pool, clock, policy):
    """With more live entries than the shared victim list holds (CANDIDATES), the
    scan's selection shortcuts (one-key fold, constant primary, tie handling) and
    the list's rebuild must still evict exactly in the order the plain definition
    gives, expired entries first."""
    from cortex_cache.layout import CANDIDATES

    n = CANDIDATES + 2000
    p = make_pool(n * BS, block_size=BS, policy=policy, clock=clock, max_entries=n, lfu_period=10**9)
    model = Model(policy, n, 10**9, clock)
    rng = random.Random(f"big-{policy}")
    for i in range(n):
        size = rng.choice([100, 200, 300])
        ttl = 100 + rng.randrange(5000) + i / 10_000 if rng.random() < 0.5 else None
        prio = rng.randrange(4)
        model.put(f"k{i}", size, ttl, prio)
        p.put(f"k{i}", b"z" * size, ttl=ttl, priority=prio)
    for _ in range(3000):  # skewed reads: counts and recency differ, with many ties
        k = f"k{min(int(rng.expovariate(1 / 300)), n - 1)}"
        assert (p.get(k) is not None) == model.get(k)
    clock.tick(400)  # some TTLs run out: those go first, soonest expiry first
    expired = sorted((m["expiry"], k) for k, m in model.e.items() if model._expired(m))
    live = sorted((model._score(m), k) for k, m in model.e.items() if not model._expired(m))
    order = [k for _, k in expired] + [k for _, k in live]
    victims = CANDIDATES + 1000  # more than one list's worth: the list is rebuilt on the way
    target = sum(model.e[k]["size"] for k in order[:victims])
    count, freed = p.evict(nbytes=target)
    assert (count, freed) == (victims, target)
    assert present(p) == set(order[victims:]) - {k for _, k in expired}


# --------------------------------------------------------------------------- queue policies


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
def test_queue_policy_is_exact_in_a_pool_larger_than_its_victim_lists(make_pool, clock, policy):
    """More live entries in each queue than its victim list holds (CANDIDATES / 2 rows): every list
    refill, second chance and ghost must still give exactly the model's hits, evictions and keys."""
    from cortex_cache.layout import CANDIDATES

    n = CANDIDATES + 2000
    p = make_pool(n * 64, block_size=64, policy=policy, clock=clock, max_entries=n)
    model = QueueModel(policy, n, clock)
    rng = random.Random(f"big-{policy}")
    for step in range(40_000):
        k = f"k{min(int(rng.expovariate(1 / 4000)), 30_000)}"  # skewed, with a long tail of one-hit keys
        hit = model.get(k)
        assert (p.get(k) is not None) == hit, step
        if not hit:
            model.put(k, 10, None, 0)
            p.put(k, b"z" * 10)
    st = p.stats()
    assert {f: st[f] for f in model.stats} == model.stats
    assert present(p) == set(model.e)
    h = p.core.queues.header[0]
    assert (int(h["q_count0"]), int(h["q_count1"])) == (len(model.q[0]), len(model.q[1]))
    assert float(h["q_target"]) == pytest.approx(model.target, abs=0, rel=1e-12)
    assert st["evictions"] > 2 * CANDIDATES and min(len(model.q[0]), len(model.q[1])) > 0
    assert p.verify()["ok"]


def test_s3fifo_keeps_what_was_read_through_a_scan_of_new_keys(small):
    """A scan of keys read once goes through the small queue; keys read since they were queued move to
    the main queue instead of being evicted (LRU would lose them to the scan)."""
    p = small("s3fifo")
    keys = fill(p)
    for k in keys[:4]:
        p.get(k)
    for i in range(40):
        p.put(f"scan{i}", V)
    assert set(keys[:4]) <= present(p) and not set(keys[4:]) & present(p)


def test_arc_moves_a_key_read_twice_to_t2_and_its_ghost_steers_p(small):
    p = small("arc")
    h = p.core.queues.header[0]
    keys = fill(p)
    p.get("k0")  # read again: T2
    assert (int(h["q_count0"]), int(h["q_count1"])) == (7, 1)
    p.put("a", V)  # T1's LRU goes (p = 0): k1, remembered in B1
    assert "k1" not in p and "k0" in p and int(h["g0_live"]) == 1
    p.put("k1", V)  # a B1 ghost: p grows by max(1, |B2| / |B1|) = 1, and k1 joins T2
    assert float(h["q_target"]) == 1.0 and int(h["q_count1"]) == 2 and int(h["g0_live"]) == 1  # k2 went to B1
    assert gone(p, keys) == {"k2"}


def test_auto_moves_its_small_queue_share_with_the_ghosts(small):
    p = small("auto")
    h = p.core.queues.header[0]
    fill(p)
    assert float(h["q_target"]) == 0.1
    for i in range(8):  # the small queue's victims k0..k7 are ghosts of queue 0
        p.put(f"n{i}", V)
    p.put("k0", V)  # back from queue 0's ghosts: the small queue was too small
    grown = float(h["q_target"])
    assert grown > 0.1 and int(h["q_count1"]) == 1
    assert p.verify()["ok"]


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
def test_damaged_queue_state_is_found_and_repaired(small, policy):
    """Queue counts, queue numbers, the target and the ghost rings are derived state: verify finds them
    out of step, repair rebuilds them from the slots, and eviction goes on as before."""
    p = small(policy)
    fill(p, 20)
    core = p.core
    h = core.queues.header[0]
    counts = int(h["q_count0"]), int(h["q_count1"])
    live = int(h["g0_live"])
    h["q_count0"] += 5
    q = core.queues.cols["queue"]
    q[int(np.flatnonzero(core.queues.cols["state"] == 2)[0])] = 7
    h["q_target"] = float("nan")
    h["g0_live"] += 3
    rep = p.verify()
    assert not rep["ok"] and any("queue" in x for x in rep["problems"])
    p.verify(repair=True)
    assert p.verify()["ok"]
    assert int(h["q_count0"]) + int(h["q_count1"]) == sum(counts) and int(h["g0_live"]) == live
    assert float(h["q_target"]) == (0.0 if policy == "arc" else 0.1)
    for i in range(20):
        p.put(f"after{i}", V)
    assert p.verify()["ok"] and len(p) == NBLOCKS


@pytest.mark.parametrize("damage", ["queue policy, no region", "region, other policy", "ring size", "region offset"])
def test_a_header_that_lies_about_the_queue_region_is_refused(make_pool, damage):
    """The queue region is described by the pool header alone (qslots_off, n_ghosts0/1; the rings' offsets are
    derived): a header whose policy and region disagree, or whose rings or region are misplaced, is refused
    at open (SegmentCorrupt, 65) before anything maps it, and leaves no segment behind."""
    from cortex_cache import SegmentCorrupt
    from cortex_cache.eviction import POLICY_IDS
    from cortex_cache.layout import HEADER_FIELDS
    from cortex_cache.segment import shm_path

    off = {n: (o, f) for n, f, o in HEADER_FIELDS}
    p = make_pool("1M", block_size="4K", policy="lru" if damage == "queue policy, no region" else "s3fifo")
    g = p.core.geometry
    name = p.name
    p.close()
    field, value = {
        "queue policy, no region": ("policy", POLICY_IDS.index("s3fifo")),
        "region, other policy": ("policy", POLICY_IDS.index("lru")),
        "ring size": ("n_ghosts0", g.n_ghosts0 + g.n_slots),
        "region offset": ("qslots_off", g.qslots_off + 4096),
    }[damage]
    o, fmt = off[field]
    with open(shm_path(name), "r+b") as f:
        f.seek(o)
        f.write(np.array([value], dtype=fmt).tobytes())
    with pytest.raises(SegmentCorrupt, match="damaged header"):
        Pool.open(name)
