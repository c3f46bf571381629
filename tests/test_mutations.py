"""Test the test: the real bugs of FAILURES.md, injected one at a time into the core as
a broken part (a room of the real core - its registry, its chunks - replaced by a
subclass that restates the bug), must each make the property suite fail.

Each mutant is the smallest faithful restatement of what went wrong in the serving
systems (see the F-number); the core suite (kvoffload.testing's programs on
CoreLifecycleMachine) runs it with the CI budget and must raise. For F1 the suite
must also shrink the failure to a schedule of at most 8 steps, which it prints. The
parts go in through ``tests.support.broken_parts``: the core has no hook for them.

Rows covered: F1, F3, F4, F5, F6, F7, F8, F9, F11, F12, F20. The shrunk schedule of
each is a plain test in tests/test_regressions.py.
"""

from __future__ import annotations

import contextlib
import re
from array import array
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import HypothesisException
from support import broken_parts

from kvoffload.abc import Completion, Transfer
from kvoffload.core.chunks import Chunks
from kvoffload.core.lifecycle import Lifecycle, LifecycleId
from kvoffload.core.registry import Registry
from kvoffload.keys import chain_keys_packed, pack_tokens, page_run_digests
from kvoffload.lifecycle.spec import LifecycleState
from kvoffload.lifecycle.table import EVENT_INDEX
from kvoffload.testing import CoreLifecycleMachine, open_arguments, programs, run_program

_FINISHING = LifecycleState.FINISHING.value
_FINISH = EVENT_INDEX["finish"]
_ABORT = EVENT_INDEX["abort"]


class OneAtATime(Chunks):
    """The base of the mutants that change how one completion is applied: the chunks'
    own delivery path (``apply``, what ``complete`` calls), given the batch one
    completion at a time, each through :meth:`deliver` - which a mutant wraps. (No
    hook in the core: the mutant overrides the method the real path calls.)"""

    def apply(self, batch: Iterable[Completion], now: float) -> None:
        for tid, error in batch:
            self.deliver(self.inflight[tid], error, now)

    def deliver(self, t: Transfer, error: BaseException | None, now: float) -> None:
        super().apply(((t.id, error),), now)

    def issuer(self, t: Transfer) -> Lifecycle | None:
        """The lifecycle the core will apply ``t`` to (by its id; None once a mutant
        released it with the copy still in flight)."""
        return self.registry.live.get(LifecycleId(t.lifecycle_id))


class RoutedByRequestId(OneAtATime):
    """F1: a completion is applied to the newest live lifecycle with the transfer's
    request id, not to the lifecycle that issued it."""

    def deliver(self, t: Transfer, error: BaseException | None, now: float) -> None:
        same_rid = [lc for lc in self.registry.live.values() if lc.rid == t.rid]
        if same_rid:
            t.lifecycle_id = same_rid[-1].id  # the core reaches the lifecycle of this id
        super().deliver(t, error, now)


class FreedMidDecode(OneAtATime):
    """F3: a chunk's device pages go back to the pool when its copy completes, while
    the request is still decoding."""

    def deliver(self, t: Transfer, error: BaseException | None, now: float) -> None:
        lc = self.issuer(t)
        super().deliver(t, error, now)
        if error is None and lc is not None and not lc.released:
            self.registry.device_pool.free(t.device_pages)


class FirstCompletionReleases(OneAtATime):
    """F5: a finished request with two chunks in flight is released by the first."""

    def deliver(self, t: Transfer, error: BaseException | None, now: float) -> None:
        lc = self.issuer(t)
        if lc is not None and lc._s == _FINISHING and lc.inflight > 1:
            lc.inflight = 1  # "this request is done": the other chunk is forgotten
        super().deliver(t, error, now)


class RemembersReleases(Registry):
    """ReleasedTwice's registry part: it notes what each release freed."""

    last_released: tuple[Lifecycle, list[int]] | None = None

    def release(self, lc: Lifecycle) -> None:
        self.last_released = (lc, list(lc.device_pages))
        super().release(lc)


class ReleasedTwice(OneAtATime):
    """F8: the completion path frees the device pages again after the finish path did."""

    def deliver(self, t: Transfer, error: BaseException | None, now: float) -> None:
        lc = self.issuer(t)
        super().deliver(t, error, now)
        registry = self.registry
        assert isinstance(registry, RemembersReleases)
        released = registry.last_released
        if released is not None and released[0] is lc:
            registry.last_released = None
            registry.device_pool.free(released[1])  # the second release


class KeysAtCompletion(OneAtATime):
    """F11: keys are computed when a chunk completes, chained from per-request state
    updated by completions (so out-of-order completions chain from the wrong page)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tokens: dict[int, array[int]] = {}
        self._last_key: dict[int, str | None] = {}

    def submit(self, lc: Lifecycle, n: int, ready: Any = None, now: float | None = None) -> bool:
        tail = array(lc._tail.typecode, lc._tail)
        self._last_key.setdefault(lc.id, lc.chain_key)
        submitted = super().submit(lc, n, ready, now)
        if submitted:
            t = next(reversed(self.inflight.values()))
            self._tokens[t.id] = tail[: t.n_tokens]
        return submitted

    def deliver(self, t: Transfer, error: BaseException | None, now: float) -> None:
        prev = self._last_key.get(t.lifecycle_id)
        t.keys = chain_keys_packed(prev, pack_tokens(self._tokens.pop(t.id)), self.config.page_size)
        self._last_key[t.lifecycle_id] = t.keys[-1]
        super().deliver(t, error, now)


class FreedAtFinish(Registry):
    """F4: a request that finishes with copies in flight gives its device pages back
    at once; the next request gets them while the copies still read them."""

    def fire(self, lc: Lifecycle, e: int, now: float | None = None) -> None:
        super().fire(lc, e, now)
        if e == _FINISH and not lc.released and lc.device_pages:  # FINISHING: copies still read them
            self.device_pool.free(lc.device_pages)
            lc.device_pages = []


class RetractionFreesBehindTheBarrier(Registry):
    """F6: the retraction (preemption) path frees a running request's device pages
    itself, at once, instead of waiting at the barrier for its in-flight copies."""

    def fire(self, lc: Lifecycle, e: int, now: float | None = None) -> None:
        if e == _ABORT and lc.inflight and lc.device_pages:
            self.device_pool.free(lc.device_pages)
            lc.device_pages = []
        super().fire(lc, e, now)


class AbortLeaksInflight(OneAtATime):
    """F7: after an abort, the completion of a chunk that was in flight finds nothing
    to clean up and is dropped: its host pages, the device pages and the request's
    slot are never returned."""

    def deliver(self, t: Transfer, error: BaseException | None, now: float) -> None:
        lc = self.issuer(t)
        if lc is not None and lc.aborted:
            del self.inflight[t.id]
            return
        super().deliver(t, error, now)


class SkippedWhenHostFull(Chunks):
    """F9: a chunk that finds the host pool full is skipped silently: not counted,
    never retried; the request goes on (its chain too) as if the pages had been sent."""

    def host_full(self, lc: Lifecycle, npages: int) -> None:
        n = npages * self.config.page_size
        lc._chain = page_run_digests(lc._chain, lc._tail[:n], self.config.page_size)[-1]
        del lc._tail[:n]
        lc.submitted += n
        lc.due = lc.submitted + self.config.stride


class NoFlushAtFinish(Chunks):
    """F12: finish sends nothing: the whole pages committed since the last stride
    are never persisted."""

    def flush(self, lc: Lifecycle, refusal_raises: bool = False) -> None:
        return


class RefusalEscapes(Chunks):
    """F20: the copy engine refuses a deferred chunk's retry, and the refusal escapes
    the background step that retried it (kvoffload v0.1: the delivery task died, the
    manager exited, the lifecycle stayed FINISHING for ever)."""

    def refused(self, lc: Lifecycle, npages: int, error: BaseException) -> None:
        raise error


#: Each mutant: the broken parts it puts in the core.
Mutant = tuple[type, ...]


#: The CI budget of one mutant: the core suite's own example count.
CI = settings(
    max_examples=2000,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def _machine() -> type[CoreLifecycleMachine]:
    """The core suite's machine (build it inside ``broken_parts`` to run it on a mutant)."""
    return type("CoreSuite", (CoreLifecycleMachine,), {"engine_owned_mode": True})


def _run(mutant: Mutant, cfg: settings) -> BaseException:
    """Run the core suite on a core with ``mutant``'s parts; return what it raised."""
    machine = _machine()

    @cfg
    @given(open_kwargs=open_arguments(), program=programs())
    def suite(open_kwargs: dict[str, Any], program: list[int]) -> None:
        run_program(machine, open_kwargs, program)

    with pytest.raises(BaseException) as info, _no_local_constants(), broken_parts(*mutant):
        suite()
    return info.value


@contextlib.contextmanager
def _no_local_constants() -> Iterator[None]:
    """Hypothesis (6.131+) also draws values from the constants of the local modules
    loaded so far - kvoffload's and the tests' - so which tests ran before, and which
    modules they imported, changed the examples a meta-test saw (and, once, whether it
    found its mutant). For these runs the pool is empty: each sees the same examples in
    any process. (A private hook, patched only where this Hypothesis has it.)"""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - a Hypothesis without providers
        yield
        return
    hook = getattr(providers, "_get_local_constants", None)
    if hook is None:  # pragma: no cover - a Hypothesis without local constants
        yield
        return
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = hook
        providers.CONSTANTS_CACHE.cache.clear()


def _schedules(error: BaseException) -> list[list[str]]:
    """The schedules hypothesis printed for ``error`` (and each of a group's errors):
    the ``state.<rule>(...)`` lines of its notes, without the after-step checks."""
    errors = list(error.exceptions) if isinstance(error, BaseExceptionGroup) else [error]
    out = []
    for e in errors:
        lines = "\n".join(getattr(e, "__notes__", [])).splitlines()
        out.append([ln for ln in lines if re.match(r"state\.(?!outside_rules_hold\(|teardown\()", ln)])
    return out


#: Each mutant, and what the suite's first failure on it must say (None: any check or
#: error of the core; the older mutants predate the match).
CAUGHT_BY: dict[Mutant, str | None] = {
    (FreedMidDecode,): None,
    (FreedAtFinish,): r"device page \d+ freed while .* reads it",
    (FirstCompletionReleases,): None,
    (RetractionFreesBehindTheBarrier,): r"device page \d+ freed while .* reads it",
    (AbortLeaksInflight,): r"in flight: 0 transfers, counter 1",
    (RemembersReleases, ReleasedTwice): None,
    (SkippedWhenHostFull,): r"neither sent, nor waiting for host pages, nor counted as dropped",
    (KeysAtCompletion,): None,
    (NoFlushAtFinish,): r"neither sent, nor waiting for host pages, nor counted as dropped",
    (RefusalEscapes,): None,
}


@pytest.mark.parametrize("mutant", list(CAUGHT_BY), ids=lambda m: m[-1].__name__)
def test_suite_catches_the_catalogued_bug(mutant: Mutant) -> None:
    """The suite fails on each mutant within the CI budget (generate phase only), for
    the reason the mutant's bug should be caught by where one is named."""
    error = _run(mutant, settings(CI, phases=[Phase.explicit, Phase.generate]))
    # The suite failed: a check, or the core's own error (PageError, InvalidTransition,
    # a refusal that escaped) surfacing from a step; not hypothesis giving up.
    assert not isinstance(error, HypothesisException), repr(error)
    pattern = CAUGHT_BY[mutant]
    if pattern is not None:
        errors = list(error.exceptions) if isinstance(error, BaseExceptionGroup) else [error]
        assert any(re.search(pattern, str(e)) for e in errors), repr(error)


def test_suite_catches_and_shrinks_routing_by_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    """F1: the suite fails on a core that routes completions by request id, and
    shrinks the failure to a schedule of at most 8 steps, which it prints."""
    error = _run((RoutedByRequestId,), settings(CI, report_multiple_bugs=False))
    schedules = _schedules(error)
    with capsys.disabled():
        print(f"\nF1 mutant: {error!r}\nshrunk schedule:\n" + "\n".join(schedules[0]))
    assert schedules and all(schedules), f"no schedule printed for {error!r}"
    assert all(len(s) <= 8 for s in schedules), schedules
