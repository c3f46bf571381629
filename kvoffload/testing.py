"""Helpers for tests of kvoffload and of code that uses it.

- :class:`SimBackend`: completes nothing until the test says so, in any order.
- :class:`LifecycleMachine`: a hypothesis state machine of the world around an
  :class:`~kvoffload.OffloadManager` (admits with reused ids, extends, finishes, aborts,
  completions and failures in any order, dropped references, a full host pool, the
  retraction barrier) that checks the lifecycle rules after every step. Subclass it to
  drive your own scheduler loop; ``YourMachine.TestCase`` is a test.
- :func:`request_streams`, :func:`completion_orders`, :func:`schedules`: hypothesis
  strategies for request streams with id reuse and for completion orders;
  :func:`run_schedule` plays one against a manager.
- :class:`ManagerHost`: a manager held open on its own event loop between
  synchronous steps (what the machine runs on).
- :func:`capture_transitions`: the lifecycle transitions a block of code caused.
- :func:`reference_keys`: an independent recomputation of the page key chain.

Everything but ``SimBackend`` needs hypothesis (``pip install kvoffload[test]``); it is
imported on first use, so ``from kvoffload.testing import SimBackend`` stays light.
See docs/testing.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvoffload.backends.sim import SimBackend

if TYPE_CHECKING:
    from kvoffload._testing.capture import TransitionRecord, capture_transitions
    from kvoffload._testing.host import ManagerHost
    from kvoffload._testing.machine import LifecycleMachine
    from kvoffload._testing.observer import CheckedSimBackend, Observer, reference_keys
    from kvoffload._testing.strategies import (
        Request,
        Schedule,
        Step,
        completion_orders,
        request_streams,
        run_schedule,
        schedules,
    )

__all__ = [
    "CheckedSimBackend",
    "LifecycleMachine",
    "ManagerHost",
    "Observer",
    "Request",
    "Schedule",
    "SimBackend",
    "Step",
    "TransitionRecord",
    "capture_transitions",
    "completion_orders",
    "reference_keys",
    "request_streams",
    "run_schedule",
    "schedules",
]

_LAZY: dict[str, str] = {
    "CheckedSimBackend": "observer",
    "LifecycleMachine": "machine",
    "ManagerHost": "host",
    "Observer": "observer",
    "Request": "strategies",
    "Schedule": "strategies",
    "Step": "strategies",
    "TransitionRecord": "capture",
    "capture_transitions": "capture",
    "completion_orders": "strategies",
    "reference_keys": "observer",
    "request_streams": "strategies",
    "run_schedule": "strategies",
    "schedules": "strategies",
}


def __getattr__(name: str) -> Any:
    room = _LAZY.get(name)
    if room is None:
        raise AttributeError(f"module 'kvoffload.testing' has no attribute {name!r}")
    try:
        module = importlib.import_module(f"kvoffload._testing.{room}")
    except ImportError as exc:
        if exc.name not in ("hypothesis", "transitions"):
            raise
        from kvoffload.errors import MissingDependency

        raise MissingDependency(
            f"kvoffload.testing.{name} needs {exc.name}: pip install 'kvoffload[test]'"
        ) from exc
    value = getattr(module, name)
    globals()[name] = value
    return value
