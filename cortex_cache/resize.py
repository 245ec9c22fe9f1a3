"""Resizing a live pool: a copy of it at the new size, built beside it and swapped in under its name.

Below `pool.py` (the pool class is handed in, as to restore.py); the copy is
built as a restore builds a pool (staging.py).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import xxhash

from . import fill, interrupts, segment
from .core import Core
from .errors import PermissionDenied, PersistBusy, PoolFull, SegmentCorrupt, UsageError, ValueTooLarge
from .layout import FLAG_MULTI_THREADED, Geometry
from .lock import PERSIST_BYTE, RecordLock
from .policy_names import POLICY_IDS
from .snapshot import RESTORE_BYTE, Record, busy, followed, pool_config
from .staging import create_staging, discard, restore_end, restore_entry, staging_name, sweep_stale_staging, tier_header

if TYPE_CHECKING:
    from .staging import PoolClass, PoolHandle


# Copied out of the old pool per lock hold, whichever comes first (a hold of 80,000 small entries kept
# readers waiting 0.5 s; 128 take about a millisecond).
RESIZE_BATCH_BYTES = 8 << 20
RESIZE_BATCH_ENTRIES = 128
# Before its last lock hold, a resize copies what was put meanwhile in up to this many rounds, until no
# more than RESIZE_LAST_ENTRIES are left for that hold to copy (writers wait for it).
RESIZE_CATCH_UP_ROUNDS = 4
RESIZE_LAST_ENTRIES = 256


def resize(Pool: "PoolClass", target: str, size: int, *, clock: Callable[[], float] | None = None,
           allow_other_owner: bool = False,
           progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Grow or shrink live pool `target` to `size` bytes of data: a new pool of that size and target's
    configuration is built beside it, filled most recently used first (what does not fit is the least
    recently used, left out), and renamed over target, which is marked superseded so the processes on it
    move to the new one (Pool.superseded; the engine adapters do by themselves).

    The copy runs while target serves, then catches up with what was put meanwhile (outside the lock, a few
    rounds); the last lock hold copies what was put since and drops what was deleted -- a few vectorised
    passes over the slot columns, however many entries were copied -- then marks the old pool and renames
    the new one over it (Core.retire), so nothing written before the swap is lost and no writer is left
    on the old copy untold.  Writers and readers wait once, for that hold alone.  Held meanwhile: target's
    persist lock (no persist or restore of it runs).  A pool with a disk tier is refused (UsageError): its
    index lives in the segment and is not carried over yet.  A size that gives the pool its geometry again
    changes nothing ("unchanged": True).  Returns a report: entries kept, left out, bytes, the old and new
    sizes, seconds, and the last lock hold's "swap_seconds"."""
    t0 = time.perf_counter()
    old = Pool.open(target, clock=clock, require_owner=not allow_other_owner)
    try:
        for t in old.tiers.configured:
            if t.resize_refusal:
                raise UsageError(f"pool {target!r} {t.resize_refusal}")
        waiting = fill.busy_reason(old.core, followed)
        if waiting is not None:
            raise PersistBusy(waiting)
        lock = RecordLock(old.core.seg.fd, PERSIST_BYTE)
        if not lock.take_soon():
            raise busy(old.core.seg.fd, target, "resize")
        running = RecordLock(old.core.seg.fd, RESTORE_BYTE)
        running.try_acquire()
        try:
            return _resize_locked(Pool, old, target, size, clock, progress, t0)
        finally:
            running.release()
            lock.release()
    finally:
        old.close()


def _resize_locked(Pool: "PoolClass", old: "PoolHandle", target: str, size: int, clock, progress, t0: float) -> dict[str, Any]:
    core = old.core
    cfg = core.locked(pool_config, core)
    keep = tier_header(core)
    keep.update(created=core.header[0]["created"], last_snapshot=core.header[0]["last_snapshot"])  # the same pool
    st = core.seg.stat()
    bs = cfg["block_size"]
    # The entry limit follows the size unless it was set by hand (then it keeps its share of the blocks).
    default_slots = Geometry.compute(cfg["size"], bs).n_slots
    max_entries = None if cfg["max_entries"] == default_slots else max(16, cfg["max_entries"] * size // max(1, cfg["size"]))
    same = Geometry.compute(size, bs, max_entries)
    if (same.data_size, same.n_slots) == (cfg["size"], cfg["max_entries"]):  # the pool as it is: nothing to do
        now = old.stats()
        return {"pool": target, "old_size": cfg["size"], "size": cfg["size"], "entries": now["entries"],
                "bytes": now["value_bytes"], "left_out": 0, "full": False, "unchanged": True,
                "swap_seconds": 0.0, "seconds": round(time.perf_counter() - t0, 6)}
    sweep_stale_staging()
    staging = staging_name()
    new = create_staging(
        Pool, target, staging, size, block_size=bs, policy=POLICY_IDS[cfg["policy"]], max_entries=max_entries,
        mode=cfg["mode"], multi_threaded=bool(cfg["flags"] & FLAG_MULTI_THREADED), lfu_period=cfg["lfu_period"],
        clock=clock, prefault=False,
    )
    report: dict[str, Any] = {"pool": target, "old_size": cfg["size"], "size": new.geometry.data_size}
    try:
        if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
            try:
                os.fchown(new.core.seg.fd, st.st_uid, st.st_gid)  # the pool's owners keep it
            except PermissionError:
                raise PermissionDenied(f"cannot give the resized pool the owner of {target!r} (uid {st.st_uid} "
                                       f"gid {st.st_gid}); resize it as that user or as root") from None
        seq, order = _put_since(core, -1)  # every live entry, the most recently used first
        copied: dict[bytes, int] = {}  # key -> its insert_seq in the old pool
        full = _resize_copy(core, new.core, order, copied, progress)
        for _ in range(RESIZE_CATCH_UP_ROUNDS):  # what was put meanwhile, outside the last lock hold
            now_seq, changed = _put_since(core, seq)
            if len(changed) <= RESIZE_LAST_ENTRIES:
                break  # few enough for the last lock hold, which brings everything put since `seq`
            full = _resize_copy(core, new.core, changed, copied, None) or full
            seq = now_seq
        with interrupts.commit():  # the last lock hold swaps: a signal now waits, and resize reports success
            t1, c1 = time.perf_counter(), time.thread_time()
            core.locked(_resize_finish, core, new, copied, seq, full, cfg["counters"], keep, target,
                        staging, report)
            report["swap_seconds"] = round(time.perf_counter() - t1, 6)
            report["swap_cpu_seconds"] = round(time.thread_time() - c1, 6)  # its work, without the machine's noise
    except BaseException:
        if segment.exists(staging):
            discard(Pool, new, staging)
        else:
            new.close()
        raise
    new.close()  # after the last hold: unmapping what this process wrote into it costs milliseconds
    report["seconds"] = round(time.perf_counter() - t0, 6)
    return report


def _no_victim() -> None:
    return None


def _resize_copy(old: Core, new: Core, order: list[int], copied: dict[bytes, int],
                 progress: Callable[[int, int], None] | None) -> bool:
    """Copy the old pool's entries at `order` (most recent first) into `new`, never evicting there; True if
    one found no room (the rest are older: left out)."""
    total = sum(int(old.columns["value_len"][i]) for i in order) if order else 0
    done = 0
    pos = 0
    while pos < len(order):
        batch, nbytes = [], 0
        while pos < len(order) and nbytes < RESIZE_BATCH_BYTES and len(batch) < RESIZE_BATCH_ENTRIES:
            batch.append(order[pos])
            nbytes += int(old.columns["value_len"][order[pos]])
            pos += 1
        for e in old.locked(_read_live, old, batch):
            if copied.get(e.key, -1) >= e.insert_seq:
                continue  # copied already, as it is now
            if not _put_live(new, e):
                return True
            copied[e.key] = e.insert_seq
            done += len(e.value)
        if progress is not None:
            progress(done, total)
    return False


def _put_since(core: Core, seq: int) -> tuple[int, list[int]]:
    """(the sequence number now, the live slots put after `seq`, most recently used first).  The columns are
    read in one lock hold, and sorted after it: a 100,000-entry sort is not something writers wait for."""
    def read() -> tuple[int, Any, Any]:
        c = core.columns
        live = np.flatnonzero(core.live_mask())
        changed = live[c["insert_seq"][live] > seq]
        return int(core.fields.seq[0]), changed, c["access_seq"][changed].copy()

    now, changed, recency = core.locked(read)
    return now, changed[np.argsort(recency, kind="stable")[::-1]].tolist()


def _read_live(core: Core, slots: list[int]) -> list[Record]:
    """The still-live entries among `slots`, as snapshot records with their values copied (lock held)."""
    out = []
    c = core.columns
    for i in slots:
        if not core.is_sealed(i) or core.expired(i):
            continue
        try:
            off, vlen = core.value_at(i)
        except SegmentCorrupt:
            continue
        out.append(Record(core.key_bytes(i), int(c["flags"][i]), memoryview(bytes(core.mv[off : off + vlen])),
                          float(c["created"][i]), float(c["last_access"][i]), float(c["expiry"][i]),
                          int(c["insert_seq"][i]), int(c["access_seq"][i]), int(c["access_count"][i]),
                          int(c["priority"][i]), core.checksum(i)))
    return out


def _put_live(new: Core, e: Record) -> bool:
    """Put one entry into the new pool without evicting there; False if it has no room for it."""
    new.evict_one = _no_victim  # type: ignore[method-assign]  # PoolFull instead of an eviction
    try:
        restore_entry(new, e, 0)
        return True
    except (PoolFull, ValueTooLarge):
        return False
    finally:
        del new.evict_one


def _resize_finish(core: Core, new: "PoolHandle", copied: dict[bytes, int], seq: int, full: bool,
                   counters: dict[str, int], keep: dict[str, Any], target: str, staging: str,
                   report: dict[str, Any]) -> None:
    """The old pool's lock held: bring what was put since `seq` and drop what was deleted or replaced since it
    was copied, then swap (Core.retire: mark the old one superseded and rename the new one over it, in this
    hold).  Vectorised over the slot columns: a few milliseconds at 100,000 entries, not a lookup per key."""
    c = core.columns
    live = np.flatnonzero(core.live_mask())
    seqs = c["insert_seq"][live]
    changed = live[seqs > seq].tolist()  # few: the catch-up rounds brought the rest
    for e in _read_live(core, changed):  # put (or put again) meanwhile: the newer value
        if copied.get(e.key, -1) >= e.insert_seq:
            continue
        if not _put_live(new.core, e):
            full = True  # no room: left out, as the oldest would be
            continue
        copied[e.key] = e.insert_seq
    # A copied entry whose insert_seq no longer lives in the old pool was deleted or replaced (and not put
    # again since): gone here too.
    gone = np.flatnonzero(~np.isin(np.fromiter(copied.values(), np.uint64, len(copied)), seqs))
    if len(gone):
        keys = list(copied)
        for n in gone.tolist():
            kb = keys[n]
            new.core.locked(new.core.delete, kb, xxhash.xxh3_64_intdigest(kb), False)
            del copied[kb]
    nc = new.core
    nc.locked(restore_end, nc, counters)
    nc.header["name"] = target.encode()
    for field, value in keep.items():
        nc.header[field] = value
    entries, nbytes = nc.locked(lambda: (int(nc.fields.n_entries[0]), int(nc.columns["value_len"][nc.live_mask()].sum())))
    report.update(entries=entries, bytes=nbytes, left_out=max(0, len(live) - entries), full=full)
    core.retire(lambda: segment.replace(staging, target))


__all__ = ["resize", "RESIZE_BATCH_BYTES", "RESIZE_BATCH_ENTRIES", "RESIZE_CATCH_UP_ROUNDS", "RESIZE_LAST_ENTRIES"]
