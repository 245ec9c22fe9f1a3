"""Victim choice in C (_fastpath_evict.c) against its Python reference (eviction.py, queues.py, Core.evict_one).

The C write path chooses and evicts its victims itself: the victim lists, the queue policies' next_victim
with its second chances, the eviction's counters, ghosts and removal.  Both paths must choose the same
victims in the same order and leave the same bits, for every policy; a pool whose evictions a disk tier
sees first is left to Python; damaged victim rows never send C outside the segment.
"""

from __future__ import annotations

import numpy as np
import pytest

from cortex_cache import Pool
from cortex_cache.core import PURE_PYTHON_ENV
from cortex_cache.errors import SegmentCorrupt
from cortex_cache.policy_names import POLICY_IDS

from tests.test_fastpath import same_state

BS = 64
N = 96  # entries the pools hold


def _trace(seed: int) -> list[tuple]:
    """Puts of new and old keys (some with a TTL that has passed by the next operation, some with one that
    never does, priorities and sizes mixed), reads that give second chances and move entries between
    queues, deletes, and views held across evictions (pinned entries the lists skip)."""
    rng = np.random.default_rng(seed)
    ops: list[tuple] = []
    for n in range(3000):
        r = rng.random()
        hot = int(rng.integers(0, 2 * N)) if rng.random() < 0.7 else int(rng.integers(0, 8 * N))
        if r < 0.55:
            ttl = 1e-6 if rng.random() < 0.03 else (3600.0 if rng.random() < 0.1 else None)
            ops.append(("put", hot, int(rng.integers(1, 3 * BS)), ttl, int(rng.integers(0, 4))))
        elif r < 0.9:
            ops.append(("get", hot))
        elif r < 0.94:
            ops.append(("delete", hot))
        elif r < 0.98:
            ops.append(("view", hot))
        else:
            ops.append(("release",))
    return ops


def _run(p: Pool, ops: list[tuple]) -> list:
    """Replay `ops`; what each step evicted (the keys gone from the pool, not deleted), in order."""
    held: list = []
    before = set(p.keys())
    out: list = []
    for op in ops:
        kind = op[0]
        if kind == "put":
            _, k, size, ttl, prio = op
            p.put(f"k{k}", bytes([k % 251]) * size, ttl=ttl, priority=prio)
            before.add(f"k{k}")
        elif kind == "get":
            p.get(f"k{op[1]}")
        elif kind == "delete":
            if p.delete(f"k{op[1]}"):
                before.discard(f"k{op[1]}")
        elif kind == "view" and len(held) < 5 and f"k{op[1]}" in p:
            held.append(p.view(f"k{op[1]}"))
        elif kind == "release" and held:
            held.pop(0).release()
        now = set(p.keys())
        out.append(sorted(before - now))
        before = now
    for v in held:
        v.release()
    return out


@pytest.mark.parametrize("policy", POLICY_IDS)
def test_c_and_python_choose_the_same_victims(make_pool, monkeypatch, policy):
    fast = make_pool(N * BS, block_size=BS, max_entries=N, policy=policy)
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    slow = make_pool(N * BS, block_size=BS, max_entries=N, policy=policy)
    assert fast.core.fast is not None and slow.core.fast is None
    ops = _trace(11)
    gone_fast, gone_slow = _run(fast, ops), _run(slow, ops)
    for step, (a, b) in enumerate(zip(gone_fast, gone_slow)):
        assert a == b, f"step {step} ({ops[step]}): C evicted {a}, Python {b}"
    same_state(fast, slow)
    st = fast.stats()
    assert st["evictions"] > 500 and st["expirations"] > 0, "the trace missed its point"
    assert fast.core.fast.evicted_in_c >= st["evictions"], "C did not evict"
    assert fast.verify()["problems"] == [] and slow.verify()["problems"] == []


@pytest.mark.parametrize("policy", ["s3fifo", "auto"])
def test_a_read_entry_gets_its_second_chance_in_c(make_pool, policy):
    """The C victim choice moves a read entry on instead of evicting it (S3-FIFO's rule): of a full pool
    whose first half was read, the second half goes first."""
    p = make_pool(N * BS, block_size=BS, max_entries=N, policy=policy)
    for k in range(N):
        p.put(f"k{k}", b"v")
    for k in range(N // 2):
        assert p.get(f"k{k}") == b"v"
    for k in range(N, N + N // 2):
        p.put(f"k{k}", b"v")
    assert p.core.fast.evicted_in_c == N // 2
    assert all(f"k{k}" in p for k in range(N // 2))
    assert not any(f"k{k}" in p for k in range(N // 2, N))


def test_a_spilling_pool_leaves_its_evictions_to_python(make_pool, tmp_path):
    """A disk tier sees each victim first (Core.on_evict): C then does not evict, and nothing is lost."""
    p = make_pool("1M", disk_path=tmp_path / "tier", disk_size="16M")
    assert p.core.fast is not None and p.core.fast.spill
    for k in range(40):
        p.put(f"k{k}", bytes([k]) * 60_000)
    assert p.stats()["evictions"] > 0 and p.core.fast.evicted_in_c == 0
    assert all(p.get(f"k{k}") == bytes([k]) * 60_000 for k in range(40))


@pytest.mark.parametrize("pure", [False, True])
def test_a_damaged_victim_row_is_refused_and_repaired(make_pool, monkeypatch, pure):
    """A victim list row naming no slot: the put is refused as damaged metadata (nothing written outside
    the segment), on both paths; the next operation repairs, and the pool goes on evicting."""
    if pure:
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    p = make_pool(N * BS, block_size=BS, max_entries=N, policy="lru")
    for k in range(N + 1):  # the last put evicts: the list is filled
        p.put(f"k{k}", b"v")
    core = p.core
    pos = int(core.header["cand_pos"][0])
    assert core.header["cand_valid"][0] and pos < int(core.header["cand_count"][0])
    core.victims._vslot[pos] = 1 << 30
    with pytest.raises(SegmentCorrupt):
        p.put("new", b"v")
    for k in range(N, 2 * N):
        p.put(f"k{k}", b"v")
    assert p.verify()["problems"] == []
    assert sorted(p.keys()) == sorted(f"k{k}" for k in range(N, 2 * N))
