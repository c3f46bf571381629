"""benchmarks/bench_vllm.py stays working: one short round of every column on a small
model (the figures themselves are the benchmark's, not a test's: nothing here depends
on how fast the machine runs). Skipped without vLLM unless ``KVOFFLOAD_REQUIRE_VLLM=1``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import vllm_engines as ve

ve.require()

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm.py"


def test_one_quick_round_prints_every_ratio(tmp_path: Path) -> None:
    """A quick round (2 layers, a 128-token prefix, one timed prompt) runs every column:
    the reloading columns compute fewer prefill tokens than recomputing, and the ratios
    the issue's targets are stated in are printed."""
    args = ["--quick", "--rounds", "1", "--prefix", "128", "--requests", "1", "--decode", "8"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--keep", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=ve.ENGINE_TIMEOUT_S * 3,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "left out" not in out, out
    assert "kvoffload store: file://" in out and "?direct=1" in out, out  # the store writes direct
    table = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in ("none", "example", "kvoffload") and len(cells) == 6:
            table[cells[0]] = [float(c) for c in cells[1:]]
    assert set(table) == {"none", "example", "kvoffload"}, out
    prefill = {c: row[1] for c, row in table.items()}
    assert prefill["kvoffload"] < prefill["none"] and prefill["example"] < prefill["none"], out
    for ratio in ("ttft recompute/kvoffload:", "ttft example/kvoffload:", "decode kvoffload/none:"):
        assert ratio in out, out
    # the kvoffload process's own pairs ran, and its quiet batches stored nothing (the
    # benchmark fails otherwise): kv_transfer_params={"kvoffload": {"store": False}} in a real engine
    assert "decode stored/not stored, one kvoffload process:" in out, out
    import json

    (result,) = tmp_path.glob("r0-kvoffload.result.json")
    files = json.loads(result.read_text())["files"]
    assert files["decode-quiet1"] == files["decode-quiet0"] == files["decode"] < files["decode-stored2"], (
        files
    )
