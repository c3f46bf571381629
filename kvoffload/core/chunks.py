"""Chunks: host pages, copies in flight in submission order, drops and holes, and the
delivery of completions.

A chunk is the next whole pages of a lifecycle, copied to host pages as one
:class:`~kvoffload.abc.Transfer`. :meth:`Chunks.submit` sends one; the batched decode
step stages many (:meth:`Chunks.submit_run`): both take a chunk's tokens (one
host-sized chunk at most) and host pages alike and send it alike (:meth:`Chunks.send`:
the mover's ``accept``, the bookkeeping, the table step; F10). A full host pool drops
the chunk (retried a stride later) or defers it (``on_host_full="wait"``: the FIFO of
:mod:`kvoffload.core.deferral`). A failed copy is a hole: offload stops there (F33).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.abc import Completion, Transfer
from kvoffload.core.deferral import HostWait
from kvoffload.core.events import Events, RateLimit, logger
from kvoffload.core.lifecycle import Lifecycle, requiet
from kvoffload.core.registry import QUIET_MOVES, Registry
from kvoffload.core.stats import Counters
from kvoffload.core.writes import Writes
from kvoffload.errors import InvariantViolation, KVOffloadError
from kvoffload.keys import page_run_digests
from kvoffload.lifecycle.spec import LifecycleState
from kvoffload.lifecycle.table import EVENT_INDEX, TABLE

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig
    from kvoffload.pools import HostPool

__all__ = ["NEVER", "Chunks"]

_SUBMIT = EVENT_INDEX["submit"]
_DONE = EVENT_INDEX["chunk_done"]
_FAILED = EVENT_INDEX["chunk_failed"]
_DROPPED = EVENT_INDEX["chunk_dropped"]
_FINISHING = LifecycleState.FINISHING.value
_RELEASED = LifecycleState.RELEASED.value
#: ``lc.due`` once offload of a lifecycle stopped at a hole (F33): no chunk is ever due.
NEVER = 1 << 62
#: Where submit goes from each state with a copy in flight and nothing deferred.
_SUBMIT_DEST = tuple(row[_SUBMIT][2] for row in TABLE)
#: TABLE's chunk_done row of each state (by guard bits): the delivery loop's one lookup.
_DONE_ROWS = tuple(row[_DONE] for row in TABLE)


class Chunks:
    """The chunks of one core, from submission to delivery.

    ``accept(t)`` is the mover's submit: it may raise to refuse a copy, and then nothing
    changed."""

    def __init__(
        self,
        config: OffloadConfig,
        counters: Counters,
        host_pool: HostPool,
        registry: Registry,
        writes: Writes,
        wait: HostWait,
        events: Events,
        accept: Callable[[Transfer], None],
        streams: int,
        page_bytes: int,
        storage: bool,
    ) -> None:
        self.config = config
        self.counters = counters
        self.host_pool = host_pool
        self.registry = registry
        self.writes = writes
        # storage: whether a storage tier takes copied pages (then their host pages are
        # held by write jobs until it has them).
        self.storage = storage
        self.events = events
        self.accept = accept
        self.streams = streams
        self.page_bytes = page_bytes
        # The config's figures the submit path reads (a config never changes).
        self._ps = config.page_size
        self._stride = config.stride
        self._most = config.host_pages * config.page_size  # one host-sized chunk's tokens
        # inflight: transfers accepted and not yet delivered, by id, in seq order.
        # Invariant: len(self.inflight) == self.counters.chunks_inflight == sum(lc.inflight)
        self.inflight: dict[int, Transfer] = {}
        # next_seq: the seq of the next transfer submitted.
        # Invariant: all(t.seq < self.next_seq for t in self.inflight.values())
        self.next_seq = 0
        # wait: the deferral FIFO (kvoffload.core.deferral); deferred is its queue, read
        # here (the delivery loop's one check), written only there.
        self.wait = wait
        self.deferred = wait.queue
        # Rate limits of the warnings that come in bursts (F9: no log line every step).
        self._drop_log = RateLimit()
        self._failure_log = RateLimit()
        self._refusal_log = RateLimit()

    # --- submission ----------------------------------------------------------------------

    def submit(self, lc: Lifecycle, n: int, ready: Any = None, now: float | None = None) -> bool:
        """Submit the next ``n`` tokens (page-aligned) of ``lc`` as one chunk.

        A full host pool drops (or defers) the chunk with nothing changed but the drop
        counters and ``lc.due``. Returns whether a chunk was submitted. Raises
        :class:`~kvoffload.KVOffloadError` (nothing changed) once the core is closing,
        and what ``accept`` raises (host pages returned, nothing changed)."""
        if self.registry.closing:
            raise KVOffloadError(f"{lc!r}: the manager is closed, no copy can start; abort() releases it")
        if lc._stop >= 0:  # offload stopped at a hole (F33): nothing after it is sent
            return False
        wanted = n // self._ps  # a drop counts every page not sent, beyond one chunk too
        n = min(n, self._most)  # one host-sized chunk at most
        if n <= 0:
            return False
        host = self.host_pool.try_allocate(n // self._ps)
        if host is None:
            self.host_full(lc, wanted)
            return False
        digests = page_run_digests(lc._chain, lc._tail[:n], self._ps)
        try:
            self.send(lc, n, host, digests, ready, self.events.clock() if now is None else now, True)
        except BaseException:
            self.host_pool.free(host)
            raise
        return True

    def submit_run(self, run: list[Lifecycle], ready: Any, now: float, progress: list[int]) -> None:
        """The due chunks of one batched decode step: exactly :meth:`submit` of the due
        stride-aligned tokens for each lifecycle of ``run`` in order (each synced, not
        deferred, due), in stages - every chunk planned (host pages for all, in one
        ``take_each``: as each :meth:`submit` would take them), then their keys, then
        each sent - so each stage runs as one tight loop.

        ``progress[0]`` counts the lifecycles done. A mover that refuses one raises
        there: the ones before it are submitted (or dropped), it and the ones after are
        not, and every host page taken for them is back, the free list as it was."""
        if self.registry.closing:
            raise KVOffloadError(f"{run[0]!r}: the manager is closed, no copy can start; abort() releases it")
        ps, stride, most, send = self._ps, self._stride, self._most, self.send
        # run[j]'s due stride-aligned tokens wants[j], of which its chunk takes ns[j] (one
        # host-sized chunk at most), into host pages hosts[j] ([] for no tokens, None
        # where the pool had too few), under digests chains[j] (None where no pages)
        wants = [(lc._committed - lc.submitted) // stride * stride for lc in run]
        ns = [w if w < most else most for w in wants]
        hosts = self.host_pool.take_each([n // ps for n in ns])
        chains: list[Any] = [
            page_run_digests(lc._chain, lc._tail[:n], ps) if host else None
            for lc, n, host in zip(run, ns, hosts, strict=True)
        ]
        chunks = pages = 0
        sent: list[Lifecycle] = []
        try:
            for j, lc in enumerate(run):
                host = hosts[j]
                if host:
                    try:
                        send(lc, ns[j], host, chains[j], ready, now, False)
                        sent.append(lc)
                    except BaseException:
                        for h in reversed(hosts[j:]):  # last taken first: the free list as it was
                            if h:
                                self.host_pool.free(h)
                        raise
                    chunks += 1
                    pages += len(host)
                elif ns[j]:  # (0: under a stride since a dropped prompt chunk: as submit, nothing)
                    self.host_full(lc, wants[j] // ps)
                progress[0] += 1
        finally:
            self._count(chunks, pages)
            self.registry.fire_all(sent, _SUBMIT, now)

    def _count(self, chunks: int, pages: int) -> None:
        """``chunks`` chunks of ``pages`` pages were sent (counted once per call)."""
        c = self.counters
        c.chunks_submitted += chunks
        c.chunks_inflight += chunks
        c.pages_submitted += pages
        c.pages_inflight += pages

    def send(
        self,
        lc: Lifecycle,
        n: int,
        host: list[int],
        digests: list[bytes],
        ready: Any,
        now: float,
        alone: bool,
    ) -> None:
        """Send ``lc``'s next ``n`` tokens, copied into ``host`` under ``digests``: the
        mover's ``accept`` first (it may raise: nothing changed, the caller returns the
        host pages), then the tokens leave the tail, the chain moves on to the chunk's
        last page, the next chunk is due a stride on, and - ``alone`` - it is counted and
        the table steps (F10); else the caller counts and steps its run of chunks at once
        (:meth:`submit_run`)."""
        first = lc.submitted // self._ps
        stream = lc.id % self.streams  # a lifecycle's chunks share one stream, in order
        dev = lc.device_pages[first : first + len(host)]
        t = Transfer(lc, dev, host, None, lc.submitted, n, now, stream, ready, True, digests)
        t.seq = self.next_seq
        self.accept(t)
        del lc._tail[:n]
        lc.submitted += n
        lc._chain = digests[-1]
        lc.due = lc.submitted + self._stride
        lc.inflight += 1
        self.inflight[t.id] = t
        self.next_seq += 1
        events = self.events
        if lc._row < 0:  # (a batch row's fast path stays closed: its _quiet is -1)
            requiet(lc, events.observed)
        if not alone:  # the batched caller counts and steps its whole run at once
            return
        self._count(1, len(host))
        if events.observed:
            npages = len(host)
            fields = {"transfer": t.id, "pages": npages, "bytes": npages * self.page_bytes, "tokens": n}
            events.emit("transfer.submitted", lc, **fields, first_token=t.first_token, stream=t.stream)
            self.registry.fire(lc, _SUBMIT, now)
            return
        dest = _SUBMIT_DEST[lc._s]
        if dest == lc._s:  # (unobserved: a step that stays is no step)
            return
        if dest >= 0 and QUIET_MOVES[dest]:
            self.registry.move(lc, dest, now)
        else:
            self.registry.fire(lc, _SUBMIT, now)

    def flush(self, lc: Lifecycle, refusal_raises: bool = False) -> None:
        """The tail flush (F12): submit every whole page not yet submitted, one host-sized
        chunk at a time, until none is left or one finds the host pool full (then the
        policy counts a drop or defers the rest; F9). Never a silent skip. A refusal of
        the first chunk raises when ``refusal_raises`` (the caller's call changes
        nothing); a later one is contained (:meth:`refused`)."""
        ps = self.config.page_size
        first = True
        while lc._deferred_since is None:
            pending = lc.committed - lc.submitted
            if pending < ps:
                return
            try:
                if not self.submit(lc, pending - pending % ps):
                    return
            except Exception as exc:
                if refusal_raises and first:
                    raise
                self.refused(lc, pending // ps, exc)
                return
            first = False

    # --- a full host pool, a refusal, a hole ---------------------------------------------

    def host_full(self, lc: Lifecycle, npages: int) -> None:
        """``lc``'s chunk of ``npages`` found the host pool full: deferred (``"wait"``) or
        dropped."""
        if self.config.on_host_full == "wait" and not self.registry.closing:
            self.wait.defer(lc, npages)
        else:
            self.drop(lc, npages)

    def drop(self, lc: Lifecycle, npages: int) -> None:
        """Count ``lc``'s chunk of ``npages`` not sent; it is retried a stride later (F9)."""
        c = self.counters
        c.chunks_dropped += 1
        c.pages_dropped += npages
        lc.due = lc.committed + self.config.stride
        requiet(lc, self.events.observed)
        self._warn(
            self._drop_log,
            "chunk.dropped",
            lc,
            "drops_since_last_log",
            pages=npages,
            host_pages_free=self.host_pool.free_pages,
        )
        if self.events.listeners:
            self.events.emit("chunk.dropped", lc, pages=npages, bytes=npages * self.page_bytes)

    def refused(self, lc: Lifecycle, npages: int, error: BaseException) -> None:
        """The mover refused a chunk outside a caller's call (F20): the chunk is counted
        and dropped (retried one stride later while decoding); a finishing lifecycle's
        lost tail makes its outcome FAILED. Never raises."""
        c = self.counters
        c.chunks_refused += 1
        c.pages_refused += npages
        if lc._s == _FINISHING:  # its tail is lost for good
            lc._failed = True
        self._warn(
            self._refusal_log,
            "transfer.refused",
            lc,
            "refusals_since_last_log",
            pages=npages,
            error=repr(error),
        )
        if self.events.listeners:
            self.events.emit(
                "transfer.refused", lc, pages=npages, bytes=npages * self.page_bytes, error=repr(error)
            )
        self.drop(lc, npages)

    def hole(self, lc: Lifecycle, first: int) -> bool:
        """Offload of live ``lc`` stops at token ``first`` (F33): a chunk from there was
        not copied or not stored, so no page after it could ever be reached. No chunk is
        submitted from now on, a deferred one is given up, the held ones after it are
        skipped; the chunks after it still in flight are discarded when they complete.
        Returns whether a deferred chunk was given up (the caller fires chunk_dropped
        unless an event of its own follows)."""
        if 0 <= lc._stop <= first:
            return False
        lc._stop = first
        lc.due = NEVER
        requiet(lc, self.events.observed)
        if self.writes.held:
            self.writes.skip_held(lc, first)
        if lc._deferred_since is None:
            return False
        self.wait.cancel(lc)
        return True

    # --- completions ---------------------------------------------------------------------

    def complete(self, batch: Sequence[Completion], now: float) -> None:
        """Apply a batch of completions (transfer id, error), in order, each to the
        lifecycle that issued it (the transfer's ``lifecycle_id``, never its request id;
        F1). A completion that names a transfer id not in flight raises
        :class:`~kvoffload.KVOffloadError` when the loop reaches it: the completions
        before it are applied, the ledger is consistent, those after it are not."""
        c = self.counters
        n, submitted = len(self.inflight), c.chunks_submitted
        try:
            self.apply(batch, now)
        finally:  # what left flight, plus what the batch's returned host pages let go out
            c.completions_delivered += n - len(self.inflight) + c.chunks_submitted - submitted

    def apply(self, batch: Iterable[Completion], now: float) -> None:
        """Apply completions in order, each exactly as a batch of that one alone would,
        doing once per batch what need not be done per completion: the observed gate,
        the ledger writes and the host-page return of copied chunks (one checked
        ``PagePool.free``).

        Invariant: what the loop holds back (``chunks``/``pages``/``held``) is written
        to the counters and the host pool (:meth:`credit`) before anything can read them -
        a log line or listener, the table step's full path (release, events),
        :meth:`pump` - and on the way out, normally or by an exception.
        """
        inflight = self.inflight
        rows = _DONE_ROWS
        fire = self.registry.fire
        move = self.registry.move
        observed = self.events.observed
        writes = self.writes
        store = self.storage
        chunks = pages = 0  # copied chunks (and their pages) not yet in the counters
        held: list[int] = []  # their host pages, not yet returned (none with storage)
        live = self.registry.live
        try:
            for tid, error in batch:
                t = inflight.pop(tid, None)
                if t is None:
                    raise KVOffloadError(f"transfer #{tid} completed twice or was never submitted")
                try:  # a lifecycle with a copy in flight is never RELEASED, so it is live
                    lc = live[t.lifecycle_id]  # type: ignore[index]
                except KeyError:  # that invariant broken (a kvoffload bug): nothing applied
                    self._back_in_flight(t)
                    raise InvariantViolation(f"{t!r} completed, but its lifecycle is not live") from None
                t.completed_at = now
                t.error = error
                lc.inflight -= 1
                if (
                    error is None
                    and lc._stop < 0
                    and not (observed or lc._aborted or self.deferred)
                    and (not store or t.first_token == lc._front)
                ):
                    s = lc._s
                    dest = rows[s][((lc.inflight > 0) << 1) | (lc._deferred_since is not None)]
                    if 0 <= dest != _RELEASED:
                        # Copied, nothing to emit, release or pump: the ledger waits for the
                        # batch (or the next full path); the table steps when the state changes.
                        chunks += 1
                        host = t.host_pages
                        pages += len(host)
                        if store:
                            writes.queue(t, lc)
                        else:
                            held += host
                        if dest != s:
                            if QUIET_MOVES[dest]:
                                move(lc, dest, now)
                            else:
                                fire(lc, _DONE, now)
                        if lc._quiet_ev is not None:
                            lc._wake_quiet()
                        continue
                # The full path, one completion at a time, on a balanced ledger.
                if chunks:
                    credit = chunks, pages, held
                    chunks = pages = 0
                    held = []
                    self.credit(*credit)
                fire(lc, self.account(t, lc, error, now), now)
                if lc._quiet_ev is not None:
                    lc._wake_quiet()
                if self.deferred and (error is not None or lc._aborted or not store):
                    self.wait.pump()  # host pages came back
                observed = self.events.observed
        finally:
            if chunks:
                self.credit(chunks, pages, held)

    def _back_in_flight(self, t: Transfer) -> None:
        """Put ``t`` back among the copies in flight, in seq order (a refused completion)."""
        self.inflight[t.id] = t
        ordered = sorted(self.inflight.values(), key=lambda u: u.seq)
        self.inflight.clear()
        self.inflight.update((u.id, u) for u in ordered)

    def credit(self, chunks: int, pages: int, held: list[int]) -> None:
        """Write ``chunks`` copied chunks of ``pages`` pages to the ledger and return
        ``held``, their host pages (none while a storage tier writes them behind)."""
        c = self.counters
        c.chunks_inflight -= chunks
        c.pages_inflight -= pages
        c.chunks_copied += chunks
        c.pages_copied += pages
        if self.storage:
            c.pages_in_write += pages
        else:
            c.pages_not_stored += pages
        if held:
            self.host_pool.free(held)

    def account(self, t: Transfer, lc: Lifecycle, error: BaseException | None, now: float) -> int:
        """The ledger part of one completion of ``lc``, written at once, then its log line
        and events (the ledger balances when they run). Returns the event to fire."""
        host = t.host_pages
        npages = len(host)
        c = self.counters
        if error is not None:
            lc._failed = True
            self.hole(lc, t.first_token)  # (the chunk_failed step follows: no drop event)
            c.chunks_inflight -= 1
            c.pages_inflight -= npages
            c.chunks_failed += 1
            c.pages_failed += npages
            self.host_pool.free(host)
            # a failing device fails every copy: one line per burst interval
            self._warn(
                self._failure_log,
                "transfer.failed",
                lc,
                "failures_since_last_log",
                transfer=t.id,
                error=repr(error),
                now=now,
            )
            if self.events.listeners:
                self.events.delivery("transfer.failed", t, lc, now, self.page_bytes, error=repr(error))
            return _FAILED
        if lc._aborted or 0 <= lc._stop <= t.first_token:  # aborted, or after a hole (F33)
            c.chunks_inflight -= 1
            c.pages_inflight -= npages
            c.chunks_discarded += 1
            c.pages_discarded += npages
            self.host_pool.free(host)
            name = "transfer.discarded"
        elif self.storage:
            self.writes.queue(t, lc)
            self.credit(1, npages, [])
            name = "transfer.completed"
        else:
            self.credit(1, npages, host)
            name = "transfer.completed"
        if self.events.observed:
            self.events.delivery(name, t, lc, now, self.page_bytes)
        return _DONE

    def _warn(
        self,
        limit: RateLimit,
        event: str,
        lc: Lifecycle,
        held_as: str,
        now: float | None = None,
        **fields: Any,
    ) -> None:
        """A warning about ``lc`` that comes in bursts: one line per ``limit`` interval,
        saying (as ``held_as``) how many there were since the last."""
        held = limit.due(self.events.clock() if now is None else now)
        if held:
            logger.warning(event, rid=lc.rid, lifecycle=lc.id, **fields, **{held_as: held})
