"""Restart at a million entries: persist, publish, attach and fill, each beside its baseline.

    python benchmarks/bench_boot.py [--entries 10000,100000] [--gib 1,4,8] [--dir DIR] [--json PATH]

Rows of two kinds: `--entries N` pools of N values of 2 KiB (4 KiB blocks;
default 10k and 100k, add 1000000 for the issue's row) and `--gib G` pools of G
GiB, ~90% full of 1 MiB values (64 KiB blocks; none by default).  For each:
the pool is filled, its newest 5% read, then

  persist      a full persist into the snapshot directory, beside a plain write
               and fsync of the same value bytes into one file (1 MiB writes):
               the ratio is the cost of persisting over the cost of its bytes
               (issue 39 item 4: <= 1.5)
  incremental  1% of the values replaced, then a persist: its time over the
               full one's (target <= 0.1) and the bytes it wrote
  returns      the pool deleted (a reboot), the snapshot's files dropped from
               the page cache (fsync + posix_fadvise DONTNEED), then
               `cortex cache restore NAME --background` run as a new process:
               seconds from its start to its exit, Python's start included
               (target <= 1 s)
  open, hit    another process, started once the command returned: its
               Pool.open of the filling pool, then its first get of the most
               recently used entry (<= 50 ms; <= 1 s after the command's start),
               and what opening cost it in memory (RSS growth, <= 16 MiB)
  fill         the fill's own time (the header's fill_started to fill_ended),
               beside a cold read of the snapshot's files (manifest and packs,
               dropped from the cache first), printed as read / fill: the
               fill's speed as a share of the disk's (target >= 0.9)
  python fill  with --python-fill: the same restore again with the C fast path
               turned off (CORTEX_CACHE_PURE_PYTHON=1 in the restoring process),
               so the fill takes fill.py's Python batches: the baseline of the
               fill by columns in C (fill_columns.py), measured in the same run;
               then the C fill once more, so that the two compared both get
               memory a pool just gave back (the first fill's may be new to the
               VM: on huge pages that alone doubled it)

The machine is shared (other helpers' tests run beside this): figures taken
under load say so in the header line; rerun on a quiet machine for the record.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_persist import drop_from_cache, pick_parent, plain_read  # noqa: E402

SMALL, SMALL_BLOCK = 2048, 4096
LARGE, LARGE_BLOCK = 1 << 20, 64 << 10

PROBE = """
import json, os, resource, sys, time
t0 = time.perf_counter()
from cortex_cache import Pool
name, mru = sys.argv[1], sys.argv[2]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
t = time.perf_counter()
q = Pool.open(name)
opened = time.perf_counter() - t
grew = rss() - before
t = time.perf_counter()
got = q.get(mru)
hit = time.perf_counter() - t
filling = q.stats()["fill"]
q.close()
print(json.dumps({"open": opened, "hit": hit, "rss": grew, "got": got is not None,
                  "filling": bool(filling) and filling["state"] == "filling"}))
"""


def drop(files: list[Path]) -> None:
    for p in files:
        drop_from_cache(p)


def plain_write(path: Path, nbytes: int, chunk: memoryview) -> float:
    """Seconds to write `nbytes` into a new file in 1 MiB writes and fsync it."""
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(path)
    return time.perf_counter() - t


def wait_fill(name: str) -> tuple[float, str]:
    """Wait for pool `name`'s fill to end: (its seconds by the header, its end state)."""
    from cortex_cache import Pool

    with Pool.open(name) as q:
        deadline = time.perf_counter() + 3600
        while (q.stats()["fill"] or {}).get("state") == "filling" and time.perf_counter() < deadline:
            time.sleep(0.05)
        st = q.stats()["fill"]
        return (st["ended"] or time.time()) - st["started"], st["state"]


def refill(name: str, files: list[Path], python: bool) -> float:
    """The fill of the same snapshot again, the files dropped from the cache first; with `python` by fill.py's
    Python batches (the C fast path off in the restorer)."""
    from cortex_cache import Pool

    drop(files)
    env = {**os.environ, "CORTEX_CACHE_PURE_PYTHON": "1" if python else "0"}
    done = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", "restore", name, "--background"],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"restore failed ({done.returncode}): {done.stderr}")
    took, _state = wait_fill(name)
    Pool.unlink(name)
    return took


def one_row(label: str, n: int, value: int, block: int, workdir: Path, baseline: bool = False) -> dict:
    from cortex_cache import Pool
    from cortex_cache.persist import persist

    name = f"bboot{os.getpid()}"
    snaps = workdir / name
    os.environ["CORTEX_CACHE_SNAPSHOT_DIR"] = str(snaps)
    size = n * (-(-value // block) * block) + (64 << 20)
    rng = np.random.default_rng(0)
    ring = rng.integers(0, 256, (1 << 20) + value, dtype=np.uint8).tobytes()
    keys = [f"kv-{i:09d}-layer-block" for i in range(n)]
    row: dict = {"row": label, "entries": n, "value": value}
    pool = Pool.create(name, size, block_size=block, max_entries=n + 1024)
    try:
        for i, k in enumerate(keys):
            off = (i * 4099) % (1 << 20)
            pool.put(k, ring[off : off + value])
        for k in keys[-max(1, n // 20):]:
            pool.get(k)
        mru = keys[-1]
        full = persist(pool, full=True)
        row["persist_s"] = full.seconds
        row["plain_write_s"] = plain_write(workdir / "plain", full.bytes, memoryview(ring)[: 1 << 20])
        for i in range(0, n, 100):
            off = (i * 7919) % (1 << 20)
            pool.put(keys[i], ring[off : off + value])
        inc = persist(pool)
        row["incremental_s"] = inc.seconds
        row["incremental_written"] = inc.written
    finally:
        pool.close()
        Pool.unlink(name)
    files = sorted(p for p in snaps.iterdir() if p.is_file() and not p.is_symlink() and not p.name.startswith("."))
    drop(files)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", "restore", name, "--background"],
                          capture_output=True, text=True)
    row["returns_s"] = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"restore failed ({done.returncode}): {done.stderr}")
    probe = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE), name, mru], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"probe failed: {probe.stderr}")
    got = json.loads(probe.stdout)
    row.update(open_s=got["open"], hit_s=got["hit"], open_rss=got["rss"], hit_ok=got["got"], probe_filling=got["filling"])
    row["first_hit_after_s"] = time.perf_counter() - t0  # a bound: the probe's own start is in it
    row["fill_s"], row["fill_state"] = wait_fill(name)
    Pool.unlink(name)
    if baseline:  # the first fill gets memory the pool never had; the next two, memory just given back
        row["python_fill_s"] = refill(name, files, python=True)
        row["fill_again_s"] = refill(name, files, python=False)
    manifest = [p for p in files if p.suffix == ".ccsnap"]
    used = [manifest[-1], *[p for p in files if p.suffix == ".ccpack"]]
    drop(used)
    buf = memoryview(bytearray(64 << 20))
    row["cold_read_s"] = sum(plain_read(p, buf) for p in used)
    shutil.rmtree(snaps, ignore_errors=True)
    return row


def show(row: dict) -> None:
    print(f"{row['row']:>10}  persist {row['persist_s']:7.3f}s / write+fsync {row['plain_write_s']:7.3f}s = "
          f"{row['persist_s'] / row['plain_write_s']:5.2f}x   incremental {row['incremental_s']:6.3f}s = "
          f"{row['incremental_s'] / row['persist_s']:5.2f}x of full")
    print(f"{'':>10}  restore --background returns {row['returns_s']:6.3f}s   another process: open "
          f"{row['open_s'] * 1e3:6.1f} ms (+{row['open_rss'] / 2**20:5.1f} MiB), first hit {row['hit_s'] * 1e3:6.1f} ms "
          f"({'hit' if row['hit_ok'] else 'MISS'}; {row['first_hit_after_s']:5.2f}s after the command began)")
    print(f"{'':>10}  fill {row['fill_s']:7.3f}s vs cold read {row['cold_read_s']:7.3f}s: read/fill "
          f"{row['cold_read_s'] / max(row['fill_s'], 1e-9):5.2f}  ({row['fill_state']})")
    if "python_fill_s" in row:
        print(f"{'':>10}  python fill {row['python_fill_s']:7.3f}s, then the C fill again {row['fill_again_s']:7.3f}s: "
              f"{row['fill_again_s'] / row['python_fill_s']:5.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", default="10000,100000", help="rows of N values of 2 KiB, comma separated ('' none)")
    ap.add_argument("--gib", default="", help="rows of G GiB of 1 MiB values, comma separated")
    ap.add_argument("--dir", default=None, help="where the snapshots go (a disk, not tmpfs)")
    ap.add_argument("--json", default=None, help="write the rows as JSON here too")
    ap.add_argument("--python-fill", action="store_true", help="also time the fill with the C fast path off")
    a = ap.parse_args(argv)
    rows = [(f"{int(n):,}", int(n), SMALL, SMALL_BLOCK) for n in a.entries.split(",") if n]
    for g in (x for x in a.gib.split(",") if x):
        gib = float(g)
        rows.append((f"{g} GiB", int(gib * (1 << 30) * 0.9) // (LARGE + LARGE_BLOCK), LARGE, LARGE_BLOCK))
    parent, fs = pick_parent(a.dir, 0)
    load = os.getloadavg()[0]
    print(f"bench_boot: {os.cpu_count()} CPUs, load {load:.1f} at the start{' (figures under load)' if load > 1 else ''}; "
          f"snapshots on {fs}")
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-boot-", dir=parent) as d:
        for label, n, value, block in rows:
            row = one_row(label, n, value, block, Path(d), a.python_fill)
            show(row)
            out.append(row)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
