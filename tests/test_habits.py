"""What a newcomer meets at the command line: warnings for settings they may not have meant, one rule for
output files, honest reports, a watch that does not hold a pool, one entry's info, pruning snapshots,
units that agree, the man page of an editable install, and no pointer to a document users never see.

Every command runs as a real subprocess against real shared memory.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from cortex_cache import Pool, segment
from tests.helpers import REPO, cli, run_py, spawn_py


def _doc(r) -> dict:
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def _err(r, code: int) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- create says what it did not quite do


def test_create_warns_of_a_size_rounded_down_to_whole_blocks_even_when_quiet(pool_name, cleanup):
    cleanup.append(pool_name)
    r = cli("cache", "-q", "create", pool_name, "--size", "100K")
    assert r.returncode == 0 and r.stdout == b""
    assert "warning: --size 100K is not a whole number of 64.0KiB blocks: the pool holds 64.0KiB (1 block)" \
        in r.stderr.decode()
    with Pool.open(pool_name) as p:
        assert p.stats()["size_bytes"] == 64 << 10
    Pool.unlink(pool_name)
    exact = cli("cache", "create", pool_name, "--size", "128K")
    assert exact.returncode == 0 and b"warning" not in exact.stderr


@pytest.mark.parametrize("mode,warned", [("0777", "read and write"), ("0604", "read the"), ("0660", None)])
def test_create_warns_of_a_mode_that_opens_the_pool_to_every_user(pool_name, cleanup, mode, warned):
    cleanup.append(pool_name)
    r = cli("cache", "create", pool_name, "--size", "1M", "--mode", mode)
    assert r.returncode == 0, r.stderr
    if warned:
        assert f"warning: mode {mode} lets every user of this host {warned}" in r.stderr.decode()
    else:
        assert b"warning" not in r.stderr
    assert oct(os.stat(segment.shm_path(pool_name)).st_mode & 0o777) == oct(int(mode, 8))


def test_create_warns_when_an_unreserved_pool_is_larger_than_dev_shm_has_free(pool_name, cleanup):
    cleanup.append(pool_name)
    st = os.statvfs("/dev/shm")
    too_big = (st.f_bavail * st.f_frsize) * 2 // (1 << 30) + 1
    r = cli("cache", "create", pool_name, "--size", f"{too_big}G", "--no-reserve")
    assert r.returncode == 0, r.stderr
    assert "warning: with --no-reserve the pool's" in r.stderr.decode() and "free in /dev/shm" in r.stderr.decode()
    Pool.unlink(pool_name)
    small = cli("cache", "create", pool_name, "--size", "1M", "--no-reserve")
    assert small.returncode == 0 and b"warning" not in small.stderr


def test_create_json_keeps_created_a_time_and_says_whether_the_pool_existed(pool_name, cleanup):
    cleanup.append(pool_name)
    plain = _doc(cli("cache", "create", pool_name, "--size", "1M", "--json"))
    assert plain["existed"] is False and isinstance(plain["created"], float)
    again = _doc(cli("cache", "create", pool_name, "--size", "1M", "--if-missing", "--json"))
    assert again["existed"] is True and again["created"] == plain["created"]


# ---------------------------------------------------------------- -h and --debug


def test_dash_h_is_help_and_every_help_names_debug():
    for args in ([], ["cache"], ["cache", "get"], ["cache", "info"], ["cache", "snapshots"]):
        short, long = cli(*args, "-h"), cli(*args, "--help")
        assert short.returncode == 0 and short.stdout == long.stdout, args
        assert b"--debug" in short.stdout and b"-h, --help" in short.stdout, args


def test_debug_after_the_command_shows_the_traceback(pool_name):
    r = cli("cache", "status", pool_name, "--debug")
    assert r.returncode == 66 and b"Traceback" in r.stderr
    assert b"Traceback" not in cli("cache", "status", pool_name).stderr


# ---------------------------------------------------------------- one rule for -o FILE


def test_get_o_refuses_an_existing_file_unless_force_and_leaves_nothing_behind(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"new value")
    out = tmp_path / "out.bin"
    out.write_bytes(b"precious")
    r = cli("cache", "get", p.name, "k", "-o", str(out))
    assert "already exists; remove it first or give --force" in _err(r, 73)
    assert out.read_bytes() == b"precious"
    assert cli("cache", "get", p.name, "k", "-o", str(out), "--force").returncode == 0
    assert out.read_bytes() == b"new value" and out.stat().st_mode & 0o777 == 0o600
    # A key that is not there: nothing written, the old file whole, no temp file beside it.
    _err(cli("cache", "get", p.name, "nope", "-o", str(out), "--force"), 66)
    assert out.read_bytes() == b"new value" and sorted(os.listdir(tmp_path)) == ["out.bin"]
    # A device is written into, as the shell's > would, never replaced.
    assert cli("cache", "get", p.name, "k", "-o", "/dev/null", "--force").returncode == 0
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    _err(cli("cache", "get", p.name, "k", "--force"), 2)  # --force without -o


def test_persist_o_follows_the_same_rule(make_pool, tmp_path, restored):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"v1")
    snap = tmp_path / "x.ccsnap"
    snap.write_bytes(b"not mine to lose")
    assert "already exists" in _err(cli("cache", "persist", p.name, "-o", str(snap)), 73)
    assert snap.read_bytes() == b"not mine to lose"
    assert cli("cache", "persist", p.name, "-o", str(snap), "--force").returncode == 0
    restored.append(Pool.restore(snap, name=p.name + "-r"))
    assert restored[-1].get("k") == b"v1"
    assert "is a directory" in _err(cli("cache", "persist", p.name, "-o", str(tmp_path), "--force"), 2)
    assert "is not a regular file" in _err(cli("cache", "persist", p.name, "-o", "/dev/null", "--force"), 2)
    _err(cli("cache", "persist", p.name, "--force"), 2)  # the snapshot directory's files are never replaced
    assert sorted(os.listdir(tmp_path)) == ["x.ccsnap"]


def test_the_library_replaces_unless_told_not_to(make_pool, tmp_path):
    from cortex_cache import OutputExists

    p = make_pool("1M", block_size="4K")
    path = tmp_path / "s.ccsnap"
    p.persist(path)
    p.persist(path)  # Pool.persist replaces, as open(path, "w") would
    with pytest.raises(OutputExists):
        p.persist(path, replace=False)


# ---------------------------------------------------------------- damaged snapshots say how


def test_bytes_appended_after_a_snapshot_are_not_called_truncation(make_pool, tmp_path):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"v" * 100)
    snap = tmp_path / "s.ccsnap"
    p.persist(snap)
    whole = snap.read_bytes()
    snap.write_bytes(whole + b"appended by a careless copy\n")
    err = _err(cli("cache", "restore", p.name + "-r", "-i", str(snap)), 65)
    assert f"28 bytes follow its trailer (added after it was written); its first {len(whole)} bytes" in err
    snap.write_bytes(whole[:-20])
    assert "truncated (no trailer)" in _err(cli("cache", "restore", p.name + "-r", "-i", str(snap)), 65)
    assert not Pool.exists(p.name + "-r")


# ---------------------------------------------------------------- verify without --repair changes nothing


def test_verify_without_repair_reports_dead_pins_and_leaves_them(make_pool):
    p = make_pool("1M", block_size="4K")
    for k in ("a", "b", "c"):
        p.put(k, b"x" * 100)
    killed = run_py(f"""
        import os, signal
        from cortex_cache import Pool
        p = Pool.open({p.name!r})
        views = [p.view(k).__enter__() for k in ("a", "b")]
        os.kill(os.getpid(), signal.SIGKILL)
    """, check=False)
    assert killed.returncode == -signal.SIGKILL
    assert p.stats()["pinned_entries"] == 2
    r = cli("cache", "verify", p.name)
    out = r.stdout.decode()
    assert r.returncode == 1 and "2 pin(s) held by dead processes" in out and "released" not in out
    assert f"nothing was changed; `cortex cache verify {p.name} --repair` fixes these" in out
    assert p.stats()["pinned_entries"] == 2
    doc = _doc_any(cli("cache", "verify", p.name, "--json"))
    assert doc["repaired"] is False and p.stats()["pinned_entries"] == 2
    fixed = cli("cache", "verify", p.name, "--repair")
    assert fixed.returncode == 1 and "[repaired]" in fixed.stdout.decode()
    assert p.stats()["pinned_entries"] == 0
    assert cli("cache", "verify", p.name).returncode == 0


def _doc_any(r) -> dict:
    return json.loads(r.stdout)


# ---------------------------------------------------------------- a watch does not hold the pool


def test_a_watch_does_not_keep_delete_from_removing_the_pool(pool_name, cleanup):
    cleanup.append(pool_name)
    assert cli("cache", "create", pool_name, "--size", "1M").returncode == 0
    watch = subprocess.Popen([sys.executable, "-m", "cortex_cache", "cache", "status", pool_name, "--watch", "3",
                              "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        first = json.loads(watch.stdout.readline())  # two samples taken; the next comes after 3 s
        assert first["pool"] == pool_name
        r = cli("cache", "delete", pool_name)
        assert r.returncode == 0, r.stderr
        _, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 66 and b"it was deleted while watched" in err


# ---------------------------------------------------------------- one entry's info


def test_info_shows_one_entry_and_counts_no_access(make_pool):
    p = make_pool("1M", block_size="4K")
    p.put("greeting", b"hello" * 1000, ttl=3600, priority=4)
    before = p.stats()
    r = cli("cache", "info", p.name, "greeting")
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr
    assert re.search(r"^size\s+4\.9KiB \(5000 bytes\) in 2 blocks from block \d+$", out, re.M), out
    assert re.search(r"^priority\s+4$", out, re.M) and re.search(r"^expires\s+.*\(in (59\.\dm|1\.0h)\)$", out, re.M), out
    doc = _doc(cli("cache", "info", p.name, "greeting", "--json"))
    assert doc["size"] == 5000 and doc["priority"] == 4 and doc["key"] == "greeting" and doc["tier"] == "memory"
    after = p.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    assert p.info("greeting")["access_count"] == 1
    assert "no key 'nope'" in _err(cli("cache", "info", p.name, "nope"), 66)


def test_info_of_an_entry_on_the_disk_tier_says_where_it_is(make_pool, tmp_path):
    p = make_pool("64K", block_size="4K", tier="disk", disk_path=str(tmp_path / "tier"))
    for i in range(30):
        p.put(f"k{i}", bytes([i]) * 3000)
    assert p.info("k0")["tier"] == "disk"
    out = cli("cache", "info", p.name, "k0").stdout.decode()
    assert re.search(r"^tier\s+disk$", out, re.M) and re.search(r"^spilled\s+\S+ \S+ \(\S+ ago\)$", out, re.M), out
    assert re.search(r"^on disk\s+file \d+ at offset \d+, 4\.0KiB$", out, re.M), out


def test_a_far_ttl_reads_in_years():
    from cortex_cache.cli_render import fmt_duration, fmt_rate

    assert fmt_duration(999_999_997) == "31.7y" and fmt_duration(90) == "1.5m" and fmt_duration(7) == "7s"
    assert fmt_duration(3599.9) == "1.0h" and fmt_duration(3500) == "58.3m"
    assert fmt_rate(3 << 30, 2.0) == "1.5GiB/s" and fmt_rate(10, 0.0) == "-"


def test_sizes_and_speeds_use_one_kind_of_unit(make_pool, tmp_path):
    p = make_pool("4M", block_size="4K")
    p.put("k", b"v" * 300_000)
    out = cli("cache", "persist", p.name, "-o", str(tmp_path / "s.ccsnap")).stdout.decode()
    assert re.search(r"\(\d+(\.\d+)?(B|KiB|MiB|GiB)/s\)$", out.strip()), out
    assert "GB/s" not in out and "MB/s" not in out


# ---------------------------------------------------------------- snapshots --prune


def test_snapshots_prune_keeps_the_newest_and_what_they_need(make_pool, snapshot_dir, restored):
    p = make_pool("1M", block_size="4K")
    for i in range(4):
        p.put(f"k{i}", f"v{i}".encode())
        p.persist()
    assert len(list(snapshot_dir.glob("*.ccsnap"))) == 4  # three kept (the default) and NAME.ccsnap
    _err(cli("cache", "snapshots", p.name, "--keep", "1"), 2)  # --keep goes with --prune
    doc = _doc(cli("cache", "snapshots", p.name, "--prune", "--keep", "1", "--json"))
    assert doc["pruned"]["kept"] == 1 and len(doc["pruned"]["removed"]) >= 2 and doc["pruned"]["freed_bytes"] > 0
    assert [s["latest"] for s in doc["snapshots"]] == [True]
    p.close()
    Pool.unlink(p.name)
    restored.append(Pool.restore(name=p.name))
    assert sorted(restored[-1].keys()) == ["k0", "k1", "k2", "k3"]
    restored[-1].close()
    Pool.unlink(p.name)
    restored.clear()
    gone = _doc(cli("cache", "snapshots", p.name, "--prune", "--keep", "0", "--json"))
    assert gone["snapshots"] == [] and gone["pruned"]["kept"] == 0
    assert [f for f in os.listdir(snapshot_dir) if p.name in f] == []


def test_snapshots_prune_waits_for_no_persist_of_the_pool(make_pool, snapshot_dir):
    p = make_pool("1M", block_size="4K")
    for i in range(3):
        p.put(f"k{i}", b"v")
        p.persist()
    holder = spawn_py(f"""
        import sys
        from cortex_cache import Pool
        from cortex_cache.lock import PERSIST_BYTE, RecordLock
        p = Pool.open({p.name!r})
        lock = RecordLock(p.core.seg.fd, PERSIST_BYTE)
        assert lock.try_acquire()
        print("held", flush=True)
        sys.stdin.readline()
    """)
    try:
        assert holder.stdout.readline() == b"held\n", holder.stderr.read().decode()
        before = sorted(os.listdir(snapshot_dir))
        assert "is running" in _err(cli("cache", "snapshots", p.name, "--prune", "--keep", "1"), 75)
        assert sorted(os.listdir(snapshot_dir)) == before  # nothing removed
    finally:
        holder.communicate(b"\n", timeout=60)
    assert _doc(cli("cache", "snapshots", p.name, "--prune", "--keep", "1", "--json"))["pruned"]["kept"] == 1


# ---------------------------------------------------------------- the install and the docs


def test_an_installed_cortex_has_its_man_page_and_completions_even_editable():
    import sysconfig

    # The install in this environment's site-packages (the checkout's own egg-info comes first on sys.path).
    found = list(metadata.distributions(name="cortex-cache", path=[sysconfig.get_paths()["purelib"]]))
    if not found:
        pytest.skip("cortex-cache is not installed in this environment (run from a source tree)")
    dist = found[0]
    files = {str(f).replace("\\", "/"): f for f in dist.files or []}
    for suffix in ("share/man/man1/cortex.1", "share/bash-completion/completions/cortex.bash"):
        found = [f for name, f in files.items() if name.endswith(suffix)]
        assert found, f"{suffix} is not in the install's RECORD"
        assert Path(dist.locate_file(found[0])).is_file(), suffix


def test_code_and_docs_point_at_the_projects_own_documents():
    stale = []
    for folder in ("cortex_cache", "tests", "benchmarks", "scripts", "docs", "man", "completions"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix not in (".py", ".md", ".c", ".h", ".1", ".bash", ".fish", ".sh") and path.name != "_cortex":
                continue
            text = path.read_text(errors="replace")
            for pattern in (r"DESIGN\b", r"\.\./shared", r"/ \"shared\" /"):
                if path.name == "test_habits.py":
                    continue
                if re.search(pattern, text):
                    stale.append(f"{path.relative_to(REPO)}: {pattern}")
    assert not stale, stale
