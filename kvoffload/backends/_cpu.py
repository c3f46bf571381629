"""The cpu backend: torch copies on one worker thread per copy stream.

The default when no GPU is present. Both pools are plain CPU tensors (page-major, so
a page is one contiguous block). ``submit`` only queues the transfer (loop thread);
the stream's worker thread copies its pages - one block copy per run of consecutive
host pages, a gather where the device pages of a run are scattered - and posts the
completion; the loop is woken with one ``call_soon_threadsafe`` per wake-up and takes
every completion posted so far in one batch. The loop never blocks on a copy (F13).

Bytes at submit time, the CPU analogue of F17: the engine writes device pages on the
loop thread, but only pages past the committed tokens; a submitted chunk covers
committed, whole pages, which the manager holds until RELEASED, after the last copy
reading them completed (F3/F4). So the worker reads bytes nobody writes while it
reads, and no snapshot at submit is taken (that would be a copy on the loop thread).
``tests/test_integrity.py`` checks this end to end, page reuse included.

``torch.Event`` is not used: on the CPU build it raises, and ``torch.cpu.Event.query()``
is always true; completion is the worker thread returning from the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.abc import Completion, Transfer
from kvoffload.backends._threaded import (
    CompletionInbox,
    CopyHooks,
    StreamWorker,
    ThreadedBackend,
    copy_transfer_pages,
)

if TYPE_CHECKING:
    from kvoffload.pools import DevicePool, EnginePages, HostPool

__all__ = ["CpuBackend"]


def copy_transfer(pairs: Sequence[tuple[Any, Any]], transfer: Transfer) -> None:
    """Copy ``transfer``'s pages the way its ``direction`` says: device -> host pages, or
    host -> device pages for a load's ``"h2d"`` (blocking; any thread)."""
    copy_transfer_pages(pairs, transfer)


class _CopyStream(StreamWorker[Transfer]):
    """One copy stream: copies its transfers in submission order on its own thread."""

    def __init__(
        self,
        name: str,
        inbox: CompletionInbox,
        device: DevicePool | EnginePages,
        host: HostPool,
        hooks: CopyHooks,
    ) -> None:
        super().__init__(name, inbox)
        self._pairs = device.copy_pairs(host)
        self._hooks = hooks
        self._page_nbytes = host.tensor[0].nbytes if host.n_pages else 1

    def transfer_of(self, item: Transfer) -> Transfer:
        return item

    #: Transfers queued behind the head are copied with it: their runs of consecutive
    #: pages merge across transfers into fewer, larger block copies. At most 64
    #: transfers and 16 MiB together, so the head's completion is not held back long.
    batch_max = 64
    batch_bytes = 16 << 20

    def batch_room(self, items: list[Transfer], item: Transfer) -> bool:
        pages = sum(len(t.device_pages) for t in items) + len(item.device_pages)
        return pages * self._page_nbytes <= self.batch_bytes

    def finish_batch(self, items: list[Transfer]) -> list[Completion]:
        hooks = self._hooks
        direction = items[0].direction
        if (
            len(items) == 1
            or hooks.before is not None
            or hooks.after is not None
            or any(t.direction != direction for t in items)
        ):
            return super().finish_batch(items)  # hooks are per transfer (and one way): one at a time
        merged = Transfer.__new__(Transfer)
        merged.direction = direction
        merged.device_pages = [p for t in items for p in t.device_pages]
        merged.host_pages = [p for t in items for p in t.host_pages]  # distinct: held by each
        try:
            copy_transfer(self._pairs, merged)
        except Exception:  # find the transfer that fails: copy them one by one
            return super().finish_batch(items)
        return [(t.id, None) for t in items]

    def finish(self, item: Transfer) -> Completion:
        hooks = self._hooks
        if hooks.before is not None:
            error = hooks.before(item)
            if error is not None:
                return (item.id, error)
        try:
            copy_transfer(self._pairs, item)
        except Exception as e:  # this transfer fails; the stream goes on
            return (item.id, e)
        if hooks.after is not None:
            hooks.after(item)
        return (item.id, None)


class CpuBackend(ThreadedBackend[Transfer]):
    """Copies on ``streams`` worker threads (default 1); completions in per-stream order.

    ``CpuBackend(streams=2)``; chosen by ``backend="cpu"`` (or ``"auto"`` without a GPU).
    """

    name = "cpu"

    def _make_worker(self, index: int) -> _CopyStream:
        assert self._device is not None and self._host is not None
        return _CopyStream(f"kvoffload.cpu-copy-{index}", self.inbox, self._device, self._host, self.hooks)

    def _start(self, transfer: Transfer, worker: StreamWorker[Transfer]) -> Transfer:
        return transfer  # the copy itself runs on the worker thread
