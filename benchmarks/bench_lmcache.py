"""LMCache L2 adapters side by side: the cortex adapter against LMCache's own that need no server.

    CORTEX_BENCH_LMCACHE_PYTHON=.lmcache-venv/bin/python python benchmarks/bench_lmcache.py [--quick] [--json PATH]

Runs LMCache's own L2 benchmark (`lmcache bench l2`, lmcache 0.5.x) once per
adapter, object size and repeat, same keys per batch, same rounds, the
harness's round-trip verification on:

  cortex      cortex_cache.integrations.lmcache.CortexConnector over a fresh pool,
              its checksum check of every load on (the default)
  cortex-noverify  the same with adapter_params "verify": false
  fs_native   LMCache's C++ file-system adapter (files in a fresh temp dir on disk)
  fs          LMCache's Python file-system adapter (same; not with --quick)
  mock        LMCache's in-memory mock adapter; it simulates a bandwidth
              (mock_bandwidth_gb, set here to 100 GB/s so it does not throttle;
              not with --quick)

Sizes 256 KiB, 1 MiB, 4 MiB (and 64 KiB without --quick).  The adapters run
one after another, in reversed order every other repeat (2 repeats, 3
without --quick), each invocation on a fresh pool or directory.  Store and
load MB/s are the harness's averages over its rounds: medians over repeats
[min-max of the harness's rounds].  The ratios are cortex's against each
adapter's: the median of the repeats' ratios.  Targets (issue 17): cortex
store and load >= 1.0x fs_native at 256 KiB, 1 MiB and 4 MiB, verification on.
Needs LMCache: build its venv with scripts/lmcache_venv.sh and point
CORTEX_BENCH_LMCACHE_PYTHON at its Python.  The harness imports cortex_cache
from the checkout this script is in (PYTHONPATH), not from LMCache's venv.
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


TARGET_SIZES = {"256 KiB": "256 KiB", "1024 KiB": "1 MiB", "4096 KiB": "4 MiB"}  # results' keys: labels
TARGET = 1.0


def adapter(name: str, work: Path, tag: str, workers: int | None) -> dict:
    if name.startswith("cortex"):
        params = {"pool": "lmcbench", **({"workers": workers} if workers else {})}
        if name == "cortex-noverify":
            params["verify"] = False
        return {"type": "native_plugin", "module_path": "cortex_cache.integrations.lmcache",
                "class_name": "CortexConnector", "adapter_params": params}
    if name == "mock":
        return {"type": "mock", "max_size_gb": 4, "mock_bandwidth_gb": 100}
    return {"type": name, "base_path": str(work / tag)}


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--workers", type=int, help="the cortex adapter's copy threads (default: its own)")
    ap.add_argument("--only", help="comma-separated adapters to run (default: all)")
    args = ap.parse_args()
    exe = lmcache_cli()
    sizes = [256, 1024, 4096] if args.quick else [64, 256, 1024, 4096]
    names = ["cortex", "fs_native", "cortex-noverify"] + ([] if args.quick else ["fs", "mock"])
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    repeats = 2 if args.quick else 3
    rounds = 3 if args.quick else 5
    keys = 32
    work = Path(tempfile.mkdtemp(prefix="ccbench-lmcache-"))
    prefix = f"ccbench-{os.getpid()}."
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "CORTEX_CACHE_SHM_PREFIX": prefix,
           "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    os.environ["CORTEX_CACHE_SHM_PREFIX"] = prefix
    from cortex_cache import Pool

    runs: dict = {}  # size -> adapter -> list of one result per repeat
    try:
        for size_kb in sizes:
            per: dict = {n: [] for n in names}
            need = 3 * keys * (size_kb << 10) * (rounds + 2)
            for rep in range(repeats):
                for name in (names if rep % 2 == 0 else names[::-1]):
                    tag = f"{name}{size_kb}-{rep}"
                    if name.startswith("cortex"):
                        Pool.create("lmcbench", need + (64 << 20)).close()
                    try:
                        per[name].append(bench(exe, adapter(name, work, tag, args.workers), size_kb, keys, rounds,
                                               env, work / f"{tag}.json"))
                    finally:
                        if name.startswith("cortex"):
                            Pool.unlink("lmcbench")
                        shutil.rmtree(work / tag, ignore_errors=True)
            runs[f"{size_kb} KiB"] = per
            print(f"  {size_kb} KiB done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for f in Path("/dev/shm").glob(prefix + "*"):
            f.unlink(missing_ok=True)
    results: dict = {}
    for size, per in runs.items():
        results[size] = {}
        for name, reps in per.items():
            ok = [r for r in reps if "store" in r]
            if len(ok) < len(reps):
                results[size][name] = {"error": next(r["error"] for r in reps if "error" in r)}
                continue
            results[size][name] = {op: {"mbps": median([r[op]["mbps"] for r in ok]),
                                        "min": min(r[op]["min"] for r in ok), "max": max(r[op]["max"] for r in ok),
                                        "ok": sum(r[op]["ok"] for r in ok), "keys": sum(r[op]["keys"] for r in ok),
                                        "repeats": [r[op]["mbps"] for r in ok]}
                                   for op in ("store", "load")}
    ratios: dict = {}
    for size, per in results.items():
        for mine in ("cortex", "cortex-noverify"):
            c = per.get(mine, {})
            if "store" not in c:
                continue
            for n, r in per.items():
                if n.startswith("cortex") or "store" not in r:
                    continue
                ratios.setdefault(size, {})[f"{mine}_vs_{n}"] = {
                    op: median([a / b for a, b in zip(c[op]["repeats"], r[op]["repeats"])]) for op in ("store", "load")}
    goals = []
    for size in TARGET_SIZES:
        for mine, label in (("cortex", "verified"), ("cortex-noverify", "verify off")):
            for op in ("store", "load"):
                rat = ratios.get(size, {}).get(f"{mine}_vs_fs_native", {}).get(op)
                c, f = results.get(size, {}).get(mine, {}), results.get(size, {}).get("fs_native", {})
                goals.append({
                    "target": f"LMCache L2 {TARGET_SIZES[size]} {op}, cortex ({label}) >= {TARGET}x fs_native",
                    "need": TARGET if mine == "cortex" else None,
                    "value": f"{c[op]['mbps']:,.0f} MB/s" if op in c else "not measured",
                    "baseline": f"fs_native {f[op]['mbps']:,.0f} MB/s" if op in f else "fs_native not measured",
                    "ratio": rat, "met": (rat >= TARGET) if (rat is not None and mine == "cortex") else None})
    print(f"\nLMCache L2 adapters via `lmcache bench l2`: {keys} keys a batch, {rounds} rounds, {repeats} repeats, "
          "verified; MB/s median of repeats [min-max of rounds]")
    print(f"{'size':>9} {'adapter':16} {'store MB/s':>24} {'load MB/s':>24}")
    for size, per in results.items():
        for name, r in per.items():
            if "error" in r:
                print(f"{size:>9} {name:16} not run: {r['error']}")
                continue
            s, lo = r["store"], r["load"]
            print(f"{size:>9} {name:16} {s['mbps']:>9,.0f} [{s['min']:,.0f}-{s['max']:,.0f}] "
                  f"{lo['mbps']:>9,.0f} [{lo['min']:,.0f}-{lo['max']:,.0f}]")
    print("ratios (cortex / adapter, median of the repeats' ratios):")
    for size, r in ratios.items():
        print(f"  {size:>9}: " + ", ".join(f"{k} store {v['store']:.2f} load {v['load']:.2f}" for k, v in r.items()))
    all_ok = all(r[op]["ok"] == r[op]["keys"] for per in results.values() for r in per.values() if "store" in r
                 for op in ("store", "load"))
    print(f"every store and load verified: {'yes' if all_ok else 'NO'}")
    for g in goals:
        if g["met"] is not None:
            print(f"target {g['target']}: {'met' if g['met'] else 'MISSED'} ({g['ratio']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "ratios": ratios, "rounds": rounds,
                                               "repeats": repeats, "keys": keys, "verified": all_ok,
                                               "goals": goals}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
