"""Snapshots are trusted only as far as who wrote them (issue 29, items 2, 4, 7, 12 and 13).

A snapshot carries its pool's whole configuration, tiers included: a disk
tier directory and a remote server the restoring process would then write
every entry to.  Those are attached only from a snapshot this user wrote
(the file and its directory ours, writable by nobody else) or when the
operator asks (`restore --trust-tiers`); from any other snapshot the
entries come back and the tiers are reported, not attached.  Whatever a
configuration block says goes through the command line's own validation:
a snapshot asking for what `create` would refuse is refused (exit 65).
Group pools restore as they were; retention stays the owner's; the
snapshot directory is walked without following symlinks.
"""

from __future__ import annotations

import ctypes.util  # noqa: F401 - imported here for as_member's child, which may not read the stdlib
import json
import os
import stat
import struct
import subprocess
import tempfile

import pytest
import xxhash

from cortex_cache import CortexCacheError, Pool, segment
from cortex_cache import persist as persist_mod
from cortex_cache.disklog import DiskLog
from tests.helpers import cli, spawn_py

OTHER_UID = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root to make")
CONFIG_LEN_AT = 200  # FILE_HEAD: u32 configuration block length


def one_line(r, code: int) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def forge_config(path, **changes) -> None:
    """Rewrite a snapshot's configuration block (disk, remote, keep...) and make every checksum agree."""
    data = bytes(open(path, "rb").read())
    head = persist_mod.FILE_HEAD.size + persist_mod.HEAD_CHECK.size
    (clen,) = struct.unpack_from("<I", data, CONFIG_LEN_AT)
    cfg = json.loads(data[head : head + clen])
    cfg.update(changes)
    block = json.dumps(cfg).encode()
    out = bytearray(data[:head] + block + data[head + clen :])
    struct.pack_into("<I", out, CONFIG_LEN_AT, len(block))
    fh = persist_mod.FILE_HEAD.size
    struct.pack_into("<Q", out, fh, xxhash.xxh3_64_intdigest(bytes(out[:fh])))
    end = len(out) - persist_mod.TRAILER.size
    struct.pack_into("<Q", out, end + 24, xxhash.xxh3_64_intdigest(bytes(out[:end])))
    with open(path, "wb") as f:
        f.write(out)


def disk_cfg(path) -> dict:
    return {"path": str(path), "size": 1 << 20, "write": "back", "o_direct": False, "max_entries": 256}


def snapshot_with(make_pool, where, **changes):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"from the snapshot")
    path = p.persist(where)
    if changes:
        forge_config(path, **changes)
    return path


def cleanup(name: str) -> None:
    if Pool.exists(name):
        with Pool.open(name) as q:
            tier = q.disk_path
        Pool.unlink(name)
        if tier:
            DiskLog.destroy(tier)


# ---------------------------------------------------------------- item 2: whose tiers


@root_only
def test_another_users_snapshot_restores_its_entries_and_never_its_tiers(make_pool, tmp_path, pool_name):
    planted_tier = tmp_path / "planted-tier"
    src = tmp_path / "drop"
    src.mkdir()
    path = snapshot_with(make_pool, src / "s.ccsnap", disk=disk_cfg(planted_tier),
                         remote={"url": "redis://127.0.0.1:1/0", "cluster": False}, keep=1)
    os.chown(path, OTHER_UID, OTHER_UID)
    r = cli("cache", "restore", pool_name, "-i", str(path))
    try:
        assert r.returncode == 0, r.stderr
        out = r.stdout.decode() + r.stderr.decode()
        lines = [ln for ln in out.splitlines() if "not attached" in ln]
        assert len(lines) == 1 and "--trust-tiers" in lines[0], out
        assert str(planted_tier) in lines[0] and "redis://127.0.0.1:1/0" in lines[0]
        with Pool.open(pool_name) as q:
            cfg = q.configuration()
            assert q.get("k") == b"from the snapshot"
            assert cfg["disk"] is None and cfg["remote"] is None and cfg["keep"] is None
        assert not planted_tier.exists()
    finally:
        cleanup(pool_name)
    r = cli("cache", "restore", pool_name, "-i", str(path), "--json")
    try:
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["trusted"] is False and "65534" in doc["not_attached"]["why"]
        assert doc["not_attached"]["disk"] == str(planted_tier)
        assert doc["not_attached"]["remote"] == "redis://127.0.0.1:1/0" and doc["not_attached"]["keep"] == 1
    finally:
        cleanup(pool_name)


def test_a_snapshot_in_a_directory_others_can_write_is_not_trusted(make_pool, tmp_path, pool_name):
    shared = tmp_path / "shared"
    shared.mkdir()
    tier = tmp_path / "tier"
    path = snapshot_with(make_pool, shared / "s.ccsnap", disk=disk_cfg(tier))
    os.chmod(shared, 0o1777)
    try:
        with Pool.restore(path, name=pool_name) as q:
            assert q.get("k") == b"from the snapshot" and q.disk_path is None
        assert not tier.exists()
    finally:
        cleanup(pool_name)
        os.chmod(shared, 0o700)


def test_asking_attaches_the_tiers_of_a_snapshot_not_ours(make_pool, tmp_path, pool_name):
    shared = tmp_path / "shared"
    shared.mkdir()
    tier = tmp_path / "tier"
    path = snapshot_with(make_pool, shared / "s.ccsnap", disk=disk_cfg(tier))
    os.chmod(shared, 0o777)
    try:
        r = cli("cache", "restore", pool_name, "-i", str(path), "--trust-tiers", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["not_attached"] is None
        with Pool.open(pool_name) as q:
            assert q.disk_path == str(tier)
        cleanup(pool_name)
        with Pool.restore(path, name=pool_name, trust_tiers=True) as q:
            assert q.disk_path == str(tier)
    finally:
        cleanup(pool_name)
        os.chmod(shared, 0o700)


def test_our_own_snapshot_attaches_its_tiers_as_before(make_pool, tmp_path, pool_name):
    p = make_pool("1M", block_size="4K", disk_path=tmp_path / "tier", disk_size="1M", keep=5)
    p.put("k", b"v")
    p.persist()
    name = p.name
    p.close()
    Pool.unlink(name)
    r = cli("cache", "restore", name, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["trusted"] is True and doc["not_attached"] is None
    with Pool.open(name) as q:
        assert q.disk_path == str(tmp_path / "tier") and q.snapshot_keep == 5


BAD_CONFIG = {
    "http": {"remote": {"url": "http://127.0.0.1:6379/0", "cluster": False}},
    "empty-url": {"remote": {"url": "", "cluster": False}},
    "port-99999": {"remote": {"url": "redis://127.0.0.1:99999/0", "cluster": False}},
    "long-url": {"remote": {"url": "redis://127.0.0.1:6379/0?x=" + "a" * 1100, "cluster": False}},
    "disk-root": {"disk": disk_cfg("/")},
    "disk-etc": {"disk": disk_cfg("/etc")},
    "disk-dotdot": {"disk": disk_cfg("/var/lib/cortex/../../../etc")},
    "disk-relative": {"disk": disk_cfg("relative/tier")},
}


@pytest.mark.parametrize("bad", sorted(BAD_CONFIG))
def test_a_snapshot_asking_for_what_the_command_line_refuses_is_refused(make_pool, tmp_path, pool_name, bad):
    path = snapshot_with(make_pool, tmp_path / "s.ccsnap", **BAD_CONFIG[bad])
    before = sorted(os.listdir("/"))
    for extra in ([], ["--trust-tiers"]):
        err = one_line(cli("cache", "restore", pool_name, "-i", str(path), *extra), 65)
        assert str(path) in err
        assert not Pool.exists(pool_name)
    assert sorted(os.listdir("/")) == before
    assert not [n for n in segment.list_names() if n.startswith(persist_mod.STAGING_PREFIX)]


@pytest.mark.parametrize("path", ["/", "/etc", "/usr", "/var/lib"])
def test_the_command_line_refuses_system_directories_as_a_disk_tier(pool_name, path):
    before = sorted(os.listdir("/"))
    one_line(cli("cache", "create", pool_name, "--size", "1M", "--disk-path", path), 2)
    assert not Pool.exists(pool_name) and sorted(os.listdir("/")) == before


# ---------------------------------------------------------------- item 4: group pools


def test_a_group_pool_restores_as_it_was(make_pool, pool_name):
    shared = make_pool("1M", name=pool_name, mode=0o660)
    shared.put("k", b"shared")
    private = make_pool("1M")
    private.put("k", b"private")
    assert stat.S_IMODE(os.stat(shared.persist()).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(private.persist()).st_mode) == 0o600
    shared.close()
    Pool.unlink(pool_name)
    r = cli("cache", "restore", pool_name, "--if-missing", "--mode", "0660")
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(segment.shm_path(pool_name)).st_mode) == 0o660
    r = cli("cache", "restore", pool_name, "--replace")
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(segment.shm_path(pool_name)).st_mode) == 0o660
    with Pool.open(pool_name) as q:
        assert q.get("k") == b"shared"


@root_only
def test_a_group_pool_comes_back_in_its_group(make_pool, pool_name):
    p = make_pool("1M", name=pool_name, mode=0o660)
    os.chown(segment.shm_path(pool_name), -1, 54321)  # the operators' group
    p.put("k", b"shared")
    snap = p.persist()
    assert os.stat(snap).st_gid == 54321 and stat.S_IMODE(os.stat(snap).st_mode) == 0o640
    p.close()
    Pool.unlink(pool_name)
    r = cli("cache", "restore", pool_name, "--if-missing", "--mode", "0660")
    assert r.returncode == 0, r.stderr
    st = os.stat(segment.shm_path(pool_name))
    assert st.st_gid == 54321 and stat.S_IMODE(st.st_mode) == 0o660


# ---------------------------------------------------------------- item 7: retention is the owner's


def as_member(fn, env: dict) -> tuple[int, str]:
    """fn() in a forked child as uid 65534 in group 54321: (exit code of what it raised or 0, its message).

    No exec (the interpreter may be readable by root alone), so the library
    is called, not the CLI, which maps the same exceptions to the same codes."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        out = "98 child failed"
        try:
            os.close(r)
            os.environ.update(env)
            os.setgroups([54321])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            fn()
            out = "0 "
        except CortexCacheError as e:
            out = f"{e.exit_code} {e}"
        except BaseException as e:
            out = f"98 {e!r}"
        finally:
            os.write(w, out.encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        code, _, msg = f.read().decode().partition(" ")
    os.waitpid(pid, 0)
    return int(code), msg


@root_only
def test_a_group_member_cannot_change_the_owners_retention(make_pool, pool_name):
    p = make_pool("1M", name=pool_name, mode=0o660, keep=4)
    p.put("k", b"v")
    os.chown(segment.shm_path(pool_name), -1, 54321)
    theirs = tempfile.mkdtemp(prefix="cctest-member-")
    os.chown(theirs, OTHER_UID, OTHER_UID)
    env = {"CORTEX_CACHE_SNAPSHOT_DIR": os.path.join(theirs, "snaps"), "HOME": theirs}
    def persist(keep):
        def run():
            with Pool.open(pool_name) as q:
                persist_mod.persist(q, keep=keep)
        return run

    try:
        code, err = as_member(persist(1), env)
        assert code == 77 and "owner" in err, (code, err)
        assert p.snapshot_keep == 4
        assert not os.path.exists(os.path.join(theirs, "snaps"))  # refused before anything was written

        def set_keep():
            with Pool.open(pool_name) as q:
                q.set_snapshot_keep(1)

        code, err = as_member(set_keep, env)  # the Python API's setter too
        assert code == 77 and "owner" in err, (code, err)
        assert p.snapshot_keep == 4
        last = p.stats()["last_snapshot"]
        assert as_member(persist(None), env) == (0, "")  # a plain persist by a member still works
        assert p.snapshot_keep == 4 and len([f for f in os.listdir(os.path.join(theirs, "snaps")) if f.endswith(".ccsnap")]) == 2
        assert p.stats()["last_snapshot"] == last  # their snapshot is not the owner's last one
        assert cli("cache", "persist", pool_name, "--keep", "2").returncode == 0  # the owner may
        assert p.snapshot_keep == 2
    finally:
        subprocess.run(["rm", "-rf", theirs], check=True)


# ---------------------------------------------------------------- item 12: the way to the snapshot directory


@pytest.mark.parametrize("plant", ["symlink-cortex-cache", "symlink-snapshots", "other-owner"])
def test_a_planted_snapshot_directory_in_a_shared_state_dir_is_refused(make_pool, tmp_path, plant):
    if plant == "other-owner" and os.geteuid() != 0:
        pytest.skip("files of another user need root to make")
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o1777)  # a world-writable XDG_STATE_HOME
    target = tmp_path / "target"  # a directory of ours the attacker wants our snapshots in
    target.mkdir(mode=0o700)
    if plant == "symlink-cortex-cache":
        (target / "snapshots").mkdir(mode=0o700)
        (state / "cortex-cache").symlink_to(target)
    elif plant == "symlink-snapshots":
        (state / "cortex-cache").mkdir()
        (state / "cortex-cache" / "snapshots").symlink_to(target)
    else:
        (state / "cortex-cache").mkdir(mode=0o755)
        (state / "cortex-cache" / "snapshots").mkdir(mode=0o700)
        os.chown(state / "cortex-cache", OTHER_UID, OTHER_UID)
    p = make_pool("1M")
    p.put("k", b"v")
    env = {"CORTEX_CACHE_SNAPSHOT_DIR": "", "XDG_STATE_HOME": str(state)}
    one_line(cli("cache", "persist", p.name, env=env), 77)
    one_line(cli("cache", "restore", p.name + "-x", env=env), 77)
    assert sorted(f.name for f in target.rglob("*")) == ([] if plant != "symlink-cortex-cache" else ["snapshots"])
    if plant == "other-owner":
        assert os.listdir(state / "cortex-cache" / "snapshots") == []
    assert not Pool.exists(p.name + "-x")


def test_a_state_dir_anyone_may_rename_in_is_refused(make_pool, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)  # no sticky bit: anyone could swap cortex-cache for a symlink after the check
    p = make_pool("1M")
    env = {"CORTEX_CACHE_SNAPSHOT_DIR": "", "XDG_STATE_HOME": str(state)}
    assert "sticky" in one_line(cli("cache", "persist", p.name, env=env), 77)
    assert os.listdir(state) == []


# ---------------------------------------------------------------- item 13: words and codes


def test_a_restore_running_is_named_a_restore(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K")
    for i in range(4):
        p.put(f"k{i}", bytes([i]) * 20_000)
    path = p.persist(tmp_path / "s.ccsnap")
    child = spawn_py(
        """
        import sys
        from cortex_cache import Pool
        def progress(done, total):
            if done == total:
                print("ready", flush=True)
                sys.stdin.readline()
        Pool.restore(sys.argv[1], name=sys.argv[2], replace=True, progress=progress).close()
        print("done", flush=True)
        """,
        str(path), p.name,
    )
    try:
        assert child.stdout.readline() == b"ready\n"
        err = one_line(cli("cache", "restore", p.name, "-i", str(path), "--replace"), 75)
        assert "restore" in err and "persist" not in err, err
        err = one_line(cli("cache", "persist", p.name), 75)
        assert "a restore" in err, err
    finally:
        child.stdin.write(b"\n")
        child.stdin.close()
        assert child.stdout.readline() == b"done\n"
        child.wait(timeout=60)


def test_two_boot_restores_at_once_leave_one_pool_and_both_succeed(make_pool, tmp_path, pool_name):
    path = snapshot_with(make_pool, tmp_path / "s.ccsnap")
    child = spawn_py(
        """
        import sys
        from cortex_cache import persist
        def progress(done, total):
            if done == total:
                print("ready", flush=True)
                sys.stdin.readline()
        pool, report = persist.restore(sys.argv[1], name=sys.argv[2], if_missing=True, progress=progress)
        print("skipped" if pool is None and report["skipped"] else "restored", flush=True)
        """,
        str(path), pool_name,
    )
    try:
        assert child.stdout.readline() == b"ready\n", child.stderr.read()
        r = cli("cache", "restore", pool_name, "-i", str(path), "--if-missing")  # the other boot line wins
        assert r.returncode == 0, r.stderr
    finally:
        child.stdin.write(b"\n")
        child.stdin.close()
        out = child.stdout.readline()
        child.wait(timeout=60)
    try:
        assert out == b"skipped\n", (out, child.stderr.read())
        with Pool.open(pool_name) as q:
            assert q.get("k") == b"from the snapshot"
        assert not [n for n in segment.list_names() if n.startswith(persist_mod.STAGING_PREFIX)]
    finally:
        cleanup(pool_name)


def test_no_space_names_the_pool_not_its_staging_segment(make_pool, tmp_path, pool_name):
    path = snapshot_with(make_pool, tmp_path / "s.ccsnap")
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 24, 1 << 50)  # the pool's data size: a PiB
    fh = persist_mod.FILE_HEAD.size
    struct.pack_into("<Q", data, fh, xxhash.xxh3_64_intdigest(bytes(data[:fh])))
    end = len(data) - persist_mod.TRAILER.size
    struct.pack_into("<Q", data, end + 24, xxhash.xxh3_64_intdigest(bytes(data[:end])))
    path.write_bytes(data)
    err = one_line(cli("cache", "restore", pool_name, "-i", str(path)), 73)
    assert repr(pool_name) in err and persist_mod.STAGING_PREFIX not in err, err
    assert not Pool.exists(pool_name)


@pytest.mark.parametrize("where", ["directory", "parent"])
def test_a_file_in_the_way_of_the_snapshot_directory_is_one_code(make_pool, tmp_path, where):
    p = make_pool("1M")
    p.put("k", b"v")
    if where == "directory":
        snaps = tmp_path / "snaps"
        snaps.write_bytes(b"not a directory")
    else:
        (tmp_path / "parent").write_bytes(b"not a directory")
        snaps = tmp_path / "parent" / "snaps"
    env = {"CORTEX_CACHE_SNAPSHOT_DIR": str(snaps)}
    assert "not a directory" in one_line(cli("cache", "persist", p.name, env=env), 73)
    assert "not a directory" in one_line(cli("cache", "restore", p.name + "-x", env=env), 73)
    # Reading commands report no snapshots rather than fail.
    r = cli("cache", "status", p.name, "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["snapshots"]["count"] == 0, r.stderr
    r = cli("cache", "snapshots", p.name, env=env)
    assert r.returncode == 0 and b"no snapshots" in r.stderr and b"Traceback" not in r.stderr, r.stderr
