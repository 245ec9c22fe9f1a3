"""The LMCache adapter: LMCache's own harness (in the LMCache venv), and its promises beyond it.

The harness needs LMCache, which lives in a virtualenv of its own
(scripts/lmcache_venv.sh; `.ci/run` builds it, sets
CORTEX_TEST_LMCACHE_PYTHON and runs it with `-m engine`).  Everything else drives the connector exactly
as LMCache does -- submit, wait on the eventfd, drain -- without LMCache.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import pytest

from cortex_cache import Pool, UsageError
from cortex_cache.integrations.lmcache import HEADER_SIZE, CortexConnector
from tests.helpers import REPO, cli, run_py

LMCACHE_PY = os.environ.get("CORTEX_TEST_LMCACHE_PYTHON")


def wait(conn: CortexConnector, fid: int, timeout: float = 30.0):
    """Block on the connector's eventfd, as LMCache does, until future `fid` completes."""
    found = None
    while found is None:
        r, _, _ = select.select([conn.event_fd()], [], [], timeout)
        assert r, "no completion signalled on the eventfd"
        for c in conn.drain_completions():
            if c[0] == fid:
                found = c
    return found


def _adapter_json(pool: str, **extra) -> str:
    return json.dumps({"type": "native_plugin", "module_path": "cortex_cache.integrations.lmcache",
                       "class_name": "CortexConnector", "adapter_params": {"pool": pool, **extra}})


@pytest.mark.engine  # refereed by LMCache's own harness: run by `pytest -m engine`
@pytest.mark.skipif(not LMCACHE_PY, reason="set CORTEX_TEST_LMCACHE_PYTHON to a Python with LMCache "
                                           "(scripts/lmcache_venv.sh; .ci/run does)")
def test_lmcaches_own_harness_passes_every_phase(make_pool):
    pool = make_pool("64M")
    r = subprocess.run(
        [LMCACHE_PY, "-m", "lmcache.v1.basic_check", "--mode", "test_l2_adapter", "--l2-adapter",
         _adapter_json(pool.name), "--num-keys", "200"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONPATH": str(REPO)},
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    # The harness prints failures instead of exiting non-zero: read every phase.
    for line in ("200/200 correctly absent", "Batch store OK", "200/200 found", "Validation (loaded): 200/200",
                 "Validation (content): 200/200"):
        assert line in out, f"{line!r} missing:\n{out[-2000:]}"
    assert "Test Failed" not in out
    assert out.count("100.0%") == 4  # lookup absent, store, lookup present, load
    assert len(pool.keys(prefix="lmcache/")) == 200


@pytest.mark.skipif(not LMCACHE_PY, reason="set CORTEX_TEST_LMCACHE_PYTHON to a Python with LMCache "
                                           "(scripts/lmcache_venv.sh; .ci/run does)")
def test_lmcaches_harness_passes_with_keys_under_the_weights_identity(make_pool, tmp_path):
    from cortex_cache.weights import identity
    from tests.test_weights import _checkpoint

    pool = make_pool("64M")
    ck = _checkpoint(tmp_path / "m", seed=0)
    r = subprocess.run(
        [LMCACHE_PY, "-m", "lmcache.v1.basic_check", "--mode", "test_l2_adapter", "--l2-adapter",
         _adapter_json(pool.name, model_path=str(ck)), "--num-keys", "50"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONPATH": str(REPO)},
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Validation (content): 50/50" in out and "Test Failed" not in out, out[-2000:]
    assert len(pool.keys(prefix=f"lmcache/{identity(ck)}/")) == 50 == len(pool)


def test_values_of_weights_saved_again_under_the_same_path_are_never_served(make_pool, tmp_path, monkeypatch):
    """Issue 43: LMCache's keys name the model, not its weights; with "model_path" (or "weights") the
    identity of the weights leads our keys, so a restart over re-saved weights misses, and the old
    weights' values are retired by their prefix."""
    from cortex_cache.weights import ENV, identity
    from tests.test_weights import _checkpoint

    monkeypatch.delenv(ENV, raising=False)
    p = make_pool("16M")
    ck = _checkpoint(tmp_path / "m", seed=0)
    keys = [f"/m@00000000@0@{i:08x}" for i in range(4)]
    values = [bytes([i + 1]) * 3000 for i in range(4)]
    with CortexConnector(pool=p.name, model_path=str(ck)) as old:
        assert old.namespace == f"lmcache/{identity(ck)}/"
        assert wait(old, old.submit_batch_set(keys, [memoryview(bytearray(v)) for v in values]))[1]
    old_id = identity(ck)
    _checkpoint(ck, seed=1)
    with CortexConnector(pool=p.name, model_path=str(ck)) as new:
        assert wait(new, new.submit_batch_exists(keys))[3] == [False] * 4
        bufs = [bytearray(3000) for _ in keys]
        assert wait(new, new.submit_batch_get(keys, [memoryview(b) for b in bufs]))[3] == [False] * 4
        assert not any(any(b) for b in bufs) and new.stats["foreign"] == 0
    with CortexConnector(pool=p.name, weights="my-ft") as named:  # the operator's name instead
        assert named.namespace == "lmcache/my-ft/"
    assert cli("cache", "evict", p.name, "--prefix", f"lmcache/{old_id}/").returncode == 0
    assert len(p) == 0
    with pytest.raises(UsageError, match="invalid weights"):
        CortexConnector(pool=p.name, weights="a/b")


def test_submissions_return_at_once_and_complete_on_the_eventfd(make_pool):
    p = make_pool("16M")
    with CortexConnector(pool=p.name) as conn:
        keys = [f"model@00000000@0@{i:08x}" for i in range(8)]
        values = [bytes([i]) * (1000 + i) for i in range(8)]
        fid = conn.submit_batch_set(keys, [memoryview(bytearray(v)) for v in values])
        assert isinstance(fid, int)
        assert wait(conn, fid)[1:] == (True, "", [True] * 8)
        assert wait(conn, conn.submit_batch_exists(keys + ["absent"]))[3] == [True] * 8 + [False]
        bufs = [bytearray(len(v)) for v in values]
        assert wait(conn, conn.submit_batch_get(keys, [memoryview(b) for b in bufs]))[3] == [True] * 8
        assert [bytes(b) for b in bufs] == values
        assert wait(conn, conn.submit_batch_delete(keys[:2]))[3] == [True, True]
        assert wait(conn, conn.submit_batch_exists(keys[:3]))[3] == [False, False, True]
        assert conn.drain_completions() == [] and not select.select([conn.event_fd()], [], [], 0)[0]
        assert conn.stats["stored"] == 8 and conn.stats["hits"] == 8
    assert p.stats()["entries"] == 6  # the pool outlives the connector


CHILD_STORE = """
import sys
from cortex_cache.integrations.lmcache import CortexConnector
from tests.test_lmcache import wait
conn = CortexConnector(pool=sys.argv[1])
keys = [f"k{i}" for i in range(20)]
vals = [memoryview(bytearray(bytes([i]) * 70000)) for i in range(20)]
print(wait(conn, conn.submit_batch_set(keys, vals))[1])
conn.close()
"""


def test_chunks_stored_by_one_process_load_in_another(make_pool):
    p = make_pool("16M")
    assert run_py(CHILD_STORE, p.name).stdout.strip() == b"True"
    with CortexConnector(pool=p.name) as conn:
        bufs = [bytearray(70000) for _ in range(20)]
        assert wait(conn, conn.submit_batch_get([f"k{i}" for i in range(20)], bufs))[3] == [True] * 20
        assert all(b == bytes([i]) * 70000 for i, b in enumerate(bufs))


def test_chunks_survive_persist_delete_restore(make_pool, tmp_path):
    p = make_pool("16M")
    name = p.name
    with CortexConnector(pool=name) as conn:
        assert wait(conn, conn.submit_batch_set(["a", "b"], [bytearray(b"A" * 5000), bytearray(b"B" * 9)]))[1]
    snap = tmp_path / "p.ccsnap"
    assert cli("cache", "persist", name, "-o", str(snap)).returncode == 0
    p.close()
    assert cli("cache", "delete", name).returncode == 0
    assert cli("cache", "restore", name, "-i", str(snap)).returncode == 0
    with CortexConnector(pool=name) as fresh:
        bufs = [bytearray(5000), bytearray(9)]
        assert wait(fresh, fresh.submit_batch_get(["a", "b"], bufs))[3] == [True, True]
        assert bufs == [bytearray(b"A" * 5000), bytearray(b"B" * 9)]


def test_foreign_and_corrupt_values_are_misses_never_loaded(make_pool):
    p = make_pool("16M")
    with CortexConnector(pool=p.name) as conn:
        assert wait(conn, conn.submit_batch_set(["good", "bad", "moved"], [bytearray(b"g" * 100)] * 3))[1]
        p.put("lmcache/foreign", b"x" * (HEADER_SIZE + 100))  # not ours: no header
        p.put("lmcache/moved", p.get("lmcache/good"))  # ours, but another key's
        # Corrupt "bad" in place, as a stray write into shared memory would.
        off = p.geometry.data_off + p.info("lmcache/bad")["first_block"] * p.geometry.block_size
        p.core.mv[off + HEADER_SIZE + 5] ^= 0xFF
        bufs = [bytearray(b"?" * 100) for _ in range(5)]
        res = wait(conn, conn.submit_batch_get(["good", "bad", "foreign", "moved", "short"], bufs))
        assert res[3] == [True, False, False, False, False]
        assert bufs[0] == b"g" * 100 and bufs[1] == bytes(100)  # the damaged copy was wiped
        assert all(b == b"?" * 100 for b in bufs[2:])  # the others were never touched
        assert conn.stats["corrupt"] == 1 and conn.stats["foreign"] == 2 and conn.stats["misses"] == 1
        # A buffer of another size than the stored chunk is refused too.
        assert wait(conn, conn.submit_batch_get(["good"], [bytearray(99)]))[3] == [False]
        assert wait(conn, conn.submit_batch_exists(["good", "foreign", "moved"]))[3] == [True, False, False]


def test_a_full_pool_fails_the_store_batch_and_says_why(make_pool):
    p = make_pool("1M")
    with CortexConnector(pool=p.name) as conn:
        _, ok, err, per = wait(conn, conn.submit_batch_set(["small", "huge"], [bytearray(10), bytearray(2 << 20)]))
        assert (ok, per) == (False, [True, False]) and "does not fit" in err
        assert conn.stats["store_failed"] == 1


def test_adapter_params_create_and_errors(tmp_path, pool_name):
    with pytest.raises(UsageError):
        CortexConnector(pool="")
    with pytest.raises(UsageError):
        CortexConnector(pool=pool_name, sizee="1G")
    with pytest.raises(UsageError):
        CortexConnector(pool=pool_name, create=True)  # create needs a size
    assert not Pool.exists(pool_name)
    conn = CortexConnector(pool=pool_name, create=True, size="8M", policy="fifo", disk_path=str(tmp_path / "t"),
                           disk_size="32M")
    try:
        st = conn.pool.stats()
        assert st["policy"] == "fifo" and st["disk"]["capacity_bytes"] == 32 << 20
        again = CortexConnector(pool=pool_name, create=True, size="8M")  # exists: opened, not made again
        again.close()
    finally:
        conn.close()
        conn.close()  # twice is fine
        Pool.unlink(pool_name)
    with pytest.raises(RuntimeError):
        conn.submit_batch_exists(["x"])


def test_importing_cortex_cache_never_imports_lmcache():
    out = run_py("""
        import sys, cortex_cache
        from cortex_cache.integrations import lmcache
        from cortex_cache import Pool
        print("lmcache" in sys.modules, "torch" in sys.modules)
    """).stdout
    assert out.split() == [b"False", b"False"]
    assert sys.modules.get("lmcache") is None or LMCACHE_PY
