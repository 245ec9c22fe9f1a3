"""The segment format across versions: snapshots written by older releases restore."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from cortex_cache import IncompatibleVersion, Pool, segment
from tests.helpers import cli

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def _own_snapshot_dir(snapshot_dir):
    """Every test here persists into a directory of its own (conftest's snapshot_dir)."""
    return snapshot_dir


def test_snapshot_of_format_2_restores(tmp_path, pool_name):
    """format2-pool.ccsnap was written by the release whose segments had format version 2
    (keys stored after their values in the data blocks); it must restore into today's format."""
    snap = tmp_path / "old.ccsnap"
    shutil.copyfile(FIXTURES / "format2-pool.ccsnap", snap)
    snap.chmod(0o600)
    p = Pool.restore(snap, name=pool_name)
    try:
        assert sorted(p.keys(), key=repr) == sorted(["str-key", b"bytes-key\x00\xff", "empty", "big", "with-ttl"],
                                                      key=repr)
        assert p.get("str-key") == b"hello, format 2"
        assert p.get(b"bytes-key\x00\xff") == bytes(range(256)) * 16
        assert p.get("empty") == b""
        big = (np.arange(50_000, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8).tobytes()
        assert p.get("big") == big
        assert p.info("big")["priority"] == 7
        assert p.get("with-ttl") == b"x" * 5000 and p.info("with-ttl")["expires"] is not None
        assert p.stats()["block_size"] == 4096 and p.policy == "lru"
        assert p.verify()["ok"]
    finally:
        p.close()
        Pool.unlink(pool_name)


# ---------------------------------------------------------------- values fill exactly their blocks


@pytest.mark.parametrize("block,value,pool_size", [(64 << 10, 64 << 10, 64 << 20), (4096, 4096, 1 << 20),
                                                   (4096, 1 << 20, 8 << 20)])
def test_a_pool_holds_size_over_value_entries(make_pool, block, value, pool_size):
    """A value of N blocks occupies exactly N: a 64 MiB pool of 64 KiB blocks holds 1,024 values of 64 KiB."""
    p = make_pool(pool_size, block_size=block, reserve=False)
    v = bytes(range(256)) * (value // 256)
    n = pool_size // value
    for i in range(n):
        p.put(f"kv/model/{i:08x}", v)
    st = p.stats()
    assert st["evictions"] == 0 and st["entries"] == n == len(p)
    assert st["used_bytes"] == pool_size and st["value_bytes"] == pool_size and st["fill_ratio"] == 1.0
    assert st["largest_free_bytes"] == 0
    assert p.get(f"kv/model/{n - 1:08x}") == v
    p.put("one-more", v)  # now something must go
    assert p.stats()["evictions"] == 1


def test_status_shows_waste_of_a_block_size_too_large(make_pool):
    p = make_pool("1M", block_size="64K")
    for i in range(4):
        p.put(f"k{i}", bytes(4096))
    st = p.stats()
    assert st["used_bytes"] == 4 * 65536 and st["value_bytes"] == 4 * 4096
    assert st["fill_ratio"] == pytest.approx(1 / 16)
    assert st["largest_free_bytes"] == (1 << 20) - 4 * 65536
    p.put("empty", b"")  # an empty value takes no block at all
    assert p.stats()["used_bytes"] == 4 * 65536 and p.get("empty") == b"" and p.info("empty")["blocks"] == 0


@pytest.mark.parametrize("block", ["4K", "64K"])
def test_every_value_starts_page_and_block_aligned(make_pool, block):
    p = make_pool("4M", block_size=block)
    for n in (1, 100, 5000, 70_000):
        with p.reserve_write(f"v{n}", n) as mv:
            mv[:] = b"x" * n
        w = p.reserve_write(f"w{n}", n)
        assert w.offset % 4096 == 0 and w.offset % p.geometry.block_size == 0
        w.abort()


def test_keys_are_evicted_for_room_in_the_key_arena(make_pool):
    """Keys live in their own arena; when it is full of long keys, entries are evicted for key room."""
    p = make_pool("1M", block_size="4K", max_entries=4, policy="fifo")  # the arena's floor: 8 KiB of keys
    long = [("k%d-" % i).encode() + b"x" * 3990 for i in range(3)]
    p.put(long[0], b"a")
    p.put(long[1], b"b")
    assert p.stats()["evictions"] == 0
    p.put(long[2], b"c")
    assert p.stats()["evictions"] == 1 and long[0] not in p and p.get(long[2]) == b"c"
    assert p.verify()["ok"]


def test_repair_rebuilds_a_damaged_key_map(make_pool):
    p = make_pool("1M", block_size="4K")
    for i in range(20):
        p.put(f"key-{i}", bytes([i]) * 100)
    g = p.geometry
    with open(f"/dev/shm/{segment.prefix()}{p.name}", "r+b") as f:
        f.seek(g.keymap_off)
        f.write(bytes(64))  # the cells of the first keys look free now
    r = p.verify()
    assert not r["ok"] and any("key map" in why for why in r["problems"])
    assert p.verify(repair=True)["repaired"]
    assert p.verify()["ok"]
    for i in range(20):
        assert p.get(f"key-{i}") == bytes([i]) * 100
    p.put("another", b"z" * 100)  # the repaired map does not hand out a live key's cells
    assert all(p.get(f"key-{i}") == bytes([i]) * 100 for i in range(20))


# ---------------------------------------------------------------- an old segment is refused, with what to do


def _set_version(name: str, version: int) -> None:
    with open(f"/dev/shm/{segment.prefix()}{name}", "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", version))


def test_a_pool_of_the_old_format_is_refused_with_what_to_do(make_pool, pool_name):
    p = make_pool("1M", name=pool_name, block_size="4K")
    p.close()
    _set_version(pool_name, 2)
    with pytest.raises(IncompatibleVersion) as e:
        Pool.open(pool_name)
    msg = str(e.value)
    assert "version 2" in msg and "persist" in msg and "restore" in msg
    r = cli("cache", "status", pool_name)
    assert r.returncode == 65 and r.stdout == b"" and len(r.stderr.decode().strip().splitlines()) == 1, r
    assert b"persist" in r.stderr and b"Traceback" not in r.stderr
