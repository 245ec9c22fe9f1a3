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
block's header and checksum (on CUDA the copies run on a stream of their
own, which the forward pass waits for on the device).  `wait_for_save`
queues the blocks the step completed and returns: a thread of the worker's
(blocks.Saver) gathers them and stores them, one batched store per request.
vLLM must not reuse those blocks meanwhile, so `request_finished` answers
True for a request with saves, vLLM keeps its blocks, and the workers name
it in `get_finished` once its saves are done; a preempted request's saves
are waited for in `handle_preemptions`, before its blocks can be written.
A block that cannot be loaded is reported to vLLM as a load error and
recomputed: the connector sets `kv_load_failure_policy` to "recompute",
since a cache miss must never fail a request.

A hybrid model (KV cache groups of full and windowed attention; the
connector declares SupportsHMA) is served as one chain too: a position's
value holds every group's block of it (groups.py), and its block ids are
tuples, one per group.

Both sides hand their counters to vLLM's own metrics (stats.py):
`get_kv_connector_stats`, `build_kv_connector_stats`, `build_prom_metrics`.

kv_connector_extra_config:
  pool        pool name (required)
  create      create the pool if missing (default false); then size (required),
              block_size (default: the one the engine's KV blocks fill best,
              blocks.fit_block_size), policy (default auto),
              disk_path / disk_size / disk_write (a disk tier)
  namespace   key prefix (default "vllm/")
  model       the model's name in keys (default: the served model name);
              processes share blocks only under one name, weights, layout and rank
  weights     a name for the weights, in keys and the chain's tag (default: computed
              from the checkpoint's files, cortex_cache/weights.py; or CORTEX_CACHE_WEIGHTS)
  verify      check each loaded block against its checksum (default true)
  load_per_layer
              load layer by layer (layers.py): the first layers compute while later
              ones load (default false: every layer before the forward pass, until a
              device shows this wins; see docs/vllm.md)
"""

from __future__ import annotations

import logging
import os
import re
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ...errors import UsageError
from ...weights import Weights, resolve
from ..pools import POOL_PARAMS
from .blocks import (HEADER_SIZE, BlockStore, Faults, HostRows, PagedLayers, PoolRef, Saver, block_fill, fingerprint,
                     fit_block_size, load_host, prefix_digests)
from .events import PoolEvents
from .groups import PagedGroups, block_numbers, check_groups, describe, has_null, positions
from .layers import LayerLoads
from .stats import CortexConnectorStats, CortexPromMetrics

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ...pool import Pool

PARAMS = (*POOL_PARAMS, "namespace", "model", "weights", "verify", "load_per_layer")
_TAG_RE = re.compile(r"[^A-Za-z0-9._:@+-]+")
# vLLM's own logger tree: what it prints at start (INFO) appears among vLLM's lines, in its format.
start_log = logging.getLogger("vllm.cortex_cache")


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
    preempted: set[str] = field(default_factory=set)  # their blocks may be reused this step


@dataclass
class _Request:
    """What the scheduler side keeps per request."""

    digests: list[bytes]  # every whole prompt block's
    request: Any = None  # vLLM's Request (its block hashes and tokens, for KV events)
    block_ids: list[int] = field(default_factory=list)
    done: int = 0  # leading blocks loaded, cached or saved already
    load: tuple[int, int] | None = None  # blocks [a, b) to load at its next schedule
    saved: bool = False  # a save of its blocks was planned: the workers report when it is done
    counted: bool = False  # its lookup is in the pool's hit/miss counters


def _params(vllm_config: "VllmConfig") -> dict[str, Any]:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(PARAMS))
    if unknown:
        raise UsageError(f"unknown kv_connector_extra_config {', '.join(unknown)}: valid are {', '.join(PARAMS)}")
    if not extra.get("pool"):
        raise UsageError('kv_connector_extra_config needs "pool": the name of a cortex pool')
    if not isinstance(extra.get("load_per_layer", False), bool):
        raise UsageError(f'kv_connector_extra_config "load_per_layer" is true or false, not '
                         f'{extra["load_per_layer"]!r}')
    return extra


def _event_groups(kv_cache_config: "KVCacheConfig | None") -> list[tuple[str | None, int | None]]:
    """Each KV cache group's attention kind and window as vLLM's KV events name them (events.py)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

        return [(get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                for g in groups]
    except Exception:  # a vLLM without them: the groups unnamed
        return [(None, None)] * len(groups)


def say_weights(who: str, weights: Weights, retire: str) -> None:
    """Say once at start which weights the keys carry, and how to retire their KV (`retire`: a command)."""
    if weights.known:
        start_log.info("%s: KV keyed to weights %s (%s); retire it with: %s", who, weights.id, weights.source, retire)
    else:
        start_log.warning("%s: KV not tied to the weights (%s): KV computed by other weights under this model name "
                          "would be served; give \"weights\" a name for them (or set CORTEX_CACHE_WEIGHTS)",
                          who, weights.source)


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
        self.block_tokens = int(vllm_config.cache_config.block_size)
        # A hybrid model (groups of full and windowed attention): one value a position, every group's
        # layers in it (groups.py); what cannot be served so is refused here, in one line.
        check_groups(groups, self.block_tokens)
        self.usable = len(groups) >= 1
        self.groups = len(groups)
        specs = [g.kv_cache_spec for g in groups]
        spec = specs[0] if specs else None
        # Only full attention keeps every block of a running request: with another spec (a sliding
        # window frees blocks that leave it) a save is finished within the step that queued it.
        self.keeps_blocks = bool(specs) and all(type(s).__name__ == "FullAttentionSpec" for s in specs)
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.group_layers = [list(g.layer_names) for g in groups]
        self.layer_names = [name for names in self.group_layers for name in names]
        pages = [int(getattr(s, "page_size_bytes", 0)) * len(names) for s, names in zip(specs, self.group_layers)]
        # What one block takes in the pool: our header and every layer's page of it.
        self.value_bytes = HEADER_SIZE + sum(pages) if pages and all(pages) else 0
        par = vllm_config.parallel_config
        self.tp, self.pp = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
        served = vllm_config.model_config.served_model_name
        served = served[0] if isinstance(served, (list, tuple)) else served
        self.model = model_tag(str(params.get("model") or served or vllm_config.model_config.model))
        mc = vllm_config.model_config
        self.weights = resolve(getattr(mc, "model", None), override=params.get("weights"),
                               revision=getattr(mc, "revision", None))
        desc = [type(spec).__name__, getattr(spec, "dtype", "?"), f"layers={len(self.layer_names)}",
                f"heads={getattr(spec, 'num_kv_heads', '?')}", f"head_size={getattr(spec, 'head_size', '?')}",
                f"head_size_v={getattr(spec, 'head_size_v', '?')}", f"block={self.block_tokens}",
                f"layout={getattr(kv_cache_config, 'kv_cache_layout', '?')}", f"tp={self.tp}", f"pp={self.pp}"]
        if len(specs) > 1:  # each group's kind, window, layers and heads (one group: the tag of old)
            desc.append("groups=" + "+".join(
                f"{describe(s)}:{len(names)}:{getattr(s, 'num_kv_heads', '?')}:{getattr(s, 'head_size', '?')}"
                for s, names in zip(specs, self.group_layers)))
        self.layout = ",".join(str(d).removeprefix("torch.") for d in desc)
        self.tag = b"cortex-vllm/1\0" + self.model.encode() + b"\0" + self.layout.encode() + \
            b"\0weights:" + self.weights.id.encode()
        self.key_model = f"{self.model}/{self.weights.id}"  # keys: namespace + this + "/" + rank + "/" + digest

    def new_generation(self) -> None:
        """Tag the chains from now on with a generation no other process shares (after a reset)."""
        self.tag = self.tag.split(b"\0reset:")[0] + b"\0reset:" + os.urandom(8).hex().encode()

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


class CortexConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over a cortex pool (see the module doc)."""

    instances: "weakref.WeakSet[CortexConnector]" = weakref.WeakSet()  # this process's, for tests and tools
    # What shutdown touches, for one whose __init__ failed half-way (a hybrid model, bad parameters).
    _pool: PoolRef | None = None
    _saver: Saver | None = None
    _events: PoolEvents | None = None  # the scheduler's, with vLLM's KV events on
    _layer_loads: LayerLoads | None = None  # the worker's, with load_per_layer
    _layer_step = False  # this step's loads went through _layer_loads (wait_for_layer_load waits for them)

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        params = _params(vllm_config)
        self.faults = Faults(f"CortexConnector({role.name.lower()}, pool {params['pool']!r})")
        self.stats = self.faults.stats
        self._layout = _Layout(vllm_config, kv_cache_config, params)
        value_bytes = self._layout.value_bytes
        if params.get("create") and params.get("block_size") is None and value_bytes:
            params = {**params, "block_size": fit_block_size(value_bytes)}  # a pool made for these blocks
        # The scheduler says it (one per engine; its workers open the same pool).
        self._pool = PoolRef(str(params["pool"]), params, self.faults,
                             on_open=self._check_fit if role == KVConnectorRole.SCHEDULER else self._pin)
        self._namespace = str(params.get("namespace", "vllm/"))
        self._verify = bool(params.get("verify", True))
        self._per_layer = bool(params.get("load_per_layer", False))
        self._reqs: dict[str, _Request] = {}
        self._matched: dict[str, tuple[int, int]] = {}
        self._held: set[str] = set()  # finished requests whose blocks vLLM keeps until the workers' saves end
        self._store: BlockStore | None = None
        self._paged: PagedLayers | PagedGroups | None = None
        self._saver: Saver | None = None
        self._saving: set[str] = set()  # requests the workers were asked to save
        self._finishing: set[str] = set()  # of those, finished ones not yet reported
        self._loading: list = []  # CUDA loads queued this step (their pins go at the step's end)
        self._load_errors: set[int] = set()
        self._host_rows: HostRows | None = None  # what CPU loads copy through, kept from one to the next
        self._reported = dict.fromkeys(self.stats, 0)  # the counters as get_kv_connector_stats last gave them
        if role == KVConnectorRole.SCHEDULER:
            # A block that cannot be loaded (evicted meanwhile, corrupt) is a
            # cache miss: recompute it, never fail the request.  The scheduler
            # reads this after it has made its connector.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            # One lookup store per rank: the scheduler needs every rank's block.
            self._rank_stores = [self._block_store(rank, b"", 0) for rank in self._layout.ranks()]
            events = getattr(vllm_config, "kv_events_config", None)
            if events is not None and getattr(events, "enable_kv_cache_events", False):
                self._events = PoolEvents(self._pool, self._rank_stores, self.faults, self._layout.block_tokens,
                                          ownership=f"cortex:{params['pool']}", groups=_event_groups(kv_cache_config))
            pool = params["pool"]
            say_weights(f"CortexConnector(pool {pool!r}, model {self._layout.model!r})", self._layout.weights,
                        f"cortex cache evict {pool} --prefix {self.key_prefix} --tier all")
        CortexConnector.instances.add(self)

    @property
    def key_prefix(self) -> str:
        """What every key of this model and weights starts with, on every rank."""
        return f"{self._namespace}{self._layout.key_model}/"

    def _check_fit(self, pool: "Pool") -> None:
        """Once per pool opened: say so when its blocks hold ours at less than half their size."""
        value_bytes = self._layout.value_bytes
        bs = pool.geometry.block_size
        if value_bytes and block_fill(bs, value_bytes) < 0.5:
            fit = fit_block_size(value_bytes)
            self.faults.once("block-fit", "pool %r has blocks of %d bytes, which hold this engine's KV blocks of %d "
                             "bytes at %.0f%% fill; a pool made with --block-size %d holds them at %.0f%%",
                             pool.name, bs, value_bytes, 100 * block_fill(bs, value_bytes), fit,
                             100 * block_fill(fit, value_bytes))

    def _block_store(self, rank: str, fp: bytes, payload_bytes: int) -> BlockStore:
        return BlockStore(self._pool, self.faults, namespace=self._namespace, model=self._layout.key_model, rank=rank,
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
        self._reqs[request.request_id] = _Request(digests, request if self._events is not None else None)
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
        st = self._reqs[request.request_id]
        if not st.counted and self._rank_stores:
            # The blocks asked for and not found are misses in the pool's own counters, once a request
            # (vLLM asks again each step it waits); those found count as hits when they are loaded.
            st.counted = True
            self._rank_stores[0].count_lookup(0, limit - start - n)
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
            self._set_blocks(st, new.block_ids)
            st.done = max(st.done, new.num_computed_tokens // bs)
            self._plan(meta, new.req_id, st, new.num_computed_tokens + n_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._set_blocks(st, new_ids)
            elif new_ids:
                self._set_blocks(st, new_ids, extend=True)
            self._plan(meta, req_id, st, cached.num_computed_tokens[i] + n_sched.get(req_id, 0))
        self._matched.clear()
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return meta

    def _set_blocks(self, st: _Request, block_ids: "tuple[list[int], ...] | None", extend: bool = False) -> None:
        """Take the engine's block ids of a request (a list per group): plain ids for one group, one tuple per
        position for a hybrid model; a request whose groups' tables do not line up is dropped (no loads or
        saves from now on)."""
        ids = positions(block_ids, self._layout.groups)
        if ids is None:
            st.digests, st.load = [], None
            self.faults.once("groups", "the KV cache groups' block tables of a request differ in length: "
                             "that request is neither loaded nor saved")
            return
        st.block_ids = st.block_ids + ids if extend else ids

    def _plan(self, meta: CortexConnectorMetadata, req_id: str, st: _Request, computed_after: int) -> None:
        if st.load is not None:
            a, b = st.load
            st.load = None
            if b > a and b <= len(st.block_ids):
                meta.loads.append(Transfer(req_id, st.digests[a:b], st.block_ids[a:b]))
                st.done = max(st.done, b)
        end = min(len(st.digests), computed_after // self._layout.block_tokens, len(st.block_ids))
        # A position a windowed group holds no block of (vLLM's null block) has no value to save: the
        # chain's saves stop there (not met in practice: a step computes every group's blocks of its positions).
        end = next((i for i in range(st.done, end) if has_null(st.block_ids[i])), end)
        if end > st.done:
            meta.saves.append(Transfer(req_id, st.digests[st.done : end], st.block_ids[st.done : end]))
            if self._events is not None and st.request is not None:
                r, lora = st.request, getattr(st.request, "lora_request", None)
                self._events.planned(st.digests[st.done : end], r.block_hashes, st.done, r.prompt_token_ids or [],
                                     getattr(lora, "adapter_id", None), getattr(lora, "name", None))
            st.done = end
            st.saved = True

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True when the workers were asked to save some of its blocks: vLLM keeps them until every worker
        reports the saves done (`get_finished`), since the workers copy them out after the step."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA's `request_finished`, vLLM's call for every model once the connector declares it: the
        same answer for every group's blocks (a position's value holds them all)."""
        st = self._reqs.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        for s in getattr(self, "_rank_stores", ()):
            s.forget(request.request_id)
        if st is not None and st.saved:
            self._held.add(request.request_id)
            return True, None
        return False, None

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._held.difference_update(connector_output.finished_sending or ())
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self._recompute(invalid)

    def _recompute(self, invalid: "set[int]") -> None:
        """Blocks a load left unwritten (the workers' `get_block_ids_with_load_errors`): vLLM recomputes each
        request from its first such block, so that block and the ones after it are saved again as the
        recomputation completes them (a corrupt block was dropped from the pool; a block evicted between
        lookup and load was lost): the pool gets them back."""
        for st in self._reqs.values():
            first = next((i for i, b in enumerate(st.block_ids[: st.done]) if block_numbers([b]) & invalid), None)
            if first is not None:
                st.done = first

    def take_events(self) -> "list[KVCacheEvent]":
        """vLLM's KV events of the pool's blocks (events.py): those this engine saved, once in the pool on every
        rank, and those of them gone from it since; with `--kv-events-config` on, else none."""
        return self._events.take() if self._events is not None else []

    def has_pending_block_frees(self) -> bool:
        # Blocks a finished request holds come back when its saves end: wait for them rather than preempt.
        return bool(self._held)

    def reset_cache(self) -> bool:
        """What vLLM's `reset_prefix_cache(reset_connector=True)` calls, also after it updated the weights in
        place (`pause_generation(clear_cache=True)`): drop from the pool every block of this model and weights,
        on every rank (`key_prefix`; other engines of the same weights lose them too), and key what this
        engine computes from now on under a new generation of its own, which no other engine and no
        restart of this one shares -- its weights may no longer be the checkpoint's.  Requests it still
        holds (preempted by the reset) are neither loaded nor saved from now on.  False when the pool could
        not be reached (vLLM then reports the reset failed)."""
        self._layout.new_generation()
        for st in self._reqs.values():
            st.digests = []  # the old generation's keys: never looked up or stored again
        self._matched.clear()
        with self._pool.use() as pool:
            if pool is None:
                return False
            try:
                n, nbytes = pool.evict(prefix=self.key_prefix, tier="all")  # not spilled to a disk tier
            except Exception as e:
                self.faults.fault("error", e)
                return False
        start_log.info("CortexConnector(pool %r): reset: dropped %d blocks (%d bytes) under %s; this engine's "
                       "blocks are keyed under a generation of their own from now on", pool.name, n, nbytes,
                       self.key_prefix)
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save dropped is a future miss, never a request to recompute

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        if not self._layout.usable:
            return
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            rank = f"pp{get_pp_group().rank_in_group}tp{get_tensor_model_parallel_rank()}"
            num_blocks = self._layout.num_blocks
            layers = [PagedLayers([kv_caches[n] for n in names], num_blocks) for names in self._layout.group_layers]
            paged = layers[0] if len(layers) == 1 else PagedGroups(layers)
        except Exception as e:  # a layout we do not understand: the engine runs without us
            self.faults.fault("unavailable", f"KV cache not usable by the connector: {e}")
            return
        fp = fingerprint(self._layout.tag, paged.shape, rank)
        self._paged = paged
        self._store = self._block_store(rank, fp, paged.payload_bytes)
        self._saver = Saver(self._store, paged, self.faults, name=f"cortex-vllm-save-{rank}")
        if self._per_layer:
            self._layer_loads = self._make_layer_loads(kv_caches)
        self._pool.get()  # opened now (and pinned: _pin), not at the first step

    def _make_layer_loads(self, kv_caches: "dict[str, torch.Tensor]") -> LayerLoads | None:
        """The per-layer loads, where they apply: every layer of the KV cache named as vLLM will name it in
        `wait_for_layer_load`; else (noted once) the whole-request loads."""
        names = self._layout.layer_names
        try:
            if sorted(names) != sorted(kv_caches):
                raise ValueError("the KV cache's layers are not the KV cache groups' layers")
            stream = None
            if self._paged.device.type == "cuda":
                import torch

                stream = self._load_stream(torch)
            return LayerLoads(self._store, self._paged, names, stream=stream)
        except Exception as e:
            self.faults.once("per-layer", "load_per_layer: %s; loading every layer before the forward pass", e)
            return None

    def _pin(self, pool: "Pool") -> None:
        """The worker's, for every pool it opens (at start, and one created or put under the name later):
        copies between the pool and a CUDA cache run at full speed from pinned memory; without CUDA this
        does nothing.  Registered in pieces on a thread of its own (~0.1 s a GiB): the engine starts
        without waiting, and copies of pieces not yet registered are pageable ones meanwhile."""
        if self._paged is None or self._paged.device.type != "cuda":
            return
        try:
            from ... import gpu

            gpu.pin_memory(pool, background=True)
        except Exception as e:
            self.faults.fault("error", f"pinning pool memory for the device: {e}")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A preempted request's blocks are free again and may be written in this very step: its
        # saves still reading them finish first (rare: a request is preempted only when memory is short).
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted and self._saver is not None:
            self._saver.wait(preempted)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        store, paged = self._store, self._paged
        if not isinstance(meta, CortexConnectorMetadata) or store is None or paged is None:
            for t in getattr(meta, "loads", ()):
                self._load_errors.update(block_numbers(t.block_ids))
            return
        if self._layer_loads is not None:
            self._finish_layer_step()  # a step whose wait_for_save never came (none expected)
            if meta.loads:
                self._start_layer_loads(meta.loads)
            return
        stream = None
        if meta.loads and paged.device.type == "cuda":
            import torch

            stream = self._load_stream(torch)
            stream.wait_stream(torch.cuda.current_stream(paged.device))
        for t in meta.loads:
            n = 0
            try:
                if stream is None:
                    if self._host_rows is None:
                        self._host_rows = HostRows(store.row_bytes())
                    n = load_host(store, paged, self._host_rows, t.digests, t.block_ids)
                else:
                    n = self._load_cuda(t, stream)
            except Exception as e:
                self.faults.fault("error", e)
                n = 0
            self._load_errors.update(block_numbers(t.block_ids[n:]))
        if stream is not None:
            import torch

            # The forward pass waits for the copies on the device, not here: the host goes on launching it.
            torch.cuda.current_stream(paged.device).wait_stream(stream)

    def _start_layer_loads(self, loads: list[Transfer]) -> None:
        """The per-layer mode's start_load_kv: pins and checks the blocks, queues (CUDA) or holds (CPU) their
        layers; each layer's wait_for_layer_load waits for (or writes) that layer only."""
        loader = self._layer_loads
        if loader.stream is not None:
            import torch

            loader.stream.wait_stream(torch.cuda.current_stream(self._paged.device))  # blocks the last step read
        self._layer_step = True
        try:
            self._load_errors.update(loader.start(loads))
        except Exception as e:
            self.faults.fault("error", e)
            for t in loads:
                self._load_errors.update(block_numbers(t.block_ids))

    def _finish_layer_step(self) -> None:
        if self._layer_step:
            self._layer_step = False
            try:
                self._layer_loads.finish()
            except Exception as e:
                self.faults.fault("error", e)

    def _load_stream(self, torch: Any) -> Any:
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream(self._paged.device)
        return self._stream

    def _load_cuda(self, t: Transfer, stream: Any) -> int:
        """Queue one request's loads on `stream`: the pool -> a staging tensor -> the paged cache."""
        import torch

        store, paged = self._store, self._paged
        with torch.cuda.stream(stream):
            out = store.staging(len(t.digests), paged.device)[:, : store.payload_bytes]
            n = store.load(t.digests, out, stream=stream, keep=self._loading)
            if n:
                paged.scatter(t.block_ids[:n], out[:n])
            self._loading.append(out)  # lives until the step is over (the copies read and write it)
        return n

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Per layer (load_per_layer): the engine's stream waits for this layer's copies (CUDA), or its blocks
        are written now (CPU); else start_load_kv ordered the forward pass after every layer's copies."""
        if self._layer_step:
            try:
                self._layer_loads.wait(layer_name)
            except Exception as e:  # that layer may not hold its blocks: every block of the step recomputed
                self.faults.fault("error", e)
                for t in getattr(self._connector_metadata, "loads", ()):
                    self._load_errors.update(block_numbers(t.block_ids))

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # saved whole, per request, after the step (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        self._finish_layer_step()  # every layer in (or the engine's stream after every copy), pins let go
        loading, self._loading = self._loading, []
        for x in loading:  # this step's CUDA loads: the forward pass is queued after them; unpin the entries
            if hasattr(x, "wait"):
                try:
                    x.wait()
                except Exception as e:
                    self.faults.fault("error", e)
        if not isinstance(meta, CortexConnectorMetadata):
            return
        saver = self._saver
        for t in meta.saves:
            self._saving.add(t.req_id)  # reported in get_finished, queued or not: the scheduler waits for it
            if saver is not None:
                saver.submit(t.req_id, t.digests, t.block_ids)
        if saver is not None and meta.saves and not self._layout.keeps_blocks:
            saver.wait()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The finished requests whose saves are done: vLLM frees their blocks now."""
        self._finishing.update(r for r in finished_req_ids if r in self._saving)
        if not self._finishing:
            return None, None
        saver = self._saver
        done = {r for r in self._finishing if saver is None or not saver.pending(r)}
        self._finishing -= done
        self._saving -= done
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_saves(self, timeout: float | None = None) -> bool:
        """Until every save queued so far is done (stored, or counted as failed); False if `timeout`
        passed first.  For tests and tools: the engine never waits for saves (vLLM keeps their blocks)."""
        return self._saver is None or self._saver.wait(timeout=timeout)

    # ------------------------------------------------------------------ vLLM's metrics

    def get_kv_connector_stats(self) -> CortexConnectorStats | None:
        """What this side counted since the last call (vLLM sums the workers' and the scheduler's)."""
        now = self.faults.snapshot()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
        if not delta:
            return None
        self._reported = now
        return CortexConnectorStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CortexConnectorStats:
        return CortexConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: "dict[type[PromMetric], type[PromMetricT]]",
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> "KVConnectorPromMetrics":
        return CortexPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish the saves already queued (30 s at most), then close the pool.  Safe to call twice."""
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close()
        if self._pool is not None:
            self._pool.close()


__all__ = ["CortexConnector", "CortexConnectorMetadata"]
