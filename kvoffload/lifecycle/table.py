"""Compile the declared lifecycle into the runtime table, and validate it.

The table is a tuple indexed by ``state.value``, then by event index, then by a
*condition* index ``(copying << 1) | deferred``; an entry is the destination
state's index, or ``-1`` when the event is illegal. A transition on the hot path is
three indexings: 1/33 to 1/39 of a transition of a ``transitions`` Machine per object
(``benchmarks/bench_bookkeeping.py``, 4 runs on a shared 2-vCPU machine; 0.23 µs there).

:func:`validate` checks the declaration with the ``transitions`` library (one
``Machine(model=None)`` is built from it) and adds the structural checks that
library does not make. :func:`oracle_machine` builds a ``transitions`` machine for
one model, used by the tests as the oracle the compiled table must agree with.
"""

from __future__ import annotations

from typing import Any

from kvoffload.lifecycle._graph import reachable, reaches
from kvoffload.lifecycle.spec import (
    GUARD_PREDICATES,
    SPEC,
    LifecycleSpec,
    LifecycleState,
)

__all__ = [
    "CONDITIONS",
    "EVENT_INDEX",
    "EVENT_NAMES",
    "TABLE",
    "SpecError",
    "compile_table",
    "condition_index",
    "oracle_machine",
    "validate",
]

#: Every (copying, deferred) combination, in condition-index order.
CONDITIONS: tuple[tuple[bool, bool], ...] = ((False, False), (False, True), (True, False), (True, True))


class SpecError(Exception):
    """The lifecycle declaration is inconsistent (a bug in spec.py, caught at import)."""


def condition_index(copying: bool, deferred: bool) -> int:
    """Index of a (copying, deferred) condition in a table row."""
    return (copying << 1) | deferred


def compile_table(spec: LifecycleSpec = SPEC) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Compile ``spec`` to ``table[state][event][condition] -> dest index or -1``.

    Raises :class:`SpecError` when two transitions apply to one (state, event,
    condition): the machine must be deterministic.
    """
    events = list(spec.events)
    table = [[[-1] * 4 for _ in events] for _ in spec.states]
    for t in spec.transitions:
        if t.event not in spec.events:
            raise SpecError(f"transition {t} uses undeclared event {t.event!r}")
        if t.guard is not None and t.guard not in GUARD_PREDICATES:
            raise SpecError(f"transition {t} uses undeclared guard {t.guard!r}")
        conds = CONDITIONS if t.guard is None else GUARD_PREDICATES[t.guard]
        row = table[t.source.value][events.index(t.event)]
        for c in conds:
            i = condition_index(*c)
            if row[i] != -1:
                raise SpecError(
                    f"{t.event!r} in {t.source.name} is ambiguous under condition "
                    f"copying={c[0]}, deferred={c[1]}"
                )
            row[i] = t.dest.value
    return tuple(tuple(tuple(r) for r in state_rows) for state_rows in table)


def _machine_transitions(spec: LifecycleSpec) -> list[dict[str, Any]]:
    out = []
    for t in spec.transitions:
        d: dict[str, Any] = {"trigger": t.event, "source": t.source.name, "dest": t.dest.name}
        if t.guard is not None:
            d["conditions"] = [f"guard_{t.guard}"]
        out.append(d)
    return out


def build_machine(
    spec: LifecycleSpec = SPEC, model: Any = None, machine_cls: Any = None, **kwargs: Any
) -> Any:
    """A ``transitions`` Machine built from the declaration (``model=None`` by default).

    ``machine_cls`` is a ``Machine`` subclass (the diagrams use ``GraphMachine``)."""
    if machine_cls is None:
        from transitions import Machine as machine_cls

    return machine_cls(
        model=model,
        states=[s.name for s in spec.states],
        initial=spec.initial.name,
        transitions=_machine_transitions(spec),
        auto_transitions=False,
        **kwargs,
    )


def validate(spec: LifecycleSpec = SPEC) -> None:
    """Validate the declaration; raise :class:`SpecError` naming the first problem.

    Checks: ``transitions`` accepts it; the table compiles (deterministic guards);
    every state is reachable from the initial one; terminal states have no way out;
    every live state can reach a terminal one; ``abort`` is legal in every live state
    under every condition; every event but the creation event is used.
    """
    try:
        machine = build_machine(spec)
    except Exception as exc:  # the library's own validation
        raise SpecError(f"transitions rejected the declaration: {exc}") from exc
    declared = {s.name for s in spec.states}
    if set(machine.states) != declared:
        raise SpecError(f"transitions saw states {sorted(machine.states)}, declared {sorted(declared)}")
    table = compile_table(spec)
    events = list(spec.events)
    succ: dict[LifecycleState, set[LifecycleState]] = {s: set() for s in spec.states}
    for t in spec.transitions:
        succ[t.source].add(t.dest)
    if unreachable := set(spec.states) - reachable(succ, spec.initial):
        raise SpecError(f"unreachable states: {sorted(s.name for s in unreachable)}")
    for s in spec.terminal:
        if any(d != -1 for row in table[s.value] for d in row):
            raise SpecError(f"terminal state {s.name} has an outgoing transition")
    for s in spec.live:
        if not reaches(succ, s, spec.terminal):
            raise SpecError(f"live state {s.name} cannot reach a terminal state")
        if any(d == -1 for d in table[s.value][events.index("abort")]):
            raise SpecError(f"abort is not legal in live state {s.name} under every condition")
    used = {t.event for t in spec.transitions} | {spec.creation_event}
    if unused := set(events) - used:
        raise SpecError(f"declared events never used: {sorted(unused)}")


class _OracleModel:
    """A model whose guards read two flags the test sets before each trigger."""

    def __init__(self) -> None:
        self.copying = False
        self.deferred = False

    def _holds(self, guard: str) -> bool:
        return (self.copying, self.deferred) in GUARD_PREDICATES[guard]

    def guard_idle(self) -> bool:
        return self._holds("idle")

    def guard_busy(self) -> bool:
        return self._holds("busy")

    def guard_drained(self) -> bool:
        return self._holds("drained")

    def guard_copying(self) -> bool:
        return self._holds("copying")


def oracle_machine(spec: LifecycleSpec = SPEC) -> Any:
    """A fresh oracle model driven by a ``transitions`` machine of the declaration.

    Set ``model.copying`` / ``model.deferred``, then ``model.trigger(event)``; it
    raises ``transitions.MachineError`` on an illegal event and returns ``False``
    when no guard held. ``model.state`` is the state name.
    """
    model = _OracleModel()
    build_machine(spec, model=model)
    return model


EVENT_NAMES: tuple[str, ...] = tuple(SPEC.events)
EVENT_INDEX: dict[str, int] = {e: i for i, e in enumerate(EVENT_NAMES)}
TABLE = compile_table(SPEC)
