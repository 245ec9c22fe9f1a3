"""The C fast path (cortex_cache/_fastpath*.c; docs/internals.md, "The fast path").

It must be built and used wherever the package is installed with a compiler
(as in CI), count exactly what the Python path counts, share pools with
processes on the Python path, and never hand out a torn value when it copies
large values outside the lock (its seqlock check).  The batched-call contract
tests in test_pool.py run over both paths.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from cortex_cache import Pool
from cortex_cache.core import PURE_PYTHON_ENV, SEQLOCK_COPIES, SLOW
from cortex_cache.layout import H_DIRTY

CTX = mp.get_context("spawn")


@pytest.fixture
def pure(monkeypatch):
    """Pools opened inside the test (and by the processes it starts) use the Python path."""
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")


def test_the_fast_path_is_built_and_used(make_pool):
    p = make_pool("1M")
    assert p.core.fast is not None, "cortex_cache._fastpath was not built: pip install needs a C compiler"


def test_the_pure_python_path_can_be_asked_for(make_pool, pure):
    assert make_pool("1M").core.fast is None


def _workload(p: Pool) -> list:
    """One run of every read the fast path serves, and the answers."""
    seen = []
    p.put("small", b"s" * 100)
    p.put("large", b"L" * (200 * 1024))  # over the 32 KiB copy-in-lock threshold
    for k in ("small", "large", "absent"):
        seen.append(p.get(k))
        seen.append(p.peek(k))
        out = bytearray(300 * 1024)
        seen.append(p.get_into(k, out))
    seen.append(p.get_many_into(["small", "large", "absent", "small"], [bytearray(300 * 1024) for _ in range(4)]))
    views = p.view_many(["large", "absent", "small"])
    seen.append([None if v is None else bytes(v.memoryview) for v in views])
    p.release_many(views)
    with p.view("small") as mv:
        seen.append(bytes(mv))
    return seen


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority", "ttl", "size", "s3fifo", "arc", "auto"])
def test_both_paths_answer_and_count_alike(make_pool, monkeypatch, policy):
    fast = make_pool("2M", block_size="4K", policy=policy)
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    slow = make_pool("2M", block_size="4K", policy=policy)
    assert fast.core.fast is not None and slow.core.fast is None
    assert _workload(fast) == _workload(slow)
    keys = ("hits", "misses", "puts", "entries", "blocks_used", "pinned_entries")
    sf, ss = fast.stats(), slow.stats()
    assert {k: sf[k] for k in keys} == {k: ss[k] for k in keys}
    for k in ("small", "large"):  # the same place in the eviction order
        fi, si = fast.info(k), slow.info(k)
        assert (fi["access_count"], fi["pins"]) == (si["access_count"], si["pins"])
    assert fast.verify()["problems"] == [] and slow.verify()["problems"] == []


def test_a_dirty_mark_sends_the_fast_path_to_the_repair(make_pool):
    p = make_pool("1M")
    p.put("k", b"v" * 1000)
    repairs = p.stats()["repairs"]
    p.core.counters.cast("B").cast("I")[H_DIRTY] = 1  # as a holder killed mid-change leaves it
    assert p.get("k") == b"v" * 1000
    assert p.stats()["repairs"] == repairs + 1


def test_a_view_keeps_its_entry_and_mapping_while_an_array_uses_it(make_pool, pool_name):
    p = make_pool("1M", block_size="4K")
    p.put("k", bytes(range(256)) * 64)
    v = p.view("k")
    arr = np.frombuffer(v.memoryview, dtype=np.uint8)
    v.release()
    assert p.info("k")["pins"] == 1  # the array still reads it
    p.delete("k")
    p.put("other", b"\xff" * (p.geometry.data_size - 4096 * 4))  # would reuse the blocks if they were free
    assert bytes(arr[:256]) == bytes(range(256))
    p.close()  # the array keeps the mapping
    assert int(arr.sum()) == sum(range(256)) * 64
    del arr


def _kh(key: bytes) -> int:
    from xxhash import xxh3_64_intdigest

    return xxh3_64_intdigest(key)


class PythonWrites:
    """A fast path whose reads are C's and whose writes are left to core.py (they answer SLOW)."""

    def __init__(self, fast):
        self._fast = fast

    def __getattr__(self, name):
        return getattr(self._fast, name)

    def put(self, *args):
        return SLOW

    put_many = reserve_many = seal_many = put


@pytest.mark.parametrize("writes", ["python", "c"])
@pytest.mark.parametrize("change", ["put-same-size", "put-other-size", "delete", "evict", "pushed-out",
                                    "put_many", "reserve_write"])
def test_every_change_of_a_value_fails_the_seqlock_check(make_pool, change, writes):
    # What a reader records under the lock (slot, insert_seq) before copying without it must no longer
    # check out after any change that may rewrite the value's bytes -- and still check out after a hit.
    # (LRU: twenty puts push out a key read twice; auto would keep it in its main queue.)
    p = make_pool("1M", block_size="4K", policy="lru")
    v = b"a" * (64 * 1024)
    p.put("k", v)
    fast = p.core.fast
    seen = fast.probe(b"k", _kh(b"k"))
    p.get("k")
    p.view_many(["k"])[0].release()
    assert fast.still(*seen), "a hit must not send readers round again"
    if writes == "python":
        p.core.fast = PythonWrites(fast)
    # Every write over the old value's bytes must find the check failing already (a reader copying
    # then would get torn bytes): watch the segment's writes.  The C write path's stores cannot be
    # watched from here; it keeps the same order (insert_seq first: _fastpath_put.c, put_held), and the
    # racing readers below check it from other processes.
    start = p.core.value_offset(seen[0])
    checks = []

    class Watched:
        def __init__(self, mv):
            self.mv = mv

        def __getitem__(self, k):
            return self.mv[k]

        def __setitem__(self, k, value):
            if isinstance(k, slice) and k.start < start + len(v) and k.stop > start:
                checks.append(fast.still(*seen))
            self.mv[k] = value

    p.core.mv = Watched(p.core.mv)
    if change == "put-same-size":
        p.put("k", b"b" * len(v))  # overwritten in place, under the lock
    elif change == "put-other-size":
        p.put("k", b"b" * (len(v) + 4096))
    elif change == "delete":
        p.delete("k")
    elif change == "evict":
        p.evict(keys=["k"])
    elif change == "pushed-out":
        for n in range(20):
            p.put(f"other{n}", b"o" * len(v))
    elif change == "put_many":
        p.put_many({"k": b"c" * len(v)})
    elif change == "reserve_write":
        with p.reserve_write("k", len(v)) as mv:
            mv[:] = b"d" * len(v)
    p.core.mv = p.core.mv.mv
    p.core.fast = fast
    assert not fast.still(*seen)
    assert not any(checks), "a value's bytes were rewritten while a reader's check still passed"
    if writes == "python" and change in ("put-same-size", "pushed-out", "put_many"):
        assert checks, "the change did not write over the old bytes: the test missed its point"
    if change in ("put-same-size", "put_many"):  # written over in place: the slot is the same
        assert fast.probe(b"k", _kh(b"k"))[0] == seen[0]


def _writer(name: str, size: int, fillers: bool, rounds: int, ready, done) -> None:
    """Overwrite `k` with uniform values (each byte = its version) until `done`, at least `rounds` times;
    with `fillers`, put other keys between, so that evictions reuse k's blocks."""
    p = Pool.open(name)
    try:
        n = 0
        while n < rounds or not done.is_set():
            p.put("k", bytes([n % 251]) * size)
            if fillers:
                p.put(f"filler{n % 3}", b"f" * size)
            n += 1
            if n == 20:
                ready.set()
    finally:
        p.close()


@pytest.mark.skipif(not SEQLOCK_COPIES, reason="the seqlock copy is used on x86-64 only")
@pytest.mark.parametrize("size,fillers", [(128 * 1024, False), (1 << 20, True)], ids=["in-place", "reused"])
def test_large_values_copied_outside_the_lock_are_never_torn(make_pool, pool_name, size, fillers):
    # A 128 KiB value put again under its key is overwritten in place, under the lock; 1 MiB ones are
    # evicted by the fillers and their blocks reused.  Either way a reader copying without the lock
    # must notice and read again.
    name = f"{pool_name}-torn"
    p = make_pool(f"{4 * size // 1024}K", name=name, block_size="4K")
    p.put("k", b"\0" * size)
    ready, done = CTX.Event(), CTX.Event()
    w = CTX.Process(target=_writer, args=(name, size, fillers, 200, ready, done))
    w.start()
    try:
        assert ready.wait(60)
        out = bytearray(size)
        reads = 0
        for n in range(6000):
            got = p.get("k") if n % 2 else (bytes(out) if p.get_into("k", out) else None)
            if got is None:
                continue  # evicted between a writer's puts
            assert got == got[:1] * size, f"torn read: bytes {got[0]} and {got[-1]} in one value"
            reads += 1
        assert reads > 100
    finally:
        done.set()
        w.join(120)
    assert w.exitcode == 0


def _pure_child(name: str, rounds: int) -> None:
    os.environ[PURE_PYTHON_ENV] = "1"
    p = Pool.open(name)
    try:
        assert p.core.fast is None
        for n in range(rounds):
            p.put(f"k{n % 40}", bytes([n % 256]) * (1000 + n % 3 * 40000))
            got = p.get(f"k{(n * 7) % 40}")
            assert got is None or got == got[:1] * len(got)
            views = p.view_many([f"k{(n + j) % 40}" for j in range(5)])
            p.release_many(views)
    finally:
        p.close()


def test_fast_and_pure_processes_share_a_pool(make_pool, pool_name):
    name = f"{pool_name}-mix"
    p = make_pool("1M", name=name, block_size="4K", policy="lfu", multi_threaded=True)
    child = CTX.Process(target=_pure_child, args=(name, 3000))
    child.start()
    try:
        for n in range(6000):
            p.put(f"k{(n * 3) % 40}", bytes([n % 256]) * (1000 + n % 3 * 40000))
            got = p.get(f"k{(n * 5) % 40}")
            assert got is None or got == got[:1] * len(got)
            views = p.view_many([f"k{(n + j) % 40}" for j in range(5)])
            for v in views:
                if v is not None and not isinstance(v, Exception):
                    assert bytes(v.memoryview) == bytes(v.memoryview)[:1] * len(v.memoryview)
            p.release_many(views)
    finally:
        child.join(120)
    assert child.exitcode == 0
    assert p.verify()["problems"] == []
    assert p.stats()["pinned_entries"] == 0  # every view of both processes was released


# ---------------------------------------------------------------- the write path (_fastpath_put.c)

# What two pools given the same writes must hold alike, whichever path wrote them: every slot field but
# the wall-clock times, every allocation word and map, the chains and the victim list's place.
_SAME_COLUMNS = ("state", "pins", "key_len", "flags", "next", "key_hash", "value_len", "first_block", "n_blocks",
                 "checksum", "insert_seq", "access_seq", "access_count", "lfu_epoch", "priority", "key_cell")
_SAME_HEADER = ("seq", "used_blocks", "n_entries", "alloc_hint", "free_slot", "hits", "misses", "puts", "deletes",
                "evictions", "expirations", "bytes_evicted", "lfu_epoch", "ops", "used_kcells", "key_hint",
                "gone_seq", "cand_valid", "cand_count", "cand_pos")
_QUEUE_HEADER = ("q_count0", "q_count1", "q_target", "q_seq", "g0_head", "g0_tail", "g0_live", "g1_head", "g1_tail",
                 "g1_live", "cand1_valid", "cand1_count", "cand1_pos", "q_regime", "q_ghost_rate", "q_hit_rate",
                 "q_hits_seen")


def _writes(p: Pool, seed: int) -> list:
    """A few hundred writes of every kind into a small pool (evicting from the start), pins held across some;
    what each returned."""
    rng = np.random.default_rng(seed)
    out: list = []
    held = []
    sizes = [0, 100, 4096, 5000, 40_000, 300_000]  # empty, in one block, several, past the in-lock copy
    for n in range(400):
        op = int(rng.integers(0, 6))
        k = f"k{int(rng.integers(0, 40))}"
        size = sizes[int(rng.integers(0, len(sizes)))]
        value = bytes([n % 251]) * size
        try:
            if op == 0:
                p.put(k, value, priority=int(rng.integers(-3, 3)))
            elif op == 1:
                got = p.put_many({f"{k}-{j}": value[: size // (j + 1)] for j in range(int(rng.integers(1, 6)))})
                out.append([type(r).__name__ for r in got])
            elif op == 2:
                ws = p.reserve_write_many([(f"{k}-w{j}", size) for j in range(int(rng.integers(1, 5)))])
                for w in ws:
                    if not isinstance(w, Exception):
                        w.memoryview[:] = value
                out.append([type(r).__name__ for r in ws])
                out.append([type(r).__name__ for r in p.commit_many([w for w in ws if not isinstance(w, Exception)])])
            elif op == 3:
                with p.reserve_write(k, size) as mv:
                    mv[:] = value
            elif op == 4:
                out.append(p.delete(k))
            elif len(held) < 6:
                v = p.view(k) if p.contains(k) else None
                if v is not None:
                    held.append(v)
            else:
                held.pop(0).release()
        except Exception as e:  # PoolFull with pins held: both paths must say it
            out.append(type(e).__name__)
    for v in held:
        v.release()
    return out


def _state(p: Pool) -> dict:
    core = p.core
    h = core.header
    state = {name: core.columns[name].copy() for name in _SAME_COLUMNS}
    state.update({name: int(h[name][0]) for name in _SAME_HEADER})
    state["block_map"], state["key_map"], state["buckets"] = (core.block_map.copy(), core.key_map.copy(),
                                                              core.buckets.copy())
    if core.queues is not None:  # a queue policy's own state: the queues, the target, the ghosts
        state.update({name: core.queues.cols[name].copy() for name in ("queue", "freq", "qseq")})
        qh = core.queues.header
        state.update({name: float(qh[name][0]) for name in _QUEUE_HEADER})
        state.update({f"ghosts{r}": g.hashes.copy() for r, g in enumerate(core.queues.ghosts)})
    state["values"] = {k: p.peek(k) for k in p.keys()}
    return state


def same_state(fast: Pool, slow: Pool) -> dict:
    """Assert that two pools hold the same slot table, allocation words, maps, chains, queues and values;
    the first one's state."""
    a, b = _state(fast), _state(slow)
    for name in a:
        if isinstance(a[name], np.ndarray):
            assert np.array_equal(a[name], b[name]), name
        else:
            assert a[name] == b[name], name
    return a


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority", "size", "s3fifo", "arc", "auto"])
def test_both_write_paths_leave_the_same_pool(make_pool, monkeypatch, policy):
    fast = make_pool("1M", block_size="4K", policy=policy, max_entries=64)
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    slow = make_pool("1M", block_size="4K", policy=policy, max_entries=64)
    assert fast.core.fast is not None and slow.core.fast is None
    assert _writes(fast, 5) == _writes(slow, 5)
    a = same_state(fast, slow)
    assert a["evictions"] > 50, "the writes did not evict: the test missed its point"
    assert fast.verify()["problems"] == [] and slow.verify()["problems"] == []


def _hold_lock(name: str, held, release) -> None:
    p = Pool.open(name)
    p.core.locked(lambda: (held.set(), release.wait(60)))
    p.close()


def test_a_busy_lock_sends_the_c_writes_to_the_python_path_unchanged(make_pool, pool_name):
    p = make_pool("1M", name=f"{pool_name}-busy", block_size="4K")
    p.put("k", b"old")
    fast = p.core.fast
    held, release = CTX.Event(), CTX.Event()
    holder = CTX.Process(target=_hold_lock, args=(p.name, held, release))
    holder.start()
    try:
        assert held.wait(60)
        before = bytes(p.core.mv)  # the whole segment: header, tables, data
        kh = _kh(b"k")
        nblk = 1
        assert fast.put(b"k", kh, 1, memoryview(b"new"), nblk, None, 0) is SLOW
        assert fast.put_many([(b"k", kh, 1, memoryview(b"new"), nblk)], None, 0) is SLOW
        assert fast.reserve_many([(b"k", kh, 1, 3, nblk)]) is SLOW
        assert fast.seal_many([(0, b"k", kh, 0, None, 0)]) is SLOW
        assert bytes(p.core.mv) == before, "a SLOW answer changed the pool"
    finally:
        release.set()
        holder.join(60)
    p.put("k", b"new")  # the Python path waited for the lock
    assert p.get("k") == b"new"


@pytest.mark.parametrize("write", ["put", "put_many", "reserve_write", "reserve_write_many"])
def test_a_dirty_mark_sends_the_c_writes_to_the_repair(make_pool, write):
    p = make_pool("1M", block_size="4K")
    p.put("k", b"v" * 1000)
    repairs = p.stats()["repairs"]
    p.core.counters.cast("B").cast("I")[H_DIRTY] = 1  # as a holder killed mid-change leaves it
    if write == "put":
        p.put("k", b"w" * 1000)
    elif write == "put_many":
        assert p.put_many({"k": b"w" * 1000}) == [None]
    elif write == "reserve_write":
        with p.reserve_write("k", 1000) as mv:
            mv[:] = b"w" * 1000
    else:
        (w,) = p.reserve_write_many([("k", 1000)])
        w.memoryview[:] = b"w" * 1000
        assert p.commit_many([w]) == [None]
    assert p.get("k") == b"w" * 1000
    assert p.stats()["repairs"] == repairs + 1


def test_a_full_pool_fails_one_key_of_a_c_batch_and_stores_the_rest(make_pool):
    p = make_pool("256K", block_size="4K")
    views = []
    for n in range(20):
        p.put(f"pinned{n}", bytes([n]) * 12_000)
        views.append(p.view(f"pinned{n}"))  # nothing can be evicted
    free = p.stats()["blocks_total"] - p.stats()["blocks_used"]
    # (The failed key first: it evicts whatever is not pinned before it gives up.)
    got = p.put_many({"too-big": b"b" * ((free + 1) * 4096), "fits": b"a" * 4096, "fits-too": b"c" * 100})
    assert type(got[0]).__name__ == "PoolFull" and got[1:] == [None, None]
    assert p.get("fits") == b"a" * 4096 and p.get("fits-too") == b"c" * 100 and p.get("too-big") is None
    ws = p.reserve_write_many([("w-too-big", (free + 1) * 4096), ("w1", 100), ("w2", 100)])
    assert type(ws[0]).__name__ == "PoolFull" and not any(isinstance(w, Exception) for w in ws[1:])
    p.abort_many([w for w in ws if not isinstance(w, Exception)])
    for v in views:
        v.release()
    assert p.verify()["problems"] == []


def _mixed_writer(name: str, rounds: int, pure: bool) -> None:
    """Every kind of write, over and over, through the C write path or (pure) through core.py."""
    from tests.helpers import make_value

    if pure:
        os.environ[PURE_PYTHON_ENV] = "1"
    p = Pool.open(name)
    assert (p.core.fast is None) == pure
    for n in range(rounds):
        p.put(f"k{n % 30}", make_value(n % 30, n, [300, 9000, 70_000][n % 3]))
        p.put_many({f"m{(n + j) % 30}": make_value(100 + (n + j) % 30, n, 2000) for j in range(3)})
        ws = p.reserve_write_many([(f"z{(n + j) % 30}", 5000) for j in range(3)])
        for j, w in enumerate(ws):
            if not isinstance(w, Exception):
                w.memoryview[:] = make_value(200 + (n + j) % 30, n, 5000)
        p.commit_many([w for w in ws if not isinstance(w, Exception)])
    p.close()


def test_c_and_python_writers_share_a_pool(make_pool, pool_name):
    from tests.helpers import check_value

    name = f"{pool_name}-writers"
    p = make_pool("2M", name=name, block_size="4K", max_entries=128)
    sides = [CTX.Process(target=_mixed_writer, args=(name, 1500, pure)) for pure in (False, True)]
    for side in sides:
        side.start()
    try:
        for n in range(3000):  # this process reads what both write: each value whole, never another key's
            for prefix, base in (("k", 0), ("m", 100), ("z", 200)):
                k = f"{prefix}{n % 30}"
                got = p.get(k)
                if got is not None:
                    assert check_value(got)[0] == base + n % 30, k
    finally:
        for side in sides:
            side.join(300)
    assert [side.exitcode for side in sides] == [0, 0]
    assert p.verify()["problems"] == []
    assert p.stats()["puts"] >= 2 * 1500 * 7


# ---------------------------------------------------------------- copy_hash (copyhash.py)

COPY_HASH_SIZES = [0, 1, 63, 16 * 1024 - 1, 16 * 1024, 64 * 1024 - 1, 64 * 1024, 64 * 1024 + 1,
                   256 * 1024 + 3, (4 << 20) + 7]


@pytest.fixture(params=["widest", "baseline"])
def c_build(request):
    """The C copy_hash as the CPU picks it, then its baseline build (which an AVX2 machine never picks)."""
    from cortex_cache import _fastpath

    if request.param == "widest":
        yield _fastpath.COPY_HASH_ISA
        return
    was = _fastpath.use_copy_hash_isa("baseline")
    try:
        yield "baseline"
    finally:
        _fastpath.use_copy_hash_isa(was)


def test_copy_hash_refuses_a_build_it_does_not_have():
    from cortex_cache import _fastpath

    with pytest.raises(ValueError, match="not built or not supported"):
        _fastpath.use_copy_hash_isa("avx512")


@pytest.mark.parametrize("impl", ["c", "python"])
def test_copy_hash_copies_and_gives_the_xxhash_packages_checksum(impl, c_build):
    import xxhash

    from cortex_cache import copyhash
    from cortex_cache.core import C_COPY_HASH

    fn = C_COPY_HASH if impl == "c" else copyhash.copy_hash_py
    rng = np.random.default_rng(7)
    for n in COPY_HASH_SIZES:
        src = rng.integers(0, 256, n, dtype=np.uint8)
        for head in (b"", b"h" * 40):
            dst = np.zeros(n, np.uint8)
            assert fn(dst, src, head) == xxhash.xxh3_64_intdigest(head + src.tobytes()), (n, head)
            assert np.array_equal(dst, src)
    # Sources of any contiguous format count in bytes, as the checksum of a put does.
    src32 = np.arange(1000, dtype=np.uint32)
    dst = bytearray(4000)
    assert fn(dst, src32) == xxhash.xxh3_64_intdigest(src32.tobytes()) and bytes(dst) == src32.tobytes()


@pytest.mark.parametrize("impl", ["c", "python"])
def test_copy_hash_refuses_buffers_of_different_lengths_and_writes_nothing(impl):
    from cortex_cache import copyhash
    from cortex_cache.core import C_COPY_HASH

    fn = C_COPY_HASH if impl == "c" else copyhash.copy_hash_py
    dst = bytearray(b"x" * 100)
    with pytest.raises(ValueError, match="dst holds 100 bytes, src 99"):
        fn(dst, b"y" * 99)
    assert dst == b"x" * 100
    with pytest.raises(TypeError):
        fn(b"read-only", b"012345678")


def test_copy_hash_runs_the_widest_build_the_cpu_has():
    from cortex_cache import copyhash
    from cortex_cache.core import C_COPY_HASH, C_COPY_HASH_ISA

    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    avx2 = " avx2" in flags and os.uname().machine == "x86_64"
    assert C_COPY_HASH_ISA == ("avx2" if avx2 else "baseline")
    assert copyhash.copy_hash is C_COPY_HASH and copyhash.ISA == C_COPY_HASH_ISA


def test_the_pure_python_path_copies_and_hashes_in_python_too():
    import subprocess
    import sys

    code = "from cortex_cache import copyhash; print(copyhash.ISA, copyhash.copy_hash is copyhash.copy_hash_py)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, PURE_PYTHON_ENV: "1"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["python", "True"]


@pytest.mark.parametrize("impl", ["c", "python"])
def test_copy_hash_many_gathers_pieces_under_one_checksum(impl, c_build):
    import xxhash

    from cortex_cache import copyhash
    from cortex_cache.core import C_COPY_HASH_MANY

    fn = C_COPY_HASH_MANY if impl == "c" else copyhash.copy_hash_many_py
    rng = np.random.default_rng(11)
    sizes = [0, 5, 16 * 1024, 64 * 1024 + 9, 300 * 1024]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    whole = bytearray(sum(sizes))
    dsts, off = [], 0
    mv = memoryview(whole)
    for n in sizes:  # the pieces land side by side, as a page's pieces in a pool entry
        dsts.append(mv[off : off + n])
        off += n
    assert fn(dsts, srcs, b"head") == xxhash.xxh3_64_intdigest(b"head" + b"".join(s.tobytes() for s in srcs))
    assert bytes(whole) == b"".join(s.tobytes() for s in srcs)
    assert fn([], [], b"h") == xxhash.xxh3_64_intdigest(b"h")


@pytest.mark.parametrize("impl", ["c", "python"])
def test_copy_hash_many_checks_every_pair_before_copying_any(impl):
    from cortex_cache import copyhash
    from cortex_cache.core import C_COPY_HASH_MANY

    fn = C_COPY_HASH_MANY if impl == "c" else copyhash.copy_hash_many_py
    first, second = bytearray(b"a" * 10), bytearray(b"b" * 10)
    with pytest.raises(ValueError, match="dst 1 holds 10 bytes, src 9"):
        fn([first, second], [b"x" * 10, b"y" * 9])
    assert first == b"a" * 10 and second == b"b" * 10  # the good first pair was not copied either
    with pytest.raises(ValueError, match="2 dsts, 1 srcs"):
        fn([first, second], [b"x" * 10])
    with pytest.raises(TypeError):
        fn([first, b"read-only!"], [b"x" * 10, b"y" * 10])
    assert first == b"a" * 10
