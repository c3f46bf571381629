"""The SGLang drop-in's ``kvoffload_*`` series, where SGLang's own ``/metrics`` finds them.

SGLang exports its scheduler's metrics (``sglang:hicache_*`` among them) in
prometheus_client's multiprocess mode: ``--enable-metrics`` sets
``PROMETHEUS_MULTIPROC_DIR`` before any process imports prometheus_client, each
scheduler process writes its series to files there, and the HTTP server's ``/metrics``
aggregates the files. A custom collector in a scheduler process is never seen there, so
:func:`export` picks by mode:

- multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set): a
  :class:`~kvoffload.integrations.metrics_mirror.Mirror` of prometheus_client's own
  classes, fed a snapshot of the rank's manager at most once a second from
  ``check_offload_progress`` (one clock read per scheduler iteration) and once at
  shutdown;
- otherwise: :func:`kvoffload.metrics.register` of the manager on prometheus_client's
  ``REGISTRY``, read at scrape time (nothing per iteration).

Either way the names are :data:`kvoffload.metrics.METRICS`, labelled ``tp_rank`` (each
TP rank's scheduler holds its own manager and shard) and, when SGLang names the model,
``model_name`` (as SGLang's own series).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["MetricsExport", "export", "wanted"]

#: The most often a rank snapshots its manager in multiprocess mode, in seconds.
INTERVAL_S = 1.0

# One Mirror per process and label names (prometheus_client refuses a name twice):
# every rank manager of the process writes through it under its own label values.
_MIRRORS: dict[tuple[str, ...], Any] = {}
_LOCK = threading.Lock()


def wanted(metrics: bool | None, settings: Any) -> bool:
    """Whether to export: ``metrics`` when given, else SGLang's ``enable_metrics``."""
    if metrics is not None:
        return bool(metrics)
    return bool(getattr(settings, "enable_metrics", False))


class MetricsExport:
    """How one rank's series reach SGLang's ``/metrics`` (see the module doc):
    :meth:`tick` once per scheduler iteration, :meth:`close` at shutdown."""

    def __init__(
        self, manager: Any, tp_rank: int, model_name: str | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.manager = manager
        self.clock = clock
        self.backend = str(getattr(manager.storage, "name", None) or "none")  # (the store metrics' label)
        self.labels = {**({"model_name": model_name} if model_name else {}), "tp_rank": str(tp_rank)}
        self.mode = "multiprocess" if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else "collector"
        self.collector: Any = None
        self.mirror: Any = None
        self.last = -1e18
        if self.mode == "collector":
            import kvoffload.metrics as km

            extra = {k: v for k, v in self.labels.items() if k != "tp_rank"}
            self.collector = km.register(manager, tp_rank=tp_rank, labels=extra or None)
        else:
            from prometheus_client import Counter, Gauge, Histogram

            from kvoffload.integrations.metrics_mirror import Mirror

            names = tuple(self.labels)
            with _LOCK:
                mirror = _MIRRORS.get(names)
                if mirror is None:
                    mirror = _MIRRORS[names] = Mirror(Counter, Gauge, Histogram, names)
            self.mirror = mirror
            manager.core.meters.timed = True  # (the manager times its polls, as register() has it)
            self.push()

    def push(self) -> None:
        """Write a snapshot of the manager into the mirror now (multiprocess mode)."""
        from kvoffload.integrations.metrics_mirror import snapshot

        self.last = self.clock()
        self.mirror.observe(snapshot(self.manager.core, backend=self.backend), list(self.labels.values()))

    def tick(self) -> None:
        """A scheduler iteration: in multiprocess mode, a snapshot when one is due."""
        if self.mirror is not None and self.clock() - self.last >= INTERVAL_S:
            self.push()

    def close(self) -> None:
        """Shutdown: the last figures (multiprocess mode), or the collector taken off."""
        if self.mirror is not None:
            self.push()
        elif self.collector is not None:
            self.collector.unregister()
            self.collector = None


def export(manager: Any, tp_rank: int, settings: Any, metrics: bool | None) -> MetricsExport | None:
    """The rank's export when it is wanted (:func:`wanted`), else ``None``. Raises
    :class:`~kvoffload.MissingDependency` without prometheus_client."""
    if not wanted(metrics, settings):
        return None
    return MetricsExport(manager, tp_rank, getattr(settings, "served_model_name", None))
