"""Drive the cortex HiCache backend with SGLang's real classes; run by the SGLang venv's Python.

    python tests/sglang_harness.py '[["SCENARIO", {ARGS}], ...]'    (prints a JSON list of results)

tests/test_sglang.py runs them with CORTEX_TEST_SGLANG_PYTHON, in a few
processes (pages really cross processes; SGLang takes ~15 s to import).  The backend is made
exactly as SGLang's cache controller makes it: `StorageBackendFactory.
create_backend("dynamic", HiCacheStorageConfig(..., extra_config=<the JSON
of the docs>), host_pool)` and then `register_mem_pool_host(host_pool)`; the
host pools are SGLang's own MHATokenToKVPoolHost / MLATokenToKVPoolHost,
built on the CPU over CPU "device" buffers (as SGLang's CPU unit tests do).
"""

from __future__ import annotations

import enum
import importlib.machinery
import json
import os
import sys
import time
import types

PAGE = 16  # tokens per page
LAYERS = 4


def _torchvision_stand_in() -> None:
    """SGLang's model-config package imports torchvision for two multimodal constants.

    The registry's torchvision needs CUDA torch and cannot load beside the
    CPU build; the HiCache path never uses it.  transformers treats a module
    without a file or version as absent, so it stays off its own torchvision
    paths.
    """
    try:
        import torchvision  # noqa: F401
        return
    except Exception:
        sys.modules.pop("torchvision", None)
    import sglang  # noqa: F401  (its transformers patches must see no torchvision)

    def module(name: str) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = m
        return m

    tv, tr, fn = module("torchvision"), module("torchvision.transforms"), module("torchvision.transforms.functional")
    InterpolationMode = enum.Enum("InterpolationMode", {"NEAREST": "nearest", "BILINEAR": "bilinear",
                                                        "BICUBIC": "bicubic"})
    fn.InterpolationMode = tr.InterpolationMode = InterpolationMode
    tr.functional, tv.transforms = fn, tr


_torchvision_stand_in()

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import cortex_cache.integrations.pools as cortex_pools  # noqa: E402
import cortex_cache.integrations.sglang as cortex_sglang  # noqa: E402
from cortex_cache import Pool  # noqa: E402

cortex_pools.REATTACH_EVERY = 0.0  # tests look again at once instead of waiting a second


def make_host(kind: str, layout: str = "page_first", pages: int = 16, layers: int = LAYERS, heads: int = 2,
              head_dim: int = 16, dtype: torch.dtype = torch.bfloat16, page_size: int = PAGE):
    """A real SGLang host KV pool of `pages` pages (plus SGLang's padding page), on the CPU."""
    n = pages * page_size
    cpu = torch.device("cpu")
    common = dict(host_to_device_ratio=1.0, host_size=0, page_size=page_size, layout=layout, pin_memory=False,
                  device="cpu", device_capacity_tokens=n, start_layer=0, end_layer=layers)
    if kind == "mha":
        k = tuple(torch.zeros(n, heads, head_dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(n, heads, head_dim, dtype=dtype) for _ in range(layers))
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
        info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                               layout=KVBufferLayout.NHD),
                             page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
                             device=cpu)
        host = MHATokenToKVPoolHost(info, **common)
        host._device_keepalive = (k, v)
        return host
    lora, rope = 4 * head_dim, head_dim
    bufs = tuple(torch.zeros(n, 1, lora + rope, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64),
                         layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
                         kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope, dtype=dtype, device=cpu)
    host = MLATokenToKVPoolHost(info, target_layer_num=layers, **common)
    host._device_keepalive = bufs
    return host


def storage_config(kind: str, model: str, extra: dict, tp_rank: int = 0, tp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=kind == "mla", enable_storage_metrics=True,
                                is_page_first_layout=True, model_name=model, extra_config=extra)


def extra_config(pool: str, v1: bool = True, **more) -> dict:
    return {"backend_name": "cortex", "module_path": "cortex_cache.integrations.sglang",
            "class_name": "CortexHiCacheStorage", "interface_v1": int(v1), "pool": pool, **more}


def make_backend(host, kind: str, pool: str, model: str = "Qwen/Qwen3-0.6B", v1: bool = True, tp_rank: int = 0,
                 tp_size: int = 1, **more):
    """The backend as SGLang's cache controller makes it (attach_storage_backend)."""
    cfg = storage_config(kind, model, extra_config(pool, v1, **more), tp_rank, tp_size)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    return backend


def page_hashes(n: int, salt: str = "") -> list[str]:
    """SGLang's own page hashes of a made-up prompt of n pages."""
    from sglang.srt.mem_cache.utils import get_hash_str

    seed = sum(ord(c) * 131**j for j, c in enumerate(salt))
    tokens = [(i * 7919 + seed) % 32000 for i in range(n * PAGE)]
    prior, out = None, []
    for p in range(n):
        prior = get_hash_str(tokens[p * PAGE : (p + 1) * PAGE], prior)
        out.append(prior)
    return out


def fill(host, seed: int) -> None:
    """Seeded random KV in every slot of the host pool."""
    g = torch.Generator().manual_seed(seed)
    buf = host.kv_buffer
    buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float32).to(buf.dtype))


def page(host, index: int) -> torch.Tensor:
    return host.get_data_page(int(index), flat=True).clone()


def store(backend, host, keys: list[str], v1: bool, indices: torch.Tensor) -> list[bool]:
    """Store pages as SGLang's controller does (_page_set_zero_copy / _generic_page_set)."""
    if v1:
        return backend.batch_set_v1(keys, indices)
    data = [host.get_data_page(indices[i * PAGE]) for i in range(len(keys))]
    return [backend.batch_set(keys, data)] * len(keys)


def load(backend, host, keys: list[str], v1: bool, indices: torch.Tensor) -> list[bool]:
    """Load pages as SGLang's controller does (_page_get_zero_copy / _generic_page_get)."""
    if v1:
        return list(backend.batch_get_v1(keys, indices))
    got = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    out = []
    for i, data in enumerate(got):
        if data is None:
            out += [False] * (len(keys) - i)
            break
        host.set_from_flat_data_page(indices[i * PAGE], data)
        out.append(True)
    return out


def counters(backend) -> dict:
    inner = getattr(backend, "_backend", backend)  # under SGLang's failure injector
    return dict(inner.stats)


# ---------------------------------------------------------------------- scenarios


def copy_threads(a: dict) -> None:
    """With "parallel", every batch of more than one page goes through the backend's copy threads."""
    cortex_sglang._PARALLEL_BYTES = 0 if a.get("parallel") else 4 << 20


def scenario_set(a: dict) -> dict:
    copy_threads(a)
    host = make_host(a["kind"], a.get("layout", "page_first"))
    fill(host, a["seed"])
    backend = make_backend(host, a["kind"], a["pool"], a.get("model", "Qwen/Qwen3-0.6B"), a["v1"],
                           a.get("tp_rank", 0), a.get("tp_size", 1))
    keys = page_hashes(a["pages"], a.get("salt", ""))
    idx = host.alloc(a["pages"] * PAGE)
    res = store(backend, host, keys, a["v1"], idx)
    again = store(backend, host, keys, a["v1"], idx)  # already there: not copied again
    out = {"stored": res, "again": again, "stats": counters(backend), "cls": type(backend).__name__,
           "key_prefix": getattr(backend, "_backend", backend).key_prefix}
    backend.close()
    return out


def scenario_get(a: dict) -> dict:
    """Load pages stored by another process into other host slots; compare with what it stored."""
    copy_threads(a)
    kind, layout = a["kind"], a.get("layout", "page_first")
    expected = make_host(kind, layout)
    fill(expected, a["seed"])
    want_idx = expected.alloc(a["pages"] * PAGE)
    host = make_host(kind, layout)
    host.alloc(3 * PAGE)  # load into other slots than the writer's
    idx = host.alloc(a["pages"] * PAGE)
    backend = make_backend(host, kind, a["pool"], a.get("model", "Qwen/Qwen3-0.6B"), a["v1"], a.get("tp_rank", 0),
                           a.get("tp_size", 1))
    keys = page_hashes(a["pages"], a.get("salt", ""))
    missing = page_hashes(2, "never stored")
    exists = backend.batch_exists(keys + missing)
    exists_gap = backend.batch_exists(keys[:2] + missing + keys[2:])
    loaded = load(backend, host, keys, a["v1"], idx)
    exact = [bool(torch.equal(page(host, idx[i * PAGE]), page(expected, want_idx[i * PAGE]))) for i in range(len(keys))]
    out = {"exists": exists, "exists_gap": exists_gap, "loaded": loaded, "exact": exact, "stats": counters(backend),
           "single": backend.exists(keys[0]) if keys else None,
           "key_prefix": getattr(backend, "_backend", backend).key_prefix}
    if not a["v1"] and len(keys) >= 2:
        # The flat interface answers for every key of a batch: a miss in the middle, the hit after it loaded.
        gap = backend.batch_get([keys[0], missing[0], keys[1]], [host.get_dummy_flat_data_page() for _ in range(3)])
        out["flat_gap"] = [t is not None for t in gap]
        out["flat_gap_exact"] = gap[2] is not None and bool(torch.equal(gap[2], page(expected, want_idx[PAGE])))
    backend.close()
    return out


def scenario_hang_mid_set(a: dict) -> dict:
    """Store two pages in one batch, then the other three in another and stop there, its pages reserved
    and the first half-copied: the test kills us there."""
    real = Pool.reserve_write_many

    def reserve_then_hang(self, *args, **kw):
        ws = real(self, *args, **kw)
        if len(ws) == 3:
            w = ws[0]
            w.memoryview[: w.nbytes // 2] = b"\xab" * (w.nbytes // 2)  # half written, never committed
            print("mid-set", flush=True)
            time.sleep(120)
        return ws

    Pool.reserve_write_many = reserve_then_hang
    copy_threads(a)
    host = make_host(a["kind"], a.get("layout", "page_first"))
    fill(host, a["seed"])
    backend = make_backend(host, a["kind"], a["pool"], a.get("model", "Qwen/Qwen3-0.6B"), a["v1"])
    keys = page_hashes(a["pages"], a.get("salt", ""))
    idx = host.alloc(a["pages"] * PAGE)
    stored = store(backend, host, keys[:2], a["v1"], idx[: 2 * PAGE])
    assert stored == [True, True], stored
    store(backend, host, keys[2:], a["v1"], idx[2 * PAGE :])
    return {}


def scenario_injected_failures(a: dict) -> dict:
    """SGLang's own failure injection around our backend: whatever it returns must be right."""
    os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"] = "0.3"
    os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"] = "0.001"
    kind = a["kind"]
    src = make_host(kind)
    fill(src, 7)
    writer = make_backend(src, kind, a["pool"])
    dst = make_host(kind)
    reader = make_backend(dst, kind, a["pool"])
    keys = page_hashes(8, "inject")
    sidx, didx = src.alloc(8 * PAGE), dst.alloc(8 * PAGE)
    wrong = 0
    truth = [False] * 8
    for _ in range(30):
        for i, ok in enumerate(writer.batch_set_v1(keys, sidx)):
            truth[i] = truth[i] or ok
        n = reader.batch_exists(keys)
        lead = next((i for i, t in enumerate(truth) if not t), 8)
        wrong += n > lead
        dst.kv_buffer.zero_()
        for i, ok in enumerate(reader.batch_get_v1(keys, didx)):
            if ok and not torch.equal(page(dst, didx[i * PAGE]), page(src, sidx[i * PAGE])):
                wrong += 1
    return {"wrapped": type(writer).__name__, "inner": type(writer._backend).__name__, "wrong": wrong,
            "stored_any": any(truth)}


def scenario_faults(a: dict) -> dict:
    """Our own faults, in one process: pool deleted under the backend, pool full, page damaged in place."""
    from cortex_cache.errors import KeyNotFound

    kind, name = a["kind"], a["pool"]
    out: dict = {}
    src = make_host(kind)
    fill(src, 11)
    dst = make_host(kind)
    backend = make_backend(src, kind, name)
    reader = make_backend(dst, kind, name)
    keys = page_hashes(4, "faults")
    sidx, didx = src.alloc(4 * PAGE), dst.alloc(4 * PAGE)
    out["stored"] = backend.batch_set_v1(keys, sidx)

    # A page damaged in place (a stray write into shared memory): a miss, wiped from SGLang's buffer.
    p = Pool.open(name)
    info = p.info(reader.key_prefix + keys[1])
    off = p.geometry.data_off + info["first_block"] * p.geometry.block_size + cortex_sglang.HEADER_SIZE + 5
    from cortex_cache import segment

    with open(segment.shm_path(name), "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    dst.kv_buffer.fill_(1)
    out["corrupt_loaded"] = reader.batch_get_v1(keys, didx)
    out["corrupt_wiped"] = bool(torch.count_nonzero(page(dst, didx[1 * PAGE])).item() == 0)
    out["corrupt_first_exact"] = bool(torch.equal(page(dst, didx[0]), page(src, sidx[0])))
    # A value copied under another page's key is not that page.
    p.put(reader.key_prefix + keys[2], p.get(reader.key_prefix + keys[0]))
    out["moved_exists"] = reader.batch_exists([keys[0], keys[2]])
    p.close()

    # The pool deleted under a running SGLang (cortex cache delete --force): misses, no exception.
    Pool.unlink(name)
    out["deleted_exists"] = reader.batch_exists(keys)
    out["deleted_get"] = reader.batch_get_v1(keys, didx)
    out["deleted_set"] = backend.batch_set_v1(keys, sidx)
    # ... and once a pool of that name exists again, both use it.
    again = Pool.create(name, a["size"])
    out["recreated_set"] = backend.batch_set_v1(keys, sidx)
    dst.kv_buffer.zero_()
    out["recreated_get"] = reader.batch_get_v1(keys, didx)
    out["recreated_exact"] = all(torch.equal(page(dst, didx[i * PAGE]), page(src, sidx[i * PAGE])) for i in range(4))

    # Full: every entry pinned by readers, so nothing can be evicted to make room.
    views = []
    for k in again.keys():
        try:
            views.append(again.view(k))
        except KeyNotFound:
            pass
    filler = 0
    while True:
        try:
            again.put(f"filler/{filler}", b"x" * (again.geometry.block_size * 4))
            views.append(again.view(f"filler/{filler}"))
            filler += 1
        except Exception:
            break
    more = page_hashes(2, "no room")
    out["full_set"] = backend.batch_set_v1(more, sidx[: 2 * PAGE])
    for v in views:
        v.release()
    out["after_full_set"] = backend.batch_set_v1(more, sidx[: 2 * PAGE])
    out["stats_writer"], out["stats_reader"] = counters(backend), counters(reader)
    backend.close()
    reader.close()
    again.close()
    return out


def scenario_too_small(a: dict) -> dict:
    """Pages larger than the whole pool (32 KiB of KV a page, a 16 KiB pool)."""
    host = make_host(a["kind"], layers=16)
    backend = make_backend(host, a["kind"], a["pool"])
    res = backend.batch_set_v1(page_hashes(2, "big"), host.alloc(2 * PAGE))
    out = {"stored": res, "stats": counters(backend)}
    backend.close()
    return out


def scenario_signatures(a: dict) -> dict:
    """The host-pool methods the backend calls, and the HiCacheStorage methods it overrides, as SGLang has them."""
    import inspect

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    cls = cortex_sglang.CortexHiCacheStorage
    mismatched = []
    for name in ("register_mem_pool_host", "batch_get_v1", "batch_set_v1", "batch_exists", "get", "set", "exists",
                 "batch_get", "batch_set", "clear", "get_stats"):
        theirs = list(inspect.signature(getattr(HiCacheStorage, name)).parameters)
        ours = list(inspect.signature(getattr(cls, name)).parameters)
        if theirs != ours:
            mismatched.append([name, theirs, ours])
    host_methods = {}
    for host_cls in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
        host_methods[host_cls.__name__] = {
            m: list(inspect.signature(getattr(host_cls, m)).parameters)
            for m in ("get_page_buffer_meta", "get_dummy_flat_data_page", "get_data_page", "set_from_flat_data_page")}
    return {"mismatched": mismatched, "host": host_methods, "abstract": sorted(getattr(cls, "__abstractmethods__", ()))}


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}

if __name__ == "__main__":
    print(json.dumps([SCENARIOS[name](args) for name, args in json.loads(sys.argv[1])]), flush=True)
