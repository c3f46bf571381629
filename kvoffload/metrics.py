"""Prometheus series of a manager's figures: ``kvoffload.metrics.register(mgr)``.

``pip install 'kvoffload[metrics]'`` (prometheus_client). ``import kvoffload`` never
imports this module or prometheus_client.

Every figure is read at scrape time (a custom collector) from what the core already
keeps: its counters (:class:`~kvoffload.core.stats.Counters`), its rooms' state, and
its meters (:mod:`kvoffload.core.meters`: transfer sizes and durations, release
delays, poll durations, storage operations). Nothing is added to the decode step; with
nobody scraping, registering costs nothing (``benchmarks/bench_metrics.py``).

Names follow Prometheus's conventions (base units, ``_total`` on counters) and line
up with vLLM's ``vllm:kv_offload_*`` and SGLang's ``sglang:hicache_*``; each is listed
in :data:`METRICS` and in docs/metrics.md. Labels come from a closed vocabulary
(``direction`` d2h/h2s/s2h/h2d, ``backend``, ``state``, ``reason``, ``op``,
``outcome``, ``result``, ``from``/``to``, ``tp_rank``, and the caller's constant
``labels``): never a request id.

A scrape runs on the HTTP server's thread while the owner thread changes the core:
each figure is one read of an int, or one copy of a list or dict (atomic under the
GIL), so a scrape may see one figure a step ahead of another, never a torn one.
"""

from __future__ import annotations

import re
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from kvoffload.errors import ConfigError, MissingDependency

try:
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
    from prometheus_client.registry import Collector
    from prometheus_client.utils import floatToGoString as _go_float
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise MissingDependency(
        "kvoffload.metrics needs prometheus_client: pip install 'kvoffload[metrics]'"
    ) from exc

from kvoffload.core.lifecycle import STATES
from kvoffload.core.meters import DIRECTIONS, SIZE_BUCKETS, Histogram
from kvoffload.core.offload import OffloadCore
from kvoffload.lifecycle.spec import LifecycleState
from kvoffload.lifecycle.table import TABLE

__all__ = ["METRICS", "KVOffloadCollector", "MetricsServer", "register", "serve"]

#: A bucket bound as Prometheus writes it ("1e+06", "+Inf").
floatToGoString = cast("Callable[[float], str]", _go_float)

#: Every family exported: name -> (type, labels, help). A counter's samples end in
#: ``_total``; a histogram's are ``_bucket`` / ``_sum`` / ``_count``. The constant
#: labels (``tp_rank``, the caller's ``labels``) come on top of these.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "kvoffload_transfer_bytes_total": (
        "counter",
        ("direction",),
        "Bytes moved, by leg: d2h copies and h2s writes out, s2h reads and h2d copies back.",
    ),
    "kvoffload_transfer_seconds_total": (
        "counter",
        ("direction",),
        "Seconds spent in the transfers of kvoffload_transfer_duration_seconds, summed.",
    ),
    "kvoffload_transfer_size_bytes": (
        "histogram",
        ("direction",),
        "Size of each transfer (a chunk's copy, a write job, a load's read or copy), in bytes.",
    ),
    "kvoffload_transfer_duration_seconds": (
        "histogram",
        ("direction",),
        "Duration of each transfer, submitted to finished, in seconds.",
    ),
    "kvoffload_pages_total": ("counter", ("direction",), "Pages moved, by leg."),
    "kvoffload_pages_dropped_total": (
        "counter",
        ("reason",),
        "Pages that did not make it out, by reason (per attempt: a page dropped twice counts twice).",
    ),
    "kvoffload_pages_lost_total": (
        "counter",
        (),
        "Whole pages a finished request should have offloaded and did not.",
    ),
    "kvoffload_store_operations_total": (
        "counter",
        ("backend", "op", "outcome"),
        "Storage operations finished: write (stored/failed/skipped), read (hit/miss/error), lookup.",
    ),
    "kvoffload_store_lookup_pages_total": (
        "counter",
        ("backend", "result"),
        "Pages asked of the store by lookups: hit (the leading pages found) or miss.",
    ),
    "kvoffload_host_pool_pages": (
        "gauge",
        ("state",),
        "Host pool pages: inflight (in a copy), used (held otherwise: writes, loads), free.",
    ),
    "kvoffload_host_pool_capacity_pages": ("gauge", (), "Host pool pages in all."),
    "kvoffload_page_size_bytes": ("gauge", (), "Bytes of one page (of every KV tensor)."),
    "kvoffload_lifecycles": ("gauge", ("state",), "Live lifecycles, by state."),
    "kvoffload_lifecycles_admitted_total": ("counter", (), "Lifecycles ever admitted."),
    "kvoffload_lifecycles_released_total": (
        "counter",
        ("outcome",),
        "Lifecycles released, by outcome (completed, aborted, failed).",
    ),
    "kvoffload_lifecycle_transitions_total": (
        "counter",
        ("from", "to"),
        "State changes of lifecycles (steps of the table that change the state).",
    ),
    "kvoffload_inflight_transfers": ("gauge", ("direction",), "Transfers in flight now, by leg."),
    "kvoffload_load_lifecycles": ("gauge", (), "Live loads (store -> host -> device)."),
    "kvoffload_loads_total": (
        "counter",
        ("outcome",),
        "Loads ended, by outcome (loaded, partial, missed, failed, cancelled).",
    ),
    "kvoffload_release_delay_seconds": (
        "histogram",
        (),
        "Finish (or abort) to RELEASED, in seconds: how long a request's device pages waited for its copies.",
    ),
    "kvoffload_oldest_inflight_age_seconds": (
        "gauge",
        (),
        "Age of the oldest copy in flight (0 when none), in seconds.",
    ),
    "kvoffload_poll_duration_seconds": (
        "histogram",
        ("op",),
        "Duration of one poll (op=poll; op=collective under a TP group) or asyncio delivery (op=deliver).",
    ),
    "kvoffload_stuck_reports_total": (
        "counter",
        (),
        "Watchdog reports of a lifecycle stuck past stuck_after_s.",
    ),
}

_RESERVED = {"direction", "state", "reason", "op", "outcome", "result", "from", "to", "le", "tp_rank"}
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_LIVE = tuple(s.name.lower() for s in STATES if s is not LifecycleState.RELEASED)
# Every (from, to) a table step can take (exported from 0, so rate() works at once).
_MOVES = sorted(
    {
        (s, d)
        for s, row in enumerate(TABLE)
        for dests in row
        for d in (dests if isinstance(dests, tuple) else ())
        if isinstance(d, int) and 0 <= d != s
    }
)


def _core(source: Any) -> OffloadCore:
    if isinstance(source, OffloadCore):
        return source
    core = getattr(source, "core", None)
    if isinstance(core, OffloadCore):
        return core
    raise ConfigError(
        "register() takes an OffloadManager, a SyncOffloadManager or an OffloadCore, "
        f"got {type(source).__name__}"
    )


def _backend(source: Any, core: OffloadCore) -> str:
    storage = getattr(source, "storage", None)
    if storage is not None:
        return str(getattr(storage, "name", type(storage).__name__.lower()))
    if isinstance(source, OffloadCore):
        return "unknown" if core.has_storage else "none"
    return "none"


def _buckets(h: Histogram) -> tuple[list[tuple[str, float]], float]:
    counts, total = h.snapshot()
    out: list[tuple[str, float]] = []
    acc = 0
    for bound, n in zip((*h.bounds, float("inf")), counts, strict=True):
        acc += n
        out.append((floatToGoString(bound), acc))
    return out, total


def _size_buckets(by_pages: dict[int, int], page_bytes: int) -> tuple[list[tuple[str, float]], float]:
    """The size histogram (vLLM's buckets, bytes) of transfers counted by pages moved."""
    counts = [0] * (len(SIZE_BUCKETS) + 1)
    total = 0.0
    for n, k in by_pages.items():
        size = n * page_bytes
        counts[bisect_left(SIZE_BUCKETS, size)] += k
        total += size * k
    out: list[tuple[str, float]] = []
    acc = 0
    for bound, k in zip((*SIZE_BUCKETS, float("inf")), counts, strict=True):
        acc += k
        out.append((floatToGoString(bound), acc))
    return out, total


class KVOffloadCollector(Collector):
    """The series of one manager (or bare core), read at scrape time.

    Made and registered by :func:`register`; :meth:`unregister` takes it off its
    registry. ``collect()`` also works alone (a registry of its own)."""

    def __init__(self, source: Any, *, tp_rank: int | None = None, labels: Mapping[str, str] | None = None):
        self.source = source
        self.core = _core(source)
        extra = dict(labels or {})
        for k, v in extra.items():
            if not isinstance(k, str) or not _LABEL.fullmatch(k) or k.startswith("__") or k in _RESERVED:
                raise ConfigError(
                    f"labels: {k!r} is not a label kvoffload.metrics can add (a Prometheus label name, "
                    f"not one of {sorted(_RESERVED)}; tp_rank has its own argument)"
                )
            if not isinstance(v, str):
                raise ConfigError(f"labels[{k!r}] must be a str, got {v!r}")
        if tp_rank is not None and (type(tp_rank) is not int or tp_rank < 0):
            raise ConfigError(f"tp_rank must be None or an int >= 0, got {tp_rank!r}")
        self.backend = extra.pop("backend", "") or _backend(source, self.core)
        if tp_rank is not None:
            extra["tp_rank"] = str(tp_rank)
        # const: the labels on every sample of this source, in order.
        self.const: dict[str, str] = extra
        self._hub: _Hub | None = None

    def describe(self) -> list[Metric]:
        return list(_families(self.const).values())

    def collect(self) -> Iterator[Metric]:
        families = _families(self.const)
        self.fill(families)
        yield from families.values()

    def unregister(self) -> None:
        """Take this source's series off the registry it was registered on (idempotent)."""
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.remove(self)

    # --- the figures -------------------------------------------------------------------

    def fill(self, fam: dict[str, Any]) -> None:
        """Add this source's samples to ``fam`` (one family per name)."""
        core = self.core
        c = core.counters
        m = core.meters
        pb = core.page_bytes
        const = tuple(self.const.values())

        def add(name: str, values: tuple[str, ...], value: float) -> None:
            fam[name].add_metric([*values, *const], value)

        pages = {"d2h": c.pages_copied, "h2s": c.pages_stored, "s2h": m.pages_read, "h2d": c.pages_loaded}
        for d in DIRECTIONS:
            add("kvoffload_transfer_bytes_total", (d,), pages[d] * pb)
            add("kvoffload_pages_total", (d,), pages[d])
            buckets, total = _buckets(m.duration[d])
            add("kvoffload_transfer_seconds_total", (d,), total)
            fam["kvoffload_transfer_duration_seconds"].add_metric([d, *const], buckets, total)
            sizes, size_sum = _size_buckets(dict(m.sizes[d]), pb)
            fam["kvoffload_transfer_size_bytes"].add_metric([d, *const], sizes, size_sum)
        dropped = {
            "host_full": c.pages_dropped - c.pages_refused,
            "mover_refused": c.pages_refused,
            "copy_failed": c.pages_failed,
            "discarded": c.pages_discarded,
            "store_error": c.pages_store_failed,
            "chain_broken": c.pages_store_skipped,
        }
        for reason, n in dropped.items():
            add("kvoffload_pages_dropped_total", (reason,), n)
        add("kvoffload_pages_lost_total", (), c.pages_lost)
        ops = dict(m.store_ops)
        for key in (
            ("write", "stored"),
            ("write", "failed"),
            ("read", "hit"),
            ("read", "miss"),
            ("lookup", "ok"),
        ):
            ops.setdefault(key, 0)
        for (op, outcome), n in sorted(ops.items()):
            add("kvoffload_store_operations_total", (self.backend, op, outcome), n)
        for result, n in dict(m.lookup_pages).items():
            add("kvoffload_store_lookup_pages_total", (self.backend, result), n)
        host = core.host_pool
        inflight = max(0, c.pages_inflight + c.load_pages_inflight)
        used = host.used
        add("kvoffload_host_pool_pages", ("inflight",), inflight)
        add("kvoffload_host_pool_pages", ("used",), max(0, used - inflight))
        add("kvoffload_host_pool_pages", ("free",), host.n_pages - used)
        add("kvoffload_host_pool_capacity_pages", (), host.n_pages)
        add("kvoffload_page_size_bytes", (), pb)
        counts = list(core.registry.state_counts)
        for i, name in enumerate(_LIVE):
            add("kvoffload_lifecycles", (name,), counts[i])
        add("kvoffload_lifecycles_admitted_total", (), c.admitted)
        for outcome, n in (
            ("completed", c.released_completed),
            ("aborted", c.released_aborted),
            ("failed", c.released_failed),
        ):
            add("kvoffload_lifecycles_released_total", (outcome,), n)
        moves = [list(row) for row in core.registry.moves]
        for src, dst in _MOVES:
            add(
                "kvoffload_lifecycle_transitions_total",
                (STATES[src].name.lower(), STATES[dst].name.lower()),
                moves[src][dst],
            )
        loads = list(core.loads.live.values())
        flights = {
            "d2h": len(core.chunks.inflight),
            "h2s": len(core.write_behind.jobs),
            "s2h": sum(1 for ld in loads if ld.reading),
            "h2d": len(core.loads.copying),
        }
        for d in DIRECTIONS:
            add("kvoffload_inflight_transfers", (d,), flights[d])
        add("kvoffload_load_lifecycles", (), len(loads))
        for outcome, n in (
            ("loaded", c.loads_loaded),
            ("partial", c.loads_partial),
            ("missed", c.loads_missed),
            ("failed", c.loads_failed),
            ("cancelled", c.loads_cancelled),
        ):
            add("kvoffload_loads_total", (outcome,), n)
        buckets, total = _buckets(m.release_delay)
        fam["kvoffload_release_delay_seconds"].add_metric(list(const), buckets, total)
        add("kvoffload_oldest_inflight_age_seconds", (), self._oldest())
        for op, h in sorted(dict(m.poll).items()):
            buckets, total = _buckets(h)
            fam["kvoffload_poll_duration_seconds"].add_metric([op, *const], buckets, total)
        add("kvoffload_stuck_reports_total", (), c.stuck_reports)

    def _oldest(self) -> float:
        """Seconds since the oldest copy in flight was submitted (the core's clock)."""
        core = self.core
        first = next(iter(list(core.chunks.inflight.values())), None)
        starts = [first.submitted_at] if first is not None else []
        starts += [
            t.submitted_at for ld in list(core.loads.copying.values()) if (t := ld.transfer) is not None
        ]
        if not starts:
            return 0.0
        return max(0.0, core.clock() - min(starts))


def _families(const: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    extra = list(const)
    for name, (kind, labels, doc) in METRICS.items():
        names = [*labels, *extra]
        if kind == "counter":
            out[name] = CounterMetricFamily(name, doc, labels=names)
        elif kind == "gauge":
            out[name] = GaugeMetricFamily(name, doc, labels=names)
        else:
            out[name] = HistogramMetricFamily(name, doc, labels=names)
    return out


class _Hub(Collector):
    """The one kvoffload collector of a registry: the series of every source registered
    on it, one family per name (two collectors of the same names would clash)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.lock = threading.Lock()
        self.sources: list[KVOffloadCollector] = []

    def describe(self) -> list[Metric]:
        return list(_families({}).values())

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            sources = list(self.sources)
        if not sources:
            return
        by_labels: dict[tuple[str, ...], dict[str, Any]] = {}
        for src in sources:
            fam = by_labels.setdefault(tuple(src.const), _families(src.const))
            src.fill(fam)
        if len(by_labels) == 1:
            yield from next(iter(by_labels.values())).values()
            return
        # Sources with different constant label names: one family per name, each sample
        # carrying its own labels (Prometheus's exposition allows it).
        for name in METRICS:
            first: Metric | None = None
            for fam in by_labels.values():
                if first is None:
                    first = fam[name]
                else:
                    first.samples.extend(fam[name].samples)
            assert first is not None
            yield first

    def add(self, src: KVOffloadCollector) -> None:
        with self.lock:
            for other in self.sources:
                if other.const == src.const:
                    raise ConfigError(
                        f"a kvoffload source with labels {src.const or '{}'} is already registered on this "
                        "registry: give each one its own labels (tp_rank=, labels=) or unregister the first"
                    )
                if other.core is src.core:
                    raise ConfigError("this manager's series are already registered on this registry")
            self.sources.append(src)

    def remove(self, src: KVOffloadCollector) -> None:
        with self.lock:
            if src in self.sources:
                self.sources.remove(src)
            empty = not self.sources
        if empty:
            with _HUBS_LOCK:
                if _HUBS.get(id(self.registry)) is self:
                    del _HUBS[id(self.registry)]
                    self.registry.unregister(self)


_HUBS: dict[int, _Hub] = {}
_HUBS_LOCK = threading.Lock()


def register(
    source: Any,
    registry: CollectorRegistry | None = None,
    *,
    tp_rank: int | None = None,
    labels: Mapping[str, str] | None = None,
) -> KVOffloadCollector:
    """Expose ``source``'s figures on ``registry`` (default prometheus_client's
    ``REGISTRY``) under the names of :data:`METRICS`; returns its collector
    (``.unregister()`` takes them off again).

    ``source``: an :class:`~kvoffload.OffloadManager`, a
    :class:`~kvoffload.SyncOffloadManager`, or a bare
    :class:`~kvoffload.core.offload.OffloadCore` (what the vLLM connector's scheduler
    side holds). ``tp_rank`` adds the ``tp_rank`` label; ``labels``: constant labels on
    every sample (low-cardinality: never a request id; ``backend`` overrides the store
    metrics' ``backend``, otherwise the storage tier's name). Several sources may share
    a registry when their labels differ. Raises :class:`~kvoffload.ConfigError` (nothing
    registered) for another kind of source, a bad label, or a source (or label set)
    already registered there."""
    collector = KVOffloadCollector(source, tp_rank=tp_rank, labels=labels)
    reg = REGISTRY if registry is None else registry
    with _HUBS_LOCK:
        hub = _HUBS.get(id(reg))
        if hub is None or hub.registry is not reg:
            hub = _Hub(reg)
            hub.add(collector)
            reg.register(hub)
            _HUBS[id(reg)] = hub
        else:
            hub.add(collector)
    collector._hub = hub
    collector.core.meters.timed = True  # (the drivers time their polls from now on)
    return collector


class MetricsServer:
    """A ``/metrics`` endpoint on ``host:port`` (:func:`serve`); :meth:`close` stops it."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str) -> None:
        self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def serve(port: int = 0, registry: CollectorRegistry | None = None, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` (default ``REGISTRY``) at ``http://host:port/metrics`` from a
    daemon thread; ``port=0`` picks a free one (``.port`` says which). Loopback by
    default."""
    if type(port) is not int or not 0 <= port <= 65535:
        raise ConfigError(f"port must be an int in 0..65535, got {port!r}")
    return MetricsServer(REGISTRY if registry is None else registry, port, host)
