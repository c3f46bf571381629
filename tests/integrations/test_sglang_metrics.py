"""The SGLang drop-in's ``kvoffload_*`` series (issue 24 point 2), on SGLang 0.5.23's REAL
classes (tests/integrations/sglang_real.py).

What must hold: with SGLang's ``enable_metrics`` (or ``metrics=True``) each rank's
series carry ``tp_rank`` and say what the rank's manager did (pages stored = its
statistics); in SGLang's own prometheus multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``,
what ``--enable-metrics`` sets) they reach the files SGLang's ``/metrics`` aggregates,
read back with prometheus_client's ``MultiProcessCollector``; without it they are a
collector on prometheus_client's ``REGISTRY``, taken off at shutdown; with metrics off
nothing is exported. Skipped without sglang unless ``KVOFFLOAD_REQUIRE_SGLANG=1``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import sglang_cpu

sglang_cpu.require()

import pytest  # noqa: E402
import sglang_real as sr  # noqa: E402

from kvoffload.storage.memory import MemoryStorage  # noqa: E402
from kvoffload.testing import SimBackend  # noqa: E402

pytest.importorskip("prometheus_client", reason="kvoffload[metrics] (prometheus_client) is not installed")

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

HERE = Path(__file__).resolve().parent


def _serve_one_request(eng: Any, mgr: Any, sim: SimBackend) -> None:
    """A request of two prompt pages (stored on the prefill side) decoding two more, to
    its release and its writes."""
    req = eng.new_req("m", list(range(8)), max_new_tokens=10)
    eng.admit(req)
    for _ in range(200):
        if req.finished() and not mgr.ongoing_offload and not sim.pending:
            break
        eng.step(mgr, [req] if not req.finished() else [])
        sim.complete_all()
        mgr.check_offload_progress()
    for _ in range(10_000):  # the idle loop until the storage writes are collected
        mgr.check_offload_progress()
        if not mgr.statistics().pages_in_write:
            break
        mgr.manager.wait_progress(0.01)


def _value(text: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def test_enable_metrics_exports_the_ranks_series_with_tp_rank_on_the_registry() -> None:
    """Not in multiprocess mode: the rank's series are read at scrape time from
    prometheus_client's REGISTRY, ``tp_rank="0"``; they leave with the manager."""
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    with sr.engine(page_size=4, enable_metrics=True) as eng:
        sim = SimBackend()
        store = MemoryStorage()
        args = eng.server_args
        mgr = eng.manager(server_args=args, backend=sim, storage=store, host_pages=64, drain_timeout_s=5)
        try:
            assert mgr._metrics is not None and mgr._metrics.mode == "collector"
            _serve_one_request(eng, mgr, sim)
            stored = mgr.statistics().pages_stored
            assert stored >= 2
            text = generate_latest(REGISTRY).decode()
            assert _value(text, "kvoffload_pages_total", direction="h2s", tp_rank="0") == stored
            assert _value(text, "kvoffload_lifecycles_admitted_total", tp_rank="0") == 1
        finally:
            mgr.release_host_resources()
        assert "kvoffload_pages_total" not in generate_latest(REGISTRY).decode()


def test_metrics_off_by_default_exports_nothing() -> None:
    """SGLang's enable_metrics off (its default) and no metrics=: nothing exported."""
    with sr.engine(page_size=4) as eng:
        store = MemoryStorage()
        mgr = eng.manager(server_args=eng.server_args, backend=SimBackend(), storage=store, host_pages=8)
        try:
            assert mgr._metrics is None
            assert "kvoffload_" not in generate_latest(REGISTRY).decode()
        finally:
            mgr.release_host_resources()


_MULTIPROCESS_RANK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    sys.path.insert(0, {tests!r})
    import test_sglang_metrics as t
    import sglang_real as sr
    from kvoffload.storage.memory import MemoryStorage
    from kvoffload.testing import SimBackend

    with sr.engine(page_size=4) as eng:
        sim = SimBackend()
        mgr = eng.manager(server_args=eng.server_args, backend=sim, storage=MemoryStorage(),
                          host_pages=64, drain_timeout_s=5.0, metrics=True)
        assert mgr._metrics.mode == "multiprocess", mgr._metrics.mode
        t._serve_one_request(eng, mgr, sim)
        print("STORED", mgr.statistics().pages_stored)
        mgr.release_host_resources()
    """
)


def test_in_sglangs_multiprocess_mode_the_series_reach_the_files_its_metrics_endpoint_reads(
    tmp_path: Path,
) -> None:
    """A scheduler process with PROMETHEUS_MULTIPROC_DIR set (as SGLang's launcher sets
    it): its kvoffload_* series are written to the directory, and prometheus_client's
    MultiProcessCollector (SGLang's /metrics) reads the rank's figures back."""
    script = tmp_path / "rank.py"
    script.write_text(_MULTIPROCESS_RANK.format(here=str(HERE), tests=str(HERE.parent)))
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    stored = float(proc.stdout.split("STORED", 1)[1].split()[0])
    assert stored >= 2
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    text = generate_latest(registry).decode()
    assert _value(text, "kvoffload_pages_total", direction="h2s", tp_rank="0") == stored
    assert _value(text, "kvoffload_transfer_size_bytes_count", direction="h2s", tp_rank="0") is not None
