"""CortexConnector's counters in vLLM's own metrics: its periodic log line and its Prometheus endpoint.

Each side of the connector (the scheduler's: lookups, hit blocks; each
worker's: blocks and bytes loaded and stored, faults) hands vLLM what it
counted since it was last asked (`CortexConnector.get_kv_connector_stats`);
vLLM sums the workers' and the scheduler's (`aggregate`), logs the sum of
an interval ("KV Transfer metrics: lookups=..., hit_blocks=...") and feeds
it to the Prometheus counters made here:

  vllm:cortex_lookups_total         prompts looked up in the pool
  vllm:cortex_hit_blocks_total      blocks found there (what the engine then loads)
  vllm:cortex_loaded_blocks_total   blocks loaded into the KV cache
  vllm:cortex_stored_blocks_total   blocks stored into the pool
  vllm:cortex_loaded_bytes_total    their bytes (the payload, without our 64-byte header)
  vllm:cortex_stored_bytes_total
  vllm:cortex_faults_total{kind}    each a miss: missing, foreign, corrupt, store_failed, unavailable, error

`data` is plain counters by name (blocks.STAT_NAMES), so it crosses vLLM's
process boundaries as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .blocks import FAULT_NAMES, STAT_NAMES

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

# stat name -> (Prometheus name, help); the faults share one counter with a `kind` label.
PROM_COUNTERS = {
    "lookups": ("vllm:cortex_lookups", "Prompts CortexConnector looked up in its pool."),
    "hit_blocks": ("vllm:cortex_hit_blocks", "KV blocks CortexConnector found in its pool."),
    "loaded": ("vllm:cortex_loaded_blocks", "KV blocks CortexConnector loaded from its pool."),
    "stored": ("vllm:cortex_stored_blocks", "KV blocks CortexConnector stored in its pool."),
    "loaded_bytes": ("vllm:cortex_loaded_bytes", "Bytes of KV blocks CortexConnector loaded from its pool."),
    "stored_bytes": ("vllm:cortex_stored_bytes", "Bytes of KV blocks CortexConnector stored in its pool."),
}


@dataclass
class CortexConnectorStats(KVConnectorStats):
    """Counters by name (blocks.STAT_NAMES), summed across workers, the scheduler and an interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "CortexConnectorStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in STAT_NAMES if self.data.get(k)}
        out.update((k, v) for k, v in self.data.items() if k not in out and v)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CortexPromMetrics(KVConnectorPromMetrics):
    """The counters of the module doc, one child per engine (and fault kind)."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {k: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                          for k, (name, doc) in PROM_COUNTERS.items()}
        self._faults = self._counter_cls(name="vllm:cortex_faults",
                                         documentation="CortexConnector faults, each served as a cache miss.",
                                         labelnames=[*labelnames, "kind"])
        self._children: dict[tuple[int, str], Any] = {}

    def _child(self, engine_idx: int, stat: str) -> Any:
        child = self._children.get((engine_idx, stat))
        if child is None:
            labels = list(self.per_engine_labelvalues[engine_idx])
            if stat in FAULT_NAMES:
                child = self._faults.labels(*labels, stat)
            else:
                child = self._counters[stat].labels(*labels)
            self._children[(engine_idx, stat)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for stat, value in transfer_stats_data.items():
            if value and (stat in PROM_COUNTERS or stat in FAULT_NAMES):
                self._child(engine_idx, stat).inc(value)


__all__ = ["CortexConnectorStats", "CortexPromMetrics", "PROM_COUNTERS"]
