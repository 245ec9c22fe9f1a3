"""Soak: 4 processes x 4 threads of random operations, persists, a disk tier, and a process killed and restarted.

    CORTEX_SOAK_SECONDS=600 .venv/bin/python -m pytest -q -m soak -s

Behind the `soak` marker; `.ci/run` runs a short form (CORTEX_SOAK_SECONDS=20)
and `CORTEX_CRASH_ROUNDS=100` for the crash matrix.  Every value read is
checked (self-describing values: key id, version, length, pattern); the
totals are printed and written to $CORTEX_SOAK_REPORT if set.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from cortex_cache import Pool
from tests.helpers import check_value, spawn_py

SECONDS = float(os.environ.get("CORTEX_SOAK_SECONDS", "30"))
KEYS = 400

WORKER = """
import json, random, sys, threading, time
from cortex_cache import Pool, CortexCacheError
from tests.helpers import check_value, make_value
name, wid, seconds, keys = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
p = Pool.open(name, multi_threaded=True)
deadline = time.monotonic() + seconds
totals = {"ops": 0, "puts": 0, "gets": 0, "hits": 0, "views": 0, "deletes": 0, "evicts": 0, "errors": 0}
lock = threading.Lock()
kinds = {}
def run(tid):
    rng = random.Random(wid * 100 + tid)
    mine = {k: 0 for k in ("ops", "puts", "gets", "hits", "views", "deletes", "evicts", "errors")}
    n = 0
    while time.monotonic() < deadline:
        k = rng.randrange(keys)
        r = rng.random()
        try:
            if r < 0.35:
                ttl = rng.choice([None, None, None, 0.5, 30])
                p.put(f"k{k}", make_value(k, wid * 1_000_000 + n, rng.choice([200, 3000, 40_000, 300_000])), ttl=ttl)
                mine["puts"] += 1
            elif r < 0.75:
                v = p.get(f"k{k}")
                mine["gets"] += 1
                if v is not None:
                    assert check_value(v)[0] == k
                    mine["hits"] += 1
            elif r < 0.85:
                try:
                    with p.view(f"k{k}") as mv:
                        assert check_value(bytes(mv))[0] == k
                    mine["views"] += 1
                except KeyError:
                    pass
            elif r < 0.97:
                p.delete(f"k{k}")
                mine["deletes"] += 1
            else:
                p.evict(percent=rng.choice([1, 10]))
                mine["evicts"] += 1
        except AssertionError:
            raise
        except CortexCacheError as e:
            mine["errors"] += 1  # PoolFull with everything pinned, and the like: counted, never wrong bytes
            with lock:
                kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
        n += 1
        mine["ops"] += 1
        if n % 500 == 0 and tid == 0:
            print("alive", flush=True)
    with lock:
        for key, v in mine.items():
            totals[key] += v
threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
for t in threads: t.start()
for t in threads: t.join()
p.close()
totals["error_kinds"] = kinds
print(json.dumps(totals), flush=True)
"""


@pytest.mark.soak
@pytest.mark.timeout(SECONDS + 600)
def test_soak(tmp_path, pool_name):
    p = Pool.create(pool_name, "32M", block_size="16K", disk_path=tmp_path / "tier", disk_size="128M",
                    multi_threaded=True)
    rng = random.Random(1)
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    totals: dict[str, int] = {}
    error_kinds: dict[str, int] = {}  # clean errors by class (PoolFull with everything pinned, ...)
    kills = persists = 0
    start = time.monotonic()
    try:
        procs = {w: spawn_py(WORKER, pool_name, str(w), str(SECONDS), str(KEYS)) for w in range(4)}
        kill_at = start + rng.uniform(0.2, 0.6) * SECONDS
        next_persist = start + 2.0
        while time.monotonic() < start + SECONDS:
            now = time.monotonic()
            if now >= kill_at and not kills:
                victim = rng.randrange(4)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                for f in (procs[victim].stdin, procs[victim].stdout, procs[victim].stderr):
                    f.close()
                kills += 1
                left = start + SECONDS - time.monotonic()
                procs[victim] = spawn_py(WORKER, pool_name, str(victim), str(max(1.0, left)), str(KEYS))
            if now >= next_persist:
                p.persist(snaps / "soak.ccsnap")
                persists += 1
                next_persist = now + 2.0
            time.sleep(0.05)  # the soak's own pacing (it runs for a duration), not a wait for an effect
        for w, proc in procs.items():
            out, err = proc.communicate(timeout=SECONDS + 120)
            assert proc.returncode == 0, err.decode()[-3000:]
            got = json.loads(out.decode().strip().splitlines()[-1])
            for k, v in got.pop("error_kinds").items():
                error_kinds[k] = error_kinds.get(k, 0) + v
            for k, v in got.items():
                totals[k] = totals.get(k, 0) + v
        p.verify(repair=True)
        rep = p.verify()
        assert rep["ok"], rep["problems"]
        checked = 0
        for k in p.keys(tier="all"):
            v = p.get(k)
            if v is not None:
                assert check_value(v)[0] == int(str(k)[1:])
                checked += 1
        q = Pool.restore(snaps / "soak.ccsnap", name=pool_name + "r")
        try:
            for k in q.keys():
                assert check_value(q.get(k))[0] == int(str(k)[1:])
        finally:
            q.close()
            Pool.unlink(pool_name + "r")
    finally:
        st = p.stats()
        p.close()
        Pool.unlink(pool_name)
    report = {"seconds": SECONDS, "processes": 4, "threads_each": 4, "kills": kills, "persists": persists,
              **totals, "final_entries_checked": checked, "repairs": st["repairs"], "spills": st["disk"]["spills"],
              "promotions": st["disk"]["promotions"], "error_kinds": error_kinds}
    print("\nsoak:", json.dumps(report))
    if os.environ.get("CORTEX_SOAK_REPORT"):
        with open(os.environ["CORTEX_SOAK_REPORT"], "w") as f:
            json.dump(report, f)
    assert totals["ops"] > 1000 and kills == 1 and persists >= 1
