"""The fill by columns in C (fill_columns.py, _fastpath_fill.c) against fill.py's Python batches.

The two fills load the same snapshot into identical pools (every key, value, metadata field, counter, queue
and gone mark), restored by the CLI in processes of their own; and each rule of the Python batch holds in C,
called on a real pool: expired, gone by position or by hash, and present entries skipped; a value that fails
its checksum not loaded; no room ends the batch with nothing taken; a key put or deleted while the values
were written keeps its newer answer.  Kills of a C filler are in test_gone.py (`c-fill`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from cortex_cache import Pool, fill_columns
from cortex_cache import persist as snap
from cortex_cache.gone import GoneMarks
from cortex_cache.layout import FILL_DONE, FILL_RUNNING

from .helpers import cli, make_value

pytestmark = pytest.mark.skipif(os.environ.get("CORTEX_CACHE_PURE_PYTHON", "") not in ("", "0"),
                                reason="the C fast path is turned off")

COLUMNS = ("_c_state", "_c_next", "_c_khash", "_c_vlen", "_c_first", "_c_nblk", "_c_cks", "_c_created",
           "_c_lastacc", "_c_expiry", "_c_iseq", "_c_aseq", "_c_acount", "_c_prio", "_c_flags", "_c_lfuep",
           "_c_kcell", "_c_klen")
HEADER = ("seq", "puts", "ops", "n_entries", "used_blocks", "used_kcells", "lfu_epoch", "alloc_hint", "key_hint",
          "free_slot", "fill_done", "fill_bytes", "fill_skipped", "fill_corrupt", "fill_total")


def _dump(name: str) -> dict:
    """Everything a fill writes into pool `name`, read from the segment."""
    with Pool.open(name) as p:
        core, g = p.core, p.geometry
        h = core.header[0]
        assert p.stats()["fill"]["state"] == "done"
        regions = {"keys": (g.keys_off, g.n_kcells * 32), "blockmap": (g.blockmap_off, g.n_blocks),
                   "keymap": (g.keymap_off, g.n_kcells), "data": (g.data_off, g.data_size),
                   "gone": (g.gone_off, g.gone_len)}
        out = {
            "header": {f: int(h[f]) for f in HEADER},
            "columns": {c: getattr(core, c).tobytes() for c in COLUMNS},
            "regions": {r: xxhash.xxh3_64_hexdigest(core.mv[o : o + n]) for r, (o, n) in regions.items()},
            "gone": GoneMarks(core).count(),
            "queues": None if core.queues is None else (int(core.queues._qu64[0]), int(core.queues._qu64[1])),
            "values": {k: p.get(k) for k in sorted(p.keys(), key=str)},
        }
        return out


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo", "auto"])
def test_the_c_fill_and_the_python_fill_load_identical_pools(make_pool, snapshot_dir, policy):
    p = make_pool("8M", block_size=4096, policy=policy)
    for i in range(400):  # sizes from 0 to 3 blocks, str and bytes keys, TTLs, priorities, reads
        key = f"k{i}" if i % 3 else f"b{i}".encode()
        p.put(key, make_value(i, 0, (i * 97) % 9000), ttl=86400 if i % 5 == 0 else None, priority=i % 4)
    for i in range(0, 400, 7):
        p.get(f"k{i}" if i % 3 else f"b{i}".encode())
    p.delete("k1")
    snap.persist(p, full=True)
    name = p.name
    p.close()
    dumps = []
    for env in ({"CORTEX_CACHE_PURE_PYTHON": "1"}, {}):
        Pool.unlink(name)
        r = cli("cache", "restore", name, env=env)
        assert r.returncode == 0 and b"restored 399 entries" in r.stdout, (r.stdout, r.stderr)
        dumps.append(_dump(name))
    python, c = dumps
    assert len(c["values"]) == 399 and c["header"]["fill_done"] == 399
    for part in ("header", "regions", "gone", "queues", "values"):
        assert c[part] == python[part], part
    for col in COLUMNS:
        assert c["columns"][col] == python["columns"][col], col


# ---------------------------------------------------------------- each rule, in C, on a real pool


class Columns:
    """A batch's columns, made by hand: keys in one blob, values back to back in one buffer."""

    def __init__(self, keys: list[bytes], values: list[bytes], expiry: list[float] | None = None):
        n = len(keys)
        self.keys, self.values = keys, values
        self.blob = b"".join(keys)
        self.key_len = np.array([len(k) for k in keys], np.uint16)
        self.key_off = np.concatenate([[0], np.cumsum(self.key_len[:-1], dtype=np.uint64)]).astype(np.uint64)
        self.flags = np.zeros(n, np.uint8)
        self.length = np.array([len(v) for v in values], np.uint64)
        self.expiry = np.array(expiry or [0.0] * n, np.float64)
        self.buf = b"".join(values)
        self.src = np.concatenate([[0], np.cumsum(self.length[:-1])]).astype(np.uint64)
        self.checksum = np.array([xxhash.xxh3_64_intdigest(v) for v in values], np.uint64)
        self.kh = np.zeros(n, np.uint64)
        self.slot = np.full(n, -9, np.int64)
        self.off = np.zeros(n, np.uint64)

    def reserve(self, p: Pool, first_pos: int, now: float) -> int:
        return p.core.locked(p.core.fast.fill_reserve, self.blob, self.key_off, self.key_len, self.flags, self.length,
                             self.expiry, 0, first_pos, now, self.kh, self.slot, self.off)

    def copy(self, p: Pool, k: int) -> np.ndarray:
        ok = np.zeros(k, np.uint8)
        p.core.fast.fill_copy(self.buf, self.src[:k], self.length[:k], self.slot[:k], self.off[:k],
                              self.checksum[:k], ok)
        return ok

    def seal(self, p: Pool, k: int, ok: np.ndarray, first_pos: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.keys)
        sealed = np.zeros(k, np.uint8)
        counts = np.zeros(3, np.uint64)
        meta = (np.full(n, 2, np.int64), np.full(n, 1000.0), np.full(n, 2000.0), self.expiry,
                np.arange(1, n + 1, dtype=np.uint64), np.arange(5, n + 5, dtype=np.uint64), np.full(n, 3, np.uint64),
                self.checksum, sealed)
        meta = tuple(m[:k] for m in meta[:-1]) + (sealed,)
        got = p.core.locked(p.core.fast.fill_seal, self.blob, self.key_off[:k], self.key_len[:k], self.kh[:k],
                            self.slot[:k], ok, 0, k, first_pos, meta, counts)
        assert got == k
        return sealed, counts


def test_each_skip_rule_holds_in_c(make_pool):
    p = make_pool("4M", block_size=4096)
    if p.core.fast is None:
        pytest.skip("the C fast path is not built here")
    now = p.core.clock()
    keys = [b"expired", b"gone-pos", b"gone-hash", b"present", b"fine", b"bad-value", b"put-meanwhile",
            b"deleted-meanwhile"]
    values = [make_value(i, 0, 3000) for i in range(len(keys))]
    cols = Columns(keys, values, expiry=[now - 1] + [0.0] * (len(keys) - 1))
    cols.checksum[5] ^= 1  # the manifest says otherwise: a damaged value
    p.put("present", b"newer")
    p.put("deleted-meanwhile", b"x")
    first = 100
    marks = GoneMarks(p.core)
    p.core.locked(marks.mark, first + 1)
    p.core.locked(marks.mark_hash, xxhash.xxh3_64_intdigest(b"gone-hash"))
    p.delete("deleted-meanwhile")  # before the fill's reservation: not present, so reserved
    assert cols.reserve(p, first, now) == len(keys)
    assert cols.slot[:4].tolist() == [fill_columns.SKIP_EXPIRED, fill_columns.SKIP_PRESENT,
                                      fill_columns.SKIP_PRESENT, fill_columns.SKIP_PRESENT]
    assert (cols.slot[4:] >= 0).all() and p.stats()["writing_entries"] == 4
    assert cols.kh[4] == xxhash.xxh3_64_intdigest(b"fine")
    ok = cols.copy(p, len(keys))
    assert ok.tolist() == [0, 0, 0, 0, 1, 0, 1, 1]  # the damaged value is not written
    p.put("put-meanwhile", b"the newer value")  # while the fill wrote: the newer one stays
    # ... and a delete of it while the fill wrote, by a process that knows no positions: its hash mark
    p.core.locked(marks.mark_hash, xxhash.xxh3_64_intdigest(b"deleted-meanwhile"))
    sealed, counts = cols.seal(p, len(keys), ok, first)
    assert sealed.tolist() == [0, 0, 0, 0, 1, 0, 0, 0]
    assert counts.tolist() == [1, 3000, 2]  # loaded, bytes, skipped while written
    assert p.stats()["writing_entries"] == 0 and len(p) == 3
    info = p.info("fine")  # the snapshot's metadata
    assert (info["created"], info["last_access"], info["access_count"], info["priority"]) == (1000.0, 2000.0, 3, 2)
    assert p.get("fine") == values[4] and p.get("put-meanwhile") == b"the newer value"
    assert p.get("present") == b"newer" and p.get("deleted-meanwhile") is None and p.get("bad-value") is None
    assert all(marks.gone(first + j, 0) for j in range(len(keys)))  # every position processed is marked
    assert p.verify()["ok"]
    marks.close()


def test_no_room_ends_the_reservations_with_nothing_taken_and_nothing_evicted(make_pool):
    p = make_pool("1M", block_size=4096)
    if p.core.fast is None:
        pytest.skip("the C fast path is not built here")
    for i in range(40):
        p.put(f"old{i}", make_value(i, 0, 4096))
    before = p.stats()
    keys = [f"new{i}".encode() for i in range(400)]  # more than the free room
    cols = Columns(keys, [make_value(i, 1, 4096) for i in range(400)])
    stop = cols.reserve(p, 0, p.core.clock())
    assert 0 < stop < 400  # stopped at the first entry without room: the Python path raises PoolFull there
    st = p.stats()
    assert st["writing_entries"] == stop and st["entries"] == before["entries"] == 40  # nothing evicted
    p.core.locked(fill_columns._abort, p.core, cols.slot[:stop])
    assert p.stats()["writing_entries"] == 0 and p.stats()["blocks_used"] == before["blocks_used"]
    assert p.stats()["key_arena_used_bytes"] == before["key_arena_used_bytes"]
    assert p.verify()["ok"]


def test_a_generation_changed_between_the_holds_seals_nothing(make_pool, snapshot_dir):
    """A fill stopped by another process (evict --all) while its values were written: the seal hold gives
    every reservation back and the fill ends."""
    p = make_pool("4M", block_size=4096)
    for i in range(50):
        p.put(f"k{i}", make_value(i, 0, 2048))
    snap.persist(p, full=True)
    name = p.name
    p.close()
    Pool.unlink(name)
    q, report = snap.restore(None, name=name)
    q.close()
    assert report["entries"] == 50
    with Pool.open(name) as q:
        core = q.core
        h = core.header[0]
        gen = int(h["fill_gen"])
        cols = Columns([b"late"], [b"v" * 100])
        at = fill_columns.At(gen, 60, GoneMarks(core))  # a position past the snapshot's: not marked gone
        h["fill_state"] = FILL_RUNNING  # as if it still ran ...
        assert cols.reserve(q, 60, core.clock()) == 1 and q.stats()["writing_entries"] == 1
        h["fill_gen"] = gen + 1  # ... and someone stopped it meanwhile
        with pytest.raises(fill_columns.Ended):
            core.locked(fill_columns._seal, core, cols, cols.kh, cols.slot, np.ones(1, np.uint8), 1, at,
                        {"entries": 0}, 0)
        assert q.stats()["writing_entries"] == 0 and "late" not in q
        h["fill_state"] = FILL_DONE
        at.marks.close()
