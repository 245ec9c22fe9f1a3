"""Reads of a pool whose slots another writer damaged (docs/reliability.md, "Trust model").

A process that can write a pool's segment can change what it returns, but a
read whose metadata is impossible is refused (SegmentCorrupt, exit 65) before
any repair, never answered with other entries' bytes or a crash; and with
`verify_reads` (`get --verify`) a slot that points at other bytes, or bytes
changed in place, is refused too (ValueCorrupt, exit 65).  The racing-writer
form of these is in test_fuzz.py.
"""

from __future__ import annotations

import pytest

from cortex_cache import CortexCacheError, KeyNotFound, Pool, SegmentCorrupt, ValueCorrupt
from cortex_cache.core import PURE_PYTHON_ENV
from tests.helpers import cli, make_value

SMALL, LARGE = make_value(1, 1, 3000), make_value(2, 1, 100_000)  # copied in the lock, and outside it


@pytest.fixture(params=["fast", "pure"])
def path(request, monkeypatch):
    if request.param == "pure":
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    else:
        monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
    return request.param


def _pool(make_pool):
    p = make_pool("1M", block_size="4K")
    p.put("a", SMALL)
    p.put("b", LARGE)
    p.put("c", make_value(3, 1, 3000))
    return p


def _slot(p: Pool, key: str) -> int:
    from xxhash import xxh3_64_intdigest

    return p.core.locked(p.core.find, key.encode(), xxh3_64_intdigest(key.encode()))


def _damage(p: Pool, key: str, field: str, value: int) -> None:
    """What another writer of the segment can do: change a slot field, without the lock."""
    p.core.columns[field][_slot(p, key)] = value


def _get_into(p: Pool, key: str, room: int):
    buf = bytearray(room)
    n = p.get_into(key, buf)
    return None if n is None else bytes(buf[:n])


def _get_many_into(p: Pool, key: str, room: int):
    buf = bytearray(room)
    n = p.get_many_into([key], [buf])[0]
    if isinstance(n, Exception):
        raise n
    return None if n is None else bytes(buf[:n])


def _view(p: Pool, key: str, room: int):
    with p.view(key) as mv:
        return bytes(mv)


def _view_many(p: Pool, key: str, room: int):
    views = p.view_many([key])
    try:
        if isinstance(views[0], Exception):
            raise views[0]
        return None if views[0] is None else bytes(views[0].memoryview)
    finally:
        p.release_many(views)


READS = {
    "get": lambda p, k, room: p.get(k),
    "peek": lambda p, k, room: p.peek(k),
    "get_into": _get_into,
    "get_many_into": _get_many_into,
    "view": _view,
    "view_many": _view_many,
}


def _every_read(p: Pool, key: str, room: int, again=None) -> dict:
    """Each read entry point once: what it answered (its value, None for a miss, or its error's class).
    `again()` runs after each (damage put back after a repair)."""
    out = {}
    for name, read in READS.items():
        try:
            r = read(p, key, room)
        except KeyNotFound:
            r = None
        except CortexCacheError as e:
            r = type(e)
        out[name] = r
        if again is not None:
            again()
    return out


@pytest.mark.parametrize("field, value", [("first_block", 2**64 - 1), ("first_block", 2**40),
                                          ("value_len", 1_000_000), ("n_blocks", 2**40)])
@pytest.mark.parametrize("key", ["a", "b"])
def test_impossible_metadata_is_refused_before_any_repair(make_pool, path, key, field, value):
    p = _pool(make_pool)

    def again():
        p.core.locked(lambda: None)  # the repair a refusal asked for (it drops the damaged entry)...
        p.put(key, SMALL if key == "a" else LARGE)  # ... and the entry, damaged again
        _damage(p, key, field, value)

    _damage(p, key, field, value)
    seen = _every_read(p, key, 200_000, again)
    assert all(r is SegmentCorrupt for r in seen.values()), seen


def test_the_cli_refuses_impossible_metadata_in_one_line(make_pool, path, pool_name):
    p = _pool(make_pool)
    for key, field, value in [("a", "first_block", 2**64 - 1), ("b", "value_len", 1_000_000)]:
        _damage(p, key, field, value)
        r = cli("cache", "get", p.name, key)
        err = r.stderr.decode()
        assert r.returncode == 65 and r.stdout == b"", (r.returncode, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("key", ["a", "b"])
def test_verified_reads_refuse_a_slot_pointing_at_another_entrys_bytes(make_pool, path, key):
    p = _pool(make_pool)
    other = p.core.columns["first_block"][_slot(p, "c")]
    if key == "b":  # the large value: point it at blocks that hold other bytes, as long a run
        other = p.core.columns["first_block"][_slot(p, "a")]
    _damage(p, key, "first_block", int(other))
    assert p.get(key) != (SMALL if key == "a" else LARGE)  # unverified: another entry's bytes (inherent)
    with Pool.open(p.name, verify_reads=True) as q:
        for name, r in _every_read(q, key, 200_000).items():
            assert r is ValueCorrupt, (name, r)
    r = cli("cache", "get", p.name, key, "--verify")
    err = r.stderr.decode()
    assert r.returncode == 65 and r.stdout == b"" and len(err.splitlines()) == 1, (r.returncode, err)
    assert cli("cache", "get", p.name, key, env={"CORTEX_CACHE_VERIFY_READS": "1"}).returncode == 65


def test_verified_reads_return_whole_values(make_pool, path):
    p = _pool(make_pool)
    with Pool.open(p.name, verify_reads=True) as q:
        seen = _every_read(q, "b", 200_000)
        assert all(v == LARGE for v in seen.values()), seen
        seen = _every_read(q, "a", 200_000)
        assert all(v == SMALL for v in seen.values()), seen


TRUNCATED_READER = r"""
import json, sys
from cortex_cache import CortexCacheError, Pool
from tests.helpers import make_value

p = Pool.open(sys.argv[1])
assert p.get("b") == make_value(2, 1, 100_000)
print("ready", flush=True)
sys.stdin.readline()  # the segment is truncated now
seen = {}
calls = {
    "get": lambda: p.get("b"), "get small": lambda: p.get("a"), "peek": lambda: p.peek("b"),
    "get_into": lambda: p.get_into("b", bytearray(200_000)),
    "get_many_into": lambda: p.get_many_into(["b"], [bytearray(200_000)]),
    "view": lambda: p.view("b"), "view_many": lambda: p.view_many(["b"]),
    "put": lambda: p.put("new", b"x" * 50_000), "stats": lambda: p.stats(), "len": lambda: len(p),
}
for name, call in calls.items():
    try:
        r = call()
        if isinstance(r, list) and isinstance(r[0], CortexCacheError):
            raise r[0]  # the batches answer each key's error in its place
        seen[name] = "answered: " + repr(r)[:60]
    except CortexCacheError as e:
        seen[name] = (type(e).__name__, e.exit_code)
p.close()
print(json.dumps(seen))
"""


def test_a_segment_truncated_under_a_reader_is_a_clean_error_not_a_sigbus(make_pool, path):
    """The owner (or a group member) truncates the segment while another process has it mapped."""
    import json
    import os
    import subprocess
    import sys

    from cortex_cache import segment
    from tests.helpers import REPO

    p = _pool(make_pool)
    reader = subprocess.Popen([sys.executable, "-c", TRUNCATED_READER, p.name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert reader.stdout.readline().strip() == "ready", reader.stderr.read()
        os.truncate(segment.shm_path(p.name), 8192)
        out, err = reader.communicate("go\n", timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, f"the reader died (status {reader.returncode}):\n{err[-2000:]}"
    seen = json.loads(out.splitlines()[-1])
    assert {k: v for k, v in seen.items() if v != ["SegmentCorrupt", 65]} == {}
