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
    # ... and the queue policies' place (s3fifo, arc, auto: issue 27; zero in every other pool) and admission
    # to the lower tiers.
    ("qslots_off", "<u8", 968), ("n_ghosts0", "<u4", 976), ("n_ghosts1", "<u4", 980),
    ("tier_admit", "<u4", 984), ("tier_pad", "<u4", 988), ("tier_refused", "<u8", 992),
    # ... and where a background fill's gone marks lie (issue 39; 0 in older pools: their fills keep none).
    ("gone_off", "<u8", 1000),
    # ... and where the base positions of an incremental persist lie (0 in older pools: full manifests).
    ("base_off", "<u8", 1008),
    # ... and the prefix the pool was made under (0 in older pools: listed under any prefix, as before).
    ("prefix_mark", "<u8", 1016),
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
FROZEN_QSLOT_COLUMNS = [("queue", "<u1"), ("freq", "<u1"), ("qseq", "<u8")]
# The queue region's own header (offsets from qslots_off), 256 bytes.
FROZEN_QUEUE_HEADER = [
    ("q_count0", "<u8", 0), ("q_count1", "<u8", 8), ("q_target", "<f8", 16), ("q_seq", "<u8", 24),
    ("g0_head", "<u8", 32), ("g0_tail", "<u8", 40), ("g0_live", "<u8", 48), ("g1_head", "<u8", 56),
    ("g1_tail", "<u8", 64), ("g1_live", "<u8", 72), ("cand1_valid", "<u4", 80), ("cand1_count", "<u4", 84),
    ("cand1_pos", "<u4", 88), ("cand1_pad", "<u4", 92), ("cand1_next_expiry", "<f8", 96),
    ("cand1_max_primary", "<f8", 104), ("cand1_max_secondary", "<u8", 112), ("cand1_epoch", "<u8", 120),
    # auto's regime, carved from the reserved zeros (zero is its state at create: no version bump).
    ("q_regime", "<u4", 128), ("q_pad", "<u4", 132), ("q_ghost_rate", "<f8", 136), ("q_hit_rate", "<f8", 144),
    ("q_hits_seen", "<u8", 152),
]
FROZEN_GHOST_COLUMNS = [("hash", "<u8"), ("next", "<i4")]


def test_layout_matches_frozen_format():
    assert layout.FORMAT_VERSION == FROZEN_VERSION
    assert layout.MAGIC == b"CORTEXKV"
    assert layout.HEADER_FIELDS == FROZEN_HEADER
    assert layout.SLOT_COLUMNS == FROZEN_SLOT_COLUMNS
    assert layout.VICTIM_COLUMNS == FROZEN_VICTIM_COLUMNS
    assert layout.PIN_FIELDS == FROZEN_PIN
    assert layout.DSLOT_COLUMNS == FROZEN_DSLOT_COLUMNS
    assert layout.QSLOT_COLUMNS == FROZEN_QSLOT_COLUMNS and layout.GHOST_COLUMNS == FROZEN_GHOST_COLUMNS
    assert layout.QUEUE_HEADER_FIELDS == FROZEN_QUEUE_HEADER and layout.QUEUE_HEADER_SIZE == 256
    assert (layout.HEADER_SIZE, layout.SLOT_BYTES, layout.PIN_SIZE, layout.CANDIDATES) == (4096, 144, 16, 4096)
    assert layout.DSLOT_BYTES == 96


@pytest.mark.parametrize("fields,size", [(layout.HEADER_FIELDS, 4096), (layout.PIN_FIELDS, 16),
                                         (layout.QUEUE_HEADER_FIELDS, 256)])
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


def test_geometry_with_a_queue_region():
    """Only a queue policy's pool carries the queue region (its header, queue columns and two ghost rings),
    between the key arena and the data; a pool of another policy is laid out exactly as before."""
    plain = Geometry.compute(16 << 20, 4096, max_entries=1000)
    g = Geometry.compute(16 << 20, 4096, max_entries=1000, ghosts=(3, 1))
    assert g.check(g.segment_size) is None
    assert (plain.qslots_off, plain.n_ghosts0, plain.n_ghosts1) == (0, 0, 0)
    assert plain.keys_off == g.keys_off and plain.data_off < g.data_off
    assert g.keys_off < g.qslots_off < g.qcols_off < g.ghosts0_off < g.ghosts1_off < g.data_off
    assert g.qcols_off == g.qslots_off + 4096 and g.qslots_off % 4096 == 0
    assert g.qslot_columns()["queue"] == g.qcols_off
    assert (g.n_ghosts0, g.n_ghosts1) == (3000, 1000)
    big = Geometry.compute(1 << 30, 4096, max_entries=100_000, ghosts=(3, 1))
    per_slot = (big.data_off - big.qslots_off) / big.n_slots
    assert 60 < per_slot < 100  # 10 of queue columns, 4 x 12 of ring places, their buckets
    s3 = Geometry.compute(16 << 20, 4096, max_entries=1000, ghosts=(1, 0))
    assert s3.check(s3.segment_size) is None and s3.n_ghosts1 == 0
    # A header that claims ghost rings without the region, or rings larger than 8 places a slot, is refused.
    from dataclasses import replace

    assert replace(plain, n_ghosts0=10).check(plain.segment_size) is not None
    assert replace(g, n_ghosts0=9000 * 1000).check(g.segment_size) is not None


def test_the_ghost_rings_places_come_from_the_header_alone():
    """The rings' offsets are derived, not stored: from_header of what initialise wrote gives back the same
    geometry, and a damaged qslots_off or ring size is refused by check (never an exception)."""
    from dataclasses import replace

    g = Geometry.compute(16 << 20, 4096, max_entries=1000, ghosts=(3, 1))
    hdr = np.zeros(1, layout.HEADER_DTYPE)
    for f in ("segment_size", "block_size", "n_blocks", "n_slots", "n_buckets", "n_pins", "slots_off", "buckets_off",
              "blockmap_off", "pins_off", "victims_off", "data_off", "n_dslots", "n_dbuckets", "dslots_off",
              "dbuckets_off", "n_kcells", "keymap_off", "keys_off", "qslots_off", "n_ghosts0", "n_ghosts1",
              "gone_off", "base_off"):
        hdr[0][f] = getattr(g, f)
    back = Geometry.from_header(hdr)
    assert back == g and (back.ghosts0_off, back.ghosts1_off) == (g.ghosts0_off, g.ghosts1_off)
    for bad in (dict(qslots_off=g.qslots_off + 8), dict(qslots_off=g.keys_off), dict(qslots_off=g.data_off),
                dict(qslots_off=1 << 62), dict(n_ghosts0=g.n_ghosts0 + 1), dict(n_ghosts1=2**32 - 1),
                dict(n_ghosts0=0, n_ghosts1=0)):
        assert replace(g, **bad).check(g.segment_size) is not None, bad


def test_queue_fields_and_the_second_victim_list_are_laid_out_as_the_first():
    hoffs = {n: o for n, _, o in layout.HEADER_FIELDS}
    qoffs = {n: o for n, _, o in layout.QUEUE_HEADER_FIELDS}
    first, second = hoffs["cand_valid"], qoffs["cand1_valid"]
    for f in ("count", "pos", "pad", "next_expiry", "max_primary", "max_secondary", "epoch"):
        assert qoffs[f"cand1_{f}"] - second == hoffs[f"cand_{f}"] - first, f
    assert layout.Q_COUNT1 == layout.Q_COUNT0 + 1  # the fast path reads them as a pair
    assert layout.VICTIM_LIST_WORDS[1][0] * 4 == second and layout.Q_TARGET * 8 == qoffs["q_target"]
    assert max(o for n, _, o in layout.HEADER_FIELDS if n != "disk_path" and n != "remote_url") < 1024
    # Nothing of the queues' moved into the fill's fields (680..963), which landed first.
    fill = [(n, o) for n, _, o in layout.HEADER_FIELDS if 680 <= o < 964]
    assert all(n.startswith("fill_") for n, _ in fill)
