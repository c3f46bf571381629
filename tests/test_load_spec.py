"""The load lifecycle's declaration (``kvoffload.lifecycle.load_spec``): it validates,
the validator rejects broken variants, and the compiled runtime table agrees with the
``transitions`` machine (the oracle), as ``test_lifecycle_spec.py`` checks the offload
lifecycle's.

As there, the table-vs-oracle test checks the compiler (both sides come from
LOAD_SPEC), not the design; the design is checked by ``validate_load`` (its shape) and
by the core's tests and the property suite (``tests/property/test_load_interleavings.py``),
which derive each load's state from what they did.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
from transitions import MachineError

import kvoffload as kvo
from kvoffload.lifecycle import LOAD_SPEC
from kvoffload.lifecycle.load_spec import (
    LOAD_TRANSITIONS,
    LoadOutcome,
    LoadSpec,
    LoadState,
    LoadTransitionSpec,
)
from kvoffload.lifecycle.load_table import (
    LOAD_EVENT_INDEX,
    LOAD_OUTCOMES,
    LOAD_TABLE,
    compile_load_table,
    load_oracle,
    validate_load,
)
from kvoffload.lifecycle.table import SpecError

READING, COPYING, CANCELLING, DONE = LoadState
EVENTS = [e for e in LOAD_SPEC.events if e != LOAD_SPEC.creation_event]


def variant(*, drop: object = None, add: tuple[LoadTransitionSpec, ...] = ()) -> LoadSpec:
    keep = tuple(t for t in LOAD_TRANSITIONS if drop is None or not drop(t))  # type: ignore[operator]
    return dataclasses.replace(LOAD_SPEC, transitions=keep + add)


def test_the_load_declaration_validates_and_is_exported() -> None:
    """LOAD_SPEC passes every check; LOAD_TABLE is its compilation; the names are
    exported where the contract says (kvoffload.lifecycle, and kvoffload for the enums)."""
    validate_load(LOAD_SPEC)
    assert compile_load_table(LOAD_SPEC) == (LOAD_TABLE, LOAD_OUTCOMES)
    assert LOAD_SPEC.initial is READING and LOAD_SPEC.terminal == {DONE}
    assert LOAD_SPEC.live == {READING, COPYING, CANCELLING}
    assert kvo.LoadState is LoadState and kvo.LoadOutcome is LoadOutcome
    assert {o.name for o in LoadOutcome} == {"LOADED", "PARTIAL", "MISSED", "FAILED", "CANCELLED"}


def test_every_outcome_is_reachable_and_cancelling_ends_only_cancelled() -> None:
    """Each outcome is named by some step into DONE; every step out of CANCELLING into
    DONE ends CANCELLED, and no other step does (a cancelled load is never usable); the
    only way into COPYING is read_ok from READING (the one place a copy is submitted)."""
    named = {o for row in LOAD_OUTCOMES for outs in row for o in outs}
    assert named == set(LoadOutcome)
    for t in LOAD_TRANSITIONS:
        if t.dest is DONE:
            assert (t.outcomes == (LoadOutcome.CANCELLED,)) == (t.source is CANCELLING), t
    into_copying = [(t.event, t.source) for t in LOAD_TRANSITIONS if t.dest is COPYING]
    assert into_copying == [("read_ok", READING)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param(
            variant(drop=lambda t: t.dest is CANCELLING and t.source is not CANCELLING),
            r"unreachable states: \['CANCELLING'\]",
            id="unreachable-state",
        ),
        pytest.param(
            variant(add=(LoadTransitionSpec("cancel", DONE, CANCELLING),)),
            "terminal state DONE has an outgoing transition",
            id="way-out-of-done",
        ),
        pytest.param(
            variant(drop=lambda t: t.event == "cancel" and t.source is COPYING),
            "cancel is not legal in live state COPYING",
            id="cancel-missing-in-live-state",
        ),
        pytest.param(
            variant(add=(LoadTransitionSpec("read_ok", READING, DONE, (LoadOutcome.LOADED,)),)),
            "'read_ok' in READING is ambiguous",
            id="ambiguous",
        ),
        pytest.param(
            variant(add=(LoadTransitionSpec("evict", COPYING, DONE, (LoadOutcome.FAILED,)),)),
            "undeclared event 'evict'",
            id="undeclared-event",
        ),
        pytest.param(
            variant(drop=lambda t: t.event == "host_full"),
            r"declared events never used: \['host_full'\]",
            id="unused-event",
        ),
        pytest.param(
            variant(
                drop=lambda t: t.event == "copy_done" and t.source is COPYING,
                add=(LoadTransitionSpec("copy_done", COPYING, DONE),),
            ),
            "names outcomes",
            id="done-without-outcome",
        ),
        pytest.param(
            variant(
                drop=lambda t: t.event == "read_ok" and t.source is READING,
                add=(LoadTransitionSpec("read_ok", READING, COPYING, (LoadOutcome.LOADED,)),),
            ),
            "names outcomes",
            id="outcome-on-a-live-step",
        ),
        pytest.param(
            variant(drop=lambda t: t.source is CANCELLING and t.dest is DONE),
            "live state CANCELLING cannot reach a terminal state",
            id="cancelling-stuck",
        ),
    ],
)
def test_validate_load_rejects_broken_declarations(spec: LoadSpec, message: str) -> None:
    """validate_load() names the first problem of a broken declaration with a SpecError."""
    with pytest.raises(SpecError, match=message):
        validate_load(spec)


def _oracle_step(model: object, event: str) -> int:
    try:
        moved = model.trigger(event)  # type: ignore[attr-defined]
    except MachineError:
        return -1
    return LoadState[model.state].value if moved else -1  # type: ignore[attr-defined]


def test_begin_is_never_a_transition() -> None:
    """The creation event has no table entry: a load is begun once, by the core."""
    assert all(row[LOAD_EVENT_INDEX["begin"]] == -1 for row in LOAD_TABLE)


def test_load_table_agrees_with_the_oracle_on_every_state_and_event() -> None:
    """For each reachable state (reached by replaying a path on the oracle) and each
    event, the compiled table gives the oracle's destination or refusal. Exhaustive."""
    paths: dict[LoadState, list[str]] = {READING: []}
    todo = deque([READING])
    while todo:
        state = todo.popleft()
        for event in EVENTS:
            model = load_oracle()
            for step in paths[state]:
                assert _oracle_step(model, step) != -1
            assert model.state == state.name
            got = _oracle_step(model, event)
            assert got == LOAD_TABLE[state.value][LOAD_EVENT_INDEX[event]], (state, event)
            if got != -1 and LoadState(got) not in paths:
                paths[LoadState(got)] = [*paths[state], event]
                todo.append(LoadState(got))
    assert set(paths) == set(LoadState)


def test_the_compiled_table_is_deterministic() -> None:
    """Compiling twice gives the same table; the declaration order of transitions does
    not change it (no two apply to one state and event)."""
    again = compile_load_table(LOAD_SPEC)
    reordered = compile_load_table(
        dataclasses.replace(LOAD_SPEC, transitions=tuple(reversed(LOAD_TRANSITIONS)))
    )
    assert again == reordered == (LOAD_TABLE, LOAD_OUTCOMES)
