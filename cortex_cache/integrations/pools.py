"""Opening the pool an engine adapter names: attach, or create it from the adapter's parameters."""

from __future__ import annotations

from typing import Any

from ..errors import PoolExists, UsageError
from ..pool import Pool

# The parameters every adapter takes for its pool (see the README).
POOL_PARAMS = ("pool", "create", "size", "block_size", "policy", "disk_path", "disk_size", "disk_write",
               "allow_other_owner")


def open_or_create(name: str, params: dict[str, Any]) -> Pool:
    """Attach to pool `name` (multi-threaded handle, the pool mapped in whole); with `create` make it first
    if missing.

    `size` is required with `create`; `block_size` (default 64K), `policy`
    (default lru), and a disk tier with `disk_path`/`disk_size`/`disk_write`.
    The pool must be this user's or root's (PermissionDenied, 77, naming its
    owner): an engine puts its users' prompts into the pool its configuration
    names, and under the shared prefix another user may have taken that name
    first.  `allow_other_owner: true` accepts another user's pool (a group
    pool made by someone else, 0660).
    Raises what Pool.open/create raise (PoolNotFound without `create`).
    """
    other = bool(params.get("allow_other_owner"))
    if not params.get("create") or Pool.exists(name):
        return attach(name, other)
    if params.get("size") is None:
        raise UsageError('"create" needs "size" (e.g. "16G")')
    kw: dict[str, Any] = {"block_size": params.get("block_size", "64K"), "policy": params.get("policy", "lru")}
    if params.get("disk_path") is not None or params.get("disk_size") is not None:
        kw.update(tier="disk", disk_path=params.get("disk_path"), disk_size=params.get("disk_size"),
                  disk_write=params.get("disk_write", "back"))
    try:
        return Pool.create(name, params["size"], multi_threaded=True, **kw)
    except PoolExists:  # another process of the engine made it first
        return attach(name, other)


def attach(name: str, allow_other_owner: bool = False) -> Pool:
    """Pool.open, multi-threaded, the whole pool being mapped on a thread of its own (`Pool.populate`): an
    engine process lives long, and its first pass over the pool should not pay a page fault per page.
    (`create` maps it too.)"""
    pool = Pool.open(name, multi_threaded=True, require_owner=not allow_other_owner)
    try:
        pool.populate(background=True)
    except BaseException:
        pool.close()
        raise
    return pool


__all__ = ["POOL_PARAMS", "open_or_create"]
