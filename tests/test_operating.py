"""Operating a pool as a service: boot and restart keep it whole.

A reboot is played by deleting the segment (what a reboot does to /dev/shm)
while the snapshot directory and the disk tier stay; every step runs the
CLI in a separate process, as a boot script would.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import xxhash

from cortex_cache import Pool
from cortex_cache import persist as snap
from cortex_cache.disklog import DiskLog

from .helpers import cli


def _json(r) -> dict:
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def _reboot(name: str) -> None:
    """What a reboot does to a pool: the segment is gone, files on disk stay."""
    Pool.unlink(name)


def test_restore_after_reboot_brings_back_the_whole_pool(pool_name, cleanup, tmp_path):
    cleanup.append(pool_name)
    disk = tmp_path / "tier"
    r = cli("cache", "create", pool_name, "--size", "256K", "--block-size", "4K", "--policy", "lfu",
            "--multi-threaded", "--disk-path", str(disk), "--disk-size", "4M",
            "--disk-write", "through", "--keep", "2", "--max-entries", "100")
    assert r.returncode == 0, r.stderr
    with Pool.open(pool_name) as p:
        for i in range(100):  # four times memory: most of it lives on disk only
            p.put(f"k{i}", bytes([i]) * 9000)
        before = p.configuration()
        on_disk = p.stats()["disk"]["entries"]
    assert on_disk >= 90
    assert cli("cache", "persist", pool_name).returncode == 0
    _reboot(pool_name)

    out = _json(cli("cache", "restore", pool_name, "--json"))
    assert "disk" in out["tiers"] and "found" in out["tiers"]["disk"]
    with Pool.open(pool_name) as p:
        assert p.configuration() == before
        # What checked out on disk was found again (keys restored into memory are served from there).
        assert p.stats()["disk"]["entries"] + len(p) >= on_disk
        assert all(p.get(f"k{i}") == bytes([i]) * 9000 for i in range(100))
    # Creating it again the way it was made is not an error any more, with --if-missing.
    r = cli("cache", "create", pool_name, "--size", "256K", "--block-size", "4K", "--policy", "lfu",
            "--multi-threaded", "--disk-path", str(disk), "--disk-write", "through",
            "--max-entries", "100", "--if-missing")
    assert r.returncode == 0, r.stderr
    assert b"nothing to do" in r.stdout


def test_restore_of_a_tier_that_is_gone_makes_it_anew(pool_name, cleanup, tmp_path):
    cleanup.append(pool_name)
    disk = tmp_path / "tier"
    with Pool.create(pool_name, "64K", block_size="4K", disk_path=disk, disk_size="1M") as p:
        p.put("a", b"x" * 100)
        p.persist()
    _reboot(pool_name)
    DiskLog.destroy(disk)
    out = _json(cli("cache", "restore", pool_name, "--json"))
    assert "made anew" in out["tiers"]["disk"]
    with Pool.open(pool_name) as p:
        assert p.get("a") == b"x" * 100 and p.disk_path == str(disk)


def test_a_copy_restored_beside_the_live_pool_leaves_its_disk_tier_alone(pool_name, cleanup, tmp_path):
    """Restoring a tiered pool's snapshot under another name while the pool lives: a copy in memory only."""
    copy = pool_name + "-copy"
    cleanup.extend([pool_name, copy])
    disk = tmp_path / "tier"
    with Pool.create(pool_name, "64K", block_size="4K", disk_path=disk, disk_size="1M") as p:
        for i in range(8):
            p.put(f"k{i}", bytes([i]) * 3000)
        snapshot = p.persist(tmp_path / "s.ccsnap")
        out = _json(cli("cache", "restore", copy, "--input", str(snapshot), "--json"))
        assert "not attached" in out["tiers"]["disk"] and out["entries"] == len(p)
        with Pool.open(copy) as q:
            assert q.disk_path is None
            assert all(q.get(k) == p.get(k) for k in p.keys())
        assert p.disk_path == str(disk) and p.stats()["disk"]["entries"] >= 0


def test_remote_tier_comes_back_with_restore_and_is_shown_redacted(pool_name, cleanup):
    pytest.importorskip("redis")
    cleanup.append(pool_name)
    url = "redis://:s3cret@127.0.0.1:1/3"  # nothing listens: restore must not need the server
    with Pool.create(pool_name, "64K", block_size="4K", remote=url) as p:
        p.persist()
    _reboot(pool_name)
    r = cli("cache", "restore", pool_name)
    assert r.returncode == 0, r.stderr
    assert b"remote tier: attached redis://***@127.0.0.1:1/3" in r.stdout and b"s3cret" not in r.stdout
    with Pool.open(pool_name) as p:
        assert p.configuration()["remote"] == {"url": url, "cluster": False}
    listing = cli("cache", "snapshots", pool_name, "--json")
    assert listing.returncode == 0 and b"s3cret" not in listing.stdout


def test_replace_of_a_tiered_pool_says_what_happens_to_its_tiers(pool_name, cleanup, tmp_path):
    cleanup.append(pool_name)
    with Pool.create(pool_name, "64K", block_size="4K", disk_path=tmp_path / "t", disk_size="1M") as p:
        p.put("old", b"o" * 100)
        path = p.persist(tmp_path / "s.ccsnap")
        p.put("new", b"n" * 100)
        p.evict(all=True)  # both now on disk only
        assert p.stats()["disk"]["entries"] == 2
    r = cli("cache", "restore", pool_name, "-i", str(path), "--replace")
    assert r.returncode == 0, r.stderr
    assert b"disk tier: emptied" in r.stdout
    with Pool.open(pool_name) as p:
        assert p.get("old") == b"o" * 100 and p.get("new") is None
        assert p.stats()["disk"]["entries"] == 0


def _as_version_1(path: Path) -> None:
    """Rewrite a snapshot as the version 1 format wrote it (no configuration block, no policy state)."""
    data = bytearray(path.read_bytes())
    (clen,) = struct.unpack_from("<I", data, 200)
    (slen,) = struct.unpack_from("<Q", data, 204)  # version 6's policy state, after the configuration block
    del data[320 : 320 + clen + slen]
    struct.pack_into("<I", data, 8, 1)
    struct.pack_into("<I", data, 200, 0)
    struct.pack_into("<Q", data, 204, 0)
    struct.pack_into("<Q", data, 312, xxhash.xxh3_64_intdigest(bytes(data[:312])))
    struct.pack_into("<Q", data, len(data) - 8, xxhash.xxh3_64_intdigest(bytes(data[: len(data) - 32])))
    path.write_bytes(bytes(data))


def test_a_version_1_snapshot_still_restores(pool_name, cleanup, tmp_path):
    cleanup.append(pool_name)
    with Pool.create(pool_name, "64K", block_size="4K", policy="fifo") as p:
        p.put("k", b"v" * 50)
        path = Path(p.persist(tmp_path / "old.ccsnap"))
    Pool.unlink(pool_name)
    _as_version_1(path)
    assert snap.Snapshot(path).header.version == 1
    r = cli("cache", "restore", pool_name, "-i", str(path))
    assert r.returncode == 0, r.stderr
    with Pool.open(pool_name) as p:
        assert p.get("k") == b"v" * 50 and p.policy == "fifo" and p.configuration()["disk"] is None


def test_create_if_missing(pool_name, cleanup):
    cleanup.append(pool_name)
    args = ["cache", "create", pool_name, "--size", "1M", "--block-size", "4K", "--if-missing"]
    first = _json(cli(*args, "--json"))
    assert first["existed"] is False
    again = _json(cli(*args, "--json"))
    # `created` is the pool's creation time in both, as in status --json; `existed` says which run made it.
    assert again["existed"] is True and again["created"] == first["created"] and isinstance(first["created"], float)
    with Pool.open(pool_name) as p:
        p.put("k", b"v")
    assert cli(*args).returncode == 0  # and nothing changed
    with Pool.open(pool_name) as p:
        assert p.get("k") == b"v"
    other = cli("cache", "create", pool_name, "--size", "2M", "--block-size", "4K", "--policy", "fifo", "--if-missing")
    assert other.returncode == 73
    err = other.stderr.decode()
    assert "size 1.0MiB (1048576 bytes) (asked 2.0MiB" in err and "policy auto (asked fifo)" in err
    assert len(err.strip().splitlines()) == 1


def test_create_if_missing_accepts_a_restored_pools_policy_unless_another_is_asked(pool_name, cleanup):
    """A boot script's `restore --if-missing || create --if-missing` without --policy: the pool restored from a
    snapshot keeps the policy it was made with (lru here, not the default), and create accepts it; only a
    --policy given, and different, is a mismatch."""
    cleanup.append(pool_name)
    with Pool.create(pool_name, "1M", block_size="4K", policy="lru") as p:
        p.put("k", b"v")
        p.persist()
    _reboot(pool_name)
    assert cli("cache", "restore", pool_name, "--if-missing").returncode == 0
    args = ["cache", "create", pool_name, "--size", "1M", "--block-size", "4K", "--if-missing"]
    assert _json(cli(*args, "--json"))["existed"] is True
    assert _json(cli(*args, "--policy", "LRU", "--json"))["existed"] is True
    other = cli(*args, "--policy", "auto")
    assert other.returncode == 73 and "policy lru (asked auto)" in other.stderr.decode()
    with Pool.open(pool_name) as p:
        assert p.policy == "lru" and p.get("k") == b"v"
    with Pool.create(pool_name, "1M", block_size="4K", exist_ok=True) as p:  # the library's rule is the same
        assert p.policy == "lru"


def test_a_new_pool_without_a_policy_gets_the_default(pool_name, cleanup):
    """`create` without --policy, Pool.create without one, and an engine adapter's `create` without "policy"
    all make a pool of DEFAULT_POLICY."""
    from cortex_cache.integrations.pools import open_or_create
    from cortex_cache.policy_names import DEFAULT_POLICY

    cleanup.append(pool_name)
    with Pool.create(pool_name, "1M", block_size="4K") as p:
        assert p.policy == DEFAULT_POLICY
    Pool.unlink(pool_name)
    assert _json(cli("cache", "create", pool_name, "--size", "1M", "--json"))["policy"] == DEFAULT_POLICY
    Pool.unlink(pool_name)
    with open_or_create(pool_name, {"create": True, "size": "1M"}) as p:
        assert p.policy == DEFAULT_POLICY != "lru"


def test_create_exist_ok_in_the_library(pool_name, cleanup):
    cleanup.append(pool_name)
    with Pool.create(pool_name, "1M", block_size="4K") as a, Pool.create(pool_name, "1M", block_size="4K", exist_ok=True) as b:
        a.put("k", b"v")
        assert b.get("k") == b"v"
    from cortex_cache.errors import PoolExists

    with pytest.raises(PoolExists, match="a disk tier none"):
        Pool.create(pool_name, "1M", block_size="4K", tier="disk", exist_ok=True)


def test_restore_if_missing(pool_name, cleanup):
    cleanup.append(pool_name)
    assert cli("cache", "restore", pool_name, "--if-missing").returncode == 66  # no pool, no snapshot
    with Pool.create(pool_name, "1M", block_size="4K") as p:
        p.put("k", b"v1")
        p.persist()
        p.put("k", b"v2")
    r = cli("cache", "restore", pool_name, "--if-missing")
    assert r.returncode == 0 and b"nothing restored" in r.stdout
    with Pool.open(pool_name) as p:
        assert p.get("k") == b"v2"  # left alone
    _reboot(pool_name)
    assert cli("cache", "restore", pool_name, "--if-missing").returncode == 0
    with Pool.open(pool_name) as p:
        assert p.get("k") == b"v1"
    assert cli("cache", "restore", pool_name, "--if-missing", "--replace").returncode == 2


def test_files_are_namespaced_by_the_prefix(pool_name, cleanup, tmp_path):
    """Two deployments (prefixes) with a pool of the same name never touch each other's snapshots."""
    other = {"CORTEX_CACHE_SHM_PREFIX": os.environ["CORTEX_CACHE_SHM_PREFIX"] + "other."}
    cleanup.append(pool_name)
    mine = cli("cache", "create", pool_name, "--size", "64K", "--block-size", "4K", "--tier", "disk", "--disk-size", "1M", "--json")
    theirs = cli("cache", "create", pool_name, "--size", "64K", "--block-size", "4K", "--tier", "disk", "--disk-size", "1M", "--json", env=other)
    try:
        assert _json(mine)["disk"]["path"] != _json(theirs)["disk"]["path"]
        for _ in range(3):
            assert cli("cache", "persist", pool_name, "--keep", "1", env=other).returncode == 0
        assert cli("cache", "persist", pool_name, "--keep", "2").returncode == 0
        assert cli("cache", "persist", pool_name).returncode == 0
        assert len(snap.snapshots_of(pool_name)) == 2
        names = sorted(p.name for p in snap.snapshot_dir().iterdir() if not p.name.startswith("."))
        theirs_files = [n for n in names if n.startswith(other["CORTEX_CACHE_SHM_PREFIX"])]
        assert len(theirs_files) == 2  # their latest link and one timestamped file: not rotated by ours
    finally:
        assert cli("cache", "delete", pool_name, "--force", env=other).returncode == 0


def test_retention_is_stored_with_the_pool(pool_name, cleanup):
    cleanup.append(pool_name)
    assert cli("cache", "create", pool_name, "--size", "64K", "--block-size", "4K", "--keep", "4").returncode == 0
    for _ in range(5):
        assert cli("cache", "persist", pool_name).returncode == 0
    assert len(snap.snapshots_of(pool_name)) == 4  # a plain persist (the cron job's) keeps what the pool keeps
    assert cli("cache", "persist", pool_name, "--keep", "2").returncode == 0
    assert len(snap.snapshots_of(pool_name)) == 2
    assert cli("cache", "persist", pool_name).returncode == 0
    assert len(snap.snapshots_of(pool_name)) == 2  # stored: later plain persists keep 2 too
    with Pool.open(pool_name) as p:
        assert p.snapshot_keep == 2
    for f in snap.snapshots_of(pool_name) + [snap.latest_path(pool_name)]:
        f.unlink()
