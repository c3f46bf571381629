"""OffloadManager: the asyncio driver over the core.

Bookkeeping is the core's (every method here that changes state is a plain ``def``
that never awaits); this driver adds waiting. Completions are delivered by a loop
callback that the backend's waker schedules (one per wake-up, every ready completion
in one batch); copies are launched by a callback on the loop's next turn (F19);
storage writes run in one task, the timers in another. Both are plain asyncio tasks
that contain their own failures (F20): nothing a background step raises cancels the
caller's code, and the manager may be entered and left in different tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from _thread import get_ident
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import anyio

from kvoffload.abc import Completion, EventBackend, Storage
from kvoffload.config import OffloadConfig
from kvoffload.core.events import logger
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.loads import Load
from kvoffload.drivers._base import DriverBase, first_error, load_buffers
from kvoffload.errors import ConfigError, DrainTimeout, KVOffloadError, ManagerClosed

if TYPE_CHECKING:
    from kvoffload.storage.writer import AsyncWriter, WritePolicy, WriteResult

__all__ = ["OffloadManager"]

#: Seconds a close waits past its drain timeout for copy threads to end.
_JOIN_GRACE_S = 0.5


class OffloadManager(DriverBase):
    """Offloads the KV of admitted requests, chunk by chunk, while they decode (asyncio).

    ``async with OffloadManager(config, backend="auto", storage=None) as mgr:`` — the
    backend and storage are a name (``"auto"``: cuda with a GPU, else cpu; ``"sim"``,
    ``"cpu"``, ``"cuda"``, which raises :class:`~kvoffload.BackendError` without a GPU;
    ``"memory"``, a directory path, a ``redis://`` URL) or an instance. Leaving the
    context drains in-flight copies (F16), at most ``config.drain_timeout_s``, then
    raises :class:`~kvoffload.DrainTimeout` naming the wedged copies (F21); lifecycles
    still live are aborted. ``on_released(lc)`` is called once per lifecycle at
    RELEASED, on the loop's thread.

    All methods are called from the event loop's thread (else
    :class:`~kvoffload.WrongThread`, nothing changed).
    """

    _kind = "OffloadManager"

    def __init__(
        self,
        config: OffloadConfig,
        *,
        backend: str | EventBackend = "auto",
        storage: str | os.PathLike[str] | Storage | None = None,
        clock: Callable[[], float] = time.monotonic,
        write_policy: WritePolicy | None = None,
        on_released: Callable[[Lifecycle], object] | None = None,
        device_kv: Any = None,
        host_buffer: Any = None,
        group: Any = None,
    ) -> None:
        if group is not None:
            raise ConfigError(
                "the asyncio OffloadManager has no tensor parallelism (group=): use "
                "kvo.SyncOffloadManager(config, ..., group=<the TP process group>), whose poll() agrees "
                "with the other ranks"
            )
        if config.host_wait_polls is not None:
            raise ConfigError(
                f"config.host_wait_polls is {config.host_wait_polls}, but the asyncio OffloadManager "
                "has no poll() to count: bound the wait with host_wait_s, or use kvo.SyncOffloadManager"
            )
        tp = getattr(config, "tp_size", None)
        if tp is not None and tp > 1:
            raise ConfigError(
                f"config.tp_size is {tp}, but the asyncio OffloadManager has no tensor parallelism: "
                "use kvo.SyncOffloadManager(config, ..., group=<the TP process group>)"
            )
        super().__init__(
            config,
            backend=backend,
            storage=storage,
            clock=clock,
            write_policy=write_policy,
            on_released=on_released,
            device_kv=device_kv,
            host_buffer=host_buffer,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._launch_scheduled = False
        self._deliver_scheduled = False
        self._tasks: list[asyncio.Task[None]] = []
        self._writer: AsyncWriter | None = None
        # _delivered: completions delivered, ever; _writes_done: storage writes finished, ever.
        self._delivered = 0
        self._writes_done = 0
        self._writes_queued = 0
        self._progress_ev: anyio.Event | None = None
        # _joined: the backend's threads ended at close (False: buffers parked).
        self._joined = True
        # _reads: the store-read tasks of live loads (each reports to the core when it ends).
        self._reads: set[asyncio.Task[None]] = set()

    def _open_hint(self) -> str:
        return "use `async with OffloadManager(...)`"

    # --- context -----------------------------------------------------------------------

    async def __aenter__(self) -> OffloadManager:
        if self._open or self._closed:
            raise KVOffloadError("an OffloadManager can be entered once")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._owner = self.core.owner = get_ident()
        self.core.refresh_observed()
        self.backend.open(self.device_pool, self.host_pool)
        self.backend.set_waker(self._wake_from_any_thread)
        if self.storage is not None:
            from kvoffload.storage.writer import AsyncWriter

            self._writer = AsyncWriter(self.storage, self.host_pool, self.write_policy, self._write_finished)
            self._spawn(self._writer.run, "kvoffload.storage-writer")
        if (
            self.config.stuck_after_s is not None
            or self.config.on_host_full == "wait"
            or self.backend.needs_polling
        ):
            self._spawn(self._tick_loop, "kvoffload.timers")
        self._open = True
        return self

    def _spawn(self, fn: Callable[[], Any], name: str) -> None:
        assert self._loop is not None
        self._tasks.append(self._loop.create_task(self._contained(fn, name), name=name))

    @staticmethod
    async def _contained(fn: Callable[[], Any], name: str) -> None:
        """Run a background task; an unexpected error is logged, never propagated (F20)."""
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # pragma: no cover - a kvoffload bug; the step that failed is logged
            logger.error("manager.step_failed", step=name, error=repr(exc))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._check_owner("leaving the OffloadManager")
        if not self._open:
            raise KVOffloadError("this OffloadManager is not open")
        timeout = self.config.drain_timeout_s
        start = time.monotonic()
        error: DrainTimeout | None = None
        # Callback errors while leaving (the drain's deliveries, the close's aborts) are
        # kept, and the first raised once the manager is closed (a body's error wins).
        errors: list[BaseException] = []
        self._errors = errors
        # After an error in the body, copies that nobody will complete (sim) are not
        # waited for; their pages stay allocated, so nothing is freed under them.
        drain = exc is None or self.backend.completes_on_its_own
        try:
            with anyio.fail_after(timeout if drain else 0):
                await self.wait_drained()
                await self._drain_loads()
        except TimeoutError:
            if drain:  # skipping the drain after an error under sim is by design: no error
                core = self.core
                logger.error(
                    "manager.drain_timeout",
                    inflight=len(core.inflight),
                    deferred=len(core.deferred),
                    writes=len(core.writes),
                    transfers=[repr(t) for t in list(core.inflight.values())[:8]],
                )
                error = DrainTimeout(self._drain_error("left the manager", timeout))
        finally:
            try:
                await self._shut_down(start, timeout)
            finally:
                self._errors = None
        if not self._joined and drain and exc is None:
            detail = self._park()
            if error is None:
                error = DrainTimeout(f"left the manager after {timeout}s: {detail}")
            else:
                error = DrainTimeout(f"{error}; {detail}")
        elif not self._joined:
            self._park()
        callback = (
            first_error(errors, "leaving the manager, which completed: it is closed") if errors else None
        )
        if error is not None and exc is None and drain:
            raise error from callback
        if callback is not None and exc is None:
            raise callback
        return None

    async def _shut_down(self, start: float, timeout: float | None) -> None:
        """Close: no copy may start; live lifecycles are aborted (the idle ones released
        now); waiters wake and see the manager closed; background tasks end; the backend
        stops (its threads joined within what is left of the timeout, plus a grace)."""
        self._open = False
        self._closed = True
        try:
            self._released(self.core.close())
        finally:
            for read in list(self._reads):  # (each reports its load, CANCELLED, as it ends)
                read.cancel()
            for read in list(self._reads):
                with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
                    await read
            self.core.take_loads()
            for ld in list(self.core.loads.live.values()):  # (a copy wedged: its waiter sees the close)
                if ld.waker is not None:
                    ld.waker.set()
            self.backend.set_waker(None)
            self._wake_progress()
            for lc in list(self.core.live.values()):
                lc.wake()
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
                    await task  # a cancelled task ends with its cancellation
            self._tasks.clear()
            self.backend.close()
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start)) + _JOIN_GRACE_S
            self._joined = await self._join_backend(left)
            if self.storage is not None:
                try:
                    with anyio.move_on_after(_JOIN_GRACE_S if timeout is not None else None):
                        await self.storage.aclose()
                except Exception as exc:  # closing a store must not hide the real outcome
                    logger.error("manager.step_failed", step="storage.aclose", error=repr(exc))

    async def _join_backend(self, timeout: float | None) -> bool:
        """Wait (without blocking the loop) until the backend's copies end, at most ``timeout``."""
        import anyio.to_thread

        if self.backend.join(0):
            return True
        with anyio.CancelScope(shield=True):
            joined = await anyio.to_thread.run_sync(self.backend.join, timeout, abandon_on_cancel=False)
        return joined

    # --- driving the movers ------------------------------------------------------------

    def _launch_soon(self) -> None:
        """Copies start on the loop's next turn: the engine may write a page it got in
        the same call before any copy reads it (F19)."""
        if not self._launch_scheduled:
            self._launch_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._launch)

    def _launch(self) -> None:
        self._launch_scheduled = False
        try:
            self.backend.launch()
        except Exception as exc:  # pragma: no cover - a backend that breaks its contract
            logger.error("manager.step_failed", step="launch", error=repr(exc))

    def _wake_from_any_thread(self) -> None:
        """The backend's waker: schedule one delivery on the loop (any thread)."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._deliver_ready)

    def _deliver_ready(self) -> None:
        """Deliver every ready completion as one batch (a loop callback)."""
        if self._closed:
            return
        batch = self.backend.take_completions()
        if batch:
            self._deliver(batch)

    def _deliver(self, batch: list[Completion]) -> None:
        """Apply ``batch`` to the core (a loop callback); a failure is logged, never
        raised into the loop (F20)."""
        outer = self._delivering()  # a listener's lc.abort() waits for the batch
        start = time.perf_counter()
        try:
            released = self._complete(batch)
        except Exception as exc:  # pragma: no cover - a kvoffload bug; the ledger check will say
            logger.error("manager.step_failed", step="deliver", error=repr(exc))
            released = []
        finally:
            more, errors = self._apply_calls() if outer else ([], [])
        self._delivered += len(batch)
        self._after_step(released + more, errors)
        if self.core.meters.timed:  # (set by kvoffload.metrics.register)
            self.core.meters.polled("deliver", time.perf_counter() - start)
        self.core.take_loads()  # (each DONE load woke its waiter: nothing more to hand over)

    def _after_step(self, released: list[Lifecycle], errors: list[BaseException] | None = None) -> None:
        """After a core step off the caller's path: start the writes it queued, launch
        the copies it made due, tell the engine, wake the waiters. Callback errors (and
        ``errors``, of the listeners' held calls) are logged; while the manager is being
        left they are kept and the first is raised once it is closed."""
        writer = self._writer
        if writer is not None:
            jobs = self.core.take_writes()
            if jobs:
                self._writes_queued += len(jobs)
                writer.put(jobs)
        try:
            self._released(released, errors=errors)
        finally:
            self._wake_progress()

    def _core_step(self, step: Callable[[], list[Lifecycle]]) -> None:
        """Run a core step off the caller's path (a finished write, the timers, a retry
        of deferred chunks); a listener's lc.abort() in it waits for the step."""
        outer = self._delivering()
        try:
            released = step()
        finally:
            more, errors = self._apply_calls() if outer else ([], [])
        self._after_step(released + more, errors)

    def _write_finished(self, result: WriteResult) -> None:
        job, stored, attempts, error = result
        self._writes_done += 1
        self._core_step(lambda: self.core.write_done(job.id, stored, attempts=attempts, error=error))

    def _wake_progress(self) -> None:
        ev = self._progress_ev
        if ev is not None:
            self._progress_ev = None
            ev.set()

    # --- waiting -------------------------------------------------------------------------

    async def settle(self) -> None:
        """Return once every completion the backend has signalled so far was delivered
        and every storage write queued so far finished. On a closed manager, where
        nothing is left to deliver or write, raises :class:`~kvoffload.KVOffloadError`
        instead of waiting for ever."""
        self._check_owner("settle()")
        target = self._delivered + self.backend.ready
        self._deliver_ready()
        while self._delivered < target:
            await self._wait_progress()
        self._after_step([])  # writes the deliveries queued are handed to the writer
        written = self._writes_queued
        while self._writes_done < written:
            await self._wait_progress()

    async def _wait_progress(self) -> None:
        """Wait for the next delivery batch or finished write (or the close)."""
        if self._closed:
            raise ManagerClosed("the manager is closed: nothing will deliver or write what is left")
        if self._progress_ev is None:
            self._progress_ev = anyio.Event()
        if self.backend.needs_polling:
            with anyio.move_on_after(1e-3):
                await self._progress_ev.wait()
            self._deliver_ready()
        else:
            await self._progress_ev.wait()

    async def wait_drained(self) -> None:
        """Wait until no chunk is in flight, deferred or waiting for its storage write.
        Raises :class:`~kvoffload.KVOffloadError` once the manager is closed with some
        left (it was left before they drained; nothing will finish them)."""
        self._check_owner("wait_drained()")
        core = self.core
        while core.busy:
            await self._wait_progress()
            if core.deferred:
                self._core_step(core.pump)

    async def wait_lifecycle(self, lc: Lifecycle, released: bool) -> None:
        """Wait until ``lc`` is RELEASED (``released``) or quiescent. Raises
        :class:`~kvoffload.KVOffloadError` on a closed manager while a chunk of ``lc`` is
        still in flight or deferred: nothing will finish it."""
        while not (lc.released if released else lc.quiescent):
            if self._closed and not lc.quiescent:
                raise ManagerClosed(f"{lc!r}: the manager is closed; its chunk in flight will never complete")
            # One waker per lifecycle and kind, shared by every waiter (the core sets it once).
            ev = lc.waker(released, anyio.Event)
            assert isinstance(ev, anyio.Event)
            if self.backend.needs_polling:
                with anyio.move_on_after(1e-3):
                    await ev.wait()
                self._deliver_ready()
            else:
                await ev.wait()

    def tick(self) -> None:
        """Run the time-based checks now (deferral expiry, watchdog). The timer task calls
        this every ``watchdog_interval_s``; tests with a virtual clock call it."""
        self._check_owner("tick()")
        self._core_step(self.core.tick)

    async def _tick_loop(self) -> None:
        cfg = self.config
        interval = cfg.watchdog_interval_s
        if cfg.on_host_full == "wait" and cfg.host_wait_s is not None:
            interval = min(interval, max(cfg.host_wait_s / 4, 0.001))
        if self.backend.needs_polling:
            interval = min(interval, 1e-3)
        while True:
            await anyio.sleep(interval)
            try:
                if self.backend.needs_polling:
                    self._deliver_ready()
                self.tick()
            except Exception as exc:  # a failing step is logged; the timers go on (F20)
                logger.error("manager.step_failed", step="tick", error=repr(exc))

    # --- loads (the way back) ------------------------------------------------------------

    def start_load(
        self,
        tokens: Sequence[int],
        device_pages: Sequence[int],
        chain_seed: str | None = None,
        *,
        skip_pages: int = 0,
        rid: Any = None,
        tag: Any = None,
    ) -> Load:
        """Begin loading the stored pages of ``tokens`` from page ``skip_pages`` on into
        ``device_pages`` (one per page, in order); return the load at once, READING.

        The keys are kvoffload's chain keys of ``tokens`` (exactly as :meth:`lookup` and
        :meth:`fetch` compute them, seeded by ``chain_seed`` or the namespace). A task
        reads the store into the load's host pages (checked bytes only: a missing or
        corrupt page ends the run there, F38), then the host->device copy of the pages
        read is submitted; ``await`` :meth:`wait_loaded`. A host pool too full to read
        into ends the load at once, MISSED. Raises (nothing held)
        :class:`~kvoffload.StorageError` without a storage tier,
        :class:`~kvoffload.InvalidTokens`, :class:`~kvoffload.PageError` (see
        ``OffloadCore.load_begin``)."""
        ld = self._begin_load("start_load()", tokens, device_pages, chain_seed, skip_pages, rid, tag)
        if not ld.done:
            assert self._loop is not None
            read = self._loop.create_task(self._read_load(ld), name=f"kvoffload.load-{ld.id}")
            self._reads.add(read)
            read.add_done_callback(self._reads.discard)
        return ld

    async def _read_load(self, ld: Load) -> None:
        """The store read of ``ld`` into its host pages, reported to the core when it
        ends however it ends (an error, a cancellation at close)."""
        storage = self.storage
        assert storage is not None
        views = load_buffers(self.host_pool, ld.host_pages)
        n, error = 0, cast("BaseException | None", None)
        try:
            n = await storage.get_into(ld.keys, views)
            if type(n) is not int:
                error, n = KVOffloadError(f"{storage!r}.get_into returned {n!r}, not a page count"), 0
        except BaseException as exc:  # (a cancellation goes on once the read is reported)
            error = exc
            raise
        finally:
            del views

            def step() -> list[Lifecycle]:
                self.core.load_read(ld, min(n, len(ld.keys)), error)
                return []

            self._core_step(step)

    async def wait_loaded(self, load: Load) -> Load:
        """Wait until ``load`` is DONE and return it (``load.outcome`` says how it ended).
        Raises :class:`~kvoffload.ManagerClosed` once the manager is closed with the load
        not done (nothing will finish it), :class:`~kvoffload.KVOffloadError` for a load
        of another manager."""
        self._check_owner("wait_loaded()")
        self._check_load(load, "wait_loaded")
        while not load.done:
            if self._closed:
                raise ManagerClosed(f"{load!r}: the manager is closed; it will never be done")
            ev = load.waker
            if ev is None:
                ev = load.waker = anyio.Event()
            assert isinstance(ev, anyio.Event)
            if self.backend.needs_polling:
                with anyio.move_on_after(1e-3):
                    await ev.wait()
                self._deliver_ready()
            else:
                await ev.wait()
        return load

    async def load(
        self,
        tokens: Sequence[int],
        device_pages: Sequence[int],
        chain_seed: str | None = None,
        *,
        skip_pages: int = 0,
        rid: Any = None,
        tag: Any = None,
    ) -> Load:
        """:meth:`start_load`, then :meth:`wait_loaded`: the load, DONE. If the caller is
        cancelled while it waits, the load is cancelled too (its pages stay busy until
        its read or copy returned: ``load.device_busy``)."""
        ld = self.start_load(tokens, device_pages, chain_seed, skip_pages=skip_pages, rid=rid, tag=tag)
        try:
            return await self.wait_loaded(ld)
        except BaseException:
            if not ld.done and not self._closed:
                self.core.load_cancel(ld)
            raise

    async def _drain_loads(self) -> None:
        """Leaving: cancel every live load and wait until each ended (its read returned,
        its copy completed), so no read or copy touches a page after the close."""
        core = self.core
        for ld in list(core.loads.live.values()):
            core.load_cancel(ld)
        while core.loads.live:
            await self._wait_progress()
        core.take_loads()

    # --- storage reads -------------------------------------------------------------------

    async def lookup(self, tokens: Sequence[int], chain_seed: str | None = None) -> int:
        """How many leading tokens of ``tokens`` (whole pages) are in the storage tier.

        Any worker may have stored them. Raises :class:`~kvoffload.InvalidTokens`, or
        :class:`~kvoffload.StorageError` when there is no storage or it cannot be reached.
        """
        self._check_owner("lookup()")
        storage = self._store()
        keys = self._read_keys(tokens, None, chain_seed)
        if not keys:
            return 0
        meters = self.core.meters
        try:
            found: int = await storage.exists_prefix(keys)
        except BaseException:
            meters.lookup_failed()
            raise
        meters.looked_up(len(keys), found)
        return found * self.config.page_size

    async def fetch(self, tokens: Sequence[int], n: int, chain_seed: str | None = None) -> list[bytes]:
        """The stored bytes of the pages of ``tokens[:n]`` (``n`` a multiple of page_size),
        each read under its chain key and checked against it.

        Returns the leading pages found, in order: fewer than ``n // page_size`` when a
        page is missing, corrupt or of the wrong size (never a wrong page). Raises like
        :meth:`lookup`.
        """
        self._check_owner("fetch()")
        storage = self._store()
        keys = self._read_keys(tokens, n, chain_seed)
        if not keys:
            return []
        return self._fetched(await storage.get(keys))
