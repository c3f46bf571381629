"""Synchronous loads (``loads="inline"``, the default on vLLM's CPU build), on plain data.

vLLM's contract for a synchronous load (``get_num_new_matched_tokens`` returns
``(n, False)``): the request is scheduled in the step that allocates its blocks, with
the loaded tokens counted as computed; the worker loads in ``start_load_kv``, before
that step's forward; the request is never reported in ``finished_recving``; blocks that
did not load are reported in ``get_block_ids_with_load_errors`` in that same step, and
vLLM then drops the step's output of the request and recomputes from the first bad
block (``_update_requests_with_invalid_blocks``).

What must hold: the forward of the loading step sees the loaded KV (one step, not two,
to the first token); a short load (a corrupt or missing page, a load the core refused)
is reported in that step and recomputed, and nothing computed in that step on top of it
is ever stored (F38: the blocks after a bad page were computed from wrong KV); every
rank loads before its forward (tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from connector_fakes import BS, FakeRequest, Forwarding, Rig

from kvoffload.abc import Storage
from kvoffload.integrations.vllm_keys import page_keys, request_seed
from kvoffload.storage.file import FileStorage

PROMPT = list(range(2000, 2013))  # 3 whole blocks + 1: stored with 3 decoded tokens


def _store_prompt(root: Path, world_size: int = 1) -> None:
    rig = Rig(FileStorage(root), world_size=world_size)
    try:
        rig.add(FakeRequest("a", PROMPT))
        for _ in range(3):
            rig.step()
        rig.finish("a")
        rig.settle()
    finally:
        rig.close()


class _Puts(Forwarding):
    """A store that records every key written."""

    name = "puts"

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.keys: list[str] = []

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        self.keys += list(keys)
        await self.inner.put(keys, pages)


def _request() -> FakeRequest:
    # the stored prompt's 3 blocks, then 4 tokens of its own: block 3 fills in the loading step
    return FakeRequest("b", [*PROMPT[:12], 5, 6, 7, 8])


def _expected(rig: Rig, rid: str, tokens: list[int], n_blocks: int, rank: int = 0) -> None:
    from connector_fakes import kv_value

    for i in range(n_blocks):
        b = rig.blocks[rid][i]
        for layer, kv in enumerate(rig.kv[rank]):
            for slot in range(BS):
                want = kv_value(tokens, i * BS + slot, rank, layer)
                got = kv[b, :, slot, :]
                assert bool((got == want).all()), f"rank {rank} block {i} slot {slot} layer {layer}"


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_sync_load_feeds_the_forward_of_the_step_that_loads_it(tmp_path: Path, world_size: int) -> None:
    """One step: the plan carries the load (synchronous) and the request's remaining
    tokens; every rank loads before its forward; the step samples the first token; the
    request is never in finished_recving; the loaded and computed blocks hold the KV
    computing would write, and the block the step filled goes out in that step."""
    _store_prompt(tmp_path, world_size)
    rig = Rig(FileStorage(tmp_path), world_size=world_size, sync_loads=True)
    try:
        req = _request()
        assert rig.add(req) == 3 * BS
        assert req.status == "RUNNING" and req.num_computed_tokens == 3 * BS
        plan = rig.step()
        assert [(j.req_id, len(j.keys), j.sync) for j in plan.loads] == [("b", 3, True)]
        assert [len(c.device_pages) for c in plan.copies] == [1]  # block 3, computed this step
        assert rig.recvd == [] and rig.load_errors == set()
        assert req.num_computed_tokens == 16 and req.num_tokens == 17  # the first token sampled
        for r in range(world_size):
            _expected(rig, "b", req.all_token_ids, 4, r)
        rig.finish("b")
        rig.settle()
        assert rig.recvd == []
        rig.planner.check_invariants()
    finally:
        rig.close()


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_short_sync_load_is_recomputed_and_what_was_computed_on_it_never_stored(
    tmp_path: Path, damage: str
) -> None:
    """F38: page 1 of the 3 promised is corrupt or gone after the lookup. In the loading step blocks 1
    and 2 are reported as load errors (not a later step, never finished_recving); the
    request goes back to block 1 and the step's output of it is dropped; block 3, which
    that step computed on top of the bad KV, is never written to the store by it. The
    next step recomputes blocks 1..3, which are then stored, and every block holds the
    KV computing would write."""
    _store_prompt(tmp_path)
    req = _request()
    keys = page_keys(request_seed(None, req), req.all_token_ids, BS, 4)
    path = FileStorage(tmp_path).path(keys[1])
    store = _Puts(FileStorage(tmp_path))
    rig = Rig(store, sync_loads=True)
    try:
        assert rig.add(req) == 3 * BS
        if damage == "corrupt":  # after the lookup promised it
            data = bytearray(path.read_bytes())
            data[-3] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.unlink()
        plan = rig.step()
        assert [len(c.device_pages) for c in plan.copies] == [1]  # block 3's copy was planned
        assert rig.load_errors == set(rig.blocks["b"][1:3]) and rig.recvd == []
        assert req.num_computed_tokens == BS and req.num_tokens == 16  # truncated, nothing sampled
        rig.settle()
        assert keys[3] not in store.keys, "a block computed on a failed load was stored"
        rig.step()  # recomputes blocks 1..3
        assert req.num_computed_tokens == 16 and req.num_tokens == 17
        _expected(rig, "b", req.all_token_ids, 4)
        rig.finish("b")
        rig.settle()
        assert keys[3] in store.keys and keys[1] in store.keys  # the recomputed blocks went out
        rig.planner.check_invariants()
    finally:
        rig.close()


def test_a_sync_load_the_core_refuses_is_every_block_an_error_in_that_step(tmp_path: Path) -> None:
    """The core refuses to begin the load (a broken core part raises): the workers still
    report the job in that step with every promised block a load error, the request
    recomputes from block 0, nothing computed in the loading step is stored, and
    nothing raises into vLLM."""
    _store_prompt(tmp_path)
    store = _Puts(FileStorage(tmp_path))
    rig = Rig(store, sync_loads=True)
    try:

        def refuse(*args: object, **kwargs: object) -> object:
            from kvoffload.errors import PageError

            raise PageError("refused")

        rig.planner.core.load_begin = refuse  # type: ignore[method-assign]
        req = _request()
        keys = page_keys(request_seed(None, req), req.all_token_ids, BS, 4)
        assert rig.add(req) == 3 * BS
        rig.step()
        assert rig.load_errors == set(rig.blocks["b"][:3]) and rig.recvd == []
        assert req.num_computed_tokens == 0 and req.num_tokens == 16
        rig.settle()
        assert keys[3] not in store.keys
        rig.step()
        _expected(rig, "b", req.all_token_ids, 4)
        assert rig.planner.matched(req, 0) == 0  # not promised again (F38)
        rig.finish("b")
        rig.settle()
        rig.planner.check_invariants()
    finally:
        rig.close()
