"""How many entries fit in a 64 MiB pool, against the ideal of size / value.

    python benchmarks/bench_capacity.py [--quick] [--json PATH]

For values of 4 KiB, 64 KiB, 256 KiB, 1 MiB and 16 MiB, at block sizes of
4 KiB and 64 KiB: create a pool whose data region is 64 MiB, put distinct
keys (short str keys, as a KV connector's) until the first eviction, and count
the entries held then.  The baseline is the ideal, 64 MiB / value size, and the
ratio is entries held / ideal.  A value smaller than a block still takes a
whole block, so its ideal at that block size is the block count: those rows
show the waste of a block size chosen too large (what `cortex cache status`
reports as allocated against value bytes).  Target (issue [T2 2/6]): >= 0.98 of
ideal for every power-of-two value at least one block long.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("CORTEX_CACHE_SHM_PREFIX", f"ccbench-{os.getpid()}.")

from cortex_cache import Pool  # noqa: E402

POOL = 64 << 20
VALUES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20]
BLOCKS = [4 << 10, 64 << 10]


def entries_that_fit(value: int, block: int) -> int:
    name = f"cap-{value}-{block}"
    p = Pool.create(name, POOL, block_size=block, reserve=False)
    try:
        v = bytes(value)
        for i in range(POOL // value + 2):
            p.put(f"chunk-{i:08d}", v)
            if p.stats()["evictions"]:
                return i  # the i-th put (counting from 0) pushed an entry out: i fitted
        return len(p)
    finally:
        p.close()
        Pool.unlink(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same (it takes a few seconds)")
    ap.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = ap.parse_args()
    rows = []
    print(f"{'value':>8} {'block':>6} {'entries':>8} {'ideal':>6} {'ratio':>6}")
    for block in BLOCKS:
        for value in VALUES:
            n = entries_that_fit(value, block)
            ideal = POOL // value
            rows.append({"value": value, "block": block, "entries": n, "ideal": ideal, "ratio": n / ideal})
            print(f"{value >> 10:>6}Ki {block >> 10:>4}Ki {n:>8} {ideal:>6} {n / ideal:>6.3f}")
    targets = {"power-of-two values >= one block hold >= 0.98 of ideal":
               all(r["ratio"] >= 0.98 for r in rows if r["value"] >= r["block"])}
    for t, ok in targets.items():
        print(f"target {t}: {'met' if ok else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "targets": targets}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
