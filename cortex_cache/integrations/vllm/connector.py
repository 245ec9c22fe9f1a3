"""CortexConnector: vLLM's KV connector (KVConnectorBase_V1) over a cortex pool.

    --kv-transfer-config '{"kv_connector": "CortexConnector", "kv_role": "kv_both",
      "kv_connector_module_path": "cortex_cache.integrations.vllm",
      "kv_connector_extra_config": {"pool": "llama"}}'

vLLM makes one instance in its scheduler and one in each worker.

Scheduler side: `get_num_new_matched_tokens` counts the leading whole
blocks of the prompt (after those the engine has cached itself) whose keys
every rank holds in the pool -- a lookup in the pool's index, no value read,
no disk -- and never the whole prompt (the engine computes at least its last
token).  `build_connector_meta` tells the workers, per request, which blocks
to load (the matched ones) and which to save (prompt blocks that this step
completes and the pool does not have yet).

Worker side: `start_load_kv` loads each request's blocks into the paged KV
cache before the forward pass (one batched copy per request), checking each
block's header and checksum; `wait_for_save` saves the blocks the step
completed, after the forward pass, one batched store per request.  A block
that cannot be loaded is reported to vLLM as a load error and recomputed:
the connector sets `kv_load_failure_policy` to "recompute", since a cache
miss must never fail a request.

kv_connector_extra_config:
  pool        pool name (required)
  create      create the pool if missing (default false); then size (required),
              block_size (default 64K), policy (default lru),
              disk_path / disk_size / disk_write (a disk tier)
  namespace   key prefix (default "vllm/")
  model       the model's name in keys (default: the served model name);
              processes share blocks only under one name, layout and rank
  verify      check each loaded block against its checksum (default true)
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...errors import UsageError
from ..pools import POOL_PARAMS
from .blocks import BlockStore, Faults, PagedLayers, PoolRef, fingerprint, prefix_digests

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

PARAMS = (*POOL_PARAMS, "namespace", "model", "verify")
_TAG_RE = re.compile(r"[^A-Za-z0-9._:@+-]+")


@dataclass
class Transfer:
    """Blocks of one request to load or save: chain digests and the engine's block ids, in order."""

    req_id: str
    digests: list[bytes]
    block_ids: list[int]


@dataclass
class CortexConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class _Request:
    """What the scheduler side keeps per request."""

    digests: list[bytes]  # every whole prompt block's
    block_ids: list[int] = field(default_factory=list)
    done: int = 0  # leading blocks loaded, cached or saved already
    load: tuple[int, int] | None = None  # blocks [a, b) to load at its next schedule


def _params(vllm_config: "VllmConfig") -> dict[str, Any]:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(PARAMS))
    if unknown:
        raise UsageError(f"unknown kv_connector_extra_config {', '.join(unknown)}: valid are {', '.join(PARAMS)}")
    if not extra.get("pool"):
        raise UsageError('kv_connector_extra_config needs "pool": the name of a cortex pool')
    return extra


def model_tag(name: str) -> str:
    """A model name fit for keys: path separators and odd characters become '_', at most 100 characters."""
    tag = _TAG_RE.sub("_", name.strip("/")).strip("_") or "model"
    if len(tag) > 100:
        tag = tag[:88] + "~" + fingerprint(tag).hex()[:11]
    return tag


class _Layout:
    """What both sides derive from the configuration: the chain's tag, the ranks, the block size."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", params: dict[str, Any]) -> None:
        groups = kv_cache_config.kv_cache_groups
        self.usable = len(groups) == 1
        spec = groups[0].kv_cache_spec if groups else None
        self.block_tokens = int(vllm_config.cache_config.block_size)
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.layer_names = list(groups[0].layer_names) if groups else []
        par = vllm_config.parallel_config
        self.tp, self.pp = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
        served = vllm_config.model_config.served_model_name
        served = served[0] if isinstance(served, (list, tuple)) else served
        self.model = model_tag(str(params.get("model") or served or vllm_config.model_config.model))
        desc = [type(spec).__name__, getattr(spec, "dtype", "?"), f"layers={len(self.layer_names)}",
                f"heads={getattr(spec, 'num_kv_heads', '?')}", f"head_size={getattr(spec, 'head_size', '?')}",
                f"head_size_v={getattr(spec, 'head_size_v', '?')}", f"block={self.block_tokens}",
                f"layout={getattr(kv_cache_config, 'kv_cache_layout', '?')}", f"tp={self.tp}", f"pp={self.pp}"]
        self.layout = ",".join(str(d).removeprefix("torch.") for d in desc)
        self.tag = b"cortex-vllm/1\0" + self.model.encode() + b"\0" + self.layout.encode()

    def ranks(self) -> list[str]:
        return [f"pp{p}tp{t}" for p in range(self.pp) for t in range(self.tp)]

    def request_tag(self, request: "Request") -> bytes:
        """The chain's tag for a request: a cache salt or a LoRA adapter makes a chain of its own."""
        tag = self.tag
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            tag += b"\0lora:" + str(getattr(lora, "lora_name", lora)).encode()
        salt = getattr(request, "cache_salt", None)
        if salt:
            tag += b"\0salt:" + str(salt).encode()
        return tag


class CortexConnector(KVConnectorBase_V1):
    """vLLM KV connector over a cortex pool (see the module doc)."""

    instances: "weakref.WeakSet[CortexConnector]" = weakref.WeakSet()  # this process's, for tests and tools

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        params = _params(vllm_config)
        self.faults = Faults(f"CortexConnector({role.name.lower()}, pool {params['pool']!r})")
        self.stats = self.faults.stats
        self._pool = PoolRef(str(params["pool"]), params, self.faults)
        self._namespace = str(params.get("namespace", "vllm/"))
        self._verify = bool(params.get("verify", True))
        self._layout = _Layout(vllm_config, kv_cache_config, params)
        self._reqs: dict[str, _Request] = {}
        self._matched: dict[str, tuple[int, int]] = {}
        self._store: BlockStore | None = None
        self._paged: PagedLayers | None = None
        self._load_errors: set[int] = set()
        if not self._layout.usable:
            self.faults.fault("unavailable", "more than one KV cache group (a hybrid model): connector idle")
        if role == KVConnectorRole.SCHEDULER:
            # A block that cannot be loaded (evicted meanwhile, corrupt) is a
            # cache miss: recompute it, never fail the request.  The scheduler
            # reads this after it has made its connector.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            # One lookup store per rank: the scheduler needs every rank's block.
            self._rank_stores = [self._block_store(rank, b"", 0) for rank in self._layout.ranks()]
        CortexConnector.instances.add(self)

    def _block_store(self, rank: str, fp: bytes, payload_bytes: int) -> BlockStore:
        return BlockStore(self._pool, self.faults, namespace=self._namespace, model=self._layout.model, rank=rank,
                          fingerprint=fp, payload_bytes=payload_bytes, block_tokens=self._layout.block_tokens,
                          verify=self._verify)

    # ------------------------------------------------------------------ scheduler side

    def _digests(self, request: "Request") -> list[bytes]:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st.digests
        if request.mm_features or getattr(request, "prompt_embeds", None) is not None or not self._layout.usable:
            digests: list[bytes] = []  # not keyed by token ids alone: never shared
        else:
            digests = prefix_digests(request.prompt_token_ids or [], self._layout.block_tokens,
                                     self._layout.request_tag(request))
        self._reqs[request.request_id] = _Request(digests)
        return digests

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self._layout.block_tokens
        digests = self._digests(request)
        # Never the whole prompt: the engine computes at least its last token.
        limit = min(len(digests), (len(request.prompt_token_ids or []) - 1) // bs)
        start = num_computed_tokens // bs
        if start >= limit:
            return 0, False
        self.faults.count("lookups")
        # Remembered per request: a request waiting for several steps costs one probe a rank a step.
        n = min((s.present(digests, start, limit, request.request_id) for s in self._rank_stores), default=0)
        self.faults.count("hit_blocks", n)
        if n == 0:
            return 0, False
        self._matched[request.request_id] = (start, start + n)
        return n * bs, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        st = self._reqs.get(request.request_id)
        if st is None or matched is None or num_external_tokens <= 0:
            return
        a = matched[0]
        st.load = (a, a + num_external_tokens // self._layout.block_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = CortexConnectorMetadata()
        bs = self._layout.block_tokens
        n_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0]) if new.block_ids else []
            st.done = max(st.done, new.num_computed_tokens // bs)
            self._plan(meta, new.req_id, st, new.num_computed_tokens + n_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, st, cached.num_computed_tokens[i] + n_sched.get(req_id, 0))
        self._matched.clear()
        return meta

    def _plan(self, meta: CortexConnectorMetadata, req_id: str, st: _Request, computed_after: int) -> None:
        if st.load is not None:
            a, b = st.load
            st.load = None
            if b > a and b <= len(st.block_ids):
                meta.loads.append(Transfer(req_id, st.digests[a:b], st.block_ids[a:b]))
                st.done = max(st.done, b)
        end = min(len(st.digests), computed_after // self._layout.block_tokens, len(st.block_ids))
        if end > st.done:
            meta.saves.append(Transfer(req_id, st.digests[st.done : end], st.block_ids[st.done : end]))
            st.done = end

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        for s in getattr(self, "_rank_stores", ()):
            s.forget(request.request_id)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        if not self._layout.usable:
            return
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            rank = f"pp{get_pp_group().rank_in_group}tp{get_tensor_model_parallel_rank()}"
            paged = PagedLayers([kv_caches[n] for n in self._layout.layer_names], self._layout.num_blocks)
        except Exception as e:  # a layout we do not understand: the engine runs without us
            self.faults.fault("unavailable", f"KV cache not usable by the connector: {e}")
            return
        fp = fingerprint(self._layout.tag, paged.shape, rank)
        self._paged = paged
        self._store = self._block_store(rank, fp, paged.payload_bytes)
        # Copies between the pool and a CUDA cache run at full speed from pinned
        # memory; without CUDA this does nothing.  Registered in pieces on a
        # thread of its own (~0.1 s a GiB): the engine starts without waiting,
        # and copies of pieces not yet registered are pageable ones meanwhile.
        pool = self._pool.get()
        if pool is not None:
            try:
                from ... import gpu

                gpu.pin_memory(pool, background=True)
            except Exception as e:
                self.faults.fault("error", f"pinning pool memory for the device: {e}")

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        store, paged = self._store, self._paged
        if not isinstance(meta, CortexConnectorMetadata) or store is None or paged is None:
            for t in getattr(meta, "loads", ()):
                self._load_errors.update(t.block_ids)
            return
        for t in meta.loads:
            n = 0
            try:
                out = store.staging(len(t.digests), paged.device)[:, : store.payload_bytes]
                n = store.load(t.digests, out)
                if n:
                    paged.scatter(t.block_ids[:n], out[:n])
            except Exception as e:
                self.faults.fault("error", e)
                n = 0
            self._load_errors.update(t.block_ids[n:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv has loaded every layer already

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # saved whole, per request, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        store, paged = self._store, self._paged
        if not isinstance(meta, CortexConnectorMetadata) or store is None or paged is None:
            return
        for t in meta.saves:
            try:
                todo = store.absent(t.digests)  # another process may have stored them meanwhile
                if not todo:
                    continue
                rows = store.staging(len(todo), paged.device)
                paged.gather([t.block_ids[i] for i in todo], rows)
                store.save([t.digests[i] for i in todo], rows)
            except Exception as e:
                self.faults.fault("store_failed", e, len(t.digests))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._pool.close()


__all__ = ["CortexConnector", "CortexConnectorMetadata"]
