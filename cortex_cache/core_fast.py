"""The core's binding to the C fast path (_fastpath*.c; docs/internals.md, "The fast path").

The compiled module is imported here and nowhere else.  This module says what
the layers above get from it (`SLOW`, `PIN`, `GUARD`, its copy-and-checksum,
the read modes), the thresholds the C and Python paths share, and `bind`: the
offsets of one mapped segment and the hooks back into `Core` that the C
functions need.  Core re-exports the names, so callers keep importing them
from core.py.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Callable

from . import procs
from .errors import CortexCacheError, SegmentCorrupt
from .layout import CANDIDATES, HEADER_FIELDS, PIN_FIELDS, PIN_SIZE, Geometry, ghost_buckets
from .lock import METADATA_BYTE

# Values up to this size are put (and restored) in one lock hold: two extra lock
# round trips (reserve, seal) would cost more than copying outside it.
COPY_IN_LOCK = 256 * 1024
# Reads copy inside the lock only up to 32 KiB: above that, readers in other
# processes gain more from overlapping their copies than the two extra lock
# round trips cost one of them (64 KiB, two reader processes: 0.8x -> 1.8x
# of one; one reader alone: -17% ops/s; benchmarks/bench_peers.py).
GET_COPY_IN_LOCK = 32 * 1024
# The C fast path, unless it was not built or CORTEX_CACHE_PURE_PYTHON=1 asks for the Python path everywhere.
try:
    from . import _fastpath
except ImportError:  # pragma: no cover - built by `pip install` wherever a C compiler is
    _fastpath = None  # type: ignore[assignment]
PURE_PYTHON_ENV = "CORTEX_CACHE_PURE_PYTHON"
SLOW = _fastpath.SLOW if _fastpath is not None else object()  # "take the Python path" (nothing was changed)
PIN = _fastpath.Pin if _fastpath is not None else None  # the fast path's pinned entry (EntryView uses it)
# A mapping fenced against SIGBUS (_fastpath.c, Guard): the segment's, and every snapshot file and pack
# mapped (snapshot.py), so that a file cut short while it is read is an error, never a dead process.
GUARD = _fastpath.Guard if _fastpath is not None else None
# Its copy-and-checksum (copyhash.py picks it or the Python loop), and the instruction set it runs.
C_COPY_HASH = _fastpath.copy_hash if _fastpath is not None else None
C_COPY_HASH_MANY = _fastpath.copy_hash_many if _fastpath is not None else None
C_GATHER_HASH = getattr(_fastpath, "gather_hash", None) if _fastpath is not None else None
C_COPY_HASH_ISA = _fastpath.COPY_HASH_ISA if _fastpath is not None else None
# Modes of the fast path's reads: count hits and misses; count hits (a miss is SLOW, for a tier below to
# look); count nothing, move nothing (peek).
READ_COUNTED, READ_HITS, READ_QUIET = 0, 1, 2
# Copying a large value outside the lock without a pin (the seqlock check) relies on stores becoming
# visible in program order (x86-64's TSO); elsewhere the fast path leaves large values to the pinned path.
SEQLOCK_COPIES = platform.machine().lower() in ("x86_64", "amd64")
# The policies as the C fast path numbers them (_fastpath.h, POL_*), for its copy of eviction.py's scores.
_POLICY_KINDS = {"lru": 0, "lfu": 1, "fifo": 2, "priority": 3, "ttl": 4, "size": 5, "s3fifo": 0, "arc": 0, "auto": 0}
# ... and what a hit does in a queue policy (its Q_* enum): count the read, or promote to queue 1.
_QUEUE_KINDS = {"s3fifo": 1, "arc": 2, "auto": 1}
_ADAPT_KINDS = {"": 0, "arc": 1, "auto": 2}  # ... and how a ghost hit moves the target (its ADAPT_* enum)


def guard(mm: Any) -> Any:
    """A SIGBUS fence over mapping `mm` (_fastpath_guard.c), or None where the fast path is not built."""
    return _fastpath.Guard(mm) if _fastpath is not None else None


def bind(seg: Any, g: Geometry, victims: Any, slot_offsets: dict[str, int], *, queued: bool, verify_reads: bool,
         thread_lock: Any, guard: Any, hooks: dict[str, Callable[..., Any]]) -> Any:
    """The C fast path over segment `seg`'s mapping (`_fastpath.Fast`), or None: not built, or turned off.

    `g`: its geometry; `victims`: its victim list (the policy, and the score hooks of a non-monotone one);
    `slot_offsets`: where each slot column starts; `queued`: a queue policy's pool (its queue region's
    offsets too); `guard`: the mapping's SIGBUS fence.  `hooks`: Core's methods the C code calls back,
    by the name the C spec gives them (free_entry, late_unpin, reserve_hook, evict_hook)."""
    if _fastpath is None or os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return None
    hoff = {name: off for name, _, off in HEADER_FIELDS}
    poff = {name: off for name, _, off in PIN_FIELDS}
    pid, start = procs.me()
    pol = victims.policy
    spec: dict[str, Any] = {
        "lock_byte": METADATA_BYTE, "policy": _POLICY_KINDS[pol.name], "monotone": int(pol.monotone),
        "seqlock": int(SEQLOCK_COPIES), "verify": int(verify_reads), "pid": pid, "start": start,
        "block_size": g.block_size, "n_blocks": g.n_blocks, "n_slots": g.n_slots, "n_buckets": g.n_buckets,
        "n_pins": g.n_pins, "data_off": g.data_off, "keys_off": g.keys_off, "n_kcells": g.n_kcells,
        "copy_in_lock": GET_COPY_IN_LOCK, "buckets_off": g.buckets_off, "pins_off": g.pins_off,
        "pin_size": PIN_SIZE, "pin_pid": poff["pid"], "pin_slot": poff["slot"], "pin_start": poff["start"],
        "n_blocks_col": slot_offsets["n_blocks"], "lfu_epoch_col": slot_offsets["lfu_epoch"],
        "thread_lock": thread_lock, "guard": guard,
        "on_unpin": victims.on_unpin,
        # The write path (_fastpath_put.c).
        "put_in_lock": COPY_IN_LOCK, "blockmap_off": g.blockmap_off, "keymap_off": g.keymap_off,
        "error": CortexCacheError, "corrupt_error": SegmentCorrupt,
        # A background fill's gone marks (gone.py), which its batches set and check (_fastpath_fill.c).
        "gone_off": g.gone_off, "gone_len": g.gone_len if g.gone_off else 0,
        **hooks,
    }
    for name in ("dirty", "cand_valid", "seq", "hits", "misses", "ops", "lfu_epoch", "lfu_period",
                 "cand_max_primary", "cand_max_secondary", "cand_next_expiry", "free_slot", "alloc_hint",
                 "used_blocks", "key_hint", "used_kcells", "n_entries", "puts", "gone_seq", "expirations",
                 "evictions", "bytes_evicted"):
        spec["h_" + name] = hoff[name]
    # Victim choice (_fastpath_evict.c): the lists' rows and words; a list found stale is filled by Python
    # (hooks["refill_hook"]).
    n_lists = 2 if queued else 1
    vo = g.victim_columns()
    spec.update(lists=n_lists, list_rows=CANDIDATES // n_lists,
                ident_col=(g.qslot_columns() if pol.identity == "qseq" else slot_offsets)[pol.identity],
                **{f"victims_{name}": vo[name] for name in ("slot", "ident", "primary", "secondary")})
    for q, prefix in enumerate(("cand", "cand1")[:n_lists]):
        for word in ("valid", "count", "pos", "next_expiry", "max_primary", "max_secondary", "epoch"):
            spec[f"l{q}_{word}"] = hoff[f"{prefix}_{word}"] if q == 0 else g.queue_field(f"{prefix}_{word}")
    for name in ("state", "pins", "key_len", "next", "key_hash", "value_len", "first_block", "checksum",
                 "last_access", "expiry", "insert_seq", "access_seq", "access_count", "priority", "key_cell",
                 "flags", "owner_pid", "owner_start", "created"):
        spec[name] = slot_offsets[name]
    if queued:
        qo = g.qslot_columns()
        spec.update(queues=_QUEUE_KINDS[pol.name], adapt=_ADAPT_KINDS[pol.adapt], queue_col=qo["queue"],
                    freq_col=qo["freq"], qseq_col=qo["qseq"])
        for name in ("q_count0", "cand1_next_expiry", "q_target", "q_seq", "g0_live", "g1_live", "g0_head",
                     "g0_tail", "g1_head", "g1_tail", "q_regime", "q_ghost_rate", "q_hit_rate", "q_hits_seen"):
            spec["h_" + name] = g.queue_field(name)  # in the queue region's header: absolute offsets
        spec["g0_factor"], spec["g1_factor"] = pol.ghosts
        for ring in (0, 1):
            offs, n, boff = g.ghost_columns(ring)
            spec.update({f"g{ring}_n": n, f"g{ring}_hash": offs["hash"], f"g{ring}_next": offs["next"],
                         f"g{ring}_buckets": boff, f"g{ring}_n_buckets": ghost_buckets(n)})
    return _fastpath.Fast(seg.mm, seg.fd, spec)


__all__ = ["bind", "guard", "COPY_IN_LOCK", "GET_COPY_IN_LOCK", "PURE_PYTHON_ENV", "SLOW", "PIN", "GUARD",
           "C_COPY_HASH", "C_COPY_HASH_MANY", "C_GATHER_HASH", "C_COPY_HASH_ISA", "READ_COUNTED", "READ_HITS", "READ_QUIET",
           "SEQLOCK_COPIES"]
