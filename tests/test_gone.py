"""Deletes, overwrites, evictions and TTLs during a background fill hold (gone.py): real processes, the filler
paused at a chosen point of its fill or killed, other processes writing meanwhile or killed in their lock hold.

A key deleted, overwritten, evicted or expired after the pool is published never comes back from the
snapshot, whether or not the fill had reached it, in every process that has the pool open.
"""

from __future__ import annotations

import json
import signal

import pytest
import xxhash

from cortex_cache import Pool
from cortex_cache import persist as snap

from .fillers import go_on, kill, no_filler_left, start  # noqa: F401 (no_filler_left: autouse)
from .helpers import cli, make_value, run_py

N = 1200  # entries of the snapshot
SIZE = 2048  # bytes each (4 KiB blocks)
DAY = 86400.0

# Another process acting on the pool: a JSON list of [op, key or keys, value version] steps.
ACTOR = """
import json, os, signal, sys
from cortex_cache import Pool, core
from tests.helpers import make_value
name, steps, stats_only, kill_in = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
if kill_in:  # die inside the n-th lock hold of this kind, its marks made, memory not changed yet
    kind, n = kill_in.split(":")
    real = getattr(core.Core, kind)
    calls = [0]
    def dying(self, *a, **kw):
        calls[0] += 1
        if calls[0] == int(n):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *a, **kw)
    setattr(core.Core, kind, dying)
p = Pool.open(name, snapshot_tier=not stats_only)
out = {"fast_ok": p.tiers.fast_ok, "got": {}}
for op, keys, version in steps:
    keys = keys if isinstance(keys, list) else [keys]
    if op == "delete":
        for k in keys:
            p.delete(k)
    elif op == "delete_many":
        p.delete_many(keys)
    elif op == "put":
        for k in keys:
            p.put(k, make_value(int(k[1:]), version, 2048))
    elif op == "put_many":
        p.put_many({k: make_value(int(k[1:]), version, 2048) for k in keys})
    elif op == "get":
        for k in keys:
            out["got"][k] = p.get(k) is not None
    elif op == "evict":
        p.evict(keys=keys)
p.close()
print(json.dumps(out), flush=True)
"""


def keys(r: range) -> list[str]:
    return [f"k{i}" for i in r]


@pytest.fixture
def persisted(make_pool, snapshot_dir):
    """A pool of N values of 2 KiB (TTL'd ones with `ttl`) persisted into the snapshot directory, then deleted
    (the boot case)."""
    made = []

    def make(ttl_keys: range = range(0)) -> str:
        p = make_pool("16M", block_size=4096)
        for i in range(N):
            p.put(f"k{i}", make_value(i, 0, SIZE), ttl=DAY if i in ttl_keys else None)
        snap.persist(p)
        name = p.name
        p.close()
        Pool.unlink(name)
        made.append(name)
        return name

    yield make
    for name in made:
        if Pool.exists(name):
            Pool.unlink(name)


def act(name: str, steps: list, stats_only: bool = False, kill_in: str = "") -> dict | None:
    """Run `steps` in another process; its report, or None when it was killed as asked."""
    r = run_py(ACTOR, name, json.dumps(steps), "1" if stats_only else "0", kill_in, check=not kill_in)
    if kill_in:
        assert r.returncode == -signal.SIGKILL, r.stderr.decode()
        return None
    return json.loads(r.stdout)


CHECK = """
import json, sys
from cortex_cache import Pool
from tests.helpers import check_value
with Pool.open(sys.argv[1]) as p:
    out = {}
    for k in p.keys():
        out[k] = list(check_value(p.get(k)))
    print(json.dumps({"fill": p.stats()["fill"]["state"], "entries": out, "ok": p.verify()["ok"]}))
"""


def _contents(name: str) -> dict:
    """What a fresh process finds in the pool: each key's value version (values checked whole)."""
    got = json.loads(run_py(CHECK, name).stdout)
    assert got["ok"]
    return {k: v for k, (_i, v) in got["entries"].items()}


def _bucket_mates(name: str, blind: list[str]) -> set[str]:
    """The keys that share a hash bucket of the gone marks with a key written by a blind handle: they may be
    misses too (never wrong)."""
    with Pool.open(name, snapshot_tier=False) as p:
        n = p.geometry.n_slots
    hit = {xxhash.xxh3_64_intdigest(k.encode()) % n for k in blind}
    return {f"k{i}" for i in range(N) if xxhash.xxh3_64_intdigest(f"k{i}".encode()) % n in hit}


@pytest.mark.parametrize("c", [False, True], ids=["python-fill", "c-fill"])
def test_deletes_by_other_processes_during_the_fill_never_come_back(persisted, c):
    """1,000 of 1,200 keys deleted by two other processes while the fill is paused after its first batch (one
    entry loaded): 0 come back, from the snapshot tier of any process or from the fill; the other 200 are all
    there, whole."""
    name = persisted()
    w = start(name, c=c)
    q = Pool.open(name)  # indexed before the deletes: what it serves must follow them
    try:
        assert q.get("k990") == make_value(990, 0, SIZE) and len(q) == 2  # read early: promoted
        assert act(name, [["delete_many", keys(range(0, 500)), 0]])["fast_ok"] is False
        act(name, [["delete", keys(range(500, 1000)), 0]])
        assert all(q.get(k) is None for k in keys(range(1000))), "a deleted key came back from the snapshot"
        assert not any(k in q for k in keys(range(1000))) and q.leading(["k1000", "k5"]) == 1
        assert q.delete("k1199") is True and q.delete("k1199") is False  # held by the snapshot alone: found
        report = go_on(w)
        assert report["ended"] == "done"
        got = _contents(name)
        back = [k for k in keys(range(1000)) if k in got or q.get(k) is not None]
        assert back == [], f"{len(back)} of 1,000 deleted keys came back"
        assert got == {k: 0 for k in keys(range(1000, 1199))}
    finally:
        q.close()


def test_overwrites_evictions_and_early_reads_during_the_fill_hold(persisted):
    name = persisted()
    w = start(name)
    act(name, [
        ["put", keys(range(0, 300)), 1],  # small puts of keys the snapshot holds: through Python, marked
        ["delete", keys(range(0, 100)), 0],  # overwritten, then deleted: neither value comes back
        ["evict", keys(range(100, 200)), 0],  # overwritten, then evicted: the old value never comes back
        ["get", keys(range(300, 500)), 0],  # read early (promoted from the snapshot) ...
        ["evict", keys(range(300, 400)), 0],  # ... then evicted: never back either
        ["put_many", keys(range(500, 600)), 2],
    ])
    go_on(w)
    got = _contents(name)
    assert not any(k in got for k in keys(range(0, 200)))
    assert not any(k in got for k in keys(range(300, 400)))
    assert got == {**{k: 1 for k in keys(range(200, 300))}, **{k: 0 for k in keys(range(400, 500))},
                   **{k: 2 for k in keys(range(500, 600))}, **{k: 0 for k in keys(range(600, N))}}


def test_a_handle_without_the_snapshot_index_marks_what_it_writes(persisted):
    """A handle opened with snapshot_tier=False (or a process that does not follow the fill mark) cannot find
    positions: it marks its keys' hash buckets.  What it deletes or overwrites never comes back either; a
    snapshot entry sharing such a bucket is a miss at worst, never a wrong value."""
    name = persisted()
    w = start(name)
    q = Pool.open(name)
    try:
        blind = keys(range(0, 40))
        assert act(name, [["delete", blind[:20], 0], ["put", blind[20:], 3]], stats_only=True)["fast_ok"] is False
        assert all(q.get(k) is None for k in blind[:20]) and all(q.get(k) == make_value(i, 3, SIZE)
                                                                 for i, k in enumerate(blind) if i >= 20)
        act(name, [["evict", blind[20:], 0]])
        go_on(w)
        got = _contents(name)
        assert not any(k in got for k in blind)
        mates = _bucket_mates(name, blind) - set(blind)
        for k in keys(range(40, N)):
            assert got.get(k) == 0 or (k in mates and k not in got), k
        assert len(got) >= N - 40 - len(mates)
    finally:
        q.close()


def test_ttls_running_out_during_the_fill_never_come_back(persisted):
    """Entries whose TTL runs out while the fill runs (the filler's clock and a reader's jump a day and a
    half ahead once it goes on) are never served from the snapshot nor loaded by the fill."""
    name = persisted(ttl_keys=range(0, 600))
    w = start(name, jump=1.5 * DAY)
    late = Pool.open(name, clock=lambda: __import__("time").time() + 1.5 * DAY)
    try:
        assert all(late.get(k) is None and k not in late for k in keys(range(0, 600)))
        assert late.get("k700") == make_value(700, 0, SIZE)
        report = go_on(w)
        assert report["expired_skipped"] >= 599
        assert not any(late.get(k) is not None for k in keys(range(0, 600)))
        assert all(late.get(k) == make_value(i + 600, 0, SIZE) for i, k in enumerate(keys(range(600, N))))
    finally:
        late.close()


@pytest.mark.parametrize("kill_in", ["delete:1", "delete:30", "put_small:5"])
def test_a_writer_killed_inside_its_lock_hold_leaves_the_key_gone(persisted, kill_in):
    """A deleter (or overwriter) killed in the lock hold that changes memory, after its mark and before the
    slot changes: the next locker repairs the pool, and the key never comes back -- not from the snapshot
    tier, not from the fill resumed afterwards."""
    name = persisted()
    w = start(name)
    q = Pool.open(name)
    try:
        op = "put" if kill_in.startswith("put") else "delete"
        act(name, [[op, keys(range(100, 200)), 5]], kill_in=kill_in)
        dead = f"k{100 + int(kill_in.split(':')[1]) - 1}"
        q.core.lock_timeout = 5.0
        assert q.get(dead) is None and dead not in q
        report = go_on(w)
        assert report["ended"] == "done"
        got = _contents(name)
        assert dead not in got
        done_before = keys(range(100, 100 + int(kill_in.split(":")[1]) - 1))
        assert all(got.get(k) == (5 if op == "put" else None) for k in done_before)
        assert all(got.get(k) == 0 for k in keys(range(200, N)))
    finally:
        q.close()


@pytest.mark.parametrize("c", [False, True], ids=["python-fill", "c-fill"])
def test_a_filler_killed_inside_a_batch_resumes_without_what_was_deleted_meanwhile(persisted, c):
    name = persisted()
    # Python: the third batch reserved, some values copied; C: the third batch (175 entries) reserved.
    w = start(name, where="value", n=3, c=True) if c else start(name, where="value", n=20)
    kill(w)
    act(name, [["delete", keys(range(0, 1000)), 0], ["put", keys(range(1000, 1100)), 4]])
    r = cli("cache", "restore", name, "--if-missing")
    assert r.returncode == 0 and b"finished the fill" in r.stdout, r.stderr
    got = _contents(name)
    assert got == {**{k: 4 for k in keys(range(1000, 1100))}, **{k: 0 for k in keys(range(1100, N))}}


@pytest.mark.parametrize("c", [False, True], ids=["python-fill", "c-fill"])
def test_a_filler_killed_inside_its_seal_hold_loses_one_entry_at_most_and_brings_back_nothing_deleted(persisted, c):
    name = persisted()
    # Python: killed sealing its 40th entry; C: killed after sealing its second batch (1,024 entries), before
    # the mark moved past it.  The lock is left dirty either way.
    w = start(name, "seal", 2, c=True) if c else start(name, "seal", 40)
    w.wait(timeout=60)
    act(name, [["delete", keys(range(0, 1000)), 0]])
    r = cli("cache", "restore", name, "--if-missing")
    assert r.returncode == 0, r.stderr
    got = _contents(name)
    assert not any(k in got for k in keys(range(1000)))
    assert all(v == 0 for v in got.values()) and len(got) >= N - 1000 - 1


@pytest.fixture
def filling_with_c(persisted):
    """A pool whose fill is paused after its first batch, and a handle on it with the C fast path."""
    name = persisted()
    w = start(name)
    q = Pool.open(name)
    try:
        if q.core.fast is None:
            pytest.skip("the C fast path is not built here")
        yield name, w, q
    finally:
        q.close()


def test_the_c_write_path_steps_aside_while_a_snapshot_tier_is_live(filling_with_c):
    """While the fill runs a write of a key the snapshot holds goes through Python, which marks (the C path
    cannot); once it is over and a miss saw it, the C path is back."""
    name, w, q = filling_with_c
    assert q.tiers.fast_ok is False
    q.put("k600", make_value(600, 7, SIZE))  # would be the C path's put: it marks k600's position
    q.evict(keys=["k600"])
    assert q.get("k600") is None
    go_on(w)
    assert q.get("nope") is None  # a miss sees the fill is over: the snapshot tier is dropped
    assert q.tiers.fast_ok is True and q.get("k600") is None and q.get("k601") == make_value(601, 0, SIZE)


def test_a_put_of_a_key_the_snapshot_never_held_takes_the_c_path_during_the_fill(filling_with_c):
    """The C write path cannot mark: a put of a key the snapshot holds goes through Python, but one of a key it
    never held (an engine's new block) has nothing to mark and keeps the C path."""
    name, w, q = filling_with_c
    real, calls = q.core.fast, []

    class Counting:
        def __getattr__(self, attr):
            return getattr(real, attr)

        def put(self, *a):
            calls.append(a[0])
            return real.put(*a)

    q.core.fast = Counting()
    try:
        q.put("k5000", make_value(5000, 1, SIZE))
        q.put("k600", make_value(600, 9, SIZE))
    finally:
        q.core.fast = real
    assert calls == [b"k5000"]
    with Pool.open(name, snapshot_tier=False) as blind:  # cannot tell what the snapshot holds: Python
        assert blind.tiers.fast_put(b"k5001") is False
    q.evict(keys=["k600"])
    go_on(w)
    got = _contents(name)
    assert "k600" not in got and got["k5000"] == 1


def test_evicting_from_every_tier_reaches_what_the_fill_has_not_loaded(persisted):
    """`evict --tier all` of keys or a prefix takes the snapshot's copies too: they never come back."""
    name = persisted()
    w = start(name)
    r = cli("cache", "evict", name, "--tier", "all", "--prefix", "k11")  # k11, k110-k119, k1100-k1199
    assert r.returncode == 0, r.stderr
    with Pool.open(name) as q:
        assert q.evict(keys=["k7", "k8", "nope"], tier="all") == (2, 2 * SIZE)
        assert q.evict(keys=["k7"], tier="all") == (0, 0)
        assert q.get("k115") is None and q.get("k7") is None and q.get("k12") == make_value(12, 0, SIZE)
    go_on(w)
    got = _contents(name)
    out = {"k7", "k8", "k11", *keys(range(110, 120)), *keys(range(1100, 1200))}
    assert got == {k: 0 for k in keys(range(N)) if k not in out}
