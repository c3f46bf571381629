"""The vLLM connector's ``kvoffload_*`` series, the vLLM way: stats from the engine core,
exported by vLLM's own Prometheus setup.

vLLM serves ``/metrics`` from its API server process; the connector's figures live in
the EngineCore process, on the scheduler side's core (the planner's: every copy, write
and load counts there once every rank reported it). vLLM carries connector figures
across with its stats: each step the scheduler asks the connector for
``get_kv_connector_stats()`` and sends the data in ``SchedulerStats``; the API server's
``PrometheusStatLogger`` hands it to the ``KVConnectorPromMetrics`` that
``build_prom_metrics`` made, and its ``LoggingStatLogger`` logs
``KVConnectorStats.reduce()``. So:

- the scheduler side answers ``get_kv_connector_stats()`` with a
  :class:`KVOffloadConnectorStats` holding a cumulative snapshot of its core
  (:func:`kvoffload.integrations.metrics_mirror.snapshot`), at most once a second
  (:data:`STATS_INTERVAL_S`) and once more when it goes idle; every other step it
  answers ``None`` (one clock read);
- :class:`KVOffloadPromMetrics` (``build_prom_metrics``) makes the ``kvoffload_*``
  metrics with vLLM's metric classes and labels (``model_name``, ``engine``, then
  kvoffload's) and writes each snapshot into them
  (:class:`~kvoffload.integrations.metrics_mirror.Mirror`).

No ``tp_rank`` label: the scheduler side's figures are the engine's, agreed by every rank
(a job counts when the last rank reported it); the workers keep no figures of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvoffload.integrations.metrics_mirror import Mirror, snapshot

__all__ = ["STATS_INTERVAL_S", "KVOffloadConnectorStats", "KVOffloadPromMetrics", "StatsClock"]

#: The most often the scheduler side snapshots its core for vLLM's stats, in seconds.
STATS_INTERVAL_S = 1.0

_SUMMARY = {
    "stored_pages": ("kvoffload_pages_total", ["h2s"]),
    "loaded_pages": ("kvoffload_pages_total", ["h2d"]),
    "copied_pages": ("kvoffload_pages_total", ["d2h"]),
    "lost_pages": ("kvoffload_pages_lost_total", []),
}


@dataclass
class KVOffloadConnectorStats(KVConnectorStats):  # type: ignore[misc]  # vLLM is untyped to mypy here
    """A cumulative snapshot of the scheduler side's figures (``data``: the plain data of
    :func:`~kvoffload.integrations.metrics_mirror.snapshot`). A later snapshot holds
    everything an earlier one did, so aggregating keeps the later one."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return other if isinstance(other, KVOffloadConnectorStats) and not other.is_empty() else self

    def reduce(self) -> dict[str, int | float]:
        """Totals since the engine started, for vLLM's "KV Transfer metrics" log line."""
        series = {(n, tuple(v)): x for n, v, x in self.data.get("series", ())}
        out: dict[str, int | float] = {}
        for key, (name, labels) in _SUMMARY.items():
            out[key] = int(series.get((name, tuple(labels)), 0))
        dropped = sum(x for (n, _), x in series.items() if n == "kvoffload_pages_dropped_total")
        out["dropped_pages"] = int(dropped)
        return out

    def is_empty(self) -> bool:
        return not self.data.get("series")


class KVOffloadPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``build_prom_metrics``: the ``kvoffload_*`` metrics, made with vLLM's classes on
    vLLM's labels; :meth:`observe` writes each engine's snapshot into them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.mirror = Mirror(self._counter_cls, self._gauge_cls, self._histogram_cls, labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues.get(engine_idx, [])
        self.mirror.observe(transfer_stats_data, values)


class StatsClock:
    """When the scheduler side snapshots its core (see the module doc): at most every
    ``interval_s`` while work goes on, and once when the work is done."""

    def __init__(self, clock: Any, interval_s: float = STATS_INTERVAL_S) -> None:
        self.clock = clock
        self.interval_s = interval_s
        self.last = -1e18
        self.busy = False

    def take(self, core: Any, busy: bool, backend: str | None) -> KVOffloadConnectorStats | None:
        now = self.clock()
        settled = self.busy and not busy
        self.busy = busy
        if now - self.last < self.interval_s and not settled:
            return None
        self.last = now
        return KVOffloadConnectorStats(data=snapshot(core, backend=backend))
