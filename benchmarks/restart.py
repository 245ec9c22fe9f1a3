"""A pool's restart with its policy state (cortex_cache/policy_state.py), for the tests and bench_policies.

MERGE SEAM: until the snapshot carries the policy state itself (the version 4 manifest's "policy"
section, written by persist from policy_state.capture and laid back by the restore and the fill's end
through policy_state.apply), `persist` here captures the blob in a lock hold of its own just before the
persist, and `restore` applies it once the restore (and its fill) returned.  The coordinator replaces
both with the snapshot's section at merge; the callers need not change.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from cortex_cache import Pool, policy_state


def persist(pool: Pool, path: str | os.PathLike | None = None, state: bool = True) -> tuple[Any, bytes | None]:
    """Persist `pool` (to `path`, or the snapshot directory): (the snapshot's path, the policy state blob,
    None without `state`)."""
    blob = pool.core.locked(policy_state.capture, pool.core) if state else None
    return pool.persist(path), blob


def restore(blob: bytes | None, path: str | os.PathLike | None = None, name: str | None = None,
            progress: Callable[[int, int], None] | None = None) -> tuple[Pool, dict | None]:
    """Restore a pool as Pool.restore does, then lay `blob` over it (nothing if None): (pool, apply's report)."""
    pool = Pool.restore(path, name=name, progress=progress)
    if blob is None:
        return pool, None
    return pool, pool.core.locked(policy_state.apply, pool.core, blob)
