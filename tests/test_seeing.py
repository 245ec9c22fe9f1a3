"""Seeing what you run: snapshots, status extras, --watch, doctor, undisturbed inspection, JSON for logs,
and the small CLI defects found on the way (each test fails without its fix)."""

from __future__ import annotations

import json
import os
import re

import pytest

from cortex_cache import Pool
from cortex_cache import persist as snap
from cortex_cache import packs
from cortex_cache import watch as w

from .helpers import REPO, cli, spawn_py


@pytest.fixture
def pool(pool_name):
    p = Pool.create(pool_name, "64K", block_size="4K", policy="lru")
    yield p
    p.close()
    if Pool.exists(pool_name):
        Pool.unlink(pool_name)
    for f in snap.snapshots_of(pool_name) + [snap.latest_path(pool_name)] + packs.packs_of(
            snap.namespaced(pool_name), snap.snapshot_dir()):
        f.unlink(missing_ok=True)


def _doc(r) -> dict:
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.count(b"\n") == 1  # one line, fit for a log
    doc = json.loads(r.stdout)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", doc.pop("time"))
    return doc


def test_snapshots_listing_status_and_prometheus(pool, pool_name):
    pool.put("k", b"v" * 100)
    # Never persisted: 0, so that `time() - ..._timestamp_seconds > interval` alerts (NaN never would).
    prom = cli("cache", "status", pool_name, "--format", "prometheus").stdout.decode()
    assert f'cortex_cache_last_snapshot_timestamp_seconds{{pool="{pool_name}"}} 0\n' in prom
    assert "NaN" not in prom
    for _ in range(2):
        assert cli("cache", "persist", pool_name).returncode == 0
    doc = _doc(cli("cache", "snapshots", pool_name, "--json"))
    rows = doc["snapshots"]
    assert [r["latest"] for r in rows] == [False, True]
    assert all(r["entries"] == 1 and r["bytes"] > 100 and r["configuration"]["disk"] is None for r in rows)
    table = cli("cache", "snapshots", pool_name).stdout.decode()
    assert rows[1]["path"] in table and "yes" in table
    # The second persist found the value held by the first: both refer to the same value in a pack (its 100 bytes).
    assert rows[0]["shared_bytes"] == rows[1]["shared_bytes"] >= 100 and rows[1]["own_bytes"] == rows[1]["bytes"]
    st = _doc(cli("cache", "status", pool_name, "--json"))
    space = snap.snapshot_space(pool_name)
    assert st["snapshots"]["count"] == 2 and st["snapshots"]["bytes"] == space["total_bytes"]
    assert space["total_bytes"] == sum(r["bytes"] for r in rows) + space["pack_bytes"]
    prom = cli("cache", "status", pool_name, "--format", "prometheus").stdout.decode()
    assert f'cortex_cache_snapshots{{pool="{pool_name}"}} 2' in prom
    # The latest snapshot's bytes are its values' (100), not its manifest file's.
    assert f'cortex_cache_last_snapshot_bytes{{pool="{pool_name}"}} {rows[1]["value_bytes"]}' in prom
    m = re.search(rf'cortex_cache_last_snapshot_timestamp_seconds{{pool="{pool_name}"}} (\S+)', prom)
    assert m and abs(float(m.group(1)) - rows[1]["time"]) < 5
    gone = cli("cache", "status", pool_name + "-gone", "--format", "prometheus")
    assert gone.returncode == 0 and f'cortex_cache_up{{pool="{pool_name}-gone"}} 0' in gone.stdout.decode()
    assert cli("cache", "status", pool_name + "-gone").returncode == 66


def test_watch_rates_of_each_interval(pool):
    """The rates are those of the interval: an injected sleep makes the traffic, an injected clock the time."""
    ticks = iter([0.0, 2.0, 4.0, 5.0])
    traffic = iter([lambda: [pool.put(f"a{i}", b"x") for i in range(4)] + [pool.get("a0"), pool.get("nope")],
                    lambda: [pool.get("a1") for _ in range(3)], lambda: None])
    rows = list(w.watch(pool, 1.0, count=3, clock=lambda: next(ticks), sleep=lambda s: next(traffic)()))
    assert [r["seconds"] for r in rows] == [2.0, 2.0, 1.0]
    assert rows[0]["puts_per_s"] == 2.0 and rows[0]["gets_per_s"] == 1.0 and rows[0]["hit_ratio"] == 0.5
    assert rows[1]["puts_per_s"] == 0.0 and rows[1]["gets_per_s"] == 1.5 and rows[1]["hit_ratio"] == 1.0
    assert rows[2]["gets_per_s"] == 0.0 and rows[2]["hit_ratio"] is None and rows[2]["entries"] == 4


def test_watch_cli_prints_one_line_per_interval(pool, pool_name):
    r = cli("cache", "status", pool_name, "--watch", "0.01", "--count", "2")
    lines = r.stdout.decode().splitlines()
    assert r.returncode == 0 and len(lines) == 3 and lines[0].split()[:3] == ["time", "puts/s", "gets/s"]
    js = cli("cache", "status", pool_name, "--watch", "--count", "1", "--json")  # SECONDS is optional
    assert _doc(js)["pool"] == pool_name
    assert cli("cache", "status", "--watch", "1").returncode == 2  # needs NAME
    assert cli("cache", "status", pool_name, "--count", "1").returncode == 2


def test_inspection_does_not_disturb_the_pool(pool, pool_name):
    """keys, info (keys -l), status, verify, snapshots and get --peek change no counter and no eviction order."""
    for k in ("a", "b", "c"):
        pool.put(k, b"v" * 3000)
    before = pool.stats()
    for args in (["keys", pool_name], ["keys", pool_name, "-l"], ["keys", pool_name, "--json"],
                 ["status", pool_name], ["status", pool_name, "--json"], ["status", "--format", "prometheus"],
                 ["verify", pool_name], ["snapshots", pool_name], ["list"]):
        assert cli("cache", *args).returncode == 0, args
    peek = cli("cache", "get", pool_name, "a", "--peek")
    assert peek.returncode == 0 and peek.stdout == b"v" * 3000
    assert cli("cache", "get", pool_name, "nope", "--peek").returncode == 66
    after = pool.stats()
    for c in ("hits", "misses", "puts", "evictions", "expirations", "deletes"):
        assert after[c] == before[c], c
    for i in range(14):  # fill the pool: LRU evicts "a" first, since nothing above touched it
        pool.put(f"fill{i}", b"f" * 3000)
    assert "a" not in pool and "b" in pool


def test_attached_shows_pid_command_and_uid(pool, pool_name):
    child = spawn_py(f"""
        import sys
        from cortex_cache import Pool
        p = Pool.open({pool_name!r})
        print("ready", flush=True)
        sys.stdin.read()
    """)
    try:
        assert child.stdout.readline() == b"ready\n"
        st = _doc(cli("cache", "status", pool_name, "--json"))
        mine = [a for a in st["attached"] if a["pid"] == child.pid]
        assert mine == [{"pid": child.pid, "command": mine[0]["command"], "uid": os.getuid()}]
        assert mine[0]["command"].startswith("python")
        table = cli("cache", "status", pool_name).stdout.decode()
        assert f"{child.pid} ({mine[0]['command']}, uid {os.getuid()})" in table
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_doctor_finds_a_leftover_staging_segment(pool, pool_name):
    r = cli("cache", "doctor", "--json")  # exit 1 where cron's PATH has no cortex (as here): read the findings
    doc = json.loads(r.stdout)
    assert r.returncode == (0 if all(f["ok"] for f in doc["findings"]) else 1)
    by_check = {f["check"]: f for f in doc["findings"]}
    assert by_check["shm"]["ok"] and by_check["staging"]["ok"]
    staging = Pool.create(snap.STAGING_PREFIX + "0123456789abcdef", "64K", block_size="4K")
    staging.close()
    try:
        r = cli("cache", "doctor", "--json")
        assert r.returncode == 1
        bad = [f for f in json.loads(r.stdout)["findings"] if not f["ok"]]
        assert any(f["check"] == "staging" and "cortex cache delete" in f["fix"] for f in bad)
        text = cli("cache", "doctor")
        assert text.returncode == 1 and b"FAIL" in text.stdout and b"fix: " in text.stdout
    finally:
        Pool.unlink(snap.STAGING_PREFIX + "0123456789abcdef")


def test_doctor_names_the_cortex_cron_would_run(tmp_path):
    from cortex_cache import doctor

    (f,) = doctor.check_cron_cortex(running=str(tmp_path / "bin" / "cortex"))
    # No `cortex` on cron's PATH: the set-up the recipes recommend (absolute paths), so a warning, not a FAIL.
    assert f["ok"] and f["warning"] and str(tmp_path / "bin" / "cortex") in f["fix"]
    r = cli("cache", "doctor")
    assert b"warn a cron job" in r.stdout and b"FAIL a cron job" not in r.stdout


def test_json_errors_are_json_on_stderr(pool_name):
    r = cli("cache", "status", pool_name, "--json")
    assert r.returncode == 66 and r.stdout == b""
    doc = json.loads(r.stderr)
    assert doc["exit"] == 66 and pool_name in doc["error"] and "time" in doc
    r = cli("cache", "keys", pool_name, "--limit", "0", "--json")
    doc = json.loads(r.stderr)
    assert r.returncode == 2 and doc["exit"] == 2 and "Input should" not in doc["error"] and "at least 1" in doc["error"]


def test_version():
    from importlib.metadata import version

    for args in (["--version"], ["cache", "--version"]):
        r = cli(*args)
        assert r.returncode == 0 and r.stdout.decode() == f"cortex-cache {version('cortex-cache')} (C fast path)\n"
    r = cli("--version", env={"CORTEX_CACHE_PURE_PYTHON": "1"})
    assert r.stdout.decode().endswith("(pure-Python path: CORTEX_CACHE_PURE_PYTHON is set)\n")


def test_get_output_dash_is_stdout(pool, pool_name, tmp_path):
    pool.put("k", b"value")
    r = cli("cache", "get", pool_name, "k", "-o", "-")
    assert r.returncode == 0 and r.stdout == b"value"
    assert not (REPO / "-").exists()


def test_evict_several_keys_by_repeating_the_option(pool, pool_name):
    for k in "abc":
        pool.put(k, b"v")
    assert _doc(cli("cache", "evict", pool_name, "--key", "a", "--key", "b", "--json"))["entries"] == 2
    assert "--key a --key b" in cli("cache", "evict", "--help").stdout.decode()


def test_delete_confirms(pool_name):
    Pool.create(pool_name, "64K", block_size="4K").close()
    r = cli("cache", "delete", pool_name)
    assert r.returncode == 0 and f"deleted pool {pool_name}" in r.stdout.decode()
    assert cli("cache", "delete", pool_name, "-q").returncode == 66


def test_status_json_with_another_format_is_a_usage_error(pool, pool_name):
    r = cli("cache", "status", pool_name, "--json", "--format", "table")
    assert r.returncode == 2 and b"contradict" in r.stderr


def test_help_writes_required_arguments_as_the_man_page_does():
    out = cli("cache", "create", "--help").stdout.decode()
    assert "Usage: cortex cache create [OPTIONS] NAME" in out and "{NAME}" not in out


@pytest.fixture
def no_redis(tmp_path):
    """An environment whose Python cannot import redis-py."""
    fake = tmp_path / "fake" / "redis"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('redis-py is hidden by this test')\n")
    return {"PYTHONPATH": str(tmp_path / "fake")}


def test_create_with_a_remote_needs_redis_py(pool_name, no_redis):
    r = cli("cache", "create", pool_name, "--size", "64K", "--remote", "redis://127.0.0.1:1/0", env=no_redis)
    assert r.returncode == 69 and b"cortex-cache[remote]" in r.stderr
    assert not Pool.exists(pool_name)


def test_brackets_in_messages_are_not_eaten_as_markup(pool_name, no_redis):
    pytest.importorskip("redis")
    with Pool.create(pool_name, "64K", block_size="4K", remote="redis://127.0.0.1:1/0"):
        pass
    try:
        out = cli("cache", "status", pool_name, env=no_redis).stdout.decode()
        assert "pip install 'cortex-cache[remote]'" in out
    finally:
        Pool.unlink(pool_name)
