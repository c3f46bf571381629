"""vLLM's KV connector on kvoffload's lifecycles: ``KVOffloadConnector``.

One config line, nothing else in vLLM changes::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=...,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"storage": "kv-store/",  # dir or URL
                                       "namespace": None,       # tenant / model
                                       "host_pages": None},     # optional
        ),
    )

``kv_connector_extra_config`` keys (:class:`~kvoffload.integrations.vllm_settings.Settings`;
an unknown key is refused):

- ``storage`` (required): a directory (``"kv-store/"``, ``"file:///..."``), a
  ``redis://`` URL, or ``"memory"`` (one process only);
- ``namespace``: seeds every page key; another namespace's pages are invisible (F22);
- ``host_pages``: host staging pages per worker, shared by stores and loads (default a
  quarter of vLLM's blocks, 64 to 4096, at most 1 GiB);
- ``stride``: tokens per copy while decoding, a multiple of the block size (default one
  block: each block goes out as soon as it is full);
- ``lookup_timeout_s`` (5): the most one store lookup waits (then a miss);
  ``io_timeout_s`` (30): the most one load's read, or the preemption fence, waits;
- ``tp_keys`` (``"rank"``): each tensor-parallel rank stores its shard of a page under
  the page key suffixed ``_<rank>_<size>``; a page counts as stored when every rank's is;
- ``on_load_error`` (``"recompute"``): the connector sets vLLM's
  ``kv_load_failure_policy`` to ``"recompute"`` (vLLM's default, ``"fail"``, fails the
  request when a load fails); ``"fail"`` leaves vLLM's policy as configured.
- ``loads`` (``"auto"``): how a load runs: ``"inline"``, synchronous (vLLM schedules
  the request in the step that allocates its blocks; each worker reads and copies in
  ``start_load_kv``, before that step's forward), ``"thread"``, asynchronous (on a load
  thread; the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` until
  ``finished_recving``); ``"auto"``: inline where the KV is in host memory (vLLM's CPU
  build), a thread on a GPU (see
  :attr:`~kvoffload.integrations.vllm_settings.Settings.loads`).

Per request, ``SamplingParams(extra_args={"kv_transfer_params": {"kvoffload": {...}}})``:
``"store": False`` (nothing of it is offloaded; it still loads), ``"load": False`` (the
store is not asked for it; it is still stored); anything else there is logged once and
left at its default (:func:`~kvoffload.integrations.vllm_plan.request_params`).

What runs where. The scheduler side (role SCHEDULER, the EngineCore process) is a
:class:`~kvoffload.integrations.vllm_plan.Planner`: one kvoffload lifecycle per request,
which decides every copy, storage write and load, and when vLLM may have a request's
blocks back; it asks the store only how many leading pages it has. The worker side
(role WORKER, each rank) is a :class:`~kvoffload.integrations.vllm_worker.Mover`: vLLM's
KV tensors, the host pool, the copier, the storage writer and the load thread. Between
them travel plain data only: a :class:`~kvoffload.integrations.vllm_messages.StepPlan` in
the connector metadata, a :class:`~kvoffload.integrations.vllm_messages.RankReport` in the
worker metadata (vLLM merges the ranks' with :meth:`KVOffloadWorkerMetadata.aggregate`;
a job counts done when every rank reported it), ``finished_sending`` /
``finished_recving`` and the blocks of failed loads. Page size is vLLM's block size;
keys are kvoffload's chain (:mod:`~kvoffload.integrations.vllm_keys`), never vLLM's
per-process block hashes.

A request inside vLLM:

1. ``get_num_new_matched_tokens``: the store's leading whole blocks beyond vLLM's own
   prefix hit, never the last prompt token (vLLM computes it to sample); synchronous
   or asynchronous as ``loads`` says.
2. ``update_state_after_alloc``: a load into the blocks vLLM allocated; each worker
   reads the store into host pages and copies them into the blocks (one job).
   Synchronous: in ``start_load_kv`` of the step that schedules the request, before its
   forward; blocks that did not load are reported in that step's
   ``get_block_ids_with_load_errors``, and vLLM drops the step's output of the request
   and recomputes from the first bad block (the lifecycle admitted on top of the load
   is aborted: nothing computed on it is stored, F38). Asynchronous: on the load
   thread; the request is reported in ``finished_recving`` - failed, short or cancelled
   loads too, their unloaded blocks in ``get_block_ids_with_load_errors`` so vLLM
   recomputes them.
3. Every step it is scheduled: its lifecycle is extended by the tokens whose KV the step
   computes; each newly full block (stride) goes out while it decodes: copied after the
   step's forward (``wait_for_save``), written to the store from the host pool.
4. ``request_finished``: the page-aligned tail goes out; it returns ``True`` (vLLM holds
   the blocks) only while a copy still reads them, and the workers report the request
   in ``finished_sending`` once its lifecycle is RELEASED (kvoffload's delay-free
   release); an abort mid-load cancels the load.

The fence (why delay-free, not vLLM's). vLLM's ``OffloadingConnector`` frees a finished
request's blocks at once and, when the scheduler hands one of them to another request
while its store is still pending, makes the workers wait for that store before the
step's forward (``jobs_to_flush``). That costs no block-holding but a synchronous wait
on the forward path exactly when blocks are scarce, and it needs a per-block reverse
index. kvoffload's lifecycle already knows when the last copy reading a request's
blocks is delivered, so the connector holds only those requests' blocks, only that
long (usually a step or two), and nothing on the forward path ever waits for a finished
request's copy. Preemption is the one place vLLM frees blocks behind a request's back
(before a copy may have finished): there the connector fences as vLLM does - the
preempted request's in-flight copies are waited for in ``handle_preemptions``, before
the forward can overwrite the blocks - and aborts its lifecycle.

Refused, with a clear error at start: hybrid models (more than one KV cache group),
Mamba / sliding-window / chunked-local / MLA attention (any spec but plain full
attention), pipeline parallelism, a ``kv_role`` other than ``"kv_both"``, and KV
tensor layouts it does not know. Refused per request (computed as without the
connector, logged once): multimodal requests and prompts given as embeddings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.request import RequestStatus

from kvoffload.core.events import logger
from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm_messages import RankReport, StepPlan
from kvoffload.integrations.vllm_plan import Planner
from kvoffload.integrations.vllm_settings import Settings
from kvoffload.integrations.vllm_worker import Mover, PrefixLookup, block_tensors, open_store, rank_stores
from kvoffload.pools import HostPool
from kvoffload.storage.writer import ThreadWriter, WritePolicy

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvoffload.abc import Storage

__all__ = [
    "KVOffloadConnector",
    "KVOffloadConnectorMetadata",
    "KVOffloadWorkerMetadata",
    "check_kv_cache_config",
    "kv_events_enabled",
]


@dataclass
class KVOffloadConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped to mypy here
    """Scheduler -> workers, one step: the planner's :class:`StepPlan`."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """A worker -> the scheduler: its :class:`RankReport` since its last one."""

    report: RankReport = field(default_factory=RankReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Both ranks' reports as one (each job's rank count added up)."""
        assert isinstance(other, KVOffloadWorkerMetadata)
        return KVOffloadWorkerMetadata(self.report.merge(other.report))


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (``kv_events_config.enable_kv_cache_events``):
    only then does the connector record its own."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def check_kv_cache_config(kv_cache_config: Any) -> Any:
    """The one KV cache group's spec, or :class:`~kvoffload.ConfigError` naming why the
    model's KV cache is refused (see the module doc)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if len(groups) != 1:
        raise ConfigError(
            f"KVOffloadConnector supports one KV cache group (plain full attention); this model has "
            f"{len(groups)} (a hybrid model: Mamba, sliding-window or mixed attention is refused)"
        )
    spec = groups[0].kv_cache_spec
    if (
        type(spec) is not FullAttentionSpec
        or getattr(spec, "sliding_window", None) is not None
        or getattr(spec, "attention_chunk_size", None) is not None
    ):
        raise ConfigError(
            f"KVOffloadConnector supports plain full attention only; this model's KV cache is "
            f"{type(spec).__name__} (sliding-window, chunked-local, MLA, Mamba and other layouts are refused)"
        )
    return spec


class KVOffloadConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvoffload as a vLLM KV connector (see the module doc)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.settings = Settings.from_extra(dict(ktc.kv_connector_extra_config or {}))
        if ktc.kv_role != "kv_both":
            raise ConfigError(
                f"KVOffloadConnector needs kv_role='kv_both' (it stores and loads), got {ktc.kv_role!r}"
            )
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size != 1:
            raise ConfigError(
                "KVOffloadConnector does not support pipeline parallelism (pipeline_parallel_size > 1)"
            )
        self.tp_size = int(par.tensor_parallel_size)
        spec = check_kv_cache_config(kv_cache_config)
        self.block_size = int(spec.block_size)
        assert kv_cache_config is not None
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        # host pages: the same number on the scheduler and on every worker
        block_bytes = int(spec.page_size_bytes) * len(self.layer_names)  # one rank's
        self.host_pages = self.settings.host_pages_for(self.num_blocks, block_bytes)
        # sync_loads: loads run in start_load_kv before the forward of the step that
        # schedules their request (get_num_new_matched_tokens says (n, False)).
        device = str(getattr(vllm_config.device_config, "device_type", "") or "")
        self.sync_loads = self.settings.sync_loads(device)
        self.planner: Planner | None = None
        self.mover: Mover | None = None
        self._io: ThreadWriter | None = None
        self._prefix: PrefixLookup | None = None  # the scheduler's lookup (on _io, or a thread of its own)
        self._stores: list[Storage] = []
        if role == KVConnectorRole.SCHEDULER:
            if self.settings.on_load_error == "recompute" and ktc.kv_load_failure_policy != "recompute":
                ktc.kv_load_failure_policy = "recompute"  # read by the scheduler right after this
                logger.info("vllm.load_failure_policy", policy="recompute")
            store = open_store(self.settings.storage)
            self._store_name = str(getattr(store, "name", type(store).__name__.lower()))
            self._stores = rank_stores(store, self.tp_size)
            meta = HostPool.new(1, (1,), "uint8", buffer=torch.empty(0, device="meta"))
            self._io = ThreadWriter(store, meta, WritePolicy())
            self._io.start()
            self._prefix = PrefixLookup(self._stores, self._io, self.settings.lookup_timeout_s)
            max_len = getattr(vllm_config.model_config, "max_model_len", None)
            self.planner = Planner(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                host_pages=self.host_pages,
                lookup=self._lookup,
                world_size=self.tp_size,
                stride=self.settings.stride,
                namespace=self.settings.namespace,
                max_blocks=None if max_len is None else math.ceil(max_len / self.block_size) + 1,
                kv_events=kv_events_enabled(vllm_config),
                page_bytes=block_bytes * self.tp_size,
                sync_loads=self.sync_loads,
            )
            self.hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None) or self.block_size)
            from kvoffload.integrations.vllm_metrics import StatsClock

            self._stats = StatsClock(time.monotonic)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a dropped store is a future miss (as vLLM's own
        OffloadingConnector)."""
        return False

    # --- scheduler side -----------------------------------------------------------------

    def _lookup(self, keys: list[str]) -> int:
        """How many leading ``keys`` every rank's store has; bounded by lookup_timeout_s."""
        assert self._prefix is not None
        return self._prefix(keys)

    def _plan(self) -> Planner:
        assert self.planner is not None, "a scheduler-side call on the worker's connector"
        return self.planner

    def on_new_request(self, request: Request) -> None:
        self._plan().add(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n = self._plan().matched(request, num_computed_tokens)
        return n, n > 0 and not self.sync_loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        self._plan().start_load(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        planner = self._plan()
        manager = self._kv_cache_manager
        assert manager is not None, "bind_kv_cache_manager was not called"

        def block_ids(rid: str) -> list[int]:
            return list(manager.get_block_ids(rid)[0])

        plan = planner.step(
            scheduler_output.num_scheduled_tokens.items(), block_ids, scheduler_output.preempted_req_ids or ()
        )
        return KVOffloadConnectorMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVOffloadWorkerMetadata):
            self._plan().apply(meta.report)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        return self._plan().finished(request, aborted), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The pages the store confirmed and the pages a load found gone since the last
        call, as vLLM's ``BlockStored`` / ``BlockRemoved`` under vLLM's block hashes
        (:mod:`~kvoffload.integrations.vllm_events`); vLLM's scheduler publishes them with
        its own (``kv_events_config``). Empty unless KV cache events are enabled."""
        planner = self.planner
        if planner is None or planner.kv_events is None or not len(planner.kv_events):
            return ()
        from kvoffload.integrations.vllm_events import vllm_events

        return vllm_events(
            planner.kv_events,
            block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            request_of=planner.request,
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler side: a cumulative snapshot of the planner's core for vLLM's stats
        (:mod:`~kvoffload.integrations.vllm_metrics`), at most once a second and once when
        the work is done; ``None`` otherwise and on the workers (they keep no figures)."""
        planner = self.planner
        if planner is None:
            return None
        return self._stats.take(planner.core, planner.busy, self._store_name)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """The stats vLLM's loggers rebuild from the data the scheduler side sent."""
        from kvoffload.integrations.vllm_metrics import KVOffloadConnectorStats

        return KVOffloadConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """The ``kvoffload_*`` metrics on vLLM's Prometheus setup (its API server's
        ``/metrics``), with vLLM's labels (``model_name``, ``engine``)."""
        from kvoffload.integrations.vllm_metrics import KVOffloadPromMetrics

        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_push_work(self) -> bool:
        """Copies, writes or loads in flight, or held requests: vLLM keeps stepping
        (also while shutting down), so what was copied reaches the store."""
        return self.planner is not None and self.planner.busy

    # --- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen: set[int] = set()
        tensors: list[torch.Tensor] = []
        names = [n for n in self.layer_names if n in kv_caches] or sorted(kv_caches)
        for name in names:
            kv = kv_caches[name]
            if kv.data_ptr() in seen:  # layers sharing one KV tensor: copied once
                continue
            seen.add(kv.data_ptr())
            tensors += block_tensors(kv, self.num_blocks, self.block_size, name)
        store: Storage | None = open_store(self.settings.storage)
        if self.tp_size > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            store = rank_stores(store, self.tp_size)[get_tensor_model_parallel_rank()]  # type: ignore[arg-type]
        self.mover = Mover(
            tensors,
            block_size=self.block_size,
            host_pages=self.host_pages,
            storage=store,
            io_timeout_s=self.settings.io_timeout_s,
            inline_loads=False,  # a synchronous load runs inline; an asynchronous one on the thread
        )

    def _worker_plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVOffloadConnectorMetadata)
        return meta.plan

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.mover is not None and isinstance(kv_connector_metadata, KVOffloadConnectorMetadata):
            self.mover.fence(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._worker_plan()
        if self.mover is not None and plan is not None:
            self.mover.start(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole requests: done in start_load_kv (sync) or before scheduling

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # copies start after the whole forward (wait_for_save)

    def wait_for_save(self) -> None:
        plan = self._worker_plan()
        if self.mover is None or plan is None:
            return
        self.mover.start(plan)  # idempotent: when start_load_kv did not run
        ready = torch.cuda.current_stream() if self.mover.device.device.type == "cuda" else None
        self.mover.save(plan, ready)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.mover is None:
            return None, None
        sending, recving = self.mover.finished(self._worker_plan())
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.mover is None else self.mover.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.mover is None:
            return None
        report = self.mover.take_report()
        return None if report is None else KVOffloadWorkerMetadata(report)

    def shutdown(self) -> None:
        if self.mover is not None:
            self.mover.close()
        if self._prefix is not None:
            self._prefix.close()
            self._prefix = None
        if self._io is not None:
            self._io.stop()
            self._io.join(5.0)
            self._io = None
