"""`kvoffload simulate` stops cleanly (FAILURES F27): SIGINT and SIGTERM end a run
promptly with 130 / 143, remove its temporary store, print one line and no
traceback; a workload that could never run is refused (exit 2), never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Long enough never to finish by itself within the test.
LONG = [sys.executable, "-m", "kvoffload", "simulate", "--requests", "100000", "--no-progress"]


def _store_with_pages(tmp: Path) -> Path | None:
    for d in tmp.glob("kvoffload-sim-*"):
        if any(p.is_file() for p in d.rglob("*")):
            return d
    return None


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_f27_a_stop_signal_ends_the_run_cleanly(sig: signal.Signals, code: int, tmp_path: Path) -> None:
    """The signal arrives mid-run, with pages in the temporary store: the process exits
    128+signum within seconds, the store is gone, stderr is one line, no traceback."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(LONG, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        store = None
        while store is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            store = _store_with_pages(tmp_path)
        assert store is not None, "the run never wrote a page"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err
    assert "Traceback" not in out + err
    assert err.strip().splitlines() == [
        f"kvoffload: stopped by {sig.name}; the run's temporary store was removed"
    ]
    assert not list(tmp_path.glob("kvoffload-sim-*"))


def test_f27_a_request_that_can_never_fit_is_refused_not_waited_for() -> None:
    """The command that hung (a 2000-token prompt, a 2-page device pool) exits 2 at once
    with a message naming the request, the pages it needs and the pool's size."""
    argv = [sys.executable, "-m", "kvoffload", "simulate", "--requests", "1", "--page-size", "16"]
    argv += ["--stride", "16", "--host-pages", "2", "--device-pages", "2", "--prompt-mean", "2000"]
    argv += ["--store", "none"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "could never be admitted" in proc.stderr and "the device pool has 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_library_refuses_an_impossible_workload_too() -> None:
    """simulate() (the notebook API) raises ConfigError instead of running for ever."""
    import asyncio

    import kvoffload as kvo
    from kvoffload.simulate import simulate
    from kvoffload.workload import WorkloadSpec

    spec = WorkloadSpec(requests=2, prompt_mean=500)
    config = kvo.OffloadConfig(page_size=16, stride=16, device_pages=4, host_pages=4)
    with pytest.raises(kvo.ConfigError, match="could never be admitted"):
        asyncio.run(simulate(spec, config, "sim", None))
