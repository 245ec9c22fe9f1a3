"""The SGLang HiCache backend, driven by SGLang's real classes in the SGLang venv.

SGLang lives in a virtualenv of its own (scripts/sglang_venv.sh; `.ci/run`
builds it, sets CORTEX_TEST_SGLANG_PYTHON and runs these with `-m engine`).
Each test runs tests/sglang_harness.py there: the backend made by SGLang's
storage backend factory from the documented JSON, SGLang's own host KV
pools, SGLang's own page hashes.  SGLang takes ~15 s to import, so each process runs several
scenarios.  The tests without SGLang check what needs none.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from cortex_cache import Pool, UsageError
from cortex_cache.integrations import sglang as cortex_sglang
from tests.helpers import REPO, cli, run_py

SGLANG_PY = os.environ.get("CORTEX_TEST_SGLANG_PYTHON")


def needs_sglang(test):
    """Refereed by SGLang: run by `pytest -m engine`, and skipped there unless CORTEX_TEST_SGLANG_PYTHON is set."""
    return pytest.mark.engine(pytest.mark.skipif(not SGLANG_PY, reason="set CORTEX_TEST_SGLANG_PYTHON to a Python "
                                                 "with SGLang (scripts/sglang_venv.sh; .ci/run does)")(test))


HARNESS = str(REPO / "tests" / "sglang_harness.py")


def harness(*scenarios: tuple[str, dict], timeout: float = 240) -> list[dict]:
    """Run scenarios in one fresh SGLang process; their results."""
    # No Hugging Face cache: the made-up hub names of the cases must not find a snapshot there (the weights'
    # identity of their keys is "unknown" on every machine).
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(REPO / "tests" / "no-hf-cache"),
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([SGLANG_PY, "-W", "ignore", HARNESS, json.dumps(scenarios)], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


CASES = [  # (kind, host layout, interface v1?, model, seed, salt, pages copied by the backend's threads?)
    ("mha", "page_first", True, "Qwen/Qwen3-0.6B", 1, "a", True),
    ("mha", "layer_first", False, "Qwen/Qwen3-0.6B", 2, "b", False),
    ("mla", "page_first", True, "deepseek-ai/DeepSeek-V2-Lite", 3, "c", False),
    ("mla", "layer_first", False, "deepseek-ai/DeepSeek-V2-Lite", 4, "d", False),
    ("mla", "layer_first", True, "deepseek-ai/DeepSeek-V2-Lite", 5, "e", True),
]


def _case(pool: str, kind: str, layout: str, v1: bool, model: str, seed: int, salt: str, parallel: bool = False,
          **more) -> dict:
    return {"pool": pool, "kind": kind, "layout": layout, "v1": v1, "model": model, "seed": seed, "salt": salt,
            "parallel": parallel, "pages": 5, **more}


@needs_sglang
def test_pages_set_by_one_process_are_read_exactly_by_another_after_persist_delete_restore(make_pool, tmp_path):
    p = make_pool("64M")
    name = p.name
    written = harness(*[("set", _case(name, *c)) for c in CASES])
    for w in written:
        assert w["cls"] == "CortexHiCacheStorage"  # made by SGLang's factory from the documented JSON
        assert w["stored"] == [True] * 5 and w["again"] == [True] * 5
        assert w["stats"]["stored"] == 5 and w["stats"]["already_stored"] == 5  # stored once, not copied again
    assert len(p.keys(prefix="sglang/Qwen/Qwen3-0.6B/unknown/mha/tp0of1/")) == 10
    assert len(p.keys(prefix="sglang/deepseek-ai/DeepSeek-V2-Lite/unknown/mla/")) == 15

    snap = tmp_path / "l3.ccsnap"
    assert cli("cache", "persist", name, "-o", str(snap)).returncode == 0
    p.close()
    assert cli("cache", "delete", name).returncode == 0
    assert cli("cache", "restore", name, "-i", str(snap)).returncode == 0

    reads = [("get", _case(name, *c)) for c in CASES]
    other_model = ("get", _case(name, "mha", "page_first", True, "meta-llama/Llama-3.2-1B", 1, "a"))
    other_rank = ("get", _case(name, "mha", "page_first", True, "Qwen/Qwen3-0.6B", 1, "a", tp_rank=1, tp_size=2))
    mla_rank = ("get", _case(name, "mla", "page_first", True, "deepseek-ai/DeepSeek-V2-Lite", 3, "c", tp_rank=1,
                             tp_size=2))
    other_layout = ("get", _case(name, "mha", "layer_first", True, "Qwen/Qwen3-0.6B", 1, "a"))
    *got, model2, rank1, mla1, layout2 = harness(*reads, other_model, other_rank, mla_rank, other_layout)
    for g, case in zip(got, CASES):
        if not case[2]:  # the flat interface's batch_get answers per key, past a miss
            assert g["flat_gap"] == [True, False, True] and g["flat_gap_exact"]
        # batch_exists counts the leading hits and stops at the first miss, even with hits after it.
        assert g["exists"] == 5 and g["exists_gap"] == 2 and g["single"] is True
        assert g["loaded"] == [True] * 5 and g["exact"] == [True] * 5
        assert g["stats"]["hits"] == 5 and g["stats"]["corrupt"] == 0 and g["stats"]["errors"] == 0
    # Another model, or another rank's MHA heads, see none of these pages; MLA pages are shared by every rank.
    for g in (model2, rank1):
        assert g["exists"] == 0 and g["loaded"] == [False] * 5 and not any(g["exact"])
    assert mla1["exists"] == 5 and mla1["exact"] == [True] * 5
    # Same model and page hashes, another host layout (another byte order): a miss, never misread.
    assert layout2["exists"] == 0 and layout2["loaded"] == [False] * 5 and not any(layout2["exact"])


@needs_sglang
def test_a_peer_killed_mid_set_leaves_misses_then_faults_and_injected_failures_never_raise(make_pool):
    kill_pool, fault_pool, tiny, inject = make_pool("64M"), make_pool("64M"), make_pool("16K", block_size="4K"), \
        make_pool("64M")
    case = _case(kill_pool.name, "mha", "page_first", True, "Qwen/Qwen3-0.6B", 9, "kill")  # two batches
    proc = subprocess.Popen([SGLANG_PY, "-W", "ignore", HARNESS, json.dumps([("hang_mid_set", case)])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == b"mid-set", proc.stderr.read()[-3000:]  # type: ignore[union-attr]
        proc.send_signal(signal.SIGKILL)  # one batch of two pages committed; the next reserved, half-copied
    finally:
        proc.kill()
        proc.wait()
    after_kill, refill, faults, too_small, injected, sig = harness(
        ("get", {**case, "parallel": True}),
        ("set", case),
        ("faults", {"pool": fault_pool.name, "kind": "mla", "size": "64M"}),
        ("too_small", {"pool": tiny.name, "kind": "mha"}),
        ("injected_failures", {"pool": inject.name, "kind": "mha"}),
        ("signatures", {}),
    )
    # The killed writer's first batch is there, its half-written one is not (and the pages
    # after the miss, loaded by the copy threads all at once, are not reported).
    assert after_kill["exists"] == 2 and after_kill["loaded"] == [True, True, False, False, False]
    assert after_kill["exact"][:2] == [True, True]
    assert refill["stored"] == [True] * 5 and refill["stats"]["stored"] == 3  # only the three missing ones

    f = faults
    assert f["stored"] == [True] * 4
    # Damaged in place: a miss, counted, wiped from SGLang's buffer; the page before it loads exactly.
    assert f["corrupt_loaded"] == [True, False, False, False] and f["corrupt_wiped"] and f["corrupt_first_exact"]
    assert f["stats_reader"]["corrupt"] == 1
    assert f["moved_exists"] == 1 and f["stats_reader"]["foreign"] >= 1  # another page's bytes are not this page
    # Pool deleted under the backend: misses and failed stores; once it exists again, used again.
    assert f["deleted_exists"] == 0 and f["deleted_get"] == [False] * 4 and f["deleted_set"] == [False] * 4
    assert f["recreated_set"] == [True] * 4 and f["recreated_get"] == [True] * 4 and f["recreated_exact"]
    # Full of pinned entries: failed stores, counted; stores work again once they are released.
    assert f["full_set"] == [False, False] and f["after_full_set"] == [True, True]
    assert f["stats_writer"]["store_failed"] == 2 and f["stats_writer"]["unavailable"] == 4
    assert f["stats_writer"]["errors"] == 0 and f["stats_reader"]["errors"] == 0

    assert too_small["stored"] == [False, False] and too_small["stats"]["store_failed"] == 2

    # SGLang's own failure injection wraps the backend; whatever comes through is right.
    assert injected["wrapped"] == "HiCacheStorageFailureInjector" and injected["inner"] == "CortexHiCacheStorage"
    assert injected["wrong"] == 0 and injected["stored_any"]

    # The methods we override have SGLang's signatures; the host-pool methods we call exist as we call them.
    assert sig["mismatched"] == [] and sig["abstract"] == []
    for methods in sig["host"].values():
        assert methods["get_page_buffer_meta"] == ["self", "indices"]
        assert methods["get_dummy_flat_data_page"] == ["self"]
        assert methods["get_data_page"] == ["self", "index", "flat"]
        assert methods["set_from_flat_data_page"] == ["self", "index", "data_page"]


# ---------------------------------------------------------------------- without SGLang


def _config(**extra) -> SimpleNamespace:
    return SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, dcp_rank=0,
                           dcp_size=1, is_mla_model=False, enable_storage_metrics=False, model_name="m",
                           extra_config=extra)


def test_importing_the_backend_needs_no_sglang_nor_torch():
    out = run_py("""
        import sys
        import cortex_cache.integrations.sglang as m
        print("sglang" in sys.modules, "torch" in sys.modules, hasattr(m, "CortexHiCache"))
    """).stdout
    assert out.split() == [b"False", b"False", b"True"]


def test_extra_config_errors_and_a_missing_pool_is_no_error(pool_name):
    with pytest.raises(UsageError, match="needs \"pool\""):
        cortex_sglang.CortexHiCache(_config(interface_v1=1))
    with pytest.raises(UsageError, match="unknown .* sise"):
        cortex_sglang.CortexHiCache(_config(pool=pool_name, sise="1G"))
    with pytest.raises(UsageError, match="workers"):
        cortex_sglang.CortexHiCache(_config(pool=pool_name, workers=0))
    with pytest.raises(UsageError, match="needs \"size\""):
        cortex_sglang.CortexHiCache(_config(pool=pool_name, create=True))
    assert not Pool.exists(pool_name)
    # A pool that does not exist yet: SGLang starts, every lookup misses until it does.
    b = cortex_sglang.CortexHiCache(_config(pool=pool_name, backend_name="cortex", interface_v1=1))
    assert b.batch_exists(["a", "b"]) == 0 and b.get("a") is None and b.set("a", None) is False
    assert b.stats["unavailable"] == 4  # two pages looked up, one loaded, one stored
    b.close()


@needs_sglang
def test_pages_of_weights_saved_again_under_the_same_path_are_never_served(make_pool, tmp_path):
    """Issue 43: SGLang names the model by its path; re-saved weights there make other keys, so a restarted
    SGLang never loads the old weights' pages (its page hashes name tokens only)."""
    from cortex_cache.weights import identity
    from tests.test_weights import _checkpoint

    ck = _checkpoint(tmp_path / "qwen", seed=0)
    p = make_pool("16M")
    case = _case(p.name, "mha", "page_first", True, str(ck), 1, "w")
    w, same = harness(("set", case), ("get", case))
    prefix = f"sglang/{ck}/{identity(ck)}/mha/tp0of1/"
    assert w["stored"] == [True] * 5 and w["key_prefix"].startswith(prefix) and len(p.keys(prefix=prefix)) == 5
    assert same["loaded"] == same["exact"] == [True] * 5  # the same weights: every page served
    _checkpoint(tmp_path / "qwen", seed=1)  # re-saved with other values: the same names, shapes, sizes
    [after] = harness(("get", case))
    assert after["exists"] == 0 and after["loaded"] == [False] * 5 and after["stats"]["foreign"] == 0
    assert after["key_prefix"].startswith(f"sglang/{ck}/{identity(ck)}/") and identity(ck) not in prefix
    # The old weights' pages, retired by their prefix.
    assert cli("cache", "evict", p.name, "--prefix", f"sglang/{ck}/{prefix.split('/')[-4]}/").returncode == 0
    assert p.keys(prefix="sglang/") == []


def test_create_makes_the_pool_with_the_given_tiers(pool_name, tmp_path):
    b = cortex_sglang.CortexHiCache(_config(pool=pool_name, create=True, size="8M", policy="fifo",
                                            disk_path=str(tmp_path / "t"), disk_size="32M", namespace="l3/"))
    try:
        st = Pool.open(pool_name)
        try:
            s = st.stats()
            assert s["policy"] == "fifo" and s["disk"]["capacity_bytes"] == 32 << 20
        finally:
            st.close()
        assert b.key_prefix == "l3/m/unknown/mha/tp0of1/"  # "m" names no checkpoint: not tied to weights
    finally:
        b.close()
        Pool.unlink(pool_name)


def test_the_backend_class_needs_sglang_when_asked_for():
    try:
        import sglang  # noqa: F401
        pytest.skip("SGLang is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError):
        cortex_sglang.CortexHiCacheStorage  # noqa: B018
    assert "sglang" not in sys.modules
