"""Every benchmark of the project in one command, one table, one JSON file.

    python -m benchmarks [--quick] [--json PATH] [--only NAME[,NAME...]]

Runs, each in its own process, the benchmarks below (their own docstrings say
exactly what they measure), then prints one table: every figure as a median
with min-max over the benchmark's repeated runs, every comparison as a ratio
against a baseline measured in the same run, and each target met or missed.
The JSON (default benchmark-results.json) holds the table and every
benchmark's full output.

  peers     cortex beside Redis (Unix socket and TCP), a naive shared-memory
            store, LMCache's CPU backend (if installed) and numpy copies
  pool      put/get/get_into against numpy copies of the same footprint; batched
            calls against one call per key; copy-and-checksum, C against Python
  capacity  entries that fit in a 64 MiB pool against size / value
  scaling   get_into throughput of two reader processes against one
  eviction  put latency and throughput in a full pool against an empty one
  policies  every eviction policy's hit rate on the Mooncake traces through a pool
            and through the KV layer, beside exact LRU of the same run, and on
            the access patterns of benchmarks/workloads.py (auto beside the
            best of the others); each policy's full-pool put p50/p99 beside
            LRU's (issues 27, 42); the hit rate after a persist, delete and
            restore beside the pool that never stopped (issue 39)
  persist   snapshot persist/restore against plain file write/read
  boot      restore of a pool that is gone (1, 4, 8 GiB; --quick 0.25, 1):
            first hit after the command starts, the background fill against
            a cold sequential read of the snapshot's files
  resize    each operation's latency for processes using a pool across its resize
            (100,000 entries; --quick 20,000) against the same run's before
  tier      disk tier hit rates, spill/promote against plain file write/read
  remote    remote-tier promotes against raw redis-py GETs of the same values
  kv        KV-chunk store/retrieve against plain copies; chunk-key cost
  lookup    leading-chunk lookups of a 128k-token prompt remembered per request
            against hashing and probing the whole prompt each time
  lmcache   the LMCache adapter against LMCache's own server-less L2 adapters
            (only with CORTEX_BENCH_LMCACHE_PYTHON: scripts/lmcache_venv.sh)
  sglang    the SGLang HiCache backend against SGLang's `file` backend, and the
            Mooncake trace's hit rate through it (only with
            CORTEX_BENCH_SGLANG_PYTHON: scripts/sglang_venv.sh; the trace in
            benchmarks/traces, or CORTEX_BENCH_MOONCAKE_TRACE)
  gpu       host<->device staging (only where CUDA is available)

  startup   `cortex --help` and friends against `python -c pass`

LMCache's CPU backend is a peer in `peers` too when CORTEX_BENCH_LMCACHE_PYTHON
names a Python that has LMCache; without it the table says it was not measured.

The last section lists the issues' targets, one line each: cortex's figure,
its baseline, the ratio and met/missed -- the head-to-head pairs of `peers`
(1 MiB put against the naive store's overwrite and against a bare copy into
kept-attached shared memory, 1 MiB get_into against LMCache's CPU backend, a
64 KiB hot-key get against Redis), `pool`'s batched view and zero-copy put,
`lmcache`'s store and load against fs_native (verification on, and off for
comparison), the eviction p99, snapshot and disk-tier figures of this run
against those recorded in docs/performance.md (RECORDED below), the
"128k-token lookup, remembered, < 50 us" (`lookup`, at 256- and 16-token
chunks, beside the un-remembered lookup), and `persist`'s incremental persist
against a full one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["peers", "pool", "capacity", "scaling", "eviction", "policies", "persist", "boot", "resize", "tier", "remote", "kv",
         "lookup", "lmcache", "sglang", "gpu", "startup"]
SCRIPTS = {name: HERE / f"bench_{name}.py" for name in ORDER}
SCRIPTS["gpu"] = HERE / "gpu_staging.py"


def run_one(name: str, quick: bool, outdir: Path) -> tuple[dict | None, str, float]:
    path = outdir / f"{name}.json"
    cmd = [sys.executable, str(SCRIPTS[name]), "--json", str(path)]
    if quick and name != "gpu":
        cmd.insert(2, "--quick")
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t
    log = r.stdout + r.stderr
    if r.returncode != 0 or not path.exists():
        why = "no CUDA device here" if name == "gpu" and r.returncode == 69 else \
            (log.strip().splitlines() or ["no output"])[-1][:200]
        if name == "lmcache" and not os.environ.get("CORTEX_BENCH_LMCACHE_PYTHON"):
            why = "set CORTEX_BENCH_LMCACHE_PYTHON to a Python with LMCache (scripts/lmcache_venv.sh)"
        if name == "sglang" and not os.environ.get("CORTEX_BENCH_SGLANG_PYTHON"):
            why = "set CORTEX_BENCH_SGLANG_PYTHON to a Python with SGLang (scripts/sglang_venv.sh)"
        return None, why, secs
    return json.loads(path.read_text()), log, secs


def fig(median: float, lo: float | None = None, hi: float | None = None, unit: str = "") -> str:
    s = f"{median:,.2f}{unit}" if median < 1000 else f"{median:,.0f}{unit}"
    if lo is not None and hi is not None:
        s += f" [{lo:,.2f}-{hi:,.2f}]" if hi < 1000 else f" [{lo:,.0f}-{hi:,.0f}]"
    return s


# Each extractor turns one benchmark's JSON into table rows:
# (figure, value with its spread, baseline, ratio or None, target result or None).

def rows_peers(d: dict) -> list:
    rows = []
    for size, per in d["results"].items():
        c = per["cortex"]
        for store, f in per.items():
            if store == "numpy":
                continue
            g, p = f["get_gbps"], f["put_gbps"]
            lat = f.get("latency_us")
            lat_s = f", cross-process get p50/p99 {lat['p50']:.0f}/{lat['p99']:.0f} us" if lat else ""
            rows.append((f"{size} {store}: get GB/s", fig(g["median"], g["min"], g["max"]),
                         f"get {f['get_ops']['median']:,.0f} ops/s, put {fig(p['median'], p['min'], p['max'])} "
                         f"GB/s, {f['put_ops']['median']:,.0f} ops/s{lat_s}", None, None))
        n = per["numpy"]
        rows.append((f"{size} numpy copy out/in GB/s", fig(n["get_gbps"]["median"], n["get_gbps"]["min"],
                     n["get_gbps"]["max"]), f"in {fig(n['put_gbps']['median'])}", None, None))
        rat = d["ratios"][size]
        for peer in ("redis-unix", "redis-tcp", "naive-shm", "lmcache"):
            if f"get_vs_{peer}" in rat:
                rows.append((f"{size} cortex vs {peer}", f"get {rat[f'get_vs_{peer}']:.1f}x, put "
                             f"{rat[f'put_vs_{peer}']:.1f}x", peer, rat[f"get_vs_{peer}"], None))
        rows.append((f"{size} cortex vs numpy copy", f"get {rat['get_vs_copy']:.2f}x, get_into "
                     f"{rat['get_into_vs_copy']:.2f}x, put {rat['put_vs_copy']:.2f}x", "numpy", rat["get_vs_copy"], None))
        rows.append((f"{size} two reader processes", fig(c["readers2_gbps"]["median"], c["readers2_gbps"]["min"],
                     c["readers2_gbps"]["max"], " GB/s"), f"one reader {fig(c['readers1_gbps']['median'])} GB/s",
                     c["two_vs_one"], None))
    for k, why in d.get("skipped", {}).items():
        rows.append((f"{k}", "not measured", why, None, None))
    return rows


def rows_pool(d: dict) -> list:
    rows = []
    for r in d["rows"]:
        size = f"{r['size'] // 1024} KiB"
        rows.append((f"{size} put / get / get_into GB/s",
                     f"{r['put_gbps']:.2f} / {r['get_gbps']:.2f} / {r['get_into_gbps']:.2f}",
                     f"copy in {r['copy_in_gbps']:.2f}, out {r['copy_out_gbps']:.2f}",
                     r["get_gbps"] / r["copy_out_gbps"], None))
        rows.append((f"{size} put / get ops/s", f"{r['put_ops']:,.0f} / {r['get_ops']:,.0f}", "", None, None))
    for b in d.get("batches", []):
        size = f"{b['size'] // 1024} KiB"
        rows.append((f"{size} view_many, batch of {b['batch']} (us/key)", f"{b['view_many_us_per_key']:.2f}",
                     f"view one by one {b['view_us_per_key']:.2f}", b["view_many_vs_view"], b["view_many_us_per_key"] <= 2.0))
        rows.append((f"{size} get_many_into / put_many (us/key)",
                     f"{b['get_many_into_us_per_key']:.2f} / {b['put_many_us_per_key']:.2f}",
                     f"one by one {b['get_into_us_per_key']:.2f} / {b['put_us_per_key']:.2f}",
                     b["get_many_vs_get_into"], None))
    for c in d.get("copy_hash", []):
        rows.append((f"{c['size'] // 1024} KiB x 32 copied + checksummed, {c['threads']} thread(s), GB/s",
                     f"{c['c_gbps']:.1f} (C, {c['isa']})", f"Python loop {c['python_gbps']:.1f}", c["c_vs_python"], None))
    return rows


def rows_capacity(d: dict) -> list:
    return [(f"{r['value'] // 1024} KiB values, {r['block'] // 1024} KiB blocks: entries", f"{r['entries']:,}",
             f"ideal {r['ideal']:,}", r["ratio"], (r["ratio"] >= 0.98) if r["value"] >= r["block"] else None)
            for r in d["rows"]]


def rows_scaling(d: list) -> list:
    return [(f"{r['size'] // 1024} KiB get_into, 2 readers", f"{r['two_gbps']:.2f} GB/s",
             f"1 reader {r['one_gbps']:.2f} GB/s", r["ratio"], None) for r in d]


def rows_eviction(d: dict) -> list:
    rows = []
    for r in d["put_latency"]:
        rows.append((f"{r['policy']} put into a full pool", f"{r['full']['ops_per_s']:,.0f} ops/s, p99 "
                     f"{r['full']['p99_us']:.0f} us", f"empty pool {r['empty']['ops_per_s']:,.0f} ops/s",
                     r["throughput_ratio"], None))
    return rows


def rows_policies(d: dict) -> list:
    rows = []
    for r in d.get("hits", {}).get("rows", []):
        per = r["policies"]
        rates = ", ".join(f"{n} {p['hit_rate']:.3f}" for n, p in per.items())
        rows.append((f"{r['trace']} {r['capacity']:,} blocks: hit rate through a pool", rates,
                     f"exact LRU {r['exact_lru']:.3f}", per["auto"]["hit_rate"] / max(r["exact_lru"], 1e-9), None))
        kv = ", ".join(f"{n} {p['kv']['hit_rate']:.3f}" for n, p in per.items() if "kv" in p)
        if kv:
            rows.append((f"{r['trace']} {r['capacity']:,} blocks: hit rate through kv.py", kv, "", None, None))
    for w in d.get("workloads", {}).get("rows", []):
        per = w["policies"]
        rates = ", ".join(f"{n} {per[n]['hit_rate']:.3f}" for n in ("auto", "lru", "s3fifo", "arc"))
        rows.append((f"workload {w['class']}, {w['capacity']:,} entries: hit rate", rates + f", {w['best_other']} "
                     f"{per[w['best_other']]['hit_rate']:.3f}", f"best of lru/s3fifo/arc {w['best_classic']:.3f}",
                     per["auto"]["hit_rate"] / max(w["best_classic"], 1e-9), None))
    for a in d.get("admission", {}).get("rows", []):
        rows.append((f"{a['trace']} {a['policy']} over a disk tier, tier_admit {a['tier_admit']}",
                     f"hit rate {a['hit_rate']:.3f}, disk share {a['disk_hit_share']:.3f}",
                     f"{a['disk_bytes_written'] / 2**20:.0f} MiB written to disk", None, None))
    for c in d.get("costs", {}).get("rows", []):
        vs_lru = "" if c["cost_vs_lru"] is None else f", {c['cost_vs_lru']:.2f}x lru's (paired)"
        rows.append((f"{c['policy']} 4 KiB put into a full pool (each evicts)", f"{c['full_us']:.2f} us, "
                     f"p50/p99 {c['p50']:.1f}/{c['p99']:.1f} us{vs_lru}",
                     f"into free space {c['free_us']:.2f} us (target >= {c['target']}x)", c["ratio"], c["met"]))
    return rows


def rows_persist(d: dict) -> list:
    s, r = d["results"], d["ratios"]
    return [
        ("persist GB/s", fig(s["persist"]["gbps"], s["persist"]["gbps_min"], s["persist"]["gbps_max"]),
         f"write+fsync {s['write']['gbps']:.2f}", r["persist_vs_write"], None),
        ("restore GB/s, file dropped", fig(s["restore_dropped"]["gbps"], s["restore_dropped"]["gbps_min"],
         s["restore_dropped"]["gbps_max"]), f"read {s['read_dropped']['gbps']:.2f}", r["restore_vs_read_dropped"], None),
    ]


def rows_boot(d: dict) -> list:
    rows = []
    for r in d["sizes"]:
        m = r["median"]
        rows.append((f"{r['gib']:g} GiB pool restored at boot: first hit", f"{m['first_hit']:.3f} s",
                     f"published after {m['published']:.3f} s", None, None))
        rows.append((f"{r['gib']:g} GiB pool: background fill", f"{m['fill']:.2f} s",
                     f"cold read {m['read']:.2f} s (with readahead {m['read_ahead']:.2f} s)", r["fill_vs_read"], None))
    return rows


def rows_resize(d: dict) -> list:
    m = d["median"]
    n = d["rounds"][0]["entries"]
    return [(f"resize at {n:,} entries: worst operation added (ms)", f"{m['added_ms']:.1f}",
             f"worst before {m['worst_baseline_ms']:.1f} ms; last hold {m['swap_ms']:.1f} ms "
             f"({m['swap_cpu_ms']:.1f} CPU), longest {m['longest_hold_ms']:.1f} ms ({m['longest_hold_cpu_ms']:.1f} CPU)",
             None, d["target_met"])]


def rows_tier(d: dict) -> list:
    rows = []
    for label, h in d["hit_rate"].items():
        rows.append((f"hit rate, {label} trace", f"{h['memory_disk']:.3f} with disk", f"{h['memory_only']:.3f} memory "
                     f"only; exact LRU of 5x {h['lru_5x']:.3f}", h["memory_disk"] / max(h["memory_only"], 1e-9), None))
    s, r = d["speed"], d["ratios"]
    rows.append(("disk spill GB/s", fig(s["spill"]["gbps"], s["spill"]["gbps_min"], s["spill"]["gbps_max"]),
                 f"write+fsync {s['write']['gbps']:.2f}", r["spill_vs_write"], None))
    rows.append(("disk promote GB/s", fig(s["promote"]["gbps"], s["promote"]["gbps_min"], s["promote"]["gbps_max"]),
                 f"read {s['read']['gbps']:.2f}", r["promote_vs_read"], None))
    return rows


def rows_remote(d: dict) -> list:
    return [(f"{size} remote promote", f"{r['promote_gbps']:.2f} GB/s, {r['promote_ops']:,.0f} ops/s, p50/p99 "
             f"{r['promote_p50_us']:.0f}/{r['promote_p99_us']:.0f} us",
             f"redis-py GET {r['get_gbps']:.2f} GB/s, p50/p99 {r['get_p50_us']:.0f}/{r['get_p99_us']:.0f} us",
             r["promote_vs_get"], None) for size, r in d["results"].items()]


def rows_kv(d: dict) -> list:
    return [
        ("KV store GB/s", fig(d["store"]["gbps"], d["store"]["gbps_min"], d["store"]["gbps_max"]),
         f"copy {d['copy_in']['gbps']:.2f}", d["ratios"]["store_vs_copy"], None),
        ("KV retrieve GB/s", fig(d["retrieve"]["gbps"], d["retrieve"]["gbps_min"], d["retrieve"]["gbps_max"]),
         f"copy {d['copy_out']['gbps']:.2f}", d["ratios"]["retrieve_vs_copy"], None),
        ("chunk keys, ns per token", f"{d['hash_us_per_token'] * 1000:.1f}", "SHA-256 chain", None, None),
    ]


def rows_lookup(d: dict) -> list:
    rows = []
    for c, r in d["results"].items():
        v = r["variants"]
        us = {k: f"{s['median_us']:,.1f} / {s['p99_us']:,.1f}" for k, s in v.items()}
        full = v["full"]["median_us"]
        rows.append((f"128k tokens, {c}-token chunks: remembered lookup, median / p99 us", us["remembered"],
                     f"un-remembered {us['full']}", full / v["remembered"]["median_us"],
                     v["remembered"]["median_us"] < 50))
        rows.append((f"128k tokens, {c}-token chunks: remembered, a chunk removed by another process",
                     us["removed"], "un-remembered", full / v["removed"]["median_us"], None))
        rows.append((f"128k tokens, {c}-token chunks: contains_many / leading, keys made",
                     f"{us['contains_many']}; {us['leading']}", "", None, None))
        rows.append((f"128k tokens, {c}-token chunks: vLLM present, remembered", us["vllm_remembered"],
                     f"not remembered {us['vllm_present']}",
                     v["vllm_present"]["median_us"] / v["vllm_remembered"]["median_us"], None))
    return rows


def rows_lmcache(d: dict) -> list:
    rows = []
    for size, per in d["results"].items():
        for name, r in per.items():
            if "store" not in r:
                rows.append((f"{size} {name}", "not run", r.get("error", ""), None, None))
                continue
            c = per.get("cortex", {})
            ratio = c["load"]["mbps"] / r["load"]["mbps"] if "load" in c and name != "cortex" else None
            rows.append((f"{size} {name}: store / load MB/s", f"{r['store']['mbps']:,.0f} / {r['load']['mbps']:,.0f}",
                         "cortex load vs this" if ratio else "", ratio, None))
    return rows


def rows_sglang(d: dict) -> list:
    t = d["throughput"]
    rows = []
    for name, r in t["results"].items():
        ratio = t["ratios_vs_file"].get(name, {}).get("get")
        rows.append((f"{t['page_bytes'] >> 10} KiB pages, {name}: set / get GB/s",
                     f"{r['set_gbps']['median']:.2f} / {r['get_gbps']['median']:.2f}",
                     "file backend get" if ratio else "", ratio, None))
    h = d.get("hit_rate")
    if h:
        rows.append((f"hit rate, {h['trace']} via the backend", f"{h['memory_disk']['hit_rate']:.3f} with disk",
                     f"{h['memory_only']['hit_rate']:.3f} memory only",
                     h["memory_disk"]["hit_rate"] / max(h["memory_only"]["hit_rate"], 1e-9), None))
    return rows


def rows_gpu(d: dict) -> list:
    bw = d["bandwidth"]
    return [
        ("H2D / D2H GB/s, pinned pool", f"{bw['pool_registered_h2d_gbps']:.1f} / {bw['pool_registered_d2h_gbps']:.1f}",
         f"torch pinned {bw['torch_pinned_h2d_gbps']:.1f} / {bw['torch_pinned_d2h_gbps']:.1f}",
         bw["pool_registered_h2d_gbps"] / bw["torch_pinned_h2d_gbps"], None),
        ("load / store API GB/s", f"{bw['pool_load_api_gbps']:.1f} / {bw['pool_store_api_gbps']:.1f}", d["device"],
         None, None),
    ]


def rows_startup(d: dict) -> list:
    return [(r["command"], f"{r['median_ms']:.0f} ms [{r['min_ms']:.0f}-{r['max_ms']:.0f}]",
             "python -c pass", r["x_python"], None) for r in d["rows"]]


# Issue 17's "no regression" figures, as recorded in docs/performance.md's table of the full run
# (`python -m benchmarks`, 2026-11-29): eviction p99 in us (lower is better), the rest ratios against a
# baseline of the same run (higher is better).  A figure passes within 5% of its record.
RECORDED = {
    "eviction": {"lru full-pool put p99 (us)": 85.0, "lfu full-pool put p99 (us)": 27.0,
                 "priority full-pool put p99 (us)": 49.0},
    "persist": {"persist / write+fsync": 1.33, "restore / read, file dropped": 0.39},
    "tier": {"chat hit rate, with disk / memory only": 1.21, "mooncake hit rate, with disk / memory only": 2.62,
             "spill / write+fsync": 0.99, "promote / read": 0.48},
}
TOLERANCE = 0.05


def current_figures(name: str, d: dict) -> dict:
    """The figures of RECORDED[name] in this run's output of that benchmark."""
    if name == "eviction":
        return {f"{r['policy']} full-pool put p99 (us)": r["full"]["p99_us"] for r in d.get("put_latency", [])}
    if name == "persist":
        return {"persist / write+fsync": d["ratios"]["persist_vs_write"],
                "restore / read, file dropped": d["ratios"]["restore_vs_read_dropped"]}
    if name == "tier":
        out = {f"{label} hit rate, with disk / memory only": h["memory_disk"] / max(h["memory_only"], 1e-9)
               for label, h in d.get("hit_rate", {}).items()}
        out["spill / write+fsync"] = d["ratios"]["spill_vs_write"]
        out["promote / read"] = d["ratios"]["promote_vs_read"]
        return out
    return {}


def regressions(name: str, d: dict) -> list[dict]:
    """Issue 17's no-regression lines: each figure against its record, within TOLERANCE."""
    lines = []
    now = current_figures(name, d)
    for fig_name, rec in RECORDED.get(name, {}).items():
        cur = now.get(fig_name)
        lower_better = fig_name.endswith("(us)")
        if cur is None:
            lines.append({"target": f"{name}: {fig_name} within 5% of recorded", "value": "not measured",
                          "baseline": f"recorded {rec:g}", "ratio": None, "met": None})
            continue
        ratio = rec / cur if lower_better else cur / rec  # > 1: better than the record
        lines.append({"target": f"{name}: {fig_name} within 5% of recorded", "value": f"{cur:.2f}",
                      "baseline": f"recorded {rec:g}", "ratio": ratio, "met": ratio >= 1 - TOLERANCE})
    return lines


EXTRACT = {"peers": rows_peers, "pool": rows_pool, "capacity": rows_capacity, "scaling": rows_scaling,
           "eviction": rows_eviction, "policies": rows_policies, "persist": rows_persist, "boot": rows_boot,
           "resize": rows_resize, "tier": rows_tier,
           "remote": rows_remote, "kv": rows_kv,
           "lookup": rows_lookup, "lmcache": rows_lmcache, "sglang": rows_sglang, "gpu": rows_gpu,
           "startup": rows_startup}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="every benchmark's short form (a few minutes in all)")
    ap.add_argument("--json", metavar="PATH", default="benchmark-results.json", help="where to write the results")
    ap.add_argument("--only", metavar="NAMES", help="comma-separated subset of: " + ", ".join(ORDER))
    args = ap.parse_args()
    names = ORDER if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in ORDER]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(ORDER)}")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc: dict = {
        "command": " ".join(["python -m benchmarks", *sys.argv[1:]]),
        "started": started,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "benchmarks": {}, "table": {}, "targets": {}, "not_run": {}, "goals": [],
    }
    with tempfile.TemporaryDirectory(prefix="ccbench-all-") as tmp:
        for name in names:
            print(f"running {name} ...", end=" ", flush=True, file=sys.stderr)
            data, log, secs = run_one(name, args.quick, Path(tmp))
            print(f"{secs:.0f} s" + ("" if data is not None else f" (not run: {log})"), file=sys.stderr, flush=True)
            if data is None:
                doc["not_run"][name] = log
                continue
            doc["benchmarks"][name] = data
            doc["table"][name] = [
                {"figure": f, "value": v, "baseline": b, "ratio": r} for f, v, b, r, _ in EXTRACT[name](data)
            ]
            if isinstance(data, dict):
                doc["goals"] += [{k: v for k, v in g.items() if not k.endswith("_s")} for g in data.get("goals", [])]
                doc["goals"] += regressions(name, data)
            targets = data.get("targets") if isinstance(data, dict) else None
            if isinstance(targets, dict):
                for t, ok in targets.items():
                    doc["targets"][f"{name}: {t}"] = bool(ok)
            for row in data.get("put_latency", []) if isinstance(data, dict) else []:
                doc["targets"][f"eviction: {row['policy']} p99 <= 1 ms and >= 0.5x empty"] = bool(
                    row["p99_target_met"] and row["ratio_target_met"])
    print(f"\ncortex-cache benchmarks, {started}; Python {doc['machine']['python']}, {doc['machine']['cpus']} CPUs, "
          f"{doc['machine']['memory_gib']} GiB")
    for name, rows in doc["table"].items():
        print(f"\n[{name}]")
        w = max(len(r["figure"]) for r in rows)
        for r in rows:
            ratio = f"  ({r['ratio']:.2f}x)" if r["ratio"] is not None else ""
            base = f"  vs {r['baseline']}" if r["baseline"] else ""
            print(f"  {r['figure']:<{w}}  {r['value']}{base}{ratio}")
    for name, why in doc["not_run"].items():
        print(f"\n[{name}] not run: {why}")
    if doc["goals"]:
        print("\ntargets of the issues (cortex, baseline, ratio: same run; ratio > 1 is cortex ahead / better than the "
              "record)" + (" -- --quick: smaller runs than the recorded ones" if args.quick else ""))
        w = max(len(g["target"]) for g in doc["goals"])
        for g in doc["goals"]:
            ratio = f"{g['ratio']:.2f}x" if g["ratio"] is not None else "-"
            verdict = {True: "met", False: "MISSED", None: ""}[g["met"]]
            print(f"  {g['target']:<{w}}  {g['value']:>14}  vs {g['baseline']:<40} {ratio:>7}  {verdict}")
    print("\ntargets:")
    for t, ok in doc["targets"].items():
        print(f"  {'met   ' if ok else 'MISSED'} {t}")
    Path(args.json).write_text(json.dumps(doc, indent=2, default=str))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
