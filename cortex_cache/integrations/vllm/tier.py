"""CortexTier: a secondary tier of vLLM's native KV offloading (TieringOffloadingSpec) over a cortex pool.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4000000000,
        "secondary_tiers": [{"type": "CortexTier", "module_path": "cortex_cache.integrations.vllm",
                             "pool": "llama"}]}}'

vLLM keeps its offloaded KV in a CPU primary region (rows of one chunk each)
and moves chunks between it and its secondary tiers: a chunk stored in the
primary region is cascaded to every secondary tier (`submit_store`), and a
chunk a request needs that only a secondary tier holds is promoted back
(`submit_load`).  This tier keeps those rows in a pool, so every vLLM
instance and DP replica on the host shares them and they outlive restarts.

All methods run in vLLM's scheduler and return at once: `lookup` asks the
pool's index (no value read, no disk); stores, loads and touches run on
worker threads (`workers`, default 2), which copy between the primary rows
and the pool and report through `get_finished_jobs`.  A store becomes
visible only when its copy is whole and checksummed (a process killed
mid-store leaves nothing); a load checks each chunk's header and checksum
and reports the keys it could not load as failed, which vLLM treats as a
miss (a corrupt chunk is deleted from the pool, so it is not promoted again).  Faults are counted in `stats` and logged once, never raised.

Keys are vLLM's own offload keys (its block hash and group index), so
instances share chunks only when their block hashes agree: vLLM's default
`sha256` hash with the same PYTHONHASHSEED setting (unset in both is fine);
with `xxhash` vLLM seeds each process at random and nothing is shared.
They are namespaced by model, weights and layout: namespace + model + "/" +
weights + "/" + 16 hex digits of the layout's fingerprint + "/" + hex(offload key)
(the weights' identity: cortex_cache/weights.py, also in the fingerprint).

Tier parameters (beside "type" and "module_path"):
  pool, create, size, block_size, policy, disk_path, disk_size, disk_write
              the pool, as for the connector
  namespace   key prefix (default "vllm-tier/")
  model       the model's name in keys (default: vLLM's model name)
  weights     a name for the weights (default: computed from the checkpoint at vLLM's
              model path; or CORTEX_CACHE_WEIGHTS)
  verify      check each promoted chunk against its checksum (default true)
  workers     copy threads (default 2)
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ...errors import UsageError
from ...weights import resolve
from ..pools import POOL_PARAMS
from .blocks import HEADER_SIZE, BlockStore, Faults, PoolRef, fingerprint
from .connector import model_tag, say_weights

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

PARAMS = (*POOL_PARAMS, "namespace", "model", "weights", "verify", "workers")
_PLAIN = (str, int, float, bool, type(None))


def _layout_facts(spec: Any) -> list:
    """What of vLLM's offloading config names the rows' layout; nothing that is not plain data."""
    try:
        c = spec.config
        facts = [c.model.name, c.model.dtype, c.cache.tokens_per_hash, c.cache.blocks_per_chunk,
                 c.parallel.tp_size, c.parallel.pp_size, c.parallel.world_size, c.worker_kv_bytes_per_block,
                 c.kv_cache_layout, c.canonical_layout,
                 *[(g.tokens_per_block, len(g.layer_names)) for g in c.groups]]
    except Exception:
        return []
    flat = [x for f in facts for x in (f if isinstance(f, tuple) else (f,))]
    return facts if all(isinstance(x, _PLAIN) for x in flat) else []


class CortexTier(SecondaryTierManager):
    """vLLM secondary offloading tier over a cortex pool (see the module doc)."""

    medium: ClassVar[Medium] = Medium.CPU  # shared memory on this host

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: "BackpressureDetector | None" = None, **params: Any) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        params.pop("locality", None)
        unknown = sorted(set(params) - set(PARAMS))
        if unknown:
            raise UsageError(f"unknown CortexTier parameters {', '.join(unknown)}: valid are {', '.join(PARAMS)}")
        if not params.get("pool"):
            raise UsageError('CortexTier needs "pool": the name of a cortex pool')
        workers = params.get("workers", 2)
        if not isinstance(workers, int) or workers < 1:
            raise UsageError(f'CortexTier "workers" must be a positive integer, not {workers!r}')
        self.faults = Faults(f"CortexTier(pool {params['pool']!r})")
        self.stats = self.faults.stats
        facts = _layout_facts(offloading_spec)
        model = params.get("model") or (facts[0] if facts else None)
        if not model:
            raise UsageError('CortexTier needs "model" when vLLM does not name its model')
        tag = model_tag(str(model))
        weights = resolve(facts[0] if facts else None, override=params.get("weights"))
        fp = fingerprint("cortex-vllm-tier/1", tag, self.block_size_bytes, *facts, "weights:" + weights.id)
        self._pool = PoolRef(str(params["pool"]), params, self.faults)
        namespace = str(params.get("namespace", "vllm-tier/"))
        say_weights(f"CortexTier(pool {params['pool']!r}, model {tag!r})", weights,
                    f"cortex cache evict {params['pool']} --prefix {namespace}{tag}/{weights.id}/ --tier all")
        self._store = BlockStore(self._pool, self.faults, namespace=namespace,
                                 model=f"{tag}/{weights.id}", rank=fp.hex()[:16], fingerprint=fp,
                                 payload_bytes=self.block_size_bytes, block_tokens=0,
                                 verify=bool(params.get("verify", True)))
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._pending: set[Future] = set()
        self._copiers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"cortex-tier-{params['pool']}")

    # ------------------------------------------------------------------ the scheduler's calls (never block)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        k = bytes(key)
        if self._store.present([k]):
            return LookupResult.HIT  # counted as a hit when it is loaded (the pool's reads count)
        self._count_miss(k, req_context)
        return LookupResult.MISS

    def _count_miss(self, key: bytes, req_context: ReqContext) -> None:
        """A key a request asked for and the pool does not hold is a miss in the pool's own counters, once a
        request (vLLM asks again at each step a request waits): remembered in the request's context."""
        get, put = getattr(req_context, "get_state", None), getattr(req_context, "set_state", None)
        if get is None or put is None:  # a vLLM without per-request state: counted as the connector cannot be
            return
        seen = get(_MissesCounted)
        if seen is None:
            seen = _MissesCounted()
            put(seen)
        if key not in seen.keys:
            seen.keys.add(key)
            self._store.count_lookup(0, 1)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._run_store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._run_load, job_metadata)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._submit(self._run_touch, list(keys))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._pending or self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            for f in pending:
                f.exception()  # waits; the job reported its own failure

    def shutdown(self) -> None:
        self.drain_jobs()
        self._copiers.shutdown(wait=True)
        self._pool.close()

    # ------------------------------------------------------------------ the worker threads

    def _submit(self, fn: Any, arg: Any) -> None:
        with self._lock:
            fut = self._copiers.submit(fn, arg)
            self._pending.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _finish(self, result: JobResult) -> None:
        with self._lock:
            self._finished.append(result)

    def _primary_rows(self) -> np.ndarray:
        """The primary region's rows as bytes (row c is chunk slot c).

        Made per job and dropped with it: vLLM unmaps the region at shutdown,
        which it cannot while a view of it lives."""
        return np.frombuffer(self._primary_kv_view, np.uint8).reshape(-1, self.block_size_bytes)

    def _run_store(self, job: TransferJob) -> None:
        import torch

        keys = [bytes(k) for k in job.keys]
        chunk_ids = np.asarray(job.chunk_ids, dtype=np.int64)
        ok = True
        try:
            todo = self._store.absent(keys)  # another instance may have stored them already
            if todo and self._pool.get() is not None:
                rows = self._store.staging(len(todo), "cpu")
                rows[:, HEADER_SIZE:] = torch.from_numpy(self._primary_rows()[chunk_ids[todo]])
                ok = self._store.save([keys[i] for i in todo], rows) == len(todo)
            elif todo:
                ok = False
        except Exception as e:  # reported as a failed job, never raised in vLLM's thread
            self.faults.fault("error", e)
            ok = False
        self._finish(JobResult(job_id=job.job_id, success=ok, transfer_bytes=len(keys) * self.block_size_bytes))

    def _run_load(self, job: TransferJob) -> None:
        keys = list(job.keys)
        chunk_ids = np.asarray(job.chunk_ids, dtype=np.int64)
        n = 0
        try:
            out = self._store.staging(len(keys), "cpu")[:, HEADER_SIZE:]
            n = self._store.load([bytes(k) for k in keys], out)
            if n:
                self._primary_rows()[chunk_ids[:n]] = out[:n].numpy()
        except Exception as e:
            self.faults.fault("error", e)
            n = 0
        if n == len(keys):
            self._finish(JobResult(job_id=job.job_id, success=True, transfer_bytes=n * self.block_size_bytes))
        else:
            self._finish(JobResult(job_id=job.job_id, success=False, successful_keys=keys[:n] or None,
                                   transfer_bytes=n * self.block_size_bytes))

    def _run_touch(self, keys: list[OffloadKey]) -> None:
        """Reading an entry's header counts as a use for the pool's eviction order."""
        with self._pool.use() as pool:
            if pool is None:
                return
            try:
                pool.release_many(pool.view_many([self._store.key(bytes(k)) for k in keys]))  # one lock hold each
            except Exception:
                pass  # the pool broke: a touch is only a hint


class _MissesCounted:
    """Per request (in vLLM's ReqContext): the keys whose miss the pool has counted."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: set[bytes] = set()


__all__ = ["CortexTier"]
