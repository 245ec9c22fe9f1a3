#!/usr/bin/env python
"""Eviction benchmarks for cortex-cache.

1. Put latency in a FULL pool (every put evicts) beside puts into the same
   pool while it is still EMPTY, per policy: p50/p99 and throughput, with
   the ratio full/empty.  Targets: p99 <= 1 ms, full >= 50 % of empty.
2. Hit rate of every policy on a skewed Zipf trace with sequential scans
   mixed in (numpy, fixed seed), beside an exact LRU (OrderedDict).
3. Replay of the Mooncake traces (benchmarks/traces) through a pool LRU of
   2,000 / 6,000 / 20,000 blocks, beside the README's exact-LRU reference
   and our own OrderedDict replay of it.

Usage:  python benchmarks/bench_eviction.py [--quick] [--json PATH] [--data DIR]

Machines are noisy: compare the ratios within one run, not absolute times
across runs (docs/performance.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import signal
import sys
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# A private prefix, set before cortex_cache is imported, so a benchmark never
# touches (or leaks into) anyone else's pools.
os.environ["CORTEX_CACHE_SHM_PREFIX"] = f"ccbench-{os.getpid()}."

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import numpy as np  # noqa: E402

from cortex_cache import Pool, PoolNotFound  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parent / "traces"  # the Mooncake traces (traces/README.md)
P99_TARGET_US = 1000.0
RATIO_TARGET = 0.5

_made: list[str] = []


@contextmanager
def bench_pool(name: str, size: int, **kw) -> Iterator[Pool]:
    """A pool that is always closed and unlinked, whatever happens."""
    _made.append(name)
    p = Pool.create(name, size, **kw)
    try:
        yield p
    finally:
        p.close()
        _unlink(name)


def _unlink(name: str) -> None:
    try:
        Pool.unlink(name)
    except PoolNotFound:
        pass


def _cleanup_all() -> None:
    for name in _made:
        _unlink(name)


def _on_signal(signum, frame):  # turn SIGTERM/SIGHUP into an exception so `finally` runs
    raise SystemExit(128 + signum)


# --------------------------------------------------------------------------- 1. put latency


def _timed_puts(p: Pool, keys: list[bytes], value: bytes, prios: np.ndarray | None) -> tuple[np.ndarray, float]:
    """Put each key; return per-put latencies (µs) and the wall time of the loop (s)."""
    lat = np.empty(len(keys), dtype=np.int64)
    put, clock = p.put, time.perf_counter_ns
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        if prios is None:
            for j, k in enumerate(keys):
                a = clock()
                put(k, value)
                lat[j] = clock() - a
        else:
            for j, k in enumerate(keys):
                pr = int(prios[j])
                a = clock()
                put(k, value, priority=pr)
                lat[j] = clock() - a
        wall = time.perf_counter() - t0
    finally:
        if gc_was:
            gc.enable()
    return lat / 1000.0, wall


def _pcts(lat_us: np.ndarray) -> dict:
    return {
        "p50_us": float(np.percentile(lat_us, 50)),
        "p99_us": float(np.percentile(lat_us, 99)),
        "p999_us": float(np.percentile(lat_us, 99.9)),
        "max_us": float(lat_us.max()),
    }


def bench_put_latency(policy: str, n_entries: int, n_measure: int, seed: int = 1) -> dict:
    """Puts into the pool while EMPTY, then fill it and measure puts while FULL."""
    bs = 4096
    value = np.random.default_rng(seed).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    rng = np.random.default_rng(seed)
    prios = rng.integers(0, 8, size=n_entries + 2 * n_measure) if policy == "priority" else None
    keys = [b"key-%d" % i for i in range(n_entries + 2 * n_measure)]
    name = f"lat-{policy}"
    with bench_pool(name, n_entries * bs, block_size=bs, max_entries=n_entries, policy=policy) as p:
        # EMPTY: the first n_measure puts never need to evict.
        empty_lat, empty_wall = _timed_puts(p, keys[:n_measure], value, None if prios is None else prios[:n_measure])
        # Fill the rest of the way.
        for j in range(n_measure, n_entries):
            if prios is None:
                p.put(keys[j], value)
            else:
                p.put(keys[j], value, priority=int(prios[j]))
        assert p.stats()["evictions"] == 0
        if policy == "lfu":
            # Give the entries different counts (Zipf reads), so LFU has an order to keep.
            hot = np.minimum(rng.zipf(1.3, size=n_entries // 2), n_entries) - 1
            for j in hot:
                p.get(keys[int(j)])
        # Steady state: a warm-up of evicting puts, then the measured ones.
        warm = max(1000, n_measure // 10)
        lo = n_entries
        _timed_puts(p, keys[lo : lo + warm], value, None if prios is None else prios[lo : lo + warm])
        lo += warm
        hi = lo + n_measure
        full_lat, full_wall = _timed_puts(p, keys[lo:hi], value, None if prios is None else prios[lo:hi])
        st = p.stats()
        assert st["evictions"] == warm + n_measure, st["evictions"]
    empty_tput = n_measure / empty_wall
    full_tput = n_measure / full_wall
    ratio = full_tput / empty_tput
    full = _pcts(full_lat)
    return {
        "policy": policy,
        "entries": n_entries,
        "block_size": bs,
        "value_bytes": len(value),
        "measured_puts": n_measure,
        "empty": {**_pcts(empty_lat), "ops_per_s": empty_tput},
        "full": {**full, "ops_per_s": full_tput},
        "throughput_ratio": ratio,
        "p99_target_met": full["p99_us"] <= P99_TARGET_US,
        "ratio_target_met": ratio >= RATIO_TARGET,
    }


# --------------------------------------------------------------------------- 2. Zipf + scans


def zipf_trace(n_ops: int, universe: int, s: float, scan_len: int, scan_every: int, seed: int) -> np.ndarray:
    """Key ids: bounded Zipf(s) over [0, universe), with a scan of `scan_len`
    never-seen ids (>= universe) after every `scan_every` Zipf requests."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, universe + 1, dtype=np.float64)
    prob = ranks**-s
    prob /= prob.sum()
    hot_ids = rng.permutation(universe)  # popularity unrelated to the id
    zipf = hot_ids[rng.choice(universe, size=n_ops, p=prob)]
    parts, next_scan = [], universe
    for lo in range(0, n_ops, scan_every):
        parts.append(zipf[lo : lo + scan_every])
        parts.append(np.arange(next_scan, next_scan + scan_len))
        next_scan += scan_len
    return np.concatenate(parts)


def _value_len(key_id: int) -> int:
    return 16 + (key_id * 2654435761) % 97  # 16..112 bytes: sizes differ (for the size policy)


def _replay_exact_lru(ids: np.ndarray, cap: int) -> int:
    c: OrderedDict = OrderedDict()
    hits = 0
    for k in ids.tolist():
        if k in c:
            c.move_to_end(k)
            hits += 1
        else:
            c[k] = None
            if len(c) > cap:
                c.popitem(last=False)
    return hits


def bench_zipf(policies: list[str], n_ops: int, cap: int, universe: int) -> dict:
    ids = zipf_trace(n_ops, universe, s=1.0, scan_len=cap, scan_every=max(1, n_ops // 8), seed=7)
    is_scan = ids >= universe
    rows = []
    t = time.perf_counter()
    exact = _replay_exact_lru(ids, cap)
    rows.append({"policy": "exact LRU (OrderedDict)", "hit_rate": exact / ids.size, "seconds": time.perf_counter() - t})
    values = {n: bytes(n) for n in range(16, 113)}
    for policy in policies:
        t = time.perf_counter()
        hits = zhits = 0
        with bench_pool(f"zipf-{policy}", cap * 128, block_size=128, max_entries=cap, policy=policy) as p:
            get, put = p.get, p.put
            for k, scan in zip(ids.tolist(), is_scan.tolist()):
                kb = b"%d" % k
                if get(kb) is not None:
                    hits += 1
                    zhits += not scan
                    continue
                v = values[_value_len(k)]
                # Application hints, used only by the policies that read them:
                # scans are low priority, and short-lived.
                if policy == "priority":
                    put(kb, v, priority=0 if scan else 1)
                elif policy == "ttl":
                    put(kb, v, ttl=3600.0 if scan else None)
                else:
                    put(kb, v)
            st = p.stats()
            assert st["hits"] == hits and st["hits"] + st["misses"] == ids.size
        rows.append({
            "policy": policy,
            "hit_rate": hits / ids.size,
            "zipf_hit_rate": zhits / int((~is_scan).sum()),
            "evictions": st["evictions"],
            "seconds": time.perf_counter() - t,
        })
    return {"ops": int(ids.size), "capacity": cap, "universe": universe, "zipf_s": 1.0,
            "scan_ops": int(is_scan.sum()), "rows": rows}


# --------------------------------------------------------------------------- 3. Mooncake replay

REFERENCE_FALLBACK = {  # traces/README.md's table, used if it cannot be read
    "conversation": {2000: 0.054, 6000: 0.139, 20000: 0.287, "unbounded": 0.366},
    "synthetic": {2000: 0.144, 6000: 0.311, 20000: 0.571, "unbounded": 0.640},
}


def read_reference(data: Path) -> dict:
    """Exact-LRU hit rates from the data README's table (trace -> capacity -> rate)."""
    try:
        text = (data / "README.md").read_text()
    except OSError:
        return REFERENCE_FALLBACK
    ref = {}
    for trace in ("conversation", "synthetic"):
        m = re.search(rf"^\|\s*{trace}\s*\|(.*)\|\s*$", text, re.M)
        if not m:
            return REFERENCE_FALLBACK
        nums = [float(x) for x in m.group(1).split("|")]
        if len(nums) != 4:
            return REFERENCE_FALLBACK
        ref[trace] = dict(zip((2000, 6000, 20000, "unbounded"), nums))
    return ref


def load_trace(path: Path) -> list[list[int]]:
    with path.open() as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def replay_ordereddict(reqs: list[list[int]], cap: float) -> tuple[int, int]:
    """Exact LRU: a request's leading cached blocks are hits; every block is then cached."""
    c: OrderedDict = OrderedDict()
    hits = total = 0
    for ids in reqs:
        matching = True
        for b in ids:
            total += 1
            if b in c:
                c.move_to_end(b)
                hits += matching
            else:
                matching = False
                c[b] = None
                if len(c) > cap:
                    c.popitem(last=False)
    return hits, total


def replay_pool(p: Pool, reqs: list[list[int]], value: bytes = b"\x00" * 32) -> tuple[int, int]:
    """The same through a pool: get every block (a hit refreshes it), put `value` under it on a miss.

    A put of a key already cached is avoided: a get refreshes it just as well,
    and a replacing put reserves room for the new copy before dropping the old.
    """
    get, put = p.get, p.put
    hits = total = 0
    for ids in reqs:
        matching = True
        for b in ids:
            total += 1
            kb = b"%d" % b
            if get(kb) is not None:
                hits += matching
            else:
                matching = False
                put(kb, value)
    return hits, total


def bench_mooncake(data: Path, traces: list[str], caps: list[int]) -> dict:
    ref = read_reference(data)
    rows = []
    for trace in traces:
        path = data / f"mooncake_{trace}_trace.jsonl"
        reqs = load_trace(path)
        h, n = replay_ordereddict(reqs, float("inf"))
        rows.append({"trace": trace, "capacity": "unbounded", "reference": ref[trace]["unbounded"],
                     "ordereddict": h / n, "pool_lru": None, "blocks": n, "seconds": None})
        for cap in caps:
            oh, on = replay_ordereddict(reqs, cap)
            t = time.perf_counter()
            with bench_pool(f"mc-{trace}-{cap}", cap * 64, block_size=64, max_entries=cap, policy="lru") as p:
                ph, pn = replay_pool(p, reqs)
                st = p.stats()
                assert st["entries"] <= cap
            rows.append({"trace": trace, "capacity": cap, "reference": ref[trace].get(cap),
                         "ordereddict": oh / on, "pool_lru": ph / pn, "blocks": pn,
                     "ordereddict_hits": oh, "pool_hits": ph,
                         "pool_evictions": st["evictions"], "seconds": time.perf_counter() - t})
    return {"data": str(data), "rows": rows}


# --------------------------------------------------------------------------- output


def _yn(ok: bool) -> str:
    return "yes" if ok else "NO"


def print_latency(rows: list[dict]) -> None:
    print("\n== 1. put latency: FULL pool (every put evicts) vs EMPTY pool, same pool geometry ==")
    r0 = rows[0]
    print(f"   {r0['entries']:,} entries, block {r0['block_size']} B, values {r0['value_bytes']} B, "
          f"{r0['measured_puts']:,} measured puts each; targets: full p99 <= {P99_TARGET_US:.0f} us, "
          f"full/empty throughput >= {RATIO_TARGET:.0%}")
    hdr = (f"{'policy':<9}{'empty p50':>10}{'empty p99':>10}{'full p50':>10}{'full p99':>10}{'full p99.9':>11}"
           f"{'full max':>10}{'empty op/s':>12}{'full op/s':>11}{'ratio':>7}  {'p99 ok':>6} {'ratio ok':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        e, f = r["empty"], r["full"]
        print(f"{r['policy']:<9}{e['p50_us']:>8.1f}us{e['p99_us']:>8.1f}us{f['p50_us']:>8.1f}us{f['p99_us']:>8.1f}us"
              f"{f['p999_us']:>9.1f}us{f['max_us']:>8.0f}us{e['ops_per_s']:>12,.0f}{f['ops_per_s']:>11,.0f}"
              f"{r['throughput_ratio']:>7.2f}  {_yn(r['p99_target_met']):>6} {_yn(r['ratio_target_met']):>8}")


def print_zipf(z: dict) -> None:
    print(f"\n== 2. hit rate on a Zipf(s={z['zipf_s']}) trace with scans: {z['ops']:,} gets "
          f"({z['scan_ops']:,} of them scans of never-seen keys), {z['universe']:,} keys, "
          f"capacity {z['capacity']:,} entries; get, put on miss ==")
    print("   hints: priority policy gives scan entries priority 0 (others 1); ttl policy gives them a TTL")
    hdr = f"{'policy':<26}{'hit rate':>9}{'zipf-only':>11}{'evictions':>11}{'seconds':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in z["rows"]:
        zo = f"{r['zipf_hit_rate']:.4f}" if "zipf_hit_rate" in r else "-"
        ev = f"{r['evictions']:,}" if "evictions" in r else "-"
        print(f"{r['policy']:<26}{r['hit_rate']:>9.4f}{zo:>11}{ev:>11}{r['seconds']:>9.1f}")


def print_mooncake(m: dict) -> None:
    print("\n== 3. Mooncake trace replay (block hit rate = matched leading blocks / all blocks) ==")
    print("   reference = data README's exact LRU; OrderedDict = our exact-LRU replay; pool = cortex pool, policy lru")
    hdr = (f"{'trace':<14}{'capacity':>10}{'reference':>10}{'OrderedDict':>12}{'pool LRU':>10}"
           f"{'pool-ref':>10}{'pool-OD':>9}{'blocks':>9}{'seconds':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in m["rows"]:
        cap = r["capacity"] if isinstance(r["capacity"], str) else f"{r['capacity']:,}"
        ref = f"{r['reference']:.3f}" if r["reference"] is not None else "-"
        if r["pool_lru"] is None:
            pool = d_ref = d_od = secs = "-"
        else:
            pool = f"{r['pool_lru']:.4f}"
            d_ref = f"{r['pool_lru'] - r['reference']:+.4f}" if r["reference"] is not None else "-"
            d_od = f"{r['pool_lru'] - r['ordereddict']:+.4f}"
            secs = f"{r['seconds']:.1f}"
        print(f"{r['trace']:<14}{cap:>10}{ref:>10}{r['ordereddict']:>12.4f}{pool:>10}{d_ref:>10}{d_od:>9}"
              f"{r['blocks']:>9,}{secs:>9}")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs (under 30 s)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--data", metavar="DIR", type=Path, default=DEFAULT_DATA,
                    help=f"folder of the Mooncake traces (default {DEFAULT_DATA})")
    ap.add_argument("--skip", action="append", default=[], choices=["latency", "zipf", "mooncake"],
                    help="skip a part (repeatable)")
    args = ap.parse_args(argv)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    q = args.quick
    results: dict = {
        "meta": {
            "quick": q,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    }
    t_all = time.perf_counter()
    try:
        if "latency" not in args.skip:
            n_entries, n_measure = (20_000, 5_000) if q else (100_000, 20_000)
            results["put_latency"] = [
                bench_put_latency(pol, n_entries, n_measure) for pol in ("lru", "lfu", "priority")
            ]
            print_latency(results["put_latency"])
        if "zipf" not in args.skip:
            n_ops = 40_000 if q else 160_000
            results["zipf"] = bench_zipf(["lru", "lfu", "fifo", "priority", "ttl", "size"], n_ops, cap=2000,
                                         universe=50_000)
            print_zipf(results["zipf"])
        if "mooncake" not in args.skip:
            if not (args.data / "mooncake_synthetic_trace.jsonl").exists():
                print(f"\n== 3. skipped: no Mooncake traces in {args.data} (use --data DIR) ==")
            else:
                traces = ["synthetic"] if q else ["conversation", "synthetic"]
                caps = [2000, 6000] if q else [2000, 6000, 20000]
                results["mooncake"] = bench_mooncake(args.data, traces, caps)
                print_mooncake(results["mooncake"])
    finally:
        _cleanup_all()
    results["meta"]["seconds"] = time.perf_counter() - t_all

    lat = results.get("put_latency", [])
    if lat:
        met = all(r["p99_target_met"] and r["ratio_target_met"] for r in lat)
        print(f"\nput-latency targets met for all policies: {_yn(met)}")
    mc = [r for r in results.get("mooncake", {}).get("rows", []) if r["pool_lru"] is not None]
    if mc:
        worst_od = max(abs(r["pool_lru"] - r["ordereddict"]) for r in mc)
        worst_ref = max(abs(r["pool_lru"] - r["reference"]) for r in mc if r["reference"] is not None)
        same = all(r["pool_hits"] == r["ordereddict_hits"] for r in mc)
        print(f"pool LRU vs exact LRU (OrderedDict): max |diff| {worst_od:.4f}, "
              f"identical block hit counts in every case: {_yn(same)}; "
              f"vs README reference (3 decimals): max |diff| {worst_ref:.4f}")
    print(f"total {results['meta']['seconds']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
