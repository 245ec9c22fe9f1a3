"""The SGLang HiCache backend: page throughput beside SGLang's `file` backend, and trace hit rates.

    CORTEX_BENCH_SGLANG_PYTHON=.sglang-venv/bin/python python benchmarks/bench_sglang.py \\
        [--quick] [--json PATH] [--trace PATH]

Runs in the SGLang venv (scripts/sglang_venv.sh; re-executes itself there
when CORTEX_BENCH_SGLANG_PYTHON is set).  Both parts use SGLang's own classes:
backends made by its storage backend factory, its host KV pools on the CPU.

throughput  Pages of 64 tokens of a Qwen2.5-0.5B-sized model's KV, all 24
            layers (2 KV heads x 64, bf16: 768 KiB a page), moved in batches
            of 128 pages (SGLang's STORAGE_BATCH_SIZE) between a page-first
            host pool and:
              cortex v1      this backend's zero-copy batch_set_v1/batch_get_v1
              cortex legacy  this backend through SGLang's generic page path
                             (get_data_page + batch_set; batch_get +
                             set_from_flat_data_page), as the controller does
                             for backends without interface_v1
              file           SGLang's `file` backend (HiCacheFile, one .bin a
                             page in a fresh directory on disk, page cache warm)
                             through that same generic path
            Every round stores 128 new pages, then loads them into other host
            slots; GB/s median [min-max] over rounds; loads checked exact.
            Only the backends' calls are timed: on the generic path SGLang
            itself copies each page out (get_data_page), allocates a page per
            load and scatters it back, the same for every backend; the v1
            path has none of that.
hit rate    The Mooncake multi-turn trace (benchmarks/traces; --trace or CORTEX_BENCH_MOONCAKE_TRACE for another;
            its blocks of 512 tokens are SGLang pages here) replayed through
            the backend as SGLang's controller drives it: batch_exists over
            the request's pages (in batches of 128, stopping at the first
            miss), batch_get_v1 of the hits, batch_set_v1 of the rest.  Hit
            rate = pages loaded / pages asked for, for a pool holding ~2,000
            pages in memory, with and without a disk tier of ~18,000 more,
            beside an exact LRU of the same capacities computed here.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

try:
    import sglang  # noqa: F401
except ImportError:
    py = os.environ.get("CORTEX_BENCH_SGLANG_PYTHON")
    if not py:
        raise SystemExit("set CORTEX_BENCH_SGLANG_PYTHON to a Python with SGLang (scripts/sglang_venv.sh)")
    os.environ["PYTHONWARNINGS"] = "ignore"
    os.execv(py, [py, __file__, *sys.argv[1:]])

import warnings  # noqa: E402

warnings.simplefilter("ignore")
os.environ.setdefault("CORTEX_CACHE_SHM_PREFIX", f"ccbench-{os.getpid()}.")

import torch  # noqa: E402

from tests.sglang_harness import fill, make_backend, make_host, storage_config  # noqa: E402

from cortex_cache import Pool  # noqa: E402

BATCH = 128
TOKENS = 64  # tokens per page in the throughput part
TRACE_PAGE = 512  # the Mooncake trace's block


def gbps(pages: int, page_bytes: int, secs: float) -> float:
    return pages * page_bytes / secs / 1e9


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed_generic_set(backend, host, keys, idx, page) -> tuple[bool, float]:
    """SGLang's _generic_page_set; only the backend's call is timed (the page copies before it are SGLang's)."""
    data = [host.get_data_page(idx[i * page]) for i in range(len(keys))]
    t = time.perf_counter()
    ok = backend.batch_set(keys, data)
    return ok, time.perf_counter() - t


def timed_generic_get(backend, host, keys, idx, page) -> tuple[int, float]:
    """SGLang's _generic_page_get; only the backend's call is timed (SGLang allocates and scatters the pages)."""
    dummies = [host.get_dummy_flat_data_page() for _ in keys]
    t = time.perf_counter()
    got = backend.batch_get(keys, dummies)
    secs = time.perf_counter() - t
    n = 0
    for i, data in enumerate(got or []):
        if data is None:
            break
        host.set_from_flat_data_page(idx[i * page], data)
        n += 1
    return n, secs


def throughput(rounds: int) -> dict:
    src = make_host("mha", "page_first", pages=BATCH, layers=24, heads=2, head_dim=64, page_size=TOKENS)
    dst = make_host("mha", "page_first", pages=BATCH, layers=24, heads=2, head_dim=64, page_size=TOKENS)
    fill(src, 5)
    sidx, didx = src.alloc(BATCH * TOKENS), dst.alloc(BATCH * TOKENS)
    page_bytes = src.get_dummy_flat_data_page().nbytes
    work = Path(tempfile.mkdtemp(prefix="ccbench-sglang-file-"))
    results: dict = {}
    try:
        for name in ("cortex v1", "cortex legacy", "file"):
            pool = None
            if name == "file":
                from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

                cfg = storage_config("mha", "Qwen/Qwen2.5-0.5B", {"file_storage_path": str(work / "hicache")})
                backend = StorageBackendFactory.create_backend("file", cfg, src)
                backend.register_mem_pool_host(src)
            else:
                pool = Pool.create("sglbench", rounds * BATCH * (page_bytes + (64 << 10)) + (64 << 20))
                backend = make_backend(src, "mha", "sglbench", "Qwen/Qwen2.5-0.5B", v1=name == "cortex v1")
            reader = backend
            if pool is not None:
                reader = make_backend(dst, "mha", "sglbench", "Qwen/Qwen2.5-0.5B", v1=name == "cortex v1")
            else:
                reader.register_mem_pool_host(dst)  # HiCacheFile keeps no host pool state of its own
            sets, gets, exact = [], [], True
            for r in range(rounds):
                keys = [f"{name[:6]}{r:04d}{i:04d}".encode().hex().ljust(64, "0") for i in range(BATCH)]
                if name == "cortex v1":
                    t = time.perf_counter()
                    ok = backend.batch_set_v1(keys, sidx)
                    secs = time.perf_counter() - t
                else:
                    done, secs = timed_generic_set(backend, src, keys, sidx, TOKENS)
                    ok = [done]
                sets.append(gbps(BATCH, page_bytes, secs))
                dst.kv_buffer.zero_()
                if name == "cortex v1":
                    t = time.perf_counter()
                    n = sum(reader.batch_get_v1(keys, didx))
                    secs = time.perf_counter() - t
                else:
                    n, secs = timed_generic_get(reader, dst, keys, didx, TOKENS)
                gets.append(gbps(BATCH, page_bytes, secs))
                exact = exact and all(ok) and n == BATCH and torch.equal(dst.kv_buffer[:, : BATCH * TOKENS],
                                                                         src.kv_buffer[:, : BATCH * TOKENS])
            results[name] = {"set_gbps": spread(sets), "get_gbps": spread(gets), "exact": bool(exact)}
            if pool is not None:
                backend.close()
                reader.close()
                pool.close()
                Pool.unlink("sglbench")
            print(f"  throughput: {name} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    f = results["file"]
    ratios = {n: {"set": results[n]["set_gbps"]["median"] / f["set_gbps"]["median"],
                  "get": results[n]["get_gbps"]["median"] / f["get_gbps"]["median"]}
              for n in ("cortex v1", "cortex legacy")}
    return {"page_bytes": page_bytes, "batch": BATCH, "rounds": rounds, "results": results, "ratios_vs_file": ratios}


def load_trace(path: Path, limit: int | None) -> list[list[int]]:
    reqs = []
    with open(path) as f:
        for line in f:
            reqs.append(json.loads(line)["hash_ids"])
            if limit and len(reqs) >= limit:
                break
    return reqs


def exact_lru(reqs: list[list[int]], capacity: int | None) -> float:
    cache: OrderedDict = OrderedDict()
    hit = total = 0
    for ids in reqs:
        total += len(ids)
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        hit += n
        for b in ids:
            cache[b] = True
            cache.move_to_end(b)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hit / max(total, 1)


def replay(reqs: list[list[int]], mem_pages: int, disk_pages: int, work: Path) -> dict:
    """The trace through the backend as SGLang's controller drives it; hit rate and wall time."""
    host = make_host("mha", "page_first", pages=max(len(r) for r in reqs) + 1, layers=1, heads=1, head_dim=8,
                     page_size=TRACE_PAGE)
    fill(host, 3)
    page_bytes = host.get_dummy_flat_data_page().nbytes
    block = 4096
    entry = -(-(page_bytes + 64 + 128) // block) * block  # payload, header and key, in whole pool blocks
    kw: dict = {"block_size": block}
    if disk_pages:
        kw.update(tier="disk", disk_path=str(work / "disk"), disk_size=disk_pages * entry)
    pool = Pool.create("sglhits", mem_pages * entry, **kw)
    backend = make_backend(host, "mha", "sglhits", "mooncake-trace")
    hit = total = 0
    t = time.perf_counter()
    try:
        for ids in reqs:
            keys = [f"{b:064x}" for b in ids]
            total += len(keys)
            found = 0
            for s in range(0, len(keys), BATCH):  # SGLang's _storage_hit_query
                batch = keys[s : s + BATCH]
                n = backend.batch_exists(batch)
                found += n
                if n < len(batch):
                    break
            idx = host.alloc(len(keys) * TRACE_PAGE)
            loaded = 0
            for s in range(0, found, BATCH):
                got = backend.batch_get_v1(keys[s : min(found, s + BATCH)], idx[s * TRACE_PAGE : min(found, s + BATCH)
                                                                             * TRACE_PAGE])
                lead = next((i for i, ok in enumerate(got) if not ok), len(got))
                loaded += lead
                if lead < len(got):
                    break
            hit += loaded
            for s in range(loaded, len(keys), BATCH):  # write back what was computed
                backend.batch_set_v1(keys[s : s + BATCH], idx[s * TRACE_PAGE : min(len(keys), s + BATCH) * TRACE_PAGE])
            host.free(idx)
        secs = time.perf_counter() - t
        stats = dict(backend.stats)
    finally:
        backend.close()
        pool.close()
        Pool.unlink("sglhits")
        if disk_pages:
            from cortex_cache.disklog import DiskLog

            DiskLog.destroy(str(work / "disk"))
    return {"hit_rate": hit / max(total, 1), "pages": total, "seconds": secs, "stats": stats}


def hit_rates(trace: Path, quick: bool) -> dict:
    reqs = load_trace(trace, 1000 if quick else None)
    mem, disk = 2000, 18000
    work = Path(tempfile.mkdtemp(prefix="ccbench-sglang-tier-"))
    try:
        memory_only = replay(reqs, mem, 0, work)
        print("  hit rate: memory only done", file=sys.stderr, flush=True)
        with_disk = replay(reqs, mem, disk, work)
        print("  hit rate: with disk done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"trace": trace.name, "requests": len(reqs), "memory_pages": mem, "disk_pages": disk,
            "memory_only": memory_only, "memory_disk": with_disk,
            "lru_memory": exact_lru(reqs, mem), "lru_memory_disk": exact_lru(reqs, mem + disk),
            "unbounded": exact_lru(reqs, None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds, the first 1,000 requests of the trace")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--trace", type=Path, default=os.environ.get("CORTEX_BENCH_MOONCAKE_TRACE")
                    or Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl",
                    help="the Mooncake multi-turn trace (mooncake_synthetic_trace.jsonl)")
    args = ap.parse_args()
    out: dict = {"throughput": throughput(3 if args.quick else 8)}
    t = out["throughput"]
    print(f"\nSGLang HiCache L3, {t['page_bytes'] >> 10} KiB pages (64 tokens x 24 layers x 2 KV heads x 64, bf16), "
          f"batches of {t['batch']}, {t['rounds']} rounds; GB/s median [min-max]")
    for name, r in t["results"].items():
        s, g = r["set_gbps"], r["get_gbps"]
        print(f"  {name:14} set {s['median']:6.2f} [{s['min']:.2f}-{s['max']:.2f}]   get {g['median']:6.2f} "
              f"[{g['min']:.2f}-{g['max']:.2f}]   loads exact: {'yes' if r['exact'] else 'NO'}")
    for name, r in t["ratios_vs_file"].items():
        print(f"  {name} / file: set {r['set']:.2f}x, get {r['get']:.2f}x")
    if args.trace and Path(args.trace).exists():
        h = out["hit_rate"] = hit_rates(Path(args.trace), args.quick)
        print(f"\n{h['trace']}, {h['requests']:,} requests replayed through the backend (pages of 512 tokens):")
        print(f"  memory ~{h['memory_pages']:,} pages:              hit rate {h['memory_only']['hit_rate']:.3f}"
              f"   (exact LRU of {h['memory_pages']:,}: {h['lru_memory']:.3f})")
        print(f"  memory + disk ~{h['disk_pages']:,} pages:      hit rate {h['memory_disk']['hit_rate']:.3f}"
              f"   (exact LRU of {h['memory_pages'] + h['disk_pages']:,}: {h['lru_memory_disk']:.3f})")
        print(f"  unbounded: {h['unbounded']:.3f}")
    else:
        out["hit_rate_skipped"] = "no trace: pass --trace or set CORTEX_BENCH_MOONCAKE_TRACE"
        print(f"\nhit rate not measured: {out['hit_rate_skipped']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
