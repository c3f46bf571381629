"""The lifecycle state machine: the outside world as hypothesis rules.

:class:`LifecycleMachine` drives an :class:`~kvoffload.OffloadManager` on a checked
:class:`~kvoffload.testing.SimBackend` through admits, extends, finishes, aborts,
completions and failures in any order, dropped references, a full host pool and the
retraction barrier, and checks after every step what :class:`Observer` checks. It owns
its event loop (a :class:`ManagerHost` per example), so it needs no pytest plugin.

Users subclass it: override the ``*_request`` hooks to go through their own scheduler,
add rules, or set ``manager_class``. ``MyMachine.TestCase`` is a unittest case.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload._testing.host import ManagerHost
from kvoffload._testing.observer import KV_SHAPE, CheckedSimBackend, Observer
from kvoffload.config import OffloadConfig
from kvoffload.errors import InvalidTransition, PoolExhausted
from kvoffload.lifecycle.core import Lifecycle
from kvoffload.lifecycle.spec import LifecycleState, Outcome
from kvoffload.drivers.asyncio import OffloadManager

__all__ = ["LifecycleMachine"]

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

_slots = st.integers(0, 2)
_tokens = st.integers(0, 3)


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

    #: The manager under test (the mutation meta-tests put a broken one here).
    manager_class: ClassVar[type[OffloadManager]] = OffloadManager
    #: The request ids the rules draw from.
    rids: ClassVar[tuple[str, ...]] = ("r0", "r1", "r2")

    def __init__(self) -> None:
        super().__init__()
        self.observer = Observer()
        self.now = 0.0
        self.mgr: OffloadManager | None = None
        self.backend: CheckedSimBackend | None = None
        # held: the lifecycles the caller still references, per rid, oldest first.
        self.held: dict[str, list[Lifecycle]] = {rid: [] for rid in self.rids}
        self.waiters: list[asyncio.Task[None]] = []
        self.host: ManagerHost | None = None

    # --- hooks a user overrides to go through their own scheduler ----------------------

    def make_config(self, **sizes: Any) -> OffloadConfig:
        """The manager's config for this example (KV rows must stay int32 ``KV_SHAPE``)."""
        return OffloadConfig(kv_shape=KV_SHAPE, dtype="int32", host_wait_s=_HOST_WAIT_S, **sizes)

    def make_manager(
        self, config: OffloadConfig, backend: CheckedSimBackend, storage: bool
    ) -> OffloadManager:
        """Build the manager under test (``manager_class`` by default)."""
        return self.manager_class(
            config, backend=backend, storage="memory" if storage else None, clock=lambda: self.now
        )

    def admit_request(self, rid: str, prompt: list[int]) -> Lifecycle:
        """Admit a request; returns its lifecycle. Default: ``mgr.admit``."""
        assert self.mgr is not None
        return self.mgr.admit(rid, prompt)

    def commit_tokens(self, lc: Lifecycle, tokens: list[int]) -> None:
        """Tokens were decoded for ``lc``. Default: ``lc.extend``."""
        lc.extend(tokens)

    def finish_request(self, lc: Lifecycle) -> None:
        """``lc``'s request finished decoding. Default: ``lc.finish``."""
        lc.finish()

    def abort_request(self, lc: Lifecycle) -> None:
        """``lc``'s request was cancelled. Default: ``lc.abort``."""
        lc.abort()

    # --- plumbing ------------------------------------------------------------------------

    def run(self, fn: Callable[[], _T]) -> _T:
        """Call ``fn`` on the machine's event loop, then wait until every signalled
        completion was delivered. Raises if the manager's tasks crashed or hung."""
        assert self.host is not None
        return self.host.call(fn)

    def _newest(self, slot: int) -> Lifecycle | None:
        held = self.held[self.rids[slot % len(self.rids)]]
        return held[-1] if held else None

    def _expect(self, lc: Lifecycle, legal: bool, action: Callable[[], None], what: str) -> bool:
        """Run ``action``; an illegal one must raise InvalidTransition and change nothing."""
        assert self.mgr is not None
        before = (self.mgr.statistics(), lc.state, lc.inflight, lc.committed, list(lc.device_pages))
        try:
            self.run(action)
        except InvalidTransition:
            assert not legal, f"{what} raised InvalidTransition in {before[1].name}"
        except PoolExhausted:
            pass
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
    ) -> None:
        """Open a small manager; admit ``first_prompt`` on ``rids[0]`` (so that no example
        is without a request) unless it is None."""
        config = self.make_config(
            page_size=page_size,
            stride=page_size * stride_pages,
            device_pages=device_pages,
            host_pages=stride_pages + spare_host_pages,
            on_host_full=on_host_full,
            offload_prompt=offload_prompt,
            watchdog_interval_s=3600.0,
        )
        self.backend = CheckedSimBackend(self.observer)
        self.mgr = self.make_manager(config, self.backend, storage)
        self.observer.attach(self.mgr)
        self.host = ManagerHost(self.mgr, hang_s=_HANG_S)
        if first_prompt is not None:
            self.admit(0, first_prompt)

    @rule(slot=_slots, prompt=st.lists(_tokens, max_size=12))
    def admit(self, slot: int, prompt: list[int]) -> None:
        assert self.mgr is not None
        rid = self.rids[slot % len(self.rids)]
        before = self.mgr.statistics()
        try:
            lc = self.run(lambda: self.admit_request(rid, prompt))
        except PoolExhausted:
            assert self.mgr.statistics() == before, "a refused admit changed the manager"
            return
        self.observer.on_admit(lc, prompt)
        self.held[rid].append(lc)

    @rule(slot=_slots, tokens=st.lists(_tokens, min_size=1, max_size=10))
    def extend(self, slot: int, tokens: list[int]) -> None:
        lc = self._newest(slot)
        if lc is not None:
            self._extend(lc, tokens)

    def _extend(self, lc: Lifecycle, tokens: list[int]) -> None:
        legal = lc.state in (_P, _O)
        if self._expect(lc, legal, lambda: self.commit_tokens(lc, tokens), "extend"):
            self.observer.on_extend(lc, tokens)

    @rule(slot=_slots)
    def finish(self, slot: int) -> None:
        lc = self._newest(slot)
        if lc is not None:
            self._expect(lc, lc.state in (_P, _O), lambda: self.finish_request(lc), "finish")

    @rule(slot=_slots)
    def abort(self, slot: int) -> None:
        lc = self._newest(slot)
        if lc is not None:
            self._expect(lc, lc.state is not _R, lambda: self.abort_request(lc), "abort")

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
        """Several completions signalled before the delivery task runs: one batch."""
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

    @rule()
    def exhaust_host_pool(self) -> None:
        """Every decoding request commits a stride at once: more chunks than host pages."""
        assert self.mgr is not None
        stride = self.mgr.config.stride
        for held in self.held.values():
            for lc in held:
                if lc.state in (_P, _O):
                    self._extend(lc, [len(lc.rid) % 4] * stride)

    @rule(slot=_slots)
    def retract(self, slot: int) -> None:
        """Retraction: abort and wait until RELEASED; then no copy may read the pages."""
        lc = self._newest(slot)
        if lc is None:
            return
        pages = list(lc.device_pages)
        self._spawn(lc.retract(), lambda: self._retracted(lc, pages))

    def _retracted(self, lc: Lifecycle, pages: list[int]) -> None:
        assert lc.state is _R and lc.device_pages == [], f"retract() returned with {lc!r}"
        assert self.backend is not None
        assert not any(t.lifecycle is lc for t in self.backend.pending), f"{lc!r} retracted mid-copy"
        assert lc.outcome is not None

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
            assert not any(t.lifecycle is lc for t in self.backend.pending), f"{lc!r} is still copied"

        self._spawn(lc.wait_quiescent(), quiet)

    def _spawn(self, wait: Coroutine[Any, Any, None], then: Callable[[], None]) -> None:
        async def waiter() -> None:
            await wait
            then()

        self.run(lambda: self.waiters.append(asyncio.ensure_future(waiter())))

    @rule(seconds=st.sampled_from([1.0, 2 * _HOST_WAIT_S]))
    def advance_clock(self, seconds: float) -> None:
        """Virtual time passes; the watchdog tick expires deferrals past host_wait_s."""
        assert self.mgr is not None
        self.now += seconds
        self.run(self.mgr.tick)

    # --- after every step ----------------------------------------------------------------

    @invariant()
    def outside_rules_hold(self) -> None:
        if self.mgr is None or self.backend is None:
            return
        for task in [w for w in self.waiters if w.done()]:
            self.waiters.remove(task)
            task.result()
        self.observer.check(self.backend.pending)

    def teardown(self) -> None:
        """Finish what is left, complete every copy, and check that nothing
        leaked: every lifecycle RELEASED, both pools empty, the ledger balanced."""
        host, mgr, backend = self.host, self.mgr, self.backend
        if host is None or mgr is None or backend is None:
            return
        _report_coverage(self.observer.seen)
        try:
            if host.stopped:
                return  # the manager crashed: that step already failed
            self._drain_all()
            self.observer.check(backend.pending)
            self._check_empty()
        finally:
            host.close()
            for task in self.waiters:  # a crashed run's waiters: their errors are known
                if task.done() and not task.cancelled():
                    task.exception()
            self.held.clear()

    def _drain_all(self) -> None:
        mgr, backend = self.mgr, self.backend
        assert mgr is not None and backend is not None
        for lc in mgr.lifecycles():
            if lc.state in (_P, _O):
                self.run(lc.finish)
        for _ in range(10_000):
            if not backend.pending:
                break
            self.run(lambda: backend.complete(backend.pending[0]))

    def _check_empty(self) -> None:
        mgr, backend = self.mgr, self.backend
        assert mgr is not None and backend is not None
        for task in self.waiters:
            assert task.done(), "a retract()/wait_quiescent() waiter was never woken"
            task.result()
        stats = mgr.statistics()
        assert stats.live_lifecycles == 0 and not backend.pending, f"left live: {mgr.lifecycles()}"
        assert stats.device_pages_used == 0, f"{stats.device_pages_used} device page(s) leaked"
        assert stats.host_pages_used == 0, f"{stats.host_pages_used} host page(s) leaked"
        for held in self.held.values():
            for lc in held:
                assert lc.outcome in (Outcome.COMPLETED, Outcome.ABORTED, Outcome.FAILED)
