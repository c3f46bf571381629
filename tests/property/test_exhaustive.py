"""The exhaustive check: every interleaving of the bare core's small worlds holds every
rule, and every catalogued bug of tests/test_mutations.py shows up in one.

Where the property suite samples schedules, kvoffload._testing.explore enumerates
them: breadth first, every sequence of admits (two lifecycles of one request id),
extends, finishes, an abort, completions and a failure in any order, batches, writes,
a refusing copy engine, time and close that its worlds allow, with the machine's
after-step check (the Observer's whole ``check``: ledger, states, F1 routing, keys,
frees, holes, ...) after every step. The counts are printed (docs/testing.md).
"""

from __future__ import annotations

from typing import Any

import pytest
from support import broken_parts
from test_holes import _KeepsOffloading, _WritesInCompletionOrder
from test_mutations import CAUGHT_BY, Mutant, RoutedByRequestId

from kvoffload._testing.explore import DEFAULT, LARGE, Exploration, explore
from kvoffload.core.offload import OffloadCore


def _report(capsys: pytest.CaptureFixture[str], title: str, result: Exploration) -> None:
    with capsys.disabled():
        print(f"\n{title}")
        for world, states, transitions in result.per_world:
            print(f"  {world}: {states} states, {transitions} transitions")
        print(f"  {result.summary()}")
        for v in result.violations:
            print(v)


def test_every_interleaving_of_the_small_worlds_holds(capsys: pytest.CaptureFixture[str]) -> None:
    """Every schedule of the CI bound (kvoffload._testing.explore.DEFAULT) passes every
    after-step check, and every state where nothing is left to do drains clean: no
    page leaked, freed twice or under a copy, every lifecycle RELEASED (F1-F12, F20)."""
    result = explore(DEFAULT, stop_at_first=False)
    _report(capsys, "exhaustive check, CI bound:", result)
    assert not result.violations, "\n\n".join(map(str, result.violations))
    # Every world was explored to its end (not cut short).
    assert [w for w, _, _ in result.per_world] == list(DEFAULT)
    assert all(states > 1 for _, states, _ in result.per_world), result.per_world


@pytest.mark.parametrize(
    "mutant",
    [(RoutedByRequestId,), *CAUGHT_BY, (_KeepsOffloading,), (_WritesInCompletionOrder,)],
    ids=lambda m: m[-1].__name__,
)
def test_exhaustive_check_catches_the_catalogued_bug(
    mutant: Mutant, capsys: pytest.CaptureFixture[str]
) -> None:
    """The exhaustive check finds each mutant of tests/test_mutations.py and the two F33
    mutants of tests/test_holes.py (as the random suite does) and prints its shortest
    counterexample (breadth first: no shorter schedule in any world shows a violation)."""
    with broken_parts(*mutant):
        result = explore(DEFAULT)
    name = mutant[-1].__name__
    _report(capsys, f"exhaustive check on {name}:", result)
    assert result.violations, f"{name} was not caught: {result.summary()}"
    shortest = result.violations[0]
    assert shortest.schedule, "a violation before any step: the world itself is broken"


def test_interleavings_that_reach_one_state_are_one_state() -> None:
    """The signature names pages and transfers by their place, not their ids: two
    lifecycles extended in either order, each chunk in flight on a two-page host pool,
    are one state (their page ids differ); on a one-page pool the order decides whose
    chunk is dropped, so they are two."""
    from kvoffload._testing.explore import World, _replay, signature

    def both(world: World) -> set[tuple[object, ...]]:
        start = [("admit", 0), ("admit", 0)]
        orders = ([("extend", 0, 1), ("extend", 1, 1)], [("extend", 1, 1), ("extend", 0, 1)])
        return {signature(_replay(world, OffloadCore, start + order)) for order in orders}

    assert len(both(World("two", host_pages=2, on_host_full="wait"))) == 1
    assert len(both(World("one", host_pages=1, on_host_full="drop"))) == 2


def test_a_replayed_state_is_checked_as_it_was_explored() -> None:
    """A state reached again by replay has the observer's model it had when explored:
    a failed copy, delivered, is the lifecycle's hole (F33), so the finish after it
    loses the later pages knowingly. The replay once skipped the after-step check,
    where the model learns what was delivered, and reported a false F12 loss."""
    from kvoffload._testing.explore import _replay

    schedule = [("admit", 0), ("extend", 0, 1), ("extend", 0, 1), ("fail", 0), ("finish", 0)]
    m = _replay(DEFAULT[0], OffloadCore, schedule)  # one host page: the second chunk is dropped
    m.check_step()


def test_a_check_added_to_the_observer_is_part_of_the_exploration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The explorer runs the observer's whole check after every step (it runs the
    machine's invariants, not a list of its own): a new rule there - here, "no copy
    ever fails" - is found at once, with its shortest schedule."""
    from kvoffload._testing.observer import Observer

    check = Observer.check

    def no_failed_copy(self: Observer, *args: Any, **kwargs: Any) -> None:
        check(self, *args, **kwargs)
        assert not any(m.failed for m in self.lcs.values()), "a copy failed"

    monkeypatch.setattr(Observer, "check", no_failed_copy)
    result = explore(DEFAULT[:1])
    assert [str(v.error).splitlines()[0] for v in result.violations] == ["a copy failed"]
    assert result.violations[0].schedule == (("admit", 0), ("extend", 0, 1), ("fail", 0))


@pytest.mark.slow
def test_every_interleaving_of_the_larger_worlds_holds(capsys: pytest.CaptureFixture[str]) -> None:
    """The slow bound (kvoffload._testing.explore.LARGE: longer lifecycles, one-token
    prompts, a refusing copy engine everywhere, the event-building path): every
    schedule passes every check."""
    result = explore(LARGE, stop_at_first=False)
    _report(capsys, "exhaustive check, slow bound:", result)
    assert not result.violations, "\n\n".join(map(str, result.violations))
