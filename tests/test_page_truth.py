"""Per-page truth of batched storage writes (FAILURES F34).

A store that stores part of a batch says which pages it stored
(:class:`~kvoffload.PartialWriteError`, one flag per page). A page counts as stored -
``statistics().pages_stored``, ``lookup``, the lifecycle's ``pages_lost`` - only when
its store confirmed that page: never the whole batch because part of it succeeded
(SGLang #38316, LMCache #4991). The writer retries only the pages not confirmed; what
is still not confirmed after the policy's attempts is dropped, counted per page, and
the request's chain breaks at the first of them (F33): the confirmed pages before it
are stored and reachable, the confirmed pages after it are in the store but no lookup
reaches them (``pages_store_unreachable``), the later chunks are skipped.

Every schedule here is driven (sim backend, a scripted store): nothing depends on how
fast the machine runs (F39).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from support import broken_parts

import kvoffload as kvo
from kvoffload.abc import Transfer, WriteChain, WriteJob
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.writes import Writes
from kvoffload.errors import PartialWriteError, StorageError
from kvoffload.pools import HostPool
from kvoffload.storage.memory import MemoryStorage
from kvoffload.storage.writer import WritePolicy, WriterState, write_job
from kvoffload.testing import CoreLifecycleMachine, FlakyStorage, SimBackend, manager_in_task

RETRY = WritePolicy(attempts=3, backoff_s=0)
ONE_TRY = WritePolicy(attempts=1, backoff_s=0)


class PartialStore(MemoryStorage):
    """The memory store behind a fault wrapper: ``refuse[key] = n`` refuses that key's
    page the next ``n`` times it is written (``-1``: every time), while the rest of the
    batch is stored; a batch with a refused page raises :class:`PartialWriteError` with
    one flag per page. Records the keys of every put."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse: dict[str, int] = {}
        self.puts: list[list[str]] = []

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        self.puts.append(list(keys))
        ok: list[bool] = []
        for key, page in zip(keys, pages, strict=True):
            left = self.refuse.get(key, 0)
            if left:
                self.refuse[key] = left - 1 if left > 0 else left
                ok.append(False)
            else:
                self.pages[key] = bytes(page)
                ok.append(True)
        if not all(ok):
            raise PartialWriteError(
                f"scripted: {ok.count(False)} of {len(ok)} page(s) refused",
                ok,
                [None if s else "scripted refusal" for s in ok],
            )


def _config(**kw: object) -> kvo.OffloadConfig:
    base: dict[str, object] = {
        "page_size": 4,
        "stride": 4,
        "device_pages": 64,
        "host_pages": 64,
        "drain_timeout_s": 5,
        "offload_prompt": True,
    }
    base.update(kw)
    return kvo.OffloadConfig(**base)  # type: ignore[arg-type]


TOKENS = list(range(24))


def _three_page_chunk(
    mgr: kvo.OffloadManager | kvo.SyncOffloadManager, backend: SimBackend
) -> tuple[Lifecycle, Transfer, Transfer, Transfer]:
    """admit [0..4) (the prompt page, chunk 0), extend [4..16) (one chunk of three pages:
    pages 1, 2, 3), extend [16..20) (page 4). Returns (lc, the transfers in order)."""
    lc = mgr.admit("r", TOKENS[:4])
    lc.extend(TOKENS[4:16])
    lc.extend(TOKENS[16:20])
    prompt, big, last = backend.pending
    assert (prompt.pages, big.pages, last.pages) == (1, 3, 1)
    return lc, prompt, big, last


def _check_partial(s: kvo.Statistics) -> None:
    """The outcome of a three-page chunk whose middle page the store never confirmed."""
    assert s.pages_stored == 2, "only pages the store confirmed, before the hole, count as stored"
    assert s.pages_store_failed == 1 and s.pages_store_unconfirmed == 1
    assert s.pages_store_unreachable == 1, "page 3 is in the store, after the hole"
    assert s.chunks_store_partial == 1
    assert s.pages_store_skipped == 1, "the chunk after the hole is not written (F33)"
    assert s.pages_store_retried == 2, "a retry re-sends only the page not confirmed"
    assert s.host_pages_used == 0


# --- the writer ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_writer_retries_only_the_pages_the_store_did_not_confirm() -> None:
    """F34: a batch the store stored in part is retried with only its unconfirmed
    pages; once they are confirmed the job is stored, and ``job.resent`` counts the
    pages re-sent (not the whole chunk per retry)."""
    pool = HostPool.new(4, (4,), "int32", zero=True)
    store = PartialStore()
    store.refuse = {"b": 2}
    job = WriteJob(1, ["a", "b", "c"], [0, 1, 2], 1, "r", chain=WriteChain())
    _, stored, attempts, error = await write_job(store, pool, job, RETRY, WriterState())
    assert (stored, attempts, error) == (True, 3, None)
    assert store.puts == [["a", "b", "c"], ["b"], ["b"]]
    assert job.resent == 2
    assert sorted(store.pages) == ["a", "b", "c"]


@pytest.mark.asyncio
async def test_the_writer_reports_per_page_what_is_still_unconfirmed_after_its_attempts() -> None:
    """F34: after the policy's attempts the job is not stored; its error is a
    PartialWriteError with one flag per page of the job (what the store confirmed over
    every attempt), the chain is broken (F33) and the store taken as down."""
    pool = HostPool.new(4, (4,), "int32", zero=True)
    store = PartialStore()
    store.refuse = {"b": -1}
    chain = WriteChain()
    state = WriterState()
    job = WriteJob(1, ["a", "b", "c"], [0, 1, 2], 1, "r", chain=chain)
    _, stored, attempts, error = await write_job(store, pool, job, RETRY, state)
    assert (stored, attempts) == (False, 3)
    assert isinstance(error, PartialWriteError)
    assert error.stored == (True, False, True)
    assert error.errors[1] is not None and error.errors[0] is None and error.errors[2] is None
    assert store.puts == [["a", "b", "c"], ["b"], ["b"]] and job.resent == 2
    assert chain.broken and state.down


@pytest.mark.asyncio
async def test_a_store_error_that_names_the_wrong_number_of_pages_confirms_none() -> None:
    """A PartialWriteError whose flags do not match the batch (a store's bug) confirms
    nothing: the whole batch is retried and, failing, reported with no page stored."""

    class Wrong(MemoryStorage):
        async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
            raise PartialWriteError("one flag for a batch of two", [True])

    pool = HostPool.new(4, (4,), "int32", zero=True)
    job = WriteJob(1, ["a", "b"], [0, 1], 1, "r")
    _, stored, attempts, error = await write_job(Wrong(), pool, job, RETRY, WriterState())
    assert (stored, attempts) == (False, 3)
    assert not isinstance(error, PartialWriteError) or not any(error.stored)
    assert job.resent == 4  # every retry re-sent both pages


# --- the asyncio and sync drivers: statistics, lookup, the lifecycle's view ----------------------


@pytest.mark.asyncio
async def test_a_partial_batch_counts_only_confirmed_pages_and_the_chain_breaks_at_the_hole() -> None:
    """F34 through the asyncio driver: chunk [4..16) is three pages; the store never
    confirms the middle one. Statistics count the page before it stored, the one after
    it stored-but-unreachable, the middle one failed; lookup finds exactly the prefix
    before the hole; the next chunk is not written; the lifecycle lost what follows."""
    backend = SimBackend()
    store = PartialStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=RETRY) as mgr:
        lc, _, big, last = _three_page_chunk(mgr, backend)
        hole = big.keys[1]
        store.refuse[hole] = -1
        backend.complete_all()
        await mgr.settle()
        s = mgr.statistics()
        _check_partial(s)
        assert s.pages_stored + s.pages_store_failed + s.pages_store_unreachable + s.pages_store_skipped == 5
        assert hole not in store.pages and big.keys[2] in store.pages and last.keys[0] not in store.pages
        assert store.puts[-2:] == [[hole], [hole]], "a retry re-sends only the refused page"
        assert await mgr.lookup(TOKENS) == 8, "lookup reaches the confirmed prefix, not past the hole"
        lc.extend(TOKENS[20:24])
        assert not backend.pending, "a chunk was submitted after the hole (F33)"
        lc.finish()
        await lc.wait_released()
        assert lc.pages_lost == 4  # pages 2..5 (tokens 8..24): the chain ends at the hole
        assert mgr.statistics().pages_lost == 4
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_a_partial_batch_whose_retry_is_confirmed_is_stored_whole() -> None:
    """F34: the store refuses one page once; the retry re-sends that page alone, the
    chunk is stored whole, nothing is lost and no partial outcome is counted."""
    backend = SimBackend()
    store = PartialStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=RETRY) as mgr:
        lc, _, big, _ = _three_page_chunk(mgr, backend)
        store.refuse[big.keys[1]] = 1
        backend.complete_all()
        await mgr.settle()
        s = mgr.statistics()
        assert (s.pages_stored, s.pages_store_failed, s.pages_store_retried) == (5, 0, 1)
        assert (s.chunks_store_partial, s.pages_store_unreachable, s.pages_store_unconfirmed) == (0, 0, 0)
        assert await mgr.lookup(TOKENS[:20]) == 20
        lc.finish()
        await lc.wait_released()
        assert lc.pages_lost == 0
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_a_partial_batch_after_release_moves_the_loss_to_the_hole() -> None:
    """F34 + F33: the request is released before its last chunk's write finishes; the
    store confirms the first of its two pages only. The loss counted on the lifecycle
    is the one unconfirmed page, not the whole chunk."""
    backend = SimBackend()
    store = PartialStore()
    async with manager_in_task(_config(), backend=backend, storage=store, write_policy=ONE_TRY) as mgr:
        lc = mgr.admit("r", TOKENS[:4])
        lc.extend(TOKENS[4:12])
        lc.finish()
        _, two = backend.pending
        store.refuse[two.keys[1]] = -1
        backend.complete_all()
        await lc.wait_released()
        await mgr.settle()
        s = mgr.statistics()
        assert (s.pages_stored, s.pages_store_failed, s.pages_store_unreachable) == (2, 1, 0)
        assert lc.pages_lost == 1 and s.pages_lost == 1
        assert await mgr.lookup(TOKENS[:12]) == 8
        mgr.check_invariants()


def _settle_sync(mgr: kvo.SyncOffloadManager) -> None:
    """poll() until every signalled completion was delivered and every write finished
    (the writer is a real thread: waited for with a bound, never a sleep)."""
    deadline = time.monotonic() + 10.0
    mgr.poll()
    while mgr.ready() or mgr.writes_pending:
        assert time.monotonic() < deadline, "the sync manager did not settle in 10 s"
        mgr.poll()


def test_the_sync_manager_counts_only_confirmed_pages_of_a_partial_batch() -> None:
    """F34 through the sync driver (its writer thread): the same schedule as the
    asyncio test, the same statistics and lookup."""
    backend = SimBackend()
    store = PartialStore()
    with kvo.SyncOffloadManager(_config(), backend=backend, storage=store, write_policy=RETRY) as mgr:
        lc, _, big, last = _three_page_chunk(mgr, backend)
        store.refuse[big.keys[1]] = -1
        backend.complete_all()
        _settle_sync(mgr)
        _check_partial(mgr.statistics())
        assert last.keys[0] not in store.pages
        assert mgr.lookup(TOKENS) == 8
        lc.finish()
        _settle_sync(mgr)
        assert lc.released and lc.pages_lost == 3  # pages 2..4 (tokens 8..20)
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_a_store_that_fails_without_saying_which_pages_confirms_none() -> None:
    """A plain StorageError says nothing per page: no page of the batch counts as
    stored (some may be in the store; the retry of the same keys is safe)."""

    class Down(MemoryStorage):
        async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
            raise StorageError("scripted: down")

    backend = SimBackend()
    async with manager_in_task(_config(), backend=backend, storage=Down(), write_policy=ONE_TRY) as mgr:
        _three_page_chunk(mgr, backend)
        backend.complete_all()
        await mgr.settle()
        s = mgr.statistics()
        assert (s.pages_stored, s.pages_store_failed, s.pages_store_skipped) == (0, 1, 4)
        assert (s.chunks_store_partial, s.pages_store_unreachable) == (0, 0)
        mgr.check_invariants()


# --- the property suite's per-page check can fail ------------------------------------------------


class _WholeBatchStored(Writes):
    """SGLang #38316 / LMCache #4991: a batch counted stored because part of it was."""

    def done(
        self, job_id: int, stored: bool, attempts: int, error: BaseException | None
    ) -> tuple[Lifecycle | None, int]:
        if isinstance(error, PartialWriteError) and any(error.stored):
            stored, error = True, None
        return super().done(job_id, stored, attempts, error)


class _NoneStored(Writes):
    """The old outcome: a batch stored in part counted as not stored at all."""

    def done(
        self, job_id: int, stored: bool, attempts: int, error: BaseException | None
    ) -> tuple[Lifecycle | None, int]:
        if isinstance(error, PartialWriteError):
            error = StorageError(str(error))
        return super().done(job_id, stored, attempts, error)


def _partial_schedule(m: CoreLifecycleMachine) -> None:
    """One chunk of two pages whose second page the store does not confirm."""
    m.extend(0, [1, 1, 1, 1, 2, 2, 2, 2])  # one stride of two pages
    m.outside_rules_hold()
    m.complete(0)
    m.outside_rules_hold()
    m.write(0, False, cut=2)  # page 0 confirmed, page 1 not
    m.outside_rules_hold()


def _core_machine() -> CoreLifecycleMachine:
    m = CoreLifecycleMachine()
    m.open(
        page_size=4,
        stride_pages=2,
        device_pages=24,
        spare_host_pages=4,
        on_host_full="drop",
        offload_prompt=False,
        storage=True,
        first_prompt=[0, 1, 2, 3],
    )
    m.outside_rules_hold()
    return m


@pytest.mark.parametrize("mutant", [_WholeBatchStored, _NoneStored])
def test_the_property_suite_catches_a_core_that_counts_a_partial_batch_wrong(mutant: type) -> None:
    """The observer's per-page check (run after every step on every layer): once every
    write finished, ``pages_stored`` is the pages the store confirmed before a hole and
    ``pages_store_unreachable`` those after. It fails on a core that counts a partial
    batch whole (SGLang #38316) or not at all; the same schedule passes on the real core."""
    _partial_schedule(_core_machine())
    with pytest.raises(AssertionError, match="the store confirmed"), broken_parts(mutant):
        _partial_schedule(_core_machine())


def test_the_property_suite_store_fails_part_of_a_batch_on_the_drivers() -> None:
    """FlakyStorage (the driver machines' store) with ``partial`` set stores every page
    of a batch but one and says so page by page (PartialWriteError)."""
    import asyncio

    store = FlakyStorage()
    store.partial = 1
    with pytest.raises(PartialWriteError) as caught:
        asyncio.run(store.put(["a", "b", "c"], [b"1", b"2", b"3"]))
    assert caught.value.stored == (True, False, True) and sorted(store.pages) == ["a", "c"]
    asyncio.run(store.put(["d"], [b"4"]))  # a one-page batch is taken whole
    store.down = True
    with pytest.raises(StorageError) as down:
        asyncio.run(store.put(["e", "f"], [b"5", b"6"]))
    assert not isinstance(down.value, PartialWriteError)
