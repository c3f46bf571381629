"""The connector's store side on plain data (no vLLM): the scheduler's planner and the
workers' movers on CPU tensors in vLLM's CPU attention layout (issue 22 points 1, 2).

What must hold: a request's newly full blocks go out stride by stride while it
decodes, not only its prompt; the page-aligned tail goes out at finish (F12); a copy
reads a block only after the step's forward wrote it (F19) and the stored bytes are
the block's; ``request_finished`` holds the blocks exactly while a copy still reads
them (delay-free), and the workers release them once the lifecycle is RELEASED; a
preempted request's in-flight copies are waited for before the forward can reuse its
blocks, and discarded (never stored); an abort mid-copy stores nothing of the chunk.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from connector_fakes import BS, FakeRequest, Rig, kv_value

from kvoffload.abc import Transfer
from kvoffload.integrations.vllm_keys import page_keys, request_seed
from kvoffload.storage.memory import MemoryStorage


@pytest.fixture
def store() -> MemoryStorage:
    return MemoryStorage()


@pytest.fixture
def rig(store: MemoryStorage) -> Iterator[Rig]:
    r = Rig(store)
    yield r
    r.close()


def _stored(store: MemoryStorage, keys: list[str]) -> list[bool]:
    import asyncio

    return [p is not None for p in asyncio.run(store.get(keys))]


def _keys(req: FakeRequest, n_pages: int, namespace: str | None = None) -> list[str]:
    return page_keys(request_seed(namespace, req), req.all_token_ids, BS, n_pages)


def test_decoded_blocks_go_out_stride_by_stride_while_decoding(rig: Rig, store: MemoryStorage) -> None:
    """A 6-token prompt (one whole block): the prefill step copies block 0; then each
    block the decode fills goes out in the step that fills it (point 2), and the store
    ends with every whole block, prompt and decoded, byte for byte what the forward
    wrote there."""
    req = FakeRequest("r", range(100, 106))
    rig.add(req)
    plan = rig.step()
    assert [len(c.device_pages) for c in plan.copies] == [1]
    assert plan.copies[0].device_pages == [rig.blocks["r"][0]]
    per_step = []
    for _ in range(7):  # tokens 6..12 computed: blocks 1 (tokens 4..7) and 2 (8..11) fill
        plan = rig.step()
        per_step.append([c.device_pages for c in plan.copies])
    # block 1 fills when token 7 is computed (the 2nd decode step), block 2 with token 11
    assert per_step == [[], [[rig.blocks["r"][1]]], [], [], [], [[rig.blocks["r"][2]]], []]
    rig.settle()
    keys = _keys(req, 3)
    assert _stored(store, keys) == [True, True, True]
    import asyncio

    pages = asyncio.run(store.get(keys))
    for i, page in enumerate(pages):
        block = rig.blocks["r"][i]
        expect = b"".join(t.numpy().tobytes() for t in rig.block_kv(0, block))
        assert page == expect, f"page {i} holds other bytes than block {block}"
    rig.planner.check_invariants()


def test_the_page_aligned_tail_goes_out_at_finish(store: MemoryStorage) -> None:
    """stride = 2 blocks: a decoded block that fills less than a stride is not copied
    while decoding, and goes out when the request finishes (F12); request_finished
    holds the blocks (True) until that copy is delivered, then the workers report the
    request in finished_sending and its blocks are freed."""
    rig = Rig(store, stride=2 * BS)
    try:
        req = FakeRequest("r", range(200, 204))  # one block: copied at prefill
        rig.add(req)
        assert len(rig.step().copies) == 1
        for _ in range(5):  # tokens 4..8 computed: block 1 is full, no stride yet
            assert rig.step().copies == []
        rig.settle()
        assert rig.finish("r") is True
        plan = rig.step_idle()
        assert [c.device_pages for c in plan.copies] == [[rig.blocks["r"][1]]]
        assert "r" in rig.held
        rig.settle()
        assert rig.sent == ["r"] and "r" not in rig.blocks
        assert _stored(store, _keys(req, 2)) == [True, True]
        rig.planner.check_invariants()
    finally:
        rig.close()


def test_request_finished_is_false_when_no_copy_reads_the_blocks(rig: Rig) -> None:
    """Delay-free: once every copy of a request is delivered, request_finished returns
    False (vLLM frees at once) and nothing is reported in finished_sending."""
    req = FakeRequest("r", range(300, 305))
    rig.add(req)
    rig.step()
    rig.settle()
    assert rig.finish("r") is False
    rig.settle()
    assert rig.sent == []


def test_a_copy_is_submitted_after_the_forward_wrote_the_block(store: MemoryStorage) -> None:
    """F19: the plan of a step carries copies of the blocks that step computes; the
    worker submits none of them before the forward (handle_preemptions and
    start_load_kv run before it) and all of them in wait_for_save; what is stored is the
    KV the forward computed, never the zeros the block held before."""
    rig = Rig(store)
    mover = rig.movers[0]
    submitted: list[object] = []
    submit = mover.backend.submit

    def spy(t: Transfer) -> None:
        submitted.append(t)
        submit(t)

    mover.backend.submit = spy  # type: ignore[method-assign]
    try:
        req = FakeRequest("r", range(400, 404))
        rig.add(req)
        rig._alloc("r", 4)
        plan = rig.planner.step([("r", 4)], lambda rid: rig.blocks[rid])
        assert len(plan.copies) == 1
        mover.fence(plan)
        mover.start(plan)
        assert submitted == []  # before the forward: nothing may read the block
        b = rig.blocks["r"][0]
        for layer, kv in enumerate(rig.kv[0]):  # the forward
            for p in range(4):
                kv[b, :, p, :] = kv_value(req.all_token_ids, p, 0, layer)
        mover.save(plan)
        assert len(submitted) == 1
        req.num_computed_tokens = 4
        rig.settle()
        import asyncio

        (page,) = asyncio.run(store.get(_keys(req, 1)))
        assert page == b"".join(t.numpy().tobytes() for t in rig.block_kv(0, b))
        assert any(page[i] for i in range(len(page)))
    finally:
        rig.close()


def _blocked_copies(rig: Rig) -> tuple[threading.Event, threading.Event]:
    """Hold every copy of rank 0 until ``go`` is set; ``copied`` is set after one ran."""
    go, copied = threading.Event(), threading.Event()

    def before(t: object) -> None:
        assert go.wait(30)

    hooks = rig.movers[0].backend.hooks  # type: ignore[attr-defined]
    hooks.before, hooks.after = before, lambda t: copied.set()
    return go, copied


def test_preemption_waits_for_in_flight_copies_and_discards_them(store: MemoryStorage) -> None:
    """A request preempted with a copy in flight: its lifecycle is aborted, the next
    plan fences the copy, the worker's fence returns only after the copy finished (so
    no copy reads a block the step's forward reuses), and the chunk is never stored."""
    rig = Rig(store)
    go, copied = _blocked_copies(rig)
    try:
        req = FakeRequest("r", range(500, 504))
        rig.add(req)
        first = rig.step()
        (copy,) = first.copies
        rig.preempt("r")
        lc = rig.planner.lifecycle("r")
        assert lc is not None
        plan = rig.planner.step([], lambda rid: [], ["r"])
        assert plan.flush == [copy.id]
        assert lc.aborted
        order: list[str] = []
        fence = threading.Thread(target=lambda: (rig.movers[0].fence(plan), order.append("fenced")))
        fence.start()
        assert fence.is_alive()  # the copy cannot finish before go is set
        order.append("released")
        go.set()
        fence.join(30)
        assert order == ["released", "fenced"] and copied.is_set()
        rig.settle()
        assert lc.released
        assert _stored(store, _keys(req, 1)) == [False]
        rig.planner.check_invariants()
    finally:
        go.set()
        rig.close()


def test_abort_mid_copy_holds_the_blocks_and_stores_nothing_of_the_chunk(store: MemoryStorage) -> None:
    """An aborted request with a copy in flight: request_finished returns True (the
    copy still reads the blocks), the copy's result is discarded (nothing stored), and
    the workers release the request once the copy was delivered."""
    rig = Rig(store)
    go, _ = _blocked_copies(rig)
    try:
        req = FakeRequest("r", range(600, 604))
        rig.add(req)
        rig.step()
        assert rig.finish("r", aborted=True) is True
        rig.step_idle()
        assert rig.sent == [] and "r" in rig.blocks
        go.set()
        rig.settle()
        assert rig.sent == ["r"] and "r" not in rig.blocks
        assert _stored(store, _keys(req, 1)) == [False]
    finally:
        go.set()
        rig.close()


def test_two_ranks_a_copy_counts_done_when_both_reported(store: MemoryStorage) -> None:
    """Tensor parallelism: each rank stores its shard under its own suffixed key; the
    planner delivers a copy only once both ranks reported it, and a page counts as
    stored only when both shards are."""
    rig = Rig(store, world_size=2)
    try:
        req = FakeRequest("r", range(700, 705))
        rig.add(req)
        plan = rig.step()
        (copy,) = plan.copies
        from kvoffload.integrations.vllm_plan import RankReport

        rig.planner.apply(RankReport(copies={copy.id: (1, None)}))
        assert copy.id in rig.planner.core.inflight  # one rank is not enough
        rig.settle()
        key = _keys(req, 1)[0]
        assert _stored(store, [key + "_0_2", key + "_1_2", key]) == [True, True, False]
        assert rig.add(FakeRequest("s", [*range(700, 705), 1, 2, 3]), load=True) == BS
    finally:
        rig.close()


def test_multimodal_requests_are_neither_stored_nor_loaded(rig: Rig, store: MemoryStorage) -> None:
    """A multimodal request is refused (its keys would not cover its images): no copy,
    no lookup."""
    req = FakeRequest("m", range(800, 809), mm=True)
    assert rig.add(req) == 0
    rig.step()
    rig.step()
    rig.settle()
    assert not any(p.copies for p in rig.plans) and rig.lookups == []
    assert rig.finish("m") is False


def test_a_failing_store_lookup_is_a_miss(rig: Rig) -> None:
    """get_num_new_matched_tokens never raises into vLLM: a store error counts as 0."""

    def broken(keys: list[str]) -> int:
        raise OSError("store down")

    rig.planner.lookup = broken
    req = FakeRequest("r", range(900, 913))
    rig.planner.add(req)
    assert rig.planner.matched(req, 0) == 0


def test_a_write_the_store_confirmed_in_part_counts_only_the_confirmed_prefix() -> None:
    """F34 through the connector: the prefill copies three blocks as one chunk; the
    store never confirms the second block's page (it stores the first and third). The
    worker reports the pages it stored from the chunk's start, and the scheduler's core
    counts exactly that prefix stored - not the chunk, not nothing - and a later lookup
    loads only it."""
    from collections.abc import Sequence

    from kvoffload.errors import PartialWriteError

    req = FakeRequest("r", range(900, 913))  # three whole blocks and one token

    class Refusing(MemoryStorage):
        refused = _keys(req, 3)[1]

        async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
            ok = [k != self.refused for k in keys]
            self.pages.update((k, bytes(p)) for k, p, good in zip(keys, pages, ok, strict=True) if good)
            if not all(ok):
                raise PartialWriteError("scripted: one page refused", ok)

    store = Refusing()
    rig = Rig(store, stride=3 * BS)
    try:
        rig.add(req)
        plan = rig.step()
        assert [len(c.device_pages) for c in plan.copies] == [3]
        rig.settle()
        s = rig.planner.core.statistics()
        assert (s.pages_stored, s.chunks_store_partial) == (1, 1)
        assert s.pages_stored + s.pages_store_failed + s.pages_store_unreachable == 3
        assert _stored(store, _keys(req, 3)) == [True, False, True]
        assert rig.add(FakeRequest("s", [*range(900, 913), 1, 2, 3]), load=True) == BS
    finally:
        rig.close()
