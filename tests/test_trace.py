"""The timeline recorder: Chrome-trace / Perfetto JSON with one track per lifecycle
(its states) and per copy stream (its transfers), and a matplotlib timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import kvoffload as kvo
from kvoffload.testing import SimBackend
from kvoffload.tools.trace import TraceRecorder, check_chrome_trace


async def _reuse_story(clock: list[float]) -> tuple[TraceRecorder, kvo.Lifecycle, kvo.Lifecycle]:
    """The README's story: r1 finishes with a copy in flight, a new r1 is admitted,
    the old copy completes late. Each step advances the virtual clock by 1 ms."""
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=64, host_pages=64, drain_timeout_s=5)
    backend = SimBackend()
    rec = TraceRecorder()

    def step() -> None:
        clock[0] += 0.001

    async with kvo.OffloadManager(config, backend=backend, clock=lambda: clock[0]) as mgr:
        mgr.add_listener(rec)
        old = mgr.admit("r1", [0, 1, 2, 3])
        step()
        old.extend([4, 5, 6, 7, 8])
        step()
        old.finish()
        step()
        new = mgr.admit("r1", [0, 1, 2, 3])
        step()
        new.extend([4, 5, 6, 7, 8])
        step()
        backend.complete(backend.pending[0])  # the old request's late completion
        await old.wait_released()
        step()
        new.finish()
        step()
        backend.complete_all()
        await mgr.settle()
    return rec, old, new


def _slices(trace: dict[str, Any], pid: int, tid: int) -> list[tuple[str, float, float]]:
    return [
        (e["name"], e["ts"], e.get("dur", 0.0))
        for e in trace["traceEvents"]
        if e["ph"] != "M" and e["pid"] == pid and e["tid"] == tid
    ]


@pytest.mark.asyncio
async def test_each_lifecycle_track_shows_its_own_states_in_order() -> None:
    """The old and new r1 get separate tracks; the old one's states follow its own
    history (the late completion released it), with virtual-clock timestamps."""
    rec, old, new = await _reuse_story([100.0])
    trace = rec.chrome_trace()
    check_chrome_trace(trace)
    old_track = _slices(trace, 1, old.id)
    assert [name for name, _, _ in old_track] == ["PENDING", "OFFLOADING", "FINISHING", "RELEASED"]
    assert old_track[0][1] == 0.0 and old_track[0][2] == pytest.approx(1000.0)  # 1 ms in PENDING
    new_track = _slices(trace, 1, new.id)
    assert [name for name, _, _ in new_track] == ["PENDING", "OFFLOADING", "FINISHING", "RELEASED"]
    # the old lifecycle released before the new one finished
    assert old_track[-1][1] < new_track[2][1]
    names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert names[(1, old.id)] == f"#{old.id} r1" and names[(1, new.id)] == f"#{new.id} r1"


@pytest.mark.asyncio
async def test_transfers_sit_on_stream_tracks_in_lanes_that_never_overlap() -> None:
    """Both transfers overlapped in time, so they take two lanes of stream 0; each
    slice spans submission to delivery and names its lifecycle."""
    rec, old, new = await _reuse_story([0.0])
    trace = rec.chrome_trace()
    transfers = [e for e in trace["traceEvents"] if e["pid"] == 2 and e["ph"] == "X"]
    assert len(transfers) == 2
    assert {e["tid"] for e in transfers} == {0, 1}  # stream 0, lanes 0 and 1
    by_lc = {e["args"]["lifecycle"]: e for e in transfers}
    assert by_lc[old.id]["ts"] == pytest.approx(1000.0) and by_lc[old.id]["dur"] == pytest.approx(4000.0)
    assert by_lc[new.id]["args"]["outcome"] == "completed"


@pytest.mark.asyncio
async def test_written_json_loads_back_and_passes_the_structure_check(tmp_path: Path) -> None:
    """write() produces JSON that round-trips and satisfies the Chrome-trace checks."""
    rec, _, _ = await _reuse_story([0.0])
    path = rec.write(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    check_chrome_trace(trace)
    assert trace["displayTimeUnit"] == "ms"
    assert {e["ph"] for e in trace["traceEvents"]} <= {"M", "X", "i"}


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({}, "traceEvents"),
        ({"traceEvents": [{"name": "x", "ph": "B", "pid": 1, "tid": 1, "ts": 0}]}, "phase"),
        (
            {
                "traceEvents": [
                    {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "ts": 0},
                    {"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10},
                    {"name": "b", "ph": "X", "pid": 1, "tid": 1, "ts": 5, "dur": 10},
                ]
            },
            "overlaps",
        ),
        (
            {
                "traceEvents": [
                    {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "ts": 0},
                    {"name": "a", "ph": "i", "pid": 1, "tid": 1, "ts": 5},
                    {"name": "b", "ph": "i", "pid": 1, "tid": 1, "ts": 1},
                ]
            },
            "back in time",
        ),
        ({"traceEvents": [{"name": "a", "ph": "i", "pid": 1, "tid": 1, "ts": 1}]}, "thread_name"),
    ],
)
def test_the_structure_check_rejects_malformed_traces(bad: dict[str, Any], problem: str) -> None:
    """check_chrome_trace names what is wrong (so the tests above can fail)."""
    with pytest.raises(ValueError, match=problem):
        check_chrome_trace(bad)


@pytest.mark.asyncio
async def test_failures_and_drops_appear_as_instant_events() -> None:
    """A failed copy is drawn on its stream with outcome failed and as an instant event."""
    clock = [0.0]
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=64, host_pages=1, drain_timeout_s=5)
    backend = SimBackend()
    rec = TraceRecorder()
    async with kvo.OffloadManager(config, backend=backend, clock=lambda: clock[0]) as mgr:
        mgr.add_listener(rec)
        a = mgr.admit("a", [0, 1, 2, 3])
        a.extend([4, 5, 6, 7])
        b = mgr.admit("b", [0, 1, 2, 3])
        b.extend([4, 5, 6, 7])  # host pool (1 page) is full: dropped
        clock[0] = 0.002
        backend.fail(backend.pending[0])
        await mgr.settle()
        a.finish()
        b.finish()  # flushes b's tail: a second transfer
        backend.complete_all()
        await mgr.settle()
    trace = rec.chrome_trace()
    check_chrome_trace(trace)
    instants = {e["name"] for e in trace["traceEvents"] if e["pid"] == 3 and e["ph"] == "i"}
    assert {"chunk.dropped", "transfer.failed"} <= instants
    outcomes = sorted(e["args"]["outcome"] for e in trace["traceEvents"] if e["pid"] == 2 and e["ph"] == "X")
    assert outcomes == ["completed", "failed"]


@pytest.mark.asyncio
async def test_the_matplotlib_timeline_draws_one_row_per_lifecycle() -> None:
    """plot() draws state bars for each lifecycle and labels the rows by id."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    rec, old, new = await _reuse_story([0.0])
    ax = rec.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"#{old.id}", f"#{new.id}"]
    assert len(ax.patches) >= 6  # 3 live states per lifecycle + transfers
    import matplotlib.pyplot as plt

    plt.close("all")
