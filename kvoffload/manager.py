"""OffloadManager: the context, the registry, waiting, statistics - the public surface.

Bookkeeping only: every method here is plain ``def`` and never awaits, except the
``wait_*``/``settle`` methods and the background tasks (completion delivery, storage
writes, the watchdog), which the manager owns in one anyio task group. The
synchronous steps that events, chunks and completions take are in ``_flow.py``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from kvoffload._events import STRUCTLOG, Listener, RateLimit, debug_enabled, logger
from kvoffload._flow import LifecycleFlow
from kvoffload.abc import Completion, EventBackend, Storage, Transfer
from kvoffload.config import OffloadConfig
from kvoffload.errors import DrainTimeout, KVOffloadError
from kvoffload.keys import chain_keys_packed, pack_tokens, validate_tokens
from kvoffload.lifecycle.core import Lifecycle, LifecycleId
from kvoffload.lifecycle.table import validate
from kvoffload.stats import Counters, Statistics

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from kvoffload._writer import WritePolicy
    from kvoffload.pools import DevicePool, HostPool

__all__ = ["OffloadManager"]

_spec_validated = False


class OffloadManager(LifecycleFlow):
    """Offloads the KV of admitted requests, chunk by chunk, while they decode.

    ``async with OffloadManager(config, backend="auto", storage=None) as mgr:`` — the
    backend and storage are a name (``"auto"``: cuda with a GPU, else cpu; ``"sim"``,
    ``"cpu"``, ``"cuda"``, which raises :class:`~kvoffload.BackendError` without a GPU; ``"memory"``, a
    directory path, a ``redis://`` URL) or an instance. Leaving the context waits for
    in-flight copies (F16), at most ``config.drain_timeout_s``.

    All methods are called from the event loop thread that entered the context.
    """

    def __init__(
        self,
        config: OffloadConfig,
        *,
        backend: str | EventBackend = "auto",
        storage: str | os.PathLike[str] | Storage | None = None,
        clock: Callable[[], float] = time.monotonic,
        write_policy: WritePolicy | None = None,
    ) -> None:
        global _spec_validated
        if not _spec_validated:
            validate()
            _spec_validated = True
        from kvoffload._writer import WritePolicy
        from kvoffload.backends import resolve_backend
        from kvoffload.storage import resolve_storage

        self.config = config
        self.backend: EventBackend = resolve_backend(backend)
        self.storage: Storage | None = resolve_storage(storage)
        self.write_policy = write_policy if write_policy is not None else WritePolicy()
        self.clock = clock
        self.device_pool: DevicePool
        self.host_pool: HostPool
        self.device_pool, self.host_pool = self.backend.create_pools(config)
        # page_bytes: bytes of one page (for the ``bytes`` field of events).
        self.page_bytes = self.host_pool.tensor[0].numel() * self.host_pool.tensor.element_size()
        # _live: every lifecycle admitted and not RELEASED, by lifecycle id (never by rid).
        # Invariant: all(lc._s != RELEASED for lc in self._live.values())
        self._live: dict[LifecycleId, Lifecycle] = {}
        self._next_id = 1
        # _state_counts[s]: live lifecycles in state s.
        # Invariant: self._state_counts[s] == sum(lc._s == s for lc in self._live.values())
        self._state_counts = [0, 0, 0, 0]
        # _inflight: transfers submitted and not yet delivered, by id.
        # Invariant: len(self._inflight) == self.counters.chunks_inflight == sum(lc.inflight)
        self._inflight: dict[int, Transfer] = {}
        # _deferred: lifecycles whose next chunk waits for host pages, FIFO.
        self._deferred: deque[Lifecycle] = deque()
        # _writes: copied transfers waiting for their storage write (host pages held).
        self._writes: deque[Transfer] = deque()
        # _writes_done: storage writes finished (stored or failed), ever; for settle().
        self._writes_done = 0
        self._write_ev: anyio.Event | None = None
        self.counters = Counters()
        self._delivered = 0
        self._settle_ev: anyio.Event | None = None
        self._listeners: list[Listener] = []
        # _stuck_reported: ids of in-flight transfers the watchdog reported (F18).
        self._stuck_reported: set[int] = set()
        # Rate limits of the warnings that come in bursts (F9: no log line every step).
        self._drop_log = RateLimit()
        self._failure_log = RateLimit()
        self._tg: TaskGroup | None = None
        self._open = False
        self._closed = False

    # --- context -----------------------------------------------------------------------

    async def __aenter__(self) -> OffloadManager:
        if self._open or self._closed:
            raise KVOffloadError("an OffloadManager can be entered once")
        self.backend.open(self.device_pool, self.host_pool)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._deliver_loop, name="kvoffload.deliver")
        if self.storage is not None:
            self._tg.start_soon(self._write_loop, name="kvoffload.storage-writer")
        if self.config.stuck_after_s is not None or self.config.on_host_full == "wait":
            self._tg.start_soon(self._tick_loop, name="kvoffload.watchdog")
        self._open = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        timeout_error: DrainTimeout | None = None
        # After an error in the body, copies that nobody will complete (sim) are not
        # waited for; their pages stay allocated, so nothing is freed under them.
        drain = exc is None or self.backend.completes_on_its_own
        try:
            with anyio.fail_after(self.config.drain_timeout_s if drain else 0):
                await self.wait_drained()
        except TimeoutError:
            stuck = list(self._inflight.values())
            left = (
                f"{len(stuck)} copies in flight, {len(self._deferred)} chunks waiting for host "
                f"pages, {len(self._writes)} storage writes"
            )
            if drain:  # skipping the drain after an error under sim is by design: no error
                logger.error(
                    "manager.drain_timeout",
                    inflight=len(stuck),
                    deferred=len(self._deferred),
                    writes=len(self._writes),
                    transfers=[repr(t) for t in stuck[:8]],
                )
            timeout_error = DrainTimeout(
                f"left after {self.config.drain_timeout_s}s with {left} unfinished: {stuck[:4]!r}; "
                f"the pages they use were not freed"
            )
        finally:
            self._open = False
            self._closed = True
            self._wake_settle()  # waiters of settle/wait_drained see the manager closed
            for lc in self._live.values():
                lc._wake()  # and so do those of wait_released/wait_quiescent
            if self._live:
                logger.warning("manager.closed_live", live=len(self._live))
            self._tg.cancel_scope.cancel()
            try:
                # The body's own exception propagates unwrapped; only a cancellation is
                # handed to the task group (which may have caused it: a background task
                # failed, and its error then comes out of the task group).
                if exc is not None and isinstance(exc, anyio.get_cancelled_exc_class()):
                    await self._tg.__aexit__(exc_type, exc, tb)
                else:
                    await self._tg.__aexit__(None, None, None)
            finally:
                try:
                    await self.backend.aclose()
                finally:
                    if self.storage is not None:
                        await self.storage.aclose()
        if timeout_error is not None and exc is None and drain:
            raise timeout_error
        return None

    # --- registry ------------------------------------------------------------------------

    def admit(self, rid: Any, prompt: Sequence[int]) -> Lifecycle:
        """Admit a request: allocate device pages for ``prompt`` and return its new
        lifecycle, in PENDING (or OFFLOADING when ``offload_prompt`` submits the prompt).

        ``rid`` is a label: it may equal a live lifecycle's rid (a reused request id);
        the two never share state. Raises :class:`~kvoffload.InvalidTokens`,
        :class:`~kvoffload.PoolExhausted`, or the backend's error when it refuses the
        ``offload_prompt`` chunk, with nothing changed.
        """
        if not self._open:
            raise KVOffloadError("admit() needs an open manager: use `async with OffloadManager(...)`")
        cfg = self.config
        tokens = validate_tokens(prompt, "prompt")
        n = len(tokens)
        ps = cfg.page_size
        pages = self.device_pool.allocate(-(-n // ps))
        lc = Lifecycle(self, LifecycleId(self._next_id), rid, self.clock())
        self._next_id += 1
        lc.device_pages = pages
        lc._cap = len(pages) * ps
        lc.committed = n
        aligned = n - n % ps
        if cfg.offload_prompt:
            lc._tail = tokens
            lc.due = aligned  # the prompt's page-aligned part is the first chunk
        else:  # taken as stored by the prefill side; its pages seed the chain
            if aligned:
                lc.chain_key = chain_keys_packed(None, pack_tokens(tokens[:aligned]), ps)[-1]
            lc.submitted = aligned
            lc._tail = tokens[aligned:]
            lc.due = aligned + cfg.stride
        self._live[lc.id] = lc
        self._state_counts[0] += 1
        self.counters.admitted += 1
        if self._listeners or (STRUCTLOG.is_configured and debug_enabled()):
            self._emit("lifecycle.admitted", lc, prompt_tokens=n, device_pages=len(pages))
        if cfg.offload_prompt and aligned:
            try:
                self._submit(lc, aligned)
            except BaseException:  # the backend refused: admit is all or nothing
                del self._live[lc.id]
                self._state_counts[0] -= 1
                self.counters.admitted -= 1
                self.device_pool.free(pages)
                raise
        return lc

    def lifecycles(self, rid: Any = None) -> list[Lifecycle]:
        """Live lifecycles, oldest first; with ``rid``, those labelled ``rid`` (there may be
        several: a reused id). For observability: O(live)."""
        if rid is None:
            return list(self._live.values())
        return [lc for lc in self._live.values() if lc.rid == rid]

    def __iter__(self) -> Iterator[Lifecycle]:
        return iter(list(self._live.values()))

    def __len__(self) -> int:
        return len(self._live)

    async def _deliver_loop(self) -> None:
        wait = self.backend.wait_completions
        while True:
            # The batch lives only in _deliver_batch's frame: while this task waits it
            # holds no transfer, so it pins no released lifecycle (F2).
            self._deliver_batch(await wait())

    def _deliver_batch(self, batch: list[Completion]) -> None:
        """Apply a batch of completions in one loop (one clock read for the batch); one
        ``_deliver`` call per completion where a subclass overrides that hook."""
        now = self.clock()
        if type(self)._deliver is LifecycleFlow._deliver:
            self._deliver_all(batch, now)
        else:
            deliver = self._deliver
            for t, err in batch:
                deliver(t, err, now)
        self._delivered += len(batch)
        self._wake_settle()

    def _wake_settle(self) -> None:
        ev = self._settle_ev
        if ev is not None:
            self._settle_ev = None
            ev.set()

    # --- storage write-behind ------------------------------------------------------------

    async def _write_loop(self) -> None:
        from kvoffload._writer import write_loop

        await write_loop(self)

    def _write_done(self, t: Transfer) -> None:
        """The writer finished ``t`` (stored or failed): its host pages return (rule 3)."""
        done = self._writes.popleft()
        assert done is t, "storage writes finish in queue order"
        self._writes_done += 1
        self.counters.pages_in_write -= len(t.host_pages)
        self.host_pool.free(t.host_pages)
        self._wake_settle()
        if self._deferred:
            self._pump_deferred()

    # --- storage reads -------------------------------------------------------------------

    async def lookup(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` (whole pages) are in the storage tier.

        Any worker may have stored them. Raises :class:`~kvoffload.InvalidTokens`, or
        :class:`~kvoffload.StorageError` when there is no storage or it cannot be reached.
        """
        from kvoffload._lookup import lookup

        return await lookup(self, tokens)

    async def fetch(self, tokens: Sequence[int], n: int) -> list[bytes]:
        """The stored bytes of the pages of ``tokens[:n]`` (``n`` a multiple of page_size),
        each read under its chain key and checked against it.

        Returns the leading pages found, in order: fewer than ``n // page_size`` when a
        page is missing, corrupt or of the wrong size (never a wrong page). Raises like
        :meth:`lookup`.
        """
        from kvoffload._lookup import fetch

        return await fetch(self, tokens, n)

    # --- waiting -------------------------------------------------------------------------

    async def settle(self) -> None:
        """Return once every completion the backend has signalled so far was delivered
        and every storage write queued so far finished. On a closed manager, where
        nothing is left to deliver or write, raises :class:`~kvoffload.KVOffloadError`
        instead of waiting for ever."""
        delivered = self.backend.signalled
        while self._delivered < delivered:
            await self._wait_progress()
        # The writes queued so far - by those deliveries too - are done when as many
        # writes have finished (they finish in queue order).
        written = self._writes_done + len(self._writes)
        while self._writes_done < written:
            await self._wait_progress()

    async def _wait_progress(self) -> None:
        """Wait for the next delivery batch or finished write (or the close)."""
        if self._closed:
            raise KVOffloadError("the manager is closed: nothing will deliver or write what is left")
        if self._settle_ev is None:
            self._settle_ev = anyio.Event()
        await self._settle_ev.wait()

    async def wait_drained(self) -> None:
        """Wait until no chunk is in flight, deferred or waiting for its storage write.
        Raises :class:`~kvoffload.KVOffloadError` once the manager is closed with some
        left (it was left before they drained; nothing will finish them)."""
        while self._inflight or self._deferred or self._writes:
            await self._wait_progress()
            if self._deferred:
                self._pump_deferred()

    def tick(self) -> None:
        """Run the time-based checks now (deferral expiry, watchdog). The background task
        calls this every ``watchdog_interval_s``; tests with a virtual clock call it."""
        if self._deferred:
            self._pump_deferred()
        if self.config.stuck_after_s is not None:
            from kvoffload._watchdog import report_stuck

            report_stuck(self)

    async def _tick_loop(self) -> None:
        interval = self.config.watchdog_interval_s
        if self.config.on_host_full == "wait":
            interval = min(interval, max(self.config.host_wait_s / 4, 0.001))
        while True:
            await anyio.sleep(interval)
            self.tick()

    # --- observability -------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event_name, fields)`` for every event; returns a remover."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def statistics(self) -> Statistics:
        """A frozen snapshot of the manager's state and counters."""
        sc = self._state_counts
        return Statistics(
            live_lifecycles=len(self._live),
            pending=sc[0],
            offloading=sc[1],
            finishing=sc[2],
            device_pages_used=self.device_pool.used,
            device_pages_total=self.device_pool.n_pages,
            host_pages_used=self.host_pool.used,
            host_pages_total=self.host_pool.n_pages,
            **self.counters.as_dict(),  # every counter is a Statistics field of its name
        )

    def check_invariants(self) -> None:
        """Raise :class:`~kvoffload.InvariantViolation` if the ledger does not balance
        (ARCHITECTURE.md rules 1-6). Tests call it after every step."""
        from kvoffload._ledger import check

        check(self)

    def __repr__(self) -> str:
        return (
            f"<OffloadManager backend={self.backend.name} live={len(self._live)} "
            f"inflight={len(self._inflight)}>"
        )
