"""Readers in several processes at once: aggregate get throughput, 1 vs 2 processes.

    python benchmarks/bench_scaling.py [--quick] [--json PATH]

Each reader process opens the pool by name and calls get_into on 16 keys in
turn.  The figure is bytes read by all readers divided by the slowest
reader's time, measured for one reader and for two in the same run; the
ratio says how well readers overlap (their copies run outside the lock for
values over 256 KiB; small values are copied inside it, so readers of small
values take turns).  Issue [7/9] targets 2 readers >= 1.6x one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
PREFIX = f"ccbench-scale-{os.getpid()}."
os.environ.setdefault("CORTEX_CACHE_SHM_PREFIX", PREFIX)

from cortex_cache import Pool  # noqa: E402

KEYS = 16


def _reader(name: str, size: int, n: int, start, q) -> None:
    with Pool.open(name) as p:
        out = bytearray(size)
        start.wait()
        t = time.perf_counter()
        for i in range(n):
            p.get_into(f"k{i % KEYS}", out)
        q.put(time.perf_counter() - t)


def run(name: str, size: int, n: int, procs: int) -> float:
    ctx = mp.get_context("spawn")
    q, start = ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=_reader, args=(name, size, n, start, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    start.set()
    times = [q.get(timeout=300) for _ in ps]
    for p in ps:
        p.join()
    return procs * n * size / max(times) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    rounds = 2 if args.quick else 3
    sizes = [(4 << 10, 20_000 if args.quick else 60_000), (1 << 20, 500 if args.quick else 2_000)]
    name = "scale"
    pool = Pool.create(name, "256M")
    rows = []
    try:
        for size, n in sizes:
            for i in range(KEYS):
                pool.put(f"k{i}", os.urandom(size))
            one = [run(name, size, n, 1) for _ in range(rounds)]
            two = [run(name, size, n, 2) for _ in range(rounds)]
            rows.append({"size": size, "one_gbps": statistics.median(one), "two_gbps": statistics.median(two),
                         "ratio": statistics.median(two) / statistics.median(one)})
    finally:
        pool.close()
        Pool.unlink(name)
    print(f"{'value':>8} {'1 reader GB/s':>14} {'2 readers GB/s':>15} {'2/1':>6}")
    for r in rows:
        print(f"{r['size'] >> 10:>6}Ki {r['one_gbps']:>14.2f} {r['two_gbps']:>15.2f} {r['ratio']:>6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
