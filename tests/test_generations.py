"""Processes follow the pool of a name (issue: engines stayed on a replaced pool's nameless copy).

`restore --replace` and `delete` mark the segment they retire (Pool.superseded); a handle learns of it with
one header load and reopens by name; `status` and delete's guard see processes still on an old copy; the
engine adapters (integrations/pools.py's Attachment) move by themselves.  Real processes, real segments.
"""

from __future__ import annotations

import json
import select

import pytest

from cortex_cache import Pool, PoolNotFound
from cortex_cache.integrations.lmcache import CortexConnector

from .helpers import cli, spawn_py

HOLDER = """
import sys
from cortex_cache import Pool
p = Pool.open(sys.argv[1])
print("open", flush=True)
sys.stdin.readline()
print("superseded" if p.superseded else "current", p.get("k"), flush=True)
"""


def _stop(child) -> bytes:
    out, _ = child.communicate(b"\n", timeout=60)
    return out


def test_restore_replace_marks_the_old_pool_and_a_handle_reopens_the_new_one(make_pool, tmp_path):
    p = make_pool("4M")
    name = p.name
    p.put("k", b"snapshot")
    snap = tmp_path / "s.ccsnap"
    assert cli("cache", "persist", name, "-o", str(snap)).returncode == 0
    p.put("k", b"live")
    child = spawn_py(HOLDER, name)
    try:
        assert child.stdout.readline() == b"open\n"
        assert not p.superseded
        r = cli("cache", "restore", name, "-i", str(snap), "--replace")
        assert r.returncode == 0, r.stderr
        assert p.superseded and p.get("k") == b"live"  # the old copy still works, nameless
        with p.reopen() as q:
            assert not q.superseded and q.get("k") == b"snapshot"
        st = json.loads(cli("cache", "status", name, "--json").stdout)
        row = st["pools"][0] if "pools" in st else st
        assert child.pid in row["attached_old_pids"] and child.pid not in row["attached_pids"]
        table = cli("cache", "status", name).stdout.decode()
        assert "on old copies" in table and str(child.pid) in table
        r = cli("cache", "delete", name)  # someone still maps an old copy: refused without --force
        assert r.returncode != 0 and b"on a copy it replaced" in r.stderr and str(child.pid).encode() in r.stderr
        assert Pool.exists(name)
    finally:
        out = _stop(child)
    assert out.split()[0] == b"superseded"


def test_delete_marks_the_pool_and_reopen_finds_none_then_the_next_one(make_pool):
    p = make_pool("4M")
    name = p.name
    q = Pool.open(name)
    try:
        p.close()
        assert cli("cache", "delete", name, "--force").returncode == 0
        assert q.superseded
        with pytest.raises(PoolNotFound):
            q.reopen()
        with Pool.create(name, "4M") as again:
            again.put("k", b"new")
            with q.reopen() as fresh:
                assert fresh.get("k") == b"new" and not fresh.superseded
    finally:
        q.close()
        if Pool.exists(name):
            Pool.unlink(name)


def _wait(conn: CortexConnector, fid: int) -> tuple:
    while True:
        assert select.select([conn.event_fd()], [], [], 30)[0], "no completion"
        for c in conn.drain_completions():
            if c[0] == fid:
                return c


def test_the_lmcache_adapter_follows_a_replace_a_delete_and_a_create(make_pool, tmp_path, monkeypatch):
    import cortex_cache.integrations.pools as pools

    monkeypatch.setattr(pools, "REATTACH_EVERY", 0.0)
    p = make_pool("8M")
    name = p.name
    try:
        with CortexConnector(pool=name) as conn:
            assert _wait(conn, conn.submit_batch_set(["a"], [bytearray(b"A" * 1000)]))[1]
            snap = tmp_path / "s.ccsnap"
            assert cli("cache", "persist", name, "-o", str(snap)).returncode == 0
            assert _wait(conn, conn.submit_batch_set(["b"], [bytearray(b"B" * 1000)]))[1]
            p.close()
            assert cli("cache", "restore", name, "-i", str(snap), "--replace").returncode == 0
            # The next batch runs on the restored pool: "b" was put after the snapshot.
            assert _wait(conn, conn.submit_batch_exists(["a", "b"]))[3] == [True, False]
            assert _wait(conn, conn.submit_batch_set(["c"], [bytearray(b"C" * 1000)]))[1]
            with Pool.open(name) as now:
                assert len(now) == 2  # a and c (namespaced), in the pool under the name
            assert cli("cache", "delete", name, "--force").returncode == 0
            done = _wait(conn, conn.submit_batch_exists(["a"]))
            assert done[1] is False and "not there" in done[2]  # no pool: the batch fails, never raises
            with Pool.create(name, "8M"):
                assert _wait(conn, conn.submit_batch_set(["d"], [bytearray(b"D" * 10)]))[1]
                with Pool.open(name) as now:
                    assert len(now) == 1
    finally:
        if Pool.exists(name):
            Pool.unlink(name)
