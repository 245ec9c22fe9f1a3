"""The connector's per-layer loads (integrations/vllm/layers.py) without vLLM: real pools, BlockStore and
PagedLayers, layer by layer, for every KV layout the GPU check covers, both ways a step runs on the CPU (layers
written at their wait; the CUDA way's pins, runs of layers and scatters, all at start)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

LAYERS, HEADS, TOKENS, CONTENT, BLOCKS = 5, 2, 16, 8, 24
LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "LBHNC/2")


@dataclass
class T:
    digests: list
    block_ids: list


def caches(layout: str, layers: int = LAYERS):
    """vLLM's per-layer views over one allocation in `layout`'s memory order (zeros), as gpu_check makes them."""
    if layout == "LBHNC":
        return list(torch.zeros(layers, BLOCKS, HEADS, TOKENS, CONTENT).unbind(0))
    if layout == "LBNHC":
        raw = torch.zeros(layers, BLOCKS, TOKENS, HEADS, CONTENT)
        return [raw[i].permute(0, 2, 1, 3) for i in range(layers)]
    if layout == "BLHNC":
        raw = torch.zeros(BLOCKS, layers, HEADS, TOKENS, CONTENT)
        return [raw[:, i] for i in range(layers)]
    raw = torch.zeros(layers, 2 * BLOCKS, HEADS, TOKENS // 2, CONTENT)  # kernel blocks of half a block
    return list(raw.unbind(0))


def _paged(layout: str, layers: int = LAYERS, seed: int | None = None):
    from cortex_cache.integrations.vllm.blocks import PagedLayers

    paged = PagedLayers(caches(layout, layers), BLOCKS)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for v in paged.views:
            v.copy_(torch.randn(v.shape, generator=g))
    return paged


def _store(pool, payload: int, verify: bool = True):
    from cortex_cache.integrations.vllm.blocks import BlockStore, Faults, PoolRef

    faults = Faults("test")
    ref = PoolRef(pool.name, {}, faults, retry_s=0.0)
    return BlockStore(ref, faults, namespace="vllm/", model="m", rank="pp0tp0", fingerprint=b"f" * 16,
                      payload_bytes=payload, block_tokens=TOKENS, verify=verify)


def _digests(start: int, n: int):
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    return prefix_digests(list(range(start, start + n * TOKENS)), TOKENS, b"layers")


def _layer(paged, i: int, ids) -> torch.Tensor:
    return paged.views[i][torch.tensor(list(ids))]


def _save(store, paged, digests, ids) -> None:
    rows = store.staging(len(ids), "cpu")
    paged.gather(ids, rows)
    assert store.save(digests, rows) == len(ids)


@pytest.mark.parametrize("by_runs", [False, True], ids=["at-each-wait", "cuda-way"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_by_layer_loads_are_exact(make_pool, layout, by_runs):
    from cortex_cache.integrations.vllm.layers import LayerLoads

    pool = make_pool("16M", block_size=4096)
    src = _paged("LBHNC/2" if layout == "LBHNC/2" else "LBHNC", seed=1)  # a kernel block split: its own bytes
    store = _store(pool, src.payload_bytes)
    a, b = _digests(0, 5), _digests(1000, 3)
    _save(store, src, a[:4], [3, 7, 1, 12])  # a's fifth block is not in the pool: a load error
    _save(store, src, b, [20, 5, 9])
    dst = _paged(layout)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    loads = LayerLoads(store, dst, names, by_runs=by_runs)
    errors = loads.start([T(a, [2, 4, 6, 8, 10]), T(b, [11, 13, 15])])
    assert errors == {10} and store.faults.stats["missing"] == 1 and store.faults.stats["loaded"] == 7
    for i, name in enumerate(names):
        loads.wait(name)
        for j in range(LAYERS):  # layers up to i are in; after it, only the CUDA way has written them yet
            there = torch.equal(_layer(dst, j, [2, 4, 6, 8, 11, 13, 15]), _layer(src, j, [3, 7, 1, 12, 20, 5, 9]))
            assert there == (j <= i or by_runs), (i, j)
    loads.finish()
    assert pool.stats()["pinned_entries"] == 0
    for j in range(LAYERS):
        assert torch.equal(_layer(dst, j, [2, 4, 6, 8, 11, 13, 15]), _layer(src, j, [3, 7, 1, 12, 20, 5, 9]))
        others = [k for k in range(BLOCKS) if k not in (2, 4, 6, 8, 11, 13, 15)]
        assert not _layer(dst, j, others).any()  # the load error's block 10 and every other block untouched


def _saved(make_pool, seed: int, n: int):
    """A pool, a source cache in LBHNC order (random, `seed`), its store, and the digests of its first `n`
    blocks, saved."""
    pool = make_pool("16M", block_size=4096)
    src = _paged("LBHNC", seed=seed)
    store = _store(pool, src.payload_bytes)
    d = _digests(0, n)
    _save(store, src, d, list(range(n)))
    return pool, src, store, d


@pytest.mark.parametrize("by_runs", [False, True], ids=["at-each-wait", "cuda-way"])
def test_an_unknown_layer_name_or_the_steps_end_writes_every_layer(make_pool, by_runs):
    from cortex_cache.integrations.vllm.layers import LayerLoads

    pool, src, store, d = _saved(make_pool, 2, 2)
    for ending in ("unknown", "finish"):
        dst = _paged("LBHNC")
        loads = LayerLoads(store, dst, [f"l{i}" for i in range(LAYERS)], by_runs=by_runs)
        assert loads.start([T(d, [5, 6])]) == set()
        if ending == "unknown":
            loads.wait("not.a.layer.of.ours")
        else:
            loads.finish()
        assert all(torch.equal(_layer(dst, j, [5, 6]), _layer(src, j, [0, 1])) for j in range(LAYERS))
        loads.finish()
    assert pool.stats()["pinned_entries"] == 0


@pytest.mark.parametrize("by_runs", [False, True], ids=["at-each-wait", "cuda-way"])
def test_a_corrupt_block_ends_the_load_and_is_reported(make_pool, by_runs):
    from cortex_cache.integrations.vllm.layers import LayerLoads

    pool, src, store, d = _saved(make_pool, 3, 3)
    off = pool.info(store.key(d[1]))["first_block"] * pool.geometry.block_size + pool.geometry.data_off
    pool.core.mv[off + 100] ^= 0xFF  # a flipped byte the checksum catches (as a bad disk would make)
    dst = _paged("LBHNC")
    loads = LayerLoads(store, dst, [f"l{i}" for i in range(LAYERS)], by_runs=by_runs)
    assert loads.start([T(d, [7, 8, 9])]) == {8, 9}
    loads.finish()
    assert store.faults.stats["corrupt"] == 1 and store.key(d[1]) not in pool
    assert all(torch.equal(_layer(dst, j, [7]), _layer(src, j, [0])) for j in range(LAYERS))
    assert not any(_layer(dst, j, [8, 9]).any() for j in range(LAYERS))
    assert pool.stats()["pinned_entries"] == 0


@pytest.mark.parametrize("by_runs", [False, True], ids=["at-each-wait", "cuda-way"])
def test_a_hybrid_models_groups_layer_by_layer(make_pool, by_runs):
    from cortex_cache.integrations.vllm.groups import PagedGroups
    from cortex_cache.integrations.vllm.layers import LayerLoads

    pool = make_pool("16M", block_size=4096)
    src = PagedGroups([_paged("LBHNC", 2, seed=4), _paged("LBNHC", 3, seed=5)])
    store = _store(pool, src.payload_bytes)
    d = _digests(0, 3)
    rows = store.staging(3, "cpu")
    src.gather([(1, 4), (2, 5), (3, 6)], rows)
    assert store.save(d, rows) == 3
    dst = PagedGroups([_paged("LBHNC", 2), _paged("BLHNC", 3)])
    names = ["full.0", "full.1", "swa.0", "swa.1", "swa.2"]
    loads = LayerLoads(store, dst, names, by_runs=by_runs)
    # The windowed group's first position is outside its window: vLLM's null block, never written.
    assert loads.start([T(d, [(10, 0), (11, 12), (13, 14)])]) == set()
    loads.wait("full.0")
    assert torch.equal(_layer(dst.groups[0], 0, [10, 11, 13]), _layer(src.groups[0], 0, [1, 2, 3]))
    assert by_runs or not _layer(dst.groups[1], 0, [12, 14]).any()
    for name in names[1:]:
        loads.wait(name)
    loads.finish()
    for j in range(2):
        assert torch.equal(_layer(dst.groups[0], j, [10, 11, 13]), _layer(src.groups[0], j, [1, 2, 3]))
    for j in range(3):
        assert torch.equal(_layer(dst.groups[1], j, [12, 14]), _layer(src.groups[1], j, [5, 6]))
        assert not _layer(dst.groups[1], j, [0]).any()


def test_layer_runs_grow_from_one_layer():
    from cortex_cache.integrations.vllm.layers import layer_runs

    assert layer_runs(1) == [(0, 1)]
    assert layer_runs(5) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    assert layer_runs(32) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32)]
    runs = layer_runs(61)
    assert runs[0] == (0, 1) and runs[-1][1] == 61 and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
