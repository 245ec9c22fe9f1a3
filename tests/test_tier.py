"""The disk tier under a pool: spill, promote, restart, damage, concurrency, kills, CLI."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from cortex_cache import Pool
from cortex_cache.disklog import DiskLog
from cortex_cache.errors import CannotCreate, NoSpace, UsageError
from tests.helpers import check_value, cli, make_value, run_py, spawn_py

MEM = "1M"  # 16 blocks of 64 KiB
VAL = 60_000  # one block per entry with its key


@pytest.fixture
def tier_dir(tmp_path) -> Path:
    return tmp_path / "tier"


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        f.close()


def _fill(p: Pool, n: int, version: int = 0, size: int = VAL) -> None:
    for i in range(n):
        p.put(f"k{i}", make_value(i, version, size))


def test_evicted_entries_spill_and_come_back_bit_exact(make_pool, tier_dir):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M")
    _fill(p, 40)
    st = p.stats()
    assert st["entries"] == 16 and st["disk"]["entries"] == 24 and st["evictions"] == 24
    assert st["disk"]["spills"] == 24 and st["disk"]["bytes_written"] >= 24 * VAL
    # get, get_into and view all see through to disk, and promote.
    assert check_value(p.get("k0")) == (0, 0)
    buf = bytearray(VAL)
    assert p.get_into("k1", buf) == VAL and check_value(bytes(buf)) == (1, 0)
    with p.view("k2") as mv:
        assert check_value(bytes(mv)) == (2, 0)
    for i in range(40):
        assert check_value(p.get(f"k{i}")) == (i, 0)
    d = p.stats()["disk"]
    assert d["hits"] >= 24 and d["promotions"] == d["hits"] and d["misses"] == 0
    assert p.get("nope") is None and p.stats()["disk"]["misses"] == 1
    # Write-back tiers are exclusive: every key lives in exactly one tier.
    assert len(p) + p.stats()["disk"]["entries"] == 40
    assert sorted(p.keys(tier="all")) == sorted(f"k{i}" for i in range(40))
    assert p.verify()["ok"]


def test_large_values_spill_and_promote_outside_the_lock(make_pool, tier_dir):
    p = make_pool("4M", disk_path=tier_dir, disk_size="64M")
    for i in range(8):
        p.put(f"big{i}", make_value(i, 0, 900_000))
    assert p.stats()["disk"]["entries"] >= 4
    for i in range(8):
        assert check_value(p.get(f"big{i}")) == (i, 0)
    assert p.verify()["ok"]


def test_info_contains_delete_and_replace_see_the_disk(make_pool, tier_dir):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M")
    p.put("old", b"x" * VAL, priority=5, ttl=3600)
    _fill(p, 20)
    inf = p.info("old")
    assert inf["tier"] == "disk" and inf["size"] == VAL and inf["priority"] == 5 and inf["ttl_remaining"] > 3000
    assert "old" in p
    p.put("old", b"new")  # replacing a key on disk drops the disk copy
    assert p.get("old") == b"new" and p.info("old")["tier"] == "memory"
    assert p.stats()["disk"]["evictions"] == 1
    assert p.delete("k0") and "k0" not in p and p.get("k0") is None
    assert not p.delete("k0")
    # The promoted entry kept its priority and absolute expiry.
    assert p.info("k1")["tier"] == "disk"
    exp = p.info("k1")["expires"]
    p.get("k1")
    assert p.info("k1")["tier"] == "memory" and p.info("k1")["expires"] == exp


def test_expired_entries_are_never_returned_from_disk(make_pool, tier_dir):
    now = [1000.0]
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M", clock=lambda: now[0])
    p.put("short", b"s" * VAL, ttl=10)
    _fill(p, 20)
    assert p.info("short")["tier"] == "disk"
    now[0] += 11
    assert p.get("short") is None and "short" not in p
    assert p.evict(expired=True, tier="disk") == (0, 0)  # already dropped by the lookup


def test_restart_finds_the_disk_entries_and_not_the_deleted_ones(tier_dir, pool_name):
    code = f"""
        from cortex_cache import Pool
        from tests.helpers import make_value
        p = Pool.create({pool_name!r}, {MEM!r}, disk_path={str(tier_dir)!r}, disk_size="16M")
        for i in range(40):
            p.put(f"k{{i}}", make_value(i, 0, {VAL}))
        p.put("k30", make_value(30, 1, {VAL}))   # replaced while on disk? no: in memory; see below
        p.delete("k3")                          # on disk: its record is killed
        p.evict(all=True)                        # a planned restart: everything to disk first
        p.put("k5", make_value(5, 2, {VAL}))     # replaces a disk entry
        p.evict(all=True)
        p.close()
        Pool.unlink({pool_name!r})
    """
    run_py(code)
    assert not Pool.exists(pool_name)
    p = Pool.create(pool_name, MEM, disk_path=tier_dir)  # same path, size taken from the tier
    try:
        d = p.stats()["disk"]
        assert d["entries"] == 39 and d["capacity_bytes"] == 16 << 20
        assert p.get("k3") is None
        assert check_value(p.get("k5")) == (5, 2)
        assert check_value(p.get("k30")) == (30, 1)
        for i in set(range(40)) - {3, 5, 30}:
            assert check_value(p.get(f"k{i}")) == (i, 0)
        assert p.verify()["ok"]
    finally:
        p.close()
        Pool.unlink(pool_name)
        DiskLog.destroy(tier_dir)


def test_write_through_puts_reach_disk_at_once(make_pool, tier_dir, pool_name):
    p = make_pool(MEM, name=pool_name, disk_path=tier_dir, disk_size="16M", disk_write="through")
    _fill(p, 10)
    d = p.stats()["disk"]
    assert d["write"] == "through" and d["entries"] == 10 and d["spills"] == 10
    _fill(p, 30)  # k0..k9 written again, 20 new: memory evicts, nothing needs writing then
    assert p.stats()["disk"]["spills"] == 40
    for i in range(30):
        assert check_value(p.get(f"k{i}")) == (i, 0)
    assert p.stats()["disk"]["entries"] == 30  # inclusive: a promotion keeps the record
    # A crash that loses memory loses nothing that was put.
    p.close()
    Pool.unlink(pool_name)
    q = Pool.create(pool_name, MEM, disk_path=tier_dir, disk_write="through")
    try:
        assert all(check_value(q.get(f"k{i}")) == (i, 0) for i in range(30))
    finally:
        q.close()
        Pool.unlink(pool_name)


def test_the_tier_is_bounded_and_forgets_the_oldest(make_pool, tier_dir):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="2M")  # 16 files of 128 KiB: 2 records each
    _fill(p, 200)
    d = p.stats()["disk"]
    assert d["dropped"] > 0 and d["entries"] <= 32
    assert sum(f.stat().st_size for f in tier_dir.glob("tier-*.log")) == 2 << 20
    got = 0
    for i in range(200):
        v = p.get(f"k{i}")
        if v is not None:
            assert check_value(v) == (i, 0)  # whatever comes back is right
            got += 1
    assert got >= 16 + 16  # memory plus most of the newest files
    assert check_value(p.get("k199")) == (199, 0)
    assert p.verify()["ok"]


def test_a_full_disk_index_drops_its_oldest_entries(make_pool, tier_dir):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="64M", disk_max_entries=20)
    _fill(p, 100)
    d = p.stats()["disk"]
    assert d["max_entries"] == 20 and 0 < d["entries"] <= 20 and d["dropped"] > 0
    assert check_value(p.get("k83")) == (83, 0)  # the newest spills are the ones kept
    assert p.get("k0") is None
    assert p.verify()["ok"]


def _damage(tier_dir: Path, pool: Pool, key: str) -> None:
    inf = pool.info(key)
    path = tier_dir / f"tier-{inf['disk_file']:02d}.log"
    with open(path, "r+b") as f:
        f.seek(inf["disk_offset"] + 64 + len(key) + 1000)
        f.write(b"\xff\x00\xff")


def test_a_damaged_record_is_a_counted_miss_and_verify_reports_it(make_pool, tier_dir):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M")
    _fill(p, 20)
    _damage(tier_dir, p, "k0")
    _damage(tier_dir, p, "k1")
    rep = p.verify()
    assert not rep["ok"] and rep["disk_checked"] == 4 and sum("checksums" in x for x in rep["problems"]) == 2
    assert p.get("k0") is None  # never garbage
    d = p.stats()["disk"]
    assert d["corrupt"] == 1 and d["misses"] == 1 and "k0" not in p
    rep = p.verify(repair=True)
    assert rep["repaired"] and p.stats()["disk"]["corrupt"] == 2 and "k1" not in p
    assert p.verify()["ok"]
    assert check_value(p.get("k2")) == (2, 0)


def test_the_disk_index_is_repaired_after_a_kill_inside_the_lock(make_pool, tier_dir):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M")
    _fill(p, 30)
    child = spawn_py(f"""
        import sys
        from cortex_cache import Pool
        from cortex_cache.layout import H_DIRTY, H_DFREE_SLOT, H_DISK_ENTRIES
        p = Pool.open({p.name!r})
        p.core.lock.acquire()
        p.core.fields.dirty[0] = 1
        t = p.tiers.named("disk").index
        t.buckets[:] = -1          # half-done changes: chains gone, counters wrong
        p.core.signed_counters[H_DFREE_SLOT] = 3
        p.core.counters[H_DISK_ENTRIES] = 999
        print("locked", flush=True)
        sys.stdin.read()
    """)
    assert child.stdout.readline().strip() == b"locked"
    _kill(child)
    p.core.lock_timeout = 5.0
    assert check_value(p.get("k0")) == (0, 0)  # found on disk again after the repair
    assert p.stats()["repairs"] == 1
    assert all(check_value(p.get(f"k{i}")) == (i, 0) for i in range(30))
    assert p.verify()["ok"]


SPILLER = """
import os, signal, sys
from cortex_cache import Pool
from cortex_cache import disklog
from tests.helpers import make_value
name, kill_at = sys.argv[1], int(sys.argv[2])
real = disklog.DiskLog.write
count = [0]
def write(self, file, off, seq, key, value, *a, **kw):
    count[0] += 1
    if count[0] == kill_at:
        # Die half-way through a record: its header is on disk, half its value is not.
        loc = real(self, file, off, seq, key, value, *a, **kw)
        n = memoryview(value).nbytes // 2
        os.pwrite(self._fds[file][0], bytes(n), off + 64 + len(key) + n)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, file, off, seq, key, value, *a, **kw)
disklog.DiskLog.write = write
p = Pool.open(name)
for i in range(100, 200):
    p.put(f"k{i}", make_value(i, 0, 60000))
"""


@pytest.mark.parametrize("kill_at", [1, 7])
def test_sigkill_mid_spill_leaves_the_tier_consistent(make_pool, tier_dir, pool_name, kill_at):
    p = make_pool(MEM, name=pool_name, disk_path=tier_dir, disk_size="16M")
    _fill(p, 20)
    proc = run_py(SPILLER, p.name, str(kill_at), check=False)
    assert proc.returncode == -signal.SIGKILL
    p.core.lock_timeout = 5.0
    assert p.verify(repair=True)["entries"] > 0
    assert p.verify()["ok"]
    seen = 0
    for i in list(range(20)) + list(range(100, 200)):
        v = p.get(f"k{i}")
        if v is not None:
            assert check_value(v) == (i, 0)
            seen += 1
    assert seen >= 20
    # And a restart finds only whole records (the torn one fails its checksum).
    tier = p.disk_path
    p.close()
    Pool.unlink(pool_name)
    q = Pool.create(pool_name, MEM, disk_path=tier)
    try:
        for k in q.keys(tier="disk"):
            check_value(q.get(k))
        assert q.verify()["ok"]
    finally:
        q.close()
        Pool.unlink(pool_name)


# ---------------------------------------------------------------- spills are written outside the lock

HELD_SPILLER = """
import sys
from cortex_cache import Pool
from cortex_cache import disklog
from tests.helpers import make_value
name, hold = sys.argv[1], sys.argv[2]  # hold: "before" or "after" the record is written
real = disklog.DiskLog.write
def write(self, file, off, seq, key, value, *a, **kw):
    if hold == "before":
        print(key.decode(), flush=True)
        sys.stdin.readline()  # held here, outside the pool lock, until the test says go
    loc = real(self, file, off, seq, key, value, *a, **kw)
    if hold == "after":
        print(key.decode(), flush=True)
        sys.stdin.readline()
    return loc
disklog.DiskLog.write = write
p = Pool.open(name)
p.put("newcomer", make_value(999, 0, 60000))  # evicts (and spills) one entry
p.close()
print("done", flush=True)
"""


def _held_spiller(p: Pool, hold: str):
    proc = spawn_py(HELD_SPILLER, p.name, hold)
    victim = proc.stdout.readline().decode().strip()
    assert victim.startswith("k"), proc.stderr.read().decode()[-2000:]
    return proc, victim


def _go(proc) -> None:
    proc.stdin.write(b"go\n")
    proc.stdin.flush()


def test_a_spill_is_written_outside_the_lock_and_readers_wait_for_it(make_pool, tier_dir, monkeypatch):
    import cortex_cache.tiers as tiers_mod

    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M")
    _fill(p, 16)  # memory is full; the next put evicts the least recently used entry
    proc, victim = _held_spiller(p, "before")
    try:
        p.core.lock_timeout = 1.0  # the spiller is inside its disk write: the lock must be free
        other = next(f"k{i}" for i in range(16) if f"k{i}" != victim)
        assert check_value(p.get(other))[0] == int(other[1:])
        assert victim in p and p.verify()["ok"]  # a spill in flight is a consistent state
        paused = []

        def pause(seconds: float) -> None:  # the reader found the spill in flight: let it finish now
            if not paused:
                _go(proc)
            paused.append(seconds)

        monkeypatch.setattr(tiers_mod, "spill_pause", pause)
        monkeypatch.setattr(tiers_mod, "SPILL_WAIT", 120.0)
        assert check_value(p.get(victim)) == (int(victim[1:]), 0)  # waited, then promoted from disk
        assert paused, "the get never met the spill in flight"
        assert proc.stdout.readline() == b"done\n" and proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            _kill(proc)
    st = p.stats()["disk"]
    assert st["spills"] == 2 and st["hits"] == 1 and st["misses"] == 0  # the promotion spilled another
    assert p.verify()["ok"]


@pytest.mark.parametrize("how", ["delete", "evict-disk-all"])
def test_a_key_removed_while_its_spill_is_written_stays_removed_after_a_restart(make_pool, tier_dir, pool_name,
                                                                               how):
    p = make_pool(MEM, name=pool_name, disk_path=tier_dir, disk_size="16M")
    _fill(p, 16)
    proc, victim = _held_spiller(p, "before")
    try:
        assert p.info(victim)["spilling"] is True
        if how == "delete":
            assert p.delete(victim) is True  # the spill in flight is the key's only copy: gone now
        else:
            assert p.evict(all=True, tier="disk") == (1, VAL)  # an emptied tier takes spills in flight too
        _go(proc)
        assert proc.stdout.readline() == b"done\n" and proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            _kill(proc)
    assert p.get(victim) is None and victim not in p
    st = p.stats()["disk"]
    assert st["spills"] == 0 and st["entries"] == 0 and p.verify()["ok"]
    p.close()
    Pool.unlink(pool_name)
    q = Pool.create(pool_name, MEM, disk_path=tier_dir)  # the restart scan reads every record
    try:
        assert q.get(victim) is None and q.stats()["disk"]["entries"] == 0
    finally:
        q.close()
        Pool.unlink(pool_name)


def test_a_spiller_killed_before_confirming_leaves_a_miss_never_a_resurrection(make_pool, tier_dir, pool_name,
                                                                             monkeypatch):
    import cortex_cache.tiers as tiers_mod

    p = make_pool(MEM, name=pool_name, disk_path=tier_dir, disk_size="16M")
    _fill(p, 20)  # 4 spills confirmed
    proc, victim = _held_spiller(p, "after")  # its record is on disk, not confirmed
    _kill(proc)
    rep = p.verify()
    assert not rep["ok"] and any("unfinished spill" in x for x in rep["problems"])

    def pause(seconds: float) -> None:
        raise AssertionError("waited for a spill whose writer is dead")

    monkeypatch.setattr(tiers_mod, "spill_pause", pause)
    assert p.get(victim) is None  # a miss at once, no error; the orphan is dropped on the way
    assert p.stats()["disk"]["entries"] == 4 and p.verify()["ok"]
    p.put(victim, make_value(int(victim[1:]), 1, VAL))
    assert check_value(p.get(victim)) == (int(victim[1:]), 1)
    p.close()
    Pool.unlink(pool_name)
    q = Pool.create(pool_name, MEM, disk_path=tier_dir)
    try:
        found = sorted(q.keys(tier="disk"))
        # The 4 confirmed spills and the one the put above caused; never the unconfirmed record.
        assert len(found) == 5 and victim not in found
        for k in found:
            assert check_value(q.get(k))[0] == int(k[1:])
    finally:
        q.close()
        Pool.unlink(pool_name)


def test_a_big_eviction_writes_in_place_beyond_what_it_may_copy_aside(make_pool, tier_dir, monkeypatch):
    import cortex_cache.disktier as disktier_mod

    monkeypatch.setattr(disktier_mod, "SPILL_ASIDE", 3 * VAL)  # 3 copies aside, the rest written in place
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M")
    _fill(p, 16)
    assert p.evict(all=True) == (16, 16 * VAL)
    st = p.stats()
    assert st["entries"] == 0 and st["disk"]["entries"] == 16 and st["disk"]["spills"] == 16
    for i in range(16):
        assert check_value(p.get(f"k{i}")) == (i, 0)
    assert p.verify()["ok"]


WORKER = """
import sys
from cortex_cache import Pool
from tests.helpers import check_value, make_value
name, wid, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
p = Pool.open(name)
import random
rng = random.Random(wid)
bad = 0
for r in range(rounds):
    i = wid * 1000 + rng.randrange(40)
    if rng.random() < 0.5:
        p.put(f"k{i}", make_value(i, 0, rng.choice([3000, 60000, 300000])))
    else:
        v = p.get(f"k{i}")
        if v is not None and check_value(v)[0] != i:
            bad += 1
    j = rng.randrange(4) * 1000 + rng.randrange(40)   # others' keys too
    v = p.get(f"k{j}")
    if v is not None and check_value(v)[0] != j:
        bad += 1
print(bad)
"""


def test_concurrent_spills_and_promotions_lose_and_tear_nothing(make_pool, tier_dir):
    p = make_pool("2M", disk_path=tier_dir, disk_size="256M")
    for w in range(4):
        for k in range(40):
            p.put(f"k{w * 1000 + k}", make_value(w * 1000 + k, 0, 3000))
    procs = [spawn_py(WORKER, p.name, str(w), "400") for w in range(4)]
    for pr in procs:
        out, err = pr.communicate(timeout=120)
        assert pr.returncode == 0, err.decode()
        assert out.strip() == b"0"
    st = p.stats()
    assert st["disk"]["spills"] > 50 and st["disk"]["promotions"] > 50
    assert st["disk"]["corrupt"] == 0 and st["disk"]["dropped"] == 0
    assert p.verify()["ok"]
    # Nothing lost: every key is still in one of the tiers, whole.
    for w in range(4):
        for k in range(40):
            assert check_value(p.get(f"k{w * 1000 + k}"))[0] == w * 1000 + k
    assert len(p.keys(tier="all")) == p.stats()["entries"] + p.stats()["disk"]["entries"]


def test_evict_can_target_the_disk_tier(make_pool, tier_dir):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M")
    _fill(p, 40)
    assert p.evict(keys=["k0", "k39"], tier="disk") == (1, VAL)  # k39 is in memory
    assert p.evict(prefix="k1", tier="disk") == (11, 11 * VAL)  # k1 and k10..k19, all on disk
    n_disk = p.stats()["disk"]["entries"]
    c, b = p.evict(percent=50, tier="disk")
    assert c == (n_disk + 1) // 2 and b == c * VAL
    assert p.evict(all=True, tier="disk")[0] == n_disk - c
    assert p.stats()["disk"]["entries"] == 0 and len(p) == 16
    assert p.evict(all=True, tier="all") == (16, 16 * VAL)  # nothing spilled
    assert p.stats()["disk"]["entries"] == 0 and len(p) == 0
    with pytest.raises(UsageError):
        p.evict(all=True, tier="tape")


def test_o_direct_tier_round_trips(make_pool, tier_dir):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M", disk_o_direct=True)
    _fill(p, 30)
    for i in range(30):
        assert check_value(p.get(f"k{i}")) == (i, 0)
    assert p.delete("k3") is True
    assert p.verify()["ok"]


def test_bad_tier_settings_are_clean_errors_that_change_nothing(tmp_path, pool_name, monkeypatch):
    with pytest.raises(UsageError):
        Pool.create(pool_name, MEM, disk_size="16M")  # disk options without a tier
    with pytest.raises(UsageError):
        Pool.create(pool_name, MEM, tier="tape")
    with pytest.raises(UsageError):
        Pool.create(pool_name, MEM, disk_path=tmp_path / "t", disk_write="sideways")
    with pytest.raises(NoSpace):
        Pool.create(pool_name, MEM, disk_path=tmp_path / "t", disk_size="1000T")
    assert not Pool.exists(pool_name) and not (tmp_path / "t").exists()
    # The segment cannot be made (a pool of that name exists): the new tier goes again.
    other = Pool.create(pool_name, MEM)
    try:
        with pytest.raises(Exception):
            Pool.create(pool_name, MEM, disk_path=tmp_path / "t2")
        assert not (tmp_path / "t2").exists()
    finally:
        other.close()
        Pool.unlink(pool_name)


def test_a_tier_belongs_to_one_pool(make_pool, tier_dir, pool_name):
    make_pool(MEM, name=pool_name, disk_path=tier_dir, disk_size="16M")
    with pytest.raises(CannotCreate):
        Pool.create(pool_name + "b", MEM, disk_path=tier_dir)
    assert not Pool.exists(pool_name + "b")
    with pytest.raises(UsageError):  # another size than the tier has
        Pool.create(pool_name + "b", MEM, disk_path=tier_dir, disk_size="32M")


def test_a_missing_tier_directory_leaves_memory_working(make_pool, tier_dir, pool_name):
    p = make_pool(MEM, name=pool_name, disk_path=tier_dir, disk_size="16M")
    _fill(p, 20)
    DiskLog.destroy(tier_dir)
    q = Pool.open(pool_name)
    try:
        d = q.stats()["disk"]
        assert d["available"] is False and "no disk tier" in d["error"]
        q.put("x", b"y")
        assert q.get("x") == b"y" and q.get("k0") is None
        assert not q.verify()["ok"]
    finally:
        q.close()


def test_a_value_larger_than_a_tier_file_is_not_spilled(make_pool, tier_dir):
    p = make_pool("4M", disk_path=tier_dir, disk_size="2M")  # files of 128 KiB
    p.put("huge", np.zeros(1 << 20, dtype=np.uint8))
    _fill(p, 80)
    assert p.get("huge") is None and p.stats()["disk"]["dropped"] >= 1


# ---------------------------------------------------------------- CLI


def test_cli_create_status_keys_evict_delete_with_a_tier(tmp_path, pool_name):
    env = {"CORTEX_CACHE_SNAPSHOT_DIR": str(tmp_path / "state" / "snapshots")}
    r = cli("cache", "create", pool_name, "--size", "1M", "--tier", "disk", "--disk-size", "16M", env=env)
    assert r.returncode == 0, r.stderr
    default_dir = tmp_path / "state" / "disk" / (os.environ["CORTEX_CACHE_SHM_PREFIX"] + pool_name)  # namespaced
    assert b"disk tier: 16.0MiB in " + str(default_dir).encode() in r.stdout
    assert (default_dir / "cortex-tier.meta").stat().st_mode & 0o777 == 0o600
    assert default_dir.stat().st_mode & 0o777 == 0o700
    for i in range(20):
        assert cli("cache", "put", pool_name, f"k{i}", "-", input=make_value(i, 0, VAL), env=env).returncode == 0
    st = json.loads(cli("cache", "status", pool_name, "--json", env=env).stdout)
    assert st["disk"]["entries"] == 4 and st["disk"]["path"] == str(default_dir)
    table = cli("cache", "status", pool_name, env=env).stdout.decode()
    assert "disk tier" in table and "disk hits / misses" in table
    prom = cli("cache", "status", pool_name, "--format", "prometheus", env=env).stdout.decode()
    assert f'cortex_cache_disk_entries{{pool="{pool_name}"}} 4' in prom
    assert cli("cache", "keys", pool_name, "--tier", "disk", env=env).stdout.split() == [b"k0", b"k1", b"k2", b"k3"]
    got = cli("cache", "get", pool_name, "k0", env=env)
    assert got.returncode == 0 and check_value(got.stdout) == (0, 0)
    r = cli("cache", "evict", pool_name, "--tier", "disk", "--all", "--json", env=env)
    assert json.loads(r.stdout)["entries"] == 4
    r = cli("cache", "verify", pool_name, env=env)
    assert r.returncode == 0 and b"disk records verified" in r.stdout
    # delete keeps the tier, and says so; --force removes it.
    r = cli("cache", "delete", pool_name, env=env)
    assert r.returncode == 0 and b"kept disk tier" in r.stdout and default_dir.exists()
    assert cli("cache", "create", pool_name, "--size", "1M", "--tier", "disk", env=env).returncode == 0
    r = cli("cache", "delete", pool_name, "--force", env=env)
    assert r.returncode == 0 and not default_dir.exists()


def test_cli_tier_errors(tmp_path, pool_name):
    env = {"CORTEX_CACHE_SNAPSHOT_DIR": str(tmp_path / "s")}
    r = cli("cache", "create", pool_name, "--size", "1M", "--tier", "tape", env=env)
    assert r.returncode == 2 and b"tape" in r.stderr
    r = cli("cache", "create", pool_name, "--size", "1M", "--disk-write", "through", env=env)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    r = cli("cache", "create", pool_name, "--size", "1M", "--tier", "disk", "--disk-size", "500T", env=env)
    assert r.returncode == 73 and len(r.stderr.splitlines()) == 1 and b"Traceback" not in r.stderr
    r = cli("cache", "create", pool_name, "--size", "1M", "--disk-path", "/proc/cortex-nope", env=env)
    assert r.returncode in (74, 77) and len(r.stderr.splitlines()) == 1
    assert not Pool.exists(pool_name) and not (tmp_path / "disk").exists()
    assert cli("cache", "create", pool_name, "--size", "1M", env=env).returncode == 0
    try:
        r = cli("cache", "evict", pool_name, "--tier", "disk", "--all", env=env)
        assert r.returncode == 2 and b"no disk tier" in r.stderr
        r = cli("cache", "keys", pool_name, "--tier", "disk", env=env)
        assert r.returncode == 2 and b"no disk tier" in r.stderr
    finally:
        assert cli("cache", "delete", pool_name, env=env).returncode == 0


def test_restore_replace_empties_both_tiers(make_pool, tier_dir, tmp_path):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M")
    p.put("snap", b"from the snapshot")
    path = p.persist(tmp_path / "p.ccsnap")
    _fill(p, 30)
    assert p.stats()["disk"]["entries"] > 0
    q = Pool.restore(path, name=p.name, replace=True)
    try:
        assert q.get("snap") == b"from the snapshot"
        assert q.stats()["disk"]["entries"] == 0 and q.get("k0") is None
    finally:
        q.close()


def test_a_tier_left_by_unlink_is_named_and_removed_by_delete_force_disk_path(make_pool, tmp_path, pool_name):
    tier = tmp_path / "tier"
    p = make_pool("1M", name=f"{pool_name}-gone", block_size="4K", disk_path=tier, disk_size="1M")
    p.put("k", b"v")
    name = p.name
    p.close()
    assert Pool.unlink(name) == str(tier)  # says what it leaves
    assert DiskLog.exists(tier)
    r = cli("cache", "delete", name, "--disk-path", str(tier))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and DiskLog.exists(tier)
    r = cli("cache", "delete", name, "--force", "--disk-path", str(tmp_path / "nothing"))
    assert r.returncode == 66 and len(r.stderr.splitlines()) == 1
    live = make_pool("1M", name=f"{pool_name}-live", block_size="4K", disk_path=tmp_path / "live", disk_size="1M")
    r = cli("cache", "delete", name, "--force", "--disk-path", str(tmp_path / "live"))
    assert r.returncode == 75 and live.name.encode() in r.stderr and DiskLog.exists(tmp_path / "live")
    r = cli("cache", "delete", live.name, "--force", "--disk-path", str(tier))
    assert r.returncode == 2 and Pool.exists(live.name)  # a pool that exists goes with its own tier
    r = cli("cache", "delete", name, "--force", "--disk-path", str(tier))
    assert r.returncode == 0 and not DiskLog.exists(tier), r.stderr
    assert Pool.unlink(live.name) == str(tmp_path / "live")
    DiskLog.destroy(tmp_path / "live")


# ---------------------------------------------------------------- admission (issue 27 item 3)


@pytest.mark.parametrize("policy", ["lru", "auto"])
def test_admission_sends_below_only_entries_seen_twice(make_pool, tier_dir, policy):
    """tier_admit=2: an evicted entry goes to disk only if it was read since its put; one that came back
    from disk earned its place there and goes back when evicted again."""
    p = make_pool(MEM, disk_path=tier_dir, disk_size="16M", tier_admit=2, policy=policy)
    _fill(p, 16)
    for i in range(0, 16, 2):
        assert check_value(p.get(f"k{i}")) == (i, 0)  # the even keys are seen twice
    assert p.evict(all=True) == (16, 16 * VAL)
    st = p.stats()
    assert st["tier_admit"] == 2 and st["tier_refused"] == 8
    assert st["disk"]["spills"] == 8 and st["disk"]["entries"] == 8
    assert sorted(p.keys(tier="all")) == sorted(f"k{i}" for i in range(0, 16, 2))
    assert check_value(p.get("k0")) == (0, 0)  # promoted from disk
    assert p.evict(keys=["k0"]) == (1, VAL)
    assert "k0" in p.keys(tier="all") and p.stats()["tier_refused"] == 8
    assert p.configuration()["tier_admit"] == 2
    assert p.verify()["ok"]


def test_admission_is_stored_shown_and_checked_by_the_cli(pool_name, tier_dir):
    try:
        r = cli("cache", "create", pool_name, "--size", "1M", "--disk-path", str(tier_dir), "--disk-size", "4M",
                "--tier-admit", "2", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tier_admit"] == 2
        r = cli("cache", "status", pool_name)
        assert r.returncode == 0 and b"tier admission" in r.stdout
    finally:
        cli("cache", "delete", pool_name, "--force")
    for bad in (["--tier-admit", "3"], ["--tier-admit", "2", "--disk-write", "through", "--tier", "disk",
                                         "--disk-path", str(tier_dir)]):
        r = cli("cache", "create", pool_name, "--size", "1M", *bad)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr


def test_admission_survives_persist_and_restore(make_pool, snapshot_dir, restored, tier_dir):
    p = make_pool(MEM, disk_path=tier_dir, disk_size="4M", tier_admit=2)
    p.put("a", b"x")
    path = p.persist()
    name = p.name
    p.close()
    Pool.unlink(name)  # its disk tier stays, and the restored pool takes it over
    q = Pool.restore(path)
    restored.append(q)
    assert q.configuration()["tier_admit"] == 2 and q.get("a") == b"x"
