"""Loads layer by layer: the connector's per-layer mode (kv_connector_extra_config "load_per_layer": true).

vLLM calls the connector's `start_load_kv` before the forward pass, then
`wait_for_layer_load(name)` just before each attention layer runs (the
`maybe_transfer_kv_layer` wrapper of the attention op, which every backend's
attention goes through, the CPU one included), and `wait_for_save` after the
pass.  The whole-request load (connector.py) orders the whole pass after
every block's copies; here the first layers compute while later ones load:

- `start` pins every block of the step's loads and checks its header and,
  with `verify`, its checksum, before any copy (a block that fails is a
  counted miss and a load error, and so is every block after it, as in the
  whole-request load).
- CUDA: the copies go on the load stream part by part, a part being a run
  of layers in the order of a block's row, 1, 1, 2, 4, 8, ... layers long
  (`layer_runs`): one copy per block and part (a value's layers lie one
  after another in it; a layer's bytes of neighbouring blocks do not), so
  2 + log2(layers) copies a block rather than one per layer.  Each part's
  copies are followed by the scatters of its layers into the paged cache
  and an event; `wait(name)` makes the engine's current stream wait for
  that layer's part only.
- CPU: the blocks are copied whole into host rows at `start` (runs of
  neighbours in one copy, BlockStore.load), and `wait(name)` writes that
  layer into the cache: the same bytes as the whole-request load, in
  another order, which lets vLLM's CPU build referee the mode.
- A layer name the connector does not know waits for (or writes) every
  layer.  `finish` (the step's end) writes what no wait wrote (CPU), makes
  the engine's stream wait for the last part (CUDA), waits for the copies
  and lets the blocks' pins go.

No vLLM here: the GPU check script drives it as the connector does.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Sequence

from ... import gpu
from .blocks import HEADER_SIZE, PARALLEL_VERIFY_BYTES, BlockStore
from .groups import NULL_BLOCK, block_numbers

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ...pool import Pool


def layer_runs(n: int) -> list[tuple[int, int]]:
    """Runs of `n` layers loaded together on CUDA: [0,1), [1,2), [2,4), [4,8), ...: the first layer is
    ready after a copy of one layer's bytes, and each run is ready by the time the layers before it have
    run if a layer computes at least as long as it loads."""
    out, a, size = [], 0, 1
    while a < n:
        b = min(n, a + size)
        out.append((a, b))
        if a:
            size *= 2
        a = b
    return out


class _Request:
    """One request's blocks of a step: rows of its loaded blocks' payloads, and where each group's go."""

    def __init__(self, rows: "torch.Tensor", block_ids: Sequence[Any], paged: Any) -> None:
        self.rows = rows  # [n, payload_bytes] uint8 on the cache's device (filled later on CUDA)
        # Per group (None: a model of one group): the rows it writes (None: all) and the engine's block ids.
        self.targets: dict[int | None, tuple[Any, "torch.Tensor"]] = {}
        parts = paged.layer_parts()
        for g in {g for _, _, _, g in parts}:
            layers = next(p for p, _, _, gg in parts if gg == g)
            if g is None:
                self.targets[g] = (None, layers.device_ids(block_ids))
                continue
            keep = [k for k, ids in enumerate(block_ids) if ids[g] != NULL_BLOCK]  # a window's null block: skip
            sel = None if len(keep) == len(block_ids) else layers.device_ids(keep)
            self.targets[g] = (sel, layers.device_ids([block_ids[k][g] for k in keep]))

    def write(self, part: tuple) -> None:
        layers, i, off, g = part
        sel, ids = self.targets[g]
        if ids.numel():
            data = self.rows[:, off : off + layers.layer_bytes]
            layers.scatter_layer(i, ids, data if sel is None else data.index_select(0, sel))


class LayerLoads:
    """One step's loads in the per-layer mode (see the module doc): `start`, `wait` per layer, `finish`."""

    def __init__(self, store: BlockStore, paged: Any, layer_names: Sequence[str], stream: Any = None,
                 by_runs: bool | None = None) -> None:
        self.store, self.paged = store, paged
        self.parts = paged.layer_parts()
        if len(layer_names) != len(self.parts):
            raise ValueError(f"{len(layer_names)} layer names for {len(self.parts)} layers of the KV cache")
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.cuda = paged.device.type == "cuda"
        # The CUDA way (pin, then copies and scatters run by run); on the CPU too with by_runs=True, so the
        # checks without a GPU cover its bytes (everything lands at `start` there: no stream to overlap).
        self.by_runs = self.cuda if by_runs is None else by_runs
        self.stream = stream
        self._reqs: list[_Request] = []
        self._written: list[bool] = []  # CPU: layers written into the cache this step
        self._events: list = []  # CUDA: per layer, the event of its run's copies
        self._pins: list = []  # CUDA: (pool, views) pinned until the copies are done

    # ------------------------------------------------------------------ the step

    def start(self, transfers: Sequence[Any]) -> set[int]:
        """Load `transfers` (each with .digests and .block_ids); the engine's block ids not loaded."""
        errors: set[int] = set()
        self._reqs, self._written, self._events, self._pins = [], [False] * len(self.parts), [], []
        loaded = []
        for t in transfers:
            try:
                n, rows = self._pin(t.digests) if self.by_runs else self._load_host(t.digests)
            except Exception as e:
                self.store.faults.fault("error", e)
                n, rows = 0, None
            errors |= block_numbers(t.block_ids[n:])
            if n:
                loaded.append((rows, t.block_ids[:n]))
        if self.by_runs and loaded:
            try:
                self._queue(loaded)
            except Exception as e:  # what was queued may have landed in part: recomputed, as not loaded
                self.store.faults.fault("error", e)
                for _, ids in loaded:
                    errors |= block_numbers(ids)
        else:
            self._reqs = [_Request(rows, ids, self.paged) for rows, ids in loaded]
        return errors

    def wait(self, layer_name: str) -> None:
        """Before layer `layer_name` runs: its blocks are in the cache (CPU), or the engine's stream waits
        for them (CUDA).  An unknown name: every layer."""
        i = self.index.get(layer_name)
        if self.by_runs:
            if self._events:
                import torch

                ev = self._events[-1] if i is None else self._events[i]
                torch.cuda.current_stream(self.paged.device).wait_event(ev)
            return
        for k in (range(len(self.parts)) if i is None else (i,)):
            if not self._written[k]:
                self._written[k] = True
                for r in self._reqs:
                    r.write(self.parts[k])

    def finish(self) -> None:
        """The step's end: every layer in the cache (or the engine's stream after every copy), pins let go."""
        try:
            if self._events or not self.by_runs:
                self.wait("")  # no layer has that name: all of them
            if self._events:
                self._events[-1].synchronize()
        finally:
            pins, self._pins = self._pins, []
            for pool, views in pins:
                try:
                    pool.release_many(views)
                finally:
                    self.store.pool.release(pool)
            self._reqs, self._events = [], []

    # ------------------------------------------------------------------ CPU

    def _load_host(self, digests: Sequence[bytes]) -> tuple[int, "torch.Tensor"]:
        """Every block whole into host rows, checked (BlockStore.load); the layers are written at `wait`."""
        rows = self.store.staging(len(digests), "cpu")[:, HEADER_SIZE:]
        n = self.store.load(digests, rows)
        return n, rows[:n]

    # ------------------------------------------------------------------ CUDA

    def _pin(self, digests: Sequence[bytes]) -> tuple[int, Any]:
        """Pin the leading blocks that are there and sound (header, checksum): (how many, (pool, views))."""
        store = self.store
        pool = store.pool.acquire()
        if pool is None:
            if digests:
                store.faults.count("missing", len(digests))
            return 0, None
        views: list = []
        n = 0
        try:
            views = pool.view_many([store.key(d) for d in digests])
            n, why = store.check_headers(digests, views)
            if n and store.verify:
                sound = gpu.start_checksums(views[:n], PARALLEL_VERIFY_BYTES)()
                if not all(sound):
                    n, why = sound.index(False), "corrupt"
            store.report(pool, digests, n, why)
        except Exception as e:
            store.faults.fault("error", e)
            n = 0
        pool.release_many(views[n:])
        if not n:
            store.pool.release(pool)
            return 0, None
        self._pins.append((pool, views[:n]))
        store.faults.count("loaded", n)
        store.faults.count("loaded_bytes", n * store.payload_bytes)
        return n, (pool, views[:n])

    def _queue(self, loaded: list) -> None:
        """Queue every request's copies run of layers by run of layers, each run's scatters after its copies
        and an event after those (the engine's layers wait for their run's event)."""
        import torch

        dev, store = self.paged.device, self.store
        stream = self.stream
        ends = [off + layers.layer_bytes for layers, _, off, _ in self.parts]
        events = [None] * len(self.parts)
        with torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext():
            jobs = []
            for (pool, views), block_ids in loaded:
                rows = store.staging(len(views), dev)[:, HEADER_SIZE:]
                offs = [v.offset + HEADER_SIZE for v in views]
                jobs.append((pool, views, offs, rows))
                self._reqs.append(_Request(rows, block_ids, self.paged))
            for a, b in layer_runs(len(self.parts)):
                lo, hi = self.parts[a][2], ends[b - 1]
                for (pool, views, offs, rows), req in zip(jobs, self._reqs):
                    _copy_columns(pool, rows, offs, lo, hi)
                    for k in range(a, b):
                        req.write(self.parts[k])
                if self.cuda:
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events[a:b] = [ev] * (b - a)
        self._events = events if self.cuda else []


def _copy_columns(pool: "Pool", rows: "torch.Tensor", offs: Sequence[int], lo: int, hi: int) -> None:
    """Bytes [lo, hi) of each value's payload (at pool offset offs[k]) into rows[k, lo:hi]: a run of whole
    payloads in one copy (gpu.copy_runs), else one copy a block."""
    if lo == 0 and hi == rows.shape[1]:
        gpu.copy_runs(pool, list(rows.unbind(0)), offs, to_pool=False, values=[HEADER_SIZE + hi] * len(offs))
        return
    seg = gpu.segment_tensor(pool)
    for k, off in enumerate(offs):
        gpu.copy_with_pool(rows[k, lo:hi], seg[off + lo : off + hi], pool, off + lo, non_blocking=True)


__all__ = ["LayerLoads", "layer_runs"]
