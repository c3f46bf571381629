"""``kvoffload simulate --metrics-port PORT [--linger S]``: its usage errors (the
endpoint itself is scraped by a real Prometheus in test_prometheus.py)."""

from __future__ import annotations

import socket

import pytest
from support import run_cli

pytest.importorskip("prometheus_client")

QUICK = ["simulate", "--backend", "sim", "--store", "none", "--requests", "2", "--no-progress"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--linger", "5"], "--linger keeps the metrics endpoint up: it needs --metrics-port"),
        (["--metrics-port", "0", "--tp", "2"], "not available with --tp"),
        (["--metrics-port", "70000"], "a TCP port in 0..65535"),
        (["--metrics-port", "0", "--linger", "-1"], "seconds >= 0"),
    ],
)
def test_metrics_options_usage_errors(
    extra: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --metrics-port / --linger exits 2 saying what is allowed, before any run."""
    code, out, err = run_cli([*QUICK, *extra], capsys)
    assert code == 2 and says in err, err
    assert "admitted" not in out


def test_metrics_port_in_use_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A port already taken on 127.0.0.1: exit 2 naming it, no run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out, err = run_cli([*QUICK, "--metrics-port", str(port)], capsys)
    assert code == 2 and f"--metrics-port {port}" in err, err
    assert "admitted" not in out


def test_metrics_port_zero_names_the_port_chosen(capsys: pytest.CaptureFixture[str]) -> None:
    """--metrics-port 0 picks a free loopback port and says which; the run's summary and
    exit code are as without it."""
    code, _, err = run_cli([*QUICK, "--metrics-port", "0"], capsys)
    assert code == 0, err
    assert "kvoffload: metrics at http://127.0.0.1:" in err and "/metrics" in err
