"""Cross-process sharing, concurrent writers and readers, SIGKILL at chosen points, threads.

Every child is a real Python process that attaches to the pool by name.
Values are self-describing (tests.helpers.make_value), so any reader can
tell a torn or mixed-up value from a whole one.
"""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest

from cortex_cache import Pool
from tests.helpers import check_value, make_value, run_py, spawn_py


def _wait_for_line(proc, expected: bytes) -> None:
    line = proc.stdout.readline()
    if line.strip() != expected:
        proc.kill()
        raise AssertionError(f"child said {line!r}, stderr: {proc.stderr.read().decode()}")


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        f.close()


def test_child_sees_parent_bytes_and_parent_sees_child_deletes(make_pool):
    p = make_pool("4M", block_size="4K")
    payload = os.urandom(100_000)
    p.put("shared", payload)
    p.put("doomed", b"x")
    out = run_py(f"""
        import sys, hashlib
        from cortex_cache import Pool
        with Pool.open({p.name!r}) as q:
            sys.stdout.write(hashlib.sha256(q.get("shared")).hexdigest())
            assert q.delete("doomed")
            q.put("from-child", b"hello parent")
    """)
    import hashlib

    assert out.stdout.decode() == hashlib.sha256(payload).hexdigest()
    assert p.get("doomed") is None and "doomed" not in p
    assert p.get("from-child") == b"hello parent"


WORKER = """
import random, sys
from cortex_cache import KeyNotFound, Pool
from tests.helpers import make_value, check_value
name, wid, n_ops, n_keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(wid)
seen = 0
with Pool.open(name) as p:
    for op in range(n_ops):
        kid = rng.randrange(n_keys)
        r = rng.random()
        if r < 0.45:
            # Mix small values (copied under the lock) and large ones (outside it).
            size = rng.choice([64, 3000, 20_000, 300_000])
            p.put(f"k{kid}", make_value(kid, wid * 1_000_000 + op, size))
        elif r < 0.9:
            v = p.get(f"k{kid}")
            if v is not None:
                got_kid, _ = check_value(v)
                assert got_kid == kid, f"key k{kid} returned the value of k{got_kid}"
                seen += 1
        elif r < 0.95:
            try:
                with p.view(f"k{kid}") as mv:
                    check_value(bytes(mv))
            except KeyNotFound:
                pass
        else:
            p.delete(f"k{kid}")
print(seen)
"""


def test_concurrent_writers_and_readers_never_see_torn_values(make_pool):
    # Small enough that puts evict all the time, so eviction races reads too.
    p = make_pool("4M", block_size="4K", policy="lru")
    procs = [spawn_py(WORKER, p.name, str(w), "400", "40") for w in range(4)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        results.append(int(out))
    assert sum(results) > 0  # reads did hit
    report = p.verify()
    assert report["ok"], report
    for k in p.keys():
        check_value(p.get(k))


def test_sigkill_mid_put_leaves_no_visible_entry_and_no_leak(make_pool):
    p = make_pool("4M", block_size="4K")
    p.put("before", b"kept")
    child = spawn_py(f"""
        import sys
        from cortex_cache import Pool
        p = Pool.open({p.name!r})
        # Reserve room for a 1 MiB value, copy half of it, then stop mid-copy.
        off = p.core.locked(p.core.reserve, b"victim", 12345, 0, 1 << 20, 256)[1]
        p.core.mv[off : off + (1 << 19)] = b"\\xab" * (1 << 19)
        print("mid-copy", flush=True)
        sys.stdin.read()
    """)
    _wait_for_line(child, b"mid-copy")
    assert p.stats()["writing_entries"] == 1
    _kill(child)
    assert p.get("victim") is None and "victim" not in p.keys()
    assert p.get("before") == b"kept"
    # The dead writer's reserved blocks and key cells are its leftovers, not leaks of their own ...
    assert p.verify()["problems"] == ["1 unfinished write(s) of dead processes"]
    # ... while a block no slot ever claimed still is one.
    p.core.block_map[p.core.geometry.n_blocks - 1] = 1
    assert p.verify()["problems"] == ["1 unfinished write(s) of dead processes",
                                      "block map out of step: 1 leaked block(s), 0 in use but marked free"]
    assert p.verify(repair=True)["repaired"]
    assert p.verify()["ok"]
    st = p.stats()
    assert st["writing_entries"] == 0 and st["blocks_used"] == 1  # only "before" remains


def test_dead_writers_blocks_are_reclaimed_when_room_runs_short(make_pool):
    p = make_pool("64K", block_size="4K")  # 16 blocks
    child = spawn_py(f"""
        import sys
        from cortex_cache import Pool
        p = Pool.open({p.name!r})
        p.core.locked(p.core.reserve, b"victim", 1, 0, 40000, 10)
        print("reserved", flush=True)
        sys.stdin.read()
    """)
    _wait_for_line(child, b"reserved")
    _kill(child)
    # 10 of 16 blocks are held by the dead writer; a put needing 8 must reclaim them.
    p.put("needs-room", bytes(30000))
    assert p.get("needs-room") == bytes(30000)
    assert p.verify()["ok"]


def test_sigkill_while_holding_the_lock_is_repaired_by_the_next_holder(make_pool):
    p = make_pool("4M", block_size="4K")
    for i in range(20):
        p.put(f"k{i}", make_value(i, 0, 5000))
    child = spawn_py(f"""
        import sys
        from cortex_cache import Pool
        from cortex_cache.layout import H_DIRTY, H_N_ENTRIES
        p = Pool.open({p.name!r})
        p.core.lock.acquire()
        p.core.fields.dirty[0] = 1
        # Half-done changes: stray block-map bits and a broken counter.
        p.core.block_map[500:600] = 1
        p.core.counters[H_N_ENTRIES] = 999
        print("locked", flush=True)
        sys.stdin.read()
    """)
    _wait_for_line(child, b"locked")
    _kill(child)
    # The kernel dropped the lock with the process; the next operation repairs.
    p.core.lock_timeout = 5.0
    assert check_value(p.get("k3")) == (3, 0)
    st = p.stats()
    assert st["repairs"] == 1 and st["entries"] == 20
    assert st["blocks_used"] == 20 * 2
    assert p.verify()["ok"]


def test_sigkill_of_a_reader_holding_a_pin(make_pool):
    p = make_pool("64K", block_size="4K")
    p.put("pinned", bytes(8000))
    child = spawn_py(f"""
        import sys
        from cortex_cache import Pool
        p = Pool.open({p.name!r})
        v = p.view("pinned")
        print("viewing", flush=True)
        sys.stdin.read()
    """)
    _wait_for_line(child, b"viewing")
    assert p.info("pinned")["pins"] == 1
    p.delete("pinned")  # becomes a zombie: its reader is still copying
    assert p.stats()["blocks_used"] == 2
    _kill(child)
    assert p.verify(repair=True)["repaired"]
    assert p.stats()["blocks_used"] == 0 and p.verify()["ok"]


CHAOS = """
import random, sys
from cortex_cache import Pool
from tests.helpers import make_value
name, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
with Pool.open(name) as p:
    for op in range(100000):
        kid = rng.randrange(30)
        r = rng.random()
        if r < 0.6:
            p.put(f"k{kid}", make_value(kid, seed * 100000 + op, rng.choice([100, 5000, 280_000])))
        elif r < 0.9:
            p.get(f"k{kid}")
        else:
            p.delete(f"k{kid}")
        if op % 10 == 0:
            print(op, flush=True)
"""


@pytest.mark.parametrize("seed", range(6))
def test_sigkill_at_random_points_never_wedges_or_corrupts(make_pool, seed):
    p = make_pool("2M", block_size="4K")
    child = spawn_py(CHAOS, p.name, str(seed))
    # Kill after a random number of progress lines: a random point in the op mix.
    for _ in range(random.Random(seed).randrange(1, 40)):
        if not child.stdout.readline():
            break
    _kill(child)
    p.core.lock_timeout = 5.0  # a wedged lock would fail the test, not hang it
    p.put("after", b"alive")
    assert p.get("after") == b"alive"
    p.verify(repair=True)
    assert p.verify()["ok"]
    for k in p.keys():
        v = p.get(k)
        if v is not None and k != "after":
            check_value(v)
    st = p.stats()
    assert st["writing_entries"] == 0 and st["pinned_entries"] == 0


def test_eight_threads_in_multi_threaded_mode(make_pool):
    p = make_pool("4M", block_size="4K", multi_threaded=True)
    errors: list[BaseException] = []

    def work(tid: int) -> None:
        rng = random.Random(tid)
        try:
            for op in range(300):
                kid = rng.randrange(24)
                r = rng.random()
                if r < 0.5:
                    p.put(f"k{kid}", make_value(kid, tid * 1000 + op, rng.choice([100, 4000, 270_000])))
                elif r < 0.9:
                    v = p.get(f"k{kid}")
                    if v is not None:
                        assert check_value(v)[0] == kid
                else:
                    p.delete(f"k{kid}")
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert p.verify()["ok"]


def test_multi_threaded_default_comes_from_the_pool(make_pool):
    p = make_pool("64K", block_size="4K", multi_threaded=True)
    with Pool.open(p.name) as q:
        assert q.multi_threaded
    with Pool.open(p.name, multi_threaded=False) as q:
        assert not q.multi_threaded
