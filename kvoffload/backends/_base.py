"""What the bundled backends share beyond the interface: waiting for them from an
event loop, for callers that drive a backend directly (tests, tools). The drivers
never use these: they take completions without blocking and wait their own way."""

from __future__ import annotations

import asyncio

import anyio
import anyio.to_thread

from kvoffload.abc import Completion, EventBackend

__all__ = ["BackendBase"]


class BackendBase(EventBackend):
    """:class:`~kvoffload.abc.EventBackend` plus ``await wait_completions()`` and
    ``await aclose()`` for callers on an asyncio loop."""

    async def wait_completions(self) -> list[Completion]:
        """Wait until at least one completion is ready; return every ready one."""
        loop = asyncio.get_running_loop()
        while True:
            batch = self.take_completions()
            if batch:
                return batch
            if self.needs_polling:
                await anyio.sleep(1e-4)
                continue
            ev = anyio.Event()

            def wake(ev: anyio.Event = ev) -> None:
                loop.call_soon_threadsafe(ev.set)

            self.set_waker(wake)
            try:
                if not self.ready:
                    await ev.wait()
            finally:
                self.set_waker(None)

    async def aclose(self) -> None:
        """:meth:`close`, then wait until no copy runs, on a worker thread; returns only
        once none runs, also when the caller is cancelled (the cancellation comes out
        after)."""
        self.close()
        if self.join(0):
            return
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.join, None, abandon_on_cancel=False)
