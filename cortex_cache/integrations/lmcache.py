"""LMCache adapter: a cortex pool as LMCache's L2 tier (multi-process mode, lmcache 0.5.x).

Load it as a `native_plugin` L2 adapter::

    --l2-adapter '{"type": "native_plugin",
                   "module_path": "cortex_cache.integrations.lmcache",
                   "class_name": "CortexConnector",
                   "adapter_params": {"pool": "llama"}}'

LMCache constructs `CortexConnector(**adapter_params)` in each of its
processes and calls the interface it validates: `event_fd()`,
`submit_batch_get/set/exists/delete(...)` (each returns a future id at once),
`drain_completions()` and `close()`.  The work runs on one worker thread per
connector; each finished batch is reported through an eventfd (written once
per completion, cleared by `drain_completions`).

adapter_params:
  pool        pool name (required)
  create      create the pool if it does not exist (default false); then:
  size        its size (required with create), block_size (default 64K),
  policy      eviction policy (default auto, as `cortex cache create`),
  disk_path, disk_size, disk_write   a disk tier under it (see the README)
  namespace   prefix of the pool keys (default "lmcache/")
  weights     a name for the model's weights, or
  model_path  the checkpoint to compute one from (cortex_cache/weights.py); or
              CORTEX_CACHE_WEIGHTS.  Keys are then namespace + weights + "/" + LMCache's
              key, so KV of weights re-saved under the same model name is never served
              (LMCache's keys name the model, not its weights)
  verify      check every loaded value against its checksum (default true)
  workers     threads that copy and checksum the keys of a batch in parallel
              (default: up to 4, one per CPU; copies and checksums release the GIL)

Each value is stored as a 32-byte header and LMCache's bytes::

    0 4s magic b"CXLM"   4 u16 version (1)   6 u16 reserved
    8 16s first 16 bytes of BLAKE2b(key)      24 u64 payload length

A value whose header does not name this key and length (foreign), or whose
bytes fail their checksum (corrupt), is a miss -- counted in `stats`, never
loaded.  Loads copy straight from the pool into LMCache's buffers: the entry
is pinned, its header checked in place, its payload copied once (no
intermediate bytes) and the copy checked against the checksum taken at put
(a failed check zeroes the buffer and reports a miss).  Where the C fast path
is built, a batch does all of that in one call that holds the GIL only for
its two lock holds (`Fast.load_many`, _fastpath_load.c: pin and count every
key in one, check the header and copy without the GIL -- on several threads
for a large batch -- unpin in the other; the header's format is told to it
here, `_LOAD_HEADER`); the keys it leaves (SLOW: expired, out
of pin records, a tier below to look in, a busy lock) take the Python path
below, which stays the reference.  Nothing here imports LMCache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from typing import Any, Sequence

import numpy as np

from ..batch import encoded
from ..copyhash import copy_hash
from ..core import READ_COUNTED, READ_HITS, SLOW
from ..errors import PoolNotFound, UsageError
from ..weights import resolve
from .copiers import Copiers
from .pools import POOL_PARAMS, Attachment, open_or_create

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<4sHH16sQ")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32
MAGIC = b"CXLM"
VERSION = 1
_PARAMS = (*POOL_PARAMS, "namespace", "weights", "model_path", "verify", "workers")

Completion = tuple[int, bool, str, "list[bool] | None"]
_PARALLEL_BYTES = 4 << 20  # smaller batches are copied by the worker thread alone
# The header as Fast.load_many checks it (the C code knows no format; this is ours): its size; the prefix it
# starts with (magic and version; the reserved u16 after them goes unchecked); where the key's digest lies,
# and its size; where the payload's length lies (u64, little-endian).
_DIGEST_SIZE = 16
_LOAD_HEADER = (HEADER_SIZE, struct.pack("<4sH", MAGIC, VERSION), struct.calcsize("<4sHH"), _DIGEST_SIZE,
                struct.calcsize("<4sHH16s"))
# Fast.load_many's per-key answers 0-4, as counted: a value the pool's verify_reads refuses is a miss, as
# the Python path's ValueCorrupt from view_many is.
_OUTCOMES = ("hits", "misses", "foreign", "corrupt", "misses")
# Keys pinned at a time by a load: a batch larger than the pool's pin records (1024, shared by every
# process) would otherwise find none left for its last keys.
_PIN_BATCH = 256


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=_DIGEST_SIZE).digest()


def _header(key: str, n: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, _digest(key), n)


class CortexConnector:
    """LMCache native L2 connector over a cortex pool (see the module doc)."""

    def __init__(self, pool: str | None = None, **params: Any) -> None:
        unknown = sorted(set(params) - set(_PARAMS))
        if unknown:
            raise UsageError(f"unknown adapter_params {', '.join(unknown)}: valid are {', '.join(_PARAMS)}")
        if not pool:
            raise UsageError('adapter_params needs "pool": the name of a cortex pool')
        self.namespace = str(params.get("namespace", "lmcache/"))
        self.weights = resolve(params.get("model_path"), override=params.get("weights"))
        if self.weights.known:
            self.namespace += self.weights.id + "/"
            logger.info("cortex LMCache adapter (pool %r): keys under %s, weights %s (%s); retire them with: "
                        "cortex cache evict %s --prefix %s --tier all", pool, self.namespace, self.weights.id,
                        self.weights.source, pool, self.namespace)
        else:
            logger.warning("cortex LMCache adapter (pool %r): keys not tied to the model's weights (%s); give "
                           "adapter_params \"weights\" or \"model_path\" (or set CORTEX_CACHE_WEIGHTS)",
                           pool, self.weights.source)
        self.verify = bool(params.get("verify", True))
        workers = params.get("workers", min(4, os.cpu_count() or 1))
        if not isinstance(workers, int) or workers < 1:
            raise UsageError(f'adapter_params "workers" must be a positive integer, not {workers!r}')
        self.pool = open_or_create(pool, params)  # multi-threaded: the workers share the handle
        # Followed by name: a pool replaced (restore --replace) or deleted under the engine is let go, and the
        # one then under the name attached, at the next batch (integrations/pools.py).
        self._attachment = Attachment(pool, params, self.pool)
        self.stats = {"stored": 0, "store_failed": 0, "hits": 0, "misses": 0, "foreign": 0, "corrupt": 0,
                      "deleted": 0}
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._done: list[Completion] = []
        self._lock = threading.Lock()
        self._next = 1
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._copiers = Copiers(workers, f"cortex-lmcache-{pool}")
        self._worker = threading.Thread(target=self._run, name=f"cortex-lmcache-{pool}", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ LMCache's interface

    def event_fd(self) -> int:
        return self._efd

    def submit_batch_get(self, keys: Sequence[str], memoryviews: Sequence[Any]) -> int:
        return self._submit(self._get, keys, memoryviews)

    def submit_batch_set(self, keys: Sequence[str], memoryviews: Sequence[Any]) -> int:
        return self._submit(self._set, keys, memoryviews)

    def submit_batch_exists(self, keys: Sequence[str]) -> int:
        return self._submit(self._exists, keys, None)

    def submit_batch_delete(self, keys: Sequence[str]) -> int:
        return self._submit(self._delete, keys, None)

    def drain_completions(self) -> list[Completion]:
        try:
            os.eventfd_read(self._efd)  # clear readiness: LMCache polls the fd but never reads it
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join()
        self._copiers.close()
        self._attachment.close()
        os.close(self._efd)
        self._efd = -1

    def __enter__(self) -> "CortexConnector":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the worker

    def _submit(self, fn: Any, keys: Sequence[str], mvs: Sequence[Any] | None) -> int:
        if self._closed:
            raise RuntimeError("CortexConnector is closed")
        keys = list(keys)
        if mvs is not None and len(mvs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(mvs)} buffers")
        with self._lock:
            fid = self._next
            self._next += 1
        self._jobs.put((fid, fn, keys, mvs))
        return fid

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fid, fn, keys, mvs = job
            with self._attachment.use() as pool:  # batches run one at a time: each on the pool of its time
                try:
                    if pool is None:
                        raise PoolNotFound(f"pool {self._attachment.name!r} is not there: "
                                           f"{self._attachment.last_error or 'it was deleted'}")
                    self.pool = pool
                    ok, err, per_key = fn(keys, mvs)
                except Exception as e:  # a batch that breaks is reported, never raised in LMCache's thread
                    ok, err, per_key = False, f"{type(e).__name__}: {e}", [False] * len(keys)
            with self._lock:
                self._done.append((fid, ok, err, per_key))
            os.eventfd_write(self._efd, 1)

    def _map(self, fn: Any, keys: list[str], mvs: Sequence[Any]) -> list:
        """fn over the batch: on the copy threads when it moves enough bytes to pay for them."""
        if sum(memoryview(mv).nbytes for mv in mvs) >= _PARALLEL_BYTES:
            return self._copiers.map(fn, keys, mvs)
        return [fn(k, mv) for k, mv in zip(keys, mvs)]

    def _set(self, keys: list[str], mvs: Sequence[Any]) -> tuple[bool, str, list[bool]]:
        # The batch is reserved in one lock hold, copied and checksummed (on the copy threads when
        # large), and committed in one.
        srcs = [np.frombuffer(memoryview(mv).cast("B"), np.uint8) for mv in mvs]
        writers = self.pool.reserve_write_many(
            [(self.namespace + k, HEADER_SIZE + src.nbytes) for k, src in zip(keys, srcs)])
        try:
            sums = self._map(self._fill, list(zip(keys, writers)), srcs)
        except BaseException:
            self.pool.abort_many(writers)
            raise
        filled = [(w, c) for w, c in zip(writers, sums) if c is not None]
        committed = iter(self.pool.commit_many([w for w, _ in filled], [c for _, c in filled]))
        outcomes = [str(w) if c is None else str(next(committed) or "") for w, c in zip(writers, sums)]
        errors = [e for e in outcomes if e]
        self.stats["stored"] += len(keys) - len(errors)
        self.stats["store_failed"] += len(errors)
        return not errors, "; ".join(dict.fromkeys(errors)), [not e for e in outcomes]

    def _fill(self, key_writer: tuple[str, Any], src: np.ndarray) -> int | None:
        """Fill one reserved value (header, then LMCache's bytes); its checksum, or None if the
        reservation failed (the writer is then the error)."""
        key, w = key_writer
        if isinstance(w, Exception):
            return None
        head = _header(key, src.nbytes)
        w.memoryview[:HEADER_SIZE] = head  # type: ignore[index]
        # One pass over the memory: each step hashed while in the CPU cache, the GIL let go (copyhash.py).
        return copy_hash(w.memoryview[HEADER_SIZE:], src, head)

    def _check(self, key: str, view: memoryview, want: int | None) -> bool:
        """Is `view` a value this adapter stored under `key` (of `want` payload bytes)?"""
        if view.nbytes < HEADER_SIZE:
            return False
        magic, version, _, digest, n = HEADER.unpack_from(view)
        good = (magic == MAGIC and version == VERSION and n == view.nbytes - HEADER_SIZE
                and digest == _digest(key))
        return good and (want is None or n == want)

    def _get(self, keys: list[str], mvs: Sequence[Any]) -> tuple[bool, str, list[bool]]:
        outcomes: list[str] = []
        for s in range(0, len(keys), _PIN_BATCH):
            outcomes += self._load(keys[s : s + _PIN_BATCH], mvs[s : s + _PIN_BATCH])
        for o in outcomes:
            self.stats[o] += 1
        return True, "", [o == "hits" for o in outcomes]

    def _load(self, keys: list[str], mvs: Sequence[Any]) -> list[str]:
        """Load a batch into LMCache's buffers: the counter of each key's outcome.  In C where it can
        be (`_load_fast`), the keys it leaves and every key without it on the Python path."""
        got = self._load_fast(keys, mvs)
        if got is None:
            return self._load_pinned(keys, mvs)
        left = [n for n, o in enumerate(got) if o is None]
        if left:
            for n, o in zip(left, self._load_pinned([keys[n] for n in left], [mvs[n] for n in left])):
                got[n] = o
        return got  # type: ignore[return-value]

    def _load_fast(self, keys: list[str], mvs: Sequence[Any]) -> list[str | None] | None:
        """The batch in one C call (_fastpath_load.c): per key its counter, or None for the Python path
        to load; None for the whole batch without the fast path or when its lock was busy."""
        pool = self.pool
        core = pool.core
        fast = core.fast
        if fast is None:  # not built, CORTEX_CACHE_PURE_PYTHON=1, or closed
            return None
        below = pool.tiers.look_below  # misses are looked up there
        r = fast.load_many(encoded([self.namespace + k for k in keys]), list(mvs), _LOAD_HEADER,
                           b"".join(map(_digest, keys)), READ_HITS if below else READ_COUNTED, self.verify,
                           self._copiers.workers)
        if r is SLOW:
            return None
        codes, leftover = r
        if leftover:  # the lock was busy after the copies: release them waiting for it
            core.release_pins(leftover)
        return [None if c is SLOW else _OUTCOMES[c] for c in codes]

    def _load_pinned(self, keys: list[str], mvs: Sequence[Any]) -> list[str]:
        """The Python path: the batch pinned in one lock hold, copied (on the copy threads when large),
        and released in one."""
        views = self.pool.view_many([self.namespace + k for k in keys])
        try:
            return self._map(self._load_one, list(zip(keys, views)), mvs)
        finally:
            self.pool.release_many(views)

    def _load_one(self, key_view: tuple[str, Any], mv: Any) -> str:
        """Load one pinned value into LMCache's buffer; which counter it counts under."""
        key, ev = key_view
        if ev is None or isinstance(ev, Exception):
            return "misses"
        dst = np.frombuffer(memoryview(mv).cast("B"), np.uint8)
        src = ev.memoryview
        if not self._check(key, src, dst.nbytes):
            return "foreign"
        if not self.verify:
            np.copyto(dst, np.frombuffer(src, np.uint8, dst.nbytes, HEADER_SIZE))  # GIL released
            return "hits"
        # Check what LMCache got, each step while it is still in the CPU cache: one pass over the
        # pool's memory instead of two, the GIL let go (copyhash.py).
        if copy_hash(dst, src[HEADER_SIZE:], src[:HEADER_SIZE]) != ev.checksum:
            dst[:] = 0  # nothing of a damaged value is left in LMCache's buffer
            return "corrupt"
        return "hits"

    def _exists(self, keys: list[str], _mvs: None) -> tuple[bool, str, list[bool]]:
        views = self.pool.view_many([self.namespace + k for k in keys])
        try:
            results = [ev is not None and not isinstance(ev, Exception) and self._check(key, ev.memoryview, None)
                       for key, ev in zip(keys, views)]
        finally:
            self.pool.release_many(views)
        return True, "", results

    def _delete(self, keys: list[str], _mvs: None) -> tuple[bool, str, list[bool]]:
        results = self.pool.delete_many([self.namespace + key for key in keys])
        self.stats["deleted"] += sum(results)
        return True, "", results


__all__ = ["CortexConnector", "HEADER_SIZE"]
