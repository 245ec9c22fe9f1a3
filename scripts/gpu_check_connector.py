#!/usr/bin/env python3
"""GPU check of the vLLM connector's data path, without vLLM: bit-exact checks, then GB/s and overlap.

    python scripts/gpu_check_connector.py [--device cuda|cpu] [--json PATH] [sizes]

Needs torch; with `--device cuda` (the default) a CUDA device, else it exits
69 with one line.  `--device cpu` runs the same checks and figures on CPU
tensors (tests/test_gpu.py runs it so, at small sizes).  Sized to take a
few minutes at most on one GPU.

The connector (cortex_cache/integrations/vllm/connector.py) cannot be
imported without vLLM, so its worker side is mirrored here, call for call,
over the real BlockStore, PagedLayers and Saver (blocks.py):

- saves: `wait_for_save` hands a request's blocks to `Saver.submit`, which
  records an event on the engine's current stream; the save thread's own
  stream waits for that event, gathers the blocks and stores them
  (`BlockStore.save` -> `gpu.store`, D2H into reserved pool memory);
- loads: `start_load_kv` makes a stream of its own wait for the engine's,
  queues each request's `BlockStore.load` (-> `gpu.load_views`, H2D from the pool)
  and `PagedLayers.scatter` on it, keeps the transfers (the entries stay
  pinned), and makes the engine's stream wait for it on the device;
  `wait_for_save` then waits for the transfers and unpins the entries.

Checks (each asserts; a failure is printed, the rest still run, exit 1):

1. Per KV layout of vLLM's layer views (`[blocks, heads, tokens, content]`
   with memory orders LBHNC, LBNHC, BLHNC and kernel blocks of half an
   engine block): a "forward pass" writes blocks on the engine's stream
   behind a ~50 ms GPU sleep, and the Saver saves them at once (the event is
   all that orders the gather after the writes); another request's blocks
   are saved in the engine's thread (`BlockStore.save`); both are loaded in
   one step into other block ids of a cache of another memory order, behind
   a sleep queued on the load stream (only the engine stream's wait orders
   the reads after the copies), and compared byte for byte in logical order;
   a transfer's missing tail is reported as load errors; blocks not named
   stay untouched; the entries are pinned until the step's end.  On CUDA a
   control gathers without waiting for the event (and reads without waiting
   for the load stream) and says whether the sleep made that race visible.
2. Per-layer loads (`load_per_layer`, integrations/vllm/layers.py's
   LayerLoads), per layout: blocks saved, then one step loads them into a
   cache of another memory order behind a GPU sleep on the load stream;
   each layer is read on the engine's stream right after `wait(layer)`
   (the engine's wait_for_layer_load), which alone orders the read after
   that layer's run of copies: bit-exact per layer, the missing tail a load
   error, pins held through the step.  On the CPU both ways (layers written
   at their wait; the CUDA way's pins, runs and scatters).
3. Foreign and corrupt blocks: another rank's block, another block's bytes
   under a key, a flipped byte: each a counted miss, nothing of it copied,
   the corrupt one deleted; the blocks before it load.
4. A full pool (every block held): a save, in the engine's thread or on the
   Saver's, stores nothing, raises nothing, is counted, leaves no half-write.

Figures (median of --reps, CUDA events around each batch; wall time on the
CPU), for --blocks blocks of the LBHNC layout, the pool's memory registered:
save (`BlockStore.save` in the caller's thread, and through the Saver),
load (the `start_load_kv` path to the step's end), the gather alone on the
device, beside a baseline measured in the same run: a torch copy of the same
bytes between the device and pinned host memory (on the CPU, a plain torch
copy): the ratio is the figure to watch (target >= 0.8x with verification
on, issue 43 item 6).  Per layer: the same load through LayerLoads (GB/s),
the time until the engine's stream may run its first layer against the
whole-request load, and a forward pass of one batch of matmuls a layer (as
long in all as the whole-request load) behind each way's loads.  Then the overlap: a save on the Saver's thread while a matmul loop
runs on the engine's stream, against each alone (reported, never asserted).

Pools are made under CORTEX_CACHE_SHM_PREFIX (default `ccgpuconn-<pid>.`)
with names of this run's own, and removed when it ends, failed or not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EX_UNAVAILABLE = 69
SLEEP_S = 0.05  # the GPU sleep that makes a missing wait visible
LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "LBHNC/2")  # vLLM's KVCacheLayout names; /2: kernel blocks of half a block


class Run:
    """What one run makes and must remove: pools (names of this run's own) and the handles on them."""

    def __init__(self) -> None:
        self.stem = f"ccgc-{os.getpid()}-{secrets.token_hex(3)}"
        self.names: list[str] = []
        self.closers: list = []

    def pool(self, what: str, size: int, block_size: int):
        from cortex_cache import Pool

        name = f"{self.stem}-{what}"
        self.names.append(name)
        p = Pool.create(name, size, block_size=block_size, multi_threaded=True)
        self.closers.append(p.close)
        return p

    def close(self) -> list[str]:
        """Close every handle, remove every pool; the segments still there after that (none, or a bug)."""
        from cortex_cache import Pool
        from cortex_cache.segment import prefix

        for close in reversed(self.closers):
            try:
                close()
            except Exception:
                traceback.print_exc()
        for name in self.names:
            try:
                if Pool.exists(name):
                    Pool.unlink(name)
            except Exception:
                traceback.print_exc()
        left = sorted(p.name for p in Path("/dev/shm").glob(prefix() + self.stem + "*"))
        for p in left:
            Path("/dev/shm", p).unlink(missing_ok=True)
        return left


class Engine:
    """One worker's side of the connector over a PagedLayers, mirroring connector.py call for call."""

    def __init__(self, torch, run: Run, pool, paged, rank: str = "pp0tp0", tag: bytes = b"gpu-check") -> None:
        from cortex_cache.integrations.vllm.blocks import BlockStore, Faults, PoolRef, Saver, fingerprint

        self.torch, self.paged = torch, paged
        self.faults = Faults(f"gpu-check({rank})")
        self.ref = PoolRef(pool.name, {}, self.faults)  # the connector's params without "create": open it
        run.closers.append(self.ref.close)
        self.store = BlockStore(self.ref, self.faults, namespace="vllm/", model="gpu-check", rank=rank,
                                fingerprint=fingerprint(tag, paged.shape, rank), payload_bytes=paged.payload_bytes,
                                block_tokens=16)
        self.saver = Saver(self.store, paged, self.faults, name=f"cortex-vllm-save-{rank}")
        run.closers.append(self.saver.close)
        self.loading: list = []
        self._stream = None
        handle = self.ref.get()  # register_kv_caches: pin the pool in the background
        self.pinning = None
        if handle is not None and paged.device.type == "cuda":
            from cortex_cache import gpu

            self.pinning = gpu.pin_memory(handle, background=True)

    # -- start_load_kv and _load_cuda
    def start_load(self, transfers, before_copies=None) -> list[int]:
        """Queue the loads of `transfers` [(digests, block ids)]; the block ids not loaded (load errors).
        `before_copies(stream)`: the check's own work queued on the load stream before the copies."""
        torch, store, paged = self.torch, self.store, self.paged
        errors: list[int] = []
        stream = None
        if transfers and paged.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(paged.device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(paged.device))
            if before_copies is not None:
                before_copies(stream)
        for digests, block_ids in transfers:
            if stream is None:
                out = store.staging(len(digests), paged.device)[:, : store.payload_bytes]
                n = store.load(digests, out)
                if n:
                    paged.scatter(block_ids[:n], out[:n])
            else:
                with torch.cuda.stream(stream):
                    out = store.staging(len(digests), paged.device)[:, : store.payload_bytes]
                    n = store.load(digests, out, stream=stream, keep=self.loading)
                    if n:
                        paged.scatter(block_ids[:n], out[:n])
                    self.loading.append(out)
            errors.extend(block_ids[n:])
        if stream is not None:
            torch.cuda.current_stream(paged.device).wait_stream(stream)
        return errors

    # -- wait_for_save
    def end_step(self, saves=()) -> None:
        """The step's end: wait for this step's CUDA loads (unpins their entries), then queue `saves`
        [(req id, digests, block ids)] on the Saver."""
        loading, self.loading = self.loading, []
        for x in loading:
            if hasattr(x, "wait"):
                x.wait()
        for req_id, digests, block_ids in saves:
            self.saver.submit(req_id, digests, block_ids)

    def save_inline(self, digests, block_ids, stream=None) -> int:
        """A save in the caller's thread: the Saver's job without the thread (gather, then BlockStore.save)."""
        rows = self.store.staging(len(digests), self.paged.device)
        self.paged.gather(block_ids, rows)
        return self.store.save(digests, rows, stream=stream)

    def stats(self) -> dict:
        return self.faults.snapshot()


# ------------------------------------------------------------------ helpers


def make_caches(torch, layout: str, layers: int, blocks: int, heads: int, tokens: int, content: int, dtype, dev):
    """vLLM's per-layer views `[blocks * r, heads, tokens / r, content]` over one allocation in `layout`'s
    memory order (zeros), and the engine's block count."""
    if layout == "LBHNC":
        raw = torch.zeros(layers, blocks, heads, tokens, content, dtype=dtype, device=dev)
        return list(raw.unbind(0)), blocks
    if layout == "LBNHC":  # heads and tokens swapped in memory
        raw = torch.zeros(layers, blocks, tokens, heads, content, dtype=dtype, device=dev)
        return [raw[i].permute(0, 2, 1, 3) for i in range(layers)], blocks
    if layout == "BLHNC":  # cross-layer: a block's layers together, each layer a strided view
        raw = torch.zeros(blocks, layers, heads, tokens, content, dtype=dtype, device=dev)
        return [raw[:, i] for i in range(layers)], blocks
    if layout == "LBHNC/2":  # the attention kernel splits each engine block in two
        raw = torch.zeros(layers, 2 * blocks, heads, tokens // 2, content, dtype=dtype, device=dev)
        return list(raw.unbind(0)), blocks
    raise ValueError(layout)


def digests_of(start: int, n: int, block_tokens: int = 16) -> list[bytes]:
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    return prefix_digests(list(range(start, start + n * block_tokens)), block_tokens, b"gpu-check-tokens")


def gpu_sleep(torch, stream=None) -> None:
    """~SLEEP_S of GPU time queued on `stream` (default: the current one)."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        torch.cuda._sleep(int(SLEEP_S * 2e9))  # cycles: ~2 GHz


class Clock:
    """Median seconds of a batch: CUDA events on the engine's stream (wall time on the CPU)."""

    def __init__(self, torch, dev) -> None:
        self.torch, self.cuda = torch, dev.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn, reps: int, setup=None) -> float:
        times = []
        for i in range(reps + 1):  # the first is a warm-up
            if setup is not None:
                setup()
            self.sync()
            if self.cuda:
                a, b = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                t = a.elapsed_time(b) / 1000
            else:
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
            if i:
                times.append(t)
        return statistics.median(times)

    def wall(self, fn, reps: int, setup=None) -> float:
        times = []
        for i in range(reps + 1):
            if setup is not None:
                setup()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


# ------------------------------------------------------------------ checks


def _bytes_of(torch, paged, ids):
    idx = torch.tensor(list(ids), dtype=torch.long, device=paged.device)
    return [v.index_select(0, idx).contiguous().view(torch.uint8) for v in paged.views]


def same_blocks(torch, a, a_ids, b, b_ids) -> bool:
    """Blocks `a_ids` of `a` hold the bytes of blocks `b_ids` of `b` (every layer, logical order)."""
    return all(torch.equal(x, y) for x, y in zip(_bytes_of(torch, a, a_ids), _bytes_of(torch, b, b_ids)))


def untouched(torch, paged, ids) -> bool:
    ids = list(ids)
    return not ids or not any(bool(x.any()) for x in _bytes_of(torch, paged, ids))


def fill_random(torch, paged) -> None:
    for v in paged.views:
        v.copy_(torch.randn(v.shape, dtype=torch.float32, device=v.device).to(v.dtype))


def check_layout(torch, run: Run, args, dev, layout: str, target: str) -> str:
    """Save (Saver with the event; inline), load in one step into another cache at other ids, compare."""
    from cortex_cache.integrations.vllm.blocks import HEADER_SIZE, PagedLayers, fit_block_size

    cuda = dev.type == "cuda"
    nb = args.check_blocks
    dims = (args.layers, nb, args.kv_heads, args.block_tokens, 2 * args.head_size)
    truth = PagedLayers(*make_caches(torch, layout, *dims, args.dtype, dev))
    fill_random(torch, truth)
    cache = PagedLayers(*make_caches(torch, layout, *dims, args.dtype, dev))  # the engine's cache, zeros
    n = max(1, min(8, (nb - 2) // 4))
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(LAYOUTS.index(layout))).tolist()
    ids_a, ids_b, spare = perm[:n], perm[n : 2 * n], perm[2 * n :]
    value = HEADER_SIZE + cache.payload_bytes
    pool = run.pool(f"l{LAYOUTS.index(layout)}", max(4 << 20, 4 * n * value + (2 << 20)), fit_block_size(value))
    eng = Engine(torch, run, pool, cache)
    da, db = digests_of(0, n), digests_of(10_000, n)
    ia, ib = (torch.tensor(x, device=dev) for x in (ids_a, ids_b))

    def write(idx) -> None:  # the forward pass: those blocks' KV, on the engine's stream
        for c, t in zip(cache.views, truth.views):
            c.index_copy_(0, idx, t.index_select(0, idx))

    # Request a: written behind a GPU sleep, handed to the Saver at once; only the event it records on the
    # engine's stream orders its gather (on the save thread's stream) after the writes.
    if cuda:
        gpu_sleep(torch)
    write(ia)
    eng.end_step([("a", da, ids_a)])
    assert eng.saver.wait(["a"], timeout=120), "the Saver did not finish request a within 120 s"
    assert not eng.saver.pending("a")
    # Request b: the same job in the caller's thread and stream (BlockStore.save without the Saver).
    write(ib)
    assert eng.save_inline(db, ids_b) == n
    st = eng.stats()
    assert st["stored"] == 2 * n and st["store_failed"] == 0, st
    assert eng.store.present(da) == n and eng.store.present(db) == n
    raced = None
    if cuda:  # control: the same gather on a stream that waits for nothing sees the blocks before the writes
        for c in cache.views:
            c.index_fill_(0, ia, 0)
        torch.cuda.synchronize()
        gpu_sleep(torch)
        write(ia)
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(side):
            rows = eng.store.staging(n, dev)
            cache.gather(ids_a, rows)
        side.synchronize()
        want = eng.store.staging(n, dev)
        truth.gather(ids_a, want)
        raced = not torch.equal(rows[:, HEADER_SIZE:].cpu(), want[:, HEADER_SIZE:].cpu())
        torch.cuda.synchronize()
    for c in cache.views:  # the engine reuses a's blocks: the pool keeps what the forward pass wrote
        c.index_fill_(0, ia, 0)

    # One step loads a, b and a request whose second block was never stored, into a cache of another memory
    # order at other ids, behind a sleep on the load stream; the blocks are read at once on the engine's stream.
    dst = PagedLayers(*make_caches(torch, target, *dims, args.dtype, dev))
    eng2 = Engine(torch, run, pool, dst)
    tgt_a, tgt_b, tgt_c = spare[:n], spare[n : 2 * n], spare[2 * n : 2 * n + 2]
    dc = da[:1] + digests_of(20_000, 1)
    errors = eng2.start_load([(da, tgt_a), (db, tgt_b), (dc, tgt_c)],
                             before_copies=(lambda s: gpu_sleep(torch, s)) if cuda else None)
    ok_now = same_blocks(torch, dst, tgt_a + tgt_b + tgt_c[:1], truth, ids_a + ids_b + ids_a[:1])
    pinned = pool.stats()["pinned_entries"]
    eng2.end_step()
    assert errors == tgt_c[1:], f"load errors at blocks {errors}, not {tgt_c[1:]}"
    assert ok_now, "the blocks the engine's stream read after start_load_kv are not the blocks saved"
    assert pool.stats()["pinned_entries"] == 0, "entries still pinned after the step's end"
    if cuda:
        assert pinned == 2 * n, f"{pinned} entries pinned before the step's end, not {2 * n}"
    loaded = set(tgt_a + tgt_b + tgt_c[:1])
    assert untouched(torch, dst, [i for i in range(nb) if i not in loaded]), "blocks not named in a load were written"
    st2 = eng2.stats()
    assert st2["loaded"] == 2 * n + 1 and st2["missing"] == 1, st2
    load_raced = None
    if cuda:  # control: a stream that does not wait for the load stream reads the blocks before they land
        eng3 = Engine(torch, run, pool, PagedLayers(*make_caches(torch, target, *dims, args.dtype, dev)))
        if eng3.pinning is not None:  # from pageable memory a copy returns only once it has landed: no race
            eng3.pinning.wait()
        eng3.start_load([(da, tgt_a)], before_copies=lambda s: gpu_sleep(torch, s))
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(side):
            early = torch.cat([x.reshape(-1) for x in _bytes_of(torch, eng3.paged, tgt_a)])
        side.synchronize()
        load_raced = not bool(early.any())
        eng3.end_step()
        torch.cuda.synchronize()
    what = f"{layout} -> {target}: {n}+{n} blocks saved (Saver, inline), loaded in one step at other ids, bit-exact"
    if cuda:
        shown = "; ".join(
            f"a control without the {control} raced: it ordered the copies" if r else
            f"a control without the {control} did not race: that ordering was not put to the test"
            for control, r in (("save's event", raced), ("load stream's wait", load_raced)))
        what += f"; {2 * n} entries pinned until the step's end; {shown}"
    return what


def check_per_layer(torch, run: Run, args, dev) -> str:
    """load_per_layer (integrations/vllm/layers.py), mirrored as the connector drives it: per KV layout, blocks
    saved, then one step loads them into a cache of another memory order behind a GPU sleep on the load
    stream; before each layer is read on the engine's stream, `wait(layer)` (the engine's wait_for_layer_load)
    is all that orders the read after that layer's copies.  Bit-exact per layer, load errors, pins."""
    from cortex_cache.integrations.vllm.blocks import HEADER_SIZE, PagedLayers, fit_block_size
    from cortex_cache.integrations.vllm.layers import LayerLoads, layer_runs

    cuda = dev.type == "cuda"
    nb = args.check_blocks
    dims = (args.layers, nb, args.kv_heads, args.block_tokens, 2 * args.head_size)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    n = max(1, min(8, (nb - 2) // 4))
    done = []
    for k, (layout, target) in enumerate(zip(LAYOUTS, ("LBNHC", "BLHNC", "LBHNC", "LBHNC/2"))):
        truth = PagedLayers(*make_caches(torch, layout, *dims, args.dtype, dev))
        fill_random(torch, truth)
        value = HEADER_SIZE + truth.payload_bytes
        pool = run.pool(f"pl{k}", max(4 << 20, 2 * n * value + (2 << 20)), fit_block_size(value))
        src = Engine(torch, run, pool, truth)
        perm = torch.randperm(nb, generator=torch.Generator().manual_seed(100 + k)).tolist()
        ids, rest = perm[:n], [i for i in perm[n:] if i != 0]  # block 0: vLLM's null block, never a load error
        tgt, tail = rest[:n], rest[n : n + 1]
        d = digests_of(0, n + 1)
        assert src.save_inline(d[:n], ids) == n
        for by_runs in ((True,) if cuda else (True, False)):  # on the CPU both ways: the CUDA way's bytes too
            dst = PagedLayers(*make_caches(torch, target, *dims, args.dtype, dev))
            eng = Engine(torch, run, pool, dst)
            if eng.pinning is not None:
                eng.pinning.wait()
            stream = torch.cuda.Stream(dev) if cuda else None
            loads = LayerLoads(eng.store, dst, names, stream=stream, by_runs=by_runs)
            if cuda:
                stream.wait_stream(torch.cuda.current_stream(dev))
                gpu_sleep(torch, stream)  # the copies land ~50 ms after the engine's stream would read them
            errors = loads.start([_T(d, tgt + tail)])
            pinned = pool.stats()["pinned_entries"]
            exact = []
            for i, name in enumerate(names):
                loads.wait(name)  # the engine's wait_for_layer_load, then the layer reads its blocks
                got = dst.views[i].index_select(0, torch.tensor(tgt, device=dev))
                exact.append(torch.equal(got, truth.views[i].index_select(0, torch.tensor(ids, device=dev))))
            loads.finish()
            assert all(exact), f"{layout} -> {target}: layers {[i for i, ok in enumerate(exact) if not ok]} not exact"
            assert errors == set(tail), f"load errors {errors}, not {set(tail)}"
            assert pool.stats()["pinned_entries"] == 0, "entries still pinned after the step's end"
            if by_runs:
                assert pinned == n, f"{pinned} entries pinned during the step, not {n}"
            assert untouched(torch, dst, [i for i in range(nb) if i not in tgt]), "blocks not loaded were written"
        done.append(f"{layout} -> {target}")
    runs = layer_runs(args.layers)
    return (f"per-layer loads ({', '.join(done)}): {n} blocks a step, each layer read on the engine's stream right "
            f"after its wait, bit-exact; {len(runs)} runs of layers ({', '.join(f'{b - a}' for a, b in runs)}), "
            f"the missing tail a load error, pins held through the step")


class _T:
    def __init__(self, digests, block_ids) -> None:
        self.digests, self.block_ids = digests, block_ids


def _source(torch, args, dev):
    """The blocks a check saves: --check-blocks engine blocks of the LBHNC layout, random; (blocks, the
    layers' dims, the PagedLayers, the bytes of one stored value)."""
    from cortex_cache.integrations.vllm.blocks import HEADER_SIZE, PagedLayers

    nb = args.check_blocks
    dims = (args.layers, nb, args.kv_heads, args.block_tokens, 2 * args.head_size)
    src = PagedLayers(*make_caches(torch, "LBHNC", *dims, args.dtype, dev))
    fill_random(torch, src)
    return nb, dims, src, HEADER_SIZE + src.payload_bytes


def check_faults(torch, run: Run, args, dev) -> str:
    """Another rank's block, another block's bytes under a key, a flipped byte: counted misses."""
    from cortex_cache.integrations.vllm.blocks import HEADER_SIZE, PagedLayers, fit_block_size

    nb, dims, src, value = _source(torch, args, dev)
    pool = run.pool("faults", max(4 << 20, 8 * value + (2 << 20)), fit_block_size(value))
    eng = Engine(torch, run, pool, src)
    d, ids, tgt = digests_of(0, 4), [0, 1, 2, 3], [nb - 1, nb - 2, nb - 3, nb - 4]
    assert eng.save_inline(d, ids) == 4
    dst = PagedLayers(*make_caches(torch, "LBHNC", *dims, args.dtype, dev))
    other = Engine(torch, run, pool, dst, rank="pp0tp1")  # another rank's layout under the same model
    okey = other.store.key(d[0])
    pool.put(okey, pool.get(eng.store.key(d[0])))  # rank 0's block under rank 1's key
    assert other.start_load([(d[:1], tgt[:1])]) == tgt[:1]
    other.end_step()
    assert other.stats()["foreign"] == 1 and untouched(torch, dst, range(nb)), other.stats()
    reader = Engine(torch, run, pool, dst)
    pool.put(eng.store.key(d[1]), pool.get(eng.store.key(d[0])))  # block 0's bytes under block 1's key
    assert reader.start_load([(d, tgt)]) == tgt[1:]
    reader.end_step()
    assert reader.stats()["foreign"] == 1 and reader.stats()["loaded"] == 1
    assert same_blocks(torch, dst, tgt[:1], src, ids[:1]) and untouched(torch, dst, tgt[1:])
    assert eng.save_inline(d[1:2], ids[1:2]) == 1  # put right again
    key2 = eng.store.key(d[2])
    off = pool.geometry.data_off + pool.info(key2)["first_block"] * pool.geometry.block_size
    pool.core.mv[off + HEADER_SIZE + 10] ^= 0xFF  # a flipped byte in block 2's payload
    for v in dst.views:
        v.zero_()
    assert reader.start_load([(d, tgt)]) == tgt[2:]
    reader.end_step()
    st = reader.stats()
    assert st["corrupt"] == 1 and st["loaded"] == 3, st
    assert key2 not in pool, "the corrupt block was not deleted"
    assert same_blocks(torch, dst, tgt[:2], src, ids[:2]) and untouched(torch, dst, tgt[2:])
    assert pool.stats()["pinned_entries"] == 0
    return "another rank's block, another block's bytes under a key, a flipped byte: counted misses, " \
           "none copied, the corrupt one deleted, the blocks before them loaded"


def check_full(torch, run: Run, args, dev) -> str:
    """A pool whose every block is held: saves store nothing and raise nothing."""
    from cortex_cache import PoolFull
    from cortex_cache.integrations.vllm.blocks import fit_block_size

    nb, _, src, value = _source(torch, args, dev)
    bs = fit_block_size(value)
    pool = run.pool("full", max(4 << 20, 4 * value), bs)
    held = []
    try:
        for size in (value, bs):  # values of a KV block's size, then single pool blocks into what is left
            while len(held) < 1 << 20:
                try:
                    pool.put(f"fill{len(held)}", bytes(size))
                except PoolFull:
                    break
                held.append(pool.view(f"fill{len(held)}"))  # held: eviction cannot free its blocks
        eng = Engine(torch, run, pool, src)
        n = min(4, nb)
        d, ids = digests_of(0, n), list(range(n))
        assert eng.save_inline(d, ids) == 0
        eng.end_step([("full", d, ids)])
        assert eng.saver.wait(["full"], timeout=120) and not eng.saver.pending("full")
        st = eng.stats()
        assert st["store_failed"] == 2 * n and st["stored"] == 0, st
        ps = pool.stats()
        assert ps["writing_entries"] == 0 and ps["entries"] == len(held), ps
        assert eng.store.present(d) == 0
    finally:
        for v in held:
            v.release()
    return f"a full pool ({len(held)} entries held): {n} blocks saved inline and {n} through the Saver " \
           "stored nothing, raised nothing, counted as failed stores, no half-write left"


# ------------------------------------------------------------------ figures


def figures(torch, run: Run, args, dev) -> dict:
    from cortex_cache import segment
    from cortex_cache.integrations.vllm.blocks import HEADER_SIZE, PagedLayers, fit_block_size

    cuda = dev.type == "cuda"
    clock = Clock(torch, dev)
    nb = args.cache_blocks
    dims = (args.layers, nb, args.kv_heads, args.block_tokens, 2 * args.head_size)
    paged = PagedLayers(*make_caches(torch, "LBHNC", *dims, args.dtype, dev))
    fill_random(torch, paged)
    value = HEADER_SIZE + paged.payload_bytes
    bs = fit_block_size(value)
    per = -(-value // bs) * bs
    n = min(args.blocks, nb // 2, max(1, int(segment.shm_free_bytes() * 0.4) // per))
    pool = run.pool("figures", int(n * per * 1.25) + (16 << 20), bs)
    eng = Engine(torch, run, pool, paged)
    if eng.pinning is not None:
        eng.pinning.wait()
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(7)).tolist()
    ids, ids_to = perm[:n], perm[n : 2 * n]
    d = digests_of(0, n)
    keys = [eng.store.key(x) for x in d]
    nbytes = n * paged.payload_bytes
    res = {"blocks": n, "block_bytes": paged.payload_bytes, "batch_bytes": nbytes, "reps": args.reps,
           "timing": "CUDA events" if cuda else "wall clock",
           "pool_registered": bool(eng.pinning is not None and eng.pinning.complete),
           "pinning_error": eng.pinning.error if eng.pinning is not None else None}

    def drop() -> None:
        pool.delete_many(keys)

    def save_inline() -> None:
        assert eng.save_inline(d, ids) == n

    def save_saver() -> None:
        eng.end_step([("fig", d, ids)])
        assert eng.saver.wait(["fig"], timeout=300)

    def load() -> None:
        assert not eng.start_load([(d, ids_to)])
        eng.end_step()

    rows = eng.store.staging(n, dev)
    stored0 = eng.stats()["stored"]
    res["save_inline_s"] = clock.time(save_inline, args.reps, setup=drop)
    res["save_saver_s"] = clock.time(save_saver, args.reps, setup=drop)
    assert eng.stats()["stored"] - stored0 == 2 * (args.reps + 1) * n, "a timed save stored fewer blocks"
    res["load_s"] = clock.time(load, args.reps)
    assert same_blocks(torch, paged, ids_to, paged, ids), "the timed loads did not bring back the blocks saved"
    res["gather_s"] = clock.time(lambda: paged.gather(ids, rows), args.reps)
    dev_buf = torch.empty((n, paged.payload_bytes), dtype=torch.uint8, device=dev)
    host = torch.empty((n, paged.payload_bytes), dtype=torch.uint8, pin_memory=cuda)
    res["baseline_d2h_s"] = clock.time(lambda: host.copy_(dev_buf, non_blocking=True), args.reps)
    res["baseline_h2d_s"] = clock.time(lambda: dev_buf.copy_(host, non_blocking=True), args.reps)
    del host, dev_buf
    for k in [k for k in res if k.endswith("_s")]:
        res[k.removesuffix("_s") + "_gbps"] = nbytes / res[k] / 1e9

    # Overlap: a save on the Saver's thread while a matmul loop (the next steps) runs on the engine's stream.
    m = 4096 if cuda else 256
    a = torch.randn(m, m, device=dev, dtype=torch.float16 if cuda else torch.float32)
    c = torch.empty_like(a)
    one = clock.time(lambda: torch.mm(a, a, out=c), 3)
    res["per_layer"] = per_layer_figures(torch, clock, args, eng, paged, d, ids, ids_to, res["load_s"],
                                         lambda: torch.mm(a, a, out=c), one)
    t_save = clock.wall(save_saver, args.reps, setup=drop)
    k = max(1, min(100_000, round(t_save / one)))

    def matmuls() -> None:
        for _ in range(k):
            torch.mm(a, a, out=c)

    def both() -> None:
        eng.end_step([("fig", d, ids)])  # its event is recorded before the matmuls are queued
        matmuls()
        assert eng.saver.wait(["fig"], timeout=300)

    t_mm = clock.wall(matmuls, args.reps)
    t_both = clock.wall(both, args.reps, setup=drop)
    drop()
    hidden = (t_save + t_mm - t_both) / min(t_save, t_mm)
    res["overlap"] = {"matmul": f"{k} x {m}x{m} {str(a.dtype).removeprefix('torch.')}", "matmul_s": t_mm,
                      "save_s": t_save, "both_s": t_both, "hidden_of_shorter": hidden}
    return res


def per_layer_figures(torch, clock, args, eng, paged, d, ids, ids_to, t_load: float, matmul, t_mm: float) -> dict:
    """load_per_layer against the whole-request load, same blocks: its GB/s (every layer waited for), the
    time until the engine's stream may run its first layer, and a forward pass of `layers` layers of
    matmuls (as long, all together, as the whole-request load) behind each way's loads."""
    from cortex_cache.integrations.vllm.layers import LayerLoads

    cuda = paged.device.type == "cuda"
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    stream = torch.cuda.Stream(paged.device) if cuda else None
    loads = LayerLoads(eng.store, paged, names, stream=stream)
    k = max(1, min(10_000, round(t_load / args.layers / t_mm)))  # matmuls a layer

    def start() -> None:
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(paged.device))
        assert not loads.start([_T(d, ids_to)])

    def layered(compute: int = 0, first_only: bool = False) -> None:
        start()
        for name in names[:1] if first_only else names:
            loads.wait(name)
            for _ in range(compute):
                matmul()

    def whole(compute: int = 0) -> None:
        assert not eng.start_load([(d, ids_to)])
        for _ in range(compute * len(names)):
            matmul()

    out = {"matmuls_a_layer": k, "layers": len(names)}
    out["load_s"] = clock.time(lambda: (layered(), loads.finish()), args.reps)
    out["first_layer_s"] = clock.time(lambda: layered(first_only=True), args.reps, setup=loads.finish)
    loads.finish()
    out["first_layer_whole_s"] = clock.time(whole, args.reps, setup=eng.end_step)
    eng.end_step()
    out["forward_s"] = clock.time(lambda: layered(k), args.reps, setup=loads.finish)
    loads.finish()
    out["forward_whole_s"] = clock.time(lambda: whole(k), args.reps, setup=eng.end_step)
    eng.end_step()
    out["compute_s"] = clock.time(lambda: [matmul() for _ in range(k * len(names))], args.reps)
    assert same_blocks(torch, paged, ids_to, paged, ids), "the per-layer loads did not bring back the blocks saved"
    out["load_gbps"] = len(ids_to) * paged.payload_bytes / out["load_s"] / 1e9
    return out


def print_figures(f: dict, dev) -> None:
    from cortex_cache.units import format_size

    cuda = dev.type == "cuda"
    where = "pool memory registered with CUDA" if f["pool_registered"] else "pool memory not registered"
    if f["pinning_error"]:
        where += f" ({f['pinning_error']})"
    print(f"\nfigures: {f['blocks']} blocks of {format_size(f['block_bytes'])} "
          f"({format_size(f['batch_bytes'])} a batch), {where}; median of {f['reps']}, {f['timing']}"
          f"{'' if cuda else ' (CPU: device = host memory)'}")
    saver = "its thread, its own stream, after the event" if cuda else "its thread, numpy copies"
    rows = [("save, BlockStore.save in the caller's thread (gather, copy, checksum, commit)", "save_inline",
             "baseline_d2h"),
            (f"save, through the Saver ({saver})", "save_saver", "baseline_d2h"),
            ("load, the start_load_kv path to the step's end (copy, scatter)", "load", "baseline_h2d"),
            ("gather alone on the device", "gather", None)]
    if cuda:
        rows += [("baseline: torch D2H into pinned memory, the same bytes", "baseline_d2h", None),
                 ("baseline: torch H2D from pinned memory, the same bytes", "baseline_h2d", None)]
    else:
        rows = [(label, k, base and "baseline_d2h") for label, k, base in rows]
        rows += [("baseline: a torch CPU copy of the same bytes", "baseline_d2h", None)]
    for label, k, base in rows:
        ratio = f"  {f[k + '_gbps'] / f[base + '_gbps']:.2f}x of the baseline" if base else ""
        print(f"  {label:78} {f[k + '_gbps']:8.2f} GB/s{ratio}")
    p = f["per_layer"]
    print(f"  {'load, per layer (load_per_layer: runs of layers, every layer waited for)':78} {p['load_gbps']:8.2f} GB/s"
          f"  {p['load_gbps'] / f['baseline_h2d_gbps' if cuda else 'baseline_d2h_gbps']:.2f}x of the baseline")
    print("  (target on a device: loads and saves >= 0.80x of the baseline, with verification on)")
    ms = 1e3
    print(f"per layer: the engine's stream may run its first layer {p['first_layer_s'] * ms:.2f} ms after the loads "
          f"start (whole-request: {p['first_layer_whole_s'] * ms:.2f} ms); a forward pass of {p['layers']} layers x "
          f"{p['matmuls_a_layer']} matmuls ({p['compute_s'] * ms:.1f} ms alone) behind the loads: "
          f"{p['forward_s'] * ms:.1f} ms per layer, {p['forward_whole_s'] * ms:.1f} ms whole-request "
          f"({p['forward_s'] / p['forward_whole_s']:.2f}x)" + ("" if cuda else " (CPU: no copy engine to overlap)"))
    o = f["overlap"]
    print(f"overlap (reported, not asserted): {o['matmul']} matmuls alone {o['matmul_s'] * 1e3:.1f} ms, the Saver's "
          f"save alone {o['save_s'] * 1e3:.1f} ms, both at once {o['both_s'] * 1e3:.1f} ms (sum "
          f"{(o['matmul_s'] + o['save_s']) * 1e3:.1f}, max {max(o['matmul_s'], o['save_s']) * 1e3:.1f}): "
          f"{100 * o['hidden_of_shorter']:.0f}% of the shorter hidden", flush=True)


# ------------------------------------------------------------------ main

DEFAULTS = {  # cuda: a Llama-3-8B-like layer set (2 MiB blocks); cpu: small, for a shared 2-core machine
    "cuda": dict(layers=32, kv_heads=8, head_size=128, block_tokens=16, cache_blocks=1024, blocks=256, reps=5),
    "cpu": dict(layers=4, kv_heads=2, head_size=64, block_tokens=16, cache_blocks=256, blocks=64, reps=3),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", metavar="PATH", help="write the checks and figures there")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-size", type=int, help="per K and V: a block's content is 2 x this")
    ap.add_argument("--block-tokens", type=int, help="tokens an engine block holds (even)")
    ap.add_argument("--cache-blocks", type=int, help="engine blocks of the figures' cache")
    ap.add_argument("--blocks", type=int, help="blocks a figure's batch moves")
    ap.add_argument("--reps", type=int, help="timed repetitions of each figure, after a warm-up")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    args = ap.parse_args(argv)
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.block_tokens % 2 or min(args.layers, args.kv_heads, args.head_size, args.blocks, args.reps) < 1 \
            or args.cache_blocks < 8:
        ap.error("sizes must be positive, --block-tokens even, --cache-blocks at least 8")
    args.check_blocks = min(args.cache_blocks, 32)
    os.environ.setdefault("CORTEX_CACHE_SHM_PREFIX", f"ccgpuconn-{os.getpid()}.")
    try:
        import torch
    except ImportError:
        print("gpu_check_connector: torch is not installed", file=sys.stderr)
        return EX_UNAVAILABLE
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check_connector: no CUDA device here (torch {torch.__version__}); --device cpu runs the checks "
              "on the CPU", file=sys.stderr)
        return EX_UNAVAILABLE
    args.dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(dev) if args.device == "cuda" else "CPU"
    out: dict = {"device": name, "torch": torch.__version__, "checks": [], "failed": [],
                 "layout": {k: getattr(args, k) for k in ("layers", "kv_heads", "head_size", "block_tokens")}
                 | {"dtype": str(args.dtype).removeprefix("torch.")}}
    print(f"{name}, torch {torch.__version__}: {args.layers} layers x {args.kv_heads} KV heads x {args.head_size} "
          f"head size, {args.block_tokens}-token blocks, {out['layout']['dtype']}", flush=True)
    torch.manual_seed(0)
    # The faults the checks provoke are logged once per kind by the connector's code: say they are expected.
    log = logging.getLogger("cortex_cache.integrations.vllm")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  logged, as the check expects: %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    run = Run()
    checks = [(f"layout {a}", lambda a=a, b=b: check_layout(torch, run, args, dev, a, b))
              for a, b in zip(LAYOUTS, ("LBNHC", "BLHNC", "LBHNC", "LBHNC/2"))]
    checks += [("per-layer loads", lambda: check_per_layer(torch, run, args, dev)),
               ("foreign and corrupt blocks", lambda: check_faults(torch, run, args, dev)),
               ("a full pool", lambda: check_full(torch, run, args, dev))]
    try:
        for label, fn in checks:
            try:
                msg = fn()
            except Exception as e:
                traceback.print_exc()
                out["failed"].append(f"{label}: {type(e).__name__}: {e}")
                print(f"FAILED: {label}: {type(e).__name__}: {e}", flush=True)
            else:
                out["checks"].append(msg)
                print("ok:", msg, flush=True)
        try:
            out["figures"] = figures(torch, run, args, dev)
            print_figures(out["figures"], dev)
        except Exception as e:
            traceback.print_exc()
            out["failed"].append(f"figures: {type(e).__name__}: {e}")
            print(f"FAILED: figures: {type(e).__name__}: {e}", flush=True)
    finally:
        left = run.close()
        if left:
            out["failed"].append(f"segments left behind (removed now): {left}")
            print(f"FAILED: segments left behind (removed now): {left}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    n_ok, n_bad = len(out["checks"]), len(out["failed"])
    print(f"\n{n_ok} checks passed" + (f", {n_bad} FAILED" if n_bad else "") + f" on {name}", flush=True)
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
