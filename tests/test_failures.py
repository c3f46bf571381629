"""FAILURES.md, one named test per row: each reproduces the scenario on the SimBackend
and asserts what kvoffload must show, with the ledger checked after every step.

(F13, F15, F17 and F18 are covered by the backend, storage, property and watchdog
suites.)
"""

from __future__ import annotations

import gc
import hashlib
import weakref
from collections.abc import Sequence

import anyio
import pytest
from structlog.testing import capture_logs
from support import (
    HANG_S,
    FakeClock,
    complete_everything,
    open_manager,
    page_bytes_of,
    released,
    small_config,
    spin,
    toks,
    unchanged,
)

import kvoffload as kvo
from kvoffload.abc import Transfer
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend

PENDING, OFFLOADING, FINISHING, RELEASED = kvo.LifecycleState

pytestmark = pytest.mark.asyncio


def sglang_get_hash_str(token_ids: Sequence[int], prior_hash: str | None = None) -> str:
    """SGLang HiCache's page hash (reference, written out independently of kvoffload)."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def sglang_chain(tokens: Sequence[int], page_size: int) -> list[str]:
    keys: list[str] = []
    prior: str | None = None
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prior = sglang_get_hash_str(tokens[i : i + page_size], prior)
        keys.append(prior)
    return keys


def progress(lc: Lifecycle, t: Transfer) -> tuple[object, ...]:
    """A lifecycle's offload progress and its chunk's keys: what no other lifecycle may change."""
    return (
        lc.committed,
        lc.submitted,
        lc.chain_key,
        lc.inflight,
        list(lc.device_pages),
        list(t.keys),
        lc.state,
    )


def allocated(pool: object, pages: Sequence[int]) -> list[bool]:
    return [pool.is_allocated(p) for p in pages]  # type: ignore[attr-defined]


# --- F1 ------------------------------------------------------------------------------


async def test_f1_reused_request_id_shares_nothing_with_the_old_lifecycle(backend: SimBackend) -> None:
    """F1: "A reaches RELEASED and frees its own pages; B's progress, in-flight count
    and keys are untouched" when A's late completion arrives after B reused A's id."""
    async with open_manager(backend) as mgr:
        a = mgr.admit("r1", prompt=toks(0, 4))
        mgr.check_invariants()
        a.extend(toks(4, 8))
        mgr.check_invariants()
        (ta,) = backend.pending
        assert a.state is OFFLOADING and a.inflight == 1
        a.finish()
        mgr.check_invariants()
        assert a.state is FINISHING
        a_pages = list(a.device_pages)

        b = mgr.admit("r1", prompt=toks(100, 104))
        mgr.check_invariants()
        assert b is not a and b.id != a.id and b.rid == a.rid
        b.extend(toks(104, 109))
        mgr.check_invariants()
        tb = backend.pending[1]
        assert ta.lifecycle_id == a.id and tb.lifecycle_id == b.id
        # B started from its own prompt: its first chunk is tokens 4..8 of its own stream.
        assert tb.first_token == 4 and tb.n_tokens == 4
        assert tb.keys == kvo.chain_keys(None, toks(100, 108), 4)[1:]
        assert set(b.device_pages).isdisjoint(a_pages)
        b_before = progress(b, tb)
        assert b_before[:4] == (9, 8, tb.keys[-1], 1) and b_before[-1] is OFFLOADING

        backend.complete(ta)
        await released(a)
        await mgr.settle()
        mgr.check_invariants()
        assert a.state is RELEASED and a.outcome is kvo.Outcome.COMPLETED and a.device_pages == []
        assert allocated(mgr.device_pool, a_pages) == [False] * len(a_pages)
        b_after = progress(b, tb)
        assert b_after == b_before
        assert backend.pending == [tb]
        assert mgr.lifecycles("r1") == [b]
        s = mgr.statistics()
        assert (s.live_lifecycles, s.chunks_inflight, s.chunks_copied, s.released_completed) == (1, 1, 1, 1)
        assert s.device_pages_used == len(b.device_pages) == 3


# --- F2 ------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", [None, "memory"])
async def test_f2_released_and_dropped_lifecycle_is_garbage(backend: SimBackend, storage: str | None) -> None:
    """F2: "the lifecycle is garbage once released and unreferenced (weakref test)";
    a live one with a chunk in flight is kept (and released) by the manager even
    when the caller dropped it. Nothing in kvoffload (registry, delivery task,
    storage writer) pins a released lifecycle."""
    async with kvo.OffloadManager(small_config(), backend=backend, storage=storage) as mgr:
        # Released with nothing in flight, then dropped.
        lc = mgr.admit("gone", prompt=toks(0, 6))
        lc.finish()
        mgr.check_invariants()
        assert lc.state is RELEASED
        ref = weakref.ref(lc)
        del lc
        gc.collect()
        assert ref() is None

        # Dropped by the caller while a chunk is in flight: the manager keeps it...
        lc = mgr.admit("dropped", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        lc.finish()
        mgr.check_invariants()
        ref = weakref.ref(lc)
        del lc
        gc.collect()
        live = ref()
        assert live is not None and live.state is FINISHING and live.inflight == 1
        del live
        # ...and still releases it when the copy completes; then it is garbage.
        backend.complete_all()
        await mgr.settle()
        mgr.check_invariants()
        s = mgr.statistics()
        assert (s.live_lifecycles, s.released_completed) == (0, 2)
        assert (s.device_pages_used, s.host_pages_used) == (0, 0)
        assert s.pages_stored == (1 if storage else 0)
        gc.collect()
        assert ref() is None


# --- F3 ------------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["complete", "fail"])
async def test_f3_device_pages_held_until_released(backend: SimBackend, outcome: str) -> None:
    """F3: "device pages are held until RELEASED, whatever completes earlier": a chunk
    completing (or failing) mid-decode frees nothing, and no admit can get those pages."""
    async with kvo.OffloadManager(small_config(device_pages=6), backend=backend) as mgr:
        a = mgr.admit("a", prompt=toks(0, 4))
        a.extend(toks(4, 8))
        mgr.check_invariants()
        pages = list(a.device_pages)
        (t,) = backend.pending
        if outcome == "complete":
            backend.complete(t)
        else:
            backend.fail(t)
        await mgr.settle()
        mgr.check_invariants()
        assert a.state is PENDING and a.inflight == 0
        assert a.device_pages == pages
        assert allocated(mgr.device_pool, pages) == [True, True]
        # Every other page goes to b; nothing is left for c.
        b = mgr.admit("b", prompt=toks(0, 4 * mgr.device_pool.free_pages))
        mgr.check_invariants()
        assert set(b.device_pages).isdisjoint(pages) and len(b.device_pages) == 4
        before = mgr.statistics()
        with pytest.raises(kvo.PoolExhausted):
            mgr.admit("c", prompt=[1])
        unchanged(mgr, before)
        with pytest.raises(kvo.PoolExhausted):
            a.extend([8])  # a's next token needs a page; none is free, a keeps its own
        unchanged(mgr, before)
        assert a.device_pages == pages and a.committed == 8
        b.finish()
        a.finish()
        mgr.check_invariants()
        assert (a.state, b.state, mgr.statistics().device_pages_used) == (RELEASED, RELEASED, 0)


# --- F4 ------------------------------------------------------------------------------


async def test_f4_release_waits_for_last_copy_which_reads_submit_time_bytes(backend: SimBackend) -> None:
    """F4: "release waits for the last completion; a copy always reads the bytes that
    were there at submit": the finishing request's pages are not handed to a new one,
    and storage gets the finishing request's own KV."""
    storage = MemoryStorage()
    async with kvo.OffloadManager(
        small_config(stride=8, device_pages=4, host_pages=8), backend=backend, storage=storage
    ) as mgr:
        a = mgr.admit("a", prompt=toks(0, 4))
        a.extend(toks(4, 12))  # 12 tokens: a stride of 8 is due, pages 1..2 go out
        mgr.check_invariants()
        (t,) = backend.pending
        assert t.device_pages == a.device_pages[1:3]
        dev = mgr.device_pool.tensor
        for i, p in enumerate(a.device_pages):
            dev[p].fill_(i + 1)
        original = [page_bytes_of(dev, p) for p in t.device_pages]
        a.finish()
        mgr.check_invariants()
        assert a.state is FINISHING
        a_pages = list(a.device_pages)

        # One page is free; a request that needs two cannot get a's pages.
        before = mgr.statistics()
        with pytest.raises(kvo.PoolExhausted):
            mgr.admit("b", prompt=toks(0, 8))
        unchanged(mgr, before)
        b = mgr.admit("b", prompt=toks(0, 4))
        mgr.check_invariants()
        assert set(b.device_pages).isdisjoint(a_pages)
        dev[b.device_pages[0]].fill_(99)  # b's model writes its KV

        backend.complete(t)
        await released(a)
        await mgr.settle()
        mgr.check_invariants()
        assert a.state is RELEASED and a.outcome is kvo.Outcome.COMPLETED
        assert sorted(storage.pages) == sorted(t.keys)
        assert [storage.pages[k] for k in t.keys] == original
        assert allocated(mgr.device_pool, a_pages) == [False] * 3
        b.finish()
        mgr.check_invariants()


# --- F5 ------------------------------------------------------------------------------


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
async def test_f5_only_the_last_completion_releases(backend: SimBackend, order: tuple[int, int]) -> None:
    """F5: "only the last completion releases", in either completion order."""
    async with open_manager(backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        lc.extend(toks(8, 12))
        mgr.check_invariants()
        transfers = list(backend.pending)
        assert len(transfers) == 2 and lc.inflight == 2
        lc.finish()
        mgr.check_invariants()
        assert lc.state is FINISHING
        pages = list(lc.device_pages)

        backend.complete(transfers[order[0]])
        await mgr.settle()
        mgr.check_invariants()
        assert lc.state is FINISHING and lc.inflight == 1 and lc.outcome is None
        assert lc.device_pages == pages and all(allocated(mgr.device_pool, pages))

        backend.complete(transfers[order[1]])
        await released(lc)
        await mgr.settle()
        mgr.check_invariants()
        assert lc.state is RELEASED and lc.inflight == 0 and lc.outcome is kvo.Outcome.COMPLETED
        s = mgr.statistics()
        assert (s.chunks_copied, s.released_completed, s.device_pages_used) == (2, 1, 0)


# --- F6 ------------------------------------------------------------------------------


async def test_f6_retraction_waits_at_the_barrier_for_inflight_copies(backend: SimBackend) -> None:
    """F6: "there is one barrier every free path goes through; it waits for in-flight
    copies": ``retract()`` returns only after the copy completed, and the device pages
    are not freed before."""
    async with open_manager(backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        (t,) = backend.pending
        pages = list(lc.device_pages)
        returned: list[kvo.LifecycleState] = []

        async def retract() -> None:
            await lc.retract()
            returned.append(lc.state)

        with anyio.fail_after(HANG_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(retract)
                await spin()
                await mgr.settle()
                mgr.check_invariants()
                assert returned == []
                assert lc.state is FINISHING and lc.aborted and lc.inflight == 1
                assert all(allocated(mgr.device_pool, pages))
                backend.complete(t)
        mgr.check_invariants()
        assert returned == [RELEASED]
        assert lc.outcome is kvo.Outcome.ABORTED
        assert allocated(mgr.device_pool, pages) == [False, False]
        assert mgr.statistics().chunks_discarded == 1


async def test_f6_wait_quiescent_returns_only_after_the_copy(backend: SimBackend) -> None:
    """F6: the barrier itself: ``wait_quiescent()`` blocks while a copy reads the pages,
    returns once it completed, and frees nothing (the lifecycle is still live)."""
    async with open_manager(backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        await lc.wait_quiescent()  # nothing in flight: returns at once
        lc.extend(toks(4, 8))
        (t,) = backend.pending
        seen: list[tuple[int, kvo.LifecycleState]] = []

        async def barrier() -> None:
            await lc.wait_quiescent()
            seen.append((lc.inflight, lc.state))

        with anyio.fail_after(HANG_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(barrier)
                await spin()
                assert seen == []
                mgr.check_invariants()
                backend.complete(t)
        mgr.check_invariants()
        assert seen == [(0, PENDING)]
        assert all(allocated(mgr.device_pool, lc.device_pages))
        lc.finish()
        mgr.check_invariants()
        assert lc.state is RELEASED


# --- F7 ------------------------------------------------------------------------------


async def test_f7_abort_stops_new_copies_discards_inflight_frees_once(backend: SimBackend) -> None:
    """F7: "abort stops new copies, discards in-flight chunks on completion, frees
    everything once": no chunk after abort, nothing stored, RELEASED/ABORTED."""
    storage = MemoryStorage()
    async with kvo.OffloadManager(small_config(), backend=backend, storage=storage) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        (t,) = backend.pending
        lc.abort()
        mgr.check_invariants()
        assert lc.state is FINISHING and lc.aborted and lc.outcome is None
        before = mgr.statistics()
        with pytest.raises(kvo.InvalidTransition):
            lc.extend(toks(8, 12))
        with pytest.raises(kvo.InvalidTransition):
            lc.finish()
        unchanged(mgr, before)
        assert backend.pending == [t] and lc.committed == 8
        lc.abort()  # a second abort while waiting is harmless
        unchanged(mgr, before)

        backend.complete(t)
        await released(lc)
        await mgr.settle()
        mgr.check_invariants()
        assert lc.state is RELEASED and lc.outcome is kvo.Outcome.ABORTED
        s = mgr.statistics()
        assert (s.chunks_discarded, s.pages_discarded, s.chunks_copied, s.pages_stored) == (1, 1, 0, 0)
        assert (s.device_pages_used, s.host_pages_used, s.live_lifecycles, s.released_aborted) == (0, 0, 0, 1)
        assert storage.pages == {}
        before = mgr.statistics()
        assert lc.abort() is None  # after RELEASED a no-op (issue 19: a disconnect racing the end)
        unchanged(mgr, before)
        assert lc.outcome is kvo.Outcome.ABORTED


# --- F8 ------------------------------------------------------------------------------


async def test_f8_release_cannot_run_twice(backend: SimBackend) -> None:
    """F8: "release is a transition into a terminal state; a second one is impossible":
    a second finish, any event after RELEASED and a duplicate completion are refused
    and change nothing; no counter goes negative."""
    async with open_manager(backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 8))
        (t,) = backend.pending
        lc.finish()
        mgr.check_invariants()
        before = mgr.statistics()
        with pytest.raises(kvo.InvalidTransition):
            lc.finish()
        unchanged(mgr, before)
        assert lc.state is FINISHING

        backend.complete(t)
        await released(lc)
        await mgr.settle()
        mgr.check_invariants()
        before = mgr.statistics()
        assert before.released_completed == 1 and before.device_pages_used == 0
        for event in (lc.finish, lambda: lc.extend([1])):
            with pytest.raises(kvo.InvalidTransition):
                event()
            unchanged(mgr, before)
        lc.abort()  # abort after RELEASED: a no-op (issue 19), nothing released twice
        unchanged(mgr, before)
        assert lc.outcome is kvo.Outcome.COMPLETED
        # A duplicate completion of the same transfer is refused by the backend...
        with pytest.raises(kvo.BackendError):
            backend.complete(t)
        with pytest.raises(kvo.BackendError):
            backend.fail(t)
        # ...and by the manager, were a backend to deliver it anyway.
        with pytest.raises(kvo.KVOffloadError, match="completed twice"):
            mgr.core.complete([(t.id, None)])
        unchanged(mgr, before)
        assert all(v >= 0 for v in mgr.statistics().as_dict().values())

        # The direct path: finish with nothing in flight releases at once, and only once.
        lc2 = mgr.admit("r2", prompt=toks(0, 6))
        lc2.finish()
        mgr.check_invariants()
        before = mgr.statistics()
        assert lc2.state is RELEASED and before.released_completed == 2 and before.device_pages_used == 0
        with pytest.raises(kvo.InvalidTransition):
            lc2.finish()
        unchanged(mgr, before)


# --- F9 ------------------------------------------------------------------------------


async def test_f9_host_full_counted_drop_rate_limited_log_and_retry(backend: SimBackend) -> None:
    """F9: "a counted drop, a rate-limited log, and retry on the next stride": many
    drops in a short time make one warning; the next stride after host pages return
    submits every pending page."""
    clock = FakeClock()
    async with kvo.OffloadManager(small_config(stride=8, host_pages=8), backend=backend, clock=clock) as mgr:
        a = mgr.admit("a", prompt=toks(0, 4))
        a.extend(toks(4, 36))  # 32 tokens: 8 pages, the whole host pool
        mgr.check_invariants()
        (ta,) = backend.pending
        assert mgr.statistics().host_pages_used == 8
        bs = [mgr.admit(f"b{i}", prompt=toks(0, 4)) for i in range(5)]
        with capture_logs() as logs:
            for b in bs:
                b.extend(toks(4, 12))  # a stride is due: 2 pages, no room
                mgr.check_invariants()
                assert b.state is PENDING and b.inflight == 0 and b.submitted == 4
        s = mgr.statistics()
        assert (s.chunks_dropped, s.pages_dropped, s.chunks_submitted) == (5, 10, 1)
        drops = [e for e in logs if e["event"] == "chunk.dropped"]
        assert len(drops) == 1
        assert drops[0]["log_level"] == "warning" and drops[0]["drops_since_last_log"] == 1

        # Later (by the clock), the next drop logs again and says how many went unlogged.
        clock.advance(6)
        with capture_logs() as logs:
            bs[0].extend(toks(12, 20))
        mgr.check_invariants()
        drops = [e for e in logs if e["event"] == "chunk.dropped"]
        assert len(drops) == 1 and drops[0]["drops_since_last_log"] == 5
        assert mgr.statistics().chunks_dropped == 6

        # Host pages return; the next stride submits every pending page: none is lost.
        backend.complete(ta)
        await mgr.settle()
        mgr.check_invariants()
        b = bs[0]
        assert b.committed == 20 and b.submitted == 4
        b.extend(toks(20, 28))
        mgr.check_invariants()
        (tb,) = backend.pending
        assert tb.lifecycle_id == b.id and tb.first_token == 4 and tb.n_tokens == 24
        assert tb.keys == kvo.chain_keys(None, toks(0, 28), 4)[1:]
        assert b.submitted == 28 == b.committed and b.state is OFFLOADING
        await complete_everything(mgr, backend)


async def test_f9_wait_policy_defers_then_submits_or_expires_to_a_counted_drop(backend: SimBackend) -> None:
    """F9, ``on_host_full="wait"``: "a bounded wait, per config": a deferred chunk is
    submitted when host pages return; one that waits past host_wait_s is a counted drop."""
    clock = FakeClock()
    config = small_config(
        stride=8, host_pages=4, on_host_full="wait", host_wait_s=100, watchdog_interval_s=1000
    )
    async with kvo.OffloadManager(config, backend=backend, clock=clock) as mgr:
        a = mgr.admit("a", prompt=toks(0, 4))
        a.extend(toks(4, 20))
        (ta,) = backend.pending
        b = mgr.admit("b", prompt=toks(0, 4))
        b.extend(toks(4, 12))
        mgr.check_invariants()
        assert b.deferred and b.state is PENDING and b.inflight == 0 and not b.quiescent
        s = mgr.statistics()
        assert (s.chunks_deferred, s.chunks_dropped, s.chunks_submitted) == (1, 0, 1)
        clock.advance(50)
        mgr.tick()
        mgr.check_invariants()
        assert b.deferred
        b.extend(toks(12, 16))  # no second attempt while one waits
        assert mgr.statistics().chunks_deferred == 1 and backend.pending == [ta]

        backend.complete(ta)  # host pages return: the deferred chunk goes out
        await mgr.settle()
        mgr.check_invariants()
        (tb,) = backend.pending
        assert tb.lifecycle_id == b.id and not b.deferred and b.state is OFFLOADING
        assert tb.keys == kvo.chain_keys(None, toks(0, 12), 4)[1:]
        assert b.submitted == 12 and b.committed == 16

        # Fill the host pool again; c's chunk waits, c finishes, and the wait expires.
        a2 = mgr.admit("a2", prompt=toks(0, 4))
        a2.extend(toks(4, 12))
        mgr.check_invariants()
        assert mgr.host_pool.free_pages == 0
        c = mgr.admit("c", prompt=toks(0, 4))
        c.extend(toks(4, 12))
        assert c.deferred
        c.finish()
        mgr.check_invariants()
        assert c.state is FINISHING  # a waiting chunk keeps it busy
        clock.advance(100.5)
        mgr.tick()
        mgr.check_invariants()
        assert c.state is RELEASED and c.outcome is kvo.Outcome.COMPLETED
        s = mgr.statistics()
        assert (s.chunks_dropped, s.pages_dropped, s.chunks_deferred) == (1, 2, 2)
        await complete_everything(mgr, backend)


# --- F10 -----------------------------------------------------------------------------


class RefusingBackend(SimBackend):
    """A SimBackend whose ``submit`` raises while ``refuse`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = False

    def submit(self, transfer: Transfer) -> None:
        if self.refuse:
            raise kvo.BackendError("simulated: copy engine refused the submission")
        super().submit(transfer)


async def test_f10_state_changes_only_after_host_pages_are_acquired(backend: SimBackend) -> None:
    """F10: "state changes only after the resource is acquired": with the host pool
    full, the lifecycle stays PENDING with nothing in flight."""
    async with kvo.OffloadManager(small_config(host_pages=1), backend=backend) as mgr:
        a = mgr.admit("a", prompt=toks(0, 4))
        a.extend(toks(4, 8))
        b = mgr.admit("b", prompt=toks(0, 4))
        b.extend(toks(4, 8))
        mgr.check_invariants()
        assert b.state is PENDING and b.inflight == 0 and b.submitted == 4
        assert [t.lifecycle_id for t in backend.pending] == [a.id]
        s = mgr.statistics()
        assert (s.offloading, s.pending, s.chunks_inflight, s.chunks_dropped) == (1, 1, 1, 1)
        await complete_everything(mgr, backend)


async def test_f10_backend_submit_failure_returns_host_pages_and_changes_no_state() -> None:
    """F10: a submission the backend refuses leaves the host pages returned and the
    state, tokens, device pages and counters as they were (extend and finish are all or
    nothing); the chunk goes out once the backend accepts."""
    backend = RefusingBackend()
    config = kvo.OffloadConfig(page_size=4, stride=8, device_pages=16, host_pages=8)
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        backend.refuse = True
        before = mgr.statistics()
        with pytest.raises(kvo.BackendError):
            lc.extend(toks(4, 12))  # a stride is due; the backend refuses the chunk
        unchanged(mgr, before)
        assert lc.state is PENDING and lc.inflight == 0 and (lc.committed, lc.submitted) == (4, 4)
        assert backend.pending == [] and mgr.host_pool.used == 0

        backend.refuse = False
        lc.extend(toks(4, 8))  # one whole page, no stride due
        backend.refuse = True
        before = mgr.statistics()
        with pytest.raises(kvo.BackendError):
            lc.finish()  # the tail flush is refused
        unchanged(mgr, before)
        assert lc.state is PENDING and lc.submitted == 4

        backend.refuse = False
        lc.finish()
        mgr.check_invariants()
        (t,) = backend.pending
        assert lc.state is FINISHING and t.keys == kvo.chain_keys(None, toks(0, 8), 4)[1:]
        backend.complete(t)
        await released(lc)
        mgr.check_invariants()


# --- F11 -----------------------------------------------------------------------------


async def test_f11_keys_fixed_at_submit_survive_out_of_order_completion(backend: SimBackend) -> None:
    """F11: "keys are fixed at submit time and travel with the chunk": two chunks that
    complete out of order carry the in-order chain, rooted at the prompt, identical to
    SGLang's get_hash_str chain."""
    storage = MemoryStorage()
    tokens = [7, 2**32 - 1, 0, 256, *(1000 * i + 13 for i in range(20))]  # 24 tokens
    async with kvo.OffloadManager(small_config(stride=8), backend=backend, storage=storage) as mgr:
        lc = mgr.admit("r", prompt=tokens[:8])  # two prompt pages seed the chain
        lc.extend(tokens[8:16])
        lc.extend(tokens[16:24])
        mgr.check_invariants()
        t1, t2 = backend.pending
        expected = kvo.chain_keys(None, tokens, 4)
        assert expected == sglang_chain(tokens, 4)
        assert (t1.keys, t2.keys) == (expected[2:4], expected[4:6])
        at_submit = (list(t1.keys), list(t2.keys))

        backend.complete(t2)
        await mgr.settle()
        mgr.check_invariants()
        # F33 (issue 19): a request's chunks are written in chain order, so t2's pages
        # wait for t1's copy - the store never holds a page whose predecessor is missing
        # (this test used to see t2's pages stored first).
        assert sorted(storage.pages) == []
        backend.complete(t1)
        await mgr.settle()
        mgr.check_invariants()
        assert (t1.keys, t2.keys) == at_submit
        assert sorted(storage.pages) == sorted(expected[2:6])
        assert lc.chain_key == expected[5]
        lc.finish()
        mgr.check_invariants()


# --- F12 -----------------------------------------------------------------------------


async def test_f12_page_aligned_remainder_is_flushed_at_finish(backend: SimBackend) -> None:
    """F12: "the page-aligned remainder is flushed at finish": fewer than a stride of
    new tokens but two whole pages are sent; the partial last page is not."""
    storage = MemoryStorage()
    async with kvo.OffloadManager(small_config(stride=16), backend=backend, storage=storage) as mgr:
        lc = mgr.admit("r", prompt=toks(0, 4))
        lc.extend(toks(4, 15))  # 11 new tokens: 2 whole pages + 3 tokens; no stride due
        mgr.check_invariants()
        assert backend.pending == [] and lc.state is PENDING
        lc.finish()
        mgr.check_invariants()
        (t,) = backend.pending
        assert lc.state is FINISHING
        assert (t.first_token, t.n_tokens) == (4, 8)
        assert t.device_pages == lc.device_pages[1:3]
        assert t.keys == kvo.chain_keys(None, toks(0, 12), 4)[1:]
        assert (lc.submitted, lc.committed) == (12, 15)
        backend.complete(t)
        await released(lc)
        await mgr.settle()
        mgr.check_invariants()
        assert sorted(storage.pages) == sorted(t.keys)
        assert mgr.statistics().pages_stored == 2


@pytest.mark.parametrize("policy", ["drop", "wait"])
async def test_f12_remainder_larger_than_one_chunk_is_not_lost_silently(
    backend: SimBackend, policy: str
) -> None:
    """F12 with F9: a remainder bigger than one chunk (the host pool is 2 pages, 3 whole
    pages wait after drops or a deferral) is flushed chunk by chunk; a page that finds
    the host full is a counted drop ("drop") or waits and goes out later ("wait"),
    never silently skipped."""
    clock = FakeClock()
    config = small_config(host_pages=2, on_host_full=policy, host_wait_s=100, watchdog_interval_s=1000)
    async with kvo.OffloadManager(config, backend=backend, clock=clock) as mgr:
        a = mgr.admit("a", prompt=toks(0, 4))
        a.extend(toks(4, 12))  # 2 pages: the whole host pool
        (ta,) = backend.pending
        b = mgr.admit("b", prompt=toks(0, 4))
        for start in (4, 8, 12):
            b.extend(toks(start, start + 4))
            mgr.check_invariants()
        assert (b.committed, b.submitted, b.state) == (16, 4, PENDING)
        if policy == "wait":
            b.finish()  # deferred: nothing can go out yet
            mgr.check_invariants()
            assert b.state is FINISHING and b.deferred
        dropped = mgr.statistics().pages_dropped
        backend.complete(ta)
        await mgr.settle()
        mgr.check_invariants()
        if policy == "drop":
            b.finish()
            mgr.check_invariants()
        (t1,) = backend.pending
        assert (t1.lifecycle_id, t1.first_token, t1.n_tokens) == (b.id, 4, 8)
        if policy == "drop":  # the third page found the host full: counted, not silent
            assert mgr.statistics().pages_dropped == dropped + 1
            assert b.submitted == 12
        else:  # the third page waits for host pages and goes out after t1
            assert mgr.statistics().pages_dropped == dropped == 0 and b.deferred
            backend.complete(t1)
            await mgr.settle()
            mgr.check_invariants()
            (t2,) = backend.pending
            assert (t2.lifecycle_id, t2.first_token, t2.n_tokens) == (b.id, 12, 4)
            assert t2.keys == kvo.chain_keys(None, toks(0, 16), 4)[3:]
            assert b.submitted == 16
        await complete_everything(mgr, backend)
        assert b.state is RELEASED


# --- F14 -----------------------------------------------------------------------------


async def test_f14_every_inflight_transfer_is_tracked_until_it_completes(backend: SimBackend) -> None:
    """F14: "every in-flight transfer is tracked until it completes": one request id
    with three stores in flight, the latest completed first (the one a per-id table
    would have kept). The earlier two are still counted and still hold their device
    pages: the request stays FINISHING, a new request with the same id gets other
    pages, and each store gets the bytes that were there at submit."""
    storage = MemoryStorage()
    config = small_config(device_pages=8, host_pages=8)
    async with kvo.OffloadManager(config, backend=backend, storage=storage) as mgr:
        a = mgr.admit("r", prompt=toks(0, 4))
        for start in (4, 8, 12):
            a.extend(toks(start, start + 4))  # a stride each: one store per extend
            mgr.check_invariants()
        t1, t2, t3 = backend.pending
        assert [t.lifecycle_id for t in (t1, t2, t3)] == [a.id, a.id, a.id] and a.inflight == 3
        dev = mgr.device_pool.tensor
        for i, p in enumerate(a.device_pages):
            dev[p].fill_(i + 1)  # a's model wrote its KV
        original = {
            k: page_bytes_of(dev, p)
            for t in (t1, t2, t3)
            for k, p in zip(t.keys, t.device_pages, strict=True)
        }
        a.finish()
        mgr.check_invariants()
        pages = list(a.device_pages)

        backend.complete(t3)  # only the latest store has completed
        await mgr.settle()
        mgr.check_invariants()
        assert a.state is FINISHING and a.inflight == 2 and a.outcome is None
        assert a.device_pages == pages and all(allocated(mgr.device_pool, pages))
        s = mgr.statistics()
        assert (s.chunks_inflight, s.pages_inflight, s.device_pages_used) == (2, 2, 4)

        # The same id again: it gets the four other pages; none of a's is free.
        b = mgr.admit("r", prompt=toks(100, 116))
        assert set(b.device_pages).isdisjoint(pages) and mgr.lifecycles("r") == [a, b]
        before = mgr.statistics()
        with pytest.raises(kvo.PoolExhausted):
            mgr.admit("c", prompt=toks(0, 4))
        unchanged(mgr, before)
        for p in b.device_pages:
            dev[p].fill_(99)  # b's model writes its KV

        backend.complete(t1)
        await mgr.settle()
        mgr.check_invariants()
        assert a.state is FINISHING and a.inflight == 1 and all(allocated(mgr.device_pool, pages))
        backend.complete(t2)
        await released(a)
        await mgr.settle()
        mgr.check_invariants()
        assert a.outcome is kvo.Outcome.COMPLETED and allocated(mgr.device_pool, pages) == [False] * 4
        assert {k: storage.pages[k] for k in original} == original
        assert mgr.statistics().pages_stored == 3
        b.finish()
        mgr.check_invariants()
        assert b.state is RELEASED


# --- F16 -----------------------------------------------------------------------------


async def test_f16_leaving_the_manager_drains_inflight_copies(backend: SimBackend) -> None:
    """F16: "leaving the manager drains in-flight copies first": a copy completed by
    another task after the body ended is awaited by ``__aexit__``."""
    order: list[str] = []
    async with anyio.create_task_group() as tg:
        async with kvo.OffloadManager(small_config(), backend=backend) as mgr:
            lc = mgr.admit("r", prompt=toks(0, 4))
            lc.extend(toks(4, 8))
            lc.finish()
            (t,) = backend.pending

            async def complete_later() -> None:
                await spin(50)
                order.append(f"completed in {lc.state.name}")
                backend.complete(t)

            tg.start_soon(complete_later)
            order.append("body done")
        order.append("exited")
    assert order == ["body done", "completed in FINISHING", "exited"]
    mgr.check_invariants()
    assert lc.state is RELEASED and mgr.statistics().device_pages_used == 0


async def test_f16_drain_timeout_raises_and_frees_nothing_under_the_copy(backend: SimBackend) -> None:
    """F16: a copy that never completes: leaving raises DrainTimeout after
    drain_timeout_s, and that copy's device and host pages were not freed. The
    lifecycle, still live at close, was aborted there: FINISHING until a copy that
    will never be delivered, its pages held (docs/integration.md, "Closing")."""
    mgr = kvo.OffloadManager(small_config(drain_timeout_s=0.01), backend=backend)
    with pytest.raises(kvo.DrainTimeout):
        async with mgr:
            lc = mgr.admit("r", prompt=toks(0, 4))
            lc.extend(toks(4, 8))
            (t,) = backend.pending
    mgr.check_invariants()
    assert lc.state is FINISHING and lc.aborted and lc.inflight == 1
    assert all(allocated(mgr.device_pool, t.device_pages)) and all(allocated(mgr.host_pool, t.host_pages))
    s = mgr.statistics()
    assert (s.chunks_inflight, s.device_pages_used, s.host_pages_used) == (1, 2, 1)
