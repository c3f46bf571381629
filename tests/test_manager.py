"""The OffloadManager contract beyond the failure catalogue: refused events and bad
input change nothing, the prompt policy, the registry, events, statistics, the ledger
check itself, and the watchdog."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs
from support import HANG_S, FakeClock, complete_everything, open_manager, toks, unchanged

import kvoffload as kvo
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.testing import SimBackend

PENDING, OFFLOADING, FINISHING, RELEASED = kvo.LifecycleState

pytestmark = pytest.mark.asyncio


def snapshot(lc: Lifecycle) -> tuple[Any, ...]:
    """Everything a refused event must leave as it was on one lifecycle."""
    return (
        lc.state,
        lc.committed,
        lc.submitted,
        lc.chain_key,
        lc.inflight,
        list(lc.device_pages),
        lc.due,
        lc.outcome,
        lc.aborted,
    )


# --- refused events ----------------------------------------------------------------


async def _finishing(mgr: kvo.OffloadManager, backend: SimBackend) -> Lifecycle:
    lc = mgr.admit("r", prompt=toks(0, 4))
    lc.extend(toks(4, 8))
    lc.finish()
    return lc


async def _released(mgr: kvo.OffloadManager, backend: SimBackend) -> Lifecycle:
    lc = await _finishing(mgr, backend)
    await complete_everything(mgr, backend)
    return lc


@pytest.mark.parametrize(
    ("reach", "state", "event", "fire"),
    [
        (_finishing, FINISHING, "extend", lambda lc: lc.extend([8])),
        (_finishing, FINISHING, "finish", lambda lc: lc.finish()),
        (_released, RELEASED, "extend", lambda lc: lc.extend([8])),
        (_released, RELEASED, "finish", lambda lc: lc.finish()),
        # abort after RELEASED is a no-op (issue 19): tests/test_driver_edges.py
    ],
    ids=["extend-after-finish", "finish-twice", "extend-released", "finish-released"],
)
async def test_illegal_event_raises_invalid_transition_and_changes_nothing(
    backend: SimBackend,
    reach: Callable[[kvo.OffloadManager, SimBackend], Any],
    state: kvo.LifecycleState,
    event: str,
    fire: Callable[[Lifecycle], None],
) -> None:
    """An event the table refuses raises InvalidTransition naming the lifecycle, its
    state and the event; the lifecycle, the pools and every counter are as they were."""
    async with open_manager(backend) as mgr:
        lc = await reach(mgr, backend)
        mgr.check_invariants()
        assert lc.state is state
        before, before_lc, pending = mgr.statistics(), snapshot(lc), list(backend.pending)
        with pytest.raises(kvo.InvalidTransition) as info:
            fire(lc)
        assert info.value.lifecycle is lc and info.value.state is state and info.value.event == event
        assert (
            f"#{lc.id}" in str(info.value)
            and state.name in str(info.value)
            and repr(event) in str(info.value)
        )
        unchanged(mgr, before)
        assert snapshot(lc) == before_lc and backend.pending == pending


# --- pools -----------------------------------------------------------------------------


async def test_admit_with_full_device_pool_raises_pool_exhausted_and_changes_nothing() -> None:
    """admit() that needs more device pages than are free raises PoolExhausted (pool,
    wanted, free) before anything is created; the lifecycle id is not used up."""
    backend = SimBackend()
    async with kvo.OffloadManager(kvo.OffloadConfig(4, 4, 4, 4), backend=backend) as mgr:
        a = mgr.admit("a", prompt=toks(0, 12))  # 3 of 4 pages
        before = mgr.statistics()
        with pytest.raises(kvo.PoolExhausted) as info:
            mgr.admit("b", prompt=toks(0, 5))  # needs 2
        assert (info.value.pool, info.value.wanted, info.value.free) == ("device", 2, 1)
        unchanged(mgr, before)
        assert mgr.lifecycles() == [a] and mgr.lifecycles("b") == []
        b = mgr.admit("b", prompt=toks(0, 4))
        mgr.check_invariants()
        assert b.id == a.id + 1


async def test_extend_needing_a_page_with_full_device_pool_changes_nothing() -> None:
    """extend() whose tokens need a new device page, with none free, raises
    PoolExhausted; no token is committed and nothing else moves."""
    backend = SimBackend()
    async with kvo.OffloadManager(kvo.OffloadConfig(4, 8, 2, 4), backend=backend) as mgr:
        lc = mgr.admit("a", prompt=toks(0, 6))
        lc.extend([6, 7])  # fills both pages exactly
        mgr.check_invariants()
        before, before_lc = mgr.statistics(), snapshot(lc)
        with pytest.raises(kvo.PoolExhausted):
            lc.extend([8, 9, 10])
        unchanged(mgr, before)
        assert snapshot(lc) == before_lc and backend.pending == []
        lc.finish()
        mgr.check_invariants()
        (t,) = backend.pending  # the tail flush holds exactly the committed tokens
        assert (t.first_token, t.n_tokens) == (4, 4)
        await complete_everything(mgr, backend)
        assert lc.state is RELEASED


BAD_TOKENS = [
    pytest.param([0, -1], id="negative"),
    pytest.param([2**63], id="too-large"),
    pytest.param([2**32, 2**64], id="too-large-wide"),
    pytest.param([1, 2.0], id="float"),
    pytest.param([5, True], id="bool"),
    pytest.param([False], id="bool-only"),
    pytest.param({1, 2}, id="set"),
    pytest.param({1: 2}, id="dict"),
    pytest.param(torch.tensor([1.0, 2.0]), id="float-tensor"),
    pytest.param(torch.tensor([True]), id="bool-tensor"),
    pytest.param(np.array([1.5]), id="float-ndarray"),
    pytest.param(torch.tensor([[1, 2]]), id="2d-tensor"),
    pytest.param("abcd", id="str"),
    pytest.param(b"abcd", id="bytes"),
    pytest.param([1, "2"], id="str-element"),
    pytest.param(None, id="none"),
]


@pytest.mark.parametrize("bad", BAD_TOKENS)
async def test_bad_tokens_raise_invalid_tokens_and_change_nothing(backend: SimBackend, bad: Any) -> None:
    """Token ids that are not ints in [0, 2**63), or not in an ordered sequence, are
    refused by admit() and extend() with InvalidTokens; nothing is allocated, committed
    or counted."""
    async with open_manager(backend) as mgr:
        lc = mgr.admit("ok", prompt=toks(0, 3))
        before, before_lc = mgr.statistics(), snapshot(lc)
        with pytest.raises(kvo.InvalidTokens):
            mgr.admit("bad", prompt=bad)
        unchanged(mgr, before)
        with pytest.raises(kvo.InvalidTokens):
            lc.extend(bad)
        unchanged(mgr, before)
        assert snapshot(lc) == before_lc and mgr.lifecycles() == [lc]


# --- the prompt --------------------------------------------------------------------------


async def test_offload_prompt_makes_the_aligned_prompt_the_first_chunk() -> None:
    """With offload_prompt=True the prompt's whole pages are the first chunk, keyed
    from the root; the partial page waits for decode tokens."""
    backend = SimBackend()
    config = kvo.OffloadConfig(page_size=4, stride=8, device_pages=16, host_pages=16, offload_prompt=True)
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 10))
        mgr.check_invariants()
        (t,) = backend.pending
        assert lc.state is OFFLOADING and lc.inflight == 1
        assert (t.first_token, t.n_tokens, t.device_pages) == (0, 8, lc.device_pages[:2])
        assert t.keys == kvo.chain_keys(None, toks(0, 8), 4)
        assert (lc.submitted, lc.committed, lc.chain_key) == (8, 10, t.keys[-1])
        short = mgr.admit("short", prompt=toks(0, 3))  # no whole page: nothing to send
        mgr.check_invariants()
        assert short.state is PENDING and backend.pending == [t]
        await complete_everything(mgr, backend)


async def test_default_prompt_is_taken_as_stored_and_seeds_the_chain(backend: SimBackend) -> None:
    """By default the prompt's aligned part is not sent; its last key seeds the chain."""
    async with open_manager(backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 10))
        mgr.check_invariants()
        assert backend.pending == [] and lc.state is PENDING
        assert (lc.submitted, lc.chain_key) == (8, kvo.chain_keys(None, toks(0, 8), 4)[-1])


# --- registry and observability ----------------------------------------------------------


async def test_lifecycles_by_rid_returns_every_live_lifecycle_sharing_it(backend: SimBackend) -> None:
    """lifecycles(rid) lists every live lifecycle labelled rid, oldest first; a
    released one drops out; lifecycles() lists all live ones."""
    async with open_manager(backend) as mgr:
        a = mgr.admit("r", prompt=toks(0, 4))
        other = mgr.admit("x", prompt=toks(0, 4))
        b = mgr.admit("r", prompt=toks(0, 4))
        mgr.check_invariants()
        assert mgr.lifecycles("r") == [a, b]
        assert mgr.lifecycles() == [a, other, b] and len(mgr) == 3 and list(mgr) == [a, other, b]
        a.finish()
        mgr.check_invariants()
        assert mgr.lifecycles("r") == [b] and mgr.lifecycles("nobody") == []


async def test_transitions_are_logged_with_lifecycle_rid_from_to_trigger(backend: SimBackend) -> None:
    """Every transition is one ``lifecycle.transition`` event with lifecycle, rid,
    from, to and trigger; listeners get the same fields."""
    async with open_manager(backend) as mgr:
        heard: list[tuple[str, dict[str, Any]]] = []
        mgr.add_listener(lambda name, fields: heard.append((name, dict(fields))))
        with capture_logs() as logs:
            lc = mgr.admit("r7", prompt=toks(0, 4))
            lc.extend(toks(4, 8))
            lc.finish()
            await complete_everything(mgr, backend)
        keys = ("lifecycle", "rid", "from", "to", "trigger")
        want = [
            (lc.id, "r7", "PENDING", "PENDING", "extend"),
            (lc.id, "r7", "PENDING", "OFFLOADING", "submit"),
            (lc.id, "r7", "OFFLOADING", "FINISHING", "finish"),
            (lc.id, "r7", "FINISHING", "RELEASED", "chunk_done"),
        ]
        logged = [e for e in logs if e["event"] == "lifecycle.transition"]
        assert [tuple(e[k] for k in keys) for e in logged] == want
        assert {e["log_level"] for e in logged} == {"debug"}
        told = [f for name, f in heard if name == "lifecycle.transition"]
        assert [tuple(f[k] for k in keys) for f in told] == want


async def test_statistics_is_a_frozen_snapshot_with_the_documented_fields(backend: SimBackend) -> None:
    """statistics() is a frozen dataclass snapshot with ARCHITECTURE.md's field names,
    and its values describe the manager at the time it was taken."""
    async with open_manager(backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 9))
        s = mgr.statistics()
        assert dataclasses.is_dataclass(s) and isinstance(s, kvo.Statistics)
        names = {f.name for f in dataclasses.fields(s)}
        assert {"live_lifecycles", "device_pages_used", "host_pages_used", "chunks_inflight"} <= names
        assert set(s.as_dict()) == names
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.live_lifecycles = 0  # type: ignore[misc]
        assert (s.live_lifecycles, s.device_pages_used, s.host_pages_used, s.chunks_inflight) == (1, 3, 1, 1)
        assert (s.pending, s.offloading, s.finishing, s.admitted, s.chunks_submitted) == (0, 1, 0, 1, 1)
        await complete_everything(mgr, backend)
        assert s.chunks_inflight == 1  # a snapshot: it does not follow the manager
        assert mgr.statistics().chunks_inflight == 0 and mgr.statistics().chunks_copied == 1


# --- the ledger check ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tamper", "words"),
    [
        (lambda m, lc: setattr(m.counters, "chunks_inflight", m.counters.chunks_inflight + 1), "in flight"),
        (lambda m, lc: setattr(m.counters, "admitted", m.counters.admitted + 1), "admitted"),
        (lambda m, lc: setattr(m.counters, "pages_copied", -1), "pages_copied is negative"),
        (lambda m, lc: setattr(lc, "inflight", 0), "OFFLOADING with nothing in flight"),
        (lambda m, lc: setattr(lc, "submitted", lc.submitted + 1), "not page-aligned"),
        (lambda m, lc: m.host_pool.allocate(1), "host pool used"),
    ],
    ids=["chunks-inflight", "admitted", "negative", "lifecycle-inflight", "submitted", "leaked-host-page"],
)
async def test_check_invariants_detects_a_tampered_ledger(
    backend: SimBackend, tamper: Callable[[Any, Lifecycle], object], words: str
) -> None:
    """check_invariants() can fail: a tampered count raises InvariantViolation naming it."""
    async with open_manager(backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        mgr.check_invariants()
        saved_counters = dataclasses.replace(mgr.counters)
        saved = (lc.inflight, lc.submitted, list(mgr.host_pool._free), bytearray(mgr.host_pool._allocated))
        tamper(mgr, lc)
        with pytest.raises(kvo.InvariantViolation, match=words):
            mgr.check_invariants()
        for name in saved_counters.names:  # the counters as they were
            setattr(mgr.counters, name, getattr(saved_counters, name))
        lc.inflight, lc.submitted, mgr.host_pool._free, mgr.host_pool._allocated = saved
        mgr.check_invariants()


# --- the watchdog (F18) ----------------------------------------------------------------------


async def test_watchdog_reports_a_stuck_lifecycle_once_per_spell() -> None:
    """F18: a lifecycle in OFFLOADING past stuck_after_s (by the manager's clock) is
    reported once (a ``lifecycle.stuck`` warning, stuck_reports == 1), not again for
    the same spell; a new spell in that state is reported again."""
    backend = SimBackend()
    clock = FakeClock()
    config = kvo.OffloadConfig(4, 4, 16, 16, stuck_after_s=10, watchdog_interval_s=1000)
    async with kvo.OffloadManager(config, backend=backend, clock=clock) as mgr:
        lc = mgr.admit("slow", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        with capture_logs() as logs:
            clock.advance(10)
            mgr.tick()  # exactly at the deadline: not past it
            assert mgr.statistics().stuck_reports == 0
            clock.advance(1)
            mgr.tick()
            mgr.tick()
            clock.advance(100)
            mgr.tick()
        mgr.check_invariants()
        stuck = [e for e in logs if e["event"] == "lifecycle.stuck"]
        assert len(stuck) == 1 and mgr.statistics().stuck_reports == 1
        assert (stuck[0]["log_level"], stuck[0]["lifecycle"], stuck[0]["rid"]) == ("warning", lc.id, "slow")
        assert (stuck[0]["state"], stuck[0]["inflight"], stuck[0]["seconds"]) == ("OFFLOADING", 1, 11)

        await complete_everything(mgr, backend)  # back to PENDING: the spell ends
        mgr.tick()
        lc.extend(toks(8, 12))  # a new spell in OFFLOADING
        clock.advance(5)
        mgr.tick()
        assert mgr.statistics().stuck_reports == 1
        clock.advance(6)
        mgr.tick()
        mgr.check_invariants()
        assert mgr.statistics().stuck_reports == 2
        await complete_everything(mgr, backend)


class _RefusingBackend(SimBackend):
    """A backend whose submit refuses while ``refuse`` is set (a closed or broken device)."""

    refuse = False

    def submit(self, transfer: kvo.Transfer) -> None:
        if self.refuse:
            raise kvo.BackendError("copy engine refused the submission")
        super().submit(transfer)


async def test_extend_whose_chunk_submit_is_refused_changes_nothing() -> None:
    """extend() is all or nothing: when the chunk it makes due is refused by the
    backend, the BackendError comes out and no token, device page or count moves, so
    the caller may retry the same tokens without committing them twice."""
    backend = _RefusingBackend()
    async with kvo.OffloadManager(kvo.OffloadConfig(4, 8, 16, 8), backend=backend) as mgr:
        lc = mgr.admit("a", prompt=toks(0, 4))
        lc.extend(toks(4, 10))  # 6 of 8: nothing due
        before, before_lc = mgr.statistics(), snapshot(lc)
        backend.refuse = True
        with pytest.raises(kvo.BackendError, match="refused"):
            lc.extend(toks(10, 14))  # a stride is due, needs a fourth device page
        unchanged(mgr, before)
        assert snapshot(lc) == before_lc and backend.pending == []
        backend.refuse = False
        lc.extend(toks(10, 14))  # the retry commits the tokens once
        assert lc.committed == 14 and lc.inflight == 1
        (t,) = backend.pending
        assert (t.first_token, t.n_tokens) == (4, 8)
        lc.finish()
        await complete_everything(mgr, backend)
        assert lc.state is RELEASED


async def test_finish_with_host_full_counts_every_whole_page_it_loses() -> None:
    """Under the drop policy a tail flush that finds the host pool full counts every
    whole page it could not send as dropped, not only the first host-sized chunk; the
    drop counters count attempts (6 pages dropped twice: 12), ``pages_lost`` what was
    lost for good (6 pages), once, when the request is released."""
    backend = SimBackend()
    config = kvo.OffloadConfig(page_size=4, stride=8, device_pages=32, host_pages=2)
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        hog = mgr.admit("hog", prompt=toks(0, 4))
        hog.extend(toks(4, 13))  # one chunk of 2 pages: the host pool is now full
        assert mgr.statistics().host_pages_used == 2
        lc = mgr.admit("a", prompt=toks(0, 4))
        lc.extend(toks(4, 11))  # 7 tokens: 1 page due at a stride? no: 7 < 8
        lc.extend(toks(11, 28))  # committed 28: 24 pending, due -> drop of 3 strides (6 pages)
        s = mgr.statistics()
        assert (s.chunks_dropped, s.pages_dropped) == (1, 6)
        assert s.pages_lost == 0  # still decoding: a later chunk may send them
        lc.finish()  # 24 tokens = 6 whole pages pending, host full: all 6 are lost
        s = mgr.statistics()
        assert (s.chunks_dropped, s.pages_dropped) == (2, 12)  # attempts
        assert s.pages_lost == 6  # losses
        assert lc.state is RELEASED and lc.outcome is kvo.Outcome.COMPLETED
        await complete_everything(mgr, backend)
        hog.finish()
        await complete_everything(mgr, backend)


async def test_a_burst_of_copy_failures_logs_one_warning_and_counts_every_one() -> None:
    """A device that fails every copy does not flood the log: the first failure is a
    warning, the rest of the burst is held back (at most one line per interval, with
    how many were held back); every failure is still counted and seen by listeners."""
    backend = SimBackend()
    clock = FakeClock()
    async with kvo.OffloadManager(kvo.OffloadConfig(4, 4, 64, 64), backend=backend, clock=clock) as mgr:
        seen: list[str] = []
        mgr.add_listener(lambda name, fields: seen.append(name))
        lcs = [mgr.admit(f"r{i}", toks(0, 4)) for i in range(10)]
        for lc in lcs:
            lc.extend(toks(4, 8))
        with capture_logs() as logs:
            for t in list(backend.pending):
                backend.fail(t)
            await mgr.settle()
            clock.advance(10)
            late = mgr.admit("late", toks(0, 4))
            late.extend(toks(4, 8))
            backend.fail(backend.pending[0])
            await mgr.settle()
        lines = [e for e in logs if e["event"] == "transfer.failed" and e["log_level"] == "warning"]
        assert len(lines) == 2
        assert lines[1]["failures_since_last_log"] == 10  # 9 held back, then this one
        assert seen.count("transfer.failed") == 11
        assert mgr.statistics().chunks_failed == 11
        for lc in [*lcs, late]:
            lc.finish()
        mgr.check_invariants()


async def test_watchdog_goes_by_copy_age_not_by_time_in_state() -> None:
    """F18 is about a copy that takes forever: a long request whose copies each finish
    quickly but overlap (so it stays OFFLOADING past the deadline) is not reported; a
    copy in flight past the deadline is, naming that transfer."""
    backend = SimBackend()
    clock = FakeClock()
    config = kvo.OffloadConfig(4, 4, 64, 64, stuck_after_s=10, watchdog_interval_s=1000)
    async with kvo.OffloadManager(config, backend=backend, clock=clock) as mgr:
        seen: list[dict[str, Any]] = []
        mgr.add_listener(
            lambda name, fields: seen.append(dict(fields)) if name == "lifecycle.stuck" else None
        )
        lc = mgr.admit("long", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        for step in range(8):  # 8 x 4 s in OFFLOADING, each copy 4 s old at most
            clock.advance(4)
            lc.extend(toks(8 + 4 * step, 12 + 4 * step))  # the next copy starts ...
            backend.complete(backend.pending[0])  # ... then the older one completes
            await mgr.settle()
            mgr.tick()
            assert lc.state is OFFLOADING
        assert mgr.statistics().stuck_reports == 0 and seen == []
        (slow,) = backend.pending
        clock.advance(11)
        mgr.tick()
        assert mgr.statistics().stuck_reports == 1
        assert (seen[0]["transfer"], seen[0]["seconds"]) == (slow.id, 11)
        await complete_everything(mgr, backend)


async def test_settle_waits_for_what_was_signalled_before_it_not_for_later_work() -> None:
    """settle() returns once the completions signalled before the call are delivered
    and the storage writes they queued are done; work that arrives while it waits does
    not keep it waiting (under steady load it would never return)."""
    import anyio

    from kvoffload.storage.memory import MemoryStorage

    gates: dict[str, anyio.Event] = {}

    class GatedStore(MemoryStorage):
        async def put(self, keys: Any, pages: Any) -> None:
            if keys[0] in gates:
                await gates[keys[0]].wait()
            await super().put(keys, pages)

    backend = SimBackend()
    async with kvo.OffloadManager(
        kvo.OffloadConfig(4, 4, 64, 64), backend=backend, storage=GatedStore()
    ) as mgr:
        a = mgr.admit("a", toks(0, 4))
        a.extend(toks(4, 8))
        (ta,) = backend.pending
        gates[ta.keys[0]] = before = anyio.Event()  # a write queued before settle()
        backend.complete(ta)
        b = mgr.admit("b", toks(100, 104))
        b.extend(toks(104, 108))
        (tb,) = backend.pending
        gates[tb.keys[0]] = later = anyio.Event()  # a write queued while settle() waits
        done = anyio.Event()

        async def settle() -> None:
            await mgr.settle()
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(settle)
            await anyio.sleep(0.01)
            assert not done.is_set()  # a's write is not done yet
            backend.complete(tb)  # new work arrives; its write blocks
            await anyio.sleep(0.01)
            before.set()
            with anyio.fail_after(HANG_S):
                await done.wait()  # returns although b's write is still pending
            assert mgr.statistics().pages_in_write == 1
            later.set()
        a.finish()
        b.finish()
        await mgr.settle()
        mgr.check_invariants()
