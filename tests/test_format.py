"""The segment format across versions: snapshots written by older releases restore."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from cortex_cache import Pool

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def snapshot_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CORTEX_CACHE_SNAPSHOT_DIR", str(tmp_path / "snapshots"))


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
