"""Disk tier: hit rate with and without it, and spill/promote speed against the disk's own.

    python benchmarks/bench_tier.py [--quick] [--dir DIR] [--json PATH]

Hit rate.  Two multi-turn chat workloads are replayed as chunk keys against a
pool of M chunks in memory, once memory-only and once with a disk tier of 4x
the memory (write-back), at the same memory size:

  chat       generated here (seeded): 16 system prompts of 2-8 chunks shared
             by 20,000 sessions; a session's history grows by 1-3 chunks a
             turn, and after 8-40 chunks the user starts a new conversation;
             which session speaks next is Zipf(0.8) by popularity.
             M = 1,000 chunks.  30,000 requests (--quick 6,000).
  mooncake   benchmarks/traces/mooncake_synthetic_trace.jsonl: real multi-turn
             conversations (Mooncake, FAST'25), 512-token blocks. M = 2,000.
             (or the file CORTEX_BENCH_MOONCAKE_TRACE names)

Each request looks up its chunks in order and stops at the first miss (a
prefix match, as an inference engine reuses KV); then every chunk of the
request is stored.  Hit rate = matched chunks / all chunks.  Values are
4,000 bytes (one 4 KiB block and one 4 KiB disk record each), since the hit
rate does not depend on the chunk size.  Beside each: an exact LRU of M and
of 5M chunks (memory + disk), computed in the same run.

Speed.  A pool of P MiB in memory (512; --quick 128) with 1 MiB values:
  spill      put 2P MiB of new values into the full pool: every put evicts
             one entry, which the putting process writes to the tier; then
             fsync the tier files.  GB/s = spilled bytes / (puts + fsync).
  write      plain write + fsync of as many bytes to a new file, 1 MiB writes.
  promote    memory emptied (untimed), tier files dropped from the page cache
             (fsync + fadvise DONTNEED); get P MiB of spilled entries in the
             order they were spilled: each is read, checked and copied into
             memory.  GB/s = promoted bytes / seconds.
  read       plain read of as many bytes of a dropped file, 1 MiB reads.
Medians over rounds (3; --quick 2) with min-max, pairs interleaved with
alternating order.  Target: spill and promote >= 0.6x the plain figures.

Lock hold.  A spill is copied aside under the pool lock and written after
it (disktier.py).  64 KiB puts into a full 64 MiB pool, memory only and
with a tier (every put then spills one victim): the put's latency, and the
get latency of a hot 4 KiB key read in a loop by another process meanwhile;
with the tier, the reader's tail should stay where it is without one.
The disk is virtual: "dropped" pages may still be cached by the host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_persist import _free, drop_from_cache, pick_parent, plain_read, plain_write  # noqa: E402

# CORTEX_BENCH_MOONCAKE_TRACE (as for bench_sglang.py) names another copy of the trace.
MOONCAKE = Path(os.environ.get("CORTEX_BENCH_MOONCAKE_TRACE")
                or Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl")
CHUNK_VALUE = 4000
TARGET = 0.6
MIB = 1 << 20


# ---------------------------------------------------------------- workloads


def chat_trace(requests: int, seed: int = 7, n_sessions: int = 20000, zipf: float = 0.8) -> list[list[str]]:
    """Multi-turn chat as chunk keys: shared system prompts, growing histories, Zipf sessions."""
    rng = np.random.default_rng(seed)
    n_sys = 16
    sys_len = rng.integers(2, 9, n_sys)
    session_sys = rng.integers(0, n_sys, n_sessions)
    history = np.zeros(n_sessions, dtype=np.int64)
    weights = 1.0 / np.arange(1, n_sessions + 1) ** zipf
    who = rng.choice(n_sessions, size=requests, p=weights / weights.sum())
    conversation = np.arange(n_sessions)  # a session's current conversation
    limit = rng.integers(8, 41, n_sessions)  # chunks before the user starts a new conversation
    out = []
    for u in who:
        s = int(session_sys[u])
        history[u] += int(rng.integers(1, 4))  # this turn's user message and the last reply
        if history[u] > limit[u]:
            conversation[u] += n_sessions
            history[u], limit[u] = int(rng.integers(1, 4)), int(rng.integers(8, 41))
        # Keys chain on the prefix: a history chunk belongs to its conversation and position.
        keys = [f"sys{s}/{i}" for i in range(int(sys_len[s]))]
        keys += [f"sys{s}/c{conversation[u]}/{i}" for i in range(int(history[u]))]
        out.append(keys)
    return out


def mooncake_trace() -> list[list[str]] | None:
    if not MOONCAKE.exists():
        return None
    with open(MOONCAKE) as f:
        return [[f"b{h}" for h in json.loads(line)["hash_ids"]] for line in f]


def lru_hit_rate(trace: list[list[str]], capacity: int) -> float:
    cache: OrderedDict[str, None] = OrderedDict()
    hit = total = 0
    for keys in trace:
        total += len(keys)
        for k in keys:
            if k not in cache:
                break
            cache.move_to_end(k)
            hit += 1
        for k in keys:
            cache[k] = None
            cache.move_to_end(k)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hit / total


def pool_hit_rate(trace: list[list[str]], chunks: int, disk: Path | None) -> tuple[float, dict]:
    from cortex_cache import Pool
    from cortex_cache.disklog import DiskLog

    name = f"hit{os.getpid()}"
    kw = {"disk_path": disk, "disk_size": 4 * chunks * 4096} if disk else {}
    p = Pool.create(name, chunks * 4096, block_size=4096, **kw)
    value = bytes(CHUNK_VALUE)
    hit = total = 0
    try:
        for keys in trace:
            total += len(keys)
            for k in keys:
                if p.get(k) is None:
                    break
                hit += 1
            for k in keys:  # store every chunk of the request that is in neither tier
                if k not in p:
                    p.put(k, value)
        st = p.stats()
    finally:
        p.close()
        Pool.unlink(name)
        if disk:
            DiskLog.destroy(disk)
    return hit / total, st


# ---------------------------------------------------------------- speed


def speed_round(workdir: Path, pool_mib: int, ring: memoryview, order: int) -> dict:
    from cortex_cache import Pool
    from cortex_cache.disklog import DiskLog

    name = f"spd{os.getpid()}"
    tier = workdir / "tier"
    n_new = 2 * pool_mib
    value_len = MIB - 4096  # value + key + record header fit one aligned MiB on disk
    res: dict = {}
    plain = workdir / "plain"

    def plain_pair() -> None:
        nbytes = n_new * MIB
        res["write_s"] = plain_write(plain, nbytes, ring)
        res["read_resident"] = drop_from_cache(plain)
        t = plain_read_bytes(plain, pool_mib * MIB, ring)
        res["read_s"] = t
        plain.unlink()

    if order % 2:
        plain_pair()
    p = Pool.create(name, pool_mib * MIB, block_size=MIB, disk_path=tier, disk_size=4 * pool_mib * MIB)
    try:
        src = np.frombuffer(ring, np.uint8)
        for i in range(pool_mib):  # fill memory (untimed)
            p.put(f"v{i}", src[(i * value_len) % (len(src) - value_len):][:value_len])
        t = time.perf_counter()
        for i in range(pool_mib, pool_mib + n_new):
            p.put(f"v{i}", src[(i * value_len) % (len(src) - value_len):][:value_len])
        spilled_bytes = p.stats()["disk"]["value_bytes"]
        for f in sorted(tier.glob("tier-*.log")):
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        res["spill_s"] = time.perf_counter() - t
        res["spill_bytes"] = spilled_bytes
        on_disk = [k for k in p.keys(tier="disk")][:pool_mib]
        p.evict(keys=p.keys(), tier="all")  # memory emptied, nothing spilled (untimed)
        res["promote_resident"] = max(drop_from_cache(f) for f in tier.glob("tier-*.log"))
        t = time.perf_counter()
        got = 0
        for k in on_disk:
            v = p.get(k)
            got += len(v)
        res["promote_s"] = time.perf_counter() - t
        res["promote_bytes"] = got
        d = p.stats()["disk"]
        assert d["corrupt"] == 0 and d["errors"] == 0 and d["promotions"] == len(on_disk)
    finally:
        p.close()
        Pool.unlink(name)
        DiskLog.destroy(tier)
    if not order % 2:
        plain_pair()
    res["plain_write_bytes"] = n_new * MIB
    res["plain_read_bytes"] = pool_mib * MIB
    return res


def plain_read_bytes(path: Path, nbytes: int, ring: memoryview) -> float:
    """plain_read of the first `nbytes` of a file (a copy of that length, read whole)."""
    part = path.with_suffix(".part")
    with open(path, "rb") as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, MIB)
        dst.truncate(nbytes)
    drop_from_cache(part)
    t = plain_read(part, ring)
    part.unlink()
    return t


READER = """
import json, sys, time
from cortex_cache import Pool
p = Pool.open(sys.argv[1])
lat = []
print("ready", flush=True)
while not p.get("stop"):
    a = time.perf_counter_ns()
    p.get("hot")
    lat.append(time.perf_counter_ns() - a)
p.close()
lat.sort()
print(json.dumps({"n": len(lat), "p50": lat[len(lat) // 2] / 1e3, "p99": lat[int(len(lat) * 0.99)] / 1e3,
                  "p999": lat[int(len(lat) * 0.999)] / 1e3}))
"""


def lock_hold(workdir: Path, with_tier: bool, puts: int = 6000, size: int = 64 << 10) -> dict:
    """Put latency of 64 KiB values into a full 64 MiB pool (with a tier every put spills its victim)
    and what it costs a reader of a hot 4 KiB key in another process."""
    import subprocess

    from cortex_cache import Pool
    from cortex_cache.disklog import DiskLog

    tier = workdir / "lock-tier"
    kw = dict(disk_path=tier, disk_size="1G") if with_tier else {}
    p = Pool.create("lockhold", 64 * MIB, block_size=size, **kw)
    try:
        value = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8).tobytes()
        for i in range(64 * MIB // size * 2):  # full, and (with a tier) spilling
            p.put(f"w{i}", value)
        p.put("hot", b"h" * 4096, priority=1 << 40)
        reader = subprocess.Popen([sys.executable, "-c", READER, "lockhold"], stdout=subprocess.PIPE, text=True,
                                  cwd=str(Path(__file__).resolve().parents[1]))
        assert reader.stdout.readline().strip() == "ready"
        lat = []
        for i in range(puts):
            a = time.perf_counter_ns()
            p.put(f"x{i}", value)
            lat.append(time.perf_counter_ns() - a)
            p.get("hot")  # keep it recent, so the policy never evicts it
        p.put("stop", b"1")
        got = json.loads(reader.communicate(timeout=120)[0].strip().splitlines()[-1])
        lat.sort()
        return {"put_p50_us": lat[len(lat) // 2] / 1e3, "put_p99_us": lat[int(len(lat) * 0.99)] / 1e3,
                "reader_p50_us": got["p50"], "reader_p99_us": got["p99"], "reader_p999_us": got["p999"],
                "spills": (p.stats().get("disk") or {}).get("spills", 0)}
    finally:
        p.close()
        Pool.unlink("lockhold")
        if with_tier:
            DiskLog.destroy(tier)


def summarise(times: list[float], nbytes: list[int]) -> dict:
    rates = [b / t / 1e9 for b, t in zip(nbytes, times)]
    return {"gbps": statistics.median(rates), "gbps_min": min(rates), "gbps_max": max(rates),
            "seconds": times}


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller trace and pool, 2 rounds")
    ap.add_argument("--dir", help="make the temp directory here (default: a disk-backed temp dir; never tmpfs)")
    ap.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = ap.parse_args()
    pool_mib = 128 if args.quick else 512
    rounds = 2 if args.quick else 3
    parent, fs_type = pick_parent(args.dir, 4 * pool_mib * MIB + 3 * pool_mib * MIB)
    if _free("/dev/shm") < 2 * pool_mib * MIB:
        raise SystemExit("not enough free /dev/shm")
    workdir = Path(tempfile.mkdtemp(prefix="ccbench-tier-", dir=parent))
    os.environ["CORTEX_CACHE_SHM_PREFIX"] = f"ccbench-{os.getpid()}."
    os.environ["CORTEX_CACHE_SNAPSHOT_DIR"] = str(workdir / "snapshots")
    out: dict = {"filesystem": fs_type, "pool_mib": pool_mib, "rounds": rounds, "hit_rate": {}, "speed": {}}
    try:
        print(f"disk tier benchmark in {workdir} ({fs_type})")
        traces = [("chat", chat_trace(6000 if args.quick else 30000), 1000)]
        mc = mooncake_trace()
        if mc is not None:
            traces.append(("mooncake", mc, 2000))
        print("\nhit rate, same memory; disk tier 4x memory, write-back")
        print(f"{'trace':10} {'chunks':>8} {'memory':>8} {'mem+disk':>9} {'LRU M':>7} {'LRU 5M':>7}  disk hits")
        for label, trace, m in traces:
            mem, _ = pool_hit_rate(trace, m, None)
            both, st = pool_hit_rate(trace, m, workdir / f"hit-{label}")
            lru1, lru5 = lru_hit_rate(trace, m), lru_hit_rate(trace, 5 * m)
            out["hit_rate"][label] = {"memory_chunks": m, "memory_only": mem, "memory_disk": both,
                                      "lru_memory": lru1, "lru_5x": lru5, "disk": st["disk"]}
            print(f"{label:10} {sum(map(len, trace)):>8} {mem:>8.3f} {both:>9.3f} {lru1:>7.3f} {lru5:>7.3f}  "
                  f"{st['disk']['hits']}")
        ring = memoryview(bytearray(np.random.default_rng(1).integers(0, 255, 64 * MIB, dtype=np.uint8).tobytes()))
        runs = [speed_round(workdir, pool_mib, ring, r) for r in range(rounds)]
        s = out["speed"]
        s["spill"] = summarise([r["spill_s"] for r in runs], [r["spill_bytes"] for r in runs])
        s["write"] = summarise([r["write_s"] for r in runs], [r["plain_write_bytes"] for r in runs])
        s["promote"] = summarise([r["promote_s"] for r in runs], [r["promote_bytes"] for r in runs])
        s["read"] = summarise([r["read_s"] for r in runs], [r["plain_read_bytes"] for r in runs])
        s["resident_before_promote"] = [r["promote_resident"] for r in runs]
        s["resident_before_read"] = [r["read_resident"] for r in runs]
        print(f"\nspeed, {pool_mib} MiB pool, 1 MiB values, GB/s median [min-max] over {rounds} rounds")
        for key, label in (("spill", "spill (puts + fsync)"), ("write", "plain write + fsync"),
                           ("promote", "promote, tier dropped"), ("read", "plain read, file dropped")):
            r = s[key]
            print(f"  {label:26} {r['gbps']:6.2f}  [{r['gbps_min']:.2f}-{r['gbps_max']:.2f}]")
        ratios = {"spill_vs_write": s["spill"]["gbps"] / s["write"]["gbps"],
                  "promote_vs_read": s["promote"]["gbps"] / s["read"]["gbps"]}
        out["ratios"] = ratios
        print(f"ratios: spill/write {ratios['spill_vs_write']:.2f}, promote/read {ratios['promote_vs_read']:.2f} "
              f"(page cache resident before: promote {max(s['resident_before_promote']):.0%}, "
              f"read {max(s['resident_before_read']):.0%})")
        print("\nlock hold: 64 KiB puts into a full 64 MiB pool; a reader of a hot key in another process")
        out["lock_hold"] = {}
        for label, with_tier in (("memory only", False), ("disk tier", True)):
            r = out["lock_hold"][label] = lock_hold(workdir, with_tier, puts=2000 if args.quick else 6000)
            print(f"  {label:12} put p50/p99 {r['put_p50_us']:6.1f}/{r['put_p99_us']:7.1f} us   reader get "
                  f"p50/p99/p99.9 {r['reader_p50_us']:5.1f}/{r['reader_p99_us']:6.1f}/{r['reader_p999_us']:7.1f} us"
                  f"   spills {r['spills']}")
        targets = {f"spill >= {TARGET}x write": ratios["spill_vs_write"] >= TARGET,
                   f"promote >= {TARGET}x read": ratios["promote_vs_read"] >= TARGET}
        for t, ok in targets.items():
            print(f"target {t}: {'met' if ok else 'MISSED'}")
        out["targets"] = targets
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
