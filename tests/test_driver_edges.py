"""The drivers at their edges (issue 19): callbacks that raise while the manager drains
or waits, what ``lc.device_pages`` says inside ``on_released``, ``abort()`` racing the
request's own finish, calls after close, a listener that calls back into the manager
during a delivery, bad timeouts, the copy thread's last batch, and a store that raises
``CancelledError``. Each behaviour on the driver(s) it concerns."""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import time
import weakref
from typing import Any

import pytest
from support import toks

import kvoffload as kvo
from kvoffload.backends import CpuBackend
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend

PENDING, OFFLOADING, FINISHING, RELEASED = kvo.LifecycleState


def small(**changes: Any) -> kvo.OffloadConfig:
    fields: dict[str, Any] = dict(page_size=4, stride=4, device_pages=16, host_pages=8, drain_timeout_s=5)
    fields.update(changes)
    return kvo.OffloadConfig(**fields)


def one_copy(mgr: Any, rid: str) -> kvo.Lifecycle:
    """Admit ``rid`` and make one chunk go out; then finish it (FINISHING)."""
    lc = mgr.admit(rid, prompt=toks(0, 4))
    lc.extend(toks(4, 8))
    lc.finish()
    assert lc.state is FINISHING
    return lc


def until(cond: Any, what: str, bound: float = 10.0) -> None:
    """Wait (real threads) until ``cond()``, at most ``bound`` seconds (STYLE 16)."""
    deadline = time.monotonic() + bound
    while not cond():
        assert time.monotonic() < deadline, f"not within {bound}s: {what}"
        time.sleep(0.001)


# --- 1: a callback that raises while the manager drains or waits --------------------------


def test_close_finishes_closing_when_on_released_raises_then_raises_the_first_error() -> None:
    """close() with an on_released that raises during the drain: the manager still
    drains every copy, stops its threads and is closed; the first callback error is
    raised at the end, the others named in its notes."""
    calls: list[str] = []

    def on_released(lc: kvo.Lifecycle) -> None:
        calls.append(lc.rid)
        raise RuntimeError(f"engine bug {lc.rid}")

    backend = CpuBackend()
    mgr = kvo.SyncOffloadManager(small(), backend=backend, on_released=on_released).open()
    first, second = one_copy(mgr, "a"), one_copy(mgr, "b")
    with pytest.raises(RuntimeError, match="engine bug a") as info:
        mgr.close()
    assert calls == ["a", "b"] and first.released and second.released
    assert not mgr.is_open and backend.join(0), "the copy thread still runs"
    assert any("engine bug b" in note for note in getattr(info.value, "__notes__", []))
    assert mgr.statistics().live_lifecycles == 0 and mgr.statistics().device_pages_used == 0
    mgr.close()  # closed: a second close is a no-op


@pytest.mark.parametrize("call", ["quiesce", "wait_released"])
def test_quiesce_and_wait_released_finish_the_wait_then_raise_the_callback_error(call: str) -> None:
    """An on_released that raises during quiesce() / wait_released(): the rest of the
    batch is delivered, the wait goes on to its end (no copy in flight / the lifecycle
    released), then the first callback error is raised with a note saying the wait
    completed."""
    calls: list[str] = []

    def on_released(lc: kvo.Lifecycle) -> None:
        calls.append(lc.rid)
        if lc.rid == "bad":
            raise RuntimeError("engine bug")

    backend = SimBackend()
    with kvo.SyncOffloadManager(small(), backend=backend, on_released=on_released) as mgr:
        bad = one_copy(mgr, "bad")
        later = mgr.admit("later", prompt=toks(0, 4))
        later.extend(toks(4, 8))
        later.finish()
        backend.complete(backend.pending[0])  # bad's copy only: later's is still in flight
        done = threading.Event()

        def complete_later() -> None:  # the second copy ends while the wait runs
            until(lambda: calls == ["bad"], "bad released")
            backend.complete(backend.pending[0])
            done.set()

        helper = threading.Thread(target=complete_later)
        helper.start()
        with pytest.raises(RuntimeError, match="engine bug") as info:
            if call == "quiesce":
                mgr.quiesce(timeout=10)
            else:
                mgr.wait_released(later, timeout=10)
        helper.join(10)
        assert done.is_set() and bad.released and later.released and calls == ["bad", "later"]
        assert mgr.copies_in_flight == 0
        assert any(f"{call}()" in note and "completed" in note for note in info.value.__notes__)
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_asyncio_close_finishes_when_on_released_raises() -> None:
    """The asyncio manager: an on_released that raises while leaving the manager is
    logged; leaving still drains, stops the backend's threads and closes."""
    backend = CpuBackend()

    def on_released(lc: kvo.Lifecycle) -> None:
        raise RuntimeError("engine bug")

    mgr = kvo.OffloadManager(small(), backend=backend, on_released=on_released)
    with pytest.raises(RuntimeError, match="engine bug"):
        async with mgr:
            one_copy(mgr, "a")
            mgr.admit("idle", prompt=toks(0, 4))  # released by the close itself
    assert not mgr.is_open and backend.join(0)
    assert mgr.statistics().live_lifecycles == 0


# --- 2: lc.device_pages inside on_released ------------------------------------------------


@pytest.mark.parametrize("owned", [False, True])
def test_device_pages_are_readable_inside_on_released_then_empty(owned: bool) -> None:
    """The natural callback ``engine.free(lc.device_pages)`` frees every page: inside
    on_released the lifecycle still lists the pages it held; once the call that
    released it returns they are [] (the lifecycle pins no page id for ever)."""
    seen: list[list[int]] = []

    def on_released(lc: kvo.Lifecycle) -> None:
        seen.append(list(lc.device_pages))

    backend = SimBackend()
    if owned:
        with kvo.SyncOffloadManager(small(), backend=backend, on_released=on_released) as mgr:
            lc = one_copy(mgr, "r")
            held = list(lc.device_pages)
            backend.complete_all()
            mgr.poll()
    else:
        import torch

        kv = [torch.zeros(16, 4, 2) for _ in range(2)]
        config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=None, host_pages=8)
        with kvo.SyncOffloadManager(config, backend=backend, device_kv=kv, on_released=on_released) as mgr:
            lc = mgr.admit("r", prompt=toks(0, 4), pages=[9])
            lc.extend(toks(4, 8), pages=[3])
            lc.finish()
            held = [9, 3]
            backend.complete_all()
            mgr.poll()
    assert len(held) == 2 and seen == [held]
    assert lc.released and lc.device_pages == []


# --- 3: abort after RELEASED; calls after close -----------------------------------------


@pytest.mark.parametrize("driver", ["sync", "asyncio"])
def test_abort_after_released_is_a_no_op(driver: str) -> None:
    """A client disconnect racing the request's own finish: abort() on a RELEASED
    lifecycle returns None and changes nothing - no transition event, outcome and
    counters as they were."""
    events: list[str] = []
    backend = SimBackend()

    def body(mgr: Any) -> None:
        mgr.add_listener(lambda name, fields: events.append(name))
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.finish()
        assert lc.outcome is kvo.Outcome.COMPLETED
        before, n = mgr.statistics(), len(events)
        assert lc.abort() is None
        assert lc.outcome is kvo.Outcome.COMPLETED and not lc.aborted
        assert mgr.statistics() == before and events[n:] == []
        with pytest.raises(kvo.InvalidTransition):
            lc.finish()  # finish after RELEASED stays an error

    if driver == "sync":
        with kvo.SyncOffloadManager(small(), backend=backend) as mgr:
            body(mgr)
    else:

        async def main() -> None:
            async with kvo.OffloadManager(small(), backend=backend) as mgr:
                body(mgr)

        asyncio.run(main())


def test_lifecycle_calls_after_close_say_the_manager_is_closed() -> None:
    """After close: extend/finish of a lifecycle and the manager's own calls raise
    ManagerClosed (a KVOffloadError naming the close), not InvalidTransition; abort
    (close already aborted it) is a no-op."""
    assert issubclass(kvo.ManagerClosed, kvo.KVOffloadError)
    backend = SimBackend()
    with kvo.SyncOffloadManager(small(), backend=backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
    assert lc.released and lc.outcome is kvo.Outcome.ABORTED
    with pytest.raises(kvo.ManagerClosed, match="closed"):
        lc.extend([1, 2])
    with pytest.raises(kvo.ManagerClosed, match="closed"):
        lc.finish()
    assert lc.abort() is None
    for call in (lambda: mgr.admit("x", prompt=[]), mgr.poll, mgr.quiesce):
        with pytest.raises(kvo.ManagerClosed, match="closed"):
            call()


# --- 4: re-entrant calls from a listener during delivery ---------------------------------


@pytest.mark.parametrize("driver", ["sync", "asyncio"])
def test_a_listener_that_aborts_during_delivery_loses_nothing(driver: str) -> None:
    """A listener that aborts the request whose copy failed, during the delivery of a
    batch: the abort is applied once the batch is applied; every other completion of
    the batch is delivered, nothing stays FINISHING, every page comes back."""
    backend = SimBackend()
    released: list[str] = []

    def on_released(lc: kvo.Lifecycle) -> None:
        released.append(lc.rid)

    def body(mgr: Any) -> list[kvo.Lifecycle]:
        def on_event(name: str, fields: dict[str, Any]) -> None:
            if name == "transfer.failed":
                victim = next(lc for lc in mgr if lc.id == fields["lifecycle"])
                victim.abort()

        mgr.add_listener(on_event)
        # a and b finished with their copy in flight, c still decodes; their copies fail
        # and the listener aborts them
        c = mgr.admit("c", prompt=toks(0, 4))
        c.extend(toks(4, 9))
        failing = [one_copy(mgr, "a"), one_copy(mgr, "b"), c]
        rest = [one_copy(mgr, f"r{i}") for i in range(3)]
        for t in [t for t in backend.pending if any(t.lifecycle_id == lc.id for lc in failing)]:
            backend.fail(t, kvo.BackendError("simulated copy failure"))
        backend.complete_all()
        return [*failing, *rest]

    if driver == "sync":
        with kvo.SyncOffloadManager(
            small(), backend=backend, on_released=lambda lc: released.append(lc.rid)
        ) as mgr:
            lcs = body(mgr)
            assert mgr.poll() == 6
            mgr.check_invariants()
            stats = mgr.statistics()
    else:

        async def main() -> tuple[list[kvo.Lifecycle], kvo.Statistics]:
            async with kvo.OffloadManager(small(), backend=backend, on_released=on_released) as mgr:
                lcs = body(mgr)
                await mgr.settle()
                mgr.check_invariants()
                return lcs, mgr.statistics()

        lcs, stats = asyncio.run(main())
    assert all(lc.released for lc in lcs), lcs
    # a and b: released FAILED by the batch, the abort then a no-op; c: aborted after it
    assert [lc.outcome for lc in lcs[:3]] == [kvo.Outcome.FAILED] * 2 + [kvo.Outcome.ABORTED]
    assert sorted(released) == ["a", "b", "c", "r0", "r1", "r2"]
    assert (stats.live_lifecycles, stats.device_pages_used, stats.host_pages_used) == (0, 0, 0)


# --- 5: timeouts and foreign lifecycles --------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, -1.0, -math.inf, "1", True])
@pytest.mark.parametrize("call", ["quiesce", "wait_released", "close"])
def test_a_bad_timeout_is_refused_at_once(call: str, bad: Any) -> None:
    """timeout=nan spun for ever at 100% CPU: nan, a negative number and a non-number
    are refused with ConfigError (a ValueError) naming the timeout; nothing changes."""
    backend = SimBackend()
    with kvo.SyncOffloadManager(small(), backend=backend) as mgr:
        lc = one_copy(mgr, "r")
        fn = {"quiesce": mgr.quiesce, "wait_released": lambda timeout: mgr.wait_released(lc, timeout)}.get(
            call, mgr.close
        )
        with pytest.raises(kvo.ConfigError, match="timeout"):
            fn(timeout=bad)
        assert mgr.is_open and lc.state is FINISHING
        backend.complete_all()


def test_a_numpy_timeout_is_a_number() -> None:
    """Any real number of seconds is a timeout (numpy scalars included); inf is for ever."""
    import numpy as np

    backend = SimBackend()
    with kvo.SyncOffloadManager(small(), backend=backend) as mgr:
        lc = one_copy(mgr, "r")
        backend.complete_all()
        mgr.wait_released(lc, timeout=np.int64(10))
        mgr.quiesce(timeout=math.inf)


def test_wait_released_on_another_managers_lifecycle_raises_at_once() -> None:
    """wait_released(lc) with a lifecycle another manager admitted waited out its whole
    timeout (for ever by default): it raises a typed error at once."""
    backend = SimBackend()
    with kvo.SyncOffloadManager(small(), backend=backend) as other:
        foreign = one_copy(other, "theirs")
        with kvo.SyncOffloadManager(small(), backend=SimBackend()) as mgr:
            start = time.monotonic()
            with pytest.raises(kvo.KVOffloadError, match="another manager"):
                mgr.wait_released(foreign)
            assert time.monotonic() - start < 5
        backend.complete_all()


# --- 6: the cpu copy thread holds no lifecycle ---------------------------------------------


def test_the_idle_cpu_copy_thread_keeps_no_lifecycle_or_tag_alive() -> None:
    """F2 on the cpu backend: once released and polled, a dropped lifecycle and its tag
    (the engine's request object) are garbage - the idle copy thread keeps nothing of
    its last batch."""

    class Req:
        pass

    with kvo.SyncOffloadManager(small(), backend="cpu") as mgr:
        req = Req()
        lc = mgr.admit("r", prompt=toks(0, 4), tag=req)
        lc.extend(toks(4, 8))
        lc.finish()
        refs = weakref.ref(lc), weakref.ref(req)
        del req
        mgr.wait_released(lc, timeout=10)
        del lc
        until(lambda: mgr.backend.inflight == 0, "copy thread idle")
        gc.collect()
        assert refs[0]() is None and refs[1]() is None, gc.get_referrers(refs[1]())


# --- 7: a store that raises CancelledError -----------------------------------------------


class CancellingStorage(MemoryStorage):
    """A store whose writes raise ``asyncio.CancelledError`` while ``cancel`` is set."""

    cancel = True

    async def put_pages(self, keys: Any, pool: Any, host_pages: Any) -> None:
        if self.cancel:
            raise asyncio.CancelledError("the store's client was cancelled")
        await super().put_pages(keys, pool, host_pages)


def test_a_store_raising_cancelled_error_fails_that_write_only_sync() -> None:
    """A store's CancelledError (a BaseException) killed the sync writer thread: its
    host pages never returned and every later poll() raised. Now it fails that write
    only (counted, host pages returned) and the writer runs on."""
    store = CancellingStorage()
    backend = SimBackend()
    with kvo.SyncOffloadManager(small(), backend=backend, storage=store) as mgr:
        one_copy(mgr, "a")
        backend.complete_all()
        until(lambda: (mgr.poll(), mgr.writes_pending == 0)[1], "write collected")
        stats = mgr.statistics()
        assert stats.host_pages_used == 0 and stats.pages_store_failed == 1, stats
        store.cancel = False
        one_copy(mgr, "b")
        backend.complete_all()
        until(lambda: (mgr.poll(), mgr.writes_pending == 0)[1], "second write collected")
        assert mgr.statistics().pages_stored == 1 and mgr.statistics().host_pages_used == 0


@pytest.mark.asyncio
async def test_a_store_raising_cancelled_error_fails_that_write_only_asyncio() -> None:
    """The asyncio writer task: a store's own CancelledError (not a cancellation of the
    task) fails that write only; the writer runs on."""
    store = CancellingStorage()
    backend = SimBackend()
    async with kvo.OffloadManager(small(), backend=backend, storage=store) as mgr:
        one_copy(mgr, "a")
        backend.complete_all()
        await mgr.settle()
        stats = mgr.statistics()
        assert stats.host_pages_used == 0 and stats.pages_store_failed == 1, stats
        store.cancel = False
        one_copy(mgr, "b")
        backend.complete_all()
        await mgr.settle()
        assert mgr.statistics().pages_stored == 1


def test_a_listener_that_aborts_during_finish_does_not_make_finish_fail() -> None:
    """A listener that aborts the request whose tail chunk its own finish() just
    submitted: the abort waits for the finish, so finish() returns normally (it raised
    InvalidTransition: the abort had moved the lifecycle to FINISHING under it) and the
    lifecycle ends ABORTED once its copy lands; the ledger balances throughout."""
    backend = SimBackend()
    with kvo.SyncOffloadManager(small(stride=8), backend=backend) as mgr:

        def on_event(name: str, fields: dict[str, Any]) -> None:
            if name == "transfer.submitted":
                next(lc for lc in mgr if lc.id == fields["lifecycle"]).abort()

        mgr.add_listener(on_event)
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 8))  # one whole page, no stride due yet
        assert backend.pending == []
        lc.finish()  # the flush submits it; the listener aborts
        assert lc.aborted and lc.state is FINISHING and lc.inflight == 1
        mgr.check_invariants()
        backend.complete_all()
        mgr.poll()
        assert lc.outcome is kvo.Outcome.ABORTED
        mgr.check_invariants()
