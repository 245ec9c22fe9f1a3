"""Incremental snapshots (snapshot.py version 3, packs.py): a persist into the snapshot directory writes
only the values no kept snapshot holds; retention and compaction keep the packs the kept snapshots need;
every kept snapshot restores whole after a kill anywhere; a missing or damaged pack refuses its snapshot."""

from __future__ import annotations

import os
import random
import signal
import struct
from pathlib import Path

import numpy as np
import pytest

from cortex_cache import Pool, SnapshotCorrupt, UsageError
from cortex_cache import packs
from cortex_cache import persist as snap
from cortex_cache import snapplaces
from tests.helpers import cli, make_value, spawn_py


def _put_all(p: Pool, values: dict) -> None:
    for k, v in values.items():
        p.put(k, v)


def _values(n: int, round_: int, size: int = 20_000, start: int = 0) -> dict:
    return {f"k{i}": make_value(i, round_, size) for i in range(start, start + n)}


def _pool_files(p: Pool, d) -> tuple[list, list]:
    return snap.snapshots_of(p.name, d), packs.packs_of(snap.namespaced(p.name), d)


def _restores_to(path, want: dict, name: str, restored: list) -> None:
    q = Pool.restore(path, name=name)
    restored.append(q)
    got = {k: q.get(k) for k in q.keys()}
    assert got == want
    q.close()
    restored.remove(q)
    Pool.unlink(name)


def test_a_persist_writes_only_what_changed_and_each_snapshot_restores_its_own(make_pool, snapshot_dir, restored,
                                                                             pool_name):
    p = make_pool("16M", block_size="4K")
    values = _values(100, 0)
    _put_all(p, values)
    first = snap.persist(p)
    assert first.written == first.bytes == 100 * 20_000 and first.incremental
    before = dict(values)
    changed = _values(5, 1)  # 5% of the entries get new values, one is deleted, one is new
    values.update(changed)
    p.delete("k99")
    del values["k99"]
    values["fresh"] = make_value(500, 1, 20_000)
    _put_all(p, {**changed, "fresh": values["fresh"]})
    second = snap.persist(p)
    assert second.written == 6 * 20_000 and second.bytes == 100 * 20_000
    assert second.entries == 100
    manifests, pk = _pool_files(p, snapshot_dir)
    assert len(manifests) == 2 and len(pk) == 2
    assert pk[1].stat().st_size < pk[0].stat().st_size // 10  # only the new values
    # Nothing changed: nothing written, no pack.
    third = snap.persist(p)
    assert third.written == 0 and len(_pool_files(p, snapshot_dir)[1]) == 2
    p.close()
    Pool.unlink(p.name)
    _restores_to(first.path, before, pool_name, restored)
    _restores_to(second.path, values, pool_name, restored)
    _restores_to(snap.latest_path(p.name), values, pool_name, restored)


def test_retention_keeps_the_bytes_kept_snapshots_share_and_drops_the_rest(make_pool, snapshot_dir, restored,
                                                                          pool_name):
    p = make_pool("16M", block_size="4K", keep=2)
    values = _values(40, 0)
    _put_all(p, values)
    history = []
    for r in range(1, 6):
        history.append((snap.persist(p).path, dict(values)))
        new = _values(10, r, start=(r * 10) % 40)  # a quarter of the values replaced each time
        values.update(new)
        _put_all(p, new)
    manifests, pk = _pool_files(p, snapshot_dir)
    assert [m.name for m in manifests] == [h[0].name for h in history[-2:]]
    # Every pack left is named by a kept snapshot, and every pack a kept snapshot names is there.
    named = set()
    for m in manifests:
        with snap.Snapshot(m) as s:  # verified whole: packs and values
            named.update(r.name for r in s.pack_refs)
    assert named == {x.name for x in pk}
    listed = cli("cache", "snapshots", p.name, "--verify")
    assert listed.returncode == 0 and b"2 of 2 verified whole" in listed.stdout
    name = p.name
    p.close()
    Pool.unlink(name)
    for path, want in history[-2:]:
        _restores_to(path, want, pool_name, restored)
    for path, _ in history[:-2]:
        assert not path.exists()


def test_keeping_one_snapshot_still_shares_with_the_one_it_replaces(make_pool, snapshot_dir, restored, pool_name):
    p = make_pool("8M", block_size="4K", keep=1)
    values = _values(20, 0)
    _put_all(p, values)
    snap.persist(p)
    values.update(_values(1, 1))
    _put_all(p, _values(1, 1))
    second = snap.persist(p)
    assert second.written == 20_000  # the one changed value; the rest stays in the first pack
    manifests, pk = _pool_files(p, snapshot_dir)
    assert manifests == [second.path] and len(pk) == 2
    name = p.name
    p.close()
    Pool.unlink(name)
    _restores_to(second.path, values, pool_name, restored)


def test_compaction_keeps_the_space_near_the_largest_snapshot(make_pool, snapshot_dir, restored, pool_name):
    p = make_pool("16M", block_size="4K", keep=3)
    rng = random.Random(3)
    _put_all(p, _values(100, 0, size=10_000))
    snap.persist(p)
    ratios, wastes, written = [], [], 0
    for r in range(1, 41):  # 5% of the entries replaced per persist, at random: every pack decays
        _put_all(p, {f"k{i}": make_value(i, r, 10_000) for i in rng.sample(range(100), 5)})
        written += snap.persist(p).written
        space = snap.snapshot_space(p.name)
        ratios.append(space["ratio"])
        wastes.append(space["waste_ratio"])
    assert max(wastes) <= snap.SPACE_BOUND + 0.01, wastes
    assert max(ratios) <= 1.55, ratios  # keep 3 and 5% changes: the three snapshots alone hold 1.1x
    assert written <= 40 * 5 * 10_000 * 3  # compaction's copies: within 3x of what changed
    # The first pack (all 100 values) was compacted away long ago; every kept snapshot restores.
    assert all("ccpack" in x.name for x in packs.packs_of(snap.namespaced(p.name), snapshot_dir))
    name, want = p.name, {k: p.get(k) for k in p.keys()}
    p.close()
    Pool.unlink(name)
    for m in snap.snapshots_of(name, snapshot_dir):
        with snap.Snapshot(m) as s:
            assert s.entries == 100
    _restores_to(snap.latest_path(name), want, pool_name, restored)


def test_full_writes_everything_and_output_writes_one_whole_file(make_pool, snapshot_dir, restored, pool_name,
                                                                tmp_path):
    p = make_pool("8M", block_size="4K")
    values = _values(20, 0)
    _put_all(p, values)
    snap.persist(p)
    full = snap.persist(p, full=True)
    assert full.written == full.bytes == 20 * 20_000
    with snap.Snapshot(full.path) as s:
        assert len(s.pack_refs) == 1 and s.pack_refs[0].name.startswith(full.path.name.split(".ccsnap")[0])
    with pytest.raises(UsageError):
        snap.persist(p, tmp_path / "x.ccsnap", full=True)
    r = cli("cache", "persist", p.name, "--output", str(tmp_path / "y.ccsnap"), "--full")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    whole = snap.persist(p, tmp_path / "whole.ccsnap")
    assert not whole.incremental and whole.written is None
    with snap.Snapshot(whole.path) as s:
        assert s.header.version == snap.VERSION == 6 and s.pack_refs == []
    name = p.name
    p.close()
    Pool.unlink(name)
    for pk in packs.packs_of(snap.namespaced(name), snapshot_dir):
        pk.unlink()  # a self-contained file needs no pack
    _restores_to(whole.path, values, pool_name, restored)


def test_a_version_2_snapshot_in_the_directory_still_restores_and_the_next_persist_writes_everything(
        make_pool, snapshot_dir, restored, pool_name):
    p = make_pool("8M", block_size="4K")
    values = _values(10, 0)
    _put_all(p, values)
    # A persist of an older release: a self-contained file (version 2 then; persist --output writes 5 now)
    # under the timestamped name, the latest name on it.
    from cortex_cache import snapshot as s

    snapshot_dir.mkdir(mode=0o700, exist_ok=True)
    old = snap.persist(p, snapshot_dir / f"{snap.namespaced(p.name)}-20260101T000000.000000Z.ccsnap")
    os.link(old.path, snap.latest_path(p.name))
    assert s.snapshots_of(p.name) == [old.path]
    with snap.Snapshot(old.path) as v2:
        assert v2.header.version == snap.VERSION and not v2.pack_refs
    new = snap.persist(p)
    assert new.written == new.bytes  # nothing to share with a self-contained file
    name = p.name
    p.close()
    Pool.unlink(name)
    _restores_to(old.path, values, pool_name, restored)
    _restores_to(new.path, values, pool_name, restored)


def _pack_of(path) -> Path:
    with snap.Snapshot(path, verify=False) as s:
        return path.parent / s.pack_refs[-1].name


def _left_without_the_damaged_one(name: str, refused: bool) -> None:
    """After a restore met damage: no pool if it was refused, else one with the 9 good entries, checked."""
    if refused:
        assert not Pool.exists(name)
        return
    q = Pool.open(name)
    try:
        assert len(q) == 9 and q.verify()["ok"]
        assert all(q.get(k) == v for k, v in _values(10, 0).items() if k in q)
    finally:
        q.close()
    Pool.unlink(name)


@pytest.mark.parametrize("damage", ["missing", "value", "record-head", "pack-header", "truncated"])
def test_a_missing_or_damaged_pack_refuses_its_snapshot_naming_the_file(make_pool, snapshot_dir, pool_name,
                                                                       damage):
    p = make_pool("8M", block_size="4K")
    _put_all(p, _values(10, 0))
    path = snap.persist(p).path
    pack = _pack_of(path)
    if damage == "missing":
        pack.unlink()
    else:
        data = bytearray(pack.read_bytes())
        if damage == "value":
            data[-5] ^= 1
        elif damage == "record-head":
            data[packs.HEAD_SIZE + 9] ^= 1  # the first record's value length
        elif damage == "pack-header":
            data[20] ^= 1
        else:
            data = data[:-100]
        pack.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=str(pack)):
        Pool.restore(path, name=pool_name)
    # A pack that is missing or whose size or header is wrong is seen before the pool is published: nothing
    # is made.  A damaged record is seen when the fill reaches it (fill.py): the pool, published already,
    # keeps every other entry, and never the damaged one.
    seen = damage in ("missing", "truncated", "pack-header")
    _left_without_the_damaged_one(pool_name, seen)
    listed = cli("cache", "snapshots", p.name, "--verify")
    assert listed.returncode == 65 and pack.name.encode() in listed.stdout and b"0 of 1 verified" in listed.stdout
    r = cli("cache", "restore", pool_name, "--input", str(path))
    assert r.returncode == 65 and len(r.stderr.splitlines()) == 1 and pack.name.encode() in r.stderr
    _left_without_the_damaged_one(pool_name, seen)
    # The next persist does not share a pack it can see is missing or damaged (its size, its header); one
    # whose records were damaged after they were written it cannot see without reading every value back:
    # --full shares nothing.
    again = snap.persist(p, full=not seen)
    assert again.written == again.bytes
    name = p.name
    p.close()
    Pool.unlink(name)
    q = Pool.restore(again.path, name=pool_name)
    assert len(q) == 10
    q.close()
    Pool.unlink(pool_name)


def test_the_pack_is_on_disk_before_the_snapshot_that_names_it(make_pool, snapshot_dir, monkeypatch):
    """Power loss, as far as fsync order models it: the pack's bytes and its name are flushed before the
    manifest is renamed into place, and the manifest's rename before the persist returns."""
    p = make_pool("8M", block_size="4K")
    _put_all(p, _values(10, 0))
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(a, b):
        events.append(("rename", str(b)))
        return real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    result = snap.persist(p)
    pack, manifest, d = str(_pack_of(result.path)), str(result.path), str(snapshot_dir)

    def first(kind, what, after=-1):
        return next(n for n, (k, x) in enumerate(events) if n > after and k == kind and what(x))

    pack_synced = first("fsync", lambda x: ".ccpack.tmp-" in x)
    pack_named = first("rename", lambda x: x == pack, pack_synced)
    dir_synced = first("fsync", lambda x: x == d, pack_named)
    manifest_synced = first("fsync", lambda x: ".ccsnap.tmp-" in x, dir_synced)
    manifest_named = first("rename", lambda x: x == manifest, manifest_synced)
    first("fsync", lambda x: x == d, manifest_named)  # and the manifest's name before the persist returns


KILLED = """
import random, sys
from cortex_cache import Pool, persist
from tests.helpers import make_value
name, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
with Pool.open(name) as q:
    r = 0
    while True:
        r += 1
        for i in rng.sample(range(30), 6):
            q.put(f"k{i}", make_value(i, 1000 * seed + r, rng.choice([3000, 40000])))
        persist.persist(q, full=rng.random() < 0.2)
        print(r, flush=True)
"""


def test_a_kill_anywhere_in_persist_retention_or_compaction_leaves_every_kept_snapshot_whole(
        make_pool, snapshot_dir, restored, pool_name):
    p = make_pool("16M", block_size="4K", keep=2)
    _put_all(p, {f"k{i}": make_value(i, 0, 3000) for i in range(30)})
    snap.persist(p)
    rounds = int(os.environ.get("CORTEX_CRASH_ROUNDS", "2"))  # as the crash matrix (test_hardening.py)
    for r in range(rounds):
        child = spawn_py(KILLED, p.name, str(r + 1))
        for _ in range(random.Random(r).randrange(1, 6)):
            if not child.stdout.readline():
                raise AssertionError(child.stderr.read().decode()[-2000:])
        if r % 2:  # mid-way through the next persist
            child.send_signal(signal.SIGKILL)
        else:
            child.kill()
        child.wait()
        for f in (child.stdin, child.stdout, child.stderr):
            f.close()
        for m in snap.snapshots_of(p.name, snapshot_dir) + [snap.latest_path(p.name, snapshot_dir)]:
            with snap.Snapshot(m) as s:  # verified whole, packs and values
                assert s.entries == 30
    # A persist after the kills cleans what they left and shares what they made.
    snap.persist(p)
    assert not [f for f in os.listdir(snapshot_dir) if ".tmp-" in f]
    named = set()
    for m in snap.snapshots_of(p.name, snapshot_dir):
        with snap.Snapshot(m, verify=False) as s:
            named.update(x.name for x in s.pack_refs)
    assert named == {x.name for x in packs.packs_of(snap.namespaced(p.name), snapshot_dir)}
    q = Pool.restore(snap.latest_path(p.name), name=pool_name)
    restored.append(q)
    assert {k: q.get(k) for k in q.keys()} == {k: p.get(k) for k in p.keys()}


def test_snapshots_shows_own_and_shared_bytes_and_doctor_flags_a_bloated_directory(make_pool, snapshot_dir):
    import json

    p = make_pool("8M", block_size="4K", keep=3)
    _put_all(p, _values(20, 0))
    for _ in range(2):
        snap.persist(p, full=True)  # two copies of everything
    rows = snap.list_snapshots(p.name)
    assert all(r["shared_bytes"] == 0 and r["own_bytes"] > 20 * 20_000 for r in rows)
    snap.persist(p)  # shares everything with the newest
    rows = snap.list_snapshots(p.name)
    assert rows[-1]["shared_bytes"] >= 20 * 20_000 and rows[-1]["own_bytes"] == rows[-1]["bytes"]
    assert rows[-2]["shared_bytes"] == rows[-1]["shared_bytes"] and rows[0]["shared_bytes"] == 0
    table = cli("cache", "snapshots", p.name).stdout.decode()
    assert "OWN" in table and "SHARED" in table and "on disk:" in table

    def finding():
        r = cli("cache", "doctor", "--json")
        return next(f for f in json.loads(r.stdout)["findings"] if f["check"] == "snapshot-space")

    assert finding()["ok"]
    # A pack no snapshot names (a persist killed after writing it, before its manifest): waste.
    stray = snapshot_dir / packs.pack_name(snap.namespaced(p.name), "20260101T000000.000000Z")
    stray.write_bytes(bytes(2 << 20))
    f = finding()
    assert not f["ok"] and p.name in f["message"] and f"cortex cache persist {p.name}" in f["fix"]
    snap.persist(p)  # deletes it
    assert not stray.exists() and finding()["ok"]


def test_a_header_of_another_version_is_refused(make_pool, snapshot_dir, pool_name):
    p = make_pool("4M", block_size="4K")
    p.put("k", b"v")
    path = snap.persist(p).path
    data = bytearray(path.read_bytes())
    newer = max(snap.READS) + 1
    struct.pack_into("<I", data, 8, newer)
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=f"version {newer}"):
        Pool.restore(path, name=pool_name)


KILLED_AT_LINK = """
import os, signal, sys
from cortex_cache import Pool, persist

def killed(*a, **k):  # the persist's one link(2): NAME.ccsnap onto its new manifest
    os.kill(os.getpid(), signal.SIGKILL)

os.link = killed
with Pool.open(sys.argv[1]) as p:
    persist.persist(p)
"""


def test_prune_after_a_persist_killed_at_its_link_keeps_the_boot_restore_whole(make_pool, snapshot_dir, pool_name):
    """A persist killed between renaming its manifest into place and linking NAME.ccsnap to it (issue 40,
    item 3): prune counts what NAME.ccsnap names, and points it at the newest snapshot first."""
    p = make_pool("4M", block_size="4K")
    _put_all(p, _values(10, 0))
    snap.persist(p)
    first = snap.snapshots_of(p.name, snapshot_dir)
    _put_all(p, _values(10, 1))  # every value changed: the new snapshot shares no pack with the first
    child = spawn_py(KILLED_AT_LINK, p.name)
    assert child.wait(timeout=60) == -signal.SIGKILL, child.stderr.read().decode()[-2000:]
    for f in (child.stdin, child.stdout, child.stderr):
        f.close()
    stamped = snap.snapshots_of(p.name, snapshot_dir)
    latest = snap.latest_path(p.name, snapshot_dir)
    assert len(stamped) == 2 and latest.stat().st_ino == first[0].stat().st_ino  # the name still on the old one
    r = cli("cache", "snapshots", p.name, "--prune", "--keep", "1")
    assert r.returncode == 0, r.stderr
    assert snap.snapshots_of(p.name, snapshot_dir) == stamped[1:]
    assert latest.stat().st_ino == stamped[1].stat().st_ino  # pointed at the newest, whole snapshot
    with snap.Snapshot(latest):  # verified whole: its packs are all there
        pass
    want = {k: p.get(k) for k in p.keys()}
    name = p.name
    p.close()
    Pool.unlink(name)
    r = cli("cache", "restore", name, "--if-missing")
    assert r.returncode == 0, r.stderr
    with Pool.open(name) as q:
        assert {k: q.get(k) for k in q.keys()} == want


def test_retention_keeps_what_the_latest_name_reaches_when_it_cannot_be_pointed_at_the_newest(
        make_pool, snapshot_dir, monkeypatch):
    p = make_pool("4M", block_size="4K")
    _put_all(p, _values(10, 0))
    snap.persist(p)
    first = snap.snapshots_of(p.name, snapshot_dir)[0]
    _put_all(p, _values(10, 1))
    inode = first.stat().st_ino
    monkeypatch.setattr(snapplaces, "link_latest", lambda *a: None)  # the link never lands, nor its repair
    snap.persist(p, keep=1)
    assert snap.snapshots_of(p.name, snapshot_dir) != [first]  # retention kept only the new one...
    assert snap.latest_path(p.name, snapshot_dir).stat().st_ino == inode  # ... and NAME.ccsnap names the old
    with snap.Snapshot(snap.latest_path(p.name, snapshot_dir)):  # its packs were kept for it
        pass


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_verify_checks_every_value_a_batch_at_a_time(make_pool, snapshot_dir, monkeypatch, which):
    """Snapshot.verify (snapshots --verify, restore --replace) reads a version 4 snapshot's values a batch of
    VERIFY_BYTES at a time, in each pack's order, with one value larger than a batch: a byte flipped in any
    of them is found, and named by where it is in its pack."""
    from cortex_cache import snapfile

    p = make_pool("8M", block_size="4K")
    values = _values(12, 0, 9_000)
    values["big"] = make_value(99, 0, 70_000)
    _put_all(p, values)
    path = snap.persist(p).path
    monkeypatch.setattr(snapfile, "VERIFY_BYTES", 20_000)
    with snap.Snapshot(path, verify=False) as s:
        s.verify()
        c = s.v4.cols
        order = np.argsort(c["offset"])
        at = int(c["offset"][order[{"first": 0, "middle": len(order) // 2, "last": -1}[which]]])
    pack = _pack_of(path)
    data = bytearray(pack.read_bytes())
    data[at + 3] ^= 1
    pack.write_bytes(bytes(data))
    with snap.Snapshot(path, verify=False) as s, \
            pytest.raises(SnapshotCorrupt, match=f"the value at byte {at} fails its checksum"):
        s.verify()
