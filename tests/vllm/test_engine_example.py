"""The harness sees a load: vLLM's own ExampleConnector, between real engine processes.

One engine stores (ExampleConnector on a directory), a fresh engine process loads what
it stored: ``num_cached_tokens`` counts the loaded tokens (prefix caching is off, so
nothing else is cached) and the outputs are those of an engine without a connector.
The baseline of benchmarks/bench_vllm.py's ``example`` column. Skipped without vLLM
unless ``KVOFFLOAD_REQUIRE_VLLM=1`` (then they fail)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import vllm_engines as ve

ve.require()


@pytest.fixture(scope="module")
def example_runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("example")
    kv = ve.example_connector(work / "store")
    phases = [{"name": "main", "requests": ve.main_requests()}]
    store = ve.run_engine(ve.spec(tiny_model, phases, kv), work, "store")
    load = ve.run_engine(ve.spec(tiny_model, phases, kv), work, "load")
    return {"store": store, "load": load}


def test_the_engines_ran_vllms_example_connector(example_runs: dict[str, dict[str, Any]]) -> None:
    """Both engines built vLLM's ExampleConnector and logged no error."""
    for name, run in example_runs.items():
        assert run["connector"].endswith("example_connector.ExampleConnector"), (name, run["connector"])
        assert ve.engine_errors(run["log"]) == [], name


def test_a_fresh_engine_loads_what_another_stored(
    example_runs: dict[str, dict[str, Any]], baseline: dict[str, Any]
) -> None:
    """The storing engine loaded nothing (an empty store); the fresh engine loaded every
    whole block of each prompt but the last token's (vLLM computes at least one), and
    generated the greedy tokens and logprobs of the engine without a connector."""
    names = [r["name"] for r in ve.main_requests()]
    store, load = example_runs["store"], example_runs["load"]
    for n in names:
        assert store["requests"][n]["num_cached_tokens"] == 0, n
        want = ve.blocks_of(load["requests"][n]["prompt_len"] - 1)
        assert load["requests"][n]["num_cached_tokens"] == want > 0, n
    ve.assert_same_outputs(store, baseline, names, what="example store")
    ve.assert_same_outputs(load, baseline, names, what="example load")
