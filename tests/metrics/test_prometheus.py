"""A real Prometheus scrapes ``kvoffload simulate --metrics-port`` (issue 24, point 5).

The server is Debian's ``prometheus``, on loopback: scripts/test.sh starts it
(scripts/prometheus.sh) and exports ``KVOFFLOAD_PROMETHEUS_URL`` /
``KVOFFLOAD_PROMETHEUS_DIR``; without them the test starts one itself when the binary is
installed, and otherwise skips - unless ``KVOFFLOAD_REQUIRE_PROMETHEUS=1`` (CI), where
the skip is a failure. Every wait is on a condition, with a generous bound.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[2]
#: Bounds of the waits (conditions, not timings): a loaded 2-core machine stays far inside.
RUN_BOUND_S = 300.0
SCRAPE_BOUND_S = 120.0
T = TypeVar("T")


def _missing(why: str) -> None:
    if os.environ.get("KVOFFLOAD_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(f"KVOFFLOAD_REQUIRE_PROMETHEUS=1 but {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def prometheus() -> Iterator[tuple[str, Path]]:
    """(Prometheus's URL, its directory: targets go in targets/*.json)."""
    url, where = os.environ.get("KVOFFLOAD_PROMETHEUS_URL"), os.environ.get("KVOFFLOAD_PROMETHEUS_DIR")
    if url and where:
        yield url, Path(where)
        return
    if shutil.which("prometheus") is None:
        _missing("no Prometheus: scripts/test.sh starts one (scripts/prometheus.sh, Debian's prometheus)")
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/prometheus.sh"), "start"], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        _missing(f"scripts/prometheus.sh start failed: {out.stderr[-2000:]}")
    env = dict(part.split("=", 1) for part in out.stdout.split()[1:])
    try:
        yield env["KVOFFLOAD_PROMETHEUS_URL"], Path(env["KVOFFLOAD_PROMETHEUS_DIR"])
    finally:
        subprocess.run(
            ["bash", str(ROOT / "scripts/prometheus.sh"), "stop"],
            env={**os.environ, "KVOFFLOAD_PROMETHEUS_DIR": env["KVOFFLOAD_PROMETHEUS_DIR"]},
            timeout=60,
            check=False,
        )


def query(url: str, promql: str) -> list[dict[str, Any]]:
    """The result of an instant query (``/api/v1/query``)."""
    q = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def until(what: str, bound_s: float, probe: Callable[[], T | None]) -> T:
    """Call ``probe`` until it returns something not None (at most ``bound_s``)."""
    deadline = time.monotonic() + bound_s
    while True:
        got = probe()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {bound_s:.0f} s")
        time.sleep(0.2)  # (polling a condition; nothing waits on this pause)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_prometheus_scrapes_a_simulate_run(prometheus: tuple[str, Path], tmp_path: Path) -> None:
    """Prometheus scrapes ``simulate --metrics-port`` while it runs and after (--linger):
    the counters it stored moved during the run, and its last samples are the run's JSON
    report (pages offloaded and stored, requests admitted / completed / aborted, bytes)."""
    url, where = prometheus
    run = uuid.uuid4().hex[:12]
    port = free_port()
    report_path = tmp_path / "report.json"
    # The target first (Prometheus finds it at once: file discovery), the run after.
    target = where / "targets" / f"{run}.json"
    target.write_text(json.dumps([{"targets": [f"127.0.0.1:{port}"], "labels": {"run": run}}]))
    # 60 requests arriving at 6/s: the run lasts >= 10 s whatever the machine, many scrapes.
    argv = [sys.executable, "-m", "kvoffload", "simulate", "--backend", "sim", "--store", "memory"]
    argv += ["--requests", "60", "--arrival-rate", "6", "--output-mean", "96", "--seed", "7"]
    argv += ["--metrics-port", str(port), "--linger", "600", "--no-progress", "--json", str(report_path)]
    log = (tmp_path / "simulate.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    sel = f'run="{run}"'
    try:
        until("simulate wrote its report", RUN_BOUND_S, lambda: True if report_path.exists() else None)
        report = json.loads(until("the report is complete", 30, lambda: _read_json(report_path)))
        assert report["ledger"]["ok"], report["ledger"]
        offloaded = report["pages"]["offloaded"]
        assert offloaded > 0

        def final() -> list[dict[str, Any]] | None:
            got = query(url, f'kvoffload_pages_total{{{sel},direction="d2h"}}')
            return got if got and float(got[0]["value"][1]) == offloaded else None

        until("Prometheus scraped the run's final figures", SCRAPE_BOUND_S, final)

        def one(promql: str) -> float:
            got = query(url, promql)
            assert len(got) == 1, (promql, got)
            return float(got[0]["value"][1])

        stats = report["statistics"]
        assert one(f'kvoffload_pages_total{{{sel},direction="h2s"}}') == report["pages"]["stored"]
        assert one(f"kvoffload_lifecycles_admitted_total{{{sel}}}") == report["requests"]["admitted"]
        for outcome in ("completed", "aborted", "failed"):
            got = one(f'kvoffload_lifecycles_released_total{{{sel},outcome="{outcome}"}}')
            assert got == report["requests"][outcome], outcome
        host_full = stats["pages_dropped"] - stats["pages_refused"]
        assert one(f'kvoffload_pages_dropped_total{{{sel},reason="host_full"}}') == host_full
        page_bytes = one(f"kvoffload_page_size_bytes{{{sel}}}")
        assert one(f'kvoffload_transfer_bytes_total{{{sel},direction="d2h"}}') == offloaded * page_bytes
        finished = stats["chunks_copied"] + stats["chunks_discarded"] + stats["chunks_failed"]
        assert one(f'kvoffload_transfer_size_bytes_count{{{sel},direction="d2h"}}') == finished
        assert sum(float(r["value"][1]) for r in query(url, f"kvoffload_lifecycles{{{sel}}}")) == 0

        # Moved: the samples Prometheus stored of the counter rise, from below the final
        # figure to it (it scraped during the run, not only after it).
        series = query(url, f'kvoffload_pages_total{{{sel},direction="d2h"}}[1h]')
        values = [float(v) for _, v in series[0]["values"]]
        assert values == sorted(values), values
        assert values[0] < offloaded == values[-1], values
        # Every expression of the Grafana dashboard is PromQL Prometheus accepts, and the
        # panels over counters of this run return data.
        dash = json.loads((ROOT / "docs" / "grafana" / "kvoffload.json").read_text())
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        answered = 0
        for expr in exprs:
            promql = expr.replace('instance=~"$instance"', sel).replace("$__rate_interval", "1h")
            answered += bool(query(url, promql))  # (query() asserts status == success)
        assert answered >= len(exprs) // 2, answered
        assert proc.poll() is None, "simulate --linger ended before the scrape"
    finally:
        target.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the linger ends; the run's exit code stands
        try:
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    assert code == 0, (tmp_path / "simulate.log").read_text()[-3000:]


def _read_json(path: Path) -> str | None:
    text = path.read_text()
    try:
        json.loads(text)
    except ValueError:
        return None  # (being written)
    return text
