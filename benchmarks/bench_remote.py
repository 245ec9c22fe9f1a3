"""Remote tier: promote throughput and latency beside a raw redis-py GET of the same values, same run.

    python benchmarks/bench_remote.py [--quick] [--json PATH]

A redis-server (Debian's, `--save '' --appendonly no`) is started on
loopback for the run.  Host A (this process) puts N values of each size into
a pool with `--remote`, and waits for its writer to send them.  Host B (a
child process with its own shm prefix, so its own pool of the same name)
then reads each value once, in the same order, two ways:

  redis GET   redis-py (+ hiredis) GET of the stored record: the floor
  promote     pool.get(key): a miss in memory, so a remote GET, the record's
              checks (header, xxh3 of key and value) and a copy into memory

Sizes 4 KiB (N=2000), 64 KiB (1000), 1 MiB (200), 16 MiB (16); --quick
divides N by 4.  Figures: GB/s and ops/s, and per-get latency p50/p99; the
ratio is promote over GET, same keys, same run (3 rounds, --quick 2; median).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import shutil
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_peers import RedisServer  # noqa: E402

SIZES = [(4 << 10, 2000), (64 << 10, 1000), (1 << 20, 200), (16 << 20, 16)]

READER = """
import json, sys, time
import numpy as np, redis
from cortex_cache import Pool
from cortex_cache.remote import remote_key
name, url, size, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r = redis.Redis.from_url(url)
keys = [f"v{size}-{i}" for i in range(n)]
lat_get, lat_pro = [], []
t = time.perf_counter()
for k in keys:
    a = time.perf_counter_ns()
    assert r.get(remote_key(name, k.encode())) is not None
    lat_get.append(time.perf_counter_ns() - a)
get_s = time.perf_counter() - t
p = Pool.create(name, max(64 << 20, 2 * n * (size + 65536)), remote=url)
try:
    t = time.perf_counter()
    for k in keys:
        a = time.perf_counter_ns()
        assert p.get(k) is not None
        lat_pro.append(time.perf_counter_ns() - a)
    pro_s = time.perf_counter() - t
    st = p.stats()["remote"]
    assert st["promotions"] == n and st["corrupt"] == 0 and st["errors"] == 0
finally:
    p.close()
    Pool.unlink(name)
pct = lambda v, q: float(np.percentile(np.array(v) / 1000, q))
print(json.dumps({"get_s": get_s, "promote_s": pro_s, "get_p50": pct(lat_get, 50), "get_p99": pct(lat_get, 99),
                  "promote_p50": pct(lat_pro, 50), "promote_p99": pct(lat_pro, 99)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    rounds = 2 if args.quick else 3
    work = Path(tempfile.mkdtemp(prefix="ccbench-remote-"))
    prefix = f"ccbench-{os.getpid()}."
    os.environ["CORTEX_CACHE_SHM_PREFIX"] = prefix
    from cortex_cache import Pool

    server = RedisServer(work)
    url = f"redis://127.0.0.1:{server.port}/0"
    results = {}
    try:
        for size, n in SIZES:
            n = max(4, n // 4) if args.quick else n
            a = Pool.create("remotebench", max(64 << 20, 2 * (size + 65536)) + size * 4, remote=url)
            try:
                value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
                for i in range(n):
                    a.put(f"v{size}-{i}", value)
                    if i % 64 == 63:
                        a.flush_remote(120)  # keep the writer's queue within its bound
                assert a.flush_remote(300) and a.stats()["remote"]["writes_dropped"] == 0
            finally:
                a.close()
                Pool.unlink("remotebench")
            env = {**os.environ, "CORTEX_CACHE_SHM_PREFIX": prefix + "b."}
            runs = []
            for _ in range(rounds):
                r = subprocess.run([sys.executable, "-c", textwrap.dedent(READER), "remotebench", url, str(size),
                                    str(n)], capture_output=True, text=True, env=env, timeout=900,
                                   cwd=str(Path(__file__).resolve().parents[1]))
                if r.returncode != 0:
                    raise SystemExit(f"reader failed: {r.stderr.strip().splitlines()[-1:]}")
                runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            med = lambda k: statistics.median(x[k] for x in runs)  # noqa: E731
            results[f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"] = {
                "n": n, "bytes": n * size,
                "get_gbps": n * size / med("get_s") / 1e9, "promote_gbps": n * size / med("promote_s") / 1e9,
                "get_ops": n / med("get_s"), "promote_ops": n / med("promote_s"),
                "get_p50_us": med("get_p50"), "get_p99_us": med("get_p99"),
                "promote_p50_us": med("promote_p50"), "promote_p99_us": med("promote_p99"),
                "promote_vs_get": med("get_s") / med("promote_s"),
            }
            import redis

            redis.Redis(unix_socket_path=server.socket).flushall()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        for f in Path("/dev/shm").glob(prefix + "*"):
            f.unlink(missing_ok=True)
    print(f"remote promote vs raw redis-py GET, redis {server.version}, median of {rounds} rounds")
    print(f"{'size':>7} {'n':>5} {'GET GB/s':>9} {'promote GB/s':>13} {'ratio':>6} {'GET ops/s':>10} "
          f"{'promote ops/s':>14} {'GET p50/p99 us':>15} {'promote p50/p99 us':>19}")
    for size, r in results.items():
        print(f"{size:>7} {r['n']:>5} {r['get_gbps']:>9.2f} {r['promote_gbps']:>13.2f} {r['promote_vs_get']:>6.2f} "
              f"{r['get_ops']:>10,.0f} {r['promote_ops']:>14,.0f} {r['get_p50_us']:>7.0f}/{r['get_p99_us']:<7.0f} "
              f"{r['promote_p50_us']:>9.0f}/{r['promote_p99_us']:<9.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "rounds": rounds, "redis": server.version},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
