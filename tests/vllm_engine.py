"""One vLLM engine process for the vLLM tests and benchmark: run in the vLLM venv (scripts/vllm_venv.sh).

    python tests/vllm_engine.py make-model DIR[:LAYERS[:SEED[:WINDOW]]] ...
    python tests/vllm_engine.py run MODEL_DIR REQUEST_JSON

`make-model` saves tiny random Llamas (2 layers and seed 0 unless given; no download); with a WINDOW
of tokens, a hybrid one: its layers alternate sliding-window attention of that window and full
attention (Llama's `layer_types`, which vLLM reads), so vLLM's hybrid KV cache manager makes two KV
cache groups of it.  `run` starts one
engine (in this process: no engine or worker subprocesses unless "tp" asks for ranks, so it
starts in seconds), generates greedily for the prompts given as token ids, and prints
one JSON line: output tokens, `num_cached_tokens` per request, seconds per
request, and the counters of every CortexConnector of the engine (its
scheduler side and its workers' sides, summed; each worker's also apart, by
rank, in "ranks").  REQUEST_JSON:

    {"prompts": [[ids...], ...], "max_tokens": 8, "connector": {...extra config} | null,
     "sequential": false, "block_size": 32, "metrics": false, "tp": 1}

With "metrics", vLLM's own statistics are on and the result has "metrics":
every `vllm:cortex_*` counter of vLLM's Prometheus registry, summed over
its labels (faults by kind, as "vllm:cortex_faults:KIND").  Saves still in
flight when the prompts are done are waited for before the counters are read.

"tp": N > 1 runs N tensor-parallel ranks, each a worker process of vLLM's
multiprocessing executor; a worker's counters come back through vLLM's
`collective_rpc` and a worker extension of this module (`WorkerProbe`),
which first waits for that worker's saves.  On the CPU build each rank
needs cores of its own: the caller sets VLLM_CPU_OMP_THREADS_BIND (e.g.
"0|1") and VLLM_CPU_NUM_OF_RESERVED_CPU=0.

"phases": true instead of "prompts" keeps the engine up between phases:
each phase is one line on stdin, a JSON list of prompts (EOF: the engine
stops), and when it is done (its saves too) the engine prints a RESULT line
of that phase (its outputs; the counters so far; "pid", this process's id).
The caller changes the world between phases (replaces the pool, ...) and
synchronises through the pipe.  A phase `{"reset": true}` instead calls
vLLM's `reset_prefix_cache(reset_connector=True)`, stepping the engine and
asking again while it fails (blocks still held, as vLLM's API says to), and
answers {"reset": what it returned last, "tries": how many calls}.

"kv_events": true turns vLLM's KV events on (its ZMQ publisher, with a
replay socket); each result then has "events": every batch vLLM published
so far, read back through its replay socket once its publisher has sent
them (each event as a dict: "type", "medium", "ownership", "hashes" as hex
or int, "parent", "tokens": the token ids).

"batch": true sends a phase's prompts in one `generate` call (they run
together, and a small "kv_cache_bytes" makes vLLM preempt some).
"hold_saves_until_preempted": true holds every save of the connector (on
its thread) until the connector first waits for a request's saves by name,
which it does when vLLM preempts a request (else two minutes): vLLM's
preemption then meets saves in flight, of the preempted request among
them, and a connector that did not wait would save blocks vLLM had given
to other requests since.  Each result has
"record": the load errors the workers reported to vLLM
(`get_block_ids_with_load_errors`, each non-empty answer), the
preemptions the workers saw (the requests, and how many of them had saves
in flight) and the loads they were asked for ("blocks", and "null": per KV
cache group, the positions vLLM gave no block of), and, with
"load_per_layer", the wait_for_layer_load calls of steps that loaded
("layer_waits": each layer's name and whether the loads knew it); and "groups": how many
KV cache groups vLLM made (None when the engine core is another process).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Iterable


def make_model(path: str, layers: int = 2, seed: int = 0, window: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hybrid = {"layer_types": ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] *
              (layers % 2), "sliding_window": window} if window else {}
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      torch_dtype="float32", **hybrid)
    LlamaForCausalLM(cfg).save_pretrained(path)


class WorkerProbe:
    """A vLLM worker extension (`worker_extension_cls`): what the test asks a worker, wherever it runs."""

    def cortex_connector_stats(self, timeout: float = 120.0) -> dict:
        """This worker's CortexConnector counters, once its saves queued so far are done; {} without one."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        c = get_kv_transfer_group()
        if not hasattr(c, "wait_for_saves"):
            return {}
        assert c.wait_for_saves(timeout=timeout), "saves did not finish"
        return dict(c.faults.snapshot())


def instrument(req: dict) -> dict:
    """Record what the connector reports to vLLM (this process's connectors: in-process engines only), and
    hold its saves until the first preemption when asked; the record, filled as the engine runs."""
    import threading

    from cortex_cache.integrations.vllm import CortexConnector
    from cortex_cache.integrations.vllm.blocks import Saver

    record: dict = {"load_errors": [], "preemptions": [], "loads": [], "layer_waits": []}
    real_errors = CortexConnector.get_block_ids_with_load_errors
    real_load = CortexConnector.start_load_kv
    real_layer_wait = CortexConnector.wait_for_layer_load

    def load(self, forward_context, **kwargs) -> None:
        # Each load's positions, and per KV cache group those vLLM left null (block 0: outside a window).
        for t in getattr(self._connector_metadata, "loads", ()):
            ids = [b if isinstance(b, tuple) else (b,) for b in t.block_ids]
            record["loads"].append({"blocks": len(ids), "null": [sum(b[g] == 0 for b in ids)
                                                                 for g in range(len(ids[0]) if ids else 0)]})
        return real_load(self, forward_context, **kwargs)

    def errors(self) -> set[int]:
        out = real_errors(self)
        if out:
            record["load_errors"].append(sorted(out))
        return out

    def layer_wait(self, layer_name: str) -> None:
        # A step's per-layer waits (load_per_layer): the layer's name, and whether the loads knew it.
        loader = getattr(self, "_layer_loads", None)
        if self._layer_step and loader is not None:
            record["layer_waits"].append([layer_name, layer_name in loader.index])
        return real_layer_wait(self, layer_name)

    CortexConnector.get_block_ids_with_load_errors = errors
    CortexConnector.start_load_kv = load
    CortexConnector.wait_for_layer_load = layer_wait
    if req.get("hold_saves_until_preempted"):
        # Saves are held until the connector waits for some by name -- which it does for a preempted
        # request's, before vLLM may write that request's blocks -- or for two minutes.  A connector that
        # did not wait would have its saves copy blocks vLLM gave to other requests meanwhile.
        waited = threading.Event()
        real_save, real_wait = Saver._save, Saver.wait
        real_preemptions = CortexConnector.handle_preemptions

        def held(self, *args):
            waited.wait(120)
            return real_save(self, *args)

        def wait(self, req_ids=None, timeout=None):
            if req_ids is not None:
                waited.set()
            return real_wait(self, req_ids, timeout)

        def preemptions(self, meta) -> None:
            ids = getattr(meta, "preempted", None)
            saver = getattr(self, "_saver", None)
            if ids and saver is not None:
                record["preemptions"].append({"requests": len(ids),
                                              "saves_in_flight": sum(saver.pending(r) for r in ids)})
            return real_preemptions(self, meta)

        Saver._save, Saver.wait, CortexConnector.handle_preemptions = held, wait, preemptions
    return record


def _plain(x):
    return x.hex() if isinstance(x, bytes) else x


def published_events(llm, replay: str) -> list[dict]:
    """Every event vLLM's publisher sent so far, asked of its replay socket (after its queue is sent)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    publisher = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
    publisher._event_queue.join()  # every batch published so far is sent, and in the replay buffer
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(replay)
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    out = []
    try:
        while True:
            if not sock.poll(60_000):
                raise TimeoutError("vLLM's replay socket did not answer")
            _, _, seq, payload = sock.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                break
            for e in decode(payload).events:
                d = {"type": type(e).__name__, "medium": getattr(e, "medium", None),
                     "ownership": getattr(e, "ownership", None), "group": getattr(e, "group_idx", None),
                     "kind": getattr(e, "kv_cache_spec_kind", None),
                     "window": getattr(e, "kv_cache_spec_sliding_window", None),
                     "hashes": [_plain(h) for h in getattr(e, "block_hashes", [])]}
                if d["type"] == "BlockStored":
                    d.update(parent=_plain(e.parent_block_hash), tokens=list(e.token_ids), block_size=e.block_size)
                out.append(d)
    finally:
        sock.close(linger=0)
    return out


def run(model: str, req: dict, phases: "Iterable[list[list[int]] | dict] | None" = None):
    """Yield one result per phase (without `phases`, the prompts of `req` are the one phase)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    tp = int(req.get("tp", 1))
    record = instrument(req) if req.get("connector") is not None else {}
    kv = None
    if req.get("connector") is not None:
        kv = KVTransferConfig(kv_connector="CortexConnector", kv_role="kv_both",
                              kv_connector_module_path="cortex_cache.integrations.vllm",
                              kv_connector_extra_config=req["connector"])
    events: dict = {}
    if req.get("kv_events"):
        import tempfile

        from vllm.config import KVEventsConfig

        d = tempfile.mkdtemp(prefix="cctest-kvevents-")  # its sockets; removed with the process's end below
        replay = f"ipc://{d}/replay"
        events["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=f"ipc://{d}/pub", replay_endpoint=replay)
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=req.get("block_size", 32),
              max_model_len=req.get("max_model_len", 2048), dtype="float32", enforce_eager=True,
              tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else "uni",
              worker_extension_cls="tests.vllm_engine.WorkerProbe",
              kv_cache_memory_bytes=req.get("kv_cache_bytes", 64 << 20),
              enable_prefix_caching=req.get("prefix_caching", True), kv_transfer_config=kv, seed=0,
              disable_log_stats=not req.get("metrics", False), **events)
    params = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    for prompts in phases if phases is not None else [req["prompts"]]:
        if isinstance(prompts, dict) and prompts.get("reset"):
            # vLLM's reset fails while a finished request's blocks wait for its saves; the engine frees them
            # at its next step (a server's engine keeps stepping until then; here nothing else steps it).
            tries = 0
            while not (ok := llm.reset_prefix_cache(reset_connector=True)) and tries < 100:
                llm.llm_engine.step()
                tries += 1
            yield {"reset": ok, "tries": tries + 1, "pid": os.getpid()}
            continue
        outs, seconds = [], []
        # One request at a time, as a replay would send them (and so a request
        # can find what the one before it stored); or all at once.
        for batch in [prompts] if req.get("batch") else [[p] for p in prompts]:
            t = time.perf_counter()
            outs += llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            seconds.append(time.perf_counter() - t)
        stats: dict[str, int] = {}
        ranks: list[dict[str, int]] = []
        metrics: dict[str, int] = {}
        if kv is not None:
            from cortex_cache.integrations.vllm import CortexConnector

            # Each worker's counters, after its saves (in this process or a worker process of its own).
            ranks = llm.collective_rpc("cortex_connector_stats")
            schedulers = [c for c in list(CortexConnector.instances) if c.role == KVConnectorRole.SCHEDULER]
            for counted in ranks + [c.faults.snapshot() for c in schedulers]:
                for k, v in counted.items():
                    stats[k] = stats.get(k, 0) + v
            if req.get("metrics"):
                for m in llm.get_metrics():
                    if m.name.startswith("vllm:cortex_"):
                        name = m.name + (":" + m.labels["kind"] if "kind" in m.labels else "")
                        metrics[name] = metrics.get(name, 0) + int(m.value)
        try:  # how many KV cache groups vLLM made (an in-process engine's scheduler; else None)
            groups = len(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups)
        except AttributeError:
            groups = None
        result = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "groups": groups,
                  "cached": [o.num_cached_tokens for o in outs], "seconds": seconds, "stats": stats,
                  "ranks": ranks, "metrics": metrics, "pid": os.getpid(), "record": record}
        if events:
            result["events"] = published_events(llm, replay)
        yield result
    if events:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        for spec in sys.argv[2:]:
            path, _, rest = spec.partition(":")
            layers, _, rest = rest.partition(":")
            seed, _, window = rest.partition(":")
            make_model(path, int(layers or 2), int(seed or 0), int(window or 0))
    elif sys.argv[1] == "run":
        with open(sys.argv[3]) as f:
            request = json.load(f)
        # With "phases", a phase per line on stdin, read when the one before it is done.
        phases = (json.loads(line) for line in sys.stdin) if request.get("phases") else None
        for result in run(sys.argv[2], request, phases):
            print("RESULT " + json.dumps(result), flush=True)
    else:
        sys.exit(f"usage: {sys.argv[0]} make-model DIR | run MODEL REQUEST_JSON")
