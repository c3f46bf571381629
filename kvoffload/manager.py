"""OffloadManager: admit / extend / finish / abort, the registry, statistics.

Bookkeeping only: every method here is plain ``def`` and never awaits, except the
``wait_*``/``settle`` methods and the background tasks (completion delivery, storage
writes, the watchdog), which the manager owns in one anyio task group.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from kvoffload._events import Listener, debug_enabled, logger
from kvoffload.abc import Completion, EventBackend, Storage, Transfer
from kvoffload.config import OffloadConfig
from kvoffload.errors import DrainTimeout, KVOffloadError
from kvoffload.keys import chain_keys_packed, pack_tokens, validate_tokens
from kvoffload.lifecycle.core import STATES, Lifecycle, LifecycleId
from kvoffload.lifecycle.spec import LifecycleState, Outcome
from kvoffload.lifecycle.table import EVENT_INDEX, EVENT_NAMES, TABLE, validate
from kvoffload.stats import Counters, Statistics

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from kvoffload.pools import DevicePool, HostPool

__all__ = ["OffloadManager"]

_EXTEND = EVENT_INDEX["extend"]
_SUBMIT = EVENT_INDEX["submit"]
_DONE = EVENT_INDEX["chunk_done"]
_FAILED = EVENT_INDEX["chunk_failed"]
_DROPPED = EVENT_INDEX["chunk_dropped"]
_FINISH = EVENT_INDEX["finish"]
_ABORT = EVENT_INDEX["abort"]
_RELEASED = LifecycleState.RELEASED.value
_DROP_LOG_INTERVAL_S = 5.0

_spec_validated = False


class OffloadManager:
    """Offloads the KV of admitted requests, chunk by chunk, while they decode.

    ``async with OffloadManager(config, backend="sim", storage=None) as mgr:`` — the
    backend and storage are a name (``"sim"``, ``"cpu"``, ``"cuda"``; ``"memory"``, a
    directory path, a ``redis://`` URL) or an instance. Leaving the context waits for
    in-flight copies (F16), at most ``config.drain_timeout_s``.

    All methods are called from the event loop thread that entered the context.
    """

    def __init__(
        self,
        config: OffloadConfig,
        *,
        backend: str | EventBackend = "sim",
        storage: str | Storage | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        global _spec_validated
        if not _spec_validated:
            validate()
            _spec_validated = True
        from kvoffload.backends import resolve_backend
        from kvoffload.storage import resolve_storage

        self.config = config
        self.backend: EventBackend = resolve_backend(backend)
        self.storage: Storage | None = resolve_storage(storage)
        self.clock = clock
        self.device_pool: DevicePool
        self.host_pool: HostPool
        self.device_pool, self.host_pool = self.backend.create_pools(config)
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
        self._write_ev: anyio.Event | None = None
        self.counters = Counters()
        self._delivered = 0
        self._settle_ev: anyio.Event | None = None
        self._listeners: list[Listener] = []
        self._stuck_reported: set[tuple[LifecycleId, float]] = set()
        self._last_drop_log = -1e18
        self._drops_since_log = 0
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
        try:
            with anyio.fail_after(self.config.drain_timeout_s):
                await self.wait_drained()
        except TimeoutError:
            stuck = list(self._inflight.values())
            logger.error("manager.drain_timeout", inflight=len(stuck), transfers=[repr(t) for t in stuck[:8]])
            timeout_error = DrainTimeout(
                f"{len(stuck)} copies still in flight after {self.config.drain_timeout_s}s: "
                f"{stuck[:4]!r}; their pages were not freed"
            )
        finally:
            self._open = False
            self._closed = True
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
        if timeout_error is not None and exc is None:
            raise timeout_error
        return None

    # --- registry ------------------------------------------------------------------------

    def admit(self, rid: Any, prompt: Sequence[int]) -> Lifecycle:
        """Admit a request: allocate device pages for ``prompt`` and return its new
        lifecycle, in PENDING (or OFFLOADING when ``offload_prompt`` submits the prompt).

        ``rid`` is a label: it may equal a live lifecycle's rid (a reused request id);
        the two never share state. Raises :class:`~kvoffload.InvalidTokens` or
        :class:`~kvoffload.PoolExhausted` with nothing changed.
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
        if self._listeners or debug_enabled():
            self._emit("lifecycle.admitted", lc, prompt_tokens=n, device_pages=len(pages))
        if cfg.offload_prompt and aligned:
            self._submit(lc, aligned)
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

    # --- events --------------------------------------------------------------------------

    def _check(self, lc: Lifecycle, e: int) -> None:
        if TABLE[lc._s][e][0] < 0:
            self._illegal(lc, e)

    def _illegal(self, lc: Lifecycle, e: int) -> None:
        from kvoffload.errors import InvalidTransition

        raise InvalidTransition(lc, STATES[lc._s], EVENT_NAMES[e])

    def _fire(self, lc: Lifecycle, e: int) -> None:
        """Apply event ``e`` to ``lc`` after its effect on the counts: one table step."""
        s = lc._s
        dest = TABLE[s][e][((lc.inflight > 0) << 1) | (lc._deferred_since is not None)]
        if dest < 0:
            self._illegal(lc, e)
        if dest != s:
            counts = self._state_counts
            counts[s] -= 1
            lc._s = dest
            lc.state_since = self.clock()
            if dest == _RELEASED:
                if self._listeners or debug_enabled():
                    self._emit_transition(lc, s, dest, e)
                self._release(lc)
                return
            counts[dest] += 1
        if self._listeners or debug_enabled():
            self._emit_transition(lc, s, dest, e)

    def _extend(self, lc: Lifecycle, tokens: Sequence[int]) -> None:
        if TABLE[lc._s][_EXTEND][0] < 0:
            self._illegal(lc, _EXTEND)
        toks = validate_tokens(tokens)
        n = len(toks)
        committed = lc.committed + n
        ps = self.config.page_size
        need = -(-committed // ps) - len(lc.device_pages)
        if need > 0:
            lc.device_pages += self.device_pool.allocate(need)
        lc.committed = committed
        lc._tail += toks
        self._fire(lc, _EXTEND)
        if committed >= lc.due and lc._deferred_since is None:
            pending = committed - lc.submitted
            self._submit(lc, pending - pending % self.config.stride)

    def _finish(self, lc: Lifecycle) -> None:
        self._check(lc, _FINISH)
        if lc._deferred_since is None:
            pending = lc.committed - lc.submitted
            self._submit(lc, pending - pending % self.config.page_size)
        self._fire(lc, _FINISH)

    def _abort(self, lc: Lifecycle) -> None:
        self._check(lc, _ABORT)
        lc._aborted = True
        if lc._deferred_since is not None:
            lc._deferred_since = None
            self._deferred.remove(lc)
            self._notify_quiet(lc)
        self._fire(lc, _ABORT)

    # --- chunks --------------------------------------------------------------------------

    def _submit(self, lc: Lifecycle, n: int) -> bool:
        """Submit the next ``n`` tokens (page-aligned) of ``lc`` as one chunk.

        Order (F10): host pages first, then the backend submit, then the bookkeeping and
        the state. A full host pool drops (or defers) the chunk with nothing changed but
        the drop counters and ``lc.due``. Returns whether a chunk was submitted.
        """
        cfg = self.config
        ps = cfg.page_size
        n = min(n, cfg.host_pages * ps)
        if n <= 0:
            return False
        npages = n // ps
        host = self.host_pool.try_allocate(npages)
        if host is None:
            self._host_full(lc, npages)
            return False
        first = lc.submitted // ps
        packed = pack_tokens(lc._tail[:n])
        keys = chain_keys_packed(lc.chain_key, packed, ps)
        now = self.clock()
        t = Transfer(lc, lc.device_pages[first : first + npages], host, keys, lc.submitted, n, now)
        try:
            self.backend.submit(t)
        except BaseException:
            self.host_pool.free(host)
            raise
        del lc._tail[:n]
        lc.submitted += n
        lc.chain_key = keys[-1]
        lc.due = lc.submitted + cfg.stride
        lc.inflight += 1
        self._inflight[t.id] = t
        c = self.counters
        c.chunks_submitted += 1
        c.chunks_inflight += 1
        c.pages_submitted += npages
        c.pages_inflight += npages
        if self._listeners or debug_enabled():
            self._emit(
                "transfer.submitted", lc, transfer=t.id, pages=npages, tokens=n, first_token=t.first_token
            )
        self._fire(lc, _SUBMIT)
        return True

    def _host_full(self, lc: Lifecycle, npages: int) -> None:
        c = self.counters
        if self.config.on_host_full == "wait":
            if lc._deferred_since is None:
                lc._deferred_since = self.clock()
                self._deferred.append(lc)
                c.chunks_deferred += 1
                if self._listeners or debug_enabled():
                    self._emit("chunk.deferred", lc, pages=npages)
            return
        self._drop(lc, npages)

    def _drop(self, lc: Lifecycle, npages: int) -> None:
        c = self.counters
        c.chunks_dropped += 1
        c.pages_dropped += npages
        lc.due = lc.committed + self.config.stride  # retry one stride later (F9)
        self._drops_since_log += 1
        now = self.clock()
        if now - self._last_drop_log >= _DROP_LOG_INTERVAL_S:
            logger.warning(
                "chunk.dropped",
                rid=lc.rid,
                lifecycle=lc.id,
                pages=npages,
                drops_since_last_log=self._drops_since_log,
                host_pages_free=self.host_pool.free_pages,
            )
            self._last_drop_log = now
            self._drops_since_log = 0
        if self._listeners:
            self._emit("chunk.dropped", lc, pages=npages)

    def _pump_deferred(self) -> None:
        """Submit deferred chunks, oldest first, while host pages last; drop the expired."""
        q = self._deferred
        cfg = self.config
        now = self.clock()
        while q:
            lc = q[0]
            since = lc._deferred_since
            if since is None or lc._s == _RELEASED:
                q.popleft()
                continue
            pending = lc.committed - lc.submitted
            final = lc._s == 2
            n = pending - pending % (cfg.page_size if final else cfg.stride)
            n = min(n, cfg.host_pages * cfg.page_size)
            if now - since > cfg.host_wait_s:
                q.popleft()
                lc._deferred_since = None
                self._drop(lc, n // cfg.page_size)
                self._notify_quiet(lc)
                self._fire(lc, _DROPPED)
                continue
            if n <= 0 or self.host_pool.free_pages < n // cfg.page_size:
                if n <= 0:  # nothing left to send (cannot happen today; be safe)
                    q.popleft()
                    lc._deferred_since = None
                    self._notify_quiet(lc)
                    self._fire(lc, _DROPPED)
                    continue
                break
            q.popleft()
            lc._deferred_since = None
            self._submit(lc, n)

    # --- completions ---------------------------------------------------------------------

    def _deliver(self, t: Transfer, error: BaseException | None) -> None:
        """Apply one completion to the lifecycle that issued it (the transfer holds it)."""
        if self._inflight.pop(t.id, None) is None:
            raise KVOffloadError(f"{t!r} completed twice or was never submitted")
        lc = t.lifecycle
        now = self.clock()
        t.completed_at = now
        t.error = error
        npages = len(t.host_pages)
        c = self.counters
        c.chunks_inflight -= 1
        c.pages_inflight -= npages
        lc.inflight -= 1
        free_host = True
        if error is not None:
            lc._failed = True
            c.chunks_failed += 1
            c.pages_failed += npages
            e = _FAILED
            logger.warning("transfer.failed", rid=lc.rid, lifecycle=lc.id, transfer=t.id, error=repr(error))
            if self._listeners:
                self._emit("transfer.failed", lc, transfer=t.id, pages=npages, error=repr(error))
        elif lc._aborted:
            c.chunks_discarded += 1
            c.pages_discarded += npages
            e = _DONE
            if self._listeners or debug_enabled():
                self._emit("transfer.discarded", lc, transfer=t.id, pages=npages)
        else:
            c.chunks_copied += 1
            c.pages_copied += npages
            e = _DONE
            if self.storage is not None:
                free_host = False
                c.pages_in_write += npages
                self._writes.append(t)
                if self._write_ev is not None:
                    self._write_ev.set()
            else:
                c.pages_not_stored += npages
            if self._listeners or debug_enabled():
                self._emit(
                    "transfer.completed",
                    lc,
                    transfer=t.id,
                    pages=npages,
                    latency_s=now - t.submitted_at,
                )
        if free_host:
            self.host_pool.free(t.host_pages)
        self._fire(lc, e)
        if lc.inflight == 0:
            self._notify_quiet(lc)
        if free_host and self._deferred:
            self._pump_deferred()

    def _notify_quiet(self, lc: Lifecycle) -> None:
        ev = lc._quiet_ev
        if ev is not None and lc.quiescent:
            lc._quiet_ev = None
            ev.set()

    def _release(self, lc: Lifecycle) -> None:
        """RELEASED: the one place device pages are returned (F2-F8). Runs once per
        lifecycle because RELEASED is terminal in the table."""
        assert lc.inflight == 0 and lc._deferred_since is None, "released with a copy pending"
        pages = lc.device_pages
        lc.device_pages = []
        self.device_pool.free(pages)
        lc._tail = lc._tail[:0]
        outcome = Outcome.ABORTED if lc._aborted else Outcome.FAILED if lc._failed else Outcome.COMPLETED
        lc.outcome = outcome
        del self._live[lc.id]
        c = self.counters
        if outcome is Outcome.COMPLETED:
            c.released_completed += 1
        elif outcome is Outcome.ABORTED:
            c.released_aborted += 1
        else:
            c.released_failed += 1
        if self._listeners or debug_enabled():
            self._emit("lifecycle.released", lc, outcome=outcome.value, device_pages=len(pages))
        ev = lc._released_ev
        if ev is not None:
            lc._released_ev = None
            ev.set()
        self._notify_quiet(lc)

    async def _deliver_loop(self) -> None:
        backend = self.backend
        while True:
            # No local names the batch: while this task waits for the next one it must
            # hold no transfer, hence no lifecycle (F2; found by the property suite).
            self._deliver_batch(await backend.wait_completions())

    def _deliver_batch(self, batch: list[Completion]) -> None:
        for t, err in batch:
            self._deliver(t, err)
        self._delivered += len(batch)
        self._wake_settle()

    def _wake_settle(self) -> None:
        ev = self._settle_ev
        if ev is not None:
            self._settle_ev = None
            ev.set()

    # --- storage write-behind ------------------------------------------------------------

    async def _write_loop(self) -> None:
        from kvoffload._writer import write_chunk

        assert self.storage is not None
        while True:
            if not self._writes:
                self._write_ev = anyio.Event()
                await self._write_ev.wait()
                self._write_ev = None
                continue
            t = self._writes[0]
            await write_chunk(self, self.storage, t)
            self._writes.popleft()
            self.counters.pages_in_write -= len(t.host_pages)
            self.host_pool.free(t.host_pages)
            del t  # hold no transfer (nor its lifecycle) while waiting for the next (F2)
            self._wake_settle()
            if self._deferred:
                self._pump_deferred()

    # --- waiting -------------------------------------------------------------------------

    async def settle(self) -> None:
        """Return once every completion the backend has signalled so far was delivered
        and every storage write queued so far finished."""
        while self._delivered < self.backend.signalled or self._writes:
            if self._settle_ev is None:
                self._settle_ev = anyio.Event()
            await self._settle_ev.wait()

    async def wait_drained(self) -> None:
        """Wait until no chunk is in flight, deferred or waiting for its storage write."""
        while self._inflight or self._deferred or self._writes:
            if self._settle_ev is None:
                self._settle_ev = anyio.Event()
            await self._settle_ev.wait()
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

    def _emit(self, name: str, lc: Lifecycle, **fields: Any) -> None:
        fields["lifecycle"] = lc.id
        fields["rid"] = lc.rid
        fields["t"] = self.clock()
        for fn in self._listeners:
            fn(name, fields)
        if debug_enabled():
            log = lc._log
            if log is None:
                log = lc._log = logger.bind(lifecycle=lc.id, rid=lc.rid)
            log.debug(name, **{k: v for k, v in fields.items() if k not in ("lifecycle", "rid")})

    def _emit_transition(self, lc: Lifecycle, s: int, dest: int, e: int) -> None:
        self._emit(
            "lifecycle.transition",
            lc,
            trigger=EVENT_NAMES[e],
            **{"from": STATES[s].name, "to": STATES[dest].name},
        )

    def statistics(self) -> Statistics:
        """A frozen snapshot of the manager's state and counters."""
        c = self.counters
        sc = self._state_counts
        return Statistics(
            live_lifecycles=len(self._live),
            pending=sc[0],
            offloading=sc[1],
            finishing=sc[2],
            admitted=c.admitted,
            released_completed=c.released_completed,
            released_aborted=c.released_aborted,
            released_failed=c.released_failed,
            device_pages_used=self.device_pool.used,
            device_pages_total=self.device_pool.n_pages,
            host_pages_used=self.host_pool.used,
            host_pages_total=self.host_pool.n_pages,
            chunks_inflight=c.chunks_inflight,
            chunks_submitted=c.chunks_submitted,
            chunks_copied=c.chunks_copied,
            chunks_discarded=c.chunks_discarded,
            chunks_failed=c.chunks_failed,
            chunks_dropped=c.chunks_dropped,
            chunks_deferred=c.chunks_deferred,
            pages_inflight=c.pages_inflight,
            pages_submitted=c.pages_submitted,
            pages_copied=c.pages_copied,
            pages_discarded=c.pages_discarded,
            pages_failed=c.pages_failed,
            pages_dropped=c.pages_dropped,
            pages_stored=c.pages_stored,
            pages_store_failed=c.pages_store_failed,
            pages_store_retried=c.pages_store_retried,
            pages_in_write=c.pages_in_write,
            pages_not_stored=c.pages_not_stored,
            stuck_reports=c.stuck_reports,
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
