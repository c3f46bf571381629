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
- :func:`manager_in_task`: an open manager that a pytest-asyncio fixture can yield
  (its ``async with`` runs in a task of its own).
- :func:`capture_transitions`: the lifecycle transitions a block of code caused.
- :class:`LocalRanks`: local tensor-parallel ranks (spawned processes in one gloo
  group) that run a function on every rank, for tests of ``SyncOffloadManager(group=)``.
- :func:`reference_keys`: an independent recomputation of the page key chain.
- :func:`explore`: every interleaving of the bare core in small worlds
  (:class:`World`), breadth first, each step checked: the exhaustive check (an
  :class:`Exploration` says what it visited, a :class:`Counterexample` gives a
  shortest failing schedule).

Everything but ``SimBackend`` needs hypothesis (``pip install kvoffload[test]``); it is
imported on first use, so ``from kvoffload.testing import SimBackend`` stays light.
See docs/testing.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio

from kvoffload.backends._sim import SimBackend
from kvoffload.drivers.asyncio import OffloadManager

if TYPE_CHECKING:
    from kvoffload._testing.capture import TransitionRecord, capture_transitions
    from kvoffload._testing.explore import Counterexample, Exploration, World, explore
    from kvoffload._testing.host import ManagerHost, SyncManagerHost
    from kvoffload._testing.machine import (
        CoreLifecycleMachine,
        FlakyStorage,
        LifecycleMachine,
        SyncLifecycleMachine,
    )
    from kvoffload._testing.observer import CheckedSimBackend, Observer, reference_keys
    from kvoffload._testing.program import open_arguments, programs, run_program
    from kvoffload._testing.ranks import LocalRanks, RankContext
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
    "CoreLifecycleMachine",
    "Counterexample",
    "Exploration",
    "FlakyStorage",
    "LifecycleMachine",
    "LocalRanks",
    "ManagerHost",
    "Observer",
    "RankContext",
    "Request",
    "Schedule",
    "SimBackend",
    "Step",
    "SyncLifecycleMachine",
    "SyncManagerHost",
    "TransitionRecord",
    "World",
    "capture_transitions",
    "completion_orders",
    "explore",
    "manager_in_task",
    "open_arguments",
    "programs",
    "reference_keys",
    "request_streams",
    "run_program",
    "run_schedule",
    "schedules",
]


@contextlib.asynccontextmanager
async def manager_in_task(*args: Any, **kwargs: Any) -> AsyncIterator[OffloadManager]:
    """An open ``OffloadManager(*args, **kwargs)`` whose ``async with`` runs in an
    asyncio task of its own.

    pytest-asyncio sets an async fixture up and tears it down in two different tasks,
    and the manager's anyio task group must be left in the task that entered it; so a
    fixture that yields a manager opens it with this. Leaving waits for the manager to
    drain and close; an error of the manager (its exit or a background task) is raised
    here. Asyncio only.
    """
    ready = anyio.Event()
    done = anyio.Event()
    box: list[OffloadManager] = []

    async def run() -> None:
        try:
            async with OffloadManager(*args, **kwargs) as m:
                box.append(m)
                ready.set()
                await done.wait()
        finally:
            ready.set()

    task = asyncio.get_running_loop().create_task(run())
    await ready.wait()
    if not box:
        await task  # it failed on the way in: raise that
    try:
        yield box[0]
    finally:
        done.set()
        await task


_LAZY: dict[str, str] = {
    "CheckedSimBackend": "observer",
    "CoreLifecycleMachine": "machine",
    "Counterexample": "explore",
    "Exploration": "explore",
    "FlakyStorage": "machine",
    "LifecycleMachine": "machine",
    "LocalRanks": "ranks",
    "ManagerHost": "host",
    "Observer": "observer",
    "RankContext": "ranks",
    "Request": "strategies",
    "Schedule": "strategies",
    "Step": "strategies",
    "SyncLifecycleMachine": "machine",
    "SyncManagerHost": "host",
    "TransitionRecord": "capture",
    "World": "explore",
    "capture_transitions": "capture",
    "completion_orders": "strategies",
    "explore": "explore",
    "open_arguments": "program",
    "programs": "program",
    "reference_keys": "observer",
    "run_program": "program",
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
