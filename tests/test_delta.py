"""Delta manifests (snapdelta.py, basepos.py, deltaplan.py): an incremental persist that writes only what
changed since a full manifest, read with that base as one snapshot by restore, the fill, the snapshot tier of
other processes, verify and retention.  Real shared memory, real processes, real kills."""

from __future__ import annotations

import os
import signal
import struct
import time

import pytest
import xxhash

from cortex_cache import Pool, SnapshotCorrupt
from cortex_cache import core_fast, packs, snapdelta
from cortex_cache import persist as snap
from cortex_cache.snapfile import DELTA_VERSION, MANIFEST_VERSION, Snapshot

from .helpers import cli, make_value, run_py
from .fillers import go_on as _go_on, no_filler_left, start as _start  # noqa: F401 (no_filler_left: autouse)
from .test_gone import _contents, act

SIZE = 2048


def _fill(p: Pool, n: int, version: int = 0) -> None:
    for i in range(n):
        p.put(f"k{i}", make_value(i, version, SIZE))


def _version(path) -> int:
    with Snapshot(path, verify=False, private=True, base=False) as s:
        return s.header.version


def _change(p: Pool) -> None:
    """Since the base: 20 overwritten, 20 deleted, 10 new, 5 evicted (a 1,000-entry pool)."""
    for i in range(20):
        p.put(f"k{i}", make_value(i, 1, SIZE))
    for i in range(20, 40):
        p.delete(f"k{i}")
    for i in range(1000, 1010):
        p.put(f"k{i}", make_value(i, 1, SIZE))
    p.evict(keys=[f"k{i}" for i in range(40, 45)])


def _contents_of(p: Pool) -> dict:
    return {k: p.get(k) for k in p.keys()}


def test_a_delta_holds_only_what_changed_and_restores_to_exactly_the_pool(make_pool, snapshot_dir, restored,
                                                                        pool_name):
    p = make_pool("16M", block_size=4096, max_entries=1500)
    _fill(p, 1000)
    base = snap.persist(p)
    _change(p)
    d = snap.persist(p)
    want = _contents_of(p)
    assert _version(base.path) == MANIFEST_VERSION and _version(d.path) == DELTA_VERSION
    assert d.entries == len(want) == 1000 - 20 - 5 + 10 and d.bytes == len(want) * SIZE
    assert d.written == 30 * SIZE  # the overwritten and the new values, nothing else
    with Snapshot(d.path, verify=False, private=True, base=False) as alone:  # the delta's own sections: only
        # what changed (the policy's state is the pool's whole, as in every snapshot: per entry for a queue policy)
        own = sum(place.length for name, place in alone.v4.places.items() if name != "policy")
    assert own * 20 < base.path.stat().st_size and d.path.stat().st_size * 4 < base.path.stat().st_size
    with Snapshot(d.path, private=True) as s:  # verified whole: the delta, its base and every value
        assert (s.entries, s.positions) == (len(want), 30 + 1000)
    p.close()
    Pool.unlink(p.name)
    q = Pool.restore(d.path, name=pool_name)
    restored.append(q)
    assert _contents_of(q) == want  # every key and value; deleted, overwritten and evicted ones absent
    fill = q.stats()["fill"]
    assert fill["state"] == "done" and fill["entries_total"] == 1030
    assert fill["skipped"] == 45  # the base's dropped positions: gone from the start, never loaded
    # Every put after the restore takes a sequence number above every restored entry's (what the base
    # positions rely on); the restored pool's first persist is a full one, its next a delta again.
    c = q.core
    assert int(c.header[0]["seq"]) >= int(c.columns["insert_seq"][c.live_mask()].max())
    assert _version(snap.persist(q).path) == MANIFEST_VERSION
    q.put("k500", make_value(500, 9, SIZE))
    q.delete("k501")
    again = snap.persist(q)
    assert _version(again.path) == DELTA_VERSION and again.written == SIZE
    want = _contents_of(q)
    q.close()
    restored.remove(q)
    Pool.unlink(pool_name)
    q = Pool.restore(again.path, name=pool_name)
    restored.append(q)
    assert _contents_of(q) == want


@pytest.mark.parametrize("c", [False, True], ids=["python-fill", "c-fill"])
def test_the_boot_restore_of_a_delta_fills_the_live_set_and_other_processes_see_base_delta_and_no_dropped(
        make_pool, snapshot_dir, c):
    """`restore` by name (the boot line) reads the delta; while its fill is paused after its first batch,
    another process is served the delta's and the base's entries from the snapshot tier and misses the
    dropped ones; deletes made meanwhile by another process never come back (the gone marks hold); the fill
    then loads exactly the rest."""
    p = make_pool("16M", block_size=4096, max_entries=1500)
    _fill(p, 1000)
    snap.persist(p)
    _change(p)
    assert _version(snap.persist(p).path) == DELTA_VERSION
    name = p.name
    p.close()
    Pool.unlink(name)
    w = _start(name, c=c)  # C: the delta's positions, then the base's, never in one batch
    try:
        got = act(name, [["get", ["k5", "k500", "k1003", "k25", "k42"], 0]])["got"]
        assert got == {"k5": True, "k500": True, "k1003": True, "k25": False, "k42": False}
        check = run_py("""
import sys
from cortex_cache import Pool
from tests.helpers import make_value
with Pool.open(sys.argv[1]) as q:
    assert q.get("k7") == make_value(7, 1, 2048)  # the delta's value, not the base's
    assert q.get("k700") == make_value(700, 0, 2048)
    assert q.get("k30") is None and q.get("k43") is None  # deleted, evicted since the base
    assert "k31" not in q and "k600" in q
""", name)
        assert check.returncode == 0, check.stderr.decode()
        act(name, [["delete", ["k8", "k800", "k1004"], 0]])
        report = _go_on(w)
    finally:
        if w.poll() is None:
            w.kill()
    assert report["ended"] == "done"
    got = _contents(name)
    gone = {f"k{i}" for i in range(20, 45)} | {"k8", "k800", "k1004"}
    want = {f"k{i}": (1 if i < 20 or i >= 1000 else 0) for i in [*range(1000), *range(1000, 1010)]}
    assert got == {k: v for k, v in want.items() if k not in gone}
    Pool.unlink(name)


def test_a_compacted_base_keeps_its_delta_restorable_and_retention_keeps_the_base(make_pool, snapshot_dir,
                                                                                 restored, pool_name):
    p = make_pool("16M", block_size=4096, max_entries=300, keep=2)
    _fill(p, 100)
    first = snap.persist(p)  # S0: every value in pack P0
    with Snapshot(first.path, verify=False) as s0:
        p0 = {r.name for r in s0.pack_refs}
    for i in range(40):  # too many for a delta, so S1 is full (60% of its values still in P0)
        p.put(f"k{i}", make_value(i, 1, SIZE))
    base = snap.persist(p)
    assert _version(base.path) == MANIFEST_VERSION
    p.put("k60", make_value(60, 2, SIZE))
    p.delete("k61")
    delta = snap.persist(p)
    assert _version(delta.path) == DELTA_VERSION
    want = _contents_of(p)
    p.put("k70", make_value(70, 3, SIZE))
    snap.persist(p, full=True)  # keeps 2 (the delta and this one) and the delta's base, compacting P0 out of it
    kept = snap.snapshots_of(p.name, snapshot_dir)
    assert base.path in kept and delta.path in kept and first.path not in kept
    assert not p0 & {x.name for x in packs.packs_of(snap.namespaced(p.name), snapshot_dir)}  # compacted away
    with Snapshot(delta.path, private=True) as s:  # the rewritten base, the delta, every value
        assert s.entries == len(want)
    p.close()
    Pool.unlink(p.name)
    q = Pool.restore(delta.path, name=pool_name)
    restored.append(q)
    assert _contents_of(q) == want


def _damage_section_table(path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # in the section table: the trailer's checksum no longer matches
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["missing", "damaged", "another-snapshot", "another-pool"])
def test_a_delta_whose_base_is_not_its_own_is_refused_in_one_line_and_nothing_is_published(
        make_pool, snapshot_dir, pool_name, how):
    p = make_pool("8M", block_size=4096, max_entries=300)
    _fill(p, 100)
    base = snap.persist(p)
    p.put("k1", make_value(1, 1, SIZE))
    d = snap.persist(p)
    assert _version(d.path) == DELTA_VERSION
    if how == "missing":
        base.path.unlink()
    elif how == "damaged":
        _damage_section_table(base.path)
    elif how == "another-snapshot":  # a full manifest of the same pool, written after: another ident
        other = snap.persist(p, full=True)
        os.replace(other.path, base.path)
    else:
        q = make_pool("8M", block_size=4096, max_entries=300)
        q.put("x", b"y")
        other = snap.persist(q)
        os.replace(other.path, base.path)
    with pytest.raises(SnapshotCorrupt, match="base"):
        Pool.restore(d.path, name=pool_name)
    assert not Pool.exists(pool_name)
    r = cli("cache", "restore", pool_name, "--input", str(d.path))
    assert r.returncode == 65 and len(r.stderr.splitlines()) == 1 and b"base" in r.stderr, r.stderr
    assert not Pool.exists(pool_name)


def test_snapshots_verify_checks_the_delta_and_its_base(make_pool, snapshot_dir):
    p = make_pool("8M", block_size=4096, max_entries=300)
    _fill(p, 100)
    base = snap.persist(p)
    p.put("k1", make_value(1, 1, SIZE))
    snap.persist(p)
    ok = cli("cache", "snapshots", p.name, "--verify")
    assert ok.returncode == 0 and b"2 of 2 verified" in ok.stdout, ok.stdout
    with Snapshot(base.path, verify=False) as s0:
        pack = base.path.parent / s0.pack_refs[0].name
    data = bytearray(pack.read_bytes())
    data[-10] ^= 0xFF  # a base value the delta keeps
    pack.write_bytes(bytes(data))
    bad = cli("cache", "snapshots", p.name, "--verify")
    assert bad.returncode == 65 and b"0 of 2 verified" in bad.stdout, bad.stdout


def test_a_pool_made_before_the_base_positions_writes_full_manifests(make_pool, snapshot_dir, pool_name):
    p = make_pool("8M", block_size=4096, max_entries=300, name=pool_name)
    _fill(p, 100)
    p.core.header[0]["base_off"] = 0  # as a pool made before the region (its bytes are simply unused)
    p.close()
    with Pool.open(pool_name) as q:
        assert q.core.geometry.base_off == 0
        snap.persist(q)
        q.put("k1", make_value(1, 1, SIZE))
        again = snap.persist(q)
        assert _version(again.path) == MANIFEST_VERSION and again.written == SIZE  # shared, but whole


def test_a_small_base_or_more_changes_than_a_quarter_of_it_write_a_full_manifest(make_pool, snapshot_dir):
    small = make_pool("8M", block_size=4096, max_entries=300)
    _fill(small, 63)
    snap.persist(small)
    small.put("k1", make_value(1, 1, SIZE))
    assert _version(snap.persist(small).path) == MANIFEST_VERSION  # 63 entries: a delta would save nothing
    p = make_pool("8M", block_size=4096, max_entries=300)
    _fill(p, 100)
    snap.persist(p)
    for i in range(20):
        p.put(f"k{i}", make_value(i, 1, SIZE))
    assert _version(snap.persist(p).path) == DELTA_VERSION  # 20%
    for i in range(20, 30):
        p.put(f"k{i}", make_value(i, 1, SIZE))
    assert _version(snap.persist(p).path) == MANIFEST_VERSION  # 30% since the base: a full one, the next base
    p.put("k50", make_value(50, 1, SIZE))
    assert _version(snap.persist(p).path) == DELTA_VERSION


KILLED_AT = """
import os, signal, sys
from cortex_cache import Pool, basepos, persist, snapshot
from tests.helpers import make_value
name, where, r = sys.argv[1], sys.argv[2], int(sys.argv[3])

def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)

module, attr = where.split(":")
setattr({"basepos": basepos, "snapshot": snapshot, "Incremental": snapshot._Incremental}[module], attr, die)
with Pool.open(name) as q:
    for i in range(3):
        q.put(f"k{(7 * r + i) % 100}", make_value(i, r, 2048))
    q.delete(f"k{(11 * r) % 100}")
    persist.persist(q, full=r % 3 == 0)
"""


@pytest.mark.parametrize("where", ["basepos:_stamp_chunk", "basepos:forget", "snapshot:retain",
                                   "Incremental:_manifest", "snapshot:fsync_dir"])
def test_a_persister_killed_at_any_step_leaves_every_kept_snapshot_restorable(make_pool, snapshot_dir, restored,
                                                                            pool_name, where):
    p = make_pool("16M", block_size=4096, max_entries=300, keep=2)
    _fill(p, 100)
    snap.persist(p)
    module, attr = where.split(":")
    script = KILLED_AT
    if "." in module:  # a method: patched on its class
        script = script.replace('setattr({"basepos": basepos, "snapshot": snapshot, "Incremental": snapshot._Incremental}[module], attr, die)',
                                "setattr(snapshot._Incremental, attr, die)")
    for r in range(1, 5):
        child = run_py(script, p.name, f"{module.split('.')[0]}:{attr}", str(r), check=False)
        assert child.returncode in (0, -signal.SIGKILL), child.stderr.decode()
        for m in snap.snapshots_of(p.name, snapshot_dir) + [snap.latest_path(p.name, snapshot_dir)]:
            with Snapshot(m, private=True):  # verified whole: a delta with its base, packs and values
                pass
    # The next persist (unpatched) writes a snapshot of exactly the pool, whatever base the kills left.
    last = snap.persist(p)
    want = _contents_of(p)
    p.close()
    Pool.unlink(p.name)
    q = Pool.restore(last.path, name=pool_name)
    restored.append(q)
    assert _contents_of(q) == want


def test_an_older_reader_refuses_a_delta_by_its_version(make_pool, snapshot_dir):
    """Version 5 on the file header: a version 4 reader says "format version 5" instead of restoring the
    changed entries alone as if they were the pool."""
    p = make_pool("8M", block_size=4096, max_entries=300)
    _fill(p, 100)
    snap.persist(p)
    p.put("k1", make_value(1, 1, SIZE))
    d = snap.persist(p)
    (version,) = struct.unpack_from("<I", d.path.read_bytes(), 8)
    assert version == 5


def test_entries_expired_since_the_base_are_dropped_by_the_delta(make_pool, snapshot_dir, pool_name):
    p = make_pool("8M", block_size=4096, max_entries=300, name=pool_name)
    _fill(p, 100)
    for i in range(10):
        p.put(f"t{i}", make_value(i, 0, SIZE), ttl=60)
    snap.persist(p)
    p.close()
    with Pool.open(pool_name, clock=lambda: time.time() + 3600) as q:  # an hour on: the TTLs ran out
        q.put("k1", make_value(1, 1, SIZE))
        d = snap.persist(q)
    assert _version(d.path) == DELTA_VERSION and d.entries == 100
    with Snapshot(d.path, private=True) as s:
        dropped = s.v4.dropped_mask()
        assert int(dropped.sum()) == 10 + 1  # the ten expired and k1's old value
        for i in range(10):
            kb = f"t{i}".encode()
            assert s.position(kb, xxhash.xxh3_64_intdigest(kb)) is None
        kb = b"k1"
        p1 = s.position(kb, xxhash.xxh3_64_intdigest(kb))
        assert p1 is not None and p1 < s.v4.nd  # the delta's own entry, found before the base's dropped one


def test_restoring_a_delta_does_not_report_its_dropped_base_entries_as_skipped(make_pool, snapshot_dir, pool_name):
    """The base entries a delta dropped were never part of its snapshot: restore's line says nothing was
    skipped (they used to be counted as 'there already or gone')."""
    p = make_pool("16M", block_size=4096, max_entries=1500)
    _fill(p, 1000)
    snap.persist(p)
    _change(p)
    d = snap.persist(p)
    assert _version(d.path) == DELTA_VERSION
    p.close()
    Pool.unlink(p.name)
    r = cli("cache", "restore", pool_name, "--input", str(d.path))
    try:
        assert r.returncode == 0, r.stderr.decode()
        out = r.stdout.decode()
        assert f"restored {1000 - 20 - 5 + 10} entries" in out and "skipped" not in out, out
    finally:
        if Pool.exists(pool_name):
            Pool.unlink(pool_name)


@pytest.mark.parametrize("from_delta,resumed", [(False, False), (True, False), (True, True)],
                         ids=["full", "delta", "delta-resumed"])
def test_the_first_persist_after_a_restore_is_a_delta_against_the_manifest_it_was_filled_from(
        make_pool, snapshot_dir, pool_name, from_delta, resumed):
    """The fill stamps each entry it loaded with its position in the full manifest it came from (a delta's
    base, for a delta), so a restored pool's next persist writes only what changed since; restored again,
    that delta gives exactly the pool.  (fill.py's Python batches stamp nothing: their pools' first persist
    is a full manifest.)"""
    if core_fast.C_COPY_HASH is None or os.environ.get(core_fast.PURE_PYTHON_ENV, "") not in ("", "0"):
        pytest.skip("the C fast path is not built or turned off here")
    p = make_pool("16M", block_size=4096, max_entries=1500, name=pool_name)
    _fill(p, 1000)
    base = snap.persist(p)
    if from_delta:
        _change(p)
        assert _version(snap.persist(p).path) == DELTA_VERSION
    p.close()
    Pool.unlink(pool_name)
    try:
        if resumed:  # a filler killed inside its second batch; another process finishes the fill
            w = _start(pool_name, where="value", n=2, c=True)
            w.kill()
            w.wait()
            r = cli("cache", "restore", pool_name, "--if-missing")
        else:
            r = cli("cache", "restore", pool_name)  # the boot line: filled by columns (C) where built
        assert r.returncode == 0, r.stderr.decode()
        with Pool.open(pool_name) as q:
            for i in range(100, 110):
                q.put(f"k{i}", make_value(i, 2, SIZE))
            q.delete("k500")
            d = snap.persist(q)
            want = _contents_of(q)
        assert _version(d.path) == DELTA_VERSION
        with Snapshot(d.path, verify=False, private=True, base=False) as s:
            assert s.entries == (10 + 30 if from_delta else 10)  # a delta's own entries stay changed
            assert snapdelta.read_base(s.section("base"), ValueError)[0] == _ident(base.path)
        Pool.unlink(pool_name)
        r = cli("cache", "restore", pool_name)
        assert r.returncode == 0, r.stderr.decode()
        with Pool.open(pool_name) as q:
            assert _contents_of(q) == want and "k500" not in q
    finally:
        if Pool.exists(pool_name):
            Pool.unlink(pool_name)


def _ident(path) -> bytes:
    with Snapshot(path, verify=False, private=True, base=False) as s:
        view = s.section("ident")
        ident = bytes(view)
        view.release()
        return ident
