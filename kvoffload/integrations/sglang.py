"""SGLang's ``DecodeKVCacheOffloadManager`` on kvoffload: a drop-in for the class the
decode scheduler owns (SGLang 0.5.23, ``python/sglang/srt/disaggregation/
decode_kvcache_offload_manager.py``), with the same constructor and scheduler-facing
methods.

It is a :class:`~kvoffload.SyncOffloadManager` in engine-owned mode: SGLang's per-layer
KV buffers are the device pages (``token_to_kv_pool_allocator.get_kvcache()``), page
ids come from SGLang's request rows (``req_to_token_pool.req_to_token``, read on the host
at most twice per scheduler iteration: once for the pages running requests enter, once
for the iteration's arrivals), the chain of
each request is seeded from ``req.extra_key`` / ``req.cache_salt``, the TP group makes
every rank release the same requests in the same call, and a finished request's KV is
released through SGLang's own path (the row's KV range freed, the prefix-cache lock
dropped, the request row freed) exactly once, after its last copy is acknowledged.

kvoffload imports no SGLang module: the objects the scheduler hands over are used by
the attributes and methods named below (``import kvoffload.integrations.sglang`` works
without SGLang). The settings SGLang's own manager reads from SGLang's published runtime
config (``runtime_context.get_schedule()``, ``get_memory()``, ``get_serving()``; the
stride through SGLang's ``envs``) are read from there when SGLang has imported it in
this process (its scheduler has) and no ``server_args`` is passed. The one exception:
with ``hicache_storage_backend`` set, :func:`sglang_l3_storage` builds SGLang's own L3
storage objects (importing SGLang's storage modules then), so SGLang's prefill side
reads what is stored (F30). The tests drive this
class with SGLang's real classes (tests/integrations/sglang_real.py) and with fakes of
the same shapes. docs/integrations/sglang.md has the one-line change in SGLang's
scheduler, what is the same and what differs.

Threading: construct it and call it from the scheduler's thread (the manager's owner
thread); nothing here starts an event loop.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from kvoffload.config import OffloadConfig
from kvoffload.core.events import logger
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.drivers.sync import SyncOffloadManager
from kvoffload.errors import ConfigError, PageError
from kvoffload.integrations.sglang_format import engine_kv_tensors
from kvoffload.integrations.sglang_metrics import export
from kvoffload.keys import namespace_seed, page_run_keys, validate_tokens

__all__ = ["DecodeKVCacheOffloadManager", "engine_kv_tensors", "sglang_l3_storage"]

#: SGLang's default directory of its file storage backend (``HiCacheFile``).
SGLANG_FILE_DIR = "/tmp/hicache"
_NO_ROW = (None, -1)


def sglang_l3_storage(
    backend: str,
    extra_config: Any,
    model_name: str | None,
    tp_rank: int,
    tp_size: int,
    mem_layout: str | None,
    kv_pool: Any,
    *,
    page_size: int,
    stride: int | None = None,
) -> Any:
    """The kvoffload store of SGLang's L3 storage ``backend`` (``--hicache-storage-backend``,
    with its extra config, ``served_model_name``, this rank of ``tp_size``,
    ``--hicache-mem-layout`` or ``None`` for SGLang's published one, the engine's KV
    pool): pages written through SGLang's own
    ``HiCacheStorage`` in SGLang's host-page layout, under SGLang's keys, so SGLang's
    prefill side reads them and kvoffload's lookup finds what SGLang stored
    (:func:`kvoffload.integrations.sglang_storage.sglang_storage`; the staging host pool
    holds one stride of pages). Raises :class:`~kvoffload.UnsupportedKVPool` for a
    layout it does not convert, naming the supported ones."""
    from kvoffload.integrations.sglang_storage import BATCH, sglang_storage

    staging = min(BATCH, max(1, (stride or page_size) // page_size))
    return sglang_storage(
        backend,
        extra_config,
        model_name,
        tp_rank,
        tp_size,
        mem_layout,
        kv_pool,
        page_size=page_size,
        staging_pages=staging,
    )


class _Entry:
    """kvoffload's state of one SGLang ``Req``, keyed by the Req object (never its rid):
    a reused rid is another Req and shares nothing."""

    __slots__ = (
        "ahead",
        "arrived",
        "base",
        "done",
        "edge",
        "finishing",
        "lc",
        "ref",
        "req",
        "resume",
        "row",
        "seed",
        "served",
    )

    def __init__(self, seed: str) -> None:
        # ref: the Req, weakly: once no lifecycle of it is live, a Req the scheduler drops
        #   leaves nothing here (its entry is forgotten; nothing else changes).
        self.ref: Callable[[], Any] = _nothing
        # req: the Req itself, held while a lifecycle of it is live (from admission to the
        #   end of the lifecycle that releases it), so no state change ever depends on
        #   when a collector runs (F31): a lifecycle ends only in a call, the same call on
        #   every TP rank. Invariant: (self.req is not None) == (self.lc is not None or
        #   self.finishing is not None)
        self.req: Any = None
        # lc: the live lifecycle, or None (not admitted yet, retracted, released).
        self.lc: Lifecycle | None = None
        # row: req.kv.req_pool_idx when lc was admitted; another value means the engine
        #   took the row back (retraction) and lc's pages are no longer the request's.
        self.row: Any = None
        # base: tokens before lc's first token (page-aligned, stored before lc began).
        #   Invariant: base + lc.committed == tokens of the Req that lc has been told of.
        self.base = 0
        # seed: the namespace chain seed of the Req ("" for none).
        self.seed = seed
        # resume: (tokens stored, chain key) of a retracted Req, for its next admission.
        self.resume: tuple[int, str] | None = None
        # finishing: the lifecycle whose release is the Req's release (finish was called).
        self.finishing: Lifecycle | None = None
        # done: SGLang's release path ran for this Req. Invariant: it runs at most once.
        self.done = False
        # served: the scheduler iteration (manager._step) of the Req's last call.
        self.served = -1
        # ahead: (iteration, first page index, slots) - the row's page-start slots read
        #   in that iteration's one batched read, for the pages the Req enters in it; used
        #   only in that iteration and only while the row is the Req's. Invariant:
        #   self.ahead is None or (self.ahead[0] <= manager._step and self.row is not None)
        self.ahead: tuple[int, int, list[int]] | None = None
        # edge: the tokens up to the next page lc has no page id of yet (a token beyond it
        #   starts a new page). Invariant: lc is None or
        #   self.edge == -(-(self.base + lc.committed) // page_size) * page_size
        self.edge = 0
        # arrived: the tokens an arrival (admitted in this iteration, unfinished) has
        #   committed but not told yet (0: none): told, their page ids read together with
        #   every other arrival's, before the next check_offload_progress delivers
        #   anything. Invariant: self.arrived == 0 or (self.lc is not None and
        #   self.lc.committed == 0 and self in manager._arrivals)
        self.arrived = 0


class _Ongoing:
    """``len(manager.ongoing_offload)``: work only ``check_offload_progress`` moves on
    (SGLang's scheduler does not sleep while it is non-zero)."""

    __slots__ = ("_arrivals", "_mgr")

    def __init__(self, mgr: SyncOffloadManager, arrivals: list[Any]) -> None:
        self._mgr = mgr
        self._arrivals = arrivals

    def __len__(self) -> int:
        return self._mgr.outstanding + len(self._arrivals) if self._mgr.is_open else 0

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        return f"<ongoing_offload {len(self)}>"


def _stride_from_env(page_size: int) -> int:
    """SGLang's offload stride: ``SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE`` tokens rounded
    down to whole pages (at least one page); unset or not positive: one page. Read
    through SGLang's ``envs`` (``sglang.srt.environ``) as SGLang's manager reads it, when
    SGLang has imported it in this process (a value that is not an int: SGLang warns and
    takes the default); else from the environment (not an int: :class:`ConfigError`)."""
    environ = sys.modules.get("sglang.srt.environ")
    if environ is not None:
        value = environ.envs.SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE.get()
        if value is None or value <= 0:
            return page_size
        return max(page_size, int(value) // page_size * page_size)
    raw = os.environ.get("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", "").strip()
    if not raw:
        return page_size
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE={raw!r} is not an int") from None
    if value <= 0:
        return page_size
    return max(page_size, value // page_size * page_size)


def published_settings() -> Any:
    """The settings SGLang 0.5.23's own ``DecodeKVCacheOffloadManager.__init__`` reads
    from SGLang's published runtime config, as a ``ServerArgs``-shaped namespace:
    ``page_size`` (``get_schedule()``), ``hicache_storage_backend``,
    ``hicache_storage_backend_extra_config``, ``hicache_ratio``, ``hicache_size``,
    ``hicache_io_backend`` (``get_memory()``) and ``served_model_name``
    (``get_serving()``). ``None`` when SGLang's ``runtime_context`` is not imported in
    this process (SGLang's scheduler imports and publishes it before it builds the
    manager) or nothing is published there. Never imports SGLang."""
    rc = sys.modules.get("sglang.srt.runtime_context")
    if rc is None:
        return None
    try:
        schedule, memory, serving = rc.get_schedule(), rc.get_memory(), rc.get_serving()
    except ValueError:  # "config namespace ... not published": nothing to read
        return None
    return SimpleNamespace(
        page_size=schedule.page_size,
        hicache_storage_backend=memory.hicache_storage_backend,
        hicache_storage_backend_extra_config=memory.hicache_storage_backend_extra_config,
        hicache_ratio=memory.hicache_ratio,
        hicache_size=memory.hicache_size,
        hicache_io_backend=getattr(memory, "hicache_io_backend", None),
        served_model_name=serving.served_model_name,
    )


def _check_settings(settings: Any, page_size: int) -> None:
    """Refuse settings the integration cannot follow, naming them (nothing built yet):
    a published page size other than the allocator's page (decode context parallelism
    widens the allocator's page; SGLang keys pages on the published one), and a
    ``hicache_storage_backend_extra_config`` that is not JSON (SGLang refuses it too)."""
    if settings is None:
        return
    published = getattr(settings, "page_size", None)
    if type(published) is int and published != page_size:
        raise ConfigError(
            f"SGLang's page_size is {published} but token_to_kv_pool_allocator.page_size is "
            f"{page_size} (decode context parallelism?): not supported yet; the integration "
            "needs the allocator's page to be SGLang's page"
        )
    extra = getattr(settings, "hicache_storage_backend_extra_config", None)
    if extra:
        try:
            json.loads(extra)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"hicache_storage_backend_extra_config is not JSON ({exc}): {extra!r}"
            ) from None


class DecodeKVCacheOffloadManager:
    """SGLang's decode-side offload manager on kvoffload (see the module docstring).

    ``DecodeKVCacheOffloadManager(req_to_token_pool, token_to_kv_pool_allocator,
    tp_group, tree_cache)`` as SGLang's scheduler builds it; ``server_args`` (optional,
    fifth) stands in for SGLang's published runtime config, which is read otherwise
    (:func:`published_settings`: where SGLang's own manager reads it). Keyword-only
    extras: ``host_pages`` (default from ``hicache_size`` in GB, else
    ``hicache_ratio`` (2.0) times the device pool, as SGLang sizes its host pool),
    ``stride`` (default ``SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE``, else one page),
    ``storage`` (default from ``hicache_storage_backend``: SGLang's own L3 storage of
    that name, which SGLang's prefill side reads (:func:`sglang_l3_storage`); ``None``
    none; anything kvoffload's ``storage=`` takes), ``backend`` (default by the KV's device),
    ``on_host_full`` (``"wait"``: a chunk that finds the host pool full goes out when
    host pages return, as SGLang retries at the next step; ``"drop"``: counted and
    retried a stride later, lost at finish), ``host_wait_steps`` (``None``: the wait is
    unbounded; an int: a chunk that waited through more scheduler steps
    (``check_offload_progress`` calls) is dropped - never a bound in wall time, so TP
    ranks and slow steps see the same; what a finished request lost is logged with its
    rid and counted in ``statistics().pages_lost`` and ``chunks_expired``),
    ``drain_timeout_s`` (30 s: what ``drain_before_retraction`` and
    ``release_host_resources`` wait at most), ``release`` (SGLang's release path,
    ``release(req)``; the default is :meth:`release_request_kv`).

    Raises :class:`~kvoffload.UnsupportedKVPool` at construction for a pool it cannot
    offload (sliding-window, hybrid, NPU; see :func:`engine_kv_tensors`), and
    :class:`~kvoffload.ConfigError` for settings it cannot follow (SGLang's page size
    other than the allocator's, an extra storage config that is not JSON).
    """

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tp_group: Any,
        tree_cache: Any,
        server_args: Any = None,
        *,
        host_pages: int | None = None,
        stride: int | None = None,
        storage: Any = "server_args",
        backend: Any = None,
        on_host_full: str = "wait",
        host_wait_steps: int | None = None,
        drain_timeout_s: float | None = 30.0,
        release: Callable[[Any], object] | None = None,
        metrics: bool | None = None,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.server_args = server_args
        page_size = getattr(token_to_kv_pool_allocator, "page_size", None)
        if type(page_size) is not int or page_size < 1:
            raise ConfigError(
                f"token_to_kv_pool_allocator.page_size must be a positive int, got {page_size!r}"
            )
        # The allocator's page is the page every row range and key is cut on; SGLang's
        # page_size must be the same (_check_settings).
        self.page_size = page_size
        # settings: what SGLang's own manager reads (server_args when passed, else
        # SGLang's published runtime config; None when neither is there: defaults).
        self.settings = server_args if server_args is not None else published_settings()
        _check_settings(self.settings, page_size)
        self.kv_kind, device_kv = engine_kv_tensors(token_to_kv_pool_allocator.get_kvcache(), page_size)
        page_bytes = sum(int(t[0].numel() * t.element_size()) for t in device_kv)
        n_pages = int(device_kv[0].shape[0])
        if host_pages is None:
            host_pages = self._host_pages_from(self.settings, page_bytes, n_pages, page_size)
        self.offload_stride = _stride_from_env(page_size) if stride is None else stride
        self.tp_group = tp_group
        self.tp_world_size = self._world_size(tp_group)
        config = OffloadConfig(
            page_size=page_size,
            stride=self.offload_stride,
            device_pages=None,
            host_pages=host_pages,
            on_host_full=on_host_full,  # type: ignore[arg-type]  # OffloadConfig checks it
            # The host-full wait is counted in scheduler steps (check_offload_progress
            # calls), never in wall time: unbounded by default (a chunk waits until host
            # pages return; they return when copies and storage writes end).
            host_wait_s=None,
            host_wait_polls=host_wait_steps,
            drain_timeout_s=drain_timeout_s,
            # Under TP each rank holds its own heads' KV (keys suffixed per rank, as
            # SGLang's HiCacheFile does for MHA); MLA's latent KV is the same on every rank.
            tp_size=self.tp_world_size if self.tp_world_size > 1 else None,
            tp_keys="shared" if self.kv_kind == "mla" else "rank",
        )
        if storage == "server_args":
            storage = self._storage_from(self.settings)
        self._release_req = release if release is not None else self.release_request_kv
        self.manager = SyncOffloadManager(
            config,
            backend=backend if backend is not None else "auto",  # "auto" follows device_kv's device
            storage=storage,
            on_released=self._on_released,
            device_kv=device_kv,
            group=tp_group if self.tp_world_size > 1 else None,
        )
        # _entries: id(Req) -> _Entry, for Reqs alive (weakly held, strongly while a
        # lifecycle of theirs is live); _dead: entries whose Req was collected (appended by
        # the weakref callback, on any thread; forgotten on the scheduler's thread at its
        # next call - memory only: no lifecycle of a collected Req is live).
        self._entries: dict[int, _Entry] = {}
        self._dead: deque[tuple[int, _Entry]] = deque()
        # _running: lifecycle id -> entry, for each live lifecycle of an unfinished Req
        # (admission order, the same on every TP rank): where a row taken back is looked for.
        # Invariant: all(e.lc is not None and e.lc.id == k and e.finishing is None
        #   for k, e in self._running.items())
        self._running: dict[int, _Entry] = {}
        # _ending: lifecycles ended because the engine took their rows back while a copy
        # still read them (no drain first, F32): they hold their page ids until the copy
        # ends. Invariant: all(lc.aborted and not lc.released for lc in _ending.values())
        self._ending: dict[int, Lifecycle] = {}
        # _drained: drain_before_retraction ran; the next call looks for rows taken back.
        self._drained = False
        # _step: scheduler iterations so far (check_offload_progress calls); _read_at: the
        # iteration of the last batched read of req_to_token (_step_pages, _scan_reclaimed),
        # at most one per iteration. Invariant: self._read_at <= self._step
        self._step = 0
        self._read_at = -1
        # _arrivals: the entries admitted in this iteration whose tokens are not told yet
        #   (their page ids are read in one read at the next check_offload_progress, before
        #   it delivers: a copy starts at that poll either way). Invariant:
        #   all(e.arrived > 0 for e in self._arrivals)
        self._arrivals: list[_Entry] = []
        self.ongoing_offload = _Ongoing(self.manager, self._arrivals)
        self.manager.open()
        # _metrics: this rank's kvoffload_* series on SGLang's /metrics (sglang_metrics);
        # None unless metrics=True, or None and SGLang's enable_metrics.
        self._metrics = export(self.manager, self._tp_rank(tp_group), self.settings, metrics)

    # --- construction helpers ----------------------------------------------------------

    @staticmethod
    def _world_size(tp_group: Any) -> int:
        if tp_group is None:
            return 1
        size = getattr(tp_group, "size", None)
        if callable(size):
            return int(size())
        import torch.distributed as dist

        return int(dist.get_world_size(group=tp_group))

    @staticmethod
    def _host_pages_from(settings: Any, page_bytes: int, n_pages: int, page_size: int) -> int:
        """SGLang's host pool size (``HostKVCache.__init__``, mem_cache/pool_host/base.py),
        in whole pages: ``hicache_size`` GB when set (``int(size * 1e9 // bytes per
        token)`` tokens), else ``hicache_ratio`` (default 2.0) times the device pool's
        tokens (its ``n_pages`` rows less SGLang's padding page); plus the one page SGLang
        adds to an independent host pool (``page_num = size // page_size + 1``, every
        page of which it allocates)."""
        size_gb = getattr(settings, "hicache_size", 0) or 0
        if size_gb > 0:
            return int(size_gb * 1e9 // (page_bytes // page_size)) // page_size + 1
        ratio = getattr(settings, "hicache_ratio", 2.0) or 2.0
        return int((n_pages - 1) * page_size * ratio) // page_size + 1

    def _storage_from(self, server_args: Any) -> Any:
        """The store SGLang's config names (``hicache_storage_backend``; ``None``: none):
        SGLang's own L3 storage, which its prefill side reads (F30): see
        :func:`sglang_l3_storage`."""
        name = getattr(server_args, "hicache_storage_backend", None)
        if name is None:
            return None
        return sglang_l3_storage(
            name,
            getattr(server_args, "hicache_storage_backend_extra_config", None),
            getattr(server_args, "served_model_name", None),
            self._tp_rank(self.tp_group),
            self.tp_world_size,
            getattr(server_args, "hicache_mem_layout", None),  # None: SGLang's published one
            self.token_to_kv_pool_allocator.get_kvcache(),
            page_size=self.page_size,
            stride=self.offload_stride,
        )

    @staticmethod
    def _tp_rank(tp_group: Any) -> int:
        if tp_group is None:
            return 0
        rank = getattr(tp_group, "rank", None)
        if callable(rank):
            return int(rank())
        import torch.distributed as dist

        return int(dist.get_rank(group=tp_group))

    # --- SGLang's scheduler-facing methods ---------------------------------------------

    def offload_kv_cache(self, req: Any) -> bool:
        """Tell kvoffload the tokens ``req`` committed since the last call (after every
        decode step, for every running request, and at finish); a chunk goes out every
        ``offload_stride`` tokens. At finish (``req.finished()``) the page-aligned tail
        is flushed too and the request's release is deferred to its last copy's ack:
        returns True when it was deferred (the scheduler must not release the KV), False
        when there was nothing to defer (the scheduler calls
        :meth:`finalize_release_on_finish`). Before finish: True when a chunk went out.

        A page id the engine hands over for ``req`` that another request's lifecycle
        still holds means the engine took that request's row back without a drain
        (priority preemption, F32): that request is found, its lifecycle ended (waiting,
        at most ``drain_timeout_s``, for a copy still reading its rows), and the call
        goes on - one request's call never fails because of another's row."""
        if self._dead:
            self._reap()
        if self._drained:  # a retraction may have happened since: find it before using rows
            self._scan_reclaimed(read_ahead=True)
        try:
            return self._offload(req)
        except PageError:  # nothing changed: find the rows taken back, then once more
            if not self._free_taken_back():
                raise
            return self._offload(req)

    def _offload(self, req: Any) -> bool:
        """:meth:`offload_kv_cache`'s work; a :class:`~kvoffload.PageError` from it
        changed nothing (the claims are checked before anything is recorded)."""
        row = req.kv.req_pool_idx
        out = req.output_ids
        if row is None or row == -1 or not out:
            return False
        e = self._entries.get(id(req))
        if e is None or e.ref() is not req:
            e = self._entry(req)
        if e.done:
            return False
        if e.finishing is not None:  # finished before: its release still waits for an ack
            return True
        e.served = self._step
        if e.arrived:  # called twice in one iteration: the arrivals are told first
            self._tell_arrivals()
        lc = e.lc
        if lc is not None and e.row != row:
            self._reclaimed(e)
            lc = None
        n_origin = len(req.origin_input_ids)
        committed = n_origin + len(out) - 1  # the last output token's KV is not written yet
        if lc is None:
            lc = self._admit(e, req, row, committed)
            sent = lc.submitted > 0
        else:
            have = e.base + lc.committed
            before = lc.submitted
            if committed > have:
                if have >= n_origin:
                    new = out[have - n_origin : committed - n_origin]
                    if type(new) is not list:  # SGLang's array("q"): the core's fast path takes a list
                        new = list(new)
                else:  # admitted this far (the prompt's last, partial page): told now
                    new = [*req.origin_input_ids[have:], *out[: committed - n_origin]]
                ps = self.page_size
                if committed > e.edge:
                    lc.extend(new, pages=self._step_pages(e, row, have, committed))
                    e.edge = -(-committed // ps) * ps
                else:
                    lc.extend(new)
            sent = lc.submitted > before
        if not req.finished():
            return sent
        self._finishing(e, lc)
        lc.finish()  # flushes the page-aligned tail; may release at once (on_released)
        return not e.done

    def check_offload_progress(self) -> None:
        """Once per scheduler iteration, before batch selection: deliver the copies that
        completed (on every TP rank the same ones, agreed), hand copied pages to the
        storage tier, and release each finished request whose last copy is acknowledged
        (SGLang's release path). Never waits on the device or the store.

        First, a request whose row the engine took back since the last call (its
        ``req_pool_idx`` changed: retraction or preemption) has its lifecycle ended, so
        a copy of rows no longer its own is discarded, never stored (F32).

        Before anything, the requests that arrived in the iteration are told their
        tokens, their page ids read in one read (a copy starts at this poll either way)."""
        if self._arrivals:
            self._tell_arrivals()
        self._step += 1
        if self._drained:
            self._scan_reclaimed()
        elif self._running:
            self._rows_taken_back()
        self.manager.poll()
        if self._dead:
            self._reap()
        if self._metrics is not None:
            self._metrics.tick()

    def finalize_release_on_finish(self, req: Any) -> None:
        """Release a finished request's KV now, unless a copy still reads it (then its
        last ack releases it). Exactly once per request, whichever path comes first; a
        request never offloaded is released at once."""
        if self._dead:
            self._reap()
        if self._arrivals:  # an arrival released before the iteration ended: told first
            self._tell_arrivals()
        e = self._entries.get(id(req))
        if e is not None and e.ref() is not req:
            self._reap()
            e = None
        if e is not None:
            if e.done or e.finishing is not None:
                return
            lc = e.lc
            if lc is not None and e.row == req.kv.req_pool_idx:
                self._finishing(e, lc)
                lc.finish()
                return
            if lc is not None:
                self._reclaimed(e)
        self._release(req, e)

    def drain_before_retraction(self) -> None:
        """Wait until no copy reads any request's rows, so the scheduler may retract
        (free rows). Raises :class:`~kvoffload.DrainTimeout` naming the copies still in
        flight after ``drain_timeout_s``, as SGLang raises when it cannot drain. The
        iteration's arrivals are told first: their copies, like SGLang's, read the rows
        before they are retracted."""
        if self._arrivals:
            self._tell_arrivals()
        timeout = self.manager.config.drain_timeout_s
        self.manager.quiesce(timeout=timeout)
        self._drained = True

    def has_inflight_device_transfer(self) -> bool:
        """Whether a device-to-host copy is running (rows must stay where they are)."""
        return self.manager.copies_in_flight > 0

    def release_host_resources(self) -> None:
        """Shut down: drain the copies and storage writes (at most ``drain_timeout_s``),
        abort what is live, stop the copy and writer threads, drop the host pool.
        Idempotent."""
        mgr = self.manager
        if mgr.is_open:
            try:
                mgr.close()
            finally:
                if self._metrics is not None:
                    self._metrics.close()
                    self._metrics = None
                self._entries.clear()
                self._dead.clear()
                self._running.clear()
                self._ending.clear()
                self._arrivals.clear()

    # --- SGLang's release path ---------------------------------------------------------

    def release_request_kv(self, req: Any) -> None:
        """SGLang's release of a finished request's KV, as SGLang 0.5.23's own manager
        does it (``DecodeKVCacheOffloadManager._release_finished_req``): the row's
        range the request owns, ``[req.kv.cache_protected_len, req.kv.kv_allocated_len)``,
        through ``tree_cache.free_kv_row`` (the prefix the decode radix cache matched,
        ``[0, cache_protected_len)``, stays the tree's: unlocked, never freed, F29);
        the prefix-cache lock through ``tree_cache.unlock(req.lock)`` then
        ``req.lock = None`` (the tree caches take the lock, not the request, F28); the
        request row through ``req_to_token_pool.free(req)``; then
        ``req.kv.mark_kv_released()``. Skipped for a Req whose row is already gone."""
        kv = req.kv
        if kv.req_pool_idx in _NO_ROW:
            return
        self.tree_cache.free_kv_row(kv, [(int(kv.cache_protected_len), int(kv.kv_allocated_len))])
        self.tree_cache.unlock(req.lock)
        req.lock = None
        self.req_to_token_pool.free(req)
        kv.mark_kv_released()

    # --- kvoffload's side ----------------------------------------------------------------

    def _entry(self, req: Any) -> _Entry:
        """A new entry for ``req`` (the entry of a collected Req with the same id is
        reaped first)."""
        key = id(req)
        if key in self._entries:
            self._reap()
            self._entries.pop(key, None)  # a dead Req's entry its callback has not queued yet
        seed = namespace_seed(getattr(req, "extra_key", None), getattr(req, "cache_salt", None))
        entry = _Entry(seed or "")
        dead = self._dead

        def collected(_: object) -> None:  # any thread (the collector's): queue only
            dead.append((key, entry))

        try:
            entry.ref = weakref.ref(req, collected)
        except TypeError:
            raise ConfigError(
                f"{type(req).__name__} objects must support weak references (SGLang's Req does)"
            ) from None
        self._entries[key] = entry
        return entry

    def _admit(self, e: _Entry, req: Any, row: Any, committed: int) -> Lifecycle:
        """A lifecycle for the tokens ``req`` committed beyond what is stored: the
        page-aligned prompt (the prefill side stored it) or, after a retraction, what
        was offloaded before it. Stored pages are never read, so they are not held: a
        prefix the engine's radix cache shares between requests is no conflict.

        An unfinished request is admitted with none of those tokens yet: they are told
        before the next ``check_offload_progress`` delivers anything (or before a drain, a
        ``finalize_release_on_finish`` or its own next call, whichever comes first), the
        page ids of every arrival of the iteration read in one read (:meth:`_tell_arrivals`).
        A copy starts at that poll either way, so nothing is later than if they were told
        now. A request that finishes at its first call is told everything now."""
        if self._drained:
            self._scan_reclaimed(read_ahead=True)
        ps = self.page_size
        n = len(req.origin_input_ids)
        if e.resume is not None:
            stored, chain = e.resume
        else:
            stored = n - n % ps
            chain = e.seed
            if stored:
                chain = page_run_keys(
                    e.seed or None, validate_tokens(req.origin_input_ids[:stored], "prompt"), ps
                )[-1]
        tokens: list[int] = []
        pages: list[int] = []
        if req.finished() and committed > stored:
            tokens = [*req.origin_input_ids, *req.output_ids[: committed - n]][stored:committed]
            pages = self._step_pages(e, row, stored, committed)
        lc = self.manager.admit(req.rid, tokens, pages=pages, tag=e, chain_seed=chain, stored=0)
        e.lc, e.row, e.base, e.resume, e.req = lc, row, stored, None, req
        e.edge = -(-(stored + len(tokens)) // ps) * ps
        self._running[lc.id] = e
        if not tokens and committed > stored:
            e.arrived = committed
            self._arrivals.append(e)
        return lc

    def _tell_arrivals(self) -> None:
        """Tell each arrival of the iteration the tokens it committed at its call, the
        page ids of all of them read in one host read. An arrival whose row the engine
        took back in between (preemption) is told nothing: the check for rows taken back
        ends its lifecycle, and it resumes from its stored prompt."""
        arrivals = [e for e in self._arrivals if e.lc is not None and e.req is not None]
        self._arrivals.clear()
        ps = self.page_size
        views: list[Any] = []
        owners: list[tuple[_Entry, int, int]] = []
        told: list[_Entry] = []
        for e in arrivals:
            committed, e.arrived = e.arrived, 0
            if e.req.kv.req_pool_idx != e.row or e.finishing is not None:
                continue
            e.arrived = committed  # read below, told after the read
            told.append(e)
            self._want(views, owners, e, e.row, -(-e.base // ps), -(-committed // ps))
        got = self._read(views, owners)
        for e, slots in zip(told, got, strict=True):
            committed, e.arrived = e.arrived, 0
            lc, req = e.lc, e.req
            assert lc is not None
            n = len(req.origin_input_ids)
            tokens = [*req.origin_input_ids, *req.output_ids[: committed - n]][e.base : committed]
            try:
                lc.extend(tokens, pages=self._page_ids(e.row, slots))
            except PageError:  # a page another lifecycle holds: a row taken back (F32)
                if not self._free_taken_back() or e.lc is not lc:
                    continue  # this arrival's own row was taken back: nothing to tell
                lc.extend(tokens, pages=self._page_ids(e.row, slots))
            e.edge = -(-committed // ps) * ps

    # --- page ids: batched host reads of req_to_token ----------------------------------
    #
    # SGLang's req_to_token is a device tensor: every host read of it is a device sync.
    # kvoffload's bookkeeping needs page ids as ints, so they are read in one batched read
    # per iteration (between two check_offload_progress calls), plus one for the
    # iteration's arrivals (_tell_arrivals, at the next check_offload_progress): at the first call that
    # needs a page id, the page-start slots of every page any running request enters in
    # this iteration are gathered (device views, one concatenation, one tolist()). What a
    # request enters is foreseen from its row: the positions SGLang has written KV for
    # (kv.kv_committed_len, advanced before the forward) that the request has not told
    # yet, capped at its token count (never a position of a later forward). Positions
    # below kv_committed_len keep their slot while the row is the request's; a read made
    # before a retraction is never used after it (drain and _reclaimed drop it), nor in
    # another iteration (a preempted request resumes on its row in a later iteration).

    def _step_pages(self, e: _Entry, row: Any, have: int, committed: int) -> list[int]:
        """Page ids of the pages tokens ``have..committed`` of ``e``'s row start: from
        this iteration's batched read (made now if not made yet); a request the read did
        not foresee (more tokens than its row showed, as speculative decoding may
        commit) reads its own (a second read in the iteration)."""
        ps = self.page_size
        a, b = -(-have // ps), -(-committed // ps)
        ahead = e.ahead
        if ahead is None or ahead[0] != self._step or ahead[1] != a or len(ahead[2]) < b - a:
            if self._read_at == self._step:
                return self._pages(row, have, committed)
            views: list[Any] = []
            owners: list[tuple[_Entry, int, int]] = []
            self._want(views, owners, e, row, a, b)
            self._read_ahead(views, owners, e)
            self._read(views, owners)
            ahead = e.ahead
            assert ahead is not None
        return self._page_ids(row, ahead[2][: b - a])

    def _want(
        self, views: list[Any], owners: list[tuple[_Entry, int, int]], e: _Entry, row: Any, a: int, b: int
    ) -> None:
        """Add the page-start slots of pages ``a..b`` of ``row`` (a device view) for ``e``."""
        ps = self.page_size
        v = self.req_to_token_pool.req_to_token[row, a * ps : b * ps : ps]
        views.append(v)
        owners.append((e, a, int(v.shape[0])))

    def _read_ahead(
        self, views: list[Any], owners: list[tuple[_Entry, int, int]], skip: _Entry | None
    ) -> None:
        """Add, for each running request not called yet in this iteration, the pages its
        row shows it enters in this iteration (see the section comment); marks the
        iteration's read as made."""
        self._read_at = step = self._step
        ps = self.page_size
        running = self._running.values()
        try:  # the hot loop, over every running request: two attribute chains each
            entering = [x for x in running if x.req.kv.kv_committed_len > x.edge]
        except (AttributeError, TypeError):  # a Req without an int kv_committed_len: no foresight
            entering = [x for x in running if type(getattr(x.req.kv, "kv_committed_len", None)) is int]
            entering = [x for x in entering if x.req.kv.kv_committed_len > x.edge]
        for x in entering:
            req = x.req
            if x.served == step or x is skip or req.kv.req_pool_idx != x.row:
                continue
            lc = x.lc
            assert lc is not None
            b = -(-min(req.kv.kv_committed_len, len(req.origin_input_ids) + len(req.output_ids)) // ps)
            a = -(-(x.base + lc.committed) // ps)
            if b > a:
                self._want(views, owners, x, x.row, a, b)

    def _read(
        self, views: list[Any], owners: list[tuple[_Entry, int, int]], first: int = 0
    ) -> list[list[int]]:
        """The one host read: every view's slots (returned, in order); the owner of each
        view from ``first`` on gets it as its ``ahead`` for this iteration."""
        if not views:
            return []
        if len(views) == 1:
            flat = views[0].tolist()
        else:
            import torch  # the rows are a torch tensor: torch is loaded

            flat = torch.cat(views).tolist()
        out, i, step = [], 0, self._step
        for k, (x, a, n) in enumerate(owners):
            slots = flat[i : i + n]
            i += n
            out.append(slots)
            if k >= first:
                x.ahead = (step, a, slots)
        return out

    def _pages(self, row: Any, start: int, end: int) -> list[int]:
        """SGLang's page ids of the pages that tokens ``start..end`` of request row
        ``row`` start (from the row's first slot of each page): a read of its own."""
        ps = self.page_size
        a, b = -(-start // ps), -(-end // ps)
        if b <= a:
            return []
        return self._page_ids(row, self.req_to_token_pool.req_to_token[row, a * ps : b * ps : ps].tolist())

    def _page_ids(self, row: Any, slots: list[int]) -> list[int]:
        """Page ids from page-start slots; :class:`~kvoffload.PageError` for a slot that
        does not start a page (the allocator's pages and the row disagree)."""
        ps = self.page_size
        if ps == 1:
            return [int(s) for s in slots]
        bad = [s for s in slots if s % ps]
        if bad:
            raise PageError(
                f"req_to_token row {row}: slot(s) {bad[:4]} start a page but are not multiples of "
                f"the page size {ps}: the allocator's pages and the row disagree"
            )
        return [int(s) // ps for s in slots]

    def _scan_reclaimed(self, read_ahead: bool = False) -> bool:
        """After a drain (or a page claimed twice): end the lifecycle of every unfinished
        Req whose row or pages the engine took back (retraction; a resumed request may
        get the same row with other pages). Reads every live request's page ids in one
        host read - with this iteration's page reads when ``read_ahead`` (called from
        ``offload_kv_cache``, whose iteration's forward has run) and not made yet.
        Returns whether any was taken back."""
        self._drained = False
        entries = list(self._running.values())
        views: list[Any] = []
        owners: list[tuple[_Entry, int, int]] = []
        for e in entries:
            e.ahead = None
            lc = e.lc
            assert lc is not None and e.req is not None
            if e.req.kv.req_pool_idx == e.row and lc.device_pages:
                a = e.base // self.page_size
                self._want(views, owners, e, e.row, a, a + len(lc.device_pages))
        n_held = len(owners)
        if read_ahead and self._read_at != self._step:
            self._read_ahead(views, owners, None)
        got = self._read(views, owners, first=n_held)
        held = {id(e): slots for (e, _, _), slots in zip(owners[:n_held], got, strict=False)}
        gone = []
        for e in entries:
            lc = e.lc
            assert lc is not None
            # The same row with exactly the pages lc holds: nothing was taken back (or all
            # of it was given back as it was, its KV recomputed from the same tokens).
            taken = e.req.kv.req_pool_idx != e.row
            if taken or (id(e) in held and self._page_ids(e.row, held[id(e)]) != lc.device_pages):
                gone.append(e)
        for e in gone:
            self._reclaimed(e)
        return bool(gone)

    def _rows_taken_back(self) -> None:
        """End the lifecycle of every unfinished Req whose row index changed since its
        admission (the engine freed the row: retraction, preemption, or a Req it
        dropped). A few attribute reads per running request; the row's contents are
        compared only after a drain or a refused page (:meth:`_scan_reclaimed`)."""
        gone = [e for e in self._running.values() if e.req.kv.req_pool_idx != e.row]
        for e in gone:
            self._reclaimed(e)

    def _free_taken_back(self) -> bool:
        """A page id was refused as held by another live lifecycle: end the lifecycles of
        rows the engine took back, then wait (a collective under TP, the same on every
        rank) until those still read by a copy are released, so their page ids are free.
        Returns whether anything was found or waited for (else the refusal stands)."""
        found = self._scan_reclaimed()
        ending = [lc for lc in self._ending.values() if not lc.released]
        timeout = self.manager.config.drain_timeout_s
        for lc in ending:
            self.manager.wait_released(lc, timeout)
        return found or bool(ending)

    def _finishing(self, e: _Entry, lc: Lifecycle) -> None:
        """``lc``'s release is now the Req's release (finish was called)."""
        e.finishing = lc
        self._running.pop(lc.id, None)

    def _reclaimed(self, e: _Entry) -> None:
        """The engine took ``e``'s row back (retraction; preemption): end its lifecycle,
        keeping where the chain is so the resumed request continues it. Copies still in
        flight read rows no longer the request's: they are discarded when they end, and
        the chain resumes at the first of them."""
        lc = e.lc
        assert lc is not None
        if e.arrived:  # an arrival taken back before it was told anything
            e.arrived = 0
            if e in self._arrivals:
                self._arrivals.remove(e)
        stored, chain = lc.submitted, lc.chain_key or ""
        if lc.inflight:  # the engine freed rows under a running copy (no drain first)
            logger.error(
                "sglang.rows_reclaimed_mid_copy",
                rid=lc.rid,
                lifecycle=int(lc.id),
                inflight=lc.inflight,
                hint="call drain_before_retraction() before retracting",
            )
            mine = [t.first_token for t in self.manager.core.inflight.values() if t.lifecycle_id == lc.id]
            stored = min(mine, default=stored)
            chain = self._chain_at(e, e.base + stored)
        e.resume = (e.base + stored, chain)
        e.ahead = None
        e.lc = None
        e.row = None
        e.req = None
        self._running.pop(lc.id, None)
        lc.abort()
        if not lc.released:
            self._ending[lc.id] = lc

    def _chain_at(self, e: _Entry, n: int) -> str:
        """The chain key of ``e``'s Req after its first ``n`` tokens (page-aligned)."""
        req = e.req
        if n == 0:
            return e.seed
        tokens = [*req.origin_input_ids, *req.output_ids][:n]
        return page_run_keys(e.seed or None, validate_tokens(tokens, "tokens"), self.page_size)[-1]

    def _reap(self) -> None:
        """Forget the entries of collected Reqs. Memory only: a Req with a live
        lifecycle is held (``_Entry.req``), so none of these has one, and nothing a
        collector does changes a lifecycle (F31)."""
        dead = self._dead
        while dead:
            key, e = dead.popleft()
            assert e.lc is None or e.lc.released, "a collected Req had a live lifecycle"
            if self._entries.get(key) is e:
                del self._entries[key]

    def _on_released(self, lc: Lifecycle) -> None:
        """kvoffload released ``lc``: if it carried a finished Req, SGLang's release path."""
        self._ending.pop(lc.id, None)
        e: _Entry = lc.tag
        if e.lc is lc:
            e.lc = None
            self._running.pop(lc.id, None)
            if e.finishing is None:
                e.req = None
        if e.finishing is lc:
            if lc.pages_lost:  # the request's KV was not all offloaded: say which request
                logger.warning(
                    "sglang.offload_incomplete",
                    rid=lc.rid,
                    lifecycle=int(lc.id),
                    pages_lost=lc.pages_lost,
                    hint="the host pool stayed full (host_wait_steps), or a copy or storage write failed",
                )
            self._release(e.req, e)

    def _release(self, req: Any, e: _Entry | None) -> None:
        """SGLang's release path for ``req``, at most once."""
        if e is not None:
            if e.done:
                return
            e.done = True
            e.req = None
            e.finishing = None
        self._release_req(req)

    # --- observability --------------------------------------------------------------------

    def statistics(self) -> Any:
        """kvoffload's counters (:class:`~kvoffload.Statistics`)."""
        return self.manager.statistics()

    def __repr__(self) -> str:
        return (
            f"<kvoffload DecodeKVCacheOffloadManager page={self.page_size} stride={self.offload_stride} "
            f"kv={self.kv_kind} tp={self.tp_world_size} requests={len(self._entries)} "
            f"ongoing={len(self.ongoing_offload)}>"
        )


def _nothing() -> None:
    """The weak reference of an entry not yet bound to its Req."""
