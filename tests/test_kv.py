"""The KV-chunk layer: deterministic chunk keys, real KV of a small transformer across processes."""

from __future__ import annotations

import hashlib
import json

import pytest

torch = pytest.importorskip("torch")

from cortex_cache import KVCache  # noqa: E402
from cortex_cache.errors import UsageError  # noqa: E402
from cortex_cache.kv import HEADER_SIZE, chunk_digests, token_bytes  # noqa: E402
from tests.helpers import run_py  # noqa: E402
from tests.tiny_model import HEAD_DIM, HEADS, LAYERS, Tiny  # noqa: E402

C = 16  # chunk tokens


def _cache(pool, model="tiny", dtype=torch.float32, chunk=C):
    return KVCache(pool, model=model, num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype,
                   chunk_tokens=chunk)


def test_chunk_keys_follow_the_documented_chain(make_pool):
    kv = _cache(make_pool("4M"))
    tokens = list(range(40))
    tag = b"cortex-kv/1\0tiny\0float32:2x2x16x4x16"
    d0 = hashlib.sha256(bytes(32) + b"".join(t.to_bytes(4, "little") for t in range(16)) + tag).digest()
    d1 = hashlib.sha256(d0 + b"".join(t.to_bytes(4, "little") for t in range(16, 32)) + tag).digest()
    assert kv.tag == tag
    assert kv.keys(tokens) == [f"kv/tiny/{d0.hex()}", f"kv/tiny/{d1.hex()}"]  # the partial third chunk has none
    # Frozen: the same keys in every process, restart and Python version.
    assert kv.keys(tokens)[0] == "kv/tiny/58ba6a9db8b9d2cacae173a4692f2a7e238bd7be3ce1043e2d4d4180cdd00018"
    assert kv.keys(torch.tensor(tokens)) == kv.keys(tokens) == kv.keys(__import__("numpy").arange(40))


def test_keys_are_the_same_in_another_process(make_pool):
    kv = _cache(make_pool("4M"))
    out = run_py("""
        import json, torch
        from cortex_cache.kv import chunk_digests
        tag = b"cortex-kv/1\\0tiny\\0float32:2x2x16x4x16"
        print(json.dumps([d.hex() for d in chunk_digests(list(range(100)), 16, tag)]))
    """).stdout
    assert [f"kv/tiny/{h}" for h in json.loads(out)] == kv.keys(list(range(100)))


def test_a_shared_prefix_shares_chunks_and_a_change_breaks_the_chain(make_pool):
    kv = _cache(make_pool("4M"))
    a, b = list(range(64)), list(range(48)) + [999] * 16
    ka, kb = kv.keys(a), kv.keys(b)
    assert ka[:3] == kb[:3] and ka[3] != kb[3]
    c = [7] + a[1:]
    assert not set(kv.keys(c)) & set(ka)  # a change in chunk 0 changes every later key
    other = _cache(make_pool("4M"), model="other")
    assert not set(other.keys(a)) & set(ka)
    half = _cache(make_pool("4M"), dtype=torch.float16)
    assert not set(half.keys(a)) & set(ka)  # layout is in the tag too


def test_bad_tokens_and_settings_are_usage_errors(make_pool):
    kv = _cache(make_pool("4M"))
    for bad in ([-1, 2], [2**32], [[1, 2]], [1.5, 2.0]):
        with pytest.raises(UsageError):
            kv.keys(bad)
    assert token_bytes([1, 258]) == b"\x01\0\0\0\x02\x01\0\0"
    with pytest.raises(UsageError):
        _cache(make_pool("4M"), model="bad model!")
    with pytest.raises(UsageError):
        kv.store(list(range(32)), torch.zeros(LAYERS, 2, 32, HEADS, HEAD_DIM + 1))
    with pytest.raises(UsageError):
        kv.store(list(range(32)), torch.zeros(LAYERS, 2, 31, HEADS, HEAD_DIM))
    with pytest.raises(UsageError):
        kv.store(list(range(32)), torch.zeros(LAYERS, 2, 32, HEADS, HEAD_DIM, dtype=torch.float64))


STORE = """
import sys, torch
from cortex_cache import Pool, KVCache
from tests.tiny_model import Tiny, LAYERS, HEADS, HEAD_DIM
pool = Pool.open(sys.argv[1])
kv = KVCache(pool, model="tiny", num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
             chunk_tokens=16)
prompt = torch.arange(int(sys.argv[2])) * 7 % 512
_, cache = Tiny()(prompt)
print(kv.store(prompt, cache))
"""


def test_kv_stored_in_one_process_is_retrieved_bit_exact_in_another(make_pool):
    p = make_pool("16M")
    assert run_py(STORE, p.name, "85").stdout.strip() == b"80"  # 5 whole chunks; the last 5 tokens are not stored
    model = Tiny()
    prompt = torch.arange(85) * 7 % 512
    _, fresh = model(prompt)
    kv = _cache(p)
    assert kv.lookup(prompt) == 80
    n, got = kv.retrieve(prompt)
    assert n == 80 and torch.equal(got, fresh[:, :, :80])
    # Attention over the retrieved KV gives what recomputing the whole prompt gives.
    rest = prompt[80:]
    h_cached, _ = model(rest, past=got)
    h_full, _ = model(prompt)
    assert torch.allclose(h_cached, h_full[80:], atol=1e-5, rtol=1e-5)
    # Into a caller's buffer, longer than what is cached.
    out = torch.full((LAYERS, 2, 100, HEADS, HEAD_DIM), 5.0)
    n, same = kv.retrieve(prompt, out=out)
    assert n == 80 and same is out and torch.equal(out[:, :, :80], fresh[:, :, :80])
    assert torch.all(out[:, :, 80:] == 5.0)


def test_a_second_prompt_reuses_the_shared_prefix(make_pool):
    p = make_pool("16M")
    model = Tiny()
    kv = _cache(p)
    first = torch.arange(64) % 512
    second = torch.cat([first[:48], torch.tensor([3] * 40)])
    _, c1 = model(first)
    kv.store(first, c1)
    puts = p.stats()["puts"]
    assert kv.lookup(second) == 48  # three chunks come from the first prompt
    n, prefix = kv.retrieve(second)
    h, c2 = model(second[48:], past=prefix)
    assert kv.store(second, c2) == 80
    assert p.stats()["puts"] == puts + 2  # only the two new chunks were written
    _, full = model(second)
    assert torch.allclose(c2, full, atol=1e-5)
    assert kv.lookup(second) == 80


def test_another_models_chunk_is_refused_never_returned(make_pool):
    p = make_pool("16M")
    ours, theirs = _cache(p), _cache(p, model="other")
    tokens = list(range(32))
    theirs.store(tokens, torch.ones(LAYERS, 2, 32, HEADS, HEAD_DIM))
    # Plant their chunk (header and all) under our first key, as a collision or a bad writer would.
    raw = p.get(theirs.keys(tokens)[0])
    p.put(ours.keys(tokens)[0], raw)
    assert ours.lookup(tokens) == 0 and ours.refused == 1
    n, got = ours.retrieve(tokens)
    assert n == 0 and got.shape[2] == 0 and ours.refused == 2
    p.put(ours.keys(tokens)[0], b"not a chunk at all")
    assert ours.lookup(tokens) == 0 and ours.refused == 3
    # And a layout mismatch with the same model tag is a different key altogether.
    assert _cache(p, model="other", dtype=torch.float16).lookup(tokens) == 0


def test_entries_carry_the_layout_fingerprint(make_pool):
    p = make_pool("16M")
    kv = _cache(p)
    kv.store(list(range(16)), torch.zeros(LAYERS, 2, 16, HEADS, HEAD_DIM))
    raw = p.get(kv.keys(list(range(16)))[0])
    assert raw[:4] == b"CKV1" and raw[8:24] == hashlib.sha256(kv.tag).digest()[:16]
    assert len(raw) == HEADER_SIZE + LAYERS * 2 * 16 * HEADS * HEAD_DIM * 4


def test_chunk_digests_of_a_short_prompt_are_empty():
    assert chunk_digests([1, 2, 3], 16, b"t") == []


def test_a_request_larger_than_the_pool_keeps_its_leading_chunks_and_no_reservation(make_pool):
    from cortex_cache import PoolFull

    probe = _cache(make_pool("4M"))
    chunk_bytes = -(-(HEADER_SIZE + probe.payload_bytes) // 4096) * 4096
    p = make_pool(3 * chunk_bytes, block_size="4K")  # room for three chunks
    kv = _cache(p)
    prompt = torch.arange(5 * C) % 512
    _, cache = Tiny()(prompt)
    with pytest.raises(PoolFull):
        kv.store(prompt, cache)
    assert p.stats()["writing_entries"] == 0 and p.stats()["pinned_entries"] == 0
    assert kv.lookup(prompt) == 3 * C
    n, got = kv.retrieve(prompt)
    assert n == 3 * C and torch.equal(got, cache[:, :, : 3 * C])
    assert p.verify()["ok"]


def test_kv_of_other_weights_under_the_same_model_name_is_never_served(make_pool, tmp_path, monkeypatch):
    """Issue 43: the weights' identity is in the tag and the keys; one weights' KV is retired by prefix."""
    from cortex_cache.weights import ENV

    monkeypatch.delenv(ENV, raising=False)
    p = make_pool("16M")
    prompt = torch.arange(64) % 512
    _, old_kv = Tiny(seed=0)(prompt)
    _, new_kv = Tiny(seed=1)(prompt)
    old = KVCache(p, model="tiny", num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                  chunk_tokens=C, weights="seed0")
    new = KVCache(p, model="tiny", num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                  chunk_tokens=C, weights="seed1")
    assert old.tag.endswith(b"\0weights:seed0") and old.keys(prompt)[0].startswith("kv/tiny/seed0/")
    assert old.store(prompt, old_kv) == 64
    assert new.lookup(prompt) == 0 and new.retrieve(prompt)[0] == 0 and new.refused == 0  # other keys: a miss
    assert new.store(prompt, new_kv) == 64
    n, got = new.retrieve(prompt)
    assert n == 64 and torch.equal(got, new_kv)
    untied = _cache(p)  # no name for the weights: the keys of before
    assert untied.keys(prompt)[0].startswith("kv/tiny/") and untied.lookup(prompt) == 0
    assert p.evict(prefix="kv/tiny/seed0/")[0] == 4
    assert old.lookup(prompt) == 0 and new.lookup(prompt) == 64  # only the old weights' KV went
    # The operator's name from the environment, checked like the argument.
    monkeypatch.setenv(ENV, "ft-7")
    assert _cache(p).keys(prompt)[0].startswith("kv/tiny/ft-7/")
    with pytest.raises(UsageError, match="invalid weights"):
        KVCache(p, model="tiny", num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                weights="a/b")
