"""The SGLang drop-in on SGLang 0.5.23's REAL classes (tests/integrations/sglang_real.py):
its release path through the real tree caches and allocators (F28, F29), TP and
preemption (F31, F32), the settings SGLang's scheduler publishes, and the host-full
wait. Skipped without sglang unless ``KVOFFLOAD_REQUIRE_SGLANG=1`` (then they fail)."""

from __future__ import annotations

import os

import sglang_cpu

sglang_cpu.require()

import pytest  # noqa: E402
import sglang_real as sr  # noqa: E402

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
