"""benchmarks/bench_bookkeeping.py keeps running against today's core.

A smoke run at tiny sizes: every function the script's ``main()`` calls runs once, and
its output names every target with a verdict. No timing is asserted (STYLE 16): the
figures of a smoke run mean nothing; what must hold is that the script does not crash
(it did: ``bench_transition_table`` still read ``OffloadCore._fire`` after the core's
table step moved to ``Registry.fire``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling _machine
    script = BENCH / "bench_bookkeeping.py"
    spec = importlib.util.spec_from_file_location("kvoffload_bench_bookkeeping", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # tiny sizes: every row, a few requests, two rounds
    monkeypatch.setattr(module, "N", 2 * module.STRIDE // 8)
    monkeypatch.setattr(module, "N_LONG", 2)
    monkeypatch.setattr(module, "ROUNDS", 2)
    monkeypatch.setattr(module, "PROMPTS", (16, 256))
    monkeypatch.setattr(module, "MEMORY_N", 64, raising=False)
    monkeypatch.setattr(module, "CROSSOVER", (4,), raising=False)
    monkeypatch.setattr(module, "TRANSITION_N", 4, raising=False)
    return module


def test_transition_table_runs_through_todays_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled table's step is timed through the core's one table step (Registry.fire)."""
    bench = _bench(monkeypatch)
    assert bench.bench_transition_table(4) > 0


def test_main_smoke_prints_every_target(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() runs end to end at tiny sizes and prints the machine, then each target with
    its verdict (ok / MISSED) and its range over rounds (issue 25 point 6)."""
    bench = _bench(monkeypatch)
    rc = bench.main()
    out = capsys.readouterr().out
    assert rc in (0, 1)
    assert out.startswith("machine: ")
    for target in (
        "per-request kvo/dict",
        "batched kvo/dict",
        "batched staggered kvo/dict",
        "batched µs per request-step",
        "memory admitted",
    ):
        line = next((ln for ln in out.splitlines() if ln.startswith(target)), None)
        assert line is not None, f"no target line {target!r} in:\n{out}"
        assert ("ok" in line or "MISSED" in line) and "rounds " in line, line
    assert "Traceback" not in out


def test_keys_alone_hashes_the_batched_rows_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor row hashes exactly the chunks the batched row does: after one stride
    each of its chains is where the batched row's lifecycles' chains are."""
    bench = _bench(monkeypatch)
    keys, kvo = bench.KeysAlone(), bench.Kvo(bench.N, 16, batched=True)
    try:
        assert [lc._chain for lc in kvo.lcs] == keys.chains  # past the prompt (stored: not copied)
        keys.round()
        kvo.round()
        assert [lc._chain for lc in kvo.lcs] == keys.chains
        assert kvo.mgr.statistics().pages_submitted == bench.N * bench.STRIDE // bench.PAGE
    finally:
        kvo.close()
