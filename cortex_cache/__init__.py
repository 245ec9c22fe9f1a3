"""cortex_cache: named KV-cache pools in POSIX shared memory.

Names are imported lazily so that `cortex --help` and `import cortex_cache`
stay fast and never load numpy until a pool is used.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Pool": ".pool",
    "EntryView": ".pool",
    "EntryWriter": ".pool",
    "KVCache": ".kv",
    "LookupMemo": ".lookups",
    "POLICIES": ".eviction",
    "parse_size": ".units",
    "format_size": ".units",
    "CortexCacheError": ".errors",
    "UsageError": ".errors",
    "InvalidName": ".errors",
    "InvalidSize": ".errors",
    "PoolNotFound": ".errors",
    "KeyNotFound": ".errors",
    "PoolExists": ".errors",
    "NoSpace": ".errors",
    "CannotCreate": ".errors",
    "OutputExists": ".errors",
    "PoolFull": ".errors",
    "ValueTooLarge": ".errors",
    "BufferTooSmall": ".errors",
    "SegmentCorrupt": ".errors",
    "IncompatibleVersion": ".errors",
    "ValueCorrupt": ".errors",
    "PermissionDenied": ".errors",
    "LockTimeout": ".errors",
    "PoolBusy": ".errors",
    "PersistBusy": ".errors",
    "SnapshotCorrupt": ".errors",
    "SnapshotNotFound": ".errors",
    "Snapshot": ".persist",
    "PoolClosed": ".errors",
    "PoolSuperseded": ".errors",
    "TooManyOpenFiles": ".errors",
    "ServiceUnavailable": ".errors",
    "StorageIOError": ".errors",
    "SpillLost": ".errors",
    "GpuUnavailable": ".errors",
    "LayoutMismatch": ".errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cortex_cache' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
