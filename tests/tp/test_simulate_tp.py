"""``kvoffload simulate --tp N``: N local gloo ranks run the workload; the summary is
printed once, with a check that every rank's ledger balanced and every rank released
the same lifecycles in the same steps (exit 1 otherwise); TERM stops it cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import run_cli

from kvoffload.tools.simulate_tp import check_ranks

SMALL = [
    "simulate", "--requests", "30", "--prompt-mean", "40", "--output-mean", "24", "--page-size", "4",
    "--stride", "8", "--step-ms", "0", "--copy-delay-ms", "2", "--arrival-rate", "2000",
    "--no-progress", "--fail", "0.1",
]  # fmt: skip


run = run_cli


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_simulate_tp_prints_one_summary_and_checks_the_ranks_agreed(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two ranks, each failing its own 10% of copies (sim: each rank's copies end after
    its own random number of steps; cpu: real copies on each rank's threads, into one
    file store): exit 0, one summary with the tensor-parallel row, every ledger balanced,
    identical release sequences; every request released once, FAILED where some rank's
    copy failed."""
    argv = [*SMALL, "--backend", backend, "--tp", "2", "--json", str(tmp_path / "s.json")]
    code, out, err = run(argv, capsys)
    assert code == 0, out + err
    assert out.count("kvoffload simulate") == 1 and "tensor parallel" in out
    report = json.loads((tmp_path / "s.json").read_text())
    tp = report["tp"]
    assert tp["ranks"] == 2 and tp["ledgers_balanced"] and tp["identical_releases"]
    assert tp["released"] == 30 == report["requests"]["admitted"]
    assert sum(tp["injected"]) > 0  # one-rank failures happened, and were agreed
    assert report["requests"]["failed"] > 0
    assert report["ledger"]["ok"] and report["ledger"]["error"] is None


def _report(releases: list[list[Any]], ok: bool = True) -> dict[str, Any]:
    return {
        "ledger": {"ok": ok, "error": None if ok else "InvariantViolation: x"},
        "tp": {"releases": releases},
    }


def test_the_rank_check_fails_on_different_release_sequences_or_a_broken_ledger() -> None:
    """The check behind exit 1: the first release that differs is named, and so is a
    rank whose ledger did not balance."""
    same = [[3, 1, "completed"], [5, 2, "failed"]]
    assert check_ranks([_report(same), _report(same)]) is None
    late = [[3, 1, "completed"], [6, 2, "failed"]]
    problem = check_ranks([_report(same), _report(late)])
    assert problem is not None and "release 1" in problem and "[5, 2, 'failed'] on rank 0" in problem
    assert "[6, 2, 'failed'] on rank 1" in problem
    assert "differ" in (check_ranks([_report(same), _report(same[:1])]) or "")
    assert "rank 1: InvariantViolation" in (check_ranks([_report(same), _report(same, ok=False)]) or "")


def test_trace_is_refused_with_tp(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run([*SMALL, "--tp", "2", "--trace", str(tmp_path / "t.json")], capsys)
    assert code == 2 and "not available with --tp" in err


def test_a_stop_signal_ends_a_tp_run_cleanly(tmp_path: Path) -> None:
    """F27 with ranks: TERM mid-run exits 143 within seconds, stops the rank processes,
    removes the temporary store the ranks wrote to, prints one line, no traceback."""
    argv = [
        sys.executable,
        "-m",
        "kvoffload",
        "simulate",
        "--requests",
        "100000",
        "--no-progress",
        "--tp",
        "2",
    ]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if any(p.is_file() for d in tmp_path.glob("kvoffload-sim-*") for p in d.rglob("*")):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the ranks never wrote a page")
        ranks = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert "Traceback" not in out + err
    assert err.strip().splitlines() == [
        "kvoffload: stopped by SIGTERM; the run's temporary store was removed"
    ]
    assert not list(tmp_path.glob("kvoffload-sim-*"))
    assert len(ranks) == 2 and not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]


def _children(pid: int) -> list[int]:
    """The rank processes ``pid`` spawned (Linux /proc; not multiprocessing's resource
    tracker, which leaves by itself once its parent is gone)."""
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid) and b"spawn_main" in cmdline:
            out.append(int(status.parent.name))
    return out
