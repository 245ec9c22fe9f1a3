"""Whole KV blocks of one engine layout in a pool: keys, the header, store and load, faults as misses.

No vLLM here: the connector and the tier describe their layout and hand
this module byte rows (torch uint8 tensors on the CPU or a CUDA device).

Keys.  A block's key names its whole prefix::

    digest_i = SHA-256 chain over the prompt's token ids, one link per block
               (kv.chunk_digests with chunk_tokens = the engine's block size
               and a tag naming model, weights, KV layout and any cache salt / LoRA)
    key_i    = namespace + model + "/" + weights + "/" + rank + "/" + hex(digest_i)

(`weights`: the identity of the model's weights, cortex_cache/weights.py;
the caller hands BlockStore "model/weights" as its `model`.)

The chain is ours, not vLLM's block hashes: vLLM's are reproducible across
processes only with a cryptographic `prefix_caching_hash_algo` and the same
PYTHONHASHSEED in every process (xxhash seeds itself at random per process),
and `sha256` hashes a pickle of Python objects.  Ours depend on the tokens
and the tag alone, so any engine process, restart or host computes them.

Each value is a 64-byte header and then the block's bytes::

    0  4s  magic b"CXVB"         4 u16 version (1)     6 u16 reserved
    8  16s fingerprint: the first 16 bytes of SHA-256 of the writer's layout
           (model tag, dtype, layers, heads, head size, block size, physical
           block shape, rank) -- see `fingerprint`
    24 16s the first 16 bytes of this block's chain digest (the key's own)
    40 u64 payload bytes         48 u32 block tokens   52 .. 63 zero

A value whose header is not exactly the one this reader would have written
for that key -- another layout or rank, another key's bytes, anything else
-- is a miss ("foreign"), never loaded; with `verify` a value whose bytes no
longer match the pool's checksum is a miss too ("corrupt"), and is deleted.  Every fault
(pool missing or unusable, pool full, foreign, corrupt, an entry gone
between lookup and load) is counted in `stats` and logged once per kind;
nothing raises into the engine.

Copies go through cortex_cache.gpu (`store`, `load`): on CUDA they are
asynchronous copies between the device and pinned pool memory; on the CPU
the same calls are plain copies.  One exception: `Saver`, the connector's
save thread, copies a CPU cache with numpy (`PagedLayers.gather_host`,
`BlockStore.save_host`), since torch's CPU copies from a second thread run
on the thread pool the engine's forward pass uses.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import struct
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Sequence

import numpy as np

from ... import gpu
from ...errors import CortexCacheError
from ...kv import chunk_digests
from ...lookups import LookupMemo, count_lookups
from ..pools import NameWatch, open_or_create

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ...pool import Pool

HEADER = struct.Struct("<4sHH16s16sQI12x")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 64
MAGIC = b"CXVB"
VERSION = 1

logger = logging.getLogger("cortex_cache.integrations.vllm")

STAT_NAMES = ("lookups", "hit_blocks", "loaded", "stored", "loaded_bytes", "stored_bytes", "missing", "foreign",
              "corrupt", "store_failed", "unavailable", "error")
FAULT_NAMES = ("missing", "foreign", "corrupt", "store_failed", "unavailable", "error")

# A load checks its blocks' checksums on several threads from this many bytes on (below it, the hop to a
# thread costs more than it saves).
PARALLEL_VERIFY_BYTES = 4 << 20
# Host rows a CPU load or save copies through, kept from one batch to the next (HostRows).
HOST_ROWS_BYTES = 64 << 20
# Pool block sizes an adapter picks from for its values: page-sized and up (values start on a page,
# which pinned copies like), at most the pool's default.
FIT_BLOCK_SIZES = tuple(4096 << i for i in range(5))  # 4 KiB .. 64 KiB


def prefix_digests(tokens: Any, block_tokens: int, tag: bytes) -> list[bytes]:
    """The chain digest of every whole block of `tokens` (see the module doc)."""
    return chunk_digests(tokens, block_tokens, tag)


def fingerprint(*parts: object) -> bytes:
    """16 bytes naming a writer's layout: SHA-256 over the parts, NUL-separated."""
    return hashlib.sha256(b"\0".join(str(p).encode() for p in parts)).digest()[:16]


def block_fill(block_size: int, value_bytes: int) -> float:
    """The share of the pool blocks a value of `value_bytes` occupies that holds its bytes."""
    return value_bytes / (-(-value_bytes // block_size) * block_size)


def fit_block_size(value_bytes: int) -> int:
    """The pool block size for values of `value_bytes`: of FIT_BLOCK_SIZES the one they fill best
    (the largest of those within 1% of the best: fewer, larger blocks cost the pool less)."""
    best = max(block_fill(b, value_bytes) for b in FIT_BLOCK_SIZES)
    return max(b for b in FIT_BLOCK_SIZES if block_fill(b, value_bytes) >= best - 0.01)


class Faults:
    """Counters of what went wrong (each one a miss for the engine); each kind is logged once.

    Counted from the engine's thread and the saver's (`count` is locked)."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.stats[kind] = self.stats.get(kind, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.stats)

    def once(self, kind: str, message: str, *args: object) -> None:
        """Log `message` the first time `kind` is given (a note, not a fault: nothing is counted)."""
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("%s: " + message, self.who, *args)

    def fault(self, kind: str, detail: object, n: int = 1) -> None:
        self.count(kind, n)
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("%s: %s: %s (served as a miss; further %s faults are only counted)",
                           self.who, kind, detail, kind)


class PoolRef:
    """The pool an adapter names: opened on first use, and again after it failed (at most every `retry_s`).

    A pool that is missing when the engine starts is a miss until someone
    creates it: a call finds it at once when something has come to the
    name's path since the last try (one stat, `NameWatch`), else the open is
    tried again every `retry_s`.  One replaced (restore --replace, resize)
    or deleted under a running engine says so in its segment
    (Pool.superseded): the next call opens the pool now under the name, or
    none until one is created again.

    Every call that reads or writes through the pool holds a lease on the
    handle it uses (`acquire` / `release`, or `use`): saves run on a thread of
    their own and loads on the engine's, and a copy may still run through
    the old mapping when another thread sees the pool superseded.  The old
    handle is closed when its last lease ends, so the process lets the old
    copy go (`status` stops listing it under "on old copies"); a CUDA load
    hands its lease to the transfer, which ends it once the copies are done.
    `on_open(pool)` is called for every pool opened (a note, or pinning it
    for the device).
    """

    def __init__(self, name: str, params: dict[str, Any], faults: Faults, retry_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_open: "Callable[[Pool], None] | None" = None) -> None:
        self.name = name
        self._params = params
        self._faults = faults
        self._retry_s = retry_s
        self._clock = clock
        self._on_open = on_open
        self._lock = threading.Lock()
        self._pool: "Pool | None" = None
        self._leases: dict[int, int] = {}  # id(pool) -> calls using it (a pool with a lease is alive)
        self._retired: dict[int, "Pool"] = {}  # let go while in use: closed by their last release
        self._next_try = 0.0
        self._watch = NameWatch(name)  # a pool created or restored under the name: tried at the next call
        self.moves = 0  # how many times a replaced or deleted pool was let go

    def _current(self) -> "Pool | None":
        """The pool to use now (lock held)."""
        pool = self._pool
        if pool is not None:
            if not pool.superseded:
                return pool
            self._pool = None  # replaced or deleted under us: follow the name
            self._let_go(pool)
            self.moves += 1
            self._next_try = 0.0
        now = self._clock()
        if now < self._next_try and not self._watch.changed():
            return None
        self._next_try = now + self._retry_s
        seen = self._watch.before()
        try:
            pool = open_or_create(self.name, self._params)
        except CortexCacheError as e:
            self._faults.fault("unavailable", e)
            self._watch.failed(seen)
            return None
        if pool.superseded:  # a delete marked it, not unlinked yet
            pool.close()
            self._watch.failed(seen)
            return None
        self._pool = pool
        if self._on_open is not None:
            try:
                self._on_open(pool)
            except Exception as e:  # a note about the pool must not cost the pool
                self._faults.fault("error", e)
        return pool

    def _let_go(self, pool: "Pool") -> None:
        if self._leases.get(id(pool)):
            self._retired[id(pool)] = pool
        else:
            pool.close()

    def get(self) -> "Pool | None":
        """The pool now under the name, without a lease: to ask whether there is one, or for a caller that is
        the only thread using this PoolRef (another may close the handle it returns once it is superseded)."""
        with self._lock:
            return self._current()

    def acquire(self) -> "Pool | None":
        """The pool to use for one call (None while there is none), open until `release(pool)`."""
        with self._lock:
            pool = self._pool
            if pool is None or pool.superseded:
                pool = self._current()
                if pool is None:
                    return None
            leases, k = self._leases, id(pool)
            leases[k] = leases.get(k, 0) + 1
            return pool

    def release(self, pool: "Pool | None") -> None:
        """End a lease `acquire` gave; a handle let go meanwhile is closed with its last one."""
        if pool is None:
            return
        k = id(pool)
        with self._lock:
            leases = self._leases
            left = leases[k] - 1
            if left:
                leases[k] = left
                return
            del leases[k]
            if not self._retired:
                return
            retired = self._retired.pop(k, None)
        if retired is not None:
            retired.close()

    @contextmanager
    def use(self) -> "Iterator[Pool | None]":
        pool = self.acquire()
        try:
            yield pool
        finally:
            self.release(pool)

    def held(self) -> int:
        """Handles open: the pool now in use, and those let go whose calls have not ended yet."""
        with self._lock:
            return (self._pool is not None) + len(self._retired)

    def close(self) -> None:
        """Let the pool go (closed now, or by the last call still using it) and open none again."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._next_try = float("inf")
            if pool is not None:
                self._let_go(pool)


class _Leased:
    """A transfer whose copies still read a pool: `wait` ends it and then the lease on the handle."""

    __slots__ = ("transfer", "_end")

    def __init__(self, transfer: Any, end: Callable[[], None]) -> None:
        self.transfer = transfer
        self._end: "Callable[[], None] | None" = end

    def wait(self) -> Any:
        try:
            return self.transfer.wait()
        finally:
            end, self._end = self._end, None
            if end is not None:
                end()


class BlockStore:
    """One rank's blocks of one layout in a pool: which are there, store rows, load rows."""

    def __init__(self, pool: PoolRef, faults: Faults, *, namespace: str, model: str, rank: str,
                 fingerprint: bytes, payload_bytes: int, block_tokens: int, verify: bool = True) -> None:
        self.pool = pool
        self.faults = faults
        self.prefix = f"{namespace}{model}/{rank}/"
        self.payload_bytes = payload_bytes
        self.block_tokens = block_tokens
        self.verify = verify
        self._fixed = HEADER.pack(MAGIC, VERSION, 0, fingerprint, bytes(16), payload_bytes, block_tokens)
        self.memo = LookupMemo(self.prefix)  # `present` per request id: see cortex_cache/lookups.py
        self.merge = True  # copies of neighbouring values merged (False: value by value, a benchmark's baseline)

    def key(self, digest: bytes) -> str:
        return self.prefix + digest.hex()

    def header(self, digest: bytes) -> bytes:
        return self._fixed[:24] + digest[:16] + self._fixed[40:]

    def row_bytes(self) -> int:
        """What a value takes in the pool now under the name (whole pool blocks): the row width at which
        `staging` rows lie as the values of a batch do, so a run of them moves in one copy."""
        value = HEADER_SIZE + self.payload_bytes
        pool = self.pool.get()
        try:
            return gpu.slot_bytes(pool, value) if pool is not None else value
        except Exception:  # a pool closed under us: plain rows
            return value

    def staging(self, n: int, device: Any) -> "torch.Tensor":
        """Rows for `save`: `[n, HEADER_SIZE + payload_bytes]` uint8 on `device`; fill `[:, HEADER_SIZE:]`.
        A view of wider rows (`row_bytes`): `save` and `load` may write the bytes between them."""
        import torch

        rows = torch.empty((n, self.row_bytes()), dtype=torch.uint8, device=device)
        return rows[:, : HEADER_SIZE + self.payload_bytes]

    def absent(self, digests: Sequence[bytes]) -> list[int]:
        """Indices of the digests whose keys the pool does not hold (its index only: no I/O)."""
        pool = self.pool.acquire()
        if pool is None:
            return []  # nowhere to store them
        try:
            held = pool.contains_many([self.key(d) for d in digests])  # one lock hold
            return [i for i, h in enumerate(held) if not h]
        except Exception as e:  # a pool that breaks under us stores nothing
            self.faults.fault("error", e)
            return []
        finally:
            self.pool.release(pool)

    def present(self, digests: Sequence[bytes], start: int = 0, stop: int | None = None,
                request_id: Any = None) -> int:
        """How many leading digests of `digests[start:stop]` have their keys in the pool (its index only:
        never reads a value or the disk).  With `request_id` the answer is remembered for that request
        (`digests` are its chain, which only grows), so a repeat looks up only what may have changed;
        `forget` it when the request is done."""
        pool = self.pool.acquire()
        if pool is None:
            return 0
        try:
            if request_id is not None:
                return self.memo.leading(pool, request_id, digests, start, stop)
            return pool.leading([self.key(d) for d in digests[start:stop]])  # one lock hold
        except Exception as e:
            self.faults.fault("error", e)
            return 0
        finally:
            self.pool.release(pool)

    def forget(self, request_id: Any) -> None:
        self.memo.forget(request_id)

    def count_lookup(self, hits: int, misses: int) -> None:
        """Add a lookup's outcome to the pool's own hit and miss counters (what `cortex cache status`,
        `--watch` and the exporter show): `present` only probes the index, which counts nothing.
        (A block's load counts as a hit by itself: the pool's reads count.)"""
        if not (hits or misses):
            return
        pool = self.pool.acquire()
        if pool is None:
            return
        try:
            count_lookups(pool, hits, misses)
        except Exception as e:
            self.faults.fault("error", e)
        finally:
            self.pool.release(pool)

    def _store_target(self, n: int) -> "Pool | None":
        """The pool to store `n` blocks into, leased (the caller releases it); None (counted as `n` failed
        stores when n > 0) without one."""
        if n == 0:
            return None
        pool = self.pool.acquire()
        if pool is None:
            self.faults.count("store_failed", n)
        return pool

    def save(self, digests: Sequence[bytes], rows: "torch.Tensor", stream: Any = None) -> int:
        """Store `rows` (from `staging`, payload filled) under `digests`' keys; how many were stored.

        The headers are written here.  The entries become visible together,
        checksummed, when every copy has landed; a process killed before
        leaves nothing visible.  A full pool (or any fault) stores none of them.
        """
        n = len(digests)
        pool = self._store_target(n)
        if pool is None:
            return 0
        import torch

        heads = torch.frombuffer(bytearray(b"".join(self.header(d) for d in digests)), dtype=torch.uint8)
        try:
            if rows.device.type == "cuda":
                # Queued on the stream the copies to the pool run on, from pinned memory: a blocking copy
                # would make torch wait for everything queued on the stream before it (the forward pass
                # a save waits for, its gather).
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    rows[:, :HEADER_SIZE].copy_(heads.pin_memory().view(n, HEADER_SIZE), non_blocking=True)
            else:
                rows[:, :HEADER_SIZE].copy_(heads.view(n, HEADER_SIZE))
            gpu.store(pool, [self.key(d) for d in digests], list(rows.unbind(0)), stream=stream,
                      merge=self.merge).wait()
        except Exception as e:  # pool full, value too large, a broken pool: the engine goes on
            self.faults.fault("store_failed", e, n)
            return 0
        finally:
            self.pool.release(pool)
        self.faults.count("stored", n)
        self.faults.count("stored_bytes", n * self.payload_bytes)
        return n

    def save_host(self, digests: Sequence[bytes], rows: np.ndarray) -> int:
        """`save` for rows in host memory (`[n, HEADER_SIZE + payload_bytes]` uint8, payload filled), with
        numpy copies only: for a thread beside the engine's, where torch's copies would run on the
        engine's own thread pool.  The same contract: visible together, checksummed, or none."""
        n = len(digests)
        pool = self._store_target(n)
        if pool is None:
            return 0
        writers: list = []
        try:
            rows[:, :HEADER_SIZE] = np.frombuffer(b"".join(self.header(d) for d in digests), np.uint8).reshape(n, -1)
            writers = pool.reserve_write_many([(self.key(d), rows.shape[1]) for d in digests])  # one lock hold
            gpu.raise_first(pool, writers, writers)
            for w, row in zip(writers, rows):
                np.frombuffer(w.memoryview, np.uint8)[:] = row
            gpu.raise_first(pool, pool.commit_many(writers), writers)  # visible together, one lock hold
        except Exception as e:  # pool full, value too large, a broken pool: the engine goes on
            if writers:
                try:
                    pool.abort_many(writers)
                except Exception:
                    pass  # a pool gone under us: its space went with it
            self.faults.fault("store_failed", e, n)
            return 0
        finally:
            self.pool.release(pool)
        self.faults.count("stored", n)
        self.faults.count("stored_bytes", n * self.payload_bytes)
        return n

    def check_headers(self, digests: Sequence[bytes], views: list) -> tuple[int, str]:
        """How many leading views hold a block under the header this reader would have written for
        `digests`, and the fault of the first that does not ('' if all do): "missing", or "foreign"
        (another writer's bytes or layout)."""
        for i, (d, ev) in enumerate(zip(digests, views)):
            if ev is None or isinstance(ev, Exception):
                return i, "missing"
            mv = ev.memoryview
            if mv.nbytes != HEADER_SIZE + self.payload_bytes or bytes(mv[:HEADER_SIZE]) != self.header(d):
                return i, "foreign"
        return len(views), ""

    def report(self, pool: "Pool", digests: Sequence[bytes], n: int, why: str) -> None:
        """Count the fault `why` ("missing", "foreign", "corrupt" or '' for none) of block `n` of a load."""
        if why == "missing":
            self.faults.fault("missing", f"{self.key(digests[n])} left the pool between lookup and load")
        elif why:
            self.faults.fault(why, f"{self.key(digests[n])} in pool {pool.name!r}")
            if why == "corrupt":
                # Damaged bytes help no one: drop them, so the next
                # look-up is a miss and the block is stored afresh.
                pool.delete(self.key(digests[n]))

    def load(self, digests: Sequence[bytes], out: "torch.Tensor", stream: Any = None,
             keep: "list | None" = None) -> int:
        """Copy the leading blocks of `digests` that are there and sound into `out[:k]`; return k.

        `out`: `[len(digests), payload_bytes]` uint8 on any device.  Stops
        at the first block missing, foreign or, with `verify`, corrupt (bytes
        that no longer match the pool's checksum); each is counted.  The
        checksums are taken on the checksum threads (xxhash releases the GIL)
        from 4 MiB on: a 2 MiB block is ~0.2 ms of hashing, and a restart's
        loads are hundreds of blocks a step.  Into a CUDA `out` the copies are
        queued while the checksums run, so the two overlap; rows of `out`
        past k may then hold bytes of blocks not loaded (the caller uses
        `out[:k]`, and scatters only those into its cache).
        """
        pool = self.pool.acquire()
        if pool is None:
            if digests:
                self.faults.count("missing", len(digests))
            return 0
        import torch

        views: list = []
        n = 0
        t = None
        leased = False  # the lease went to a transfer still copying
        handed = 0  # views[:handed] belong to the transfer now (it unpins them)
        try:
            # Every block pinned in one lock hold (eviction cannot reuse one mid-copy), released in one.
            views = pool.view_many([self.key(d) for d in digests])
            n, why = self.check_headers(digests, views)

            def copy(k: int) -> "gpu.Transfer":  # each block read (and counted a hit) once, from its view
                nonlocal handed
                handed = k
                return gpu.load_views(pool, views[:k], dtype=torch.uint8, shape=(self.payload_bytes,),
                                      device=out.device, out=out[:k], offset=HEADER_SIZE, stream=stream,
                                      merge=self.merge)

            if n and self.verify:
                checked = gpu.start_checksums(views[:n], PARALLEL_VERIFY_BYTES)
                if out.device.type == "cuda":
                    try:
                        t = copy(n)  # queued while the checksums run
                    finally:
                        sound = checked()  # always waited for: no thread reads a view once it is released
                else:
                    sound = checked()
                if not all(sound):
                    n, why = sound.index(False), "corrupt"
            self.report(pool, digests, n, why)
            if t is None and n:
                t = copy(n)
            if t is not None:
                if keep is not None and t.event is not None:
                    # The caller waits (and unpins, and ends the lease) once its stream is past the copies.
                    keep.append(_Leased(t, lambda: self.pool.release(pool)))
                    leased = True
                else:
                    t.wait()
        except Exception as e:
            self.faults.fault("error", e)
            if t is not None and not leased:
                try:
                    t.wait()  # copies already queued: let them land, then unpin their entries
                except Exception:
                    pass
            return 0
        finally:
            pool.release_many(views[handed:])
            if not leased:
                self.pool.release(pool)
        self.faults.count("loaded", n)
        self.faults.count("loaded_bytes", n * self.payload_bytes)
        return n


class HostRows:
    """Rows of host memory one thread copies blocks through, kept from one batch to the next, at most
    `cap` bytes (a larger batch goes in parts).  Memory allocated per batch is fresh, and this VM backs
    fresh pages at 1-1.4 GB/s on first touch, against ~8 GB/s for a copy into warm memory: a 2 MiB block's
    CPU load took 2.7 ms through a new buffer (`benchmarks/bench_vllm.py --host-cost`)."""

    def __init__(self, width: int, cap: int | None = None) -> None:
        self.width = width
        self.max_rows = max(1, (HOST_ROWS_BYTES if cap is None else cap) // width)
        self._buf: np.ndarray | None = None

    def take(self, n: int) -> np.ndarray:
        """`min(n, max_rows)` rows of `width` bytes (their contents are whatever the last batch left)."""
        n = min(n, self.max_rows)
        have = 0 if self._buf is None else len(self._buf)
        if have < n:
            self._buf = np.empty((min(self.max_rows, max(n, 2 * have)), self.width), np.uint8)
        return self._buf[:n]  # type: ignore[index]


def load_host(store: BlockStore, paged: "PagedLayers", rows: HostRows, digests: Sequence[bytes],
              block_ids: Sequence[int]) -> int:
    """Load the leading blocks of `digests` that are there and sound into `block_ids` of a paged cache in
    host memory, through `rows` (in parts of at most its rows; rows `store.row_bytes()` wide let a run of
    values that neighbour in the pool come in one copy); how many were loaded (the first part that stops
    short ends it)."""
    import torch

    n = 0
    while n < len(digests):
        out = torch.from_numpy(rows.take(len(digests) - n))[:, : store.payload_bytes]
        k = store.load(digests[n : n + len(out)], out)
        if k:
            paged.scatter(block_ids[n : n + k], out[:k])
        n += k
        if k < len(out):
            break
    return n


def save_host(store: BlockStore, paged: "PagedLayers", rows: HostRows, digests: Sequence[bytes],
              block_ids: Sequence[int]) -> int:
    """Store blocks `block_ids` of a paged cache in host memory under `digests`' keys, through `rows` (in
    parts of at most its rows, each visible as one); how many were stored.  Copies with numpy, not torch:
    torch's copies would run on the engine's thread pool, whose threads vLLM's CPU backend binds to its
    cores (measured: a third of the engine's speed)."""
    a = 0
    while a < len(block_ids):
        host = rows.take(len(block_ids) - a)
        paged.gather_host(block_ids[a : a + len(host)], host)
        if not store.save_host(digests[a : a + len(host)], host):
            # The pool refused this part (counted): a later part would only leave a gap in the chain.
            store.faults.count("store_failed", len(block_ids) - a - len(host))
            break
        a += len(host)
    return a


class PagedLayers:
    """An engine's paged KV cache as byte rows: one tensor per layer, blocks along its first axis.

    Each layer is `[num_blocks * r, *block_shape]` (r > 1 when the attention
    kernel splits an engine block into r kernel blocks); a block's row is
    every layer's `[r, *block_shape]` in order, in logical (not physical)
    element order, so two processes with the same layout agree byte for byte.
    """

    def __init__(self, layers: "Sequence[torch.Tensor]", num_blocks: int) -> None:
        first = layers[0]
        if first.shape[0] % num_blocks:
            raise ValueError(f"a layer of {first.shape[0]} blocks is not {num_blocks} engine blocks")
        for t in layers:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError("the KV cache layers differ in shape, dtype or device")
        self.views = [t.unflatten(0, (num_blocks, first.shape[0] // num_blocks)) for t in layers]
        self.dtype = first.dtype
        self.device = first.device
        self.layer_bytes = int(np.prod(self.views[0].shape[1:])) * first.element_size()
        self.payload_bytes = self.layer_bytes * len(layers)
        self.shape = f"{str(self.dtype).removeprefix('torch.')}:{len(layers)}x{tuple(self.views[0].shape[1:])}"

    def host_layers(self) -> "list[np.ndarray] | None":
        """Each layer as `[num_blocks, bytes of a block]` uint8 numpy (no copy), when the cache is in host
        memory and contiguous; else None."""
        if getattr(self, "_host", False) is False:
            import torch

            host = None
            if self.device.type == "cpu" and all(v.is_contiguous() for v in self.views):
                host = [v.reshape(v.shape[0], -1).view(torch.uint8).numpy() for v in self.views]
            self._host = host
        return self._host

    def gather_host(self, block_ids: Sequence[int], rows: np.ndarray, offset: int = HEADER_SIZE) -> bool:
        """`gather` with numpy copies, into host rows; False (nothing copied) where `host_layers` is None."""
        layers = self.host_layers()
        if layers is None:
            return False
        ids, lb = np.asarray(block_ids, dtype=np.intp), self.layer_bytes
        for i, layer in enumerate(layers):
            a = offset + i * lb
            rows[:, a : a + lb] = layer[ids]
        return True

    def device_ids(self, block_ids: Sequence[int]) -> "torch.Tensor":
        import torch

        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if self.device.type != "cuda":
            return ids
        # From pinned memory, without blocking: a blocking (or pageable) copy makes torch wait for the
        # whole current stream, so start_load_kv would stall the engine's thread until the copies queued
        # before it on the load stream (earlier requests') had landed, and a save's gather until the
        # forward pass it waits for had run.
        return ids.pin_memory().to(self.device, non_blocking=True)

    def gather(self, block_ids: Sequence[int], rows: "torch.Tensor", offset: int = HEADER_SIZE) -> None:
        """Copy those blocks into `rows[:, offset:]` (`[len(block_ids), >= offset + payload_bytes]` uint8)."""
        import torch

        ids, n, lb = self.device_ids(block_ids), len(block_ids), self.layer_bytes
        for i, v in enumerate(self.views):
            a = offset + i * lb
            rows[:, a : a + lb].copy_(v.index_select(0, ids).reshape(n, -1).view(torch.uint8))

    def scatter(self, block_ids: Sequence[int], data: "torch.Tensor") -> None:
        """Write `data` (`[len(block_ids), payload_bytes]` uint8, any device) into those blocks."""
        ids, lb = self.device_ids(block_ids), self.layer_bytes
        data = data.to(self.device, non_blocking=True)
        for i in range(len(self.views)):
            self.scatter_layer(i, ids, data[:, i * lb : (i + 1) * lb])

    def layer_parts(self) -> "list[tuple[PagedLayers, int, int, int | None]]":
        """Each layer, in the order of a block's row: (the PagedLayers holding it, its index there, the byte
        offset of its part of the row, its group: None for a model of one group)."""
        return [(self, i, i * self.layer_bytes, None) for i in range(len(self.views))]

    def scatter_layer(self, i: int, block_ids: "Sequence[int] | torch.Tensor", data: "torch.Tensor") -> None:
        """Write layer `i`'s part of blocks (`data`: `[len(block_ids), layer_bytes]` uint8, on this device)."""
        import torch

        ids = block_ids if isinstance(block_ids, torch.Tensor) else self.device_ids(block_ids)
        v = self.views[i]
        v.index_copy_(0, ids, data.view(self.dtype).unflatten(1, v.shape[1:]))


class Saver:
    """Saves of one worker on a thread of its own, so the engine's step does not wait for them.

    `submit` queues one request's blocks (digests and the engine's block ids);
    the thread gathers them out of the paged cache, asks which the pool lacks,
    and stores those (`BlockStore.save`).  The engine must not reuse those
    blocks until `pending(req_id)` is False: the connector keeps them through
    vLLM's `request_finished` / `get_finished` contract, and waits here for a
    preempted request's saves (`wait`) before its blocks can be handed out again.

    On CUDA each job carries an event recorded on the engine's stream when it
    was queued (after the forward pass that wrote the blocks); the thread's
    own stream waits for that event, gathers and copies, so the copies to the
    pool overlap the engine's next steps.  On the CPU the job is plain copies.
    Every fault is a counted store failure, never raised.  The thread is a
    daemon: a process that exits without `close` loses the queued saves, and
    a save cut short leaves nothing visible (the pool's reserve/commit).
    """

    def __init__(self, store: BlockStore, paged: "PagedLayers", faults: Faults, name: str = "cortex-vllm-save") -> None:
        self.store, self.paged, self.faults = store, paged, faults
        self._name = name
        self._cond = threading.Condition()
        self._jobs: deque = deque()
        self._pending: dict[Any, int] = {}  # req id -> jobs queued or running
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stream: Any = None
        self._rows: HostRows | None = None  # the thread's rows for CPU saves

    def submit(self, req_id: Any, digests: Sequence[bytes], block_ids: Sequence[int]) -> bool:
        """Queue a save; False (nothing queued, counted as failed) once closed."""
        event = None
        if self.paged.device.type == "cuda":
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.paged.device))
        with self._cond:
            if self._closed:
                self.faults.count("store_failed", len(digests))
                return False
            self._jobs.append((req_id, list(digests), list(block_ids), event))
            self._pending[req_id] = self._pending.get(req_id, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def pending(self, req_id: Any) -> bool:
        with self._cond:
            return req_id in self._pending

    def busy(self) -> bool:
        with self._cond:
            return bool(self._pending)

    def wait(self, req_ids: "Collection[Any] | None" = None, timeout: float | None = None) -> bool:
        """Until no save of `req_ids` (None: any) is queued or running; False if `timeout` passed first."""
        def idle() -> bool:
            return not self._pending if req_ids is None else not any(r in self._pending for r in req_ids)

        with self._cond:
            return self._cond.wait_for(idle, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the saves already queued (for at most `timeout` seconds), then stop the thread.
        Safe to call twice; what is left after `timeout` is dropped with the process."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                self.faults.once("save-drain", "saves still running after %.0f s at shutdown: dropped", timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return  # closed and drained
                req_id, digests, block_ids, event = self._jobs.popleft()
            try:
                self._save(digests, block_ids, event)
            except BaseException as e:  # never out of this thread: a save is only a future hit
                self.faults.fault("store_failed", e, len(digests))
            finally:
                with self._cond:
                    left = self._pending.get(req_id, 1) - 1
                    if left > 0:
                        self._pending[req_id] = left
                    else:
                        self._pending.pop(req_id, None)
                    self._cond.notify_all()

    def _save(self, digests: list[bytes], block_ids: list[int], event: Any) -> None:
        store, paged = self.store, self.paged
        todo = store.absent(digests)  # another process may have stored them meanwhile
        if not todo:
            return
        if event is None:
            ids, ds = [block_ids[i] for i in todo], [digests[i] for i in todo]
            if paged.host_layers() is not None:
                if self._rows is None:
                    self._rows = HostRows(HEADER_SIZE + store.payload_bytes)
                save_host(store, paged, self._rows, ds, ids)
                return
            rows = store.staging(len(todo), paged.device)
            paged.gather(ids, rows)
            store.save([digests[i] for i in todo], rows)
            return
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(paged.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(event)  # the forward pass that wrote these blocks
            rows = store.staging(len(todo), paged.device)
            paged.gather([block_ids[i] for i in todo], rows)
            store.save([digests[i] for i in todo], rows, stream=self._stream)


__all__ = ["BlockStore", "PagedLayers", "Faults", "PoolRef", "Saver", "HostRows", "HEADER_SIZE", "block_fill",
           "fit_block_size", "load_host", "save_host", "prefix_digests", "fingerprint"]
