"""The operator CLI, `cortex cache ...`, run as real subprocesses (docs/cli.md).

Every command is run through `python -m cortex_cache` against real shared
memory.  Pools a test needs but does not itself test the creation of are made
with the library in this process (milliseconds, versus ~0.3 s per CLI call);
the figures the CLI reports are checked against what was stored.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import cli, run_py, spawn_py

SHM = Path("/dev/shm")
MiB = 1024 * 1024

# Binary payloads: every byte value, NULs and 0xff runs, odd lengths.
BIN = bytes(range(256)) * 16 + b"\x00\xff" * 100 + b"\x00"  # 4297 bytes
FILE_DATA = b"\xff\x00" * 3000 + b"\x00tail\xff"  # 6006 bytes

ANSI = b"\x1b["


# ---------------------------------------------------------------- helpers


def prefix() -> str:
    return os.environ["CORTEX_CACHE_SHM_PREFIX"]


def seg_path(name: str) -> Path:
    return SHM / (prefix() + name)


def our_segments() -> set[str]:
    p = prefix()
    return {e.name for e in SHM.iterdir() if e.name.startswith(p)}


def show(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\nstdout: {r.stdout[:2000]!r}\nstderr: {r.stderr[:4000]!r}"


def ok(r: subprocess.CompletedProcess, *, quiet_stderr: bool = True) -> subprocess.CompletedProcess:
    """Assert a command succeeded, wrote nothing to stderr, and no escape codes (stdout is a pipe)."""
    assert r.returncode == 0, show(r)
    if quiet_stderr:
        assert r.stderr == b"", show(r)
    assert ANSI not in r.stdout and ANSI not in r.stderr, show(r)
    return r


def failed(r: subprocess.CompletedProcess, code: int) -> str:
    """Assert the documented failure shape: exit code, empty stdout, one stderr line, no traceback."""
    assert r.returncode == code, show(r)
    assert r.stdout == b"", show(r)
    assert r.stderr.endswith(b"\n") and r.stderr.count(b"\n") == 1, show(r)
    assert b"Traceback" not in r.stderr, show(r)
    assert r.stderr.startswith(b"cortex: "), show(r)
    assert ANSI not in r.stderr, show(r)
    return r.stderr.decode()


def jdoc(r: subprocess.CompletedProcess):
    """The --json document: one line, with a `time` field (taken out, so tests compare the rest)."""
    ok(r)
    assert r.stdout.count(b"\n") == 1, r.stdout
    doc = json.loads(r.stdout)
    if isinstance(doc, dict):
        assert isinstance(doc.pop("time"), str) and doc.pop("schema") == 1
    return doc


def lib_stats(name: str) -> dict:
    from cortex_cache import Pool

    with Pool.open(name) as p:
        return p.stats()


def lib_keys(name: str) -> list:
    from cortex_cache import Pool

    with Pool.open(name) as p:
        return list(p.keys())


def fill(name: str, items: list[tuple[str, bytes]], **put_kw) -> None:
    from cortex_cache import Pool

    with Pool.open(name) as p:
        for k, v in items:
            p.put(k, v, **put_kw)


@pytest.fixture
def new_pool(pool_name, cleanup):
    """Factory: create a 4 MiB pool of 4 KiB blocks with the library, closed; return its name."""
    from cortex_cache import Pool

    count = 0

    def make(suffix: str | None = None, size: str = "4M", **kw) -> str:
        nonlocal count
        count += 1
        name = f"{pool_name}-{suffix or count}"
        cleanup.append(name)
        kw.setdefault("block_size", "4K")
        Pool.create(name, size, **kw).close()
        return name

    return make


# ---------------------------------------------------------------- happy paths


def test_create_put_get_delete_roundtrip(pool_name, cleanup, tmp_path):
    cleanup.append(pool_name)
    r = ok(cli("cache", "create", pool_name, "--size", "4M", "--block-size", "4K", "--tier", "cpu"))
    assert pool_name in r.stdout.decode()
    path = seg_path(pool_name)
    assert path.is_file()
    assert path.stat().st_mode & 0o777 == 0o600  # private by default

    # put from stdin with '-', and from a FILE; both binary with NULs and 0xff
    r = ok(cli("cache", "put", pool_name, "bin", "-", input=BIN))
    assert r.stdout == b""
    src = tmp_path / "value.bin"
    src.write_bytes(FILE_DATA)
    r = ok(cli("cache", "put", pool_name, "file", str(src)))
    assert r.stdout == b""

    # get to stdout: exactly the bytes, nothing else
    r = ok(cli("cache", "get", pool_name, "bin"))
    assert r.stdout == BIN

    # get -o FILE: exact content, mode 0600, nothing on stdout
    out = tmp_path / "out.bin"
    r = ok(cli("cache", "get", pool_name, "file", "-o", str(out)))
    assert r.stdout == b""
    assert out.read_bytes() == FILE_DATA
    assert out.stat().st_mode & 0o777 == 0o600

    st = lib_stats(pool_name)
    assert st["size_bytes"] == 4 * MiB and st["block_size"] == 4096
    assert st["entries"] == 2 and st["puts"] == 2
    assert st["value_bytes"] == len(BIN) + len(FILE_DATA)
    assert st["hits"] == 2 and st["misses"] == 0

    # -o refuses to overwrite an existing file (exit 73) and leaves it alone
    out.write_bytes(b"precious\x00")
    failed(cli("cache", "get", pool_name, "bin", "-o", str(out)), 73)
    assert out.read_bytes() == b"precious\x00"

    # delete; then the pool is gone for every command
    r = ok(cli("cache", "delete", pool_name))
    assert r.stdout == f"deleted pool {pool_name}\n".encode()  # a confirmation, as create gives
    assert not path.exists()
    failed(cli("cache", "status", pool_name), 66)


def test_put_replaces_and_empty_value(new_pool, tmp_path):
    from cortex_cache import Pool

    name = new_pool()
    ok(cli("cache", "put", name, "k", "-", input=b"first value"))
    ok(cli("cache", "put", name, "k", "-", input=b"\x00"))  # replaces
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    ok(cli("cache", "put", name, "e", str(empty)))  # an empty value is a value
    with Pool.open(name) as p:
        assert p.get("k") == b"\x00"
        assert p.get("e") == b""
    st = lib_stats(name)
    assert st["entries"] == 2 and st["puts"] == 3 and st["value_bytes"] == 1


def test_put_ttl_and_priority_options(new_pool):
    name = new_pool()
    ok(cli("cache", "put", name, "t", "-", "--ttl", "3600", "--priority", "7", input=b"abc"))
    from cortex_cache import Pool

    with Pool.open(name) as p:
        info = p.info("t")
    assert info["priority"] == 7
    assert info["expires"] is not None and 3500 < info["ttl_remaining"] <= 3600


def test_status_exact_counts(new_pool):
    name = new_pool()
    fill(name, [("a", b"x" * 1000), ("b", b"y" * 5000)])  # 1 block + 2 blocks of 4 KiB
    assert ok(cli("cache", "get", name, "a")).stdout == b"x" * 1000
    failed(cli("cache", "get", name, "nope"), 66)

    st = jdoc(cli("cache", "status", name, "--json"))
    assert st["name"] == name
    assert st["size_bytes"] == 4 * MiB
    assert st["block_size"] == 4096 and st["blocks_total"] == 1024
    assert st["entries"] == 2
    assert st["value_bytes"] == 6000
    assert st["blocks_used"] == 3 and st["used_bytes"] == 3 * 4096
    assert st["hits"] == 1 and st["misses"] == 1
    assert st["puts"] == 2 and st["evictions"] == 0 and st["deletes"] == 0
    assert st["policy"] == "auto" and st["mode"] == "0600"  # the default policy
    assert isinstance(st["attached_pids"], list)

    # --format json is the same document as --json
    st2 = jdoc(cli("cache", "status", name, "--format", "json"))
    assert {k: st2[k] for k in ("entries", "value_bytes", "hits", "misses", "puts")} == {
        k: st[k] for k in ("entries", "value_bytes", "hits", "misses", "puts")
    }

    text = ok(cli("cache", "status", name)).stdout.decode()
    assert name in text
    assert "4194304" in text  # exact size in bytes
    assert re.search(r"\b2 of 1024\b", text), text  # entries of max
    assert re.search(r"\b1 / 1\b", text), text  # hits / misses


def test_keys_plain_prefix_limit_long_json(new_pool):
    name = new_pool()
    items = [("user42/a", b"a" * 10), ("user42/b", b"\x00" * 20), ("other", b"o" * 30), ("ключ/é", b"\xff" * 40)]
    fill(name, items[:2])
    fill(name, items[2:3], priority=7)
    fill(name, items[3:])

    r = ok(cli("cache", "keys", name))
    assert r.stdout.decode("utf-8").splitlines() == [k for k, _ in items]  # oldest first

    r = ok(cli("cache", "keys", name, "--prefix", "user42/"))
    assert r.stdout.decode().splitlines() == ["user42/a", "user42/b"]

    r = ok(cli("cache", "keys", name, "--limit", "2"))
    assert r.stdout.decode().splitlines() == ["user42/a", "user42/b"]

    r = ok(cli("cache", "keys", name, "--long"))
    lines = r.stdout.decode("utf-8").splitlines()
    assert lines[0].split()[:3] == ["KEY", "TIER", "SIZE"]
    for k, v in items:
        row = [ln for ln in lines if ln.split() and ln.split()[0] == k]
        assert len(row) == 1, (k, lines)
        assert row[0].split()[1:3] == ["memory", str(len(v))], row

    doc = jdoc(cli("cache", "keys", name, "--json"))
    assert [e["key"] for e in doc["keys"]] == [k for k, _ in items]
    assert [e["size"] for e in doc["keys"]] == [len(v) for _, v in items]
    assert [e["priority"] for e in doc["keys"]] == [0, 0, 7, 0]
    assert all(e["ttl_remaining"] is None for e in doc["keys"])


def test_list_and_status_of_all_pools(new_pool):
    a = new_pool("a")
    b = new_pool("b", size="2M")
    fill(a, [("k1", b"1" * 100), ("k2", b"2" * 200)])

    r = ok(cli("cache", "list"))
    lines = r.stdout.decode().splitlines()
    for n, entries in ((a, "2"), (b, "0")):
        row = [ln.split() for ln in lines if ln.split() and ln.split()[0] == n]
        assert len(row) == 1, lines
        assert entries in row[0], row

    doc = jdoc(cli("cache", "list", "--json"))
    pools = {p["name"]: p for p in doc["pools"]}
    assert pools[a]["entries"] == 2 and pools[a]["value_bytes"] == 300 and pools[a]["size_bytes"] == 4 * MiB
    assert pools[b]["entries"] == 0 and pools[b]["size_bytes"] == 2 * MiB

    doc = jdoc(cli("cache", "status", "--json"))
    assert set(doc) == {"pools"}
    pools = {p["name"]: p for p in doc["pools"]}
    assert pools[a]["entries"] == 2 and pools[a]["puts"] == 2 and pools[a]["value_bytes"] == 300
    assert pools[b]["entries"] == 0 and pools[b]["size_bytes"] == 2 * MiB

    text = ok(cli("cache", "status")).stdout.decode()
    assert a in text and b in text


def test_no_pools(tmp_path):
    # A prefix of our own that no segment has.
    env = {"CORTEX_CACHE_SHM_PREFIX": prefix() + "none."}
    r = cli("cache", "list", env=env)
    assert r.returncode == 0 and r.stdout == b"", show(r)
    assert jdoc(cli("cache", "list", "--json", env=env)) == {"pools": []}
    assert jdoc(cli("cache", "status", "--json", env=env)) == {"pools": []}


EVICT_ITEMS = [("user42/a", 1000), ("user42/b", 2000), ("other/c", 3000), ("other/d", 4000)]


@pytest.mark.parametrize(
    "args, entries, nbytes, left",
    [
        pytest.param(["--key", "user42/a", "--key", "other/c"], 2, 4000, ["user42/b", "other/d"], id="key"),
        pytest.param(["--prefix", "user42/"], 2, 3000, ["other/c", "other/d"], id="prefix"),
        pytest.param(["--all"], 4, 10000, [], id="all"),
        # lru: least recently used first; 30% of 10000 bytes = 3000 -> a and b
        pytest.param(["--percent", "30"], 2, 3000, ["other/c", "other/d"], id="percent"),
        # 1KB is 1000 bytes (decimal unit): exactly a
        pytest.param(["--bytes", "1KB"], 1, 1000, ["user42/b", "other/c", "other/d"], id="bytes-KB"),
        # 2K is 2048 bytes: a (1000) is not enough, so b too
        pytest.param(["--bytes", "2K"], 2, 3000, ["other/c", "other/d"], id="bytes-K"),
        pytest.param(["--expired"], 1, 500, ["user42/a", "user42/b", "other/c", "other/d", "ttl/long"], id="expired"),
    ],
)
def test_evict_selectors(new_pool, args, entries, nbytes, left):
    from cortex_cache import Pool

    name = new_pool()
    fill(name, [(k, bytes([i]) * n) for i, (k, n) in enumerate(EVICT_ITEMS)])
    if args == ["--expired"]:
        # Expired for certain: stored through a handle whose clock is an hour behind.
        with Pool.open(name, clock=lambda: time.time() - 3600) as p:
            p.put("ttl/gone", b"e" * 500, ttl=60)
        fill(name, [("ttl/long", b"l" * 700)], ttl=3600)
    before = lib_stats(name)

    doc = jdoc(cli("cache", "evict", name, *args, "--json"))
    assert doc == {"pool": name, "tier": "memory", "entries": entries, "bytes": nbytes,
                   **({"missing": []} if "--key" in args else {})}

    assert lib_keys(name) == left
    after = lib_stats(name)
    assert after["entries"] == len(left)
    if args == ["--expired"]:  # reclaimed expired entries are counted as expirations
        assert after["expirations"] - before["expirations"] == entries
        assert after["evictions"] == before["evictions"]
    else:
        assert after["evictions"] - before["evictions"] == entries
        assert after["bytes_evicted"] - before["bytes_evicted"] == nbytes


def test_evict_human_output(new_pool):
    name = new_pool()
    fill(name, [("a", b"1" * 1000), ("b", b"2" * 24)])
    r = ok(cli("cache", "evict", name, "--all"))
    text = r.stdout.decode()
    assert "2 entries" in text and "1024 bytes" in text, text
    assert lib_stats(name)["entries"] == 0


def test_verify_ok_and_corruption(new_pool):
    from cortex_cache import Pool

    name = new_pool()
    fill(name, [("a", b"A" * 5000), ("b", b"B" * 100)])
    r = ok(cli("cache", "verify", name))
    assert "ok" in r.stdout.decode()
    doc = jdoc(cli("cache", "verify", name, "--json"))
    assert doc["ok"] is True and doc["problems"] == [] and doc["entries"] == 2

    # Flip bytes of a's value in the segment itself: verify must now find a problem (exit 1).
    with Pool.open(name) as p:
        off = p.geometry.data_off + p.info("a")["first_block"] * p.geometry.block_size
    with open(seg_path(name), "r+b") as f:
        f.seek(off + 100)
        f.write(b"corrupt!")
    r = cli("cache", "verify", name, "--json")
    assert r.returncode == 1, show(r)
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["problems"], doc
    r = cli("cache", "verify", name, "--repair")
    assert r.returncode == 1, show(r)  # a problem was found, even though it was repaired
    ok(cli("cache", "verify", name))
    assert lib_keys(name) == ["b"]


def test_delete_refuses_pool_in_use_unless_forced(new_pool):
    name = new_pool()
    child = spawn_py(
        """
        import sys
        from cortex_cache import Pool
        p = Pool.open(sys.argv[1])
        print("ready", flush=True)
        sys.stdin.read()
        p.close()
        """,
        name,
    )
    try:
        assert child.stdout.readline() == b"ready\n"
        st = jdoc(cli("cache", "status", name, "--json"))
        assert child.pid in st["attached_pids"]
        failed(cli("cache", "delete", name), 75)
        assert seg_path(name).exists()
        ok(cli("cache", "delete", name, "--force"))
        assert not seg_path(name).exists()
    finally:
        child.communicate(b"", timeout=30)
    assert child.returncode == 0, child.stderr


# ---------------------------------------------------------------- prometheus


def test_status_prometheus(new_pool):
    from prometheus_client.parser import text_string_to_metric_families

    from cortex_cache import Pool

    a = new_pool("a")
    b = new_pool("b")
    with Pool.open(a) as p:
        p.put("k1", b"1" * 1000)
        p.put("k2", b"2" * 10)
        assert p.get("k1") == b"1" * 1000
        assert p.get("k1") is not None
        assert p.get("missing") is None
    fill(b, [("z", b"z")])

    def parse(text: str) -> dict:
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, s.labels["pool"])] = (fam.type, s.value)
        return out

    m = parse(ok(cli("cache", "status", "--format", "prometheus")).stdout.decode())
    assert m[("cortex_cache_entries", a)] == ("gauge", 2)
    assert m[("cortex_cache_hits_total", a)] == ("counter", 2)
    assert m[("cortex_cache_misses_total", a)] == ("counter", 1)
    assert m[("cortex_cache_puts_total", a)] == ("counter", 2)
    assert m[("cortex_cache_value_bytes", a)] == ("gauge", 1010)
    assert m[("cortex_cache_size_bytes", a)] == ("gauge", 4 * MiB)
    assert m[("cortex_cache_up", a)] == ("gauge", 1)
    assert m[("cortex_cache_entries", b)] == ("gauge", 1)
    assert m[("cortex_cache_hits_total", b)] == ("counter", 0)

    m = parse(ok(cli("cache", "status", b, "--format", "prometheus")).stdout.decode())
    assert {pool for _, pool in m} == {b}
    assert m[("cortex_cache_puts_total", b)] == ("counter", 1)


# ---------------------------------------------------------------- bad input

BAD = [
    # (id, args, exit code, stdin, words the one-line message must contain)
    ("name-slash", ["create", "bad/name", "--size", "4M"], 2, None, ["bad/name"]),
    ("name-dotdot", ["create", "../x", "--size", "4M"], 2, None, ["../x"]),
    ("name-empty", ["create", "", "--size", "4M"], 2, None, []),
    ("name-dash", ["create", "-x", "--size", "4M"], 2, None, []),
    ("name-65", ["create", "n" * 65, "--size", "4M"], 2, None, []),
    ("status-bad-name", ["status", "bad/name"], 2, None, []),
    ("delete-bad-name", ["delete", "../x"], 2, None, []),
    ("put-bad-name", ["put", "n" * 65, "k", "-"], 2, b"v", []),
    ("size-0", ["create", "{new}", "--size", "0"], 2, None, []),
    ("size-neg", ["create", "{new}", "--size=-1"], 2, None, []),
    ("size-abc", ["create", "{new}", "--size", "abc"], 2, None, ["abc"]),
    ("size-1.5.5G", ["create", "{new}", "--size", "1.5.5G"], 2, None, ["1.5.5G"]),
    ("size-10Q", ["create", "{new}", "--size", "10Q"], 2, None, ["10Q"]),
    ("block-size-3K", ["create", "{new}", "--size", "4M", "--block-size", "3K"], 2, None, []),
    ("tier-gpu", ["create", "{new}", "--size", "4M", "--tier", "gpu"], 2, None, ["gpu", "cpu"]),
    ("policy-foo", ["create", "{new}", "--size", "4M", "--policy", "foo"], 2, None,
     ["foo", "lru", "lfu", "fifo", "priority", "ttl", "size"]),
    ("mode-0777x", ["create", "{new}", "--size", "4M", "--mode", "0777x"], 2, None, []),
    ("mode-0400", ["create", "{new}", "--size", "4M", "--mode", "0400"], 2, None, []),
    ("mode-01777", ["create", "{new}", "--size", "4M", "--mode", "01777"], 2, None, []),
    ("max-entries-0", ["create", "{new}", "--size", "4M", "--max-entries", "0"], 2, None, []),
    ("create-exists", ["create", "{pool}", "--size", "4M"], 73, None, []),
    ("create-100T", ["create", "{new}", "--size", "100T"], 73, None, []),
    ("evict-no-selector", ["evict", "{pool}"], 2, None, []),
    ("evict-two-selectors", ["evict", "{pool}", "--all", "--key", "w1"], 2, None, []),
    ("evict-percent-0", ["evict", "{pool}", "--percent", "0"], 2, None, []),
    ("evict-percent-150", ["evict", "{pool}", "--percent", "150"], 2, None, []),
    ("evict-bytes-0", ["evict", "{pool}", "--bytes", "0"], 2, None, []),
    ("get-missing-key", ["get", "{pool}", "nokey"], 66, None, ["nokey"]),
    ("put-missing-file", ["put", "{pool}", "k", "{nofile}"], 66, None, []),
    ("put-directory", ["put", "{pool}", "k", "{dir}"], 2, None, []),
    ("put-too-large", ["put", "{pool}", "big", "-"], 2, b"\x00" * (5 * MiB), []),
    ("put-ttl-0", ["put", "{pool}", "k", "-", "--ttl", "0"], 2, b"v", []),
    ("get-o-no-dir", ["get", "{pool}", "w1", "-o", "{dir}/no/such/dir/out"], 73, None, []),
    ("persist-o-no-dir", ["persist", "{pool}", "-o", "{dir}/no/such/dir/out.ccsnap"], 73, None, []),
    ("keys-limit-0", ["keys", "{pool}", "--limit", "0"], 2, None, []),
    ("status-format-xml", ["status", "{pool}", "--format", "xml"], 2, None, []),
    ("unknown-command", ["frobnicate", "{pool}"], 2, None, []),
    ("unknown-option", ["status", "{pool}", "--frob"], 2, None, []),
    ("missing-status", ["status", "{missing}"], 66, None, ["{missing}"]),
    ("missing-keys", ["keys", "{missing}"], 66, None, ["{missing}"]),
    ("missing-get", ["get", "{missing}", "k"], 66, None, ["{missing}"]),
    ("missing-put", ["put", "{missing}", "k", "-"], 66, b"value", ["{missing}"]),
    ("missing-evict", ["evict", "{missing}", "--all"], 66, None, ["{missing}"]),
    ("missing-verify", ["verify", "{missing}"], 66, None, ["{missing}"]),
    ("missing-delete", ["delete", "{missing}"], 66, None, ["{missing}"]),
    # restore: the snapshot is read and verified whole before any pool is touched
    ("restore-missing-file", ["restore", "{new}", "--input", "{nofile}"], 66, None, ["{nofile}"]),
    ("restore-missing-file-replace", ["restore", "{pool}", "--input", "{nofile}", "--replace"], 66, None, ["{nofile}"]),
    ("restore-no-snapshot", ["restore", "{new}"], 66, None, ["{new}"]),
    ("restore-empty-file", ["restore", "{new}", "--input", "{empty}"], 65, None, ["{empty}"]),
    ("restore-empty-file-replace", ["restore", "{pool}", "-i", "{empty}", "--replace"], 65, None, ["{empty}"]),
    ("restore-garbage", ["restore", "{new}", "-i", "{garbage}"], 65, None, ["{garbage}"]),
    ("restore-damaged-value", ["restore", "{new}", "-i", "{damaged}"], 65, None, ["{damaged}"]),
    ("restore-damaged-value-replace", ["restore", "{pool}", "-i", "{damaged}", "--replace"], 65, None, ["{damaged}"]),
    ("restore-truncated-replace", ["restore", "{pool}", "-i", "{truncated}", "--replace"], 65, None, ["{truncated}"]),
    ("restore-directory", ["restore", "{new}", "-i", "{dir}"], 2, None, []),
    ("restore-exists", ["restore", "{pool}", "-i", "{snap}"], 73, None, ["--replace"]),
    ("restore-bad-name", ["restore", "bad/name", "-i", "{snap}"], 2, None, ["bad/name"]),
    ("persist-missing", ["persist", "{missing}"], 66, None, ["{missing}"]),
    ("persist-keep-0", ["persist", "{pool}", "--keep", "0"], 2, None, []),
    ("persist-keep-and-output", ["persist", "{pool}", "-o", "{dir}/s.ccsnap", "--keep", "2"], 2, None, []),
]
WATCHED = ("entries", "puts", "deletes", "evictions", "expirations", "value_bytes", "blocks_used", "policy", "size_bytes")


def _snapshot_files(pool: str, tmp_path: Path) -> dict[str, str]:
    """Snapshot files for restore's bad inputs: empty, not a snapshot, a value damaged, truncated, and a good one."""
    from cortex_cache import Pool, persist

    good = tmp_path / "good.ccsnap"
    with Pool.open(pool) as p:
        persist.persist(p, good)
    data = good.read_bytes()
    at = data.index(b"twotwotwo")  # inside w2's value: only that record's checksum can tell
    files = {
        "{snap}": data,
        "{empty}": b"",
        "{garbage}": bytes(range(256)) * 64,
        "{damaged}": data[:at] + b"X" + data[at + 1:],
        "{truncated}": data[: len(data) * 2 // 3],
    }
    out = {}
    for key, content in files.items():
        f = tmp_path / (key.strip("{}") + ".ccsnap")
        f.write_bytes(content)
        out[key] = str(f)
    return out


@pytest.mark.parametrize("args, code, stdin, words", [pytest.param(*c[1:], id=c[0]) for c in BAD])
def test_bad_input(new_pool, pool_name, tmp_path, args, code, stdin, words):
    from cortex_cache import Pool

    witness = new_pool("witness")
    fill(witness, [("w1", b"one\x00"), ("w2", b"two" * 1000)])
    subst = {
        "{pool}": witness,
        "{new}": f"{pool_name}-new",
        "{missing}": f"{pool_name}-missing",
        "{dir}": str(tmp_path),
        "{nofile}": str(tmp_path / "no-such-file"),
    }
    if any(a in " ".join(args) for a in ("{empty}", "{garbage}", "{damaged}", "{truncated}", "{snap}")):
        subst.update(_snapshot_files(witness, tmp_path))

    def fmt(s: str) -> str:
        for k, v in subst.items():
            s = s.replace(k, v)
        return s

    before_segments = our_segments()
    before = {k: lib_stats(witness)[k] for k in WATCHED}
    before_files = sorted(p.name for p in tmp_path.iterdir())

    r = cli("cache", *map(fmt, args), input=stdin)

    msg = failed(r, code)
    for w in words:
        assert fmt(w) in msg, msg
    # Nothing changed: no new segment, the existing pool as it was, no stray file.
    assert our_segments() == before_segments
    assert {k: lib_stats(witness)[k] for k in WATCHED} == before
    assert lib_keys(witness) == ["w1", "w2"]
    with Pool.open(witness) as p:
        assert p.get("w1") == b"one\x00"
    assert sorted(p.name for p in tmp_path.iterdir()) == before_files


def test_put_without_file_from_a_terminal_is_usage_error(new_pool):
    """`put NAME KEY` with stdin a TTY must not hang waiting for input: exit 2."""
    name = new_pool()
    master, slave = pty.openpty()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "cortex_cache", "cache", "put", name, "k"],
            stdin=slave, capture_output=True, timeout=30, cwd=Path(__file__).resolve().parent.parent,
        )
    finally:
        os.close(slave)
        os.close(master)
    failed(r, 2)
    assert lib_stats(name)["entries"] == 0


# ---------------------------------------------------------------- output rules


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"TERM": "xterm-256color", "COLORTERM": "truecolor"}, id="pipe"),
        pytest.param({"TERM": "xterm-256color", "COLORTERM": "truecolor", "NO_COLOR": "1"}, id="pipe-NO_COLOR"),
    ],
)
def test_no_escape_codes_when_piped(new_pool, env):
    name = new_pool()
    fill(name, [("k", b"v" * 10)])
    for args in (["status", name], ["list"], ["keys", name, "--long"]):
        r = cli("cache", *args, env=env)
        ok(r)  # asserts no ESC[ on stdout or stderr, and a quiet stderr
        assert r.stdout.strip(), args
    r = cli("cache", "status", name + "-missing", env=env)
    failed(r, 66)  # asserts no ESC[ on stderr


def _sgr_colour_params(data: bytes) -> list[str]:
    """The SGR parameters in `data` that set a colour (foreground/background)."""
    found = []
    for seq in re.findall(rb"\x1b\[([0-9;]*)m", data):
        parts = [int(x) for x in seq.split(b";") if x]
        for n in parts:
            if 30 <= n <= 38 or 40 <= n <= 48 or 90 <= n <= 97 or 100 <= n <= 107:
                found.append(seq.decode())
                break
    return found


def test_no_colour_on_a_terminal_with_NO_COLOR(new_pool):
    name = new_pool()
    fill(name, [("k", b"v" * 10)])
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLORTERM="truecolor", NO_COLOR="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cortex_cache", "cache", "status", name],
        stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    os.close(slave)
    out = b""
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        assert proc.wait(timeout=30) == 0, out
    assert name.encode() in out
    assert _sgr_colour_params(out) == [], out


def test_long_names_and_keys_are_not_cut_when_piped(pool_name, cleanup):
    """A 64-character name and a long key come out whole in a pipe: not wrapped, not cut to 80 columns."""
    name = (pool_name + "-" + "n" * 64)[:64]
    cleanup.append(name)
    key = "user42/" + "k" * 150
    problems = []
    r = ok(cli("cache", "create", name, "--size", "1M", "--block-size", "4K"))
    if r.stdout.decode().count("\n") != 1 or name not in r.stdout.decode():
        problems.append(f"create: {r.stdout!r}")
    fill(name, [(key, b"value")])
    r = ok(cli("cache", "list"))
    if name not in r.stdout.decode().split():
        problems.append(f"list: {r.stdout!r}")
    r = ok(cli("cache", "keys", name, "--long"))
    if key not in r.stdout.decode().split():
        problems.append(f"keys --long: {r.stdout!r}")
    r = ok(cli("cache", "status", name))
    if name not in r.stdout.decode():
        problems.append(f"status: {r.stdout!r}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- --debug


@pytest.mark.parametrize(
    "argv, env, traceback",
    [
        pytest.param(["--debug", "cache", "status", "{missing}"], {}, True, id="debug-first"),
        pytest.param(["cache", "--debug", "status", "{missing}"], {}, True, id="debug-middle"),
        pytest.param(["cache", "status", "{missing}", "--debug"], {}, True, id="debug-last"),
        pytest.param(["cache", "status", "{missing}"], {"CORTEX_CACHE_DEBUG": "1"}, True, id="env-1"),
        pytest.param(["cache", "status", "{missing}"], {"CORTEX_CACHE_DEBUG": "0"}, False, id="env-0"),
        pytest.param(["cache", "status", "{missing}"], {}, False, id="plain"),
    ],
)
def test_debug_shows_traceback(pool_name, argv, env, traceback):
    missing = f"{pool_name}-missing"
    r = cli(*(a.replace("{missing}", missing) for a in argv), env=env)
    if not traceback:
        failed(r, 66)
        return
    assert r.returncode == 66, show(r)
    assert r.stdout == b""
    err = r.stderr.decode()
    assert "Traceback (most recent call last)" in err, err
    assert "PoolNotFound" in err, err
    # The one-line message is still the last line.
    assert err.splitlines()[-1].startswith("cortex: error:") and missing in err.splitlines()[-1], err


def test_double_dash_ends_options(new_pool):
    """After `--`, `--debug` is an ordinary argument (here, a key)."""
    name = new_pool()
    ok(cli("cache", "put", name, "--", "--debug", "-", input=b"v"))
    assert lib_keys(name) == ["--debug"]


# ---------------------------------------------------------------- help


COMMANDS = ["create", "list", "status", "delete", "put", "get", "info", "keys", "evict", "verify"]


def test_help():
    r = ok(cli("cache", "--help"))
    text = r.stdout.decode()
    for cmd in COMMANDS:
        assert cmd in text
    for code in ("66", "73", "77"):  # exit codes are documented in --help
        assert code in text, text
    r = ok(cli("--help"))
    assert "cache" in r.stdout.decode()

    # Every command's help, in one child; none of them may load numpy.
    out = run_py(
        """
        import contextlib, io, json, sys
        from cortex_cache.cli import main
        res = {}
        for cmd in sys.argv[1:]:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                try:
                    rc = main(["cache", cmd, "--help"])
                except SystemExit as e:
                    rc = e.code
            res[cmd] = [rc, buf.getvalue()]
        print(json.dumps({"helps": res, "numpy": "numpy" in sys.modules}))
        """,
        *COMMANDS,
    )
    doc = json.loads(out.stdout)
    for cmd in COMMANDS:
        rc, text = doc["helps"][cmd]
        assert rc in (0, None), (cmd, rc)
        assert "Example:" in text, (cmd, text)
        example = text.split("Example:", 1)[1]
        assert f"cortex cache {cmd}" in example, (cmd, text)
    assert doc["numpy"] is False


def test_console_script():
    script = Path(sys.executable).parent / "cortex"
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    r = subprocess.run([str(script), "cache", "--help"], capture_output=True, timeout=60)
    ok(r)
    assert b"create" in r.stdout
    r = subprocess.run([str(script), "cache", "status", "no-such-pool-x"], capture_output=True, timeout=60)
    failed(r, 66)


def test_help_does_not_import_numpy():
    out = run_py(
        """
        import sys
        from cortex_cache.cli import main
        try:
            main(['--help'])
        except SystemExit:
            pass
        print('numpy' in sys.modules)
        """
    )
    assert out.stdout.decode().strip().splitlines()[-1] == "False"


# ---------------------------------------------------------------- permissions


def test_mode_0660(pool_name, cleanup):
    cleanup.append(pool_name)
    r = ok(cli("cache", "create", pool_name, "--size", "1M", "--block-size", "4K", "--mode", "0660", "--json"))
    assert json.loads(r.stdout)["mode"] == "0660"
    assert seg_path(pool_name).stat().st_mode & 0o777 == 0o660
    st = jdoc(cli("cache", "status", pool_name, "--json"))
    assert st["mode"] == "0660"


def test_mode_is_exact_whatever_the_umask(pool_name, cleanup):
    name = pool_name + "-umask"
    cleanup.append(name)
    run_py(
        """
        import os, sys
        from cortex_cache.cli import main
        os.umask(0o077)
        sys.exit(main(["cache", "create", sys.argv[1], "--size", "1M", "--mode", "0660"]))
        """,
        name,
    )
    assert seg_path(name).stat().st_mode & 0o777 == 0o660


def test_list_and_status_show_damaged_segments_instead_of_crashing(pool_name):
    from cortex_cache import Pool
    from cortex_cache.segment import shm_path

    good, junk, future = pool_name + "-good", pool_name + "-junk", pool_name + "-v9"
    Pool.create(good, "64K", block_size="4K").close()
    try:
        with open(shm_path(junk), "wb") as f:
            f.write(b"definitely not a pool" * 500)
        Pool.create(future, "64K", block_size="4K").close()
        with open(shm_path(future), "r+b") as f:
            f.seek(8)
            f.write((9).to_bytes(4, "little"))  # a format version from the future
        for args in (["list", "--json"], ["status", "--json"]):
            r = cli("cache", *args)
            assert r.returncode == 0, r.stderr
            rows = {row["name"]: row for row in json.loads(r.stdout)["pools"]}
            assert rows[good]["status"] == "ok"
            assert rows[junk]["status"] == "corrupt"
            assert rows[future]["status"] == "corrupt" and "version 9" in rows[future]["error"]
        r = cli("cache", "list")
        assert r.returncode == 0 and junk in r.stdout.decode() and "corrupt" in r.stdout.decode()
        r = cli("cache", "status", junk)
        assert r.returncode == 65 and len(r.stderr.splitlines()) == 1
    finally:
        for n in (good, junk, future):
            if os.path.exists(shm_path(n)):
                os.unlink(shm_path(n))


def test_tables_have_no_trailing_blanks_when_piped(pool_name):
    from cortex_cache import Pool

    Pool.create(pool_name, "64K", block_size="4K").close()
    try:
        for args in (["status", pool_name], ["list"], ["keys", pool_name, "--long"]):
            out = cli("cache", *args).stdout.decode()
            assert out and all(line == line.rstrip() for line in out.splitlines()), args
    finally:
        Pool.unlink(pool_name)
