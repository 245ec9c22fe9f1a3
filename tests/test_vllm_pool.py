"""The vLLM connector's pool side, without vLLM: keys, headers, faults as misses, the save thread, the pool of a name
followed (tests/test_vllm.py has the engines as referees, in the vLLM venv)."""

from __future__ import annotations

import os

import pytest

from cortex_cache import Pool
from tests.helpers import cli, run_py

torch = pytest.importorskip("torch")


def _store(pool_name: str, verify: bool = True, rank: str = "pp0tp0", fp: bytes = b"f" * 16, payload: int = 4096):
    from cortex_cache.integrations.vllm.blocks import BlockStore, Faults, PoolRef

    faults = Faults("test")
    ref = PoolRef(pool_name, {}, faults, retry_s=0.0)
    return BlockStore(ref, faults, namespace="vllm/", model="m", rank=rank, fingerprint=fp,
                      payload_bytes=payload, block_tokens=32, verify=verify), faults


def _paged(num_blocks: int = 6, layers: int = 2):
    from cortex_cache.integrations.vllm.blocks import PagedLayers

    caches = [torch.randn(num_blocks, 2, 32, 8) for _ in range(layers)]  # [B, H, N, C] per layer
    return caches, PagedLayers(caches, num_blocks)


def test_paged_blocks_round_trip_through_the_pool_bytes_exact(make_pool):
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    pool = make_pool("8M")
    caches, paged = _paged()
    store, faults = _store(pool.name, payload=paged.payload_bytes)
    digests = prefix_digests(list(range(32 * 4)), 32, b"tag")
    rows = store.staging(3, paged.device)
    paged.gather([5, 0, 2], rows)
    assert store.save(digests[:3], rows) == 3
    assert store.present(digests) == 3 and store.absent(digests) == [3]
    assert store.present(digests[1:]) == 2  # a prefix, counted from where it is asked
    # Load into other blocks of a fresh cache: exactly the bytes gathered.
    fresh, fpaged = _paged()
    for c in fresh:
        c.zero_()
    out = store.staging(4, fpaged.device)[:, 64:]
    hits = pool.stats()["hits"]
    assert store.load(digests, out) == 3 and faults.stats["missing"] == 1
    # Each loaded block is read once (its header checked, then copied from the same pinned view): one hit
    # each in the pool's own counters, and no pin left behind.
    assert pool.stats()["hits"] - hits == 3 and pool.stats()["pinned_entries"] == 0
    fpaged.scatter([1, 3, 4], out[:3])
    for c, f in zip(caches, fresh):
        assert torch.equal(f[1], c[5]) and torch.equal(f[3], c[0]) and torch.equal(f[4], c[2])
        assert not f[0].any() and not f[2].any()


def test_kernel_blocks_split_an_engine_block(make_pool):
    from cortex_cache.integrations.vllm.blocks import PagedLayers

    caches = [torch.randn(8, 2, 16, 4) for _ in range(3)]  # 4 engine blocks of 2 kernel blocks each
    paged = PagedLayers(caches, 4)
    assert paged.payload_bytes == 3 * 2 * 2 * 16 * 4 * 4
    rows = torch.zeros(1, 64 + paged.payload_bytes, dtype=torch.uint8)
    paged.gather([3], rows)
    for c in caches:
        c[6:8] = 0
    paged.scatter([3], rows[:, 64:])
    back = torch.zeros(1, 64 + paged.payload_bytes, dtype=torch.uint8)
    paged.gather([3], back)
    assert torch.equal(rows, back) and rows[:, 64:].any()


def test_foreign_and_corrupt_blocks_are_counted_misses_never_loaded(make_pool):
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    pool = make_pool("8M")
    store, faults = _store(pool.name)
    d = prefix_digests(list(range(32 * 4)), 32, b"tag")
    rows = store.staging(4, "cpu")
    rows[:, 64:] = 7
    assert store.save(d, rows) == 4
    # Another rank's layout under these keys; another block's bytes under a key; a flipped byte.
    other, _ = _store(pool.name, fp=b"g" * 16)
    out = torch.full((4, 4096), 9, dtype=torch.uint8)
    assert other.load(d, out) == 0 and other.faults.stats["foreign"] == 1
    pool.put(store.key(d[1]), pool.get(store.key(d[0])))
    assert store.load(d, out) == 1 and faults.stats["foreign"] == 1
    assert store.save(d[1:2], rows[:1]) == 1  # put right again
    off = pool.geometry.data_off + pool.info(store.key(d[2]))["first_block"] * pool.geometry.block_size
    pool.core.mv[off + 64 + 10] ^= 0xFF
    out[:] = 9
    assert store.load(d, out) == 2 and faults.stats["corrupt"] == 1
    assert (out[:2] == 7).all() and (out[2:] == 9).all()  # nothing of the damaged block was copied
    assert store.key(d[2]) not in pool  # and it was dropped: the next look-up is a plain miss
    assert store.present(d) == 2
    off = pool.geometry.data_off + pool.info(store.key(d[3]))["first_block"] * pool.geometry.block_size
    pool.core.mv[off + 64 + 10] ^= 0xFF
    unverified, uf = _store(pool.name, verify=False)
    assert unverified.load(d[3:], out) == 1 and uf.stats["corrupt"] == 0  # verify=False trusts the bytes


def test_a_large_load_checks_its_blocks_on_threads_and_stops_at_the_first_fault(make_pool, monkeypatch):
    """Loads of 4 MiB and more take their checksums on the checksum threads: still in order of the
    blocks, the first fault (a corrupt block before a foreign one) the one counted, nothing after it loaded."""
    from cortex_cache import gpu
    from cortex_cache.integrations.vllm import blocks
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    pool = make_pool("32M")
    payload = 1 << 20
    store, faults = _store(pool.name, payload=payload)
    d = prefix_digests(list(range(32 * 8)), 32, b"big")
    rows = store.staging(8, "cpu")
    for i in range(8):
        rows[i, 64:] = i + 1
    assert store.save(d, rows) == 8
    assert 8 * payload >= blocks.PARALLEL_VERIFY_BYTES
    out = torch.zeros((8, payload), dtype=torch.uint8)
    assert store.load(d, out) == 8 and all((out[i] == i + 1).all() for i in range(8))
    pool.put(store.key(d[6]), pool.get(store.key(d[0])))  # block 6: another block's bytes (foreign)
    off = pool.geometry.data_off + pool.info(store.key(d[3]))["first_block"] * pool.geometry.block_size
    pool.core.mv[off + 64 + payload - 1] ^= 0xFF  # block 3: its last byte flipped (corrupt)
    used = []
    real = gpu.copy_executor
    monkeypatch.setattr(gpu, "copy_executor", lambda: used.append(True) or real())
    out.zero_()
    assert store.load(d, out) == 3
    assert used, "the checksums of a large load were not taken on the checksum threads"
    assert faults.stats["corrupt"] == 1 and faults.stats["foreign"] == 0
    assert all((out[i] == i + 1).all() for i in range(3)) and not out[3:].any()
    assert store.key(d[3]) not in pool and store.present(d) == 3


def test_a_missing_pool_is_retried_and_a_full_pool_stores_nothing(make_pool, pool_name):
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    store, faults = _store(pool_name)
    d = prefix_digests(list(range(64)), 32, b"t")
    rows = store.staging(2, "cpu")
    assert store.present(d) == 0 and store.save(d, rows) == 0 and store.load(d, rows[:, 64:]) == 0
    assert faults.stats["unavailable"] >= 1 and faults.stats["store_failed"] == 2
    pool = make_pool("8M", name=pool_name)  # created later: found on the next try
    assert store.save(d, rows) == 2 and store.present(d) == 2
    tiny = make_pool("16K", block_size="4K")
    small, sf = _store(tiny.name, payload=32 << 10)  # a block larger than the whole pool
    assert small.save(d, small.staging(2, "cpu")) == 0 and sf.stats["store_failed"] == 2 and len(tiny) == 0
    store.pool.close()
    assert pool.stats()["entries"] == 2


def _one_block_saved_and_persisted(make_pool, pool_name: str, tmp_path):
    """A pool under `pool_name` with one block saved through a BlockStore, then persisted to a file: the pool,
    the store and its faults, three digests, staging rows and the snapshot's path."""
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    pool = make_pool("8M", name=pool_name)
    store, faults = _store(pool_name)
    d = prefix_digests(list(range(96)), 32, b"t")
    rows = store.staging(3, "cpu")
    assert store.save(d[:1], rows[:1]) == 1
    snap = tmp_path / "s.ccsnap"
    assert cli("cache", "persist", pool_name, "-o", str(snap)).returncode == 0
    return pool, store, faults, d, rows, snap


def test_the_block_store_follows_a_replaced_a_deleted_and_a_created_pool(make_pool, pool_name, tmp_path):
    """The connector's pool handle (PoolRef) moves to the pool now under the name (issue: engines stayed on the
    nameless copy restore --replace left, and never found the pool created again after a delete)."""
    pool, store, faults, d, rows, snap = _one_block_saved_and_persisted(make_pool, pool_name, tmp_path)
    assert store.save(d[1:2], rows[:1]) == 1
    assert cli("cache", "restore", pool_name, "-i", str(snap), "--replace").returncode == 0
    assert store.present(d) == 1  # the restored pool: the block saved after the snapshot is not in it
    assert store.save(d[1:3], rows[:2]) == 2
    pool.close()
    with Pool.open(pool_name) as now:
        assert len(now) == 3
    assert cli("cache", "delete", pool_name, "--force").returncode == 0
    assert store.present(d) == 0 and faults.stats["unavailable"] >= 1
    with Pool.create(pool_name, "8M") as again:
        assert store.save(d[:1], rows[:1]) == 1 and len(again) == 1
        store.pool.close()
    Pool.unlink(pool_name)


def test_a_pool_created_under_the_name_is_found_at_the_next_call_not_the_next_retry(make_pool, pool_name,
                                                                                     monkeypatch):
    """Issue 43, item 8: a missing pool is tried again when something comes to its name's path (one stat a
    call), not only every retry interval: the engine's first call after `create` finds it."""
    from cortex_cache.integrations import pools
    from cortex_cache.integrations.vllm.blocks import Faults, PoolRef

    faults = Faults("test")
    ref = PoolRef(pool_name, {}, faults, retry_s=3600.0)
    monkeypatch.setattr(pools, "REATTACH_EVERY", 3600.0)
    att = pools.Attachment(pool_name, {})
    tries = []
    real = pools.open_or_create
    monkeypatch.setattr(pools, "open_or_create", lambda *a: tries.append(a[0]) or real(*a))
    for _ in range(3):
        with att.use() as p:
            assert p is None and ref.get() is None
    assert faults.stats["unavailable"] == 1 and len(tries) == 1  # nothing came to the name: no open tried again
    pool = make_pool("4M", name=pool_name)
    got = ref.get()
    with att.use() as p:
        assert got is not None and got.name == pool_name and p is not None and p.name == pool_name
    pool.close()
    assert cli("cache", "delete", pool_name, "--force").returncode == 0
    with att.use() as p:
        assert p is None and ref.get() is None
    again = make_pool("4M", name=pool_name)
    with att.use() as p:
        assert p is not None and ref.get() is not None and len(again) == 0
    ref.close()
    att.close()


def test_a_superseded_pool_is_closed_once_the_last_call_using_it_ends(make_pool, pool_name, tmp_path):
    """A save or load still copying through the old mapping holds a lease on it (PoolRef.acquire): the old
    handle is closed when that ends, so the process stops mapping the old copy (status: "on old copies").
    A retired segment is unmapped on a thread of its own (Core.close): segment.wait_unmapped waits for that."""
    from cortex_cache.integrations.vllm.blocks import _Leased
    from cortex_cache.segment import mapped_generations, wait_unmapped

    def on_old_copy() -> bool:
        assert wait_unmapped(60)
        return os.getpid() in mapped_generations()[1].get(pool_name, [])

    pool, store, faults, d, rows, snap = _one_block_saved_and_persisted(make_pool, pool_name, tmp_path)
    pool.close()  # only the store's handles map the pool from here on
    ref = store.pool
    in_flight = ref.acquire()  # a copy on another thread, still running when the pool is replaced
    assert cli("cache", "restore", pool_name, "-i", str(snap), "--replace").returncode == 0
    assert store.save(d[1:2], rows[:1]) == 1  # into the pool now under the name
    assert ref.get() is not in_flight and ref.moves == 1 and ref.held() == 2
    # Still mapped, not closed, while its lease lasts (a new read through it raises PoolSuperseded: the
    # copy in flight reads through the views it pinned before the replace).
    assert in_flight.superseded and on_old_copy()
    ref.release(in_flight)
    assert ref.held() == 1 and not on_old_copy()  # closed with its last lease
    # Nothing in flight: a deleted pool's handle is closed at the next call, which finds no pool.
    assert cli("cache", "delete", pool_name, "--force").returncode == 0
    assert store.present(d) == 0 and ref.held() == 0 and not on_old_copy() and ref.moves == 2
    with Pool.create(pool_name, "8M"):
        # A CUDA load hands its lease to the transfer, which ends it once the copies are done.
        leased = ref.acquire()
        assert leased is not None and leased.name == pool_name
        waited = []
        t = _Leased(type("T", (), {"wait": lambda self: waited.append(1) or "done"})(), lambda: ref.release(leased))
        assert cli("cache", "delete", pool_name, "--force").returncode == 0
        assert ref.get() is None and ref.held() == 1  # the transfer's handle stays open
        assert t.wait() == "done" and waited == [1] and ref.held() == 0
        t.wait()  # twice: the lease ended once
        assert ref.held() == 0
    ref.close()
    assert faults.stats["error"] == 0


def test_saves_run_off_the_callers_thread_and_are_reported_per_request(make_pool, pool_name):
    from cortex_cache.integrations.vllm.blocks import Saver, prefix_digests

    pool = make_pool("8M")
    caches, paged = _paged()
    store, faults = _store(pool.name, payload=paged.payload_bytes)
    d = prefix_digests(list(range(32 * 4)), 32, b"tag")
    saver = Saver(store, paged, faults)
    assert saver.submit("a", d[:3], [5, 0, 2]) and saver.submit("b", d[3:], [1])
    assert saver.wait(["a", "b"], timeout=60) and not saver.pending("a") and not saver.busy()
    assert store.present(d) == 4 and faults.stats["stored"] == 4
    assert faults.stats["stored_bytes"] == 4 * paged.payload_bytes
    out = store.staging(4, "cpu")[:, 64:]
    assert store.load(d, out) == 4
    fresh, fpaged = _paged()
    fpaged.scatter([0, 1, 2, 3], out)
    for c, f in zip(caches, fresh):  # the bytes of the blocks named, in the order given
        assert torch.equal(f[0], c[5]) and torch.equal(f[1], c[0]) and torch.equal(f[2], c[2])
        assert torch.equal(f[3], c[1])
    saver.close()
    saver.close()  # twice is fine
    assert not saver.submit("c", d[:1], [0]) and faults.stats["store_failed"] == 1  # closed: counted, not queued
    # A pool that is missing: the save is a counted failure, and the request is reported done all the same.
    lost, lf = _store(pool_name + "-absent", payload=paged.payload_bytes)
    s2 = Saver(lost, paged, lf)
    assert s2.submit("x", d, [0, 1, 2, 3]) and s2.wait(timeout=60) and not s2.pending("x")
    assert lf.stats["stored"] == 0 and lf.stats["unavailable"] >= 1
    s2.close()
    store.pool.close()
    lost.pool.close()


def test_cpu_saves_and_loads_go_through_rows_kept_between_batches_in_parts(make_pool, monkeypatch):
    """A CPU cache's saves and loads copy through host rows kept from one batch to the next (fresh memory
    costs more than the copy: issue 43, item 6), at most HOST_ROWS_BYTES at a time: a larger batch goes in
    parts, each part's blocks exact, and a load stops at the first block missing even in a later part."""
    from cortex_cache.integrations.vllm import blocks
    from cortex_cache.integrations.vllm.blocks import HostRows, Saver, load_host, prefix_digests

    pool = make_pool("8M")
    caches, paged = _paged(num_blocks=8)
    store, faults = _store(pool.name, payload=paged.payload_bytes)
    monkeypatch.setattr(blocks, "HOST_ROWS_BYTES", 2 * (64 + paged.payload_bytes))  # two blocks a part
    d = prefix_digests(list(range(32 * 5)), 32, b"tag")
    saver = Saver(store, paged, faults)
    assert saver.submit("a", d, [7, 6, 5, 4, 3]) and saver.wait(timeout=60)
    assert saver._rows.max_rows == 2 and store.present(d) == 5 and faults.stats["stored"] == 5
    saver.close()
    rows = HostRows(paged.payload_bytes, cap=2 * paged.payload_bytes)
    kept = rows.take(5)
    assert len(kept) == 2 and rows.take(1).base is kept.base  # the same memory, batch after batch
    fresh, fpaged = _paged(num_blocks=8)
    assert load_host(store, fpaged, rows, d, [0, 1, 2, 3, 4]) == 5
    for c, f in zip(caches, fresh):
        assert all(torch.equal(f[i], c[7 - i]) for i in range(5))
    pool.delete(store.key(d[3]))  # in the second part: blocks 0-2 load, the rest is left alone
    for f in fresh:
        f.zero_()
    assert load_host(store, fpaged, rows, d, [0, 1, 2, 3, 4]) == 3
    assert all(f[:3].any() and not f[3:].any() for f in fresh) and faults.stats["missing"] == 1
    store.pool.close()


def test_block_sizes_fit_the_engines_values_and_lookups_count_as_misses(make_pool):
    from cortex_cache.integrations.vllm.blocks import block_fill, fit_block_size, prefix_digests

    assert fit_block_size(32768 + 64) == 4096 and round(block_fill(4096, 32768 + 64), 2) == 0.89
    assert fit_block_size(16384 + 64) == 4096 and block_fill(65536, 16384 + 64) < 0.26  # the 25%
    assert fit_block_size(65536) == 65536  # whole blocks at any size: the largest
    assert fit_block_size(3 * 8192) == 8192
    pool = make_pool("8M")
    store, faults = _store(pool.name)
    d = prefix_digests(list(range(32 * 4)), 32, b"tag")
    before = pool.stats()
    store.count_lookup(0, 3)
    store.count_lookup(2, 0)
    after = pool.stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (2, 3)
    assert store.present(d) == 0 and pool.stats()["misses"] == after["misses"]  # a probe counts nothing
    store.pool.close()


KILLED_MID_SAVE = """
import os, signal, sys, torch
from cortex_cache import gpu
from cortex_cache.integrations.vllm.blocks import prefix_digests
from tests.test_vllm_pool import _store
store, _ = _store(sys.argv[1])
d = prefix_digests(list(range(32 * 8)), 32, b"tag")
rows = store.staging(8, "cpu")
rows[:, 64:] = 1
pool = store.pool.get()
# What save() does, stopped between the copies and the commit:
import numpy as np
heads = np.frombuffer(bytearray(b"".join(store.header(x) for x in d)), np.uint8).reshape(8, 64)
rows[:, :64] = torch.from_numpy(heads)
t = gpu.store(pool, [store.key(x) for x in d], list(rows.unbind(0)))
print("copied", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_writer_killed_mid_save_leaves_nothing_visible(make_pool):
    pool = make_pool("8M")
    r = run_py(KILLED_MID_SAVE, pool.name, check=False)
    assert r.returncode == -9 and b"copied" in r.stdout
    store, faults = _store(pool.name)
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    d = prefix_digests(list(range(32 * 8)), 32, b"tag")
    assert store.present(d) == 0 and len(pool) == 0
    rows = store.staging(8, "cpu")
    assert store.save(d, rows) == 8  # the dead writer's space came back


def test_a_hybrid_models_groups_are_one_value_a_position_and_null_blocks_are_never_written(make_pool):
    """A hybrid model (groups.py): position i is one value holding every group's block i, group after group;
    a load writes a windowed group's blocks only where vLLM gave one (block 0, the null block, elsewhere)."""
    from cortex_cache.integrations.vllm.blocks import HostRows, PagedLayers, Saver, load_host, prefix_digests
    from cortex_cache.integrations.vllm.groups import PagedGroups, block_numbers, positions

    def groups():
        full = [torch.randn(8, 2, 32, 8) for _ in range(2)]  # full attention: 2 layers
        window = [torch.randn(8, 2, 32, 4)]  # sliding window: 1 layer of another shape
        return full, window, PagedGroups([PagedLayers(full, 8), PagedLayers(window, 8)])

    pool = make_pool("8M")
    full, window, paged = groups()
    assert paged.payload_bytes == 2 * 2048 + 1024 and paged.shape.count("|") == 1
    store, faults = _store(pool.name, payload=paged.payload_bytes)
    d = prefix_digests(list(range(32 * 4)), 32, b"tag")
    # The engine's tables: group 0 [7, 6, 5, 4], group 1 [3, 2, 1, 5] -- one tuple a position.
    saved = positions(([7, 6, 5, 4], [3, 2, 1, 5]), 2)
    assert saved == [(7, 3), (6, 2), (5, 1), (4, 5)] and positions(([1, 2], [3]), 2) is None
    saver = Saver(store, paged, faults)  # the host path: numpy copies of each group's layers
    assert saver.submit("a", d, saved) and saver.wait(timeout=60) and store.present(d) == 4
    saver.close()
    # A later request hits all 4 positions; its window group holds only the last two (null before them).
    f_full, f_window, fpaged = groups()
    for t in f_full + f_window:
        t.zero_()
    wanted = positions(([1, 2, 3, 4], [0, 0, 6, 7]), 2)
    assert block_numbers(wanted) == {1, 2, 3, 4, 6, 7}  # what a failed load reports: never the null block
    assert load_host(store, fpaged, HostRows(paged.payload_bytes), d, wanted) == 4
    for c, f in zip(full, f_full):
        assert all(torch.equal(f[i + 1], c[7 - i]) for i in range(4))
    assert torch.equal(f_window[0][6], window[0][1]) and torch.equal(f_window[0][7], window[0][5])
    assert not f_window[0][0].any()  # the null block: nothing written into it
    assert not f_window[0][1:6].any()
    # The torch path (a CUDA cache's, here on the CPU): the same rows.
    rows = store.staging(2, "cpu")
    paged.gather(saved[:2], rows)
    out = store.staging(2, "cpu")[:, 64:]
    assert store.load(d[:2], out) == 2 and torch.equal(out, rows[:, 64:])
    store.pool.close()


def test_a_hybrid_layout_the_connector_cannot_serve_is_refused_in_one_line():
    from types import SimpleNamespace as NS

    from cortex_cache.errors import UsageError
    from cortex_cache.integrations.vllm.groups import check_groups

    FullAttentionSpec = type("FullAttentionSpec", (), {"block_size": 16})
    SlidingWindowSpec = type("SlidingWindowSpec", (), {"block_size": 16, "sliding_window": 64})
    MambaSpec = type("MambaSpec", (), {"block_size": 16})
    check_groups([NS(kv_cache_spec=FullAttentionSpec()), NS(kv_cache_spec=SlidingWindowSpec())], 16)
    check_groups([NS(kv_cache_spec=MambaSpec())], 16)  # one group: the layout of old, not checked here
    with pytest.raises(UsageError) as e:
        check_groups([NS(kv_cache_spec=FullAttentionSpec()), NS(kv_cache_spec=MambaSpec())], 16)
    assert "group 1 is MambaSpec" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError) as e:
        check_groups([NS(kv_cache_spec=FullAttentionSpec()), NS(kv_cache_spec=SlidingWindowSpec())], 32)
    assert "blocks of 16 tokens and the engine's are 32" in str(e.value) and "\n" not in str(e.value)
