"""The lifecycle declaration: it validates, the validator rejects broken variants, and
the compiled runtime table agrees with the ``transitions`` machine (the oracle).

What the table-vs-oracle test shows, and what it does not: both sides are built from
the same declaration (``SPEC``), so it tests the compiler (``compile_table`` reads the
declaration as ``transitions`` does), not the design. A wrong transition in ``SPEC``
would be on both sides and pass. The design is tested elsewhere: ``validate`` (above)
checks the declaration's shape, and the property suite's observer derives each
lifecycle's state from what the test did, without the table
(``kvoffload/_testing/observer.py``).
"""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
from transitions import MachineError

from kvoffload.lifecycle.spec import SPEC, TRANSITIONS, LifecycleSpec, LifecycleState, TransitionSpec
from kvoffload.lifecycle.table import (
    CONDITIONS,
    EVENT_INDEX,
    TABLE,
    SpecError,
    compile_table,
    condition_index,
    oracle_machine,
    validate,
)

PENDING, OFFLOADING, FINISHING, RELEASED = LifecycleState
#: Events a lifecycle can receive (``admit`` creates one; it is never a transition).
EVENTS = [e for e in SPEC.events if e != SPEC.creation_event]


def variant(*, drop: object = None, add: tuple[TransitionSpec, ...] = ()) -> LifecycleSpec:
    """SPEC with the transitions matching ``drop`` removed and ``add`` appended."""
    keep = tuple(t for t in TRANSITIONS if drop is None or not drop(t))  # type: ignore[operator]
    return dataclasses.replace(SPEC, transitions=keep + add)


def test_the_declaration_validates() -> None:
    """The shipped SPEC passes every check, and TABLE is its compilation."""
    validate(SPEC)
    assert compile_table(SPEC) == TABLE
    assert (
        SPEC.initial is PENDING
        and SPEC.terminal == {RELEASED}
        and SPEC.live == {PENDING, OFFLOADING, FINISHING}
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param(
            variant(drop=lambda t: t.dest is FINISHING and t.source is not FINISHING),
            r"unreachable states: \['FINISHING'\]",
            id="unreachable-state",
        ),
        pytest.param(
            variant(add=(TransitionSpec("extend", RELEASED, PENDING),)),
            "terminal state RELEASED has an outgoing transition",
            id="way-out-of-released",
        ),
        pytest.param(
            variant(drop=lambda t: t.event == "abort" and t.source is OFFLOADING),
            "abort is not legal in live state OFFLOADING",
            id="abort-missing-in-live-state",
        ),
        pytest.param(
            variant(drop=lambda t: t.event == "abort" and t.source is PENDING and t.guard == "busy"),
            "abort is not legal in live state PENDING under every condition",
            id="abort-missing-under-one-guard",
        ),
        pytest.param(
            variant(add=(TransitionSpec("chunk_done", OFFLOADING, FINISHING, "busy"),)),
            "'chunk_done' in OFFLOADING is ambiguous",
            id="ambiguous-guard",
        ),
        pytest.param(
            variant(add=(TransitionSpec("extend", PENDING, OFFLOADING, "idle"),)),
            "'extend' in PENDING is ambiguous",
            id="guard-overlaps-unguarded",
        ),
        pytest.param(
            variant(add=(TransitionSpec("chunk_done", OFFLOADING, PENDING, "sometimes"),)),
            "undeclared guard 'sometimes'",
            id="undeclared-guard",
        ),
        pytest.param(
            variant(add=(TransitionSpec("evict", OFFLOADING, PENDING),)),
            "undeclared event 'evict'",
            id="undeclared-event",
        ),
        pytest.param(
            variant(drop=lambda t: t.event == "chunk_dropped"),
            r"declared events never used: \['chunk_dropped'\]",
            id="unused-event",
        ),
    ],
)
def test_validate_rejects_broken_declarations(spec: LifecycleSpec, message: str) -> None:
    """validate() names the first problem of a broken declaration with a SpecError."""
    with pytest.raises(SpecError, match=message):
        validate(spec)


def _table_step(state: LifecycleState, event: str, copying: bool, deferred: bool) -> int:
    return TABLE[state.value][EVENT_INDEX[event]][condition_index(copying, deferred)]


def _oracle_step(model: object, event: str, copying: bool, deferred: bool) -> int:
    """The oracle's answer: the destination index, or -1 when the event is refused."""
    model.copying, model.deferred = copying, deferred  # type: ignore[attr-defined]
    try:
        moved = model.trigger(event)  # type: ignore[attr-defined]
    except MachineError:
        return -1
    return LifecycleState[model.state].value if moved else -1  # type: ignore[attr-defined]


def test_admit_is_never_a_transition() -> None:
    """The creation event has no row entry: a lifecycle is admitted once, by the manager."""
    admit = EVENT_INDEX[SPEC.creation_event]
    assert all(d == -1 for state_rows in TABLE for d in state_rows[admit])


def test_table_agrees_with_oracle_on_every_state_event_condition() -> None:
    """The compiler: for each reachable state (reached by replaying a path on the
    oracle), each event and each (copying, deferred) condition, the compiled table
    gives the oracle's destination or refusal. Exhaustive, so a random walk over the
    same (state, event, condition) triples would add nothing."""
    paths: dict[LifecycleState, list[tuple[str, bool, bool]]] = {PENDING: []}
    todo = deque([PENDING])
    while todo:
        state = todo.popleft()
        for event in EVENTS:
            for copying, deferred in CONDITIONS:
                model = oracle_machine()
                for step in paths[state]:
                    assert _oracle_step(model, *step) != -1
                assert model.state == state.name
                got = _oracle_step(model, event, copying, deferred)
                assert got == _table_step(state, event, copying, deferred), (state, event, copying, deferred)
                if got != -1 and LifecycleState(got) not in paths:
                    paths[LifecycleState(got)] = [*paths[state], (event, copying, deferred)]
                    todo.append(LifecycleState(got))
    assert set(paths) == set(LifecycleState)
