"""Write-behind: a copied chunk's host pages go to the storage tier under their keys.

A mover: it does the I/O and nothing else. The core queues a :class:`~kvoffload.abc.WriteJob`
when a chunk's copy completed; a writer writes the jobs one at a time, in the order the
copies completed, so the pages of one request reach the store in chain order and
``exists_prefix`` stays a prefix for every reader; it reports each job back (stored or
failed, after how many attempts) and the core returns the host pages and counts the
outcome (FAILURES F15). A lifecycle never waits on this (it may be RELEASED long before).

Two writers share :func:`write_job`: :class:`AsyncWriter`, a task on the asyncio
driver's loop, and :class:`ThreadWriter`, a thread with an event loop of its own for
the sync driver (whose ``poll()`` only starts writes and collects what finished).

Failure policy (:class:`WritePolicy`): a chunk is tried up to ``attempts`` times with
exponential backoff; then its pages are counted as failed and its host pages returned.
Per page (FAILURES F34): when the store stored part of a batch
(:class:`~kvoffload.PartialWriteError`), a retry re-sends only the pages it did not
confirm, and what is still unconfirmed after the attempts is reported page by page, so
the core counts as stored exactly the pages the store confirmed. After a chunk has
failed, the store is taken as down: the next chunks get one try each (no retries, no
backoff) until one succeeds, so a dead store costs one failed call per chunk and never
stalls the queue. The core logs failures once per *burst*: a ``storage.failed`` warning
when the first chunk fails, a reminder at most every ``log_interval_s`` while it lasts,
and ``storage.recovered`` with the burst's totals at the first success.

No holes (FAILURES F33): a page is reachable only when every page before it in its
chain is stored, so once a chunk of a request was not stored, the later chunks of that
request are not written either (:class:`~kvoffload.abc.WriteChain`): they are reported
not stored after 0 attempts, their host pages return, and the core counts them as
``pages_store_skipped`` and stops offloading the request at the hole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from kvoffload.errors import ConfigError, KVOffloadError, PartialWriteError, StorageError

if TYPE_CHECKING:
    from kvoffload.abc import Storage, WriteJob
    from kvoffload.pools import HostPool

__all__ = [
    "AsyncWriter",
    "ThreadWriter",
    "WritePolicy",
    "WriteResult",
    "page_bytes",
    "stored_prefix",
    "write_job",
]

_T = TypeVar("_T")

#: Why a job was not written: its chain broke before it (FAILURES F33).
_SKIPPED = (
    "not written: an earlier chunk of this request's chain was not stored, so no lookup could "
    "reach these pages (F33)"
)

#: Chunks larger than this are read out of the host pool on a worker thread.
_THREAD_COPY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class WritePolicy:
    """How the storage writer retries and logs (``OffloadManager(write_policy=...)``)."""

    attempts: int = 3
    """Tries per chunk while the store is healthy (1: never retry)."""
    backoff_s: float = 0.05
    """Sleep before the first retry; doubled before each next one."""
    backoff_max_s: float = 1.0
    """Upper bound of one backoff sleep."""
    log_interval_s: float = 30.0
    """While failures go on, at most one ``storage.failed`` reminder per this many
    seconds of the manager's clock."""

    def __post_init__(self) -> None:
        if type(self.attempts) is not int or self.attempts < 1:
            raise ConfigError(f"attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("backoff_s", "backoff_max_s", "log_interval_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")

    def backoff(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (0-based)."""
        return float(min(self.backoff_s * (2**retry), self.backoff_max_s))


#: A finished job: (job, stored, attempts, error or None).
WriteResult = tuple["WriteJob", bool, int, "BaseException | None"]


def stored_prefix(result: WriteResult) -> int:
    """How many leading pages of a finished job its store confirmed (F34): all of them
    when stored, else the leading True flags of its :class:`~kvoffload.PartialWriteError`
    (none for any other error, or flags that do not match the job)."""
    job, stored, _, error = result
    n = len(job.host_pages)
    if stored:
        return n
    flags = error.stored if isinstance(error, PartialWriteError) else ()
    if len(flags) != n:
        return 0
    return flags.index(False) if False in flags else n


class WriterState:
    """What a writer remembers between jobs: whether the store is taken as down."""

    __slots__ = ("down",)

    def __init__(self) -> None:
        # down: the last job failed after its attempts; the next ones get one try each.
        self.down = False


def page_bytes(pool: HostPool, host_pages: list[int]) -> list[bytes]:
    """The raw bytes of each host page (a copy: the pages return to the pool after).

    A pool is page-major, so each page is one contiguous block: one memcpy per page.
    """
    import torch

    t = pool.tensor
    if t.is_contiguous() and t.device.type == "cpu":
        rows = t.view(t.shape[0], -1).view(torch.uint8).numpy()
        return [rows[p].tobytes() for p in host_pages]
    picked = t[torch.tensor(host_pages, dtype=torch.long)].cpu().contiguous()
    flat = picked.view(torch.uint8).reshape(len(host_pages), -1).numpy()
    return [flat[i].tobytes() for i in range(len(host_pages))]


def _cancelling() -> bool:
    """Whether the running task was asked to cancel (``Task.cancel()``, an anyio cancel
    scope): then a ``CancelledError`` is the caller's. A store that raises one of its
    own (a client's cancelled future) while nobody cancelled the task fails the write."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def write_job(
    storage: Storage,
    pool: HostPool,
    job: WriteJob,
    policy: WritePolicy,
    state: WriterState,
    *,
    threaded_read: bool = True,
) -> WriteResult:
    """Write ``job``'s pages under its keys with bounded retries (fewer while the store
    is down). Never raises a storage failure - any exception the store raises,
    ``BaseException`` subclasses such as its own ``asyncio.CancelledError`` included, is
    the result (STYLE 13); only ``KeyboardInterrupt``, ``SystemExit`` and a cancellation
    of the writer's own task propagate.

    Per-page truth (F34): a store that stored part of a batch says which pages
    (:class:`~kvoffload.PartialWriteError`); a retry re-sends only the pages not yet
    confirmed, and ``job.resent`` counts the pages re-sent. The job is stored
    (``(job, True, attempts, None)``) once every page was confirmed; else it is
    ``(job, False, attempts, error)``, where ``error`` is a PartialWriteError with one
    flag per page of the job (what the store confirmed over all attempts) when any page
    was confirmed, and the last error otherwise (no page confirmed). A
    PartialWriteError whose flags do not match the pages sent confirms none.

    No holes (F33): a job whose chain broke (an earlier job of its request was not
    stored) is not written - ``(job, False, 0, StorageError)`` - and a job with a page
    not stored breaks its chain, so nothing of that request is stored after a page
    the store lacks (a page confirmed after it is in the store, but unreachable).

    The store reads the pages from the host pool (``Storage.put_pages``): they are held
    until the core hears the result, so they are stable for every attempt; how it reads
    them is the store's business (``threaded_read`` is ignored)."""
    chain = job.chain
    job.resent = 0
    if chain is not None and chain.broken:  # an earlier page of its chain is not stored (F33)
        return (job, False, 0, StorageError(_SKIPPED))
    attempts = 1 if state.down else policy.attempts
    error: BaseException | None = None
    keys, pages = job.keys, job.host_pages
    # confirmed[i]: the store confirmed page i (in any attempt); todo: the pages not yet.
    # Invariant: todo == [i for i in range(len(keys)) if not confirmed[i]]
    confirmed = [False] * len(keys)
    todo = list(range(len(keys)))
    reasons: dict[int, str] = {}
    resent = 0
    for attempt in range(attempts):
        if attempt:
            await anyio.sleep(policy.backoff(attempt - 1))
            job.resent = resent = resent + len(todo)
        whole = len(todo) == len(keys)
        try:
            if whole:
                await storage.put_pages(keys, pool, pages)
            else:
                await storage.put_pages([keys[i] for i in todo], pool, [pages[i] for i in todo])
        except (KeyboardInterrupt, SystemExit):
            raise
        except PartialWriteError as exc:  # part of the batch stored: one flag per page sent
            error = exc
            if len(exc.stored) != len(todo):  # a store's bug: it confirms nothing
                error = StorageError(
                    f"{storage.name} storage answered {len(exc.stored)} per-page flag(s) for a batch "
                    f"of {len(todo)}: no page of it counts as confirmed ({exc})"
                )
                for i in todo:
                    reasons[i] = str(error)
            else:
                for i, ok, why in zip(todo, exc.stored, exc.errors, strict=True):
                    if ok:
                        confirmed[i] = True
                    else:
                        reasons[i] = why or str(exc)
                todo = [i for i in todo if not confirmed[i]]
                if not todo:
                    break
            continue
        except BaseException as exc:  # a store may raise anything; it is this chunk's failure
            if isinstance(exc, asyncio.CancelledError) and _cancelling():
                raise  # the writer itself is cancelled (the manager is closing), not the store
            error = exc
            for i in todo:
                reasons[i] = repr(exc)
            continue
        todo = []
        break
    if not todo:
        state.down = False
        return (job, True, attempt + 1, None)
    state.down = True
    if chain is not None:
        chain.broken = True  # the later jobs of this request are not written after the hole
    if any(confirmed):
        error = PartialWriteError(
            f"{len(todo)} of {len(keys)} page(s) not confirmed by the store after {attempts} "
            f"attempt(s): {error!r}",
            confirmed,
            [None if ok else reasons.get(i, repr(error)) for i, ok in enumerate(confirmed)],
        )
    return (job, False, attempts, error)


class AsyncWriter:
    """The asyncio driver's writer: one task on the driver's loop writes the jobs in
    order and hands each result to ``done`` (on the loop thread)."""

    def __init__(
        self,
        storage: Storage,
        pool: HostPool,
        policy: WritePolicy,
        done: Callable[[WriteResult], None],
    ) -> None:
        self.storage = storage
        self._pool = pool
        self._policy = policy
        self._done = done
        self._state = WriterState()
        # _queue: jobs handed over and not yet written, in order.
        self._queue: deque[WriteJob] = deque()
        self._ev: anyio.Event | None = None

    def put(self, jobs: list[WriteJob]) -> None:
        """Queue ``jobs`` (loop thread)."""
        self._queue.extend(jobs)
        ev = self._ev
        if ev is not None:
            self._ev = None
            ev.set()

    async def run(self) -> None:
        """The writer task: write queued jobs in order, for ever (until cancelled)."""
        q = self._queue
        while True:
            if not q:
                self._ev = anyio.Event()
                await self._ev.wait()
                continue
            result = await write_job(self.storage, self._pool, q[0], self._policy, self._state)
            q.popleft()
            self._done(result)
            del result  # hold no job while waiting for the next


class ThreadWriter(threading.Thread):
    """The sync driver's writer: a thread running an event loop of its own. ``put``
    hands jobs over and ``take_results`` collects what finished, both without blocking
    (owner thread); ``call`` runs a storage coroutine (``lookup``, ``fetch``) there and
    waits for it, ``submit`` runs one there without waiting (a load's read). The store's
    connections belong to this thread's loop."""

    def __init__(self, storage: Storage, pool: HostPool, policy: WritePolicy) -> None:
        super().__init__(name="kvoffload.storage-writer", daemon=True)
        self.storage = storage
        self._pool = pool
        self._policy = policy
        self._state = WriterState()
        self._lock = threading.Lock()
        # _results: finished jobs not yet taken (guarded by _lock).
        self._results: deque[WriteResult] = deque()
        # _inflight: jobs handed over and not yet finished (guarded by _lock).
        self._inflight = 0
        self._progress = threading.Condition(self._lock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_ready = threading.Event()  # not Thread._started: that one is Thread's own
        self._queue: asyncio.Queue[WriteJob | None] | None = None
        self._halted = False

    def start(self) -> None:
        super().start()
        self._loop_ready.wait()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._loop_ready.set()
        try:
            while True:
                job = await self._queue.get()
                if job is None:
                    return
                try:
                    result = await write_job(self.storage, self._pool, job, self._policy, self._state)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # never the writer: this write fails, the thread goes on
                    result = (job, False, 1, exc)
                with self._lock:
                    self._results.append(result)
                    self._inflight -= 1
                    self._progress.notify_all()
                del job, result
        finally:
            with contextlib.suppress(Exception):  # a store that fails to close: nothing is left to lose
                await self.storage.aclose()

    def put(self, jobs: list[WriteJob]) -> None:
        """Hand ``jobs`` to the thread (owner thread; never blocks)."""
        loop, queue = self._loop, self._queue
        if self._halted or loop is None or queue is None:
            raise KVOffloadError("the storage writer is stopped")
        with self._lock:
            self._inflight += len(jobs)
        for job in jobs:
            loop.call_soon_threadsafe(queue.put_nowait, job)

    @property
    def pending(self) -> int:
        """Jobs handed over and not yet finished."""
        return self._inflight

    @property
    def has_results(self) -> bool:
        """Whether a finished job waits to be taken."""
        return bool(self._results)

    def take_results(self) -> list[WriteResult]:
        """Every finished job not yet taken, in order (never blocks)."""
        if not self._results:
            return []
        with self._lock:
            out = list(self._results)
            self._results.clear()
        return out

    def wait_progress(self, timeout: float | None) -> bool:
        """Block until a result is ready (or ``timeout``); whether one is."""
        with self._progress:
            if not self._results:
                self._progress.wait(timeout)
            return bool(self._results)

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run ``coro`` on this thread's loop and wait for its result."""
        loop = self._loop
        if self._halted or loop is None:
            coro.close()
            raise KVOffloadError("the storage writer is stopped")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Run ``coro`` on this thread's loop (a load's store read); return its future at
        once, never blocking (owner thread). Raises :class:`~kvoffload.KVOffloadError`
        once stopped (``coro`` closed, never run)."""
        loop = self._loop
        if self._halted or loop is None:
            coro.close()
            raise KVOffloadError("the storage writer is stopped")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def stop(self) -> None:
        """Write what was handed over, then close the store and end the thread."""
        loop, queue = self._loop, self._queue
        if self._halted or loop is None or queue is None:
            return
        self._halted = True
        with contextlib.suppress(RuntimeError):  # the loop already ended
            loop.call_soon_threadsafe(queue.put_nowait, None)
