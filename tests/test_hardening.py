"""Hardening: resource hygiene over 10,000 cycles, permissions across users, a crash matrix of SIGKILLs.

The crash matrix kills a process at random points of every operation that
changes state, CORTEX_CRASH_ROUNDS times each (2 in the default run, 25 in the
long form .ci/run runs; hundreds for a release).  After each kill another process must get the pool lock within a
second (lock_timeout=1), `verify` must be clean after repair, and every
entry still there must hold exactly the bytes that were put.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import stat
import threading

import pytest

from cortex_cache import PermissionDenied, Pool, segment
from cortex_cache.errors import InvalidName
from cortex_cache.core import PURE_PYTHON_ENV
from tests.helpers import as_user, check_value, cli, make_value, spawn_py

ROUNDS = int(os.environ.get("CORTEX_CRASH_ROUNDS", "2"))


# ---------------------------------------------------------------- resource hygiene


def _resources() -> tuple[int, int, int, int]:
    """Open fds, mappings of our segments, threads, our segments in /dev/shm."""
    prefix = segment.prefix()
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "/dev/shm/" + prefix in line)
    segs = sum(1 for n in os.listdir("/dev/shm") if n.startswith(prefix))
    return len(os.listdir("/proc/self/fd")), maps, threading.active_count(), segs


def test_10000_open_close_cycles_leak_no_fd_mapping_thread_or_segment(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K", disk_path=tmp_path / "tier", disk_size="2M")  # 17 more files per open
    p.put("k", b"v" * 5000)
    name = p.name
    gc.collect()
    before = _resources()
    for i in range(10_000):
        q = Pool.open(name)
        if i % 500 == 0:
            assert q.get("k") == b"v" * 5000
            with q.view("k") as mv:
                assert mv[0] == ord("v")
        q.close()
    gc.collect()
    assert _resources() == before


# ---------------------------------------------------------------- permissions


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")


@root_only
def test_a_0600_pool_cannot_be_opened_by_another_user(make_pool):
    p = make_pool("1M")
    p.put("secret", b"prompt")

    def try_open() -> int:
        try:
            Pool.open(p.name)
        except PermissionDenied as e:
            return e.exit_code
        return 0

    assert as_user(try_open) == 77
    assert stat.S_IMODE(os.stat(segment.shm_path(p.name)).st_mode) == 0o600


@root_only
def test_mode_0660_with_a_shared_group_lets_the_group_in(make_pool):
    p = make_pool("1M", mode=0o660)
    os.chown(segment.shm_path(p.name), -1, 54321)  # the operators' group
    p.put("shared", b"kv")

    def use() -> int:
        with Pool.open(p.name) as q:
            ok = q.get("shared") == b"kv"
            q.put("from-group", b"hello")
        return 0 if ok else 1

    assert as_user(use, uid=65534, gid=54321) == 0
    assert p.get("from-group") == b"hello"
    assert as_user(lambda: Pool.open(p.name) and 0, uid=65534, gid=65534) == 98  # other groups: refused


def test_snapshots_and_disk_tiers_are_private(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K", disk_path=tmp_path / "tier", disk_size="1M")
    for i in range(60):
        p.put(f"k{i}", make_value(i, 0, 3000))
    path = p.persist(tmp_path / "p.ccsnap")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "tier").st_mode) == 0o700
    for f in (tmp_path / "tier").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


@pytest.mark.parametrize("name", ["../etc", "a/b", "/abs", ".hidden", "-dash", "x" * 65, "", "nul\0", "sp ace",
                                  "\u00e9t\u00e9"])
def test_a_name_never_addresses_anything_outside_the_prefix(name):
    with pytest.raises(InvalidName):
        Pool.create(name, "1M")
    r = cli("cache", "create", name, "--size", "1M") if "\0" not in name else None
    if r is not None:
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1


# ---------------------------------------------------------------- crash matrix

CHILD = """
import os, random, sys
from cortex_cache import Pool
from tests.helpers import make_value
op, name, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
p = Pool.open(name)
i = 0
while True:
    i += 1
    k = rng.randrange(48)
    if op == "put":
        p.put(f"k{k}", make_value(k, i, rng.choice([500, 5000, 300_000])))
    elif op == "delete":
        p.put(f"k{k}", make_value(k, i, 2000)); p.delete(f"k{rng.randrange(48)}")
    elif op == "evict":
        p.put(f"k{k}", make_value(k, i, 40_000)); p.evict(percent=rng.choice([5, 50]))
    elif op == "put_many":
        p.put_many([(f"k{j}", make_value(j, i, rng.choice([500, 5000, 300_000]))) for j in rng.sample(range(48), 8)])
    elif op == "get_many":
        ks = [f"k{j}" for j in rng.sample(range(48), 8)]
        p.get_many_into(ks, [bytearray(300_000) for _ in ks])
        vs = p.view_many(ks)                               # killed while holding pins, sometimes
        p.release_many(vs)
        p.delete_many(ks[:1])
    elif op == "write_many":                               # the batched zero-copy put
        ks = [f"k{j}" for j in rng.sample(range(48), 8)]
        vals = [make_value(int(k[1:]), i, rng.choice([500, 5000, 300_000])) for k in ks]
        ws = p.reserve_write_many([(k, len(v)) for k, v in zip(ks, vals)])
        for w, v in zip(ws, vals):
            if not isinstance(w, Exception):
                w.memoryview[:] = v                        # killed while holding reservations, sometimes
        p.commit_many([w for w in ws if not isinstance(w, Exception)])
    elif op == "evict_all":
        p.put(f"k{k}", make_value(k, i, 30_000))
        p.evict(all=True)                                  # every entry moves memory -> disk
    elif op == "spill":
        p.put(f"k{k}", make_value(k, i, 30_000))          # a full pool: every put spills one
    elif op == "promote":
        p.get(f"k{k}")                                     # disk hits promote, promotions spill
    elif op == "persist":
        p.persist(sys.argv[4])
    elif op == "repair":
        from cortex_cache.layout import H_DIRTY
        p.core.fields.dirty[0] = 1                               # as if a holder had died: the next hold repairs
        p.get(f"k{k}")                                     # ... and is killed mid-repair, sometimes
    elif op == "remote":
        p.put(f"k{k}", make_value(k, i, 20_000))
    elif op == "restore":
        q = Pool.restore(sys.argv[4], name=sys.argv[5])
        q.close()
        Pool.unlink(sys.argv[5])
    elif op == "fill":                                     # published at once, filled in the background
        q = Pool.restore(sys.argv[4], name=sys.argv[5])
        q.close()
        Pool.unlink(sys.argv[5])
    elif op == "replace":                                  # two snapshots, in turn, over one pool
        Pool.restore(sys.argv[4 + i % 2], name=name, replace=True).close()
    print(i, flush=True)
"""


def _check_pool(p: Pool) -> int:
    """Repair if needed, then: verify clean, every entry exact, a put and get work.  Entries seen."""
    p.core.lock_timeout = 1.0  # another process continues within a second, or this raises LockTimeout
    p.verify(repair=True)
    rep = p.verify()
    assert rep["ok"], rep["problems"]
    seen = 0
    for k in p.keys(tier="all") if p.disk_path is not None else p.keys():
        if k == "alive":
            continue
        v = p.get(k)
        if v is not None:
            assert check_value(v)[0] == int(str(k)[1:])
            seen += 1
    p.put("alive", b"yes")
    assert p.get("alive") == b"yes"
    return seen


# What verify (without repair) may find in a pool after a process was killed in it: a lock hold cut short,
# and what the dead process held (unsealed entries, pins).  The next writer, or verify --repair, repairs it.
KILL_LEFTOVERS = ("a process died while changing the pool's metadata", "of dead processes")


def _kill_at_random(op: str, name: str, seed: int, *extra: str) -> None:
    child = spawn_py(CHILD, op, name, str(seed), *extra)
    try:
        for _ in range(random.Random(seed).randrange(1, 25)):
            if not child.stdout.readline():
                raise AssertionError(child.stderr.read().decode()[-2000:])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        for f in (child.stdin, child.stdout, child.stderr):
            f.close()


# The writes run both ways: through the C write path (_fastpath_put.c) and through core.py.
@pytest.mark.parametrize("op,path", [(op, "c") for op in ("put", "delete", "evict", "repair", "put_many",
                                                          "get_many", "write_many")]
                         + [(op, "python") for op in ("put", "put_many", "write_many")])
def test_sigkill_at_random_points_of_memory_operations(make_pool, op, path, monkeypatch):
    if path == "python":
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")  # the killed child's
    p = make_pool("2M", block_size="16K")
    for k in range(48):
        p.put(f"k{k}", make_value(k, 0, 2000))
    for r in range(ROUNDS):
        _kill_at_random(op, p.name, 1000 * r + len(op))
        _check_pool(p)


# The queue policies keep more shared state (queues, counts, ghost rings, two victim lists): the same kills.
@pytest.mark.parametrize("policy,op,path", [(pol, op, "c") for pol in ("s3fifo", "arc", "auto")
                                            for op in ("put", "get_many", "evict")]
                         + [("auto", "put", "python"), ("arc", "put_many", "python")])
def test_sigkill_at_random_points_of_queue_policies(make_pool, policy, op, path, monkeypatch):
    if path == "python":
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    p = make_pool("2M", block_size="16K", policy=policy)
    for k in range(48):
        p.put(f"k{k}", make_value(k, 0, 2000))
    for r in range(ROUNDS):
        _kill_at_random(op, p.name, 3000 * r + len(op))
        _check_pool(p)
    assert p.core.queues.repair(False) == []  # counts, target and ghost rings in step after every repair


@pytest.mark.parametrize("op", ["spill", "promote"])
def test_sigkill_at_random_points_of_disk_tier_operations(make_pool, tmp_path, op):
    p = make_pool("512K", block_size="4K", disk_path=tmp_path / "tier", disk_size="4M")
    for k in range(48):
        p.put(f"k{k}", make_value(k, 0, 30_000))  # most of them on disk
    for r in range(ROUNDS):
        _kill_at_random(op, p.name, 7000 + r)
        _check_pool(p)
    # And a restart finds only whole records.
    tier, name = p.disk_path, p.name
    p.close()
    Pool.unlink(name)
    q = Pool.create(name, "512K", block_size="4K", disk_path=tier)
    try:
        _check_pool(q)
    finally:
        q.close()
        Pool.unlink(name)


HOLDS_VIEWS = """
import sys
from cortex_cache import Pool
p = Pool.open(sys.argv[1])
views = p.view_many(sys.argv[2:])
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize("waited", [True, False], ids=["waited", "zombie"])
def test_a_killed_readers_pins_do_not_make_the_next_put_fail(make_pool, path, waited, monkeypatch):
    """A process holding views of most of a small pool is killed: the next put that needs their room
    reaps its pins and evicts (issue: it exited 73 once, and the same put then succeeded).  Also while the
    killed reader is a zombie its parent has not waited for yet (/proc still shows its pid and start time)."""
    if path == "python":
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    p = make_pool("1M", block_size="64K")
    for i in range(4):
        p.put(f"k{i}", make_value(i, 0, 250_000))
    child = spawn_py(HOLDS_VIEWS, p.name, "k0", "k1", "k2")
    try:
        assert child.stdout.readline() == b"held\n", child.stderr.read().decode()[-2000:]
        assert p.stats()["pinned_entries"] == 3
        child.send_signal(signal.SIGKILL)
        if waited:
            child.wait()
        else:  # dead once waitid says so, but not reaped (WNOWAIT): a zombie
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                assert f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        p.put("new", make_value(9, 0, 600_000))  # needs three of the four entries' room
    finally:
        child.kill()
        child.wait()
        for f in (child.stdin, child.stdout, child.stderr):
            f.close()
    assert check_value(p.get("new"))[0] == 9
    assert p.stats()["pinned_entries"] == 0 and p.verify()["ok"]


def test_sigkill_mid_evict_all_to_disk_loses_no_entry(make_pool, tmp_path):
    # An entry moving memory -> disk must be readable in one tier or the other at every instant,
    # whenever its mover is killed (issue 15).
    p = make_pool("2M", block_size="4K", disk_path=tmp_path / "tier", disk_size="8M")
    for k in range(48):
        p.put(f"k{k}", make_value(k, 0, 30_000))
    lost = []
    for r in range(ROUNDS):
        _kill_at_random("evict_all", p.name, 9000 + r)
        _check_pool(p)
        lost += [k for k in range(48) if p.get(f"k{k}") is None]
    assert not lost, f"entries lost by killed evictions: {lost}"


def test_sigkill_mid_persist_leaves_the_old_snapshot_or_the_new_one(make_pool, tmp_path, pool_name):
    p = make_pool("8M")
    for k in range(48):
        p.put(f"k{k}", make_value(k, 0, 100_000))
    target = tmp_path / "s.ccsnap"
    p.persist(target)
    for r in range(ROUNDS):
        _kill_at_random("persist", p.name, 500 + r, str(target))
        # Restoring verifies the whole file: the old snapshot or a complete new one, never a mix.
        q = Pool.restore(target, name=pool_name + "r")
        try:
            assert len(q) in (48, 49) and all(check_value(q.get(f"k{k}"))[0] == k for k in range(48))
        finally:
            q.close()
            Pool.unlink(pool_name + "r")
        _check_pool(p)


def test_sigkill_mid_restore_leaves_no_pool_or_a_whole_one(make_pool, tmp_path, pool_name, monkeypatch):
    from cortex_cache import persist, staging

    p = make_pool("8M")
    for k in range(48):
        p.put(f"k{k}", make_value(k, 0, 100_000))
    snap = str(p.persist(tmp_path / "s.ccsnap"))
    target = pool_name + "t"
    for r in range(ROUNDS):
        _kill_at_random("restore", p.name, 900 + r, snap, target)
        if Pool.exists(target):  # published: then it is whole
            with Pool.open(target) as q:
                assert q.verify()["ok"] and all(check_value(q.get(f"k{k}"))[0] == k for k in range(48))
            Pool.unlink(target)
        _check_pool(p)
    # Killed restores leave their staging segments; the next restore sweeps those nobody maps.
    monkeypatch.setattr(staging, "STAGING_STALE_AFTER", 0.0)
    q = Pool.restore(snap, name=target)
    q.close()
    Pool.unlink(target)
    assert not [n for n in segment.list_names() if n.startswith(persist.STAGING_PREFIX)]


def test_sigkill_mid_fill_leaves_no_pool_or_one_the_next_restore_finishes(make_pool, snapshot_dir, pool_name,
                                                                          monkeypatch):
    """A restore from the snapshot directory publishes the pool before its values are in (fill.py): killed
    at random, it leaves no pool, or one whose entries are each exact, which the next restore completes."""
    from cortex_cache import restore, staging

    p = make_pool("8M")
    for k in range(48):
        p.put(f"k{k}", make_value(k, 0, 100_000))
    manifest = str(p.persist())  # an incremental snapshot: what restore publishes before filling
    name = pool_name + "f"
    for r in range(ROUNDS):
        _kill_at_random("fill", p.name, 1900 + r, manifest, name)
        if not Pool.exists(name):
            continue
        try:
            with Pool.open(name) as q:
                # A filler killed in a lock hold leaves the dirty mark; one killed mid-copy, the entries it had
                # reserved unsealed (never visible to a reader) and perhaps its pins.  verify names those and
                # nothing else, and repair drops them.
                report = q.verify()
                assert all(any(left in m for left in KILL_LEFTOVERS) for m in report["problems"]), (r, report)
                q.verify(repair=True)
                assert q.verify()["ok"], (r, q.verify())
                assert all(check_value(q.get(k))[0] == int(k[1:]) for k in q.keys())
                state = q.stats()["fill"]["state"]
                assert state in ("interrupted", "done")
            if state == "interrupted":
                q = Pool.restore(manifest, name=name)  # finishes the fill from where it stopped
                try:
                    assert len(q) == 48 and all(check_value(q.get(f"k{k}"))[0] == k for k in range(48))
                    assert q.stats()["writing_entries"] == 0
                finally:
                    q.close()
        finally:
            if Pool.exists(name):
                Pool.unlink(name)
        _check_pool(p)
    monkeypatch.setattr(staging, "STAGING_STALE_AFTER", 0.0)
    Pool.restore(manifest, name=name).close()  # sweeps the staging segments killed restores left
    Pool.unlink(name)
    assert not [n for n in segment.list_names() if n.startswith(restore.STAGING_PREFIX)]


REPLACE_ROUNDS = max(ROUNDS, 20)


def test_sigkill_mid_restore_replace_leaves_the_old_pool_or_the_new_one(make_pool, tmp_path, pool_name, monkeypatch):
    """Two snapshots of 200 entries each (different keys) restored over one pool in turn, killed at random:
    the pool always holds exactly one of them, whole, and never a mix."""
    from cortex_cache import persist, staging

    snaps = []
    for v, keys in ((1, "a"), (2, "b")):
        with Pool.create(f"{pool_name}{keys}", "4M", block_size="4K") as src:
            for k in range(200):
                src.put(f"{keys}{k}", make_value(k, v, 15_000))
            snaps.append(str(src.persist(tmp_path / f"{keys}.ccsnap")))
        Pool.unlink(f"{pool_name}{keys}")
    p = make_pool("4M", block_size="4K", name=pool_name)
    for k in range(200):
        p.put(f"a{k}", make_value(k, 1, 15_000))
    p.close()
    seen = {"a": 0, "b": 0}
    for r in range(REPLACE_ROUNDS):
        _kill_at_random("replace", pool_name, 1300 + r, *snaps)
        with Pool.open(pool_name) as q:
            keys = sorted(map(str, q.keys()))
            which = keys[0][0]
            assert keys == sorted(f"{which}{k}" for k in range(200)), (r, len(keys), keys[:3])
            for k in range(200):
                assert check_value(q.get(f"{which}{k}")) == (k, 1 if which == "a" else 2)
            assert q.verify()["ok"]
        seen[which] += 1
    monkeypatch.setattr(staging, "STAGING_STALE_AFTER", 0.0)
    Pool.restore(snaps[0], name=pool_name, replace=True).close()  # sweeps the killed ones' staging segments
    assert not [n for n in segment.list_names() if n.startswith(persist.STAGING_PREFIX)]
    assert seen["a"] and seen["b"], seen  # kills landed on both sides of the swap


def test_sigkill_of_a_remote_writer_leaves_the_pool_and_the_server_consistent(make_pool, pool_name):
    from tests.redis_servers import REDIS_SERVER, Server

    if not REDIS_SERVER:
        pytest.skip("needs redis-server")
    s = Server()
    try:
        p = make_pool("2M", name=pool_name, remote=s.url)
        for r in range(ROUNDS):
            _kill_at_random("remote", p.name, 300 + r)
            _check_pool(p)
        # Whatever reached the server is whole: a fresh pool of that name reads it or misses.
        p.evict(all=True)
        for k in range(48):
            v = p.get(f"k{k}")
            assert v is None or check_value(v)[0] == k
        assert p.stats()["remote"]["corrupt"] == 0
    finally:
        s.stop()
