"""Put/get throughput of one process against a plain numpy copy of the same size.

    python benchmarks/bench_pool.py [--quick] [--json PATH]

For each size the copy baselines and the pool operations are measured in the
same run, interleaved, and reported as medians with their ratio; these
machines are noisy, so only the ratios mean much.  The pool cycles through
KEYS keys, so its data does not all sit in the CPU cache; the baselines copy
over the same footprint (put: one source into KEYS rotating destinations;
get: KEYS rotating sources into one destination), so the ratio measures the
pool's overhead, not the cache.  Targets (issue [1/9]):
put and get >= 0.7x the copy at 1 MiB and up; >= 100,000 ops/s at 4 KiB.
Then batched calls against one call per key, and a batch of values copied
and checksummed by copy threads with the C copy_hash against the Python loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("CORTEX_CACHE_SHM_PREFIX", f"ccbench-{os.getpid()}.")

from cortex_cache import Pool  # noqa: E402

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
KEYS = 16


def _time(fn, n: int) -> float:
    """Seconds per call of fn over n calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def bench_size(pool: Pool, size: int, rounds: int, budget_bytes: int) -> dict:
    n = max(20, min(20000, budget_bytes // size))
    keys = [f"k{size}-{i}" for i in range(KEYS)]
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    ring = np.zeros((KEYS, size), dtype=np.uint8)  # the baselines' footprint
    out = bytearray(size)
    out_np = np.frombuffer(out, dtype=np.uint8)
    for k in keys:  # warm: every key exists, every block has been written once
        pool.put(k, src)
    res: dict[str, list[float]] = {"copy_in": [], "copy_out": [], "put": [], "get": [], "get_into": []}
    for _ in range(rounds):
        it = iter(range(10**9))
        res["copy_in"].append(_time(lambda: np.copyto(ring[next(it) % KEYS], src), n))
        it = iter(range(10**9))
        res["copy_out"].append(_time(lambda: np.copyto(out_np, ring[next(it) % KEYS]), n))
        it = iter(range(10**9))
        res["put"].append(_time(lambda: pool.put(keys[next(it) % len(keys)], src), n))
        it = iter(range(10**9))
        res["get"].append(_time(lambda: pool.get(keys[next(it) % len(keys)]), n))
        it = iter(range(10**9))
        res["get_into"].append(_time(lambda: pool.get_into(keys[next(it) % len(keys)], out), n))
    for k in keys:
        pool.delete(k)
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "size": size,
        "iterations": n,
        "rounds": rounds,
        **{f"{k}_gbps": size / v / 1e9 for k, v in med.items()},
        **{f"{k}_ops": 1 / v for k, v in med.items()},
        **{f"{k}_gbps_min": size / max(v) / 1e9 for k, v in res.items()},
        **{f"{k}_gbps_max": size / min(v) / 1e9 for k, v in res.items()},
        "put_vs_copy": med["copy_in"] / med["put"],
        "get_vs_copy": med["copy_out"] / med["get"],
        "get_into_vs_copy": med["copy_out"] / med["get_into"],
    }


BATCH = 64


def bench_batch(pool: Pool, size: int, rounds: int) -> dict:
    """Batched calls against the same keys one call at a time (issue [T2 3/6]: batched view <= 2 us per key
    in batches of 64), interleaved in each round; seconds per key."""
    keys = [f"b{size}-{i}" for i in range(BATCH)]
    src = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    outs = [bytearray(size) for _ in keys]
    pool.put_many([(k, src) for k in keys])
    n = 50

    def views_one() -> None:
        for k in keys:
            pool.view(k).release()

    def views_many() -> None:
        pool.release_many(pool.view_many(keys))

    def gets_one() -> None:
        for k, o in zip(keys, outs):
            pool.get_into(k, o)

    def puts_one() -> None:
        for k in keys:
            pool.put(k, src)

    cases = {"view": views_one, "view_many": views_many, "get_into": gets_one,
             "get_many_into": lambda: pool.get_many_into(keys, outs), "put": puts_one,
             "put_many": lambda: pool.put_many([(k, src) for k in keys])}
    res: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            res[k].append(_time(fn, n) / BATCH)
    pool.delete_many(keys)
    med = {k: statistics.median(v) for k, v in res.items()}
    return {"size": size, "batch": BATCH, **{f"{k}_us_per_key": v * 1e6 for k, v in med.items()},
            "view_many_vs_view": med["view"] / med["view_many"],
            "get_many_vs_get_into": med["get_into"] / med["get_many_into"],
            "put_many_vs_put": med["put"] / med["put_many"]}


def bench_write_paths(pool: Pool, rounds: int) -> dict:
    """The C write path against core.py's on the same pool (a second handle opened with
    CORTEX_CACHE_PURE_PYTHON=1), interleaved in each round: the engines' zero-copy put -- reserve_write_many
    and commit_many of 64 x 256 KiB overwrites, checksums given as the engine adapters give them, the
    values not copied -- in us per key; and a 1 MiB put, in us."""
    from xxhash import xxh3_64_intdigest

    from cortex_cache.core import PURE_PYTHON_ENV

    os.environ[PURE_PYTHON_ENV] = "1"
    try:
        slow = Pool.open(pool.name)
    finally:
        del os.environ[PURE_PYTHON_ENV]
    assert pool.core.fast is not None and slow.core.fast is None
    size, big = 256 << 10, 1 << 20
    items = [(f"zc{i}", size) for i in range(BATCH)]
    value = np.random.default_rng(3).integers(0, 255, big, dtype=np.uint8)
    sums = [xxh3_64_intdigest(value[:size])] * BATCH
    for w in pool.reserve_write_many(items):
        w.memoryview[:] = value[:size]
        w.commit(sums[0])
    n = 50

    def zero_copy(p: Pool):
        return lambda: p.commit_many(p.reserve_write_many(items), sums)

    cases = {"zc_c": zero_copy(pool), "zc_python": zero_copy(slow),
             "put_c": lambda: [pool.put(f"big{i % 8}", value) for i in range(8)],
             "put_python": lambda: [slow.put(f"big{i % 8}", value) for i in range(8)]}
    res: dict[str, list[float]] = {k: [] for k in cases}
    try:
        for _ in range(rounds):
            for k, fn in cases.items():
                res[k].append(_time(fn, n) / (BATCH if k.startswith("zc") else 8))
    finally:
        slow.close()
        pool.delete_many([k for k, _ in items] + [f"big{i}" for i in range(8)])
    med = {k: statistics.median(v) * 1e6 for k, v in res.items()}
    return {"zero_copy_c_us_per_key": med["zc_c"], "zero_copy_python_us_per_key": med["zc_python"],
            "put_1mib_c_us": med["put_c"], "put_1mib_python_us": med["put_python"],
            "zero_copy_c_vs_python": med["zc_python"] / med["zc_c"], "put_c_vs_python": med["put_python"] / med["put_c"]}


COPY_BATCH = 32  # values a batch in the copy-and-checksum benchmark (LMCache's bench l2 batch)


def bench_copy_hash(size: int, rounds: int, threads: int) -> dict:
    """A batch of values copied and checksummed by `threads` copy threads, as the engine adapters load and
    store them: the C copy_hash (GIL let go for a whole value) against the Python loop (numpy's copy and
    xxhash's update, each without the GIL, a 256 KiB step at a time), interleaved in each round."""
    from cortex_cache.copyhash import ISA, copy_hash, copy_hash_py
    from cortex_cache.integrations.copiers import Copiers

    rng = np.random.default_rng(2)
    srcs = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(COPY_BATCH)]
    dsts = [np.ones(size, np.uint8) for _ in srcs]  # touched: no page faults in the timing
    n = max(3, (256 << 20) // (size * COPY_BATCH))
    copiers = Copiers(threads, "bench-copy-hash")
    res: dict[str, list[float]] = {"c": [], "python": []}
    try:
        for _ in range(rounds):
            for name, fn in (("c", copy_hash), ("python", copy_hash_py)):
                res[name].append(size * COPY_BATCH / _time(lambda: copiers.map(fn, dsts, srcs), n) / 1e9)
    finally:
        copiers.close()
    c, py = statistics.median(res["c"]), statistics.median(res["python"])
    return {"size": size, "threads": threads, "isa": ISA, "c_gbps": c, "python_gbps": py, "c_vs_python": c / py}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = ap.parse_args()
    rounds = 3 if args.quick else 7
    budget = (64 if args.quick else 256) << 20
    name = "bench"
    pool = Pool.create(name, "1G", block_size="64K")
    try:
        rows = [bench_size(pool, s, rounds, budget) for s in SIZES]
        batches = [bench_batch(pool, s, rounds) for s in (4 << 10, 64 << 10)]
        writes = bench_write_paths(pool, rounds)
        copy_rows = [bench_copy_hash(s, rounds, t) for s in (256 << 10, 1 << 20) for t in (1, 2)]
    finally:
        pool.close()
        Pool.unlink(name)
    print(f"{'size':>8} {'copy GB/s':>10} {'put GB/s':>9} {'put/copy':>9} {'get GB/s':>9} {'get/copy':>9} "
          f"{'get_into':>9} {'into/copy':>9} {'put ops/s':>10} {'get ops/s':>10}")
    for r in rows:
        print(f"{r['size'] >> 10:>6}Ki {r['copy_in_gbps']:>4.1f}/{r['copy_out_gbps']:<5.1f} "
              f"{r['put_gbps']:>9.1f} {r['put_vs_copy']:>9.2f} "
              f"{r['get_gbps']:>9.1f} {r['get_vs_copy']:>9.2f} {r['get_into_gbps']:>9.1f} "
              f"{r['get_into_vs_copy']:>9.2f} {r['put_ops']:>10.0f} {r['get_ops']:>10.0f}")
    print(f"\nbatches of {BATCH} keys, us per key (one call per key / one batched call):")
    for b in batches:
        print(f"{b['size'] >> 10:>6}Ki view {b['view_us_per_key']:.2f}/{b['view_many_us_per_key']:.2f} "
              f"get_into {b['get_into_us_per_key']:.2f}/{b['get_many_into_us_per_key']:.2f} "
              f"put {b['put_us_per_key']:.2f}/{b['put_many_us_per_key']:.2f}")
    print(f"\nthe C write path / core.py's: {BATCH} x 256 KiB reserve_write_many + commit_many "
          f"{writes['zero_copy_c_us_per_key']:.2f} / {writes['zero_copy_python_us_per_key']:.2f} us a key "
          f"({writes['zero_copy_c_vs_python']:.1f}x); 1 MiB put {writes['put_1mib_c_us']:.1f} / "
          f"{writes['put_1mib_python_us']:.1f} us ({writes['put_c_vs_python']:.2f}x)")
    print(f"\ncopy and checksum a batch of {COPY_BATCH} values, GB/s (C copy_hash, {copy_rows[0]['isa']} / "
          "the Python loop):")
    for c in copy_rows:
        print(f"{c['size'] >> 10:>6}Ki, {c['threads']} thread(s): {c['c_gbps']:.1f} / {c['python_gbps']:.1f} "
              f"({c['c_vs_python']:.2f}x)")
    small = rows[0]
    big = [r for r in rows if r["size"] >= 1 << 20]
    targets = {
        "4KiB put >= 100k ops/s": small["put_ops"] >= 100_000,
        "4KiB get >= 100k ops/s": small["get_ops"] >= 100_000,
        ">=1MiB put >= 0.7x copy": all(r["put_vs_copy"] >= 0.7 for r in big),
        ">=1MiB get_into >= 0.7x copy": all(r["get_into_vs_copy"] >= 0.7 for r in big),
        ">=1MiB get >= 0.7x copy": all(r["get_vs_copy"] >= 0.7 for r in big),
        "batched view <= 2 us/key (batches of 64)": all(b["view_many_us_per_key"] <= 2.0 for b in batches),
        "zero-copy put, 64 x 256 KiB reserve+commit <= 1.5 us/key": writes["zero_copy_c_us_per_key"] <= 1.5,
    }
    # Issue 17's line: the per-key cost of a batched view against a single-key view+release, same run.
    goals = [{"target": f"{b['size'] >> 10} KiB view_many+release_many <= 2 us/key, batches of {BATCH}",
              "need": "<= 2 us/key", "value": f"{b['view_many_us_per_key']:.2f} us/key",
              "baseline": f"view+release one key {b['view_us_per_key']:.2f} us/key",
              "ratio": b["view_many_vs_view"], "met": b["view_many_us_per_key"] <= 2.0} for b in batches]
    goals.append({"target": f"{BATCH} x 256 KiB reserve_write_many+commit_many <= 1.5 us/key",
                  "need": "<= 1.5 us/key", "value": f"{writes['zero_copy_c_us_per_key']:.2f} us/key",
                  "baseline": f"core.py's path {writes['zero_copy_python_us_per_key']:.2f} us/key",
                  "ratio": writes["zero_copy_c_vs_python"], "met": writes["zero_copy_c_us_per_key"] <= 1.5})
    for t, ok in targets.items():
        print(f"target {t}: {'met' if ok else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "batches": batches, "writes": writes, "copy_hash": copy_rows,
                                               "targets": targets, "goals": goals}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
