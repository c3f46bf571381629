"""SyncOffloadManager: the synchronous driver, for engines whose scheduler is a plain loop.

No event loop anywhere. The owner is the thread that called :meth:`~SyncOffloadManager.open`;
every call comes from it. Copies run on the backend's threads (or CUDA streams) and
storage writes on a writer thread; :meth:`~SyncOffloadManager.poll`, called once per
scheduler iteration, launches the copies made due since the last call (F19), delivers
the completions that are ready, runs due timers, hands copied chunks to the writer and
collects finished writes - on the caller's thread, without waiting on a device or a
store. ``on_released(lc)`` is called from inside those calls.

A call-by-call picture of one scheduler iteration::

    for req in batch: lc.extend(new_tokens)      # after the forward pass
    mgr.poll()                                   # completions -> on_released(lc)

With ``group=`` (tensor parallelism, :mod:`kvoffload.drivers.distributed`) ``poll``,
``quiesce``, ``wait_released``, ``close``, ``lookup`` and ``fetch`` are collectives:
each is one small all-reduce, and every rank delivers the same completions and
releases the same lifecycles in the same call (FAILURES F25).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from _thread import get_ident
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar

from kvoffload.abc import EventBackend, Storage, Transfer
from kvoffload.config import OffloadConfig
from kvoffload.core.events import logger
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.loads import Load
from kvoffload.drivers._base import DriverBase, check_timeout, first_error, load_buffers
from kvoffload.drivers.distributed import CLOSE, FETCH, LOOKUP, POLL, QUIESCE, WAIT, RankAgreement, join_group
from kvoffload.errors import ConfigError, DrainTimeout, KVOffloadError, RanksDiverged, RankTimeout

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from kvoffload.storage.writer import ThreadWriter, WritePolicy, WriteResult

__all__ = ["SyncOffloadManager"]

#: Seconds a close waits past its timeout for copy and writer threads to end.
_JOIN_GRACE_S = 0.5
#: Longest single wait inside quiesce/close, so storage progress and timers are seen.
_WAIT_SLICE_S = 0.01


class SyncOffloadManager(DriverBase):
    """Offloads the KV of admitted requests while they decode, driven from a sync loop.

    ``with SyncOffloadManager(config, backend="cpu", storage=None, on_released=...) as mgr:``
    (or ``open()`` / ``close()``). ``admit``, ``lookup``, ``fetch``, ``statistics()``,
    ``check_invariants()`` are plain calls; :meth:`poll` delivers, :meth:`ready` counts
    what is waiting, :meth:`quiesce` waits for the copies. Every call comes from the
    thread that opened it (else :class:`~kvoffload.WrongThread`, nothing changed).

    ``group``: a ``torch.distributed`` process group with a gloo backend (tensor
    parallelism): every rank builds its manager with the same config and makes the same
    calls; ``poll``, ``quiesce``, ``wait_released``, ``close``, ``lookup`` and ``fetch``
    are then collectives (see docs/integration.md). A group that is not a process
    group, of another size than ``config.tp_size``, or none when ``tp_size`` is above 1,
    raises :class:`~kvoffload.ConfigError`.
    """

    _kind = "SyncOffloadManager"
    #: How a rank agrees with the others under a group (the meta-tests put a broken one here).
    _agreement_class: ClassVar[type[RankAgreement]] = RankAgreement

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
        # _tp: this rank's side of the agreement with the other ranks; None without a group.
        self._tp = join_group(group, config, clock, self._agreement_class)
        if self._tp is not None:
            clock = self._tp.clock  # the core decides by the agreed clock
            host_buffer = self._tp.host_buffer(host_buffer)  # none on a rank that never copies
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
        if self._tp is not None:
            self.storage = self._tp.key_space(self.storage)
        self.group = group
        self._writer: ThreadWriter | None = None
        # _reads: the store reads of live loads, on the writer thread, in start order;
        # each is reported to the core (load_read) by the poll that finds it done.
        # Invariant: all(ld.reading for ld, _ in self._reads)
        self._reads: list[tuple[Load, concurrent.futures.Future[int]]] = []
        # _tick_every: seconds between timer runs inside poll(), or None without timers.
        cfg = config
        self._tick_every: float | None = None
        if cfg.stuck_after_s is not None or cfg.on_host_full == "wait":
            interval = cfg.watchdog_interval_s
            if cfg.on_host_full == "wait" and cfg.host_wait_s is not None:
                interval = min(interval, max(cfg.host_wait_s / 4, 0.001))
            self._tick_every = interval
        self._next_tick = 0.0

    def _open_hint(self) -> str:
        return "call open() first, or use `with SyncOffloadManager(...) as mgr:`"

    # --- open / close --------------------------------------------------------------------

    def open(self) -> SyncOffloadManager:
        """Start: the calling thread becomes the owner; the backend's threads and the
        storage writer start. Once per manager."""
        if self._open or self._closed:
            raise KVOffloadError("a SyncOffloadManager can be opened once")
        self._owner = self.core.owner = get_ident()
        self.core.refresh_observed()
        # Copies start at the next poll(): nothing to schedule per job, so without a group
        # the core hands its jobs to the backend directly (one call less on the submit
        # path); under a group every job goes through the agreement (_accept).
        self.core.accept = self.backend.submit if self._tp is None else self._accept
        self.backend.open(self.device_pool, self.host_pool)
        self.backend.set_waker(None)
        if self.storage is not None:
            from kvoffload.storage.writer import ThreadWriter

            self._writer = ThreadWriter(self.storage, self.host_pool, self.write_policy)
            self._writer.start()
        self._next_tick = self.clock() + (self._tick_every or 0.0)
        self._open = True
        return self

    def __enter__(self) -> SyncOffloadManager:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and not self.backend.completes_on_its_own:
            self.close(timeout=0, raise_timeout=False)  # sim after an error: nobody completes
        else:
            self.close(raise_timeout=exc is None)

    def close(self, timeout: float | None = None, *, raise_timeout: bool = True) -> None:
        """Drain in-flight copies, deferred chunks and storage writes (at most
        ``timeout`` seconds; ``None``: ``config.drain_timeout_s``, which may itself be
        ``None``: for ever), then
        stop: live lifecycles are aborted (the idle ones released now, ``on_released``
        called), the backend's and writer's threads end. With a group it is a
        collective: the ranks drain together and time out together (the timeout is
        agreed: passed on any rank). If the group fails (:class:`~kvoffload.RankTimeout`,
        :class:`~kvoffload.RanksDiverged`), before or during the drain, this rank drains
        its own copies alone and stops; a failure during it is raised at the end.

        Raises :class:`~kvoffload.DrainTimeout` (within the timeout plus a second) naming
        the wedged copies; their buffers are parked, never freed, and their lifecycles
        stay FINISHING with their pages held.

        An ``on_released`` that raises during the drain or the close does not stop it:
        the close runs to its end (every copy drained, threads stopped, the manager
        closed), then the first callback error is raised, the others named in its
        notes (after a ``DrainTimeout`` or a group's error, as its cause). With
        ``raise_timeout=False`` (leaving a ``with`` block on an error) nothing is raised.
        A ``timeout`` that is not None or a number >= 0 raises
        :class:`~kvoffload.ConfigError`, nothing closed.
        """
        self._check_owner("close()")
        if self._closed:
            return
        if not self._open:
            raise KVOffloadError("this SyncOffloadManager was never opened")
        if timeout is None:
            timeout = self.config.drain_timeout_s
        timeout = check_timeout("close()", timeout)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        core = self.core
        group_error: KVOffloadError | None = None
        # Callback errors are kept until the close is done (not raised out of the drain).
        outer = self._errors is None
        errors: list[BaseException] = []
        if outer:
            self._errors = errors
        for ld in list(core.loads.live.values()):  # no load copies from now on; each ends
            core.load_cancel(ld)  # when its read returns or its copy completes (drained here)

        def drained() -> bool:
            return not core.busy and not core.loads.live

        try:
            try:
                timed_out = not self._until(drained, deadline, CLOSE)
            except (RankTimeout, RanksDiverged) as exc:  # the group failed in the drain:
                group_error = exc  # finish it with this rank's own copies, then say so
                timed_out = not self._until(drained, deadline, CLOSE)
        except BaseException:  # not closed (e.g. KeyboardInterrupt): callbacks raise again
            if outer:
                self._errors = None
            raise
        message = self._drain_error("closed the manager", timeout) if timed_out else None
        if timed_out:
            logger.error(
                "manager.drain_timeout",
                inflight=len(core.inflight),
                deferred=len(core.deferred),
                writes=len(core.writes),
                transfers=[repr(t) for t in list(core.inflight.values())[:8]],
            )
        self._open = False
        self._closed = True
        try:
            self._released(core.close())
        finally:
            if outer:
                self._errors = None
            self.backend.close()
            grace = None if deadline is None else max(0.0, deadline - time.monotonic()) + _JOIN_GRACE_S
            joined = self.backend.join(grace)
            writer = self._writer
            if writer is not None:
                writer.stop()
                writer.join(_JOIN_GRACE_S if deadline is not None else None)
                joined = joined and not writer.is_alive()
            elif self.storage is not None:  # pragma: no cover - storage always has a writer
                pass
        if not joined:
            detail = self._park()
            message = f"{message}; {detail}" if message else f"closed the manager after {timeout}s: {detail}"
        if not raise_timeout:
            return
        callback = first_error(errors, "close(), which completed: the manager is closed") if errors else None
        if message is not None:
            raise DrainTimeout(message) from (group_error or callback)
        if group_error is not None:
            raise group_error from callback
        if callback is not None:
            raise callback

    # --- driving -------------------------------------------------------------------------

    def _launch_soon(self) -> None:
        """Copies start at the next :meth:`poll` (F19): nothing to schedule."""

    def _accept(self, t: Transfer) -> None:
        tp = self._tp
        if tp is None:
            self.backend.submit(t)
        else:  # never refuses: a refusal on one rank fails that chunk on every rank
            tp.accept(t, self.backend)

    def poll(self, max_completions: int | None = None) -> int:
        """Deliver at most ``max_completions`` ready completions (all by default) on this
        thread, run due timers, hand copied chunks to the storage writer and collect the
        writes that finished; launch the copies made due since the last call. Never
        waits on a device or a store. Calls ``on_released(lc)`` for each lifecycle
        released; if one raises, the ledger is already consistent, the other callbacks
        still ran, and the first error is raised here. Returns how many completions
        were delivered.

        With a group, a collective: every rank must call it, once per scheduler step at
        the same point; every rank delivers the same completions (those finished on
        every rank; at most the smallest ``max_completions`` any rank passed) and
        releases the same lifecycles, in the same order. A chunk that failed on any rank
        fails on every rank. What it sends is an all-reduce (MIN) of 2 int64 (the
        compact exchange), followed, only when that says so, by one of
        ``2 * tp_window + 14`` int64 - a header and a finished/failed slot per copy and
        storage write of the oldest in flight; a poll with nothing to agree on may skip
        both, on every rank alike. Why that is enough is told in
        :mod:`kvoffload.drivers.distributed`. Raises :class:`~kvoffload.RankTimeout` or
        :class:`~kvoffload.RanksDiverged` (nothing delivered) on every rank that sees it.
        """
        owner = self._owner
        if owner is None or get_ident() != owner or not self._open:
            self._check_open("poll()")
        if max_completions is not None and (type(max_completions) is not int or max_completions < 0):
            raise ConfigError(f"max_completions must be None or an int >= 0, got {max_completions!r}")
        meters = self.core.meters
        if not meters.timed:  # (kvoffload.metrics.register times polls: nothing else reads it)
            return self._step(max_completions, POLL, False)[0]
        start = time.perf_counter()
        n = self._step(max_completions, POLL, False)[0]
        meters.polled("poll" if self._tp is None else "collective", time.perf_counter() - start)
        return n

    def _step(self, max_completions: int | None, kind: int, late: bool) -> tuple[int, bool]:
        """The body of :meth:`poll` and of every wait; returns (completions delivered,
        whether ``late``). Under a group it holds this rank's completions and finished
        writes, agrees with the other ranks (one all-reduce, ``kind`` naming the call)
        and delivers what was agreed; ``late`` is then whether a deadline passed on any
        rank."""
        backend = self.backend
        backend.launch()
        outer = self._delivering()  # a listener's lc.abort() waits for the batch
        try:
            n, late, released = self._deliver_step(max_completions, kind, late)
        except BaseException:
            if outer:
                self._released(self._apply_calls()[0])  # told (errors logged); the error goes on
            raise
        errors: list[BaseException] = []
        if outer:
            more, errors = self._apply_calls()
            released += more
        backend.launch()  # what a retried deferred chunk (or a held call's flush) submitted
        if released or errors:
            self._released(released, raise_errors=True, errors=errors)
        self.core.take_loads()  # (each DONE load woke its waiter: nothing more to hand over)
        return n, late

    def _deliver_step(
        self, max_completions: int | None, kind: int, late: bool
    ) -> tuple[int, bool, list[Lifecycle]]:
        """The core's part of :meth:`_step`: returns (completions delivered, late, the
        lifecycles released)."""
        backend = self.backend
        core = self.core
        writer = self._writer
        tp = self._tp
        released: list[Lifecycle] = []
        n = 0
        results: Sequence[WriteResult] = ()
        if tp is None:
            if backend.ready or backend.needs_polling:
                batch = backend.take_completions(max_completions)
                if batch:
                    n = len(batch)
                    released = self._complete(batch)
            if writer is not None:
                results = writer.take_results()
            if self._reads:
                self._reads_done()
        else:
            if backend.ready or backend.needs_polling:
                tp.hold_copies(backend.take_completions(), core)
            if writer is not None:
                tp.hold_writes(writer.take_results())
            agreed = tp.exchange(kind, core, limit=max_completions, late=late)
            late = agreed.late
            if agreed.copies:
                n = len(agreed.copies)
                released = self._complete(agreed.copies)
            results = agreed.writes
        for job, stored, attempts, error in results:
            released += core.write_done(job.id, stored, attempts=attempts, error=error)
        if writer is not None:
            self._start_writes(writer)
        if kind == POLL:  # one scheduler step (the same count on every rank)
            core.polls += 1
            if core.deferred and core.config.host_wait_polls is not None:
                released += core.expire_waits()
        if self._tick_every is not None:
            now = self.clock()  # under a group the agreed clock: the same call on every rank
            if now >= self._next_tick:
                self._next_tick = now + self._tick_every
                released += core.tick()
                if writer is not None:
                    self._start_writes(writer)
        return n, late, released

    def _start_writes(self, writer: ThreadWriter) -> None:
        """Hand the writes the core queued to the writer (under a group, on a rank that
        stores nothing, count its part of them done at once)."""
        jobs = self.core.take_writes()
        if jobs:
            tp = self._tp
            if tp is None or tp.copies_here:
                writer.put(jobs)
            else:
                tp.skip_writes(jobs)

    def ready(self) -> int:
        """Completions signalled by the backend and not yet delivered (with a group:
        this rank's, the ones held for the other ranks included - not a collective, so
        never decide from it whether to call :meth:`poll`)."""
        self._check_owner("ready()")
        backend = self.backend
        if backend.needs_polling:
            backend.take_ready_nowait()
        tp = self._tp
        return backend.ready if tp is None else backend.ready + len(tp.copies)

    def tick(self) -> None:
        """Run the time-based checks now (deferral expiry, watchdog); :meth:`poll` runs
        them every ``watchdog_interval_s``. Tests with a virtual clock call this."""
        self._check_open("tick()")
        outer = self._delivering()
        try:
            released = self.core.tick()
        finally:
            more, errors = self._apply_calls() if outer else ([], [])
        self._released(released + more, raise_errors=True, errors=errors)

    @property
    def writes_pending(self) -> int:
        """Storage writes queued and not yet finished (their host pages are held)."""
        return len(self.core.writes)

    def wait_progress(self, timeout: float | None) -> None:
        """Block until the backend or the storage writer has something for :meth:`poll`,
        at most ``timeout`` seconds (and at most a short slice). A ``timeout`` that is not
        None or a number >= 0 raises :class:`~kvoffload.ConfigError`."""
        self._check_owner("wait_progress()")
        self._wait(check_timeout("wait_progress()", timeout))

    def _wait(self, timeout: float | None) -> None:
        """Block until the backend or the writer has something, at most a short slice."""
        slice_s = _WAIT_SLICE_S if timeout is None else max(0.0, min(timeout, _WAIT_SLICE_S))
        writer = self._writer
        if self.backend.ready or (writer is not None and writer.has_results):
            return
        if self._reads and not self.core.inflight and not self.core.loads.copying:
            futures = [f for _, f in self._reads]
            concurrent.futures.wait(futures, slice_s, concurrent.futures.FIRST_COMPLETED)
        elif writer is not None and writer.pending and not self.core.inflight:
            writer.wait_progress(slice_s)
        else:
            self.backend.wait_ready(slice_s)

    def quiesce(self, timeout: float | None = None) -> None:
        """Wait until no copy is in flight (storage writes not counted), delivering as
        :meth:`poll` does; raises :class:`~kvoffload.DrainTimeout` naming the copies
        still in flight after ``timeout`` seconds (``None``: for ever). The barrier
        before retraction: when it returns, no copy reads any lifecycle's pages. With a
        group, a collective: it returns on every rank once no rank has a copy in
        flight, or raises ``DrainTimeout`` on every rank once the timeout passed on any.

        An ``on_released`` that raises does not end the wait: the rest of its batch is
        delivered and the wait goes on to its end; then the first callback error is
        raised (a note says the wait completed; the others are named in its notes), or
        is the cause of the ``DrainTimeout``. A ``timeout`` that is not None or a number
        >= 0 (nan, negative, a str, a bool) raises :class:`~kvoffload.ConfigError` at once."""
        self._check_open("quiesce()")
        timeout = check_timeout("quiesce()", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        core = self.core
        done, errors = self._until_end(lambda: not core.inflight, deadline, QUIESCE)
        if not done:
            stuck = list(core.inflight.values())
            raise DrainTimeout(
                f"quiesce: {len(stuck)} copies still in flight after {timeout}s: {stuck[:4]!r}"
            ) from (first_error(errors, "quiesce()") if errors else None)
        if errors:
            raise first_error(errors, "quiesce(), which completed: no copy is in flight")

    def wait_released(self, lc: Lifecycle, timeout: float | None = None) -> None:
        """Poll until ``lc`` is RELEASED; :class:`~kvoffload.DrainTimeout` after
        ``timeout`` seconds (``None``: for ever). A collective with a group, as
        :meth:`quiesce`; callback errors and bad timeouts as there. A lifecycle this
        manager did not admit raises :class:`~kvoffload.KVOffloadError` at once."""
        self._check_open("wait_released()")
        if not isinstance(lc, Lifecycle) or lc._core is not self.core:
            raise KVOffloadError(
                f"wait_released({lc!r}): not a lifecycle of this manager (another manager admitted "
                "it, or it is no Lifecycle): only its own manager delivers its completions"
            )
        timeout = check_timeout("wait_released()", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        done, errors = self._until_end(lambda: lc.released, deadline, WAIT)
        if not done:
            raise DrainTimeout(f"{lc!r} was not released within {timeout}s") from (
                first_error(errors, "wait_released()") if errors else None
            )
        if errors:
            raise first_error(errors, f"wait_released(), which completed: {lc!r} is released")

    def _until_end(
        self, done: Callable[[], bool], deadline: float | None, kind: int
    ) -> tuple[bool, list[BaseException]]:
        """:meth:`_until`, keeping the callback errors of its steps (logged) to the end
        instead of leaving the wait at the first: (whether ``done()``, the errors)."""
        outer = self._errors is None
        errors: list[BaseException] = []
        if outer:
            self._errors = errors
        try:
            return self._until(done, deadline, kind), errors
        finally:
            if outer:
                self._errors = None

    def _until(self, done: Callable[[], bool], deadline: float | None, kind: int) -> bool:
        """Deliver as :meth:`poll` does until ``done()``; False once ``deadline``
        (monotonic seconds) passed first. Under a group every rank leaves in the same
        call: ``done()`` reads agreed state, and the deadline counts as passed once it
        passed on any rank."""
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            late = self._step(None, kind, left is not None and left <= 0)[1]
            if done():
                return True
            if late:
                return False
            self._wait(left)

    def wait_lifecycle(self, lc: Lifecycle, released: bool) -> Awaitable[None]:
        raise KVOffloadError(
            f"{lc!r} belongs to a SyncOffloadManager, which has no event loop: use "
            "mgr.wait_released(lc) or mgr.quiesce(), or watch on_released"
        )

    # --- loads (the way back) ------------------------------------------------------------

    def load(
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
        :meth:`fetch` compute them, seeded by ``chain_seed`` or the namespace). The
        writer thread reads the store into the load's host pages (checked bytes only: a
        missing or corrupt page ends the run there, F38); :meth:`poll` delivers the
        read and then the host->device copy's completion; :meth:`wait_loaded` waits.
        A host pool too full to read into ends the load at once, MISSED. Raises (nothing
        held) :class:`~kvoffload.StorageError` without a storage tier,
        :class:`~kvoffload.ConfigError` under a TP group (loads are not supported there
        yet), :class:`~kvoffload.InvalidTokens`, :class:`~kvoffload.PageError` (see
        ``OffloadCore.load_begin``)."""
        if self._tp is not None:
            self._check_owner("load()")
            raise ConfigError(
                "load() under a tensor-parallel group (group=) is not supported: each rank's load "
                "would need its shard's keys and an agreed count; load on a manager without a group"
            )
        ld = self._begin_load("load()", tokens, device_pages, chain_seed, skip_pages, rid, tag)
        if ld.done:  # no host pages to read into: a miss
            return ld
        writer, storage = self._writer, self.storage
        assert writer is not None and storage is not None
        views = load_buffers(self.host_pool, ld.host_pages)
        try:
            future = writer.submit(storage.get_into(ld.keys, views))
        except BaseException as exc:  # the writer is stopped: the read failed at once
            self.core.load_read(ld, 0, exc)
            return ld
        finally:
            del views
        self._reads.append((ld, future))
        return ld

    def _reads_done(self) -> None:
        """Report every finished store read to the core, in start order (a copy of the
        pages read is submitted; the next :meth:`backend.launch` starts it)."""
        left: list[tuple[Load, concurrent.futures.Future[int]]] = []
        for ld, future in self._reads:
            if not future.done():
                left.append((ld, future))
                continue
            error = future.exception()
            n = 0 if error is not None else future.result()
            if error is None and type(n) is not int:
                error = KVOffloadError(f"{self.storage!r}.get_into returned {n!r}, not a page count")
                n = 0
            self.core.load_read(ld, min(n, len(ld.keys)), error)
        self._reads = left

    def wait_loaded(self, load: Load, timeout: float | None = None) -> Load:
        """Poll until ``load`` is DONE and return it (``load.outcome`` says how it
        ended); :class:`~kvoffload.DrainTimeout` after ``timeout`` seconds (``None``: for
        ever). A load of another manager raises :class:`~kvoffload.KVOffloadError` at once."""
        self._check_open("wait_loaded()")
        self._check_load(load, "wait_loaded")
        timeout = check_timeout("wait_loaded()", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        done, errors = self._until_end(lambda: load.done, deadline, WAIT)
        if not done:
            raise DrainTimeout(f"{load!r} was not done within {timeout}s") from (
                first_error(errors, "wait_loaded()") if errors else None
            )
        if errors:
            raise first_error(errors, f"wait_loaded(), which completed: {load!r} is done")
        return load

    # --- storage reads -------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], chain_seed: str | None = None) -> int:
        """How many leading tokens of ``tokens`` (whole pages) are in the storage tier
        (blocks while the store answers). Raises like ``OffloadManager.lookup``. With a
        group, a collective: the pages every rank has (its own shard's, under
        ``tp_keys="rank"``), the smallest count over the ranks."""
        self._check_open("lookup()")
        storage = self._store()
        keys = self._read_keys(tokens, None, chain_seed)
        if not keys:
            return 0
        writer = self._writer
        assert writer is not None
        meters = self.core.meters

        def found() -> int:
            try:
                n = writer.call(storage.exists_prefix(keys))
            except Exception:
                meters.lookup_failed()
                raise
            meters.looked_up(len(keys), n)
            return n

        if self._tp is None:
            return found() * self.config.page_size

        return self._tp.agree_count(LOOKUP, self.core, found) * self.config.page_size

    def fetch(self, tokens: Sequence[int], n: int, chain_seed: str | None = None) -> list[bytes]:
        """The stored bytes of the pages of ``tokens[:n]``, each checked against its key
        (blocks while the store answers). Raises like ``OffloadManager.fetch``. With a
        group, a collective: every rank returns as many pages as the rank that found
        fewest (each rank its own shard's bytes under ``tp_keys="rank"``)."""
        self._check_open("fetch()")
        storage = self._store()
        keys = self._read_keys(tokens, n, chain_seed)
        if not keys:
            return []
        writer = self._writer
        assert writer is not None
        if self._tp is None:
            return self._fetched(writer.call(storage.get(keys)))
        pages: list[bytes] = []

        def read() -> int:
            pages.extend(self._fetched(writer.call(storage.get(keys))))
            return len(pages)

        return pages[: self._tp.agree_count(FETCH, self.core, read)]
