"""benchmarks/bench_sglang.py and bench_core_sglang.py keep running against SGLang's real
manager (issue 25 points 3 and 6).

Each script runs once as its users run it, at tiny sizes, in the environment with
SGLang's real classes; the output must name the machine and, for every ratio, its range
over rounds (and for bench_core_sglang each target's verdict). No figure is asserted
(STYLE 16). Skipped with the reason where sglang does not import, failed under
``KVOFFLOAD_REQUIRE_SGLANG=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import sglang_cpu

sglang_cpu.require()

ROOT = Path(__file__).resolve().parents[2]
RANGE = re.compile(r"rounds [0-9.]+\.\.[0-9.]+ \(2\)")


def _run(args: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900
    )
    assert done.returncode in (0, 1), f"rc {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    assert done.stdout.startswith("machine: "), done.stdout[:500]
    return done.stdout


def test_bench_sglang_prints_its_ratios_with_their_range() -> None:
    """The drop-in beside SGLang's real manager, 8 requests, 2 rounds."""
    out = _run(["benchmarks/bench_sglang.py", "--requests", "8", "--context", "64", "--rounds", "2"])
    for name in ("ratio kvoffload / SGLang", "ratio kvoffload / kvoffload before"):
        (line,) = [ln for ln in out.splitlines() if ln.strip().startswith(name)]
        assert RANGE.search(line), line


def test_bench_core_sglang_prints_every_target_with_its_verdict() -> None:
    """The core's per-request and batched paths beside SGLang's real manager, tiny sizes."""
    out = _run(["benchmarks/bench_core_sglang.py", "--requests", "16", "--long", "256", "--rounds", "2"])
    lines = [ln for ln in out.splitlines() if ln.startswith("ratio kvoffload ")]
    assert len(lines) == 5, out
    for line in lines:
        assert re.search(r"\(target <= [0-9.]+: (ok|MISSED); " + RANGE.pattern, line), line
