"""A decode scheduler that uses kvoffload exactly as a serving engine would.

This is the integration example (``examples/scheduler.py`` runs it) and the loop
behind ``kvoffload simulate``. One iteration is one decode step of the running batch:

1. admit the requests that have arrived (``mgr.admit(rid, prompt)``); a request that
   does not fit in device memory waits in the queue, as in an engine;
2. one forward pass: every running request commits one token (``lc.extend([tok])``),
   and kvoffload submits a chunk whenever a stride is due; it never blocks;
3. requests that reached their length ``finish()``; the ones the workload aborts
   ``abort()``; each finished request's slot is freed when ``await lc.wait_released()``
   returns (a small task per request, as an engine's detokenizer/cleanup would);
4. ``await`` the forward pass (``step_ms``), during which completions are delivered.

The plan's clock is the step count, never the machine's (FAILURES F39): step ``n``
is at ``n * step_ms`` of the plan (1 ms a step when ``step_ms`` is 0), so requests
arrive, and the sim copy engine's delays run out, at the same steps on a fast machine
and on a busy one. A slow machine makes a run longer, never a different run.

With the ``sim`` backend nothing completes by itself, so the loop also plays the copy
engine: it completes each pending transfer after a seeded random number of steps, and
before the next step waits until the manager took every completion it played and
finished every storage write queued (``settle()``). The run is then a function of
the seed: the same requests reuse the same finishing ids, the same completions arrive
late while their id is reused, in the same delivery batches. Everything else — which
lifecycle a completion reaches, when pages return — is the library's job.

Given an :class:`~kvoffload.tools.delivery_check.EngineRecord` (``engine=``), the loop also tells
it every token it committed and writes their KV into the device pool before it yields,
as a model's forward pass would (``kvoffload simulate`` checks each completion
against it).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from kvoffload.core.lifecycle import Lifecycle
from kvoffload.drivers._base import DriverBase
from kvoffload.drivers.asyncio import OffloadManager
from kvoffload.errors import PoolExhausted
from kvoffload.lifecycle.spec import LifecycleState
from kvoffload.tools.delivery_check import EngineRecord
from kvoffload.tools.workload import RequestPlan, WorkloadSpec

__all__ = ["DecodeScheduler", "SchedulerResult"]

_VOCAB = 32000


@dataclass
class SchedulerResult:
    """What the loop itself observed (the manager's counters are in ``statistics()``)."""

    steps: int = 0
    wall_s: float = 0.0
    finished: int = 0
    aborted: int = 0
    preempted: int = 0
    """Aborted because device memory ran out mid-decode."""
    reused_ids: int = 0
    """Admissions whose rid belonged to a lifecycle still FINISHING."""
    release_latency_s: list[float] = field(default_factory=list)
    """From ``finish()``/``abort()`` to RELEASED, per request."""
    invariant_checks: int = 0


@dataclass
class _Running:
    lc: Lifecycle
    plan: RequestPlan
    rng: random.Random
    steps: int = 0


class DecodeScheduler:
    """Play ``requests`` against ``mgr``: admit, extend per step, finish, abort, wait.
    ``run()`` drives an :class:`~kvoffload.OffloadManager` on the plan's clock (the
    step count, see the module doc); :mod:`kvoffload.tools.simulate_tp` steps the same
    decisions on a synchronous manager.

    ``on_release(n)`` is called each time ``n`` more requests were released (progress).
    ``check_every`` steps, ``mgr.check_invariants()`` runs (0: only at the end).
    ``engine``: told every token committed (``commit``); its KV is written each step
    (``write_kv``) before the loop yields.
    """

    def __init__(
        self,
        mgr: DriverBase,
        requests: list[RequestPlan],
        spec: WorkloadSpec,
        *,
        on_release: Callable[[int], None] | None = None,
        check_every: int = 50,
        engine: EngineRecord | None = None,
    ) -> None:
        self.mgr = mgr
        self.engine = engine
        self.spec = spec
        self.on_release = on_release
        self.check_every = check_every
        self.result = SchedulerResult()
        self._arrivals = list(reversed(requests))  # pop() takes the next arrival
        self._queue: list[RequestPlan] = []  # arrived, waiting for device pages
        self._running: list[_Running] = []
        self._finishing: dict[Any, Lifecycle] = {}  # rid -> a lifecycle still FINISHING
        self._rng = random.Random(spec.seed ^ 0xC0FFEE)
        self._due: dict[int, float] = {}  # sim: transfer id -> when it completes (plan seconds)
        self._sim: Any = None
        # pace: plan seconds per step (step_ms; 1 ms when step_ms is 0, so arrivals come).
        self.pace = (spec.step_ms or 1.0) / 1000
        # _now: the plan's clock, in seconds; advanced by pace once per step, by run() only.
        # Invariant: self._now == (steps run so far, tail steps included) * self.pace
        self._now = 0.0

    async def run(self) -> SchedulerResult:
        """Run every request to RELEASED; return what the loop saw."""
        from kvoffload.backends._sim import SimBackend

        backend = getattr(self.mgr.backend, "inner", self.mgr.backend)
        self._sim = backend if isinstance(backend, SimBackend) else None
        mgr = self.mgr
        assert isinstance(mgr, OffloadManager), "the asyncio loop needs an OffloadManager"
        step_s = self.spec.step_ms / 1000
        start = time.monotonic()
        try:
            async with anyio.create_task_group() as tg:
                while self._arrivals or self._queue or self._running:
                    # As an engine's loop: the step's results first (extend, finish,
                    # abort), then scheduling - so an arrival can reuse the id of a
                    # request that has just finished and whose copies are still running.
                    self._decode_step(tg)
                    self._admit_arrivals(self._now)
                    if self.engine is not None:  # the step's KV, before any copy may read it
                        self.engine.write_kv()
                    self._play_copy_engine()
                    self.result.steps += 1
                    if self.check_every and self.result.steps % self.check_every == 0:
                        self.mgr.check_invariants()
                        self.result.invariant_checks += 1
                    await self._forward_pass(mgr, step_s)
                while self._sim is not None and self._sim.pending:  # the last copies
                    self._play_copy_engine()
                    await self._forward_pass(mgr, step_s)
        except BaseException:
            if self._sim is not None:  # the copy engine stops with us: let the manager drain
                self._sim.complete_all()
            raise
        await mgr.wait_drained()
        self.mgr.check_invariants()
        self.result.invariant_checks += 1
        self.result.wall_s = time.monotonic() - start
        return self.result

    async def _forward_pass(self, mgr: OffloadManager, step_s: float) -> None:
        """The forward pass (``step_s`` of wall time, during which completions arrive),
        then the plan's clock moves one step. With the sim backend, the copies this loop
        completed are all delivered (and the writes they queued done) before the next
        step, however long that takes the machine: the schedule never races it."""
        await anyio.sleep(step_s)
        if self._sim is not None:
            await mgr.settle()
        self._now += self.pace
        # A released request's id is free again, at the same step on every machine
        # (its waiter task, which also forgets it, runs whenever the event loop gets to it).
        self._finishing = {rid: lc for rid, lc in self._finishing.items() if not lc.released}

    # --- one step --------------------------------------------------------------------

    def _admit_arrivals(self, now: float) -> None:
        while self._arrivals and self._arrivals[-1].arrival_s <= now:
            self._queue.append(self._arrivals.pop())
        while self._queue:
            p = self._queue[0]
            rid = self._rid_for(p)
            rng = random.Random(self.spec.seed * 1_000_003 + p.index)
            prompt = [rng.randrange(_VOCAB) for _ in range(p.prompt_len)]
            try:
                lc = self.mgr.admit(rid, prompt)
            except PoolExhausted:
                break  # no device memory: it waits, and so does everything behind it
            self._queue.pop(0)
            if self.engine is not None:
                self.engine.commit(lc, prompt)
            self._running.append(_Running(lc, p, rng))

    def _rid_for(self, p: RequestPlan) -> str:
        if p.reuse:
            for rid, old in self._finishing.items():
                if old.state is LifecycleState.FINISHING:
                    self.result.reused_ids += 1
                    return str(rid)
        return f"req-{p.index}"

    def _decode_step(self, tg: Any) -> None:
        still: list[_Running] = []
        done: list[_Running] = []
        for r in self._running:
            if r.plan.abort_after is not None and r.steps >= r.plan.abort_after:
                r.lc.abort()
                self.result.aborted += 1
                self._retire(tg, r.lc)
                continue
            token = r.rng.randrange(_VOCAB)
            try:
                r.lc.extend([token])
            except PoolExhausted:  # out of device memory mid-decode: preempt it
                r.lc.abort()
                self.result.preempted += 1
                self._retire(tg, r.lc)
                continue
            if self.engine is not None:
                self.engine.commit(r.lc, [token])
            r.steps += 1
            (done if r.steps >= r.plan.output_len else still).append(r)
        if self.engine is not None:  # the forward pass wrote the step's KV ...
            self.engine.write_kv()
        for r in done:  # ... before a request finishes: it may be released at once, its
            r.lc.finish()  # pages given to an arrival of this same step
            self.result.finished += 1
            self._retire(tg, r.lc)
        self._running = still

    def _retire(self, tg: Any, lc: Lifecycle) -> None:
        if lc.state is LifecycleState.FINISHING:
            self._finishing[lc.rid] = lc
        tg.start_soon(self._await_release, lc, time.monotonic())

    async def _await_release(self, lc: Lifecycle, since: float) -> None:
        await lc.wait_released()  # device pages are back: the engine may reuse the slot
        self.result.release_latency_s.append(time.monotonic() - since)
        if self._finishing.get(lc.rid) is lc:
            del self._finishing[lc.rid]
        if self.on_release is not None:
            self.on_release(1)

    def _play_copy_engine(self) -> None:
        """``sim`` only: complete each pending transfer after an exponential delay
        (seeded, on the plan's clock)."""
        sim = self._sim
        if sim is None:
            return
        now = self._now
        mean = self.spec.copy_delay_ms / 1000
        due = self._due
        for t in list(sim.pending):
            when = due.get(t.id)
            if when is None:
                due[t.id] = now + (self._rng.expovariate(1 / mean) if mean > 0 else 0.0)
            elif when <= now:
                del due[t.id]
                sim.complete(t)
