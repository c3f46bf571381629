"""Compile the declared load lifecycle into its runtime table, and validate it.

The table is a tuple indexed by ``state.value``, then by event index; an entry is the
destination state's index, or ``-1`` when the event is illegal there (the load
lifecycle has no guards). :data:`LOAD_OUTCOMES` gives, for the same pair, the outcomes
a load may end with when it takes that step (empty unless it reaches DONE).

:func:`validate_load` checks the declaration with the ``transitions`` library (one
``Machine(model=None)`` is built from it) and adds the structural checks that library
does not make; :func:`load_oracle` builds a ``transitions`` machine for one model, the
oracle the tests hold the compiled table against (as :mod:`kvoffload.lifecycle.table`
does for the offload lifecycle).
"""

from __future__ import annotations

from typing import Any

from kvoffload.lifecycle._graph import reachable, reaches
from kvoffload.lifecycle.load_spec import LOAD_SPEC, LoadOutcome, LoadSpec, LoadState
from kvoffload.lifecycle.table import SpecError

__all__ = [
    "LOAD_EVENT_INDEX",
    "LOAD_EVENT_NAMES",
    "LOAD_OUTCOMES",
    "LOAD_TABLE",
    "build_load_machine",
    "compile_load_table",
    "load_oracle",
    "validate_load",
]


def compile_load_table(
    spec: LoadSpec = LOAD_SPEC,
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[tuple[LoadOutcome, ...], ...], ...]]:
    """Compile ``spec`` to ``(table, outcomes)``: ``table[state][event] -> dest index or
    -1`` and ``outcomes[state][event]``, the outcomes that step may end with.

    Raises :class:`~kvoffload.lifecycle.table.SpecError` when a transition uses an
    undeclared event or two transitions apply to one (state, event)."""
    events = list(spec.events)
    table = [[-1] * len(events) for _ in spec.states]
    outs: list[list[tuple[LoadOutcome, ...]]] = [[() for _ in events] for _ in spec.states]
    for t in spec.transitions:
        if t.event not in spec.events:
            raise SpecError(f"transition {t} uses undeclared event {t.event!r}")
        e = events.index(t.event)
        if table[t.source.value][e] != -1:
            raise SpecError(f"{t.event!r} in {t.source.name} is ambiguous: two transitions apply")
        table[t.source.value][e] = t.dest.value
        outs[t.source.value][e] = t.outcomes
    return tuple(tuple(r) for r in table), tuple(tuple(r) for r in outs)


def build_load_machine(
    spec: LoadSpec = LOAD_SPEC, model: Any = None, machine_cls: Any = None, **kwargs: Any
) -> Any:
    """A ``transitions`` Machine built from the declaration (``model=None`` by default);
    ``machine_cls`` is a ``Machine`` subclass (the diagrams use ``GraphMachine``)."""
    if machine_cls is None:
        from transitions import Machine as machine_cls

    return machine_cls(
        model=model,
        states=[s.name for s in spec.states],
        initial=spec.initial.name,
        transitions=[
            {"trigger": t.event, "source": t.source.name, "dest": t.dest.name} for t in spec.transitions
        ],
        auto_transitions=False,
        **kwargs,
    )


def validate_load(spec: LoadSpec = LOAD_SPEC) -> None:
    """Validate the declaration; raise :class:`~kvoffload.lifecycle.table.SpecError`
    naming the first problem.

    Checks: ``transitions`` accepts it; the table compiles (deterministic); every state
    is reachable from the initial one; terminal states have no way out; every live state
    can reach a terminal one; ``cancel`` is legal in every live state; every event but
    the creation event is used; a step into a terminal state names at least one outcome
    and a step elsewhere names none.
    """
    try:
        machine = build_load_machine(spec)
    except Exception as exc:  # the library's own validation
        raise SpecError(f"transitions rejected the load declaration: {exc}") from exc
    declared = {s.name for s in spec.states}
    if set(machine.states) != declared:
        raise SpecError(f"transitions saw states {sorted(machine.states)}, declared {sorted(declared)}")
    table, _ = compile_load_table(spec)
    events = list(spec.events)
    succ: dict[LoadState, set[LoadState]] = {s: set() for s in spec.states}
    for t in spec.transitions:
        succ[t.source].add(t.dest)
        if (t.dest in spec.terminal) != bool(t.outcomes):
            raise SpecError(
                f"{t.event!r} from {t.source.name} to {t.dest.name} names outcomes {t.outcomes}: "
                "a step into a terminal state names at least one, any other step none"
            )
    if unreachable := set(spec.states) - reachable(succ, spec.initial):
        raise SpecError(f"unreachable states: {sorted(s.name for s in unreachable)}")
    for s in spec.terminal:
        if any(d != -1 for d in table[s.value]):
            raise SpecError(f"terminal state {s.name} has an outgoing transition")
    cancel = events.index(spec.cancel_event) if spec.cancel_event in events else -1
    for s in spec.live:
        if not reaches(succ, s, spec.terminal):
            raise SpecError(f"live state {s.name} cannot reach a terminal state")
        if cancel < 0 or table[s.value][cancel] == -1:
            raise SpecError(f"{spec.cancel_event} is not legal in live state {s.name}")
    used = {t.event for t in spec.transitions} | {spec.creation_event}
    if unused := set(events) - used:
        raise SpecError(f"declared events never used: {sorted(unused)}")


class _LoadOracleModel:
    """A model for the oracle machine (no guards: nothing to set before a trigger)."""

    state: str


def load_oracle(spec: LoadSpec = LOAD_SPEC) -> Any:
    """A fresh oracle model driven by a ``transitions`` machine of the declaration:
    ``model.trigger(event)`` raises ``transitions.MachineError`` on an illegal event;
    ``model.state`` is the state name."""
    model = _LoadOracleModel()
    build_load_machine(spec, model=model)
    return model


LOAD_EVENT_NAMES: tuple[str, ...] = tuple(LOAD_SPEC.events)
LOAD_EVENT_INDEX: dict[str, int] = {e: i for i, e in enumerate(LOAD_EVENT_NAMES)}
LOAD_TABLE, LOAD_OUTCOMES = compile_load_table(LOAD_SPEC)
