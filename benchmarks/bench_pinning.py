#!/usr/bin/env python
"""Pinning a pool in pieces, and what it costs an attach (issue 28 item 4).

    python benchmarks/bench_pinning.py [--quick] [--gib N] [--rounds N] [--attach-gib N] [--piece SIZE]
                                       [--json PATH]

Two parts, each against a baseline measured in the same run, alternating:

  attach   a pool of --attach-gib (default 16) GiB made without reserving its
           memory (nothing is allocated): Pool.open alone, against Pool.open
           and the background pinning started (gpu.pin_memory(background=True)
           where CUDA is, else pinning.mlock(background=True)); then, untimed
           as a pair, close() while that pinning runs (it waits for the piece
           under way: timed on its own).
  pin      a pool of --gib (default 2, --quick 1) GiB, its memory reserved, on
           one handle whose page tables are dropped (MADV_DONTNEED) before
           each run, so every run maps every page afresh:
             memset     the baseline: numpy fills the whole data region
             touch      one byte written per page
             populate   Pool.populate (MADV_POPULATE_WRITE in 32 MiB steps)
             mlock      pinning.mlock in --piece (default 1G) pieces, waited
             cuda       gpu.pin_memory in pieces, waited (only where CUDA is)
           each as seconds, seconds per GiB and a ratio to memset.  The pool
           is unlinked as soon as it is made: its memory goes with this
           process, however it ends.

The pin part refuses a size the host cannot spare (MemAvailable below size +
4 GiB).  mlock past RLIMIT_MEMLOCK without CAP_IPC_LOCK is reported as refused.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import resource
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["CORTEX_CACHE_SHM_PREFIX"] = f"ccbench-pin-{os.getpid()}."


from cortex_cache import Pool, pinning  # noqa: E402
from cortex_cache.units import parse_size  # noqa: E402

GiB = 1 << 30
MARGIN = 4 * GiB  # what the pin part leaves the host, at least


def cuda() -> Any:
    """torch with CUDA initialised (outside every timing), or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    return torch


def start_pinning(pool: Pool, torch: Any, piece: int, background: bool) -> pinning.Pinning:
    if torch is not None:
        from cortex_cache import gpu

        return gpu.pin_memory(pool, background=background, piece=piece)
    return pinning.mlock(pool, background=background, piece=piece)


def ms_stats(ts: list[float]) -> dict:
    return {"median_ms": round(statistics.median(ts) * 1e3, 3), "min_ms": round(min(ts) * 1e3, 3),
            "max_ms": round(max(ts) * 1e3, 3)}


def bench_attach(gib: int, piece: int, rounds: int, torch: Any) -> dict:
    name = "attach"
    Pool.create(name, gib * GiB, reserve=False).close()
    try:
        plain, started, closing = [], [], []
        for _ in range(rounds):
            t = time.perf_counter()
            p = Pool.open(name, multi_threaded=True)
            plain.append(time.perf_counter() - t)
            p.close()
            t = time.perf_counter()
            p = Pool.open(name, multi_threaded=True)
            reg = start_pinning(p, torch, piece, background=True)
            started.append(time.perf_counter() - t)
            t = time.perf_counter()
            p.close()  # stops after the piece under way and unpins what was pinned
            closing.append(time.perf_counter() - t)
            assert reg.closed
    finally:
        Pool.unlink(name)
    return {"pool_gib": gib, "open": ms_stats(plain), "open_and_start": ms_stats(started),
            "close_while_pinning": ms_stats(closing),
            "start_vs_open": round(statistics.median(started) / statistics.median(plain), 2)}


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def bench_pin(gib: int, piece: int, rounds: int, torch: Any) -> dict:
    nbytes = gib * GiB
    if mem_available() < nbytes + MARGIN:
        sys.exit(f"bench_pinning: {gib} GiB would leave this host less than {MARGIN // GiB} GiB "
                 f"(MemAvailable {mem_available() / GiB:.1f} GiB): give a smaller --gib")
    pool = Pool.create("pin", nbytes, prefault=False)  # allocated, not mapped here
    Pool.unlink("pin")  # the mapping keeps it: nothing is left behind if this process dies
    try:
        return _bench_pin(pool, piece, rounds, torch)
    finally:
        pool.close()


def _bench_pin(pool: Pool, piece: int, rounds: int, torch: Any) -> dict:
    off, n = pool.geometry.data_off, pool.geometry.data_size
    mm = pool.core.seg.mm

    def fresh() -> None:  # drop this process's page tables over the data region (the pages stay)
        mm.madvise(mmap.MADV_DONTNEED, off, n)

    def memset() -> None:
        a = pool.core.value_array(off, n)
        a.fill(0)
        del a

    def touch() -> None:
        a = pool.core.value_array(off, n)
        a[:: mmap.PAGESIZE] = 0
        del a

    refused: dict[str, str] = {}

    def pinner(kind: str) -> Callable[[], Any]:
        def run() -> Any:
            try:
                return start_pinning(pool, torch if kind == "cuda" else None, piece, background=False)
            except Exception as e:
                refused[kind] = str(e)
                raise
        return run

    cases: dict[str, Callable[[], Any]] = {"memset": memset, "touch": touch, "populate": lambda: pool.populate(),
                                           "mlock": pinner("mlock")}
    if torch is not None:
        cases["cuda"] = pinner("cuda")
    times: dict[str, list[float]] = {k: [] for k in cases}
    unpins: list[float] = []
    for _ in range(rounds):
        for kind, fn in cases.items():
            if kind in refused:
                continue
            fresh()
            t = time.perf_counter()
            try:
                got = fn()
            except Exception:
                continue
            times[kind].append(time.perf_counter() - t)
            if isinstance(got, pinning.Pinning):
                t = time.perf_counter()
                got.close()  # unpins every piece
                unpins.append(time.perf_counter() - t)
    base = statistics.median(times["memset"])
    gib = n / GiB
    out: dict[str, Any] = {"gib": round(gib, 3), "piece_bytes": pinning.piece_size(pool, piece), "rows": {}}
    for kind, ts in times.items():
        if not ts:
            out["rows"][kind] = {"refused": refused.get(kind, "not measured")}
            continue
        med = statistics.median(ts)
        out["rows"][kind] = {"s": round(med, 3), "min_s": round(min(ts), 3), "max_s": round(max(ts), 3),
                             "s_per_gib": round(med / gib, 4), "vs_memset": round(med / base, 2)}
    if unpins:
        out["unpin_s"] = round(statistics.median(unpins), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 GiB, fewer rounds")
    ap.add_argument("--gib", type=int, help="size of the pin part's pool (default 2, --quick 1)")
    ap.add_argument("--attach-gib", type=int, default=16, help="size of the attach part's pool (default 16)")
    ap.add_argument("--piece", default="1G", help="bytes a piece (default 1G)")
    ap.add_argument("--rounds", type=int, help="rounds of the pin part (default 3, --quick 2)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks unlink what was made
    gib = args.gib or (1 if args.quick else 2)
    piece = parse_size(args.piece)
    torch = cuda()
    backend = "cudaHostRegister" if torch is not None else "mlock"
    attach = bench_attach(args.attach_gib, piece, 5 if args.quick else 15, torch)
    pin = bench_pin(gib, piece, args.rounds or (2 if args.quick else 3), torch)

    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    print(f"bench_pinning: {platform.python_version()}, {os.cpu_count()} CPUs, background pinning by {backend}, "
          f"pieces of {args.piece}, RLIMIT_MEMLOCK {'unlimited' if memlock < 0 else memlock}, euid {os.geteuid()}")
    a = attach
    print(f"attach, {a['pool_gib']} GiB pool: open {a['open']['median_ms']:.3f} ms; open + start pinning "
          f"{a['open_and_start']['median_ms']:.3f} ms ({a['start_vs_open']:.2f}x); close while pinning "
          f"{a['close_while_pinning']['median_ms']:.1f} ms (max {a['close_while_pinning']['max_ms']:.1f})")
    print(f"pin, {pin['gib']} GiB, each over fresh page tables:")
    for kind, r in pin["rows"].items():
        if "refused" in r:
            print(f"  {kind:<9} refused: {r['refused']}")
        else:
            print(f"  {kind:<9} {r['s']:7.3f} s  ({r['s_per_gib']:.3f} s/GiB, {r['vs_memset']:.2f}x memset)")
    if "unpin_s" in pin:
        print(f"  unpinning it all (close): {pin['unpin_s']:.3f} s")
    if args.json:
        doc = {"benchmark": "pinning", "python": platform.python_version(), "cpus": os.cpu_count(),
               "backend": backend, "rlimit_memlock": memlock, "euid": os.geteuid(), "attach": attach, "pin": pin}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
