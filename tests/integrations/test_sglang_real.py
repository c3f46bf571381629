"""The SGLang drop-in on SGLang 0.5.23's REAL classes (tests/integrations/sglang_real.py):
its release path through the real tree caches and allocators (F28, F29), TP and
preemption (F31, F32), the settings SGLang's scheduler publishes, and the host-full
wait. Skipped without sglang unless ``KVOFFLOAD_REQUIRE_SGLANG=1`` (then they fail)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import sglang_cpu

sglang_cpu.require()

import pytest  # noqa: E402
import sglang_real as sr  # noqa: E402

import kvoffload as kvo  # noqa: E402
from kvoffload.storage.memory import MemoryStorage  # noqa: E402
from kvoffload.testing import SimBackend  # noqa: E402

TREES = ["unified", "radix"]


# --- the harness itself ----------------------------------------------------------------------


def test_the_harness_leaves_no_global_state_behind() -> None:
    """The published runtime context and SGLANG_DEBUG_MEMORY_POOL are SGLang's process
    globals: inside ``sr.engine`` they are the decode server's, after it what they were."""
    from sglang.srt import runtime_context as rc

    def published() -> bool:
        try:
            rc.get_schedule()
        except ValueError:
            return False
        return True

    before_env = os.environ.get("SGLANG_DEBUG_MEMORY_POOL")
    before = published()
    with sr.engine(page_size=4) as eng:
        assert rc.get_schedule().page_size == 4
        assert rc.get_disagg().disaggregation_mode == "decode"
        assert rc.get_disagg().disaggregation_decode_retraction_backup == "cpu_tensor"
        assert os.environ["SGLANG_DEBUG_MEMORY_POOL"] == "1"
        assert eng.allocator.debug_mode is True
    assert published() == before
    assert os.environ.get("SGLANG_DEBUG_MEMORY_POOL") == before_env


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tree", TREES)
def test_the_harness_runs_sglangs_own_request_lifecycle(page_size: int, tree: str) -> None:
    """Admission with a prefix matched from the tree, decode steps, retraction and
    resume (SGLang's own ``release_req`` / ``restore_kv_cache``), all on SGLang's
    objects: the KV bytes survive the retraction, and once the tree evicts, every slot
    is back on the free list exactly once."""
    with sr.engine(page_size=page_size, tree=tree, decode_radix=True) as eng:
        assert eng.seed_tree(list(range(10))) == 10 - 10 % page_size
        req = eng.new_req("a", list(range(10)), max_new_tokens=30)
        prefix = eng.admit(req)
        assert prefix == 10 - 10 % page_size == req.kv.cache_protected_len
        assert req.lock is not None
        for _ in range(5):
            eng.decode_step(req)
        n = req.kv.kv_committed_len
        assert eng.kv_bytes(eng.row_slots(req, 0, n)) == eng.expected_kv_bytes(eng.tokens(req), 0, n)
        assert eng.retract(req)
        assert req.kv.req_pool_idx is None and req.lock is None
        eng.resume(req)
        assert eng.kv_bytes(eng.row_slots(req, 0, n)) == eng.expected_kv_bytes(eng.tokens(req), 0, n)
        assert eng.retract(req)
        eng.evict()
        eng.check_free_list()
        assert eng.free_count() == eng.capacity


# --- driving the drop-in -------------------------------------------------------------------


def open_mgr(eng: sr.Engine, sim: SimBackend | None = None, **kw: Any) -> Any:
    """kvoffload's drop-in on the engine's real objects, on a SimBackend (the test
    completes the copies), a memory store."""
    kw.setdefault("storage", MemoryStorage())
    kw.setdefault("host_pages", 64)
    kw.setdefault("drain_timeout_s", 5.0)
    return eng.manager(backend=sim or SimBackend(), **kw)


def run_to_end(eng: sr.Engine, mgr: Any, sim: SimBackend, reqs: list[Any]) -> None:
    """Scheduler iterations (copies completing after each) until every request finished
    and kvoffload released it; then the idle loop until nothing is in flight."""
    for _ in range(10_000):
        if all(r.finished() for r in reqs):
            break
        eng.step(mgr, reqs)
        sim.complete_all()
    assert all(r.finished() for r in reqs)
    while mgr.ongoing_offload or sim.pending:
        sim.complete_all()
        mgr.check_offload_progress()


def released(req: Any) -> bool:
    """SGLang's state of a request whose KV was released (``_release_finished_req``)."""
    return req.kv.req_pool_idx is None and req.lock is None and req.kv.kv_allocated_len == 0


# --- F28, F29: the release path through SGLang's real tree caches --------------------------


@pytest.mark.parametrize("decode_radix", [False, True], ids=["no-radix", "decode-radix"])
@pytest.mark.parametrize("tree", TREES)
def test_f28_release_goes_through_the_real_tree_caches(tree: str, decode_radix: bool) -> None:
    """F28: a finished request is released through SGLang's real ``UnifiedRadixCache``
    / ``RadixCache`` as SGLang's own ``_release_finished_req`` does
    (``tree_cache.unlock(req.lock)``, then ``req.lock = None``): no exception into the
    scheduler, the row and every slot back, the lock dropped."""
    with sr.engine(page_size=4, tree=tree, decode_radix=decode_radix) as eng:
        sim = SimBackend()
        mgr = open_mgr(eng, sim)
        if decode_radix:
            eng.seed_tree(list(range(50, 58)))  # a tree with other pages: nothing matches
        seeded = eng.tree_slots()
        reqs = [
            eng.new_req(f"r{i}", list(range(10 * i, 10 * i + 7 + i)), max_new_tokens=9 + i) for i in range(3)
        ]
        for r in reqs:
            eng.admit(r)
            assert (r.lock is not None) == decode_radix
        run_to_end(eng, mgr, sim, reqs)
        assert all(released(r) for r in reqs), [r.kv for r in reqs]
        eng.check_free_list()
        assert eng.free_count() == eng.capacity - seeded
        assert eng.tree_slots() == seeded
        mgr.release_host_resources()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tree", TREES)
def test_f29_a_prefix_matched_from_the_tree_stays_the_trees(tree: str, page_size: int) -> None:
    """F29: with the decode radix cache on and a prefix matched from the tree
    (``cache_protected_len > 0``), the release frees only from ``cache_protected_len``,
    as SGLang does: the tree's pages stay on the tree (its size unchanged, locked no
    more), and after the tree evicts them every slot is on the free list exactly once
    (SGLang's debug memory pool checks each free; the free count ends where it began)."""
    with sr.engine(page_size=page_size, tree=tree, decode_radix=True) as eng:
        sim = SimBackend()
        mgr = open_mgr(eng, sim)
        prompt = list(range(11))
        seeded = eng.seed_tree(prompt)
        assert seeded == 11 - 11 % page_size
        a = eng.new_req("a", prompt, max_new_tokens=12)
        b = eng.new_req("b", [*prompt[:8], 90, 91, 92], max_new_tokens=7)
        for r in (a, b):
            assert eng.admit(r) > 0 and r.kv.cache_protected_len > 0
        assert eng.tree_cache.protected_size() == seeded
        run_to_end(eng, mgr, sim, [a, b])
        assert released(a) and released(b)
        assert eng.tree_slots() == seeded and eng.tree_cache.protected_size() == 0
        tree_held = eng.capacity - eng.free_count()
        assert tree_held == seeded, f"the tree holds {seeded} slots, {tree_held} are not free"
        assert eng.evict() == seeded
        eng.check_free_list()
        assert eng.free_count() == eng.capacity
        mgr.release_host_resources()


# --- settings: where SGLang's own manager reads them ---------------------------------------


def files_under(root: Any) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if p.is_file())


def test_the_one_line_swap_reads_sglangs_published_settings(tmp_path: Any, monkeypatch: Any) -> None:
    """SGLang's scheduler builds the manager with four arguments and no server_args;
    SGLang's own manager reads the published runtime config. After the one-line swap,
    with only the runtime context published: ``--hicache-storage-backend file`` stores
    (under ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``), the host pool is sized by
    ``--hicache-ratio`` as SGLang sizes its own (the device pool's tokens times the
    ratio, in whole pages), and the stride comes from SGLang's ``envs``."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", "9")
    with sr.engine(page_size=4, slots=256, hicache_storage_backend="file", hicache_ratio=3.0) as eng:
        sim = SimBackend()
        mgr = eng.manager(backend=sim)  # SGLang's line: (r2t, allocator, tp_group, tree_cache)
        assert mgr.manager.config.host_pages == int(256 * 3.0) // 4 + 1
        assert mgr.offload_stride == 8  # 9 tokens rounded down to whole pages, as SGLang does
        req = eng.new_req("a", list(range(9)), max_new_tokens=20)
        eng.admit(req)
        run_to_end(eng, mgr, sim, [req])
        for _ in range(10_000):  # the idle loop until the storage writes are collected
            mgr.check_offload_progress()
            if not mgr.statistics().pages_in_write:
                break
            mgr.manager.wait_progress(0.01)
        assert mgr.statistics().pages_stored >= (9 + 19) // 4 - 9 // 4
        assert files_under(tmp_path), "nothing was stored under the file backend's directory"
        mgr.release_host_resources()


def test_hicache_size_sizes_the_host_pool_as_sglang_does() -> None:
    """``--hicache-size`` (GB) wins over the ratio: SGLang's host pool holds
    ``int(size * 1e9 // bytes per token)`` tokens; kvoffload's that many whole pages."""
    with sr.engine(page_size=4, slots=256, hicache_size=0.0001, hicache_ratio=3.0) as eng:
        mgr = eng.manager(backend=SimBackend(), storage=None)
        per_token = 2 * sr.HEADS * sr.HEAD_DIM * 2 * 2  # K and V, 2 layers, float16
        assert mgr.manager.config.host_pages == int(0.0001 * 1e9 // per_token) // 4 + 1
        mgr.release_host_resources()


def test_server_args_when_passed_win_over_the_published_settings() -> None:
    """A ``server_args`` passed to the drop-in (its optional fifth argument) is read
    instead of the published context."""
    with sr.engine(page_size=4, slots=256, hicache_ratio=3.0) as eng:
        args = sr.server_args(page_size=4, hicache_ratio=0.5)
        mgr = eng.manager(backend=SimBackend(), server_args=args)
        assert mgr.manager.config.host_pages == int(256 * 0.5) // 4 + 1
        mgr.release_host_resources()


def test_a_published_page_size_other_than_the_allocators_is_refused() -> None:
    """SGLang keys pages on its published page size; an allocator page of another size
    (decode context parallelism widens it) is refused by name, nothing opened."""
    with sr.engine(page_size=4) as eng:
        from sglang.srt import runtime_context as rc

        rc.get_context().override("test", page_size=8)
        with pytest.raises(kvo.ConfigError, match="page_size is 8"):
            eng.manager(backend=SimBackend(), storage=None)


# --- F31, F32 on the real classes ------------------------------------------------------------


def test_f31_tp_ranks_whose_collectors_run_at_other_moments_stay_in_step(tmp_path: Any) -> None:
    """F31 on two gloo ranks and SGLang's real objects: a Req dropped mid-decode in a
    reference cycle is collected on rank 0 at once and on rank 1 never. Both ranks see
    the same lifecycles, aborts, discarded copies and pages after every iteration,
    release the same requests in the same iterations (no collective raises
    RanksDiverged), and every slot and row is back in SGLang's allocator and pool.
    (MHA: each rank's KV differs; MLA under TP is covered by test_sglang.py's fakes.)"""
    from kvoffload.testing import LocalRanks

    with LocalRanks(2, timeout_s=240.0) as ranks:
        r0, r1 = ranks.run(sr.tp_rank_run, 11, str(tmp_path), True, "mha")
    assert r0["counts"] == r1["counts"]
    assert r0["released_at"] == r1["released_at"]
    assert r0["released"] == r0["names"], "every request not dropped was released"
    aborted = [c[2] for c in r0["counts"]]  # released ABORTED: only the dropped request is
    assert aborted[11] == 0 and aborted[12] == 1, f"the dropped request ends when its row goes: {aborted}"
    for r in (r0, r1):
        assert r["live"] == 0 and r["host_used"] == 0
        assert r["free"] == r["capacity"] and r["rows_free"] == 16


class FinishesWhenWaitedOn(SimBackend):
    """A copy engine whose pending copies all finish when the caller waits for one (the
    test's schedule; nothing finishes on its own)."""

    def wait_ready(self, timeout: float | None) -> bool:
        self.complete_all()
        return super().wait_ready(timeout)


def check_stored(eng: sr.Engine, mgr: Any, storage: MemoryStorage, req: Any, first: int, last: int) -> None:
    """Pages ``first..last`` of ``req`` are stored under SGLang's keys (SGLang's own
    hash) with the bytes the engine wrote."""
    for _ in range(10_000):  # the idle loop until the storage writes are collected
        mgr.check_offload_progress()
        if not mgr.statistics().pages_in_write:
            break
        mgr.manager.wait_progress(0.01)
    ps = eng.page_size
    tokens = eng.tokens(req)
    keys = sr.page_keys(tokens, ps, extra_key=req.extra_key, cache_salt=req.cache_salt)[first:last]
    got = asyncio.run(storage.get(keys))
    for i, (key, page) in enumerate(zip(keys, got, strict=True)):
        p = first + i
        assert page is not None, f"{req.rid}: page {p} ({key[:12]}) missing from storage"
        assert page == eng.expected_kv_bytes(tokens, p * ps, (p + 1) * ps), f"{req.rid}: page {p} bytes"


def page_ids(eng: sr.Engine, req: Any) -> set[int]:
    ps = eng.page_size
    return {s // ps for s in eng.row_slots(req, 0, req.kv.kv_allocated_len)}


@pytest.mark.parametrize("path", ["extend", "admit"])
def test_f32_a_request_preempted_without_a_drain_never_fails_another_requests_call(path: str) -> None:
    """F32 on SGLang's real objects: request a is preempted (SGLang's ``release_req``,
    no ``drain_before_retraction()`` first, as priority preemption does) while its copy
    is in flight; SGLang's allocator hands a's freed pages to b's next step
    (``extend``) or to a new request c (``admit``). That call must not fail; a resumes
    (``restore_kv_cache``) and its chain goes on; every request's pages are stored
    under SGLang's keys with the engine's bytes, and every slot comes back once."""
    with sr.engine(page_size=4) as eng:
        sim = FinishesWhenWaitedOn()
        storage = MemoryStorage()
        mgr = open_mgr(eng, sim, storage=storage)
        a = eng.new_req("a", list(range(9)), max_new_tokens=40)
        b = eng.new_req("b", list(range(6)), max_new_tokens=30)
        eng.admit(a)
        eng.admit(b)
        running = [a, b]

        def ready() -> bool:
            copying = any(t.tag.ref() is a for t in sim.pending)
            b_grows = b.kv.kv_committed_len % eng.page_size == 0  # b's next slot starts a page
            return copying and (path == "admit" or b_grows)

        for _ in range(60):
            if ready():
                break
            eng.step(mgr, running)
        assert ready()
        a_pages = page_ids(eng, a)
        mgr.check_offload_progress()  # SGLang's order: progress, batch selection, the step
        assert eng.retract(a)  # priority preemption: no drain, a's copy still reads its rows
        running = [b]
        reqs = [a, b]
        if path == "admit":
            c = eng.new_req("c", list(range(50, 63)), max_new_tokens=20)
            eng.admit(c)
            running.append(c)
            reqs.append(c)
            assert a_pages & page_ids(eng, c), "c was handed a's pages"
        eng.step(mgr, running)  # the step's offload calls: none may raise
        if path == "extend":
            assert page_ids(eng, b) & a_pages, "b's new page was a's"
        eng.resume(a)
        running.append(a)
        for _ in range(10_000):
            running = [r for r in running if not r.finished()]
            if not running:
                break
            sim.complete_all()
            eng.step(mgr, running)
        while mgr.ongoing_offload or sim.pending:
            sim.complete_all()
            mgr.check_offload_progress()
        assert all(released(r) for r in reqs)
        for r in reqs:
            n = len(r.origin_input_ids) + len(r.output_ids) - 1
            check_stored(eng, mgr, storage, r, len(r.origin_input_ids) // 4, n // 4)
        eng.check_free_list()
        assert eng.free_count() == eng.capacity
        mgr.release_host_resources()


# --- the host-full wait: in scheduler steps, never in wall time ------------------------------


class Hours:
    """A manager clock the test moves: an hour passes at every scheduler step."""

    def __init__(self) -> None:
        self.now = time.monotonic()  # where the manager's own clock is: its timers are due

    def __call__(self) -> float:
        return self.now


def hours_pass(mgr: Any) -> Hours:
    """Put a clock the test moves under the drop-in's manager (driver and core)."""
    clock = Hours()
    mgr.manager.clock = clock
    mgr.manager.core.events.clock = clock  # the clock every room of the core reads
    return clock


def test_a_full_host_pool_holds_the_tail_however_long_the_wall_clock_says() -> None:
    """The host pool (one page) stays full for many steps and hours of the manager's
    clock while the request finishes: its chunks and its tail wait (nothing expires in
    wall time, nothing is lost: ``pages_lost`` and ``chunks_expired`` stay 0), go out
    when host pages return, and the release comes after the last copy, every page
    stored with the engine's bytes."""
    with sr.engine(page_size=4) as eng:
        sim = SimBackend()
        storage = MemoryStorage()
        mgr = open_mgr(eng, sim, storage=storage, host_pages=1)
        clock = hours_pass(mgr)
        req = eng.new_req("a", list(range(4)), max_new_tokens=14)
        eng.admit(req)
        for _ in range(40):  # no copy completes: the first chunk holds the only host page
            clock.now += 3600.0
            eng.step(mgr, [req])
        assert req.finished() and not released(req)
        assert mgr.statistics().chunks_deferred >= 1
        while mgr.ongoing_offload or sim.pending:
            clock.now += 3600.0
            sim.complete_all()
            mgr.check_offload_progress()
        assert released(req)
        check_stored(eng, mgr, storage, req, 1, (4 + 13) // 4)
        stats = mgr.statistics()
        assert stats.pages_lost == 0 and stats.chunks_expired == 0, stats
        eng.check_free_list()
        assert eng.free_count() == eng.capacity
        mgr.release_host_resources()


def test_host_wait_steps_bounds_the_wait_in_scheduler_steps_and_shows_the_loss() -> None:
    """``host_wait_steps=3``: a chunk that waited through more than 3 scheduler steps
    for host pages is dropped, whatever the clock (none expires in fewer steps, however
    many hours pass); the finished request is then released with the loss visible: its
    lifecycle's ``pages_lost``, ``statistics().chunks_expired`` and ``pages_lost``."""
    with sr.engine(page_size=4) as eng:
        sim = SimBackend()
        mgr = open_mgr(eng, sim, host_pages=1, host_wait_steps=3)
        clock = hours_pass(mgr)
        req = eng.new_req("a", list(range(4)), max_new_tokens=16)
        eng.admit(req)
        for _ in range(12):  # 4 tokens a chunk: the second chunk is deferred and waits
            clock.now += 3600.0
            eng.step(mgr, [req])
            if mgr.statistics().chunks_deferred:
                break
        assert mgr.statistics().chunks_deferred == 1
        lc = next(iter(mgr.manager.core.live.values()))
        for _ in range(3):  # three steps and days of the clock: still waiting
            clock.now += 86_400.0
            mgr.check_offload_progress()
        assert mgr.statistics().chunks_expired == 0 and lc.deferred
        mgr.check_offload_progress()  # the fourth step: the wait ran out
        assert mgr.statistics().chunks_expired == 1 and not lc.deferred
        while not req.finished():
            eng.step(mgr, [req])
        while mgr.ongoing_offload or sim.pending:
            sim.complete_all()
            mgr.check_offload_progress()
        assert released(req)
        assert lc.pages_lost >= 1 and mgr.statistics().pages_lost == lc.pages_lost
        eng.check_free_list()
        assert eng.free_count() == eng.capacity
        mgr.release_host_resources()


@pytest.mark.parametrize("tree", TREES)
def test_f29_a_request_with_a_matched_prefix_retracted_and_resumed_frees_only_its_own(tree: str) -> None:
    """F29 across a retraction: a request whose prompt prefix was matched from the tree
    is retracted (``drain_before_retraction()``, then SGLang's ``release_req``: it
    unlocks the tree and frees only ``[cache_protected_len, ...)``), resumed on fresh
    slots (SGLang re-matches nothing on resume), decodes to the end and is released by
    kvoffload: the tree's pages are never freed by anyone but the tree, and after it
    evicts every slot is on the free list exactly once."""
    with sr.engine(page_size=4, tree=tree, decode_radix=True) as eng:
        sim = SimBackend()
        storage = MemoryStorage()
        mgr = open_mgr(eng, sim, storage=storage)
        prompt = list(range(13))
        seeded = eng.seed_tree(prompt)
        req = eng.new_req("a", prompt, max_new_tokens=25)
        assert eng.admit(req) == seeded == 12
        for _ in range(9):
            eng.step(mgr, [req])
            sim.complete_all()
        mgr.check_offload_progress()
        mgr.drain_before_retraction()
        assert eng.retract(req) and req.lock is None
        assert eng.tree_slots() == seeded and eng.tree_cache.protected_size() == 0
        eng.resume(req)
        run_to_end(eng, mgr, sim, [req])
        assert released(req)
        n = len(req.origin_input_ids) + len(req.output_ids) - 1
        check_stored(eng, mgr, storage, req, len(prompt) // 4, n // 4)
        assert eng.capacity - eng.free_count() == seeded
        assert eng.evict() == seeded
        eng.check_free_list()
        assert eng.free_count() == eng.capacity
        mgr.release_host_resources()


def test_an_extra_storage_config_that_is_not_json_is_refused() -> None:
    """``--hicache-storage-backend-extra-config`` must be JSON (SGLang's manager raises
    on it too): refused by name at construction, nothing opened."""
    refused = pytest.raises(kvo.ConfigError, match="hicache_storage_backend_extra_config is not JSON")
    with sr.engine(page_size=4, hicache_storage_backend_extra_config="{not json") as eng, refused:
        eng.manager(backend=SimBackend(), storage=None)


def test_a_wait_bounded_in_steps_expires_in_the_same_step_on_every_tp_rank(tmp_path: Any) -> None:
    """Two gloo ranks, a host pool of 2 pages, ``host_wait_steps=2``, each rank's copies
    completing in its own random order and rounds: the chunks that wait for host pages,
    and those whose wait runs out, are the same on both ranks after every iteration
    (counted in scheduler steps, never a rank's own clock), as are the releases and
    what was lost; every slot is back in SGLang's allocator."""
    from kvoffload.testing import LocalRanks

    with LocalRanks(2, timeout_s=240.0) as ranks:
        r0, r1 = ranks.run(sr.tp_rank_run, 5, str(tmp_path), False, "mha", 2, 2)
    assert r0["counts"] == r1["counts"]
    assert r0["released_at"] == r1["released_at"]
    assert r0["released"] == r0["names"]
    deferred, expired, lost = r0["counts"][-1][5:]
    assert deferred >= 1 and expired >= 1, "no wait ran out: the test shows nothing"
    assert lost >= 1, "an expired wait of a finishing request loses pages, counted"
    for r in (r0, r1):
        assert r["live"] == 0 and r["host_used"] == 0
        assert r["free"] == r["capacity"] and r["rows_free"] == 16


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_request_stopped_mid_page_is_released_once_with_its_whole_pages_stored(page_size: int) -> None:
    """A stop token ends a request mid-page (and mid-stride): kvoffload flushes the
    page-aligned tail, releases once through SGLang's path after the last copy, and
    every slot comes back; on SGLang's real allocators of both kinds."""
    with sr.engine(page_size=page_size) as eng:
        sim = SimBackend()
        storage = MemoryStorage()
        mgr = open_mgr(eng, sim, storage=storage, stride=8)
        req = eng.new_req("a", list(range(6)), max_new_tokens=100)
        eng.admit(req)
        for _ in range(10):
            mgr.check_offload_progress()
            eng.decode_step(req)
            mgr.offload_kv_cache(req)
        mgr.check_offload_progress()
        eng.decode_step(req, stop=True)
        assert req.finished() and len(req.output_ids) == 12
        if not mgr.offload_kv_cache(req):
            mgr.finalize_release_on_finish(req)
        while mgr.ongoing_offload or sim.pending:
            sim.complete_all()
            mgr.check_offload_progress()
        assert released(req) and req.kv.req_pool_idx is None
        n = 6 + 12 - 1
        check_stored(eng, mgr, storage, req, 6 // page_size, n // page_size)
        eng.check_free_list()
        assert eng.free_count() == eng.capacity
        mgr.release_host_resources()
