"""Processes follow the pool of a name (issue: engines stayed on a replaced pool's nameless copy).

`restore --replace` and `delete` mark the segment they retire (Pool.superseded); a handle learns of it with
one header load and reopens by name; `status` and delete's guard see processes still on an old copy; the
engine adapters (integrations/pools.py's Attachment) move by themselves.  Real processes, real segments.
"""

from __future__ import annotations

import json
import select

import pytest

from cortex_cache import Pool, PoolNotFound, PoolSuperseded
from cortex_cache.integrations.lmcache import CortexConnector

from .helpers import cli, spawn_py

HOLDER = """
import sys
from cortex_cache import Pool, PoolSuperseded
p = Pool.open(sys.argv[1])
print("open", flush=True)
sys.stdin.readline()
try:
    got = p.get("k")
except PoolSuperseded:  # the old copy is never read or written as if it were the pool of the name
    got = "raised"
print("superseded" if p.superseded else "current", got, flush=True)
"""


def _stop(child) -> bytes:
    out, _ = child.communicate(b"\n", timeout=60)
    return out


def test_restore_replace_marks_the_old_pool_and_a_handle_reopens_the_new_one(make_pool, tmp_path):
    p = make_pool("4M")
    name = p.name
    p.put("k", b"snapshot")
    snap = tmp_path / "s.ccsnap"
    assert cli("cache", "persist", name, "-o", str(snap)).returncode == 0
    p.put("k", b"live")
    child = spawn_py(HOLDER, name)
    try:
        assert child.stdout.readline() == b"open\n"
        assert not p.superseded
        r = cli("cache", "restore", name, "-i", str(snap), "--replace")
        assert r.returncode == 0, r.stderr
        assert p.superseded
        with pytest.raises(PoolSuperseded):  # the old copy is never served as the pool of the name
            p.get("k")
        with p.reopen() as q:
            assert not q.superseded and q.get("k") == b"snapshot"
        st = json.loads(cli("cache", "status", name, "--json").stdout)
        row = st["pools"][0] if "pools" in st else st
        assert child.pid in row["attached_old_pids"] and child.pid not in row["attached_pids"]
        table = cli("cache", "status", name).stdout.decode()
        assert "on old copies" in table and str(child.pid) in table
        r = cli("cache", "delete", name)  # someone still maps an old copy: refused without --force
        assert r.returncode != 0 and b"on a copy it replaced" in r.stderr and str(child.pid).encode() in r.stderr
        assert Pool.exists(name)
    finally:
        out = _stop(child)
    assert out.split() == [b"superseded", b"raised"]


def test_delete_marks_the_pool_and_reopen_finds_none_then_the_next_one(make_pool):
    p = make_pool("4M")
    name = p.name
    q = Pool.open(name)
    try:
        p.close()
        assert cli("cache", "delete", name, "--force").returncode == 0
        assert q.superseded
        with pytest.raises(PoolNotFound):
            q.reopen()
        with Pool.create(name, "4M") as again:
            again.put("k", b"new")
            with q.reopen() as fresh:
                assert fresh.get("k") == b"new" and not fresh.superseded
    finally:
        q.close()
        if Pool.exists(name):
            Pool.unlink(name)


def _wait(conn: CortexConnector, fid: int) -> tuple:
    while True:
        assert select.select([conn.event_fd()], [], [], 30)[0], "no completion"
        for c in conn.drain_completions():
            if c[0] == fid:
                return c


def test_the_lmcache_adapter_follows_a_replace_a_delete_and_a_create(make_pool, tmp_path, monkeypatch):
    import cortex_cache.integrations.pools as pools

    monkeypatch.setattr(pools, "REATTACH_EVERY", 0.0)
    p = make_pool("8M")
    name = p.name
    try:
        with CortexConnector(pool=name) as conn:
            assert _wait(conn, conn.submit_batch_set(["a"], [bytearray(b"A" * 1000)]))[1]
            snap = tmp_path / "s.ccsnap"
            assert cli("cache", "persist", name, "-o", str(snap)).returncode == 0
            assert _wait(conn, conn.submit_batch_set(["b"], [bytearray(b"B" * 1000)]))[1]
            p.close()
            assert cli("cache", "restore", name, "-i", str(snap), "--replace").returncode == 0
            # The next batch runs on the restored pool: "b" was put after the snapshot.
            assert _wait(conn, conn.submit_batch_exists(["a", "b"]))[3] == [True, False]
            assert _wait(conn, conn.submit_batch_set(["c"], [bytearray(b"C" * 1000)]))[1]
            with Pool.open(name) as now:
                assert len(now) == 2  # a and c (namespaced), in the pool under the name
            assert cli("cache", "delete", name, "--force").returncode == 0
            done = _wait(conn, conn.submit_batch_exists(["a"]))
            assert done[1] is False and "not there" in done[2]  # no pool: the batch fails, never raises
            with Pool.create(name, "8M"):
                assert _wait(conn, conn.submit_batch_set(["d"], [bytearray(b"D" * 10)]))[1]
                with Pool.open(name) as now:
                    assert len(now) == 1
    finally:
        if Pool.exists(name):
            Pool.unlink(name)


def test_resize_keeps_the_most_recently_used_and_the_processes_on_it_move(make_pool):
    p = make_pool("1M", block_size="64K", policy="lru")
    name = p.name
    for i in range(5):
        p.put(f"k{i}", bytes([i]) * 150_000)  # three blocks each: five fill fifteen of sixteen
    assert p.get("k0") is not None  # k0 is now the most recently used, k1 the least
    child = spawn_py(HOLDER, name)
    try:
        assert child.stdout.readline() == b"open\n"
        r = cli("cache", "resize", name, "--size", "512K", "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert (report["entries"], report["left_out"], report["size"]) == (2, 3, 512 << 10)
        assert p.superseded
        with p.reopen() as q:
            assert sorted(q.keys()) == ["k0", "k4"] and q.get("k0") == bytes([0]) * 150_000
            assert q.verify()["ok"]
        r = cli("cache", "resize", name, "--size", "2M")
        assert r.returncode == 0 and b"resized" in r.stdout
        with Pool.open(name) as q:
            assert q.stats()["size_bytes"] == 2 << 20 and len(q) == 2
            q.put("x", b"x" * 1_800_000)  # needs the room of one of them: the least recently used goes
            assert "k4" not in q and "k0" in q
    finally:
        out = _stop(child)
    assert out.split() == [b"superseded", b"raised"]


def test_resize_brings_what_was_put_and_deleted_while_it_copied(make_pool, monkeypatch):
    from cortex_cache import resize as restore  # the resize moved out of restore.py

    p = make_pool("4M", block_size="4K")
    name = p.name
    for i in range(20):
        p.put(f"k{i}", bytes([i]) * 30_000)
    monkeypatch.setattr(restore, "RESIZE_BATCH_BYTES", 60_000)  # two entries per lock hold
    seen = []

    def meanwhile(done: int, total: int) -> None:  # between two batches, outside the lock: another writer
        if not seen:
            p.put("late", b"L" * 100)
            p.put("k19", b"new")  # copied already (most recent first), then replaced
            p.delete("k18")  # copied already, then deleted
        seen.append(done)

    report = Pool.resize(name, "8M", progress=meanwhile)
    assert len(seen) > 2 and report["left_out"] == 0
    with p.reopen() as q:
        assert q.get("late") == b"L" * 100 and q.get("k19") == b"new" and "k18" not in q
        assert len(q) == 20 and q.verify()["ok"]


def test_resize_refusals_change_nothing(make_pool, tmp_path):
    from cortex_cache.lock import PERSIST_BYTE, RecordLock

    r = cli("cache", "resize", "no-such-pool", "--size", "1M")
    assert r.returncode == 66 and len(r.stderr.splitlines()) == 1
    p = make_pool("1M", tier="disk", disk_path=str(tmp_path / "tier"), disk_size="4M")
    r = cli("cache", "resize", p.name, "--size", "2M")
    assert r.returncode == 2 and b"disk tier" in r.stderr and len(r.stderr.splitlines()) == 1
    q = make_pool("1M")
    q.put("k", b"v")
    r = cli("cache", "resize", q.name, "--size", "nonsense")
    assert r.returncode == 2
    lock = RecordLock(q.core.seg.fd, PERSIST_BYTE)  # a persist of it runs
    assert lock.try_acquire()
    try:
        r = cli("cache", "resize", q.name, "--size", "2M")
        assert r.returncode == 75, r.stderr
    finally:
        lock.release()
    assert not q.superseded and q.get("k") == b"v" and q.stats()["size_bytes"] == 1 << 20


@pytest.mark.parametrize("policy", ["s3fifo", "auto"])
def test_resize_of_a_queue_pool_keeps_its_policy_admission_and_queues_in_step(make_pool, policy):
    """Resize builds the new pool with the old one's configuration: its queue policy (the new segment gets
    a queue region of its own size) and tier_admit 2; each entry copied joins a queue as a put's would, so
    the evictions after it keep the queue counts right."""
    p = make_pool("1M", block_size="4K", policy=policy, tier_admit=2)
    name = p.name
    for i in range(200):
        p.put(f"k{i}", bytes([i % 251]) * 4096)
    report = Pool.resize(name, "512K")
    assert report["entries"] == 128 and p.superseded
    with p.reopen() as q:
        st = q.stats()
        assert st["policy"] == policy and st["tier_admit"] == 2 and q.configuration()["tier_admit"] == 2
        g = q.core.geometry
        assert g.n_slots < p.core.geometry.n_slots and (g.n_ghosts0, g.n_ghosts1) == tuple(
            f * g.n_slots for f in q.core.queues.policy.ghosts)
        for i in range(200, 400):
            q.put(f"k{i}", bytes([i % 251]) * 4096)
        qh = q.core.queues.header[0]
        assert int(qh["q_count0"]) + int(qh["q_count1"]) == len(q) == 128
        assert q.verify()["ok"] and q.stats()["evictions"] >= 200
