"""The segment's byte layout must not drift without a format version bump."""

from __future__ import annotations

import numpy as np
import pytest

from cortex_cache import layout
from cortex_cache.layout import Geometry

# Frozen copy of format version 3 (2 added the disk and remote tiers' header fields and the disk index;
# 3 moved the keys into their own arena, so values fill exactly their blocks).  If this test fails you changed the bytes
# of the segment: bump FORMAT_VERSION and update this table on purpose.
FROZEN_VERSION = 3
FROZEN_HEADER = [
    ("magic", "S8", 0), ("version", "<u4", 8), ("header_size", "<u4", 12), ("segment_size", "<u8", 16),
    ("block_size", "<u8", 24), ("n_blocks", "<u8", 32), ("n_slots", "<u8", 40), ("n_buckets", "<u8", 48),
    ("n_pins", "<u8", 56), ("slots_off", "<u8", 64), ("buckets_off", "<u8", 72), ("blockmap_off", "<u8", 80),
    ("pins_off", "<u8", 88), ("data_off", "<u8", 96), ("policy", "<u4", 104), ("flags", "<u4", 108),
    ("created", "<f8", 112), ("dirty", "<u4", 120), ("mode", "<u4", 124), ("name", "S64", 128),
    ("seq", "<u8", 192), ("used_blocks", "<u8", 200), ("n_entries", "<u8", 208), ("alloc_hint", "<u8", 216),
    ("free_slot", "<i8", 224), ("hits", "<u8", 232), ("misses", "<u8", 240), ("puts", "<u8", 248),
    ("deletes", "<u8", 256), ("evictions", "<u8", 264), ("expirations", "<u8", 272),
    ("bytes_evicted", "<u8", 280), ("repairs", "<u8", 288), ("last_snapshot", "<f8", 296),
    ("lfu_epoch", "<u8", 304), ("lfu_period", "<u8", 312), ("ops", "<u8", 320), ("cand_valid", "<u4", 328),
    ("cand_count", "<u4", 332), ("cand_pos", "<u4", 336), ("cand_pad", "<u4", 340),
    ("cand_next_expiry", "<f8", 344), ("cand_max_primary", "<f8", 352), ("cand_max_secondary", "<u8", 360),
    ("cand_epoch", "<u8", 368), ("victims_off", "<u8", 376),
    ("disk_flags", "<u4", 384), ("disk_pad", "<u4", 388), ("disk_size", "<u8", 392), ("n_dslots", "<u8", 400),
    ("n_dbuckets", "<u8", 408), ("dslots_off", "<u8", 416), ("dbuckets_off", "<u8", 424),
    ("dfree_slot", "<i8", 432), ("disk_entries", "<u8", 440), ("disk_value_bytes", "<u8", 448),
    ("disk_hits", "<u8", 456), ("disk_misses", "<u8", 464), ("disk_spills", "<u8", 472),
    ("disk_promotions", "<u8", 480), ("disk_bytes_written", "<u8", 488), ("disk_bytes_read", "<u8", 496),
    ("disk_corrupt", "<u8", 504), ("disk_dropped", "<u8", 512), ("disk_errors", "<u8", 520),
    ("disk_evictions", "<u8", 528), ("remote_flags", "<u4", 536), ("remote_pad", "<u4", 540),
    ("remote_hits", "<u8", 544), ("remote_misses", "<u8", 552), ("remote_promotions", "<u8", 560),
    ("remote_errors", "<u8", 568), ("remote_corrupt", "<u8", 576), ("remote_sent", "<u8", 584),
    ("remote_written", "<u8", 592), ("remote_dropped", "<u8", 600), ("remote_bytes_written", "<u8", 608),
    ("remote_bytes_read", "<u8", 616), ("keymap_off", "<u8", 624), ("keys_off", "<u8", 632),
    ("n_kcells", "<u8", 640), ("used_kcells", "<u8", 648), ("key_hint", "<u8", 656), ("snapshot_keep", "<u4", 664),
    # Carved from the reserved zeros in version 3 (older code reads past them): the lookups' memo counter
    # and the background fill's fields.
    ("gone_seq", "<u8", 672),
    ("fill_state", "<u4", 680),
    ("fill_gen", "<u4", 684),
    ("fill_done", "<u8", 688),
    ("fill_total", "<u8", 696),
    ("fill_bytes", "<u8", 704),
    ("fill_bytes_total", "<u8", 712),
    ("fill_check", "<u8", 720),
    ("fill_started", "<f8", 728),
    ("fill_corrupt", "<u8", 736),
    ("fill_skipped", "<u8", 744),
    ("fill_path", "S200", 752),
    ("fill_ended", "<f8", 952),
    ("fill_flags", "<u4", 960),
    ("disk_path", "S2048", 1024), ("remote_url", "S1024", 3072),
]
FROZEN_SLOT_COLUMNS = [
    ("state", "<u4"), ("pins", "<u4"), ("key_len", "<u4"), ("flags", "<u4"), ("owner_pid", "<u4"),
    ("next", "<i4"), ("key_hash", "<u8"), ("value_len", "<u8"), ("first_block", "<u8"), ("n_blocks", "<u8"),
    ("checksum", "<u8"), ("created", "<f8"), ("last_access", "<f8"), ("expiry", "<f8"), ("insert_seq", "<u8"),
    ("access_seq", "<u8"), ("access_count", "<u8"), ("lfu_epoch", "<u8"), ("priority", "<i8"),
    ("owner_start", "<u8"), ("key_cell", "<u8"),
]
FROZEN_VICTIM_COLUMNS = [("slot", "<i4"), ("pad", "<i4"), ("ident", "<u8"), ("primary", "<f8"), ("secondary", "<u8")]
FROZEN_DSLOT_COLUMNS = [
    ("state", "<u4"), ("key_len", "<u4"), ("file", "<u4"), ("flags", "<u4"), ("next", "<i4"), ("pad", "<i4"),
    ("key_hash", "<u8"), ("key_hash2", "<u8"), ("value_len", "<u8"), ("offset", "<u8"), ("length", "<u8"),
    ("seq", "<u8"), ("expiry", "<f8"), ("priority", "<i8"), ("spilled", "<f8"),
]
FROZEN_PIN = [("pid", "<u4", 0), ("slot", "<i4", 4), ("start", "<u8", 8)]


def test_layout_matches_frozen_format():
    assert layout.FORMAT_VERSION == FROZEN_VERSION
    assert layout.MAGIC == b"CORTEXKV"
    assert layout.HEADER_FIELDS == FROZEN_HEADER
    assert layout.SLOT_COLUMNS == FROZEN_SLOT_COLUMNS
    assert layout.VICTIM_COLUMNS == FROZEN_VICTIM_COLUMNS
    assert layout.PIN_FIELDS == FROZEN_PIN
    assert layout.DSLOT_COLUMNS == FROZEN_DSLOT_COLUMNS
    assert (layout.HEADER_SIZE, layout.SLOT_BYTES, layout.PIN_SIZE, layout.CANDIDATES) == (4096, 144, 16, 4096)
    assert layout.DSLOT_BYTES == 96


@pytest.mark.parametrize("fields,size", [(layout.HEADER_FIELDS, 4096), (layout.PIN_FIELDS, 16)])
def test_fields_do_not_overlap_and_fit(fields, size):
    spans = sorted((off, off + np.dtype(fmt).itemsize, name) for name, fmt, off in fields)
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        assert a1 <= b0, f"{an} overlaps {bn}"
    assert spans[-1][1] <= size
    for name, fmt, off in fields:
        assert off % min(8, np.dtype(fmt).base.itemsize) == 0, f"{name} misaligned"


def test_word_indices_agree_with_the_tables():
    hoffs = {n: o for n, _, o in layout.HEADER_FIELDS}
    assert layout.H_DIRTY * 4 == hoffs["dirty"] and layout.H_OPS * 8 == hoffs["ops"]
    assert layout.H_SEQ * 8 == hoffs["seq"] and layout.H_FREE_SLOT * 8 == hoffs["free_slot"]
    poffs = {n: o for n, _, o in layout.PIN_FIELDS}
    assert layout.P_SLOT * 4 == poffs["slot"] and layout.P_START * 8 == poffs["start"]


def test_slot_columns_are_packed_in_order_on_64_byte_boundaries():
    offs = layout.column_offsets(layout.SLOT_COLUMNS, 1000, 4096)
    names = [n for n, _ in layout.SLOT_COLUMNS]
    assert offs["state"] == 4096 and offs["pins"] == 4096 + 4032  # 4000 bytes, aligned to 64
    assert all(offs[a] < offs[b] for a, b in zip(names, names[1:]))
    assert all(o % 64 == 0 for o in offs.values())


def test_header_documents_the_layout():
    doc = layout.__doc__
    for region in ("header", "slots", "buckets", "block map", "pins", "victims", "disk index", "disk hash", "key map",
                   "key arena", "data"):
        assert region in doc


def test_geometry_regions_are_aligned_and_fill_the_segment():
    g = Geometry.compute(16 << 20, 4096, max_entries=1000)
    assert g.check(g.segment_size) is None
    assert g.data_off % 4096 == 0 and g.n_blocks == 4096 and g.n_slots == 1000
    assert g.n_buckets >= 2 * g.n_slots and g.n_buckets & (g.n_buckets - 1) == 0
    assert g.check(g.segment_size + 1) is not None


def test_geometry_with_a_disk_index():
    g = Geometry.compute(16 << 20, 4096, max_entries=1000, disk_entries=5000)
    assert g.check(g.segment_size) is None
    assert g.n_dslots == 5000 and g.n_dbuckets >= 10000 and g.n_dbuckets & (g.n_dbuckets - 1) == 0
    assert g.victims_off < g.dslots_off < g.dbuckets_off < g.keymap_off < g.keys_off < g.data_off
    plain = Geometry.compute(16 << 20, 4096, max_entries=1000)
    assert plain.n_dslots == 0 and plain.data_off < g.data_off


@pytest.mark.parametrize("block_size", [64, 4096, 65536, 4 << 20])
def test_values_start_on_block_and_page_boundaries(block_size):
    """The data region starts on a block boundary, and on a page boundary: every value does (from 4 KiB blocks up
    both at once, what O_DIRECT and pinned-memory DMA want)."""
    g = Geometry.compute(64 * block_size, block_size)
    assert g.check(g.segment_size) is None
    assert g.data_off % block_size == 0 and g.data_off % 4096 == 0


def test_blocks_for_a_value_are_exactly_its_size_in_blocks():
    assert [layout.blocks_for(n, 4096) for n in (0, 1, 4095, 4096, 4097, 8192)] == [0, 1, 1, 1, 2, 2]
    assert layout.key_cells(1) == 1 and layout.key_cells(layout.KEY_CELL) == 1 and layout.key_cells(33) == 2
