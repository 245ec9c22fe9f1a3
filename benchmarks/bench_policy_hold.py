"""How long the policy state's capture and apply hold the pool lock, at a million entries.

    python benchmarks/bench_policy_hold.py [--entries 1000000] [--policies lru,lfu,s3fifo,arc,auto] [--json PATH]

For each policy: a pool of N entries of 64 bytes (64-byte blocks) takes 1.2 N puts (so that it evicts,
and the queue policies have ghosts) and a read of every tenth key; then, beside the baseline of an empty
lock hold (`core.locked(lambda: None)`):

  capture   persist's capture of the policy state (snapshot.policy_blob): its longest lock hold and the
            total of its holds, in ms (every writer waits out each hold)
  apply     policy_state.apply of that blob over the same entries (what the lock hold that ends a fill of
            N entries adds): its hold, in ms, alone and (prepared) after policy_state.prepare, as the fill
            does it
  blob      the blob's size

The machine is shared (other helpers' tests run beside this): figures taken under load say so in the
header line; rerun on a quiet machine for the record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VALUE = 64


def _timed_holds(core, fn):
    """Run fn (which takes the lock through core.locked, once or more); (result, the holds' lengths in s)."""
    holds: list[float] = []
    plain = core.locked

    def locked(f, *args):
        def timed(*a):
            t0 = time.perf_counter()
            try:
                return f(*a)
            finally:
                holds.append(time.perf_counter() - t0)

        return plain(timed, *args)

    core.locked = locked
    try:
        return fn(), holds
    finally:
        del core.locked


def one_policy(policy: str, n: int) -> dict:
    from cortex_cache import Pool, policy_state, snapshot

    name = f"bhold{os.getpid()}-{policy}"
    pool = Pool.create(name, n * VALUE + (16 << 20), block_size=VALUE, max_entries=n, policy=policy)
    try:
        value = b"v" * VALUE
        keys = [b"k%09d" % i for i in range(int(1.2 * n))]
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            pool.put(k, value)
            if i % 10 == 0 and i > n // 2:
                pool.get(keys[i - n // 2])
        fill_s = time.perf_counter() - t0
        core = pool.core
        empty = min(_timed_holds(core, lambda: core.locked(lambda: None))[1] for _ in range(5))
        best_capture = None
        for _ in range(3):
            blob, holds = _timed_holds(core, lambda: snapshot.policy_blob(core))
            if best_capture is None or sum(holds) < sum(best_capture):
                best_capture = holds
        best_apply = best_ready = None
        for _ in range(3):
            report, holds = _timed_holds(core, lambda: core.locked(policy_state.apply, core, blob))
            assert report["applied"], report
            if best_apply is None or holds[0] < best_apply:
                best_apply = holds[0]
            ready = policy_state.prepare(core, blob)
            report, holds = _timed_holds(core, lambda: core.locked(policy_state.apply, core, blob, ready))
            assert report["applied"], report
            if best_ready is None or holds[0] < best_ready:
                best_ready = holds[0]
        return {"policy": policy, "entries": pool.stats()["entries"], "populate_s": round(fill_s, 1),
                "empty_hold_ms": round(empty[0] * 1e3, 4), "capture_holds": len(best_capture),
                "capture_max_ms": round(max(best_capture) * 1e3, 2), "capture_total_ms": round(sum(best_capture) * 1e3, 2),
                "apply_ms": round(best_apply * 1e3, 2), "apply_prepared_ms": round(best_ready * 1e3, 2),
                "blob_bytes": len(blob)}
    finally:
        pool.close()
        Pool.unlink(name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--policies", default="lru,lfu,s3fifo,arc,auto")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"policy state lock holds, {args.entries} entries, load {load:.1f} on {os.cpu_count()} cores"
          + (" (under load: rerun on a quiet machine for the record)" if load > 1.0 else ""))
    print(f"{'policy':8} {'capture max ms':>15} {'capture total ms':>17} {'holds':>6} {'apply ms':>9} "
          f"{'prepared ms':>12} {'blob MB':>8} {'empty hold ms':>14}")
    rows = []
    for policy in args.policies.split(","):
        row = one_policy(policy, args.entries)
        rows.append(row)
        print(f"{policy:8} {row['capture_max_ms']:15.2f} {row['capture_total_ms']:17.2f} {row['capture_holds']:6d} "
              f"{row['apply_ms']:9.2f} {row['apply_prepared_ms']:12.2f} {row['blob_bytes'] / 1e6:8.2f} {row['empty_hold_ms']:14.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
