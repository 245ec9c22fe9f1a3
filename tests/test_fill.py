"""A restored pool serves while it fills (fill.py): real processes, paused and killed mid-fill.

A worker restores the pool in a process of its own and stops at a chosen point of its fill (after a
batch, or inside one, with its reservations made) until the test says go on or kills it (fillers.py).
"""

from __future__ import annotations

import json

import pytest

from cortex_cache import Pool
from cortex_cache import persist as snap
from cortex_cache.fill import FILL_BYTE
from cortex_cache.lock import RecordLock

from .fillers import go_on, kill, no_filler_left, start  # noqa: F401 (no_filler_left: autouse)
from .helpers import cli, make_value

N = 30
MIB = 1 << 20


@pytest.fixture
def persisted(make_pool, snapshot_dir):
    """A pool of N 1 MiB values persisted into the snapshot directory, then deleted (the boot case);
    k2, k9, k5 read last, in that order (k5 the most recently used)."""
    p = make_pool("64M")
    for i in range(N):
        p.put(f"k{i}", make_value(i, 0, MIB))
    for k in ("k2", "k9", "k5"):
        assert p.get(k) is not None
    snap.persist(p)
    name = p.name
    p.close()
    Pool.unlink(name)
    yield name
    if Pool.exists(name):
        Pool.unlink(name)


def _all_there(q: Pool, but: dict | None = None) -> None:
    but = but or {}
    for i in range(N):
        k = f"k{i}"
        assert q.get(k) == but.get(k, make_value(i, 0, MIB)), k
    assert q.verify()["ok"]
    assert q.stats()["writing_entries"] == 0


def test_a_restored_pool_serves_while_it_fills_and_keeps_what_is_put_meanwhile(persisted):
    w = start(persisted)  # paused after its first batch: one entry, the most recently used
    q = Pool.open(persisted)
    try:
        assert len(q) == 1 and q.get("k5") == make_value(5, 0, MIB)
        # In the snapshot, not loaded yet: the snapshot is a tier below memory (snaptier.py), so it is there,
        # and a get brings it in, checked, before the fill comes to it.
        assert "k6" in q and q.leading(["k6", "k1", "nope"]) == 2
        assert q.get("k6") == make_value(6, 0, MIB) and len(q) == 2
        q.delete("k5")  # the fill came to it: the snapshot never brings it back
        assert q.get("k5") is None and "k5" not in q
        st = q.stats()["fill"]
        assert st["state"] == "filling" and st["running"] and st["entries_done"] == 1 and st["entries_total"] == N
        r = cli("cache", "persist", persisted)  # a snapshot of a half-filled pool would retire the whole one
        assert r.returncode == 75 and b"still being filled" in r.stderr and len(r.stderr.splitlines()) == 1
        q.put("k7", b"newer")  # in the snapshot, not loaded yet: the newer value must stay
        q.put("fresh", b"f")
        report = go_on(w)
        assert report["entries"] == N - 2 and report["present_skipped"] == 2 and report["ended"] == "done"
        assert report["published_seconds"] is not None
        _all_there(q, but={"k7": b"newer", "k5": None})
        assert q.get("fresh") == b"f" and len(q) == N
        assert "k5" not in q  # the fill is over: nothing comes from the snapshot any more
        assert q.stats()["fill"]["state"] == "done"
        assert cli("cache", "persist", persisted).returncode == 0  # done: persists again
    finally:
        q.close()


def test_a_handle_that_only_reads_stats_does_not_index_the_filling_snapshot(persisted):
    """status, list and --watch open the pool without the snapshot tier (its index costs about 0.5 s per
    100,000 entries at each open): such a handle sees only what is loaded, and its stats are the pool's."""
    w = start(persisted)  # paused after its first batch
    full, light = Pool.open(persisted), Pool.open(persisted, snapshot_tier=False)
    try:
        assert "k6" in full and "k6" not in light and light.get("k6") is None
        assert light.stats()["fill"]["state"] == "filling" and light.stats()["entries"] == 1
        with light.reopen() as again:  # reopen keeps how it was opened
            assert "k6" not in again
        st = json.loads(cli("cache", "status", persisted, "--json").stdout)
        assert st["fill"]["state"] == "filling" and st["entries"] == 1  # nothing was brought in by status
        go_on(w)
        assert len(light) == N and light.get("k6") == make_value(6, 0, MIB)
    finally:
        full.close()
        light.close()


def test_the_fill_brings_the_most_recently_used_first(persisted):
    w = start(persisted, n=2, band=MIB)  # one entry per band: the order is exactly most recent first
    q = Pool.open(persisted)
    try:
        assert set(q.keys()) == {"k5", "k9", "k2"}  # one entry, then a batch of two (2 MiB)
        go_on(w)
        _all_there(q)
    finally:
        q.close()


def test_a_filler_killed_between_batches_leaves_a_pool_the_next_restore_finishes(persisted):
    w = start(persisted, n=2)
    kill(w)
    st = cli("cache", "status", persisted)
    assert st.returncode == 0 and b"interrupted at" in st.stdout and b"--if-missing" in st.stdout
    r = cli("cache", "persist", persisted)
    assert r.returncode == 75 and b"restore " + persisted.encode() + b" --if-missing" in r.stderr
    with Pool.open(persisted) as q:
        assert len(q) == 3
    assert _doctor_fill_findings() == [
        {"check": "fill", "ok": False, "fix": f"`cortex cache restore {persisted} --if-missing` finishes it"}]
    r = cli("cache", "restore", persisted, "--if-missing")
    assert r.returncode == 0 and b"finished the fill" in r.stdout, r.stderr
    with Pool.open(persisted) as q:
        _all_there(q)
        assert len(q) == N and q.stats()["fill"]["state"] == "done"
    assert _doctor_fill_findings() == []


def _doctor_fill_findings() -> list[dict]:
    r = cli("cache", "doctor", "--json")  # exits 1 where cron's PATH has no cortex: read the findings
    found = [f for f in json.loads(r.stdout)["findings"] if f["check"] == "fill"]
    return [{k: f[k] for k in ("check", "ok", "fix")} for f in found]


@pytest.mark.parametrize("c", [False, True], ids=["python-fill", "c-fill"])
def test_a_filler_killed_inside_a_batch_leaves_no_reservation_behind_the_resume(persisted, c):
    # Python: the second batch reserved, one value of it copied; C: the second batch reserved, none written
    w = start(persisted, where="value", n=2, c=True) if c else start(persisted, where="value", n=3)
    kill(w)
    with Pool.open(persisted) as q:
        assert q.stats()["writing_entries"] == 2 and len(q) == 1
    r = cli("cache", "restore", persisted)  # a plain restore of the pool finishes its fill as well
    assert r.returncode == 0, r.stderr
    with Pool.open(persisted) as q:
        _all_there(q)


@pytest.mark.parametrize("c", [False, True], ids=["python-fill", "c-fill"])
def test_emptying_the_pool_stops_its_fill(persisted, c):
    w = start(persisted, c=c)
    assert cli("cache", "evict", persisted, "--all").returncode == 0
    report = go_on(w)
    assert report["ended"] == "stopped"
    with Pool.open(persisted) as q:
        assert len(q) == 0 and q.stats()["fill"]["state"] == "stopped"
    assert cli("cache", "persist", persisted).returncode == 0


@pytest.mark.parametrize("c", [False, True], ids=["python-fill", "c-fill"])
def test_the_fill_never_evicts_what_was_put_meanwhile(persisted, c):
    w = start(persisted, c=c)
    q = Pool.open(persisted)
    try:
        newer = [f"n{i}" for i in range(60)]
        for k in newer:  # 61 MiB of newer entries beside the one loaded: no room for the snapshot's rest
            q.put(k, b"n" * MIB)
        evicted = q.stats()["evictions"]
        report = go_on(w)
        assert report["ended"] == "stopped"
        st = q.stats()
        assert st["evictions"] == evicted and all(q.get(k) == b"n" * MIB for k in newer)
        assert st["fill"]["state"] == "stopped" and q.verify()["ok"]
    finally:
        q.close()


def test_restore_in_the_background_returns_once_published(persisted):
    r = cli("cache", "restore", persisted, "--if-missing", "--background", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["filling"] and report["filler_pid"] > 0 and not report["skipped"]
    with Pool.open(persisted) as q:
        lock = RecordLock(q.core.seg.fd, FILL_BYTE)  # the filler holds it from before the publish to its end
        lock.acquire(timeout=60)
        lock.release()
        _all_there(q)
        assert q.stats()["fill"]["state"] == "done"
    again = cli("cache", "restore", persisted, "--if-missing", "--background")
    assert again.returncode == 0 and b"exists; nothing restored" in again.stdout


def test_restore_in_the_background_says_why_it_could_not_publish(snapshot_dir, pool_name):
    r = cli("cache", "restore", pool_name, "--background")
    assert r.returncode == 66 and len(r.stderr.splitlines()) == 1 and b"no snapshot" in r.stderr
    assert not Pool.exists(pool_name)
    r = cli("cache", "restore", pool_name, "--background", "--replace")
    assert r.returncode == 2


def test_a_damaged_value_the_snapshot_tier_would_bring_is_a_miss(persisted):
    """A get of an entry not loaded yet reads it from its pack and checks it: a damaged one is a miss (and the fill
    leaves it out too), never wrong bytes."""
    from cortex_cache.fill import manifest_items
    from cortex_cache.snapshot import Snapshot, latest_path

    with Snapshot(latest_path(persisted), private=True) as s:
        (it,) = [it for it in manifest_items(s) if it.key == b"k6"]
        pack, off = it.where
        path = s.pack_reader(pack).path
    with open(path, "r+b") as f:  # one byte of the value (a version 4 manifest gives the value's own offset)
        f.seek(off + 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    w = start(persisted)
    q = Pool.open(persisted)
    try:
        assert q.get("k6") is None and q.get("k1") == make_value(1, 0, MIB)
        w.stdin.write(b"\n")
        w.stdin.flush()
        assert w.wait(timeout=60) != 0 and b"SnapshotCorrupt" in w.stderr.read()  # after the fill, naming the pack
        assert q.get("k6") is None and q.stats()["fill"]["corrupt"] == 1
    finally:
        q.close()
        for f in (w.stdin, w.stdout, w.stderr):
            f.close()


# ---------------------------------------------------------------- queue policies and admission (issue 27)


def _queued(q: Pool) -> None:
    """Every sealed entry of queue pool `q` is in one queue, counted, with its own place in the queues' order."""
    qs = q.core.queues
    sealed = qs.cols["state"] == 2  # SEALED
    qh = qs.header[0]
    assert int(qh["q_count0"]) + int(qh["q_count1"]) == len(q) == int(sealed.sum())
    order = qs.cols["qseq"][sealed]
    assert order.min() > 0 and len(set(order.tolist())) == order.size and int(order.max()) <= int(qh["q_seq"])
    rep = q.verify()
    assert rep["ok"], rep["problems"]


@pytest.mark.parametrize("policy", ["s3fifo", "auto"])
def test_what_the_fill_seals_joins_a_queue_as_a_put_would(make_pool, snapshot_dir, restored, policy):
    """Queue state is not in a snapshot: the fill queues each entry it seals (all new keys: queue 0), so the
    evictions after it account for them as for any put's, and the pool stays consistent."""
    p = make_pool("1M", block_size="4K", policy=policy)
    for i in range(200):
        p.put(f"k{i}", make_value(i, 0, 4096))
    for i in range(0, 200, 3):
        assert p.get(f"k{i}") is not None
    snap.persist(p)
    name = p.name
    p.close()
    Pool.unlink(name)
    q, _ = snap.restore(None, name=name)
    restored.append(q)
    assert q.stats()["fill"]["state"] == "done" and len(q) == 200
    _queued(q)
    assert int(q.core.queues.header[0]["q_count0"]) == 200  # no ghosts yet: every key is new to the queues
    for i in range(300):
        q.put(f"n{i}", make_value(i, 1, 4096))
    assert q.stats()["evictions"] >= 200
    _queued(q)
    assert all(q.get(f"n{i}") == make_value(i, 1, 4096) for i in range(280, 300))


@pytest.mark.parametrize("policy", ["s3fifo", "auto"])
def test_puts_beside_a_fill_evict_what_it_sealed_with_the_queues_in_step(make_pool, snapshot_dir, policy):
    """Another process's puts, mid-fill, evict entries the fill sealed: the queue counts stay right through
    it, and after the fill ends."""
    p = make_pool("16M", policy=policy)
    for i in range(12):
        p.put(f"k{i}", make_value(i, 0, MIB))
    snap.persist(p)
    name = p.name
    p.close()
    Pool.unlink(name)
    try:
        w = start(name)  # paused after its first batch
        q = Pool.open(name)
        try:
            assert len(q) >= 1
            for i in range(20):  # more than the pool holds: the fill's entries are evicted too
                q.put(f"n{i}", make_value(i, 1, MIB))
            assert q.stats()["evictions"] > 0
            _queued(q)
            report = go_on(w)
            assert report["ended"] in ("stopped", "done")
            _queued(q)
            for i in range(20, 40):
                q.put(f"n{i}", make_value(i, 1, MIB))
            _queued(q)
        finally:
            q.close()
    finally:
        if Pool.exists(name):
            Pool.unlink(name)


def test_a_restore_from_the_snapshot_directory_keeps_tier_admission(make_pool, snapshot_dir, restored, tmp_path):
    """tier_admit 2 is configuration: the boot restore (published at once, filled after) keeps it, and the
    restored pool admits below as the original did."""
    p = make_pool("1M", block_size="4K", disk_path=tmp_path / "tier", disk_size="4M", tier_admit=2)
    for i in range(8):
        p.put(f"k{i}", make_value(i, 0, 4096))
    snap.persist(p)
    name = p.name
    p.close()
    Pool.unlink(name)  # its disk tier stays, and the restored pool takes it over
    q, report = snap.restore(None, name=name)
    restored.append(q)
    assert q.stats()["fill"]["state"] == "done"  # restored by the fill (a pool published, then filled)
    assert q.configuration()["tier_admit"] == 2 and q.stats()["tier_admit"] == 2 and q.tiers.admit
    assert q.get("k0") == make_value(0, 0, 4096)  # read since it came back: admitted when evicted
    assert q.evict(all=True) == (8, 8 * 4096)
    st = q.stats()
    assert st["tier_refused"] == 7 and st["disk"]["entries"] == 1 and q.get("k0") == make_value(0, 0, 4096)
