"""Every interleaving of a small world, checked: a bounded breadth-first exploration of
the bare core.

The property suite samples schedules; this module enumerates them. For each of a few
small configurations (:class:`World`) it explores, breadth first, every sequence of
the outside world's actions that it allows - admits of several
lifecycles that share one request id, extends, finishes, an abort, completions and
failures of the in-flight copies in any order (one at a time, or two in one delivery
batch), storage writes finishing in any order, a refusing copy engine, virtual time
passing, closing - on a bare :class:`~kvoffload.core.offload.OffloadCore` under
:class:`~kvoffload.testing.CoreLifecycleMachine`. After every step it runs the
machine's own after-step check (the :class:`~kvoffload.testing.Observer`'s whole
``check``: the ledger, states, in-flight counts (F1), keys against the reference
chain (F11), device frees (F3/F4/F8), host frees, holes, flushes, outcomes, ...), and
on every state where no action is left the machine's ``teardown`` (drain everything,
nothing leaked).

The core holds real objects (lifecycles, transfers, pools), so a state is not copied:
each one is reached again by replaying its action sequence from a fresh machine, and
identified by a canonical signature (:func:`signature`) - what the core, the pools,
the backend and the observer's model hold, with objects named by their place (the
n-th lifecycle, a transfer by its lifecycle and first token) rather than their ids.
States with the same signature are explored once, so the search ends; breadth first,
so the first violation found comes with a shortest schedule that shows it.

``python -m kvoffload._testing.explore`` runs the default bound and prints the counts;
``--large`` the slow one.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload._testing.machine import CoreLifecycleMachine
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.offload import OffloadCore
from kvoffload.errors import BackendError, InvalidTransition, PoolExhausted
from kvoffload.lifecycle.spec import LifecycleState

__all__ = [
    "DEFAULT",
    "LARGE",
    "Counterexample",
    "Exploration",
    "World",
    "explore",
    "signature",
]

_P, _O, _R = LifecycleState.PENDING, LifecycleState.OFFLOADING, LifecycleState.RELEASED
#: The request id every explored lifecycle carries: they all share it (F1).
RID = "r0"

Action = tuple[Any, ...]


@dataclass(frozen=True)
class World:
    """One small configuration (the machine's ``open``) and what may happen in it.

    ``host_pages`` of 1-2 pages make the host pool run out; ``stride_pages`` 2 with
    ``page_size`` 1 leaves whole pages for ``finish`` to flush (F12)."""

    name: str
    page_size: int = 1
    stride_pages: int = 1
    host_pages: int = 1
    on_host_full: str = "drop"
    offload_prompt: bool = False
    storage: bool = False
    device_pages: int = 8
    #: A listener is attached: the core takes its slow, event-building path, and every
    #: transition is replayed on the spec's ``transitions`` oracle.
    events: bool = False
    #: Lifecycles admitted, all with the request id ``RID``.
    lifecycles: int = 2
    #: Tokens each lifecycle commits in all (prompt and extends): with page size 1 and a
    #: one-page stride, at most this many chunks.
    max_tokens: int = 2
    #: The prompt lengths an admit may take.
    prompts: tuple[int, ...] = (0,)
    #: The token counts one extend may commit.
    extends: tuple[int, ...] = (1,)
    #: Copies the test fails; lifecycles it aborts; episodes of a refusing copy engine;
    #: clock advances (each past the host wait: deferred chunks expire).
    failures: int = 1
    aborts: int = 1
    refusals: int = 0
    ticks: int = 0
    #: Whether two completions may arrive in one delivery batch.
    batches: bool = False
    #: Whether the core may be closed.
    close: bool = True
    #: Whether every new state is also drained by the machine's teardown (the leak
    #: check); else only the states where no action is enabled are.
    teardown_every: bool = False

    def open_arguments(self) -> dict[str, Any]:
        """The keyword arguments of the machine's ``open``."""
        return {
            "page_size": self.page_size,
            "stride_pages": self.stride_pages,
            "device_pages": self.device_pages,
            "spare_host_pages": self.host_pages - self.stride_pages,
            "on_host_full": self.on_host_full,
            "offload_prompt": self.offload_prompt,
            "storage": self.storage,
            "first_prompt": None,
            "events": self.events,
            "engine_owned": False,
        }

    def __str__(self) -> str:
        flags = [f"page={self.page_size}", f"stride={self.stride_pages}p", f"host={self.host_pages}p"]
        flags.append(self.on_host_full)
        flags += [n for n in ("offload_prompt", "storage", "events", "batches", "close") if getattr(self, n)]
        flags += [
            f"{n}={getattr(self, n)}"
            for n in ("lifecycles", "max_tokens", "failures", "aborts", "refusals", "ticks")
        ]
        return f"{self.name} ({' '.join(flags)}, prompts {list(self.prompts)})"


#: The CI bound (tests/property/test_exhaustive.py): every mutant of
#: tests/test_mutations.py shows up in one of its worlds.
DEFAULT: tuple[World, ...] = (
    # Two lifecycles of one request id, three chunks each, a one-page host pool: F1,
    # F3, F4, F6, F7, F8, F9 - a failure, an abort and close anywhere.
    World("reuse", host_pages=1, on_host_full="drop", max_tokens=3),
    # Two chunks in flight at once, delivered alone or in one batch, in either order;
    # the third waits for host pages: F5, F11.
    World("two in flight", host_pages=2, on_host_full="wait", max_tokens=2, batches=True),
    # A two-page stride: finish flushes the whole pages since the last one (F12); the
    # storage tier holds host pages until each write finishes, in any order.
    World("flush", stride_pages=2, host_pages=2, storage=True, max_tokens=2),
    # A deferred chunk whose retry the copy engine refuses (F20), or that expires.
    World(
        "refused retry", host_pages=1, on_host_full="wait", lifecycles=1, max_tokens=3, refusals=1, ticks=1
    ),
)
#: The slow bound (``-m slow``): each world of the CI bound with more (prompts of one
#: token, three chunks a lifecycle, two lifecycles, a refusing copy engine), and one on
#: the event-building path.
LARGE: tuple[World, ...] = (
    World("reuse", host_pages=1, on_host_full="drop", max_tokens=3, prompts=(0, 1), refusals=1),
    World("two in flight", host_pages=2, on_host_full="wait", max_tokens=3, batches=True),
    World("flush", stride_pages=2, host_pages=2, storage=True, max_tokens=3),
    World("refused retry", host_pages=1, on_host_full="wait", max_tokens=2, refusals=1, ticks=1),
    World("events", host_pages=2, on_host_full="drop", events=True, max_tokens=2, batches=True),
)


@dataclass
class Counterexample:
    """A violation and the shortest schedule (from the world's ``open``) that shows it."""

    world: World
    schedule: tuple[Action, ...]
    error: BaseException
    #: Whether it surfaced in the teardown (the drain after the last step).
    at_teardown: bool = False

    def __str__(self) -> str:
        lines = [f"world: {self.world}", *(f"  {_show(a)}" for a in self.schedule)]
        if self.at_teardown:
            lines.append("  teardown()")
        lines.append(f"-> {type(self.error).__name__}: {self.error}")
        return "\n".join(lines)


@dataclass
class Exploration:
    """What an exploration visited: distinct states, transitions (actions applied to an
    explored state), the deepest schedule, the time, and the violations found."""

    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    violations: list[Counterexample] = field(default_factory=list)
    per_world: list[tuple[World, int, int]] = field(default_factory=list)

    def summary(self) -> str:
        """One line of counts."""
        return (
            f"exhaustive: {self.states} states, {self.transitions} transitions, depth {self.depth}, "
            f"{len(self.per_world)} worlds, {self.seconds:.1f} s, {len(self.violations)} violation(s)"
        )


def _show(a: Action) -> str:
    name, *args = a
    return f"{name}({', '.join(map(repr, args))})"


class _Explorer(CoreLifecycleMachine):
    """The core machine, acting on the n-th lifecycle (not the newest of a rid), with
    the exploration's budgets. Each rule body is the machine's own."""

    rids = (RID,)

    def __init__(self) -> None:
        super().__init__()
        self.budget: dict[str, int] = {"failures": 0, "aborts": 0, "refusals": 0, "ticks": 0}
        # replaying: the steps run again to reach a state already checked; a refused
        # call's "nothing changed" comparison was made when the step was first explored.
        self.replaying = False

    def _expect(self, lc: Lifecycle, legal: bool, action: Callable[[], None], what: str) -> bool:
        if not self.replaying:
            return super()._expect(lc, legal, action, what)
        try:
            self.run(action)
        except (InvalidTransition, PoolExhausted, BackendError):
            return False
        return True

    def check_step(self) -> None:
        """The after-step check: every ``@invariant`` the machine declares, as
        hypothesis runs them (today ``outside_rules_hold``: the Observer's ``check``),
        so a check added to the machine or the observer is part of the exploration."""
        invariants = getattr(self, "invariants", None)  # hypothesis' list for this class
        if invariants is None:  # pragma: no cover - a hypothesis that keeps it elsewhere
            self.outside_rules_hold()
            return
        for inv in invariants:
            if all(pre(self) for pre in inv.preconditions):
                inv.function(self)

    def nth(self, i: int) -> Lifecycle:
        return self.held[RID][i]

    def token(self, i: int, pos: int) -> int:
        return (i + pos) % 4

    def act(self, a: Action) -> None:
        name = a[0]
        if name == "admit":
            i, n = len(self.held[RID]), a[1]
            self.admit(0, [self.token(i, p) for p in range(n)])
        elif name == "extend":
            lc = self.nth(a[1])
            self._extend(lc, [self.token(a[1], lc.committed + p) for p in range(a[2])])
        elif name == "finish":
            lc = self.nth(a[1])
            dropped = self.core.counters.pages_dropped
            if self._expect(lc, lc.state in (_P, _O), lambda: self.finish_request(lc), "finish"):
                self.observer.on_end(lc, aborted=False)
                self.observer.on_finished(lc, dropped_before=dropped)
        elif name == "abort":
            self.budget["aborts"] += 1
            lc = self.nth(a[1])
            if self._expect(lc, lc.state is not _R, lambda: self.abort_request(lc), "abort"):
                self.observer.on_end(lc, aborted=True)
        elif name == "complete":
            self.complete(a[1])
        elif name == "fail":
            self.budget["failures"] += 1
            self.fail(a[1])
        elif name == "batch":
            self.complete_batch(list(a[1:]), fail_first=False)
        elif name == "write":
            super().write(a[1], a[2])
        elif name == "refuse":
            if a[1]:
                self.budget["refusals"] += 1
            self.refuse_submissions(a[1])
        elif name == "tick":
            self.budget["ticks"] += 1
            self.advance_clock(a[1])
        elif name == "close":
            self.close()
        else:  # pragma: no cover - a typo in an action
            raise ValueError(f"unknown action {a!r}")

    def actions(self, world: World) -> list[Action]:
        """Every action enabled now, in a fixed order."""
        out: list[Action] = []
        backend = self.backend
        assert backend is not None
        held = self.held[RID]
        open_ = not self.closed
        live = any(lc.state is not _R for lc in held)
        if open_ and len(held) < world.lifecycles:
            out += [("admit", n) for n in world.prompts]
        if open_:
            for i, lc in enumerate(held):
                if lc.state in (_P, _O):
                    out += [("extend", i, k) for k in world.extends if lc.committed + k <= world.max_tokens]
                    out.append(("finish", i))
                if lc.state is not _R and self.budget["aborts"] < world.aborts:
                    out.append(("abort", i))
        n = len(backend.pending)
        out += [("complete", j) for j in range(n)]
        if self.budget["failures"] < world.failures:
            out += [("fail", j) for j in range(n)]
        if world.batches and n >= 2:
            out += [("batch", j, k) for j in range(n) for k in range(n - 1)]
        out += [("write", j, stored) for j in range(len(self.writes)) for stored in (True, False)]
        if open_:
            if backend.refuse:
                out.append(("refuse", False))
            elif self.budget["refusals"] < world.refusals and live:
                out.append(("refuse", True))
            if self.core.deferred and self.budget["ticks"] < world.ticks:
                out.append(("tick", 20.0))
            if world.close and live:
                out.append(("close",))
        return out


def signature(m: _Explorer) -> tuple[Any, ...]:
    """A canonical, hashable picture of everything that decides what the machine does
    next and what its checks see: each lifecycle's fields and the observer's model of
    it (by admission order), the in-flight transfers (by their lifecycle and first
    token, never by id), the deferred queue, the queued writes, both pools' free lists,
    the clock, the budgets used.

    Two reductions, exact for the steps (the futures of two states they identify are
    the same up to renaming; only ``teardown`` drains in the backend's order): the
    in-flight transfers and the queued writes are sets - every action takes any of
    them by position, so their order only names them - and page
    ids are renamed in order of first appearance (lifecycles, transfers, writes, then
    the free lists), since nothing compares page ids but for equality. Left out: the
    counters (no step reads them; the ledger checks their relations to this state
    after every step, so interleavings that reach one state with different totals are
    one state), what only logging reads (rate limits, the store's failure burst), and
    time stamps that only statistics read."""
    core = m.core
    backend = m.backend
    assert backend is not None
    held = m.held[RID]
    index: dict[int, int] = {lc.id: i for i, lc in enumerate(held)}
    obs = m.observer
    dev: dict[int, int] = {}
    host: dict[int, int] = {}

    def rename(names: dict[int, int], pages: Any) -> tuple[int, ...]:
        return tuple(names.setdefault(p, len(names)) for p in pages)

    def key(t: Any) -> tuple[int, int, int]:
        return (index.get(t.lifecycle_id, -1), t.first_token, t.n_tokens)

    lcs = []
    for lc in held:
        model = obs.lcs.get(lc.id)
        lcs.append(
            (
                lc.id,
                lc._s,
                lc.inflight,
                lc._committed,
                lc.submitted,
                lc.due,
                lc._quiet,
                lc._deferred_since,
                lc._aborted,
                lc._failed,
                lc.outcome,
                rename(dev, lc.device_pages),
                lc._cap,
                len(lc._tail),
                lc._chain,
                None
                if model is None
                else (
                    len(model.tokens),
                    model.ended,
                    model.aborted,
                    model.failed,
                    model.refused,
                    model.reported,
                    model.sent,
                ),
            )
        )
    pending = sorted(backend.pending, key=key)
    transfers = tuple((key(t), rename(dev, t.device_pages), rename(host, t.host_pages)) for t in pending)
    writes = sorted(m.writes, key=lambda j: (index.get(j.lifecycle_id, -1), tuple(j.keys)))
    return (
        tuple(lcs),
        transfers,
        tuple(sorted(key(t) for t in core.inflight.values())),
        tuple(sorted((key(s.transfer), s.signalled) for s in obs.transfers.values())),
        tuple(index.get(lc.id, -1) for lc in core.deferred),
        tuple((index.get(j.lifecycle_id, -1), len(j.keys), rename(host, j.host_pages)) for j in writes),
        rename(dev, core.device_pool._free),  # type: ignore[union-attr]
        rename(host, core.host_pool._free),
        tuple(core.state_counts),
        core.registry.next_id,
        core.closing,
        m.closed,
        m.now,
        backend.refuse,
        obs.lost,
        tuple(sorted(m.budget.items())),
    )


def _drop(logger: Any, method: str, event: Any) -> Any:
    import structlog

    raise structlog.DropEvent


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """Mute kvoffload's log lines while exploring (every replay is a fresh core whose
    rate limits let the first warning of a kind through); restore structlog after.
    Debug stays off, as in production: the explored paths are the quiet ones."""
    import structlog

    was_configured = structlog.is_configured()
    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL), processors=[_drop]
    )
    try:
        yield
    finally:
        if was_configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()


#: The explorer's machine on each core class explored so far.
_MACHINES: dict[type[OffloadCore], type[_Explorer]] = {OffloadCore: _Explorer}


def _machine(world: World, core_class: type[OffloadCore]) -> _Explorer:
    cls = _MACHINES.get(core_class)
    if cls is None:
        name = f"ExplorerOn{core_class.__name__}"
        cls = _MACHINES[core_class] = type(name, (_Explorer,), {"core_class": core_class})
    m = cls()
    m.open(**world.open_arguments())
    return m


def _replay(world: World, core_class: type[OffloadCore], schedule: Sequence[Action]) -> _Explorer:
    """A fresh machine brought to the state ``schedule`` reached, exactly as it was
    first explored: each step followed by the after-step check, since the check is also
    where the observer's model learns what was delivered (a failure's hole, F33) - a
    replay without it left the model behind the core and reported false F12 losses."""
    m = _machine(world, core_class)
    m.replaying = True
    for a in schedule:
        m.act(a)
        m.check_step()
    m.replaying = False
    return m


def explore(
    worlds: Sequence[World] = DEFAULT,
    core_class: type[OffloadCore] = OffloadCore,
    *,
    stop_at_first: bool = True,
) -> Exploration:
    """Explore every schedule each of ``worlds`` allows on ``core_class``, breadth
    first - one depth at a time across all the worlds - checking every step, and
    draining (the machine's ``teardown``) every state where nothing more is enabled
    (with ``World.teardown_every``, every new state).

    Returns the counts and the violations found, each with a shortest schedule that
    shows it; with ``stop_at_first`` the search stops at the first violation, which
    then has the shortest schedule of all the worlds. Logging is muted meanwhile
    (see :func:`_quiet_logs`).
    """
    result = Exploration()
    start = time.perf_counter()
    with _quiet_logs():
        searches = [_Search(w, core_class, result, stop_at_first) for w in worlds]
        try:
            for search in searches:
                search.start()
            while any(search.frontier for search in searches):
                for search in searches:
                    search.deeper()
        except _Stop:
            pass
    result.per_world = [(s.world, s.states, s.transitions) for s in searches]
    result.seconds = time.perf_counter() - start
    return result


class _Stop(Exception):
    """The first violation was found and the search stops."""


#: A state to explore: its schedule, its machine if kept, and its enabled actions.
_Node = tuple[tuple[Action, ...], "_Explorer | None", list[Action]]


class _Search:
    """The breadth-first search of one world, a depth at a time."""

    def __init__(self, world: World, core_class: type[OffloadCore], result: Exploration, stop: bool) -> None:
        self.world = world
        self.core_class = core_class
        self.result = result
        self.stop = stop
        self.seen: set[tuple[Any, ...]] = set()
        # frontier: the new states found at the last depth.
        self.frontier: list[_Node] = []
        self.states = self.transitions = 0

    def violation(self, path: tuple[Action, ...], exc: BaseException, at_teardown: bool = False) -> None:
        self.result.violations.append(Counterexample(self.world, path, exc, at_teardown))
        if self.stop:
            raise _Stop

    def start(self) -> None:
        root = _machine(self.world, self.core_class)
        try:
            root.check_step()
        except Exception as exc:
            self.violation((), exc)
            return
        self.seen.add(signature(root))
        self.frontier = [self.found((), root)]

    def found(self, path: tuple[Action, ...], m: _Explorer) -> _Node:
        """A new state: its enabled actions, and the machine kept to explore the last
        of them without a replay - or, where none is enabled, drained and checked."""
        self.states += 1
        self.result.states += 1
        self.result.depth = max(self.result.depth, len(path))
        actions = m.actions(self.world)
        if self.world.teardown_every and actions:
            drained = _replay(self.world, self.core_class, path)
            try:
                drained.teardown()
            except Exception as exc:
                self.violation(path, exc, at_teardown=True)
        if not actions:
            try:
                m.teardown()
            except Exception as exc:
                self.violation(path, exc, at_teardown=True)
            return path, None, actions
        return path, m, actions

    def deeper(self) -> None:
        """Apply every enabled action to every state of the frontier, check each step,
        and keep the new states as the next frontier."""
        frontier, self.frontier = self.frontier, []
        for schedule, kept, actions in frontier:
            for k, a in enumerate(actions):
                self.transitions += 1
                self.result.transitions += 1
                path = (*schedule, a)
                if kept is not None and k == len(actions) - 1:
                    m = kept
                else:
                    m = _replay(self.world, self.core_class, schedule)
                try:
                    m.act(a)
                    m.check_step()
                except Exception as exc:
                    self.violation(path, exc)
                    continue
                sig = signature(m)
                if sig not in self.seen:
                    self.seen.add(sig)
                    self.frontier.append(self.found(path, m))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvoffload._testing.explore [--large]``: explore, print the counts
    (per world and in all) and any counterexample; exit 1 if one was found."""
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload._testing.explore", description="Explore every interleaving of small worlds."
    )
    parser.add_argument("--large", action="store_true", help="the slow bound (tests marked slow)")
    args = parser.parse_args(argv)
    result = explore(LARGE if args.large else DEFAULT, stop_at_first=False)
    for world, states, transitions in result.per_world:
        print(f"  {world}: {states} states, {transitions} transitions")
    print(result.summary())
    for v in result.violations:
        print(v)
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
