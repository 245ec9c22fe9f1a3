"""A pool's restart with or without its policy state (cortex_cache/policy_state.py), for the tests and
bench_policies.

A snapshot carries the policy state itself: persist writes it into the version 4 manifest's "policy"
section (snapshot.policy_blob), a self-contained file (`persist --output`, version 6) before its
records, and the restore lays it back in the lock hold where it ends (fill._finish, restore._end_restore;
its report says what it did, as restore's report["policy_state"]).  `persist(..., state=False)` writes a
snapshot without it (empty, as an older snapshot's), for the contrast.  A self-contained file of version
2 or 1 (written before version 6) has none: for those, and only those, `restore` lays the blob captured
by `persist` over the restored pool itself.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from cortex_cache import Pool, policy_state, snapshot
from cortex_cache.persist import restore as _restore


def persist(pool: Pool, path: str | os.PathLike | None = None, state: bool = True) -> tuple[Any, bytes | None]:
    """Persist `pool` (to `path`, or the snapshot directory): (the snapshot's path, the policy state blob for
    a self-contained file, None without `state`)."""
    blob = policy_state.capture(pool.core) if state else None
    if state:
        return pool.persist(path), blob
    keep = snapshot.policy_blob
    snapshot.policy_blob = lambda core: b""  # in this process only: a snapshot without the state
    try:
        return pool.persist(path), None
    finally:
        snapshot.policy_blob = keep


def restore(blob: bytes | None, path: str | os.PathLike | None = None, name: str | None = None,
            progress: Callable[[int, int], None] | None = None) -> tuple[Pool, dict | None]:
    """Restore a pool as Pool.restore does: (pool, what laying its policy state did: None without one).  The
    snapshot's own state is used; `blob` only for a self-contained file of version 2 or 1, which has none."""
    pool, report = _restore(path, name=name, progress=progress)
    assert pool is not None
    got = report.get("policy_state")
    if got is None and blob is not None and _self_contained(path):
        got = pool.core.locked(policy_state.apply, pool.core, blob)
    return pool, got


def _self_contained(path: str | os.PathLike | None) -> bool:
    if path is None:
        return False
    with snapshot.Snapshot(path, verify=False, private=True) as snap:
        return snap.header.version in (1, snapshot.PLAIN)
