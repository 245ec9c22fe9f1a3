"""Leading-chunk lookups remembered per request (cortex_cache/lookups.py): a repeat never answers stale.

Every change that can make a remembered answer wrong is made here for real
-- from another process where it can come from one (delete, eviction, a
replacement, a pool filled until it evicts), by the clock for expiry -- and
the next lookup must see it.  Each answer is compared with the un-remembered
one (`Pool.leading`, `KVCache.lookup` without a request id).
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from cortex_cache import LookupMemo, Pool, UsageError
from cortex_cache.layout import H_GONE_SEQ
from tests.helpers import run_py

PREFIX = "req/"


def _digests(n: int, salt: bytes = b"") -> list[bytes]:
    out, prev = [], bytes(32)
    for i in range(n):
        prev = hashlib.sha256(prev + salt + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


def _key(d: bytes) -> str:
    return PREFIX + d.hex()


def _put(pool: Pool, digests: list[bytes], **kw) -> None:
    for d in digests:
        pool.put(_key(d), b"x" * 100, **kw)


def _in_child(pool: Pool, body: str, *args: str) -> None:
    """Run `body` in another process with the pool open as `pool` and `keys` = args as pool keys."""
    run_py(f"""
        import sys
        from cortex_cache import Pool
        keys = sys.argv[2:]
        with Pool.open(sys.argv[1]) as pool:
            {body}
    """, pool.name, *args)


def test_pool_leading_is_contains_many_up_to_its_first_false(make_pool):
    pool = make_pool("4M")
    d = _digests(6)
    _put(pool, d[:2] + d[3:])
    keys = [_key(x) for x in d]
    assert pool.contains_many(keys) == [True, True, False, True, True, True]
    assert pool.leading(keys) == 2
    assert pool.leading(keys[3:]) == 3 and pool.leading([]) == 0
    assert pool.leading([keys[0], "", keys[1]]) == 1  # a bad key is not there, as contains_many says


@pytest.mark.parametrize("how", ["delete", "evict", "replace"])
def test_a_repeat_sees_a_remembered_chunk_leave_from_another_process(make_pool, how):
    pool = make_pool("4M")
    d = _digests(8)
    _put(pool, d)
    memo = LookupMemo(PREFIX)
    assert memo.leading(pool, "r", d) == 8
    seq = int(pool.core.counters[H_GONE_SEQ])
    body = {
        "delete": "pool.delete(keys[0])",
        "evict": "pool.evict(keys=keys)",
        # A put over a key takes the old entry out of memory first; the new one is live at once.
        "replace": "pool.put(keys[0], b'y' * 5000); pool.delete(keys[1])",
    }[how]
    _in_child(pool, body, _key(d[3]), _key(d[5]))
    assert int(pool.core.counters[H_GONE_SEQ]) > seq  # what the memo relies on: the shared counter moved
    want = 3 if how != "replace" else 5
    assert memo.leading(pool, "r", d) == want == pool.leading([_key(x) for x in d])


def test_a_repeat_sees_chunks_evicted_for_room_by_another_process(make_pool):
    pool = make_pool(64 * 4096, block_size="4K", policy="fifo")
    d = _digests(8)
    _put(pool, d)
    memo = LookupMemo(PREFIX)
    assert memo.leading(pool, "r", d) == 8
    # Another process fills the pool: the oldest entries (ours, fifo) are evicted for room.
    _in_child(pool, "[pool.put(f'fill/{i}', b'z' * 4096) for i in range(60)]")
    assert pool.leading([_key(x) for x in d]) < 8
    assert memo.leading(pool, "r", d) == pool.leading([_key(x) for x in d])


def test_an_expired_chunk_is_not_counted_though_nothing_removed_it(make_pool):
    now = [1000.0]
    pool = make_pool("4M", clock=lambda: now[0])
    d = _digests(6)
    _put(pool, d[:2])
    _put(pool, d[2:3], ttl=10)
    _put(pool, d[3:])
    memo = LookupMemo(PREFIX)
    assert memo.leading(pool, "r", d) == 6
    seq = int(pool.core.counters[H_GONE_SEQ])
    now[0] += 11
    assert int(pool.core.counters[H_GONE_SEQ]) == seq  # expiry is lazy: the counter did not move
    assert memo.leading(pool, "r", d) == 2 == pool.leading([_key(x) for x in d])


def test_a_chunk_added_after_the_lookup_is_found(make_pool):
    pool = make_pool("4M")
    d = _digests(8)
    _put(pool, d[:3])
    memo = LookupMemo(PREFIX)
    assert memo.leading(pool, "r", d) == 3
    _in_child(pool, "[pool.put(k, b'x' * 100) for k in keys]", *[_key(x) for x in d[3:6]])
    assert memo.leading(pool, "r", d) == 6
    _put(pool, d[6:])
    assert memo.leading(pool, "r", d) == 8


def test_a_range_is_counted_from_where_it_is_asked(make_pool):
    pool = make_pool("4M")
    d = _digests(8)
    _put(pool, d[:5])
    memo = LookupMemo(PREFIX)
    assert memo.leading(pool, "r", d, 0, 3) == 3
    assert memo.leading(pool, "r", d, 2) == 3
    assert memo.leading(pool, "r", d, 6) == 0
    pool.delete(_key(d[1]))
    assert memo.leading(pool, "r", d, 0) == 1
    assert memo.leading(pool, "r", d, 2, 4) == 2


def test_a_longer_chain_of_the_request_goes_on_and_another_chain_starts_afresh(make_pool):
    pool = make_pool("4M")
    d = _digests(8)
    _put(pool, d[:6])
    memo = LookupMemo(PREFIX)
    assert memo.leading(pool, "r", d[:4]) == 4
    assert memo.leading(pool, "r", d) == 6  # the same chain, longer
    other = _digests(8, b"other")
    _put(pool, other[:2])
    assert memo.leading(pool, "r", other) == 2  # the id reused for another chain: not the old answer
    assert memo.digests("r") == other


def test_forget_and_the_lru_bound(make_pool):
    pool = make_pool("4M")
    d = _digests(4)
    _put(pool, d)
    memo = LookupMemo(PREFIX, capacity=3)
    for rid in ("a", "b", "c"):
        memo.leading(pool, rid, d)
    memo.leading(pool, "a", d)  # used: now the most recent
    memo.leading(pool, "d", d)
    assert len(memo) == 3 and "b" not in memo and "a" in memo and "c" in memo and "d" in memo
    memo.forget("a")
    memo.forget("never")
    assert "a" not in memo and memo.digests("a") == [] and len(memo) == 2
    with pytest.raises(UsageError):
        LookupMemo(PREFIX, capacity=0)


def test_a_closed_pool_raises_as_the_lookup_without_memo_does(make_pool):
    from cortex_cache import PoolClosed

    pool = make_pool("4M")
    d = _digests(3)
    _put(pool, d)
    memo = LookupMemo(PREFIX)
    assert memo.leading(pool, "r", d) == 3
    other = Pool.open(pool.name)
    other.close()
    with pytest.raises(PoolClosed):
        memo.leading(other, "r", d)


def test_threads_share_a_memo_and_each_answer_is_the_pools(make_pool):
    pool = make_pool("8M", multi_threaded=True)
    chains = [_digests(40, bytes([t])) for t in range(4)]
    for c in chains:
        _put(pool, c)
    memo = LookupMemo(PREFIX)
    stop = threading.Event()
    bad: list = []

    def reader(t: int) -> None:
        keys = [_key(x) for x in chains[t]]
        while not stop.is_set():
            got = memo.leading(pool, t, chains[t])
            # Only deletes run meanwhile: the answer is at least what is left after them, at most before.
            after = pool.leading(keys)
            if got < after:
                bad.append((t, got, after))

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    try:
        for i in range(39, 0, -3):
            for c in chains:
                pool.delete(_key(c[i]))
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not bad
    for t, c in enumerate(chains):
        assert memo.leading(pool, t, c) == pool.leading([_key(x) for x in c])


# ---------------------------------------------------------------------- the KV layer


torch = pytest.importorskip("torch")


def _kv(pool, chunk=16):
    from cortex_cache import KVCache

    return KVCache(pool, model="tiny", num_layers=1, num_heads=1, head_dim=4, dtype=torch.float32,
                   chunk_tokens=chunk)


def test_kv_lookup_with_a_request_id_gives_the_same_answers(make_pool, monkeypatch):
    import cortex_cache.kv as kvmod

    pool = make_pool("8M")
    kv = _kv(pool)
    tokens = list(range(16 * 10 + 5))
    kv.store(tokens[: 16 * 6], torch.zeros(1, 2, 16 * 6, 1, 4))
    hashed: list[int] = []
    real = kvmod.chunk_digests

    def counting(toks, *a, **k):
        hashed.append(len(toks))
        return real(toks, *a, **k)

    monkeypatch.setattr(kvmod, "chunk_digests", counting)
    assert kv.lookup(tokens[:100], request_id="r") == 96 == kv.lookup(tokens[:100])
    hashed.clear()
    assert kv.lookup(tokens, request_id="r") == 96
    assert hashed == [16 * 4]  # only the chunks after the 6 it had hashed
    hashed.clear()
    assert kv.lookup(tokens, request_id="r") == 96 and hashed == []
    # Another process deletes chunk 2: the repeat sees it.
    _in_child(pool, "pool.delete(keys[0])", kv.keys(tokens)[2])
    assert kv.lookup(tokens, request_id="r") == 32 == kv.lookup(tokens)
    # The id used for other tokens (its first or last hashed chunk differs): hashed afresh, right answer.
    other = [7] + tokens[1:]
    assert kv.lookup(other, request_id="r") == 0 == kv.lookup(other)
    assert kv.lookup(tokens, request_id="r") == 32
    other = tokens[: 16 * 10 - 1] + [7] + tokens[16 * 10 :]
    assert kv.lookup(other, request_id="r") == 32 == kv.lookup(other)
    kv.store(other, torch.zeros(1, 2, 16 * 10, 1, 4))
    assert kv.lookup(other, request_id="r") == 160
    assert kv.lookup(tokens, request_id="r") == 144 == kv.lookup(tokens)  # chunk 9 of `tokens` is not there
    with pytest.raises(UsageError):
        kv.lookup(tokens + [-1], request_id="r")  # the partial last chunk is checked too
    kv.forget("r")
    assert "r" not in kv.memo


@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
def test_kv_lookup_with_a_request_id_takes_tokens_as_arrays_too(make_pool, kind):
    import numpy as np

    pool = make_pool("8M")
    kv = _kv(pool)
    as_kind = torch.tensor if kind == "tensor" else np.array
    tokens = list(range(16 * 10 + 5))
    kv.store(tokens[: 16 * 6], torch.zeros(1, 2, 16 * 6, 1, 4))

    def both(toks: list[int]) -> tuple[int, int]:
        """(remembered lookup, un-remembered lookup) of `toks` given as an array of this kind."""
        arr = as_kind(toks)
        return kv.lookup(arr, request_id="r"), kv.lookup(arr)

    assert both(tokens[:100]) == (96, 96)
    assert both(tokens) == (96, 96) == both(tokens)  # grown, then repeated
    assert both([7] + tokens[1:]) == (0, 0)  # its first remembered chunk differs: hashed afresh
    assert both(tokens) == (96, 96)
    other = tokens[: 16 * 10 - 1] + [7] + tokens[16 * 10 :]  # its last remembered chunk differs
    kv.store(other, torch.zeros(1, 2, 16 * 10, 1, 4))
    assert both(other) == (160, 160)
    assert both(tokens) == (144, 144)  # the prefix they share is there, chunk 9 of `tokens` is not
    with pytest.raises(UsageError):
        kv.lookup(as_kind(tokens + [-1]), request_id="r")  # the partial last chunk is checked too
    with pytest.raises(UsageError):
        kv.lookup(as_kind([2**32] + tokens[1:]), request_id="r")  # and a changed first chunk's ids


def test_kv_lookup_remembers_only_chunks_that_are_ours(make_pool):
    pool = make_pool("8M")
    kv = _kv(pool)
    tokens = list(range(16 * 4))
    kv.store(tokens, torch.zeros(1, 2, 16 * 4, 1, 4))
    keys = kv.keys(tokens)
    assert kv.lookup(tokens, request_id="r") == 64
    # Another process puts something else under chunk 1's key: a miss, counted, not a hit.
    _in_child(pool, "pool.put(keys[0], b'not kv')", keys[1])
    assert kv.lookup(tokens, request_id="r") == 16 == kv.lookup(tokens)
    assert kv.refused == 2


def test_kv_lookup_of_more_chunks_than_the_pools_pin_records(make_pool):
    pool = make_pool("16M", block_size="4K")
    kv = _kv(pool, chunk=1)
    tokens = list(range(1500))  # 1500 chunks: more than the 1024 pin records of a pool
    kv.store(tokens, torch.zeros(1, 2, 1500, 1, 4))
    assert kv.lookup(tokens) == 1500 == kv.lookup(tokens, request_id="r")


# ---------------------------------------------------------------------- the vLLM connector's store


def test_vllm_block_store_present_per_request(make_pool):
    from cortex_cache.integrations.vllm.blocks import BlockStore, Faults, PoolRef, prefix_digests

    pool = make_pool("8M")
    faults = Faults("test")
    store = BlockStore(PoolRef(pool.name, {}, faults, retry_s=0.0), faults, namespace="vllm/", model="m",
                       rank="pp0tp0", fingerprint=bytes(16), payload_bytes=64, block_tokens=32)
    d = prefix_digests(list(range(32 * 6)), 32, b"tag")
    for x in d[:4]:
        pool.put(store.key(x), b"v" * 128)
    assert store.present(d, 1, 5, "r") == 3 == store.present(d[1:5])
    assert store.present(d, 0, None, "r") == 4
    _in_child(pool, "pool.delete(keys[0])", store.key(d[2]))
    assert store.present(d, 1, 5, "r") == 1 == store.present(d[1:5])
    store.forget("r")
    assert "r" not in store.memo
