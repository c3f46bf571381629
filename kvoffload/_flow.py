"""The lifecycle engine: events, chunks and completions, as one step each.

:class:`LifecycleFlow` is the part of :class:`~kvoffload.OffloadManager` that applies
events to lifecycles through the compiled table, submits chunks (host pages first,
F10), handles a full host pool (drop or defer, F9), delivers completions to the
lifecycle that issued them (F1) and releases device pages exactly once (F2-F8). Every
method is a plain ``def``: each runs to completion on the event loop thread and never
awaits. The manager (``manager.py``) owns the registry, the context, the background
tasks and the public surface; it inherits these steps so the hot path stays a single
method call.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload._events import STRUCTLOG, Listener, RateLimit, debug_enabled, logger
from kvoffload.abc import Completion, EventBackend, Storage, Transfer
from kvoffload.config import OffloadConfig
from kvoffload.errors import InvalidTransition, KVOffloadError
from kvoffload.keys import chain_keys_packed, pack_tokens, validate_tokens
from kvoffload.lifecycle.core import STATES, Lifecycle, LifecycleId
from kvoffload.lifecycle.spec import LifecycleState, Outcome
from kvoffload.lifecycle.table import EVENT_INDEX, EVENT_NAMES, TABLE
from kvoffload.stats import Counters

if TYPE_CHECKING:
    import anyio

    from kvoffload.pools import DevicePool, HostPool

__all__ = ["LifecycleFlow", "notify_listeners"]

_EXTEND = EVENT_INDEX["extend"]
_SUBMIT = EVENT_INDEX["submit"]
_DONE = EVENT_INDEX["chunk_done"]
_FAILED = EVENT_INDEX["chunk_failed"]
_DROPPED = EVENT_INDEX["chunk_dropped"]
_FINISH = EVENT_INDEX["finish"]
_ABORT = EVENT_INDEX["abort"]
_RELEASED = LifecycleState.RELEASED.value
#: TABLE's chunk_done row of each state (by guard bits): the delivery loop's one lookup.
_DONE_ROWS = tuple(row[_DONE] for row in TABLE)


#: Rate limits of ``listener.failed`` lines, by event name.
_LISTENER_FAILURES: dict[str, RateLimit] = {}


def notify_listeners(listeners: list[Listener], name: str, fields: dict[str, Any]) -> None:
    """Call every listener with event ``name``. The manager calls this in the middle of
    a synchronous step: a listener that raises is logged (``listener.failed``) and the
    step goes on, so a listener's bug never leaves the ledger half changed."""
    for fn in tuple(listeners):  # a listener may remove itself (or another) while called
        try:
            fn(name, fields)
        except Exception as exc:
            limit = _LISTENER_FAILURES.get(name)
            if limit is None:
                limit = _LISTENER_FAILURES[name] = RateLimit()
            held = limit.due(time.monotonic())
            if held:  # a listener that fails on every event: a line per event name per interval
                logger.error(
                    "listener.failed",
                    listener=repr(fn),
                    event_name=name,
                    error=repr(exc),
                    failures_since_last_log=held,
                )


class LifecycleFlow:
    """The manager's synchronous steps. State is set up by ``OffloadManager.__init__``;
    its meaning and invariants are written there."""

    config: OffloadConfig
    backend: EventBackend
    storage: Storage | None
    clock: Callable[[], float]
    device_pool: DevicePool
    host_pool: HostPool
    page_bytes: int
    counters: Counters
    _live: dict[LifecycleId, Lifecycle]
    _state_counts: list[int]
    _inflight: dict[int, Transfer]
    _deferred: deque[Lifecycle]
    _writes: deque[Transfer]
    _write_ev: anyio.Event | None
    _listeners: list[Listener]
    _drop_log: RateLimit
    _failure_log: RateLimit
    _closed: bool

    # --- events --------------------------------------------------------------------------

    def _check(self, lc: Lifecycle, e: int) -> None:
        if TABLE[lc._s][e][0] < 0:
            self._illegal(lc, e)

    def _illegal(self, lc: Lifecycle, e: int) -> None:
        raise InvalidTransition(lc, STATES[lc._s], EVENT_NAMES[e])

    def _fire(self, lc: Lifecycle, e: int, now: float | None = None) -> None:
        """Apply event ``e`` to ``lc`` after its effect on the counts: one table step."""
        s = lc._s
        dest = TABLE[s][e][((lc.inflight > 0) << 1) | (lc._deferred_since is not None)]
        if dest < 0:
            self._illegal(lc, e)
        if dest != s:
            counts = self._state_counts
            counts[s] -= 1
            lc._s = dest
            lc.state_since = self.clock() if now is None else now
            if dest == _RELEASED:
                if self._listeners or (STRUCTLOG.is_configured and debug_enabled()):
                    self._emit_transition(lc, s, dest, e)
                self._release(lc)
                return
            counts[dest] += 1
        if self._listeners or (STRUCTLOG.is_configured and debug_enabled()):
            self._emit_transition(lc, s, dest, e)

    def _extend(self, lc: Lifecycle, tokens: Sequence[int]) -> None:
        self._check(lc, _EXTEND)
        toks = validate_tokens(tokens)
        n = len(toks)
        committed = lc.committed + n
        ps = self.config.page_size
        held = len(lc.device_pages)
        need = -(-committed // ps) - held
        if need > 0:
            lc.device_pages += self.device_pool.allocate(need)
            lc._cap = len(lc.device_pages) * ps
        lc.committed = committed
        lc._tail += toks
        self._fire(lc, _EXTEND)
        if committed >= lc.due and lc._deferred_since is None:
            pending = committed - lc.submitted
            try:
                self._submit(lc, pending - pending % self.config.stride)
            except BaseException:  # the backend refused: extend is all or nothing
                del lc._tail[len(lc._tail) - n :]
                lc.committed = committed - n
                if need > 0:
                    self.device_pool.free(lc.device_pages[held:])
                    del lc.device_pages[held:]
                    lc._cap = held * ps
                raise

    def _finish(self, lc: Lifecycle) -> None:
        self._check(lc, _FINISH)
        self._flush(lc)
        self._fire(lc, _FINISH)

    def _flush(self, lc: Lifecycle) -> None:
        """The tail flush (F12): submit every whole page not yet submitted, one host-sized
        chunk at a time, until none is left or one finds the host pool full (then the
        policy counts a drop or defers the rest; F9). Never a silent skip."""
        ps = self.config.page_size
        while lc._deferred_since is None:
            pending = lc.committed - lc.submitted
            if pending < ps or not self._submit(lc, pending - pending % ps):
                return

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
        the drop counters and ``lc.due``. Returns whether a chunk was submitted. Raises
        :class:`~kvoffload.KVOffloadError` (nothing changed) once the manager is closing:
        nothing would deliver the chunk's completion.
        """
        if self._closed:
            raise KVOffloadError(f"{lc!r}: the manager is closed, no copy can start; abort() releases it")
        cfg = self.config
        ps = cfg.page_size
        wanted = n // ps  # a drop counts every page not sent, beyond one host-sized chunk too
        n = min(n, cfg.host_pages * ps)
        if n <= 0:
            return False
        npages = n // ps
        host = self.host_pool.try_allocate(npages)
        if host is None:
            self._host_full(lc, wanted)
            return False
        first = lc.submitted // ps
        packed = pack_tokens(lc._tail[:n])
        keys = chain_keys_packed(lc.chain_key, packed, ps)
        now = self.clock()
        stream = lc.id % self.backend.streams  # a lifecycle's chunks share one stream, in order
        t = Transfer(lc, lc.device_pages[first : first + npages], host, keys, lc.submitted, n, now, stream)
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
        if self._listeners or (STRUCTLOG.is_configured and debug_enabled()):
            self._emit(
                "transfer.submitted",
                lc,
                transfer=t.id,
                pages=npages,
                bytes=npages * self.page_bytes,
                tokens=n,
                first_token=t.first_token,
                stream=t.stream,
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
                if self._listeners or (STRUCTLOG.is_configured and debug_enabled()):
                    self._emit("chunk.deferred", lc, pages=npages, bytes=npages * self.page_bytes)
            return
        self._drop(lc, npages)

    def _drop(self, lc: Lifecycle, npages: int) -> None:
        c = self.counters
        c.chunks_dropped += 1
        c.pages_dropped += npages
        lc.due = lc.committed + self.config.stride  # retry one stride later (F9)
        held = self._drop_log.due(self.clock())
        if held:
            logger.warning(
                "chunk.dropped",
                rid=lc.rid,
                lifecycle=lc.id,
                pages=npages,
                drops_since_last_log=held,
                host_pages_free=self.host_pool.free_pages,
            )
        if self._listeners:
            self._emit("chunk.dropped", lc, pages=npages, bytes=npages * self.page_bytes)

    def _pump_deferred(self) -> None:
        """Submit deferred chunks, oldest first, while host pages last; drop the expired.
        Does nothing once the manager is closing: no chunk may start (see ``_submit``),
        and a background task that runs in that window must not fail on one."""
        if self._closed:
            return
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
            wanted = pending - pending % (cfg.page_size if final else cfg.stride)
            n = min(wanted, cfg.host_pages * cfg.page_size)
            if now - since > cfg.host_wait_s:
                q.popleft()
                lc._deferred_since = None
                self._drop(lc, wanted // cfg.page_size)  # every page not sent, as _submit counts
                self._notify_quiet(lc)
                self._fire(lc, _DROPPED)
                continue
            if n <= 0:  # nothing left to send (a prompt chunk sent with a later one; be safe)
                q.popleft()
                lc._deferred_since = None
                self._notify_quiet(lc)
                self._fire(lc, _DROPPED)
                continue
            if self.host_pool.free_pages < n // cfg.page_size:
                break  # FIFO: later ones wait behind this one
            q.popleft()
            lc._deferred_since = None
            if final:
                self._flush(lc)  # may defer the rest again: it rejoins the queue
            else:
                self._submit(lc, n)

    # --- completions ---------------------------------------------------------------------

    def _deliver(self, t: Transfer, error: BaseException | None, now: float | None = None) -> None:
        """Apply one completion to the lifecycle that issued it (the transfer holds it).
        ``now``: the delivery time (one clock read per batch), else read here. A subclass
        may override this hook: the manager's batch loop then calls it per completion."""
        self._deliver_all(((t, error),), self.clock() if now is None else now)

    def _deliver_all(self, batch: Iterable[Completion], now: float) -> None:
        """Apply completions in order, each exactly as one :meth:`_deliver` would, doing
        once per batch what need not be done per completion: the observed gate, the
        ledger writes and the host-page return of copied chunks (one checked
        ``PagePool.free``). Raises :class:`~kvoffload.KVOffloadError` on a completion
        delivered twice, :class:`~kvoffload.PageError` on a host double free,
        :class:`~kvoffload.InvalidTransition` from the table.

        Invariant: what the loop holds back (``chunks``/``pages``/``held``) is written
        to the counters and the host pool (``_credit``) before anything can read them -
        a log line or listener, ``_fire``'s full path (release, events, a subclass's
        hook), ``_pump_deferred`` - and on the way out, normally or by an exception.
        """
        inflight = self._inflight
        rows = _DONE_ROWS
        counts = self._state_counts
        fire = self._fire
        hooked = type(self)._fire is not LifecycleFlow._fire  # a subclass's hook sees every event
        observed = bool(self._listeners) or (STRUCTLOG.is_configured and debug_enabled())
        store = self.storage is not None
        writes = self._writes
        chunks = pages = 0  # copied chunks (and their pages) not yet in the counters
        held: list[int] = []  # their host pages, not yet returned (none with storage)
        try:
            for t, error in batch:
                if inflight.pop(t.id, None) is None:
                    raise KVOffloadError(f"{t!r} completed twice or was never submitted")
                lc = t.lifecycle
                t.completed_at = now
                t.error = error
                lc.inflight -= 1
                if error is None and not (observed or hooked or lc._aborted or self._deferred):
                    s = lc._s
                    dest = rows[s][((lc.inflight > 0) << 1) | (lc._deferred_since is not None)]
                    if 0 <= dest != _RELEASED:
                        # Copied, nothing to emit, release or pump: the ledger waits for the
                        # batch (or the next full path) and TABLE's step is applied here.
                        chunks += 1
                        host = t.host_pages
                        pages += len(host)
                        if store:
                            writes.append(t)
                            if self._write_ev is not None:
                                self._write_ev.set()
                        else:
                            held += host
                        if dest != s:
                            counts[s] -= 1
                            lc._s = dest
                            lc.state_since = now
                            counts[dest] += 1
                        if lc._quiet_ev is not None:
                            self._notify_quiet(lc)
                        continue
                # The full path, one completion at a time, on a balanced ledger.
                if chunks:
                    credit = chunks, pages, held
                    chunks = pages = 0
                    held = []
                    self._credit(*credit)
                e = self._account(t, error, now)
                fire(lc, e, now)
                if lc._quiet_ev is not None:
                    self._notify_quiet(lc)
                if self._deferred and (error is not None or lc._aborted or not store):
                    self._pump_deferred()  # host pages came back
                observed = bool(self._listeners) or (STRUCTLOG.is_configured and debug_enabled())
        finally:
            if chunks:
                self._credit(chunks, pages, held)

    def _credit(self, chunks: int, pages: int, held: list[int]) -> None:
        """Write ``chunks`` copied chunks of ``pages`` pages to the ledger and return
        ``held``, their host pages (none while a storage tier writes them behind)."""
        c = self.counters
        c.chunks_inflight -= chunks
        c.pages_inflight -= pages
        c.chunks_copied += chunks
        c.pages_copied += pages
        if self.storage is not None:
            c.pages_in_write += pages
        else:
            c.pages_not_stored += pages
        if held:
            self.host_pool.free(held)

    def _account(self, t: Transfer, error: BaseException | None, now: float) -> int:
        """The ledger part of one completion, written at once, then its log line and
        events (the ledger balances when they run). Returns the event to fire."""
        lc = t.lifecycle
        host = t.host_pages
        npages = len(host)
        c = self.counters
        if error is not None:
            lc._failed = True
            c.chunks_inflight -= 1
            c.pages_inflight -= npages
            c.chunks_failed += 1
            c.pages_failed += npages
            self.host_pool.free(host)
            held = self._failure_log.due(now)
            if held:  # a failing device fails every copy: one line per burst interval
                logger.warning(
                    "transfer.failed",
                    rid=lc.rid,
                    lifecycle=lc.id,
                    transfer=t.id,
                    error=repr(error),
                    failures_since_last_log=held,
                )
            if self._listeners:
                self._emit_delivery("transfer.failed", t, now, error=repr(error))
            return _FAILED
        if lc._aborted:
            c.chunks_inflight -= 1
            c.pages_inflight -= npages
            c.chunks_discarded += 1
            c.pages_discarded += npages
            self.host_pool.free(host)
            name = "transfer.discarded"
        elif self.storage is not None:
            self._writes.append(t)
            if self._write_ev is not None:
                self._write_ev.set()
            self._credit(1, npages, [])
            name = "transfer.completed"
        else:
            self._credit(1, npages, host)
            name = "transfer.completed"
        if self._listeners or (STRUCTLOG.is_configured and debug_enabled()):
            self._emit_delivery(name, t, now)
        return _DONE

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
        if self._listeners or (STRUCTLOG.is_configured and debug_enabled()):
            self._emit("lifecycle.released", lc, outcome=outcome.value, device_pages=len(pages))
        ev = lc._released_ev
        if ev is not None:
            lc._released_ev = None
            ev.set()
        self._notify_quiet(lc)

    # --- events out ----------------------------------------------------------------------

    def _emit(self, name: str, lc: Lifecycle, **fields: Any) -> None:
        fields["lifecycle"] = lc.id
        fields["rid"] = lc.rid
        fields["t"] = self.clock()
        if self._listeners:
            notify_listeners(self._listeners, name, fields)
        if debug_enabled():
            log = lc._log
            if log is None:
                log = lc._log = logger.bind(lifecycle=lc.id, rid=lc.rid)
            log.debug(name, **{k: v for k, v in fields.items() if k not in ("lifecycle", "rid")})

    def _emit_delivery(self, name: str, t: Transfer, now: float, **extra: Any) -> None:
        npages = len(t.host_pages)
        self._emit(
            name,
            t.lifecycle,
            transfer=t.id,
            pages=npages,
            bytes=npages * self.page_bytes,
            latency_s=now - t.submitted_at,
            **extra,
        )

    def _emit_transition(self, lc: Lifecycle, s: int, dest: int, e: int) -> None:
        self._emit(
            "lifecycle.transition",
            lc,
            trigger=EVENT_NAMES[e],
            **{"from": STATES[s].name, "to": STATES[dest].name},
        )
