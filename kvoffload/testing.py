"""Helpers for tests of kvoffload and of code that uses it.

``SimBackend`` completes nothing until the test says so. ``manager_in_task`` opens an
``OffloadManager`` that a pytest-asyncio fixture can hand to a test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio

from kvoffload.backends.sim import SimBackend
from kvoffload.manager import OffloadManager

__all__ = ["SimBackend", "manager_in_task"]


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
