"""No holes in a chain (FAILURES F33), and a loss visible per lifecycle.

A stored chain is contiguous from its first page: a page is reachable by ``lookup``
only when every page before it is stored, so a page stored after a hole is dead
weight. When a chunk's copy fails, or its storage write fails, the lifecycle stops
offloading at that chunk: chunks after it that are already in flight are discarded
when they complete (host pages returned, nothing written), chunks already copied are
not written (the writer skips them), and no new chunk is submitted for it. Every whole
page a request should have stored and did not is counted on the lifecycle itself
(``lc.pages_lost``, readable after release) and in ``statistics().pages_lost``.

Every schedule here is driven (sim backend, an injected clock): nothing depends on how
fast the machine runs (F39).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from support import broken_parts

import kvoffload as kvo
from kvoffload.abc import Transfer, WriteChain, WriteJob
from kvoffload.core.chunks import Chunks
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.writes import Writes
from kvoffload.errors import StorageError
from kvoffload.pools import HostPool
from kvoffload.storage.memory import MemoryStorage
from kvoffload.storage.writer import WritePolicy, WriterState, write_job
from kvoffload.testing import CoreLifecycleMachine, SimBackend, manager_in_task

ONE_TRY = WritePolicy(attempts=1, backoff_s=0)


class Clock:
    """A virtual clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FailingStore(MemoryStorage):
    """A memory store that fails the next ``fail_next`` puts, and records every put."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next = 0
        self.puts: list[list[str]] = []

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise StorageError("scripted: the store refused the write")
        self.puts.append(list(keys))
        await super().put(keys, pages)


def _two_chunks(mgr: kvo.OffloadManager | kvo.SyncOffloadManager) -> Lifecycle:
    """admit [0..3], extend [4..8], extend [9..12]: two one-page chunks go out, in that
    order (the measured F33 schedule's start); returns the lifecycle."""
    lc = mgr.admit("r", list(range(4)))
    lc.extend(list(range(4, 9)))
    lc.extend(list(range(9, 13)))
    return lc


def _config(**kw: object) -> kvo.OffloadConfig:
    base: dict[str, object] = {
        "page_size": 4,
        "stride": 4,
        "device_pages": 64,
        "host_pages": 64,
        "drain_timeout_s": 5,
    }
    base.update(kw)
    return kvo.OffloadConfig(**base)  # type: ignore[arg-type]


# --- F33: a failed copy -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_failed_copy_stops_offload_at_the_hole_and_nothing_after_it_is_stored() -> None:
    """F33, the measured schedule: page_size 4, stride 4, memory store. admit [0..3],
    extend [4..8], extend [9..12]; the first copy fails, the second completes, extend
    [13..16], all complete, finish. No page after the hole is stored, no chunk is
    submitted after it, and the three pages the request should have stored are lost on
    the lifecycle and in the statistics."""
    backend = SimBackend()
    store = FailingStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = _two_chunks(mgr)
        first, second = backend.pending
        assert (first.first_token, second.first_token) == (4, 8)
        backend.fail(first, RuntimeError("copy failed"))
        backend.complete(second)
        await mgr.settle()
        lc.extend(list(range(13, 17)))
        assert not backend.pending, "a chunk was submitted after the hole (F33)"
        lc.finish()
        backend.complete_all()
        await mgr.settle()
        await lc.wait_released()
        s = mgr.statistics()
        assert store.puts == [], "pages were stored after the hole (F33)"
        assert lc.outcome is kvo.Outcome.FAILED
        assert lc.pages_lost == 3  # pages 1, 2, 3 (tokens 4..15); page 0 was stored at admit
        assert s.pages_lost == 3
        assert s.pages_stored == 0 and s.chunks_discarded == 1 and s.host_pages_used == 0
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_every_stored_page_stays_reachable_by_lookup_after_a_failed_copy() -> None:
    """F33 with the prompt offloaded: the prompt page is stored, the next page's copy
    fails, a later one completes. What is stored is exactly the prefix lookup reaches."""
    backend = SimBackend()
    store = FailingStore()
    config = _config(offload_prompt=True)
    async with manager_in_task(config, backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        tokens = list(range(17))
        lc = mgr.admit("r", tokens[:4])
        lc.extend(tokens[4:9])
        lc.extend(tokens[9:13])
        prompt, hole, after = backend.pending
        backend.complete(prompt)
        backend.complete(after)  # completes before the earlier chunk fails
        backend.fail(hole, RuntimeError("copy failed"))
        await mgr.settle()
        lc.extend(tokens[13:17])
        lc.finish()
        backend.complete_all()
        await mgr.settle()
        await lc.wait_released()
        assert store.puts == [prompt.keys]
        assert await mgr.lookup(tokens) == 4
        assert lc.pages_lost == 3
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_a_chunk_copied_before_an_earlier_chunk_fails_is_never_written() -> None:
    """Copies of one lifecycle may complete in any order (sim): a later chunk that
    completes first waits, so its pages are not written ahead of the earlier ones; when
    the earlier one fails it is discarded, its host pages returned (F33)."""
    backend = SimBackend()
    store = FailingStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = mgr.admit("r", list(range(4)))
        lc.extend(list(range(4, 12)))  # two strides: one chunk of two pages
        lc.extend(list(range(12, 16)))
        a, b = backend.pending
        backend.complete(b)
        await mgr.settle()
        assert store.puts == [], "a later chunk was written before an earlier one was copied"
        assert mgr.statistics().host_pages_used == 3
        backend.fail(a, RuntimeError("copy failed"))
        await mgr.settle()
        s = mgr.statistics()
        assert store.puts == [] and s.host_pages_used == 0
        lc.finish()
        await lc.wait_released()
        assert lc.pages_lost == 3
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_chunks_of_one_lifecycle_are_written_in_chain_order_whatever_order_they_copy() -> None:
    """Without a failure, a later chunk that copies first is written after the earlier
    one, so the store never holds a page whose predecessor is missing."""
    backend = SimBackend()
    store = FailingStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = _two_chunks(mgr)
        a, b = backend.pending
        backend.complete(b)
        await mgr.settle()
        backend.complete(a)
        await mgr.settle()
        assert store.puts == [a.keys, b.keys]
        lc.finish()
        await lc.wait_released()
        assert lc.pages_lost == 0
        mgr.check_invariants()


# --- F33: a failed storage write ----------------------------------------------------------


@pytest.mark.asyncio
async def test_a_failed_write_is_a_hole_the_later_chunks_are_not_written_after() -> None:
    """F33 in the store: chunk k's write fails while chunk k+1's would succeed. The
    writer skips k+1 (its chain broke: reported not stored, host pages returned), the
    lifecycle stops offloading at k, and the loss is counted on it."""
    backend = SimBackend()
    store = FailingStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = _two_chunks(mgr)
        store.fail_next = 1
        backend.complete_all()  # one batch: both writes are queued, in chain order
        await mgr.settle()
        s = mgr.statistics()
        assert store.puts == [], "a page was stored after a failed write (F33)"
        assert (s.pages_store_failed, s.pages_store_skipped, s.host_pages_used) == (1, 1, 0)
        lc.extend(list(range(13, 17)))
        assert not backend.pending, "a chunk was submitted after the store lost an earlier one"
        lc.finish()
        await lc.wait_released()
        assert lc.outcome is kvo.Outcome.COMPLETED  # the request itself completed
        assert lc.pages_lost == 3
        assert mgr.statistics().pages_lost == 3
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_a_write_that_fails_after_release_is_counted_on_the_lifecycle() -> None:
    """The write-behind may finish after the lifecycle was released: a write failure
    then still shows in ``lc.pages_lost`` (and the statistics) once the write is done."""
    backend = SimBackend()
    store = FailingStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = mgr.admit("r", list(range(4)))
        lc.extend(list(range(4, 9)))
        lc.finish()
        store.fail_next = 1
        backend.complete_all()
        await lc.wait_released()
        await mgr.settle()
        assert lc.outcome is kvo.Outcome.COMPLETED
        assert lc.pages_lost == 1
        assert mgr.statistics().pages_lost == 1
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_the_writer_skips_a_job_whose_chain_broke_and_marks_the_chain_on_failure() -> None:
    """write_job: a failure marks the job's chain broken; a later job of that chain is
    not written at all (0 attempts, a StorageError that says why)."""
    pool = HostPool.new(4, (4,), "int32", zero=True)
    store = FailingStore()
    chain = WriteChain()
    first = WriteJob(1, ["a"], [0], 1, "r", chain=chain)
    second = WriteJob(2, ["b"], [1], 1, "r", chain=chain)
    other = WriteJob(3, ["c"], [2], 2, "s", chain=WriteChain())
    state = WriterState()
    store.fail_next = 1
    _, stored, attempts, _ = await write_job(store, pool, first, ONE_TRY, state)
    assert (stored, attempts, chain.broken) == (False, 1, True)
    _, stored, attempts, error = await write_job(store, pool, second, ONE_TRY, state)
    assert (stored, attempts) == (False, 0)
    assert isinstance(error, StorageError) and "F33" in str(error)
    _, stored, attempts, _ = await write_job(store, pool, other, ONE_TRY, state)
    assert (stored, attempts) == (True, 1)
    assert store.puts == [["c"]]


# --- the time-dependent path: a deferred chunk expires, a later stride goes out -----------------


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["wait", "drop"])
@pytest.mark.parametrize("batched", [False, True])
async def test_after_a_deferred_chunk_expires_the_next_chunk_starts_at_the_first_unsent_page(
    policy: str, batched: bool
) -> None:
    """The time-dependent hole (F33, F9): a chunk finds the host pool full, waits
    (``"wait"``) until ``host_wait_s`` passes on the injected clock and is dropped (or is
    dropped at once, ``"drop"``); the next stride is then committed. The next chunk
    starts at the first page never sent - no page is skipped - and the request loses
    nothing once the pool has room. Also through extend_batch's rows."""
    clock = Clock()
    backend = SimBackend()
    config = _config(host_pages=1, on_host_full=policy, host_wait_s=1.0, stuck_after_s=None)
    async with manager_in_task(config, backend=backend, clock=clock) as mgr:
        if batched:
            mgr.core.step.rows_min = 1  # extend_batch keeps its rows from one lifecycle up
        hog = mgr.admit("hog", [0, 1, 2, 3])
        hog.extend([4, 5, 6, 7, 8])  # holds the only host page
        lc = mgr.admit("r", [0, 1, 2, 3])
        tokens = list(range(4, 20))

        def step(toks: list[int]) -> None:
            for t in toks:
                if batched:
                    mgr.extend_batch([lc], [t])
                else:
                    lc.extend([t])

        step(tokens[:5])  # page 1 (tokens 4..7) is due: the host pool is full
        assert lc.deferred == (policy == "wait") and lc.inflight == 0
        clock.now += 2.0
        mgr.tick()  # "wait": the deferral expired, the chunk is dropped
        assert not lc.deferred and lc.inflight == 0
        backend.complete(backend.pending[0])  # the hog's copy: the page is free again
        await mgr.settle()
        step(tokens[5:9])  # the next stride is due
        (t,) = [t for t in backend.pending if t.lifecycle_id == lc.id]
        assert t.first_token == 4, f"the next chunk starts at token {t.first_token}: page 1 skipped"
        backend.complete(t)
        await mgr.settle()
        lc.finish()  # the tail flush: tokens 8..11, the one whole page left
        hog.finish()
        backend.complete_all()
        await lc.wait_released()
        assert lc.pages_lost == 0 and lc.outcome is kvo.Outcome.COMPLETED
        mgr.check_invariants()


# --- the loss, per lifecycle --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_expired_wait_is_visible_on_the_lifecycle_it_cost() -> None:
    """``on_host_full="wait"`` expires after ``host_wait_s``: the request is released
    COMPLETED (it completed), and ``lc.pages_lost`` says how many of its whole pages
    were never offloaded; another request that lost nothing says 0."""
    clock = Clock()
    backend = SimBackend()
    config = _config(host_pages=1, on_host_full="wait", host_wait_s=1.0)
    async with manager_in_task(config, backend=backend, clock=clock) as mgr:
        hog = mgr.admit("hog", [0, 1, 2, 3])
        hog.extend([4, 5, 6, 7, 8])
        lc = mgr.admit("r", [0, 1, 2, 3])
        lc.extend([4, 5, 6, 7, 8, 9, 10, 11])  # two pages due; the pool is full
        lc.finish()  # the tail waits for host pages
        assert lc.deferred and lc.state is kvo.LifecycleState.FINISHING
        clock.now += 2.0
        mgr.tick()
        await lc.wait_released()
        assert lc.outcome is kvo.Outcome.COMPLETED
        assert lc.pages_lost == 2
        backend.complete_all()
        hog.finish()
        await hog.wait_released()
        assert hog.pages_lost == 0
        assert mgr.statistics().pages_lost == 2
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_an_aborted_lifecycle_loses_nothing() -> None:
    """An aborted request wanted nothing more stored: its pages_lost stays 0, even when
    one of its copies failed first."""
    backend = SimBackend()
    async with manager_in_task(_config(), backend=backend) as mgr:
        lc = mgr.admit("r", list(range(4)))
        lc.extend(list(range(4, 13)))
        backend.fail(backend.pending[0], RuntimeError("copy failed"))
        await mgr.settle()
        lc.abort()
        await lc.wait_released()
        assert lc.outcome is kvo.Outcome.ABORTED and lc.pages_lost == 0
        assert mgr.statistics().pages_lost == 0


@pytest.mark.asyncio
async def test_pages_lost_is_zero_while_live_and_for_a_request_that_stored_everything() -> None:
    """``lc.pages_lost`` is 0 on a live lifecycle and after a clean run."""
    backend = SimBackend()
    store = FailingStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = mgr.admit("r", list(range(4)))
        lc.extend(list(range(4, 14)))  # one chunk of two pages; tokens 12, 13 are no whole page
        assert lc.pages_lost == 0
        lc.finish()
        backend.complete_all()
        await lc.wait_released()
        await mgr.settle()
        assert lc.pages_lost == 0 and mgr.statistics().pages_lost == 0
        assert len(store.puts) == 1 and len(store.puts[0]) == 2


# --- the property suite's no-holes check can fail -------------------------------------------------


class _KeepsOffloading(Chunks):
    """v2's F33: a failed copy does not stop the lifecycle's offload."""

    def hole(self, lc: Lifecycle, first: int) -> bool:
        return False


class _WritesInCompletionOrder(Writes):
    """v2's write-behind: a chunk's write goes out when its copy completes, ahead of an
    earlier chunk still in flight."""

    def queue(self, t: Transfer, lc: Lifecycle) -> None:
        job = WriteJob(t.id, t.keys, t.host_pages, lc.id, lc.rid, first_token=t.first_token)
        self.jobs[t.id] = job
        self.out.append(job)


def _machine() -> CoreLifecycleMachine:
    m = CoreLifecycleMachine()
    m.open(
        page_size=4,
        stride_pages=1,
        device_pages=24,
        spare_host_pages=4,
        on_host_full="drop",
        offload_prompt=False,
        storage=True,
        first_prompt=[0, 1, 2, 3],
    )
    m.outside_rules_hold()
    return m


def _after_a_failed_copy(m: CoreLifecycleMachine) -> None:
    m.extend(0, [1, 1, 1, 1, 1])
    m.extend(0, [2, 2, 2, 2])
    m.outside_rules_hold()
    m.fail(0)
    m.outside_rules_hold()
    m.extend(0, [3, 3, 3, 3])
    m.outside_rules_hold()


def _a_later_chunk_copied_first(m: CoreLifecycleMachine) -> None:
    m.extend(0, [1, 1, 1, 1, 1])
    m.extend(0, [2, 2, 2, 2])
    m.outside_rules_hold()
    m.complete(1)
    m.outside_rules_hold()
    while m.writes:
        m.write(0, True)
        m.outside_rules_hold()


@pytest.mark.parametrize(
    ("mutant", "schedule", "says"),
    [
        (_KeepsOffloading, _after_a_failed_copy, "submitted after"),
        (_WritesInCompletionOrder, _a_later_chunk_copied_first, "a hole in the store"),
    ],
)
def test_the_property_suite_catches_a_chain_with_a_hole(
    mutant: type, schedule: Callable[[CoreLifecycleMachine], None], says: str
) -> None:
    """The observer's no-holes check (run after every step on every layer) fails on a
    core that keeps offloading after a failed copy, or writes a later chunk ahead of an
    earlier one; the same schedules pass on the real core."""
    schedule(_machine())
    with pytest.raises(AssertionError, match=says), broken_parts(mutant):
        schedule(_machine())


def _settle_sync(mgr: kvo.SyncOffloadManager) -> None:
    """poll() until every signalled completion was delivered and every write finished
    (the writer is a real thread: waited for with a bound, never a sleep)."""
    import time

    deadline = time.monotonic() + 10.0
    mgr.poll()
    while mgr.ready() or mgr.writes_pending:
        assert time.monotonic() < deadline, "the sync manager did not settle in 10 s"
        mgr.poll()


def test_the_sync_manager_stops_offload_at_a_failed_copy_and_at_a_failed_write() -> None:
    """F33 through the sync driver: the measured schedule (a failed copy) and a failed
    write each leave nothing stored after the hole and the loss on the lifecycle."""
    backend = SimBackend()
    store = FailingStore()
    with kvo.SyncOffloadManager(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = mgr.admit("copy", list(range(4)))
        lc.extend(list(range(4, 9)))
        lc.extend(list(range(9, 13)))
        first, second = backend.pending
        backend.fail(first, RuntimeError("copy failed"))
        backend.complete(second)
        _settle_sync(mgr)
        lc.extend(list(range(13, 17)))
        assert not backend.pending
        lc.finish()
        _settle_sync(mgr)
        assert lc.released and lc.pages_lost == 3 and store.puts == []

        other = mgr.admit("write", list(range(4)))
        other.extend(list(range(4, 9)))
        other.extend(list(range(9, 13)))
        store.fail_next = 1
        backend.complete_all()
        _settle_sync(mgr)
        other.extend(list(range(13, 17)))
        assert not backend.pending
        other.finish()
        _settle_sync(mgr)
        assert other.released and other.pages_lost == 3 and store.puts == []
        s = mgr.statistics()
        assert (s.pages_store_failed, s.pages_store_skipped, s.pages_lost) == (1, 1, 6)
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_an_abort_never_writes_a_chunk_that_waited_for_an_earlier_one() -> None:
    """A chunk copied ahead of an earlier one waits (held); when the request is aborted
    the earlier copy is discarded, so the waiting one is never written either: its host
    pages return, counted as skipped."""
    backend = SimBackend()
    store = FailingStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = _two_chunks(mgr)
        a, b = backend.pending
        backend.complete(b)
        await mgr.settle()
        lc.abort()
        backend.complete(a)
        await lc.wait_released()
        await mgr.settle()
        s = mgr.statistics()
        assert store.puts == [] and s.host_pages_used == 0 and s.pages_store_skipped == 1
        assert lc.outcome is kvo.Outcome.ABORTED and lc.pages_lost == 0
        mgr.check_invariants()


def test_a_write_waiting_for_an_earlier_copy_is_not_pending_on_the_sync_manager() -> None:
    """A later chunk copied first waits for the earlier copy (F33). Its write is not
    ``writes_pending`` meanwhile - nothing the writer could finish - so an engine that
    polls until no write is pending does not spin while a copy is still in flight; once
    the earlier copy completes both are written, in chain order."""
    backend = SimBackend()
    store = FailingStore()
    with kvo.SyncOffloadManager(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = _two_chunks(mgr)
        a, b = backend.pending
        backend.complete(b)
        _settle_sync(mgr)
        assert mgr.writes_pending == 0 and store.puts == []
        assert mgr.statistics().host_pages_used == 2  # a's (in flight) and b's (waiting)
        backend.complete(a)
        _settle_sync(mgr)
        assert store.puts == [a.keys, b.keys]
        lc.finish()
        _settle_sync(mgr)
        assert lc.released and lc.pages_lost == 0
        mgr.check_invariants()
