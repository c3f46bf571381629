"""kvoffload's drop-in for SGLang's DecodeKVCacheOffloadManager, driven only through
the scheduler's calls, on engines behind one interface (sglang_engines.py, its KINDS):
the fakes of sglang_fakes.py (fast), and SGLang 0.5.23's REAL classes (sglang_real.py:
its Req, ReqToTokenPool, MHA / MLA pools on the CPU, the paged allocator and the
page-size-1 one, UnifiedRadixCache and RadixCache, the decode radix cache off and on
with a matched prefix, the published runtime context, its retraction and resume), the
runs that decide. The real runs skip with the reason where sglang does not import, and
fail under ``KVOFFLOAD_REQUIRE_SGLANG=1``.

The behaviours SGLang's own tests pin down, then where kvoffload differs on purpose.
Every run checks what the storage tier holds against the engine's KV bytes and
independently computed chain keys, and that every page the engine handed out came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import random
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sglang_cpu
import torch
from sglang_engines import KINDS, FakeEngine, make
from sglang_fakes import Allocator, collect
from sglang_fakes import ServerArgs as FakeServerArgs
from support import HANG_S

import kvoffload as kvo
from kvoffload.integrations.sglang import DecodeKVCacheOffloadManager, engine_kv_tensors
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend

#: An engine of either kind (sglang_engines.FakeEngine or RealEngine): one interface.
Engine = Any
Req = Any

PS = 4


def ref_keys(tokens: list[int], page_size: int, seed: str | None = None) -> list[str]:
    """SGLang's page keys, written out with hashlib (not kvoffload's key code):
    sha256(prior key's bytes + each token as uint32 little-endian), hex; the chain
    starts from the namespace seed's bytes, or nothing."""
    keys, prior = [], bytes.fromhex(seed) if seed else b""
    for p in range(len(tokens) // page_size):
        h = hashlib.sha256(prior)
        for t in tokens[p * page_size : (p + 1) * page_size]:
            h.update(struct.pack("<I", t))
        prior = h.digest()
        keys.append(h.hexdigest())
    return keys


def stored(storage: MemoryStorage, keys: list[str]) -> list[bytes | None]:
    return asyncio.run(storage.get(keys))


def writes_done(mgr: DecodeKVCacheOffloadManager) -> None:
    """Scheduler iterations until the storage writes started so far are collected (they
    run on the writer's thread): what an idle scheduler loop does. Fails after HANG_S
    (a hang, never a slow machine: F39)."""
    deadline = time.monotonic() + HANG_S
    mgr.check_offload_progress()
    while mgr.statistics().pages_in_write:
        assert time.monotonic() < deadline, f"storage writes never finished: {mgr.statistics()}"
        time.sleep(0.001)
        mgr.check_offload_progress()


def check_stored(
    mgr: DecodeKVCacheOffloadManager,
    engine: Engine,
    storage: MemoryStorage,
    req: Req,
    from_page: int,
    to_page: int,
) -> None:
    """Pages ``from_page..to_page`` of ``req`` are in storage under SGLang's keys, with
    the engine's bytes (once the writes started so far are done)."""
    writes_done(mgr)
    tokens = [*req.origin_input_ids, *req.output_ids[:-1]]
    keys = page_keys(engine, tokens, req.extra_key, req.cache_salt)[from_page:to_page]
    got = stored(storage, keys)
    for i, (key, page) in enumerate(zip(keys, got, strict=True)):
        p = from_page + i
        assert page is not None, f"{req.rid}: page {p} ({key[:12]}) missing from storage"
        assert page == engine.expected(getattr(req, "uid", 0), tokens, p), f"{req.rid}: page {p} bytes"


def check_all_stored(
    mgr: DecodeKVCacheOffloadManager, engine: Engine, storage: MemoryStorage, req: Req
) -> None:
    """Every whole page of ``req`` past its prompt's whole pages (those are the prefill
    side's) is stored with the engine's bytes."""
    ps = engine.page_size
    n = len(req.origin_input_ids) + len(req.output_ids) - 1
    check_stored(mgr, engine, storage, req, len(req.origin_input_ids) // ps, n // ps)


def page_keys(engine: Engine, tokens: list[int], extra_key: str | None, cache_salt: str | None) -> list[str]:
    """The keys SGLang stores a request's pages under: :func:`ref_keys` from the
    namespace seed; on a real engine also SGLang's own chain (its manager's
    ``_compute_prefix_hash``: ``storage_namespace_seed``, then the cache controller's
    ``get_hash_str`` page by page), which must be the same."""
    keys = ref_keys(tokens, engine.page_size, kvo.namespace_seed(extra_key, cache_salt))
    if engine.kind != "fake":
        assert engine.sglang_keys(tokens, extra_key, cache_salt) == keys, "SGLang's keys differ"
    return keys


def check_nothing_left_and_close(engine: Engine, mgr: DecodeKVCacheOffloadManager) -> None:
    """Every page and row the engine handed out came back; kvoffload holds nothing. Then
    SGLang's shutdown (release_host_resources). Storage writes run on the writer's
    thread: the scheduler's idle iterations collect them (a bounded wait)."""
    writes_done(mgr)
    stats = mgr.statistics()
    assert stats.live_lifecycles == 0, stats
    assert stats.host_pages_used == 0, stats
    assert len(mgr.ongoing_offload) == 0
    assert not mgr.has_inflight_device_transfer()
    assert engine.held() == 0, f"{engine.held()} slots never freed"
    mgr.manager.check_invariants()
    mgr.release_host_resources()


def settle(mgr: DecodeKVCacheOffloadManager) -> None:
    """Scheduler iterations with nothing to decode until the copies and storage writes
    are done (what an idle SGLang scheduler's loop does before it may sleep)."""
    mgr.drain_before_retraction()
    while mgr.ongoing_offload:
        mgr.check_offload_progress()
        mgr.manager.wait_progress(0.05)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """The engine this run of a test drives (sglang_engines.KINDS); a real one is
    skipped with the reason where SGLang's classes do not import here (a failure under
    ``KVOFFLOAD_REQUIRE_SGLANG=1``)."""
    if request.param != "fake":
        sglang_cpu.require()
    return str(request.param)


@pytest.fixture
def page_size(request: pytest.FixtureRequest) -> int:
    """The engine's page size: 4, or what a test parametrizes (``indirect``): 1 is
    SGLang's ``TokenToKVPoolAllocator`` (a page is a slot), more its paged allocator."""
    return int(getattr(request, "param", PS))


#: Run a test with both of SGLang's allocators: the paged one and page size 1.
both_allocators = pytest.mark.parametrize("page_size", [PS, 1], indirect=True, ids=["paged", "page_size=1"])


@pytest.fixture
def make_engine(kind: str, page_size: int) -> Iterator[Callable[..., Engine]]:
    """Engines of this run's kind (fake or real), as many as the test needs
    (``make_engine(mla=True, n_pages=64, ...)``); a real one's published runtime
    context is restored when the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **kw: make(stack, kind, **{"page_size": page_size, **kw})


@pytest.fixture
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine()


Opened = tuple[DecodeKVCacheOffloadManager, MemoryStorage]


def open_mgr(engine: Engine, backend: Any = None, **kw: Any) -> Opened:
    storage = kw.pop("storage", None) or MemoryStorage()
    kw.setdefault("host_pages", 64)
    kw.setdefault("drain_timeout_s", 5.0)
    mgr = engine.manager(storage=storage, backend=backend or SimBackend(), **kw)
    return mgr, storage


# --- the behaviours SGLang's tests pin down -----------------------------------------------


@both_allocators
def test_in_flight_is_tracked_until_the_ack(engine: Engine) -> None:
    sim = SimBackend()
    mgr, _ = open_mgr(engine, sim)
    req = engine.new_req("a", list(range(10)), max_new=50)
    engine.prefill(req)
    while not sim.pending:
        engine.iteration()
    assert mgr.has_inflight_device_transfer()
    # The copies in flight (an arrival's first chunk goes out at the next poll, with the
    # chunk of that iteration's own call: one or two).
    assert len(mgr.ongoing_offload) == len(sim.pending) >= 1
    for _ in range(3):  # no ack yet: still in flight, however often the scheduler checks
        mgr.check_offload_progress()
        assert mgr.has_inflight_device_transfer()
    for job in list(sim.pending):
        sim.complete(job)
    mgr.check_offload_progress()
    assert not mgr.has_inflight_device_transfer()
    engine.drop(req)
    del req
    collect()
    check_nothing_left_and_close(engine, mgr)


@both_allocators
def test_release_waits_for_the_last_ack_and_happens_once(engine: Engine) -> None:
    sim = SimBackend()
    mgr, storage = open_mgr(engine, sim)
    req = engine.new_req("a", list(range(6)), max_new=13)
    engine.prefill(req)
    done: list[Req] = []
    while not done:
        done = engine.iteration()
    # At finish: copies still read the row; the scheduler was told to leave the KV alone.
    assert len(sim.pending) >= 2
    assert engine.released == [] and req.kv.req_pool_idx is not None
    while len(sim.pending) > 1:
        sim.complete(sim.pending[0])
        mgr.check_offload_progress()
        assert engine.released == [], "released before the last ack"
    sim.complete(sim.pending[0])
    mgr.check_offload_progress()
    assert engine.released == ["a"]
    assert engine.releases(req) == 1
    # A second finalize (or check) does not release again.
    mgr.finalize_release_on_finish(req)
    mgr.check_offload_progress()
    assert engine.released == ["a"] and engine.releases(req) == 1
    check_all_stored(mgr, engine, storage, req)
    check_nothing_left_and_close(engine, mgr)


@both_allocators
def test_a_reused_rid_shares_nothing(engine: Engine) -> None:
    sim = SimBackend()
    mgr, storage = open_mgr(engine, sim)
    first = engine.new_req("same", list(range(8)), max_new=9)
    engine.prefill(first)
    while not engine.iteration():
        pass
    assert sim.pending, "the first request's copies are still in flight"
    first_copies = list(sim.pending)
    second = engine.new_req("same", [50 + i for i in range(8)], max_new=30)  # same rid, other tokens
    engine.prefill(second)
    for _ in range(10):
        engine.iteration()
    # The first one's late completions reach only the first one.
    for t in first_copies:
        sim.complete(t)
    mgr.check_offload_progress()
    assert engine.released == ["same"] and engine.releases(first) == 1 and engine.releases(second) == 0
    assert second.kv.req_pool_idx is not None and not second.finished()
    while engine.running:
        sim.complete_all()
        engine.iteration()
    sim.complete_all()
    mgr.check_offload_progress()
    assert engine.released == ["same", "same"] and engine.releases(second) == 1
    check_all_stored(mgr, engine, storage, first)
    check_all_stored(mgr, engine, storage, second)
    check_nothing_left_and_close(engine, mgr)


@both_allocators
def test_a_req_dropped_without_finish_leaves_nothing(engine: Engine) -> None:
    """The engine drops a Req (frees its row and pages) without finishing it: the next
    check_offload_progress sees the row gone and ends its lifecycle; once the Req is
    collected nothing of it is left, and nothing is released through SGLang's path."""
    sim = SimBackend()
    mgr, _ = open_mgr(engine, sim)
    req = engine.new_req("gone", list(range(9)), max_new=100)
    engine.prefill(req)
    while not sim.pending:
        engine.iteration()
    copies = list(sim.pending)
    # The engine drops the Req (after the copies, as F19 requires of any free).
    for t in copies:
        sim.complete(t)
    engine.drop(req)
    del req
    collect()
    mgr.check_offload_progress()
    assert mgr._entries == {}
    assert engine.released == [], "a dropped Req is the engine's to release, not kvoffload's"
    check_nothing_left_and_close(engine, mgr)


def test_a_req_dropped_mid_copy_is_held_until_its_row_is_taken_back(engine: Engine) -> None:
    """Dropped while its copy runs, its row kept: the collector ends nothing (F31) - the
    lifecycle and its Req are held, the copy ends and its host pages come back; when the
    engine frees the row, the next check_offload_progress ends the lifecycle and then
    nothing of the Req is left."""
    sim = SimBackend()
    mgr, _ = open_mgr(engine, sim)
    req = engine.new_req("gone", list(range(9)), max_new=100)
    engine.prefill(req)
    while not sim.pending:
        engine.iteration()
    engine.running.remove(req)  # the engine forgets it but keeps the row until the copy ends
    kv = req.kv
    del req
    collect()
    mgr.check_offload_progress()
    assert len(mgr._entries) == 1 and mgr.statistics().live_lifecycles == 1
    assert mgr.statistics().host_pages_used > 0  # still under the running copy
    sim.complete_all()
    writes_done(mgr)
    assert mgr.statistics().host_pages_used == 0 and mgr.statistics().live_lifecycles == 1
    engine.take_back(kv)
    mgr.check_offload_progress()
    assert mgr.statistics().live_lifecycles == 0 and mgr._entries == {}
    check_nothing_left_and_close(engine, mgr)


def test_drain_before_retraction_waits_for_every_copy(engine: Engine) -> None:
    mgr, _ = open_mgr(engine, "cpu")
    reqs = [engine.new_req(f"r{i}", list(range(5 + i)), max_new=400) for i in range(3)]
    for r in reqs:
        engine.prefill(r)
    for _ in range(12):
        engine.iteration()
    mgr.drain_before_retraction()
    assert not mgr.has_inflight_device_transfer()
    assert mgr.manager.copies_in_flight == 0


def test_drain_before_retraction_raises_when_a_copy_cannot_drain(engine: Engine) -> None:
    sim = SimBackend()  # nothing completes unless the test says so: a wedged copy
    mgr, _ = open_mgr(engine, sim, drain_timeout_s=0.2)
    req = engine.new_req("stuck", list(range(9)), max_new=100)
    engine.prefill(req)
    while not sim.pending:
        engine.iteration()
    with pytest.raises(kvo.DrainTimeout, match="in flight"):
        mgr.drain_before_retraction()
    assert mgr.has_inflight_device_transfer()  # nothing was freed under the copy
    sim.complete_all()
    mgr.drain_before_retraction()
    engine.drop(req)
    mgr.release_host_resources()


@both_allocators
def test_host_pool_full_then_retry(engine: Engine) -> None:
    """SGLang returns False and tries again at the next step; kvoffload returns False and
    defers the chunk until host pages return (on_host_full="wait"), then sends the same
    pages: none lost, the chain unbroken, the release after the last copy."""
    sim = SimBackend()
    mgr, storage = open_mgr(engine, sim, host_pages=1)
    req = engine.new_req("a", list(range(4)), max_new=40)
    engine.prefill(req)
    while len(sim.pending) < 1:
        engine.iteration()
    for _ in range(engine.page_size):  # a second chunk is due: the host pool (1 page) is full
        engine.iteration()
    stats = mgr.statistics()
    assert stats.chunks_deferred >= 1 and len(sim.pending) == 1
    while engine.running:
        sim.complete_all()
        engine.iteration()
    while sim.pending or mgr.ongoing_offload:
        sim.complete_all()
        mgr.check_offload_progress()
    check_all_stored(mgr, engine, storage, req)
    assert mgr.statistics().pages_lost == 0
    check_nothing_left_and_close(engine, mgr)


@both_allocators
@pytest.mark.parametrize("same_row", [False, True], ids=["new-row", "same-row"])
def test_resume_after_retraction_continues_the_chain(engine: Engine, same_row: bool) -> None:
    """Retracted (drain first), resumed on a new row - or the same row index with other
    pages, which only the pages tell apart - the request's chain goes on where it
    stopped: every page stored once, with the KV the engine recomputed (or restored)."""
    mgr, storage = open_mgr(engine, "cpu")
    req = engine.new_req("a", list(range(7)), max_new=60, extra_key="lora-1")
    other = engine.new_req("b", list(range(30, 41)), max_new=25)
    engine.prefill(req)
    engine.prefill(other)
    for _ in range(20):
        engine.iteration()
    sent_before = mgr.statistics().pages_submitted
    row = req.kv.req_pool_idx
    engine.retract(req)  # drain, then the engine frees the row and pages
    if same_row:  # resumed before kvoffload is called again: the same row, other pages
        engine.next_row(row)
        engine.reverse_free_pages()
    else:
        for _ in range(6):  # the other request runs on (it may reuse the freed pages)
            engine.iteration()
        # SGLang's pool hands the row freed last out first (here a's, or b's once its
        # release came): another free row is next, so a resumes on a new row.
        engine.next_row(next(r for r in engine.req_to_token_pool.free_slots if r != row))
    engine.resume(req)  # new pages, the KV recomputed (fake) or restored (SGLang's backup)
    assert (req.kv.req_pool_idx == row) is same_row
    while engine.running:
        engine.iteration()
    settle(mgr)
    check_all_stored(mgr, engine, storage, req)
    # Nothing stored before the retraction was copied again.
    ps, n = engine.page_size, len(req.origin_input_ids) + len(req.output_ids) - 1
    pages_of_req = n // ps - len(req.origin_input_ids) // ps
    other_pages = (len(other.origin_input_ids) + len(other.output_ids) - 1) // ps - len(
        other.origin_input_ids
    ) // ps
    assert mgr.statistics().pages_submitted == pages_of_req + other_pages
    assert sent_before > 0
    assert engine.released == ["b", "a"]
    check_nothing_left_and_close(engine, mgr)


def test_a_request_never_offloaded_is_released_at_once(engine: Engine) -> None:
    mgr, _ = open_mgr(engine, SimBackend())
    # Finished at its first token: no output KV committed, nothing to copy.
    req = engine.new_req("short", list(range(6)), max_new=1)
    engine.prefill(req)
    engine.finish_now(req)
    assert mgr.offload_kv_cache(req) is False
    mgr.finalize_release_on_finish(req)
    assert engine.released == ["short"] and engine.releases(req) == 1
    engine.running.remove(req)
    # Finished before a whole page beyond the prompt: admitted and released in one call.
    req2 = engine.new_req("tiny", list(range(8)), max_new=3)
    engine.prefill(req2)
    engine.iteration()
    engine.iteration()
    assert req2.finished() and engine.released == ["short", "tiny"]
    engine.running.clear()
    check_nothing_left_and_close(engine, mgr)


def test_idle_and_in_flight_gates(engine: Engine) -> None:
    """``len(ongoing_offload)`` is what SGLang's idle check adds: non-zero while a copy
    or a storage write is pending; ``has_inflight_device_transfer`` only while a copy
    reads device rows (the gate for moving rows)."""
    sim = SimBackend()

    class SlowStore(MemoryStorage):
        def __init__(self) -> None:
            super().__init__()
            self.release = asyncio.Event()

        async def put_pages(self, keys: Any, host_pool: Any, host_pages: Any) -> None:
            while not self.gate:
                await asyncio.sleep(0.005)
            await super().put_pages(keys, host_pool, host_pages)

        gate = False

    store = SlowStore()
    mgr, _ = open_mgr(engine, sim, storage=store)
    assert len(mgr.ongoing_offload) == 0 and not mgr.has_inflight_device_transfer()
    req = engine.new_req("a", list(range(4)), max_new=100)
    engine.prefill(req)
    while not sim.pending:
        engine.iteration()
    assert len(mgr.ongoing_offload) == 1 and mgr.has_inflight_device_transfer()
    sim.complete_all()
    mgr.check_offload_progress()  # copied: the write to storage is still pending
    assert not mgr.has_inflight_device_transfer()
    assert len(mgr.ongoing_offload) == 1, "a pending storage write must keep the scheduler awake"
    store.gate = True
    for _ in range(400):
        mgr.check_offload_progress()
        if not mgr.ongoing_offload:
            break
        mgr.manager.wait_progress(0.01)
    assert len(mgr.ongoing_offload) == 0
    engine.drop(req)
    mgr.release_host_resources()


# --- state changes that every TP rank makes in the same call (F31, F32) -----------------


def _a_dropped_req_in_a_cycle(engine: Engine, collect_it: bool) -> list[tuple[str, Any]]:
    """One scheduler's run, recorded after every call that reaches kvoffload: a Req the
    engine drops mid-copy, caught in a reference cycle, is collected right away
    (``collect_it``) or not at all; later the engine takes its row back. What a TP rank
    sees: the same calls on every rank, the collector running whenever it runs."""
    sim = SimBackend()
    # No storage: host pages come back when a copy is delivered, not when a writer thread
    # is done, so what each call sees depends on the calls alone.
    mgr = engine.manager(storage=None, backend=sim, host_pages=64, drain_timeout_s=5.0)
    seen: list[tuple[str, Any]] = []

    def record(label: str) -> None:
        s = mgr.statistics()
        counts = (s.live_lifecycles, s.finishing, s.released_aborted, s.device_pages_used, s.host_pages_used)
        seen.append((label, (*counts, s.chunks_inflight, s.chunks_discarded, list(engine.released))))

    a = engine.new_req("a", list(range(9)), max_new=100)
    b = engine.new_req("b", list(range(5)), max_new=24)
    engine.prefill(a)
    engine.prefill(b)
    for i in range(6):
        engine.iteration()
        record(f"step {i}")
    assert any(t.tag.ref() is a for t in sim.pending), "a's copy is in flight"
    a.cycle = a  # type: ignore[attr-defined]  # only the collector can free it
    kv = a.kv
    engine.running.remove(a)  # the engine forgets it, and keeps its row for now
    del a
    if collect_it:
        collect()
    try:
        for i in range(6):
            sim.complete_all()
            engine.iteration()
            record(f"after the drop, step {i}")
        # The engine takes the row back (its pages and the row itself).
        engine.take_back(kv)
        mgr.check_offload_progress()
        record("row taken back")
        while engine.running or sim.pending:
            sim.complete_all()
            engine.iteration()
            record("to the end")
    except kvo.KVOffloadError as exc:  # what the scheduler would have died of
        seen.append(("raised", f"{type(exc).__name__}: {exc}"))
        mgr.release_host_resources()
        return seen
    check_nothing_left_and_close(engine, mgr)
    return seen


def test_f31_the_collector_running_at_another_moment_changes_nothing_a_rank_sees(
    make_engine: Callable[..., Engine],
) -> None:
    """F31: a Req caught in a reference cycle is collected at a different moment on each
    TP rank. Every state change must come from a call, the same on every rank, never
    from the collector: the run where the cycle is collected at once and the run where
    it never is see the same lifecycles, pages, copies and releases after every call.
    The dropped Req's lifecycle ends in the call that sees its row taken back."""
    gc.disable()
    try:
        collected = _a_dropped_req_in_a_cycle(make_engine(), True)
        kept = _a_dropped_req_in_a_cycle(make_engine(), False)
    finally:
        gc.enable()
    for mine, theirs in zip(collected, kept, strict=True):
        assert mine == theirs, f"collected: {mine}, never collected: {theirs}"
    by_label = dict(kept)
    live_before = by_label["after the drop, step 5"][0]
    live_after = by_label["row taken back"][0]
    assert live_after == live_before - 1, (live_before, live_after)


class FinishesWhenWaitedOn(SimBackend):
    """A copy engine whose pending copies all finish when the caller waits for one: the
    test's schedule, with nothing finishing on its own (so a wait that was not needed,
    or never made, shows in what is in flight)."""

    def wait_ready(self, timeout: float | None) -> bool:
        self.complete_all()
        return super().wait_ready(timeout)


@pytest.mark.parametrize("path", ["extend", "admit"])
def test_f32_a_request_preempted_without_a_drain_never_fails_another_requests_call(
    engine: Engine, path: str
) -> None:
    """F32: the scheduler preempts request a (priority preemption: its row and pages
    freed, no drain first) while a's copy is in flight; the pages go to b's next step
    (``extend``) or to a new request c (``admit``). That call must not fail: the
    reclaimed row is found, a's lifecycle ends (its copy discarded once it ends), and
    the page is b's or c's. a resumes later (SGLang's next iteration: progress, then
    ``resume_retracted_reqs``) and its chain goes on from its last page actually
    stored; every request's pages are stored with the engine's bytes.

    a's and c's prompts are shorter than a page, so every page of theirs is one
    kvoffload holds (a prompt's whole pages are the prefill side's, never held): the
    page handed on is one a's lifecycle holds, whichever end of the free list the
    engine's allocator hands out first (SGLang's hands out the page freed first)."""
    sim = FinishesWhenWaitedOn()
    mgr, storage = open_mgr(engine, sim)
    a = engine.new_req("a", list(range(3)), max_new=40)
    b = engine.new_req("b", list(range(6)), max_new=30)
    engine.prefill(a)
    engine.prefill(b)

    def ready() -> bool:
        copying = any(t.tag.ref() is a for t in sim.pending)
        return copying and (path == "admit" or engine.next_step_takes_a_page(b))

    for _ in range(40):
        if ready():
            break
        engine.iteration()
    assert ready()
    a_pages = set(engine.row_pages(a))
    # SGLang's order: progress, then batch selection (which preempts), then the step.
    mgr.check_offload_progress()
    engine.preempt(a)  # no drain: a's copy still reads its rows
    reqs = [a, b]
    if path == "admit":
        c = engine.new_req("c", list(range(50, 52)), max_new=20)
        engine.prefill(c)
        reqs.append(c)
        assert a_pages & set(engine.row_pages(c)), "c was handed a's pages"
    engine.forward()
    engine.process_results()  # the step's offload calls: none may raise
    if path == "extend":
        assert engine.row_pages(b)[-1] in a_pages, "b's new page was a's"
    mgr.check_offload_progress()  # the next iteration: progress, then the resume
    engine.resume(a)
    while engine.running:
        sim.complete_all()
        engine.iteration()
    sim.complete_all()
    settle(mgr)
    assert sorted(engine.released) == sorted(r.rid for r in reqs)
    for r in reqs:
        check_all_stored(mgr, engine, storage, r)
    check_nothing_left_and_close(engine, mgr)


def test_f31_two_tp_ranks_whose_collectors_run_at_other_moments_stay_in_step(
    kind: str, tmp_path: Any
) -> None:
    """F31 on two gloo ranks: a request dropped mid-decode in a reference cycle is
    collected on rank 0 at once and on rank 1 never. Both ranks see the same
    lifecycles, aborts, discarded copies and pages after every iteration, release the
    same requests in the same iterations, and no collective raises RanksDiverged."""
    from sglang_engines import tp_rank_run

    from kvoffload.testing import LocalRanks

    with LocalRanks(2, timeout_s=120.0) as ranks:
        r0, r1 = ranks.run(tp_rank_run, kind, 11, str(tmp_path), False, True)
    assert r0["counts"] == r1["counts"]
    assert r0["released_at"] == r1["released_at"]
    assert sorted(r0["released"]) == sorted(r for r, *_ in r0["reqs"])
    aborted = [c[2] for c in r0["counts"]]  # released ABORTED: only the dropped request is
    assert aborted[11] == 0 and aborted[12] == 1, f"the dropped request ends when its row goes: {aborted}"
    for r in (r0, r1):
        assert r["live"] == 0 and r["host_used"] == 0 and r["engine_slots_held"] == 0


@pytest.mark.parametrize("seed", range(1, 9))
def test_a_seeded_random_schedule_stores_every_page_once_and_leaks_nothing(engine: Engine, seed: int) -> None:
    """A seeded random scheduler in SGLang's order (progress; resume a retracted
    request; admit; retract with a drain, or preempt without one; the decode step; the
    offload calls), reused rids, copies completing in a random subset and order, a small
    host pool: every request finishes and is released exactly once through SGLang's
    path, every page past its prompt is stored with the engine's bytes, and every slot
    comes back (on SGLang's real classes: each exactly once on the free list)."""
    rng = random.Random(seed)
    sim = FinishesWhenWaitedOn()  # a drain (retraction) waits: the copies then finish
    mgr, storage = open_mgr(engine, sim, host_pages=16)
    arrivals = [
        engine.new_req(
            f"r{i % 4}", [rng.randrange(1, 500) for _ in range(rng.randint(1, 11))], rng.randint(2, 30)
        )
        for i in range(10)
    ]
    admitted: list[Req] = []
    for _ in range(2000):
        if not arrivals and not engine.running and not engine.waiting:
            break
        mgr.check_offload_progress()
        if engine.waiting and rng.random() < 0.3:
            engine.resume(engine.waiting[0])
        if arrivals and rng.random() < 0.3:
            admitted.append(arrivals.pop())
            engine.prefill(admitted[-1])
        if engine.running and rng.random() < 0.08:
            victim = rng.choice(engine.running)
            if rng.random() < 0.5:
                engine.retract(victim)  # drain_before_retraction(), then SGLang's release_req
            else:
                engine.preempt(victim)  # priority preemption: no drain (F32)
        if engine.running:
            engine.forward()
            engine.process_results()
        pending = list(sim.pending)
        rng.shuffle(pending)
        for t in pending[: rng.randint(0, len(pending))]:
            sim.complete(t)
    assert not arrivals and not engine.running and not engine.waiting, "the schedule did not end"
    while mgr.ongoing_offload:
        sim.complete_all()
        mgr.check_offload_progress()
    settle(mgr)
    assert sorted(engine.released) == sorted(r.rid for r in admitted)
    for r in admitted:
        assert r.finished() and engine.releases(r) == 1, r.rid
        check_all_stored(mgr, engine, storage, r)
    check_nothing_left_and_close(engine, mgr)


# --- where kvoffload differs on purpose ------------------------------------------------


def test_the_page_aligned_tail_is_flushed_at_finish(engine: Engine) -> None:
    """SGLang offloads only whole strides; kvoffload also sends the whole pages since
    the last stride when the request finishes (F12)."""
    mgr, storage = open_mgr(engine, "cpu", stride=4 * PS)
    req = engine.new_req("a", list(range(PS)), max_new=3 * PS + 2)  # finishes 3 pages past the prompt
    engine.run([req])
    settle(mgr)
    n = len(req.origin_input_ids) + len(req.output_ids) - 1
    assert n // PS == 4  # 3 whole pages beyond the prompt: less than a stride
    check_stored(mgr, engine, storage, req, 1, 4)
    check_nothing_left_and_close(engine, mgr)


@both_allocators
def test_keys_stay_right_under_out_of_order_completions(engine: Engine) -> None:
    sim = SimBackend()
    mgr, storage = open_mgr(engine, sim)
    reqs = [engine.new_req(f"r{i}", list(range(i, i + 6)), max_new=30, cache_salt=f"s{i}") for i in range(3)]
    for r in reqs:
        engine.prefill(r)
    while engine.running:
        engine.iteration()
        for t in reversed(sim.pending[1:]):  # newest first, one left behind each step
            sim.complete(t)
    for t in reversed(sim.pending):
        sim.complete(t)
    settle(mgr)
    for r in reqs:
        check_all_stored(mgr, engine, storage, r)
    check_nothing_left_and_close(engine, mgr)


def test_namespaces_keep_requests_apart(engine: Engine) -> None:
    """The same tokens under another extra_key / cache_salt are another chain."""
    mgr, storage = open_mgr(engine, "cpu")
    a = engine.new_req("a", list(range(8)), max_new=9, extra_key="model-a")
    b = engine.new_req("b", list(range(8)), max_new=9, extra_key="model-b")
    engine.run([a, b])
    settle(mgr)
    for r in (a, b):
        check_stored(mgr, engine, storage, r, 2, 4)
    unseeded = ref_keys(a.origin_input_ids + a.output_ids[:-1], PS)[2:4]
    assert stored(storage, unseeded) == [None, None]
    mgr.release_host_resources()


def test_prefix_pages_shared_by_two_requests_are_not_held() -> None:
    """A radix cache hands two requests the same prompt pages: they are stored (the
    prefill side wrote them), so kvoffload never reads them and holds neither's. (The
    fake has no radix tree: the second row is pointed at the first's pages by hand.
    On SGLang's real radix caches: the next test.)"""
    engine = FakeEngine(page_size=PS)
    mgr, _ = open_mgr(engine, "cpu")
    a = engine.new_req("a", list(range(8)), max_new=12)
    b = engine.new_req("b", list(range(8)), max_new=12)
    engine.prefill(a)
    engine.prefill(b)
    row_a, row_b = a.kv.req_pool_idx, b.kv.req_pool_idx
    engine.r2t.req_to_token[row_b, :8] = engine.r2t.req_to_token[row_a, :8]  # shared prefix
    for _ in range(5):
        engine.iteration()  # would raise PageError if the shared pages were claimed twice
    engine.r2t.req_to_token[row_b, :8] = torch.arange(0, 8)  # un-share before the engine frees
    engine.running.clear()
    mgr.release_host_resources()


@pytest.mark.parametrize("taken_back", ["", "retract", "preempt"], ids=["run", "retracted", "preempted"])
@pytest.mark.parametrize("page_size", [PS, 1], ids=["paged", "page_size=1"])
@pytest.mark.parametrize("tree", ["unified", "radix"])
def test_prefix_pages_matched_in_sglangs_radix_tree_are_not_held_nor_freed(
    tree: str, page_size: int, taken_back: str
) -> None:
    """SGLang's real decode radix cache (``--disaggregation-decode-enable-radix-cache``)
    matches two requests' prompt in the tree: both rows start with the tree's pages
    (``cache_protected_len`` = 8) and hold a lock on its node. kvoffload never reads
    nor holds those pages; each request's release frees only its own slots and drops
    its lock (F28, F29): once the tree evicts, every slot is on the free list exactly
    once, and every page past the prompt is stored with the engine's bytes. Also when
    request a is taken back mid-decode (SGLang's ``release_req``: its own slots freed,
    the lock dropped; drained first, or not: a priority preemption) and resumed on
    slots of its own (no prefix: ``restore_kv_cache``)."""
    with contextlib.ExitStack() as stack:
        engine = make(stack, f"real-{tree}", page_size=page_size, decode_radix=True)
        mgr, storage = open_mgr(engine, "cpu")
        prompt = list(range(8))
        assert engine.real.seed_tree(prompt) == 8
        a = engine.new_req("a", prompt, max_new=12)
        b = engine.new_req("b", prompt, max_new=12)
        for r in (a, b):
            engine.prefill(r)
            assert r.kv.cache_protected_len == 8 and r.lock is not None, "no prefix matched"
        if taken_back:
            for _ in range(5):
                engine.iteration()
            getattr(engine, taken_back)(a)
            mgr.check_offload_progress()  # SGLang's next iteration: progress, then the resume
            engine.resume(a)
            assert a.kv.cache_protected_len == 0
        engine.run([])
        settle(mgr)
        assert sorted(engine.released) == ["a", "b"] and engine.releases(a) == engine.releases(b) == 1
        for r in (a, b):
            assert r.lock is None, f"{r.rid}: its tree lock was never dropped"
            check_all_stored(mgr, engine, storage, r)
        check_nothing_left_and_close(engine, mgr)
        engine.real.evict()
        engine.real.check_free_list()
        assert engine.real.free_count() == engine.real.capacity, "slots lost or held"


# --- construction: what is refused, and why ------------------------------------------------


def _mha(rows: int = 8 * PS) -> Any:
    """A stand-in for an MHA pool of ``rows`` token rows: SGLang's own always holds whole
    pages (size + one padding page), so a partial page can only be built this way."""

    class MHATokenToKVPool:
        def __init__(self) -> None:
            self.k_buffer = [torch.zeros(rows, 2, 4)]
            self.v_buffer = [torch.zeros(rows, 2, 4)]

    return MHATokenToKVPool()


# Stand-ins for pools kvoffload refuses by name or by shape. SGLang's real SWA pool is
# refused in the next test; its hybrid (linear attention / Mamba) pool needs a MambaPool
# and model config this CPU build does not make. The allocator handed to the drop-in is
# the fake one (sglang_fakes.Allocator, checked against SGLang's in
# test_sglang_fake_shapes.py) around the stand-in pool.
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: type("SWAKVPool", (), {"full_kv_pool": _mha(), "swa_kv_pool": _mha()})(), "sliding-window"),
        (lambda: type("HybridLinearKVPool", (), {})(), "hybrid"),
        (lambda: type("Unknown", (), {})(), "not a KV pool"),
        (lambda: _mha(8 * PS + 1), "not a whole number of pages"),
    ],
    ids=["swa", "hybrid", "unknown", "partial-page"],
)
def test_unsupported_pools_are_refused_at_construction(engine: Engine, make: Any, match: str) -> None:
    with pytest.raises(kvo.UnsupportedKVPool, match=match):
        DecodeKVCacheOffloadManager(
            engine.req_to_token_pool, Allocator(make(), 8, PS), None, engine.tree_cache
        )


@pytest.mark.parametrize("tree", ["unified", "radix"])
def test_sglangs_swa_pool_is_refused_at_construction(tree: str) -> None:
    """SGLang's real ``SWAKVPool`` (a full-attention and a sliding-window MHA pool, on
    the CPU) behind SGLang's real paged allocator: refused by name, nothing opened."""
    with contextlib.ExitStack() as stack:
        engine = make(stack, f"real-{tree}", page_size=PS)
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        pool = SWAKVPool(
            size=16 * PS,
            size_swa=16 * PS,
            page_size=PS,
            dtype=torch.float16,
            head_num=2,
            head_dim=4,
            swa_attention_layer_ids=[0],
            full_attention_layer_ids=[1],
            device="cpu",
        )
        alloc = PagedTokenToKVPoolAllocator(16 * PS, PS, torch.float16, "cpu", pool, False)
        with pytest.raises(kvo.UnsupportedKVPool, match="sliding-window"):
            DecodeKVCacheOffloadManager(engine.req_to_token_pool, alloc, None, engine.tree_cache)


def test_sglangs_dsa_pool_with_its_indexer_keys_is_refused_at_construction() -> None:
    """SGLang's real ``DSATokenToKVPool`` (DeepSeek sparse attention: the MLA latent in
    ``kv_buffer`` and, per token, the NSA indexer's keys in ``index_key_cache``, an
    ``IndexKeyCache``) holds per-token state besides the KV that the drop-in would not
    copy: it must be refused by name at construction (docs/integrations/sglang.md: "pools
    that hold per-token state besides K and V (an NSA indexer's keys ...)"), never
    offloaded without the indexer's keys. DSA needs 64-token pages."""
    with contextlib.ExitStack() as stack:
        engine = make(stack, "real-unified", page_size=64, n_pages=4)
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        pool = DSATokenToKVPool(
            size=128,
            page_size=64,
            kv_lora_rank=8,
            dtype=torch.bfloat16,
            qk_rope_head_dim=4,
            layer_num=2,
            device="cpu",
            index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=12,
        )
        assert pool.index_key_cache is not None  # the indexer's per-token keys
        alloc = PagedTokenToKVPoolAllocator(128, 64, torch.bfloat16, "cpu", pool, False)
        with pytest.raises(kvo.UnsupportedKVPool, match="DSATokenToKVPool"):
            DecodeKVCacheOffloadManager(engine.req_to_token_pool, alloc, None, engine.tree_cache)


@pytest.mark.parametrize("slots", [256, 252], ids=["rows-not-whole-pages", "rows-whole-pages"])
def test_sglangs_hnd_layout_pool_is_refused_by_its_layout(slots: int, monkeypatch: Any) -> None:
    """SGLang's real ``MHATokenToKVPool`` with the HND layout (``SGLANG_USE_HND_KVCACHE=1``,
    ``kv_cache_layout == "hnd"``) holds each K / V buffer as (pages, heads, page size,
    head dim), not one row per token. The drop-in reads a buffer's first dimension as
    token rows: it must refuse the layout by name, never view pages as tokens. Before
    the fix, with 256 slots (65 pages) it was refused as "65 token rows, not a whole
    number of pages" (the wrong reason); with 252 slots (64 pages) it was accepted, each
    buffer viewed as 16 "pages" of 4 pages each."""
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    with contextlib.ExitStack() as stack:
        engine = make(stack, "real-unified", page_size=PS)
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        pool = MHATokenToKVPool(slots, PS, torch.float16, 2, 4, 2, "cpu", False)
        assert pool.kv_cache_layout == "hnd" and tuple(pool.k_buffer[0].shape[1:]) == (2, PS, 4)
        alloc = PagedTokenToKVPoolAllocator(slots, PS, torch.float16, "cpu", pool, False)
        with pytest.raises(kvo.UnsupportedKVPool, match="hnd"):
            DecodeKVCacheOffloadManager(engine.req_to_token_pool, alloc, None, engine.tree_cache)


def test_a_pool_with_extra_per_token_state_is_refused() -> None:
    pool = _mha()
    pool.index_k_with_scale_buffer = [torch.zeros(8 * PS, 1)]  # an NSA indexer's keys
    with pytest.raises(kvo.UnsupportedKVPool, match="index_k_with_scale_buffer"):
        engine_kv_tensors(pool, PS)


def test_an_npu_pool_is_refused() -> None:
    class AscendTokenToKVPool:
        def __init__(self) -> None:
            meta = torch.zeros(8 * PS, 2, 4, device="meta")  # stands in for an NPU tensor
            self.k_buffer = [meta]
            self.v_buffer = [meta]

    with pytest.raises(kvo.UnsupportedKVPool, match="NPU"):
        engine_kv_tensors(AscendTokenToKVPool(), PS)


@both_allocators
def test_mla_pools_are_offloaded(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(mla=True)
    mgr, storage = open_mgr(engine, "cpu")
    assert mgr.kv_kind == "mla"
    req = engine.new_req("a", list(range(6)), max_new=15)
    engine.run([req])
    settle(mgr)
    check_all_stored(mgr, engine, storage, req)
    mgr.release_host_resources()


def test_server_args_size_the_host_pool_and_pick_the_store(
    kind: str, make_engine: Callable[..., Engine], tmp_path: Any, monkeypatch: Any
) -> None:
    """``server_args`` handed to the drop-in (on the real engine: SGLang's own
    ``ServerArgs``) size the host pool (``hicache_ratio`` of the device pool) and pick
    the store (``hicache_storage_backend``); the stride comes from SGLang's env var. On
    the real engine, the same settings only published (SGLang's scheduler builds its
    manager with no ``server_args``) give the same manager."""

    class Redisless(FakeServerArgs):
        hicache_storage_backend = "mooncake"

    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", str(3 * PS + 1))
    fields = {"hicache_ratio": 0.5, "hicache_size": 0, "hicache_storage_backend": "file"}
    engine = make_engine(n_pages=64, **({} if kind == "fake" else fields))
    managers = [lambda: engine.manager(server_args=args)]
    if kind == "fake":
        args, other = FakeServerArgs(), Redisless()
    else:
        import sglang_real as sr

        args = sr.server_args(**fields)
        other = sr.server_args(**{**fields, "hicache_storage_backend": "mooncake"})
        managers.append(lambda: engine.manager())  # the published runtime context only
    for build in managers:
        mgr = build()
        assert mgr.manager.config.host_pages == int(64 * 0.5) + 1  # padding aside, + SGLang's one page
        assert mgr.offload_stride == 3 * PS  # rounded down to whole pages, as SGLang does
        # SGLang's own HiCacheFile where its host pool can be built here (the
        # side-by-side module's CPU stand-ins, once imported), else HiCacheFile's format
        # written by kvoffload: the same directory either way.
        st: Any = mgr.manager.storage
        assert str(getattr(st, "root", None) or st.backend.file_path) == str(tmp_path)
        mgr.release_host_resources()
    with pytest.raises(kvo.ConfigError, match="mooncake"):
        engine.manager(server_args=other)


def test_importing_the_integration_imports_no_sglang() -> None:
    code = (
        "import sys, kvoffload.integrations.sglang as s; "
        "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; "
        "print(bad); assert not bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@both_allocators
def test_a_full_run_from_a_plain_loop_releases_everything(engine: Engine) -> None:
    """Many requests, real copy threads (cpu backend), a file-less memory store: every
    page stored with the engine's bytes, every row and page returned, each request
    released exactly once."""
    mgr, storage = open_mgr(engine, "cpu")
    reqs = [
        engine.new_req(f"r{i % 5}", [i * 10 + j for j in range(3 + i % 7)], max_new=8 + 3 * i)
        for i in range(12)
    ]
    engine.run(reqs[:6])
    engine.run(reqs[6:])
    settle(mgr)
    assert sorted(engine.released) == sorted(r.rid for r in reqs)
    for r in reqs:
        assert engine.releases(r) == 1
        check_all_stored(mgr, engine, storage, r)
    check_nothing_left_and_close(engine, mgr)


# --- tensor parallelism: two gloo ranks through the same class --------------------------


@pytest.mark.parametrize("mla", [False, True], ids=["mha-rank-keys", "mla-shared-keys"])
def test_two_tp_ranks_release_together_and_store_their_shards(
    kind: str, make_engine: Callable[..., Engine], tmp_path: Any, mla: bool
) -> None:
    from sglang_engines import tp_rank_run

    from kvoffload.storage.file import FileStorage
    from kvoffload.testing import LocalRanks

    with LocalRanks(2, timeout_s=120.0) as ranks:
        records = ranks.run(tp_rank_run, kind, 7, str(tmp_path), mla)
    r0, r1 = records
    # Every rank released the same requests in the same iterations (F25), all of them.
    assert r0["released_at"] == r1["released_at"]
    assert sorted(r0["released"]) == sorted(r for r, *_ in r0["reqs"])
    for r in records:
        assert r["live"] == 0 and r["host_used"] == 0 and r["engine_slots_held"] == 0
    # Each rank's pages are under its own keys (MHA) or rank 0's once (MLA), with its bytes
    # (what an engine of the same kind and shape writes on that rank).
    engine = make_engine(mla=mla)
    store = FileStorage(tmp_path)
    for rank, rec in enumerate(records):
        engine.shard = 0 if mla else rank
        for rid, uid, prompt, output, extra_key, salt in rec["reqs"]:
            tokens = prompt + output[:-1]
            keys = page_keys(engine, tokens, extra_key, salt)
            first, last = len(prompt) // PS, len(tokens) // PS
            names = keys[first:last] if mla else [f"{k}_{rank}_2" for k in keys[first:last]]
            got = asyncio.run(store.get(names))
            for p, page in zip(range(first, last), got, strict=True):
                assert page == engine.expected(uid, tokens, p), f"rank {rank} {rid}: page {p}"
