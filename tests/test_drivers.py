"""The drivers over the core: failures contained (F20), shutdown bounded (F21), the
owner thread (F24), what closing does to live lifecycles, and the asyncio manager
entered and left in different tasks. Each behaviour on both drivers."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs
from support import HANG_S, toks

import kvoffload as kvo
from kvoffload.backends import CpuBackend
from kvoffload.drivers._base import parked
from kvoffload.testing import ManagerHost, SimBackend, SyncManagerHost

PENDING, OFFLOADING, FINISHING, RELEASED = kvo.LifecycleState

#: How much longer than its timeout a close may take on a busy machine (F39): a bound
#: on a hang, not a speed check; below the sync test's drain_timeout_s (30 s), so a
#: close that ignored its own timeout for the config's still fails.
_SLACK_S = 10.0


class RefusingBackend(SimBackend):
    """A SimBackend whose ``submit`` raises while ``refuse`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = False

    def submit(self, transfer: kvo.Transfer) -> None:
        if self.refuse:
            raise kvo.BackendError("simulated: the copy engine refused the submission")
        super().submit(transfer)


def _wait_config(**changes: Any) -> kvo.OffloadConfig:
    """One host page; chunks that find it taken wait for it (on_host_full="wait")."""
    fields: dict[str, Any] = dict(
        page_size=4,
        stride=4,
        device_pages=16,
        host_pages=1,
        on_host_full="wait",
        host_wait_s=30,
        drain_timeout_s=5,
    )
    fields.update(changes)
    return kvo.OffloadConfig(**fields)


# --- F20: failures contained ----------------------------------------------------------


@pytest.mark.asyncio
async def test_f20_a_refused_deferred_retry_fails_that_chunk_and_the_manager_runs_on() -> None:
    """F20 (asyncio): a deferred chunk's retry is refused by the copy engine while the
    delivery that returned host pages runs it. The refusal is counted and logged once,
    the finished lifecycle is released FAILED (not left FINISHING), the caller's body
    is not cancelled, and the manager goes on working."""
    backend = RefusingBackend()
    released: list[kvo.Lifecycle] = []
    with capture_logs() as logs:
        async with kvo.OffloadManager(_wait_config(), backend=backend, on_released=released.append) as mgr:
            a = mgr.admit("a", prompt=toks(0, 4))
            a.extend(toks(4, 8))  # a's chunk takes the only host page
            b = mgr.admit("b", prompt=toks(0, 4))
            b.extend(toks(4, 8))  # b's chunk waits for it
            b.finish()
            assert b.state is FINISHING and b.deferred
            backend.refuse = True
            backend.complete(backend.pending[0])  # a's copy ends: b's retry is refused
            with anyio.fail_after(HANG_S):
                await b.wait_released()
            assert b.outcome is kvo.Outcome.FAILED and a.state is PENDING
            s = mgr.statistics()
            assert (s.chunks_refused, s.pages_refused, s.released_failed) == (1, 1, 1)
            mgr.check_invariants()
            backend.refuse = False
            a.extend(toks(8, 12))  # the manager runs on
            backend.complete_all()
            a.finish()
            await a.wait_released()
            assert a.outcome is kvo.Outcome.COMPLETED
    assert [e["event"] for e in logs].count("transfer.refused") == 1
    assert released == [b, a]


def test_f20_a_refused_deferred_retry_is_contained_in_the_sync_driver() -> None:
    """F20 (sync): the same refusal inside ``poll()`` fails that chunk only; ``poll``
    returns normally and the lifecycle is released FAILED."""
    backend = RefusingBackend()
    released: list[kvo.Lifecycle] = []
    with kvo.SyncOffloadManager(_wait_config(), backend=backend, on_released=released.append) as mgr:
        a = mgr.admit("a", prompt=toks(0, 4))
        a.extend(toks(4, 8))
        b = mgr.admit("b", prompt=toks(0, 4))
        b.extend(toks(4, 8))
        b.finish()
        backend.refuse = True
        backend.complete(backend.pending[0])
        assert mgr.poll() == 1
        assert b.outcome is kvo.Outcome.FAILED and released == [b]
        assert mgr.statistics().chunks_refused == 1
        mgr.check_invariants()
        backend.refuse = False
        a.finish()
    assert released == [b, a]


def host_for(driver: str, config: kvo.OffloadConfig, backend: Any, **kw: Any) -> Any:
    """A manager of ``driver`` held open by a host (kvoffload.testing): ``host.call(fn)``
    runs a step on the owner thread and delivers what was signalled."""
    if driver == "sync":
        return SyncManagerHost(kvo.SyncOffloadManager(config, backend=backend, **kw))
    return ManagerHost(kvo.OffloadManager(config, backend=backend, **kw))


def settle_until(host: Any, cond: Any) -> None:
    """Deliver until ``cond()`` holds (copies on threads finish when they do; HANG_S)."""
    deadline = time.monotonic() + HANG_S
    while not host.call(cond):
        assert time.monotonic() < deadline, "hung"
        time.sleep(0.001)


@pytest.mark.parametrize("driver", ["asyncio", "sync"])
def test_f20_a_launch_that_cannot_start_fails_that_chunk_only(driver: str) -> None:
    """F20: a copy whose launch raises (a CUDA launch error, a closed stream) completes
    as a failure of that transfer; the other copies and the manager go on."""
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=16, host_pages=8, drain_timeout_s=5)
    backend = CpuBackend()
    real_start = backend._start

    def start(t: kvo.Transfer, worker: Any) -> Any:
        if t.rid == "bad":
            raise RuntimeError("simulated: cudaErrorLaunchFailure")
        return real_start(t, worker)

    backend._start = start  # type: ignore[method-assign]
    host = host_for(driver, config, backend)
    mgr = host.mgr
    try:
        ok = host.call(lambda: mgr.admit("ok", prompt=toks(0, 4)))
        bad = host.call(lambda: mgr.admit("bad", prompt=toks(0, 4)))
        host.call(lambda: (ok.extend(toks(4, 8)), bad.extend(toks(4, 8)), ok.finish(), bad.finish()))
        settle_until(host, lambda: ok.released and bad.released)
        assert ok.outcome is kvo.Outcome.COMPLETED and bad.outcome is kvo.Outcome.FAILED
        s = host.call(mgr.statistics)
        assert (s.chunks_copied, s.chunks_failed) == (1, 1)
        host.call(mgr.check_invariants)
    finally:
        host.close()


# --- F21: shutdown bounded ------------------------------------------------------------


def _wedged_cpu_backend() -> tuple[CpuBackend, threading.Event]:
    """A cpu backend whose every copy blocks until the returned event is set."""
    backend = CpuBackend()
    gate = threading.Event()

    def before(t: kvo.Transfer) -> None:
        gate.wait(30)

    backend.hooks.before = before
    return backend, gate


@pytest.mark.asyncio
async def test_f21_leaving_with_a_wedged_copy_raises_drain_timeout_in_bounded_time() -> None:
    """F21 (asyncio): leaving the manager while a cpu copy is wedged raises DrainTimeout
    within drain_timeout_s plus _SLACK_S (a hang bound), naming the wedged transfer; the buffers the
    copy reads are parked (never freed) and its lifecycle keeps its pages."""
    backend, gate = _wedged_cpu_backend()
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=16, host_pages=8, drain_timeout_s=0.3)
    mgr = kvo.OffloadManager(config, backend=backend)
    start = time.monotonic()
    try:
        with pytest.raises(kvo.DrainTimeout) as info:
            async with mgr:
                lc = mgr.admit("wedged", prompt=toks(0, 4))
                lc.extend(toks(4, 8))
                (t,) = lc.manager.core.inflight.values()
                start = time.monotonic()
        elapsed = time.monotonic() - start
        assert elapsed < config.drain_timeout_s + _SLACK_S, elapsed
        assert f"Transfer #{t.id}" in str(info.value) and "parked" in str(info.value)
        assert parked() >= 1
        assert lc.state is FINISHING and lc.device_pages and mgr.statistics().host_pages_used == 1
        with pytest.raises(kvo.KVOffloadError, match="closed"):
            await lc.wait_released()  # nothing will deliver it: raises at once
    finally:
        gate.set()
    assert backend.join(10) and parked() == 0  # the copy ended: nothing is parked any more


def test_f21_closing_a_sync_manager_with_a_wedged_copy_is_bounded_too() -> None:
    """F21 (sync): ``close()`` honours its timeout the same way."""
    backend, gate = _wedged_cpu_backend()
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=16, host_pages=8, drain_timeout_s=30)
    mgr = kvo.SyncOffloadManager(config, backend=backend).open()
    try:
        lc = mgr.admit("wedged", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        mgr.poll()  # launches the copy
        (t,) = mgr.core.inflight.values()
        start = time.monotonic()
        with pytest.raises(kvo.DrainTimeout) as info:
            mgr.close(timeout=0.3)
        assert time.monotonic() - start < 0.3 + _SLACK_S < config.drain_timeout_s
        assert f"Transfer #{t.id}" in str(info.value)
        assert lc.state is FINISHING and parked() >= 1
        with pytest.raises(kvo.KVOffloadError, match="open"):
            mgr.poll()  # closed: nothing is delivered any more
    finally:
        gate.set()
    assert backend.join(10)


# --- F24: the owner thread ------------------------------------------------------------


def _in_thread(fn: Any) -> BaseException | None:
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            box[0] = exc

    t = threading.Thread(target=run, name="engine-side-thread")
    t.start()
    t.join(10)
    return box[0]


@pytest.mark.asyncio
async def test_f24_asyncio_calls_from_a_foreign_thread_raise_and_change_nothing() -> None:
    """F24 (asyncio): admit, extend, finish, abort, statistics and the waits from a
    thread other than the loop's raise WrongThread naming both threads; nothing
    changes, and a waiter is still woken by the owner's own abort."""
    backend = SimBackend()
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=16, host_pages=8, drain_timeout_s=5)
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        before = mgr.statistics()
        calls = [
            lambda: mgr.admit("x", prompt=[1]),
            lambda: lc.extend([1]),
            lambda: mgr.extend_batch([lc], [1]),
            lc.finish,
            lc.abort,
            mgr.statistics,
            lambda: asyncio.run(lc.wait_released()),
        ]
        for call in calls:
            err = await anyio.to_thread.run_sync(_in_thread, call)
            assert isinstance(err, kvo.WrongThread), err
            assert "engine-side-thread" in str(err) and "MainThread" in str(err)
        assert mgr.statistics() == before and lc.state is OFFLOADING and backend.pending
        waiter = asyncio.ensure_future(lc.retract())
        await asyncio.sleep(0)
        backend.complete_all()
        with anyio.fail_after(HANG_S):
            await waiter
        assert lc.outcome is kvo.Outcome.ABORTED


def test_f24_sync_calls_from_a_foreign_thread_raise_and_change_nothing() -> None:
    """F24 (sync): every call from a thread other than the one that opened the manager
    raises WrongThread naming both threads; nothing changes."""
    backend = SimBackend()
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=16, host_pages=8, drain_timeout_s=5)
    with kvo.SyncOffloadManager(config, backend=backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        before = mgr.statistics()
        for call in (
            lambda: mgr.admit("x", prompt=[1]),
            mgr.poll,
            mgr.ready,
            mgr.quiesce,
            lambda: lc.extend([1]),
            lambda: mgr.extend_batch([lc], [1]),
            lc.finish,
            lc.abort,
            mgr.close,
        ):
            err = _in_thread(call)
            assert isinstance(err, kvo.WrongThread), err
            assert "engine-side-thread" in str(err) and "MainThread" in str(err)
        assert mgr.statistics() == before and lc.state is OFFLOADING
        backend.complete_all()
        lc.finish()
        mgr.quiesce(5)
        assert lc.released


def _steps_on_real_copies(driver: str, n: int, batched: bool) -> tuple[Any, ...]:
    """30 decode steps of ``n`` lifecycles on the cpu backend, through extend_batch or
    per-request extends, a listener attached for steps 10-19; then finish and release.
    Returns what was seen after each step, the events the steps emitted (deliveries
    depend on the copy threads' timing) and the end counters."""
    pages = 12 * n  # host pages as many as device pages: no drop, whatever the copies' timing
    config = kvo.OffloadConfig(page_size=4, stride=8, device_pages=pages, host_pages=pages, drain_timeout_s=5)
    host = host_for(driver, config, CpuBackend())
    mgr = host.mgr
    seen: list[tuple[Any, ...]] = []
    events: list[tuple[Any, ...]] = []
    lcs = host.call(lambda: [mgr.admit(f"r{i}", toks(i, i + 1 + i % 9)) for i in range(n)])
    remove: Any = None

    def listen(name: str, fields: dict[str, Any]) -> None:  # what the steps emit (not deliveries)
        if name == "transfer.submitted" or fields.get("trigger") in ("extend", "submit"):
            events.append((name, fields["rid"], fields.get("trigger")))

    def step(ids: list[int]) -> None:
        if batched:
            mgr.extend_batch(lcs, ids)
        else:
            for lc, t in zip(lcs, ids, strict=True):
                lc.extend([t])

    for s in range(30):
        if s == 10:
            remove = host.call(lambda: mgr.add_listener(listen))
        if s == 20:
            host.call(remove)
        host.call(lambda s=s: step([1000 * s + i for i in range(n)]))
        seen.append(host.call(lambda: tuple((lc.committed, lc.submitted, lc.chain_key) for lc in lcs)))
    rows = host.call(lambda: mgr.core.rows.attached if mgr.core.rows else 0)
    host.call(lambda: [lc.finish() for lc in lcs])
    settle_until(host, lambda: all(lc.released for lc in lcs))
    stats = host.call(mgr.statistics)
    host.close()
    return seen, sorted(events), rows, stats.pages_copied, stats.chunks_submitted, stats.device_pages_used


@pytest.mark.parametrize("driver", ["asyncio", "sync"])
def test_a_large_batch_on_real_copies_ends_as_the_per_request_calls_do(driver: str) -> None:
    """extend_batch's array state (from ROWS_MIN lifecycles) under each driver, copies on
    the cpu backend's threads, a listener attached for steps 10-19 (the rows are given
    back while events are emitted per step): the same chunks, keys, pages and events as
    per-request extends, everything released."""
    from kvoffload.core.offload import ROWS_MIN

    n = ROWS_MIN + 8
    seen, events, rows, copied, chunks, used = _steps_on_real_copies(driver, n, batched=True)
    assert rows == n  # the array path was taken (again, once the listener was gone)
    assert events and used == 0
    p_seen, p_events, p_rows, p_copied, p_chunks, _ = _steps_on_real_copies(driver, n, batched=False)
    assert p_rows == 0
    assert (seen, events, copied, chunks) == (p_seen, p_events, p_copied, p_chunks)


# --- closing --------------------------------------------------------------------------


@pytest.mark.parametrize("driver", ["asyncio", "sync"])
def test_closing_aborts_live_lifecycles_and_leaves_no_page_counted_as_used(driver: str) -> None:
    """Lifecycles still live when the manager closes are aborted: those with nothing in
    flight are released at once (``on_released`` called, outcome ABORTED), those with a
    copy in flight after it (the drain waits for it); no page stays counted as used."""
    backend = CpuBackend()
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=16, host_pages=8, drain_timeout_s=5)
    released: list[kvo.Lifecycle] = []
    host = host_for(driver, config, backend, on_released=released.append)
    mgr = host.mgr
    idle = host.call(lambda: mgr.admit("idle", prompt=toks(0, 6)))
    busy = host.call(lambda: mgr.admit("busy", prompt=toks(0, 4)))
    host.call(lambda: busy.extend(toks(4, 8)))
    host.close()
    assert idle.outcome is kvo.Outcome.ABORTED and busy.state is RELEASED
    assert set(released) == {idle, busy}
    s = mgr.statistics()
    assert (s.live_lifecycles, s.device_pages_used, s.host_pages_used) == (0, 0, 0)
    mgr.check_invariants()


@pytest.mark.asyncio
async def test_waiting_on_a_lifecycle_released_by_the_close_returns_at_once() -> None:
    """A lifecycle that was live but idle when the manager closed is released by the
    close: wait_released() and retract() return at once instead of waiting for ever."""
    async with kvo.OffloadManager(
        kvo.OffloadConfig(page_size=4, stride=4, device_pages=16, host_pages=8), backend="sim"
    ) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
    with anyio.fail_after(2):
        await lc.wait_released()
        await lc.retract()
        await lc.wait_quiescent()
    assert lc.outcome is kvo.Outcome.ABORTED


@pytest.mark.asyncio
async def test_the_asyncio_manager_may_be_entered_and_left_in_different_tasks() -> None:
    """Entering in one task and leaving in another works (a pytest-asyncio fixture does
    this); a background failure never cancels the caller's code."""
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=16, host_pages=8, drain_timeout_s=5)
    backend = SimBackend()
    mgr = kvo.OffloadManager(config, backend=backend)
    await asyncio.ensure_future(mgr.__aenter__())
    lc = mgr.admit("r", prompt=toks(0, 4))
    lc.extend(toks(4, 8))
    backend.complete_all()
    await mgr.settle()
    lc.finish()
    await asyncio.ensure_future(mgr.__aexit__(None, None, None))
    assert lc.outcome is kvo.Outcome.COMPLETED and mgr.statistics().device_pages_used == 0
