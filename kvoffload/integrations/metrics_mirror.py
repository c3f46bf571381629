"""kvoffload's ``kvoffload_*`` series through an engine's own Prometheus setup.

:func:`kvoffload.metrics.register` exposes a core's figures with a custom collector read
at scrape time: right where the process that holds the core serves ``/metrics``. An
engine may serve its metrics elsewhere: vLLM's API server process exports what its stat
loggers observe (the engine core's figures arrive there as ``KVConnectorStats`` data),
and SGLang runs prometheus_client in multiprocess mode (a scheduler process writes its
series to files the HTTP server aggregates; a custom collector there is never seen).
Both take only prometheus_client's own ``Counter`` / ``Gauge`` / ``Histogram`` objects
(or the engine's wrappers of them). So:

- :func:`snapshot` reads a manager's (or core's) figures - the same names, types and
  labels as :data:`kvoffload.metrics.METRICS`, from the same collector - into plain
  data (lists, str, numbers: it crosses vLLM's process boundary in ``SchedulerStats``);
- :class:`Mirror` makes one metric object per name with the engine's classes and writes
  each snapshot into them: gauges set, counters increased by what grew since the last
  snapshot of the same series, histograms given the new observations - one value per
  new observation inside its bucket, so every bucket count, ``_count`` and ``_sum`` is
  the collector's (the classes take observations, not bucket counts).

Snapshots are cumulative: one skipped, late or taken twice changes nothing; a figure
that went down (the engine restarted) counts from zero again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Mirror", "snapshot", "spread"]

#: Snapshot format version (the ``"v"`` key).
VERSION = 1


def snapshot(source: Any, *, backend: str | None = None) -> dict[str, Any]:
    """The figures of ``source`` (a manager or an ``OffloadCore``) as plain data:
    ``{"v": 1, "series": [[name, [label values], value], ...], "hist": [[name, [label
    values], [count per bucket, +Inf last], sum], ...]}``, label values in the order of
    ``METRICS[name]``. ``backend`` names the store in the store metrics. Needs
    prometheus_client (``kvoffload[metrics]``)."""
    from kvoffload.metrics import METRICS, KVOffloadCollector

    collector = KVOffloadCollector(source, labels={"backend": backend} if backend else None)
    series: list[list[Any]] = []
    hist: list[list[Any]] = []
    # (prometheus_client names a counter's family without its _total)
    by_family = {n.removesuffix("_total") if k == "counter" else n: n for n, (k, _, _) in METRICS.items()}
    for fam in collector.collect():
        name = by_family[fam.name]
        kind, labels, _ = METRICS[name]
        if kind != "histogram":
            want = name if kind == "counter" else fam.name
            for s in fam.samples:
                if s.name == want:
                    series.append([name, [s.labels[k] for k in labels], float(s.value)])
            continue
        groups: dict[tuple[str, ...], list[Any]] = {}
        for s in fam.samples:
            key = tuple(s.labels[k] for k in labels)
            g = groups.setdefault(key, [[], 0.0])
            if s.name.endswith("_bucket"):
                g[0].append(float(s.value))
            elif s.name.endswith("_sum"):
                g[1] = float(s.value)
        for key, (cumulative, total) in groups.items():
            counts = [int(c - p) for c, p in zip(cumulative, [0.0, *cumulative[:-1]], strict=True)]
            hist.append([name, list(key), counts, total])
    return {"v": VERSION, "series": series, "hist": hist}


def _buckets(name: str) -> tuple[float, ...]:
    from kvoffload.core import meters

    if "size" in name:
        return meters.SIZE_BUCKETS
    if "release" in name:
        return meters.RELEASE_BUCKETS
    if "poll" in name:
        return meters.POLL_BUCKETS
    return meters.DURATION_BUCKETS


def spread(bounds: Sequence[float], counts: Sequence[int], total: float) -> list[float]:
    """Values that fall in Prometheus buckets ``bounds`` (``le``; the last count is
    +Inf's) exactly ``counts`` times each and add up to ``total`` (within float
    rounding) whenever real observations could: finite buckets' values move together
    between their bucket's top and bottom, +Inf's take what is left above the last
    bound. Figures are never negative (the first bucket starts at 0)."""
    lows = [0.0, *bounds]
    finite = [(n, lows[i], bounds[i]) for i, n in enumerate(counts[: len(bounds)]) if n > 0]
    n_inf = counts[len(bounds)] if len(counts) > len(bounds) else 0
    hi_total = sum(n * hi for n, _, hi in finite)
    lo_total = sum(n * lo for n, lo, _ in finite)
    if n_inf:
        f = 0.0
        rest = (total - hi_total) / n_inf
        last = bounds[-1] if bounds else 0.0
        inf_value = rest if rest > last else last + max(abs(last) * 1e-9, 1e-12)
    else:
        span = hi_total - lo_total
        f = min(max((hi_total - total) / span, 0.0), 1.0) if span > 0 else 0.0
        inf_value = 0.0
    out: list[float] = []
    for n, lo, hi in finite:
        v = hi - f * (hi - lo)
        out += [v if lo == 0 or v > lo else math.nextafter(lo, math.inf)] * n  # (le: lo is the bucket below)
    out += [inf_value] * n_inf
    return out


class Mirror:
    """kvoffload's series as metric objects of the engine's classes (see the module doc).

    ``Mirror(counter_cls, gauge_cls, histogram_cls, labelnames)``: the classes are
    called as prometheus_client's (``name=``, ``documentation=``, ``labelnames=``, and
    ``buckets=`` / ``multiprocess_mode="mostrecent"``); ``labelnames`` are the engine's
    own labels, put first on every series (vLLM's ``model_name``, ``engine``; the SGLang
    drop-in's ``tp_rank``). :meth:`observe` writes one snapshot under the engine's label
    values. Not thread-safe: one caller (the engine's stat logger, the scheduler)."""

    def __init__(
        self, counter_cls: Any, gauge_cls: Any, histogram_cls: Any, labelnames: Sequence[str]
    ) -> None:
        from kvoffload.metrics import METRICS

        self.labelnames = list(labelnames)
        self.kinds: dict[str, str] = {}
        self.metrics: dict[str, Any] = {}
        self.bounds: dict[str, tuple[float, ...]] = {}
        for name, (kind, labels, doc) in METRICS.items():
            names = [*self.labelnames, *labels]
            self.kinds[name] = kind
            if kind == "counter":
                self.metrics[name] = counter_cls(
                    name=name.removesuffix("_total"), documentation=doc, labelnames=names
                )
            elif kind == "gauge":
                self.metrics[name] = gauge_cls(
                    name=name, documentation=doc, labelnames=names, multiprocess_mode="mostrecent"
                )
            else:
                self.bounds[name] = _buckets(name)
                self.metrics[name] = histogram_cls(
                    name=name, documentation=doc, labelnames=names, buckets=list(self.bounds[name])
                )
        # _last: the last snapshot's value of each counter / histogram series (the key:
        # engine label values, name, label values): what the next one adds to.
        self._last: dict[tuple[Any, ...], Any] = {}

    def observe(self, snap: Mapping[str, Any], labelvalues: Sequence[object] = ()) -> None:
        """Write snapshot ``snap`` (:func:`snapshot`) under the engine's ``labelvalues``.
        A snapshot of another format version is ignored."""
        if snap.get("v") != VERSION:
            return
        eng = tuple(str(v) for v in labelvalues)
        for name, values, value in snap.get("series", ()):
            kind = self.kinds.get(name)
            if kind is None:
                continue
            child = self.metrics[name].labels(*eng, *values)
            if kind == "gauge":
                child.set(value)
                continue
            key = (eng, name, *values)
            last = self._last.get(key, 0.0)
            grown = value - last if value >= last else value  # (went down: a restart)
            if grown > 0:
                child.inc(grown)
            self._last[key] = value
        for name, values, counts, total in snap.get("hist", ()):
            if name not in self.bounds or len(counts) != len(self.bounds[name]) + 1:
                continue
            child = self.metrics[name].labels(*eng, *values)
            key = (eng, name, *values)
            last_counts, last_total = self._last.get(key, ([0] * len(counts), 0.0))
            restarted = len(last_counts) != len(counts)
            if restarted or any(c < p for c, p in zip(counts, last_counts, strict=True)):
                last_counts, last_total = [0] * len(counts), 0.0  # a restart
            new = [c - p for c, p in zip(counts, last_counts, strict=True)]
            if any(new):
                for v in spread(self.bounds[name], new, total - last_total):
                    child.observe(v)
            self._last[key] = (list(counts), total)
