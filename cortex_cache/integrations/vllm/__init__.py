"""vLLM on a cortex pool: a KV connector and a secondary tier of vLLM's native offloading.

Both load by module path and import vLLM only when vLLM asks for them, so
`import cortex_cache.integrations.vllm` works (and its pool-side parts are
usable and tested) without vLLM:

- `CortexConnector` (connector.py): a `KVConnectorBase_V1`,
  ``"kv_connector_module_path": "cortex_cache.integrations.vllm"``.
- `CortexTier` (tier.py): a `SecondaryTierManager` of `TieringOffloadingSpec`,
  ``{"type": "CortexTier", "module_path": "cortex_cache.integrations.vllm"}``.
- blocks.py: what both store in the pool (keys, the 64-byte header, faults
  as counted misses), with no vLLM in it.
- groups.py: a hybrid model's KV cache groups as one value a block position
  (the connector's), with no vLLM in it.

docs/vllm.md has the configurations, parameters and tested versions.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {"CortexConnector": ".connector", "CortexConnectorMetadata": ".connector", "CortexTier": ".tier"}

__all__ = ["CortexConnector", "CortexConnectorMetadata", "CortexTier"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)  # imports vLLM
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
