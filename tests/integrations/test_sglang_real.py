"""The SGLang drop-in on SGLang 0.5.23's REAL classes (tests/integrations/sglang_real.py):
its release path through the real tree caches and allocators (F28, F29), TP and
preemption (F31, F32), the settings SGLang's scheduler publishes, and the host-full
wait. Skipped without sglang unless ``KVOFFLOAD_REQUIRE_SGLANG=1`` (then they fail)."""

from __future__ import annotations

import os
from typing import Any

import sglang_cpu

sglang_cpu.require()

import pytest  # noqa: E402
import sglang_real as sr  # noqa: E402

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
