"""The lifecycle state machine: the outside world as hypothesis rules.

:class:`LifecycleMachine` drives an :class:`~kvoffload.OffloadManager` on a checked
:class:`~kvoffload.testing.SimBackend` through admits, extends, finishes, aborts,
completions and failures in any order, dropped references, a full host pool, the
retraction barrier, refused submissions, storage failures and closing mid-run, and
checks after every step what :class:`Observer` checks. The same rules drive the
synchronous driver (:class:`SyncLifecycleMachine`) and the bare core
(:class:`CoreLifecycleMachine`, fast: no event loop, no bytes). None attaches a
listener unless the example draws ``events=True``, so the drivers run the production
delivery path; with it, transitions are replayed on the ``transitions`` oracle.

Users subclass :class:`LifecycleMachine`: override the ``*_request`` hooks to go
through their own scheduler, add rules, or set ``manager_class``.
``MyMachine.TestCase`` is a unittest case.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload._testing.host import ManagerHost, SyncManagerHost
from kvoffload._testing.observer import KV_SHAPE, CheckedSimBackend, Observer
from kvoffload.abc import WriteJob
from kvoffload.config import OffloadConfig
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.offload import OffloadCore
from kvoffload.drivers.asyncio import OffloadManager
from kvoffload.drivers.sync import SyncOffloadManager
from kvoffload.errors import (
    BackendError,
    DrainTimeout,
    InvalidTransition,
    PartialWriteError,
    PoolExhausted,
    StorageError,
)
from kvoffload.lifecycle.spec import LifecycleState, Outcome
from kvoffload.pools import EnginePages
from kvoffload.storage.memory import MemoryStorage
from kvoffload.storage.writer import WritePolicy

__all__ = ["CoreLifecycleMachine", "FlakyStorage", "LifecycleMachine", "SyncLifecycleMachine"]

_T = TypeVar("_T")
_P, _O, _F, _R = (
    LifecycleState.PENDING,
    LifecycleState.OFFLOADING,
    LifecycleState.FINISHING,
    LifecycleState.RELEASED,
)
#: Seconds (real time) a step may wait for the manager before the suite calls it hung.
_HANG_S = 10.0
#: The virtual ``host_wait_s`` of the ``"wait"`` policy; ``advance_clock`` steps past it.
_HOST_WAIT_S = 10.0
#: The virtual ``stuck_after_s`` of the watchdog (F18); ``advance_clock`` steps past it.
_STUCK_AFTER_S = 5.0
#: One try per storage write, no backoff: a failure is one call.
_WRITE_POLICY = WritePolicy(attempts=1, backoff_s=0)

_slots = st.integers(0, 2)
_tokens = st.integers(0, 3)


class FlakyStorage(MemoryStorage):
    """A memory store that fails every write while ``down`` is set, and - while
    ``partial`` is an int - stores part of each batch of two or more pages: every page
    but the one at index ``partial % n``, raising :class:`~kvoffload.PartialWriteError`
    with one flag per page (FAILURES F34). It tells its ``observer`` (when set) of every
    write it is asked for (host pages, and which of them it takes), so the observer can
    check that what is stored has no holes (F33) and that the pages counted stored are
    exactly the pages it confirmed before a hole."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.partial: int | None = None
        self.observer: Observer | None = None

    def _flags(self, n: int) -> list[bool]:
        """Which pages of a batch of ``n`` this write takes."""
        if self.down:
            return [False] * n
        if self.partial is None or n < 2:
            return [True] * n
        miss = self.partial % n
        return [i != miss for i in range(n)]

    async def put_pages(self, keys: Sequence[str], host_pool: Any, host_pages: Sequence[int]) -> None:
        from kvoffload.pools import page_views

        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys for {len(host_pages)} pages")
        flags = self._flags(len(keys))
        if self.observer is not None:
            self.observer.on_put(host_pages, flags)
        self._store(keys, [v.tobytes() for v in page_views(host_pool, host_pages)], flags)

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        self._store(keys, pages, self._flags(len(keys)))

    def _store(self, keys: Sequence[str], pages: Sequence[bytes], flags: list[bool]) -> None:
        if keys and not any(flags):
            raise StorageError("simulated: the store is down")
        self.pages.update((k, bytes(p)) for k, p, ok in zip(keys, pages, flags, strict=True) if ok)
        if not all(flags):
            raise PartialWriteError("simulated: the store took part of the batch", flags)


def _report_coverage(seen: set[str]) -> None:
    """Tell hypothesis which events a run reached (``--hypothesis-show-statistics``)."""
    from hypothesis import event
    from hypothesis.errors import InvalidArgument

    try:
        for name in sorted(seen):
            event(name)
    except InvalidArgument:  # replayed outside a hypothesis test (a pasted regression)
        pass


class LifecycleMachine(RuleBasedStateMachine):
    """Hypothesis rules for the world around an :class:`OffloadManager`.

    Request ids come from ``rids`` (a small pool, so ids are reused); a rule acts on
    the newest lifecycle the caller still holds for that id. A transfer is picked by
    its position among the in-flight ones, so completions come in any order.
    """

    #: The manager under test (the mutation meta-tests put one with a broken core here).
    manager_class: ClassVar[type[Any]] = OffloadManager
    #: The request ids the rules draw from.
    rids: ClassVar[tuple[str, ...]] = ("r0", "r1", "r2")
    #: Whether the pools carry KV bytes that every copy's result is checked against.
    check_bytes: ClassVar[bool] = True
    #: Whether rules that await (retract, wait_quiescent) apply: the asyncio driver only.
    awaits: ClassVar[bool] = True
    #: Whether an example may draw engine-owned mode (the machine then plays the engine
    #: itself: its own pages, passed with ``pages=``). Off for a subclass whose hooks
    #: drive a scheduler that owns no pages; the suites of kvoffload turn it on.
    engine_owned_mode: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.observer = Observer(check_bytes=self.check_bytes)
        self.now = 0.0
        self.mgr: Any = None
        self.backend: CheckedSimBackend | None = None
        self.storage: FlakyStorage | None = None
        # held: the lifecycles the caller still references, per rid, oldest first.
        self.held: dict[str, list[Lifecycle]] = {rid: [] for rid in self.rids}
        self.waiters: list[asyncio.Task[None]] = []
        self.host: ManagerHost | None = None
        # closed: the manager was closed mid-run; delivered: it still delivers completions.
        self.closed = False
        self.delivering = True
        # Engine-owned mode: the machine is the engine - its KV tensors, its free pages,
        # and the pages it gave each lifecycle (freed only in on_released).
        self.engine_kv: list[Any] | None = None
        self.free_pages: list[int] = []
        self.given: dict[int, list[int]] = {}

    # --- hooks a user overrides to go through their own scheduler ----------------------

    def make_config(self, **sizes: Any) -> OffloadConfig:
        """The manager's config for this example (KV rows must stay int32 ``KV_SHAPE``)."""
        return OffloadConfig(kv_shape=KV_SHAPE, dtype="int32", host_wait_s=_HOST_WAIT_S, **sizes)

    def make_manager(
        self, config: OffloadConfig, backend: CheckedSimBackend, storage: FlakyStorage | None
    ) -> Any:
        """Build the manager under test (``manager_class`` by default)."""
        return self.manager_class(
            config,
            backend=backend,
            storage=storage,
            clock=lambda: self.now,
            write_policy=_WRITE_POLICY,
            on_released=self.released,
            device_kv=self.engine_kv,
        )

    def released(self, lc: Lifecycle) -> None:
        """``on_released(lc)``: checked once and only at RELEASED; engine-owned, the
        engine frees the lifecycle's pages now (and not before) and may reuse them."""
        self.observer.on_released(lc)
        pages = self.given.pop(lc.id, None)
        if pages is not None:
            self.observer.on_engine_free(pages)
            self.free_pages.extend(reversed(pages))

    def _engine_pages(self, n: int) -> list[int]:
        """The engine allocates ``n`` pages of its own, or refuses (PoolExhausted)."""
        if n > len(self.free_pages):
            raise PoolExhausted("engine", n, len(self.free_pages))
        return [self.free_pages.pop() for _ in range(n)]

    def admit_request(self, rid: str, prompt: list[int]) -> Lifecycle:
        """Admit a request; returns its lifecycle. Default: ``mgr.admit`` (engine-owned:
        with pages the machine, as the engine, allocates)."""
        if self.engine_kv is None:
            return self.mgr.admit(rid, prompt)  # type: ignore[no-any-return]
        ps = self.core.config.page_size
        pages = self._engine_pages(-(-len(prompt) // ps))
        try:
            lc: Lifecycle = self.mgr.admit(rid, prompt, pages=pages)
        except BaseException:
            self.free_pages.extend(reversed(pages))
            raise
        self.given[lc.id] = list(pages)
        return lc

    def commit_tokens(self, lc: Lifecycle, tokens: list[int]) -> None:
        """Tokens were decoded for ``lc``. Default: ``lc.extend`` (engine-owned: with the
        new pages the tokens start, which the engine allocates)."""
        if self.engine_kv is None:
            lc.extend(tokens)
            return
        ps = self.core.config.page_size
        held = self.given.get(lc.id, [])
        pages = self._engine_pages(max(0, -(-(lc.committed + len(tokens)) // ps) - len(held)))
        try:
            lc.extend(tokens, pages=pages)
        except BaseException:
            self.free_pages.extend(reversed(pages))
            raise
        held += pages

    def finish_request(self, lc: Lifecycle) -> None:
        """``lc``'s request finished decoding. Default: ``lc.finish``."""
        lc.finish()

    def abort_request(self, lc: Lifecycle) -> None:
        """``lc``'s request was cancelled. Default: ``lc.abort``."""
        lc.abort()

    # --- plumbing (the driver's) ---------------------------------------------------------

    @property
    def core(self) -> OffloadCore:
        """The core under the manager."""
        return self.mgr.core  # type: ignore[no-any-return]

    def open_manager(self) -> None:
        """Open the manager built by :meth:`make_manager`."""
        self.host = ManagerHost(self.mgr, hang_s=_HANG_S)

    def run(self, fn: Callable[[], _T]) -> _T:
        """Call ``fn`` on the machine's event loop, then wait until every signalled
        completion was delivered. Raises if the manager's tasks crashed or hung. Once
        the manager is closed, only calls ``fn``: nothing delivers any more."""
        if not self.delivering:
            return fn()
        assert self.host is not None
        return self.host.call(fn)

    def close_manager(self) -> None:
        """Leave the manager's context now (copies the test never completes are not
        waited for: its drain times out at once, as after an error)."""
        assert self.host is not None
        self.host.close()
        self.delivering = False

    def tick(self) -> None:
        self.run(self.mgr.tick)

    def finish_run(self) -> None:
        """End of an example: close what is open."""
        if self.host is not None:
            self.host.close()

    # --- helpers -------------------------------------------------------------------------

    def _newest(self, slot: int) -> Lifecycle | None:
        held = self.held[self.rids[slot % len(self.rids)]]
        return held[-1] if held else None

    def _expect(self, lc: Lifecycle, legal: bool, action: Callable[[], None], what: str) -> bool:
        """Run ``action``; an illegal or refused one must raise and change nothing."""
        before = (self.mgr.statistics(), lc.state, lc.inflight, lc.committed, list(lc.device_pages))
        try:
            self.run(action)
        except InvalidTransition:
            assert not legal, f"{what} raised InvalidTransition in {before[1].name}"
        except (PoolExhausted, BackendError):
            pass  # no device page, or a refused submission: nothing may change
        else:
            assert legal, f"{what} was accepted in {before[1].name}"
            return True
        after = (self.mgr.statistics(), lc.state, lc.inflight, lc.committed, list(lc.device_pages))
        assert after == before, f"a refused {what} changed {before} into {after}"
        return False

    # --- rules: the outside world --------------------------------------------------------

    @initialize(
        page_size=st.integers(2, 4),
        stride_pages=st.integers(1, 2),
        device_pages=st.integers(6, 24),
        spare_host_pages=st.integers(0, 4),
        on_host_full=st.sampled_from(["drop", "wait"]),
        offload_prompt=st.booleans(),
        storage=st.booleans(),
        first_prompt=st.lists(_tokens, max_size=12),
        events=st.booleans(),
        engine_owned=st.booleans(),
    )
    def open(
        self,
        page_size: int,
        stride_pages: int,
        device_pages: int,
        spare_host_pages: int,
        on_host_full: str,
        offload_prompt: bool,
        storage: bool,
        first_prompt: list[int] | None = None,
        events: bool = False,
        engine_owned: bool = False,
    ) -> None:
        """Open a small manager; admit ``first_prompt`` on ``rids[0]`` (so that no example
        is without a request) unless it is None. ``events``: attach the observer's
        listener (the slow path, replayed on the oracle). ``engine_owned``: the machine
        is the engine - it owns ``device_pages`` pages of KV in two tensors, allocates
        them, writes them and frees them only in ``on_released``."""
        engine_owned = engine_owned and self.engine_owned_mode
        if engine_owned:
            import torch

            shape = (device_pages, page_size, *KV_SHAPE)
            self.engine_kv = [torch.zeros(shape, dtype=torch.int32) for _ in range(2)]
            self.observer.engine_kv = self.engine_kv
            self.free_pages = list(range(device_pages - 1, -1, -1))
        config = self.make_config(
            page_size=page_size,
            stride=page_size * stride_pages,
            device_pages=None if engine_owned else device_pages,
            host_pages=stride_pages + spare_host_pages,
            on_host_full=on_host_full,
            offload_prompt=offload_prompt,
            watchdog_interval_s=3600.0,
            stuck_after_s=_STUCK_AFTER_S,
            drain_timeout_s=0.0,
        )
        self.backend = CheckedSimBackend(self.observer)
        self.storage = FlakyStorage() if storage else None
        if self.storage is not None:
            self.storage.observer = self.observer
        self.mgr = self.make_manager(config, self.backend, self.storage)
        self.observer.attach(self.core, events=events)
        self.open_manager()
        if first_prompt is not None:
            self.admit(0, first_prompt)

    @precondition(lambda self: not self.closed)
    @rule(slot=_slots, prompt=st.lists(_tokens, max_size=12))
    def admit(self, slot: int, prompt: list[int]) -> None:
        rid = self.rids[slot % len(self.rids)]
        before = self.mgr.statistics()
        try:
            lc = self.run(lambda: self.admit_request(rid, prompt))
        except (PoolExhausted, BackendError):
            assert self.mgr.statistics() == before, "a refused admit changed the manager"
            return
        self.observer.on_admit(lc, prompt)
        self.held[rid].append(lc)

    @precondition(lambda self: not self.closed)
    @rule(slot=_slots, tokens=st.lists(_tokens, min_size=1, max_size=10))
    def extend(self, slot: int, tokens: list[int]) -> None:
        lc = self._newest(slot)
        if lc is not None:
            self._extend(lc, tokens)

    def _extend(self, lc: Lifecycle, tokens: list[int]) -> None:
        legal = lc.state in (_P, _O)
        if self._expect(lc, legal, lambda: self.commit_tokens(lc, tokens), "extend"):
            self.observer.on_extend(lc, tokens)

    @precondition(lambda self: not self.closed)
    @rule(slot=_slots)
    def finish(self, slot: int) -> None:
        lc = self._newest(slot)
        dropped = self.core.counters.pages_dropped
        if lc is not None and self._expect(
            lc, lc.state in (_P, _O), lambda: self.finish_request(lc), "finish"
        ):
            self.observer.on_end(lc, aborted=False)
            self.observer.on_finished(lc, dropped_before=dropped)

    @precondition(lambda self: not self.closed)
    @rule(slot=_slots)
    def abort(self, slot: int) -> None:
        lc = self._newest(slot)
        if lc is not None and lc.state is _R:  # a no-op on a RELEASED lifecycle (issue 19)
            before = (self.mgr.statistics(), lc.outcome, list(lc.device_pages))
            self.run(lambda: self.abort_request(lc))
            after = (self.mgr.statistics(), lc.outcome, list(lc.device_pages))
            assert after == before, f"abort of a RELEASED lifecycle changed {before} into {after}"
        elif lc is not None and self._expect(lc, True, lambda: self.abort_request(lc), "abort"):
            self.observer.on_end(lc, aborted=True)

    def _pick(self, positions: Sequence[int]) -> list[Any]:
        assert self.backend is not None
        pending = list(self.backend.pending)
        picked = []
        for pos in positions:
            if pending:
                picked.append(pending.pop(pos % len(pending)))
        return picked

    def _signal(self, pos: int, ok: bool) -> None:
        backend = self.backend
        assert backend is not None
        (t,) = self._pick([pos])
        self.run(lambda: backend.complete(t) if ok else backend.fail(t))

    @precondition(lambda self: self.backend is not None and self.backend.pending)
    @rule(pos=st.integers(0, 7))
    def complete(self, pos: int) -> None:
        """The copy of the in-flight transfer at ``pos`` completes."""
        self._signal(pos, ok=True)

    @precondition(lambda self: self.backend is not None and self.backend.pending)
    @rule(pos=st.integers(0, 7))
    def fail(self, pos: int) -> None:
        """The copy of the in-flight transfer at ``pos`` fails."""
        self._signal(pos, ok=False)

    @precondition(lambda self: self.backend is not None and len(self.backend.pending) >= 2)
    @rule(positions=st.lists(st.integers(0, 7), min_size=2, max_size=4), fail_first=st.booleans())
    def complete_batch(self, positions: list[int], fail_first: bool) -> None:
        """Several completions signalled before the driver delivers: one batch."""
        backend = self.backend
        assert backend is not None
        picked = self._pick(positions)

        def signal() -> None:
            for i, t in enumerate(picked):
                if i == 0 and fail_first:
                    backend.fail(t)
                else:
                    backend.complete(t)

        self.run(signal)

    @rule(slot=_slots)
    def drop(self, slot: int) -> None:
        """The caller drops its reference to the oldest lifecycle it holds for the rid."""
        held = self.held[self.rids[slot % len(self.rids)]]
        if held:
            self.observer.dropped(held.pop(0))

    @precondition(lambda self: not self.closed)
    @rule()
    def exhaust_host_pool(self) -> None:
        """Every decoding request commits a stride at once: more chunks than host pages."""
        stride = self.mgr.config.stride
        for held in self.held.values():
            for lc in held:
                if lc.state in (_P, _O):
                    self._extend(lc, [len(lc.rid) % 4] * stride)

    @precondition(lambda self: self.backend is not None and not self.closed)
    @rule(on=st.booleans())
    def refuse_submissions(self, on: bool) -> None:
        """The copy engine refuses (or accepts again) every submission: a caller's call
        raises with nothing changed; a deferred retry fails that chunk only (F20)."""
        assert self.backend is not None
        self.backend.refuse = on

    @precondition(lambda self: self.storage is not None and not self.closed)
    @rule(down=st.booleans())
    def storage_down(self, down: bool) -> None:
        """The storage tier fails (or recovers): writes fail, host pages still return."""
        assert self.storage is not None
        self.storage.down = down

    @precondition(lambda self: self.storage is not None and not self.closed)
    @rule(miss=st.integers(-1, 2))
    def storage_partial(self, miss: int) -> None:
        """The storage tier stores part of each batch (F34): every page but the one at
        index ``miss`` (of a batch of two or more), or - ``miss`` -1 - whole batches again."""
        assert self.storage is not None
        self.storage.partial = None if miss < 0 else miss

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        """The manager closes mid-run: live lifecycles are aborted, the idle ones
        released; copies in flight keep their pages."""
        self.close_manager()
        self.closed = True
        self.observer.on_closed()

    @precondition(lambda self: self.awaits and not self.closed)
    @rule(slot=_slots)
    def retract(self, slot: int) -> None:
        """Retraction: abort and wait until RELEASED; then no copy may read the pages."""
        lc = self._newest(slot)
        if lc is None:
            return
        pages = list(lc.device_pages)
        if not lc.released:
            self.observer.on_end(lc, aborted=True)
        self._spawn(lc.retract(), lambda: self._retracted(lc, pages))

    def _retracted(self, lc: Lifecycle, pages: list[int]) -> None:
        assert lc.state is _R and lc.device_pages == [], f"retract() returned with {lc!r}"
        assert self.backend is not None
        assert not any(t.lifecycle_id == lc.id for t in self.backend.pending), f"{lc!r} retracted mid-copy"
        assert lc.outcome is not None

    @precondition(lambda self: self.awaits and not self.closed)
    @rule(slot=_slots)
    def wait_quiescent(self, slot: int) -> None:
        """The barrier every free path goes through (F6): when it returns, nothing reads
        the request's device pages."""
        lc = self._newest(slot)
        if lc is None:
            return

        def quiet() -> None:
            assert self.backend is not None
            assert lc.quiescent, f"wait_quiescent() returned with {lc!r}"
            assert not any(t.lifecycle_id == lc.id for t in self.backend.pending), f"{lc!r} is still copied"

        self._spawn(lc.wait_quiescent(), quiet)

    def _spawn(self, wait: Coroutine[Any, Any, None], then: Callable[[], None]) -> None:
        async def waiter() -> None:
            await wait
            then()

        self.run(lambda: self.waiters.append(asyncio.ensure_future(waiter())))

    @precondition(lambda self: not self.closed)
    @rule(seconds=st.sampled_from([1.0, 2 * _HOST_WAIT_S]))
    def advance_clock(self, seconds: float) -> None:
        """Virtual time passes; the timers tick: deferral expiry (``host_wait_s``), the
        retry of deferred chunks, and the watchdog (``stuck_after_s``, F18): afterwards
        every lifecycle with a copy in flight for longer than that has been reported."""
        self.now += seconds
        self.tick()
        assert self.backend is not None
        if not self.delivering:
            return
        core = self.core
        overdue = {t.lifecycle_id for t in self.backend.pending if self.now - t.submitted_at > _STUCK_AFTER_S}
        reported = {core.inflight[tid].lifecycle_id for tid in core.stuck_reported if tid in core.inflight}
        assert overdue <= reported, (
            f"the watchdog did not report lifecycles {sorted(overdue - reported)} (F18)"
        )

    # --- after every step ----------------------------------------------------------------

    @invariant()
    def outside_rules_hold(self) -> None:
        if self.mgr is None or self.backend is None:
            return
        for task in [w for w in self.waiters if w.done()]:
            self.waiters.remove(task)
            if not self.closed:
                task.result()
        self.observer.check(self.backend.pending, delivered=self.delivering)

    def teardown(self) -> None:
        """Finish what is left, complete every copy, and check that nothing
        leaked: every lifecycle RELEASED, both pools empty, the ledger balanced."""
        backend = self.backend
        if self.mgr is None or backend is None:
            return
        _report_coverage(self.observer.seen)
        try:
            if self.stopped():
                return  # the manager crashed: that step already failed
            if not self.closed:
                backend.refuse = False
                if self.storage is not None:
                    self.storage.down = False
                self._drain_all()
                self.observer.check(backend.pending)
                self._check_empty()
        finally:
            self.finish_run()
            for task in self.waiters:  # a crashed run's waiters: their errors are known
                if task.done() and not task.cancelled():
                    task.exception()
            self.held.clear()

    def stopped(self) -> bool:
        """Whether the manager stopped on its own (crashed)."""
        return self.host is not None and self.host.stopped and not self.closed

    def _drain_all(self) -> None:
        backend = self.backend
        assert backend is not None
        for lc in self.mgr.lifecycles():
            if lc.state in (_P, _O):
                dropped = self.core.counters.pages_dropped
                self.run(lc.finish)
                self.observer.on_end(lc, aborted=False)
                self.observer.on_finished(lc, dropped_before=dropped)
        for _ in range(10_000):
            if not backend.pending and not self.core.deferred:
                break
            if backend.pending:
                self.run(lambda: backend.complete(backend.pending[0]))
            else:
                self.now += 2 * _HOST_WAIT_S
                self.tick()
        self.settle_writes()

    def settle_writes(self) -> None:
        """Every storage write finished (the drivers' writers run on their own)."""
        self.run(lambda: None)

    def _check_empty(self) -> None:
        backend = self.backend
        assert backend is not None
        for task in self.waiters:
            assert task.done(), "a retract()/wait_quiescent() waiter was never woken"
            task.result()
        stats = self.mgr.statistics()
        assert stats.live_lifecycles == 0 and not backend.pending, f"left live: {self.mgr.lifecycles()}"
        assert stats.device_pages_used == 0, f"{stats.device_pages_used} device page(s) leaked"
        assert stats.host_pages_used == 0, f"{stats.host_pages_used} host page(s) leaked"
        for held in self.held.values():
            for lc in held:
                assert lc.outcome in (Outcome.COMPLETED, Outcome.ABORTED, Outcome.FAILED)


class SyncLifecycleMachine(LifecycleMachine):
    """The same rules through a :class:`~kvoffload.SyncOffloadManager`: each step is a
    plain call on this thread, then ``poll()`` until everything signalled is delivered
    and every storage write came back."""

    manager_class: ClassVar[type[Any]] = SyncOffloadManager
    awaits: ClassVar[bool] = False

    def open_manager(self) -> None:
        self.sync_host = SyncManagerHost(self.mgr, hang_s=_HANG_S)

    def run(self, fn: Callable[[], _T]) -> _T:
        if not self.delivering:
            return fn()
        return self.sync_host.call(fn)

    def close_manager(self) -> None:
        with contextlib.suppress(DrainTimeout):  # copies the test never completes: pages stay held
            self.mgr.close(timeout=0.0)
        self.delivering = False

    def tick(self) -> None:
        self.run(self.mgr.tick)

    def finish_run(self) -> None:
        if not self.closed:
            with contextlib.suppress(DrainTimeout):
                self.mgr.close(timeout=0.0)

    def stopped(self) -> bool:
        return False


class CoreLifecycleMachine(LifecycleMachine):
    """The same rules on a bare :class:`~kvoffload.core.offload.OffloadCore`: no event
    loop, no threads, no bytes - the core's bookkeeping alone, fast. Storage writes are
    finished by the rule ``write`` (stored or failed, in any order); closing is
    ``core.close()``, after which completions are still delivered."""

    check_bytes: ClassVar[bool] = False
    awaits: ClassVar[bool] = False
    #: The core under test (the mutation meta-tests put a broken one here).
    core_class: ClassVar[type[OffloadCore]] = OffloadCore

    def __init__(self) -> None:
        super().__init__()
        # writes: write jobs the core queued and the "store" has not finished.
        self.writes: list[WriteJob] = []

    def make_manager(
        self, config: OffloadConfig, backend: CheckedSimBackend, storage: FlakyStorage | None
    ) -> Any:
        device: Any
        if self.engine_kv is not None:
            device = EnginePages(self.engine_kv, config.page_size)
            host = backend.create_host_pool(config.host_pages, (device.page_bytes,), "uint8")
        else:
            device, host = backend.create_pools(config)
        backend.open(device, host)
        core = self.core_class(
            config,
            device_pool=device,
            host_pool=host,
            accept=backend.submit,
            clock=lambda: self.now,
            storage=storage is not None,
        )
        core.host.on_released = self.released  # type: ignore[attr-defined]
        return core

    @property
    def core(self) -> OffloadCore:
        return self.mgr  # type: ignore[no-any-return]

    def open_manager(self) -> None:
        pass

    def run(self, fn: Callable[[], _T]) -> _T:
        result = fn()
        assert self.backend is not None
        batch = self.backend.take_completions()
        if batch:
            self._released(self.mgr.complete(batch))
        self.writes += self.mgr.take_writes()
        return result

    def _released(self, released: list[Lifecycle]) -> None:
        for lc in released:
            self.released(lc)
        self.mgr.told(released)  # as a driver does once on_released ran

    def close_manager(self) -> None:
        self._released(self.mgr.close())  # the core goes on delivering what is in flight

    def tick(self) -> None:
        self.run(lambda: self._released(self.mgr.tick()))

    def finish_run(self) -> None:
        pass

    def stopped(self) -> bool:
        return False

    @precondition(lambda self: bool(self.writes))
    @rule(pos=st.integers(0, 7), stored=st.booleans(), cut=st.integers(0, 3))
    def write(self, pos: int, stored: bool, cut: int = 0) -> None:
        """The store finishes the write at ``pos`` (stored or failed), in any order
        across requests; as a writer does, one request's writes in the order they were
        handed over, and none after one of its chain failed (F33). Failed with ``cut``
        > 0, a chunk of two or more pages is stored in part (F34): every page but its
        page ``(cut - 1) % n``, reported with one flag per page."""
        self._write(pos % len(self.writes), stored, cut)

    def _write(self, pos: int, stored: bool, cut: int = 0) -> None:
        lid = self.writes[pos].lifecycle_id
        job = next(j for j in self.writes if j.lifecycle_id == lid)  # the request's oldest
        self.writes.remove(job)
        attempts = 1
        chain = job.chain
        n = len(job.host_pages)
        flags = [stored] * n
        if not stored and cut and n > 1:
            flags = [i != (cut - 1) % n for i in range(n)]
        error: BaseException | None = None
        if chain is not None and chain.broken:  # the writer skips it: not a write
            stored, attempts, error = False, 0, StorageError("skipped")
        else:
            if not stored and chain is not None:
                chain.broken = True
            self.observer.on_write(job.id, flags)
            if not stored:
                error = PartialWriteError("simulated", flags) if any(flags) else StorageError("down")
        self.run(lambda: self._released(self.mgr.write_done(job.id, stored, attempts=attempts, error=error)))

    def settle_writes(self) -> None:
        while self.writes:
            self._write(0, True)

    def teardown(self) -> None:
        if self.closed and self.backend is not None and self.mgr is not None:
            # Closed: completions are still delivered; everything must end released.
            for _ in range(10_000):
                if not self.backend.pending:
                    break
                self.run(lambda: self.backend.complete(self.backend.pending[0]))  # type: ignore[union-attr]
            self.settle_writes()
            self.observer.check(self.backend.pending)
            self.closed = False
            self._check_empty()
            return
        super().teardown()
