"""kvoffload.metrics.register: the series of a manager (or a bare core), read at scrape
time, named as docs/metrics.md says (issue 24)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from _prom import scrape, value
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from support import complete_everything, small_config, toks

import kvoffload as kvo
from kvoffload import metrics
from kvoffload.core.meters import SIZE_BUCKETS
from kvoffload.core.offload import OffloadCore
from kvoffload.pools import DevicePool, HostPool
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend


def run_some(mgr: kvo.SyncOffloadManager, backend: SimBackend, n: int = 3) -> None:
    """``n`` requests of 8 prompt and 24 decoded tokens, every copy completed, finished."""
    lcs = [mgr.admit(f"r{i}", toks(0, 8)) for i in range(n)]
    for t in range(8, 32):
        for lc in lcs:
            lc.extend([t])
        backend.complete_all()
        mgr.poll()
    for lc in lcs:
        lc.finish()
    deadline = time.monotonic() + 60  # a bound on a condition, not a timing
    while mgr.core.busy and time.monotonic() < deadline:  # (the writer thread stores)
        backend.complete_all()
        mgr.wait_progress(0.05)
        mgr.poll()
    assert not mgr.core.busy


def test_import_kvoffload_does_not_import_prometheus_client() -> None:
    """`import kvoffload` stays light: prometheus_client is loaded only by kvoffload.metrics."""
    code = (
        "import sys, kvoffload; print('prometheus_client' in sys.modules, 'kvoffload.metrics' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_missing_prometheus_client_names_the_extra() -> None:
    """Without prometheus_client, importing kvoffload.metrics raises MissingDependency
    naming the extra to install (an ImportError too)."""
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "prometheus_client":
                    raise ImportError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Block())
        from kvoffload.errors import MissingDependency
        try:
            import kvoffload.metrics
        except MissingDependency as e:
            print("missing:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "missing:" in out.stdout and "kvoffload[metrics]" in out.stdout, out.stdout + out.stderr


def test_register_sync_manager_figures_match_statistics() -> None:
    """Each counter of a scrape is the manager's own figure: pages and bytes per leg,
    lifecycles, transitions, histograms (one observation per copy), the store's writes."""
    backend = SimBackend()
    reg = CollectorRegistry()
    with kvo.SyncOffloadManager(
        small_config(offload_prompt=True), backend=backend, storage=MemoryStorage()
    ) as mgr:
        col = metrics.register(mgr, reg, tp_rank=0)
        run_some(mgr, backend)
        assert mgr.lookup(toks(0, 32)) == 32
        st = mgr.statistics()
        s = scrape(reg)
        pb = mgr.page_bytes
        r = {"tp_rank": "0"}
        assert st.pages_copied > 0 and st.pages_stored > 0 and st.pages_in_write == 0
        assert value(s, "kvoffload_pages_total", direction="d2h", **r) == st.pages_copied
        assert value(s, "kvoffload_transfer_bytes_total", direction="d2h", **r) == st.pages_copied * pb
        assert value(s, "kvoffload_pages_total", direction="h2s", **r) == st.pages_stored
        assert value(s, "kvoffload_transfer_size_bytes_count", direction="d2h", **r) == st.chunks_copied
        assert value(s, "kvoffload_transfer_size_bytes_sum", direction="d2h", **r) == st.pages_copied * pb
        assert value(s, "kvoffload_transfer_duration_seconds_count", direction="h2s", **r) > 0
        assert value(s, "kvoffload_lifecycles_admitted_total", **r) == 3
        assert value(s, "kvoffload_lifecycles_released_total", outcome="completed", **r) == 3
        assert value(s, "kvoffload_release_delay_seconds_count", **r) == 3
        assert (
            value(s, "kvoffload_lifecycle_transitions_total", **{"from": "pending", "to": "offloading"}, **r)
            > 0
        )
        assert value(s, "kvoffload_poll_duration_seconds_count", op="poll", **r) > 0
        assert value(s, "kvoffload_host_pool_capacity_pages", **r) == 64
        assert value(s, "kvoffload_host_pool_pages", state="free", **r) == 64 - st.host_pages_used
        stored_jobs = value(
            s, "kvoffload_store_operations_total", backend="memory", op="write", outcome="stored", **r
        )
        assert stored_jobs > 0
        assert value(s, "kvoffload_transfer_size_bytes_sum", direction="h2s", **r) == st.pages_stored * pb
        assert (
            value(s, "kvoffload_store_operations_total", backend="memory", op="lookup", outcome="ok", **r)
            == 1
        )
        assert value(s, "kvoffload_store_lookup_pages_total", backend="memory", result="hit", **r) == 8
        assert value(s, "kvoffload_lifecycles", state="pending", **r) == 0
        col.unregister()
        assert scrape(reg) == {}


def test_histogram_buckets_are_vllms() -> None:
    """kvoffload_transfer_size_bytes uses vLLM's TRANSFER_SIZE_BUCKETS (1e6 ... 200e6)."""
    assert SIZE_BUCKETS == (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
    reg = CollectorRegistry()
    with kvo.SyncOffloadManager(small_config(), backend=SimBackend()) as mgr:
        metrics.register(mgr, reg)
        les = {dict(k[1])["le"] for k in scrape(reg) if k[0] == "kvoffload_transfer_size_bytes_bucket"}
    assert les == {
        "1e+06",
        "5e+06",
        "1e+07",
        "2e+07",
        "4e+07",
        "6e+07",
        "8e+07",
        "1e+08",
        "1.5e+08",
        "2e+08",
        "+Inf",
    }


@pytest.mark.asyncio
async def test_register_async_manager() -> None:
    """An OffloadManager (asyncio) exports the same names; a delivery batch is op=deliver."""
    backend = SimBackend()
    reg = CollectorRegistry()
    async with kvo.OffloadManager(small_config(offload_prompt=True), backend=backend) as mgr:
        metrics.register(mgr, reg, labels={"model": "tiny"})
        lc = mgr.admit("a", toks(0, 16))
        await mgr.settle()  # (the copy starts when control returns to the driver)
        await complete_everything(mgr, backend)
        s = scrape(reg)
        assert (
            value(s, "kvoffload_pages_total", direction="d2h", model="tiny")
            == mgr.statistics().pages_copied
            > 0
        )
        assert value(s, "kvoffload_poll_duration_seconds_count", op="deliver", model="tiny") >= 1
        lc.finish()
        await complete_everything(mgr, backend)


def _bare_core() -> tuple[OffloadCore, list[Any]]:
    cfg = small_config(offload_prompt=True)
    device = DevicePool.create(64, 4, (1,), "float32")
    host = HostPool.new(64, (4, 1), "float32")
    jobs: list[Any] = []
    return OffloadCore(cfg, device_pool=device, host_pool=host, accept=jobs.append, page_bytes=16), jobs


def test_register_bare_core_inflight_and_oldest_age() -> None:
    """A bare OffloadCore (the vLLM connector's scheduler side) registers as a manager
    does: copies in flight and the age of the oldest are read at scrape time."""
    core, jobs = _bare_core()
    reg = CollectorRegistry()
    metrics.register(core, reg, tp_rank=1, labels={"backend": "vllm"})
    core.admit("a", toks(0, 8))
    s = scrape(reg)
    assert value(s, "kvoffload_inflight_transfers", direction="d2h", tp_rank="1") == len(jobs) == 1
    assert value(s, "kvoffload_host_pool_pages", state="inflight", tp_rank="1") == 2
    assert value(s, "kvoffload_oldest_inflight_age_seconds", tp_rank="1") >= 0
    assert (
        value(
            s, "kvoffload_store_operations_total", backend="vllm", op="write", outcome="stored", tp_rank="1"
        )
        == 0
    )
    core.complete([(jobs[0].id, None)])
    s = scrape(reg)
    assert value(s, "kvoffload_inflight_transfers", direction="d2h", tp_rank="1") == 0
    assert value(s, "kvoffload_oldest_inflight_age_seconds", tp_rank="1") == 0
    assert value(s, "kvoffload_transfer_size_bytes_sum", direction="d2h", tp_rank="1") == 2 * 16


def test_two_sources_share_a_registry_by_their_labels() -> None:
    """Two ranks in one registry: one family per name, a sample per rank; the same
    labels twice is a ConfigError with nothing registered."""
    reg = CollectorRegistry()
    a, _ = _bare_core()
    b, _ = _bare_core()
    ca = metrics.register(a, reg, tp_rank=0)
    metrics.register(b, reg, tp_rank=1)
    with pytest.raises(kvo.ConfigError, match="already registered"):
        metrics.register(b, reg, tp_rank=0)
    text = generate_latest(reg).decode()
    assert text.count("# TYPE kvoffload_pages_total counter") == 1
    s = scrape(reg)
    assert {dict(k[1]).get("tp_rank") for k in s if k[0] == "kvoffload_host_pool_capacity_pages"} == {
        "0",
        "1",
    }
    ca.unregister()
    s = scrape(reg)
    assert {dict(k[1]).get("tp_rank") for k in s if k[0] == "kvoffload_host_pool_capacity_pages"} == {"1"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"labels": {"direction": "x"}},
        {"labels": {"1bad": "x"}},
        {"labels": {"ok": 3}},
        {"tp_rank": -1},
        {"tp_rank": "0"},
    ],
)
def test_bad_labels_are_config_errors(kwargs: dict[str, Any]) -> None:
    """A label kvoffload uses itself, a name Prometheus refuses, a value not a str, or a
    tp_rank not an int >= 0: ConfigError, nothing registered."""
    reg = CollectorRegistry()
    core, _ = _bare_core()
    with pytest.raises(kvo.ConfigError):
        metrics.register(core, reg, **kwargs)
    assert scrape(reg) == {}


def test_register_refuses_other_sources() -> None:
    with pytest.raises(kvo.ConfigError, match="OffloadManager"):
        metrics.register(object(), CollectorRegistry())


def test_every_name_follows_the_conventions() -> None:
    """Counters end in _total, the others do not; units are base units; every label is
    of the closed vocabulary."""
    vocab = {"direction", "backend", "pool", "state", "reason", "op", "outcome", "result", "from", "to"}
    for name, (kind, labels, doc) in metrics.METRICS.items():
        assert name.startswith("kvoffload_") and doc
        assert name.endswith("_total") == (kind == "counter"), name
        assert not any(u in name for u in ("_ms", "_milliseconds", "_kb", "_mb")), name
        assert set(labels) <= vocab, name


def test_no_two_families_share_a_series_name() -> None:
    """A counter's family is its name less _total, a histogram's series add _bucket,
    _sum and _count: no two families may produce the same series name (prometheus_client
    would refuse to unregister them, and Prometheus would see one series twice)."""
    seen: dict[str, str] = {}
    for name, (kind, _, _) in metrics.METRICS.items():
        base = name.removesuffix("_total") if kind == "counter" else name
        suffixes = {
            "counter": ["", "_total", "_created"],
            "gauge": [""],
            "histogram": ["", "_bucket", "_sum", "_count"],
        }
        for suffix in suffixes[kind]:
            series = base + suffix
            assert series not in seen, (name, seen.get(series))
            seen[series] = name


def test_metrics_doc_lists_every_name_with_its_type_and_labels() -> None:
    """docs/metrics.md has one table row per exported family: its name, its type and its
    labels as kvoffload.metrics.METRICS says; and names no kvoffload_ family that is not
    exported."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(kvoffload_\w+)` \|.*$", text, flags=re.M)}
    assert set(rows) == set(metrics.METRICS), set(rows) ^ set(metrics.METRICS)
    for name, (kind, labels, _) in metrics.METRICS.items():
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert cells[1].startswith(kind), (name, cells[1])
        assert {x.strip() for x in cells[2].split(",") if x.strip()} == set(labels), (name, cells[2])
