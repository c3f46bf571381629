"""A synthetic decode workload for ``kvoffload simulate``, seeded.

:class:`WorkloadSpec` holds every size and rate; :func:`plan` turns it into a list of
:class:`RequestPlan` (arrival time, prompt and output lengths, whether it reuses the
id of a request that is still finishing, when it is aborted). The scheduler
(:mod:`kvoffload.tools.scheduler`) plays the plan against an :class:`~kvoffload.OffloadManager`.

:class:`FaultyBackend` wraps any event backend and turns a seeded share of its
completions into copy failures, so failures are injected the same way on the ``sim``
and ``cpu`` backends. :class:`RunMonitor` is the listener that gathers the figures of
the summary (latencies, late completions, storage writes) and checks every delivered
completion against what the simulated engine committed
(:class:`~kvoffload.tools.delivery_check.EngineRecord`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.abc import Completion, EventBackend
from kvoffload.errors import BackendError, ConfigError

if TYPE_CHECKING:
    from kvoffload.abc import Transfer
    from kvoffload.config import OffloadConfig
    from kvoffload.pools import DevicePool, EnginePages, HostPool
    from kvoffload.tools.delivery_check import EngineRecord

__all__ = ["FaultyBackend", "RequestPlan", "RunMonitor", "WorkloadSpec", "percentiles", "plan"]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Every size and rate of a simulated run (the ``kvoffload simulate`` options)."""

    requests: int = 200
    """Requests to run."""
    arrival_rate: float = 400.0
    """Mean arrivals per second (Poisson)."""
    prompt_mean: int = 200
    """Mean prompt length in tokens (log-normal)."""
    output_mean: int = 96
    """Mean output length in tokens (log-normal); one token per decode step."""
    reuse: float = 0.2
    """Share of arrivals that reuse the id of a request still FINISHING."""
    abort: float = 0.05
    """Share of requests aborted part-way through decoding."""
    fail: float = 0.02
    """Share of copies that fail (injected)."""
    step_ms: float = 1.0
    """Duration of one decode step (the forward pass the scheduler awaits)."""
    copy_delay_ms: float = 4.0
    """Mean copy latency with the ``sim`` backend (exponential)."""
    seed: int = 0
    """Seed of every random choice."""

    def __post_init__(self) -> None:
        if type(self.requests) is not int or self.requests <= 0:
            raise ConfigError(f"requests must be a positive int, got {self.requests!r}")
        for name in ("prompt_mean", "output_mean"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        for name in ("reuse", "abort", "fail"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"{name} is a share: it must be between 0 and 1, got {v!r}")
        for name in ("arrival_rate", "step_ms", "copy_delay_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.arrival_rate <= 0:
            raise ConfigError(f"arrival_rate must be > 0, got {self.arrival_rate!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request of the workload."""

    index: int
    arrival_s: float
    """Seconds after the start at which it arrives."""
    prompt_len: int
    output_len: int
    reuse: bool
    """Take the id of a request still FINISHING, when there is one."""
    abort_after: int | None
    """Abort after this many decode steps (None: runs to the end)."""


def _lognormal(rng: random.Random, mean: int, sigma: float, cap: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that the mean is `mean`
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def plan(spec: WorkloadSpec) -> list[RequestPlan]:
    """The requests of ``spec``, in arrival order; the same seed gives the same plan."""
    rng = random.Random(spec.seed)
    t = 0.0
    out = []
    for i in range(spec.requests):
        t += rng.expovariate(spec.arrival_rate)
        output_len = _lognormal(rng, spec.output_mean, 0.6, 8 * spec.output_mean)
        aborted = rng.random() < spec.abort
        out.append(
            RequestPlan(
                index=i,
                arrival_s=t,
                prompt_len=_lognormal(rng, spec.prompt_mean, 0.6, 4 * spec.prompt_mean),
                output_len=output_len,
                reuse=rng.random() < spec.reuse,
                abort_after=rng.randrange(output_len) if aborted else None,
            )
        )
    return out


class FaultyBackend(EventBackend):
    """Wraps an event backend; each completion fails with probability ``rate`` (seeded).

    The copy itself still ran: only its result is reported as a failure, which the
    manager must handle like any other failed copy (host pages back, outcome FAILED).
    """

    def __init__(
        self,
        inner: EventBackend,
        rate: float,
        seed: int = 0,
        *,
        on_submit: Callable[[Transfer], None] | None = None,
    ) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # report the wrapped backend's name
        self.device_type = inner.device_type  # type: ignore[misc]
        self.pins_host = inner.pins_host  # type: ignore[misc]
        self.rate = rate
        self._rng = random.Random(seed ^ 0x5EED)
        self.injected = 0
        # on_submit(t): told of every transfer the wrapped backend accepted.
        self.on_submit = on_submit

    def create_pools(self, config: OffloadConfig, host_buffer: Any = None) -> tuple[DevicePool, HostPool]:
        return self.inner.create_pools(config, host_buffer)

    def create_host_pool(
        self, n_pages: int, page_shape: Sequence[int], dtype: str, *, zero: bool = False, buffer: Any = None
    ) -> HostPool:
        return self.inner.create_host_pool(n_pages, page_shape, dtype, zero=zero, buffer=buffer)

    def open(self, device: DevicePool | EnginePages, host: HostPool) -> None:
        self.device_type = self.inner.device_type  # type: ignore[misc]
        self.inner.open(device, host)
        self.completes_on_its_own = self.inner.completes_on_its_own  # type: ignore[misc]
        self.needs_polling = self.inner.needs_polling  # type: ignore[misc]

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        self.inner.set_waker(waker)

    def submit(self, transfer: Transfer) -> None:
        self.inner.submit(transfer)  # a refusal raises here: nothing to tell
        if self.on_submit is not None:
            self.on_submit(transfer)

    def launch(self) -> None:
        self.inner.launch()

    def take_completions(self, max_completions: int | None = None) -> list[Completion]:
        out: list[Completion] = []
        for tid, err in self.inner.take_completions(max_completions):
            if err is None and self.rate and self._rng.random() < self.rate:
                self.injected += 1
                err = BackendError(f"injected copy failure of transfer {tid}")
            out.append((tid, err))
        return out

    @property
    def ready(self) -> int:
        return self.inner.ready

    def wait_ready(self, timeout: float | None) -> bool:
        return self.inner.wait_ready(timeout)

    def take_ready_nowait(self) -> bool:
        return self.inner.take_ready_nowait()

    @property
    def signalled(self) -> int:
        return self.inner.signalled

    @property
    def streams(self) -> int:
        return self.inner.streams

    def running(self) -> list[Transfer]:
        return self.inner.running()

    def close(self) -> None:
        self.inner.close()

    def join(self, timeout: float | None = None) -> bool:
        return self.inner.join(timeout)


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles of ``values`` (empty: zeros), plus the max."""
    if not values:
        return {**{f"p{p}": 0.0 for p in ps}, "max": 0.0}
    s = sorted(values)
    out = {f"p{p}": s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] for p in ps}
    out["max"] = s[-1]
    return out


@dataclass
class RunMonitor:
    """A manager listener gathering what the summary reports, and the check of every
    delivered completion.

    With an ``engine`` record, each completion (copied, failed or discarded) is checked
    against what the simulated engine committed to the lifecycle the completion
    reached (the lifecycle its event names): its keys, and for a copied or discarded
    chunk its host bytes when the engine writes KV
    (:meth:`~kvoffload.tools.delivery_check.EngineRecord.check`).
    ``mismatched`` counts the completions that fail the check: one delivered to a
    lifecycle that did not issue it (F1: its KV names another lifecycle, and its keys
    differ unless both committed the same tokens), keys computed from the wrong chain
    (F11), or a copy that read a page before it was written or after it was freed and
    reused (F19, F4). ``checked`` and ``bytes_checked`` count what was checked. The
    manager is asked for nothing: the transfers come from the backend
    (:meth:`submitted`, given to :class:`FaultyBackend` as ``on_submit``).

    A *late completion* is one delivered while its lifecycle's request id was also the
    id of another live lifecycle (a reused id): the case F1 is about.
    """

    engine: EngineRecord | None = None
    transfer_latency_s: list[float] = field(default_factory=list)
    late_completions: int = 0
    checked: int = 0
    bytes_checked: int = 0
    mismatched: int = 0
    first_mismatch: str | None = None
    stuck_reports: int = 0
    bytes_copied: int = 0
    bytes_stored: int = 0
    # _live_by_rid: rid -> ids of its live lifecycles.
    _live_by_rid: dict[Any, set[int]] = field(default_factory=dict)
    # _transfers: transfers the backend accepted and not yet delivered, by id.
    _transfers: dict[int, Transfer] = field(default_factory=dict)

    def submitted(self, t: Transfer) -> None:
        """The backend accepted ``t`` (the copy engine's view, not the manager's)."""
        self._transfers[t.id] = t

    def __call__(self, name: str, f: dict[str, Any]) -> None:
        if name == "lifecycle.admitted":
            self._live_by_rid.setdefault(f["rid"], set()).add(f["lifecycle"])
        elif name == "lifecycle.released":
            ids = self._live_by_rid.get(f["rid"])
            if ids is not None:
                ids.discard(f["lifecycle"])
                if not ids:
                    del self._live_by_rid[f["rid"]]
            if self.engine is not None:
                self.engine.forget(f["lifecycle"])
        elif name in ("transfer.completed", "transfer.failed", "transfer.discarded"):
            self._delivered(name, f)
            if len(self._live_by_rid.get(f["rid"], ())) > 1:
                self.late_completions += 1
            if name == "transfer.completed":
                self.transfer_latency_s.append(f["latency_s"])
                self.bytes_copied += f.get("bytes", 0)
        elif name == "storage.written":
            self.bytes_stored += f.get("bytes", 0)
        elif name == "lifecycle.stuck":
            self.stuck_reports += 1

    def _delivered(self, name: str, f: dict[str, Any]) -> None:
        t = self._transfers.pop(f["transfer"], None)
        engine = self.engine
        if engine is None:
            return
        with_bytes = name != "transfer.failed" and engine.checks_bytes
        if t is None:
            problem: str | None = f"transfer {f['transfer']} was delivered but the backend never accepted it"
        else:
            problem = engine.check(t, f["lifecycle"], with_bytes=with_bytes)
        self.checked += 1
        self.bytes_checked += with_bytes
        if problem is not None:
            self.mismatched += 1
            if self.first_mismatch is None:
                self.first_mismatch = problem
