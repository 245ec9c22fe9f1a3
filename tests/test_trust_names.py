"""Pool names another user can take, listings they can slow down, tables they can fill (issue 29: 3, 10-12).

- A pool opened by name on a user's behalf (create --if-missing, restore,
  the engine adapters) must be that user's or root's: under the shared
  default prefix anyone can take a name first, and forge its header.
- Running out of file descriptors is a temporary failure (75), and a failed
  create leaves nothing behind.
- Listing and sweeping ignore what is not ours; persist and verify work
  with every pin record taken; a pin's owner is checked by pid and start.
- An empty CORTEX_CACHE_SHM_PREFIX is refused.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import subprocess
import sys
import time

import pytest

from cortex_cache import PermissionDenied, Pool, UsageError, procs, segment
from cortex_cache.disklog import DiskLog
from tests.helpers import REPO, as_user, cli, run_py, spawn_py

OTHER_UID = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root to make")


def one_line(r, code: int) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err, r.stdout.decode()[-500:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _take_first(name: str, mode: int = 0o666) -> None:
    """What another user does: create the pool before its owner, and keep something of theirs in it."""
    with Pool.create(name, "1M", block_size="4K", mode=mode) as p:
        p.put("planted", b"theirs")
        os.fchown(p.core.seg.fd, OTHER_UID, OTHER_UID)


def _owner(name: str) -> int:
    return os.stat(segment.shm_path(name)).st_uid


# ---------------------------------------------------------------- 3. a name taken first


@root_only
def test_create_if_missing_refuses_a_pool_another_user_took_first(pool_name):
    _take_first(pool_name)  # its header says mode 0666, as the owner's boot line asks
    try:
        r = cli("cache", "create", pool_name, "--size", "1M", "--block-size", "4K", "--mode", "0666", "--if-missing")
        assert "belongs to uid 65534" in one_line(r, 77)
        with pytest.raises(PermissionDenied):
            Pool.create(pool_name, "1M", block_size="4K", mode=0o666, exist_ok=True)
        assert _owner(pool_name) == OTHER_UID
        # Asked for explicitly, it is used.
        r = cli("cache", "create", pool_name, "--size", "1M", "--block-size", "4K", "--mode", "0666", "--if-missing",
                "--allow-other-owner")
        assert r.returncode == 0, r.stderr
        with Pool.create(pool_name, "1M", block_size="4K", mode=0o666, exist_ok=True, allow_other_owner=True) as p:
            assert p.get("planted") == b"theirs"
    finally:
        Pool.unlink(pool_name)
    # The rule's other half: a root-owned pool is used on a user's behalf (a service run as root may make
    # a shared pool for its users).
    Pool.create(pool_name, "1M", block_size="4K", mode=0o666).close()
    try:
        def theirs() -> int:
            Pool.create(pool_name, "1M", block_size="4K", mode=0o666, exist_ok=True).close()
            return 0

        assert as_user(theirs) == 0
    finally:
        Pool.unlink(pool_name)


@root_only
def test_restore_refuses_a_pool_another_user_took_first(pool_name, tmp_path):
    with Pool.create(pool_name, "1M", block_size="4K") as mine:
        mine.put("mine", b"owner's")
        mine.persist()
    Pool.unlink(pool_name)
    _take_first(pool_name, mode=0o600)
    try:
        # The documented boot line: restore --if-missing || create --if-missing.
        assert "belongs to uid 65534" in one_line(cli("cache", "restore", pool_name, "--if-missing"), 77)
        assert "belongs to uid 65534" in one_line(cli("cache", "restore", pool_name, "--replace"), 77)
        assert _owner(pool_name) == OTHER_UID
        with Pool.open(pool_name) as p:
            assert p.get("planted") == b"theirs" and p.get("mine") is None
        r = cli("cache", "restore", pool_name, "--if-missing", "--allow-other-owner", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["skipped"], r.stderr
    finally:
        Pool.unlink(pool_name)


@root_only
def test_engine_adapters_refuse_a_pool_another_user_took_first(pool_name):
    from cortex_cache.integrations.pools import open_or_create

    _take_first(pool_name)
    try:
        for params in ({}, {"create": True, "size": "1M", "block_size": "4K"}):
            with pytest.raises(PermissionDenied, match="belongs to uid 65534"):
                open_or_create(pool_name, params)
        p = open_or_create(pool_name, {"allow_other_owner": True})
        try:
            assert p.get("planted") == b"theirs"
        finally:
            p.close()
    finally:
        Pool.unlink(pool_name)


# ---------------------------------------------------------------- 10. out of file descriptors


def test_running_out_of_file_descriptors_is_a_temporary_failure(make_pool, pool_name):
    p = make_pool("1M", block_size="4K")
    r = run_py(
        """
        import os, resource, sys
        from cortex_cache import Pool, CortexCacheError
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        for what in (lambda: Pool.open(sys.argv[1]), lambda: Pool.create(sys.argv[2], "1M", block_size="4K")):
            try:
                what().close()
                print("opened")
            except Exception as e:
                print(type(e).__name__, getattr(e, "exit_code", None), e)
        """,
        p.name, pool_name + "-new",
    )
    lines = r.stdout.decode().splitlines()
    assert len(lines) == 2, lines
    for line in lines:
        assert line.startswith("TooManyOpenFiles 75 ") and "too many open files" in line, lines
    assert not Pool.exists(pool_name + "-new")


def test_a_create_out_of_file_descriptors_leaves_nothing(pool_name, tmp_path):
    tier = tmp_path / "tier"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (14, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    r = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", "create", pool_name, "--size", "1M",
                        "--block-size", "4K", "--disk-path", str(tier)],
                       capture_output=True, cwd=REPO, timeout=60, preexec_fn=limit)
    assert "too many open files" in one_line(r, 75)
    assert not Pool.exists(pool_name)
    assert not tier.exists() and not DiskLog.exists(str(tier))


# ---------------------------------------------------------------- 11. listing, sweeping, pins


def _plant_staging(n: int) -> list[str]:
    """Staging-like segments of another user, sitting still for an hour (sticky /dev/shm lets anyone)."""
    paths = []
    old = time.time() - 3600
    for _ in range(n):
        path = os.path.join(segment.SHM_DIR, f"{segment.prefix()}restoring-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        os.fchown(fd, OTHER_UID, OTHER_UID)
        os.close(fd)
        os.utime(path, (old, old))
        paths.append(path)
    return paths


@root_only
def test_listing_and_sweeping_leave_other_users_staging_segments_alone(make_pool, pool_name):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"v")
    p.persist()
    planted = _plant_staging(3)
    try:
        listed = json.loads(cli("cache", "list", "--json").stdout)["pools"]
        assert [row["name"] for row in listed] == [p.name]
        status = json.loads(cli("cache", "status", "--json").stdout)["pools"]
        assert [row["name"] for row in status] == [p.name]
        # A restore sweeps its own killed staging segments, never another user's.
        r = cli("cache", "restore", p.name, "--replace")
        assert r.returncode == 0, r.stderr
        assert all(os.path.exists(f) for f in planted)
        doc = json.loads(cli("cache", "doctor", "--json").stdout)
        (staging,) = [f for f in doc["findings"] if f["check"] == "staging"]
        assert staging["ok"] and "3 of other users" in staging["message"]
    finally:
        for f in planted:
            os.unlink(f)


def test_a_pin_record_is_alive_only_with_its_process_start_time():
    pid, start = procs.me()
    alive = procs.alive_checker()  # what reaping pins and dead writers' reservations asks
    assert alive(pid, start)
    assert not alive(pid, 0)  # a planted record (start 0) on a live pid is not that process
    assert not alive(1, 0)
    assert not alive(pid, start + 1)


@pytest.mark.parametrize("taken_by", ["views", "planted"])
def test_persist_and_verify_need_no_free_pin_record(make_pool, pool_name, taken_by, tmp_path):
    p = make_pool("4M", block_size="4K")
    for i in range(5):
        p.put(f"k{i}", bytes([i]) * (3000 + i))
    n_pins = p.geometry.n_pins
    holder = None
    if taken_by == "views":  # one process holding every pin record with open views
        holder = spawn_py(
            """
            import sys
            from cortex_cache import Pool
            p = Pool.open(sys.argv[1])
            views = [p.view("k0") for _ in range(int(sys.argv[2]))]
            print("ready", flush=True)
            sys.stdin.read()
            """,
            p.name, str(n_pins),
        )
        assert holder.stdout.readline().strip() == b"ready", holder.stderr.read().decode()
    else:  # records forged by a writer of the segment: pid 1, start 0
        core = p.core

        def plant() -> None:
            core.pin_records["pid"][:] = 1
            core.pin_records["start"][:] = 0
            core.pin_records["slot"][:] = -1

        core.locked(plant)
    try:
        out = tmp_path / "snap.ccsnap"
        r = cli("cache", "persist", p.name, "--output", str(out), "--json")
        assert r.returncode == 0, r.stderr.decode()
        assert json.loads(r.stdout)["entries"] == 5
        r = cli("cache", "verify", p.name, "--json")
        assert r.returncode == 0, r.stderr.decode()
        assert json.loads(r.stdout)["checked"] == 5
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait(timeout=30)


# ---------------------------------------------------------------- 12. the prefix


def test_an_empty_prefix_is_refused(monkeypatch):
    r = cli("cache", "list", env={"CORTEX_CACHE_SHM_PREFIX": ""})
    assert "CORTEX_CACHE_SHM_PREFIX" in one_line(r, 2)
    monkeypatch.setenv("CORTEX_CACHE_SHM_PREFIX", "")
    with pytest.raises(UsageError):
        segment.prefix()
    with pytest.raises(UsageError):
        Pool.list()
