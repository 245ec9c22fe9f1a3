"""Huge pages for a pool's memory: do they make a fill, random gets or pinning cheaper here?

    python benchmarks/bench_hugepages.py [--gib 2] [--rounds 3] [--huge-dir DIR] [--json PATH]

A pool's memory is a tmpfs file (/dev/shm).  This kernel's
/sys/kernel/mm/transparent_hugepage/shmem_enabled decides whether /dev/shm
hands out 2 MiB pages (it is printed); a tmpfs mounted with
`huge=within_size` hands them out whatever /dev/shm does.  For each of the
two backings -- /dev/shm (the baseline) and such a mount (--huge-dir, or one
mounted here for the run when this runs as root) -- in alternating rounds,
on a new file of --gib GiB each round:

  first touch  copying the bytes into memory never written in this file
               (what a fill of a freshly created pool does): 8 MiB copies
               from an anonymous buffer already in memory.
  populate+copy  the same, with the file's pages allocated first by
               MADV_POPULATE_WRITE in a second thread, the copy following it
               one step behind (population and copy on two cores).
  touch, pages reused  first touch again, of a file made after the
               first two were removed: pages this backing freed a moment ago.
  rewrite      the same copy into the now-touched pages: memory's speed.
  4 KiB gets   200,000 reads of random 4 KiB blocks (numpy gathers: no
               Python per read), the TLB's share of a get.
  pin          mlock of the whole mapping, then munlock: the page walk that
               cudaHostRegister also does (it pins each page).

The 2 MiB pages are confirmed from /proc/self/smaps (FilePmdMapped or
ShmemPmdMapped of the mapping) and printed.  Ratios are the time a step takes with huge
pages over its time with 4 KiB pages: below 1.0 the huge pages win.  Guest memory that the host has not backed yet
costs more on first touch (see docs/performance.md): every round here runs
on memory this machine has touched before, as a long-running host's is.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

STEP = 8 << 20
MADV_POPULATE_WRITE = 23
GETS = 200_000
THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = _libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _address(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _pmd_mapped_kib(mm: mmap.mmap) -> int:
    """KiB of this mapping held in 2 MiB pages (smaps' *PmdMapped of its range)."""
    start = _address(mm)
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo = int(head.split("-")[0], 16)
                inside = lo <= start < int(head.split("-")[1], 16)
            elif inside and head in ("FilePmdMapped:", "ShmemPmdMapped:"):
                total += int(line.split()[1])
    return total


def _copy_in(dst: np.ndarray, src: np.ndarray, populate: mmap.mmap | None) -> float:
    t0 = time.perf_counter()
    ahead = None
    if populate is not None:
        done = [0]
        cond = threading.Condition()

        def run() -> None:  # allocate pages one step ahead of the copy, on the other core
            for off in range(0, len(dst), STEP):
                populate.madvise(MADV_POPULATE_WRITE, off, min(STEP, len(dst) - off))
                with cond:
                    done[0] = off + STEP
                    cond.notify()

        ahead = threading.Thread(target=run)
        ahead.start()
    for off in range(0, len(dst), STEP):
        if populate is not None:
            with cond:
                cond.wait_for(lambda off=off: done[0] > off)
        dst[off:off + STEP] = src[off:off + STEP]
    if ahead is not None:
        ahead.join()
    return time.perf_counter() - t0


def one_round(directory: str, nbytes: int, src: np.ndarray, rng: np.random.Generator) -> dict:
    out: dict = {}
    for populate in (False, True, None):
        fd, path = tempfile.mkstemp(dir=directory)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
            dst = np.frombuffer(mm, np.uint8)
            key = {False: "first touch", True: "populate+copy", None: "touch, pages reused"}[populate]
            out[key] = nbytes / _copy_in(dst, src, mm if populate else None) / 1e9
            if populate is not False:
                del dst
                mm.close()
                continue
            out["huge KiB"] = _pmd_mapped_kib(mm)
            out["rewrite"] = nbytes / _copy_in(dst, src, None) / 1e9
            rows = dst.reshape(-1, 4096)
            idx = rng.integers(0, len(rows), GETS)
            buf = np.empty((GETS // 20, 4096), np.uint8)
            t0 = time.perf_counter()
            for chunk in np.array_split(idx, 20):
                np.take(rows, chunk, axis=0, out=buf[:len(chunk)])
            out["4 KiB gets"] = (time.perf_counter() - t0) / GETS * 1e9
            addr = _address(mm)
            t0 = time.perf_counter()
            if _libc.mlock(addr, nbytes) != 0:
                out["pin"] = None
            else:
                out["pin"] = time.perf_counter() - t0
                _libc.munlock(addr, nbytes)
            del dst, rows
            mm.close()
        finally:
            os.close(fd)
            os.unlink(path)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="bytes per file (GiB, default 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--huge-dir", help="a tmpfs mounted with huge=within_size (default: mount one, as root)")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    nbytes = int(a.gib * (1 << 30)) // STEP * STEP
    print(f"{THP}: {Path(THP).read_text().strip() if Path(THP).exists() else 'absent'}")
    mounted = None
    huge_dir = a.huge_dir
    if huge_dir is None:
        if os.geteuid() != 0:
            print("give --huge-dir (a tmpfs mounted huge=within_size): mounting one needs root", file=sys.stderr)
            return 2
        mounted = tempfile.mkdtemp(prefix="cortex-huge-")
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=within_size,size={nbytes + (64 << 20)},mode=0700",
                        "tmpfs", mounted], check=True)
        huge_dir = mounted
    shm_dir = tempfile.mkdtemp(dir="/dev/shm", prefix="cortex-bench-")
    rng = np.random.default_rng(1)
    src = np.empty(nbytes, np.uint8)
    src[::4096] = 1  # touched: the source is memory, as a page-cached snapshot is
    rows: dict[str, list[dict]] = {"4 KiB pages (/dev/shm)": [], "2 MiB pages (huge=within_size)": []}
    try:
        for _ in range(a.rounds):
            for label, d in zip(rows, (shm_dir, huge_dir)):
                rows[label].append(one_round(d, nbytes, src, rng))
    finally:
        os.rmdir(shm_dir)
        if mounted is not None:
            subprocess.run(["umount", mounted], check=False)
            os.rmdir(mounted)
    fields = ("first touch", "populate+copy", "touch, pages reused", "rewrite", "4 KiB gets", "pin")
    units = {"first touch": "GB/s", "populate+copy": "GB/s", "touch, pages reused": "GB/s", "rewrite": "GB/s", "4 KiB gets": "ns/get", "pin": "s"}
    med = {label: {k: statistics.median(r[k] for r in rs if r[k] is not None) if any(r[k] is not None for r in rs)
                   else None for k in fields} for label, rs in rows.items()}
    base, huge = list(med)
    print(f"\n{a.gib:g} GiB per file, {a.rounds} rounds (median); ratio = time with 2 MiB pages / time with 4 KiB pages\n")
    print(f"{'':20}{base:>26}{huge:>34}{'ratio':>9}")
    for k in fields:
        b, h = med[base][k], med[huge][k]
        faster_is_larger = units[k] == "GB/s"
        ratio = "-" if not (b and h) else f"{(b / h if faster_is_larger else h / b):.2f}x"
        fmt = (lambda v, k=k: "-" if v is None else f"{v:.3f} {units[k]}")
        print(f"{k:20}{fmt(b):>26}{fmt(h):>34}{ratio:>9}")
    for label, rs in rows.items():
        print(f"{label}: {statistics.median(r['huge KiB'] for r in rs) / 1024:.0f} MiB mapped in 2 MiB pages")
    if a.json:
        Path(a.json).write_text(json.dumps({"gib": a.gib, "rounds": rows, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
