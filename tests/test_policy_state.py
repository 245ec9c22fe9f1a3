"""The eviction policy's state across a persist and a restore (cortex_cache/policy_state.py).

For every policy (auto in each of its three regimes): a pool runs a workload, is persisted with its
policy state, restored under another name (in another process, through the background fill; or from a
self-contained file, in the foreground) and given the state back; then the pool that never stopped and
the restored one take the same requests and must answer every one alike, and end with the same keys.
Also: the state as a blob (its bytes as documented, the same bytes twice), entries put and read while
the fill ran, and blobs that are absent, damaged, of another version or of another policy (ignored,
saying why, the pool as the restore left it).

The snapshot carries the blob itself (the version 4 manifest's "policy" section, the bytes before a
version 6 file's records); benchmarks/restart.py restores with it, or without for the contrast.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from benchmarks import restart, workloads
from cortex_cache import Pool, policy_state, snapfile
from cortex_cache.errors import SnapshotCorrupt
from cortex_cache.queues import AUTO_LOOP
from cortex_cache.snapshot import latest_path
from tests.helpers import REPO, cli

BS = 64
N = 100


def loop_keys(n: int, laps: int, seed: int = 1) -> list[int]:
    """A loop over 1.25 n keys with one-shot keys between its steps (test_auto.py's)."""
    rng = np.random.default_rng(seed)
    span, out, fresh = int(1.25 * n), [], 1 << 40
    for i in range(laps * span):
        while rng.random() < 0.2:
            out.append(fresh)
            fresh += 1
        out.append(i % span)
    return out


def read_back(n: int, gap: int = 40, first: int = 0) -> list[int]:
    """Every new key read again `gap` puts later: keys come back from queue 0's ghosts (auto: recency)."""
    keys = []
    for k in range(first, first + 30 * n):
        keys.append(k)
        if k - first >= gap:
            keys.append(k - gap)
    return keys


def hot_and_scan(n: int, first: int, warm: int = 4) -> list[int]:
    """A hot set read `warm` times over, then a scan of one-shot keys, then the hot set again (auto stays
    in its frequency regime, and keeps the hot set through the scan)."""
    hot = [(1 << 20) + i for i in range(n // 2)]
    return hot * warm + list(range(first, first + 2 * n)) + hot * 2


def aging(n: int, seed: int) -> tuple[list[int], list[int]]:
    """LFU's case: a set read often long ago, then a newer set read a few times among one-shot keys (the
    epochs pass and halve the old counts); then requests over both sets and new keys."""
    rng = np.random.default_rng(seed)
    old, new = list(range(1000, 1000 + n // 3)), list(range(2000, 2000 + n // 2))
    first = old * 12
    fresh = iter(range(1 << 30, 1 << 31))
    for _ in range(4):
        for k in new:
            first += [k, next(fresh), next(fresh)]
    then = [int(k) if k >= 0 else next(fresh) for k in rng.choice(old + new + [-1] * (n // 2), 6 * n)]
    return first, then


def _halves(cls: str) -> tuple[list[int], list[int]]:
    keys = workloads.generate(cls, N).tolist()
    return keys[: len(keys) // 2], keys[len(keys) // 2 :]


# name: (policy, create options, phase 1 keys, phase 2 keys, auto's regime after phase 1 or None)
SCENARIOS = {
    "lru": ("lru", {}, *_halves("zipf+scan"), None),
    "lfu": ("lfu", {"lfu_period": 16}, *aging(N, 5), None),
    "fifo": ("fifo", {}, *_halves("mixed"), None),
    "priority": ("priority", {}, *_halves("zipf+scan"), None),
    "ttl": ("ttl", {}, *_halves("zipf"), None),
    "size": ("size", {}, *_halves("zipf+scan"), None),
    "s3fifo": ("s3fifo", {}, *_halves("mixed"), None),
    "arc": ("arc", {}, *_halves("short-reuse"), None),
    "auto-frequency": ("auto", {}, hot_and_scan(N, 1 << 30), hot_and_scan(N, 1 << 31, 0), "frequency"),
    "auto-recency": ("auto", {}, read_back(N), read_back(N, first=1 << 30)[: 20 * N], "recency"),
    "auto-loop": ("auto", {}, loop_keys(N, 8), loop_keys(N, 4, seed=2), "loop"),
}


def put_for(policy: str, p: Pool, kb: bytes, k: int) -> None:
    """A put that gives the policy something to order by (values of 1..64 bytes, priorities, TTLs)."""
    if policy == "priority":
        p.put(kb, b"v" * 16, priority=k % 4)
    elif policy == "ttl":
        p.put(kb, b"v" * 16, ttl=3600 + (k % 5) * 60 if k % 3 else None)
    elif policy == "size":
        p.put(kb, b"v" * (1 + k * 7 % BS))
    else:
        p.put(kb, b"v" * 16)


def replay(p: Pool, policy: str, keys: list[int]) -> list[bool]:
    """Each key as a request: a get, and on a miss a put.  Which requests hit."""
    out = []
    for k in keys:
        kb = b"%d" % k
        hit = p.get(kb) is not None
        out.append(hit)
        if not hit:
            put_for(policy, p, kb, k)
    return out


def regime(p: Pool) -> str:
    q = p.core.queues
    if int(q.header[0]["q_regime"]) == AUTO_LOOP:
        return "loop"
    return "frequency" if q.frequency_regime() else "recency"


def queue_state(p: Pool) -> dict:
    """What a queue pool's choices depend on, keyed by key: per entry (queue, freq, qseq), the rings'
    windows, and the queue header's learnt words."""
    core, q = p.core, p.core.queues

    def grab():
        sealed = np.flatnonzero(core.columns["state"] == 2)
        per = {core.key_bytes(int(i)): (int(q.cols["queue"][i]), int(q.cols["freq"][i]), int(q.cols["qseq"][i]))
               for i in sealed}
        qh = q.header[0]
        rings = [policy_state._window(g.hashes, int(qh[f"g{r}_head"]), int(qh[f"g{r}_tail"])).tolist()
                 for r, g in enumerate(q.ghosts)]
        words = {w: qh[w].item() for w in ("q_count0", "q_count1", "q_target", "q_seq", "q_regime", "q_ghost_rate",
                                           "q_hit_rate", "g0_live", "g1_live")}
        return per, rings, words

    return core.locked(grab)



def first_phase(make_pool, scenario: str) -> tuple[Pool, str, list[int]]:
    """A pool of SCENARIOS[scenario] that has run its first phase (evicting, in the regime it names): the
    pool, its policy, the next phase's keys."""
    policy, opts, first, then, want_regime = SCENARIOS[scenario]
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy=policy, **opts)
    replay(a, policy, first)
    assert a.stats()["evictions"] > 0
    if want_regime:
        assert regime(a) == want_regime, "the workload missed the regime: the test missed its point"
    return a, policy, then


RESTORE_IN_CHILD = """
import json, sys
from benchmarks import restart
blob = open(sys.argv[1], "rb").read()
pool, report = restart.restore(blob, sys.argv[2], name=sys.argv[3])
pool.close()
print(json.dumps(report))
"""


WORK_DURING_FILL = """
import sys
from cortex_cache import Pool
name, newest, oldest = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
with Pool.open(name) as other:
    assert other.get(newest) is not None  # loaded in the first batch: a hit
    other.put(b"fresh", b"new")
    other.put(oldest, b"newer value")  # not loaded yet: the fill will skip it
"""


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_restored_pool_evicts_as_the_pool_that_never_stopped(make_pool, restored, snapshot_dir, tmp_path,
                                                                  scenario):
    """Through the background fill, restored and given its state in another process: every request of
    the next phase hits or misses as in the pool that never stopped, and both end with the same keys
    (and, for the queue policies, the same queues, read counts, places, ghosts and learnt words)."""
    a, policy, then = first_phase(make_pool, scenario)
    _, blob = restart.persist(a)
    (tmp_path / "state").write_bytes(blob)
    name = f"{a.name}-r"
    out = subprocess.run([sys.executable, "-c", RESTORE_IN_CHILD, str(tmp_path / "state"), str(latest_path(a.name)),
                          name], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    b = Pool.open(name)
    restored.append(b)
    assert report["applied"] and report["note"] is None
    if a.core.queues is not None:
        assert queue_state(b) == queue_state(a)
        assert report["entries"] == N
    assert replay(b, policy, then) == replay(a, policy, then)
    assert sorted(b.keys()) == sorted(a.keys())
    assert b.verify()["ok"]


@pytest.mark.parametrize("scenario", ["lfu", "s3fifo", "arc", "auto-loop"])
def test_a_pool_restored_in_the_foreground_gets_its_state_too(make_pool, restored, tmp_path, scenario):
    """From a self-contained file (persist --output: verified and filled whole before it is published)."""
    policy, opts, first, then, _ = SCENARIOS[scenario]
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy=policy, **opts)
    replay(a, policy, first)
    _, blob = restart.persist(a, tmp_path / "a.ccsnap")
    b, report = restart.restore(blob, tmp_path / "a.ccsnap", name=f"{a.name}-r")
    restored.append(b)
    assert report["applied"]
    if a.core.queues is not None:
        assert queue_state(b) == queue_state(a)
    assert replay(b, policy, then) == replay(a, policy, then)


@pytest.mark.parametrize("scenario", ["lfu", "s3fifo", "arc", "auto-frequency", "auto-loop"])
def test_without_its_state_a_restored_pool_evicts_otherwise(make_pool, restored, snapshot_dir, scenario):
    """The contrast that makes the tests above mean something: the same restore without the state
    answers the next phase differently (the restore alone cannot bring back what the blob carries)."""
    policy, opts, first, then, _ = SCENARIOS[scenario]
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy=policy, **opts)
    replay(a, policy, first)
    restart.persist(a, state=False)
    b, report = restart.restore(None, latest_path(a.name), name=f"{a.name}-r")
    restored.append(b)
    assert report is None
    assert replay(b, policy, then) != replay(a, policy, then)


def test_entries_put_and_read_while_the_fill_ran_keep_their_place(make_pool, restored, snapshot_dir):
    """Another process works on the pool while its fill runs: a key put then (new) stays newer than every
    restored entry of its queue; a restored key read then keeps that read on top of its restored count;
    a key of the snapshot put again before the fill reached it keeps the new value's state."""
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy="s3fifo")
    replay(a, "s3fifo", _halves("mixed")[0])
    newest = b"read once"  # the most recently used: the fill's first entry
    a.put(newest, b"v")
    assert a.get(newest) == b"v"
    _, blob = restart.persist(a)
    q = a.core.queues
    keys = a.keys()
    slot = {k: a.core.locked(a.core.find, k, xxhash.xxh3_64_intdigest(k)) for k in keys}
    oldest = min(keys, key=lambda k: int(a.core.columns["access_seq"][slot[k]]))  # among the fill's last
    freq_before = int(q.cols["freq"][slot[newest]])
    assert freq_before == 1
    name = f"{a.name}-r"
    seen = []

    def during_fill(done: int, total: int) -> None:
        if seen:
            return
        seen.append(done)
        out = subprocess.run([sys.executable, "-c", WORK_DURING_FILL, name, newest.hex(), oldest.hex()], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr

    b, report = restart.restore(blob, latest_path(a.name), name=name, progress=during_fill)
    restored.append(b)
    assert seen and report["applied"]
    qb, core = b.core.queues, b.core
    find = {k: core.locked(core.find, k, xxhash.xxh3_64_intdigest(k)) for k in b.keys()}
    assert b.get(oldest) == b"newer value"
    restored_q0 = [int(qb.cols["qseq"][i]) for k, i in find.items() if k not in (b"fresh", oldest)
                   and qb.cols["queue"][i] == 0]
    assert int(qb.cols["queue"][find[b"fresh"]]) == 0
    assert int(qb.cols["qseq"][find[b"fresh"]]) > max(restored_q0)
    assert int(qb.cols["qseq"][find[oldest]]) > max(restored_q0)
    assert int(qb.cols["freq"][find[newest]]) == 2  # its read before the persist, and the one during the fill
    assert b.verify()["ok"]


def test_the_blob_is_laid_out_as_documented(make_pool):
    """policy_state's docstring: a 24-byte head, 24-byte directory entries, values padded to 8 bytes, an
    xxh3_64 trailer; the same pool gives the same bytes twice (no hash(), nothing of the process)."""
    assert (policy_state.HEAD.size, policy_state.ENTRY.size, policy_state.TRAILER.size) == (24, 24, 8)
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy="auto")
    replay(a, "auto", loop_keys(N, 3))
    blob = policy_state.capture(a.core)
    assert blob == policy_state.capture(a.core)
    magic, version, pid, n_fields, reserved, total = struct.unpack_from("<4sHHIIQ", blob, 0)
    assert (magic, version, pid, reserved, total) == (b"CCPS", 1, 8, 0, len(blob))
    assert struct.unpack_from("<Q", blob, total - 8)[0] == xxhash.xxh3_64_intdigest(blob[:-8])
    pos = 24 + 24 * n_fields
    seen = {}
    for k in range(n_fields):
        name, kind, count = struct.unpack_from("<8s8sQ", blob, 24 + 24 * k)
        name, kind = name.rstrip(b"\0").decode(), kind.rstrip(b"\0").decode()
        assert policy_state.FIELDS[name][0] == kind
        seen[name] = np.frombuffer(blob, kind, count, pos)
        size = count * np.dtype(kind).itemsize
        pos += size + (-size % 8)
    assert pos == total - 8
    assert seen["hash"].size == a.stats()["entries"] == seen["qseq"].size
    assert seen["qregime"][0] == int(a.core.queues.header[0]["q_regime"])


def _damage(blob: bytes, kind: str) -> bytes:
    """A blob made wrong in one way (a checksum recomputed where the damage is not the checksum's)."""
    head = bytearray(blob[:-8])
    if kind == "flipped":
        b = bytearray(blob)
        b[len(b) // 2] ^= 0x40
        return bytes(b)
    if kind == "truncated":
        return blob[: len(blob) // 2]
    if kind == "empty":
        return b""
    if kind == "version":
        struct.pack_into("<H", head, 4, 2)
    elif kind == "policy":
        struct.pack_into("<H", head, 6, 0)  # lru's
    elif kind == "unknown policy":
        struct.pack_into("<H", head, 6, 99)
    elif kind == "count":  # a per-entry field one value short of the hashes
        n_fields = struct.unpack_from("<I", head, 8)[0]
        for k in range(n_fields):
            name, kind_b, count = struct.unpack_from("<8s8sQ", head, 24 + 24 * k)
            if name.rstrip(b"\0") == b"freq":
                struct.pack_into("<Q", head, 24 + 24 * k + 16, count - 1)
    elif kind == "target":  # auto's share of 7.5 entries in 1
        n_fields = struct.unpack_from("<I", head, 8)[0]
        pos = 24 + 24 * n_fields
        for k in range(n_fields):
            name, kind_b, count = struct.unpack_from("<8s8sQ", head, 24 + 24 * k)
            if name.rstrip(b"\0") == b"qtarget":
                struct.pack_into("<d", head, pos, 7.5)
            size = count * np.dtype(kind_b.rstrip(b"\0").decode()).itemsize
            pos += size + (-size % 8)
    return bytes(head) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(head)))


@pytest.mark.parametrize("kind", ["flipped", "truncated", "empty", "version", "policy", "unknown policy", "count",
                                  "target"])
def test_a_bad_blob_is_ignored_and_the_restore_stands(make_pool, restored, snapshot_dir, kind):
    """A damaged blob, one of another version or policy, or one whose values are out of range: apply
    says why, changes nothing, and the pool serves what the restore brought back (as without a blob)."""
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy="auto")
    replay(a, "auto", loop_keys(N, 4))
    _, blob = restart.persist(a)
    b = Pool.restore(latest_path(a.name), name=f"{a.name}-r")
    restored.append(b)
    before = queue_state(b)
    columns = {c: b.core.columns[c].copy() for c in ("lfu_epoch", "access_seq", "insert_seq")}
    report = b.core.locked(policy_state.apply, b.core, _damage(blob, kind))
    assert not report["applied"] and report["note"] and report["entries"] == 0
    words = {"flipped": "checksum", "truncated": "checksum", "empty": "too short", "version": "version 2",
             "policy": "lru's", "unknown policy": "does not know", "count": "freq", "target": "out of range"}
    assert words[kind] in report["note"]
    assert queue_state(b) == before
    assert all(np.array_equal(b.core.columns[c], v) for c, v in columns.items())
    assert sorted(b.keys()) == sorted(a.keys()) and b.verify()["ok"]


def test_a_blob_from_before_the_state_existed_restores_as_today(make_pool, restored, snapshot_dir):
    """No blob (a snapshot written before it, or one whose section is missing): the pool restores with the
    entries' own metadata, LRU order exactly, the queue pools with every entry in queue 0 again."""
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy="lru")
    replay(a, "lru", _halves("zipf")[0])
    restart.persist(a, state=False)
    b, report = restart.restore(None, latest_path(a.name), name=f"{a.name}-r")
    restored.append(b)
    then = _halves("zipf")[1]
    assert report is None and replay(b, "lru", then) == replay(a, "lru", then)
    q = make_pool(N * BS, block_size=BS, max_entries=N, policy="auto")
    replay(q, "auto", loop_keys(N, 4))
    restart.persist(q, state=False)
    c, _ = restart.restore(None, latest_path(q.name), name=f"{q.name}-r")
    restored.append(c)
    per, _, words = queue_state(c)
    assert {v[0] for v in per.values()} == {0} and words["g0_live"] == 0 and c.verify()["ok"]


def test_the_blob_keys_entries_by_hash_not_by_slot(make_pool, restored, tmp_path):
    """The restored pool lays its slots out as it likes (the fill loads most recent first): each key's
    state follows it, whatever slot it landed in."""
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy="arc")
    replay(a, "arc", _halves("short-reuse")[0])
    _, blob = restart.persist(a, tmp_path / "a.ccsnap")
    b, _ = restart.restore(blob, tmp_path / "a.ccsnap", name=f"{a.name}-r")
    restored.append(b)
    slot_a = {k: a.core.locked(a.core.find, k, xxhash.xxh3_64_intdigest(k)) for k in a.keys()}
    slot_b = {k: b.core.locked(b.core.find, k, xxhash.xxh3_64_intdigest(k)) for k in a.keys()}
    assert any(slot_a[k] != slot_b[k] for k in slot_a), "slots alike: the test cannot tell hash from slot"
    assert queue_state(b) == queue_state(a)


# ---------------------------------------------------------------- a self-contained file (persist --output)


def _restore_cli(path, name: str) -> dict:
    """`cortex cache restore NAME --input FILE --json` in a process of its own: its report."""
    r = cli("cache", "restore", name, "--input", str(path), "--json")
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_pool_restored_from_a_self_contained_file_evicts_as_the_pool_that_never_stopped(
        make_pool, restored, tmp_path, scenario):
    """`persist --output` (version 6) carries the policy state itself: persisted and restored by the CLI,
    each in a process of its own, with no blob handed over, the restored pool answers the next phase as
    the pool that never stopped, and ends with the same keys (and queues, ghosts and learnt words)."""
    a, policy, then = first_phase(make_pool, scenario)
    path = tmp_path / "a.ccsnap"
    r = cli("cache", "persist", a.name, "--output", str(path))
    assert r.returncode == 0, r.stderr.decode()
    with snapfile.Snapshot(path) as s:
        assert s.header.version == snapfile.VERSION == 6 and s.policy_state()
    report = _restore_cli(path, f"{a.name}-r")
    b = Pool.open(f"{a.name}-r")
    restored.append(b)
    assert report["policy_state"]["applied"] and report["policy_state"]["note"] is None
    if a.core.queues is not None:
        assert queue_state(b) == queue_state(a)
    assert replay(b, policy, then) == replay(a, policy, then)
    assert sorted(b.keys()) == sorted(a.keys())
    assert b.verify()["ok"]


def _as_version_2(path, out) -> None:
    """The file `persist --output` wrote before version 6, made from a version 6 one: the same header with
    version 2 and no policy state length, no policy state, the trailer's checksum over what is left."""
    raw = path.read_bytes()
    (config_len,) = struct.unpack_from("<I", raw, 200)
    (state_len,) = struct.unpack_from("<Q", raw, snapfile.POLICY_AT_OFFSET)
    head = bytearray(raw[:312])
    struct.pack_into("<I", head, 8, 2)
    struct.pack_into("<Q", head, snapfile.POLICY_AT_OFFSET, 0)
    body = bytes(head) + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + raw[320 : 320 + config_len]
    body += raw[320 + config_len + state_len : -32]
    _magic, entries, nbytes, _check = struct.unpack_from("<8sQQQ", raw, len(raw) - 32)
    out.write_bytes(body + struct.pack("<8sQQQ", b"CRTXEND\0", entries, nbytes, xxhash.xxh3_64_intdigest(body)))
    out.chmod(0o600)


def test_a_self_contained_file_of_version_2_still_restores(make_pool, restored, tmp_path):
    """A file written before version 6 (no policy state): it restores, every entry, with no state applied
    (report None), as before; and the same file with the state restores it."""
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy="s3fifo")
    replay(a, "s3fifo", _halves("mixed")[0])
    a.persist(tmp_path / "v5.ccsnap")
    _as_version_2(tmp_path / "v5.ccsnap", tmp_path / "v2.ccsnap")
    with snapfile.Snapshot(tmp_path / "v2.ccsnap") as s:  # verified whole: a well-formed version 2 file
        assert s.header.version == 2 and s.policy_state() is None
    report = _restore_cli(tmp_path / "v2.ccsnap", f"{a.name}-2")
    b = Pool.open(f"{a.name}-2")
    restored.append(b)
    assert report["policy_state"] is None and report["entries"] == a.stats()["entries"]
    assert sorted(b.keys()) == sorted(a.keys()) and b.verify()["ok"]
    per, _, words = queue_state(b)
    assert {v[0] for v in per.values()} == {0} and words["g0_live"] == 0  # as a restore without state
    assert _restore_cli(tmp_path / "v5.ccsnap", f"{a.name}-5")["policy_state"]["applied"]
    restored.append(Pool.open(f"{a.name}-5"))


@pytest.mark.parametrize("where", ["middle", "head", "last byte"])
def test_a_damaged_policy_state_in_a_self_contained_file_is_ignored_with_a_note(make_pool, restored, tmp_path,
                                                                                where):
    """A version 6 file whose policy state fails its own checks though the file passes its checksum (written
    so): the restored pool gets every entry and no state (the report and one warning say why).  A byte
    flipped after the file was written fails the file's checksum: refused whole, as any other byte."""
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy="auto")
    replay(a, "auto", loop_keys(N, 4))
    path = tmp_path / "a.ccsnap"
    a.persist(path)
    raw = bytearray(path.read_bytes())
    (config_len,) = struct.unpack_from("<I", raw, 200)
    (state_len,) = struct.unpack_from("<Q", raw, snapfile.POLICY_AT_OFFSET)
    raw[320 + config_len + {"middle": state_len // 2, "head": 0, "last byte": state_len - 1}[where]] ^= 0x10
    path.write_bytes(bytes(raw))
    r = cli("cache", "restore", f"{a.name}-x", "--input", str(path))
    assert r.returncode == 65 and b"checksum" in r.stderr and not Pool.exists(f"{a.name}-x")
    struct.pack_into("<Q", raw, len(raw) - 8, xxhash.xxh3_64_intdigest(bytes(raw[:-32])))
    path.write_bytes(bytes(raw))
    r = cli("cache", "restore", f"{a.name}-r", "--input", str(path))
    assert r.returncode == 0, r.stderr.decode()
    b = Pool.open(f"{a.name}-r")
    restored.append(b)
    warning = r.stderr.decode().strip().splitlines()
    assert len(warning) == 1 and "policy state" in warning[0] and ("checksum" in warning[0] or "magic" in warning[0])
    per, _, words = queue_state(b)
    assert {v[0] for v in per.values()} == {0} and words["g0_live"] == 0  # nothing of the blob was laid
    assert sorted(b.keys()) == sorted(a.keys()) and b.verify()["ok"]


def test_older_readers_refuse_a_version_6_file_by_its_version(make_pool, tmp_path, monkeypatch):
    """A reader of versions 1-4 (this one with version 6 taken out of what it reads) refuses the file with
    the usual one line naming its version: never reads the policy state as records."""
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy="arc")
    replay(a, "arc", _halves("short-reuse")[0])
    a.persist(tmp_path / "a.ccsnap")
    monkeypatch.setattr(snapfile, "READS", (1, 2, 3, 4))
    with pytest.raises(SnapshotCorrupt, match="format version 6; this cortex_cache reads versions 1, 2, 3, 4"):
        snapfile.Snapshot(tmp_path / "a.ccsnap")


# ---------------------------------------------------------------- capture in short lock holds


@pytest.mark.parametrize("scenario", ["lfu", "s3fifo", "arc", "auto-loop", "auto-frequency"])
def test_the_blob_taken_in_chunks_is_the_blob_taken_at_once(make_pool, monkeypatch, scenario):
    """capture copies the per-entry state CHUNK_SLOTS slots per lock hold: on a pool nobody changes meanwhile
    the blob is byte for byte the one a single hold gives (so the replay tests above hold for it too)."""
    policy, opts, first, _, _ = SCENARIOS[scenario]
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy=policy, **opts)
    replay(a, policy, first)
    whole = policy_state.capture(a.core)
    holds = []
    plain = a.core.locked
    monkeypatch.setattr(a.core, "locked", lambda fn, *args: holds.append(fn) or plain(fn, *args))
    monkeypatch.setattr(policy_state, "CHUNK_SLOTS", 7)
    assert policy_state.capture(a.core) == whole
    assert holds.count(policy_state._chunk) == -(-a.core.columns["state"].size // 7) > 1


@pytest.mark.parametrize("policy", ["s3fifo", "auto"])
def test_puts_between_the_holds_leave_a_consistent_blob(make_pool, restored, snapshot_dir, monkeypatch, policy):
    """Another writer between capture's holds (puts of new keys that evict, reads): the blob holds no entry
    put after its first hold, no key both as an entry and as a ghost, no qseq past its clock; laid over a
    restore of the pool it gives a pool that checks out, whose rings hold no key of the pool."""
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy=policy)
    replay(a, policy, _halves("mixed")[0])
    for k in range(5):
        a.put(b"unread-%d" % k, b"v" * 16)  # in queue 0, never read: the first a put evicts into a ring
    a.persist()
    chunk = policy_state._chunk
    extra = iter(range(1 << 40, (1 << 40) + 10_000))
    plain = a.core.locked
    gaps: list[int] = []

    chunks = -(-a.core.columns["state"].size // 16)

    def between(fn, *args):  # after each chunk's hold, before the next: the other writer's turn
        got = plain(fn, *args)
        if fn is chunk:
            gaps.append(1)
            # After the last chunk: 15 puts (queue 0's unread entries evicted into its ghosts), every
            # entry copied already.
            for _ in range(15 if len(gaps) == chunks else 2):
                a.put(b"fresh-%d" % next(extra), b"v" * 16)
            for k in a.keys()[:3]:
                a.get(k)
        return got

    with monkeypatch.context() as m:
        m.setattr(policy_state, "CHUNK_SLOTS", 16)
        m.setattr(a.core, "locked", between)
        blob = policy_state.capture(a.core)
    _, fields = policy_state.parse(blob)
    ghosts = np.concatenate([fields["ghosts0"], fields["ghosts1"]])
    unread = [xxhash.xxh3_64_intdigest(b"unread-%d" % k) for k in range(5)]
    assert np.isin(unread, ghosts).all(), "no entry copied, then evicted: the test missed its point"
    assert not np.isin(fields["hash"][fields["hash"] != 0], ghosts[ghosts != 0]).any()
    assert int(fields["qseq"].max()) <= int(fields["qclock"][0])
    fresh = {xxhash.xxh3_64_intdigest(b"fresh-%d" % k) for k in range(1 << 40, (1 << 40) + 10_000)}
    assert not fresh & set(fields["hash"].tolist())
    b = Pool.restore(latest_path(a.name), name=f"{a.name}-r")
    restored.append(b)
    report = b.core.locked(policy_state.apply, b.core, blob)
    assert report["applied"] and b.verify()["ok"]
    per, rings, _ = queue_state(b)
    in_pool = {xxhash.xxh3_64_intdigest(k) for k in per}
    assert not in_pool & {h for ring in rings for h in ring if h}


@pytest.mark.parametrize("stale", [False, True])
def test_apply_prepared_before_its_hold_gives_what_apply_alone_gives(make_pool, restored, snapshot_dir, monkeypatch,
                                                                       stale):
    """prepare matches the blob to the slots without the lock (the fill does it before the hold that ends
    it); apply uses that match only if the slots are still those.  Either way the pool ends as apply alone
    leaves it -- with a put between prepare and apply (stale), apply matches again in its hold."""
    a = make_pool(N * BS, block_size=BS, max_entries=N * 2, policy="auto")
    replay(a, "auto", loop_keys(N, 4))
    blob = policy_state.capture(a.core)
    a.persist()
    states = []
    for k in range(2):
        b = Pool.restore(latest_path(a.name), name=f"{a.name}-{k}")
        restored.append(b)
        ready = None
        if k and stale:
            ready = policy_state.prepare(b.core, blob)
        b.put(b"raced", b"v")  # a put while the fill ran (stale: after the match was made, a slot more)
        if k and not stale:
            ready = policy_state.prepare(b.core, blob)
        matches = []
        match = policy_state._match
        monkeypatch.setattr(policy_state, "_match", lambda *x: matches.append(1) or match(*x))
        report = b.core.locked(policy_state.apply, b.core, blob, ready)
        monkeypatch.setattr(policy_state, "_match", match)
        assert report["applied"] and len(matches) == (0 if k and not stale else 1)
        states.append((queue_state(b), report))
    assert states[0] == states[1]


def test_a_prepared_blob_that_is_ignored_says_why(make_pool):
    a = make_pool(N * BS, block_size=BS, max_entries=N, policy="arc")
    ready = policy_state.prepare(a.core, b"CCPS")
    report = a.core.locked(policy_state.apply, a.core, b"CCPS", ready)
    assert not report["applied"] and "too short" in report["note"]
