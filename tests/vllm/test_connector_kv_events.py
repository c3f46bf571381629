"""KVOffloadConnector's KV events against vLLM's real classes (the vllm env; issue 24
point 3): ``take_events()`` returns vLLM's own ``BlockStored`` / ``BlockRemoved``.

What must hold: with vLLM's ``kv_events_config`` enabled, once every worker's store
confirmed a request's blocks the scheduler-side connector's ``take_events()`` yields
vLLM ``BlockStored`` events under vLLM's block hashes of those blocks (the request's
``block_hashes``, what vLLM's GPU events carry), with their parent, tokens, block size
and ``medium="STORAGE"`` - also for blocks confirmed after ``request_finished`` - and
they go through vLLM's ``KVEventBatch`` wire encoding; a load that finds a block gone
yields a ``BlockRemoved`` of that block's vLLM hash; with events disabled nothing is
recorded at all.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

# vllm.v1, not vllm: without vLLM installed, "vllm" imports as this test directory
# (a namespace package: tests/ is on sys.path), which must never get an __init__.py.
pytest.importorskip("vllm.v1.request", reason="vLLM's real classes: run in the vllm environment (.venv-vllm)")

import msgspec
from engine_run import TINY_LLAMA
from test_connector_vllm import BS, Engine, _vllm_config
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request, RequestStatus

from kvoffload.integrations.vllm_keys import page_keys, request_seed
from kvoffload.storage.file import FileStorage


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


def _config(model_dir: Path, store: Path, events: bool) -> Any:
    cfg = _vllm_config(model_dir, store)
    if events:
        cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return cfg


def _hashed_request(rid: str, prompt: list[int]) -> Request:
    """A Request with vLLM's block hasher, as EngineCore makes it when a connector is set."""
    init_none_hash(sha256)
    return Request(
        rid, prompt, SamplingParams(max_tokens=8), None, block_hasher=get_request_block_hasher(BS, sha256)
    )


def _add(e: Engine, req: Request) -> Request:
    e.requests = getattr(e, "requests", {})
    e.requests[req.request_id] = req
    e.sched.on_new_request(req)
    return req


def _events(e: Engine) -> list[Any]:
    return list(e.sched.take_events())


def test_confirmed_blocks_come_out_as_vllms_block_stored_under_vllms_hashes(
    model_dir: Path, tmp_path: Path
) -> None:
    """A prompt's two whole blocks, then a decoded third one confirmed after
    request_finished: BlockStored events under the request's vLLM block hashes, in
    vLLM's wire encoding; none before the store confirmed them."""
    eng = Engine(_config(model_dir, tmp_path / "store", events=True))
    prompt = [(7 * i) % 400 + 1 for i in range(70)]
    try:
        req = _add(eng, _hashed_request("a", prompt))
        eng.manager.allocate_slots(req, 70)
        meta = eng.step({"a": 70})  # the copy is planned and done; its write not yet confirmed
        assert [len(c.device_pages) for c in meta.plan.copies] == [2]
        assert _events(eng) == []
        for _ in range(26):  # decode: block 2 fills at token 95
            req.append_output_token_ids(9)
            eng.manager.allocate_slots(req, 1)
            eng.step({"a": 1})
        req.status = RequestStatus.FINISHED_STOPPED
        eng.sched.request_finished(req, eng.manager.get_block_ids("a")[0])
        got: list[Any] = _events(eng)
        deadline = time.monotonic() + 20
        while sum(len(e.block_hashes) for e in got) < 3:
            assert time.monotonic() < deadline, f"three blocks not announced: {got}"
            eng.step({})
            assert eng.work.mover is not None
            eng.work.mover.wait_progress(0.05)
            got += _events(eng)
        eng.settle()
        got += _events(eng)
        assert all(type(e) is BlockStored for e in got)
        hashes = [maybe_convert_block_hash(h) for h in req.block_hashes[:3]]
        assert [h for e in got for h in e.block_hashes] == hashes
        tokens = list(req.all_token_ids)
        first, *rest = got
        assert first.parent_block_hash is None and first.token_ids == tokens[: len(first.block_hashes) * BS]
        for e in rest:
            p0 = hashes.index(e.block_hashes[0])
            assert e.parent_block_hash == hashes[p0 - 1]
            assert e.token_ids == tokens[p0 * BS : (p0 + len(e.block_hashes)) * BS]
        for e in got:
            assert (e.block_size, e.medium, e.group_idx, e.lora_id) == (BS, "STORAGE", 0, None)
        wire = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=got))
        back = msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire)
        assert [e.block_hashes for e in back.events] == [e.block_hashes for e in got]
    finally:
        eng.close()


def test_a_load_that_finds_a_block_gone_comes_out_as_block_removed(model_dir: Path, tmp_path: Path) -> None:
    """Engine A stores three blocks; the store loses block 1 between B's lookup and its
    load: B's take_events() yields a BlockRemoved of block 1's vLLM hash."""
    store = tmp_path / "store"
    a = Engine(_config(model_dir, store, events=False))
    prompt = [(11 * i) % 400 + 1 for i in range(100)]  # 3 whole blocks + 4
    try:
        req = _add(a, _hashed_request("a", prompt))
        a.manager.allocate_slots(req, 100)
        a.step({"a": 100})
        req.status = RequestStatus.FINISHED_STOPPED
        a.sched.request_finished(req, a.manager.get_block_ids("a")[0])
        a.settle()
    finally:
        a.close()
    b = Engine(_config(model_dir, store, events=True))
    try:
        r2 = _add(b, _hashed_request("b", prompt))
        n, _ = b.sched.get_num_new_matched_tokens(r2, 0)
        assert n == 96
        key = page_keys(request_seed("t", r2), prompt, BS, 3)[1]
        FileStorage(store).path(key).unlink()  # the store evicted it meanwhile
        assert b.manager.allocate_slots(r2, 0, num_external_computed_tokens=96, delay_cache_blocks=True)
        b.sched.update_state_after_alloc(r2, b.manager.get_blocks("b"), 96)
        b.settle()
        got = _events(b)
        assert [type(e) for e in got] == [BlockRemoved]
        assert got[0].block_hashes == [maybe_convert_block_hash(r2.block_hashes[1])]
        assert got[0].medium == "STORAGE"
    finally:
        b.close()


def test_without_kv_events_config_nothing_is_recorded(model_dir: Path, tmp_path: Path) -> None:
    """vLLM's KV cache events off (the default): the planner subscribes nothing (the
    core's sink is its own, no chunk recorded) and take_events() is empty."""
    eng = Engine(_config(model_dir, tmp_path / "store", events=False))
    try:
        planner = eng.sched.planner
        assert planner is not None and planner.kv_events is None and not planner.core.kv.on
        req = _add(eng, _hashed_request("a", [3] * 70))
        eng.manager.allocate_slots(req, 70)
        eng.step({"a": 70})
        req.status = RequestStatus.FINISHED_STOPPED
        eng.sched.request_finished(req, eng.manager.get_block_ids("a")[0])
        eng.settle()
        assert _events(eng) == [] and planner.core.kv.chunks == {}
    finally:
        eng.close()
