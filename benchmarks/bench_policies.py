#!/usr/bin/env python
"""Every eviction policy on the Mooncake traces, through a real pool and through the KV layer (issue 27).

    python benchmarks/bench_policies.py [--quick] [--json PATH] [--data DIR]

1. hit rate   Both traces (benchmarks/traces) replayed through a pool of 2,000 / 6,000 / 20,000 one-block
              entries (64-byte blocks: values scaled down) for every policy, each beside the exact LRU
              (OrderedDict) of the same run and the policy's own simulation (benchmarks/sim_eviction.py,
              which the pool must match exactly).  Block hit rate as in the data README: every block of a
              request looked up (a hit refreshes it), hits counted while the leading blocks all hit, the
              missing blocks put.  Also the share of the entries left that no request can reach (a block
              whose prefix block is gone: LRU evicts a chain's head first).  Target: auto at least the best
              of lru, s3fifo and arc - 0.005 at every capacity, on both traces (and against the issue's
              table, the papers' S3-FIFO and ARC: sim_eviction.py's s3fifo-paper, arc-paper).
2. KV layer   The same requests through cortex_cache.kv.KVCache (chained SHA-256 prefix keys, 16-token
              chunks of 192 bytes, one per trace block): lookup(tokens), then store(tokens, kv) of what is
              missing -- the figure an engine sees.  Policies lru, s3fifo, arc, auto.
3. per op     4 KiB puts into a full pool of 20,000 entries (every put evicts) against puts into a pool of
              as many entries with room (none evicts), in paired bursts of 1,000 (bench_put_pairs), every
              policy, 3 rounds interleaved; targets (issue 42): every policy's evicting put >= 0.8x a put
              into free space, auto's per-put cost in the full pool <= 1.05x lru's (s3fifo, arc <= 1.5x).

5. workloads  Every class of benchmarks/workloads.py (loops, scans, shifting and mixed hot sets, frequency-
              and recency-heavy patterns; fixed seeds) through pools of 1,000 and 4,000 entries of 4 KiB
              values, for every policy: auto beside lru, s3fifo, arc and the best of the others, and each
              simulated policy against its simulation.  Target: auto >= the best of lru, s3fifo and arc
              - 0.01 on every class at both capacities.

4. admission  Both traces through a pool of 2,000 entries of 4 KiB over a write-back disk tier of 4x
              its size (in the system's temporary directory), lru and auto, with tier_admit 1 (every
              evicted entry goes to disk) and 2 (only entries seen twice): the hit rate of memory and disk
              together, the disk's share of the hits, and the bytes written to disk.

6. restart   The synthetic trace's first half through a pool of 2,000 / 6,000 one-block entries, then the
              pool persisted (the snapshot directory's incremental snapshot), deleted and restored (the
              background fill's path), and the next 600 requests replayed: the hit rate of those 600 beside
              the pool that never stopped, for every policy, restored with its policy state
              (policy_state.py, carried by benchmarks/restart.py until the snapshot's own section does) and
              without it (as before).  Target: with the state, within 0.005 of the pool that never stopped.

--quick: the synthetic trace only, capacities 2,000 and 6,000, the KV layer at 6,000, fewer puts, the
workloads at 1,000 entries only, the restart at 2,000.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["CORTEX_CACHE_SHM_PREFIX"] = f"ccbench-{os.getpid()}."
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import bench_eviction  # noqa: E402  (its put-latency measure and pool clean-up)
import restart  # noqa: E402
import sim_eviction  # noqa: E402
import workloads  # noqa: E402
from cortex_cache import Pool, PoolNotFound  # noqa: E402
from cortex_cache.policy_names import POLICY_IDS  # noqa: E402

QUEUE_POLICIES = ["s3fifo", "arc", "auto"]
CLASSIC = ["lru", "s3fifo", "arc"]
ISSUE_TABLE = {  # issue 27's simulated table: exact LRU, S3-FIFO (10% small queue), ARC
    "conversation": {2000: (0.054, 0.078, 0.071), 6000: (0.139, 0.160, 0.154), 20000: (0.287, 0.251, 0.289)},
    "synthetic": {2000: (0.144, 0.146, 0.142), 6000: (0.311, 0.321, 0.322), 20000: (0.571, 0.594, 0.593)},
}
WITHIN = 0.005
RESTART_WITHIN = 0.005
RESTART_NEXT = 600  # requests replayed after the restart
WORKLOAD_WITHIN = 0.01
WORKLOAD_VALUE = bytes(4096)
COST_LIMIT = 1.5  # s3fifo's and arc's per-put cost in a full pool against lru's
AUTO_COST_LIMIT = 1.05  # auto's (issue 42)
PUT_RATIO_TARGET = 0.8  # an evicting put against a put into free space, every policy (issue 42)
CHUNK = 16


def _pool(name: str, size: int, **kw) -> Pool:
    bench_eviction._made.append(name)
    return Pool.create(name, size, **kw)


def _close(p: Pool) -> None:
    name = p.name
    p.close()
    try:
        Pool.unlink(name)
    except PoolNotFound:
        pass


def unreachable(keys: list[int], parent: dict[int, int]) -> int:
    """How many of the cached blocks `keys` no request can reach: some block of their prefix is not cached."""
    cached = set(keys)
    memo: dict[int, bool] = {}

    def ok(b: int) -> bool:
        chain = []
        while b not in memo:
            chain.append(b)
            p = parent.get(b)
            if p is None:
                memo[b] = True
                break
            if p not in cached:
                memo[b] = False
                break
            b = p
        v = memo[b]
        for c in chain:
            memo[c] = v
        return v

    return sum(not ok(b) for b in cached)


def replay_pool(reqs: list[list[int]], cap: int, policy: str) -> dict:
    p = _pool(f"hr-{policy}-{cap}", cap * 64, block_size=64, max_entries=cap, policy=policy)
    try:
        t = time.perf_counter()
        hits, total = bench_eviction.replay_pool(p, reqs)
        secs = time.perf_counter() - t
        keys = [int(k) for k in p.keys()]
        st = p.stats()
    finally:
        _close(p)
    return {"hit_rate": hits / total, "hits": hits, "seconds": secs, "keys": keys, "evictions": st["evictions"]}


def replay_kv(reqs: list[list[int]], cap: int, policy: str) -> dict:
    """The requests through KVCache: each block is CHUNK tokens equal to its id; lookup, then store."""
    import torch

    from cortex_cache.kv import HEADER_SIZE, KVCache

    payload = 1 * 2 * CHUNK * 1 * 2 * 2  # [layers, 2, tokens, heads, head_dim] of float16
    block = 1 << (HEADER_SIZE + payload - 1).bit_length()
    p = _pool(f"kv-{policy}-{cap}", cap * block, block_size=block, max_entries=cap, policy=policy)
    try:
        kv = KVCache(p, model="trace", num_layers=1, num_heads=1, head_dim=2, dtype=torch.float16,
                     chunk_tokens=CHUNK)
        longest = max(len(r) for r in reqs)
        tensor = torch.zeros((1, 2, longest * CHUNK, 1, 2), dtype=torch.float16)
        hit = total = 0
        t = time.perf_counter()
        for ids in reqs:
            tokens = np.repeat(np.asarray(ids, dtype=np.uint32), CHUNK)
            hit += kv.lookup(tokens) // CHUNK
            total += len(ids)
            kv.store(tokens, tensor)
        secs = time.perf_counter() - t
    finally:
        _close(p)
    return {"hit_rate": hit / total, "seconds": secs}


def bench_hit_rates(data: Path, traces: list[str], caps: list[int], kv_caps: list[int]) -> dict:
    rows, goals = [], []
    for trace in traces:
        reqs = sim_eviction.load(data / f"mooncake_{trace}_trace.jsonl")
        parent = {}
        for ids in reqs:
            for a, b in zip(ids, ids[1:]):
                parent.setdefault(b, a)
        for cap in caps:
            exact = bench_eviction.replay_ordereddict(reqs, cap)
            exact_rate = exact[0] / exact[1]
            per: dict = {}
            for policy in POLICY_IDS:
                r = replay_pool(reqs, cap, policy)
                sim = sim_eviction.POLICIES.get(policy)
                r["sim"] = sim_eviction.replay(sim(cap), reqs) if sim else None
                r["unreachable"] = unreachable(r.pop("keys"), parent) / cap
                if cap in kv_caps and policy in ["lru"] + QUEUE_POLICIES:
                    r["kv"] = replay_kv(reqs, cap, policy)
                per[policy] = r
                print(f"  {trace} {cap:>6,} {policy:<8} pool {r['hit_rate']:.4f}"
                      + (f" sim {r['sim']:.4f}" if r["sim"] is not None else "")
                      + (f" kv {r['kv']['hit_rate']:.4f}" if "kv" in r else ""), file=sys.stderr, flush=True)
            papers = {n: sim_eviction.replay(sim_eviction.POLICIES[n](cap), reqs) for n in ("s3fifo-paper", "arc-paper")}
            rows.append({"trace": trace, "capacity": cap, "exact_lru": exact_rate, "policies": per, "papers": papers})
            same = [n for n, r in per.items() if r["sim"] is not None and r["sim"] != r["hit_rate"]]
            goals.append({"target": f"policies: {trace} {cap:,} every simulated policy hits exactly as simulated",
                          "value": "yes" if not same else "no: " + ",".join(same), "baseline": "sim_eviction.py",
                          "ratio": None, "met": not same})
            best = max(per[n]["hit_rate"] for n in CLASSIC)
            auto = per["auto"]["hit_rate"]
            goals.append({"target": f"policies: {trace} {cap:,} auto >= best of lru/s3fifo/arc - {WITHIN}",
                          "value": f"{auto:.4f}", "baseline": f"best {best:.4f}", "ratio": auto / best,
                          "met": auto >= best - WITHIN})
            table = ISSUE_TABLE.get(trace, {}).get(cap)
            if table:
                goals.append({"target": f"policies: {trace} {cap:,} auto >= the issue's best - {WITHIN}",
                              "value": f"{auto:.4f}", "baseline": f"issue {max(table):.3f}",
                              "ratio": auto / max(table), "met": auto >= max(table) - WITHIN})
            if "kv" in per["auto"]:
                kbest = max(per[n]["kv"]["hit_rate"] for n in CLASSIC)
                kauto = per["auto"]["kv"]["hit_rate"]
                goals.append({"target": f"policies: {trace} {cap:,} through kv.py, auto >= best - {WITHIN}",
                              "value": f"{kauto:.4f}", "baseline": f"best {kbest:.4f}", "ratio": kauto / kbest,
                              "met": kauto >= kbest - WITHIN})
    return {"rows": rows, "goals": goals}


def _fill_pool(p: Pool, keys: list[bytes], value: bytes, prios: np.ndarray | None) -> None:
    for j, k in enumerate(keys):
        p.put(k, value, priority=0 if prios is None else int(prios[j]))


class _Side:
    """One side of paired bursts: a pool of 4 KiB entries of `policy` holding `n_entries`, with room for
    `room` (full when equal: warmed up by evicting puts first), and keys of its own for every burst."""

    BS = 4096

    def __init__(self, tag: str, policy: str, n_entries: int, room: int, burst: int, pairs: int, seed: int) -> None:
        self.value = np.random.default_rng(seed).integers(0, 256, 4000, dtype=np.uint8).tobytes()
        rng = np.random.default_rng(seed)
        self.warm = max(1000, burst) if room == n_entries else 0
        total = n_entries + self.warm + burst * pairs
        self.prios = rng.integers(0, 8, size=total) if policy == "priority" else None
        self.keys = [b"%s-%d" % (tag.encode(), i) for i in range(total)]
        self.pool = _pool(f"pair-{tag}-{policy}", room * self.BS, block_size=self.BS, max_entries=room, policy=policy)
        _fill_pool(self.pool, self.keys[:n_entries], self.value, self._prios(0, n_entries))
        if policy == "lfu":  # different counts (Zipf reads), so LFU has an order to keep
            for j in np.minimum(rng.zipf(1.3, size=n_entries // 2), n_entries) - 1:
                self.pool.get(self.keys[int(j)])
        _fill_pool(self.pool, self.keys[n_entries : n_entries + self.warm], self.value,
                   self._prios(n_entries, n_entries + self.warm))
        self.next = n_entries + self.warm
        self.burst, self.times, self.lat = burst, [], []
        self.stats: dict = {}

    def _prios(self, lo: int, hi: int) -> np.ndarray | None:
        return None if self.prios is None else self.prios[lo:hi]

    def run(self) -> float:
        """One burst: its seconds per put."""
        lo, hi = self.next, self.next + self.burst
        lat, wall = bench_eviction._timed_puts(self.pool, self.keys[lo:hi], self.value, self._prios(lo, hi))
        self.next = hi
        self.lat.append(lat)
        self.times.append(wall / self.burst)
        return wall / self.burst


def _paired_bursts(a: _Side, b: _Side, pairs: int) -> float:
    """`pairs` bursts into each side in turn (which goes first flips each pair): the median of the pairs'
    time ratios a / b, so a drift of the machine's speed moves both sides of a pair alike."""
    ratios = []
    try:
        for n in range(pairs):
            if n % 2 == 0:
                ta = a.run()
                tb = b.run()
            else:
                tb = b.run()
                ta = a.run()
            ratios.append(ta / tb)
        for side in (a, b):
            side.stats = side.pool.stats()
        return statistics.median(ratios)
    finally:
        for side in (a, b):
            _close(side.pool)


def bench_put_pairs(policy: str, n_entries: int, burst: int, pairs: int, seed: int = 1) -> dict:
    """Paired bursts of 4 KiB puts: `burst` into a full pool of `n_entries` (each put evicts one entry) and
    `burst` into a pool holding as many entries with room for every put of the run (none evicts).  The
    ratio is the evicting put's throughput against the free one's (the median pair's)."""
    full = _Side("full", policy, n_entries, n_entries, burst, pairs, seed)
    free = _Side("free", policy, n_entries, n_entries + burst * pairs, burst, pairs, seed)
    ratio = 1 / _paired_bursts(full, free, pairs)
    assert full.stats["evictions"] == full.warm + burst * pairs and free.stats["evictions"] == 0
    lat = np.concatenate(full.lat)
    return {"policy": policy, "ratio": ratio, "full_us": 1e6 * statistics.median(full.times),
            "free_us": 1e6 * statistics.median(free.times), "p50": float(np.percentile(lat, 50)),
            "p99": float(np.percentile(lat, 99))}


def bench_cost_pairs(policy: str, baseline: str, n_entries: int, burst: int, pairs: int, seed: int = 1) -> float:
    """Paired bursts of evicting 4 KiB puts into two full pools, of `policy` and of `baseline`: the per-put
    cost of the one against the other (the median pair's).  Run twice, the pools made in either order, and
    the two ratios' geometric mean taken: the pool made first ran a few per cent slower here whatever its
    policy (lru against lru: 1.03), which the two orders cancel."""
    first = _paired_bursts(_Side("a", policy, n_entries, n_entries, burst, pairs, seed),
                           _Side("b", baseline, n_entries, n_entries, burst, pairs, seed), pairs)
    second = _paired_bursts(_Side("a", baseline, n_entries, n_entries, burst, pairs, seed),
                            _Side("b", policy, n_entries, n_entries, burst, pairs, seed), pairs)
    return math.sqrt(first / second)


def bench_costs(n_entries: int, burst: int, pairs: int, rounds: int) -> dict:
    """Every policy's evicting put against a put into free space (bench_put_pairs), and each queue
    policy's evicting put against lru's (bench_cost_pairs), `rounds` rounds with the policies interleaved;
    medians over the rounds."""
    got: dict = {p: {k: [] for k in ("ratio", "full_us", "free_us", "p50", "p99", "cost_vs_lru")} for p in POLICY_IDS}
    for _ in range(rounds):
        for policy in POLICY_IDS:
            r = bench_put_pairs(policy, n_entries, burst, pairs)
            r["cost_vs_lru"] = bench_cost_pairs(policy, "lru", n_entries, burst, pairs) if policy in QUEUE_POLICIES else None
            for k, v in got[policy].items():
                v.append(r[k])
    med = {p: {k: statistics.median(v) if None not in v else None for k, v in d.items()} for p, d in got.items()}
    rows, goals = [], []
    for policy in POLICY_IDS:
        m = med[policy]
        rows.append({"policy": policy, **m, "target": PUT_RATIO_TARGET, "met": m["ratio"] >= PUT_RATIO_TARGET})
        goals.append({"target": f"policies: {policy} evicting put >= {PUT_RATIO_TARGET}x a put into free space",
                      "value": f"{m['full_us']:.2f} us", "baseline": f"free space {m['free_us']:.2f} us",
                      "ratio": m["ratio"], "met": m["ratio"] >= PUT_RATIO_TARGET})
        if policy in QUEUE_POLICIES:
            limit = AUTO_COST_LIMIT if policy == "auto" else COST_LIMIT
            goals.append({"target": f"policies: {policy} evicting put <= {limit}x lru's (paired bursts)",
                          "value": f"{m['full_us']:.2f} us", "baseline": f"lru {med['lru']['full_us']:.2f} us",
                          "ratio": m["cost_vs_lru"], "met": m["cost_vs_lru"] <= limit})
    return {"entries": n_entries, "burst": burst, "pairs": pairs, "rounds": rounds, "rows": rows, "goals": goals}


def replay_tiers(reqs: list[list[int]], cap: int, policy: str, admit: int, workdir: Path) -> dict:
    """The requests through memory over a disk tier: get every block (a disk hit promotes), put a miss."""
    import shutil

    tier = workdir / f"tier-{policy}-{admit}"
    p = _pool(f"adm-{policy}-{admit}", cap * 4096, block_size=4096, max_entries=cap, policy=policy,
              disk_path=tier, disk_size=4 * cap * 4096, tier_admit=admit)
    try:
        t = time.perf_counter()
        hits, total = bench_eviction.replay_pool(p, reqs, bytes(4000))
        secs = time.perf_counter() - t
        st = p.stats()
    finally:
        _close(p)
        shutil.rmtree(tier, ignore_errors=True)
    d = st["disk"]
    return {"hit_rate": hits / total, "disk_hits": d["hits"], "memory_hits": st["hits"],
            "disk_hit_share": d["hits"] / max(1, st["hits"] + d["hits"]), "disk_bytes_written": d["bytes_written"],
            "disk_records": d["spills"], "not_admitted": st["tier_refused"], "seconds": secs}


def bench_admission(data: Path, traces: list[str], cap: int) -> dict:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="ccbench-admit-") as tmp:
        for trace in traces:
            reqs = sim_eviction.load(data / f"mooncake_{trace}_trace.jsonl")
            for policy in ("lru", "auto"):
                for admit in (1, 2):
                    r = replay_tiers(reqs, cap, policy, admit, Path(tmp))
                    rows.append({"trace": trace, "capacity": cap, "policy": policy, "tier_admit": admit, **r})
                    print(f"  {trace} {policy} admit {admit}: hit {r['hit_rate']:.4f}, disk written "
                          f"{r['disk_bytes_written'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    return {"rows": rows}


def replay_keys(get, put, keys: list[int], value) -> int:
    """Hits of `keys` replayed as single-key requests: a get, and on a miss a put of `value`."""
    hits = 0
    for k in keys:
        if get(k) is not None:
            hits += 1
        else:
            put(k, value)
    return hits


class _Sim:
    """A simulated policy behind the pool's get/put (a hit answers True, a miss None)."""

    def __init__(self, policy) -> None:
        self.p = policy

    def get(self, k):
        return True if self.p.get(k) else None

    def put(self, k, value) -> None:
        self.p.put(k)


def bench_workloads(caps: list[int]) -> dict:
    rows, goals = [], []
    for cls in workloads.CLASSES:
        for cap in caps:
            keys = workloads.generate(cls, cap).tolist()
            encoded = [b"%d" % k for k in keys]
            per: dict = {}
            for policy in POLICY_IDS:
                p = _pool(f"wl-{policy}-{cap}", cap * len(WORKLOAD_VALUE), block_size=len(WORKLOAD_VALUE),
                          max_entries=cap, policy=policy)
                try:
                    t = time.perf_counter()
                    hits = replay_keys(p.get, p.put, encoded, WORKLOAD_VALUE)
                    secs = time.perf_counter() - t
                finally:
                    _close(p)
                sim = sim_eviction.POLICIES.get(policy)
                simmed = None
                if sim is not None:
                    s = _Sim(sim(cap))
                    simmed = replay_keys(s.get, s.put, keys, None) / len(keys)
                per[policy] = {"hit_rate": hits / len(keys), "sim": simmed, "seconds": secs}
            others = {n: r["hit_rate"] for n, r in per.items() if n not in CLASSIC + ["auto"]}
            other = max(others, key=others.get)
            best = max(per[n]["hit_rate"] for n in CLASSIC)
            auto = per["auto"]["hit_rate"]
            rows.append({"class": cls, "capacity": cap, "accesses": len(keys), "policies": per,
                         "best_other": other, "best_classic": best})
            print(f"  {cls:<12}{cap:>6,}  auto {auto:.4f}  lru {per['lru']['hit_rate']:.4f}  s3fifo "
                  f"{per['s3fifo']['hit_rate']:.4f}  arc {per['arc']['hit_rate']:.4f}  {other} "
                  f"{others[other]:.4f}", file=sys.stderr, flush=True)
            same = [n for n, r in per.items() if r["sim"] is not None and r["sim"] != r["hit_rate"]]
            goals.append({"target": f"policies: workload {cls} {cap:,} every simulated policy hits exactly as "
                          "simulated", "value": "yes" if not same else "no: " + ",".join(same),
                          "baseline": "sim_eviction.py", "ratio": None, "met": not same})
            goals.append({"target": f"policies: workload {cls} {cap:,} auto >= best of lru/s3fifo/arc - "
                          f"{WORKLOAD_WITHIN}", "value": f"{auto:.4f}", "baseline": f"best {best:.4f}",
                          "ratio": auto / max(best, 1e-9), "met": auto >= best - WORKLOAD_WITHIN})
    return {"rows": rows, "goals": goals, "value_bytes": len(WORKLOAD_VALUE)}


def replay_restart(reqs: list[list[int]], cap: int, policy: str, how: str) -> float:
    """The first half of `reqs`, then (`how`: "state", "none") a persist, delete and restore, or ("never")
    nothing; the hit rate of the next RESTART_NEXT requests."""
    half = len(reqs) // 2
    name = f"rs-{policy}-{cap}"
    p = _pool(name, cap * 64, block_size=64, max_entries=cap, policy=policy)
    try:
        bench_eviction.replay_pool(p, reqs[:half])
        if how != "never":
            _, blob = restart.persist(p, state=how == "state")
            p.close()
            Pool.unlink(name)
            p, report = restart.restore(blob, name=name)
            if report is not None and not report["applied"]:
                raise RuntimeError(f"policy state not applied: {report['note']}")
        hits, total = bench_eviction.replay_pool(p, reqs[half : half + RESTART_NEXT])
    finally:
        _close(p)
    return hits / total


def bench_restart(data: Path, caps: list[int]) -> dict:
    import tempfile

    reqs = sim_eviction.load(data / "mooncake_synthetic_trace.jsonl")
    rows, goals = [], []
    saved = os.environ.get("CORTEX_CACHE_SNAPSHOT_DIR")
    with tempfile.TemporaryDirectory(prefix="ccbench-restart-") as tmp:
        os.environ["CORTEX_CACHE_SNAPSHOT_DIR"] = str(Path(tmp) / "snapshots")  # never the user's own
        try:
            for cap in caps:
                for policy in POLICY_IDS:
                    r = {how: replay_restart(reqs, cap, policy, how) for how in ("never", "state", "none")}
                    rows.append({"capacity": cap, "policy": policy, **r})
                    print(f"  restart {cap:>6,} {policy:<8} never stopped {r['never']:.4f}  restored {r['state']:.4f}"
                          f"  without its state {r['none']:.4f}", file=sys.stderr, flush=True)
                    gap = abs(r["state"] - r["never"])
                    goals.append({"target": f"policies: restart {cap:,} {policy} restored within {RESTART_WITHIN} "
                                  "of never stopped", "value": f"{r['state']:.4f}",
                                  "baseline": f"never stopped {r['never']:.4f}", "ratio": r["state"] / max(r["never"], 1e-9),
                                  "met": gap <= RESTART_WITHIN})
        finally:
            if saved is None:
                os.environ.pop("CORTEX_CACHE_SNAPSHOT_DIR", None)
            else:
                os.environ["CORTEX_CACHE_SNAPSHOT_DIR"] = saved
    return {"rows": rows, "goals": goals, "next_requests": RESTART_NEXT}


def print_restart(r: dict) -> None:
    print(f"\n== 6. restart: the synthetic trace's first half, persist, delete, restore, then {r['next_requests']} "
          "requests: their hit rate ==")
    print(f"  {'capacity':>9}  {'policy':<9}{'never stopped':>14}{'restored':>10}{'- never':>9}{'without state':>14}"
          f"{'- never':>9}")
    for x in r["rows"]:
        print(f"  {x['capacity']:>9,}  {x['policy']:<9}{x['never']:>14.4f}{x['state']:>10.4f}"
              f"{x['state'] - x['never']:>+9.4f}{x['none']:>14.4f}{x['none'] - x['never']:>+9.4f}")


def print_workloads(w: dict) -> None:
    print(f"\n== 5. workload classes (benchmarks/workloads.py) through pools of {w['value_bytes']:,}-byte values: "
          "hit rate ==")
    print(f"  {'class':<13}{'capacity':>9}{'auto':>8}{'lru':>8}{'s3fifo':>8}{'arc':>8}  {'best other':<16}"
          f"{'auto - best':>12}")
    for r in w["rows"]:
        per = r["policies"]
        other = f"{r['best_other']} {per[r['best_other']]['hit_rate']:.3f}"
        print(f"  {r['class']:<13}{r['capacity']:>9,}{per['auto']['hit_rate']:>8.3f}{per['lru']['hit_rate']:>8.3f}"
              f"{per['s3fifo']['hit_rate']:>8.3f}{per['arc']['hit_rate']:>8.3f}  {other:<16}"
              f"{per['auto']['hit_rate'] - r['best_classic']:>+12.4f}")


def print_admission(a: dict) -> None:
    print("\n== 4. admission to the disk tier (memory 2,000 x 4 KiB entries, disk 4x, write-back) ==")
    print(f"  {'trace':<13}{'policy':<7}{'admit':>6}{'hit rate':>10}{'disk hits':>11}{'disk share':>11}"
          f"{'MiB written':>12}{'records':>9}{'refused':>9}")
    for r in a["rows"]:
        print(f"  {r['trace']:<13}{r['policy']:<7}{r['tier_admit']:>6}{r['hit_rate']:>10.4f}{r['disk_hits']:>11,}"
              f"{r['disk_hit_share']:>11.3f}{r['disk_bytes_written'] / 2**20:>12.1f}{r['disk_records']:>9,}"
              f"{r['not_admitted']:>9,}")


def print_hit_rates(h: dict) -> None:
    print("\n== 1-2. block hit rate, through a pool (and through kv.py), beside exact LRU of the same run ==")
    print("   sim: the policy's simulation (sim_eviction.py; the pool must equal it); unreach: share of the pool "
          "holding blocks whose prefix is gone")
    for r in h["rows"]:
        print(f"\n{r['trace']}, {r['capacity']:,} blocks: exact LRU {r['exact_lru']:.4f}; the papers' S3-FIFO "
              f"{r['papers']['s3fifo-paper']:.4f}, ARC {r['papers']['arc-paper']:.4f}")
        print(f"  {'policy':<9}{'pool':>8}{'- LRU':>9}{'sim':>8}{'kv.py':>8}{'unreach':>9}{'seconds':>9}")
        for name, p in r["policies"].items():
            sim = f"{p['sim']:.4f}" if p["sim"] is not None else "-"
            kv = f"{p['kv']['hit_rate']:.4f}" if "kv" in p else "-"
            print(f"  {name:<9}{p['hit_rate']:>8.4f}{p['hit_rate'] - r['exact_lru']:>+9.4f}{sim:>8}{kv:>8}"
                  f"{p['unreachable']:>9.3f}{p['seconds']:>9.1f}")


def print_costs(c: dict) -> None:
    print(f"\n== 3. 4 KiB puts into a full pool ({c['entries']:,} entries, each put evicts) against puts into "
          f"free space, and the queue policies' against lru's: {c['pairs']} paired bursts of {c['burst']:,}, "
          f"median of {c['rounds']} interleaved rounds ==")
    print(f"  {'policy':<9}{'full us':>9}{'free us':>9}{'full/free':>11}{'target':>8}{'cost/lru':>10}"
          f"{'p50 us':>8}{'p99 us':>8}")
    for r in c["rows"]:
        cost = "" if r["cost_vs_lru"] is None else f"{r['cost_vs_lru']:.2f}"
        print(f"  {r['policy']:<9}{r['full_us']:>9.2f}{r['free_us']:>9.2f}{r['ratio']:>11.2f}"
              f"{PUT_RATIO_TARGET:>8.2f}{cost:>10}{r['p50']:>8.2f}{r['p99']:>8.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--data", type=Path, default=bench_eviction.DEFAULT_DATA)
    ap.add_argument("--skip", action="append", default=[], choices=["hits", "costs", "admission", "workloads",
                                                                              "restart"])
    args = ap.parse_args()
    q = args.quick
    out: dict = {"quick": q, "goals": []}
    try:
        if "hits" not in args.skip:
            if not (args.data / "mooncake_synthetic_trace.jsonl").exists():
                out["hits_skipped"] = f"no Mooncake traces in {args.data}"
            else:
                traces = ["synthetic"] if q else ["conversation", "synthetic"]
                caps = [2000, 6000] if q else [2000, 6000, 20000]
                out["hits"] = bench_hit_rates(args.data, traces, caps, [6000] if q else caps)
                print_hit_rates(out["hits"])
                out["goals"] += out["hits"]["goals"]
        if "workloads" not in args.skip:
            out["workloads"] = bench_workloads([1000] if q else [1000, 4000])
            print_workloads(out["workloads"])
            out["goals"] += out["workloads"]["goals"]
        if "admission" not in args.skip and (args.data / "mooncake_synthetic_trace.jsonl").exists():
            out["admission"] = bench_admission(args.data, ["synthetic"] if q else ["conversation", "synthetic"], 2000)
            print_admission(out["admission"])
        if "restart" not in args.skip and (args.data / "mooncake_synthetic_trace.jsonl").exists():
            out["restart"] = bench_restart(args.data, [2000] if q else [2000, 6000])
            print_restart(out["restart"])
            out["goals"] += out["restart"]["goals"]
        if "costs" not in args.skip:
            out["costs"] = bench_costs(20_000, 1_000, 5 if q else 20, 3)
            print_costs(out["costs"])
            out["goals"] += out["costs"]["goals"]
    finally:
        bench_eviction._cleanup_all()
    print()
    for g in out["goals"]:
        print(f"  {'met   ' if g['met'] else 'MISSED'} {g['target']}: {g['value']} vs {g['baseline']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
