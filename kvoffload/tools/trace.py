"""Timelines of a run: Chrome-trace / Perfetto JSON, and a matplotlib timeline.

:class:`TraceRecorder` is a manager listener (``mgr.add_listener(recorder)``): it keeps
the events a timeline needs, nothing else, and draws

- one track per lifecycle (process "lifecycles", thread ``#id rid``) showing the state
  it was in, as complete (``ph: "X"``) slices from one transition to the next;
- one track per copy stream (process "copy streams") showing each transfer from
  submission to delivery. Transfers on one stream overlap (several are in flight), so
  a stream is drawn as lanes ``stream 0 · lane k``, a transfer taking the first lane
  free at its submission; slices on one track never overlap;
- instant events (``ph: "i"``) for drops, failures, storage writes and watchdog reports.

Load the JSON in https://ui.perfetto.dev or chrome://tracing. Timestamps are the
manager's clock in microseconds, from the first event recorded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.errors import MissingDependency

__all__ = ["StateSpan", "TraceRecorder", "TransferSpan", "check_chrome_trace"]

_PID_LIFECYCLES = 1
_PID_STREAMS = 2
_PID_EVENTS = 3
_INSTANTS = ("chunk.dropped", "transfer.failed", "storage.written", "storage.failed", "lifecycle.stuck")


@dataclass(slots=True)
class StateSpan:
    """A lifecycle in one state from ``start`` to ``end`` (None: still in it)."""

    lifecycle: int
    rid: Any
    state: str
    start: float
    end: float | None = None


@dataclass(slots=True)
class TransferSpan:
    """One transfer from submission to delivery (``end`` None: still in flight)."""

    transfer: int
    lifecycle: int
    rid: Any
    stream: int
    pages: int
    start: float
    end: float | None = None
    outcome: str = "inflight"
    lane: int = 0


@dataclass
class TraceRecorder:
    """Record a run for a timeline; attach with ``mgr.add_listener(recorder)``.

    Called on the event loop thread, once per event; O(1) per event.
    """

    states: list[StateSpan] = field(default_factory=list)
    transfers: dict[int, TransferSpan] = field(default_factory=dict)
    instants: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    # _open: lifecycle id -> its current (open) state span.
    _open: dict[int, StateSpan] = field(default_factory=dict)
    # _lanes: stream -> end time of the last transfer on each lane (None: lane busy).
    _lanes: dict[int, list[float | None]] = field(default_factory=dict)

    def __call__(self, name: str, fields: dict[str, Any]) -> None:
        t = float(fields.get("t", 0.0))
        if name == "lifecycle.admitted":
            self._enter(fields["lifecycle"], fields["rid"], "PENDING", t)
        elif name == "lifecycle.transition" and fields["from"] != fields["to"]:
            self._enter(fields["lifecycle"], fields["rid"], fields["to"], t)
        elif name == "lifecycle.released":
            open_span = self._open.pop(fields["lifecycle"], None)
            if open_span is not None:
                open_span.end = t
        elif name == "transfer.submitted":
            stream = int(fields.get("stream", 0))
            span = TransferSpan(
                fields["transfer"], fields["lifecycle"], fields["rid"], stream, fields["pages"], t
            )
            span.lane = self._take_lane(stream, t)
            self.transfers[span.transfer] = span
        elif name in ("transfer.completed", "transfer.failed", "transfer.discarded"):
            tspan = self.transfers.get(fields["transfer"])
            if tspan is not None and tspan.end is None:
                tspan.end = t
                tspan.outcome = name.split(".", 1)[1]
                self._lanes[tspan.stream][tspan.lane] = t
        if name in _INSTANTS:
            self.instants.append((name, t, {k: v for k, v in fields.items() if k != "t"}))

    def _enter(self, lid: int, rid: Any, state: str, t: float) -> None:
        prev = self._open.get(lid)
        if prev is not None:
            prev.end = t
        span = StateSpan(lid, rid, state, t)
        self.states.append(span)
        if state != "RELEASED":
            self._open[lid] = span
        else:
            span.end = t
            self._open.pop(lid, None)

    def _take_lane(self, stream: int, t: float) -> int:
        lanes = self._lanes.setdefault(stream, [])
        for i, free_at in enumerate(lanes):
            if free_at is not None and free_at <= t:
                lanes[i] = None
                return i
        lanes.append(None)
        return len(lanes) - 1

    # --- export --------------------------------------------------------------------

    def _origin(self) -> float:
        starts = [s.start for s in self.states] + [s.start for s in self.transfers.values()]
        starts += [t for _, t, _ in self.instants]
        return min(starts, default=0.0)

    def _last(self) -> float:
        ends = [s.end or s.start for s in self.states] + [s.end or s.start for s in self.transfers.values()]
        ends += [t for _, t, _ in self.instants]
        return max(ends, default=0.0)

    def chrome_trace(self) -> dict[str, Any]:
        """The run as a Chrome-trace object: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

        Open spans (still in a state, or a transfer still in flight) end at the last
        recorded time. Slice events on each (pid, tid) are sorted by ``ts`` and never
        overlap.
        """
        t0, last = self._origin(), self._last()

        def us(t: float) -> float:
            return round((t - t0) * 1e6, 3)

        meta: list[dict[str, Any]] = [
            _meta("process_name", _PID_LIFECYCLES, 0, name="lifecycles"),
            _meta("process_name", _PID_STREAMS, 0, name="copy streams"),
            _meta("process_name", _PID_EVENTS, 0, name="events"),
            _meta("thread_name", _PID_EVENTS, 0, name="drops, failures, storage, watchdog"),
        ]
        events: list[dict[str, Any]] = []
        named: set[tuple[int, int]] = set()
        for s in self.states:
            if (_PID_LIFECYCLES, s.lifecycle) not in named:
                named.add((_PID_LIFECYCLES, s.lifecycle))
                meta.append(
                    _meta("thread_name", _PID_LIFECYCLES, s.lifecycle, name=f"#{s.lifecycle} {s.rid}")
                )
            if s.state == "RELEASED":
                events.append(
                    {"name": "RELEASED", "ph": "i", "s": "t", "pid": _PID_LIFECYCLES, "tid": s.lifecycle,
                     "ts": us(s.start), "cat": "lifecycle", "args": {"rid": str(s.rid)}}
                )  # fmt: skip
                continue
            end = s.end if s.end is not None else last
            events.append(
                {"name": s.state, "ph": "X", "pid": _PID_LIFECYCLES, "tid": s.lifecycle, "ts": us(s.start),
                 "dur": round(max(us(end) - us(s.start), 0.0), 3), "cat": "lifecycle",
                 "args": {"rid": str(s.rid), "lifecycle": s.lifecycle}}
            )  # fmt: skip
        for tr in self.transfers.values():
            tid = tr.stream * 1000 + tr.lane
            if (_PID_STREAMS, tid) not in named:
                named.add((_PID_STREAMS, tid))
                meta.append(
                    _meta("thread_name", _PID_STREAMS, tid, name=f"stream {tr.stream} · lane {tr.lane}")
                )
            end = tr.end if tr.end is not None else last
            events.append(
                {"name": f"transfer {tr.transfer}", "ph": "X", "pid": _PID_STREAMS, "tid": tid,
                 "ts": us(tr.start), "dur": round(max(us(end) - us(tr.start), 0.0), 3), "cat": "transfer",
                 "args": {"lifecycle": tr.lifecycle, "rid": str(tr.rid), "pages": tr.pages,
                          "outcome": tr.outcome}}
            )  # fmt: skip
        for name, t, fields in self.instants:
            args = {
                k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                for k, v in fields.items()
            }
            events.append(
                {"name": name, "ph": "i", "s": "t", "pid": _PID_EVENTS, "tid": 0, "ts": us(t),
                 "cat": name.split(".", 1)[0], "args": args}
            )  # fmt: skip
        events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"]))
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        """Write :meth:`chrome_trace` as JSON to ``path``; return the path."""
        path = Path(path)
        path.write_text(json.dumps(self.chrome_trace()))
        return path

    def plot(self, ax: Any = None, max_lifecycles: int = 60) -> Any:
        """A matplotlib timeline: one row per lifecycle (coloured by state) for the first
        ``max_lifecycles`` lifecycles, and transfers as thin bars under their row.
        Returns the axis. Raises :class:`~kvoffload.MissingDependency` without matplotlib."""
        try:
            import matplotlib.pyplot as plt
            from matplotlib.patches import Patch
        except ImportError:
            raise MissingDependency("TraceRecorder.plot needs matplotlib: pip install matplotlib") from None
        colors = {"PENDING": "#9ecae1", "OFFLOADING": "#fd8d3c", "FINISHING": "#de2d26"}
        ids = sorted({s.lifecycle for s in self.states})[:max_lifecycles]
        row = {lid: i for i, lid in enumerate(ids)}
        if ax is None:
            _, ax = plt.subplots(figsize=(11, max(2.5, 0.18 * len(ids) + 1)))
        t0, last = self._origin(), self._last()
        for s in self.states:
            if s.lifecycle in row and s.state in colors:
                end = s.end if s.end is not None else last
                ax.barh(row[s.lifecycle], (end - s.start) * 1e3, left=(s.start - t0) * 1e3, height=0.8,
                        color=colors[s.state], linewidth=0)  # fmt: skip
        for tr in self.transfers.values():
            if tr.lifecycle in row:
                end = tr.end if tr.end is not None else last
                color = "magenta" if tr.outcome == "failed" else "black"
                ax.barh(row[tr.lifecycle] + 0.45, (end - tr.start) * 1e3, left=(tr.start - t0) * 1e3,
                        height=0.12, color=color, linewidth=0)  # fmt: skip
        ax.set_yticks(range(len(ids)))
        ax.set_yticklabels([f"#{lid}" for lid in ids], fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("ms since start")
        handles = [Patch(color=c, label=s) for s, c in colors.items()]
        handles += [Patch(color="black", label="transfer"), Patch(color="magenta", label="failed transfer")]
        ax.legend(handles=handles, loc="upper right", fontsize=7)
        return ax


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": args}


def check_chrome_trace(trace: Any) -> None:
    """Raise ``ValueError`` naming the first problem if ``trace`` is not a Chrome-trace
    object as :meth:`TraceRecorder.chrome_trace` promises: a ``traceEvents`` list of
    events with ``name``, ``ph`` in M/X/i, int ``pid``/``tid``, numeric ``ts`` >= 0;
    ``X`` events with ``dur`` >= 0; on each (pid, tid), ``ts`` non-decreasing and no
    two ``X`` slices overlapping; every track named by a ``thread_name`` event."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: no traceEvents list")
    last: dict[tuple[int, int], float] = {}
    slice_end: dict[tuple[int, int], float] = {}
    named: set[tuple[int, int]] = set()
    used: set[tuple[int, int]] = set()
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise ValueError(f"event {i} has no name: {e!r}")
        ph = e.get("ph")
        if ph not in ("M", "X", "i"):
            raise ValueError(f"event {i} has phase {ph!r}; expected M, X or i")
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            raise ValueError(f"event {i} lacks an int pid/tid: {e!r}")
        track = (e["pid"], e["tid"])
        if ph == "M":
            if e["name"] == "thread_name":
                named.add(track)
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or ts < 0:
            raise ValueError(f"event {i} has a bad ts {ts!r}")
        if ts < last.get(track, 0.0):
            raise ValueError(f"event {i}: ts {ts} goes back in time on track {track}")
        last[track] = ts
        used.add(track)
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                raise ValueError(f"event {i} has a bad dur {dur!r}")
            if ts < slice_end.get(track, 0.0) - 1e-3:
                raise ValueError(f"event {i} overlaps the previous slice on track {track}")
            slice_end[track] = ts + dur
    if unnamed := used - named:
        raise ValueError(f"tracks without a thread_name: {sorted(unnamed)}")
