"""The benchmarks whose targets a closing note quotes keep running against today's code.

Each script runs once as its users run it (``python benchmarks/X.py``), at tiny sizes,
and its output must name the machine and every target with a verdict (ok / MISSED) and
a range over rounds (issue 25 point 6). No figure is asserted (STYLE 16): a smoke run's
figures mean nothing; what must hold is that the script runs to its end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERDICT = re.compile(r"\(target [<>]= [0-9.]+: (ok|MISSED); rounds [0-9.]+\.\.[0-9.]+ \(\d+\)\)")


def _run(args: list[str], timeout: float = 600) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode in (0, 1), f"rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.startswith("machine: "), done.stdout[:500]
    return done.stdout


def _targets(out: str, *names: str) -> None:
    for name in names:
        lines = [ln for ln in out.splitlines() if ln.startswith(f"{name}: ")]
        assert len(lines) == 1, (name, out)
        assert VERDICT.search(lines[0]), lines[0]


def test_bench_tp_prints_both_ratios_with_verdicts() -> None:
    """bench_tp at 2 rounds: gloo groups of 2 and 4 spawned ranks, both sides measured."""
    pytest.importorskip("torch.distributed")
    out = _run(["benchmarks/bench_tp.py", "2"])
    _targets(out, "ratio kvoffload/sglang tp2", "ratio kvoffload/sglang tp4")


def test_bench_storage_prints_the_file_target_with_its_verdict(tmp_path: Path) -> None:
    """bench_storage at 2 rounds of 32 small pages: the file store against a plain writer
    (Redis and Mooncake rows print where their servers are up, skipped otherwise)."""
    out = _run(
        [
            "benchmarks/bench_storage.py",
            "--pages",
            "32",
            "--page-kib",
            "4",
            "--rounds",
            "2",
            "--dir",
            str(tmp_path),
        ]
    )
    _targets(out, "ratio kvoffload/plain file")
