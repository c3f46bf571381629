"""``kvoffload simulate --tp N``: the simulated workload on N local tensor-parallel ranks.

Each rank is a spawned process in one gloo group (:class:`~kvoffload._testing.ranks.LocalRanks`)
running a replicated scheduler: the same requests, the same decisions, step by step,
on a :class:`~kvoffload.SyncOffloadManager` with ``group=``. What differs per rank is
what differs in a real deployment: each rank's copies finish at their own times (the
sim backend's copy engine is seeded per rank) and each rank's injected copy failures
are its own. The ranks agree inside ``poll()``; this module checks that they did:
every rank's ledger balanced, and every rank released the same lifecycles in the same
steps. The summary is printed once, from rank 0's figures.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from kvoffload.config import OffloadConfig
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.lifecycle.spec import LifecycleState
from kvoffload.tools.scheduler import DecodeScheduler, SchedulerResult
from kvoffload.tools.workload import RequestPlan, WorkloadSpec

if TYPE_CHECKING:
    from kvoffload.drivers.sync import SyncOffloadManager

__all__ = ["StepScheduler", "check_ranks", "run_rank", "simulate_tp"]

#: Steps between two ledger checks on every rank.
_CHECK_EVERY = 50


class StepScheduler(DecodeScheduler):
    """:class:`~kvoffload.tools.scheduler.DecodeScheduler`'s decode loop on a synchronous
    manager, stepped: arrivals come by step number (the plan's arrival time over
    ``step_ms``), never by a rank's wall clock, so replicated ranks make the same
    decisions. Each step polls once (a collective under a group), then decodes, admits
    and - with the sim backend - plays this rank's copy engine, which finishes a copy
    after a random number of steps drawn from ``seed`` and ``rank``."""

    def __init__(
        self, mgr: SyncOffloadManager, requests: list[RequestPlan], spec: WorkloadSpec, rank: int
    ) -> None:
        super().__init__(mgr, requests, spec)
        self.sync_mgr = mgr
        # pace: seconds of the plan's time per step (arrivals, copy delays); at least 1 ms.
        self.pace = max(spec.step_ms, 1.0) / 1000
        self._rng = random.Random(f"{spec.seed}/copy-engine/{rank}")
        self.releases: list[list[Any]] = []  # [step, lifecycle id, outcome], in release order
        self._retired: dict[int, float] = {}  # lifecycle id -> when it finished or was aborted

    def on_released(self, lc: Lifecycle) -> None:
        """The manager's ``on_released``: the step it came in, and its latency."""
        outcome = lc.outcome.value if lc.outcome is not None else None
        self.releases.append([self.result.steps, int(lc.id), outcome])
        since = self._retired.pop(lc.id, None)
        if since is not None:
            self.result.release_latency_s.append(time.monotonic() - since)
        if self._finishing.get(lc.rid) is lc:
            del self._finishing[lc.rid]

    def _retire(self, tg: Any, lc: Lifecycle) -> None:
        if lc.released:  # released by the call that retired it (on_released has run)
            self.result.release_latency_s.append(0.0)
            return
        if lc.state is LifecycleState.FINISHING:
            self._finishing[lc.rid] = lc
        self._retired[lc.id] = time.monotonic()

    def run_steps(self) -> SchedulerResult:
        """Run every request to RELEASED; return what the loop saw. If the loop fails,
        this rank's copy engine finishes every copy first, so the manager can drain."""
        from kvoffload.backends._sim import SimBackend

        mgr = self.sync_mgr
        backend = getattr(mgr.backend, "inner", mgr.backend)
        self._sim = backend if isinstance(backend, SimBackend) else None
        step_s = self.spec.step_ms / 1000
        start = time.monotonic()
        try:
            while self._arrivals or self._queue or self._running or self._retired:
                mgr.poll()  # before scheduling, once per step (SGLang's check_offload_progress)
                self._decode_step(None)
                self._admit_arrivals(self.result.steps * self.pace)
                self._play_copy_engine()
                self.result.steps += 1
                if self.result.steps % _CHECK_EVERY == 0:
                    mgr.check_invariants()
                    self.result.invariant_checks += 1
                if step_s:
                    time.sleep(step_s)  # the forward pass
        except BaseException:
            if self._sim is not None:
                self._sim.complete_all()
            raise
        mgr.check_invariants()
        self.result.invariant_checks += 1
        self.result.wall_s = time.monotonic() - start
        return self.result

    def _play_copy_engine(self) -> None:
        sim = self._sim
        if sim is None:
            return
        step = self.result.steps
        mean = self.spec.copy_delay_ms / 1000 / self.pace  # in steps
        due = self._due
        for t in list(sim.pending):
            when = due.get(t.id)
            if when is None:
                when = due[t.id] = step + (round(self._rng.expovariate(1 / mean)) if mean > 0 else 0)
            if when <= step:
                del due[t.id]
                sim.complete(t)


def run_rank(
    ctx: Any,
    spec: WorkloadSpec,
    config: OffloadConfig,
    backend: str,
    storage: Any,
    log_level: str | None = None,
) -> dict[str, Any]:
    """One rank's run (in its process): the summary dict of
    :func:`~kvoffload.tools.simulate.build_report` plus ``tp``: this rank's release sequence.
    ``storage`` is what ``resolve_storage`` takes (a directory shared by the ranks).
    ``log_level``: where this rank's process sends kvoffload's events, as the command
    line does for its own (the rank's process is the application here)."""
    if log_level is not None:
        import sys

        import structlog

        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(log_level.upper()),
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        )
    from kvoffload.backends import resolve_backend
    from kvoffload.drivers.sync import SyncOffloadManager
    from kvoffload.tools.simulate import build_report, describe_error, verdict
    from kvoffload.tools.workload import FaultyBackend, RunMonitor, plan

    faulty = FaultyBackend(resolve_backend(backend), spec.fail, spec.seed * 7919 + ctx.rank)
    monitor = RunMonitor()
    requests = plan(spec)
    sched: StepScheduler | None = None

    def released(lc: Lifecycle) -> None:
        assert sched is not None
        sched.on_released(lc)

    mgr = SyncOffloadManager(config, backend=faulty, storage=storage, group=ctx.group, on_released=released)
    sched = StepScheduler(mgr, requests, spec, ctx.rank)
    mgr.add_listener(monitor)
    error: str | None = None
    try:
        with mgr:
            try:
                sched.run_steps()
            except Exception as exc:
                error = describe_error(exc)
    except Exception as exc:
        error = error or describe_error(exc)
    stats = mgr.statistics()
    error = verdict(mgr, monitor, error)
    report = build_report(
        spec, config, faulty.name, str(storage), sched.result, monitor, stats, error, faulty
    )
    report["tp"] = {"rank": ctx.rank, "releases": sched.releases, "injected": faulty.injected}
    return report


def check_ranks(reports: list[dict[str, Any]]) -> str | None:
    """``None`` when every rank's ledger balanced and every rank released the same
    lifecycles (same ids, same outcomes) in the same steps; else what went wrong."""
    problems = []
    for i, r in enumerate(reports):
        if not r["ledger"]["ok"]:
            problems.append(f"rank {i}: {r['ledger']['error']}")
    first = reports[0]["tp"]["releases"]
    for i, r in enumerate(reports[1:], 1):
        mine = r["tp"]["releases"]
        if mine != first:
            pairs = enumerate(zip(first, mine, strict=False))
            k = next((k for k, (a, b) in pairs if a != b), min(len(first), len(mine)))
            a = first[k] if k < len(first) else "nothing"
            b = mine[k] if k < len(mine) else "nothing"
            problems.append(
                f"release sequences differ: release {k} was [step, lifecycle, outcome] {a} on rank 0 "
                f"and {b} on rank {i}"
            )
    return "; ".join(problems) or None


def simulate_tp(
    spec: WorkloadSpec,
    config: OffloadConfig,
    tp: int,
    backend: str = "sim",
    storage: Any = "memory",
    store_desc: str | None = None,
    *,
    timeout_s: float = 600.0,
    log_level: str | None = None,
) -> dict[str, Any]:
    """Run ``spec`` on ``tp`` local ranks; return rank 0's summary dict with a ``tp``
    section (ranks, keys, whether every ledger balanced and the release sequences were
    identical) and ``ledger`` failed when either check failed. ``storage``: what
    ``resolve_storage`` takes, as a string (each rank opens its own: a directory or a
    redis URL is shared, ``"memory"`` is per rank), or ``None``. ``log_level``: the
    ranks' kvoffload events at or above it go to stderr (None: structlog's defaults).
    ``timeout_s`` bounds the whole run. Raises
    :class:`~kvoffload._testing.ranks.RanksFailed` when a rank crashed."""
    from kvoffload._testing.ranks import LocalRanks
    from kvoffload.storage._url import redact
    from kvoffload.tools.simulate import check_workload

    check_workload(spec, config)
    with LocalRanks(tp, timeout_s=timeout_s) as ranks:
        reports = ranks.run(run_rank, spec, config, backend, storage, log_level)
    problem = check_ranks(reports)
    report: dict[str, Any] = reports[0]
    report["setup"]["store"] = redact(store_desc or str(storage))
    releases = reports[0]["tp"]["releases"]
    report["tp"] = {
        "ranks": tp,
        "keys": config.tp_keys,
        "ledgers_balanced": all(r["ledger"]["ok"] for r in reports),
        "identical_releases": all(r["tp"]["releases"] == releases for r in reports),
        "released": len(releases),
        "release_steps": len({step for step, _, _ in releases}),
        "injected": [r["tp"]["injected"] for r in reports],
    }
    if problem is not None:
        report["ledger"] = {**report["ledger"], "ok": False, "error": problem}
    return report
