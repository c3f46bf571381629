"""`kvoffload simulate` stops cleanly (FAILURES F27): SIGINT and SIGTERM end a run
promptly with 130 / 143, remove its temporary store, print one line and no
traceback; a workload that could never run is refused (exit 2), never a hang."""

from __future__ import annotations

import os
import re
import selectors
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


#: The two ways to start the command: ``python -m kvoffload`` and the console script.
COMMANDS = {
    "python -m kvoffload": [sys.executable, "-X", "importtime", "-m", "kvoffload"],
    "console script": [sys.executable, "-X", "importtime", str(Path(sys.executable).with_name("kvoffload"))],
}


def _read_until(proc: subprocess.Popen[str], marker: str, bound_s: float) -> list[str]:
    """stderr lines of ``proc`` up to the first that ``marker`` (a regex) matches (waits
    for the line, at most ``bound_s``: a hang bound, never a pace)."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + bound_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if re.search(marker, line):
                return lines
    raise AssertionError(f"no {marker!r} on stderr within {bound_s} s: {lines[-5:]}")


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_f27_a_stop_signal_while_kvoffload_imports_exits_quietly(
    command: str, sig: signal.Signals, code: int, tmp_path: Path
) -> None:
    """F27: the signal arrives while ``import kvoffload`` runs (the first half second,
    before the command's own handlers exist): the process exits 128+signum with one
    line and no traceback. The moment is driven: python's ``-X importtime`` reports
    each module as its import ends, and the signal goes when the first kvoffload
    module is reported, while the package itself is still importing."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = [*COMMANDS[command], "simulate", "--requests", "100000", "--no-progress"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = _read_until(proc, r"\|\s+kvoffload\.", 60)  # "| <indent>kvoffload.errors"
        assert not any(re.search(r"\|\s+kvoffload$", line.rstrip()) for line in seen)  # still importing
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    said = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in err
    assert said == [f"kvoffload: stopped by {sig.name}"], said
    assert not list(tmp_path.glob("kvoffload-sim-*"))


def test_the_early_handlers_belong_to_the_command_only() -> None:
    """A program that imports kvoffload keeps its own signal handlers: only the
    ``kvoffload`` command (``python -m kvoffload``, the console script) gets the early
    ones."""
    from kvoffload._early_stop import _stop, is_the_command

    assert is_the_command(["-m"], ["python", "-X", "importtime", "-m", "kvoffload", "simulate"])
    assert is_the_command(["-m"], ["python", "-mkvoffload"])
    assert is_the_command(["/venv/bin/kvoffload", "simulate"], ["python", "/venv/bin/kvoffload"])
    assert not is_the_command(["-m"], ["python", "-m", "mypkg"])  # mypkg imports kvoffload
    assert not is_the_command(["-m"], ["python", "-m", "kvoffload.other"])
    assert not is_the_command(["app.py"], ["python", "app.py"])
    assert not is_the_command(["-c"], ["python", "-c", "import kvoffload"])
    # This process (pytest) imported kvoffload: its handlers are its own.
    assert all(signal.getsignal(sig) is not _stop for sig in (signal.SIGINT, signal.SIGTERM))


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
    from kvoffload.tools.simulate import simulate
    from kvoffload.tools.workload import WorkloadSpec

    spec = WorkloadSpec(requests=2, prompt_mean=500)
    config = kvo.OffloadConfig(page_size=16, stride=16, device_pages=4, host_pages=4)
    with pytest.raises(kvo.ConfigError, match="could never be admitted"):
        asyncio.run(simulate(spec, config, "sim", None))
