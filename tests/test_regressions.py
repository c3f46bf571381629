"""Failures the property suite found, pasted as plain deterministic tests.

Each test's body is the shrunk schedule hypothesis printed (``state.<rule>(...)``
and ``state.outside_rules_hold()``, the after-step check), pasted verbatim: it replays
on :class:`~kvoffload.testing.LifecycleMachine` exactly as in the failing run.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable

import pytest
from support import broken_parts
from test_mutations import (
    AbortLeaksInflight,
    FirstCompletionReleases,
    FreedAtFinish,
    FreedMidDecode,
    KeysAtCompletion,
    Mutant,
    NoFlushAtFinish,
    RefusalEscapes,
    ReleasedTwice,
    RemembersReleases,
    RetractionFreesBehindTheBarrier,
    RoutedByRequestId,
    SkippedWhenHostFull,
    _machine,
)

import kvoffload as kvo
from kvoffload.testing import CoreLifecycleMachine, LifecycleMachine, SimBackend, SyncLifecycleMachine


@pytest.mark.asyncio
@pytest.mark.parametrize("storage", [None, "memory"])
async def test_delivery_task_does_not_pin_the_last_delivered_lifecycle(storage: str | None) -> None:
    """Found by the suite (F2 check): the completion-delivery task kept its last batch
    (and the loop variable) alive while it waited for the next one, so a released,
    dropped lifecycle stayed referenced until some other copy completed. The storage
    writer task had the same fault with its last written transfer."""
    config = kvo.OffloadConfig(page_size=2, stride=2, device_pages=6, host_pages=1)
    backend = SimBackend()
    async with kvo.OffloadManager(config, backend=backend, storage=storage) as mgr:
        lc = mgr.admit("r1", prompt=[])
        lc.extend([0, 0])
        lc.finish()
        ref = weakref.ref(lc)
        del lc
        backend.complete(backend.pending[0])
        await mgr.settle()
        gc.collect()
        assert ref() is None, gc.get_referrers(ref())


def test_shrunk_released_lifecycle_pinned_by_delivery_task() -> None:
    """The schedule the suite printed for the failure above."""
    state = LifecycleMachine()
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="drop",
        offload_prompt=False,
        storage=False,
    )
    state.outside_rules_hold()
    state.admit(prompt=[], slot=1)
    state.outside_rules_hold()
    state.extend(slot=1, tokens=[0, 0])
    state.outside_rules_hold()
    state.abort(slot=1)
    state.outside_rules_hold()
    state.complete(pos=0)
    state.outside_rules_hold()
    state.drop(slot=1)
    state.outside_rules_hold()
    state.teardown()


# --- the schedules the suite shrank for the catalogued bugs (tests/test_mutations.py) ---
# Each passes on the real manager and fails on the mutant it was found on.


def f1_routed_by_request_id(state: LifecycleMachine) -> None:
    """F1: A offloads, B reuses A's id, A's completion arrives."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="drop",
        offload_prompt=False,
        storage=False,
        first_prompt=[],
    )
    state.outside_rules_hold()
    state.exhaust_host_pool()
    state.outside_rules_hold()
    state.admit(prompt=[], slot=0)
    state.outside_rules_hold()
    state.complete(pos=0)
    state.outside_rules_hold()
    state.teardown()


def f3_freed_mid_decode(state: LifecycleMachine) -> None:
    """F3: a chunk completes mid-decode (here: under the "wait" policy)."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="wait",
        offload_prompt=False,
        storage=False,
    )
    state.outside_rules_hold()
    state.admit(prompt=[], slot=0)
    state.outside_rules_hold()
    state.exhaust_host_pool()
    state.outside_rules_hold()
    state.exhaust_host_pool()
    state.outside_rules_hold()
    state.teardown()


def f4_freed_at_finish(state: LifecycleMachine) -> None:
    """F4: a request finishes (here: at teardown) with a copy in flight."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="drop",
        offload_prompt=False,
        storage=False,
        first_prompt=[],
        events=False,
    )
    state.outside_rules_hold()
    state.extend(slot=0, tokens=[0, 3, 0, 0, 0, 0, 0, 0, 0])
    state.outside_rules_hold()
    state.teardown()


def f5_first_completion_releases(state: LifecycleMachine) -> None:
    """F5: a finished request with two chunks in flight."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=1,
        on_host_full="drop",
        offload_prompt=False,
        storage=False,
    )
    state.outside_rules_hold()
    state.admit(prompt=[], slot=0)
    state.outside_rules_hold()
    state.exhaust_host_pool()
    state.outside_rules_hold()
    state.exhaust_host_pool()
    state.outside_rules_hold()
    state.teardown()


def close_with_the_prompt_chunk_in_flight(state: LifecycleMachine) -> None:
    """F6 and F7 shrink to the same schedule: a request with its prompt chunk in flight
    is aborted by closing (F6: retracted behind the barrier; F7: the abort must keep
    the in-flight copy counted until it completes, later)."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="drop",
        offload_prompt=True,
        storage=False,
        first_prompt=[0, 0],
        events=False,
    )
    state.outside_rules_hold()
    state.close()
    state.outside_rules_hold()
    state.teardown()


def f8_released_twice(state: LifecycleMachine) -> None:
    """F8: the finish path and the last completion both release."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="drop",
        offload_prompt=False,
        storage=False,
    )
    state.outside_rules_hold()
    state.admit(prompt=[], slot=0)
    state.outside_rules_hold()
    state.exhaust_host_pool()
    state.outside_rules_hold()
    state.teardown()


def f9_skipped_when_host_full(state: LifecycleMachine) -> None:
    """F9: three pages due, one host page: the rest finds the host pool full at finish."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="drop",
        offload_prompt=False,
        storage=False,
        first_prompt=[],
        events=False,
    )
    state.outside_rules_hold()
    state.extend(slot=0, tokens=[0, 2, 1, 0, 0, 0])
    state.outside_rules_hold()
    state.teardown()


def f11_keys_at_completion(state: LifecycleMachine) -> None:
    """F11: two chunks of one request complete out of order."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=1,
        on_host_full="drop",
        offload_prompt=False,
        storage=False,
    )
    state.outside_rules_hold()
    state.admit(prompt=[], slot=0)
    state.outside_rules_hold()
    state.exhaust_host_pool()
    state.outside_rules_hold()
    state.exhaust_host_pool()
    state.outside_rules_hold()
    state.complete(pos=1)
    state.outside_rules_hold()
    state.teardown()


def f12_no_flush_at_finish(state: LifecycleMachine) -> None:
    """F12: whole pages are left unsent when the request finishes (at teardown)."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="drop",
        offload_prompt=False,
        storage=False,
        first_prompt=[],
        events=False,
    )
    state.outside_rules_hold()
    state.extend(slot=0, tokens=[0, 2, 1, 0, 0, 0])
    state.outside_rules_hold()
    state.teardown()


def f20_refusal_escapes(state: LifecycleMachine) -> None:
    """F20: a deferred chunk's retry is refused by the copy engine."""
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="wait",
        offload_prompt=True,
        storage=False,
        first_prompt=[0, 0],
    )
    state.outside_rules_hold()
    state.admit(slot=1, prompt=[0, 0, 0, 0])
    state.outside_rules_hold()
    state.refuse_submissions(on=True)
    state.outside_rules_hold()
    state.complete(pos=1)
    state.outside_rules_hold()
    state.teardown()


SHRUNK: dict[str, tuple[Callable[[LifecycleMachine], None], Mutant]] = {
    "F1": (f1_routed_by_request_id, (RoutedByRequestId,)),
    "F3": (f3_freed_mid_decode, (FreedMidDecode,)),
    "F4": (f4_freed_at_finish, (FreedAtFinish,)),
    "F5": (f5_first_completion_releases, (FirstCompletionReleases,)),
    "F6": (close_with_the_prompt_chunk_in_flight, (RetractionFreesBehindTheBarrier,)),
    "F7": (close_with_the_prompt_chunk_in_flight, (AbortLeaksInflight,)),
    "F8": (f8_released_twice, (RemembersReleases, ReleasedTwice)),
    "F9": (f9_skipped_when_host_full, (SkippedWhenHostFull,)),
    "F11": (f11_keys_at_completion, (KeysAtCompletion,)),
    "F12": (f12_no_flush_at_finish, (NoFlushAtFinish,)),
    "F20": (f20_refusal_escapes, (RefusalEscapes,)),
}


@pytest.mark.parametrize("bug", sorted(SHRUNK))
@pytest.mark.parametrize("machine", [LifecycleMachine, SyncLifecycleMachine, CoreLifecycleMachine])
def test_shrunk_schedule_holds_on_every_layer(bug: str, machine: type[LifecycleMachine]) -> None:
    """The catalogued bug's shortest schedule: every check holds on the real core, and
    through each driver."""
    schedule, _ = SHRUNK[bug]
    schedule(machine())


@pytest.mark.parametrize("bug", sorted(SHRUNK))
def test_shrunk_schedule_fails_on_its_mutant(bug: str) -> None:
    """The same schedule fails on the mutant it was shrunk from: it is that bug's test."""
    schedule, mutant = SHRUNK[bug]
    state = _machine()()
    with pytest.raises((AssertionError, kvo.KVOffloadError)), broken_parts(*mutant):
        try:
            schedule(state)
        finally:
            with contextlib.suppress(BaseException):
                state.teardown()


# --- found while writing the F9/F12 mutants: completions_delivered counted the change in
# copies in flight, so a delivery whose host pages let deferred chunks go out undercounted
# (two such made the counter negative and check_invariants failed a correct run) -------


@pytest.mark.parametrize("machine", [LifecycleMachine, SyncLifecycleMachine, CoreLifecycleMachine])
def test_completions_delivered_counts_what_was_delivered(machine: type[LifecycleMachine]) -> None:
    """Two completions under the "wait" policy, each returning host pages that deferred
    chunks take at once: completions_delivered must count 2 deliveries. (The schedule
    the suite shrank on NoFlushAtFinish, where it surfaced first; it fails the same on
    the real core, on every layer.)"""
    state = machine()
    try:
        state.open(
            page_size=3,
            stride_pages=1,
            device_pages=6,
            spare_host_pages=1,
            on_host_full="wait",
            offload_prompt=False,
            storage=False,
            first_prompt=[],
            events=False,
        )
        state.outside_rules_hold()
        state.exhaust_host_pool()
        state.outside_rules_hold()
        state.admit(slot=1, prompt=[0, 0, 0, 0])
        state.outside_rules_hold()
        state.extend(slot=1, tokens=[3, 1, 1, 1, 1])
        state.outside_rules_hold()
        state.complete(pos=1)
        state.outside_rules_hold()
        state.exhaust_host_pool()
        state.outside_rules_hold()
        state.complete(pos=1)
        state.outside_rules_hold()
        assert state.core.counters.completions_delivered == 2
    finally:
        with contextlib.suppress(BaseException):
            state.teardown()
