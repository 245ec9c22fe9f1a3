"""One vLLM offloading process for the CortexTier tests: run in the vLLM venv (scripts/vllm_venv.sh).

    python tests/vllm_tier.py store POOL FIRST N      store chunks FIRST..FIRST+N-1 and exit
    python tests/vllm_tier.py promote POOL FIRST N    promote them into a fresh primary region, compare bytes
    python tests/vllm_tier.py hang POOL FIRST N       store, but stop for good once the copies are in the pool

Each process drives vLLM's own TieringOffloadingManager over vLLM's CPU
primary tier (a real SharedOffloadRegion in /dev/shm) with a CortexTier made
by vLLM's SecondaryTierFactory from its module path -- the calls vLLM's
scheduler makes, in its order -- and prints one JSON line.  Chunk i's bytes
and key are a function of i alone, so processes agree on both.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import uuid

import numpy as np

ROW = 8192  # bytes per chunk (a page multiple, as vLLM's region wants)
SLOTS = 16


def chunk_bytes(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, ROW, dtype=np.uint8)


def build(pool: str):
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

    region = SharedOffloadRegion(engine_id=f"cctest-{uuid.uuid4().hex}", num_chunks=SLOTS, rank=None,
                                 kv_bytes_per_chunk=ROW, cpu_page_size=ROW)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=SLOTS, mmap_region=region)
    spec = type("Spec", (), {})()  # vLLM's own tests pass a stand-in spec; the tier needs "model" then
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "CortexTier", "module_path": "cortex_cache.integrations.vllm", "pool": pool, "model": "tiny"},
        primary.get_kv_memoryview(), spec)
    print(f"region {region.mmap_path}", flush=True)  # a killed process leaves it behind: the test removes it
    return TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier]), tier


def write_rows(manager, slots, chunks) -> None:
    """What the GPU->CPU copy would have written into the primary region."""
    rows = np.frombuffer(manager.primary_tier.get_kv_memoryview(), np.uint8).reshape(SLOTS, ROW)
    for slot, i in zip(slots, chunks):
        rows[slot] = chunk_bytes(i)


def rows_equal(manager, slots, chunks) -> list[bool]:
    rows = np.frombuffer(manager.primary_tier.get_kv_memoryview(), np.uint8).reshape(SLOTS, ROW)
    return [bool(np.array_equal(rows[slot], chunk_bytes(i))) for slot, i in zip(slots, chunks)]


def keys_of(first: int, n: int) -> list:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(hashlib.sha256(b"chunk %d" % i).digest(), 0) for i in range(first, first + n)]


def end_step(manager) -> None:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))


def store(pool: str, first: int, n: int) -> dict:
    from vllm.v1.kv_offload.base import ReqContext

    manager, tier = build(pool)
    ctx = ReqContext(req_id="store")
    keys = keys_of(first, n)
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    write_rows(manager, out.store_spec.chunk_ids, range(first, first + n))
    manager.complete_store(keys, ctx, success=True)  # cascades to the tier (on its threads)
    tier.drain_jobs()
    end_step(manager)
    end_step(manager)  # the first end of step may have skipped its poll (vLLM polls once per step)
    manager.on_request_finished(ctx)
    result = {"pending": manager.has_pending_work(), "stats": tier.stats}
    manager.shutdown()
    return result


def promote(pool: str, first: int, n: int) -> dict:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    manager, tier = build(pool)
    ctx = ReqContext(req_id="promote")
    keys = keys_of(first, n)
    manager.on_new_request(ctx)
    before = [manager.lookup(k, ctx).name for k in keys]  # a tier hit starts a promotion
    end_step(manager)  # submits it
    tier.drain_jobs()
    after = [manager.lookup(k, ctx).name for k in keys]
    hits = [k for k in keys if manager.lookup(k, ctx) is LookupResult.HIT]
    equal = []
    if hits:
        spec = manager.prepare_load(hits, ctx)
        equal = rows_equal(manager, spec.chunk_ids, [first + keys.index(k) for k in hits])
        manager.complete_load(hits, ctx)
    end_step(manager)
    manager.on_request_finished(ctx)
    result = {"before": before, "after": after, "equal": equal, "stats": tier.stats}
    manager.shutdown()
    return result


def hang(pool: str, first: int, n: int) -> None:
    from cortex_cache import gpu

    def stop(self):  # the copies are in the pool, uncommitted: now kill me
        print("copied", flush=True)
        threading.Event().wait()

    gpu.Transfer.wait = stop
    store(pool, first, n)


if __name__ == "__main__":
    cmd, pool, first, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if cmd == "hang":
        hang(pool, first, n)
    else:
        print("RESULT " + json.dumps({"store": store, "promote": promote}[cmd](pool, first, n)), flush=True)
