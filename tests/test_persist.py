"""Snapshots: atomic persist, verified restore, crash safety, rotation, fuzzed reader."""

from __future__ import annotations

import errno
import os
import random
import stat
import struct

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cortex_cache import (
    PersistBusy,
    Pool,
    PoolExists,
    PoolSuperseded,
    SnapshotCorrupt,
    SnapshotNotFound,
)
from cortex_cache import persist as snap
from tests.helpers import FUZZ_EXAMPLES, check_value, cli, make_value, memory_bound, run_py, spawn_py


@pytest.fixture(autouse=True)
def _own_snapshot_dir(snapshot_dir):
    """Every test here persists into a directory of its own (conftest's snapshot_dir)."""
    return snapshot_dir


def _fill(p: Pool, n: int = 40) -> dict:
    rng = random.Random(7)
    for i in range(n):
        p.put(f"k{i}", make_value(i, 1, rng.choice([20, 3000, 70_000, 300_000])), priority=i % 5,
              ttl=None if i % 3 else 10_000 + i)
    for i in range(0, n, 4):
        p.get(f"k{i}")
    return {k: (p.get(k), p.info(k)) for k in p.keys()}


def _same(p: Pool, expected: dict) -> None:
    assert set(p.keys()) == set(expected)
    for k, (value, info) in expected.items():
        got = p.info(k)  # before the get below changes last_access
        for field in ("size", "created", "last_access", "priority", "expires", "checksum"):
            assert got[field] == info[field], (k, field)
        assert p.get(k) == value


def test_round_trip_across_processes_is_bit_exact_with_metadata(make_pool, snapshot_dir, restored):
    p = make_pool("8M", block_size="4K", policy="priority")
    # Another process writes the snapshot of the pool we filled.
    expected = _fill(p)
    out = run_py(f"""
        from cortex_cache import Pool, persist
        with Pool.open({p.name!r}) as q:
            r = persist.persist(q)
        print(r.path, r.entries, r.bytes)
    """)
    path, entries, nbytes = out.stdout.decode().split()
    assert int(entries) == len(expected) and int(nbytes) == sum(len(v) for v, _ in expected.values())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    name = p.name
    stats_before = p.stats()
    p.close()
    Pool.unlink(name)
    q = Pool.restore(name=name)  # the stable latest name
    restored.append(q)
    _same(q, expected)
    st_after = q.stats()
    assert st_after["policy"] == "priority" and st_after["size_bytes"] == stats_before["size_bytes"]
    assert st_after["block_size"] == 4096 and st_after["mode"] == "0600"
    assert st_after["hits"] >= stats_before["hits"]  # counters carried over
    assert q.verify()["ok"]


def test_restore_refuses_an_existing_pool_unless_replace(make_pool, restored):
    p = make_pool("4M", block_size="4K")
    p.put("a", b"1")
    path = p.persist()
    p.put("b", b"2")
    with pytest.raises(PoolExists):
        Pool.restore(path)
    assert set(p.keys()) == {"a", "b"}
    q = Pool.restore(path, replace=True)
    restored.append(q)
    assert set(q.keys()) == {"a"} and q.get("a") == b"1"
    # Swapped in whole: a handle on the old pool is told so (never served the old copy as the pool) ...
    with pytest.raises(PoolSuperseded):
        p.keys()
    with Pool.open(p.name) as again:  # ... and whoever opens the name now gets the new one.
        assert set(again.keys()) == {"a"}


def test_restore_under_another_name_and_ttl_stays_absolute(make_pool, restored, pool_name, tmp_path):
    class Clock:
        t = 1_000_000.0

        def __call__(self):
            return self.t

    clock = Clock()
    p = make_pool("4M", block_size="4K", clock=clock)
    p.put("short", b"s", ttl=10)
    p.put("long", b"l", ttl=1000)
    p.put("forever", b"f")
    path = snap.persist(p, tmp_path / "x.ccsnap").path
    clock.t += 100  # "short" expires between persist and restore
    q, report = snap.restore(path, name=pool_name + "copy", clock=clock)
    restored.append(q)
    assert report["entries"] == 2 and report["expired_skipped"] == 1
    assert set(q.keys()) == {"long", "forever"}
    assert q.info("long")["expires"] == p.info("long")["expires"]


def test_an_entry_that_expires_during_the_restore_is_not_a_restore_that_did_not_fit(
        make_pool, restored, pool_name, tmp_path):
    class Clock:
        t = 1_000_000.0

        def __call__(self):
            return self.t

    clock = Clock()
    p = make_pool("4M", block_size="4K", clock=clock)
    p.put("brief", b"b", ttl=5)
    for i in range(20):
        p.put(f"k{i}", bytes([i]) * 100)
    path = snap.persist(p, tmp_path / "x.ccsnap").path

    def later(done: int, total: int) -> None:  # time passes while the restore runs: "brief" runs out
        clock.t += 100

    q, report = snap.restore(path, name=pool_name + "copy", clock=clock, progress=later)
    restored.append(q)
    assert {f"k{i}" for i in range(20)} == set(q.keys())
    assert report["entries"] == 20


def test_keep_rotates_and_the_latest_name_follows(make_pool, snapshot_dir):
    p = make_pool("1M", block_size="4K")
    paths = []
    for i in range(5):
        p.put("gen", str(i).encode())
        paths.append(snap.persist(p, keep=2).path)
    family = snap.snapshots_of(p.name)
    assert family == paths[-2:]
    latest = snap.latest_path(p.name)
    assert os.path.samefile(latest, paths[-1])
    with snap.Snapshot(latest) as s:
        assert [bytes(r.value) for r in s.records()] == [b"4"]
    for f in snapshot_dir.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(snapshot_dir.stat().st_mode) == 0o700


def test_second_persist_of_the_same_pool_is_refused_at_once(make_pool):
    p = make_pool("4M", block_size="4K")
    for i in range(4):
        p.put(f"k{i}", bytes(300_000))
    child = spawn_py(f"""
        import sys
        from cortex_cache import Pool, persist
        def hold(done, total):
            print("writing", flush=True)
            sys.stdin.readline()
        with Pool.open({p.name!r}) as q:
            persist.persist(q, progress=hold)
    """)
    try:
        assert child.stdout.readline().strip() == b"writing"
        with pytest.raises(PersistBusy):
            snap.persist(p)
        r = cli("cache", "persist", p.name)
        assert r.returncode == 75 and b"already running" in r.stderr
    finally:
        child.kill()
        child.wait()
        for f in (child.stdin, child.stdout, child.stderr):
            f.close()
    snap.persist(p)  # the dead persist's lock went with it


KILLED_PERSIST = """
import sys
from cortex_cache import Pool, persist
def report(done, total):
    print(done, flush=True)
with Pool.open(sys.argv[1]) as q:
    persist.persist(q, progress=report)
print("done", flush=True)
"""


@pytest.mark.parametrize("kill_after", [0, 1, 3, 7, 15, 30])
def test_sigkill_during_persist_keeps_the_previous_snapshot(make_pool, snapshot_dir, restored, kill_after):
    p = make_pool("16M", block_size="4K")
    for i in range(10):
        p.put(f"old{i}", make_value(i, 0, 1000))
    first = snap.persist(p).path
    for i in range(40):
        p.put(f"new{i}", make_value(100 + i, 0, 200_000))
    child = spawn_py(KILLED_PERSIST, p.name)
    for _ in range(kill_after):
        if child.stdout.readline() in (b"", b"done\n"):
            break
    child.kill()
    child.wait()
    for f in (child.stdin, child.stdout, child.stderr):
        f.close()
    # Whatever the kill point, the latest name is a whole snapshot: the old
    # one, or (if the child finished first) the new one.
    latest = snap.latest_path(p.name)
    with snap.Snapshot(latest) as s:
        keys = {r.key for r in s.records()}
    assert keys == {f"old{i}".encode() for i in range(10)} or len(keys) == 50
    assert os.path.exists(first)
    # The next persist cleans whatever temp file the killed one left.
    snap.persist(p)
    assert not [f for f in os.listdir(snapshot_dir) if ".tmp-" in f]
    name = p.name
    p.close()
    Pool.unlink(name)
    q = Pool.restore(first, name=name)
    restored.append(q)
    for k in q.keys():
        check_value(q.get(k))
    assert len(q) == 10


def test_disk_full_is_a_clean_error_and_keeps_the_old_snapshot(make_pool, snapshot_dir, monkeypatch):
    p = make_pool("4M", block_size="4K")
    p.put("k", b"old")
    old = snap.persist(p).path
    p.put("k", os.urandom(1_000_000))
    real_fsync = os.fsync

    def enospc(fd):  # the one fault we cannot make for real: a full disk
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", enospc)
        with pytest.raises(snap.StorageIOError) as info:
            snap.persist(p)
    assert info.value.exit_code == 74
    assert os.path.samefile(snap.latest_path(p.name), old)
    assert not [f for f in os.listdir(snapshot_dir) if ".tmp-" in f]
    with snap.Snapshot(old) as s:
        assert [bytes(r.value) for r in s.records()] == [b"old"]


def test_unwritable_directory_is_permission_denied(make_pool, tmp_path, monkeypatch):
    p = make_pool("1M", block_size="4K")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_open = os.open

    def eacces(path, flags, *a, **kw):  # as root, only injection gives EACCES
        if str(path).startswith(str(locked)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "open", eacces)
        with pytest.raises(snap.PermissionDenied) as info:
            snap.persist(p, locked / "x.ccsnap")
    assert info.value.exit_code == 77
    assert list(locked.iterdir()) == []


def test_missing_and_foreign_snapshots(tmp_path, pool_name):
    with pytest.raises(SnapshotNotFound):
        Pool.restore(tmp_path / "nope.ccsnap")
    foreign = tmp_path / "foreign.ccsnap"
    foreign.write_bytes(b"PK\x03\x04" + os.urandom(5000))
    with pytest.raises(SnapshotCorrupt):
        Pool.restore(foreign)
    r = cli("cache", "restore", pool_name, "--input", str(foreign))
    assert r.returncode == 65 and len(r.stderr.splitlines()) == 1
    assert not Pool.exists(pool_name)
    r = cli("cache", "restore", pool_name)
    assert r.returncode == 66


def test_newer_version_is_refused(make_pool, tmp_path, pool_name):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"v")
    path = snap.persist(p, tmp_path / "s.ccsnap").path
    data = bytearray(path.read_bytes())
    newer = max(snap.READS) + 1
    struct.pack_into("<I", data, 8, newer)
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=f"version {newer}"):
        Pool.restore(path, name=pool_name)
    assert not Pool.exists(pool_name)


def test_persist_of_a_live_pool_gets_whole_entries(make_pool, restored, pool_name, tmp_path):
    p = make_pool("16M", block_size="4K")
    for i in range(30):
        p.put(f"k{i}", make_value(i, 0, 100_000))
    writer = spawn_py("""
        import sys, random
        from cortex_cache import Pool
        from tests.helpers import make_value
        rng = random.Random(1)
        with Pool.open(sys.argv[1]) as q:
            print("go", flush=True)
            for op in range(3000):
                i = rng.randrange(30)
                if rng.random() < 0.8:
                    q.put(f"k{i}", make_value(i, op + 1, rng.choice([100, 100_000, 290_000])))
                else:
                    q.delete(f"k{i}")
    """, p.name)
    assert writer.stdout.readline().strip() == b"go"
    paths = [snap.persist(p, tmp_path / f"live{i}.ccsnap").path for i in range(5)]
    writer.communicate(timeout=120)
    assert writer.returncode == 0
    for i, path in enumerate(paths):
        q = Pool.restore(path, name=f"{pool_name}-r{i}")
        restored.append(q)
        for k in q.keys():
            kid, _ = check_value(q.get(k))
            assert k == f"k{kid}"


# ---------------------------------------------------------------- the reader against damaged files


@pytest.fixture(scope="module")
def sample_snapshot(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    name = "fuzz-src"
    p = Pool.create(name, "1M", block_size="4K")
    try:
        for i in range(6):
            p.put(f"key{i}", make_value(i, 0, [20, 300, 5000][i % 3]), ttl=1e6 if i % 2 else None)
        path = snap.persist(p, d / "s.ccsnap").path
    finally:
        p.close()
        Pool.unlink(name)
    return _Bytes(path.read_bytes())


class _Bytes(bytes):
    def __repr__(self) -> str:  # keep failure reports short
        return f"<snapshot of {len(self)} bytes>"


def _boundaries(data: bytes) -> list[int]:
    cuts = {0, 8, 12, 16, 312, 320, len(data) - 32, len(data) - 24, len(data) - 8, len(data) - 1}
    pos = 320
    while pos < len(data) - 32:
        klen, vlen = struct.unpack_from("<I", data, pos + 4)[0], struct.unpack_from("<Q", data, pos + 16)[0]
        cuts.update({pos, pos + 4, pos + 96, pos + 104, pos + 104 + klen})
        pos += 104 + klen + vlen
    return sorted(c for c in cuts if 0 <= c < len(data))


def test_truncation_at_every_section_boundary_is_refused(sample_snapshot, tmp_path):
    f = tmp_path / "t.ccsnap"
    for cut in _boundaries(sample_snapshot):
        f.write_bytes(sample_snapshot[:cut])
        with pytest.raises(SnapshotCorrupt):
            snap.Snapshot(f)
    f.write_bytes(sample_snapshot)
    with snap.Snapshot(f) as s:
        assert s.entries == 6


@settings(max_examples=3 * FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_damage_is_always_detected(sample_snapshot, tmp_path, data):
    damaged = bytearray(sample_snapshot)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(damaged) - 1))
        damaged[pos] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        damaged = damaged[: data.draw(st.integers(0, len(damaged)))]
    assume(bytes(damaged) != sample_snapshot)  # two flips of one byte can cancel out
    f = tmp_path / "d.ccsnap"
    f.write_bytes(bytes(damaged))
    with pytest.raises(SnapshotCorrupt), memory_bound():  # a damaged length never buys an allocation
        snap.Snapshot(f)


def test_a_directory_is_not_a_snapshot(tmp_path, pool_name):
    from cortex_cache import UsageError

    with pytest.raises(UsageError):
        Pool.restore(tmp_path, name=pool_name)
    assert not Pool.exists(pool_name)


def test_write_behind_windows_produce_the_same_snapshot(make_pool, tmp_path, monkeypatch, restored, pool_name):
    """Small write-behind windows (start writeback, wait, drop from cache) must not change a byte."""
    p = make_pool("16M", block_size="4K")
    for i in range(30):
        p.put(f"k{i}", make_value(i, 0, 290_000))
    plain = snap.persist(p, tmp_path / "plain.ccsnap").path
    monkeypatch.setattr(snap.WriteBehind, "WINDOW", 256 * 1024)
    windowed = snap.persist(p, tmp_path / "windowed.ccsnap").path
    a, b = plain.read_bytes(), windowed.read_bytes()
    # The same records and trailer counts; only the creation time (and so the
    # header and file checksums) may differ.
    assert len(a) == len(b) and a[320:-8] == b[320:-8]
    q = Pool.restore(windowed, name=pool_name)
    restored.append(q)
    assert len(q) == 30
    for k in q.keys():
        check_value(q.get(k))


@pytest.mark.parametrize("where", ["first-value", "last-value", "trailer-count"])
def test_restore_of_a_damaged_file_creates_nothing(make_pool, tmp_path, pool_name, where):
    """A fresh restore copies while it verifies: damage found late must leave no pool behind."""
    p = make_pool("4M", block_size="4K")
    for i in range(8):
        p.put(f"k{i}", make_value(i, 0, 50_000))
    path = snap.persist(p, tmp_path / "s.ccsnap").path
    data = bytearray(path.read_bytes())
    if where == "first-value":
        data[320 + 104 + 2 + 100] ^= 0x40  # inside k0's value
    elif where == "last-value":
        data[-32 - 10] ^= 0x01  # near the end of the last value
    else:
        struct.pack_into("<Q", data, len(data) - 24, 7)  # trailer claims 7 entries
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt):
        Pool.restore(path, name=pool_name)
    assert not Pool.exists(pool_name)
    assert not [n for n in Pool.list() if n.startswith("restoring-")]


def _status(name: str) -> tuple[dict, float]:
    """status --json of pool `name`, and its Prometheus last-snapshot gauge."""
    import json
    import re

    doc = json.loads(cli("cache", "status", name, "--json").stdout)
    prom = cli("cache", "status", name, "--format", "prometheus").stdout.decode()
    m = re.search(r'cortex_cache_last_snapshot_timestamp_seconds\{pool="%s"\} (\S+)' % re.escape(name), prom)
    assert m, prom
    return doc, float(m.group(1))


def test_status_after_restore_and_resize_names_the_snapshot_it_came_from_and_when_it_was_made(make_pool,
                                                                                               snapshot_dir, tmp_path):
    """Issue 40, item 8: text, --json and Prometheus agree on the pool's last snapshot, and a restore or a
    resize keeps when the pool was first created."""
    p = make_pool("4M")
    name = p.name
    born = p.stats()["created"] - 86_400.0  # a pool made a day ago
    p.core.header["created"] = born
    p.put("k", b"v")
    snap.persist(p)
    taken = snap.Snapshot(snap.latest_path(name), verify=False).header.created
    p.close()
    Pool.unlink(name)
    assert cli("cache", "restore", name, "--if-missing").returncode == 0
    doc, gauge = _status(name)
    assert doc["created"] == born and doc["last_snapshot"] == taken == gauge
    text = cli("cache", "status", name).stdout.decode()
    assert "never" not in text.split("last snapshot", 1)[1].splitlines()[0]
    assert cli("cache", "resize", name, "--size", "8M").returncode == 0
    doc, gauge = _status(name)
    assert doc["created"] == born and doc["last_snapshot"] == taken == gauge and doc["size_bytes"] == 8 << 20
    other = tmp_path / "o.ccsnap"
    with Pool.open(name) as q:
        q.put("k", b"newer")
        snap.persist(q, other)
    taken_o = snap.Snapshot(other, verify=False).header.created
    assert cli("cache", "restore", name, "-i", str(other), "--replace").returncode == 0
    doc, gauge = _status(name)
    assert doc["created"] == born and doc["last_snapshot"] == taken_o == gauge
    Pool.unlink(name)


def test_a_persist_keeps_little_writeback_in_flight_for_other_processes_reads_to_queue_behind(make_pool, tmp_path,
                                                                                              monkeypatch):
    """Issue 40, item 6: a second persist, a status or an open started during a long persist waited for its
    own reads (module imports) behind the persist's writeback -- 64 MiB windows handed to the disk at once.
    No more than 16 MiB are now started and not yet waited for at any time."""
    from cortex_cache import snapshot as snapshot_mod

    real = snapshot_mod._sync_file_range()
    if real is None:
        pytest.skip("no sync_file_range here: a plain buffered writer")
    flight: dict[int, int] = {}  # offset -> bytes started, not yet waited for
    worst = [0]

    def recording():
        def call(fd, offset, nbytes, flags):
            if flags == snapshot_mod.WriteBehind._START:
                flight[offset] = nbytes
            else:
                for off in [o for o in flight if offset <= o < offset + nbytes]:
                    del flight[off]
            worst[0] = max(worst[0], sum(flight.values()))
            return real(fd, offset, nbytes, flags)
        return call

    monkeypatch.setattr(snapshot_mod, "_sync_file_range", recording)
    p = make_pool("96M")
    for i in range(80):
        p.put(f"k{i}", make_value(i, 0, 1 << 20))
    snap.persist(p, tmp_path / "big.ccsnap")
    assert 0 < worst[0] <= 16 << 20, worst[0]
