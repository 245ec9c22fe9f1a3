"""Byte layout of a pool segment (format version 3).

A segment is one POSIX shared-memory object, laid out as eleven regions (twelve
in a queue policy's pool), each starting on a 4096-byte boundary (docs/design.md, "Segment layout")::

    0             header     4096 bytes, HEADER_FIELDS below
    slots_off     slots      one column per SLOT_COLUMNS entry, n_slots values each
    buckets_off   buckets    n_buckets x int32: head slot of each hash chain, -1 empty
    blockmap_off  block map  n_blocks  x uint8: 0 free, 1 used
    pins_off      pins       n_pins    x 16 bytes, PIN_FIELDS below
    victims_off   victims    CANDIDATES (4096) x 32 bytes, VICTIM_COLUMNS below
    dslots_off    disk index one column per DSLOT_COLUMNS entry, n_dslots values each
    dbuckets_off  disk hash  n_dbuckets x int32: head disk slot of each chain, -1 empty
    keymap_off    key map    n_kcells  x uint8: 0 free, 1 used
    keys_off      key arena  n_kcells  x KEY_CELL bytes: the keys of the entries
    qslots_off    queues     queue policies only: QUEUE_HEADER_FIELDS (256 bytes), then on the
                             next page QSLOT_COLUMNS (n_slots values each), ghost ring 0 and
                             ring 1 (GHOST_COLUMNS and their hash heads), each page-aligned
    gone_off      gone marks gone_room  x uint8: per position of a fill's snapshot, bit 0 "its
                             copy is no longer the answer"; bit 1 of byte kh % n_slots "a key
                             of that hash was written by a process that cannot find positions"
    base_off      base pos.  BASE_HEAD (64 bytes: the base manifest's ident, entries), then
                             n_slots x uint32: the slot's entry's position + 1 in that full
                             manifest, 0 none (basepos.py; an incremental persist's delta)
    data_off      data       n_blocks  x block_size bytes: values only

The two disk-index regions are empty (n_dslots = 0) in a pool without a disk
tier.  Version 2 added them and the tier fields of the header (from byte 384);
version 3 moved the keys out of the data blocks into the key arena (header
fields from byte 624), so a value of N x block_size bytes takes exactly N
blocks, and aligned the data region to the block size.

All integers are little-endian.  The tables below are the single source of
truth: offsets and dtypes are derived from them, and `tests/test_layout.py`
holds a frozen copy so that any drift fails a test.  Changing a field means
bumping FORMAT_VERSION.

Slots are stored by column (all `state` values, then all `pins`, ...), each
column starting on a 64-byte boundary: eviction scans a few fields of every
slot, and reading them from contiguous columns is ~5x faster than striding
through 144-byte records.  Column k of a pool with n slots starts at
`slots_off + sum(align64(n * size_j) for j < k)`.

Entries.  An entry's value occupies ceil(value_len / block_size) contiguous
blocks (none for an empty value), starting on a block boundary, so tensor
views over it are block-aligned and, from 4 KiB blocks up, page-aligned (what
O_DIRECT and DMA want).  Its key occupies ceil(key_len / KEY_CELL) contiguous
cells of the key arena, which holds KEY_BYTES_PER_SLOT bytes per slot on
average; an entry is evicted for key room as it is for block room.  The slot
columns are authoritative; the hash chains, the block map, the key map, the
free-slot list, the victim list and the entry/usage counters are derived from
them and are rebuilt by repair.

Why a byte per block instead of a bit: the allocator scans the map with numpy,
which is several times faster on bytes than on packed bits, and the map costs
1/65536 of the data region at the default block size.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .errors import InvalidSize, UsageError
from .units import ceil_div

# The hot paths read fields through native-order memoryviews (see the end of
# this file); the format is little-endian, so refuse to run elsewhere.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("cortex_cache supports little-endian machines only")

MAGIC = b"CORTEXKV"
FORMAT_VERSION = 3
HEADER_SIZE = 4096
PAGE = 4096

# Slot states.  The state word is the commit point of every slot change:
# a slot is only ever interpreted according to its state.
FREE = 0  # unused; `next` links the free-slot list
WRITING = 1  # blocks reserved, writer copying; invisible to readers
SEALED = 2  # complete and visible through its hash chain
ZOMBIE = 3  # deleted/replaced/evicted while pinned; blocks freed at last unpin

# Header flags.
FLAG_MULTI_THREADED = 1 << 0  # default of Pool.open(multi_threaded=None)
FLAG_RESERVED = 1 << 1  # memory reserved with posix_fallocate at create
FLAG_SUPERSEDED = 1 << 2  # this segment was replaced under its name (restore --replace) or deleted: handles
# still on it re-attach by name (Pool.superseded, Pool.reopen; the engine adapters follow by themselves)

# Fill states (header field fill_state; fill.py).
FILL_NONE = 0  # never filled from a snapshot (a created pool, a restore --replace)
FILL_RUNNING = 1  # published, values still coming: a filler holds FILL_BYTE, or it was killed (resumable)
FILL_DONE = 2  # every entry of the snapshot was processed
FILL_STOPPED = 3  # ended early: the pool filled up with newer entries, or it was emptied (evict --all)
FILL_FAILED = 4  # ended early: the snapshot became unreadable or damaged
FILL_PRIVATE = 1 << 0  # fill_flags: the snapshot is the pool's own, in the snapshot directory
FILL_PATH_BYTES = 200

# Slot flags (column `flags`; the disk index and snapshot records use the same bit).
SLOT_FLAG_STR_KEY = 1 << 0  # the key was given as str: keys() returns it as str

# Disk tier flags (header field disk_flags).
DISK_ON = 1 << 0  # the pool has a disk tier
DISK_WRITE_THROUGH = 1 << 1  # every put also goes to disk (else: write-back, on eviction)
DISK_O_DIRECT = 1 << 2  # the tier's files are written and read with O_DIRECT

# Remote tier flags (header field remote_flags).
REMOTE_ON = 1 << 0  # the pool has a remote tier
REMOTE_CLUSTER = 1 << 1  # the URL names a node of a Redis/Valkey cluster

# Admission to the lower tiers (header field tier_admit; tiers.py): every evicted entry (0 or 1), or only
# those read since their put, i.e. seen at least twice (2).
ADMIT_ALL = 1
ADMIT_REUSED = 2

# Disk slot states.
DFREE = 0  # unused; `next` links the free list
DLIVE = 1  # a record on disk, indexed by its key's hashes
DPENDING = 2  # a spill being written outside the pool lock: in the chains, not yet readable
DISK_PATH_BYTES = 2048

NAME_BYTES = 64

# (name, numpy type, offset) -- offsets in bytes from the segment start.
HEADER_FIELDS: list[tuple[str, str, int]] = [
    ("magic", "S8", 0),  # b"CORTEXKV"; written last at create
    ("version", "<u4", 8),  # FORMAT_VERSION
    ("header_size", "<u4", 12),  # 4096
    ("segment_size", "<u8", 16),  # total bytes of the segment
    ("block_size", "<u8", 24),
    ("n_blocks", "<u8", 32),
    ("n_slots", "<u8", 40),  # index capacity (max entries)
    ("n_buckets", "<u8", 48),  # power of two
    ("n_pins", "<u8", 56),
    ("slots_off", "<u8", 64),
    ("buckets_off", "<u8", 72),
    ("blockmap_off", "<u8", 80),
    ("pins_off", "<u8", 88),
    ("data_off", "<u8", 96),
    ("policy", "<u4", 104),  # index into eviction.POLICY_IDS
    ("flags", "<u4", 108),  # FLAG_*
    ("created", "<f8", 112),  # wall clock, seconds since the epoch
    ("dirty", "<u4", 120),  # 1 while a lock holder is mid-change
    ("mode", "<u4", 124),  # permission bits given at create
    ("name", "S64", 128),  # pool name, NUL padded
    ("seq", "<u8", 192),  # logical clock, +1 per put and per hit
    ("used_blocks", "<u8", 200),
    ("n_entries", "<u8", 208),  # sealed entries
    ("alloc_hint", "<u8", 216),  # next-fit cursor into the block map
    ("free_slot", "<i8", 224),  # head of the free-slot list, -1 none
    ("hits", "<u8", 232),
    ("misses", "<u8", 240),
    ("puts", "<u8", 248),
    ("deletes", "<u8", 256),
    ("evictions", "<u8", 264),
    ("expirations", "<u8", 272),
    ("bytes_evicted", "<u8", 280),
    ("repairs", "<u8", 288),
    ("last_snapshot", "<f8", 296),  # wall clock of the last persist, 0 never
    ("lfu_epoch", "<u8", 304),  # LFU aging epoch (eviction.py)
    ("lfu_period", "<u8", 312),  # accesses per LFU epoch
    ("ops", "<u8", 320),  # puts + hits, drives lfu_epoch
    ("cand_valid", "<u4", 328),  # eviction candidate cache valid (0/1)
    ("cand_count", "<u4", 332),
    ("cand_pos", "<u4", 336),  # next candidate to try
    ("cand_pad", "<u4", 340),
    ("cand_next_expiry", "<f8", 344),  # earliest expiry not in the cache
    ("cand_max_primary", "<f8", 352),  # score of the last cached candidate
    ("cand_max_secondary", "<u8", 360),
    ("cand_epoch", "<u8", 368),  # lfu_epoch when the victim list was filled
    ("victims_off", "<u8", 376),
    # Disk tier (all zero without one); disktier.py.
    ("disk_flags", "<u4", 384),  # DISK_*
    ("disk_pad", "<u4", 388),
    ("disk_size", "<u8", 392),  # capacity of the tier's files in bytes
    ("n_dslots", "<u8", 400),  # disk index capacity (entries on disk)
    ("n_dbuckets", "<u8", 408),  # power of two, or 0 without a tier
    ("dslots_off", "<u8", 416),
    ("dbuckets_off", "<u8", 424),
    ("dfree_slot", "<i8", 432),  # head of the free disk-slot list, -1 none
    ("disk_entries", "<u8", 440),  # live disk slots
    ("disk_value_bytes", "<u8", 448),  # value bytes of the live disk slots
    ("disk_hits", "<u8", 456),  # memory misses found on disk (and returned)
    ("disk_misses", "<u8", 464),  # memory misses not on disk either
    ("disk_spills", "<u8", 472),  # records written (spills and write-through puts)
    ("disk_promotions", "<u8", 480),  # disk hits copied back into memory
    ("disk_bytes_written", "<u8", 488),
    ("disk_bytes_read", "<u8", 496),
    ("disk_corrupt", "<u8", 504),  # records that failed their checksums on read
    ("disk_dropped", "<u8", 512),  # entries lost to the ring going round or a full disk index
    ("disk_errors", "<u8", 520),  # I/O errors (the entry was not written or not read)
    ("disk_evictions", "<u8", 528),  # entries removed from the tier by evict/delete/replace
    # Remote tier (all zero without one); remote.py.
    ("remote_flags", "<u4", 536),  # REMOTE_*
    ("remote_pad", "<u4", 540),
    ("remote_hits", "<u8", 544),  # misses of memory and disk found on the server
    ("remote_misses", "<u8", 552),
    ("remote_promotions", "<u8", 560),  # remote hits copied into memory
    ("remote_errors", "<u8", 568),  # failed commands and connections
    ("remote_corrupt", "<u8", 576),  # values that failed their checks (counted as misses too)
    ("remote_sent", "<u8", 584),  # writes the writers tried (sets and deletes)
    ("remote_written", "<u8", 592),  # of which succeeded
    ("remote_dropped", "<u8", 600),  # writes dropped: queue full, or abandoned at close
    ("remote_bytes_written", "<u8", 608),
    ("remote_bytes_read", "<u8", 616),
    # Key arena (format 3).
    ("keymap_off", "<u8", 624),
    ("keys_off", "<u8", 632),
    ("n_kcells", "<u8", 640),  # cells of KEY_CELL bytes in the key arena
    ("used_kcells", "<u8", 648),
    ("key_hint", "<u8", 656),  # next-fit cursor into the key map
    # Operating (persist.py): snapshots of the pool persist keeps; 0 = DEFAULT_KEEP.
    ("snapshot_keep", "<u4", 664),
    # 668..671 reserved (zero).
    # Lookups (batch.py, LookupMemo): counts every sealed entry that left memory or had its value
    # replaced in place; a memoized "first n chunks are present" holds while it stays the same.
    ("gone_seq", "<u8", 672),
    # The background fill of a restored pool (fill.py): where it reads, how far it got.  A pool
    # published by restore before its values are in reads fill_state FILL_RUNNING until the fill ends.
    ("fill_state", "<u4", 680),  # FILL_* (0: never filled from a snapshot)
    ("fill_gen", "<u4", 684),  # +1 whenever a fill starts or is stopped: a filler that sees it change stops
    ("fill_done", "<u8", 688),  # snapshot entries processed, in the fill's order (loaded, skipped or damaged)
    ("fill_total", "<u8", 696),  # positions of the fill's order: the snapshot's entries (a delta's: and its dropped)
    ("fill_bytes", "<u8", 704),  # value bytes loaded
    ("fill_bytes_total", "<u8", 712),  # value bytes of the snapshot
    ("fill_check", "<u8", 720),  # the snapshot's file checksum (its trailer's): which snapshot the fill reads
    ("fill_started", "<f8", 728),  # wall clock
    ("fill_corrupt", "<u8", 736),  # values that failed their checksums: not loaded
    ("fill_skipped", "<u8", 744),  # entries the pool already held (put meanwhile) or that had expired
    ("fill_path", "S200", 752),  # the snapshot's absolute path, NUL padded
    ("fill_ended", "<f8", 952),  # wall clock, 0 while it runs
    ("fill_flags", "<u4", 960),  # FILL_PRIVATE: the snapshot is the pool's own in the snapshot directory
    # 964..967 reserved (zero).
    # Queue policies (s3fifo, arc, auto; queues.py), carved from format 3's reserved zeros: where the queue
    # region lies (its own header, QUEUE_HEADER_FIELDS, holds the queues' state).  All zero in a pool of
    # another policy, which carries no queue region.  The ghost rings' offsets are not stored: Geometry
    # derives them from qslots_off, n_slots and the rings' sizes.
    ("qslots_off", "<u8", 968),  # the queue region: QUEUE_HEADER, QSLOT_COLUMNS, ghost ring 0, ring 1; 0 = none
    ("n_ghosts0", "<u4", 976),  # places in ghost ring 0 (keys evicted from queue 0); 0 = no ring
    ("n_ghosts1", "<u4", 980),  # ... ring 1 (keys evicted from queue 1)
    # Admission to the lower tiers (tiers.py), also carved from format 3's reserved zeros.
    ("tier_admit", "<u4", 984),  # 0 or 1: every evicted entry goes below; 2: only entries read since their put
    ("tier_pad", "<u4", 988),
    ("tier_refused", "<u8", 992),  # evicted entries the lower tiers were not offered (not admitted)
    # The gone marks of a background fill (gone.py), carved from format 3's reserved zeros: where the region of
    # one byte per slot lies (0 = none: a pool made before it, whose fill keeps no marks).
    ("gone_off", "<u8", 1000),
    # The base positions of an incremental persist (basepos.py), carved from format 3's last reserved zeros:
    # where the region lies (a 64-byte head naming the base manifest, then a u32 per slot); 0 = none (a pool
    # made before it, whose persists always write full manifests).
    ("base_off", "<u8", 1008),
    # Which CORTEX_CACHE_SHM_PREFIX the pool was made under (header.prefix_mark; 0: made before this field),
    # so that a listing under a shorter prefix ("nc.") leaves out the pools of a longer one ("nc.sd.").
    ("prefix_mark", "<u8", 1016),
    ("disk_path", "S2048", 1024),  # absolute path of the tier's directory, NUL padded
    ("remote_url", "S1024", 3072),  # the server's URL (password included: the segment is private)
]

# (name, numpy type) of each slot column, in segment order.
SLOT_COLUMNS: list[tuple[str, str]] = [
    ("state", "<u4"),  # FREE / WRITING / SEALED / ZOMBIE
    ("pins", "<u4"),  # readers copying or viewing the value
    ("key_len", "<u4"),
    ("flags", "<u4"),  # bit 0: the key was given as str
    ("owner_pid", "<u4"),  # writer of a WRITING slot
    ("next", "<i4"),  # next slot in the hash chain / free list, -1 end
    ("key_hash", "<u8"),  # xxh3_64 of the key bytes
    ("value_len", "<u8"),
    ("first_block", "<u8"),
    ("n_blocks", "<u8"),
    ("checksum", "<u8"),  # xxh3_64 of the value, taken at put
    ("created", "<f8"),  # wall clock of the put
    ("last_access", "<f8"),  # wall clock of the last put or hit
    ("expiry", "<f8"),  # absolute wall clock; 0 = never
    ("insert_seq", "<u8"),  # header seq at put (fifo)
    ("access_seq", "<u8"),  # header seq at last put or hit (lru)
    ("access_count", "<u8"),  # hits + 1, aged for lfu
    ("lfu_epoch", "<u8"),  # epoch at which access_count was last aged
    ("priority", "<i8"),
    ("owner_start", "<u8"),  # writer's process start time (pid reuse guard)
    ("key_cell", "<u8"),  # first cell of the key in the key arena
]
SLOT_BYTES = sum(np.dtype(f).itemsize for _, f in SLOT_COLUMNS)  # 144 per slot

# The shared victim list (eviction.py): CANDIDATES rows, by column.
CANDIDATES = 4096
VICTIM_COLUMNS: list[tuple[str, str]] = [
    ("slot", "<i4"),  # cached victims, best first
    ("pad", "<i4"),
    ("ident", "<u8"),  # the victim's identity sequence number when cached
    ("primary", "<f8"),  # its score: -inf for an expired entry
    ("secondary", "<u8"),
]

# The disk index (disktier.py): one row per record on disk, by column.
DSLOT_COLUMNS: list[tuple[str, str]] = [
    ("state", "<u4"),  # DFREE / DLIVE / DPENDING
    ("key_len", "<u4"),
    ("file", "<u4"),  # which tier file holds the record
    ("flags", "<u4"),  # bit 0: the key was given as str
    ("next", "<i4"),  # next disk slot in the hash chain / free list, -1 end
    ("pad", "<i4"),
    ("key_hash", "<u8"),  # xxh3_64 of the key (as in the memory index)
    ("key_hash2", "<u8"),  # xxh3_64 of the key with another seed: 128 bits to tell keys apart
    ("value_len", "<u8"),
    ("offset", "<u8"),  # of the record in its file
    ("length", "<u8"),  # of the record on disk (aligned)
    ("seq", "<u8"),  # the record's sequence number (checked on every read)
    ("expiry", "<f8"),  # absolute wall clock; 0 = never
    ("priority", "<i8"),
    ("spilled", "<f8"),  # wall clock when the record was written
]
DSLOT_BYTES = sum(np.dtype(f).itemsize for _, f in DSLOT_COLUMNS)  # 96 per disk slot

# The queue region (queues.py), only in a pool of a queue policy (s3fifo, arc, auto), at qslots_off: first
# its own header, QUEUE_HEADER_SIZE bytes (the queues' state, offsets from the region's start), changed under
# the pool lock with the dirty mark set like the pool header's fields,
QUEUE_HEADER_SIZE = 256
QUEUE_HEADER_FIELDS: list[tuple[str, str, int]] = [
    ("q_count0", "<u8", 0),  # sealed entries in queue 0 (S3-FIFO's small queue, ARC's T1)
    ("q_count1", "<u8", 8),  # ... in queue 1 (the main queue, ARC's T2); the fast path reads the two as a pair
    ("q_target", "<f8", 16),  # ARC: p, the target of T1 in entries; s3fifo and auto: queue 0's share of entries
    ("q_seq", "<u8", 24),  # the queues' clock: +1 whenever an entry joins the tail of a queue (its qseq)
    ("g0_head", "<u8", 32),  # ghosts ever added to ring 0 (the next one's sequence number)
    ("g0_tail", "<u8", 40),  # oldest sequence number still in its window
    ("g0_live", "<u8", 48),  # ghosts in ring 0 (added, not yet forgotten or taken back)
    ("g1_head", "<u8", 56),
    ("g1_tail", "<u8", 64),
    ("g1_live", "<u8", 72),
    # The second victim list (queue 1's; queue 0's is the pool header's cand_* fields), laid out as those
    # are, word for word.
    ("cand1_valid", "<u4", 80),
    ("cand1_count", "<u4", 84),
    ("cand1_pos", "<u4", 88),
    ("cand1_pad", "<u4", 92),
    ("cand1_next_expiry", "<f8", 96),
    ("cand1_max_primary", "<f8", 104),
    ("cand1_max_secondary", "<u8", 112),
    ("cand1_epoch", "<u8", 120),
    # auto's regime (queues.py, QueueVictims.admit), carved from the reserved zeros (zero = its state at
    # create): which regime it is in, and the two rates, per put, that tell them apart.
    ("q_regime", "<u4", 128),  # AUTO_ADAPTIVE (0) or AUTO_LOOP (1)
    ("q_pad", "<u4", 132),
    ("q_ghost_rate", "<f8", 136),  # share of the puts whose key was a ghost (an average over ~n puts)
    ("q_hit_rate", "<f8", 144),  # hits per put (the same average)
    ("q_hits_seen", "<u8", 152),  # the pool's hits counter at the last put
    # 160..255 reserved (zero).
]
# then (on the next page) per slot, by column,
QSLOT_COLUMNS: list[tuple[str, str]] = [
    ("queue", "<u1"),  # 0 or 1: which queue a sealed entry is in
    ("freq", "<u1"),  # s3fifo and auto: reads since it joined its queue, at most 3
    ("qseq", "<u8"),  # q_seq when it joined the tail of its queue (their FIFO order)
]
# then two ghost rings of key hashes (n_ghosts0 and n_ghosts1 places), each its columns and its hash buckets
# (int32 heads, ghost_buckets(n) of them): the keys a queue lost lately, found by hash.
GHOST_COLUMNS: list[tuple[str, str]] = [
    ("hash", "<u8"),  # xxh3_64 of the key (as key_hash), 0 = an empty place
    ("next", "<i4"),  # next place in its bucket's chain, -1 end
]
QSLOT_BYTES = sum(np.dtype(f).itemsize for _, f in QSLOT_COLUMNS)  # 10 per slot
GHOST_BYTES = sum(np.dtype(f).itemsize for _, f in GHOST_COLUMNS)  # 12 per place, and 4 per bucket


def ghost_buckets(n: int) -> int:
    """Hash buckets of a ghost ring of `n` places: a power of two, at least n."""
    return 1 << max(4, (n - 1).bit_length()) if n else 0


def ghost_ring_size(n: int) -> int:
    return columns_size(GHOST_COLUMNS, n) + ghost_buckets(n) * 4 if n else 0


PIN_SIZE = 16
PIN_FIELDS: list[tuple[str, str, int]] = [
    ("pid", "<u4", 0),  # 0 = free pin record
    ("slot", "<i4", 4),
    ("start", "<u8", 8),  # process start time of pid
]


# The struct format of a typed memoryview over a column of each numpy type (the hot paths' views).
MV_FORMAT = {"<u1": "B", "<u4": "I", "<i4": "i", "<u8": "Q", "<i8": "q", "<f8": "d"}


def _dtype(fields: list[tuple[str, str, int]], itemsize: int) -> np.dtype:
    return np.dtype(
        {
            "names": [f[0] for f in fields],
            "formats": [f[1] for f in fields],
            "offsets": [f[2] for f in fields],
            "itemsize": itemsize,
        }
    )


HEADER_DTYPE = _dtype(HEADER_FIELDS, HEADER_SIZE)
QUEUE_HEADER_DTYPE = _dtype(QUEUE_HEADER_FIELDS, QUEUE_HEADER_SIZE)
PIN_DTYPE = _dtype(PIN_FIELDS, PIN_SIZE)


def column_offsets(columns: list[tuple[str, str]], n: int, base: int) -> dict[str, int]:
    """Offset of each column of `n` values, packed from `base` on 64-byte boundaries."""
    out, off = {}, base
    for name, fmt in columns:
        out[name] = off
        off += _align(n * np.dtype(fmt).itemsize, 64)
    return out


def columns_size(columns: list[tuple[str, str]], n: int) -> int:
    return sum(_align(n * np.dtype(fmt).itemsize, 64) for _, fmt in columns)

DEFAULT_BLOCK_SIZE = 64 * 1024
MIN_BLOCK_SIZE = 64
MAX_DEFAULT_SLOTS = 1 << 20
DEFAULT_PINS = 1024
MAX_KEY_BYTES = 4096
# The key arena: cells of KEY_CELL bytes, KEY_BYTES_PER_SLOT of them per slot on average
# (a KV connector's keys are 40-150 bytes), and room for two keys of the largest size at least.
KEY_CELL = 32
KEY_BYTES_PER_SLOT = 256


def key_cells(klen: int) -> int:
    """Cells of the key arena that a key of `klen` bytes occupies."""
    return -(-klen // KEY_CELL)


def blocks_for(nbytes: int, block_size: int) -> int:
    """Blocks a value of `nbytes` occupies: exactly ceil(nbytes / block_size), none for an empty value."""
    return -(-nbytes // block_size)


BASE_HEAD_SIZE = 64  # the base positions' head (basepos.py): u8[16] ident of the base, u64 its entries, u64 seq


def gone_room(n_slots: int, deltas: bool) -> int:
    """Bytes of the gone marks of a pool of `n_slots` slots: one per slot, and in a pool with base positions
    (deltas: an incremental persist's delta manifest has up to a quarter of its base's entries beside them,
    deltaplan.MAX_CHANGED) a quarter more."""
    return n_slots + (-(-n_slots // 4) if deltas else 0)


def base_region_size(n_slots: int) -> int:
    """Bytes of the base positions region of a pool of `n_slots` slots: its head, then a u32 per slot."""
    return BASE_HEAD_SIZE + 4 * n_slots


def _align(n: int, a: int = PAGE) -> int:
    return ceil_div(n, a) * a


def _queue_parts(qslots_off: int, n_slots: int, n_ghosts0: int, n_ghosts1: int) -> tuple[int, int, int, int]:
    """Where the queue region's parts start after its header: (queue columns, ghost ring 0, ring 1, the end),
    each on a page boundary; all 0 without a region."""
    if not qslots_off:
        return 0, 0, 0, 0
    qcols = _align(qslots_off + QUEUE_HEADER_SIZE)
    g0 = _align(qcols + columns_size(QSLOT_COLUMNS, n_slots))
    g1 = _align(g0 + ghost_ring_size(n_ghosts0))
    return qcols, g0, g1, _align(g1 + ghost_ring_size(n_ghosts1))


@dataclass(frozen=True)
class Geometry:
    """Where each region lies, derived from the pool's size parameters."""

    block_size: int
    n_blocks: int
    n_slots: int
    n_buckets: int
    n_pins: int
    slots_off: int
    buckets_off: int
    blockmap_off: int
    pins_off: int
    victims_off: int
    data_off: int
    segment_size: int
    n_dslots: int = 0
    n_dbuckets: int = 0
    dslots_off: int = 0
    dbuckets_off: int = 0
    n_kcells: int = 0
    keymap_off: int = 0
    keys_off: int = 0
    qslots_off: int = 0  # 0: no queue region (the policy is not a queue policy)
    n_ghosts0: int = 0
    n_ghosts1: int = 0
    gone_off: int = 0  # 0: no gone marks (a pool made before them)
    base_off: int = 0  # 0: no base positions (a pool made before them)

    @property
    def gone_len(self) -> int:
        """Bytes of the gone marks (positions a fill's snapshot may have): gone_room."""
        return gone_room(self.n_slots, bool(self.base_off))

    @property
    def data_size(self) -> int:
        return self.block_size * self.n_blocks

    def slot_columns(self) -> dict[str, int]:
        return column_offsets(SLOT_COLUMNS, self.n_slots, self.slots_off)

    def victim_columns(self) -> dict[str, int]:
        return column_offsets(VICTIM_COLUMNS, CANDIDATES, self.victims_off)

    def dslot_columns(self) -> dict[str, int]:
        return column_offsets(DSLOT_COLUMNS, self.n_dslots, self.dslots_off)

    # The queue region's parts after its header, derived (not stored): _queue_parts.
    @property
    def qcols_off(self) -> int:
        return _queue_parts(self.qslots_off, self.n_slots, self.n_ghosts0, self.n_ghosts1)[0]

    @property
    def ghosts0_off(self) -> int:
        return _queue_parts(self.qslots_off, self.n_slots, self.n_ghosts0, self.n_ghosts1)[1]

    @property
    def ghosts1_off(self) -> int:
        return _queue_parts(self.qslots_off, self.n_slots, self.n_ghosts0, self.n_ghosts1)[2]

    def qslot_columns(self) -> dict[str, int]:
        return column_offsets(QSLOT_COLUMNS, self.n_slots, self.qcols_off)

    def queue_field(self, name: str) -> int:
        """Absolute offset of the queue header's field `name` (what the C fast path is given)."""
        return self.qslots_off + {f[0]: f[2] for f in QUEUE_HEADER_FIELDS}[name]

    def ghost_columns(self, ring: int) -> tuple[dict[str, int], int, int]:
        """(column offsets, places, bucket heads' offset) of ghost ring 0 or 1."""
        n, off = (self.n_ghosts0, self.ghosts0_off) if ring == 0 else (self.n_ghosts1, self.ghosts1_off)
        return column_offsets(GHOST_COLUMNS, n, off), n, off + columns_size(GHOST_COLUMNS, n)

    @classmethod
    def compute(
        cls,
        size: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_entries: int | None = None,
        n_pins: int = DEFAULT_PINS,
        disk_entries: int = 0,
        ghosts: tuple[int, int] | None = None,
    ) -> "Geometry":
        """Lay out a pool whose data region holds `size` bytes (rounded down to blocks).  `ghosts`: a queue
        policy's queue region, with ghost rings of so many places per slot (eviction.QueuePolicy.ghosts)."""
        if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
            raise InvalidSize(
                f"invalid block size {block_size}: must be a power of two of at least {MIN_BLOCK_SIZE} bytes"
            )
        n_blocks = size // block_size
        if n_blocks < 1:
            raise InvalidSize(f"pool size {size} is smaller than one block ({block_size} bytes)")
        if max_entries is None:
            n_slots = min(n_blocks, MAX_DEFAULT_SLOTS)
        else:
            if max_entries < 1:
                raise UsageError(f"invalid max entries {max_entries}: must be at least 1")
            n_slots = max_entries
        if n_slots >= 2**31 - 1:
            raise UsageError(f"invalid max entries {n_slots}: at most {2**31 - 2}")
        n_buckets = 1 << max(4, (2 * n_slots - 1).bit_length())
        slots_off = HEADER_SIZE
        buckets_off = _align(slots_off + columns_size(SLOT_COLUMNS, n_slots))
        blockmap_off = _align(buckets_off + n_buckets * 4)
        pins_off = _align(blockmap_off + n_blocks)
        victims_off = _align(pins_off + n_pins * PIN_SIZE)
        dslots_off = _align(victims_off + columns_size(VICTIM_COLUMNS, CANDIDATES))
        if not 0 <= disk_entries < 2**31 - 1:
            raise UsageError(f"invalid disk entries {disk_entries}: at most {2**31 - 2}")
        n_dbuckets = 1 << max(4, (2 * disk_entries - 1).bit_length()) if disk_entries else 0
        dbuckets_off = _align(dslots_off + columns_size(DSLOT_COLUMNS, disk_entries))
        n_kcells = max(n_slots * KEY_BYTES_PER_SLOT, 2 * MAX_KEY_BYTES) // KEY_CELL
        keymap_off = _align(dbuckets_off + n_dbuckets * 4)
        keys_off = _align(keymap_off + n_kcells)
        data_off = _align(keys_off + n_kcells * KEY_CELL)
        qslots_off = n_g0 = n_g1 = 0
        if ghosts is not None:
            qslots_off = data_off
            n_g0, n_g1 = ghosts[0] * n_slots, ghosts[1] * n_slots
            if max(n_g0, n_g1) >= 2**32:  # the header holds them as u32
                raise UsageError(f"too many entries ({n_slots}) for a queue policy's ghost rings")
            data_off = _queue_parts(qslots_off, n_slots, n_g0, n_g1)[3]
        gone_off = data_off  # the gone marks (gone.py): a byte per position of a fill's snapshot
        data_off = _align(gone_off + gone_room(n_slots, True))
        base_off = data_off  # the base positions (basepos.py): a head, then a u32 per slot
        data_off = _align(base_off + base_region_size(n_slots))
        # The data region starts on a block boundary (and a page boundary), so
        # every value starts on one: blocks of 4 KiB and up are page-aligned.
        data_off = _align(data_off, max(PAGE, block_size))
        segment_size = data_off + n_blocks * block_size
        return cls(
            block_size, n_blocks, n_slots, n_buckets, n_pins,
            slots_off, buckets_off, blockmap_off, pins_off, victims_off, data_off, segment_size,
            disk_entries, n_dbuckets, dslots_off, dbuckets_off, n_kcells, keymap_off, keys_off,
            qslots_off, n_g0, n_g1, gone_off, base_off,
        )

    @classmethod
    def from_header(cls, hdr: np.ndarray) -> "Geometry":
        h = hdr[0]
        return cls(
            int(h["block_size"]), int(h["n_blocks"]), int(h["n_slots"]), int(h["n_buckets"]),
            int(h["n_pins"]), int(h["slots_off"]), int(h["buckets_off"]), int(h["blockmap_off"]),
            int(h["pins_off"]), int(h["victims_off"]), int(h["data_off"]), int(h["segment_size"]),
            int(h["n_dslots"]), int(h["n_dbuckets"]), int(h["dslots_off"]), int(h["dbuckets_off"]),
            int(h["n_kcells"]), int(h["keymap_off"]), int(h["keys_off"]),
            int(h["qslots_off"]), int(h["n_ghosts0"]), int(h["n_ghosts1"]), int(h["gone_off"]),
            int(h["base_off"]),
        )

    def check(self, file_size: int) -> str | None:
        """Return why this geometry cannot describe a segment of `file_size` bytes, or None."""
        bs = self.block_size
        if bs < MIN_BLOCK_SIZE or bs & (bs - 1) or bs > 1 << 40:
            return f"bad block size {bs}"
        if not (0 < self.n_slots < 2**31 - 1) or self.n_pins > 1 << 24 or self.n_pins < 1 or self.n_blocks < 1:
            return "bad table sizes"
        if self.n_buckets < 16 or self.n_buckets & (self.n_buckets - 1) or self.n_buckets > 1 << 33:
            return "bad bucket count"
        if self.n_dslots:
            nd = self.n_dbuckets
            if not (0 < self.n_dslots < 2**31 - 1) or nd < 2 * self.n_dslots or nd & (nd - 1) or nd > 1 << 33:
                return "bad disk index sizes"
        elif self.n_dbuckets:
            return "bad disk index sizes"
        regions = [
            (self.slots_off, columns_size(SLOT_COLUMNS, self.n_slots)),
            (self.buckets_off, self.n_buckets * 4),
            (self.blockmap_off, self.n_blocks),
            (self.pins_off, self.n_pins * PIN_SIZE),
            (self.victims_off, columns_size(VICTIM_COLUMNS, CANDIDATES)),
        ]
        if self.n_dslots:
            regions += [
                (self.dslots_off, columns_size(DSLOT_COLUMNS, self.n_dslots)),
                (self.dbuckets_off, self.n_dbuckets * 4),
            ]
        if not 2 * MAX_KEY_BYTES // KEY_CELL <= self.n_kcells <= 1 << 40:
            return "bad key arena size"
        regions += [
            (self.keymap_off, self.n_kcells),
            (self.keys_off, self.n_kcells * KEY_CELL),
        ]
        if self.qslots_off:
            # Each ring holds a whole number of places per slot (Geometry.compute), ring 0 at least one.
            n0, n1, ns = self.n_ghosts0, self.n_ghosts1, self.n_slots
            if not (ns <= n0 <= 8 * ns and n1 <= 8 * ns and n0 % ns == 0 and n1 % ns == 0):
                return "bad ghost ring sizes"
            regions += [
                (self.qslots_off, QUEUE_HEADER_SIZE),
                (self.qcols_off, columns_size(QSLOT_COLUMNS, self.n_slots)),
                (self.ghosts0_off, ghost_ring_size(self.n_ghosts0)),
                (self.ghosts1_off, ghost_ring_size(self.n_ghosts1)),
            ]
        elif self.n_ghosts0 or self.n_ghosts1:
            return "ghost rings without a queue region"
        if self.gone_off:
            regions.append((self.gone_off, self.gone_len))
        if self.base_off:
            regions.append((self.base_off, base_region_size(self.n_slots)))
        regions.append((self.data_off, self.n_blocks * bs))
        end = HEADER_SIZE
        for off, length in regions:
            if off < end or off % PAGE:
                return "regions overlap or are misaligned"
            end = off + length
        if self.data_off % bs:
            return "regions overlap or are misaligned"
        if end != self.segment_size or self.segment_size != file_size:
            return f"segment is {file_size} bytes but its header describes {self.segment_size}"
        return None


__all__ = [
    "MAGIC", "FORMAT_VERSION", "HEADER_SIZE", "HEADER_FIELDS", "SLOT_COLUMNS", "PIN_FIELDS", "VICTIM_COLUMNS",
    "HEADER_DTYPE", "PIN_DTYPE", "Geometry", "FREE", "WRITING", "SEALED", "ZOMBIE", "KEY_CELL", "key_cells",
    "blocks_for", "MV_FORMAT", "SLOT_FLAG_STR_KEY",
    "DSLOT_COLUMNS", "QSLOT_COLUMNS", "GHOST_COLUMNS", "QUEUE_HEADER_FIELDS", "QUEUE_HEADER_SIZE",
    "QUEUE_HEADER_DTYPE", "ghost_buckets", "DFREE", "DLIVE", "DPENDING", "DISK_ON", "DISK_WRITE_THROUGH", "DISK_O_DIRECT",
]


# ---------------------------------------------------------------------------
# Word indices for scalar access through typed memoryviews (hot paths).
# numpy scalar access costs ~0.2 us a field; a memoryview cast to "Q"/"I"/"d"
# costs ~0.04 us, which is what lets a 4 KiB put or get run in a few us.
# Header field F is at u64view[H_F] (or u32view for 4-byte fields); pin
# record j's fields at u32view[j * P32 + P_F] / u64view[j * P64 + P_F].


def _word(fields: list[tuple[str, str, int]], name: str, width: int) -> int:
    off = {f[0]: f[2] for f in fields}[name]
    assert off % width == 0, f"{name} is not {width}-byte aligned"
    return off // width


P64, P32 = PIN_SIZE // 8, PIN_SIZE // 4
P_PID, P_SLOT = _word(PIN_FIELDS, "pid", 4), _word(PIN_FIELDS, "slot", 4)
P_START = _word(PIN_FIELDS, "start", 8)
H_FLAGS = _word(HEADER_FIELDS, "flags", 4)
H_DIRTY, H_CAND_VALID, H_CAND_COUNT, H_CAND_POS = (
    _word(HEADER_FIELDS, n, 4) for n in ("dirty", "cand_valid", "cand_count", "cand_pos")
)
H_CAND_NEXT_EXPIRY, H_CAND_MAX_PRIMARY, H_CAND_MAX_SECONDARY, H_CAND_EPOCH = (
    _word(HEADER_FIELDS, n, 8) for n in ("cand_next_expiry", "cand_max_primary", "cand_max_secondary", "cand_epoch")
)
(H_SEQ, H_USED_BLOCKS, H_N_ENTRIES, H_ALLOC_HINT, H_FREE_SLOT, H_HITS, H_MISSES, H_PUTS, H_DELETES,
 H_EVICTIONS, H_EXPIRATIONS, H_BYTES_EVICTED, H_REPAIRS, H_LFU_EPOCH, H_LFU_PERIOD, H_OPS) = (
    _word(HEADER_FIELDS, n, 8)
    for n in ("seq", "used_blocks", "n_entries", "alloc_hint", "free_slot", "hits", "misses", "puts", "deletes",
              "evictions", "expirations", "bytes_evicted", "repairs", "lfu_epoch", "lfu_period", "ops")
)
H_USED_KCELLS, H_KEY_HINT, H_GONE_SEQ = (_word(HEADER_FIELDS, n, 8) for n in ("used_kcells", "key_hint", "gone_seq"))
H_DISK_FLAGS = _word(HEADER_FIELDS, "disk_flags", 4)
(H_DFREE_SLOT, H_DISK_ENTRIES, H_DISK_VALUE_BYTES, H_DISK_HITS, H_DISK_MISSES, H_DISK_SPILLS,
 H_DISK_PROMOTIONS, H_DISK_BYTES_WRITTEN, H_DISK_BYTES_READ, H_DISK_CORRUPT, H_DISK_DROPPED, H_DISK_ERRORS,
 H_DISK_EVICTIONS) = (
    _word(HEADER_FIELDS, n, 8)
    for n in ("dfree_slot", "disk_entries", "disk_value_bytes", "disk_hits", "disk_misses", "disk_spills",
              "disk_promotions", "disk_bytes_written", "disk_bytes_read", "disk_corrupt", "disk_dropped",
              "disk_errors", "disk_evictions")
)
H_REMOTE_FLAGS = _word(HEADER_FIELDS, "remote_flags", 4)
H_SNAPSHOT_KEEP = _word(HEADER_FIELDS, "snapshot_keep", 4)
H_TIER_ADMIT = _word(HEADER_FIELDS, "tier_admit", 4)
H_FILL_STATE, H_FILL_GEN = (_word(HEADER_FIELDS, n, 4) for n in ("fill_state", "fill_gen"))
H_FILL_DONE = _word(HEADER_FIELDS, "fill_done", 8)
H_TIER_REFUSED = _word(HEADER_FIELDS, "tier_refused", 8)
(H_REMOTE_HITS, H_REMOTE_MISSES, H_REMOTE_PROMOTIONS, H_REMOTE_ERRORS, H_REMOTE_CORRUPT, H_REMOTE_SENT,
 H_REMOTE_WRITTEN, H_REMOTE_DROPPED, H_REMOTE_BYTES_WRITTEN, H_REMOTE_BYTES_READ) = (
    _word(HEADER_FIELDS, n, 8)
    for n in ("remote_hits", "remote_misses", "remote_promotions", "remote_errors", "remote_corrupt", "remote_sent",
              "remote_written", "remote_dropped", "remote_bytes_written", "remote_bytes_read")
)
# The queue header's words (QUEUE_HEADER_FIELDS), as indices into typed views over that header alone.
(Q_COUNT0, Q_COUNT1, Q_TARGET, Q_SEQ, Q_G0_HEAD, Q_G0_TAIL, Q_G0_LIVE, Q_G1_HEAD, Q_G1_TAIL, Q_G1_LIVE,
 Q_GHOST_RATE, Q_HIT_RATE, Q_HITS_SEEN) = (
    _word(QUEUE_HEADER_FIELDS, n, 8)
    for n in ("q_count0", "q_count1", "q_target", "q_seq", "g0_head", "g0_tail", "g0_live", "g1_head", "g1_tail",
              "g1_live", "q_ghost_rate", "q_hit_rate", "q_hits_seen")
)
Q_REGIME = _word(QUEUE_HEADER_FIELDS, "q_regime", 4)
# A victim list's header words (eviction.VictimCache), in the order (valid, count, pos: u32 words;
# next_expiry, max_primary, max_secondary, epoch: u64 words) for list 0 (every pool: in the pool header) and
# list 1 (queue pools: in the queue header).
VICTIM_LIST_WORDS = [
    tuple(_word(fields, f"{p}_{f}", w) for f, w in (("valid", 4), ("count", 4), ("pos", 4), ("next_expiry", 8),
                                                     ("max_primary", 8), ("max_secondary", 8), ("epoch", 8)))
    for p, fields in (("cand", HEADER_FIELDS), ("cand1", QUEUE_HEADER_FIELDS))
]
