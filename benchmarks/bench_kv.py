"""KV-chunk layer on the CPU: store/retrieve GB/s beside a plain copy, and the cost of chunk keys per token.

    python benchmarks/bench_kv.py [--quick] [--json PATH]

A Llama-3-8B-like layout (32 layers, 8 KV heads of 128, fp16, 256-token
chunks: 32 MiB a chunk) and a prompt of 8,192 tokens (--quick: 2,048),
i.e. 32 chunks and 1 GiB of KV (--quick 256 MiB):

  store      KVCache.store(tokens, kv) into an empty pool: keys, a header
             and a copy of each chunk into reserved pool memory, checksum, commit.
  retrieve   KVCache.retrieve(tokens, out=buffer): lookup, header check and a
             copy of each chunk out of the pool.
  copy       the same chunk copies between plain torch tensors (the ceiling).
  hashing    chunk_digests (SHA-256 chain) over 1M tokens, given as a tensor and as a
             Python list: nanoseconds per token.

Medians over 5 rounds (--quick 3) with min-max, baselines interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, HEADS, HEAD_DIM, CHUNK = 32, 8, 128, 256


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    os.environ["CORTEX_CACHE_SHM_PREFIX"] = f"ccbench-{os.getpid()}."
    import torch

    from cortex_cache import KVCache, Pool
    from cortex_cache.kv import chunk_digests

    torch.set_num_threads(1)
    n_tok = 2048 if args.quick else 8192
    rounds = 3 if args.quick else 5
    kv = torch.randn(LAYERS, 2, n_tok, HEADS, HEAD_DIM, dtype=torch.float16)
    tokens = torch.randint(0, 128_000, (n_tok,))
    chunk_bytes = LAYERS * 2 * CHUNK * HEADS * HEAD_DIM * 2
    total = n_tok // CHUNK * chunk_bytes
    out = torch.empty_like(kv)
    pool = Pool.create("kvbench", total + (64 << 20), block_size=1 << 20)
    times: dict[str, list[float]] = {"store": [], "retrieve": [], "copy_in": [], "copy_out": []}
    try:
        cache = KVCache(pool, model="llama-3-8b", num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM,
                        dtype=torch.float16, chunk_tokens=CHUNK)
        dst = [torch.empty(LAYERS, 2, CHUNK, HEADS, HEAD_DIM, dtype=torch.float16) for _ in range(n_tok // CHUNK)]
        for r in range(rounds + 1):  # the first round warms up
            pool.evict(all=True)
            t = time.perf_counter()
            assert cache.store(tokens, kv) == n_tok
            s = time.perf_counter() - t
            t = time.perf_counter()
            n, _ = cache.retrieve(tokens, out=out)
            g = time.perf_counter() - t
            assert n == n_tok
            t = time.perf_counter()
            for i, d in enumerate(dst):
                d.copy_(kv[:, :, i * CHUNK : (i + 1) * CHUNK])
            ci = time.perf_counter() - t
            t = time.perf_counter()
            for i, d in enumerate(dst):
                out[:, :, i * CHUNK : (i + 1) * CHUNK].copy_(d)
            co = time.perf_counter() - t
            if r:
                for k, v in zip(("store", "retrieve", "copy_in", "copy_out"), (s, g, ci, co)):
                    times[k].append(v)
        assert torch.equal(out, kv)
    finally:
        pool.close()
        Pool.unlink("kvbench")
    hash_tokens = torch.randint(0, 128_000, (1 << 20,))
    t = time.perf_counter()
    chunk_digests(hash_tokens, CHUNK, cache.tag)
    per_token_us = (time.perf_counter() - t) / len(hash_tokens) * 1e6
    as_list = hash_tokens.tolist()
    t = time.perf_counter()
    chunk_digests(as_list, CHUNK, cache.tag)
    per_token_list_us = (time.perf_counter() - t) / len(as_list) * 1e6

    res = {k: {"gbps": total / statistics.median(v) / 1e9, "gbps_min": total / max(v) / 1e9,
               "gbps_max": total / min(v) / 1e9} for k, v in times.items()}
    res["ratios"] = {"store_vs_copy": res["store"]["gbps"] / res["copy_in"]["gbps"],
                     "retrieve_vs_copy": res["retrieve"]["gbps"] / res["copy_out"]["gbps"]}
    res["hash_us_per_token"] = per_token_us
    res["hash_us_per_token_from_list"] = per_token_list_us
    res["bytes"] = total
    print(f"KV layer, {n_tok} tokens = {n_tok // CHUNK} chunks of {chunk_bytes >> 20} MiB "
          f"({LAYERS} layers, {HEADS}x{HEAD_DIM} fp16); GB/s median [min-max] over {rounds} rounds")
    for k, label in (("store", "store (pool)"), ("copy_in", "plain chunk copy"), ("retrieve", "retrieve (pool)"),
                     ("copy_out", "plain chunk copy")):
        r = res[k]
        print(f"  {label:18} {r['gbps']:6.2f}  [{r['gbps_min']:.2f}-{r['gbps_max']:.2f}]")
    print(f"ratios: store/copy {res['ratios']['store_vs_copy']:.2f}, retrieve/copy {res['ratios']['retrieve_vs_copy']:.2f}")
    print(f"chunk keys (SHA-256 chain): {per_token_us * 1000:.1f} ns per token from a tensor "
          f"({per_token_us * CHUNK:.1f} us per {CHUNK}-token chunk), {per_token_list_us * 1000:.1f} ns from a list")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
