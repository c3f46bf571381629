"""A listener's failure is logged by the manager it failed in: the rate limit of
``listener.failed`` lines is one manager's state, on that manager's clock, never the
process's (F39: a test that ran after another one in the same process, within the
limit's interval of wall time, saw no line)."""

from __future__ import annotations

from typing import Any

import structlog
from support import small_config, toks

import kvoffload as kvo
from kvoffload.testing import SimBackend


def _raising(name: str, fields: dict[str, Any]) -> None:
    if name == "lifecycle.admitted":
        raise RuntimeError("listener bug")


def _admit_with_a_raising_listener(clock: Any = None) -> list[dict[str, Any]]:
    kwargs = {} if clock is None else {"clock": clock}
    with kvo.SyncOffloadManager(small_config(), backend=SimBackend(), **kwargs) as mgr:
        mgr.add_listener(_raising)
        with structlog.testing.capture_logs() as logs:
            mgr.admit("r1", prompt=toks(0, 4)).finish()
            mgr.admit("r2", prompt=toks(0, 4)).finish()
        mgr.poll()
    return [e for e in logs if e["event"] == "listener.failed"]


def test_a_second_manager_logs_its_listeners_failure_at_once() -> None:
    """Two managers one after the other in one process, within a second: each logs its
    own listener's first failure (a module-wide limit kept the second one silent)."""
    first = _admit_with_a_raising_listener()
    second = _admit_with_a_raising_listener()
    assert len(first) == 1 and first[0]["failures_since_last_log"] == 1, first
    assert len(second) == 1 and second[0]["failures_since_last_log"] == 1, second


def test_listener_failure_lines_are_limited_on_the_managers_clock() -> None:
    """The limit runs on the clock the manager was given, so a virtual clock decides it:
    a frozen clock gives one line for two failures, whatever the wall clock does."""
    frozen = _admit_with_a_raising_listener(clock=lambda: 100.0)
    assert len(frozen) == 1, frozen
