"""Opening the pool an engine adapter names: attach, or create it from the adapter's parameters; and
following the name when the pool is replaced or deleted under the engine (`Attachment`)."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from .. import segment
from ..config import ADAPTER_PARAMS, adapter_options
from ..errors import PoolExists, UsageError
from ..policy_names import DEFAULT_POLICY
from ..pool import Pool

REATTACH_EVERY = 1.0  # seconds between tries to attach a pool that is missing (unless its name changes)

# The parameters every adapter takes for its pool (see the README); a tier's are its own (ADAPTER_OPTIONS).
POOL_PARAMS = ("pool", "create", "size", "block_size", "policy", *ADAPTER_PARAMS, "allow_other_owner")


def open_or_create(name: str, params: dict[str, Any]) -> Pool:
    """Attach to pool `name` (multi-threaded handle, the pool mapped in whole); with `create` make it first
    if missing.

    `size` is required with `create`; `block_size` (default 64K), `policy`
    (default DEFAULT_POLICY, as `cortex cache create`'s), and a disk tier with `disk_path`/`disk_size`/`disk_write`.
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
    kw: dict[str, Any] = {"block_size": params.get("block_size", "64K"), "policy": params.get("policy", DEFAULT_POLICY),
                          **adapter_options(params)}
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


class NameWatch:
    """Has anything come to pool `name`'s path since a failed open?  One stat of the path (a microsecond or two):
    so an adapter whose pool is missing finds one created or restored under the name at its next call,
    instead of after its retry interval, without trying to open a pool that is not there at every call.

    `before()` before an open is tried; `failed(seen)` with its answer when the open failed; `changed()` says
    whether the path holds something else now (another file, or one where there was none)."""

    def __init__(self, name: str) -> None:
        self.path = segment.shm_path(name)
        self._seen: tuple | None = None

    def before(self) -> tuple | None:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_ctime_ns

    def failed(self, seen: tuple | None) -> None:
        # What was there before the open was tried: a pool created between that stat and the failed open
        # still counts as a change.
        self._seen = seen

    def changed(self) -> bool:
        return self.before() != self._seen


class Attachment:
    """The pool of one name, followed: when the pool an engine uses is replaced under its name (restore
    --replace) or deleted, the segment says so (Pool.superseded, one header word read per call), and the
    next call lets the old copy go and attaches to the pool now under the name, or to none until one exists
    (tried again at the next call once something comes to the name's path, else every REATTACH_EVERY
    seconds; `last_error` says why not).

    Every data-path call holds a lease on the handle it uses (`use`); a handle let go is closed once its
    last lease ends (other threads may still be copying out of its mapping).  `pool`: a handle already
    open (the adapter's first attach, whose errors it reports at start).
    """

    def __init__(self, name: str, params: dict, pool: Pool | None = None) -> None:
        self.name = name
        self._params = params
        self._lock = threading.Lock()
        self._pool: Pool | None = pool
        self._leases: dict[int, int] = {}  # id(pool) -> calls using it
        self._retired: dict[int, Pool] = {}
        self._next_try = 0.0
        self._watch = NameWatch(name)
        self.last_error = ""
        self.moves = 0  # how many times it let a replaced or deleted pool go

    def _current(self) -> Pool | None:
        if self._pool is not None and self._pool.superseded:
            self._retire(self._pool)  # replaced or deleted under us
            self.moves += 1
            self._next_try = 0.0  # look for the new one at once
        if self._pool is None and (time.monotonic() >= self._next_try or self._watch.changed()):
            self._next_try = time.monotonic() + REATTACH_EVERY
            seen = self._watch.before()
            try:
                pool = open_or_create(self.name, self._params)
            except Exception as e:  # missing, damaged, no permission: tried again later
                self.last_error = f"{type(e).__name__}: {e}"
                self._watch.failed(seen)
                return None
            if pool.superseded:  # a delete marked it and has not unlinked it yet (or was killed in between)
                pool.close()
                self.last_error = "the pool was being replaced or deleted"
                self._watch.failed(seen)
                return None
            self._pool, self.last_error = pool, ""
        return self._pool

    def _retire(self, pool: Pool) -> None:
        self._pool = None
        if self._leases.get(id(pool), 0):
            self._retired[id(pool)] = pool
        else:
            pool.close()

    @contextmanager
    def use(self) -> Iterator[Pool | None]:
        """The pool to use for one call (None while there is none), held open until the call ends."""
        with self._lock:
            pool = self._current()
            if pool is not None:
                self._leases[id(pool)] = self._leases.get(id(pool), 0) + 1
        try:
            yield pool
        finally:
            if pool is not None:
                with self._lock:
                    left = self._leases[id(pool)] - 1
                    if left:
                        self._leases[id(pool)] = left
                    else:
                        del self._leases[id(pool)]
                        if self._retired.pop(id(pool), None) is not None:
                            pool.close()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._retire(self._pool)
            self._next_try = float("inf")


__all__ = ["POOL_PARAMS", "REATTACH_EVERY", "open_or_create", "Attachment", "NameWatch"]
