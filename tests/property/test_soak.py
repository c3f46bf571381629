"""The soak run of benchmarks/soak.py: the ledger balances, nothing leaks, memory is flat.

The full run (100,000 requests) is marked ``slow`` (``pytest -m slow``); the default
run plays a short one so the script itself stays working.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvoffload_soak", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_soak_balances() -> None:
    """2,000 requests with id reuse, aborts, failed copies, random completion order."""
    assert _soak().main(["--requests", "2000", "--concurrency", "32"]) == 0


@pytest.mark.slow
def test_full_soak_balances() -> None:
    """100,000 requests: every ledger count balances, no page leaks, memory is flat."""
    assert _soak().main(["--requests", "100000"]) == 0
