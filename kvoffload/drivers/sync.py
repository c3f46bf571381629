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
"""

from __future__ import annotations

import os
import time
from _thread import get_ident
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvoffload.abc import EventBackend, Storage
from kvoffload.config import OffloadConfig
from kvoffload.core.events import logger
from kvoffload.drivers._base import DriverBase
from kvoffload.errors import DrainTimeout, KVOffloadError
from kvoffload.lifecycle.core import Lifecycle

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from kvoffload.storage.writer import ThreadWriter, WritePolicy

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
    """

    _kind = "SyncOffloadManager"

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
        if group is not None:
            raise KVOffloadError(
                "SyncOffloadManager(group=...) (tensor parallelism) is not available in this version: "
                "run one manager per rank without a group, or upgrade"
            )
        self.group = group
        self._writer: ThreadWriter | None = None
        # _tick_every: seconds between timer runs inside poll(), or None without timers.
        cfg = config
        self._tick_every: float | None = None
        if cfg.stuck_after_s is not None or cfg.on_host_full == "wait":
            interval = cfg.watchdog_interval_s
            if cfg.on_host_full == "wait":
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
        # Copies start at the next poll(): nothing to schedule per job, so the core hands
        # its jobs to the backend directly (one call less on the submit path).
        self.core.accept = self.backend.submit
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
        called), the backend's and writer's threads end.

        Raises :class:`~kvoffload.DrainTimeout` (within the timeout plus a second) naming
        the wedged copies; their buffers are parked, never freed, and their lifecycles
        stay FINISHING with their pages held.
        """
        self._check_owner("close()")
        if self._closed:
            return
        if not self._open:
            raise KVOffloadError("this SyncOffloadManager was never opened")
        if timeout is None:
            timeout = self.config.drain_timeout_s
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        core = self.core
        timed_out = False
        while True:
            self.poll()
            if not core.busy:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                timed_out = True
                break
            self._wait(left)
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
        if message is not None and raise_timeout:
            raise DrainTimeout(message)

    # --- driving -------------------------------------------------------------------------

    def _launch_soon(self) -> None:
        """Copies start at the next :meth:`poll` (F19): nothing to schedule."""

    def poll(self, max_completions: int | None = None) -> int:
        """Deliver at most ``max_completions`` ready completions (all by default) on this
        thread, run due timers, hand copied chunks to the storage writer and collect the
        writes that finished; launch the copies made due since the last call. Never
        waits on a device or a store. Calls ``on_released(lc)`` for each lifecycle
        released; if one raises, the ledger is already consistent, the other callbacks
        still ran, and the first error is raised here. Returns how many completions
        were delivered."""
        owner = self._owner
        if owner is None or get_ident() != owner or not self._open:
            self._check_open("poll()")
        backend = self.backend
        backend.launch()
        core = self.core
        released: list[Lifecycle] = []
        n = 0
        if backend.ready or backend.needs_polling:
            batch = backend.take_completions(max_completions)
            if batch:
                n = len(batch)
                released = self._complete(batch)
        writer = self._writer
        if writer is not None:
            for job, stored, attempts, error in writer.take_results():
                released += core.write_done(job.id, stored, attempts=attempts, error=error)
            jobs = core.take_writes()
            if jobs:
                writer.put(jobs)
        if self._tick_every is not None:
            now = self.clock()
            if now >= self._next_tick:
                self._next_tick = now + self._tick_every
                released += core.tick()
                if writer is not None and (jobs := core.take_writes()):
                    writer.put(jobs)
        backend.launch()  # what a retried deferred chunk submitted
        if released:
            self._released(released, raise_errors=True)
        return n

    def ready(self) -> int:
        """Completions signalled by the backend and not yet delivered."""
        self._check_owner("ready()")
        backend = self.backend
        if backend.needs_polling:
            backend.take_ready_nowait()
        return backend.ready

    def tick(self) -> None:
        """Run the time-based checks now (deferral expiry, watchdog); :meth:`poll` runs
        them every ``watchdog_interval_s``. Tests with a virtual clock call this."""
        self._check_open("tick()")
        self._released(self.core.tick(), raise_errors=True)

    @property
    def writes_pending(self) -> int:
        """Storage writes queued and not yet finished (their host pages are held)."""
        return len(self.core.writes)

    def wait_progress(self, timeout: float | None) -> None:
        """Block until the backend or the storage writer has something for :meth:`poll`,
        at most ``timeout`` seconds (and at most a short slice)."""
        self._check_owner("wait_progress()")
        self._wait(timeout)

    def _wait(self, timeout: float | None) -> None:
        """Block until the backend or the writer has something, at most a short slice."""
        slice_s = _WAIT_SLICE_S if timeout is None else max(0.0, min(timeout, _WAIT_SLICE_S))
        writer = self._writer
        if self.backend.ready or (writer is not None and writer.has_results):
            return
        if writer is not None and writer.pending and not self.core.inflight:
            writer.wait_progress(slice_s)
        else:
            self.backend.wait_ready(slice_s)

    def quiesce(self, timeout: float | None = None) -> None:
        """Wait until no copy is in flight (storage writes not counted), delivering as
        :meth:`poll` does; raises :class:`~kvoffload.DrainTimeout` naming the copies
        still in flight after ``timeout`` seconds (``None``: for ever). The barrier
        before retraction: when it returns, no copy reads any lifecycle's pages."""
        self._check_open("quiesce()")
        deadline = None if timeout is None else time.monotonic() + timeout
        core = self.core
        while True:
            self.poll()
            if not core.inflight:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                stuck = list(core.inflight.values())
                raise DrainTimeout(
                    f"quiesce: {len(stuck)} copies still in flight after {timeout}s: {stuck[:4]!r}"
                )
            self._wait(left)

    def wait_released(self, lc: Lifecycle, timeout: float | None = None) -> None:
        """Poll until ``lc`` is RELEASED; :class:`~kvoffload.DrainTimeout` after
        ``timeout`` seconds (``None``: for ever)."""
        self._check_open("wait_released()")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()
            if lc.released:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DrainTimeout(f"{lc!r} was not released within {timeout}s")
            self._wait(left)

    def wait_lifecycle(self, lc: Lifecycle, released: bool) -> Awaitable[None]:
        raise KVOffloadError(
            f"{lc!r} belongs to a SyncOffloadManager, which has no event loop: use "
            "mgr.wait_released(lc) or mgr.quiesce(), or watch on_released"
        )

    # --- storage reads -------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], chain_seed: str | None = None) -> int:
        """How many leading tokens of ``tokens`` (whole pages) are in the storage tier
        (blocks while the store answers). Raises like ``OffloadManager.lookup``."""
        self._check_open("lookup()")
        storage = self._store()
        keys = self._read_keys(tokens, None, chain_seed)
        if not keys:
            return 0
        assert self._writer is not None
        return self._writer.call(storage.exists_prefix(keys)) * self.config.page_size

    def fetch(self, tokens: Sequence[int], n: int, chain_seed: str | None = None) -> list[bytes]:
        """The stored bytes of the pages of ``tokens[:n]``, each checked against its key
        (blocks while the store answers). Raises like ``OffloadManager.fetch``."""
        self._check_open("fetch()")
        storage = self._store()
        keys = self._read_keys(tokens, n, chain_seed)
        if not keys:
            return []
        assert self._writer is not None
        return self._fetched(self._writer.call(storage.get(keys)))
