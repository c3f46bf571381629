"""The deterministic simulated backend: nothing completes until a test says so.

``complete(t)`` moves the bytes from ``t``'s device pages to its host pages (or, for
a load's ``"h2d"`` transfer, from its host pages to its device pages) *at that
moment*, so a device page freed (and rewritten) too early shows up as wrong data in
the host page; ``fail(t, error)`` reports a failed copy. Completions may be signalled
in any order. Everything runs on the owner thread; ``launch`` has nothing to start (a
copy reads when the test completes it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvoffload.abc import Completion, Transfer
from kvoffload.backends._base import BackendBase
from kvoffload.backends._threaded import CompletionInbox, copy_transfer_pages
from kvoffload.errors import BackendError

if TYPE_CHECKING:
    from kvoffload.pools import DevicePool, EnginePages, HostPool

__all__ = ["SimBackend"]


class SimBackend(BackendBase):
    """A copy backend driven by the test: ``pending``, ``complete(t)``, ``fail(t, error)``."""

    name = "sim"
    completes_on_its_own = False

    def __init__(self) -> None:
        # pending: submitted transfers not yet completed or failed, in submission order.
        self.pending: list[Transfer] = []
        self.inbox = CompletionInbox()
        self._device: DevicePool | EnginePages | None = None
        self._host: HostPool | None = None
        self._pairs: list[tuple[Any, Any]] = []
        self._closed = False
        self.submitted = 0

    def open(self, device: DevicePool | EnginePages, host: HostPool) -> None:
        self._device, self._host = device, host
        self._pairs = device.copy_pairs(host)

    def submit(self, transfer: Transfer) -> None:
        """Record ``transfer`` as pending; nothing is copied yet."""
        if self._closed:
            raise BackendError("SimBackend is closed")
        if self._device is not None and self._host is not None and not transfer.owned:
            transfer.check_fits(self._device.n_pages, self._host.n_pages, self.streams)
        self.pending.append(transfer)
        self.submitted += 1

    def _take(self, transfer: Transfer) -> None:
        try:
            self.pending.remove(transfer)
        except ValueError:
            raise BackendError(
                f"{transfer!r} is not pending (completed already, or never submitted)"
            ) from None

    def complete(self, transfer: Transfer) -> None:
        """Copy ``transfer``'s pages now (device -> host, or host -> device for ``"h2d"``)
        and signal success."""
        self._take(transfer)
        assert self._device is not None and self._host is not None
        copy_transfer_pages(self._pairs, transfer)
        self._signal((transfer.id, None))

    def fail(self, transfer: Transfer, error: BaseException | None = None) -> None:
        """Signal that ``transfer``'s copy failed (nothing is copied)."""
        self._take(transfer)
        self._signal((transfer.id, error if error is not None else BackendError("simulated copy failure")))

    def complete_all(self) -> None:
        """Complete every pending transfer, in submission order."""
        for t in list(self.pending):
            self.complete(t)

    def _signal(self, completion: Completion) -> None:
        self.inbox.post([completion])

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        self.inbox.set_waker(waker)

    def take_completions(self, max_completions: int | None = None) -> list[Completion]:
        return self.inbox.take_nowait(max_completions)

    @property
    def ready(self) -> int:
        return self.inbox.ready

    @property
    def signalled(self) -> int:
        return self.inbox.signalled

    def wait_ready(self, timeout: float | None) -> bool:
        """Nothing completes by itself here: waits only for another thread's ``complete``."""
        return self.inbox.wait_ready(timeout)

    def running(self) -> list[Transfer]:
        return list(self.pending)

    def close(self) -> None:
        self._closed = True
