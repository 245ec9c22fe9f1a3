"""LMCache's local CPU backend as a peer of bench_peers.py (run under a Python that has LMCache).

    PYTHON_WITH_LMCACHE benchmarks/lmcache_peer.py SIZE OPS KEYS ROUNDS
    PYTHON_WITH_LMCACHE benchmarks/lmcache_peer.py --serve SIZE KEYS

Prints one JSON line: a list of rounds, each {"put_s", "get_s", "ops"}.
With --serve it puts KEYS values once, prints "ready", then for each line
OPS read from stdin times OPS gets (get+copy, cycling over the KEYS keys) and
prints the seconds; an empty line or end of input stops it.  bench_peers.py
uses it to alternate LMCache's bursts with cortex's in one run.  --serve
runs torch's copies on one thread, as cortex's get_into runs on one: with
torch's default (one per core) on a busy 2-core machine a burst's time
swung 10-50x with the OpenMP threads' waits for each other.  It imports
nothing of cortex_cache, so which checkout's code is measured is decided by
the cortex side alone.

LMCache (0.5.x) on a CPU-only machine: `LocalCPUBackend` with its mixed
memory allocator, driven as its storage manager drives it:
  put  allocate a MemoryObj, copy the value in, submit_put_task, drop our reference
  get  get_blocking, copy the value out into a caller's buffer, drop the reference
Each round puts OPS values under fresh keys (a backend put of a key it holds
is not a replacement), then gets KEYS of them OPS times over, then removes
them.  Install (CPU): torch==2.13.0 first, then `pip install --no-deps
lmcache==0.5.6` and its requirements without the CUDA-only ones (cupy,
cuda-python, cufile-python).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


def backend(size: int, n_values: int):
    """LMCache's LocalCPUBackend with room for n_values values of size bytes."""
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    logging.getLogger("lmcache").setLevel(logging.WARNING)
    need_gb = n_values * size * 1.3 / 2**30 + 0.25
    cfg = LMCacheEngineConfig.from_defaults(local_cpu=True, max_local_cpu_size=need_gb, chunk_size=256)
    md = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.uint8, kv_shape=(1, 2, 256, 1, 8))
    return LocalCPUBackend(cfg, metadata=md)


def serve(size: int, n_keys: int) -> int:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    torch.set_num_threads(1)
    be = backend(size, n_keys)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.empty(size, dtype=torch.uint8)
    keys = [CacheEngineKey(model_name="bench", world_size=1, worker_id=0, chunk_hash=i, dtype=torch.uint8)
            for i in range(n_keys)]
    try:
        for k in keys:
            obj = be.allocate(torch.Size([size]), torch.uint8, fmt=MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache's allocator returned no memory")
            obj.tensor.copy_(src)
            be.submit_put_task(k, obj)
            obj.ref_count_down()
        print("ready", flush=True)
        for line in sys.stdin:
            if not line.strip():
                break
            ops = int(line)
            t = time.perf_counter()
            for i in range(ops):
                obj = be.get_blocking(keys[i % n_keys])
                dst.copy_(obj.tensor)
                obj.ref_count_down()
            secs = time.perf_counter() - t
            if not torch.equal(dst, src):
                raise RuntimeError("LMCache returned different bytes")
            print(secs, flush=True)
        for k in keys:
            be.remove(k)
    finally:
        be.close()
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        return serve(int(sys.argv[2]), int(sys.argv[3]))
    size, ops, n_keys, rounds = (int(a) for a in sys.argv[1:5])
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    be = backend(size, ops)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.empty(size, dtype=torch.uint8)
    shape = torch.Size([size])
    runs = []
    try:
        for r in range(rounds + 1):  # the first round warms up
            keys = [CacheEngineKey(model_name="bench", world_size=1, worker_id=0, chunk_hash=(r << 40) | i,
                                   dtype=torch.uint8) for i in range(ops)]
            t = time.perf_counter()
            for k in keys:
                obj = be.allocate(shape, torch.uint8, fmt=MemoryFormat.KV_2LTD)
                if obj is None:
                    raise RuntimeError("LMCache's allocator returned no memory")
                obj.tensor.copy_(src)
                be.submit_put_task(k, obj)
                obj.ref_count_down()
            put_s = time.perf_counter() - t
            hot = keys[: max(1, min(n_keys, ops))]
            t = time.perf_counter()
            for i in range(ops):
                obj = be.get_blocking(hot[i % len(hot)])
                dst.copy_(obj.tensor)
                obj.ref_count_down()
            get_s = time.perf_counter() - t
            if not torch.equal(dst, src):
                raise RuntimeError("LMCache returned different bytes")
            for k in keys:
                be.remove(k)
            if r:
                runs.append({"put_s": put_s, "get_s": get_s, "ops": ops})
    finally:
        be.close()
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
