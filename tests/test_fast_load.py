"""The LMCache adapter's batched load in C (Fast.load_many, cortex_cache/_fastpath_load.c).

It must answer every key as the Python path does (hits, misses, foreign
headers, wrong lengths, corrupt bytes, with and without verification, with
the pool's own verify_reads), count the same, hand back every pin, answer
SLOW before anything changed when the lock is busy or marked dirty, survive
its handle closed or its segment truncated in the middle of a batch, and
never load torn or wrong bytes while another process overwrites and deletes
the keys it loads.  The header's format is the adapter's, told to the C
call; the C code knows none, and checks any format it is told alike.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from cortex_cache import Pool
from cortex_cache.batch import encoded
from cortex_cache.core import PURE_PYTHON_ENV, SLOW
from cortex_cache.integrations import lmcache
from cortex_cache.integrations.lmcache import HEADER_SIZE, CortexConnector
from cortex_cache.layout import H_DIRTY
from cortex_cache.pool import VERIFY_READS_ENV
from tests.helpers import REPO, spawn_py
from tests.test_lmcache import wait

CTX = mp.get_context("spawn")


@pytest.fixture(autouse=True)
def fast_path_unless_asked(monkeypatch):
    """Handles opened here use the C path, whatever the environment says; the tests ask for the Python
    path where they compare (`_connector(..., "pure")`)."""
    monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)


def _connector(monkeypatch, name: str, path: str, **params) -> CortexConnector:
    """A connector on the C load ("fast") or the Python path ("pure"); its Python-path keys recorded in
    `conn.python_keys`."""
    with monkeypatch.context() as m:
        if path == "pure":
            m.setenv(PURE_PYTHON_ENV, "1")
        else:
            m.delenv(PURE_PYTHON_ENV, raising=False)
        conn = CortexConnector(pool=name, **params)
    assert (conn.pool.core.fast is None) == (path == "pure")
    conn.python_keys = []
    pinned = conn._load_pinned

    def spy(keys, mvs):
        conn.python_keys += keys
        return pinned(keys, mvs)

    conn._load_pinned = spy
    return conn


def _store(conn: CortexConnector, keys: list[str], size: int) -> list[bytes]:
    values = [bytes([i % 250 + 1]) * size for i in range(len(keys))]
    assert wait(conn, conn.submit_batch_set(keys, [bytearray(v) for v in values]))[1:3] == (True, "")
    return values


def _offset(p: Pool, key: str) -> int:
    """Where the stored value of adapter key `key` begins in the segment."""
    return p.geometry.data_off + p.info("lmcache/" + key)["first_block"] * p.geometry.block_size


def _seen(p: Pool, conn: CortexConnector, keys: list[str], sizes: list[int]) -> dict:
    """One batch loaded into fresh buffers: everything either path must answer alike."""
    bufs = [bytearray(b"?" * n) for n in sizes]
    done = wait(conn, conn.submit_batch_get(keys, [memoryview(b) for b in bufs]))
    st = p.stats()
    info = {k: p.info("lmcache/" + k)["access_count"] for k in set(keys) if "lmcache/" + k in p}
    return {"done": done[1:], "bufs": [bytes(b) for b in bufs], "stats": dict(conn.stats),
            "pool": {k: st[k] for k in ("hits", "misses", "pinned_entries")}, "access_count": info}


@pytest.fixture(params=["fast", "pure"])
def path(request):
    return request.param


def _answers(make_pool, monkeypatch, path: str, verify: str) -> tuple[dict, list[str]]:
    if verify == "pool":
        monkeypatch.setenv(VERIFY_READS_ENV, "1")
    else:
        monkeypatch.delenv(VERIFY_READS_ENV, raising=False)
    p = make_pool("16M", block_size="4K")
    conn = _connector(monkeypatch, p.name, path, verify=verify != "off")
    try:
        vals = _store(conn, ["good", "bad", "moved", "long", "cut"], 5000)
        p.put("lmcache/foreign", b"x" * (HEADER_SIZE + 5000))  # not ours: no header
        p.put("lmcache/moved", p.peek("lmcache/good"))  # ours, but another key's
        p.put("lmcache/cut", p.peek("lmcache/cut") + b"!")  # its header's length is not the value's
        p.core.mv[_offset(p, "bad") + HEADER_SIZE + 7] ^= 0xFF  # a stray write into shared memory
        keys = ["good", "bad", "foreign", "moved", "long", "cut", "absent", "good"]
        seen = _seen(p, conn, keys, [5000, 5000, 5000, 5000, 4999, 5000, 5000, 5000])  # long: 1 short
        seen["python_keys"] = conn.python_keys
        assert vals[0] == seen["bufs"][0]
        return seen, keys
    finally:
        conn.close()


@pytest.mark.parametrize("verify", ["on", "off", "pool"])
def test_both_paths_answer_count_and_copy_alike(make_pool, monkeypatch, verify):
    fast, keys = _answers(make_pool, monkeypatch, "fast", verify)
    pure, _ = _answers(make_pool, monkeypatch, "pure", verify)
    assert fast.pop("python_keys") == []  # the C call answered every key
    assert pure.pop("python_keys") == keys
    assert fast == pure
    bad = fast["bufs"][1]
    if verify == "on":
        assert fast["done"][2] == [True, False, False, False, False, False, False, True]
        assert bad == bytes(5000)  # the damaged copy was wiped
        assert (fast["stats"]["corrupt"], fast["stats"]["foreign"], fast["stats"]["misses"]) == (1, 4, 1)
    elif verify == "off":
        assert fast["done"][2] == [True, True, False, False, False, False, False, True]
        assert bad != bytes([2]) * 5000 and bad.count(2) == 4999  # loaded as stored, damage and all
    else:  # the pool's own check refuses it before the adapter sees it: a miss, the buffer untouched
        assert fast["done"][2] == [True, False, False, False, False, False, False, True]
        assert bad == b"?" * 5000 and (fast["stats"]["corrupt"], fast["stats"]["misses"]) == (0, 2)
    assert all(b == b"?" * len(b) for b in fast["bufs"][2:7])  # foreign, wrong lengths, absent: untouched
    assert fast["pool"] == {"hits": 7, "misses": 1, "pinned_entries": 0}


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("size", [1 << 20, 2 << 20], ids=["12MiB", "24MiB"])
def test_large_batches_load_alike_on_the_copy_threads(make_pool, monkeypatch, workers, size):
    # Over the threshold where the C call copies on `workers` threads; 12 MiB a batch is hashed where it
    # lands, 24 MiB streamed past the cache (LOAD_CACHED_BYTES).
    results = []
    for path in ("fast", "pure"):
        p = make_pool("64M")
        conn = _connector(monkeypatch, p.name, path, workers=workers)
        try:
            keys = [f"big{i}" for i in range(12)]
            vals = _store(conn, keys, size)
            p.core.mv[_offset(p, "big5") + HEADER_SIZE + size // 2 + 3] ^= 0x01
            seen = _seen(p, conn, keys + ["absent"], [size] * 13)
            assert seen["bufs"][:5] == vals[:5] and seen["bufs"][6:12] == vals[6:]
            assert seen["bufs"][5] == bytes(size)
            assert conn.python_keys == ([] if path == "fast" else keys + ["absent"])
            results.append(seen)
        finally:
            conn.close()
    assert results[0] == results[1]
    assert results[0]["done"][2] == [True] * 5 + [False] + [True] * 6 + [False]


def test_a_batch_larger_than_the_pin_records_loads_whole(make_pool, monkeypatch, path):
    p = make_pool("16M", block_size="4K")
    n_pins = p.geometry.n_pins
    keys = [f"k{i}" for i in range(n_pins + 100)]
    conn = _connector(monkeypatch, p.name, path)
    try:
        vals = _store(conn, keys, 100)
        if path == "fast":
            # One C call over more keys than there are pin records: the keys past them are left to the
            # Python path, unpinned and uncounted, and every pin taken is given back.
            bufs = [bytearray(100) for _ in keys]
            hits = p.stats()["hits"]
            got = conn._load_fast(keys, bufs)
            assert got == ["hits"] * n_pins + [None] * 100
            assert bufs[:n_pins] == vals[:n_pins] and bufs[n_pins:] == [bytes(100)] * 100
            assert p.stats()["hits"] == hits + n_pins and p.stats()["pinned_entries"] == 0
        # The adapter pins a few hundred keys at a time: the whole batch loads on either path.
        seen = _seen(p, conn, keys, [100] * len(keys))
        assert seen["done"] == (True, "", [True] * len(keys)) and seen["bufs"] == vals
        assert seen["pool"]["pinned_entries"] == 0
        assert conn.python_keys == ([] if path == "fast" else keys)
    finally:
        conn.close()


def _unchanged(p: Pool, conn: CortexConnector, keys: list[str]) -> None:
    """The C call answers SLOW for the whole batch, before any buffer or pin changed (the counters are
    compared by the caller, once the lock can be taken)."""
    bufs = [bytearray(b"?" * 5000) for _ in keys]
    pins = int(np.count_nonzero(p.core.pin_records["pid"]))
    assert conn._load_fast(keys, bufs) is None
    assert bufs == [bytearray(b"?" * 5000)] * len(keys)
    assert int(np.count_nonzero(p.core.pin_records["pid"])) == pins


def test_a_dirty_mark_answers_slow_and_changes_nothing(make_pool, monkeypatch):
    p = make_pool("16M", block_size="4K")
    conn = _connector(monkeypatch, p.name, "fast")
    try:
        keys = ["a", "b", "absent"]
        _store(conn, keys[:2], 5000)
        st = p.stats()
        counts = [p.info("lmcache/" + k)["access_count"] for k in keys[:2]]
        dirty = p.core.counters.cast("B").cast("I")
        dirty[H_DIRTY] = 1  # as a holder killed mid-change leaves it
        _unchanged(p, conn, keys)
        dirty[H_DIRTY] = 0  # nothing was changed: the pool is as it was
        after = p.stats()
        assert (after["hits"], after["misses"], after["repairs"]) == (st["hits"], st["misses"], st["repairs"])
        assert [p.info("lmcache/" + k)["access_count"] for k in keys[:2]] == counts
        dirty[H_DIRTY] = 1
        seen = _seen(p, conn, keys, [5000] * 3)  # the Python path repairs, then loads
        assert seen["done"][2] == [True, True, False] and conn.python_keys == keys
        assert p.stats()["repairs"] == st["repairs"] + 1
    finally:
        conn.close()


HOLD_LOCK = """
import sys
from cortex_cache import Pool
p = Pool.open(sys.argv[1])
def hold():
    print("held", flush=True)
    sys.stdin.readline()
p.core.locked(hold)
p.close()
"""


def test_a_busy_lock_answers_slow_and_changes_nothing(make_pool, monkeypatch):
    p = make_pool("16M", block_size="4K")
    conn = _connector(monkeypatch, p.name, "fast")
    holder = None
    try:
        keys = ["a", "b", "absent"]
        vals = _store(conn, keys[:2], 5000)
        hits = p.stats()["hits"]
        holder = spawn_py(HOLD_LOCK, p.name)
        assert holder.stdout.readline().strip() == b"held", holder.stderr.read()
        _unchanged(p, conn, keys)
        bufs = [bytearray(5000) for _ in keys]
        fid = conn.submit_batch_get(keys, bufs)  # in C if it runs after the release, else waiting for it
        holder.stdin.write(b"\n")
        holder.stdin.flush()
        assert wait(conn, fid)[3] == [True, True, False]
        assert bufs[:2] == vals and holder.wait(30) == 0
        assert p.stats()["hits"] == hits + 2  # the SLOW answer counted nothing
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        conn.close()


def _raw_load(fast, keys: list[str], bufs: list, workers: int = 1):
    """Fast.load_many over adapter keys, as the adapter calls it (verified, hits and misses counted)."""
    enc = encoded(["lmcache/" + k for k in keys])
    return fast.load_many(enc, bufs, lmcache._LOAD_HEADER, b"".join(map(lmcache._digest, keys)), 0, True, workers)


# A format that is not the adapter's: 16 bytes, a 4-byte prefix, the key's 4-byte id at 4, the payload's
# length (u64, little-endian) at 8.
OTHER_HEADER = (16, b"ABCD", 4, 4, 8)


def _other(prefix: bytes, key_id: bytes, n: int, payload: bytes) -> bytes:
    return prefix + key_id + n.to_bytes(8, "little") + payload


@pytest.mark.parametrize("verify", [True, False])
def test_the_header_format_is_the_callers(make_pool, verify):
    p = make_pool("8M", block_size="4K")
    fast = p.core.fast
    if fast is None:
        pytest.skip("the C fast path is not built")
    payload = bytes(range(256)) * 20
    n = len(payload)
    stored = {"hit": _other(b"ABCD", b"id01", n, payload), "other id": _other(b"ABCD", b"id99", n, payload),
              "other prefix": _other(b"ABCE", b"id03", n, payload), "other length": _other(b"ABCD", b"id04", n + 1, payload),
              "short": b"ABCDid05"}
    for k, v in stored.items():
        p.put(k, v)
    p.core.mv[p.geometry.data_off + p.info("hit")["first_block"] * p.geometry.block_size + 16 + 9] ^= 0xFF
    keys = [*stored, "absent"]
    ids = b"id01id02id03id04id05id06"
    bufs = [bytearray(b"?" * n) for _ in keys]
    codes, left = fast.load_many(encoded(keys), bufs, OTHER_HEADER, ids, 0, verify, 1)
    # Hit (or corrupt: its payload was damaged in place, and verified), then foreign four times, then a miss.
    assert left is None and codes == [3 if verify else 0, 2, 2, 2, 2, 1]
    assert bufs[0] == (bytes(n) if verify else p.peek("hit")[16:])
    assert all(b == b"?" * n for b in bufs[1:])
    # Told that the header holds no length and no key id, "other id" and "other length" load.
    codes, _ = fast.load_many(encoded(["other id", "other length"]), [bytearray(n)] * 2, (16, b"ABCD", 0, 0, -1),
                              b"", 0, verify, 1)
    assert codes == [0, 0]


@pytest.mark.parametrize("header", [
    (0, b"", 0, 0, -1), (257, b"", 0, 0, -1),  # no header, or one larger than the C call takes
    (16, b"x" * 17, 0, 0, -1),  # a prefix longer than the header
    (16, b"", 12, 5, -1), (16, b"", -1, 4, -1),  # key bytes outside it
    (16, b"", 0, 0, 9), (16, b"", 0, 0, -2),  # a length field outside it
    (16, b"", 0, 4, -1),  # 4 key bytes a key, but 3 given
    (16, "ABCD", 0, 0, -1), (16, b"", 0, 0), "(16, b'', 0, 0, -1)",  # not the spec's types or shape
])
def test_a_bad_header_spec_is_refused_before_anything_changes(make_pool, header):
    p = make_pool("8M", block_size="4K")
    fast = p.core.fast
    if fast is None:
        pytest.skip("the C fast path is not built")
    p.put("k", b"ABCD" + bytes(12) + b"v" * 100)
    before, count = p.stats(), p.info("k")["access_count"]
    buf = bytearray(b"?" * 100)
    with pytest.raises((ValueError, TypeError)) as e:
        fast.load_many(encoded(["k"]), [buf], header, b"id1", 0, True, 1)
    assert "load_many" in str(e.value) and "\n" not in str(e.value)
    after = p.stats()
    assert buf == b"?" * 100 and p.info("k")["access_count"] == count
    assert (after["hits"], after["misses"], after["pinned_entries"]) == (before["hits"], before["misses"], 0)


def test_pins_left_by_a_lock_busy_after_the_copies_are_released(make_pool, monkeypatch):
    # Another handle takes the lock while the C call copies without the GIL: the call cannot take it
    # again at once and hands its pins back; the caller releases them, waiting for the lock.
    size = 2 << 20
    p = make_pool("48M")
    conn = _connector(monkeypatch, p.name, "fast")
    other = Pool.open(p.name)
    keys = [f"k{i}" for i in range(16)]
    pids = p.core.pin_records["pid"]
    try:
        vals = _store(conn, keys, size)
        left_seen = tries = 0
        # The race is the point: on a loaded machine the grabbing thread may not get the GIL while the
        # copies run, so try until it has won a few times (each try is checked whole either way).
        while left_seen < 3 and tries < 200:
            tries += 1
            loading, holding, release = threading.Event(), threading.Event(), threading.Event()

            def grab():
                while not np.count_nonzero(pids) and loading.is_set():
                    pass  # the pins appear, and the copies run without the GIL
                if loading.is_set():
                    other.core.locked(lambda: (holding.set(), release.wait(30)))

            bufs = [bytearray(size) for _ in keys]
            loading.set()
            t = threading.Thread(target=grab)
            t.start()
            try:
                codes, left = _raw_load(conn.pool.core.fast, keys, bufs)
                loading.clear()
                if left:
                    left_seen += 1
                    assert holding.is_set() and len(left) == len(keys)
                    assert int(np.count_nonzero(pids)) == len(keys)  # still pinned
            finally:
                loading.clear()
                release.set()
                t.join()
            if left:
                conn.pool.core.release_pins(left)
            assert codes == [0] * len(keys) and bufs == vals
            assert int(np.count_nonzero(pids)) == 0 and p.stats()["pinned_entries"] == 0
        print(f"{left_seen} of {tries} loads found the lock taken after their copies")
        assert left_seen, "the lock was never taken during the copies: the test missed its point"
    finally:
        other.close()
        conn.close()


def test_a_handle_closed_during_a_load_never_crashes_or_answers_wrong(make_pool, monkeypatch):
    size = 2 << 20
    p = make_pool("48M")
    keys = [f"k{i}" for i in range(16)]
    with _connector(monkeypatch, p.name, "fast") as conn:
        vals = _store(conn, keys, size)
    pids = p.core.pin_records["pid"]
    closed_mid_copy = 0
    for _ in range(10):
        h = Pool.open(p.name)
        fast, bufs, out = h.core.fast, [bytearray(size) for _ in keys], []

        def load():
            try:
                out.append(_raw_load(fast, keys, bufs))
            except ValueError as e:  # closed before the call began
                out.append(e)

        before = int(np.count_nonzero(pids))
        t = threading.Thread(target=load)
        t.start()
        while int(np.count_nonzero(pids)) == before and t.is_alive():
            pass  # until the batch is pinned, and copying without the GIL
        h.close()
        t.join()
        if isinstance(out[0], ValueError):
            assert "closed" in str(out[0])
            continue
        codes, left = out[0]
        assert left is None
        if codes == [SLOW] * len(keys):
            closed_mid_copy += 1  # its pins go with the process, as a closed handle's views do
        else:
            assert codes == [0] * len(keys) and bufs == vals
    print(f"{closed_mid_copy} of 10 handles closed during their copies")
    assert closed_mid_copy, "no close landed during the copies: the test missed its point"
    with CortexConnector(pool=p.name) as again:  # the pool is whole for every other handle
        bufs = [bytearray(size) for _ in keys]
        assert wait(again, again.submit_batch_get(keys, bufs))[3] == [True] * len(keys) and bufs == vals
    assert p.verify()["problems"] == []


TRUNCATED_LOADER = """
import json, os, sys
from cortex_cache.integrations.lmcache import CortexConnector
from tests.test_lmcache import wait
conn = CortexConnector(pool=sys.argv[1])
keys = [f"k{i}" for i in range(8)]
assert wait(conn, conn.submit_batch_set(keys, [bytearray(1 << 20) for _ in keys]))[1]
answered = []


class Recorded:  # the fast path, its load_many's answers recorded
    def __init__(self, fast):
        self.fast = fast

    def __getattr__(self, name):
        return getattr(self.fast, name)

    def load_many(self, *args):
        r = self.fast.load_many(*args)
        answered.append("SLOW" if r is SLOW else ["SLOW" if c is SLOW else c for c in r[0]])
        return r


if conn.pool.core.fast is not None:
    from cortex_cache.core import SLOW
    conn.pool.core.fast = Recorded(conn.pool.core.fast)
print("ready", flush=True)
sys.stdin.readline()
done = wait(conn, conn.submit_batch_get(keys, [bytearray(1 << 20) for _ in keys]))
print(json.dumps([answered, done[1], done[2].split(":")[0], done[3]]))
conn.close()
"""


def test_a_segment_truncated_under_a_load_fails_the_batch_not_the_process(make_pool, path):
    from cortex_cache import segment

    p = make_pool("32M")
    env = {**os.environ, PURE_PYTHON_ENV: "1" if path == "pure" else "0"}
    loader = subprocess.Popen([sys.executable, "-c", TRUNCATED_LOADER, p.name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        assert loader.stdout.readline().strip() == "ready", loader.stderr.read()
        os.truncate(segment.shm_path(p.name), p.geometry.data_off + 4096)  # the values' pages are gone
        out, err = loader.communicate("go\n", timeout=60)
    finally:
        if loader.poll() is None:
            loader.kill()
    assert loader.returncode == 0, f"the loader died (status {loader.returncode}):\n{err[-2000:]}"
    answered, ok, error, per_key = json.loads(out.splitlines()[-1])
    # The C call copied from zero pages, found the segment gone and left every key to the Python path.
    assert answered == ([["SLOW"] * 8] if path == "fast" else [])
    assert (ok, error, per_key) == (False, "SegmentCorrupt", [False] * 8)


def _churn(name: str, size: int, rounds: int, ready, done) -> None:
    """Overwrite (in two sizes) and delete the keys k0..k7 until `done`, at least `rounds` times."""
    conn = CortexConnector(pool=name, workers=1)
    try:
        n = 0
        while n < rounds or not done.is_set():
            key = f"k{n % 8}"
            wait(conn, conn.submit_batch_set([key], [bytearray(bytes([n % 250 + 1]) * (size + n % 2 * 4096))]))
            if n % 5 == 0:
                wait(conn, conn.submit_batch_delete([f"k{(n * 3) % 8}"]))
            n += 1
            if n == 16:
                ready.set()
    finally:
        conn.close()


@pytest.mark.parametrize("verify", [True, False])
def test_loads_racing_another_process_never_see_wrong_bytes(make_pool, pool_name, monkeypatch, verify):
    # 8 x 1 MiB a batch: copied on two threads while another process overwrites and deletes the keys.
    name = f"{pool_name}-race"
    size = 1 << 20
    p = make_pool("48M", name=name)
    ready, done = CTX.Event(), CTX.Event()
    w = CTX.Process(target=_churn, args=(name, size, 200, ready, done))
    w.start()
    conn = _connector(monkeypatch, name, "fast", verify=verify, workers=2)
    try:
        assert ready.wait(60)
        keys = [f"k{i}" for i in range(8)]
        loaded = 0
        for _ in range(150):
            bufs = [bytearray(size) for _ in keys]
            for ok, b in zip(wait(conn, conn.submit_batch_get(keys, bufs))[3], bufs):
                if ok:
                    assert b[0] != 0 and b.count(b[0]) == size, "a loaded value is torn or not what was stored"
                    loaded += 1
                else:
                    assert b == bytes(size)  # absent or of the other size: untouched
        assert loaded > 50 and conn.stats["corrupt"] == 0
    finally:
        done.set()
        w.join(120)
        conn.close()
    assert w.exitcode == 0
    assert p.stats()["pinned_entries"] == 0 and p.verify()["problems"] == []
