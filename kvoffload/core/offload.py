"""OffloadCore: the bookkeeping of every lifecycle, pure, synchronous and deterministic.

The core is what the property suite checks; the drivers above it only add waiting.
It imports no anyio, starts no thread, does no I/O and never calls a mover. In:
calls (``admit``, ``extend``, ``finish``, ``abort``), completions (``complete``), the
clock (``tick``) and finished storage writes (``write_done``). Out: copy jobs, handed
to the ``accept`` sink the driver gives it (a mover's submit, which may refuse by
raising and then nothing changed), storage write jobs (``take_writes``), and the
lifecycles each call released (its return value).

:class:`OffloadCore` is the facade that wires the rooms, each the one owner of its
state, its invariants written beside it:

- :class:`~kvoffload.core.registry.Registry`: the live lifecycles, their state
  counts, the one table step, release;
- :class:`~kvoffload.core.chunks.Chunks`: host pages, copies in flight in submission
  order, the one submit planner, drops, holes, completions;
- :class:`~kvoffload.core.deferral.HostWait`: the chunks that wait for host pages;
- :class:`~kvoffload.core.writes.Writes`: the storage write jobs, in chain order;
- :class:`~kvoffload.core.step.DecodeStep`: extend, extend_due, extend_batch and the
  one undo; it owns the batch rows;
- :class:`~kvoffload.core.loads.Loads`: the load path (store -> host -> device pages):
  live loads, their host pages and h2d copies (``load_begin``, ``load_read``,
  ``load_cancel``, ``take_loads``: the room's own bound methods);
- :class:`~kvoffload.core.events.Events` and the
  :class:`~kvoffload.core.watchdog.Watchdog`.

Every method is a plain ``def`` that runs to completion. Each event goes through the
compiled table (:mod:`kvoffload.lifecycle.table`); no transition lives only in an
``if`` chain. The rules of ARCHITECTURE.md are meant to hold after every call;
:meth:`check_invariants` checks the ledger's part of them (``kvoffload.core.ledger``),
and the property suite checks them all after every step of the schedules it draws.
"""

from __future__ import annotations

import time
from _thread import get_ident
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.abc import Completion, Transfer, WriteJob
from kvoffload.config import OffloadConfig
from kvoffload.core import ledger
from kvoffload.core.chunks import Chunks
from kvoffload.core.deferral import HostWait
from kvoffload.core.events import Events, logger
from kvoffload.core.kv_events import KVEventSource
from kvoffload.core.lifecycle import Lifecycle, LifecycleHost, requiet
from kvoffload.core.loads import Loads
from kvoffload.core.meters import Meters
from kvoffload.core.registry import Registry
from kvoffload.core.rows import DecodeRows
from kvoffload.core.stats import Counters, Statistics
from kvoffload.core.step import ROWS_MIN, DecodeStep
from kvoffload.core.watchdog import Watchdog
from kvoffload.core.writes import Writes
from kvoffload.errors import InvalidTokens, KVOffloadError
from kvoffload.keys import page_run_digests, validate_tokens
from kvoffload.lifecycle.table import EVENT_INDEX

if TYPE_CHECKING:
    from kvoffload.pools import DevicePool, EnginePages, HostPool

__all__ = ["ROWS_MIN", "OffloadCore"]

_FINISH = EVENT_INDEX["finish"]
_ABORT = EVENT_INDEX["abort"]
_DROPPED = EVENT_INDEX["chunk_dropped"]


class _DirectHost:
    """The :class:`LifecycleHost` of a core used without a driver (tests, tools):
    lifecycle events go straight to the core; there is nothing to wait with. What a
    lifecycle's own call releases goes to ``on_released`` when one is set."""

    def __init__(self, core: OffloadCore) -> None:
        self.core = core
        self.on_released: Callable[[Lifecycle], object] | None = None

    def finish_lifecycle(self, lc: Lifecycle) -> None:
        self._tell(self.core.finish(lc))

    def abort_lifecycle(self, lc: Lifecycle) -> None:
        self._tell(self.core.abort(lc))

    def _tell(self, released: list[Lifecycle]) -> None:
        try:
            if self.on_released is not None:
                for lc in released:
                    self.on_released(lc)
        finally:
            self.core.told(released)

    def wait_lifecycle(self, lc: Lifecycle, released: bool) -> Awaitable[None]:
        raise KVOffloadError(f"{lc!r} belongs to a bare OffloadCore: a driver waits, the core does not")


class OffloadCore:
    """The facade of the core's rooms (see the module doc).

    ``OffloadCore(config, device_pool=..., host_pool=..., accept=...)``. ``accept(t)``
    takes each copy job the moment it is due; it may raise to refuse it (a mover that
    is closed or cannot start a copy), and then nothing changed. ``storage``: whether a
    storage tier takes copied pages (then their host pages are held until
    :meth:`write_done`). Called from one thread (the driver's owner thread).

    The decode step's entry points (``extend``, ``extend_due``, ``extend_batch``,
    ``grow_one``, ``grow``) are the step room's own bound methods, set on the facade
    once: a lifecycle's fast path calls them with no call in between.
    """

    def __init__(
        self,
        config: OffloadConfig,
        *,
        device_pool: DevicePool | EnginePages,
        host_pool: HostPool,
        accept: Callable[[Transfer], None],
        clock: Callable[[], float] = time.monotonic,
        storage: bool = False,
        streams: int = 1,
        page_bytes: int = 0,
        store_log_interval_s: float = 30.0,
    ) -> None:
        self.config = config
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.has_storage = storage
        self.streams = streams
        self.page_bytes = page_bytes
        counters = Counters()
        self.events = events = Events(clock)
        self.meters = meters = Meters(page_bytes, clock)  # per transfer / poll figures (kvoffload.metrics)
        self.registry = registry = Registry(
            config, counters, device_pool, events, get_ident(), _DirectHost(self), meters
        )
        self.write_behind = Writes(config, counters, host_pool, events, page_bytes, store_log_interval_s)
        self.wait = wait = HostWait(config, counters, host_pool, registry, events, page_bytes)
        self.chunks = chunks = Chunks(
            config,
            counters,
            host_pool,
            registry,
            self.write_behind,
            wait,
            events,
            accept,
            streams,
            page_bytes,
            storage,
        )
        self.step = step = DecodeStep(config, device_pool, registry, chunks, events, self)
        self.watchdog = Watchdog(registry, chunks)
        self.loads = loads = Loads(
            counters, host_pool, device_pool, registry, events, lambda: chunks.accept, page_bytes
        )
        self.kv = KVEventSource(registry.live, chunks, self.write_behind, clock)  # kv_events()
        registry.detach_row = step.detach
        wait.chunks = chunks
        wait.sync_row = step.sync
        # For readers (drivers, the ledger's callers, tests): the rooms' containers, never
        # rebound by their owners; read them, change them only through the core's calls.
        self.live = registry.live
        self.state_counts = registry.state_counts
        self.inflight = chunks.inflight
        self.deferred = wait.queue
        self.writes = self.write_behind.jobs  # write jobs out (or about to be), not finished
        self.listeners = events.listeners
        self.counters = counters  # (read them through statistics())
        # The decode step's entry points, bound once (see the class doc).
        self.extend = step.extend
        self.extend_due = step.extend_due
        self.extend_batch = step.extend_batch
        self.grow_one = step.grow_one
        self.grow = step.grow
        # The load path (kvoffload.core.loads): take_loads() lists each load that reached DONE once.
        self.load_begin, read = meters.wrap_loads(loads.begin, loads.read)  # (s2h metered)
        self.load_read = self.kv.wrap_read(read)  # (a short read is a KV event while subscribed)
        self.load_cancel = loads.cancel
        self.take_loads = loads.take

    # --- slots the driver sets ----------------------------------------------

    @property
    def clock(self) -> Callable[[], float]:
        """The core's clock: the events room's, which every room reads."""
        return self.events.clock

    @property
    def accept(self) -> Callable[[Transfer], None]:
        """The mover's submit, offered each copy job."""
        return self.chunks.accept

    @accept.setter
    def accept(self, accept: Callable[[Transfer], None]) -> None:
        self.chunks.accept = self.kv.wrap(accept)  # (itself unless KV events are on)

    @property
    def owner(self) -> int:
        """The thread every lifecycle admitted from now on checks its calls against."""
        return self.registry.owner

    @owner.setter
    def owner(self, owner: int) -> None:
        self.registry.owner = owner

    @property
    def host(self) -> LifecycleHost:
        """The driver lifecycles call back into (a bare core serves them itself)."""
        return self.registry.host

    @host.setter
    def host(self, host: LifecycleHost) -> None:
        self.registry.host = host

    @property
    def polls(self) -> int:
        """Scheduler steps so far (the sync driver counts them): host_wait_polls' clock."""
        return self.wait.polls

    @polls.setter
    def polls(self, polls: int) -> None:
        self.wait.polls = polls

    # --- reading the rooms --------------------------------------------------------------

    @property
    def closing(self) -> bool:
        """Whether close() ran: no admit, no copy may start."""
        return self.registry.closing

    @property
    def next_seq(self) -> int:
        return self.chunks.next_seq

    @property
    def rows(self) -> DecodeRows | None:
        return self.step.rows

    @property
    def rows_step(self) -> int:
        """The batch rows' step counter (``Lifecycle.committed`` adds a row's held tokens)."""
        rows = self.step.rows
        assert rows is not None
        return rows.step

    @property
    def observed(self) -> bool:
        return self.events.observed

    @property
    def stuck_reported(self) -> set[int]:
        return self.watchdog.reported

    # --- events in ---------------------------------------------------------------------

    def admit(
        self,
        rid: Any,
        prompt: Sequence[int],
        *,
        pages: Any = None,
        tag: Any = None,
        chain_seed: str | None = None,
        stored: int | None = None,
    ) -> Lifecycle:
        """Admit a request and return its new lifecycle, in PENDING (or OFFLOADING when
        the prompt's unstored whole pages go out at once).

        ``rid`` is a label: it may equal a live lifecycle's rid (a reused request id);
        the two never share state. Owned mode allocates the prompt's device pages
        (``pages`` None or empty); engine-owned mode takes ``pages``, the engine's ids
        of exactly the pages the prompt fills, in token order
        (:func:`~kvoffload.pools.page_ids`). ``stored``: leading prompt tokens the
        storage tier already has (page-aligned; default the page-aligned prompt, or 0
        with ``offload_prompt``): they are never copied and the chain continues from
        their key; their pages may also be in other live lifecycles' stored prefixes
        (a prefix cache shares them), the pages after them are this lifecycle's own. Raises
        :class:`~kvoffload.InvalidTokens`, :class:`~kvoffload.PoolExhausted`,
        :class:`~kvoffload.PageError`, or the mover's error when it refuses the prompt
        chunk, with nothing changed.
        """
        if self.registry.closing:
            raise KVOffloadError("the manager is closed: no request can be admitted")
        self.refresh_observed()
        cfg = self.config
        tokens = validate_tokens(prompt, "prompt")
        n = len(tokens)
        ps = cfg.page_size
        aligned = n - n % ps
        if stored is None:
            stored = 0 if cfg.offload_prompt else aligned
        elif type(stored) is not int or not 0 <= stored <= n or stored % ps:
            raise InvalidTokens(
                f"stored={stored!r} must be a whole number of pages (a multiple of page_size {ps}) "
                f"between 0 and the prompt's {n} tokens"
            )
        dev = self.step.take_pages(-(-n // ps), pages, stored // ps)
        lc = self.registry.new(self, rid, tag)
        lc.device_pages = dev
        lc._cap = len(dev) * ps
        lc._committed = n
        seed = bytes.fromhex(chain_seed) if chain_seed else b""
        lc._chain = seed
        if stored:  # the stored prefix seeds the chain (its pages are never copied)
            lc._chain = page_run_digests(seed, tokens[:stored], ps)[-1]
        lc.submitted = stored
        lc._front = stored
        lc._tail = tokens[stored:]
        # offload_prompt: the prompt's unstored whole pages are the first chunk; else (or
        # when there are none) a chunk is due a stride past what is stored (at once for a
        # resumed request).
        lc.due = aligned if cfg.offload_prompt and aligned > stored else stored + cfg.stride
        requiet(lc, self.events.observed)
        self.registry.add(lc)
        if self.events.observed:
            self.events.emit("lifecycle.admitted", lc, prompt_tokens=n, device_pages=len(dev))
        pending = n - stored
        due = pending - pending % (ps if cfg.offload_prompt else cfg.stride)
        if due and n >= lc.due:
            try:
                self.chunks.submit(lc, due)
            except BaseException:  # the mover refused: admit is all or nothing
                self.registry.withdraw(lc)
                self.device_pool.free(dev)
                raise
        return lc

    def lifecycles(self, rid: Any = None) -> list[Lifecycle]:
        """Live lifecycles, oldest first; with ``rid``, those labelled ``rid`` (there may be
        several: a reused id). For observability: O(live)."""
        return self.registry.lifecycles(rid)

    def finish(self, lc: Lifecycle) -> list[Lifecycle]:
        """The request finished: flush the page-aligned remainder (F12), then FINISHING,
        or RELEASED at once when nothing is in flight. Returns what it released."""
        self.registry.check(lc, _FINISH)
        if lc._row >= 0:
            self.step.detach(lc)
        self.chunks.flush(lc, refusal_raises=True)
        self.registry.fire(lc, _FINISH)
        return self.registry.take_released()

    def abort(self, lc: Lifecycle) -> list[Lifecycle]:
        """No new chunks; in-flight ones are discarded on completion; RELEASED (ABORTED)
        after the last one, or at once. Returns what it released."""
        self.registry.check(lc, _ABORT)
        if lc._row >= 0:
            self.step.detach(lc)
        lc._aborted = True
        if self.write_behind.held:  # copied ahead of a chunk that will now be discarded: never written
            self.write_behind.skip_held(lc, 0)
        if lc._deferred_since is not None:
            self.wait.cancel(lc)
        self.registry.fire(lc, _ABORT)
        return self.registry.take_released()

    def close(self) -> list[Lifecycle]:
        """The driver is closing: no copy may start from now on (nothing would deliver
        it), deferred chunks are dropped, and every live lifecycle is aborted - those
        with nothing in flight are RELEASED now (returned), the others when their last
        copy is delivered (discarded)."""
        self.registry.closing = True
        self.loads.close()  # (cancelled: each ends when its read or copy returns; take_loads lists it)
        live = list(self.registry.live.values())
        if live:
            logger.warning("manager.closed_live", live=len(live))
        released: list[Lifecycle] = []
        for lc in live:
            if not lc._aborted:
                released += self.abort(lc)
        return released + self.registry.take_released()

    # --- completions and writes ----------------------------------------------------------

    def complete(self, batch: Sequence[Completion], now: float | None = None) -> list[Lifecycle]:
        """Apply a batch of completions (transfer id, error), in order, each to the
        lifecycle that issued it (the transfer's ``lifecycle_id``, never its request id;
        F1). Returns the lifecycles the batch released; a load's h2d copy ends its load
        (listed by :meth:`take_loads`).

        A completion that names a transfer id not in flight (delivered twice, never
        submitted: a mover's bug) raises :class:`~kvoffload.KVOffloadError` when the loop
        reaches it: the completions before it are applied, the ledger is consistent,
        and those after it are not applied (still in flight: deliver them again; the
        drivers do). :class:`~kvoffload.PageError` on a host double free.
        """
        now = self.events.clock() if now is None else now
        self.meters.copies(batch, self.chunks.inflight, self.loads.copying, now)
        if self.loads.copying:
            self.loads.complete(batch, self.chunks.complete, now)
        else:
            self.chunks.complete(batch, now)
        return self.registry.take_released()

    def take_writes(self) -> list[WriteJob]:
        """The storage write jobs queued since the last call, in completion order (a
        request's chunks in chain order). Their host pages stay held until
        :meth:`write_done`."""
        return self.meters.taken(self.write_behind.take())

    def write_done(
        self, job_id: int, stored: bool, *, attempts: int = 1, error: BaseException | None = None
    ) -> list[Lifecycle]:
        """The writer finished job ``job_id`` (stored, or failed after ``attempts``
        tries): its host pages return (rule 3), the outcome is counted, a burst of
        failures is logged once. A job not stored is a hole (F33) at its first page the
        store did not confirm: a :class:`~kvoffload.PartialWriteError` ``error`` says per
        page (F34); any other error confirms none. Returns what an expiry released."""
        if self.kv.on:  # the one place a write's result becomes a KV event (the job still queued)
            self.kv.written(job_id, stored, error)
        job = self.writes.get(job_id)
        lc, at = self.write_behind.done(job_id, stored, attempts, error)
        if lc is not None and self.chunks.hole(lc, at):
            self.registry.fire(lc, _DROPPED)
        if job is not None:  # the pages the store confirmed before the hole (F34)
            n = len(job.host_pages) if at < 0 else (at - job.first_token) // self.config.page_size
            self.meters.written(job, n, attempts)
        if self.wait.queue:
            self.wait.pump()
        return self.registry.take_released()

    # --- time ---------------------------------------------------------------------------

    def pump(self) -> list[Lifecycle]:
        """Retry deferred chunks now (host pages may have come back); drop the expired.
        Returns what an expired deferral released."""
        if self.wait.queue:
            self.wait.pump()
        return self.registry.take_released()

    def expire_waits(self) -> list[Lifecycle]:
        """A poll passed (``polls`` was counted): deferred chunks that waited past
        ``host_wait_polls`` are dropped (and the others retried). Returns what that
        released."""
        return self.pump()

    def tick(self) -> list[Lifecycle]:
        """The time-based checks, now: deferral expiry (and retry) and the watchdog
        (F18). Returns what an expired deferral released."""
        if self.wait.queue:
            self.wait.pump()
        if self.config.stuck_after_s is not None:
            self.watchdog.report()
        return self.registry.take_released()

    # --- release and events out ------------------------------------------------------------

    def told(self, released: Iterable[Lifecycle]) -> None:
        """The engine was told about ``released`` (``on_released`` ran): they stop
        listing their device pages. Whoever receives released lifecycles from the core
        (the drivers, :class:`_DirectHost`) calls this once it told the engine."""
        self.registry.told(released)

    def refresh_observed(self) -> bool:
        """Recompute :attr:`observed` (listeners, and whether debug logging is seen); when
        it changes, every live lifecycle's fast-path threshold follows (O(live), rare)."""
        events = self.events
        observed = events.refresh()  # (manager.fast_paths_off, once, the first time it turns on)
        if observed != events.observed:
            if observed and self.step.rows is not None:
                self.step.rows.detach_all()  # every step of theirs emits an event from now on
            events.observed = observed
            for lc in self.registry.live.values():
                requiet(lc, observed)
        return observed

    # --- reading ---------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a chunk is in flight, deferred, or waiting for its storage write."""
        return bool(self.chunks.inflight or self.wait.queue or self.write_behind.jobs)

    def statistics(self) -> Statistics:
        """A frozen snapshot of the state and counters."""
        sc = self.registry.state_counts
        return Statistics(
            live_lifecycles=len(self.registry.live),
            pending=sc[0],
            offloading=sc[1],
            finishing=sc[2],
            device_pages_used=self.device_pool.used,
            device_pages_total=self.device_pool.n_pages,
            host_pages_used=self.host_pool.used,
            host_pages_total=self.host_pool.n_pages,
            loads_live=len(self.loads.live),
            load_host_pages=self.loads.host_held,
            **self.counters.as_dict(),  # every counter is a Statistics field of its name
        )

    def check_invariants(self) -> None:
        """Raise :class:`~kvoffload.InvariantViolation` if the ledger does not balance
        (ARCHITECTURE.md rules 1-6). Tests call it after every step."""
        ledger.check(self.registry, self.chunks, self.step, self.loads)

    def __repr__(self) -> str:
        return f"<OffloadCore live={len(self.registry.live)} inflight={len(self.chunks.inflight)}>"
