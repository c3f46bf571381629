"""Hosts: a manager held open between synchronous steps, either driver.

:class:`ManagerHost` keeps an :class:`~kvoffload.OffloadManager` open on its own event
loop; :class:`SyncManagerHost` opens a :class:`~kvoffload.SyncOffloadManager` on this
thread. Both have ``call(fn)`` (run one step, then deliver every signalled completion
and finished storage write), ``run(coro_fn)`` and ``close()``, so one scenario runs
under both drivers.

A hypothesis state machine is synchronous: each rule is a plain call. The host enters
``async with mgr`` in a task on a private ``asyncio.Runner`` and keeps that task
waiting, so the manager's task group lives (in one task, as anyio requires) across
steps; each step runs on the loop and then waits until every signalled completion was
delivered. So the machine needs no pytest-asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from kvoffload.drivers.asyncio import OffloadManager
    from kvoffload.drivers.sync import SyncOffloadManager

__all__ = ["ManagerHost", "SyncManagerHost"]

_T = TypeVar("_T")


class ManagerHost:
    """Opens ``mgr`` on a private event loop; :meth:`call` runs one step on it.

    ``hang_s`` (real seconds) bounds each wait for the manager: past it the step fails
    as hung instead of blocking the test run for ever.
    """

    def __init__(self, mgr: OffloadManager, hang_s: float = 10.0) -> None:
        self.mgr = mgr
        self.hang_s = hang_s
        self._runner: asyncio.Runner | None = asyncio.Runner()
        # _task: the task inside `async with mgr`; done only once the manager stopped.
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._runner.run(self._start())

    async def _start(self) -> None:
        self._stop = asyncio.Event()
        entered = asyncio.Event()
        mgr, stop = self.mgr, self._stop

        async def hold_open() -> None:
            async with mgr:
                entered.set()
                await stop.wait()

        self._task = asyncio.create_task(hold_open())
        await asyncio.wait({self._task, asyncio.ensure_future(entered.wait())}, return_when="FIRST_COMPLETED")
        if self._task.done():
            self._task.result()

    @property
    def stopped(self) -> bool:
        """Whether the manager left its context (closed, or crashed: a task failed)."""
        return self._task is None or self._task.done()

    def raise_if_stopped(self) -> None:
        """Raise ``AssertionError`` naming the manager's error if it stopped."""
        if self.stopped:
            task = self._task
            exc = task.exception() if task is not None and not task.cancelled() else None
            raise AssertionError(f"the manager stopped: {exc!r}")

    def call(self, fn: Callable[[], _T]) -> _T:
        """Call ``fn`` on the loop, then wait until every completion the backend signalled
        was delivered (``mgr.settle()``). Raises if the manager crashed or hung."""
        assert self._runner is not None, "the host is closed"
        self.raise_if_stopped()

        async def step() -> _T:
            result = fn()
            await self._settle()
            return result

        return self._runner.run(step())

    async def _settle(self) -> None:
        assert self._task is not None
        settle = asyncio.ensure_future(self.mgr.settle())
        done, _ = await asyncio.wait({settle, self._task}, timeout=self.hang_s, return_when="FIRST_COMPLETED")
        if settle not in done:
            settle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await settle
            self.raise_if_stopped()
            raise AssertionError(f"settle() hung for {self.hang_s}s: {self.mgr!r}")

    def run(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        """Await ``fn()`` on the loop (e.g. ``lambda: mgr.lookup(tokens)``), then settle."""
        assert self._runner is not None, "the host is closed"
        self.raise_if_stopped()

        async def step() -> _T:
            result = await fn()
            await self._settle()
            return result

        return self._runner.run(step())

    def close(self) -> None:
        """Leave the manager's context (it drains in-flight copies) and close the loop."""
        runner = self._runner
        if runner is None:
            return

        async def stop() -> None:
            assert self._stop is not None and self._task is not None
            self._stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._task), self.hang_s)

        try:
            runner.run(stop())
        finally:
            runner.close()
            self._runner = None


class SyncManagerHost:
    """Opens ``mgr`` (a :class:`~kvoffload.SyncOffloadManager`) on this thread;
    :meth:`call` runs one step, then polls until every signalled completion was
    delivered and every storage write came back (at most ``hang_s`` seconds)."""

    stopped = False

    def __init__(self, mgr: SyncOffloadManager, hang_s: float = 10.0) -> None:
        self.mgr = mgr
        self.hang_s = hang_s
        mgr.open()

    def call(self, fn: Callable[[], _T]) -> _T:
        """Call ``fn``, then poll until nothing signalled or written is left."""
        result = fn()
        self.settle()
        return result

    def settle(self) -> None:
        import time

        mgr = self.mgr
        deadline = time.monotonic() + self.hang_s
        while True:
            mgr.poll()
            if not mgr.ready() and not mgr.writes_pending:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"poll() did not deliver everything within {self.hang_s}s: {mgr!r}")
            mgr.wait_progress(0.01)

    def run(self, fn: Callable[[], Awaitable[_T]] | Callable[[], _T]) -> _T:
        """Call ``fn`` (a plain call here: the sync manager returns values)."""
        return self.call(fn)  # type: ignore[return-value]

    def close(self) -> None:
        """Close the manager (it drains in-flight copies, at most its drain timeout)."""
        self.mgr.close()
