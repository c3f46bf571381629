"""The vLLM connector's ``kvoffload_*`` series through vLLM's own stats path, with vLLM's
real classes (the vllm env; issue 24 point 2).

What must hold: the scheduler side's ``get_kv_connector_stats()`` carries a snapshot of
its core that survives vLLM's msgpack transport; vLLM's ``KVConnectorProm`` (what its
``PrometheusStatLogger`` builds through ``build_prom_metrics``) turns it into the
``kvoffload_*`` series with vLLM's ``model_name`` / ``engine`` labels, every sample equal
to what :func:`kvoffload.metrics.register` scrapes from the same core (counters,
gauges, every histogram bucket, count and sum) - after one snapshot and after a later
one; vLLM's ``KVConnectorLogging`` logs its reduction; between snapshots the connector
answers ``None`` (one clock read per step).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest

# vllm.v1, not vllm: without vLLM installed, "vllm" imports as this test directory
# (a namespace package: tests/ is on sys.path), which must never get an __init__.py.
pytest.importorskip("vllm.v1.request", reason="vLLM's real classes: run in the vllm environment (.venv-vllm)")

import msgspec
from engine_run import TINY_LLAMA
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from test_connector_vllm import Engine, _vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

import kvoffload.metrics as km
from kvoffload.integrations.metrics_mirror import spread
from kvoffload.integrations.vllm_metrics import KVOffloadConnectorStats

ENGINE_LABELS = ["model_name", "engine"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


def _prom(cfg: Any, registry: CollectorRegistry) -> KVConnectorProm:
    """vLLM's KVConnectorProm, its metric classes on ``registry`` (not the process's)."""

    class Prom(KVConnectorProm):  # type: ignore[misc]
        _gauge_cls = partial(Gauge, registry=registry)
        _counter_cls = partial(Counter, registry=registry)
        _histogram_cls = partial(Histogram, registry=registry)

    return Prom(cfg, ENGINE_LABELS, {0: ["tiny", "0"]})


def _samples(registry: CollectorRegistry, drop: set[str]) -> dict[tuple[Any, ...], float]:
    out: dict[tuple[Any, ...], float] = {}
    for fam in registry.collect():
        for s in fam.samples:
            if s.name.startswith("kvoffload_") and not s.name.endswith("_created"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in drop))
                out[(s.name, labels)] = s.value
    return out


def _run(eng: Engine, rid: str, prompt: list[int], decode: int) -> None:
    req = Request(rid, prompt, SamplingParams(max_tokens=8), None)
    eng.requests = getattr(eng, "requests", {})
    eng.requests[rid] = req
    eng.sched.on_new_request(req)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    eng.manager.allocate_slots(req, len(prompt))
    eng.step({rid: len(prompt)})
    for _ in range(decode):
        req.append_output_token_ids(7)
        eng.manager.allocate_slots(req, 1)
        eng.step({rid: 1})
    req.status = RequestStatus.FINISHED_STOPPED
    eng.sched.request_finished(req, eng.manager.get_block_ids(rid)[0])
    eng.settle()


def _stats(eng: Engine) -> dict[str, Any]:
    """The scheduler side's stats as vLLM's frontend gets them (msgpack, as
    SchedulerStats.kv_connector_stats)."""
    eng.sched._stats.last = -1e18  # due now (the test does not wait a second)
    stats = eng.sched.get_kv_connector_stats()
    assert isinstance(stats, KVOffloadConnectorStats) and not stats.is_empty()
    data: dict[str, Any] = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.to_dict()))
    return data


def test_vllms_prometheus_path_exports_what_the_collector_scrapes(model_dir: Path, tmp_path: Path) -> None:
    """Every kvoffload_* sample vLLM's KVConnectorProm exports equals the direct
    collector's of the same core, with vLLM's labels on top; again after more work."""
    cfg = _vllm_config(model_dir, tmp_path / "store")
    eng = Engine(cfg)
    mirrored, direct = CollectorRegistry(), CollectorRegistry()
    try:
        prom = _prom(cfg, mirrored)
        planner = eng.sched.planner
        assert planner is not None
        km.register(planner.core, registry=direct, labels={"backend": "file"})
        for round_, (rid, n, decode) in enumerate([("a", 70, 26), ("b", 100, 3)]):
            _run(eng, rid, [(3 * i + round_) % 400 + 1 for i in range(n)], decode)
            prom.observe(_stats(eng), 0)
            got = _samples(mirrored, drop=set(ENGINE_LABELS))
            want = _samples(direct, drop=set())
            assert set(got) == set(want)
            for key, value in want.items():
                if key[0].endswith("_sum"):
                    assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
                elif "oldest_inflight_age" not in key[0]:  # (an age: read at two moments)
                    assert got[key] == value, key
        pages = want[("kvoffload_pages_total", (("direction", "h2s"),))]
        assert pages == 3 + 3  # a: 2 prompt blocks + 1 decoded; b: 3 prompt blocks
        ok = (("backend", "file"), ("op", "lookup"), ("outcome", "ok"))
        lookups = ("kvoffload_store_operations_total", ok)
        assert want[lookups] == 2
        ours = [s for f in mirrored.collect() for s in f.samples if s.name.startswith("kvoffload_")]
        engine_labels = {s.labels.get("engine") for s in ours}
        assert engine_labels == {"0"}
    finally:
        eng.close()


def test_vllms_logging_path_reduces_the_snapshot(model_dir: Path, tmp_path: Path) -> None:
    """vLLM's KVConnectorLogging finds the connector class, rebuilds its stats from the
    data (build_kv_connector_stats) and logs the totals; between snapshots the
    connector answers None."""
    cfg = _vllm_config(model_dir, tmp_path / "store")
    eng = Engine(cfg)
    try:
        _run(eng, "a", [5] * 70, 0)
        data = _stats(eng)
        assert eng.sched.get_kv_connector_stats() is None  # not due: less than a second later
        logging = KVConnectorLogging(cfg.kv_transfer_config)
        logging.observe(data)
        lines: list[str] = []
        logging.log(lambda fmt, *args: lines.append(fmt % args))
        assert len(lines) == 1 and "stored_pages=2" in lines[0] and "dropped_pages=0" in lines[0]
    finally:
        eng.close()


def test_spread_keeps_every_bucket_count_and_the_sum() -> None:
    """The observations replayed into a Prometheus Histogram fall in the buckets the
    core counted, and add up to the core's sum."""
    bounds = (1.0, 5.0, 10.0)
    cases = [([2, 0, 1, 0], 9.0), ([0, 3, 0, 2], 60.0), ([1, 1, 1, 0], 8.5), ([0, 0, 0, 1], 11.0)]
    cases.append(([3, 0, 0, 0], 0.0))  # (a figure of 0: the first bucket's bottom)
    for counts, total in cases:
        values = spread(bounds, counts, total)
        reg = CollectorRegistry()
        h = Histogram("h", "h", buckets=bounds, registry=reg)
        for v in values:
            h.observe(v)
        (fam,) = reg.collect()
        samples = {s.labels.get("le"): s.value for s in fam.samples if s.name == "h_bucket"}
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        assert [samples[k] for k in ("1.0", "5.0", "10.0", "+Inf")] == cumulative
        assert sum(values) == pytest.approx(total)
