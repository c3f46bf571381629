"""A real-engine smoke run of KVOffloadConnector (not collected by pytest; the CI engine
tests live with the engine harness). Run in the vllm environment:

    .venv-vllm/bin/python tests/vllm/connector_smoke.py [WORKDIR]

Three fresh engine processes, one after the other, on a tiny dummy-weight Llama
(vLLM's dummy loader is seeded: every process computes the same model): no connector;
kvoffload storing to a file store; kvoffload in a fresh process loading from it. The
third must report cached tokens (prefix caching off, so they came from the store) and
give the same greedy tokens and logprobs as the first. Prints one JSON line per run
and ``SMOKE OK`` at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = {
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


def prompts() -> list[list[int]]:
    shared = [(7 * i + 3) % 500 + 1 for i in range(200)]
    return [shared + [(11 * j + k) % 500 + 1 for k in range(9)] for j in range(3)]


def engine(model_dir: str, store: str | None, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict[str, object] = {}
    if store is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"storage": store, "namespace": "smoke", "host_pages": 64},
        )
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
        **kw,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, detokenize=False)
    rows = []
    todo = prompts()
    while todo:  # one at a time: the first's store is there for the next
        p = todo.pop(0)
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        c = o.outputs[0]
        lps = [lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids, strict=True)]
        rows.append({"tokens": list(c.token_ids), "logprobs": lps, "cached": o.num_cached_tokens})
        if len(rows) == 1:  # a follow-up repeating prompt + answer: loads past the prompt
            todo.append(p + list(c.token_ids)[:20])
    Path(out).write_text(json.dumps(rows))
    del llm


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="kvo-smoke-"))
    model = work / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL))
    store = work / "store"
    results = {}
    for name, st in (("plain", None), ("store", str(store) + "/"), ("load", str(store) + "/")):
        out = work / f"{name}.json"
        cmd = [sys.executable, __file__, "--engine", str(model), st or "-", str(out)]
        subprocess.run(cmd, check=True, timeout=600, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
        results[name] = json.loads(out.read_text())
        print(json.dumps({name: [(r["cached"], r["tokens"][:6]) for r in results[name]]}), flush=True)
    files = sum(1 for _ in store.rglob("*") if _.is_file())
    print(json.dumps({"store_files": files}))
    plain, load = results["plain"], results["load"]
    assert all(r["cached"] > 0 for r in load), [r["cached"] for r in load]
    # the follow-up (209 prompt + 20 answer tokens) loads 7 blocks: one holds decoded tokens
    assert load[-1]["cached"] == 224, load[-1]["cached"]
    for a, b in zip(plain, load, strict=True):
        assert a["tokens"] == b["tokens"], (a["tokens"], b["tokens"])
        assert a["logprobs"] == b["logprobs"]
    assert [r["tokens"] for r in results["store"]] == [r["tokens"] for r in plain]
    print("SMOKE OK")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(sys.argv[2], None if sys.argv[3] == "-" else sys.argv[3], sys.argv[4])
    else:
        main()
