"""One vLLM engine, in a process of its own: ``python engine_run.py SPEC.json RESULT.json``.

The spec (JSON) names the model directory, the engine's arguments, the KV connector (or
none) and the phases to run; the result (JSON) holds, per request, what the engine
returned. The engine starts once and runs its phases in order, so one start (~40 s here)
serves many prompts. Used by tests/vllm (the engine tests) and benchmarks/bench_vllm.py.

Spec keys:

- ``model``: a directory holding a ``config.json`` (and the weights: ``write_model``).
- ``load_format``: ``"auto"`` (the weights in the directory; the default) or ``"dummy"``
  (vLLM's dummy loader: seeded, so every process computes the same model).
- ``kv_cache_gib``: vLLM's CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``, default 1).
- ``seed``: the engine's seed (default 0).
- ``kv_transfer_config``: the ``KVTransferConfig`` keyword arguments, or ``null``.
- ``engine_args``: extra ``LLM(...)`` keyword arguments (``block_size``,
  ``max_model_len``, ``enable_prefix_caching`` (default ``False``: what is cached is what
  the connector loaded), ``num_gpu_blocks_override``, ``max_num_seqs`` ...).
- ``kv_events``: ``{"endpoint": "tcp://127.0.0.1:PORT", "joined": PATH, "done": PATH}``:
  vLLM publishes its KV cache events over ZMQ to the endpoint (a subscriber the test
  bound: vLLM's publisher connects to a non-wildcard endpoint). Before the phases the
  runner publishes empty batches stamped ``ts=0.0`` until the file ``joined`` exists
  (the subscriber saw one: nothing later is lost to ZMQ's slow joiner); after them, one
  stamped ``ts=-1.0`` (after every event of the run, on the same socket) until ``done``
  exists. In-process only.
- ``metrics``: ``true``: the result's ``metrics`` holds the ``kvoffload_*`` lines of
  this process's Prometheus exposition after the phases (what vLLM's stat loggers
  exported: the connector's figures through ``build_prom_metrics``).
- ``inproc``: run vLLM's EngineCore in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``;
  default ``true``): the scheduler can then be read between steps (step phases).
- ``watch_dir``: a directory (a file store's root): the result's ``files`` holds, per
  phase, how many files were under it after the phase (its writes drained first).
- ``phases``: a list; each has ``name``, ``requests`` and ``mode``:

  - ``"generate"``: the requests go to ``LLM.generate`` as one batch.
  - ``"step"``: the requests are added to the engine (``LLMEngine.add_request``) and the
    engine is stepped by hand. ``abort_waiting_for_load``: names of requests aborted
    (``LLMEngine.abort_request``) after the first step that leaves them in vLLM's
    ``WAITING_FOR_REMOTE_KVS`` (waiting for the connector's load); the result records
    the status each had when aborted and whether its load was still pending.
    ``abort_after_first_step``: names of requests aborted after the first step that ran
    them (``RUNNING``: with a synchronous load, the step that loaded them); the result
    records the status and the computed tokens each had when aborted.

  A request: ``name``, ``prompt`` (token ids), ``max_tokens``, optional ``logprobs``
  (default 1), ``extend_with`` (the name of a request of an earlier phase: its prompt
  and its output tokens are put in front of ``prompt``), ``kv_transfer_params`` (its
  ``SamplingParams(extra_args={"kv_transfer_params": ...})``).

The result: ``requests`` (per name: ``prompt`` length, ``output`` token ids,
``logprobs`` of the sampled tokens, ``num_cached_tokens``, the engine's own timestamps:
``ttft_s`` from queued to first token, ``decode_s_per_token``, ``num_preemptions``),
``phases`` (wall seconds per phase), ``drain_steps`` (per phase: the steps taken after
it while the scheduler still had work, in-process only: see ``_drain``), ``aborts``,
``connector`` (the class vLLM's scheduler built, in-process only), ``scheduler_stats``
and ``startup_s``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _logprobs_of(completion: Any) -> list[float]:
    out: list[float] = []
    if completion.logprobs is None:
        return out
    for pos, token in enumerate(completion.token_ids):
        entry = completion.logprobs[pos]
        out.append(float(entry[token].logprob))
    return out


def _record(output: Any, prompt_len: int) -> dict[str, Any]:
    completion = output.outputs[0]
    rec: dict[str, Any] = {
        "prompt_len": prompt_len,
        "output": list(completion.token_ids),
        "logprobs": _logprobs_of(completion),
        "num_cached_tokens": int(output.num_cached_tokens or 0),
        "finish_reason": completion.finish_reason,
    }
    m = output.metrics
    if m is not None and getattr(m, "first_token_ts", 0.0):
        rec["ttft_s"] = m.first_token_ts - m.queued_ts
        rec["prefill_wait_s"] = m.first_token_ts - m.scheduled_ts
        n = m.num_generation_tokens
        rec["decode_s_per_token"] = (m.last_token_ts - m.first_token_ts) / (n - 1) if n > 1 else None
        rec["num_preemptions"] = m.num_preemptions
    return rec


TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}


def write_model(path: str, config: dict[str, Any], *, weights: bool, seed: int = 0) -> None:
    """Write a Llama model directory: ``config.json`` and, with ``weights``, seeded random
    weights (``model.safetensors``) large enough that the output depends on the context.

    vLLM's dummy loader draws weights from [-1e-3, 1e-3]: the logits are then nearly
    flat (every log-probability about ``-ln(vocab)``) and a wrong KV cache would give
    the same greedy tokens as the right one, so a test comparing outputs could not fail.
    The random weights here (embeddings N(0, 1), projections N(0, 1/fan_in), norms 1)
    make each token's log-probabilities depend on the whole context. Without
    ``weights`` the engine is run with ``load_format="dummy"`` (the benchmark: compute,
    not values, is what it measures)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if not weights:
        return
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (config["vocab_size"], h),
    }
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes |= {
            pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (q, h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, q),
            pre + "mlp.gate_proj.weight": (inter, h),
            pre + "mlp.up_proj.weight": (inter, h),
            pre + "mlp.down_proj.weight": (h, inter),
        }
    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:
            tensors[name] = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            tensors[name] = torch.randn(shape, generator=g)
        else:
            tensors[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    save_file(tensors, os.path.join(path, "model.safetensors"))


def _scheduler(llm: Any) -> Any:
    core = llm.llm_engine.engine_core
    inner = getattr(core, "engine_core", None)  # InprocClient holds the EngineCore
    return None if inner is None else inner.scheduler


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("inproc", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's CPU backend claims most of the machine's memory for its KV cache unless told
    # (GiB); a test engine needs a few MiB.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "load_format": spec.get("load_format", "auto"),
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "block_size": 32,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "disable_log_stats": False,
        "seed": spec.get("seed", 0),
    }
    kwargs.update(spec.get("engine_args", {}))
    kv_events = spec.get("kv_events")
    if kv_events:
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events["endpoint"], topic="kv"
        )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"startup_s": time.monotonic() - t0, "requests": {}, "phases": {}, "aborts": {}}
    # vLLM's CPU worker binds its threads to cores: what this process may run on now
    result["cpus"] = sorted(os.sched_getaffinity(0))
    sched = _scheduler(llm)
    if sched is not None:
        conn = getattr(sched, "connector", None)
        result["connector"] = None if conn is None else f"{type(conn).__module__}.{type(conn).__qualname__}"

    if kv_events:
        _kv_events_handshake(sched, 0.0, kv_events["joined"])
    full: dict[str, list[int]] = {}  # name -> prompt + output, for extend_with

    def prompt_of(req: dict[str, Any]) -> list[int]:
        head = full[req["extend_with"]] if req.get("extend_with") else []
        return [*head, *req["prompt"]]

    def params_of(req: dict[str, Any]) -> Any:
        kv = req.get("kv_transfer_params")
        return SamplingParams(
            max_tokens=req["max_tokens"],
            temperature=0.0,
            logprobs=req.get("logprobs", 1),
            ignore_eos=True,
            extra_args=None if kv is None else {"kv_transfer_params": kv},
        )

    for phase in spec["phases"]:
        reqs = phase["requests"]
        prompts = [prompt_of(r) for r in reqs]
        start = time.monotonic()
        cpu0 = _thread_cpu()
        if phase.get("mode", "generate") == "generate":
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts],
                [params_of(r) for r in reqs],
                use_tqdm=False,
            )
            by_name = dict(zip([r["name"] for r in reqs], outs, strict=True))
        else:
            by_name = _step_phase(llm, sched, phase, reqs, prompts, params_of, TokensPrompt, result)
        result["phases"][phase["name"]] = time.monotonic() - start
        result.setdefault("phase_cpu_s", {})[phase["name"]] = _cpu_delta(cpu0, _thread_cpu())
        if sched is not None:
            result.setdefault("drain_steps", {})[phase["name"]] = _drain(llm, sched)
        if spec.get("watch_dir"):
            result.setdefault("files", {})[phase["name"]] = _count_files(spec["watch_dir"])
        for r, p in zip(reqs, prompts, strict=True):
            out = by_name.get(r["name"])
            if out is None:
                continue  # aborted
            rec = _record(out, len(p))
            result["requests"][r["name"]] = rec
            full[r["name"]] = [*p, *rec["output"]]
    if kv_events:
        _kv_events_handshake(sched, -1.0, kv_events["done"])
    if spec.get("metrics"):
        from prometheus_client import REGISTRY, generate_latest

        text = generate_latest(REGISTRY).decode()
        result["metrics"] = [line for line in text.splitlines() if line.startswith("kvoffload_")]
    if sched is not None:
        result["scheduler_stats"] = {
            "requests_left": len(sched.requests),
            "waiting_left": len(sched.waiting),
            "running_left": len(sched.running),
        }
    with open(result_path, "w") as f:
        json.dump(result, f)
    # Shut the engine down before the interpreter does (its workers, its store threads).
    del llm


DRAIN_S = 120.0
KV_EVENTS_WAIT_S = 120.0


def _kv_events_handshake(sched: Any, marker: float, ack: str) -> None:
    """Publish an empty KV event batch stamped ``marker`` through vLLM's own publisher
    until the subscriber acknowledges one (the file ``ack`` exists); a subscriber that
    never does ends the run with an error within ``KV_EVENTS_WAIT_S``."""
    from vllm.distributed.kv_events import KVEventBatch

    if sched is None:
        raise SystemExit("kv_events needs the EngineCore in this process (inproc: true)")
    deadline = time.monotonic() + KV_EVENTS_WAIT_S
    while not os.path.exists(ack):
        if time.monotonic() > deadline:
            raise SystemExit(
                f"no KV event subscriber acknowledged ts={marker} within {KV_EVENTS_WAIT_S:.0f} s"
            )
        sched.kv_event_publisher.publish(KVEventBatch(ts=marker, events=[]))
        time.sleep(0.05)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) so far of each thread of this process, by name
    (Python's thread name where the thread is a Python thread, else its OS name; threads
    of one name summed), read from /proc (Linux); empty where /proc is not there."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _count_files(root: str) -> int:
    """Files under ``root`` (a file store's records and anything else), 0 if it is not there."""
    return sum(len(files) for _, _, files in os.walk(root))


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each thread name spent between two :func:`_thread_cpu` readings, and
    ``"total"``; names that spent none are left out."""
    out = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0) > 0}
    out["total"] = round(sum(out.values()), 3)
    return out


def _drain(llm: Any, sched: Any) -> int:
    """Step an in-process engine while its scheduler still has work (``has_requests()``:
    a connector's pending push work counts), as vLLM's own engine process does in its
    busy loop between requests; returns the steps taken. In-process, nothing else steps
    the engine after ``LLM.generate`` returns: a connector's stores of the last requests
    would wait for the next call (or be lost at exit). A connector that never settles
    within ``DRAIN_S`` ends the run with an error (the test fails with the log)."""
    deadline = time.monotonic() + DRAIN_S
    steps = 0
    while sched.has_requests():
        if time.monotonic() > deadline:
            raise SystemExit(f"the engine still had work {DRAIN_S:.0f} s after its requests finished")
        llm.llm_engine.step()
        steps += 1
        if steps % 64 == 0:
            time.sleep(0.001)  # yield to the connector's threads (no busy spin on a 2-core box)
    return steps


def _step_phase(
    llm: Any,
    sched: Any,
    phase: dict[str, Any],
    reqs: list[dict[str, Any]],
    prompts: list[list[int]],
    params_of: Any,
    tokens_prompt: Any,
    result: dict[str, Any],
) -> dict[str, Any]:
    from vllm.v1.request import RequestStatus

    if sched is None:
        raise SystemExit("a step phase needs the EngineCore in this process (inproc: true)")
    engine = llm.llm_engine
    internal: dict[str, str] = {}
    for r, p in zip(reqs, prompts, strict=True):
        internal[r["name"]] = engine.add_request(r["name"], tokens_prompt(prompt_token_ids=p), params_of(r))
    to_abort = set(phase.get("abort_waiting_for_load", []))
    after_first = set(phase.get("abort_after_first_step", []))
    seen: dict[str, list[str]] = {name: [] for name in to_abort | after_first}
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        for name in sorted(to_abort):
            req = sched.requests.get(internal[name])
            status = None if req is None else req.status
            seen[name].append(str(status))
            if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                pending = internal[name] not in sched.finished_recving_kv_req_ids
                engine.abort_request([name])
                result["aborts"][name] = {"status": str(status), "load_pending": pending, "step": steps}
                to_abort.discard(name)
            elif status is None or status == RequestStatus.RUNNING or req.is_finished():
                # it never waited for a load (or it is past it): nothing aborted mid-load
                result["aborts"][name] = {"status": str(status), "load_pending": False, "step": steps}
                to_abort.discard(name)
        for name in sorted(after_first):
            req = sched.requests.get(internal[name])
            status = None if req is None else req.status
            seen[name].append(str(status))
            if status == RequestStatus.RUNNING:
                computed = req.num_computed_tokens
                engine.abort_request([name])
                result["aborts"][name] = {"status": str(status), "computed": computed, "step": steps}
                after_first.discard(name)
            elif status is None or req.is_finished():
                result["aborts"][name] = {"status": str(status), "computed": 0, "step": steps}
                after_first.discard(name)
        if steps > 100_000:
            raise SystemExit("the engine did not finish its requests")
    for name, statuses in seen.items():
        result["aborts"].setdefault(name, {"status": None, "load_pending": False, "step": steps})
        result["aborts"][name]["seen"] = statuses
    result.setdefault("steps", {})[phase["name"]] = steps
    return {name: done[name] for name in internal if name in done}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
