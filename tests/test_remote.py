"""The remote tier against real redis-server processes: standalone, cluster, killed, paused, restarted."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from cortex_cache import Pool, UsageError
from tests.helpers import REPO, cli, make_value, check_value
from tests.redis_servers import REDIS_CLI, REDIS_SERVER, Cluster, Server

pytestmark = pytest.mark.skipif(not (REDIS_SERVER and REDIS_CLI),
                                reason="needs redis-server and redis-cli (Debian: redis-server; .ci/run installs it)")
redis = pytest.importorskip("redis")


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.stop()


def other_host(code: str, *args: str, prefix_tag: str = "hostb") -> subprocess.CompletedProcess:
    """Run `code` in a process that stands for another host: its own shm prefix, so its own pools."""
    env = dict(os.environ)
    env["CORTEX_CACHE_SHM_PREFIX"] = os.environ["CORTEX_CACHE_SHM_PREFIX"] + prefix_tag + "."
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, env=env,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return r


READ_ON_HOST_B = """
import json, sys
from cortex_cache import Pool
from tests.helpers import check_value
name, url, cluster, n = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
p = Pool.create(name, "8M", remote=url, remote_cluster=cluster)
try:
    got = [check_value(p.get(f"chunk{i}"))[0] for i in range(n)]
    again = p.get("chunk0") is not None           # now from memory
    st = p.stats()
    print(json.dumps({"got": got, "again": again, "remote": st["remote"], "hits": st["hits"]}))
finally:
    p.close()
    Pool.unlink(name)
"""


def _fast(p: Pool, timeout: float = 0.5, backoff: float = 0.0) -> None:
    p.tiers.named("remote").socket_timeout = timeout
    p.tiers.named("remote").backoff = backoff


def test_a_chunk_put_on_one_host_is_found_on_another(make_pool, server, pool_name):
    a = make_pool("8M", name=pool_name, remote=server.url)
    for i in range(10):
        a.put(f"chunk{i}", make_value(i, 0, 50_000 + i))
    assert a.flush_remote(30)
    st = a.stats()["remote"]
    assert st["writes_done"] == 10 and st["errors"] == 0 and st["queue_depth"] == 0
    out = json.loads(other_host(READ_ON_HOST_B, pool_name, server.url, "0", "10").stdout)
    assert out["got"] == list(range(10)) and out["again"]
    assert out["remote"]["hits"] == 10 and out["remote"]["promotions"] == 10 and out["hits"] == 1
    # Keys on the server are namespaced by the pool name.
    keys = sorted(server.client().keys("*"))
    assert keys[0] == f"cortex:1:{pool_name}:chunk0".encode() and len(keys) == 10


def test_a_3_node_cluster_shares_chunks_too(make_pool, cluster, pool_name):
    a = make_pool("8M", name=pool_name, remote=cluster.url, remote_cluster=True)
    for i in range(30):
        a.put(f"chunk{i}", make_value(i, 1, 3000))
    assert a.flush_remote(30) and a.stats()["remote"]["writes_done"] == 30
    on_nodes = [n.client().dbsize() for n in cluster.nodes]
    assert sum(on_nodes) == 30 and all(on_nodes)  # spread over the three masters
    out = json.loads(other_host(READ_ON_HOST_B, pool_name, cluster.url, "1", "30").stdout)
    assert out["got"] == list(range(30)) and out["remote"]["cluster"] is True


def test_ttl_and_delete_reach_the_server(make_pool, server):
    p = make_pool("8M", remote=server.url)
    p.put("short", b"x", ttl=300)
    p.put("gone", b"y")
    p.delete("gone")
    assert p.flush_remote(30)
    c = server.client()
    assert 0 < c.pttl(f"cortex:1:{p.name}:short".encode()) <= 300_000
    assert c.exists(f"cortex:1:{p.name}:gone".encode()) == 0


def test_a_bad_value_on_the_server_is_a_counted_miss(make_pool, server, pool_name):
    a = make_pool("8M", name=pool_name, remote=server.url)
    c = server.client()
    c.set(f"cortex:1:{pool_name}:garbage".encode(), b"not a cortex record at all, just bytes")
    a.put("real", b"r" * 1000)
    assert a.flush_remote(30)
    raw = c.get(f"cortex:1:{pool_name}:real".encode())
    c.set(f"cortex:1:{pool_name}:flipped".encode(), raw[:-1] + bytes([raw[-1] ^ 1]))  # damaged value
    c.set(f"cortex:1:{pool_name}:moved".encode(), raw)  # another key's record
    for key in ("garbage", "flipped", "moved"):
        assert a.get(key) is None
    st = a.stats()["remote"]
    assert st["corrupt"] == 3 and st["misses"] == 3 and st["hits"] == 0


def test_a_killed_server_raises_nothing_and_recovery_is_automatic(make_pool, server, pool_name):
    p = make_pool("8M", name=pool_name, remote=server.url)
    _fast(p, timeout=0.5, backoff=60.0)
    clock = [0.0]
    p.tiers.named("remote").monotonic = lambda: clock[0]
    p.put("before", b"b")
    assert p.flush_remote(30)
    server.kill()
    for i in range(20):  # no error reaches the caller, memory keeps serving
        p.put(f"during{i}", b"d" * 100)
        assert p.get(f"during{i}") == b"d" * 100
    assert p.get("never-put") is None
    st = p.stats()["remote"]
    assert st["queue_depth"] >= 1, st  # writes wait out the rest period in the queue
    assert st["errors"] >= 1 and "Connection" in st.get("last_error", ""), st
    assert not p.flush_remote(0.2)  # a flush gives up in real time, whatever the rest period's clock says
    server.start()  # back, same port, empty (no persistence)
    clock[0] += 61.0  # the rest period is over
    p.put("after", b"a")
    assert p.flush_remote(30)
    st = p.stats()["remote"]
    assert st["writes_done"] >= 2 and st["queue_depth"] == 0, st
    assert server.client().get(f"cortex:1:{pool_name}:after".encode()) is not None


def test_a_stalled_server_costs_a_timeout_not_an_error(make_pool, server):
    p = make_pool("8M", remote=server.url)
    _fast(p, timeout=0.2, backoff=60.0)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        assert p.get("nothing-here") is None  # one bounded wait, then a miss
        assert p.get("nothing-either") is None  # resting now: no wait at all
        p.put("k", b"v")
        assert p.get("k") == b"v"
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    st = p.stats()["remote"]
    assert st["errors"] == 1 and st["misses"] >= 1 and "Timeout" in st["last_error"]


def test_a_full_write_queue_drops_and_counts(make_pool, server):
    p = make_pool("8M", remote=server.url)
    _fast(p, timeout=0.5, backoff=60.0)
    p.tiers.named("remote").max_entries = 4
    server.kill()
    p.put("first", b"1")  # the writer meets the dead server and rests for a minute
    for i in range(40):
        p.put(f"k{i}", b"x" * 10)  # never blocks
    st = p.stats()["remote"]
    assert st["writes_dropped"] >= 30 and st["queue_depth"] <= 5
    p.close()  # what is still queued is abandoned, counted
    with Pool.open(p.name) as again:
        assert again.stats()["remote"]["writes_dropped"] >= 35


def test_no_thread_connection_or_fd_leaks(make_pool, server):
    pool = make_pool("8M", remote=server.url)
    name = pool.name
    pool.put("warm", b"w")
    pool.flush_remote(30)
    pool.close()
    watcher = server.client()
    clients = len(watcher.client_list())  # (the watcher's own connection is open from here on)
    gc.collect()  # earlier tests' unreferenced clients close now, not in the middle of the count
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for i in range(30):
        with Pool.open(name) as p:
            p.put(f"k{i}", b"v" * 100)
            assert p.get(f"absent{i}") is None  # a remote lookup: a connection
    gc.collect()
    assert threading.active_count() == threads
    assert len(os.listdir("/proc/self/fd")) == fds
    assert len(watcher.client_list()) == clients
    assert len(server.client().keys("*")) == 31  # every write landed before close returned


def test_the_password_is_never_shown(make_pool, pool_name):
    s = Server(password="s3cret-pw")
    try:
        p = make_pool("8M", name=pool_name, remote=s.url)
        p.put("k", b"v")
        assert p.flush_remote(30) and p.stats()["remote"]["writes_done"] == 1
        assert "s3cret-pw" not in json.dumps(p.stats())
        for args in (("status", pool_name), ("status", pool_name, "--json"), ("status", "--format", "prometheus"),
                     ("list", "--json")):
            r = cli("cache", *args)
            assert r.returncode == 0 and b"s3cret-pw" not in r.stdout + r.stderr
            assert b"***" in r.stdout or args[0] == "list" or "prometheus" in args
        bad = make_pool("8M", remote=s.url.replace("s3cret-pw", "wrong-pw"))
        _fast(bad, timeout=0.5, backoff=60.0)
        assert bad.get("k") is None  # refused by the server: a counted error, not an exception
        st = bad.stats()["remote"]
        assert st["errors"] == 1 and "wrong-pw" not in json.dumps(st)
    finally:
        s.stop()


def test_bad_remote_urls_are_usage_errors_that_hide_passwords(pool_name):
    for url in ("http://host:1", "redis://", "redis://:pw-abc@host:notaport/0", "unix://", ""):
        with pytest.raises(UsageError) as e:
            Pool.create(pool_name, "1M", remote=url)
        assert "pw-abc" not in str(e.value)
    with pytest.raises(UsageError):
        Pool.create(pool_name, "1M", remote_cluster=True)
    r = cli("cache", "create", pool_name, "--size", "1M", "--remote", "redis://:pw-abc@h:x/0")
    assert r.returncode == 2 and b"pw-abc" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert not Pool.exists(pool_name)


def test_cli_create_status_and_prometheus_with_a_remote(server, pool_name):
    r = cli("cache", "create", pool_name, "--size", "2M", "--remote", server.url)
    assert r.returncode == 0 and b"remote tier" in r.stdout
    try:
        assert cli("cache", "put", pool_name, "k", "-", input=b"hello").returncode == 0  # flushed at exit
        st = json.loads(cli("cache", "status", pool_name, "--json").stdout)
        assert st["remote"]["writes_done"] == 1 and st["remote"]["url"] == server.url
        table = cli("cache", "status", pool_name).stdout.decode()
        assert "remote tier" in table and server.url in table
        prom = cli("cache", "status", "--format", "prometheus").stdout.decode()
        assert f'cortex_cache_remote_writes_done_total{{pool="{pool_name}"}} 1' in prom
        # Another "host" reads it through the CLI.
        env = {"CORTEX_CACHE_SHM_PREFIX": os.environ["CORTEX_CACHE_SHM_PREFIX"] + "cli-b."}
        assert cli("cache", "create", pool_name, "--size", "2M", "--remote", server.url, env=env).returncode == 0
        try:
            got = cli("cache", "get", pool_name, "k", env=env)
            assert got.returncode == 0 and got.stdout == b"hello"
        finally:
            cli("cache", "delete", pool_name, env=env)
    finally:
        assert cli("cache", "delete", pool_name).returncode == 0


def test_values_round_trip_through_get_into_and_view(make_pool, server, pool_name):
    a = make_pool("8M", name=pool_name, remote=server.url)
    a.put("v", make_value(7, 3, 200_000))
    a.flush_remote(30)
    a.evict(all=True)  # gone from memory; only the server has it now
    buf = bytearray(200_000)
    assert a.get_into("v", buf) == 200_000 and check_value(bytes(buf)) == (7, 3)
    a.evict(all=True)
    with a.view("v") as mv:
        assert check_value(bytes(mv)) == (7, 3)


def test_without_redis_py_writes_are_counted_as_dropped(make_pool, server):
    p = make_pool("2M", remote=server.url)
    p.tiers.named("remote").unavailable = "redis-py is not installed"  # as in a process without the `remote` extra
    p.put("k", b"v")
    assert p.get("k") == b"v"  # memory serves
    st = p.stats()["remote"]
    assert st["writes_dropped"] == 1 and st["available"] is False and st["error"]


def test_evict_tier_remote_deletes_by_key_prefix_or_all_and_nothing_else(make_pool, server, pool_name):
    a = make_pool("8M", name=pool_name, remote=server.url)
    neighbour = make_pool("2M", name=pool_name + "x", remote=server.url)  # its keys start like ours do
    for k in ["a0", "a1", "a2", "b0", "b1", "x*y", "xzy", "x?"]:
        a.put(k, b"v" * 100)
    neighbour.put("a9", b"n")
    assert a.flush_remote(30) and neighbour.flush_remote(30)
    c = server.client()

    def on_server():
        return sorted(k.decode().split(":", 3)[3] for k in c.keys(f"cortex:1:{pool_name}:*"))

    assert a.evict(prefix="a", tier="remote") == (3, 300)
    assert on_server() == ["b0", "b1", "x*y", "x?", "xzy"]
    assert a.evict(keys=["b0", "missing"], tier="remote") == (1, 100)
    assert a.evict(prefix="x*", tier="remote") == (1, 100)  # a glob character is only itself
    assert on_server() == ["b1", "x?", "xzy"]
    assert a.get("a0") == b"v" * 100  # memory keeps its copy: only the server was asked
    assert a.evict(all=True, tier="remote") == (3, 300)
    assert on_server() == [] and c.exists(f"cortex:1:{pool_name}x:a9".encode()) == 1
    for bad in (dict(percent=10), dict(nbytes="1K"), dict(expired=True)):
        with pytest.raises(UsageError, match="--key, --prefix or --all"):
            a.evict(tier="remote", **bad)


def test_evict_tier_remote_on_a_cluster_reaches_every_node(make_pool, cluster, pool_name):
    a = make_pool("8M", name=pool_name, remote=cluster.url, remote_cluster=True)
    for i in range(30):
        a.put(f"e{i}", b"c" * 10)
    assert a.flush_remote(30)
    assert a.evict(all=True, tier="remote") == (30, 300)
    assert sum(len(n.client().keys(f"cortex:1:{pool_name}:*")) for n in cluster.nodes) == 0


def test_cli_evict_tier_remote_and_its_errors(make_pool, pool_name):
    password_server = Server(password="s3cret-pw")
    try:
        a = make_pool("2M", name=pool_name, remote=password_server.url)
        a.put("k1", b"one")
        a.put("k2", b"two")
        assert a.flush_remote(30)
        r = cli("cache", "evict", pool_name, "--tier", "remote", "--prefix", "k", "--json")
        assert r.returncode == 0, r.stderr
        assert {k: v for k, v in json.loads(r.stdout).items() if k not in ("time", "schema")} == {"pool": pool_name, "tier": "remote", "entries": 2, "bytes": 6}
        r = cli("cache", "evict", pool_name, "--tier", "remote", "--percent", "10")
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and b"--key, --prefix or --all" in r.stderr
        password_server.kill()
        r = cli("cache", "evict", pool_name, "--tier", "remote", "--all")
        assert r.returncode == 69 and len(r.stderr.splitlines()) == 1, r.stderr
        assert b"s3cret-pw" not in r.stderr and b"***" in r.stderr
    finally:
        password_server.stop()
    plain = make_pool("1M", name=pool_name + "plain")
    r = cli("cache", "evict", plain.name, "--tier", "remote", "--all")
    assert r.returncode == 2 and b"has no remote tier" in r.stderr


def test_keys_tier_remote_lists_the_pools_entries_on_the_server(make_pool, server, pool_name):
    a = make_pool("8M", name=pool_name, remote=server.url)
    neighbour = make_pool("2M", name=pool_name + "x", remote=server.url)
    a.put("a1", b"1" * 10)
    a.put("a2", b"2" * 20, ttl=300)
    a.put(b"\xffbin", b"3" * 30)
    neighbour.put("a9", b"n")
    assert a.flush_remote(30) and neighbour.flush_remote(30)
    server.client().set(f"cortex:1:{pool_name}:junk".encode(), b"not a record")  # not ours: left out
    assert a.keys(tier="remote") == ["a1", "a2", b"\xffbin"]  # key order, str and bytes as put
    assert a.keys(prefix="a", tier="remote") == ["a1", "a2"] and a.keys(limit=1, tier="remote") == ["a1"]
    got = {e["key"]: e for e in a.remote_entries()}
    assert [got[k]["size"] for k in ("a1", "a2", b"\xffbin")] == [10, 20, 30]
    assert got["a1"]["ttl_remaining"] is None and 0 < got["a2"]["ttl_remaining"] <= 300
    r = cli("cache", "keys", pool_name, "--tier", "remote", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["keys"]
    assert [(x["key"], x["tier"], x["size"]) for x in rows][:2] == [("a1", "remote", 10), ("a2", "remote", 20)]
    r = cli("cache", "keys", pool_name, "--tier", "remote", "--prefix", "a", "-l")
    assert r.returncode == 0 and r.stdout.decode().count("remote") == 2
    server.kill()
    r = cli("cache", "keys", pool_name, "--tier", "remote")
    assert r.returncode == 69 and len(r.stderr.splitlines()) == 1, r.stderr
    plain = make_pool("1M", name=pool_name + "plain")
    r = cli("cache", "keys", plain.name, "--tier", "remote")
    assert r.returncode == 2 and b"has no remote tier" in r.stderr


def test_admission_writes_to_the_server_only_entries_seen_twice_when_evicted(make_pool, server, pool_name):
    """tier_admit=2: puts no longer go to the server; an evicted entry that was read goes, one that was not
    stays off it (counted in tier_refused)."""
    p = make_pool("64K", name=pool_name, block_size="4K", remote=server.url, tier_admit=2)
    for i in range(16):
        p.put(f"k{i}", make_value(i, 0, 3000))
    p.get("k0")
    assert p.flush_remote(30) and p.stats()["remote"]["writes_sent"] == 0
    assert p.evict(all=True) == (16, 16 * 3000)
    assert p.flush_remote(30)
    st = p.stats()
    assert st["remote"]["writes_done"] == 1 and st["tier_refused"] == 15
    assert sorted(server.client().keys("*")) == [f"cortex:1:{pool_name}:k0".encode()]
    assert check_value(p.get("k0")) == (0, 0)  # found on the server again
    # Puts skip the server under admission, deletes do not: a deleted key never comes back from it.
    assert p.delete("k0") and p.flush_remote(30)
    assert server.client().keys("*") == [] and p.get("k0") is None
