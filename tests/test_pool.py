"""The pool contract: run once per policy, with and without multi-threaded mode, with and without a disk tier.

(The test across processes runs a variant of each kind by default, and every variant with `-m long`.)
"""

from __future__ import annotations

import itertools
import os
import stat

import numpy as np
import pytest
from xxhash import xxh3_64_intdigest

import cortex_cache
from cortex_cache import (
    BufferTooSmall,
    InvalidName,
    InvalidSize,
    KeyNotFound,
    Pool,
    PoolClosed,
    PoolExists,
    PoolFull,
    PoolNotFound,
    UsageError,
    ValueTooLarge,
)
from cortex_cache.core import PURE_PYTHON_ENV
from cortex_cache.eviction import POLICY_IDS
from cortex_cache.layout import MAX_KEY_BYTES
from cortex_cache.segment import shm_path, wait_unmapped


# Every policy, single- and multi-threaded, without a disk tier and with one (write-back; and
# write-through for one of the modes, to keep the count sane), through the C fast path; and the
# pure-Python path (CORTEX_CACHE_PURE_PYTHON=1) for every policy, and with a disk tier and threads.
CONTRACT_VARIANTS = [(p, mt, None, False) for p in POLICY_IDS for mt in (False, True)] + [
    (p, mt, "back", False) for p in POLICY_IDS for mt in (False, True)] + [
    (p, mt, "through", False) for p, mt in zip(POLICY_IDS, itertools.cycle((False, True)))] + [
    (p, False, None, True) for p in POLICY_IDS] + [("lfu", True, "back", True)]


def _variant_id(v) -> str:
    return f"{v[0]}-{'mt' if v[1] else 'st'}" + (f"-disk-{v[2]}" if v[2] else "") + ("-pure" if v[3] else "")


@pytest.fixture(params=CONTRACT_VARIANTS, ids=_variant_id)
def pool(request, make_pool, tmp_path, monkeypatch):
    policy, mt, disk, pure = request.param
    if pure:
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")  # inherited by the processes a test starts
    tier = dict(disk_path=tmp_path / "tier", disk_size="4M", disk_write=disk) if disk else {}
    p = make_pool("1M", block_size="4K", policy=policy, multi_threaded=mt, **tier)
    assert (p.stats().get("disk") or {}).get("write") == disk
    assert (p.core.fast is None) == pure
    return p


# ---------------------------------------------------------------- contract (every policy, both modes)


def test_put_get_roundtrip_of_every_value_kind(pool):
    import torch

    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    t = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    pool.put("bytes", b"\x00\xffhello")
    pool.put("bytearray", bytearray(b"ba"))
    pool.put("memoryview", memoryview(b"mv-data")[3:])
    pool.put("numpy", arr)
    pool.put("torch", t)
    pool.put("empty", b"")
    assert pool.get("bytes") == b"\x00\xffhello"
    assert pool.get("bytearray") == b"ba"
    assert pool.get("memoryview") == b"data"
    assert np.array_equal(np.frombuffer(pool.get("numpy"), dtype=np.float32).reshape(10, 100), arr)
    back = torch.frombuffer(bytearray(pool.get("torch")), dtype=torch.bfloat16).reshape(8, 8)
    assert torch.equal(back, t)
    assert pool.get("empty") == b""
    assert len(pool) == 6


def test_replace_delete_contains_len(pool):
    assert pool.get("k") is None and pool.get("k", b"dflt") == b"dflt"
    pool.put("k", b"one")
    pool.put("k", b"two-two")
    assert pool.get("k") == b"two-two"
    assert "k" in pool and "nope" not in pool and 42 not in pool
    assert len(pool) == 1
    assert pool.delete("k") is True
    assert pool.delete("k") is False
    assert "k" not in pool and len(pool) == 0
    assert pool.stats()["blocks_used"] == 0


def test_twice_the_pool_put_through_it(pool):
    """More than fits: with a disk tier nothing is lost, without one evictions only; never other bytes."""
    from tests.helpers import check_value, make_value

    n = 48  # 48 x 40 KB ~ 1.9x the 1 MiB pool; the 4 MiB disk tier holds them all
    for i in range(n):
        pool.put(f"v{i}", make_value(i, 0, 40_000))
    tier = pool.stats().get("disk")
    assert pool.stats()["evictions"] > 0
    found = [i for i in range(n) if (v := pool.get(f"v{i}")) is not None and check_value(v) == (i, 0)]
    if tier is None:
        assert 0 < len(found) < n
    else:
        assert found == list(range(n))  # misses in memory came back from disk
    gone = found[0]
    assert pool.delete(f"v{gone}") is True
    pool.evict(all=True)  # with a tier: the rest move to disk
    assert pool.get(f"v{gone}") is None and f"v{gone}" not in pool  # deleted from every tier
    assert len(pool) == 0
    if tier is not None:
        assert pool.get(f"v{found[-1]}") is not None and f"v{found[-1]}" in pool


def test_str_and_bytes_keys(pool):
    pool.put("é-key", b"s")
    pool.put(b"\x00\xfe", b"b")
    assert pool.get("é-key") == b"s"
    assert pool.get("é-key".encode()) == b"s"  # str keys are their UTF-8 bytes
    assert sorted(pool.keys(), key=repr) == sorted(["é-key", b"\x00\xfe"], key=repr)


def test_long_keys(pool):
    long_key = "k" * MAX_KEY_BYTES
    pool.put(long_key, b"v")
    pool.put("x" * 250, b"w")
    assert pool.get(long_key) == b"v" and pool.get("x" * 250) == b"w"
    with pytest.raises(UsageError):
        pool.put("k" * (MAX_KEY_BYTES + 1), b"v")
    with pytest.raises(UsageError):
        pool.put("", b"v")
    with pytest.raises(UsageError):
        pool.put(123, b"v")  # type: ignore[arg-type]


def test_multi_block_values_and_large_values_outside_the_lock(pool):
    big = os.urandom(300 * 1024)  # > COPY_IN_LOCK: copied outside the lock, pinned on read
    pool.put("big", big)
    pool.put("mid", os.urandom(9000))
    assert pool.get("big") == big
    out = bytearray(len(big) + 10)
    assert pool.get_into("big", out) == len(big)
    assert out[: len(big)] == big
    info = pool.info("big")
    assert info["size"] == len(big) and info["blocks"] == -(-len(big) // 4096)  # exactly the value's blocks: the key is elsewhere
    assert pool.verify()["ok"]


def test_get_into(pool):
    pool.put("k", b"abcdef")
    buf = bytearray(10)
    assert pool.get_into("k", buf) == 6 and buf[:6] == b"abcdef"
    arr = np.zeros(8, dtype=np.uint8)
    assert pool.get_into("k", arr) == 6 and arr[:6].tobytes() == b"abcdef"
    assert pool.get_into("missing", buf) is None
    with pytest.raises(BufferTooSmall):
        pool.get_into("k", bytearray(3))
    with pytest.raises(UsageError):
        pool.get_into("k", b"readonly-bytes-buffer")


def test_view_is_zero_copy_read_only_and_pins(pool):
    pool.put("k", b"zero-copy")
    with pool.view("k") as mv:
        assert bytes(mv) == b"zero-copy"
        assert mv.readonly
        assert pool.info("k")["pins"] == 1
        pool.delete("k")  # the view keeps the bytes alive until released
        assert bytes(mv) == b"zero-copy"
        assert pool.stats()["blocks_used"] == 1
    assert pool.stats()["blocks_used"] == 0
    with pytest.raises(KeyNotFound):
        pool.view("k")


def test_keys_prefix_limit_and_info(pool):
    for i in range(5):
        pool.put(f"user1/{i}", b"x" * i, priority=i)
    pool.put("user2/0", b"y")
    assert pool.keys(prefix="user1/") == [f"user1/{i}" for i in range(5)]
    assert pool.keys(limit=2) == ["user1/0", "user1/1"]
    info = pool.info("user1/3")
    assert info["size"] == 3 and info["priority"] == 3 and info["expires"] is None
    with pytest.raises(KeyNotFound):
        pool.info("nope")


def test_stats_fields(pool):
    pool.put("a", b"12345")
    pool.get("a")
    pool.get("b")
    st = pool.stats()
    assert st["entries"] == 1 and st["value_bytes"] == 5 and st["hits"] == 1 and st["misses"] == 1
    assert st["size_bytes"] == 1 << 20 and st["block_size"] == 4096 and st["blocks_total"] == 256
    assert st["policy"] == pool.policy and st["mode"] == "0600"
    assert st["puts"] == 1 and st["hit_ratio"] == 0.5


def test_value_too_large_and_exact_fit(pool):
    with pytest.raises(ValueTooLarge):
        pool.put("huge", bytes((1 << 20) + 1))
    whole = bytes((1 << 20) - 1)  # with a 1-byte key it fills every block
    pool.put("w", whole)
    assert pool.get("w") == whole


def test_full_pool_with_everything_pinned_raises_pool_full(pool):
    views = []
    for i in range(256):
        pool.put(f"k{i}", bytes(100))
        views.append(pool.view(f"k{i}"))
    with pytest.raises(PoolFull):
        pool.put("one-more", bytes(100))
    for v in views:
        v.release()
    pool.put("one-more", bytes(100))  # now something can be evicted
    assert pool.get("one-more") == bytes(100)
    assert pool.verify()["ok"]


def test_two_handles_in_one_process_share_the_pool(pool):
    other = Pool.open(pool.name)
    try:
        pool.put("k", b"v1")
        assert other.get("k") == b"v1"
        other.delete("k")
        assert pool.get("k") is None
    finally:
        other.close()


# ---------------------------------------------------------------- lifecycle


def test_lifecycle_close_unlink_repr(make_pool, pool_name):
    p = Pool.create(pool_name, "64K", block_size="4K")
    try:
        assert repr(p) == f"Pool('{pool_name}', size=64.0KiB, entries=0)"
        with Pool.open(pool_name) as q:
            q.put("k", b"v")
        assert repr(p).endswith("entries=1)")
    finally:
        p.close()
        p.close()  # twice is fine
    assert "closed" in repr(p)
    with pytest.raises(PoolClosed):
        p.get("k")
    Pool.unlink(pool_name)
    with pytest.raises(PoolNotFound):
        Pool.unlink(pool_name)
    with pytest.raises(PoolNotFound):
        Pool.open(pool_name)


def test_create_refuses_existing_and_bad_arguments(make_pool, pool_name):
    make_pool("64K", name=pool_name, block_size="4K")
    with pytest.raises(PoolExists):
        Pool.create(pool_name, "64K")
    for bad in ["", "a/b", "../x", "-x", ".x", "x" * 65, "sp ace", "é"]:
        with pytest.raises(InvalidName):
            Pool.create(bad, "64K")
    for bad_size in [0, -1, "0", "abc", "1.2.3G", "5Q", "-5M"]:
        with pytest.raises(InvalidSize):
            Pool.create("ok-name", bad_size)
    with pytest.raises(InvalidSize):
        Pool.create("ok-name", "64K", block_size="3000")
    with pytest.raises(UsageError):
        Pool.create("ok-name", "64K", policy="random")
    with pytest.raises(UsageError):
        Pool.create("ok-name", "64K", mode=0o400)
    assert not Pool.exists("ok-name")


def test_segment_mode_and_reservation(make_pool, pool_name):
    p = make_pool("8M", name=pool_name)
    st = os.stat(shm_path(pool_name))
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_blocks * 512 >= 8 << 20  # posix_fallocate made the memory real
    g = make_pool("8M", name=pool_name + "-g", mode=0o660)
    assert stat.S_IMODE(os.stat(shm_path(g.name)).st_mode) == 0o660
    sparse = make_pool("8M", name=pool_name + "-s", reserve=False)
    assert os.stat(shm_path(sparse.name)).st_blocks * 512 < 1 << 20
    sparse.put("k", b"v")
    assert sparse.get("k") == b"v" and sparse.stats()["reserved"] is False
    assert p.stats()["reserved"] is True


def test_create_larger_than_free_shm_is_a_clean_error(pool_name):
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(cortex_cache.NoSpace):
        Pool.create(pool_name, free + (1 << 30))
    assert not Pool.exists(pool_name)


def test_fallocate_enospc_is_a_clean_error_and_cleans_up(monkeypatch, pool_name):
    import errno

    def enospc(fd, off, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)  # the one fault we cannot cause for real
    with pytest.raises(cortex_cache.NoSpace):
        Pool.create(pool_name, "1M")
    assert not Pool.exists(pool_name)


def test_foreign_or_damaged_segments_are_refused(make_pool, pool_name):
    from cortex_cache import IncompatibleVersion, SegmentCorrupt

    path = shm_path(pool_name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"not a pool at all" * 1000)
        with pytest.raises(SegmentCorrupt):
            Pool.open(pool_name)
        os.ftruncate(fd, 0)  # a creator that died before writing anything
        with pytest.raises(SegmentCorrupt):
            Pool.open(pool_name)
    finally:
        os.close(fd)
        os.unlink(path)
    p = make_pool("64K", name=pool_name, block_size="4K")
    p.close()
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(4, "little"))  # format version 99
    with pytest.raises(IncompatibleVersion):
        Pool.open(pool_name)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((1).to_bytes(4, "little"))
        f.seek(32)
        f.write((10**12).to_bytes(8, "little"))  # n_blocks that cannot fit the file
    with pytest.raises(SegmentCorrupt):
        Pool.open(pool_name)


def test_list_shows_our_pools(make_pool, pool_name):
    make_pool("64K", name=pool_name + "a", block_size="4K")
    make_pool("64K", name=pool_name + "b", block_size="4K")
    assert {pool_name + "a", pool_name + "b"} <= set(Pool.list())


def test_handle_refuses_use_after_fork(make_pool):
    p = make_pool("64K", block_size="4K")
    p.put("k", b"v")
    pid = os.fork()
    if pid == 0:  # child: the inherited handle must refuse, a fresh one works
        code = 1
        try:
            try:
                p.get("k")
            except UsageError:
                with Pool.open(p.name) as q:
                    code = 0 if q.get("k") == b"v" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_close_unmaps_and_releases_the_fd(make_pool):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"v")
    name = p.name

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if line.rstrip().endswith(shm_path(name)))

    # Another test's teardown may have deleted a pool a moment ago: its handle's unmap, on a thread, closes
    # two descriptors whenever it runs (Core.close).  Counted once it is done.
    assert wait_unmapped(60)
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):  # every operation kind, then close: nothing may stay behind
        q = Pool.open(name)
        q.get("k")
        q.put("k2", os.urandom(300_000))
        with q.view("k"):
            pass
        q.stats()
        q.verify()
        q.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert mapped() == 1  # only `p` itself


def test_a_retired_handle_lets_its_mapping_and_descriptors_go_on_a_thread_waited_for(make_pool):
    """A segment that lost its name is unmapped on a thread of its own when its handle closes (Core.close),
    its two descriptors (the segment's, and the one mmap keeps) with it: `wait_unmapped` waits for that, so
    a count of this process's descriptors or mappings (the test above) is not thrown by one going late."""
    p = make_pool("1M", block_size="4K")
    name = p.name

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if shm_path(name) in line)

    assert wait_unmapped(60)  # none left running by earlier tests
    fds_before = len(os.listdir("/proc/self/fd"))
    q = Pool.open(name)
    Pool.unlink(name)  # marked and unlinked through a handle of its own, closed at once
    assert q.superseded and p.superseded
    q.close()
    assert wait_unmapped(60) and len(os.listdir("/proc/self/fd")) == fds_before and mapped() == 1  # `p`'s
    p.close()
    assert wait_unmapped(60) and len(os.listdir("/proc/self/fd")) == fds_before - 2 and mapped() == 0


# ---------------------------------------------------------------- batched calls (every policy, both modes, tiers)


def _pins(p) -> int:
    return p.core.locked(lambda: int(p.core.columns["pins"].sum()))


def test_batched_calls_answer_as_the_single_key_calls_do(pool):
    from tests.helpers import check_value, make_value

    values = {f"k{i}": make_value(i, 1, size) for i, size in enumerate([12, 4096, 5000, 70_000, 300_000, 20])}
    res = pool.put_many(list(values.items()) + [(7, b"bad key"), ("huge", b"x" * (2 << 20))], ttl=60)
    assert res[:6] == [None] * 6
    assert isinstance(res[6], UsageError) and isinstance(res[7], ValueTooLarge)
    keys = list(values) + ["absent"]
    assert pool.contains_many(keys + [b"\xff", 3]) == [True] * 6 + [False, False, False]
    outs = [bytearray(300_000) for _ in keys]
    got = pool.get_many_into(keys, outs)
    assert got == [len(v) for v in values.values()] + [None]
    for k, n, out in zip(keys, got, outs):
        if n:
            assert check_value(bytes(out[:n]))[0] == int(k[1:])
            assert bytes(out[:n]) == pool.get(k)
    views = pool.view_many(keys)
    assert views[-1] is None
    assert [bytes(v.memoryview) for v in views[:-1]] == list(values.values())
    assert all(v.memoryview.readonly for v in views[:-1])
    assert _pins(pool) == 6
    pool.release_many(views)
    pool.release_many(views)  # twice is harmless
    assert _pins(pool) == 0
    assert pool.delete_many(["k0", "absent", "k3"]) == [True, False, True]
    assert pool.contains_many(["k0", "k1", "k3"]) == [False, True, False]


def test_a_batch_that_partly_fails_reports_per_key_and_leaves_no_pins_or_reservations(pool):
    pool.put_many({"a": b"a" * 100, "b": b"b" * 50_000, "c": b"c" * 300_000})
    got = pool.get_many_into(["a", "b", "c", "none"], [bytearray(100), bytearray(10), bytearray(300_000),
                                                      bytearray(1)])
    assert got[0] == 100 and isinstance(got[1], BufferTooSmall) and got[2] == 300_000 and got[3] is None
    assert _pins(pool) == 0
    with pytest.raises(UsageError):
        pool.get_many_into(["a"], [b"read-only"])  # a bad argument raises before anything is pinned
    with pytest.raises(UsageError):
        pool.get_many_into(["a", "b"], [bytearray(100)])
    with pytest.raises(UsageError):
        pool.put_many({"x": b"1"}, priority=2**70)
    assert "x" not in pool
    # Everything pinned: the puts that find no room say PoolFull, the others go in.
    views = pool.view_many(["a", "b", "c"])
    res = pool.put_many({"f0": b"f" * 100_000, "f1": b"f" * 700_000, "f2": b"f" * 20_000})
    assert res[0] is None and isinstance(res[1], PoolFull) and res[2] is None
    assert pool.contains_many(["f1"]) == [False]
    pool.release_many(views)
    assert _pins(pool) == 0
    assert pool.verify()["ok"]
    assert pool.stats()["blocks_used"] * 4096 <= 1 << 20


def _writing(p) -> int:
    from cortex_cache.layout import WRITING

    return p.core.locked(lambda: int((p.core.columns["state"] == WRITING).sum()))


def test_batched_zero_copy_puts_commit_together_and_give_everything_back(pool):
    from tests.helpers import check_value, make_value

    pool.put("k1", b"old value")
    vals = {f"k{i}": make_value(i, 2, size) for i, size in enumerate([12, 4096, 70_000, 300_000], start=1)}
    vals["k5"] = b""
    items = list((k, len(v)) for k, v in vals.items()) + [(7, 10), ("neg", -1), ("huge", 2 << 20)]
    ws = pool.reserve_write_many(items, ttl=60, priority=3)
    assert [type(w).__name__ for w in ws[5:]] == ["UsageError", "UsageError", "ValueTooLarge"]
    writers = ws[:5]
    assert _writing(pool) == 5
    assert pool.get("k1") == b"old value"  # a reserved value is invisible until committed
    for w, v in zip(writers, vals.values()):
        assert w.nbytes == len(v)
        w.memoryview[:] = v
    sums = [None] * 5
    sums[2] = xxh3_64_intdigest(vals["k3"])  # a checksum the caller took itself
    assert pool.commit_many(writers, sums) == [None] * 5
    assert _writing(pool) == 0
    for k, v in vals.items():
        assert pool.get(k) == v
        if v:
            assert check_value(pool.get(k))[0] == int(k[1:])
        assert pool.info(k)["priority"] == 3
    assert pool.verify()["ok"]  # the checksums recorded are the values'
    again = pool.commit_many(writers[:1])
    assert isinstance(again[0], UsageError)
    with pytest.raises(UsageError):
        pool.commit_many(writers, [None])  # one checksum per writer, checked before anything changes
    with pytest.raises(UsageError):
        pool.reserve_write_many([("x", 1)], ttl=-1)
    # Aborted: the space comes back and no key appears.
    used = pool.stats()["blocks_used"]
    ws = pool.reserve_write_many([("a1", 50_000), ("a2", 5000)])
    assert pool.stats()["blocks_used"] > used
    pool.abort_many(ws + [None, ValueError("not a writer")])
    pool.abort_many(ws)  # twice is harmless
    assert pool.stats()["blocks_used"] == used and _writing(pool) == 0
    assert pool.contains_many(["a1", "a2"]) == [False, False]
    # No room left (everything pinned or reserved): PoolFull for the keys that do not fit, nothing stuck.
    views = pool.view_many(list(vals))
    ws = pool.reserve_write_many([("f0", 100_000), ("f1", 900_000), ("f2", 20_000)])
    assert isinstance(ws[1], PoolFull) and not isinstance(ws[0], Exception) and not isinstance(ws[2], Exception)
    pool.abort_many(ws)
    pool.release_many(views)
    assert _pins(pool) == 0 and _writing(pool) == 0
    assert pool.verify()["ok"]


def test_a_view_s_derived_arrays_keep_its_entry_pinned_after_release(pool):
    pool.put("k", b"old!" * 1000)
    v = pool.view("k")
    arr = np.frombuffer(v.memoryview, np.uint8)[:4]  # made from the memoryview, outliving the view
    v.release()
    assert _pins(pool) == 1  # the array still reads the entry: it stays pinned
    pool.delete("k")
    pool.put("k", b"new!" * 1000)  # cannot reuse the old blocks
    assert arr.tobytes() == b"old!"
    del arr
    assert _pins(pool) == 0
    assert pool.verify()["ok"]
    with pool.view("k") as mv:
        assert bytes(mv[:4]) == b"new!"
    assert _pins(pool) == 0


def test_batched_calls_from_many_threads_never_tear(pool):
    import threading

    from tests.helpers import check_value, make_value

    if not pool.multi_threaded:
        pytest.skip("a single-threaded handle is used from one thread at a time")
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for r in range(30):
                keys = [f"k{(t * 7 + r + j) % 24}" for j in range(6)]
                pool.put_many([(k, make_value(int(k[1:]), r, 3000 + 900 * (r % 5))) for k in keys])
                outs = [bytearray(8000) for _ in keys]
                for n, out in zip(pool.get_many_into(keys, outs), outs):
                    if isinstance(n, int):
                        check_value(bytes(out[:n]))
                views = pool.view_many(keys)
                for v in views:
                    if v is not None and not isinstance(v, Exception):
                        check_value(bytes(v.memoryview))
                pool.release_many(views)
                vals = [make_value(int(k[1:]), r, 2000 + 700 * (r % 3)) for k in keys]
                ws = pool.reserve_write_many([(k, len(v)) for k, v in zip(keys, vals)])
                for w, v in zip(ws, vals):
                    if not isinstance(w, Exception):
                        w.memoryview[:] = v
                pool.commit_many([w for w in ws if not isinstance(w, Exception)])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert _pins(pool) == 0
    assert pool.verify()["ok"]


BATCH_WRITER = """
import sys
from cortex_cache import Pool
from tests.helpers import make_value
p = Pool.open(sys.argv[1])
for r in range(40):
    p.put_many([(f"k{k}", make_value(k, r, 2000 + 3000 * ((r + k) % 4))) for k in range(16)])
    vals = [make_value(k, r, 1000 + 2500 * ((r + k) % 5)) for k in range(16)]
    ws = p.reserve_write_many([(f"k{k}", len(v)) for k, v in enumerate(vals)])
    ws = [(w, v) for w, v in zip(ws, vals) if not isinstance(w, Exception)]
    for w, v in ws:
        w.memoryview[:] = v
    p.commit_many([w for w, _ in ws])
p.close()
"""


# Across processes (a process start each, the longest test of the contract) the default run takes a variant of
# each kind: both modes, each disk write mode, the queue policies, the pure-Python path; `-m long` runs the rest.
ACROSS_PROCESSES = {("lru", False, None, False), ("s3fifo", True, None, False), ("arc", False, "back", False),
                    ("auto", True, "back", False), ("lfu", True, "through", False), ("fifo", False, None, True),
                    ("lfu", True, "back", True)}


@pytest.mark.parametrize("pool", [v if v in ACROSS_PROCESSES else pytest.param(v, marks=pytest.mark.long)
                                  for v in CONTRACT_VARIANTS], ids=_variant_id, indirect=True)
def test_batched_reads_across_processes_see_whole_values(pool):
    from tests.helpers import check_value, spawn_py

    child = spawn_py(BATCH_WRITER, pool.name)
    keys = [f"k{k}" for k in range(16)]
    seen = 0
    try:
        while child.poll() is None or seen == 0:
            outs = [bytearray(12_000) for _ in keys]
            for n, out in zip(pool.get_many_into(keys, outs), outs):
                if isinstance(n, int):
                    check_value(bytes(out[:n]))
                    seen += 1
            views = pool.view_many(keys)
            for v in views:
                if v is not None and not isinstance(v, Exception):
                    check_value(bytes(v.memoryview))
            pool.release_many(views)
            if child.poll() is not None:
                break
    finally:
        assert child.wait(60) == 0, child.stderr.read().decode()[-2000:]
        for f in (child.stdin, child.stdout, child.stderr):
            f.close()
    assert _pins(pool) == 0
    assert pool.verify()["ok"]


POPULATE = """
import sys
from cortex_cache import Pool
from cortex_cache.segment import shm_path


def resident() -> int:  # KiB of the pool's mapping in this process's page tables
    path, kib, inside = shm_path(sys.argv[1]), 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("Rss:"):
            kib += int(line.split()[1])
    return kib


p = Pool.open(sys.argv[1])
before = resident()
if sys.argv[2] == "background":
    assert p.populate(background=True)
    p.close()  # stops and joins the populating thread
    print(before, -1, flush=True)
else:
    ok = p.populate()
    print(before, resident() if ok else -2, flush=True)
    assert p.get("k") == b"v" * 5000 and p.verify()["ok"]
    p.close()
"""


@pytest.mark.parametrize("pure", [False, True], ids=["fast", "pure"])
def test_populate_maps_the_whole_pool_into_a_process_and_leaves_it_unchanged(make_pool, pure):
    from tests.helpers import run_py

    p = make_pool("64M", block_size="64K")
    p.put("k", b"v" * 5000)
    env = {PURE_PYTHON_ENV: "1"} if pure else None
    before, after = map(int, run_py(POPULATE, p.name, "now", env=env).stdout.split())
    size_kib = os.stat(shm_path(p.name)).st_size // 1024
    assert before < size_kib // 4  # a fresh process maps pages as it touches them
    assert after != -2, "MADV_POPULATE_WRITE unsupported (Linux < 5.14)"
    assert after >= size_kib * 0.99
    assert p.get("k") == b"v" * 5000
    # In the background, stopped by close() at whatever point it reached.
    run_py(POPULATE, p.name, "background", env=env)
    assert p.verify()["ok"]


def test_populate_refuses_a_pool_without_reserved_memory(make_pool):
    p = make_pool("4M", reserve=False)
    assert p.populate() is False
