"""cortex_cache.gpu on a machine without CUDA (the same calls on CPU tensors), and Pool.reserve_write."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from cortex_cache import GpuUnavailable, KeyNotFound, Pool, PoolFull, UsageError, gpu  # noqa: E402
from tests.helpers import REPO, cli, run_py, spawn_py  # noqa: E402

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def _pins(p: Pool, key: str) -> int:
    return p.info(key)["pins"]


def test_entry_tensor_is_zero_copy_and_pins_while_any_view_lives(make_pool):
    p = make_pool("4M")
    src = torch.arange(4096, dtype=torch.float32)
    p.put("t", src)
    t = gpu.entry_tensor(p, "t", torch.float32, (64, 64))
    assert torch.equal(t.reshape(-1), src) and _pins(p, "t") == 1
    row = t[3]  # a view keeps the storage, hence the pin
    del t
    gc.collect()
    assert _pins(p, "t") == 1
    # Zero copy: the tensor reads the pool's bytes in place.
    base, _ = p.core.data_region()
    assert row.data_ptr() == base + p.info("t")["first_block"] * p.geometry.block_size + 3 * 64 * 4
    assert torch.equal(row, src[192:256])
    # A pinned entry is not reused: delete unlinks it, the bytes stay until the tensor goes.
    p.delete("t")
    p.put("u", torch.zeros(4096))
    assert torch.equal(row, src[192:256])
    del row
    gc.collect()
    assert p.stats()["pinned_entries"] == 0


def test_entry_tensor_checks_its_arguments(make_pool):
    p = make_pool("4M")
    p.put("t", bytes(100))
    with pytest.raises(KeyNotFound):
        gpu.entry_tensor(p, "nope", torch.uint8)
    assert p.stats()["pinned_entries"] == 0


def test_entry_tensor_shapes(make_pool):
    p = make_pool("4M")
    p.put("t", bytes(100))
    assert gpu.entry_tensor(p, "t", torch.float32).shape == (25,)
    assert gpu.entry_tensor(p, "t", "uint8", (10, 10)).shape == (10, 10)
    assert gpu.entry_tensor(p, "t", torch.uint8, (4,), offset=96).shape == (4,)
    for dtype, shape in ((torch.float64, None), (torch.float32, (3, 3)), ("nosuch", None)):
        with pytest.raises(UsageError):
            gpu.entry_tensor(p, "t", dtype, shape)
    gc.collect()
    assert p.stats()["pinned_entries"] == 0


@needs_no_cuda
def test_asking_for_cuda_without_it_is_a_clean_error(make_pool):
    p = make_pool("4M")
    p.put("t", bytes(16))
    with pytest.raises(GpuUnavailable) as e:
        gpu.load(p, ["t"], dtype=torch.uint8, shape=(16,), device="cuda")
    assert e.value.exit_code == 69
    assert p.stats()["pinned_entries"] == 0
    assert gpu.pin_memory(p) is None and not gpu.is_pinned(p)
    assert not gpu.cuda_available()


def test_store_and_load_round_trip_on_cpu(make_pool):
    p = make_pool("16M")
    xs = [torch.randn(300, 7), torch.arange(1000, dtype=torch.int64).reshape(10, 100)]
    with gpu.store(p, ["a", "b"], xs) as tr:
        assert "a" not in p  # invisible until the transfer is waited for
    assert tr.done() and p.get("b") == xs[1].numpy().tobytes()
    got = gpu.load(p, ["a"], dtype=torch.float32, shape=(300, 7), device="cpu").wait()
    assert torch.equal(got[0], xs[0])
    out = torch.zeros(2, 300, 7)
    p.put("a2", xs[0])
    gpu.load(p, ["a", "a2"], dtype=torch.float32, shape=(300, 7), device="cpu", out=out).wait()
    assert torch.equal(out[0], xs[0]) and torch.equal(out[1], xs[0])
    assert p.verify()["ok"] and p.stats()["pinned_entries"] == 0


def test_a_store_checksums_its_values_in_groups_each_under_its_own_value(make_pool):
    """Values checksummed in jobs of CHECKSUM_GROUP_BYTES: several groups, a last short one, and every
    value committed with its own checksum (verify re-hashes each)."""
    p = make_pool("64M")
    sizes = [3 << 20, 3 << 20, 3 << 20, 5 << 20, 1 << 20, 4096]  # groups: 9 MiB, 9 MiB (crossed), 1 MiB + 4 KiB
    assert sum(sizes[:3]) >= gpu.CHECKSUM_GROUP_BYTES > sum(sizes[:2])
    xs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    keys = [f"v{i}" for i in range(len(xs))]
    gpu.store(p, keys, xs).wait()
    assert [p.get(k) for k in keys] == [x.numpy().tobytes() for x in xs]
    report = p.verify()
    assert report["ok"] and report["entries"] == len(xs), report
    # verify re-hashes every value (so the check above could fail): one flipped byte fails it.
    p.put("w", xs[0])
    off = p.geometry.data_off + p.info("w")["first_block"] * p.geometry.block_size
    p.core.mv[off + 5] ^= 0xFF
    assert not p.verify()["ok"]
    p.delete("w")


def test_load_of_a_missing_key_copies_nothing_and_pins_nothing(make_pool):
    p = make_pool("4M")
    p.put("a", bytes(64))
    out = torch.full((2, 64), 7, dtype=torch.uint8)
    with pytest.raises(KeyNotFound):
        gpu.load(p, ["a", "missing"], dtype=torch.uint8, shape=(64,), device="cpu", out=out)
    assert torch.all(out == 7) and p.stats()["pinned_entries"] == 0
    with pytest.raises(UsageError):
        gpu.load(p, ["a"], dtype=torch.uint8, shape=(65,), device="cpu")
    assert p.stats()["pinned_entries"] == 0


def test_store_that_cannot_fit_leaves_nothing_behind(make_pool):
    p = make_pool("1M", block_size="64K")
    with pytest.raises(PoolFull):
        with _pinned_all(p):
            gpu.store(p, ["big"], [torch.zeros(300_000, dtype=torch.uint8)])
    assert "big" not in p and p.stats()["writing_entries"] == 0
    with pytest.raises(UsageError):
        gpu.store(p, ["x", "y"], [torch.zeros(4)])
    with pytest.raises(UsageError):
        gpu.store(p, ["x"], [torch.zeros(4, 4).t()])


class _pinned_all:
    """Fill the pool with entries held by views, so nothing can be evicted."""

    def __init__(self, p: Pool) -> None:
        self.p = p
        self.views = []

    def __enter__(self):
        for i in range(16):
            self.p.put(f"fill{i}", bytes(60_000))
            self.views.append(self.p.view(f"fill{i}"))
        return self

    def __exit__(self, *exc):
        for v in self.views:
            v.release()


def test_gather_and_scatter_between_chunks_and_a_paged_cache():
    layers = [torch.randn(2, 10, 4, 3, 8) for _ in range(3)]  # [2, num_blocks, block_size, heads, head_dim]
    chunk = gpu.gather_blocks(layers, [7, 2])
    assert chunk.shape == (3, 2, 8, 3, 8)
    assert torch.equal(chunk[1, :, :4], layers[1][:, 7]) and torch.equal(chunk[2, :, 4:], layers[2][:, 2])
    fresh = [torch.zeros_like(t) for t in layers]
    gpu.scatter_blocks(chunk, fresh, torch.tensor([0, 9]))
    assert all(torch.equal(f[:, 0], t[:, 7]) and torch.equal(f[:, 9], t[:, 2]) for f, t in zip(fresh, layers))
    assert all(torch.count_nonzero(f[:, 1:9]) == 0 for f in fresh)
    for bad in ([10], [-1]):
        with pytest.raises(UsageError):
            gpu.gather_blocks(layers, bad)
    with pytest.raises(UsageError):
        gpu.scatter_blocks(chunk, fresh, [1])
    with pytest.raises(UsageError):
        gpu.gather_blocks([torch.zeros(3, 10, 4, 3, 8)], [1])


def test_store_blocks_and_load_blocks_through_the_pool(make_pool):
    p = make_pool("16M")
    layers = [torch.randn(2, 32, 16, 4, 16, dtype=torch.float16) for _ in range(4)]
    gpu.store_blocks(p, "chunk0", layers, [3, 30, 8]).wait()
    fresh = [torch.zeros_like(t) for t in layers]
    gpu.load_blocks(p, "chunk0", fresh, [0, 1, 2]).wait()
    assert all(torch.equal(f[:, :3], t[:, [3, 30, 8]]) for f, t in zip(fresh, layers))
    assert p.stats()["pinned_entries"] == 0


def test_reserve_write_commit_abort_and_context(make_pool):
    p = make_pool("4M")
    w = p.reserve_write("k", 10, ttl=60, priority=3)
    w.memoryview[:] = b"0123456789"
    assert "k" not in p and p.stats()["writing_entries"] == 1
    w.commit()
    assert p.get("k") == b"0123456789" and p.info("k")["priority"] == 3 and p.info("k")["ttl_remaining"] > 50
    with pytest.raises(UsageError):
        w.commit()
    with p.reserve_write("k", 3) as mv:
        mv[:] = b"new"
    assert p.get("k") == b"new"
    with pytest.raises(RuntimeError):
        with p.reserve_write("k", 3) as mv:
            mv[:] = b"bad"
            raise RuntimeError("the copy failed")
    assert p.get("k") == b"new" and p.stats()["writing_entries"] == 0
    p.reserve_write("gone", 5).abort()
    assert "gone" not in p and p.verify()["ok"]
    for bad in (-1, 1.5):
        with pytest.raises(UsageError):
            p.reserve_write("x", bad)


def test_a_writer_killed_before_commit_leaves_nothing_visible(make_pool):
    p = make_pool("4M")
    child = spawn_py(f"""
        import sys
        from cortex_cache import Pool
        p = Pool.open({p.name!r})
        w = p.reserve_write("half", 200_000)
        w.memoryview[:100] = b"x" * 100
        print("reserved", flush=True)
        sys.stdin.read()
    """)
    assert child.stdout.readline().strip() == b"reserved"
    child.send_signal(signal.SIGKILL)
    child.wait()
    for f in (child.stdin, child.stdout, child.stderr):
        f.close()
    assert "half" not in p and p.stats()["writing_entries"] == 1
    p.verify(repair=True)
    assert p.stats()["writing_entries"] == 0 and p.stats()["blocks_used"] == 0


def test_importing_cortex_cache_and_the_cli_never_load_torch():
    out = run_py("""
        import sys, cortex_cache
        from cortex_cache import Pool, KVCache, gpu
        print("torch" in sys.modules)
    """).stdout
    assert out.strip() == b"False"
    r = cli("cache", "list")
    assert r.returncode == 0


GPU_CHECK = [sys.executable, str(REPO / "scripts" / "gpu_check_connector.py")]


def test_the_connectors_gpu_check_passes_on_the_cpu(tmp_path):
    """scripts/gpu_check_connector.py (run with CUDA on a GPU machine) kept from rotting: the same checks on CPU
    tensors, at small sizes; any check that fails makes it exit 1 (and print FAILED)."""
    report = tmp_path / "check.json"
    r = subprocess.run([*GPU_CHECK, "--device", "cpu", "--layers", "2", "--kv-heads", "2", "--head-size", "16",
                        "--cache-blocks", "32", "--blocks", "8", "--reps", "1", "--json", str(report)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and "FAILED" not in r.stdout, r.stdout + r.stderr
    oks = [line for line in r.stdout.splitlines() if line.startswith("ok: ")]
    assert len(oks) == 7 and all("bit-exact" in line for line in oks[:5]), r.stdout
    assert "per-layer loads (LBHNC -> LBNHC, LBNHC -> BLHNC, BLHNC -> LBHNC, LBHNC/2 -> LBHNC/2)" in oks[4]
    assert "7 checks passed on CPU" in r.stdout and "GB/s" in r.stdout and "overlap" in r.stdout
    assert "may run its first layer" in r.stdout
    got = json.loads(report.read_text())
    assert got["failed"] == [] and len(got["checks"]) == 7
    assert all(got["figures"][k] > 0 for k in ("save_inline_gbps", "save_saver_gbps", "load_gbps", "baseline_d2h_gbps"))
    assert all(got["figures"]["per_layer"][k] > 0 for k in ("load_gbps", "first_layer_s", "forward_s"))


@needs_no_cuda
def test_the_connectors_gpu_check_without_cuda_exits_69():
    r = subprocess.run(GPU_CHECK, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 69 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
