"""A pool segment as a whole: its header written at create, checked at open (docs/design.md, "Upgrading").

The core (core.py) attaches to a segment this module opened and validated;
`Pool.create` lays a new one out with `initialise` and makes it visible with
`publish`.  Nothing here holds the pool lock: a segment being created is
guarded by its creator's record lock until its magic is written.
"""

from __future__ import annotations

import os
import time

import numpy as np
import xxhash

from . import segment
from .errors import CortexCacheError, IncompatibleVersion, SegmentCorrupt
from .eviction import POLICY_IDS, policy_by_id
from .layout import (
    DISK_ON, FLAG_MULTI_THREADED, FLAG_RESERVED, FORMAT_VERSION, HEADER_DTYPE, HEADER_FIELDS, HEADER_SIZE, MAGIC,
    QUEUE_HEADER_DTYPE, Geometry, ghost_buckets,
)
from .lock import RecordLock

_OPEN_WAIT = 10.0  # seconds to wait for a pool that is still being created


def initialise(seg: segment.Segment, geo: Geometry, name: str, policy: str, mode: int, reserve: bool,
               multi_threaded: bool, lfu_period: int | None, complete: bool = True) -> None:
    """Write the header and empty tables of a new segment; the magic last, if `complete`
    (else the caller writes it with `publish` once its own regions are filled)."""
    mm = seg.mm
    h = np.frombuffer(mm, HEADER_DTYPE, 1, 0)[0]
    h["version"] = FORMAT_VERSION
    h["header_size"] = HEADER_SIZE
    for f in ("segment_size", "block_size", "n_blocks", "n_slots", "n_buckets", "n_pins",
              "slots_off", "buckets_off", "blockmap_off", "pins_off", "victims_off", "data_off",
              "n_dslots", "n_dbuckets", "dslots_off", "dbuckets_off", "n_kcells", "keymap_off", "keys_off",
              "qslots_off", "n_ghosts0", "n_ghosts1", "gone_off", "base_off"):
        h[f] = getattr(geo, f)
    h["policy"] = POLICY_IDS.index(policy)
    h["flags"] = (FLAG_MULTI_THREADED if multi_threaded else 0) | (FLAG_RESERVED if reserve else 0)
    h["created"] = time.time()
    h["mode"] = mode
    h["name"] = name.encode()
    h["prefix_mark"] = prefix_mark()
    h["lfu_period"] = lfu_period or max(1024, geo.n_slots)
    h["cand_next_expiry"] = np.inf
    pol = policy_by_id(int(h["policy"]))
    if pol is not None and pol.queues:
        qh = np.frombuffer(mm, QUEUE_HEADER_DTYPE, 1, geo.qslots_off)[0]  # the queue region's own header
        qh["cand1_next_expiry"] = np.inf
        qh["q_target"] = pol.target  # type: ignore[attr-defined]
        del qh
        for ring in (0, 1):
            _, n, boff = geo.ghost_columns(ring)
            if n:  # empty chains; the places' hashes are zeros already
                np.frombuffer(mm, np.int32, ghost_buckets(n), boff)[:] = -1
                np.frombuffer(mm, np.int32, n, geo.ghost_columns(ring)[0]["next"])[:] = -1
    nxt = np.frombuffer(mm, np.int32, geo.n_slots, geo.slot_columns()["next"])
    nxt[:-1] = np.arange(1, geo.n_slots, dtype=np.int32)
    nxt[-1] = -1
    h["free_slot"] = 0
    np.frombuffer(mm, np.int32, geo.n_buckets, geo.buckets_off)[:] = -1
    del nxt
    if complete:
        h["magic"] = MAGIC
    del h

def publish(seg: segment.Segment) -> None:
    """Write the magic: the segment is a complete pool from now on."""
    np.frombuffer(seg.mm, np.uint8, 8, 0)[:] = np.frombuffer(MAGIC, np.uint8)

def prefix_mark(prefix: str | None = None) -> int:
    """What a pool made under `prefix` (default: the prefix in force) carries in its header's prefix_mark:
    a checksum of the prefix, never 0 (0 is "made before the mark existed")."""
    p = segment.prefix() if prefix is None else prefix
    return xxhash.xxh3_64_intdigest(b"cortex-cache prefix " + p.encode()) or 1


_MARK_AT = {f[0]: f[2] for f in HEADER_FIELDS}["prefix_mark"]


def made_under_another_prefix(name: str) -> bool:
    """True when the segment listed as pool `name` under the prefix in force was made under a longer prefix:
    `nc.sd.` + `pool1` is also `nc.` + `sd.pool1`, and the header's prefix_mark says whose it is.  False when
    it was made under this prefix, carries no mark (made before it existed, or still being made), or cannot
    be read, or is no pool at all (no magic: junk is listed as corrupt under every prefix)."""
    try:
        fd = os.open(segment.shm_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        magic, raw = os.pread(fd, len(MAGIC), 0), os.pread(fd, 8, _MARK_AT)
    except OSError:
        return False
    finally:
        os.close(fd)
    if magic != MAGIC or len(raw) < 8:
        return False
    mark = int.from_bytes(raw, "little")
    return mark != 0 and mark != prefix_mark()


def open_segment(name: str, wait: bool = True) -> segment.Segment:
    """Open and validate pool `name`'s segment, waiting (bounded) for a creator still initialising it;
    without `wait` (listing many pools) such a segment is SegmentCorrupt at once."""
    seg = _open_complete_segment(name) if wait else _open_now(name)
    try:
        _validate(seg)
    except BaseException:
        seg.close()
        raise
    return seg


def _open_now(name: str) -> segment.Segment:
    seg = segment.Segment.open(name)
    if seg.size >= HEADER_SIZE and bytes(seg.mm[0:8]) == MAGIC:
        return seg
    seg.close()
    raise SegmentCorrupt(f"segment of pool {name!r} is not a complete pool (still being created, or its creator "
                         "died mid-create)")


def _open_complete_segment(name: str) -> segment.Segment:
    """Open `name`, waiting (bounded) for a creator that is still initialising it."""
    deadline = time.monotonic() + _OPEN_WAIT
    attempts = 0
    while True:
        seg = segment.Segment.open(name)
        if seg.size >= HEADER_SIZE and bytes(seg.mm[0:8]) == MAGIC:
            return seg
        # No magic yet: the creator holds the record lock until it writes it.
        lock = RecordLock(seg.fd)
        try:
            lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            lock.release()
        except CortexCacheError:
            seg.close()
            raise SegmentCorrupt(f"pool {name!r} is still being created (or its creator hung)") from None
        again = os.fstat(seg.fd).st_size
        complete = again >= HEADER_SIZE and seg.size == again and bytes(seg.mm[0:8]) == MAGIC
        if complete:
            return seg
        seg.close()
        if again >= HEADER_SIZE and again == seg.size:
            raise SegmentCorrupt(
                f"segment of pool {name!r} is not a cortex pool, or its creator died mid-create; "
                "delete it with `cortex cache delete`"
            )
        # Nobody held the lock and there is no header: either a creator sits
        # in the microseconds between shm_open and taking the lock, or it
        # died there.  Retry briefly, then call it what it is.
        attempts += 1
        if attempts >= 5:
            raise SegmentCorrupt(
                f"segment of pool {name!r} is empty: its creator died mid-create; "
                "delete it with `cortex cache delete`"
            )
        time.sleep(0.01)


def _validate(seg: segment.Segment) -> None:
    # A copy, not a view: an exception's traceback must not pin the mapping.
    hdr = np.frombuffer(seg.mm[:HEADER_SIZE], HEADER_DTYPE, 1, 0)
    h = hdr[0]
    if bytes(h["magic"]) != MAGIC:
        raise SegmentCorrupt(f"segment of pool {seg.name!r} is not a cortex pool")
    version = int(h["version"])
    if version != FORMAT_VERSION:
        advice = (
            "persist it with the cortex_cache that made it (`cortex cache persist`), delete it, and "
            "`cortex cache restore` it with this one" if version < FORMAT_VERSION else "use a newer cortex_cache"
        )
        raise IncompatibleVersion(
            f"pool {seg.name!r} has segment format version {version}; this cortex_cache reads version "
            f"{FORMAT_VERSION}: {advice}"
        )
    if int(h["header_size"]) != HEADER_SIZE:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header (header size)")
    why = Geometry.from_header(hdr).check(seg.size)
    if why:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header: {why}")
    pol = policy_by_id(int(h["policy"]))
    if pol is None:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header: unknown policy {int(h['policy'])}")
    # A queue policy's pool carries its queue region, with rings of its policy's sizes; no other pool does.
    n_slots, qslots_off = int(h["n_slots"]), int(h["qslots_off"])
    if pol.queues and not qslots_off:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header: policy {pol.name} without its queues")
    if pol.queues and (int(h["n_ghosts0"]), int(h["n_ghosts1"])) != tuple(
            f * n_slots for f in pol.ghosts):  # type: ignore[attr-defined]
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header: ghost rings of the wrong size for "
                             f"policy {pol.name}")
    if not pol.queues and qslots_off:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header: a queue region for policy {pol.name}")
    if int(h["disk_flags"]) & DISK_ON and int(h["n_dslots"]) == 0:
        raise SegmentCorrupt(f"pool {seg.name!r} has a damaged header: a disk tier without a disk index")


__all__ = ["initialise", "publish", "open_segment", "prefix_mark", "made_under_another_prefix"]
