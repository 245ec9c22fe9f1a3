"""Pinning a pool in pieces on a thread of its own (cortex_cache/pinning.py): CUDA host registration through a fake
CUDA runtime (this machine has no GPU), and mlock for real.

The fake records every call and can refuse the Nth piece or hold it until the
test lets it go (events, never sleeps); pools are real shared memory.
"""

from __future__ import annotations

import logging
import os
import resource
import threading

import pytest

from cortex_cache import GpuUnavailable, Pool, PoolClosed, UsageError, gpu, pinning
from cortex_cache.layout import PAGE
from tests.helpers import as_user

MiB = 1 << 20
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister as torch.cuda.cudart() offers them, recording each call.

    `fail_at`: the index of the register call that returns cudaErrorMemoryAllocation.  `hold_at`: the index of
    the register call that waits, once it has started (`held` set), until `release` is set."""

    def __init__(self, fail_at: int | None = None, hold_at: int | None = None) -> None:
        self.fail_at, self.hold_at = fail_at, hold_at
        self.registers: list[tuple[int, int, int]] = []  # (addr, nbytes, flags), each call
        self.unregisters: list[int] = []
        self.live: dict[int, int] = {}  # addr -> nbytes, registered now
        self.held, self.release = threading.Event(), threading.Event()
        self.lock = threading.Lock()

    def cudaHostRegister(self, addr: int, nbytes: int, flags: int) -> int:
        with self.lock:
            i = len(self.registers)
            self.registers.append((addr, nbytes, flags))
        if i == self.hold_at:
            self.held.set()
            assert self.release.wait(60), "the test never released the held piece"
        if i == self.fail_at:
            return CUDA_ERROR_MEMORY_ALLOCATION
        with self.lock:
            for a, n in self.live.items():  # the driver refuses overlapping registrations
                if a < addr + nbytes and addr < a + n:
                    return 712  # cudaErrorHostMemoryAlreadyRegistered
            self.live[addr] = nbytes
        return 0

    def cudaHostUnregister(self, addr: int) -> int:
        with self.lock:
            self.unregisters.append(addr)
            return 0 if self.live.pop(addr, None) is not None else CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED

    def cudaGetErrorString(self, err: int) -> str:
        return {2: "cudaErrorMemoryAllocation"}.get(err, f"error {err}")

    def ok(self) -> list[tuple[int, int]]:
        """(addr, nbytes) of the register calls that succeeded, in order."""
        return [(a, n) for i, (a, n, _) in enumerate(self.registers) if i != self.fail_at]


@pytest.fixture
def pool(make_pool) -> Pool:
    return make_pool("8M", block_size="16K")


def _pieces_expected(p: Pool, piece: int) -> list[tuple[int, int]]:
    addr, total = p.core.data_region()
    return [(addr + at, min(piece, total - at)) for at in range(0, total, piece)]


def test_pieces_cover_the_data_region_exactly_in_order_and_close_unregisters_them(pool):
    fake = FakeCudart()
    reg = gpu.pin_memory(pool, piece=MiB + 1, cudart=fake)  # rounded up to whole blocks and pages
    piece = reg.piece_bytes
    assert piece == MiB + 16384 and piece % PAGE == 0 and piece % pool.geometry.block_size == 0
    addr, total = pool.core.data_region()
    assert total % piece  # a short last piece
    assert [(a, n) for a, n, _ in fake.registers] == _pieces_expected(pool, piece)
    assert sum(n for _, n, _ in fake.registers) == total
    assert {f for _, _, f in fake.registers} == {1}  # cudaHostRegisterPortable
    assert reg.done and reg.complete and reg.error is None and reg.pinned_bytes == total
    assert gpu.is_pinned(pool) and gpu.pinned_memory(pool) is reg
    assert gpu.pin_memory(pool, cudart=FakeCudart()) is reg  # once per handle
    pool.close()
    assert fake.unregisters == [a for a, _, _ in reversed(fake.registers)] and fake.live == {}
    assert not gpu.is_pinned(pool) and gpu.pinned_memory(pool) is None and reg.closed
    reg.close()  # twice: nothing more
    assert len(fake.unregisters) == len(fake.registers)


def test_attach_returns_while_the_registration_is_held_and_the_pool_works_meanwhile(pool):
    torch = pytest.importorskip("torch")
    pool.put("k", bytes(range(256)) * 1024)
    fake = FakeCudart(hold_at=0)
    with Pool.open(pool.name) as other:  # another handle: what an engine does when it attaches
        reg = gpu.pin_memory(other, background=True, piece=MiB, cudart=fake)
        assert fake.held.wait(60)  # the first piece is under way, and pin_memory has returned
        assert not reg.done and reg.pinned_bytes == 0 and not gpu.is_pinned(other)
        assert other.get("k") == bytes(range(256)) * 1024
        got = gpu.load(other, ["k"], dtype=torch.uint8, shape=(256 * 1024,), device="cpu",
                       out=torch.empty(1, 256 * 1024, dtype=torch.uint8)).wait()
        assert bytes(got[0].numpy()) == bytes(range(256)) * 1024
        fake.release.set()
        assert reg.wait(60) and reg.complete and gpu.is_pinned(other)
    assert fake.live == {}


def test_progress_and_covers_follow_the_pieces_registered(pool):
    fake = FakeCudart(hold_at=3)
    reg = gpu.pin_memory(pool, background=True, piece=MiB, cudart=fake)
    assert fake.held.wait(60)
    off = pool.geometry.data_off
    assert reg.pinned_bytes == 3 * MiB and reg.total_bytes == pool.geometry.data_size and not reg.done
    assert reg.covers(off, 3 * MiB) and reg.covers(off + 2 * MiB, MiB)
    assert not reg.covers(off + 2 * MiB, MiB + 1) and not reg.covers(off + 3 * MiB, 1) and not reg.covers(off - 1, 1)
    assert repr(reg) == (f"Pinning(cudaHostRegister, pool {pool.name!r}, 3.0MiB of 8.0MiB in pieces of 1.0MiB, "
                         "running)")
    fake.release.set()
    assert reg.wait(60) and reg.covers(off, reg.total_bytes) and "done" in repr(reg)


def test_a_piece_that_fails_stops_there_logs_once_and_never_raises(pool, caplog):
    fake = FakeCudart(fail_at=2)
    with caplog.at_level(logging.WARNING, logger="cortex_cache.pinning"):
        reg = gpu.pin_memory(pool, background=True, piece=MiB, cudart=fake)
        assert reg.wait(60)
    assert reg.done and not reg.complete and reg.pinned_bytes == 2 * MiB
    assert "CUDA error 2 (cudaErrorMemoryAllocation)" in reg.error and "\n" not in reg.error
    assert len(fake.registers) == 3  # nothing tried after the failure
    assert [r.getMessage() for r in caplog.records] == [f"cortex_cache: {reg.error}"]
    assert not gpu.is_pinned(pool) and reg.covers(pool.geometry.data_off, 2 * MiB)
    # The pool goes on; waiting again raises nothing, and a second call is the same failed pinning.
    assert reg.wait(0) and gpu.pin_memory(pool, background=True, cudart=FakeCudart()) is reg
    with pytest.raises(GpuUnavailable, match="cudaErrorMemoryAllocation"):
        gpu.pin_memory(pool, cudart=FakeCudart())  # a caller that waits is told
    pool.close()
    assert fake.unregisters == [a for a, _ in reversed(fake.ok())] and fake.live == {}


def test_waiting_for_a_registration_that_fails_raises_and_keeps_what_was_registered(pool):
    fake = FakeCudart(fail_at=1)
    with pytest.raises(GpuUnavailable) as e:
        gpu.pin_memory(pool, piece=MiB, cudart=fake)
    assert e.value.exit_code == 69 and "the first 1.0MiB of" in str(e.value)
    assert gpu.pinned_memory(pool).pinned_bytes == MiB
    pool.close()
    assert fake.unregisters == [fake.registers[0][0]] and fake.live == {}


def test_close_during_a_registration_unregisters_what_was_registered_and_nothing_else(pool):
    fake = FakeCudart(hold_at=2)
    reg = gpu.pin_memory(pool, background=True, piece=MiB, cudart=fake)
    assert fake.held.wait(60)
    reg.cancel()  # what close() does first; then it waits for the piece under way
    fake.release.set()
    pool.close()
    assert reg.closed and reg.done and not reg.complete and reg.error is None
    assert len(fake.registers) == 3  # the held piece finished, none started after
    assert fake.unregisters == [a for a, _, _ in reversed(fake.registers)] and fake.live == {}


def test_close_from_another_thread_waits_for_the_piece_under_way(pool):
    fake = FakeCudart(hold_at=1)
    reg = gpu.pin_memory(pool, background=True, piece=MiB, cudart=fake)
    assert fake.held.wait(60)
    closer = threading.Thread(target=pool.close)
    closer.start()
    fake.release.set()
    closer.join(60)
    assert not closer.is_alive() and reg.done and reg.closed
    # However far it got before it saw the stop: every piece registered is unregistered, once.
    assert sorted(fake.unregisters) == sorted(a for a, _ in fake.ok()) and fake.live == {}


def test_a_forked_child_closes_without_unregistering_its_parents_pieces(pool):
    fake = FakeCudart()
    gpu.pin_memory(pool, piece=MiB, cudart=fake)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            pool.close()
            code = 0 if fake.unregisters == [] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fake.unregisters == [] and gpu.is_pinned(pool)


def test_bad_arguments_and_closed_pools_are_refused_before_anything_is_registered(pool):
    fake = FakeCudart()
    for bad in (0, -4096, 1.5, True, "1G"):
        with pytest.raises(UsageError, match="piece"):
            gpu.pin_memory(pool, piece=bad, cudart=fake)
    with Pool.open(pool.name) as other:
        pass
    with pytest.raises(PoolClosed):
        gpu.pin_memory(other, cudart=fake)
    assert fake.registers == [] and gpu.pinned_memory(pool) is None


# ------------------------------------------------------------------ copies cut where pieces meet


def test_cuts_split_a_range_exactly_where_pieces_meet(pool):
    off = pool.geometry.data_off
    assert pinning.cuts(pool, off + 5, 3 * MiB) == [(0, 3 * MiB)]  # no pinning: one copy
    fake = FakeCudart(hold_at=1)
    reg = gpu.pin_memory(pool, background=True, piece=MiB, cudart=fake)
    assert reg.cuts(off, MiB) == [(0, MiB)]
    assert reg.cuts(off + MiB - 10, 30) == [(0, 10), (10, 30)]
    assert reg.cuts(off + 100, 2 * MiB) == [(0, MiB - 100), (MiB - 100, 2 * MiB - 100), (2 * MiB - 100, 2 * MiB)]
    assert reg.cuts(off + MiB, MiB) == [(0, MiB)]
    assert pinning.cuts(pool, off + MiB - 10, 30) == [(0, 10), (10, 30)]
    fake.release.set()
    reg.wait(60)


def _watch_copies(monkeypatch, torch, pool: Pool, piece: int) -> list:
    """Every Tensor.copy_ that reads or writes the pool's data region; a copy over a piece boundary is recorded
    in the list returned (what CUDA refuses while one side of the boundary is registered and the other not)."""
    base, total = pool.core.data_region()
    crossed: list = []
    real = torch.Tensor.copy_

    def copy_(self, src, *a, **kw):
        for t in (self, src):
            n = t.numel() * t.element_size()
            at = t.data_ptr() - base
            if t.device.type == "cpu" and 0 <= at < total and n and at // piece != (at + n - 1) // piece:
                crossed.append((at, n))
        return real(self, src, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return crossed


def test_copies_over_piece_boundaries_are_exact_while_a_registration_is_under_way(make_pool, monkeypatch):
    torch = pytest.importorskip("torch")
    from cortex_cache import KVCache

    pool = make_pool("8M", block_size="16K")
    fake = FakeCudart(hold_at=2)  # pieces 0 and 1 registered, the rest not yet
    reg = gpu.pin_memory(pool, background=True, piece=64 * 1024, cudart=fake)
    assert fake.held.wait(60)
    crossed = _watch_copies(monkeypatch, torch, pool, reg.piece_bytes)
    xs = [torch.randn(300, 257) for _ in range(6)]  # 308,400 bytes each: every value spans pieces
    gpu.store(pool, [f"x{i}" for i in range(6)], xs).wait()
    starts = [pool.view(f"x{i}") for i in range(6)]
    assert all(len(reg.cuts(v.offset, 300 * 257 * 4)) > 1 for v in starts)
    for v in starts:
        v.release()
    got = gpu.load(pool, [f"x{i}" for i in range(6)], dtype=torch.float32, shape=(300, 257), device="cpu",
                   out=torch.empty(6, 300, 257)).wait()
    assert all(torch.equal(g, x) for g, x in zip(got, xs))
    # Into tensors of another layout and dtype than the pool's, as dst.copy_(src) takes them.
    strided = torch.empty(257, 300).t()
    wide = torch.empty(300, 257, dtype=torch.float64)
    gpu.load(pool, ["x0", "x1"], dtype=torch.float32, shape=(300, 257), device="cpu", out=[strided, wide]).wait()
    assert torch.equal(strided, xs[0]) and torch.equal(wide, xs[1].double())
    # The KV layer's copies, both ways, into and out of strided tensors.
    kv = KVCache(pool, model="m", num_layers=2, num_heads=3, head_dim=64, dtype=torch.float16, chunk_tokens=64)
    tokens = list(range(256))
    past = torch.randn(2, 2, 256, 3, 64).to(torch.float16)
    kv.store(tokens, past.transpose(3, 4).contiguous().transpose(3, 4))  # a non-contiguous source
    out = torch.zeros(2, 2, 256, 3, 64, dtype=torch.float16)
    assert kv.retrieve(tokens, out=out)[0] == 256 and torch.equal(out, past)
    assert pool.verify()["ok"] and pool.stats()["pinned_entries"] == 0
    assert crossed == []  # no copy ran over two pieces
    fake.release.set()
    assert reg.wait(60) and reg.complete


def test_without_a_registration_copies_are_whole(make_pool, monkeypatch):
    torch = pytest.importorskip("torch")
    pool = make_pool("8M", block_size="16K")
    crossed = _watch_copies(monkeypatch, torch, pool, 64 * 1024)
    x = torch.randn(300, 257)
    gpu.store(pool, ["x"], [x]).wait()
    got = gpu.load(pool, ["x"], dtype=torch.float32, shape=(300, 257), device="cpu", out=torch.empty(1, 300, 257))
    assert torch.equal(got.wait()[0], x) and len(crossed) == 2  # the watch sees what the test above forbids


# ------------------------------------------------------------------ mlock, for real


def _locked_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


def _can_lock(nbytes: int) -> bool:
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= nbytes + 64 * MiB


def test_mlock_locks_the_data_region_in_pieces_and_close_unlocks_it(pool):
    total = pool.geometry.data_size
    if not _can_lock(total):
        pytest.skip("this process may not lock 8 MiB (RLIMIT_MEMLOCK)")
    before = _locked_kib()
    reg = pinning.mlock(pool, piece=MiB)
    assert reg.complete and reg.pinned_bytes == total and reg.what == "mlock"
    assert _locked_kib() - before == total // 1024
    pool.close()
    assert _locked_kib() == before and reg.closed


def test_mlock_over_the_limit_stops_at_the_piece_refused(make_pool):
    pool = make_pool("8M", block_size="16K", mode=0o666)  # another user opens it by name

    def unprivileged() -> int:
        # A process without CAP_IPC_LOCK may lock RLIMIT_MEMLOCK bytes: two pieces here.
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (2 * MiB, 2 * MiB))
        with Pool.open(pool.name) as p:
            reg = pinning.mlock(p, background=True, piece=MiB)
            reg.wait(60)
            if reg.pinned_bytes != 2 * MiB or "RLIMIT_MEMLOCK is 2097152 bytes" not in (reg.error or ""):
                return 1
            if _locked_kib() != 2048:
                return 2
            try:
                pinning.mlock(p, piece=MiB)  # waiting: the same pinning, and its error raised
                return 3
            except Exception as e:
                if getattr(e, "exit_code", None) != 69:
                    return 4
        return 0 if _locked_kib() == 0 else 5

    assert as_user(unprivileged) == 0
