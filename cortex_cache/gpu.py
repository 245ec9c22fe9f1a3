"""GPU staging: torch tensors over pool entries, pinned host memory, batched transfers, paged-KV gather/scatter.

torch is imported here only, and only when one of these functions runs (the
extra `gpu`), so `import cortex_cache` and the CLI never load it.  On a
machine without CUDA everything works on CPU tensors; asking for a CUDA
device there raises GpuUnavailable (exit 69 from the CLI).

- `entry_tensor(pool, key, dtype, shape)`: a zero-copy tensor over an
  entry's bytes.  The entry is pinned (not evicted, its blocks not reused)
  until the tensor's storage is freed -- every view of it included.  Do not
  write to it: the pool checksums values at put.
- `pin_memory(pool)`: registers this handle's mapping of the data region
  with `cudaHostRegister` (portable), once, in pieces of 1 GiB on a thread of
  its own (`background=True` returns at once: cortex_cache/pinning.py); it is
  unregistered before the mapping goes (`pool.close()`), so copies between
  the pool and the GPU run at full PCIe/NVLink-C2C speed with no bounce
  buffer.  Every copy here is split where pieces meet, so none spans memory
  partly registered.
- `load(pool, keys, ...)` / `store(pool, keys, tensors, ...)`: batched,
  asynchronous on the caller's stream; they return a `Transfer` whose
  `event` completes when the copies have, and whose `wait()` (or `with`)
  synchronises and releases the entries (load) or commits them (store).
  A store copies device-to-host straight into reserved pool memory
  (`Pool.reserve_write`): no intermediate buffer.
- `gather_blocks` / `scatter_blocks`: between a chunk of tokens and a paged KV
  cache laid out as vLLM does, per layer `[2, num_blocks, block_size,
  num_heads, head_dim]`; a chunk is `[num_layers, 2, tokens, num_heads,
  head_dim]`.  `store_blocks` / `load_blocks` do that between the pool and
  the GPU cache in one call.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from . import pinning
from .errors import GpuUnavailable, KeyNotFound, ServiceUnavailable, UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .pool import Pool

_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def torch_module():
    try:
        import torch
    except ImportError:
        raise ServiceUnavailable("torch is not installed: pip install 'cortex-cache[gpu]'") from None
    return torch


def cuda_available() -> bool:
    return torch_module().cuda.is_available()


def device_of(device: Any) -> "torch.device":
    """A torch.device; GpuUnavailable when CUDA is asked for and there is none."""
    torch = torch_module()
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GpuUnavailable(f"{device} was asked for, but no CUDA device is available here")
    if dev.type not in ("cuda", "cpu"):
        raise UsageError(f"device {device!r}: cortex_cache.gpu moves data between the pool and cuda or cpu")
    return dev


def as_dtype(dtype: Any) -> "torch.dtype":
    torch = torch_module()
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise UsageError(f"unknown dtype {dtype!r}: give a torch.dtype such as torch.float16")


def _shape(shape: Any, nbytes: int, itemsize: int) -> tuple[int, ...]:
    if shape is None:
        if nbytes % itemsize:
            raise UsageError(f"a value of {nbytes} bytes is not a whole number of {itemsize}-byte items")
        return (nbytes // itemsize,)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape) or int(np.prod(shape, dtype=np.int64)) * itemsize != nbytes:
        raise UsageError(f"shape {shape} of {itemsize}-byte items does not match a value of {nbytes} bytes")
    return shape


def host_tensor(pool: "Pool", off: int, nbytes: int, dtype: "torch.dtype", shape: tuple[int, ...]) -> "torch.Tensor":
    """A CPU tensor over bytes of the pool's mapping (no copy); keeps the mapping alive while it lives."""
    torch = torch_module()
    arr = pool.core.value_array(off, nbytes)
    return torch.from_numpy(arr).view(dtype).view(shape)


# ------------------------------------------------------------------ zero-copy tensors


def entry_tensor(pool: "Pool", key: str | bytes, dtype: Any, shape: Sequence[int] | None = None,
                 offset: int = 0) -> "torch.Tensor":
    """A CPU tensor over `key`'s value (from byte `offset`), sharing the pool's memory.

    The entry stays pinned while the tensor's storage lives (views of it
    included), so eviction and delete cannot reuse its blocks under it.
    Raises KeyNotFound, UsageError (shape or dtype does not match the value).
    """
    torch = torch_module()
    dt = as_dtype(dtype)
    ev = pool.view(key)  # pins the entry
    try:
        mv = ev.memoryview
        assert mv is not None
        nbytes = mv.nbytes - offset
        if offset < 0 or nbytes < 0:
            raise UsageError(f"offset {offset} is outside a value of {mv.nbytes} bytes")
        itemsize = torch.empty((), dtype=dt).element_size()
        shp = _shape(shape, nbytes, itemsize)
        arr = pool.core.value_array(ev.offset + offset, nbytes)
    except BaseException:
        ev.release()
        raise
    # The numpy array is the storage's owner: torch keeps it alive exactly as
    # long as some tensor uses the memory, so its finaliser is the unpin.
    ev.detach()  # released by the finaliser, not by pool.close()
    weakref.finalize(arr, _release_view, ev)
    return torch.from_numpy(arr).view(dt).view(shp)


def _release_view(ev: Any) -> None:
    try:
        ev.release()
    except Exception:
        pass  # the pool was closed: the pin goes with this process


# ------------------------------------------------------------------ pinned memory


class _CudaHost:
    """cudaHostRegister (portable) of one piece through a CUDA runtime: torch.cuda.cudart(), or a test's fake."""

    what = "cudaHostRegister"
    error = GpuUnavailable

    def __init__(self, cudart: Any) -> None:
        self.cudart = cudart  # torch's binding lets the GIL go during each call

    def _check(self, err: Any, call: str, nbytes: int) -> None:
        err = int(err)
        if err != 0:
            name = getattr(self.cudart, "cudaGetErrorString", None)
            why = f" ({name(err)})" if name is not None else ""
            raise GpuUnavailable(f"{call} of {nbytes} bytes failed with CUDA error {err}{why}")

    def register(self, addr: int, nbytes: int) -> None:
        self._check(self.cudart.cudaHostRegister(addr, nbytes, _REGISTER_PORTABLE), "cudaHostRegister", nbytes)

    def unregister(self, addr: int, nbytes: int) -> None:
        self._check(self.cudart.cudaHostUnregister(addr), "cudaHostUnregister", nbytes)


def pin_memory(pool: "Pool", *, background: bool = False, piece: int = pinning.PIECE,
               cudart: Any = None) -> "pinning.Pinning | None":
    """Register the pool's data region (this handle's mapping) with CUDA, in pieces; None without CUDA.

    Once per handle (a second call returns the first's Pinning); every piece
    registered is unregistered by `pool.close()` before the mapping goes.
    The pieces (`piece` bytes, rounded up to whole blocks; 1 GiB by default)
    are registered in order on a thread of its own, each usable as soon as it
    is: `background=True` returns at once (the Pinning says how far it got,
    `wait()` blocks until it is done; a piece that fails stops it, logged
    once, never raised); `background=False` waits, and raises GpuUnavailable
    if a piece was refused (those before it stay registered).
    `cudart`: the CUDA runtime to call (default torch.cuda.cudart()).
    """
    if cudart is None:
        torch = torch_module()
        if not torch.cuda.is_available():
            return None
        cudart = torch.cuda.cudart()
    if pool.geometry.data_size <= 0:
        return None  # never register zero bytes
    return pinning.pin(pool, _CudaHost(cudart), piece=piece, background=background)


def pinned_memory(pool: "Pool") -> "pinning.Pinning | None":
    """This handle's CUDA registration (complete or under way), or None."""
    return pinning.pinning_of(pool, _CudaHost.what)


def is_pinned(pool: "Pool") -> bool:
    """True once this handle's whole data region is registered with CUDA."""
    p = pinned_memory(pool)
    return p is not None and p.complete


def _byte_view(t: "torch.Tensor") -> "torch.Tensor":
    torch = torch_module()
    return t.reshape(-1).view(torch.uint8)


def copy_with_pool(dst: "torch.Tensor", src: "torch.Tensor", pool: "Pool", off: int, *,
                   non_blocking: bool = False) -> None:
    """`dst.copy_(src)`, where one of them is a contiguous tensor over the pool's bytes at segment offset `off`.

    Where those bytes cross a boundary between pieces of this handle's
    registration (`pin_memory`), the copy is made in one part per piece, so
    each part runs over host memory wholly registered or wholly not: CUDA
    refuses (invalid argument) a copy over memory partly registered, which a
    registration under way leaves at its edge, and batched copies over two
    registrations.  Without a registration this is `dst.copy_(src)`.
    """
    if not pinning.active(pool):
        dst.copy_(src, non_blocking=non_blocking)
        return
    pool_side = src if _in_pool(pool, src) else dst
    parts = pinning.cuts(pool, off, pool_side.numel() * pool_side.element_size())
    if len(parts) == 1:
        dst.copy_(src, non_blocking=non_blocking)
        return
    torch = torch_module()
    if pool_side is dst:  # the caller's tensor in one layout and dtype with the pool's, on its own device
        src = src.to(dtype=dst.dtype).expand(dst.shape).contiguous()
        land = dst
    elif dst.is_contiguous() and dst.dtype == src.dtype and dst.shape == src.shape:
        land = dst
    else:  # land the pool's bytes in a contiguous tensor on dst's device, then in dst as it is laid out
        land = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
    d, s = _byte_view(land), _byte_view(src)
    for a, b in parts:
        d[a:b].copy_(s[a:b], non_blocking=non_blocking)
    if land is not dst:
        dst.copy_(land, non_blocking=non_blocking)


def _in_pool(pool: "Pool", t: "torch.Tensor") -> bool:
    if t.device.type != "cpu":
        return False
    base, size = pool.core.data_region()
    return base <= t.data_ptr() < base + size


# ------------------------------------------------------------------ the segment as one tensor, runs of values

_segments: "weakref.WeakKeyDictionary[Pool, torch.Tensor]" = weakref.WeakKeyDictionary()
_segments_lock = threading.Lock()


def segment_tensor(pool: "Pool") -> "torch.Tensor":
    """A uint8 CPU tensor over this handle's whole mapping, made once per handle and dropped when it closes.

    A copy slices it at a value's offset: a slice is one cheap torch call,
    where a numpy array and a tensor made per value cost ~10 us of Python
    each (a quarter of what a CUDA load spent per value on the H200)."""
    t = _segments.get(pool)
    if t is not None:
        return t
    torch = torch_module()
    with _segments_lock:
        t = _segments.get(pool)
        if t is None:
            t = torch.from_numpy(pool.core.value_array(0, len(pool.core.seg.mm)))
            _segments[pool] = t
            ref = weakref.ref(pool)
            pool.add_close_hook(lambda: _forget_segment(ref))  # before the mapping goes
    return t


def _forget_segment(ref: Any) -> None:
    pool = ref()
    if pool is not None:
        _segments.pop(pool, None)


def slot_bytes(pool: "Pool", nbytes: int) -> int:
    """What a value of `nbytes` occupies in the pool: whole blocks.  Values reserved together usually lie
    one slot after another, and rows of this width then match them byte for byte."""
    bs = pool.geometry.block_size
    return -(-nbytes // bs) * bs


def _runs(pool: "Pool", rows: Sequence["torch.Tensor"], offs: Sequence[int], merge: bool,
          values: Sequence[int] | None = None, cap: int = 0) -> list[tuple[int, int]]:
    """Index ranges [a, b) of `rows` (contiguous uint8 tensors, one per value, at pool offset `offs[k]`, a
    part of a value of `values[k]` bytes, default the row's own) that one copy can move: each value of the
    run one slot after the last in the pool (so the bytes between two rows are the first value's padding
    and the second's bytes before the row, never another entry's) and as far after it in one storage.
    A run ends at `cap` bytes (default CHECKSUM_GROUP_BYTES: a store checksums each run once it has
    landed, so runs that size let the checksums of the first overlap the copies of the next)."""
    cap = cap or CHECKSUM_GROUP_BYTES
    n = len(rows)
    if not merge or n < 2:
        return [(k, k + 1) for k in range(n)]
    out, a = [], 0
    bs = pool.geometry.block_size
    size = rows[0].numel()
    slots = [-(-v // bs) * bs for v in values] if values is not None else [-(-size // bs) * bs] * n
    base = rows[0].untyped_storage().data_ptr()
    ptr = rows[0].data_ptr()
    for k in range(1, n):
        r = rows[k]
        p = r.data_ptr()
        slot = slots[k - 1]
        if not (r.numel() == size and offs[k] - offs[k - 1] == slot and p - ptr == slot
                and offs[k] + size - offs[a] <= cap and r.device == rows[k - 1].device
                and r.untyped_storage().data_ptr() == base):
            out.append((a, k))
            a, size = k, r.numel()
            base = r.untyped_storage().data_ptr()
        ptr = p
    out.append((a, n))
    return out


def _copy_run(pool: "Pool", rows: Sequence["torch.Tensor"], offs: Sequence[int], a: int, b: int,
              to_pool: bool, sliced: bool = True) -> None:
    """Copy rows[a:b] to (or from) the pool as one span, from the first value's start to the last's end.
    `sliced=False`: the pool's side through a tensor made for it (what every copy cost before the
    segment's tensor: a baseline for benchmarks)."""
    first = rows[a]
    nbytes = offs[b - 1] - offs[a] + rows[b - 1].numel()
    if b - a == 1:
        other = first
    else:  # the span of the rows' storage, the bytes between rows included
        torch = torch_module()
        other = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
            first.untyped_storage(), first.storage_offset() * first.element_size(), (nbytes,))
    if sliced:
        pool_side = segment_tensor(pool)[offs[a] : offs[a] + nbytes]
    else:
        pool_side = host_tensor(pool, offs[a], nbytes, torch_module().uint8, (nbytes,))
    if to_pool:
        copy_with_pool(pool_side, other, pool, offs[a], non_blocking=True)
    else:
        copy_with_pool(other, pool_side, pool, offs[a], non_blocking=True)


def copy_runs(pool: "Pool", rows: Sequence["torch.Tensor"], offs: Sequence[int], *, to_pool: bool,
              merge: bool = True, values: Sequence[int] | None = None, cap: int = 0) -> int:
    """Copy each of `rows` (contiguous uint8 tensors on any device) to or from the pool's bytes at `offs[k]`
    (within a value of `values[k]` bytes; default: the row is the value), neighbours merged into one copy
    of at most `cap` bytes (default CHECKSUM_GROUP_BYTES) where `_runs` allows; how many copies (queued on
    the current stream for a CUDA tensor) it made."""
    runs = _runs(pool, rows, offs, merge, values, cap)
    for a, b in runs:
        _copy_run(pool, rows, offs, a, b, to_pool, sliced=merge)
    return len(runs)


# ------------------------------------------------------------------ batched transfers


class Transfer:
    """Copies queued on a stream.  `event` (None on CPU) completes with them; `wait()` finishes the job."""

    def __init__(self, tensors: list, event: Any, finish: Any) -> None:
        self.tensors = tensors
        self.event = event
        self._finish = finish

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> list:
        """Block until the copies are done, then release (load) or commit (store) the entries."""
        finish, self._finish = self._finish, None
        if finish is None:
            return self.tensors
        try:
            if self.event is not None:
                self.event.synchronize()
        finally:
            finish()
        return self.tensors

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()

    def __del__(self) -> None:
        try:
            self.wait()
        except Exception:
            pass


def _stream_ctx(dev: "torch.device", stream: Any):
    """Run on the caller's stream, after the work already queued on the current one (which made the data)."""
    torch = torch_module()
    if dev.type != "cuda":
        return _Null()
    current = torch.cuda.current_stream(dev)
    if stream is None:
        return torch.cuda.stream(current)
    if stream != current:
        stream.wait_stream(current)
    return torch.cuda.stream(stream)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _record(dev: "torch.device", stream: Any) -> Any:
    if dev.type != "cuda":
        return None
    torch = torch_module()
    ev = torch.cuda.Event()
    ev.record(stream if stream is not None else torch.cuda.current_stream(dev))
    return ev


def load(
    pool: "Pool", keys: Sequence[str | bytes], *, dtype: Any, shape: Sequence[int], device: Any = "cuda",
    out: Any = None, stream: Any = None, offset: int = 0,
) -> Transfer:
    """Copy the values of `keys` into tensors on `device` (or into `out`), asynchronously.

    `out`: a tensor of shape `[len(keys), *shape]` or a list of tensors of
    `shape`, preallocated by the caller; else new tensors are made.  Every
    key is looked up (and pinned) before any copy starts: a missing one
    raises KeyNotFound and nothing is copied.  The entries stay pinned until
    `wait()`.
    """
    keys = list(keys)
    views = pool.view_many(keys)  # every key pinned in one lock hold
    for k, v in zip(keys, views):
        if v is None or isinstance(v, Exception):
            pool.release_many(views)
            if v is None:
                raise KeyNotFound(f"no key {k!r} in pool {pool.name!r}")
            raise v
    return load_views(pool, views, dtype=dtype, shape=shape, device=device, out=out, stream=stream, offset=offset)


def load_views(
    pool: "Pool", views: list, *, dtype: Any, shape: Sequence[int], device: Any = "cuda", out: Any = None,
    stream: Any = None, offset: int = 0, merge: bool = True,
) -> Transfer:
    """`load` from entries the caller pinned already (EntryViews of `pool.view_many`, every one there):
    the transfer takes the pins over and releases them at `wait()`, or at once on an error.  For a
    caller that looked at the entries first (a header check): each is read once, so counted once.

    Values that lie one slot after another in the pool and whose rows of `out` lie as far apart in one
    tensor are copied as one span (`copy_runs`), the bytes between them included: with `out` a column
    slice of wider rows (BlockStore's staging), what lies between its rows may be overwritten.
    `merge=False` copies value by value (a baseline for benchmarks)."""

    def release() -> None:
        pool.release_many(views)

    try:
        torch = torch_module()
        dev = device_of(device)
        dt = as_dtype(dtype)
        shp = tuple(int(s) for s in shape)
        itemsize = torch.empty((), dtype=dt).element_size()
        seg = segment_tensor(pool)
        srcs = []
        starts = []
        sizes = [v.memoryview.nbytes for v in views]  # type: ignore[union-attr]
        for n in set(sizes):
            _shape(shp, n - offset, itemsize)
        for v, n in zip(views, sizes):
            start = v.offset + offset
            srcs.append(seg[start : start + n - offset])
            starts.append(start)
        if out is None:
            pin = dev.type == "cuda"
            dsts = [torch.empty(shp, dtype=dt, device=dev) for _ in srcs] if pin else \
                [s.view(dt).view(shp).clone() for s in srcs]
            if not pin:
                release()
                return Transfer(dsts, None, None)
        elif isinstance(out, (list, tuple)):
            dsts = list(out)
        else:
            if tuple(out.shape) != (len(srcs), *shp):
                raise UsageError(f"out has shape {tuple(out.shape)}, not {(len(srcs), *shp)}")
            dsts = list(out.unbind(0))
        if len(dsts) != len(srcs):
            raise UsageError(f"{len(dsts)} output tensors for {len(srcs)} keys")
        with _stream_ctx(dev, stream):
            if all(d.dtype == dt and d.is_contiguous() for d in dsts):
                copy_runs(pool, [_byte_view(d) for d in dsts], starts, to_pool=False, merge=merge, values=sizes,
                          cap=LOAD_RUN_BYTES)
            else:  # another dtype or layout: torch converts, value by value
                for d, s, start in zip(dsts, srcs, starts):
                    copy_with_pool(d, s.view(dt).view(shp), pool, start, non_blocking=True)
            event = _record(dev, stream)
    except BaseException:
        release()
        raise
    return Transfer(dsts, event, release)


def store(
    pool: "Pool", keys: Sequence[str | bytes], tensors: Sequence["torch.Tensor"], *, stream: Any = None,
    ttl: float | None = None, priority: int = 0, merge: bool = True,
) -> Transfer:
    """Copy `tensors` (CUDA or CPU, contiguous) into entries `keys`, asynchronously.

    Each value goes straight into reserved pool memory; the entries become
    visible (atomically, checksummed) at `wait()`.  If the process dies
    before, nothing half-written is ever seen.  Tensors that lie one pool
    slot apart in one storage, reserved one slot apart, are copied as one
    span (`copy_runs`; `merge=False`: value by value).
    """
    torch = torch_module()
    if len(keys) != len(tensors):
        raise UsageError(f"{len(keys)} keys for {len(tensors)} tensors")
    devs = {t.device for t in tensors}
    if len(devs) > 1:
        raise UsageError("store takes tensors of one device at a time")
    dev = device_of(devs.pop()) if devs else torch.device("cpu")
    for t in tensors:
        if not t.is_contiguous():
            raise UsageError("store needs contiguous tensors: call .contiguous() first")
    # Every value reserved in one lock hold; if one cannot be, none is kept.
    writers = pool.reserve_write_many([(k, t.numel() * t.element_size()) for k, t in zip(keys, tensors)],
                                      ttl=ttl, priority=priority)
    raise_first(pool, writers, writers)
    jobs = []
    try:
        with _stream_ctx(dev, stream):
            byte_rows = [t.reshape(-1).view(torch.uint8) for t in tensors]
            offs = [w.offset for w in writers]
            group: list = []  # memoryviews copied since the last checksum job
            group_bytes = 0
            for a, b in _runs(pool, byte_rows, offs, merge):
                _copy_run(pool, byte_rows, offs, a, b, to_pool=True, sliced=merge)
                group += [w.memoryview for w in writers[a:b]]
                group_bytes += sum(w.nbytes for w in writers[a:b])
                # The values are checksummed as soon as their copies land, on a
                # worker thread (xxhash and the event wait release the GIL), so
                # checksums overlap the copies still in flight and each other:
                # one event and one job per CHECKSUM_GROUP_BYTES (a run is at
                # most that, or one value), not per value (each costs Python
                # calls and a thread's wake-up under the GIL).
                if group_bytes >= CHECKSUM_GROUP_BYTES or b == len(writers):
                    jobs.append(copy_executor().submit(_checksums_when_done, group, _record(dev, stream)))
                    group, group_bytes = [], 0
            event = _record(dev, stream)
    except BaseException:
        for j in jobs:
            j.cancel()
        wait_jobs(jobs)
        pool.abort_many(writers)
        raise

    def commit() -> None:
        try:
            sums = [x for j in jobs for x in j.result()]
        except BaseException:
            wait_jobs(jobs)
            pool.abort_many(writers)
            raise
        raise_first(pool, pool.commit_many(writers, sums), writers)  # visible together, in one lock hold

    return Transfer(list(tensors), event, commit)


def raise_first(pool: "Pool", results: Sequence[Any], writers: Sequence[Any]) -> None:
    """If any of a batch's `results` is an error, give back every writer still open and raise the first."""
    err = next((r for r in results if isinstance(r, Exception)), None)
    if err is not None:
        pool.abort_many(writers)
        raise err


# A load's runs of values go up to this many bytes a copy (no checksum waits on a load's copies: the
# values were checked in place), so a batch of 2 MiB blocks is a few copies, not one per 8 MiB.
LOAD_RUN_BYTES = 64 << 20
_EXECUTOR = None
# Threads the checksums run on (made on first use, daemons).
CHECKSUM_THREADS = min(8, os.cpu_count() or 1)
# A store's values are checksummed in jobs of about this many bytes (one CUDA event each).
CHECKSUM_GROUP_BYTES = 8 << 20


def copy_executor():
    """Worker threads for checksums (made on first use; CHECKSUM_THREADS daemon threads)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        from concurrent.futures import ThreadPoolExecutor

        _EXECUTOR = ThreadPoolExecutor(max_workers=CHECKSUM_THREADS, thread_name_prefix="cortex-gpu")
    return _EXECUTOR


def _checksums_when_done(mvs: list, event: Any) -> list[int]:
    from xxhash import xxh3_64_intdigest

    if event is not None:
        event.synchronize()
    return [xxh3_64_intdigest(mv) for mv in mvs]


def start_checksums(views: Sequence[Any], parallel_bytes: int) -> Callable[[], list[bool]]:
    """Start `[view.verify() for view in views]`; the returned call waits for it and gives the list.

    On the checksum threads, in runs of views, when they hold
    `parallel_bytes` or more (xxhash releases the GIL): the caller can queue
    its copies meanwhile.  Below that, in the caller's thread at the call.
    One run per `parallel_bytes / 2` at most, and no more runs than threads:
    a thread woken for less hashing than that costs more than it saves.
    The views must stay pinned (and the pool open) until the call returns."""
    nbytes = sum(v.memoryview.nbytes for v in views)
    if len(views) < 2 or nbytes < parallel_bytes:
        return lambda: [v.verify() for v in views]
    k = min(CHECKSUM_THREADS, len(views), max(2, 2 * nbytes // parallel_bytes))
    runs = [views[len(views) * i // k : len(views) * (i + 1) // k] for i in range(k)]
    jobs = [copy_executor().submit(lambda run=run: [v.verify() for v in run]) for run in runs]

    def result() -> list[bool]:
        wait_jobs(jobs)  # every job done, even if one failed: none reads the views after this
        return [ok for j in jobs for ok in j.result()]

    return result


def wait_jobs(jobs: list) -> None:
    for j in jobs:
        try:
            j.result()
        except BaseException:
            pass


# ------------------------------------------------------------------ paged KV cache


def _check_paged(kv_caches: Sequence["torch.Tensor"], block_ids: Any) -> tuple["torch.Tensor", int, tuple]:
    torch = torch_module()
    if not kv_caches:
        raise UsageError("no KV cache layers given")
    c0 = kv_caches[0]
    if c0.dim() != 5 or c0.shape[0] != 2:
        raise UsageError(f"a paged KV cache layer is [2, num_blocks, block_size, num_heads, head_dim], not {tuple(c0.shape)}")
    for c in kv_caches:
        if c.shape != c0.shape or c.dtype != c0.dtype or c.device != c0.device:
            raise UsageError("all KV cache layers must have one shape, dtype and device")
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=c0.device).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= c0.shape[1]):
        raise UsageError(f"block ids must be in [0, {c0.shape[1]})")
    return ids, int(c0.shape[2]), tuple(c0.shape[3:])


def gather_blocks(kv_caches: Sequence["torch.Tensor"], block_ids: Any, out: Any = None) -> "torch.Tensor":
    """The chunk `[num_layers, 2, len(block_ids) * block_size, num_heads, head_dim]` those blocks hold."""
    torch = torch_module()
    ids, bs, (h, d) = _check_paged(kv_caches, block_ids)
    n_tok = ids.numel() * bs
    c0 = kv_caches[0]
    if out is None:
        out = torch.empty((len(kv_caches), 2, n_tok, h, d), dtype=c0.dtype, device=c0.device)
    elif tuple(out.shape) != (len(kv_caches), 2, n_tok, h, d):
        raise UsageError(f"out has shape {tuple(out.shape)}, not {(len(kv_caches), 2, n_tok, h, d)}")
    for layer, cache in enumerate(kv_caches):
        torch.index_select(cache, 1, ids, out=out[layer].view(2, ids.numel(), bs, h, d))
    return out


def scatter_blocks(chunk: "torch.Tensor", kv_caches: Sequence["torch.Tensor"], block_ids: Any) -> None:
    """Write a chunk `[num_layers, 2, tokens, num_heads, head_dim]` into those blocks of the paged cache."""
    ids, bs, (h, d) = _check_paged(kv_caches, block_ids)
    want = (len(kv_caches), 2, ids.numel() * bs, h, d)
    if tuple(chunk.shape) != want:
        raise UsageError(f"chunk has shape {tuple(chunk.shape)}, not {want} for these blocks")
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, ids, chunk[layer].to(cache.device, non_blocking=True).view(2, ids.numel(), bs, h, d))


def store_blocks(pool: "Pool", key: str | bytes, kv_caches: Sequence["torch.Tensor"], block_ids: Any, *,
                 stream: Any = None, ttl: float | None = None, priority: int = 0) -> Transfer:
    """Gather blocks of the paged cache on its device and store the chunk under `key` (async)."""
    dev = device_of(kv_caches[0].device) if kv_caches else None
    with _stream_ctx(dev, stream) if dev is not None else _Null():
        chunk = gather_blocks(kv_caches, block_ids)
    return store(pool, [key], [chunk], stream=stream, ttl=ttl, priority=priority)


def load_blocks(pool: "Pool", key: str | bytes, kv_caches: Sequence["torch.Tensor"], block_ids: Any, *,
                stream: Any = None) -> Transfer:
    """Load the chunk under `key` and scatter it into those blocks of the paged cache (async)."""
    ids, bs, (h, d) = _check_paged(kv_caches, block_ids)
    c0 = kv_caches[0]
    shape = (len(kv_caches), 2, ids.numel() * bs, h, d)
    tr = load(pool, [key], dtype=c0.dtype, shape=shape, device=c0.device, stream=stream)
    with _stream_ctx(c0.device, stream):
        scatter_blocks(tr.tensors[0], kv_caches, block_ids)
        tr.event = _record(c0.device, stream) if c0.device.type == "cuda" else None
    return tr


__all__ = [
    "cuda_available", "device_of", "entry_tensor", "segment_tensor", "slot_bytes", "copy_runs", "pin_memory",
    "pinned_memory", "is_pinned", "copy_with_pool",
    "load", "load_views", "store", "Transfer", "gather_blocks", "scatter_blocks", "store_blocks", "load_blocks",
]
