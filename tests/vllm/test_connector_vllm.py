"""KVOffloadConnector against vLLM's real classes, without an engine (the vllm env).

A real ``VllmConfig`` (from ``EngineArgs`` on a tiny model directory), a real
``KVCacheConfig`` and ``KVCacheManager``, real ``Request`` and ``SchedulerOutput``
objects and vLLM's own ``KVOutputAggregator``; the scheduler-role and worker-role
connectors run in one process, in the order of vLLM's step. Also: the plain-data
tests' fakes have the real classes' attributes (STYLE 15, F28), and what the
connector refuses is refused at construction.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# vllm.v1, not vllm: without vLLM installed, "vllm" imports as this test directory
# (a namespace package: tests/ is on sys.path), which must never get an __init__.py.
pytest.importorskip("vllm.v1.request", reason="vLLM's real classes: run in the vllm environment (.venv-vllm)")

import torch
from connector_fakes import FakeRequest
from engine_run import TINY_LLAMA
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm import (
    KVOffloadConnector,
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
    check_kv_cache_config,
)
from kvoffload.integrations.vllm_plan import RankReport

BS = 32
NUM_BLOCKS = 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
MODEL = TINY_LLAMA  # the engine tests' tiny Llama (tests/vllm/engine_run.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(MODEL))
    return d


def _vllm_config(model_dir: Path, store: Path, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    ktc = KVTransferConfig(
        kv_connector="KVOffloadConnector",
        kv_connector_module_path="kvoffload.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"storage": str(store) + "/", "namespace": "t", "host_pages": 16, **extra},
    )
    args = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BS,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=1024,
        kv_transfer_config=ktc,
    )
    return args.create_engine_config()


def _kv_cache_config(spec: Any = None, groups: int = 1) -> KVCacheConfig:
    spec = spec or FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=spec) for _ in range(groups)
        ],
    )


class Engine:
    """The scheduler- and worker-role connectors, driven as vLLM's step drives them."""

    def __init__(self, vllm_config: Any) -> None:
        self.kvc = _kv_cache_config()
        self.sched = KVOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER, self.kvc)
        self.work = KVOffloadConnector(vllm_config, KVConnectorRole.WORKER, self.kvc)
        self.manager = KVCacheManager(
            self.kvc, max_model_len=1024, scheduler_block_size=BS, hash_block_size=BS, enable_caching=False
        )
        self.sched.bind_kv_cache_manager(self.manager)
        # vLLM's CPU attention layout: (num_blocks, kv_heads, block_size, 2 * head_size)
        self.kv = {name: torch.zeros(NUM_BLOCKS, 2, BS, 64) for name in LAYERS}
        self.work.register_kv_caches(self.kv)
        self.aggregator = KVOutputAggregator(1)
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.load_errors: set[int] = set()

    def step(
        self, scheduled: dict[str, int], preempted: set[str] | None = None
    ) -> KVOffloadConnectorMetadata:
        so = SchedulerOutput.make_empty()
        so.num_scheduled_tokens = dict(scheduled)
        so.total_num_scheduled_tokens = sum(scheduled.values())
        so.preempted_req_ids = preempted
        meta = self.sched.build_connector_meta(so)
        assert isinstance(meta, KVOffloadConnectorMetadata)
        w = self.work
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        w.start_load_kv(None)  # type: ignore[arg-type]
        for rid, n in scheduled.items():  # the forward
            req = self.requests[rid]
            blocks = self.manager.get_block_ids(rid)[0]
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                for i, name in enumerate(LAYERS):
                    self.kv[name][blocks[p // BS], :, p % BS, :] = float(req.all_token_ids[p] * 10 + i)
        w.wait_for_save()
        sending, recving = w.get_finished(set())
        out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        out.kv_connector_output = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        agg = self.aggregator.aggregate([out])
        assert agg is not None and agg.kv_connector_output is not None
        kvo = agg.kv_connector_output
        self.sched.update_connector_output(kvo)
        self.finished_sending |= kvo.finished_sending or set()
        self.finished_recving |= kvo.finished_recving or set()
        self.load_errors |= kvo.invalid_block_ids
        for rid, n in scheduled.items():
            self.requests[rid].num_computed_tokens += n
        return meta

    requests: dict[str, Request]

    def add(self, rid: str, prompt: list[int]) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=8), None)
        self.requests = getattr(self, "requests", {})
        self.requests[rid] = req
        self.sched.on_new_request(req)
        return req

    def settle(self) -> None:
        import time

        deadline = time.monotonic() + 20
        while self.sched.has_pending_push_work():
            assert time.monotonic() < deadline, "the connector did not settle"
            self.step({})
            assert self.work.mover is not None
            self.work.mover.wait_progress(0.05)

    def close(self) -> None:
        self.work.shutdown()
        self.sched.shutdown()


@pytest.fixture
def engines(model_dir: Path, tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    yield _vllm_config(model_dir, tmp_path / "store"), tmp_path / "store"


def test_the_fakes_have_the_real_classes_attributes() -> None:
    """STYLE 15: every attribute the plain-data tests' FakeRequest offers (and the
    connector reads) exists on vLLM's Request, with the same meaning."""
    real = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), None, cache_salt="s")
    fake = FakeRequest("r", [1, 2, 3], cache_salt="s")
    for name in ("request_id", "all_token_ids", "num_computed_tokens", "num_tokens", "num_prompt_tokens",
                 "lora_request", "cache_salt", "mm_features", "prompt_embeds", "status",
                 "kv_transfer_params"):  # fmt: skip
        assert hasattr(real, name), name
        assert hasattr(fake, name), name
    assert list(real.all_token_ids) == fake.all_token_ids and real.num_tokens == fake.num_tokens
    # a request's kv_transfer_params come from its SamplingParams(extra_args=), as the fake's are given
    asked = {"kvoffload": {"store": False}}
    with_params = Request(
        "p", [1], SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": asked}), None
    )
    assert with_params.kv_transfer_params == asked and real.kv_transfer_params is None
    params = inspect.signature(Request).parameters
    assert {"lora_request", "cache_salt", "mm_features", "prompt_embeds"} <= set(params)
    from vllm.v1.core.sched.output import SchedulerOutput as SO

    fields = set(SO.__dataclass_fields__)
    assert {"num_scheduled_tokens", "preempted_req_ids", "finished_req_ids"} <= fields
    # the Rig's synchronous loads (connector_fakes.Rig, sync_loads): vLLM runs start_load_kv
    # before the forward of a step with them, and truncates at the first bad block
    from vllm.v1.core.sched.scheduler import Scheduler

    assert "has_sync_kv_loads" in fields
    assert callable(getattr(Scheduler, "_update_requests_with_invalid_blocks", None))


def _store_a_prompt(cfg: Any) -> Request:
    """Engine A's connectors store a prompt's blocks and a decoded block; returns A's request."""
    a = Engine(cfg)
    prompt = [(5 * i) % 400 + 1 for i in range(70)]  # 2 whole blocks + 6
    try:
        req = a.add("a", prompt)
        assert a.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        a.manager.allocate_slots(req, 70)
        meta = a.step({"a": 70})
        assert [len(c.device_pages) for c in meta.plan.copies] == [2]
        for _ in range(26):  # decode: block 2 fills at token 95
            req.append_output_token_ids(9)
            a.manager.allocate_slots(req, 1)
            a.step({"a": 1})
        req.status = RequestStatus.FINISHED_STOPPED
        delay, _ = a.sched.request_finished(req, a.manager.get_block_ids("a")[0])
        a.settle()
        assert (delay and a.finished_sending == {"a"}) or not delay
    finally:
        a.close()
    return req


def _holds(b: Engine, rid: str, tokens: list[int], upto: int) -> None:
    ids = b.manager.get_block_ids(rid)[0]
    for i, name in enumerate(LAYERS):
        for p in range(upto):
            assert torch.all(b.kv[name][ids[p // BS], :, p % BS, :] == float(tokens[p] * 10 + i)), (name, p)


def test_store_then_a_fresh_connector_loads_it(model_dir: Path, tmp_path: Path) -> None:
    """Engine A's connectors store a prompt's blocks and a decoded block; fresh
    connectors (a new process would have nothing else) with ``loads="thread"`` find
    them, say the load is asynchronous, load them into the blocks vLLM's KVCacheManager
    allocated, report finished_recving, and the blocks hold what A computed."""
    req = _store_a_prompt(_vllm_config(model_dir, tmp_path / "store"))
    b = Engine(_vllm_config(model_dir, tmp_path / "store", loads="thread"))
    try:
        tokens = [*list(req.all_token_ids)[:96], 1, 2, 3]
        r2 = b.add("b", tokens)
        n, is_async = b.sched.get_num_new_matched_tokens(r2, 0)
        assert (n, is_async) == (96, True)
        blocks = b.manager.allocate_slots(r2, 0, num_external_computed_tokens=96, delay_cache_blocks=True)
        assert blocks is not None
        b.sched.update_state_after_alloc(r2, b.manager.get_blocks("b"), 96)
        b.settle()
        assert b.finished_recving == {"b"} and b.load_errors == set()
        _holds(b, "b", tokens, 96)
    finally:
        b.close()


def test_on_the_cpu_build_a_load_is_synchronous_in_the_step_that_schedules_it(
    model_dir: Path, tmp_path: Path
) -> None:
    """The default (``loads="auto"``) on vLLM's CPU build: ``get_num_new_matched_tokens``
    says ``(96, False)``; vLLM allocates the blocks and schedules the request's other
    tokens in the same step (the loaded ones counted computed); the worker loads in
    ``start_load_kv``, before that step's forward, so after the one step every block
    holds its KV (loaded, then computed on top) and the request is never in
    finished_recving, with no load error."""
    cfg = _vllm_config(model_dir, tmp_path / "store")
    assert cfg.device_config.device_type == "cpu"
    req = _store_a_prompt(cfg)
    b = Engine(cfg)
    try:
        tokens = [*list(req.all_token_ids)[:96], 1, 2, 3]
        r2 = b.add("b", tokens)
        assert b.sched.get_num_new_matched_tokens(r2, 0) == (96, False)
        blocks = b.manager.allocate_slots(r2, 3, num_external_computed_tokens=96)
        assert blocks is not None
        b.sched.update_state_after_alloc(r2, b.manager.get_blocks("b"), 96)
        r2.num_computed_tokens = 96  # vLLM's scheduler: local + external hit
        meta = b.step({"b": 3})
        assert [(j.req_id, j.sync) for j in meta.plan.loads] == [("b", True)]
        assert b.finished_recving == set() and b.load_errors == set()
        _holds(b, "b", tokens, 99)
        b.settle()
        assert b.finished_recving == set()
    finally:
        b.close()


def test_worker_metadata_aggregates_through_vllms_aggregator() -> None:
    """Two ranks' worker metadata through vLLM's KVOutputAggregator: one report with
    each job counted twice."""
    outs = []
    for _ in range(2):
        o = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        o.kv_connector_output = KVConnectorOutput(
            kv_connector_worker_meta=KVOffloadWorkerMetadata(RankReport(copies={5: (1, None)}))
        )
        outs.append(o)
    agg = KVOutputAggregator(2).aggregate(outs)
    assert agg is not None and agg.kv_connector_output is not None
    meta = agg.kv_connector_output.kv_connector_worker_meta
    assert isinstance(meta, KVOffloadWorkerMetadata) and meta.report.copies == {5: (2, None)}


def test_refused_at_construction(model_dir: Path, tmp_path: Path) -> None:
    """Hybrid models (two groups), sliding-window attention and unknown settings are
    refused with a ConfigError naming them; a load failure is set to recompute."""
    with pytest.raises(ConfigError, match="one KV cache group"):
        check_kv_cache_config(_kv_cache_config(groups=2))
    sw = SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64
    )
    with pytest.raises(ConfigError, match="SlidingWindowSpec"):
        check_kv_cache_config(_kv_cache_config(sw))
    with pytest.raises(ConfigError, match="unknown"):
        KVOffloadConnector(
            _vllm_config(model_dir, tmp_path, typo=1), KVConnectorRole.SCHEDULER, _kv_cache_config()
        )
    cfg = _vllm_config(model_dir, tmp_path)
    assert cfg.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default
    c = KVOffloadConnector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config())
    try:
        assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"
        assert c.requires_kv_delivery is False
    finally:
        c.shutdown()


def test_preemption_through_the_real_hooks_fences_the_copy(engines: tuple[Any, Path]) -> None:
    """A request preempted with a copy in flight (vLLM's KVCacheManager frees its
    blocks): build_connector_meta with the real SchedulerOutput's preempted_req_ids
    fences that copy, handle_preemptions returns only once it finished, and nothing of
    the aborted lifecycle is stored."""
    import threading

    cfg, store = engines
    e = Engine(cfg)
    go = threading.Event()
    mover = e.work.mover
    assert mover is not None

    def hold(t: object) -> None:
        assert go.wait(30)

    mover.backend.hooks.before = hold  # type: ignore[attr-defined]
    try:
        req = e.add("a", [(3 * i) % 300 + 1 for i in range(40)])  # one whole block + 8
        e.manager.allocate_slots(req, 40)
        first = e.step({"a": 40})
        (copy,) = first.plan.copies
        e.manager.free(req)
        req.status = RequestStatus.PREEMPTED
        so = SchedulerOutput.make_empty()
        so.preempted_req_ids = {"a"}
        meta = e.sched.build_connector_meta(so)
        assert isinstance(meta, KVOffloadConnectorMetadata) and meta.plan.flush == [copy.id]
        done: list[str] = []
        fence = threading.Thread(target=lambda: (e.work.handle_preemptions(meta), done.append("fenced")))
        fence.start()
        assert fence.is_alive()  # the copy is held: the fence waits for it
        go.set()
        fence.join(30)
        assert done == ["fenced"]
        e.settle()
        assert [p for p in store.rglob("*") if p.is_file()] == []  # the aborted chunk: never stored
        assert e.sched.planner is not None and not e.sched.planner.busy
    finally:
        go.set()
        e.close()
