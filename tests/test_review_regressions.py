"""Regressions found by an adversarial review of the core: each test names the rule
that must hold (ARCHITECTURE.md rules 1-6, FAILURES.md F1-F18, or "bad input is refused
with a typed error and changes nothing") and failed before its fix."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import structlog
from support import HANG_S, FakeClock, complete_everything, released, small_config, toks
from test_manager import _RefusingBackend

import kvoffload as kvo
from kvoffload.testing import SimBackend

pytestmark = pytest.mark.asyncio

RELEASED = kvo.LifecycleState.RELEASED


def _raising_on(event: str) -> Any:
    def listener(name: str, fields: dict[str, Any]) -> None:
        if name == event:
            raise RuntimeError(f"listener bug on {name}")

    return listener


@pytest.mark.parametrize(
    "event",
    [
        "lifecycle.admitted",
        "lifecycle.transition",
        "transfer.submitted",
        "transfer.completed",
        "lifecycle.released",
        "storage.written",
    ],
)
async def test_a_raising_listener_never_corrupts_the_ledger_or_frees_a_page_under_a_copy(event: str) -> None:
    """A listener that raises is a bug in the listener, not in the lifecycle: the step
    that emitted the event still runs to completion (no device page freed under the
    in-flight copy, no lifecycle left half released, the delivery and storage tasks go
    on), and the error is logged. Before the fix a raise on ``transfer.submitted``
    made extend's rollback free the device pages the submitted copy reads (rule 2)."""
    backend = SimBackend()
    async with kvo.OffloadManager(small_config(), backend=backend, storage="memory") as mgr:
        mgr.add_listener(_raising_on(event))
        with structlog.testing.capture_logs() as logs:
            lc = mgr.admit("r1", prompt=toks(0, 4))
            lc.extend(toks(4, 12))  # a chunk of 2 pages goes out
            mgr.check_invariants()
            (t,) = backend.pending
            assert all(mgr.device_pool.is_allocated(p) for p in t.device_pages)
            assert set(t.device_pages) <= set(lc.device_pages)
            lc.finish()
            backend.complete_all()
            await released(lc)
            with anyio.fail_after(HANG_S):
                await mgr.settle()
        mgr.check_invariants()
        s = mgr.statistics()
        assert (s.live_lifecycles, s.device_pages_used, s.host_pages_used) == (0, 0, 0)
        assert s.pages_stored == 2
        assert any(e["event"] == "listener.failed" and e["event_name"] == event for e in logs)


async def test_admit_whose_prompt_chunk_is_refused_changes_nothing() -> None:
    """With ``offload_prompt=True`` admit submits the prompt's first chunk. When the
    backend refuses it, admit raises and nothing is left behind: no live lifecycle
    that the caller never got (and so could never finish), no device page, no count.
    Before the fix the lifecycle stayed registered and its device pages leaked."""
    backend = _RefusingBackend()
    async with kvo.OffloadManager(small_config(offload_prompt=True), backend=backend) as mgr:
        before = mgr.statistics()
        backend.refuse = True
        with pytest.raises(kvo.BackendError, match="refused"):
            mgr.admit("r1", prompt=toks(0, 10))
        assert mgr.statistics() == before
        assert len(mgr) == 0
        mgr.check_invariants()
        backend.refuse = False
        lc = mgr.admit("r1", prompt=toks(0, 10))  # the retry admits once
        assert mgr.statistics().admitted == 1 and lc.inflight == 1
        lc.finish()
        await complete_everything(mgr, backend)


async def test_a_deferred_tail_that_expires_counts_every_whole_page_it_loses() -> None:
    """F9 under ``on_host_full="wait"``: when a finished request's deferred tail waits
    past ``host_wait_s``, the drop counts every whole page not sent, as the drop policy
    does, not only the first host-sized chunk of them."""
    clock = FakeClock()
    backend = SimBackend()
    config = kvo.OffloadConfig(
        page_size=4, stride=4, device_pages=32, host_pages=2, on_host_full="wait", host_wait_s=1.0
    )
    async with kvo.OffloadManager(config, backend=backend, clock=clock) as mgr:
        hog = mgr.admit("hog", prompt=toks(0, 4))
        hog.extend(toks(4, 12))  # one chunk of 2 pages: the host pool is full
        lc = mgr.admit("a", prompt=toks(0, 4))
        lc.extend(toks(4, 8))  # a stride due, host full: deferred
        assert lc.deferred
        lc.extend(toks(8, 16))  # 3 whole pages now wait
        lc.finish()
        clock.advance(2.0)
        mgr.tick()  # the wait expired: the 3 pages are dropped
        s = mgr.statistics()
        assert (s.chunks_dropped, s.pages_dropped) == (1, 3)
        assert lc.state is RELEASED
        hog.finish()
        await complete_everything(mgr, backend)


async def test_a_listener_removing_itself_does_not_hide_the_event_from_the_next_one() -> None:
    """A one-shot listener that calls its remover while being called must not make the
    listener after it miss that event (the list was mutated while being iterated)."""
    backend = SimBackend()
    async with kvo.OffloadManager(small_config(), backend=backend) as mgr:
        seen: list[str] = []
        removers: list[Any] = []

        def once(name: str, fields: dict[str, Any]) -> None:
            removers[0]()

        removers.append(mgr.add_listener(once))
        mgr.add_listener(lambda name, fields: seen.append(name))
        lc = mgr.admit("r1", prompt=toks(0, 4))
        assert seen == ["lifecycle.admitted"]
        lc.finish()


async def test_cpu_backend_aclose_in_a_cancelled_scope_returns_only_once_no_copy_runs() -> None:
    """EventBackend.aclose contract (F16): it returns only once no copy is running, so
    no buffer is freed under one - also when the task closing it is being cancelled
    (a server shut down by cancellation). Before the fix aclose raised at its first
    checkpoint and left the stream thread copying."""
    import threading
    from types import SimpleNamespace

    from support import spin

    from kvoffload.backends import CpuBackend

    backend = CpuBackend()
    gate = threading.Event()
    started = threading.Event()

    def hold(t: kvo.Transfer) -> None:
        started.set()
        gate.wait(10)
        return None

    backend.hooks.before = hold
    device, host = backend.create_pools(small_config())
    backend.open(device, host)
    workers = list(backend._workers)
    lc: Any = SimpleNamespace(id=0, rid="r", tag=None)
    backend.submit(kvo.Transfer(lc, [0], [0], ["k"], 0, 4, 0.0))
    await anyio.to_thread.run_sync(started.wait, 10)

    async def release_later() -> None:
        await spin(5)
        gate.set()

    alive: list[bool] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(release_later)
        with anyio.CancelScope() as scope:
            scope.cancel()
            try:
                await backend.aclose()
            finally:
                alive = [w.is_alive() for w in workers]
    gate.set()
    assert alive == [False]


async def test_a_chunk_made_due_while_the_manager_is_closing_is_refused_and_changes_nothing() -> None:
    """Once the manager has drained and is closing, no new copy may start: nobody is
    left to deliver its completion, so its lifecycle could never be released. An
    extend that makes a chunk due from another task in that window raises a typed
    error and changes nothing (as admit does). Before the fix the chunk was accepted
    and the lifecycle stayed OFFLOADING for ever."""
    backend = SimBackend()
    outcome: list[Any] = []
    # The manager is left before the task group: late() first runs inside its exit.
    async with anyio.create_task_group() as tg, kvo.OffloadManager(small_config(), backend=backend) as mgr:
        lc = mgr.admit("r1", prompt=toks(0, 4))

        async def late() -> None:  # first runs while the manager's exit awaits
            before = mgr.statistics()
            try:
                lc.extend(toks(4, 8))
            except kvo.KVOffloadError as exc:
                outcome.append(exc)
            outcome.append(mgr.statistics() == before)

        tg.start_soon(late)
    assert len(outcome) == 2 and isinstance(outcome[0], kvo.KVOffloadError), outcome
    assert outcome[1] is True
    assert backend.pending == [] and lc.inflight == 0 and lc.committed == 4
    # Live at close with nothing in flight: aborted and released by the close (v2).
    assert lc.state is RELEASED and lc.outcome is kvo.Outcome.ABORTED
    with pytest.raises(kvo.ManagerClosed):  # issue 19: says the manager is closed
        lc.finish()


async def _close_with_a_copy_in_flight(
    backend: SimBackend, wait: Callable[[kvo.OffloadManager, kvo.Lifecycle], Awaitable[None]]
) -> tuple[kvo.OffloadManager, kvo.Lifecycle, list[BaseException]]:
    """Leave a manager whose body raised with one finished lifecycle's copy in flight
    (sim: not waited for), while another task is in ``wait(mgr, lc)``; return what
    that task raised."""
    from support import spin

    errors: list[BaseException] = []

    async def waiter(mgr: kvo.OffloadManager, lc: kvo.Lifecycle) -> None:
        try:
            with anyio.fail_after(HANG_S):  # a hang guard, never reached once fixed
                await wait(mgr, lc)
        except BaseException as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        with pytest.raises(RuntimeError, match="body failed"):
            async with kvo.OffloadManager(small_config(), backend=backend) as mgr:
                lc = mgr.admit("r1", prompt=toks(0, 4))
                lc.extend(toks(4, 8))  # a copy in flight
                lc.finish()
                tg.start_soon(waiter, mgr, lc)
                await spin()
                raise RuntimeError("body failed")
    return mgr, lc, errors


async def test_waiting_on_a_closed_manager_that_cannot_drain_raises_instead_of_hanging() -> None:
    """A manager used after exit: when it was left with a copy in flight (the body
    raised; the sim copy was not waited for), nothing will ever deliver that copy's
    completion. ``wait_drained()`` and ``settle()`` then raise a typed error instead of
    waiting for ever - also for a task that was already waiting when the manager
    closed."""
    backend = SimBackend()
    mgr, _, errors = await _close_with_a_copy_in_flight(backend, lambda mgr, lc: mgr.wait_drained())
    assert len(errors) == 1 and type(errors[0]) is kvo.ManagerClosed, errors
    with anyio.fail_after(HANG_S), pytest.raises(kvo.KVOffloadError, match="closed"):
        await mgr.wait_drained()
    backend.complete(backend.pending[0])  # signalled, but no task is left to deliver it
    with anyio.fail_after(HANG_S), pytest.raises(kvo.KVOffloadError, match="closed"):
        await mgr.settle()


async def test_waiting_on_a_lifecycle_whose_copy_a_closed_manager_will_never_deliver_raises() -> None:
    """``wait_released()``, ``wait_quiescent()`` and ``retract()`` (the F6 barrier) of a
    lifecycle whose copy is still in flight when the manager closed raise a typed error
    instead of waiting for ever: nothing is left to deliver that copy. A task already
    waiting when the manager closed is woken and raises too."""
    mgr, lc, errors = await _close_with_a_copy_in_flight(SimBackend(), lambda mgr, lc: lc.wait_released())
    assert len(errors) == 1 and type(errors[0]) is kvo.ManagerClosed, errors
    for wait in (lc.wait_released, lc.wait_quiescent, lc.retract):
        with anyio.fail_after(HANG_S), pytest.raises(kvo.KVOffloadError, match="closed"):
            await wait()
    assert lc.state is kvo.LifecycleState.FINISHING and mgr.statistics().device_pages_used == 2
