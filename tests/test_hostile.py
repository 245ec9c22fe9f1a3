"""What a hostile user or a careless operator can do to a pool's files, restores and command line.

Each test stands for a class of fault found by trying: planted symlinks and
files of another user, forged snapshot headers, restores that do not fit,
inputs that never end or never open, full filesystems, names squatted on,
keys that are not printable.  Every one ends in a one-line error with its
documented exit code and no change to any pool or file.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys

import pytest
import xxhash

from cortex_cache import NoSpace, PermissionDenied, Pool, UsageError, segment
from cortex_cache import persist as persist_mod
from tests.helpers import REPO, check_value, cli, make_value

OTHER_UID = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root to make")


def one_line(r, code: int) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def forge_header(path, **fields) -> None:
    """Rewrite snapshot header fields (mode, max_entries) and make every checksum agree again."""
    data = bytearray(open(path, "rb").read())
    offsets = {"max_entries": ("<Q", 40), "mode": ("<I", 56)}
    for f, v in fields.items():
        fmt, off = offsets[f]
        struct.pack_into(fmt, data, off, v)
    head = persist_mod.FILE_HEAD.size
    struct.pack_into("<Q", data, head, xxhash.xxh3_64_intdigest(bytes(data[:head])))
    end = len(data) - persist_mod.TRAILER.size
    struct.pack_into("<Q", data, end + 24, xxhash.xxh3_64_intdigest(bytes(data[:end])))
    with open(path, "wb") as f:
        f.write(data)


# ---------------------------------------------------------------- 1. files another user controls


@root_only
def test_a_tier_file_swapped_for_a_symlink_is_never_written_through(make_pool, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's secret" * 100)
    os.chmod(victim, 0o600)
    tier = tmp_path / "tier"
    p = make_pool("512K", block_size="4K", disk_path=tier, disk_size="1M")
    name = p.name
    p.close()
    # The attacker (who can write the directory in this story) swaps a data file for a symlink.
    (tier / "tier-00.log").unlink()
    (tier / "tier-00.log").symlink_to(victim)
    before = victim.read_bytes()
    with Pool.open(name) as q:  # the tier is refused, the pool still works from memory
        st = q.stats()["disk"]
        assert not st["available"] and "symbolic link" in st["error"]
        for i in range(200):
            try:
                q.put(f"k{i}", make_value(i, 0, 20_000))
            except PermissionDenied as e:  # full: evicting what cannot be spilled is refused (issue 29, 5)
                assert "disk tier" in str(e)
    assert victim.read_bytes() == before
    # Taking the directory over for a new pool is refused outright.
    Pool.unlink(name)
    r = cli("cache", "create", name, "--size", "512K", "--block-size", "4K", "--disk-path", str(tier))
    assert "symbolic link" in one_line(r, 77)
    assert not Pool.exists(name) and victim.read_bytes() == before
    (tier / "tier-00.log").unlink()


@root_only
@pytest.mark.parametrize("how", ["owner", "world-writable", "group-writable"])
def test_a_tier_directory_others_control_is_refused(make_pool, tmp_path, pool_name, how):
    tier = tmp_path / "tier"
    tier.mkdir(mode=0o700)
    if how == "owner":
        os.chown(tier, OTHER_UID, OTHER_UID)
    else:
        os.chmod(tier, 0o777 if how == "world-writable" else 0o770)
    with pytest.raises(PermissionDenied):
        Pool.create(pool_name, "1M", disk_path=tier)
    r = cli("cache", "create", pool_name, "--size", "1M", "--disk-path", str(tier))
    one_line(r, 77)
    assert not Pool.exists(pool_name) and os.listdir(tier) == []


@root_only
def test_a_tier_file_of_another_user_is_refused(make_pool, tmp_path):
    tier = tmp_path / "tier"
    p = make_pool("512K", block_size="4K", disk_path=tier, disk_size="1M")
    name = p.name
    p.close()
    os.chown(tier / "cortex-tier.meta", OTHER_UID, OTHER_UID)
    with Pool.open(name) as q:
        assert "belongs to uid" in q.stats()["disk"]["error"]
    os.chown(tier / "cortex-tier.meta", 0, 0)


def test_tier_directories_are_private_or_group_shared_as_the_mode_says(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K", disk_path=tmp_path / "a", disk_size="1M")
    q = make_pool("1M", block_size="4K", disk_path=tmp_path / "b", disk_size="1M", mode=0o660)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "b").st_mode) == 0o770
    assert {stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "b").iterdir()} == {0o660}
    q.close()
    with Pool.open(q.name) as again:  # a group-shared tier reopens
        assert again.stats()["disk"]["available"]
    del p


def test_a_group_pool_persisting_first_leaves_the_snapshot_directory_private(make_pool, monkeypatch, tmp_path):
    snaps = tmp_path / "snaps"
    monkeypatch.setenv("CORTEX_CACHE_SNAPSHOT_DIR", str(snaps))
    shared = make_pool("1M", mode=0o660)
    private = make_pool("1M")
    shared.put("k", b"v")
    private.put("k", b"w")
    shared.persist()
    assert stat.S_IMODE(os.stat(snaps).st_mode) == 0o700
    assert private.persist().parent == snaps  # the private pool is not locked out of its own directory


@root_only
def test_a_snapshot_directory_others_control_is_refused(make_pool, tmp_path, pool_name):
    p = make_pool("1M")
    p.put("k", b"v")
    snaps = tmp_path / "snaps"
    snaps.mkdir(mode=0o777)
    os.chmod(snaps, 0o777)
    env = {"CORTEX_CACHE_SNAPSHOT_DIR": str(snaps)}
    assert "writable by others" in one_line(cli("cache", "persist", p.name, env=env), 77)
    os.chmod(snaps, 0o700)
    os.chown(snaps, OTHER_UID, OTHER_UID)
    one_line(cli("cache", "persist", p.name, env=env), 77)
    assert os.listdir(snaps) == []


@root_only
@pytest.mark.parametrize("plant", ["symlink", "other-owner"])
def test_a_planted_latest_snapshot_is_never_restored(make_pool, tmp_path, pool_name, plant):
    src = make_pool("1M")
    src.put("planted", b"attacker's value")
    theirs = src.persist(tmp_path / "theirs.ccsnap")
    snaps = tmp_path / "snaps"
    snaps.mkdir(mode=0o700)
    planted = snaps / f"{os.environ['CORTEX_CACHE_SHM_PREFIX']}{pool_name}.ccsnap"  # namespaced by the prefix
    if plant == "symlink":
        planted.symlink_to(theirs)
    else:
        planted.write_bytes(theirs.read_bytes())
        os.chown(planted, OTHER_UID, OTHER_UID)
    r = cli("cache", "restore", pool_name, env={"CORTEX_CACHE_SNAPSHOT_DIR": str(snaps)})
    one_line(r, 77)
    assert not Pool.exists(pool_name)


# ---------------------------------------------------------------- 3. restored mode


def test_a_forged_header_mode_never_widens_the_restored_pool(make_pool, tmp_path, pool_name):
    p = make_pool("1M")
    p.put("k", b"v")
    path = p.persist(tmp_path / "s.ccsnap")
    forge_header(path, mode=0o666)
    with Pool.restore(path, name=pool_name) as q:
        assert stat.S_IMODE(os.fstat(q.core.seg.fd).st_mode) == 0o600
    Pool.unlink(pool_name)
    # The operator's --mode wins, but never wider than who may read the snapshot file.
    one_line(cli("cache", "restore", pool_name, "-i", str(path), "--mode", "0660"), 77)
    assert not Pool.exists(pool_name)
    os.chmod(path, 0o640)
    r = cli("cache", "restore", pool_name, "-i", str(path), "--mode", "0640", "--json")
    assert r.returncode == 0, r.stderr
    try:
        assert stat.S_IMODE(os.stat(segment.shm_path(pool_name)).st_mode) == 0o640
    finally:
        Pool.unlink(pool_name)


# ---------------------------------------------------------------- 5. restores that do not fit


def test_a_restore_that_does_not_fit_fails_and_changes_nothing(make_pool, tmp_path, pool_name):
    big = make_pool("1M", block_size="4K")
    for i in range(6):
        big.put(f"k{i}", make_value(i, 0, 120_000))
    path = big.persist(tmp_path / "s.ccsnap")
    small = make_pool("300K", block_size="4K")
    small.put("unrelated", b"keep me")
    r = cli("cache", "restore", small.name, "-i", str(path), "--replace")
    assert "does not fit" in one_line(r, 73)
    with Pool.open(small.name) as q:
        assert set(q.keys()) == {"unrelated"} and q.get("unrelated") == b"keep me"
    # A forged max_entries=1 does the same to a new pool: refused, no pool.
    forge_header(path, max_entries=1)
    with pytest.raises(NoSpace):
        Pool.restore(path, name=pool_name)
    assert not Pool.exists(pool_name)
    assert not [n for n in segment.list_names() if n.startswith(persist_mod.STAGING_PREFIX)]


def test_a_restore_reports_what_is_really_there(make_pool, tmp_path, pool_name):
    p = make_pool("1M", block_size="4K")
    for i in range(6):
        p.put(f"k{i}", make_value(i, 0, 10_000))
    path = p.persist(tmp_path / "s.ccsnap")
    r = cli("cache", "restore", pool_name, "-i", str(path), "--json")
    try:
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["entries"] == 6
        with Pool.open(pool_name) as q:
            assert len(q) == 6
    finally:
        Pool.unlink(pool_name)


def test_replace_keeps_the_pools_configuration_and_tiers(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K", policy="lfu", disk_path=tmp_path / "tier", disk_size="1M")
    p.put("snap", b"from the snapshot")
    path = p.persist(tmp_path / "s.ccsnap")
    for i in range(60):
        p.put(f"k{i}", make_value(i, 0, 30_000))
    assert p.stats()["disk"]["entries"] > 0
    with Pool.restore(path, name=p.name, replace=True) as q:
        st = q.stats()
        assert st["policy"] == "lfu" and st["disk"]["path"] == str(tmp_path / "tier") and st["disk"]["available"]
        assert q.get("snap") == b"from the snapshot" and st["disk"]["entries"] == 0 and q.get("k1") is None
        for i in range(60):  # and the tier works under the new pool
            q.put(f"n{i}", make_value(i, 1, 30_000))
        assert q.stats()["disk"]["entries"] > 0 and check_value(q.get("n0")) == (0, 1)
    assert not [n for n in segment.list_names() if n.startswith(persist_mod.STAGING_PREFIX)]


# ---------------------------------------------------------------- 8. inputs that are not files


def test_restore_from_a_fifo_is_refused_before_anything_blocks(tmp_path, pool_name):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = cli("cache", "restore", pool_name, "--input", str(fifo), timeout=30)
    assert "not a regular file" in one_line(r, 2)
    r = cli("cache", "restore", pool_name, "--input", "/dev/zero", timeout=30)
    one_line(r, 2)
    assert not Pool.exists(pool_name)


# ---------------------------------------------------------------- 13. an empty disk path


def test_an_empty_disk_path_is_a_usage_error(tmp_path, pool_name):
    r = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", "create", pool_name, "--size", "1M",
                        "--disk-path", ""], capture_output=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "disk path is empty" in one_line(r, 2)
    assert os.listdir(tmp_path) == [] and not Pool.exists(pool_name)
    with pytest.raises(UsageError):
        Pool.create(pool_name, "1M", disk_path="")


# ---------------------------------------------------------------- 2. credentials in URLs

SECRET_URLS = [
    "redis://:pw-userinfo-1@127.0.0.1:1/0",
    "redis://alice:pw-userinfo-2@127.0.0.1:1/0",
    "redis://127.0.0.1:1/0?password=pw-query-3",
    "redis://127.0.0.1:1/0?username=user-query-4&password=pw-query-4",
    "unix:///run/r.sock?db=0&password=pw-unix-5",
    "rediss://127.0.0.1:1/0?PassWord=pw%2Dquery%2D6",
]


@pytest.mark.parametrize("url", SECRET_URLS)
def test_every_credential_form_is_redacted_wherever_a_url_is_shown(url, pool_name):
    from cortex_cache.remote import redact, scrub, secrets_of

    secret = [s for s in secrets_of(url) if s.startswith(("pw", "user"))][0]
    assert secret not in redact(url) and "***" in redact(url)
    assert secret not in scrub(f"Error connecting to {url}: auth {secret} refused", url)
    r = cli("cache", "create", pool_name, "--size", "1M", "--remote", url)
    try:
        assert r.returncode == 0, r.stderr
        outs = [r.stdout + r.stderr]
        for args in (["status", pool_name], ["status", "--format", "json"]):
            q = cli("cache", *args)
            outs.append(q.stdout + q.stderr)
        for out in outs:
            for s in secrets_of(url):
                if s.startswith(("pw", "user")):
                    assert s.encode() not in out, (s, out[-400:])
    finally:
        Pool.unlink(pool_name)


def test_a_malformed_ipv6_url_is_a_usage_error(pool_name):
    r = cli("cache", "create", pool_name, "--size", "1M", "--remote", "redis://:pw-6@[::1:6379/0")
    err = one_line(r, 2)
    assert "IPv6" in err and "pw-6" not in err and not Pool.exists(pool_name)


# ---------------------------------------------------------------- 7. bounded waits


def test_a_stopped_lock_holder_costs_a_lock_timeout_not_a_hang(make_pool):
    import signal

    from cortex_cache import LockTimeout
    from cortex_cache.lock import DEFAULT_TIMEOUT, default_timeout
    from tests.helpers import run_py, spawn_py

    assert default_timeout() == DEFAULT_TIMEOUT == 30.0  # finite by default
    p = make_pool("1M")
    p.put("k", b"v")
    holder = spawn_py("""
        import os, signal, sys
        from cortex_cache import Pool
        p = Pool.open(sys.argv[1])
        p.core.lock.acquire()
        print("held", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)   # stopped while holding the lock
    """, p.name)
    try:
        assert holder.stdout.readline() == b"held\n"
        r = run_py("""
            import sys
            from cortex_cache import Pool, LockTimeout
            try:
                Pool.open(sys.argv[1]).get("k")
            except LockTimeout as e:
                print(e.exit_code)
        """, p.name, check=True, timeout=60, env={"CORTEX_CACHE_LOCK_TIMEOUT": "0.3"})
        assert r.stdout.strip() == b"75"
        with pytest.raises(LockTimeout):
            p.core.lock_timeout = 0.2
            p.get("k")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        for f in (holder.stdin, holder.stdout, holder.stderr):
            f.close()
    p.core.lock_timeout = 1.0
    assert p.get("k") == b"v"


# ---------------------------------------------------------------- 9. values that never end


def _limited(fsize: int | None = None, vm: int | None = None):
    """A preexec_fn: cap the child's file size (writes past it fail with EFBIG) and address space."""
    import resource
    import signal

    def apply() -> None:
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        if vm is not None:
            resource.setrlimit(resource.RLIMIT_AS, (vm, vm))

    return apply


def _cli_proc(*args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, preexec_fn=None):
    return subprocess.Popen([sys.executable, "-m", "cortex_cache", *args], stdin=stdin, stdout=stdout,
                            stderr=subprocess.PIPE, cwd=REPO, preexec_fn=preexec_fn)


def test_put_stops_reading_an_endless_pipe_at_the_pools_size(make_pool):
    p = make_pool("1M", block_size="4K")
    proc = _cli_proc("cache", "put", p.name, "big", "-", stdin=subprocess.PIPE)
    chunk, sent = b"z" * 65536, 0
    try:
        while sent < 100 << 20:
            proc.stdin.write(chunk)
            sent += len(chunk)
    except BrokenPipeError:
        pass
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
    err = proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    assert proc.wait() == 2 and len(err.splitlines()) == 1 and "larger than the pool" in err, err
    assert sent < 4 << 20, sent  # the pool's size and a pipe buffer or two, not 100 MiB
    assert "big" not in p


def test_put_from_dev_zero_is_value_too_large_not_out_of_memory(make_pool):
    p = make_pool("1M", block_size="4K")
    r = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", "put", p.name, "z", "/dev/zero"],
                       capture_output=True, cwd=REPO, timeout=60, preexec_fn=_limited(vm=3 << 30))
    assert "larger than the pool" in one_line(r, 2)
    assert len(p) == 0


# ---------------------------------------------------------------- 10. output that cannot be written


def test_get_to_a_file_that_cannot_be_written_whole_leaves_no_file(make_pool, tmp_path):
    p = make_pool("4M")
    p.put("k", b"x" * (1 << 20))
    out = tmp_path / "out.bin"
    r = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", "get", p.name, "k", "-o", str(out)],
                       capture_output=True, cwd=REPO, timeout=60, preexec_fn=_limited(fsize=64 << 10))
    one_line(r, 74)
    assert not out.exists()


@pytest.mark.parametrize("args", [["get", "{p}", "k"], ["keys", "{p}"], ["status", "{p}", "--json"],
                                  ["keys", "{p}", "--json"]])
def test_output_to_a_full_device_is_an_io_error(make_pool, args):
    p = make_pool("1M")
    p.put("k", b"v" * 100_000)
    with open("/dev/full", "wb") as full:
        r = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", *(a.format(p=p.name) for a in args)],
                           stdout=full, stderr=subprocess.PIPE, cwd=REPO, timeout=60)
    assert "I/O error" in one_line(r, 74)


# ---------------------------------------------------------------- 11. environment faults, right codes


@pytest.mark.parametrize("size", ["9999999T", "1000T"])
def test_impossible_sizes_cannot_be_created(size, pool_name):
    assert "cannot create pool" in one_line(cli("cache", "create", pool_name, "--size", size, "--no-reserve"), 73)
    assert not Pool.exists(pool_name)


@pytest.mark.parametrize("kind", ["symlink", "directory", "dangling"])
def test_something_squatting_on_a_pools_name_is_reported_and_removed_by_delete_force(tmp_path, pool_name, kind):
    path = segment.shm_path(pool_name)
    if kind == "directory":
        os.mkdir(path)
    else:
        os.symlink(tmp_path / "target" if kind == "dangling" else "/etc/passwd", path)
    try:
        for args in (["status", pool_name], ["get", pool_name, "k"], ["keys", pool_name], ["delete", pool_name],
                     ["create", pool_name, "--size", "1M"]):
            r = cli("cache", *args)
            one_line(r, 73 if args[0] == "create" else 65)
        r = cli("cache", "delete", pool_name, "--force")
        assert r.returncode == 0, r.stderr
        assert not os.path.lexists(path) and os.path.exists("/etc/passwd")
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def test_a_stray_file_in_a_disk_tier_directory_is_cannot_create(tmp_path, pool_name):
    tier = tmp_path / "tier"
    tier.mkdir(mode=0o700)
    (tier / "tier-03.log").write_bytes(b"mine")
    r = cli("cache", "create", pool_name, "--size", "1M", "--disk-path", str(tier))
    assert "stray" in one_line(r, 73)
    assert sorted(os.listdir(tier)) == ["tier-03.log"] and not Pool.exists(pool_name)


def test_a_key_with_a_lone_surrogate_is_a_usage_error(make_pool):
    p = make_pool("1M")
    for call in (lambda: p.put("bad\ud800", b"v"), lambda: p.get("bad\ud800")):
        with pytest.raises(UsageError):
            call()


# ---------------------------------------------------------------- 15. keys that are not printable


def test_keys_are_listed_unambiguously(make_pool):
    p = make_pool("1M")
    tricky = ["two\nlines", "\x1b[2J\x1b[31mred", "back\\x0aslash", "tab\there", "plain", "\u202eevil"]
    for k in tricky:
        p.put(k, b"v")
    p.put(b"\xff\x00raw", b"v")
    p.put(b"bytes-key", b"v")
    r = cli("cache", "keys", p.name)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    assert len(lines) == len(tricky) + 2 and b"\x1b" not in r.stdout
    assert "two\\x0alines" in lines and "back\\\\x0aslash" in lines and "\\xff\\x00raw" in lines
    assert "\\xe2\\x80\\xaeevil" in lines
    doc = json.loads(cli("cache", "keys", p.name, "--json").stdout)["keys"]
    kinds = {(d["key"], d["key_type"], d.get("key_hex")) for d in doc}
    assert ("plain", "str", None) in kinds and ("bytes-key", "bytes", b"bytes-key".hex()) in kinds
    assert ("\\xff\\x00raw", "bytes", b"\xff\x00raw".hex()) in kinds
    long = cli("cache", "keys", p.name, "--long")
    assert long.returncode == 0 and b"\x1b" not in long.stdout and b"two\\x0alines" in long.stdout
