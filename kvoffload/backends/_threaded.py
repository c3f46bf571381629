"""What the cpu and cuda backends share: copy plans, stream threads, the loop inbox.

Both backends do their blocking work (a torch copy; waiting on a CUDA event) on one
thread per copy stream and hand completions back to the event loop the same way:

- :class:`CompletionInbox` - worker threads ``post()`` completions under a lock; a
  waiting driver is woken with **one** waker call per wake-up (only when no wake-up is
  outstanding), and takes everything posted so far as one batch without blocking.
- :class:`StreamWorker` - a thread with a FIFO of in-flight items. It finishes the head
  (blocking, off the loop), then takes every following item that is already done
  without blocking, and posts them as one batch: per-stream order is submission order.
  ``close()`` lets it drain what was queued; ``join`` returns once no copy runs.
- :func:`plan_runs` - a transfer's (device page, host page) pairs grouped into runs
  of consecutive host pages, so a copy is a few large block copies, not one per page.

CPU copies off the main thread start no OpenMP team (:func:`copy_pages`,
:func:`copy_pages_h2d`): a torch CPU op large enough to run in parallel, called on a
thread other than the one running the model, starts a second OpenMP team of torch's
intra-op threads; with more OpenMP threads than cores, libgomp then throttles every
team's spin-wait, the model's too. In a vLLM CPU engine on 2 cores that made every
decode step about 1.3x slower for as long as the process lived (the same slowdown as
``GOMP_SPINCOUNT=1000`` on an engine without any connector), although the copies
themselves took under 1% of the time. So those copies are numpy's single-threaded
``copyto`` (which releases the GIL); on the main thread, and for CUDA tensors, they
stay torch's.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio

from kvoffload.abc import Completion, Transfer
from kvoffload.backends._base import BackendBase
from kvoffload.errors import BackendError, ConfigError

if TYPE_CHECKING:
    from kvoffload.pools import DevicePool, EnginePages, HostPool

__all__ = [
    "CompletionInbox",
    "CopyHooks",
    "Run",
    "StreamWorker",
    "ThreadedBackend",
    "copy_pages",
    "copy_pages_h2d",
    "copy_transfer_pages",
    "plan_runs",
]


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive host pages from ``host_start`` take device pages ``device``
    (in that order). ``device_start`` is set when those device pages are consecutive
    too (one block copy); else the copy gathers ``device``."""

    host_start: int
    count: int
    device: tuple[int, ...]
    device_start: int | None


def plan_runs(device_pages: Sequence[int], host_pages: Sequence[int]) -> list[Run]:
    """Group a transfer's page pairs by runs of consecutive host pages (ascending).

    Page-major pools make a run of pages one contiguous block, so each run is one
    block copy (or one gather into a block). Pairs are reordered by host page, which
    changes nothing about which bytes land where.
    """
    pairs = sorted(zip(host_pages, device_pages, strict=True))
    runs: list[Run] = []
    i = 0
    n = len(pairs)
    while i < n:
        j = i + 1
        while j < n and pairs[j][0] == pairs[j - 1][0] + 1:
            j += 1
        dev = tuple(p[1] for p in pairs[i:j])
        consecutive = all(dev[k] == dev[0] + k for k in range(len(dev)))
        runs.append(Run(pairs[i][0], j - i, dev, dev[0] if consecutive else None))
        i = j
    return runs


def copy_pages(
    pairs: Sequence[tuple[Any, Any]], device_pages: Sequence[int], host_pages: Sequence[int]
) -> None:
    """Copy device pages to host pages (blocking; any thread). ``pairs`` are the
    device side's ``copy_pairs(host)``: (source, destination) tensors whose row ``p`` is
    one page; one block copy per run of consecutive pages, a gather where the device
    pages of a run are scattered."""
    import torch

    runs = plan_runs(device_pages, host_pages)
    if _single_threaded(pairs):
        for src, dst in pairs:
            _copy_runs(_array(src), _array(dst), runs, h2d=False)
        return
    index = [None if r.device_start is not None else torch.tensor(r.device, dtype=torch.long) for r in runs]
    for src, dst in pairs:
        for run, idx in zip(runs, index, strict=True):
            out = dst[run.host_start : run.host_start + run.count]
            if idx is None:
                assert run.device_start is not None
                out.copy_(src[run.device_start : run.device_start + run.count])
            elif out.is_contiguous():
                torch.index_select(src, 0, idx, out=out)
            else:  # an engine tensor's slice of a host page: gather, then one strided copy
                out.copy_(src.index_select(0, idx))


def copy_pages_h2d(
    pairs: Sequence[tuple[Any, Any]], device_pages: Sequence[int], host_pages: Sequence[int]
) -> None:
    """Copy host pages into device pages (blocking; any thread): :func:`copy_pages`
    backwards, over the same ``pairs`` (device row ``p`` is written from host row ``h``).
    One block copy per run of consecutive pages on both sides, a scatter
    (``index_copy_``) where the device pages of a run are not consecutive."""
    import torch

    runs = plan_runs(device_pages, host_pages)
    if _single_threaded(pairs):
        for dev, host in pairs:
            _copy_runs(_array(dev), _array(host), runs, h2d=True)
        return
    index = [None if r.device_start is not None else torch.tensor(r.device, dtype=torch.long) for r in runs]
    for dev, host in pairs:
        for run, idx in zip(runs, index, strict=True):
            src = host[run.host_start : run.host_start + run.count]
            if idx is None:
                assert run.device_start is not None
                dev[run.device_start : run.device_start + run.count].copy_(src)
            else:
                dev.index_copy_(0, idx, src.contiguous())


#: Item sizes the single-threaded copy takes: a tensor of any dtype is copied as raw integers.
_ITEM = (1, 2, 4, 8)


def _single_threaded(pairs: Sequence[tuple[Any, Any]]) -> bool:
    """Whether a copy over ``pairs`` must start no OpenMP team (see the module doc): on
    a thread other than the main one, between CPU tensors of one dtype per pair whose
    items numpy can copy as integers of their size (:data:`_ITEM`)."""
    if threading.current_thread() is threading.main_thread():
        return False
    return all(
        a.device.type == "cpu" and b.device.type == "cpu" and a.dtype == b.dtype and a.element_size() in _ITEM
        for a, b in pairs
    )


def _array(t: Any) -> Any:
    """``t``'s memory as a numpy array of its shape and strides (no copy), its items
    read as integers of their size (numpy has no bfloat16)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(ints).numpy()


def _copy_runs(device: Any, host: Any, runs: Sequence[Run], *, h2d: bool) -> None:
    """Copy each run between numpy views of one device tensor and its host tensor (rows
    are pages): one ``copyto`` per run of consecutive pages on both sides, one per page
    where the device pages of a run are scattered. Single-threaded; releases the GIL."""
    import numpy as np

    for run in runs:
        h = run.host_start
        if run.device_start is not None:
            d = run.device_start
            if h2d:
                np.copyto(device[d : d + run.count], host[h : h + run.count])
            else:
                np.copyto(host[h : h + run.count], device[d : d + run.count])
            continue
        for k, d in enumerate(run.device):
            if h2d:
                np.copyto(device[d], host[h + k])
            else:
                np.copyto(host[h + k], device[d])


def copy_transfer_pages(pairs: Sequence[tuple[Any, Any]], transfer: Transfer) -> None:
    """Copy ``transfer``'s pages the way its ``direction`` says (blocking; any thread):
    device -> host for ``"d2h"``, host -> device for ``"h2d"``."""
    if transfer.direction == "h2d":
        copy_pages_h2d(pairs, transfer.device_pages, transfer.host_pages)
    else:
        copy_pages(pairs, transfer.device_pages, transfer.host_pages)


@dataclass(slots=True)
class CopyHooks:
    """Test and benchmark hooks, called on the stream thread (never on the loop).

    ``before(t)`` runs before ``t``'s completion is decided (cpu: before its copy; cuda:
    before waiting for its event); it may block (tests hold a copy in flight with a
    ``threading.Event``) and may return an exception to fail ``t``. ``after(t)`` runs
    once ``t``'s bytes are on the host, before its completion is posted.
    """

    before: Callable[[Transfer], BaseException | None] | None = None
    after: Callable[[Transfer], None] | None = None


class CompletionInbox:
    """Completions handed from stream threads (or the sim backend) to the driver.

    ``post()`` from any thread; ``take_nowait()`` on the owner thread. A waiting driver
    is told with its waker, called **once** per wake-up (only when no wake-up is
    outstanding: the next ``take_nowait()`` that empties the inbox ends it); a blocking
    waiter (the sync driver's ``quiesce``) waits on the condition.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # _ready: posted, not yet taken; guarded by _lock (read without it only for emptiness).
        self._ready: deque[Completion] = deque()
        # _scheduled: the waker was called and the inbox was not emptied since (guarded by _lock).
        # Invariant: self._ready and self._waker and not self._scheduled -> the driver is
        # taking now or will find _ready non-empty before it waits (nothing is stranded).
        self._scheduled = False
        # _signalled: completions ever posted (monotonic); written under _lock.
        self._signalled = 0
        self._waker: Callable[[], Any] | None = None
        self._event: anyio.Event | None = None
        self.wakeups = 0  # waker calls (for benchmarks and tests)

    def set_waker(self, waker: Callable[[], Any] | None) -> None:
        """``waker()`` is called (any thread) when completions arrive and none is outstanding."""
        with self._lock:
            self._waker = waker
            self._scheduled = False
        if waker is not None and self._ready:
            self._poke()

    def bind(self) -> None:
        """Wake :meth:`wait` on the running asyncio loop (call on the loop thread)."""
        import asyncio

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise BackendError("CompletionInbox.bind() needs a running asyncio loop") from None
        self.set_waker(lambda: loop.call_soon_threadsafe(self._wake))

    @property
    def signalled(self) -> int:
        return self._signalled

    @property
    def ready(self) -> int:
        """Completions posted and not yet taken."""
        return len(self._ready)

    def post(self, batch: list[Completion]) -> None:
        """Hand ``batch`` over (any thread). Calls the waker at most once per wake-up."""
        with self._lock:
            self._ready.extend(batch)
            self._signalled += len(batch)
            self._cond.notify_all()
            if self._scheduled or self._waker is None:
                return
            self._scheduled = True
            self.wakeups += 1
            waker = self._waker
        self._call(waker)

    def _poke(self) -> None:
        with self._lock:
            if self._scheduled or self._waker is None:
                return
            self._scheduled = True
            self.wakeups += 1
            waker = self._waker
        self._call(waker)

    def _call(self, waker: Callable[[], Any]) -> None:
        try:
            waker()
        except RuntimeError:  # the loop is closed; nobody is left to wake
            with self._lock:
                self._scheduled = False

    def _wake(self) -> None:
        ev = self._event
        if ev is not None:
            self._event = None
            ev.set()

    def take_nowait(self, max_completions: int | None = None) -> list[Completion]:
        """Up to ``max_completions`` (all by default) of what was posted, oldest first."""
        if not self._ready:
            return []
        with self._lock:
            ready = self._ready
            if max_completions is None or max_completions >= len(ready):
                batch = list(ready)
                ready.clear()
            else:
                batch = [ready.popleft() for _ in range(max(0, max_completions))]
            if not ready:
                self._scheduled = False
        return batch

    def wait_ready(self, timeout: float | None) -> bool:
        """Block until something is posted or ``timeout`` passed; whether something is ready."""
        with self._cond:
            if not self._ready:
                self._cond.wait(timeout)
            return bool(self._ready)

    async def wait(self) -> list[Completion]:
        """Wait (asyncio) until at least one completion was posted; return all of them."""
        while True:
            batch = self.take_nowait()
            if batch:
                return batch
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()


_Item = TypeVar("_Item")


class StreamWorker(threading.Thread, Generic[_Item]):
    """One copy stream: a thread working through a FIFO of in-flight items in order.

    Subclasses give ``finish(item)`` (block until ``item`` is done; return its
    completion - called off the lock, on this thread) and may give ``done_nowait(item)``
    (its completion if already done without blocking, else ``None``). After finishing the
    head, the worker also takes every following item that is already done, and posts the
    whole batch with one :meth:`CompletionInbox.post`.
    """

    def __init__(self, name: str, inbox: CompletionInbox) -> None:
        super().__init__(name=name, daemon=True)
        self._inbox = inbox
        self._cv = threading.Condition()
        # _queue: submitted and not yet posted, in submission order (guarded by _cv).
        self._queue: deque[_Item] = deque()
        # _closing: no new item is accepted; the thread exits once _queue is empty.
        self._closing = False

    def put(self, item: _Item) -> None:
        """Queue ``item`` (loop thread). Raises :class:`BackendError` once closing."""
        with self._cv:
            if self._closing:
                raise BackendError(f"{self.name} is closed")
            self._queue.append(item)
            self._cv.notify()

    def close(self) -> None:
        """Accept nothing more; the thread exits once every queued item is posted."""
        with self._cv:
            self._closing = True
            self._cv.notify()

    @property
    def queued(self) -> int:
        """Items submitted and not yet posted."""
        return len(self._queue)

    def transfers(self) -> list[Transfer]:
        """The transfers of the items queued (any thread; a snapshot)."""
        with self._cv:
            return [self.transfer_of(i) for i in self._queue]

    def finish(self, item: _Item) -> Completion:
        raise NotImplementedError

    def transfer_of(self, item: _Item) -> Transfer:
        raise NotImplementedError

    def done_nowait(self, item: _Item) -> Completion | None:
        return None

    #: Most queued items one ``finish_batch`` call may take (1: no batching).
    batch_max = 1

    def batch_room(self, items: list[_Item], item: _Item) -> bool:
        """Whether ``item`` may join ``items`` in one ``finish_batch`` (under ``batch_max``)."""
        return True

    def finish_batch(self, items: list[_Item]) -> list[Completion]:
        """Finish ``items`` (the head and the items queued behind it), in order; one
        completion each. The default finishes them one by one."""
        out: list[Completion] = []
        for item in items:
            try:
                out.append(self.finish(item))
            except BaseException as e:  # a bug or an unexpected error: fail this transfer only
                out.append((self.transfer_of(item).id, e))
        return out

    def run(self) -> None:
        q, cv = self._queue, self._cv
        while True:
            with cv:
                while not q and not self._closing:
                    cv.wait()
                if not q:
                    return
                # The head and what queued behind it; they stay queued until posted.
                items = [q[0]]
                limit = min(len(q), self.batch_max)
                while len(items) < limit and self.batch_room(items, q[len(items)]):
                    items.append(q[len(items)])
            done = self.finish_batch(items)
            with cv:
                for _ in range(len(items)):  # (a loop variable would keep the last item)
                    q.popleft()
                batch = [*done, *self.take_done()]
            self._inbox.post(batch)
            # Hold nothing of the batch while idle: its transfers hold their issuer's tag,
            # the engine's request object (F2: garbage once released and dropped).
            del items, done, batch

    def take_done(self) -> list[Completion]:
        """Pop every item at the head that is done without blocking, in order (any thread;
        the poll mode of the cuda backend calls it from the loop instead of a thread)."""
        batch: list[Completion] = []
        q = self._queue
        with self._cv:
            while q:
                try:
                    c = self.done_nowait(q[0])
                except BaseException as e:  # e.g. a CUDA error on this event: this transfer fails
                    c = (self.transfer_of(q[0]).id, e)
                if c is None:
                    break
                q.popleft()
                batch.append(c)
        return batch


class ThreadedBackend(BackendBase, Generic[_Item]):
    """An event backend whose copies are tracked by one :class:`StreamWorker` per stream.

    Subclasses give ``_make_worker(i)`` and ``_start(transfer, worker)`` (start the copy,
    or only queue it, without blocking; return the item to queue). ``submit`` only
    checks and stages a transfer; ``launch`` starts what was staged (F19). Everything
    the driver sees - submit, launch, take, close, join - is here.
    """

    def __init__(self, streams: int = 1) -> None:
        if type(streams) is not int or streams < 1:
            raise ConfigError(f"streams must be a positive int, got {streams!r}")
        self._n_streams = streams
        self.inbox = CompletionInbox()
        self.hooks = CopyHooks()
        # _workers: one per stream, started by open(); kept after close for join().
        self._workers: list[StreamWorker[_Item]] = []
        # _staged: accepted, not yet launched, in submission order (owner thread only).
        self._staged: list[Transfer] = []
        self._device: DevicePool | EnginePages | None = None
        self._host: HostPool | None = None
        self._closed = False
        self.submitted = 0
        # Whether open() starts the stream threads (the cuda poll mode does not).
        self._run_threads = True

    @property
    def streams(self) -> int:
        return self._n_streams

    def _make_worker(self, index: int) -> StreamWorker[_Item]:
        raise NotImplementedError

    def _start(self, transfer: Transfer, worker: StreamWorker[_Item]) -> _Item:
        raise NotImplementedError

    def _accept(self, transfer: Transfer) -> None:
        """Backend-specific work at submit, on the owner thread (cuda: note the stream)."""

    def open(self, device: DevicePool | EnginePages, host: HostPool) -> None:
        """Bind the pools; start one thread per stream (owner thread)."""
        if self._workers or self._closed:
            raise BackendError(f"{self.name} backend opened twice")
        self._device, self._host = device, host
        self._workers = [self._make_worker(i) for i in range(self._n_streams)]
        if self._run_threads:
            for w in self._workers:
                w.start()

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        self.inbox.set_waker(waker)

    def submit(self, transfer: Transfer) -> None:
        """Accept ``transfer`` (no page is read until :meth:`launch`); return at once.

        Raises :class:`~kvoffload.BackendError` (nothing queued) when closed, not open,
        or when the transfer names pages or a stream this backend does not have.
        """
        if self._closed or not self._workers:
            raise BackendError(f"{self.name} backend is {'closed' if self._closed else 'not open'}")
        assert self._device is not None and self._host is not None
        if not transfer.owned:
            transfer.check_fits(self._device.n_pages, self._host.n_pages, self._n_streams)
        self._accept(transfer)
        self._staged.append(transfer)
        self.submitted += 1

    def launch(self) -> None:
        """Start every staged copy on its stream. A copy that cannot start fails alone."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        for t in staged:
            worker = self._workers[t.stream]
            try:
                worker.put(self._start(t, worker))
            except Exception as e:  # a launch refused (F20): this transfer fails, the rest go on
                self.inbox.post([(t.id, e if isinstance(e, BackendError) else BackendError(repr(e)))])

    def take_completions(self, max_completions: int | None = None) -> list[Completion]:
        return self.inbox.take_nowait(max_completions)

    @property
    def ready(self) -> int:
        return self.inbox.ready

    def wait_ready(self, timeout: float | None) -> bool:
        return self.inbox.wait_ready(timeout)

    @property
    def signalled(self) -> int:
        return self.inbox.signalled

    @property
    def inflight(self) -> int:
        """Transfers accepted whose completion was not yet posted."""
        return len(self._staged) + sum(w.queued for w in self._workers)

    def running(self) -> list[Transfer]:
        out = list(self._staged)
        for w in self._workers:
            out += w.transfers()
        return out

    def close(self) -> None:
        """Refuse new copies; launch what was staged; every stream finishes what it has
        and its thread exits. Never blocks."""
        if not self._closed:
            self.launch()
        self._closed = True
        for w in self._workers:
            w.close()

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds for every stream thread to exit (no copy runs)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self._workers:
            if w.is_alive():
                w.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(w.is_alive() for w in self._workers)
