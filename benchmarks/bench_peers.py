"""A cortex pool beside its peers, in one run on one machine: Redis, a naive shared-memory store, numpy.

    python benchmarks/bench_peers.py [--quick] [--json PATH]

Stores, each started (and stopped) by this script, on loopback only:

  cortex       a pool with the default 64 KiB blocks (4 KiB blocks for 4 KiB values);
               get, get_into (into a caller's buffer) and put.
  redis-unix   the Debian `redis-server` (`--save '' --appendonly no`) over a
  redis-tcp    Unix socket and over TCP 127.0.0.1, through redis-py + hiredis.
  naive-shm    what people write by hand: one `multiprocessing.shared_memory`
               segment per key, named from a hash of the key (the name is the
               index, so any process finds it); a get attaches, copies, detaches.
  lmcache      LMCache's local CPU backend, if benchmarks/lmcache_peer.py finds
               LMCache installed (CORTEX_BENCH_LMCACHE_PYTHON names a Python
               that has it); else the table says why not.
  numpy        np.copyto between buffers of the same footprint: the memory
               bandwidth ceiling (copy in = put, copy out = get).

Sizes 4 KiB, 64 KiB, 1 MiB, 16 MiB.  Each store cycles over enough keys to
hold 64 MiB (16 at least), so small values are not all in the CPU cache.
Figures (median, min-max over rounds: 3, --quick 2):
  - put and get GB/s and ops/s, one process;
  - get GB/s with two reader processes at once against one, same store, same run;
  - cross-process get latency p50/p99: a child process reads what the parent wrote.
Targets: cortex get of 1 MiB >= 5x redis-unix; 64 KiB ops/s >= 10x redis-unix
(get and put); cortex >= 0.7x numpy copy at 1 MiB and up; two readers >= 1.6x one.

Head to head (issue 17), each pair measured in alternating bursts (the order
flips every round; 5 rounds, 11 without --quick), the ratio the median of the
rounds' ratios:
  - 1 MiB put against naive-shm's overwrite (attach an existing segment, copy
    in, detach), both cycling over the same 64 keys that already exist;
  - 1 MiB get_into against LMCache's LocalCPUBackend get + copy into a
    caller's tensor (benchmarks/lmcache_peer.py --serve, a process of its own
    kept running between bursts), both cycling over 64 keys;
  - 64 KiB get of ONE hot key against Redis GET of one key over its Unix
    socket (redis-py + hiredis), the same loop on both sides.
Targets: put >= 0.9x naive-shm overwrite; get_into >= 1.0x LMCache; hot get
>= 10x Redis.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 64 * KIB, MIB, 16 * MIB]
WORKING_SET = 64 * MIB
TARGETS = {"get_1mib_vs_redis": 5.0, "ops_64k_vs_redis": 10.0, "vs_copy": 0.7, "two_readers": 1.6}
H2H = {"put_vs_naive_overwrite": 0.9, "put_vs_bare_copy": 0.8, "get_into_vs_lmcache": 1.0, "hot_get_vs_redis": 10.0}


def human(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ---------------------------------------------------------------- stores


class CortexStore:
    name = "cortex"

    def __init__(self, spec: dict, create: bool = False) -> None:
        from cortex_cache import Pool

        self.spec = spec
        if create:
            self.pool = Pool.create(spec["pool"], spec["bytes"], block_size=spec["block"])
        else:
            self.pool = Pool.open(spec["pool"])

    def put(self, key: str, value) -> None:
        self.pool.put(key, value)

    def get(self, key: str) -> bytes:
        return self.pool.get(key)

    def get_into(self, key: str, buf) -> int:
        return self.pool.get_into(key, buf)

    def close(self, destroy: bool = False) -> None:
        self.pool.close()
        if destroy:
            from cortex_cache import Pool

            Pool.unlink(self.spec["pool"])


class RedisStore:
    def __init__(self, spec: dict, create: bool = False) -> None:
        import redis

        self.spec = spec
        self.name = spec["kind"]
        if spec["kind"] == "redis-unix":
            self.r = redis.Redis(unix_socket_path=spec["socket"], socket_timeout=60)
        else:
            self.r = redis.Redis(host="127.0.0.1", port=spec["port"], socket_timeout=60)
        if create:
            self.r.flushall()

    def put(self, key: str, value) -> None:
        self.r.set(key, value)

    def get(self, key: str) -> bytes:
        return self.r.get(key)

    def close(self, destroy: bool = False) -> None:
        if destroy:
            self.r.flushall()
        self.r.close()


class NaiveShmStore:
    """One shared_memory segment per key: 8-byte length, then the value."""

    name = "naive-shm"

    def __init__(self, spec: dict, create: bool = False) -> None:
        self.spec = spec
        self.made: set[str] = set()

    def _name(self, key: str) -> str:
        return self.spec["prefix"] + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()

    @staticmethod
    def _untrack(shm) -> None:
        # Python 3.11's resource tracker unlinks segments that any process
        # merely attached to when it exits; this store manages them itself.
        from multiprocessing import resource_tracker

        try:
            resource_tracker.unregister(shm._name, "shared_memory")
        except Exception:
            pass

    def put(self, key: str, value) -> None:
        from multiprocessing import shared_memory

        name = self._name(key)
        n = memoryview(value).nbytes
        try:  # an overwrite (the common case once a key exists) attaches and copies; it creates nothing
            shm = shared_memory.SharedMemory(name)
            if shm.size < 8 + n:  # unlink() below also stops tracking it
                shm.close()
                shm.unlink()
                raise FileNotFoundError(name)
        except FileNotFoundError:
            shm = shared_memory.SharedMemory(name, create=True, size=8 + n)
            self.made.add(name)
        self._untrack(shm)
        shm.buf[8 : 8 + n] = value
        shm.buf[:8] = n.to_bytes(8, "little")
        shm.close()

    def get(self, key: str) -> bytes | None:
        from multiprocessing import shared_memory

        try:
            shm = shared_memory.SharedMemory(self._name(key))
        except FileNotFoundError:
            return None
        self._untrack(shm)
        n = int.from_bytes(shm.buf[:8], "little")
        out = bytes(shm.buf[8 : 8 + n])
        shm.close()
        return out

    def close(self, destroy: bool = False) -> None:
        if destroy:
            for name in self.made:
                try:
                    os.unlink(f"/dev/shm/{name}")
                except FileNotFoundError:
                    pass


STORES = {"cortex": CortexStore, "redis-unix": RedisStore, "redis-tcp": RedisStore, "naive-shm": NaiveShmStore}


# ---------------------------------------------------------------- redis server


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.socket = str(workdir / "redis.sock")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--unixsocket", self.socket,
             "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(workdir),
             "--loglevel", "warning", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        import redis

        deadline = time.monotonic() + 20
        while True:  # a server start is waited for, with a deadline: this is a benchmark, not a test
            try:
                redis.Redis(unix_socket_path=self.socket).ping()
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {err.strip()[:200]}")
                time.sleep(0.05)
        self.version = redis.Redis(unix_socket_path=self.socket).info()["redis_version"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


# ---------------------------------------------------------------- measurements


def n_keys(size: int) -> int:
    return max(16, WORKING_SET // size)


def n_ops(size: int, quick: bool) -> int:
    return max(16 if quick else 32, ((32 if quick else 128) * MIB) // size)


def one_process(store, size: int, value: bytes, quick: bool) -> dict:
    keys = [f"k{size}-{i}" for i in range(n_keys(size))]
    ops = n_ops(size, quick)
    for k in keys:
        store.put(k, value)
    t = time.perf_counter()
    for i in range(ops):
        store.put(keys[i % len(keys)], value)
    put_s = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(ops):
        store.get(keys[i % len(keys)])
    get_s = time.perf_counter() - t
    out = {"put_s": put_s, "get_s": get_s, "ops": ops}
    if hasattr(store, "get_into"):
        buf = bytearray(size)
        t = time.perf_counter()
        for i in range(ops):
            store.get_into(keys[i % len(keys)], buf)
        out["get_into_s"] = time.perf_counter() - t
    return out


def numpy_copy(size: int, quick: bool) -> dict:
    k = n_keys(size)
    ops = n_ops(size, quick)
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    bufs = [np.empty(size, np.uint8) for _ in range(k)]
    for b in bufs:
        b[:] = src
    one = np.empty(size, np.uint8)
    t = time.perf_counter()
    for i in range(ops):
        np.copyto(bufs[i % k], src)
    cin = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(ops):
        np.copyto(one, bufs[i % k])
    cout = time.perf_counter() - t
    return {"put_s": cin, "get_s": cout, "get_into_s": cout, "ops": ops}


def _reader(kind: str, spec: dict, size: int, ops: int, barrier, results, latency: bool) -> None:
    store = STORES[kind](spec)
    keys = [f"k{size}-{i}" for i in range(n_keys(size))]
    store.get(keys[0])
    barrier.wait()
    t0 = time.perf_counter()
    lat = []
    if latency:
        for i in range(ops):
            a = time.perf_counter_ns()
            store.get(keys[i % len(keys)])
            lat.append(time.perf_counter_ns() - a)
    else:
        for i in range(ops):
            store.get(keys[i % len(keys)])
    t1 = time.perf_counter()
    store.close()
    results.put((t0, t1, lat))


def readers(kind: str, spec: dict, size: int, ops: int, n: int, latency: bool = False) -> tuple[float, list]:
    """Aggregate get GB/s of n reader processes started together; and their latencies."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(kind, spec, size, ops, barrier, results, latency)) for _ in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    start, end = min(g[0] for g in got), max(g[1] for g in got)
    lat = [x for g in got for x in g[2]]
    return n * ops * size / (end - start) / 1e9, lat


# ---------------------------------------------------------------- the run


def run(quick: bool, workdir: Path) -> dict:
    rounds = 2 if quick else 3
    out: dict = {"quick": quick, "rounds": rounds, "cpus": os.cpu_count(), "stores": {}, "skipped": {}}
    server = None
    try:
        server = RedisServer(workdir)
        out["redis_version"] = server.version
        import redis as redis_py

        out["redis_py"] = redis_py.__version__
        try:
            import hiredis

            out["hiredis"] = hiredis.__version__
        except ImportError:
            out["hiredis"] = None
    except Exception as e:  # noqa: BLE001 - reported in the table
        out["skipped"]["redis-unix"] = out["skipped"]["redis-tcp"] = str(e)
    prefix = f"ccbench-{os.getpid()}."
    specs = {
        "naive-shm": {"prefix": f"ccnaive-{os.getpid()}-"},
    }
    if server is not None:
        specs["redis-unix"] = {"kind": "redis-unix", "socket": server.socket}
        specs["redis-tcp"] = {"kind": "redis-tcp", "port": server.port}
    res: dict = {}
    os.environ["CORTEX_CACHE_SHM_PREFIX"] = prefix
    try:
        out["goals"] = head_to_head(quick, server, prefix)
        print("  head to head done", file=sys.stderr, flush=True)
        for size in SIZES:
            value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
            block = min(64 * KIB, size)  # the default block size, or the value's size when smaller
            cortex_spec = {"pool": f"peers{size}", "bytes": int(n_keys(size) * (size + 2 * block) * 1.2),
                           "block": block}
            os.environ["CORTEX_CACHE_SHM_PREFIX"] = prefix
            per = {}
            for kind, spec in [("cortex", cortex_spec), *specs.items()]:
                store = STORES[kind](spec, create=True)
                try:
                    runs = [one_process(store, size, value, quick) for _ in range(rounds)]
                    one_gbps, _ = readers(kind, spec, size, n_ops(size, quick) // 2, 1)
                    two_gbps, _ = readers(kind, spec, size, n_ops(size, quick) // 2, 2)
                    ones, twos = [one_gbps], [two_gbps]
                    for _ in range(rounds - 1):
                        ones.append(readers(kind, spec, size, n_ops(size, quick) // 2, 1)[0])
                        twos.append(readers(kind, spec, size, n_ops(size, quick) // 2, 2)[0])
                    lat_ops = min(2000, max(50, n_ops(size, quick) // 2)) if size <= MIB else 0
                    lat = readers(kind, spec, size, lat_ops, 1, latency=True)[1] if lat_ops else []
                finally:
                    store.close(destroy=True)
                per[kind] = _figures(runs, size, ones, twos, lat)
            per["numpy"] = _figures([numpy_copy(size, quick) for _ in range(rounds)], size, None, None, [])
            lm = _lmcache(size, quick, rounds)
            if "error" in lm:
                out["skipped"]["lmcache"] = lm["error"]
            else:
                per["lmcache"] = lm
            res[human(size)] = per
            print(f"  {human(size)} done", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
        for f in Path("/dev/shm").glob(prefix + "*"):
            f.unlink(missing_ok=True)
    out["results"] = res
    out["ratios"], out["targets"] = _ratios(res)
    for g in out["goals"]:
        if g["met"] is not None:
            out["targets"][g["target"]] = g["met"]
    return out


# ---------------------------------------------------------------- head to head (issue 17)


def alternate(a, b, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds of a() and of b() in `rounds` rounds, the order flipped every round."""
    sa, sb = [], []
    a(), b()  # warm both
    for r in range(rounds):
        if r % 2:
            sb.append(b())
            sa.append(a())
        else:
            sa.append(a())
            sb.append(b())
    return sa, sb


def timed(fn, ops: int):
    def run() -> float:
        t = time.perf_counter()
        for i in range(ops):
            fn(i)
        return time.perf_counter() - t
    return run


def goal(target: str, need: float, size: int, ops: int, ours: list[float] | None, theirs: list[float] | None,
         baseline: str, why: str = "") -> dict:
    """One line of the issue's targets: cortex's figure, the baseline's, the median paired ratio."""
    if not ours or not theirs:
        return {"target": target, "need": need, "value": "not measured", "baseline": f"{baseline}: {why}",
                "ratio": None, "met": None}
    ratio = statistics.median(t / o for o, t in zip(ours, theirs))
    fmt = (lambda s: f"{ops * size / statistics.median(s) / 1e9:.2f} GB/s") if size >= MIB else \
        (lambda s: f"{statistics.median(s) / ops * 1e6:.2f} us/op")
    return {"target": target, "need": need, "value": fmt(ours), "baseline": f"{baseline} {fmt(theirs)}",
            "ratio": ratio, "met": ratio >= need, "ours_s": ours, "theirs_s": theirs, "ops": ops}


def head_to_head(quick: bool, server: RedisServer | None, prefix: str) -> list[dict]:
    from cortex_cache import Pool

    rounds = 5 if quick else 11
    goals = []
    keys = [f"h{i}" for i in range(n_keys(MIB))]
    value = np.random.default_rng(7).integers(0, 255, MIB, dtype=np.uint8).tobytes()
    ops = 64 if quick else 128
    pool = Pool.create("h2h", int(len(keys) * MIB * 1.5) + (64 << 20), block_size=64 * KIB)
    naive = NaiveShmStore({"prefix": f"ccnaive-{os.getpid()}-h-"})
    try:
        for k in keys:
            pool.put(k, value)
            naive.put(k, value)
        ours, theirs = alternate(timed(lambda i: pool.put(keys[i % len(keys)], value), ops),
                                 timed(lambda i: naive.put(keys[i % len(keys)], value), ops), rounds)
        goals.append(goal(f"1 MiB put >= {H2H['put_vs_naive_overwrite']}x naive-shm overwrite",
                          H2H["put_vs_naive_overwrite"], MIB, ops, ours, theirs, "naive-shm overwrite"))
        # Issue 28: the same segments kept attached, so an overwrite is the bare copy (np.copyto, no checksum).
        from multiprocessing import shared_memory

        held = [shared_memory.SharedMemory(naive._name(k)) for k in keys]
        arrays = [np.frombuffer(seg.buf, np.uint8, MIB, 8) for seg in held]
        src = np.frombuffer(value, np.uint8)

        def copy_in(i: int) -> None:
            np.copyto(arrays[i % len(arrays)], src)

        ours, theirs = alternate(timed(lambda i: pool.put(keys[i % len(keys)], value), ops), timed(copy_in, ops),
                                 rounds)
        del arrays
        for seg in held:
            NaiveShmStore._untrack(seg)
            seg.close()
        goals.append(goal(f"1 MiB put (checksummed) >= {H2H['put_vs_bare_copy']}x a bare copy into kept-attached "
                          "shared memory", H2H["put_vs_bare_copy"], MIB, ops, ours, theirs,
                          "np.copyto into an attached segment"))
        naive.close(destroy=True)
        buf = bytearray(MIB)
        lm, why = _lmcache_server(MIB, len(keys))
        if lm is None:
            goals.append(goal(f"1 MiB get_into >= {H2H['get_into_vs_lmcache']}x LMCache CPU get+copy",
                              H2H["get_into_vs_lmcache"], MIB, ops, None, None, "LMCache LocalCPUBackend", why))
        else:
            def lm_burst() -> float:
                lm.stdin.write(f"{ops}\n")
                lm.stdin.flush()
                return float(lm.stdout.readline())

            try:
                ours, theirs = alternate(timed(lambda i: pool.get_into(keys[i % len(keys)], buf), ops), lm_burst,
                                         rounds)
            finally:
                lm.stdin.close()
                lm.wait(60)
            goals.append(goal(f"1 MiB get_into >= {H2H['get_into_vs_lmcache']}x LMCache CPU get+copy",
                              H2H["get_into_vs_lmcache"], MIB, ops, ours, theirs, "LMCache LocalCPUBackend"))
        for k in keys:
            pool.delete(k)
        hot = value[: 64 * KIB]
        pool.put("hot", hot)
        hops = 2000 if quick else 5000
        target = f"64 KiB hot-key get >= {H2H['hot_get_vs_redis']:.0f}x Redis GET (unix socket)"
        if server is None:
            goals.append(goal(target, H2H["hot_get_vs_redis"], 64 * KIB, hops, None, None, "redis-unix",
                              "no redis-server"))
        else:
            import redis

            r = redis.Redis(unix_socket_path=server.socket, socket_timeout=60)
            r.set("hot", hot)
            ours, theirs = alternate(timed(lambda i: pool.get("hot"), hops), timed(lambda i: r.get("hot"), hops),
                                     rounds)
            r.delete("hot")
            r.close()
            goals.append(goal(target, H2H["hot_get_vs_redis"], 64 * KIB, hops, ours, theirs, "redis-unix GET"))
    finally:
        naive.close(destroy=True)
        pool.close()
        Pool.unlink("h2h")
    return goals


def _lmcache_server(size: int, keys: int):
    """lmcache_peer.py --serve, started and ready; or None and why not."""
    py = os.environ.get("CORTEX_BENCH_LMCACHE_PYTHON")
    if not py:
        return None, "set CORTEX_BENCH_LMCACHE_PYTHON to a Python that has LMCache"
    script = Path(__file__).with_name("lmcache_peer.py")
    err = tempfile.TemporaryFile("w+")  # not a pipe: LMCache's logging must never block it
    p = subprocess.Popen([py, str(script), "--serve", str(size), str(keys)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=err, text=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        p.wait()
        err.seek(0)
        tail = err.read().strip().splitlines()[-1:] or ["no output"]
        return None, f"LMCache did not start: {tail[0][:200]}"
    return p, ""


def _figures(runs: list[dict], size: int, ones, twos, lat) -> dict:
    f = {}
    for what in ("put", "get", "get_into"):
        key = f"{what}_s"
        if key in runs[0]:
            f[f"{what}_gbps"] = summary([r["ops"] * size / r[key] / 1e9 for r in runs])
            f[f"{what}_ops"] = summary([r["ops"] / r[key] for r in runs])
    if ones:
        f["readers1_gbps"] = summary(ones)
        f["readers2_gbps"] = summary(twos)
        f["two_vs_one"] = statistics.median(twos) / statistics.median(ones)
    if lat:
        a = np.array(lat) / 1000
        f["latency_us"] = {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "n": len(lat)}
    return f


def _lmcache(size: int, quick: bool, rounds: int) -> dict:
    """LMCache's local CPU backend, run by benchmarks/lmcache_peer.py under the Python that has LMCache."""
    py = os.environ.get("CORTEX_BENCH_LMCACHE_PYTHON")
    if not py:
        try:
            import lmcache  # noqa: F401
        except ImportError:
            return {"error": "LMCache is not installed here (set CORTEX_BENCH_LMCACHE_PYTHON to a Python that has it)"}
        py = sys.executable
    script = Path(__file__).with_name("lmcache_peer.py")
    r = subprocess.run([py, str(script), str(size), str(n_ops(size, quick)), str(n_keys(size)), str(rounds)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"LMCache did not run: {tail[0][:200]}"}
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    return _figures(runs, size, None, None, [])


def _ratios(res: dict) -> tuple[dict, dict]:
    r: dict = {}
    med = lambda fig, k: fig[k]["median"]  # noqa: E731
    for size, per in res.items():
        c, n = per["cortex"], per["numpy"]
        r[size] = {
            "get_vs_copy": med(c, "get_gbps") / med(n, "get_gbps"),
            "get_into_vs_copy": med(c, "get_into_gbps") / med(n, "get_gbps"),
            "put_vs_copy": med(c, "put_gbps") / med(n, "put_gbps"),
            "two_readers_vs_one": c["two_vs_one"],
        }
        for peer in ("redis-unix", "redis-tcp", "naive-shm", "lmcache"):
            if peer in per:
                r[size][f"get_vs_{peer}"] = med(c, "get_gbps") / med(per[peer], "get_gbps")
                r[size][f"put_vs_{peer}"] = med(c, "put_gbps") / med(per[peer], "put_gbps")
    t: dict = {}
    if "redis-unix" in res.get("1 MiB", {}):
        t["get 1 MiB >= 5x redis (unix socket)"] = r["1 MiB"]["get_vs_redis-unix"] >= TARGETS["get_1mib_vs_redis"]
    if "redis-unix" in res.get("64 KiB", {}):
        t["get 64 KiB ops/s >= 10x redis (unix socket)"] = r["64 KiB"]["get_vs_redis-unix"] >= TARGETS["ops_64k_vs_redis"]
        t["put 64 KiB ops/s >= 10x redis (unix socket)"] = r["64 KiB"]["put_vs_redis-unix"] >= TARGETS["ops_64k_vs_redis"]
    for size in ("1 MiB", "16 MiB"):
        for what in ("get", "get_into", "put"):
            t[f"{what} {size} >= 0.7x numpy copy"] = r[size][f"{what}_vs_copy"] >= TARGETS["vs_copy"]
    for size in ("1 MiB", "16 MiB"):
        t[f"two readers {size} >= 1.6x one"] = r[size]["two_readers_vs_one"] >= TARGETS["two_readers"]
    return r, t


def report(out: dict) -> None:
    print(f"\nput/get, one process (GB/s and ops/s, median over {out['rounds']} rounds [min-max]); "
          f"redis {out.get('redis_version', '-')} via redis-py {out.get('redis_py', '-')} + hiredis "
          f"{out.get('hiredis', '-')}")
    print(f"{'size':>7} {'store':11} {'put GB/s':>17} {'get GB/s':>17} {'put ops/s':>10} {'get ops/s':>10} "
          f"{'2 readers':>9} {'p50/p99 us':>13}")
    for size, per in out["results"].items():
        for store, f in per.items():
            def g(k):
                return f"{f[k]['median']:6.2f} [{f[k]['min']:.2f}-{f[k]['max']:.2f}]" if k in f else "-"

            two = f"{f['two_vs_one']:.2f}x" if "two_vs_one" in f else "-"
            lat = f"{f['latency_us']['p50']:.0f}/{f['latency_us']['p99']:.0f}" if "latency_us" in f else "-"
            print(f"{size:>7} {store:11} {g('put_gbps'):>17} {g('get_gbps'):>17} {f['put_ops']['median']:>10,.0f} "
                  f"{f['get_ops']['median']:>10,.0f} {two:>9} {lat:>13}")
    for k, why in out["skipped"].items():
        print(f"  {k}: not measured: {why}")
    print("\nratios (same run):")
    for size, r in out["ratios"].items():
        print(f"  {size:>7}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    print("\nhead to head (alternating bursts, median of the rounds' ratios):")
    for g in out["goals"]:
        ratio = f"{g['ratio']:.2f}x" if g["ratio"] is not None else "-"
        print(f"  {g['target']}: {g['value']} vs {g['baseline']}: {ratio}")
    for t, ok in out["targets"].items():
        print(f"target {t}: {'met' if ok else 'MISSED'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ccbench-peers-"))
    try:
        out = run(args.quick, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
