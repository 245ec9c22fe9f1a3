"""cortex_cache.gpu's merged copies: neighbouring values moved in one copy over the segment's tensor, exact at
every run boundary (broken in the pool, broken in the caller's rows, one value, none), never touching another
entry's bytes (on CPU tensors: the same calls a CUDA copy makes)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cortex_cache import gpu  # noqa: E402

HEAD = 64
VALUE = HEAD + 16384  # a 16 KiB block and its header: five 4 KiB pool blocks a value, 4032 bytes of padding
SLOT = 20480


@pytest.fixture
def copies(monkeypatch):
    """How many copies the pool's bytes took part in (each run is one)."""
    seen: list[int] = []
    real = gpu.copy_with_pool

    def counting(dst, src, pool, off, *, non_blocking=False):
        seen.append(off)
        return real(dst, src, pool, off, non_blocking=non_blocking)

    monkeypatch.setattr(gpu, "copy_with_pool", counting)
    return seen


def _rows(n: int, seed: int) -> torch.Tensor:
    """`n` value rows inside rows one pool slot wide (BlockStore's staging), random bytes, padding included."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, SLOT), dtype=torch.uint8, generator=g)[:, :VALUE]


def _first_blocks(pool, keys):
    return [pool.info(k)["first_block"] for k in keys]


def test_a_store_of_neighbours_is_one_copy_and_leaves_the_entries_around_it_alone(make_pool, copies):
    pool = make_pool("8M", block_size=4096)
    before = bytes(range(256)) * 20
    pool.put("before", before)
    rows = _rows(4, 1)
    keys = [f"k{i}" for i in range(4)]
    gpu.store(pool, keys, list(rows.unbind(0))).wait()
    after = bytes(reversed(range(256))) * 30
    pool.put("after", after)
    first = _first_blocks(pool, keys)
    assert [b - first[0] for b in first] == [0, 5, 10, 15]  # reserved one slot after another
    assert len(copies) == 1  # the four values, and the padding between them, in one copy
    for k, row in zip(keys, rows):
        assert pool.get(k) == row.numpy().tobytes()
    assert pool.get("before") == before and pool.get("after") == after
    views = pool.view_many(keys + ["before", "after"])
    try:
        assert all(v.verify() for v in views)  # every checksum over exactly its value's bytes
    finally:
        pool.release_many(views)


def test_runs_end_at_the_checksum_group(make_pool, copies, monkeypatch):
    pool = make_pool("8M", block_size=4096)
    monkeypatch.setattr(gpu, "CHECKSUM_GROUP_BYTES", 2 * SLOT)
    rows = _rows(5, 2)
    keys = [f"k{i}" for i in range(5)]
    gpu.store(pool, keys, list(rows.unbind(0))).wait()
    assert len(copies) == 3  # 2 + 2 + 1 values
    assert [pool.get(k) for k in keys] == [r.numpy().tobytes() for r in rows]


def _load(pool, keys, out, offset=HEAD):
    views = pool.view_many(keys)
    t = gpu.load_views(pool, views, dtype=torch.uint8, shape=(VALUE - offset,), device="cpu", out=out,
                       offset=offset)
    t.wait()
    assert pool.stats()["pinned_entries"] == 0


def test_a_load_breaks_its_run_where_the_pool_does(make_pool, copies):
    pool = make_pool("8M", block_size=4096)
    src = _rows(4, 3)
    for i in (0, 1):
        pool.put(f"k{i}", src[i].numpy().tobytes())
    pool.put("wedge", b"w" * 100)  # one pool block between k1 and k2
    for i in (2, 3):
        pool.put(f"k{i}", src[i].numpy().tobytes())
    keys = [f"k{i}" for i in range(4)]
    first = _first_blocks(pool, keys)
    assert [b - first[0] for b in first] == [0, 5, 11, 16]
    staging = torch.zeros((4, SLOT), dtype=torch.uint8)
    out = staging[:, HEAD:VALUE]
    copies.clear()
    _load(pool, keys, out)
    assert len(copies) == 2
    assert torch.equal(out, src[:, HEAD:])  # every payload exact on both sides of the break
    assert pool.get("wedge") == b"w" * 100


def test_a_load_breaks_its_run_where_the_rows_do_and_for_one_value_or_none(make_pool, copies):
    pool = make_pool("8M", block_size=4096)
    src = _rows(4, 4)
    keys = [f"k{i}" for i in range(4)]
    gpu.store(pool, keys, list(src.unbind(0))).wait()
    staging = torch.zeros((4, SLOT), dtype=torch.uint8)
    # Rows out of order in the caller's tensor: values neighbours in the pool, rows not -> one copy each.
    order = [0, 2, 1, 3]
    out = [staging[i, HEAD:VALUE] for i in order]
    copies.clear()
    _load(pool, keys, out)
    assert len(copies) == 4
    for k, i in enumerate(order):
        assert torch.equal(staging[i, HEAD:VALUE], src[k, HEAD:])
    # Rows of separate tensors: no run either.
    apart = [torch.zeros(VALUE - HEAD, dtype=torch.uint8) for _ in keys]
    copies.clear()
    _load(pool, keys, apart)
    assert len(copies) == 4 and all(torch.equal(a, s[HEAD:]) for a, s in zip(apart, src))
    # Plain contiguous rows (no room for the bytes between values): one copy each, nothing written past them.
    plain = torch.zeros((5, VALUE - HEAD), dtype=torch.uint8)
    copies.clear()
    _load(pool, keys, plain[:4])
    assert len(copies) == 4 and torch.equal(plain[:4], src[:, HEAD:]) and not plain[4].any()
    # A run of the middle two, one value, none.
    staging.zero_()
    copies.clear()
    _load(pool, keys[1:3], staging[:2, HEAD:VALUE])
    assert len(copies) == 1 and torch.equal(staging[:2, HEAD:VALUE], src[1:3, HEAD:])
    copies.clear()
    _load(pool, keys[3:], staging[:1, HEAD:VALUE])
    assert len(copies) == 1 and torch.equal(staging[0, HEAD:VALUE], src[3, HEAD:])
    copies.clear()
    _load(pool, [], staging[:0, HEAD:VALUE])
    assert copies == []


def test_the_segment_tensor_is_one_per_handle_and_goes_with_it(make_pool):
    pool = make_pool("4M", block_size=4096)
    t = gpu.segment_tensor(pool)
    assert gpu.segment_tensor(pool) is t and t.numel() == len(pool.core.seg.mm)
    del t
    pool.close()  # its close hook drops the tensor before the mapping goes (no BufferError)
    assert pool not in gpu._segments
