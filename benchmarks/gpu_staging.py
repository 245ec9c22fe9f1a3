"""GPU staging check: correctness on a real GPU, then host<->device GB/s from a pool.

    python benchmarks/gpu_staging.py [--gib N] [--json PATH]

Needs CUDA (exits 69 without).  Runs in a few minutes on one GPU:

1. Checks (each asserts): store of CUDA tensors into the pool and load back
   (bit-exact); a preallocated output; gather/scatter between pool chunks and
   a paged KV cache `[2, num_blocks, block_size, num_heads, head_dim]` per
   layer; KVCache.store from CUDA KV and retrieve into a CUDA tensor;
   pinning registers and unregisters around close.
2. Bandwidth, host->device and device->host, for N GiB (default 4) moved in
   64 MiB pieces, from three kinds of host memory in the same run:
     pool (registered)   the pool's data region after cortex_cache.gpu.pin_memory
                         (cudaHostRegister): the copy engine reads the pool itself
     pageable            plain numpy memory (the driver stages it through a bounce buffer)
     torch pinned        torch.empty(pin_memory=True), the usual ceiling
   plus, end to end through the API: `load` (pin entries, H2D, release) and
   `store` (reserve, D2H into the pool, checksum, commit).
3. Paged KV cache: `store_blocks` (gather on the GPU + D2H + commit) and
   `load_blocks` (H2D + scatter) of 256-token chunks of a 32-layer,
   8-head, 128-dim fp16 cache.

Timings use CUDA events around each batch (median of 5 after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PIECE = 64 << 20


def timed(fn, reps: int = 5) -> float:
    """Median seconds of fn() measured with CUDA events (after one warm-up)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def wall(fn, reps: int = 5) -> float:
    """Median wall seconds of fn() (which must synchronise itself), after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def checks(Pool, gpu, KVCache, torch) -> list[str]:
    ok = []
    dev = torch.device("cuda")
    p = Pool.create("gpucheck", "1G")
    try:
        assert gpu.pin_memory(p) and gpu.is_pinned(p)
        xs = [torch.randn(1000, 257, device=dev), torch.arange(12345, device=dev, dtype=torch.int32)]
        gpu.store(p, ["x0", "x1"], xs, stream=torch.cuda.Stream()).wait()
        back = gpu.load(p, ["x0"], dtype=torch.float32, shape=(1000, 257)).wait()[0]
        assert back.device.type == "cuda" and torch.equal(back, xs[0])
        out = torch.empty(1, 12345, dtype=torch.int32, device=dev)
        gpu.load(p, ["x1"], dtype=torch.int32, shape=(12345,), out=out).wait()
        assert torch.equal(out[0], xs[1])
        ok.append("store/load of CUDA tensors through the pool: bit-exact (fresh and preallocated outputs)")
        t = gpu.entry_tensor(p, "x0", torch.float32, (1000, 257))
        assert torch.equal(t.to(dev), xs[0]) and p.info("x0")["pins"] == 1
        del t
        assert p.info("x0")["pins"] == 0
        ok.append("entry_tensor: zero-copy view, entry pinned while it lives")
        caches = [torch.randn(2, 64, 16, 8, 128, device=dev, dtype=torch.float16) for _ in range(4)]
        ids = torch.tensor([5, 9, 33, 2], device=dev)
        gpu.store_blocks(p, "chunk", caches, ids).wait()
        fresh = [torch.zeros_like(c) for c in caches]
        gpu.load_blocks(p, "chunk", fresh, [60, 61, 62, 63]).wait()
        torch.cuda.synchronize()
        assert all(torch.equal(f[:, 60 + k], c[:, int(ids[k])]) for f, c in zip(fresh, caches) for k in range(4))
        ok.append("store_blocks/load_blocks between a paged KV cache on the GPU and the pool: bit-exact")
        kvc = KVCache(p, model="check", num_layers=4, num_heads=8, head_dim=128, dtype=torch.bfloat16, chunk_tokens=64)
        tokens = torch.randint(0, 50000, (200,))
        kv = torch.randn(4, 2, 200, 8, 128, device=dev, dtype=torch.bfloat16)
        assert kvc.store(tokens, kv) == 192 and kvc.lookup(tokens) == 192
        o = torch.zeros(4, 2, 200, 8, 128, device=dev, dtype=torch.bfloat16)
        n, _ = kvc.retrieve(tokens, out=o)
        assert n == 192 and torch.equal(o[:, :, :192], kv[:, :, :192])
        ok.append("KVCache: store from CUDA KV, retrieve into a CUDA tensor: bit-exact")
    finally:
        p.close()  # unregisters before the unmap
        Pool.unlink("gpucheck")
    ok.append("close unregistered the pool's memory before unmapping it (no CUDA error)")
    return ok


def bandwidth(Pool, gpu, torch, gib: int) -> dict:
    import numpy as np

    n = (gib << 30) // PIECE
    dev = torch.device("cuda")
    res: dict = {}
    d_bufs = [torch.empty(PIECE, dtype=torch.uint8, device=dev) for _ in range(n)]
    for d in d_bufs:
        d.random_(0, 255)

    def pair(host_pieces, label):
        def h2d():
            for h, d in zip(host_pieces, d_bufs):
                d.copy_(h, non_blocking=True)

        def d2h():
            for h, d in zip(host_pieces, d_bufs):
                h.copy_(d, non_blocking=True)

        res[f"{label}_h2d_gbps"] = n * PIECE / timed(h2d) / 1e9
        res[f"{label}_d2h_gbps"] = n * PIECE / timed(d2h) / 1e9

    # pageable
    page = torch.from_numpy(np.ones(n * PIECE, dtype=np.uint8))
    pair(list(page.split(PIECE)), "pageable")
    del page
    # torch pinned
    pinned = torch.empty(n * PIECE, dtype=torch.uint8, pin_memory=True)
    pair(list(pinned.split(PIECE)), "torch_pinned")
    del pinned
    # the pool, registered
    p = Pool.create("gpubw", n * PIECE + (256 << 20), block_size=1 << 20)
    try:
        gpu.pin_memory(p)
        keys = [f"piece{i}" for i in range(n)]
        gpu.store(p, keys, d_bufs).wait()
        # Raw copies over the entries' bytes (no API around them; D2H here overwrites
        # sealed values, which is fine for a pool deleted right after).
        views = [gpu.entry_tensor(p, k, torch.uint8, (PIECE,)) for k in keys]
        pair(views, "pool_registered")
        del views
        outs = [torch.empty(PIECE, dtype=torch.uint8, device=dev) for _ in range(n)]
        res["pool_load_api_gbps"] = n * PIECE / wall(lambda: gpu.load(p, keys, dtype=torch.uint8, shape=(PIECE,),
                                                                          out=outs).wait()) / 1e9
        res["pool_store_api_gbps"] = n * PIECE / wall(lambda: gpu.store(p, keys, d_bufs).wait()) / 1e9
        res["pool_bytes"] = n * PIECE
    finally:
        p.close()
        Pool.unlink("gpubw")
    p = Pool.create("gpubw2", n * PIECE + (256 << 20), block_size=1 << 20)
    try:  # the same pool memory unregistered: what pinning buys
        keys = [f"piece{i}" for i in range(n)]
        gpu.store(p, keys, d_bufs).wait()
        views = [gpu.entry_tensor(p, k, torch.uint8, (PIECE,)) for k in keys]
        pair(views, "pool_unregistered")
        del views
    finally:
        p.close()
        Pool.unlink("gpubw2")
    return res


def paged(Pool, gpu, torch, chunks: int) -> dict:
    dev = torch.device("cuda")
    layers, blocks, bs, heads, hd = 32, 4096, 16, 8, 128
    caches = [torch.randn(2, blocks, bs, heads, hd, device=dev, dtype=torch.float16) for _ in range(layers)]
    per_chunk = 256 // bs
    chunk_bytes = layers * 2 * 256 * heads * hd * 2
    p = Pool.create("gpupaged", chunks * chunk_bytes + (512 << 20), block_size=1 << 20)
    try:
        gpu.pin_memory(p)
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = [torch.randperm(blocks, generator=g)[:per_chunk].to(dev) for _ in range(chunks)]

        def store_all():
            trs = [gpu.store_blocks(p, f"c{i}", caches, ids[i]) for i in range(chunks)]
            for t in trs:
                t.wait()

        def load_all():
            trs = [gpu.load_blocks(p, f"c{i}", caches, ids[(i + 1) % chunks]) for i in range(chunks)]
            for t in trs:
                t.wait()
            torch.cuda.synchronize()

        def gather_only():
            for i in range(chunks):
                gpu.gather_blocks(caches, ids[i])

        s_store = wall(store_all, reps=3)
        s_load = wall(load_all, reps=3)
        s_gather = timed(gather_only, reps=3)
    finally:
        p.close()
        Pool.unlink("gpupaged")
    total = chunks * chunk_bytes
    return {"chunk_bytes": chunk_bytes, "chunks": chunks, "store_blocks_gbps": total / s_store / 1e9,
            "load_blocks_gbps": total / s_load / 1e9, "gather_on_gpu_gbps": total / s_gather / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=int, default=4, help="GiB moved per bandwidth measurement (default 4)")
    ap.add_argument("--chunks", type=int, default=64, help="256-token chunks in the paged-cache measurement")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    os.environ.setdefault("CORTEX_CACHE_SHM_PREFIX", f"ccgpu-{os.getpid()}.")
    import torch

    from cortex_cache import KVCache, Pool, gpu

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 69
    st = os.statvfs("/dev/shm")
    shm_free = st.f_bavail * st.f_frsize
    gib = max(1, min(args.gib, int(shm_free * 0.4) >> 30))
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "gib": gib,
           "shm_free_gib": round(shm_free / 2**30, 1)}
    print(f"{out['device']}, torch {out['torch']}, /dev/shm free {out['shm_free_gib']} GiB", flush=True)
    failed = 0
    try:
        out["checks"] = checks(Pool, gpu, KVCache, torch)
    except Exception:  # report and go on to the measurements: device time is short
        import traceback

        traceback.print_exc()
        out["checks"], failed = ["FAILED"], 1
    for c in out["checks"]:
        print("ok:", c, flush=True)
    out["bandwidth"] = bw = bandwidth(Pool, gpu, torch, gib)
    print(f"\nhost<->device, {gib} GiB in 64 MiB copies, GB/s (median of 5)")
    print(f"  {'host memory':28} {'H2D':>7} {'D2H':>7}")
    for label, name in (("pool_registered", "pool, cudaHostRegister'ed"), ("pool_unregistered", "pool, not registered"),
                        ("torch_pinned", "torch pin_memory=True"), ("pageable", "pageable numpy")):
        print(f"  {name:28} {bw[label + '_h2d_gbps']:7.1f} {bw[label + '_d2h_gbps']:7.1f}")
    print(f"  API: load (pin, H2D, release) {bw['pool_load_api_gbps']:.1f}; "
          f"store (reserve, D2H, checksum, commit) {bw['pool_store_api_gbps']:.1f}", flush=True)
    chunks = max(4, min(args.chunks, int(shm_free * 0.3) // (32 * 2 * 256 * 8 * 128 * 2)))
    out["paged"] = pg = paged(Pool, gpu, torch, chunks)
    print(f"\npaged KV cache (32 layers, 16-token blocks, 8 heads x 128, fp16), {chunks} chunks of 256 tokens "
          f"({pg['chunk_bytes'] >> 20} MiB each), GB/s")
    print(f"  store_blocks (gather + D2H + checksum + commit) {pg['store_blocks_gbps']:.1f}; "
          f"load_blocks (H2D + scatter) {pg['load_blocks_gbps']:.1f}; gather alone on the GPU "
          f"{pg['gather_on_gpu_gbps']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return failed


if __name__ == "__main__":
    sys.exit(main())
