"""Snapshots of pools: `persist` and `restore`, the entry points (docs/design.md, "Layers").

The snapshot format, its writer and its reader live in snapshot.py, on the
core's interface, and restore.py builds a pool from a snapshot with the pool
class it is handed; this module hands it `Pool`.  Its names are re-exported here for callers that
use `cortex_cache.persist` as the snapshot module.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import PermissionDenied, StorageIOError  # noqa: F401 (re-exported: callers catch them from here)
from .pool import Pool
from .restore import STAGING_PREFIX, check_snapshot_dir  # noqa: F401 (re-exported)
from .restore import restore as _restore_with
from .snapshot import (  # noqa: F401 (re-exported: the format's tables too)
    COUNTERS,
    DEFAULT_KEEP,
    FILE_HEAD,
    HEAD_CHECK,
    REC_CHECK,
    REC_HEAD,
    TRAILER,
    READS,
    VERSION,
    MANIFEST_VERSION,
    SPACE_BOUND,
    PersistResult,
    Snapshot,
    WriteBehind,
    latest_path,
    list_snapshots,
    namespaced,
    prune,
    snapshot_dir,
    snapshot_space,
    snapshot_usage,
    snapshots_and_space,
    snapshots_of,
    write,
)


def persist(pool: Pool, path: str | os.PathLike | None = None, *args: Any, **options: Any) -> PersistResult:
    """Write a snapshot of `pool`'s live entries and its whole configuration; the rest of the parameters are
    snapshot.write's, which says what they do (keep, progress, full, replace): one place for them.

    Into the snapshot directory it is incremental: only the values no kept
    snapshot holds are written (`full`: every value, sharing nothing); with
    `path`, one self-contained file (an existing one replaced atomically, or
    with `replace=False` refused: OutputExists, 73).

    Retention: as many snapshots as the pool keeps (`Pool.snapshot_keep`,
    default 3); a `keep` given here is stored with the pool first, which
    only the pool's owner (or root) may do: PermissionDenied (77) for
    anyone else, before anything is written."""
    if pool.superseded:  # a snapshot of an old copy under the name would retire the pool's own
        raise pool.core.superseded_error()
    return write(pool.core, pool.configuration, path, *args, **options)


def restore(path: str | os.PathLike | None, *args: Any, **options: Any) -> tuple[Pool | None, dict[str, Any]]:
    """Rebuild a pool from a snapshot; return (pool, report).  The parameters are restore.restore's but its
    first (the pool class: Pool here), which says what they do: one place for them (name, replace,
    progress, clock, mode, if_missing, trust_tiers, allow_other_owner, detach).

    A pool that is gone comes back from the snapshot directory at once and is filled in the background
    (fill.py): this returns when the fill ended, or with `detach` once the pool is published, a forked
    process filling it (fork: call it from a program with no other threads).

    `if_missing`: a pool that exists is left alone: (None, a report with "skipped": True).
    `trust_tiers`: attach the snapshot's tiers even from a file this user may not have written.
    `allow_other_owner`: use (skip, or replace) an existing pool that is neither this user's nor root's."""
    return _restore_with(Pool, path, *args, **options)


__all__ = ["persist", "restore", "Snapshot", "PersistResult", "snapshot_dir", "latest_path", "snapshots_of",
           "check_snapshot_dir", "STAGING_PREFIX", "COUNTERS", "list_snapshots", "snapshot_usage", "snapshot_space", "snapshots_and_space", "SPACE_BOUND", "MANIFEST_VERSION", "namespaced",
           "DEFAULT_KEEP"]
