"""The cuda backend: copies on side streams, completion from one event per submission.

``submit`` (owner thread, never blocks) notes what the copy must wait for: the
transfer's ``ready`` (a ``torch.cuda.Event`` or ``Stream`` the engine passed with
``extend(..., ready=)``), else an event recorded at submit on the stream current then
(F17, F26). ``launch`` (the driver's next turn, F19) then, per transfer:

1. the stream's side stream waits on that event or stream, so the copy never reads KV
   the model is still writing;
2. the copy is queued on the side stream: one device->host copy per run of
   consecutive host pages; scattered device pages are first gathered on the device by
   one ``index_select`` per submission, so a submission is a few large copies into
   pinned host pages (the host pool is pinned, so the copies are truly async). A
   load's ``"h2d"`` transfer is the same backwards (:func:`queue_copy_h2d`): a few
   large copies out of pinned host pages, scattered by one ``index_copy_``;
3. one event is recorded after the copy. Events come from a pool and go back to it only
   after the waiter consumed their completion: an event is never re-recorded before.

Completion (``completion="waiter"``, the default): one waiter thread per stream. It
takes the oldest in-flight submission; ``query()`` first (fast path), else
``synchronize()`` on a blocking-sync event (the thread sleeps in the driver, the loop
never waits); then it takes every following submission whose event already completed
and posts the whole batch to the loop with one ``call_soon_threadsafe``.
``completion="poll"`` is the fallback: no threads; ``take_completions`` queries the
heads (a waiting driver sleeps with backoff, 20 µs doubling to 1 ms, while nothing
completed). Neither uses
host-function callbacks or ``to_thread(event.synchronize)`` per event.

Importing this module does not import torch; the stream and event logic
(:class:`EventStream`, :func:`poll_completions`) only needs objects with ``query()`` and
``synchronize()``, so it is tested on the CPU with fake events. The backend itself has
run on a GPU once, and its contract suite is not yet seen passing there (docs/backends.md):
treat it as untested on real hardware.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio

from kvoffload.abc import Completion, EventBackend, Transfer
from kvoffload.backends._threaded import (
    CompletionInbox,
    CopyHooks,
    StreamWorker,
    ThreadedBackend,
    plan_runs,
)
from kvoffload.errors import BackendError, ConfigError
from kvoffload.pools import EnginePages as EnginePagesType

if TYPE_CHECKING:
    from kvoffload.pools import DevicePool, EnginePages, HostPool

__all__ = ["CudaBackend"]

_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3
_DIRECT_RUNS_MAX = 4  # up to this many runs of consecutive device pages: copy each directly


class CompletionEvent(Protocol):
    """What the stream logic needs of an event (``torch.cuda.Event``, or a test fake)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class InFlight:
    """One submission on a stream: its transfer, its event, and the temporaries its copy
    uses (kept alive until the event completed)."""

    __slots__ = ("event", "keep", "transfer")

    def __init__(self, transfer: Transfer, event: CompletionEvent, keep: Sequence[Any] = ()) -> None:
        self.transfer = transfer
        self.event = event
        self.keep: Sequence[Any] = keep


class EventStream(StreamWorker[InFlight]):
    """Per-stream completion: the waiter thread (or, in poll mode, the loop) turns events
    into completions, oldest first; ``recycle(event)`` is called once per event after its
    completion was consumed, never before."""

    def __init__(
        self,
        name: str,
        inbox: CompletionInbox,
        hooks: CopyHooks,
        recycle: Callable[[CompletionEvent], None],
        stream: Any = None,
        threaded: bool = True,
        device: Any = None,
    ) -> None:
        super().__init__(name, inbox)
        self._hooks = hooks
        self._recycle = recycle
        self.stream = stream  # the side stream (torch.cuda.Stream), None in tests
        # device: the GPU (torch.device) the waiter thread selects before it waits on
        # an event; None: select none (tests with fake events).
        self.device = device
        # threaded: a waiter thread runs finish(); in poll mode only done_nowait() runs,
        # so hooks.before (which may block) is not applied there.
        self._threaded = threaded

    def transfer_of(self, item: InFlight) -> Transfer:
        return item.transfer

    def run(self) -> None:
        """The waiter thread: select the stream's GPU first (a new thread's current
        device is GPU 0: waiting there would create a context on GPU 0 in every TP
        rank's process), then finish the queue in order."""
        if self.device is not None:
            import torch

            torch.cuda.set_device(self.device)
        super().run()

    def _consumed(self, item: InFlight) -> Completion:
        self._recycle(item.event)
        item.keep = ()
        if self._hooks.after is not None:
            self._hooks.after(item.transfer)
        return (item.transfer.id, None)

    def finish(self, item: InFlight) -> Completion:
        """Block this thread until ``item``'s copy completed (query fast path first)."""
        error = self._hooks.before(item.transfer) if self._hooks.before is not None else None
        ev = item.event
        if not ev.query():
            ev.synchronize()  # blocking-sync event: the thread sleeps, the GIL is released
        if error is not None:  # the bytes have landed; report the injected failure
            self._recycle(ev)
            item.keep = ()
            return (item.transfer.id, error)
        return self._consumed(item)

    def done_nowait(self, item: InFlight) -> Completion | None:
        if (self._threaded and self._hooks.before is not None) or not item.event.query():
            return None  # with a before-hook every item goes through finish()
        return self._consumed(item)


async def poll_completions(streams: Sequence[EventStream], inbox: CompletionInbox) -> list[Completion]:
    """The polling fallback, run by the delivery task: query every stream's heads; sleep
    with backoff (20 µs doubling to 1 ms) while none completed; return a batch (>= 1)."""
    delay = _POLL_MIN_S
    while True:
        for s in streams:
            batch = s.take_done()
            if batch:
                inbox.post(batch)
        batch = inbox.take_nowait()
        if batch:
            return batch
        await anyio.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


def order_after(side: Any, ready: Any) -> None:
    """Make ``side`` (a stream) wait for ``ready``: an event (``wait_event``) or a stream
    (``wait_stream``). Duck-typed, so the ordering logic is tested on the CPU with fakes."""
    if ready is None:
        return
    if hasattr(ready, "record") and hasattr(ready, "query") and not hasattr(ready, "wait_stream"):
        side.wait_event(ready)
    elif hasattr(ready, "wait_stream") or hasattr(ready, "record_event"):
        side.wait_stream(ready)
    else:
        raise BackendError(
            f"ready={ready!r} is neither a torch.cuda.Event nor a torch.cuda.Stream; pass what the "
            "copy must wait for (the event recorded after the forward pass, or its stream)"
        )


def queue_copy(device: DevicePool | EnginePages, host: HostPool, transfer: Transfer, dev: Any) -> list[Any]:
    """Queue ``transfer``'s device->host copy on the current stream; return the
    temporaries that must live until it completed.

    Owned mode: one copy per run of consecutive pages (up to a few), else one gather on
    the device, then one copy per run of host pages. Engine-owned mode: the pages of
    every KV tensor are gathered on the device into one staging buffer laid out as host
    pages (each tensor's rows at its offset), then copied with one contiguous copy per
    run of host pages - a strided copy into pinned memory would not be asynchronous.
    Works on CPU tensors too (``dev`` a CPU device), which is how it is tested here.
    """
    import torch

    runs = plan_runs(transfer.device_pages, transfer.host_pages)
    cuda = getattr(dev, "type", "cpu") == "cuda"

    def on_device(idx: Any) -> Any:
        return idx.pin_memory().to(dev, non_blocking=True) if cuda else idx

    if isinstance(device, EnginePagesType):
        order = [p for r in runs for p in r.device]
        idx = on_device(torch.tensor(order, dtype=torch.long))
        stage = torch.empty((len(order), device.page_bytes), dtype=torch.uint8, device=dev)
        for t, off, nb in zip(device.tensors, device.offsets, device.nbytes, strict=True):
            stage[:, off : off + nb].copy_(t.view(device.n_pages, -1).view(torch.uint8).index_select(0, idx))
        dst = host.tensor.view(host.n_pages, -1).view(torch.uint8)
        k = 0
        for r in runs:
            dst[r.host_start : r.host_start + r.count].copy_(stage[k : k + r.count], non_blocking=cuda)
            k += r.count
        return [idx, stage]
    src, dst = device.tensor, host.tensor
    if len(runs) <= _DIRECT_RUNS_MAX and all(r.device_start is not None for r in runs):
        for r in runs:
            assert r.device_start is not None
            dst[r.host_start : r.host_start + r.count].copy_(
                src[r.device_start : r.device_start + r.count], non_blocking=cuda
            )
        return []
    order = [p for r in runs for p in r.device]
    idx = on_device(torch.tensor(order, dtype=torch.long))
    gathered = src.index_select(0, idx)
    off = 0
    for r in runs:
        dst[r.host_start : r.host_start + r.count].copy_(gathered[off : off + r.count], non_blocking=cuda)
        off += r.count
    return [idx, gathered]


def queue_copy_h2d(
    device: DevicePool | EnginePages, host: HostPool, transfer: Transfer, dev: Any
) -> list[Any]:
    """Queue a load's host->device copy (``direction="h2d"``) on the current stream;
    return the temporaries that must live until it completed.

    :func:`queue_copy` backwards. Owned mode: one copy per run when the device pages of
    every run are consecutive (up to a few runs), else the host runs are copied into one
    device staging buffer (contiguous copies out of pinned memory: truly asynchronous)
    and scattered into the device pages by one ``index_copy_``. Engine-owned mode: the
    host runs are staged on the device the same way, laid out as host pages, and each
    KV tensor takes its rows (its offset in a host page) by one ``index_copy_``. Works
    on CPU tensors too (``dev`` a CPU device), which is how it is tested here.
    """
    import torch

    runs = plan_runs(transfer.device_pages, transfer.host_pages)
    cuda = getattr(dev, "type", "cpu") == "cuda"

    def on_device(idx: Any) -> Any:
        return idx.pin_memory().to(dev, non_blocking=True) if cuda else idx

    def staged(rows: Any, width: Sequence[int]) -> Any:
        stage = torch.empty((sum(r.count for r in runs), *width), dtype=rows.dtype, device=dev)
        k = 0
        for r in runs:
            stage[k : k + r.count].copy_(rows[r.host_start : r.host_start + r.count], non_blocking=cuda)
            k += r.count
        return stage

    order = [p for r in runs for p in r.device]
    if isinstance(device, EnginePagesType):
        src = host.tensor.view(host.n_pages, -1).view(torch.uint8)
        stage = staged(src, (device.page_bytes,))
        idx = on_device(torch.tensor(order, dtype=torch.long))
        for t, off, nb in zip(device.tensors, device.offsets, device.nbytes, strict=True):
            t.view(device.n_pages, -1).view(torch.uint8).index_copy_(0, idx, stage[:, off : off + nb])
        return [idx, stage]
    dst, src = device.tensor, host.tensor
    if len(runs) <= _DIRECT_RUNS_MAX and all(r.device_start is not None for r in runs):
        for r in runs:
            assert r.device_start is not None
            dst[r.device_start : r.device_start + r.count].copy_(
                src[r.host_start : r.host_start + r.count], non_blocking=cuda
            )
        return []
    stage = staged(src, tuple(src.shape[1:]))
    idx = on_device(torch.tensor(order, dtype=torch.long))
    dst.index_copy_(0, idx, stage)
    return [idx, stage]


class _EventPool:
    """Blocking-sync CUDA events; one is handed out per submission (loop thread) and
    returned by the stream after its completion was consumed (any thread)."""

    def __init__(self, make: Callable[[], CompletionEvent]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._free: list[CompletionEvent] = []

    def get(self) -> CompletionEvent:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._make()

    def put(self, event: CompletionEvent) -> None:
        with self._lock:
            self._free.append(event)


class CudaBackend(ThreadedBackend[InFlight]):
    """Device pool on the GPU, host pool pinned; ``streams`` side streams (default 1).

    ``CudaBackend(streams=1, device=None, completion="waiter" | "poll")``. Raises
    :class:`~kvoffload.BackendError` at construction when no CUDA GPU is available.
    """

    name = "cuda"
    device_type = "cuda"
    pins_host = True

    def __init__(
        self,
        streams: int = 1,
        device: int | str | None = None,
        completion: Literal["waiter", "poll"] = "waiter",
    ) -> None:
        super().__init__(streams)
        import torch

        if not torch.cuda.is_available():
            raise BackendError(
                "backend 'cuda' needs a CUDA GPU, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
                "use backend='cpu' (or 'auto', which picks cpu without a GPU)"
            )
        if completion not in ("waiter", "poll"):
            raise ConfigError(f"completion must be 'waiter' or 'poll', got {completion!r}")
        self._torch = torch
        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ConfigError(f"device must be a CUDA device (an index, 'cuda' or 'cuda:N'), got {device!r}")
        # Invariant: self.device.index is not None (the pools and streams name one GPU).
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.completion = completion
        self._run_threads = completion == "waiter"
        self._events = _EventPool(lambda: torch.cuda.Event(blocking=True))  # type: ignore[no-untyped-call]

    @property
    def device_name(self) -> str:
        return str(self.device)

    def _make_worker(self, index: int) -> EventStream:
        stream = self._torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        name = f"kvoffload.cuda-wait-{index}"
        return EventStream(
            name, self.inbox, self.hooks, self._events.put, stream, self._run_threads, device=self.device
        )

    def _accept(self, transfer: Transfer) -> None:
        """With no ``ready`` from the engine, the copy waits for what the stream current
        at this call (``extend``) had queued: an event recorded on it now (F17)."""
        ready = transfer.ready
        if ready is None:
            ev = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._torch.cuda.current_stream(self.device))
            transfer.ready = ev
        elif not (hasattr(ready, "query") or hasattr(ready, "wait_stream")):
            raise BackendError(f"{transfer!r}: ready={ready!r} is neither a torch.cuda.Event nor a Stream")

    def _start(self, transfer: Transfer, worker: StreamWorker[InFlight]) -> InFlight:
        """Queue ``transfer``'s copy on the side stream after what it must wait for."""
        torch = self._torch
        assert isinstance(worker, EventStream) and self._device is not None and self._host is not None
        side = worker.stream
        try:
            order_after(side, transfer.ready)  # F17, F26
            with torch.cuda.stream(side):
                copy = queue_copy_h2d if transfer.direction == "h2d" else queue_copy
                keep = copy(self._device, self._host, transfer, self.device)
                event = self._events.get()
                event.record(side)  # type: ignore[attr-defined]
        except Exception as e:
            # Part of the copy may be queued: let it end before the caller frees the host
            # pages (an error path; the driver waits here only when a launch failed).
            with contextlib.suppress(Exception):
                side.synchronize()
            raise BackendError(f"{transfer!r}: could not start the copy: {e!r}") from e
        return InFlight(transfer, event, keep)

    @property
    def needs_polling(self) -> bool:  # type: ignore[override]
        return self.completion == "poll"

    def take_completions(self, max_completions: int | None = None) -> list[Completion]:
        if self.completion == "poll":
            self.take_ready_nowait()
        return super().take_completions(max_completions)

    def take_ready_nowait(self) -> bool:
        """Poll mode: query every stream's heads and post what completed."""
        if self.completion == "poll":
            for s in self._streams():
                batch = s.take_done()
                if batch:
                    self.inbox.post(batch)
        return bool(self.inbox.ready)

    def wait_ready(self, timeout: float | None) -> bool:
        if self.completion == "poll":
            return EventBackend.wait_ready(self, timeout)  # sleep-poll: no thread posts here
        return super().wait_ready(timeout)

    async def wait_completions(self) -> list[Completion]:
        """For callers without a driver (tests, benchmarks, tools). Waiter mode waits as
        every threaded backend does, with a waker of its own set for the wait: the inbox
        alone is woken only through a waker, which no driver set here (the first GPU
        run hung on that)."""
        if self.completion == "poll":
            return await poll_completions(self._streams(), self.inbox)
        return await super().wait_completions()

    def _streams(self) -> list[EventStream]:
        return [w for w in self._workers if isinstance(w, EventStream)]

    def join(self, timeout: float | None = None) -> bool:
        """Waiter mode: the threads drain and exit. Poll mode: poll until every stream is
        empty, at most ``timeout`` seconds. Returns whether no copy runs."""
        if self.completion == "poll":
            import time

            deadline = None if timeout is None else time.monotonic() + timeout
            streams = self._streams()
            while any(s.queued for s in streams):
                self.take_ready_nowait()
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                time.sleep(_POLL_MAX_S)
            return True
        return super().join(timeout)
