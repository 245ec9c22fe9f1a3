"""SIGTERM and SIGINT clean up as an error does, commit points stand, SIGKILL leftovers are swept (issue 29, 8).

Each test runs the CLI in a real child process, stops it at a chosen point
(a function of the library patched to say "here" on a pipe and then block
reading its stdin), sends the signal there, and checks what is left and what
the command said.  No sleeps: the child is known to be at that point.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from cortex_cache import Pool
from cortex_cache import persist as snap
from cortex_cache.disklog import DiskLog
from tests.conftest import our_segments
from tests.helpers import REPO, cli

VALUE = 20_000
CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}

# The child's stop: say "here" on fd SYNC_FD, then wait for a byte on stdin (signals wait too
# inside a commit point, which blocks them; elsewhere the signal interrupts the read).
STOP = """
import os, sys
_stopped = []
def stop():
    if _stopped:
        return
    _stopped.append(1)
    os.write(int(os.environ["SYNC_FD"]), b"!")
    os.read(0, 1)
"""


class Child:
    def __init__(self, patch: str, args: list[str], env: dict | None = None) -> None:
        r, w = os.pipe()
        code = STOP + textwrap.dedent(patch) + f"\nfrom cortex_cache.cli import main\nsys.exit(main({args!r}))\n"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=REPO, pass_fds=(w,), env={**os.environ, "SYNC_FD": str(w), **(env or {})},
        )
        os.close(w)
        self.sync = r

    def wait_stopped(self) -> None:
        got = os.read(self.sync, 1)
        os.close(self.sync)
        assert got == b"!", self.proc.communicate(timeout=60)

    def finish(self, go_on: bool = True) -> tuple[int, str, str]:
        out, err = self.proc.communicate(input=b"g" if go_on else None, timeout=60)
        return self.proc.returncode, out.decode(), err.decode()


def staging_segments() -> list[str]:
    return [p.name for p in our_segments() if snap.STAGING_PREFIX in p.name]


@pytest.fixture
def tier_pool(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K", disk_path=tmp_path / "tier", disk_size="1M")
    for i in range(10):
        p.put(f"k{i}", bytes([i]) * VALUE)
    p.persist()
    p.put("after", b"changed since the snapshot")
    return p


@pytest.fixture
def tmpdir_env(tmp_path):
    d = tmp_path / "tmp"
    d.mkdir(mode=0o700)
    return d, {"TMPDIR": str(d)}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_restore_replace_removes_what_it_made(tier_pool, tmpdir_env, sig):
    tmp, env = tmpdir_env
    child = Child("""
        import cortex_cache.restore as r
        orig = r.restore_entry
        def entry(*a):
            stop()
            return orig(*a)
        r.restore_entry = entry
        """, ["cache", "restore", tier_pool.name, "--replace"], env)
    child.wait_stopped()
    assert staging_segments() and os.listdir(tmp)  # it had made both
    child.proc.send_signal(sig)
    rc, out, err = child.finish(go_on=False)
    assert rc == CODES[sig], (rc, err)
    assert len(err.splitlines()) == 1 and f"interrupted by {sig.name}" in err and "Traceback" not in err, err
    assert staging_segments() == [] and os.listdir(tmp) == []
    with Pool.open(tier_pool.name) as q:  # the pool is as it was
        assert q.get("after") == b"changed since the snapshot" and len(q) == 11


def test_a_signal_at_the_commit_of_a_restore_waits_and_the_restore_reports_success(tier_pool, tmpdir_env):
    tmp, env = tmpdir_env
    child = Child("""
        import cortex_cache.segment as s
        orig = s.replace
        def replace(*a):
            stop()
            return orig(*a)
        s.replace = replace
        """, ["cache", "restore", tier_pool.name, "--replace"], env)
    child.wait_stopped()
    child.proc.send_signal(signal.SIGTERM)  # it waits: the swap is under way
    rc, out, err = child.finish()
    assert rc == 0, (rc, err)
    assert "restored" in out and "SIGTERM arrived after the command had completed" in err, (out, err)
    assert staging_segments() == [] and os.listdir(tmp) == []
    with Pool.open(tier_pool.name) as q:  # the snapshot's contents
        assert q.get("after") is None and q.get("k3") == bytes([3]) * VALUE


def test_a_signal_during_persist_leaves_no_temp_file(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K")
    for i in range(10):
        p.put(f"k{i}", bytes([i]) * VALUE)
    snaps = tmp_path / "snaps"
    child = Child("""
        import cortex_cache.capture as c
        orig = c.gather
        def gather(core, live, which=None):  # every persist's values, a batch at a time
            for batch in orig(core, live, which):
                stop()
                yield batch
        c.gather = gather
        """, ["cache", "persist", p.name], {"CORTEX_CACHE_SNAPSHOT_DIR": str(snaps)})
    child.wait_stopped()
    assert any(".tmp-" in n for n in os.listdir(snaps))
    child.proc.send_signal(signal.SIGTERM)
    rc, out, err = child.finish(go_on=False)
    assert rc == 143 and "interrupted by SIGTERM" in err and len(err.splitlines()) == 1, (rc, err)
    assert os.listdir(snaps) == []


def test_a_signal_during_delete_force_waits_and_the_tier_goes_with_the_pool(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K", disk_path=tmp_path / "tier", disk_size="1M")
    p.put("k", b"v")
    name = p.name
    p.close()
    child = Child("""
        from cortex_cache.disklog import DiskLog
        orig = DiskLog.destroy
        def destroy(path):
            stop()
            return orig(path)
        DiskLog.destroy = staticmethod(destroy)
        """, ["cache", "delete", name, "--force"])
    child.wait_stopped()
    child.proc.send_signal(signal.SIGTERM)
    rc, out, err = child.finish()
    assert rc == 0, (rc, err)
    assert f"deleted pool {name}" in out and "removed disk tier" in out
    assert not Pool.exists(name) and not (tmp_path / "tier").exists()


def test_delete_force_removes_an_orphaned_tier_whose_segment_is_gone(pool_name):
    from cortex_cache.pool import default_disk_path

    p = Pool.create(pool_name, "1M", block_size="4K", tier="disk", disk_size="1M")
    tier = default_disk_path(pool_name)
    assert p.disk_path == tier
    p.close()
    Pool.unlink(pool_name)  # what a delete killed between its two steps left
    for i in range(4):
        os.unlink(os.path.join(tier, f"tier-{i:02d}.log"))
    try:
        r = cli("cache", "delete", pool_name, "--force")
        assert r.returncode == 0, r.stderr
        assert b"orphaned disk tier" in r.stdout
        assert not os.path.exists(tier)
        # Without --force, or with nothing left, it is still "no pool".
        assert cli("cache", "delete", pool_name, "--force").returncode == 66
    finally:
        DiskLog.destroy(tier)


def test_what_a_killed_restore_left_is_reported_by_doctor_and_swept_by_the_next(tier_pool, tmpdir_env):
    tmp, env = tmpdir_env
    child = Child("""
        import cortex_cache.restore as r
        orig = r.restore_entry
        def entry(*a):
            stop()
            return orig(*a)
        r.restore_entry = entry
        """, ["cache", "restore", tier_pool.name, "--replace"], env)
    child.wait_stopped()
    child.proc.kill()
    child.finish(go_on=False)
    left = staging_segments()
    try:
        assert left and os.listdir(tmp)
        r = cli("cache", "doctor", "--json", env=env)
        findings = {f["check"]: f for f in json.loads(r.stdout)["findings"]}
        assert not findings["staging"]["ok"] and "restore" in findings["staging"]["fix"]
        assert not findings["restore-tmp"]["ok"] and "--replace" in findings["restore-tmp"]["fix"]
        r = cli("cache", "restore", tier_pool.name, "--replace", env=env)
        assert r.returncode == 0, r.stderr
        assert staging_segments() == [] and os.listdir(tmp) == []
    finally:
        for n in staging_segments():
            Pool.unlink(n[len(os.environ["CORTEX_CACHE_SHM_PREFIX"]):])


def test_doctor_reports_a_killed_persists_temp_file(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"v")
    snaps = tmp_path / "snaps"
    env = {"CORTEX_CACHE_SNAPSHOT_DIR": str(snaps)}
    child = Child("""
        import cortex_cache.capture as c
        orig = c.capture
        def capture(core):  # before the first entry is read
            stop()
            return orig(core)
        c.capture = capture
        """, ["cache", "persist", p.name], env)
    child.wait_stopped()
    child.proc.kill()
    child.finish(go_on=False)
    (tmpfile,) = [snaps / n for n in os.listdir(snaps)]
    os.utime(tmpfile, (0, 0))  # a minute and more ago
    r = cli("cache", "doctor", "--json", env=env)
    findings = {f["check"]: f for f in json.loads(r.stdout)["findings"]}
    assert not findings["persist-tmp"]["ok"] and tmpfile.name in findings["persist-tmp"]["message"]
    assert f"persist {p.name}" in findings["persist-tmp"]["fix"]
    assert cli("cache", "persist", p.name, env=env).returncode == 0
    assert not tmpfile.exists()


def test_a_signal_during_a_restore_of_a_missing_pool_leaves_no_pool_and_no_new_tier(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K", disk_path=tmp_path / "tier", disk_size="1M")
    for i in range(10):
        p.put(f"k{i}", bytes([i]) * VALUE)
    p.persist()
    name = p.name
    p.close()
    assert cli("cache", "delete", name, "--force").returncode == 0
    assert not (tmp_path / "tier").exists()
    child = Child("""
        import cortex_cache.fill as f
        orig = f.mark
        def mark(*a):
            stop()
            return orig(*a)
        f.mark = mark
        """, ["cache", "restore", name])
    child.wait_stopped()  # the pool is made under its staging name, not published yet
    assert staging_segments() and (tmp_path / "tier").exists()  # the restore made both
    child.proc.send_signal(signal.SIGTERM)
    rc, out, err = child.finish(go_on=False)
    assert rc == 143 and "interrupted by SIGTERM" in err, (rc, err)
    assert staging_segments() == [] and not Pool.exists(name) and not (tmp_path / "tier").exists()


def test_a_signal_during_the_fill_of_a_published_pool_keeps_it_for_the_next_restore(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K", disk_path=tmp_path / "tier", disk_size="1M")
    for i in range(10):
        p.put(f"k{i}", bytes([i]) * VALUE)
    p.persist()
    name = p.name
    p.close()
    assert cli("cache", "delete", name, "--force").returncode == 0
    child = Child("""
        import cortex_cache.fill_columns as f  # the fill by columns (C): one call per batch
        orig = f._write
        calls = []
        def write(*a):
            calls.append(1)
            if len(calls) == 2:
                stop()
            return orig(*a)
        f._write = write
        """, ["cache", "restore", name])
    child.wait_stopped()  # published, one entry in, the second batch reserved
    child.proc.send_signal(signal.SIGTERM)
    rc, out, err = child.finish(go_on=False)
    assert rc == 143 and "interrupted by SIGTERM" in err and "stays" in err and "--if-missing" in err, (rc, err)
    assert staging_segments() == [] and Pool.exists(name)
    with Pool.open(name) as q:  # the interrupted batch gave its reservations back on the way out
        assert len(q) == 1 and q.stats()["writing_entries"] == 0 and q.stats()["fill"]["state"] == "interrupted"
    assert cli("cache", "restore", name, "--if-missing").returncode == 0
    with Pool.open(name) as q:
        assert len(q) == 10 and all(q.get(f"k{i}") == bytes([i]) * VALUE for i in range(10))


def test_a_signal_during_create_leaves_no_segment_and_no_tier(pool_name, tmp_path):
    child = Child("""
        from cortex_cache.diskindex import DiskIndex
        orig = DiskIndex.initialise
        def initialise(*a):
            stop()
            return orig(*a)
        DiskIndex.initialise = staticmethod(initialise)
        """, ["cache", "create", pool_name, "--size", "1M", "--disk-path", str(tmp_path / "tier"), "--disk-size", "1M"])
    child.wait_stopped()
    assert Pool.exists(pool_name) and (tmp_path / "tier").exists()
    child.proc.send_signal(signal.SIGTERM)
    rc, out, err = child.finish(go_on=False)
    assert rc == 143 and "interrupted by SIGTERM" in err, (rc, err)
    assert not Pool.exists(pool_name) and not (tmp_path / "tier").exists()
