"""One vLLM engine process for the vLLM tests and benchmark: run in the vLLM venv (scripts/vllm_venv.sh).

    python tests/vllm_engine.py make-model DIR[:LAYERS] ...
    python tests/vllm_engine.py run MODEL_DIR REQUEST_JSON

`make-model` saves tiny random Llamas (2 layers unless given; no download).  `run` starts one
engine (in this process: no engine or worker subprocesses, so it starts in
seconds), generates greedily for the prompts given as token ids, and prints
one JSON line: output tokens, `num_cached_tokens` per request, seconds per
request, and the counters of every CortexConnector in the process (its
scheduler side and its worker side, summed).  REQUEST_JSON:

    {"prompts": [[ids...], ...], "max_tokens": 8, "connector": {...extra config} | null,
     "sequential": false, "block_size": 32, "metrics": false}

With "metrics", vLLM's own statistics are on and the result has "metrics":
every `vllm:cortex_*` counter of vLLM's Prometheus registry, summed over
its labels (faults by kind, as "vllm:cortex_faults:KIND").  Saves still in
flight when the prompts are done are waited for before the counters are read.
"""

from __future__ import annotations

import json
import os
import sys
import time


def make_model(path: str, layers: int = 2, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(path)


def run(model: str, req: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if req.get("connector") is not None:
        kv = KVTransferConfig(kv_connector="CortexConnector", kv_role="kv_both",
                              kv_connector_module_path="cortex_cache.integrations.vllm",
                              kv_connector_extra_config=req["connector"])
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=req.get("block_size", 32),
              max_model_len=req.get("max_model_len", 2048), dtype="float32", enforce_eager=True,
              distributed_executor_backend="uni", kv_cache_memory_bytes=req.get("kv_cache_bytes", 64 << 20),
              enable_prefix_caching=req.get("prefix_caching", True), kv_transfer_config=kv, seed=0,
              disable_log_stats=not req.get("metrics", False))
    params = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
    outs, seconds = [], []
    # One request at a time, as a replay would send them (and so a request
    # can find what the one before it stored).
    for p in prompts:
        t = time.perf_counter()
        outs += llm.generate([p], params, use_tqdm=False)
        seconds.append(time.perf_counter() - t)
    stats: dict[str, int] = {}
    metrics: dict[str, int] = {}
    if kv is not None:
        from cortex_cache.integrations.vllm import CortexConnector

        for c in list(CortexConnector.instances):
            assert c.wait_for_saves(timeout=120), "saves did not finish"
        if req.get("metrics"):
            for m in llm.get_metrics():
                if m.name.startswith("vllm:cortex_"):
                    name = m.name + (":" + m.labels["kind"] if "kind" in m.labels else "")
                    metrics[name] = metrics.get(name, 0) + int(m.value)
        for c in list(CortexConnector.instances):
            for k, v in c.stats.items():
                stats[k] = stats.get(k, 0) + v
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs], "seconds": seconds, "stats": stats,
            "metrics": metrics}


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        for spec in sys.argv[2:]:
            path, _, layers = spec.partition(":")
            make_model(path, int(layers or 2))
    elif sys.argv[1] == "run":
        with open(sys.argv[3]) as f:
            request = json.load(f)
        result = run(sys.argv[2], request)
        print("RESULT " + json.dumps(result), flush=True)
    else:
        sys.exit(f"usage: {sys.argv[0]} make-model DIR | run MODEL REQUEST_JSON")
