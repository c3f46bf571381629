"""kvoffload logs as a library should (issue 13): nothing printed unless the
application configured logging; warnings go where the application's logging sends them
(structlog when configured, else the stdlib logger "kvoffload"); no reads of
structlog's private internals."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A run that logs warnings: a full host pool drops chunks (chunk.dropped) and the
# manager is left with a live lifecycle (manager.closed_live).
SCENARIO = """
import kvoffload as kvo
from kvoffload.testing import SimBackend
{setup}
config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=32, host_pages=1)
b = SimBackend()
with kvo.SyncOffloadManager(config, backend=b) as mgr:
    a = mgr.admit("a", [0, 1, 2, 3])
    a.extend([4, 5, 6, 7, 8])
    c = mgr.admit("c", [0, 1, 2, 3])
    c.extend([4, 5, 6, 7, 8])  # the host pool is full: a counted drop, a warning
    assert mgr.statistics().chunks_dropped == 1
    b.complete_all()
    mgr.poll()
print("done")
"""


def _run(setup: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCENARIO.format(setup=setup)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_nothing_is_printed_unless_the_application_configures_logging() -> None:
    out = _run("")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "done\n" and out.stderr == ""


def test_warnings_go_where_the_applications_stdlib_logging_sends_them() -> None:
    out = _run("import logging; logging.basicConfig(level=logging.WARNING, format='%(name)s %(message)s')")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^kvoffload chunk\.dropped .*rid='c'", out.stderr, re.M), out.stderr
    assert "manager.closed_live" in out.stderr and "transfer.submitted" not in out.stderr  # no debug


def test_warnings_go_to_structlog_when_the_application_configured_it() -> None:
    setup = (
        "import logging, structlog; structlog.configure("
        "wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))"
    )
    out = _run(setup)
    assert out.returncode == 0, out.stderr
    assert "chunk.dropped" in out.stdout and "transfer.submitted" not in out.stdout


def test_debug_events_when_the_application_asks_for_them() -> None:
    out = _run("import logging; logging.basicConfig(level=logging.DEBUG, format='%(name)s %(message)s')")
    assert re.search(r"^kvoffload lifecycle\.transition ", out.stderr, re.M), out.stderr


def test_no_module_reads_structlogs_private_internals() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "kvoffload").rglob("*.py")
        if re.search(r"structlog\._|from structlog import _", p.read_text())
    ]
    assert offenders == []
