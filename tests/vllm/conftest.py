"""Fixtures of the vLLM engine tests (tests/vllm): the tiny model and the engine run
without a connector whose outputs every connector's run must reproduce.

Nothing here imports vLLM: the plain suite collects tests/vllm and each module skips
(``vllm_engines.require()``) where vLLM is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The issue's tiny Llama (2 layers, hidden 128, head_dim 32, vocab 512) with seeded
    random weights (engine_run.write_model says why not vLLM's dummy ones)."""
    import engine_run

    path = tmp_path_factory.mktemp("vllm-model")
    engine_run.write_model(str(path), engine_run.TINY_LLAMA, weights=True)
    return path


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine, no connector, every prompt of the engine tests (vllm_engines.baseline_phases)."""
    import vllm_engines as ve

    return ve.run_engine(ve.spec(tiny_model, ve.baseline_phases()), tmp_path_factory.mktemp("none"), "none")
