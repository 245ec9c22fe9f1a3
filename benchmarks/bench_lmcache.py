"""LMCache L2 adapters side by side: the cortex adapter against LMCache's own that need no server.

    CORTEX_BENCH_LMCACHE_PYTHON=.lmcache-venv/bin/python python benchmarks/bench_lmcache.py [--quick] [--json PATH]

Runs LMCache's own L2 benchmark (`lmcache bench l2`, lmcache 0.5.x) once per
adapter and object size, same keys per batch, same rounds, verification on:

  cortex      cortex_cache.integrations.lmcache.CortexConnector over a fresh pool
  fs_native   LMCache's C++ file-system adapter (files in a fresh temp dir on disk)
  fs          LMCache's Python file-system adapter (same)
  mock        LMCache's in-memory mock adapter; it simulates a bandwidth
              (mock_bandwidth_gb, set here to 100 GB/s so it does not throttle)

Store and load MB/s are the harness's: average over rounds, with min-max.
The ratios are cortex's against each adapter's, same run.  Needs LMCache:
build its venv with scripts/lmcache_venv.sh and point
CORTEX_BENCH_LMCACHE_PYTHON at its Python.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]


def lmcache_cli() -> Path:
    py = os.environ.get("CORTEX_BENCH_LMCACHE_PYTHON")
    if not py:
        raise SystemExit("set CORTEX_BENCH_LMCACHE_PYTHON to a Python with LMCache (scripts/lmcache_venv.sh)")
    exe = Path(py).with_name("lmcache")
    if not exe.exists():
        raise SystemExit(f"no lmcache command beside {py}")
    return exe


def bench(exe: Path, adapter: dict, size_kb: int, keys: int, rounds: int, env: dict, out: Path) -> dict:
    cmd = [str(exe), "bench", "l2", "--l2-adapter", json.dumps(adapter), "--num-keys", str(keys),
           "--data-size-kb", str(size_kb), "--rounds", str(rounds), "--no-skip-verify", "--format", "json",
           "--output", str(out), "-q"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0 or not out.exists():
        tail = [ln for ln in (r.stderr or r.stdout).splitlines() if "arn" not in ln][-1:] or ["no output"]
        return {"error": tail[0][:200]}
    ops = {m["operation"].lower(): m for k, m in json.loads(out.read_text())["metrics"].items() if k.startswith("op_")}
    res = {}
    for op in ("store", "load"):
        m = ops[op]
        res[op] = {"mbps": m["throughput_avg_mbps"], "min": m["throughput_min_mbps"], "max": m["throughput_max_mbps"],
                   "ok": m["total_success"], "keys": m["total_keys"]}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--workers", type=int, help="the cortex adapter's copy threads (default: its own)")
    ap.add_argument("--only", help="comma-separated adapters to run (default: all)")
    args = ap.parse_args()
    exe = lmcache_cli()
    sizes = [64, 1024] if args.quick else [64, 256, 1024, 4096]
    rounds = 3 if args.quick else 5
    keys = 32
    work = Path(tempfile.mkdtemp(prefix="ccbench-lmcache-"))
    prefix = f"ccbench-{os.getpid()}."
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "CORTEX_CACHE_SHM_PREFIX": prefix,
           "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    os.environ["CORTEX_CACHE_SHM_PREFIX"] = prefix
    from cortex_cache import Pool

    results: dict = {}
    try:
        for size_kb in sizes:
            per = {}
            need = 3 * keys * (size_kb << 10) * (rounds + 2)
            pool = Pool.create("lmcbench", need + (64 << 20))
            pool.close()
            adapters = {
                "cortex": {"type": "native_plugin", "module_path": "cortex_cache.integrations.lmcache",
                           "class_name": "CortexConnector",
                           "adapter_params": {"pool": "lmcbench", **({"workers": args.workers} if args.workers else {})}},
                "fs_native": {"type": "fs_native", "base_path": str(work / f"fsn{size_kb}")},
                "fs": {"type": "fs", "base_path": str(work / f"fs{size_kb}")},
                "mock": {"type": "mock", "max_size_gb": 4, "mock_bandwidth_gb": 100},
            }
            try:
                for name, spec in adapters.items():
                    if args.only and name not in args.only.split(","):
                        continue
                    per[name] = bench(exe, spec, size_kb, keys, rounds, env, work / f"{name}{size_kb}.json")
            finally:
                Pool.unlink("lmcbench")
            results[f"{size_kb} KiB"] = per
            print(f"  {size_kb} KiB done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for f in Path("/dev/shm").glob(prefix + "*"):
            f.unlink(missing_ok=True)
    ratios: dict = {}
    print(f"\nLMCache L2 adapters via `lmcache bench l2`: {keys} keys a batch, {rounds} rounds, verified; "
          "MB/s average [min-max]")
    print(f"{'size':>9} {'adapter':10} {'store MB/s':>24} {'load MB/s':>24}")
    for size, per in results.items():
        for name, r in per.items():
            if "error" in r:
                print(f"{size:>9} {name:10} not run: {r['error']}")
                continue
            s, lo = r["store"], r["load"]
            print(f"{size:>9} {name:10} {s['mbps']:>9,.0f} [{s['min']:,.0f}-{s['max']:,.0f}] "
                  f"{lo['mbps']:>9,.0f} [{lo['min']:,.0f}-{lo['max']:,.0f}]")
        c = per.get("cortex", {})
        if "store" in c:
            ratios[size] = {f"vs_{n}": {"store": c["store"]["mbps"] / r["store"]["mbps"],
                                         "load": c["load"]["mbps"] / r["load"]["mbps"]}
                            for n, r in per.items() if n != "cortex" and "store" in r}
    print("ratios (cortex / adapter, same run):")
    for size, r in ratios.items():
        print(f"  {size:>9}: " + ", ".join(f"{k} store {v['store']:.2f} load {v['load']:.2f}" for k, v in r.items()))
    all_ok = all(r[op]["ok"] == r[op]["keys"] for per in results.values() for r in per.values() if "store" in r
                 for op in ("store", "load"))
    print(f"every store and load verified: {'yes' if all_ok else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "ratios": ratios, "rounds": rounds,
                                               "keys": keys, "verified": all_ok}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
