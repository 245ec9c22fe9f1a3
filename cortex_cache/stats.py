"""Stats assembly: the memory tier's usage and counters as `cortex cache status --json` names them.

`memory_stats` reads a Core's header and slot columns (core.py; the caller
holds the lock); `hit_stats` is the one rule every tier (memory, disk,
remote) uses for its hits, misses and hit ratio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import fill
from .allocator import largest_run
from .layout import FLAG_MULTI_THREADED, FLAG_RESERVED, KEY_CELL, SEALED, WRITING

if TYPE_CHECKING:
    from .core import Core


def memory_stats(core: "Core") -> dict[str, Any]:
    """The memory tier's usage and counters (lock held); `Pool.stats` adds the tiers'."""
    h = core.header[0]
    g = core.geometry
    c = core.columns
    sealed = c["state"] == SEALED
    used = int(h["used_blocks"]) * g.block_size
    value_bytes = int(c["value_len"][sealed].sum())
    st = core.seg.stat()
    last = float(h["last_snapshot"])
    out = {
        "name": core.name,
        "format_version": int(h["version"]),
        "policy": core.policy,
        "multi_threaded": bool(int(h["flags"]) & FLAG_MULTI_THREADED),
        "reserved": bool(int(h["flags"]) & FLAG_RESERVED),
        "size_bytes": g.data_size,
        "segment_bytes": g.segment_size,
        "block_size": g.block_size,
        "blocks_total": g.n_blocks,
        "blocks_used": int(h["used_blocks"]),
        "used_bytes": used,
        "value_bytes": value_bytes,
        # How well the blocks are used: value bytes per allocated byte (1.0 when every value
        # fills its blocks; low when the block size is too large for the values), and the
        # longest run of free blocks (the largest value that fits without an eviction).
        "fill_ratio": value_bytes / used if used else 1.0,
        "largest_free_bytes": largest_run(core.block_map) * g.block_size,
        "key_arena_bytes": g.n_kcells * KEY_CELL,
        "key_arena_used_bytes": int(h["used_kcells"]) * KEY_CELL,
        "entries": int(h["n_entries"]),
        "max_entries": g.n_slots,
    }
    out.update(hit_stats(h["hits"], h["misses"]))
    out.update({
        "puts": int(h["puts"]),
        "deletes": int(h["deletes"]),
        "evictions": int(h["evictions"]),
        "expirations": int(h["expirations"]),
        "bytes_evicted": int(h["bytes_evicted"]),
        "repairs": int(h["repairs"]),
        # Admission to the tiers below (tiers.py): 1 every evicted entry, 2 only those seen twice; and how
        # many evicted entries were not admitted.
        "tier_admit": max(1, int(h["tier_admit"])),
        "tier_refused": int(h["tier_refused"]),
        "pinned_entries": int(np.count_nonzero(c["pins"])),
        "writing_entries": int(np.count_nonzero(c["state"] == WRITING)),
        "created": float(h["created"]),
        "last_snapshot": last if last > 0 else None,
        # A pool restored from an incremental snapshot: how its background fill went (fill.py); None else.
        "fill": fill.state(core),
        "mode": f"{st.st_mode & 0o777:04o}",
        "uid": st.st_uid,
        "gid": st.st_gid,
    })
    return out


def hit_stats(hits: int, misses: int) -> dict[str, Any]:
    """`hits`, `misses` and `hit_ratio` of a tier (one rule for every tier's stats)."""
    hits, misses = int(hits), int(misses)
    return {"hits": hits, "misses": misses, "hit_ratio": hits / (hits + misses) if hits + misses else 0.0}


__all__ = ["hit_stats", "memory_stats"]
