"""``kvoffload simulate`` and ``kvoffload graph``: the figures add up, the ledger check
decides the exit code, bad options exit 2 with a message, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from support import broken_parts, run_cli

import kvoffload as kvo
from kvoffload.abc import Completion, Transfer
from kvoffload.backends import BACKENDS
from kvoffload.core.chunks import Chunks
from kvoffload.tools import graph
from kvoffload.tools.delivery_check import EngineRecord
from kvoffload.tools.trace import check_chrome_trace
from kvoffload.tools.workload import FaultyBackend, RunMonitor, WorkloadSpec, plan

# A small, quick workload (well under a second).
SMALL = [
    "simulate", "--requests", "40", "--prompt-mean", "40", "--output-mean", "24", "--page-size", "4",
    "--stride", "8", "--step-ms", "0.2", "--copy-delay-ms", "1", "--arrival-rate", "2000",
    "--no-progress",
]  # fmt: skip


#: Every arrival reuses a finishing request's id, and copies are slow (sim backend).
REUSED = [*SMALL, "--backend", "sim", "--reuse", "1", "--copy-delay-ms", "20", "--requests", "60"]
REUSED += ["--arrival-rate", "1000"]


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


run = run_cli


def test_simulate_reports_figures_that_add_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run exits 0 with a balanced ledger; every request has one outcome; every
    submitted page was offloaded, failed or discarded; the JSON matches the table."""
    code, out, _ = run(
        [*SMALL, "--json", str(tmp_path / "s.json"), "--trace", str(tmp_path / "t.json")], capsys
    )
    assert code == 0, out
    report = json.loads((tmp_path / "s.json").read_text())
    q, p = report["requests"], report["pages"]
    assert q["admitted"] == 40 == q["completed"] + q["aborted"] + q["failed"]
    assert p["submitted"] == p["offloaded"] + p["failed"] + p["discarded"]
    assert p["stored"] + p["store_failed"] + p["not_stored"] == p["offloaded"]
    assert report["ledger"] == {"ok": True, "error": None, "checks": report["ledger"]["checks"]}
    d = report["deliveries"]  # every completion was checked; its bytes too unless the copy failed
    assert d["checked"] == report["statistics"]["completions_delivered"]
    assert d["bytes_checked"] == d["checked"] - report["statistics"]["chunks_failed"] > 0
    assert d["mismatched"] == 0
    assert report["setup"]["backend"] == ("cpu" if "cpu" in BACKENDS else "sim")
    assert set(report["latency_ms"]["transfer"]) == {"p50", "p90", "p99", "max"}
    assert "ledger" in out and "OK" in out and f"{q['admitted']} admitted" in out
    check_chrome_trace(json.loads((tmp_path / "t.json").read_text()))


def test_reused_ids_get_late_completions_delivered_to_their_own_lifecycle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With every arrival reusing a finishing id and slow copies, some completions
    arrive while their rid is shared, and each carries the keys and KV of the lifecycle
    it reached (test_a_misrouted_completion_fails_the_run: this check can fail)."""
    code, out, _ = run([*REUSED, "--json", str(tmp_path / "s.json")], capsys)
    assert code == 0, out
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["requests"]["reused_ids"] > 0
    assert report["deliveries"]["late_while_id_reused"] > 0
    assert report["deliveries"]["mismatched"] == 0


#: What describes a run's schedule in its report: everything but wall-clock figures.
_SCHEDULE = ("requests", "pages", "deliveries", "ledger")


def _schedule(report: dict[str, Any]) -> dict[str, Any]:
    stats = {k: v for k, v in report["statistics"].items() if k != "stuck_reports"}  # the watchdog's clock
    steps = report["throughput"]["decode_steps"]
    return {**{k: report[k] for k in _SCHEDULE}, "steps": steps, "stats": stats}


def test_f39_a_slow_machine_plays_the_same_simulated_schedule(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """F39: with the sim backend the run is driven, not timed: arrivals and copy delays
    count decode steps, and each step waits until the manager took the completions the
    loop played. A machine that needs 2 ms more for every step (a busy one) runs the
    same schedule, figure for figure, with its late completions during id reuse."""
    from kvoffload.tools.scheduler import DecodeScheduler

    code, out, _ = run([*REUSED, "--json", str(tmp_path / "fast.json")], capsys)
    assert code == 0, out
    fast = json.loads((tmp_path / "fast.json").read_text())
    step = DecodeScheduler._decode_step

    def slow_step(self: DecodeScheduler, tg: Any) -> None:
        time.sleep(0.002)  # a slow forward pass, on purpose: the schedule must not see it
        step(self, tg)

    monkeypatch.setattr(DecodeScheduler, "_decode_step", slow_step)
    code, out, _ = run([*REUSED, "--json", str(tmp_path / "slow.json")], capsys)
    assert code == 0, out
    slow = json.loads((tmp_path / "slow.json").read_text())
    assert slow["requests"]["reused_ids"] > 0 and slow["deliveries"]["late_while_id_reused"] > 0
    assert _schedule(slow) == _schedule(fast)


class SwapsSharedIdsInABatch(Chunks):
    """A seeded misrouting (F1): two completions of one batch whose lifecycles share a
    request id are delivered to each other's lifecycle. Each lifecycle still receives
    as many completions as it issued, after its copies ended: every count, state,
    ledger and leak check still holds. Only what the completions carry is wrong."""

    def apply(self, batch: Iterable[Completion], now: float) -> None:
        batch = list(batch)
        # The core reaches a completion's lifecycle by its transfer's lifecycle_id: swap those.
        ts = [self.inflight.get(tid) for tid, _ in batch]
        for i, t in enumerate(ts):
            for u in ts[i + 1 :]:
                if t is None or u is None:
                    continue
                if u.lifecycle_id != t.lifecycle_id and u.rid == t.rid:
                    t.lifecycle_id, u.lifecycle_id = u.lifecycle_id, t.lifecycle_id
                    break
        super().apply(batch, now)


def test_a_misrouted_completion_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a core that swaps completions between lifecycles sharing an id, the run
    counts mismatched completions and exits 1 (the error is the delivery check's, or
    the ledger's when the swap also broke the chain-order write bookkeeping, F33)."""
    with broken_parts(SwapsSharedIdsInABatch):
        code, out, _ = run([*REUSED, "--json", str(tmp_path / "s.json")], capsys)
    report = json.loads((tmp_path / "s.json").read_text())
    mismatched = report["deliveries"]["mismatched"]
    assert code == 1 and mismatched > 0, report["deliveries"]
    error = report["ledger"]["error"]
    # Since F33 (issue 19) the core writes a request's chunks in chain order, by where
    # each starts in its own lifecycle; a completion delivered to another lifecycle can
    # break that bookkeeping too, and then the ledger check (which runs first) reports
    # it. The delivery check counted the mismatches either way (mismatched > 0 above).
    if error.startswith("InvariantViolation"):
        assert "held" in error, report["ledger"]
    else:
        assert error.startswith(f"{mismatched} completion(s) do not carry"), report["ledger"]
        assert "not the chain over its tokens" in error
        assert f"{mismatched} mismatched" in out
    assert "FAILED" in out


def test_a_copy_of_the_wrong_bytes_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A copy engine that copies a chunk's pages in the wrong order moves the right
    lifecycle's KV to the wrong places: the keys are right, the bytes check fires."""
    from kvoffload.testing import SimBackend

    copy = SimBackend.complete

    def reversed_pages(self: SimBackend, transfer: Transfer) -> None:
        transfer.device_pages = transfer.device_pages[::-1]
        copy(self, transfer)

    monkeypatch.setattr(SimBackend, "complete", reversed_pages)
    code, _, _ = run([*SMALL, "--backend", "sim", "--json", str(tmp_path / "s.json")], capsys)
    report = json.loads((tmp_path / "s.json").read_text())
    assert code == 1 and report["deliveries"]["mismatched"] > 0, report["deliveries"]
    assert "do not hold the engine's KV" in report["ledger"]["error"]


def test_a_failed_invariant_makes_the_run_exit_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check_invariants raising is reported in the table and JSON, and exits 1."""

    def broken(self: kvo.OffloadManager) -> None:
        raise kvo.InvariantViolation("admitted != live + released")

    monkeypatch.setattr(kvo.OffloadManager, "check_invariants", broken)
    code, out, _ = run([*SMALL, "--json", str(tmp_path / "s.json")], capsys)
    assert code == 1
    assert "FAILED" in out and "admitted != live + released" in out
    assert json.loads((tmp_path / "s.json").read_text())["ledger"]["ok"] is False


def test_store_none_keeps_nothing_and_still_balances(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, _ = run([*SMALL, "--store", "none", "--json", str(tmp_path / "s.json")], capsys)
    assert code == 0
    pages = json.loads((tmp_path / "s.json").read_text())["pages"]
    assert pages["stored"] == 0 and pages["not_stored"] == pages["offloaded"]


def test_auto_backend_is_the_managers_auto() -> None:
    """simulate's --backend auto picks what OffloadManager's "auto" picks: cuda with a
    GPU, else cpu."""
    from kvoffload.tools.simulate import choose_backend

    assert choose_backend("auto") == ("cuda" if _has_gpu() else "cpu")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--requests", "0"], "positive integer"),
        (["simulate", "--requests", "many"], "positive integer"),
        (["simulate", "--reuse", "1.5"], "between 0 and 1"),
        (["simulate", "--step-ms", "-1"], ">= 0"),
        (["simulate", "--arrival-rate", "0"], "arrival_rate must be > 0"),
        (["simulate", "--tp", "1000000"], "at most"),  # not a million processes
        (["simulate", "--requests", "1000000000"], "at most 1,000,000"),
        (["simulate", "--prompt-mean", "1000000000", "--device-pages", "100000000"], "at most 1,000,000"),
        (["simulate", "--output-mean", "1000000000"], "at most 1,000,000"),
        (["simulate", "--step-ms", "1e300"], "at most 10,000"),  # a run that never ends
        (["simulate", "--copy-delay-ms", "1e300"], "at most 60,000"),
        (["simulate", "--page-size", "16", "--stride", "24"], "multiple of page_size"),
        (["simulate", "--backend", "quantum"], "not available"),
        pytest.param(
            ["simulate", "--backend", "cuda"],
            "needs a CUDA GPU",
            marks=pytest.mark.skipif(_has_gpu(), reason="a GPU is present: cuda is a valid choice"),
            id="cuda-without-gpu",
        ),
        (["simulate", "--store", "ftp://nowhere"], "--store"),
        (["simulate", "--json", "/nonexistent-dir/x.json"], "does not exist"),
        (["simulate", "--on-host-full", "panic"], "invalid choice"),
        (["graph", "--format", "gif"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_options_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(argv, capsys)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_tp_is_bounded_by_the_machines_cores(capsys: pytest.CaptureFixture[str]) -> None:
    """--tp starts one process per rank: more than 4 a CPU core (64 at most) is refused
    with the bound and the reason, exit 2, before anything starts."""
    from kvoffload.tools.cli import max_tp

    bound = max_tp()
    assert bound == min(64, 4 * (os.cpu_count() or 1))
    code, _, err = run(["simulate", "--tp", str(bound + 1)], capsys)
    assert code == 2 and f"at most {bound}" in err and "CPU core" in err


def test_the_installed_command_reports_bad_options_without_a_traceback() -> None:
    """The real process (python -m kvoffload) exits 2 and prints the reason."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload", "simulate", "--fail", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "between 0 and 1" in proc.stderr and "Traceback" not in proc.stderr


def test_graph_prints_the_mermaid_diagram(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(["graph"], capsys)
    assert code == 0 and out == graph.mermaid()
    code, _, _ = run(["graph", "--format", "mermaid", "-o", str(tmp_path / "g.mmd")], capsys)
    assert code == 0 and (tmp_path / "g.mmd").read_text() == graph.mermaid()


def test_graph_svg_without_graphviz_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No dot program: exit 3 and a message naming the extra and the system package."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code, _, err = run(["graph", "--format", "svg"], capsys)
    assert code == 3
    assert "graphviz" in err and "mermaid" in err and "Traceback" not in err


def test_the_workload_plan_is_seeded() -> None:
    """The same seed gives the same requests; another seed gives others."""
    spec = WorkloadSpec(requests=50, seed=7)
    assert plan(spec) == plan(WorkloadSpec(requests=50, seed=7))
    assert plan(spec) != plan(WorkloadSpec(requests=50, seed=8))
    shares = plan(WorkloadSpec(requests=2000, abort=0.25, reuse=0.5))
    assert 0.2 < sum(p.abort_after is not None for p in shares) / 2000 < 0.3
    assert 0.45 < sum(p.reuse for p in shares) / 2000 < 0.55


@pytest.mark.asyncio
async def test_the_monitor_checks_the_late_completion_of_the_readme_story() -> None:
    """The old r1's completion arrives while a new r1 is live: one late completion,
    checked against what the old lifecycle committed. Both requests committed the same
    tokens, so only the KV bytes (which name the lifecycle) tell them apart: checked
    as a delivery to the new one, the same transfer is a mismatch."""
    from kvoffload.testing import SimBackend

    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=64, host_pages=64, drain_timeout_s=5)
    backend = SimBackend()
    monitor = RunMonitor()
    seen: list[tuple[str, dict[str, Any]]] = []
    faulty = FaultyBackend(backend, 0.0, on_submit=monitor.submitted)
    async with kvo.OffloadManager(config, backend=faulty) as mgr:
        engine = monitor.engine = EngineRecord(4, device=mgr.device_pool, host=mgr.host_pool)
        mgr.add_listener(monitor)
        mgr.add_listener(lambda n, f: seen.append((n, dict(f))))
        lcs = []
        for _ in range(2):
            lc = mgr.admit("r1", [0, 1, 2, 3])
            engine.commit(lc, [0, 1, 2, 3])
            lc.extend([4, 5, 6, 7, 8])
            engine.commit(lc, [4, 5, 6, 7, 8])
            engine.write_kv()  # before the driver's next turn: then a copy may read
            lcs.append(lc)
        old, new = lcs
        old.finish()
        late = backend.pending[0]
        assert late.lifecycle_id == old.id
        backend.complete(late)
        await old.wait_released()
        assert monitor.late_completions == 1 and monitor.checked == monitor.bytes_checked == 1
        assert monitor.mismatched == 0
        problem = engine.check(late, new.id, with_bytes=True)
        assert problem is not None and "do not hold the engine's KV" in problem
        assert engine.check(late, new.id, with_bytes=False) is None  # same tokens, same keys
        new.finish()
        backend.complete_all()
        await mgr.settle()
    assert monitor.late_completions == 1  # the new one's completion: its rid was no longer shared
    assert monitor.checked == 2 and monitor.mismatched == 0
    (done,) = [f for n, f in seen if n == "transfer.completed" and f["lifecycle"] == old.id]
    assert done["rid"] == "r1"


def test_slow_copies_are_reported_by_the_watchdog(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Copies slower than --stuck-after-ms show up as stuck reports (FAILURES F18), in
    the summary and as instant events on the timeline; the run still balances."""
    argv = [*SMALL, "--backend", "sim", "--copy-delay-ms", "40", "--stuck-after-ms", "5", "--requests", "20"]
    code, out, _ = run(
        [*argv, "--json", str(tmp_path / "s.json"), "--trace", str(tmp_path / "t.json")], capsys
    )
    assert code == 0, out
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["watchdog"]["stuck_reports"] > 0
    trace = json.loads((tmp_path / "t.json").read_text())
    assert any(e["name"] == "lifecycle.stuck" for e in trace["traceEvents"])
