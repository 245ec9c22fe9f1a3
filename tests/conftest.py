"""Shared fixtures: a private shm prefix per test session, and leak checks.

Every test runs under its own CORTEX_CACHE_SHM_PREFIX (inherited by the
processes it spawns), and fails if it leaves a segment behind.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

PREFIX = f"cctest-{os.getpid()}-{secrets.token_hex(3)}."
os.environ["CORTEX_CACHE_SHM_PREFIX"] = PREFIX
# Snapshots of tests never land in the user's (or root's) real snapshot directory.
# Its parent is private too: default disk tiers go next to it (STATE_DIR/disk/NAME).
STATE_DIR = tempfile.mkdtemp(prefix="cctest-state-")
atexit.register(shutil.rmtree, STATE_DIR, ignore_errors=True)  # also when pytest stops before the session starts
SNAPSHOT_DIR = os.path.join(STATE_DIR, "snapshots")
os.environ["CORTEX_CACHE_SNAPSHOT_DIR"] = SNAPSHOT_DIR
os.environ.pop("CORTEX_CACHE_DEBUG", None)

SHM = Path("/dev/shm")


def our_segments() -> list[Path]:
    return sorted(p for p in SHM.iterdir() if p.name.startswith(PREFIX))


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail any test that leaves a segment under our prefix (and remove it)."""
    before = set(our_segments())
    yield
    leaked = [p for p in our_segments() if p not in before]
    for p in leaked:
        p.unlink(missing_ok=True)
    assert not leaked, f"test leaked shared-memory segments: {[p.name for p in leaked]}"


# The files refereed by engines (their `-m engine` tests start engine processes for minutes, in one
# worker under `-n 2 --dist loadfile`) run first, so that the other worker takes the shorter files
# meanwhile instead of the slowest file being the run's tail.
ENGINE_FILES = ("test_vllm.py", "test_sglang.py", "test_lmcache.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in ENGINE_FILES)  # stable: the order within stays


_counter = 0


@pytest.fixture
def pool_name() -> str:
    """A fresh pool name (unique within the session)."""
    global _counter
    _counter += 1
    return f"p{_counter}"


@pytest.fixture
def make_pool(pool_name):
    """Factory: create pools that are closed and unlinked after the test."""
    from cortex_cache import Pool

    made: list[tuple[str, Pool]] = []

    def factory(size="4M", name: str | None = None, **kw) -> Pool:
        n = name or f"{pool_name}-{len(made)}"
        p = Pool.create(n, size, **kw)
        made.append((n, p))
        return p

    yield factory
    from cortex_cache.disklog import DiskLog

    for n, p in made:
        tier = p.disk_path
        p.close()
        if Pool.exists(n):
            Pool.unlink(n)
        if tier:
            DiskLog.destroy(tier)


@pytest.fixture
def cleanup():
    """Pool names a test makes through the CLI or another process: each still there afterwards is removed,
    with its disk tier."""
    from cortex_cache import Pool
    from cortex_cache.disklog import DiskLog

    names: list[str] = []
    try:
        yield names
    finally:
        for n in names:
            if Pool.exists(n):
                try:
                    with Pool.open(n) as p:
                        tier = p.disk_path
                except Exception:
                    tier = None
                Pool.unlink(n)
                if tier:
                    DiskLog.destroy(tier)


@pytest.fixture
def snapshot_dir(tmp_path, monkeypatch):
    """A snapshot directory of the test's own (CORTEX_CACHE_SNAPSHOT_DIR, inherited by what it starts)."""
    d = tmp_path / "snapshots"
    monkeypatch.setenv("CORTEX_CACHE_SNAPSHOT_DIR", str(d))
    return d


@pytest.fixture
def restored():
    """Pools made by restore in a test: closed and unlinked afterwards."""
    from cortex_cache import Pool

    made = []
    yield made
    for p in made:
        name = p.name
        p.close()
        if Pool.exists(name):
            Pool.unlink(name)


@pytest.fixture(scope="session", autouse=True)
def _remove_snapshot_dir():
    yield
    shutil.rmtree(STATE_DIR, ignore_errors=True)
