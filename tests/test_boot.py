"""Restart at a million entries (issue 39): manifest version 4, persist without per-entry work, publish first,
attach in O(1).  Real shared memory, real processes; sizes kept small -- what is O(1) is shown by counting
the work an attach does at two sizes ten times apart, never by timing it."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex_cache import Pool, SnapshotCorrupt, manifest, packs
from cortex_cache import persist as snap
from cortex_cache import snapfile
from cortex_cache.snapshot import Snapshot, latest_path, namespaced

from .helpers import make_value, run_py, spawn_py

VALUE = 2048


def _fill(p: Pool, n: int, version: int = 0) -> dict[str, bytes]:
    want = {}
    for i in range(n):
        v = make_value(i, version, VALUE)
        p.put(f"key-{i:06d}", v, ttl=3600 if i % 7 == 0 else None, priority=i % 5)
        want[f"key-{i:06d}"] = v
    return want


def test_persist_writes_version_4_in_fill_order_with_a_table_that_finds_every_key(make_pool, snapshot_dir):
    p = make_pool("4M", block_size="4K")
    want = _fill(p, 300)
    for k in ("key-000007", "key-000100", "key-000003"):  # key-000003 the most recently used
        p.get(k)
    r = snap.persist(p)
    with Snapshot(r.path, private=True) as s:
        assert s.header.version == 4 and s.entries == 300 and s.value_bytes == 300 * VALUE
        v4 = s.v4
        assert v4 is not None and len(v4.table) >= 600 and len(v4.table) & (len(v4.table) - 1) == 0
        assert v4.key(0) == b"key-000003"  # the fill's first: the most recently used, alone
        aseq = v4.cols["access_seq"]
        assert aseq[0] == aseq.max() and (np.diff(aseq[1:].astype(np.int64)) < 0).all()  # one band: newest first
        for k in want:
            kb = k.encode()
            pos = s.position(kb, xxhash.xxh3_64_intdigest(kb))
            assert pos is not None and v4.key(pos) == kb
            row = v4.row(pos)
            value = s.pack_reader(row["pack"]).raw_value(row["offset"], row["length"], row["checksum"], s.path, True)
            assert bytes(value) == want[k]
        assert s.position(b"absent", xxhash.xxh3_64_intdigest(b"absent")) is None
        assert bytes(s.section("policy"))[:4] == b"CCPS" and s.section("no-such") is None  # policy_state.py
        s.verify()  # every section's checksum, every value


def test_a_restore_from_version_4_brings_back_every_entry_and_its_metadata(make_pool, snapshot_dir, restored):
    p = make_pool("4M", block_size="4K")
    want = _fill(p, 200)
    before = {k: p.info(k) for k in want}
    snap.persist(p)
    name = p.name
    p.close()
    Pool.unlink(name)
    q, report = snap.restore(None, name=name)
    restored.append(q)
    assert report["entries"] == 200 and not report["corrupt"]
    for k, v in want.items():
        assert q.get(k) == v
        got = q.info(k)
        for field in ("created", "priority", "expires", "checksum"):
            assert got[field] == before[k][field], field


def test_an_incremental_persist_writes_only_what_changed_and_restores_the_newest(make_pool, snapshot_dir, restored):
    p = make_pool("4M", block_size="4K")
    want = _fill(p, 200)
    full = snap.persist(p, full=True)
    for i in range(0, 200, 50):
        want[f"key-{i:06d}"] = make_value(i, 1, VALUE)
        p.put(f"key-{i:06d}", want[f"key-{i:06d}"])
    p.delete("key-000001")
    del want["key-000001"]
    inc = snap.persist(p)
    assert full.written is not None and full.written == 200 * VALUE and inc.written == 4 * VALUE
    name = p.name
    p.close()
    Pool.unlink(name)
    q, _ = snap.restore(None, name=name)
    restored.append(q)
    assert {k: q.get(k) for k in q.keys()} == want


# ---------------------------------------------------------------- version 3 still restores


def _v3_snapshot(directory, stem: str, prefix: bytes, entries: list[tuple[bytes, bytes, int]]) -> None:
    """A version 3 manifest and its version 1 pack, as persist wrote them before version 4 (packs.py and
    snapfile.py document both): `prefix` a snapshot's header and configuration block, made version 3."""
    stamp = "20260101T000000.000000Z"
    pack_name, pack_id = f"{stem}-{stamp}.ccpack", 1767225600000000
    head = packs.PACK_HEAD.pack(packs.PACK_MAGIC, 1, packs.HEAD_SIZE, 1.0, pack_id)
    pack = bytearray(head + packs.PACK_HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(head)))
    records = bytearray()
    for n, (key, value, aseq) in enumerate(entries):
        off = len(pack)
        rec = packs.PACK_REC.pack(b"CPRC", len(key), len(value), xxhash.xxh3_64_intdigest(value))
        pack += rec + packs.PACK_REC_CHECK.pack(xxhash.xxh3_64_intdigest(rec + key)) + key + value
        man = snapfile.REC_HEAD.pack(b"CMRC", len(key), 0, 0, len(value), 1.0, 1.0, 0.0, n + 1, aseq, 1, 0,
                                     xxhash.xxh3_64_intdigest(value), off)
        records += man + snapfile.REC_CHECK.pack(xxhash.xxh3_64_intdigest(man + key)) + key
    (directory / pack_name).write_bytes(pack)
    fh = bytearray(prefix[: snapfile.FILE_HEAD.size])
    struct.pack_into("<I", fh, 8, 3)
    struct.pack_into("<QI", fh, manifest.SECTIONS_AT_OFFSET, 0, 0)
    body = bytes(fh) + snapfile.HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(fh)) + prefix[snapfile.FILE_HEAD.size + 8:]
    body += snapfile.PACK_TABLE.pack(1, 0) + snapfile.PACK_ENTRY.pack(pack_id, len(pack), len(pack_name)) + pack_name.encode()
    body += records
    nbytes = sum(len(v) for _, v, _ in entries)
    body += snapfile.TRAILER.pack(snapfile.END_MAGIC, len(entries), nbytes, xxhash.xxh3_64_intdigest(body))
    path = directory / f"{stem}-{stamp}.ccsnap"
    path.write_bytes(body)
    os.chmod(path, 0o600)
    os.chmod(directory / pack_name, 0o600)
    os.link(path, directory / f"{stem}.ccsnap")


def test_a_version_3_snapshot_still_restores_and_the_next_persist_shares_its_pack(make_pool, snapshot_dir, restored):
    p = make_pool("4M", block_size="4K")
    p.put("seed", b"x")
    r = snap.persist(p)
    with Snapshot(r.path, private=True) as s:
        prefix = s.prefix()
    name = p.name
    p.close()
    Pool.unlink(name)
    for f in snapshot_dir.iterdir():
        f.unlink()
    entries = [(f"old-{i}".encode(), make_value(i, 3, VALUE), 10 + i) for i in range(40)]
    _v3_snapshot(snapshot_dir, namespaced(name), prefix, entries)
    with Snapshot(latest_path(name), private=True) as s:
        assert s.header.version == 3 and s.v4 is None
        s.verify()
    q, report = snap.restore(None, name=name)
    restored.append(q)
    assert report["entries"] == 40 and all(q.get(k.decode()) == v for k, v, _ in entries)
    assert q.get("old-39") is not None
    r = snap.persist(q)  # version 4 now, its values still in the version 1 pack: nothing written
    assert r.written == 0
    q.close()
    Pool.unlink(name)
    restored.clear()
    q, report = snap.restore(None, name=name)
    restored.append(q)
    assert report["entries"] == 40 and all(q.get(k.decode()) == v for k, v, _ in entries)


# ---------------------------------------------------------------- publish first, attach in O(1)


PAUSED_RESTORE = """
import sys
from cortex_cache import persist
calls = 0
def progress(done, total):  # after the first batch (one entry): the pool is published and filling
    global calls
    calls += 1
    if calls == 1:
        print("paused", flush=True)
        sys.stdin.readline()
pool, report = persist.restore(None, name=sys.argv[1], progress=progress)
pool.close()
"""

ATTACH = """
import json, resource, sys, tracemalloc
from cortex_cache import Pool, snapfile, fill
opened = {"n": 0}
real = fill.manifest_items
def counted(*a, **k):  # the per-process index of a version 3 manifest: must not be built
    opened["n"] += 1
    return real(*a, **k)
fill.manifest_items = counted
name, key = sys.argv[1], sys.argv[2]
q0 = Pool.open(name)  # the modules' own first use, outside what is counted
q0.close()
tracemalloc.start()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
q = Pool.open(name)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
below = [t for t in q.tiers.below if t.name == "snapshot"]
got = q.get(key)
print(json.dumps({"peak": peak, "faults": faults, "index_builds": opened["n"], "tier": bool(below),
                  "hit": got is not None, "filling": q.stats()["fill"]["state"]}))
q.close()
"""


def _paused_fill(make_pool, n: int, delta: bool = False):
    p = make_pool(f"{n * 4096 // (1 << 20) + 8}M", block_size="4K", max_entries=n + 64)
    _fill(p, n)
    snap.persist(p)
    if delta:  # 1% changed: the boot restore reads a delta and its base (snapdelta.py)
        for i in range(0, n, 100):
            p.put(f"key-{i:06d}", b"changed")
        d = snap.persist(p)
        with Snapshot(d.path, verify=False, private=True, base=False) as alone:
            assert alone.header.version == 5 and alone.v4.n == len(range(0, n, 100))
    name = p.name
    p.close()
    Pool.unlink(name)
    w = spawn_py(PAUSED_RESTORE, name)
    assert w.stdout.readline() == b"paused\n", w.stderr.read().decode()
    return name, w


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
@pytest.mark.parametrize("n", [1000])
def test_attaching_to_a_filling_pool_reads_nothing_per_entry(make_pool, snapshot_dir, n, delta):
    """Another process's Pool.open of a filling pool: the same memory and page faults at n and at 10 n
    entries (no index of the snapshot is built: the manifest's table is used in place; a delta's and its
    base's both), and a get of an entry the fill has not reached is served from the snapshot."""
    seen = []
    for size in (n, 10 * n):
        name, w = _paused_fill(make_pool, size, delta)
        try:
            out = json.loads(run_py(ATTACH, name, f"key-{size // 2:06d}").stdout)
        finally:
            w.stdin.write(b"\n")
            w.stdin.close()
            w.wait(timeout=120)
            Pool.unlink(name)
        assert out["tier"] and out["hit"] and out["filling"] == "filling" and out["index_builds"] == 0, out
        seen.append(out)
    small, large = seen
    # 10x the entries: a version 3 index grew by ~10 MB of Python objects and every manifest page here.
    assert large["peak"] - small["peak"] < 64 << 10, seen
    assert large["faults"] - small["faults"] < 64, seen
    assert large["peak"] < 1 << 20, seen


def test_snapshot_tier_position_is_the_fill_position_of_a_key(make_pool, snapshot_dir):
    name, w = _paused_fill(make_pool, 300)
    try:
        q = Pool.open(name)
        try:
            (below,) = [t for t in q.tiers.below if t.name == "snapshot"]
            with Snapshot(latest_path(name), private=True) as s:
                for k in ("key-000000", "key-000150", "key-000299"):
                    kb = k.encode()
                    kh = xxhash.xxh3_64_intdigest(kb)
                    pos = below.position(kb, kh)
                    assert pos is not None and pos == s.position(kb, kh) and s.v4.key(pos) == kb
            assert below.position(b"absent", xxhash.xxh3_64_intdigest(b"absent")) is None
        finally:
            q.close()
    finally:
        w.stdin.write(b"\n")
        w.stdin.close()
        w.wait(timeout=60)
        Pool.unlink(name)


def test_restore_publishes_before_it_reads_any_column(make_pool, snapshot_dir, monkeypatch):
    """What restore checks before publishing is O(1): a manifest whose columns are damaged is published
    (its header and section table are whole) and the fill, which checks the sections it reads, fails
    after it -- loading nothing, serving nothing from the snapshot."""
    p = make_pool("4M", block_size="4K")
    _fill(p, 100)
    r = snap.persist(p)
    name = p.name
    p.close()
    Pool.unlink(name)
    with Snapshot(r.path, private=True) as s:
        at = s.v4.places["checksum"].offset
    with open(r.path, "r+b") as f:
        f.seek(at + 8)
        f.write(b"\xff" * 8)
    with pytest.raises(SnapshotCorrupt, match="section 'checksum'"):
        snap.restore(None, name=name)
    with Pool.open(name) as q:  # published, then the fill failed: empty, and nothing served from the file
        assert len(q) == 0 and q.get("key-000001") is None and q.stats()["fill"]["state"] == "failed"
    Pool.unlink(name)


# ---------------------------------------------------------------- persist: no per-entry work, no pins


def test_persist_takes_no_pin_and_leaves_out_an_entry_damaged_in_memory(make_pool, snapshot_dir, restored):
    p = make_pool("4M", block_size="4K")
    want = _fill(p, 50)
    core = p.core
    slot = core.locked(core.find, b"key-000010", xxhash.xxh3_64_intdigest(b"key-000010"))
    off, _ = core.locked(core.value_at, slot)
    core.mv[off] ^= 0xFF  # one byte of one value, damaged in memory
    pins = core.pin_records["pid"].copy()
    r = snap.persist(p)
    assert (core.pin_records["pid"] == pins).all()
    assert r.entries == 49 and r.skipped_corrupt == 1
    name = p.name
    p.close()
    Pool.unlink(name)
    q, _ = snap.restore(None, name=name)
    restored.append(q)
    del want["key-000010"]
    assert {k: q.get(k) for k in q.keys()} == want


# ---------------------------------------------------------------- damaged manifests


@pytest.fixture(scope="module")
def v4_image(tmp_path_factory):
    """A version 4 snapshot directory of 40 entries (its bytes), and the values."""
    d = tmp_path_factory.mktemp("v4") / "snapshots"
    old = os.environ.get("CORTEX_CACHE_SNAPSHOT_DIR")
    os.environ["CORTEX_CACHE_SNAPSHOT_DIR"] = str(d)
    name = f"dmg{os.getpid()}"
    try:
        p = Pool.create(name, "2M", block_size="4K")
        want = {f"key-{i:06d}".encode(): make_value(i, 0, VALUE) for i in range(40)}
        for k, v in want.items():
            p.put(k, v)
        r = snap.persist(p)
        p.close()
        Pool.unlink(name)
    finally:
        if old is None:
            del os.environ["CORTEX_CACHE_SNAPSHOT_DIR"]
        else:
            os.environ["CORTEX_CACHE_SNAPSHOT_DIR"] = old
    return r.path, r.path.read_bytes(), want


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_damaged_version_4_manifest_gives_misses_or_errors_never_wrong_bytes(v4_image, data):
    """Damaged bytes anywhere in a manifest: opening it is refused, or every lookup is the right entry or a
    miss, and a value served is the value (checked against its checksum as the snapshot tier does)."""
    path, image, want = v4_image
    buf = bytearray(image)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(buf) - 1))
        buf[at] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(buf))
    try:
        s = Snapshot(path, verify=False, private=True)
    except SnapshotCorrupt:
        return
    try:
        for k, v in want.items():
            pos = s.position(k, xxhash.xxh3_64_intdigest(k))
            if pos is None:
                continue
            assert s.v4.key(pos) == k
            row = s.v4.row(pos)
            try:
                got = bytes(s.pack_reader(row["pack"]).raw_value(row["offset"], row["length"], row["checksum"],
                                                                   s.path, False))
            except SnapshotCorrupt:
                continue
            if xxhash.xxh3_64_intdigest(got) == row["checksum"]:
                assert got == v
        try:
            s.verify()
        except SnapshotCorrupt:
            pass
    finally:
        s.close()
        path.write_bytes(image)


def test_the_format_table_in_manifest_py_names_every_column_with_its_type():
    """The bytes are documented where they are defined: the module's table cannot drift from COLUMNS."""
    doc = " ".join(manifest.__doc__.split())
    bits = {"u": "u", "i": "i", "f": "f"}
    for name, fmt in manifest.COLUMNS:
        kind, size = fmt[1], int(fmt[2:])
        assert f"{name} {bits[kind]}{size * 8}" in doc, name
    assert manifest.SECTION.size == 40 and manifest.SECTIONS_AT_OFFSET == 204
    assert "204 u64 offset of the section table" in doc and "212 u32 sections in it" in doc


def test_gather_hash_copies_each_piece_and_its_checksum_and_refuses_a_piece_outside():
    from cortex_cache import copyhash

    src = os.urandom(1 << 16)
    offs = np.array([0, 100, 5000, 60000, 7], np.uint64)
    lens = np.array([10, 2048, 0, 5536, 1], np.uint64)
    want = b"".join(src[int(o) : int(o + n)] for o, n in zip(offs, lens))
    for fn in {copyhash.gather_hash, copyhash.gather_hash_py}:
        dst, sums = bytearray(len(want) + 3), np.zeros(len(offs), np.uint64)
        assert fn(dst, src, offs, lens, sums) == len(want) and bytes(dst[: len(want)]) == want
        assert sums.tolist() == [xxhash.xxh3_64_intdigest(src[int(o) : int(o + n)]) for o, n in zip(offs, lens)]
        dst = bytearray(len(want))
        with pytest.raises(ValueError):
            fn(dst, src, np.array([0, 1 << 16], np.uint64), np.array([4, 1], np.uint64), np.zeros(2, np.uint64))
        assert dst == bytearray(len(want))  # nothing copied
