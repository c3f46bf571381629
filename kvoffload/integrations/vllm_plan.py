"""The scheduler side of the vLLM connector, on plain data: which pages go out, which
come back, and when vLLM may have a request's blocks back.

Runs in vLLM's EngineCore process (the connector's SCHEDULER role), on the scheduler's
thread. :class:`Planner` holds a kvoffload :class:`~kvoffload.core.offload.OffloadCore`
with one :class:`~kvoffload.core.lifecycle.Lifecycle` per request: admitted the first
step the request is scheduled, extended every step by the tokens whose KV that step
computes, finished (or aborted) at ``request_finished``. It owns no KV memory: its
device pool is a zero-memory stand-in of page ids and its host pool only counts pages;
the workers hold the memory (:mod:`kvoffload.integrations.vllm_worker`). What the core
decides leaves as a :class:`StepPlan` (copies, storage writes, loads, cancels, a
preemption fence, releases: ids, page ids and keys only) in the next step's connector
metadata; what the workers did comes back as :class:`RankReport` (per job: ranks that
reported it, and an error as a string), and a job counts done when every rank reported
it (:meth:`Planner.apply`). Nothing here imports vLLM: requests are read by attribute
(``request_id``, ``all_token_ids``, ``num_computed_tokens``, ``lora_request``,
``cache_salt``, ``mm_features``, ``prompt_embeds``), and the engine's block table is a
callable from request id to block ids.

Request ids: vLLM names each live request by a unique id, so the planner finds a
request's record by it while the request lives (vLLM calls it by that id); the record
is dropped at ``request_finished``. Completions never go through it: they reach the
lifecycle that issued the copy by its id (``Transfer.lifecycle_id``), so a late
completion of a finished request can never touch a new request that reuses its id (F1).

Device page ids (why the core does not see vLLM's block ids as they are): vLLM's prefix
cache shares a running request's blocks with a new request that hits its prefix, and a
preemption frees a request's blocks and may hand them to another request in the same
step, before the preempted request's last copies are delivered. kvoffload's page record
refuses both (a page one live lifecycle may copy is never another's). So the core sees
stand-in ids: each page a lifecycle may copy gets a fresh one (mapped to its vLLM block
id, translated back in every copy job), and the pages of its stored prefix (never
copied) share one run of ids. What keeps vLLM's real blocks safe is vLLM's own hold on
them, kept exactly as long as a copy reads them: a running request's blocks are its
own; a finished request's are held by ``request_finished`` returning ``True`` until its
lifecycle is RELEASED; a preempted request's in-flight copies are waited for by every
worker before the step's forward may overwrite the blocks (:attr:`StepPlan.flush`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvoffload.abc import Transfer, TransferId
from kvoffload.config import OffloadConfig
from kvoffload.core.events import logger
from kvoffload.core.kv_events import KVEvents
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.loads import Load
from kvoffload.core.offload import OffloadCore
from kvoffload.errors import BackendError, ConfigError, KVOffloadError, PartialWriteError, StorageError
from kvoffload.integrations.vllm_keys import page_keys, refusal, request_seed
from kvoffload.integrations.vllm_messages import CopyJob, LoadJob, RankReport, StepPlan, WriteOrder
from kvoffload.integrations.vllm_settings import SETTING_KEYS, Settings
from kvoffload.lifecycle.load_spec import LoadOutcome
from kvoffload.lifecycle.spec import LifecycleState
from kvoffload.pools import EnginePages, HostPool

__all__ = [
    "REQUEST_PARAMS",
    "SETTING_KEYS",
    "CopyJob",
    "LoadJob",
    "Planner",
    "RankReport",
    "Settings",
    "StepPlan",
    "WriteOrder",
    "request_params",
]

_RELEASED = LifecycleState.RELEASED
#: A write no rank reported yet: every page counts as stored until one says fewer.
_ALL = 1 << 62


# --- the scheduler's records ---------------------------------------------------------


#: The keys of a request's ``kv_transfer_params["kvoffload"]`` (each a bool, default True).
REQUEST_PARAMS = ("store", "load")


def request_params(request: Any) -> tuple[bool, bool, str | None]:
    """``(store, load, problem)`` of a vLLM request: what its
    ``SamplingParams(extra_args={"kv_transfer_params": {"kvoffload": {"store": False}}})``
    asks (``store``: its KV is offloaded; ``load``: it may load from the store; both
    True unless set). ``problem`` names what was not understood (a key not in
    :data:`REQUEST_PARAMS`, a value that is not a bool, not a dict); that part is left
    at its default (the engine never fails a request over it: the planner logs it)."""
    params = getattr(request, "kv_transfer_params", None)
    mine = params.get("kvoffload") if isinstance(params, dict) else None
    if mine is None:
        return True, True, None
    if not isinstance(mine, dict):
        return True, True, f'kv_transfer_params["kvoffload"] must be a dict, got {type(mine).__name__}'
    wrong = [f"{k!r}={v!r}" for k, v in mine.items() if k not in REQUEST_PARAMS or type(v) is not bool]
    store, load = mine.get("store", True), mine.get("load", True)
    problem = None
    if wrong:
        problem = (
            f'kv_transfer_params["kvoffload"]: {", ".join(wrong)} not understood '
            f"(keys: {', '.join(REQUEST_PARAMS)}, each True or False)"
        )
    return store if type(store) is bool else True, load if type(load) is bool else True, problem


class _Request:
    """The planner's record of one live vLLM request (see the module doc)."""

    __slots__ = ("lc", "load", "load_failed", "local", "no_load", "no_store", "off", "request", "seed")

    def __init__(self, request: Any, seed: str | None, off: bool) -> None:
        self.request = request
        self.seed = seed
        # no_store / no_load: what the request asked (kv_transfer_params, request_params).
        self.no_store = False
        self.no_load = False
        # local: the engine's own prefix hit the last lookup was asked beyond.
        self.local = 0
        # lc: the request's lifecycle while it is scheduled; None before its first
        # step and after a preemption (a new one is admitted when it runs again).
        self.lc: Lifecycle | None = None
        # load: its load from the store (the core's Load) until DONE.
        self.load: Load | None = None
        # off: nothing of this request is stored (refused, or its offload failed).
        self.off = off
        # load_failed: a load of it came back short (a corrupt or missing page, a store
        # error): vLLM recomputes from the first bad block and asks again when it
        # schedules the request; the store still lists the bad page, so nothing more
        # is promised to it (F38: else load, fail, reschedule, for ever).
        self.load_failed = False


class Planner:
    """The scheduler side (see the module doc). One thread (the scheduler's).

    ``Planner(block_size=, num_blocks=, host_pages=, lookup=)``: ``lookup(keys)`` says
    how many leading keys the store has (the connector's bounded, side-effect free
    store query; it may raise, which counts as none). ``world_size``: the workers that
    must report a job before it counts done. ``stride``: tokens per copy while decoding
    (a multiple of ``block_size``; default one block); the host pages are shared by
    stores and loads. ``max_blocks``: most blocks one request can have (vLLM's
    ``max_model_len`` in blocks). ``kv_events``: subscribe the core's KV events
    (:attr:`kv_events`; the connector hands them to vLLM's publisher). ``page_bytes``:
    the bytes of one block on all ranks (the core's byte figures; 0: unknown).
    ``sync_loads``: loads are synchronous (vLLM schedules a loading request in the step
    that allocates its blocks and the workers load before that step's forward; see
    :meth:`start_load`), else asynchronous (the request waits for ``finished_recving``).
    """

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        host_pages: int,
        lookup: Callable[[list[str]], int],
        world_size: int = 1,
        stride: int | None = None,
        namespace: str | None = None,
        max_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_events: bool = False,
        page_bytes: int = 0,
        sync_loads: bool = False,
    ) -> None:
        import torch

        if type(world_size) is not int or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        self.block_size = block_size
        self.world_size = world_size
        self.sync_loads = sync_loads
        self.namespace = namespace
        self.lookup = lookup
        self.config = OffloadConfig(
            page_size=block_size,
            stride=block_size if stride is None else stride,
            device_pages=None,
            host_pages=host_pages,
            offload_prompt=True,
        )
        max_blocks = num_blocks if max_blocks is None else max(1, max_blocks)
        # Stand-in page ids (module doc): [0, n_own) for pages a lifecycle may copy,
        # [n_own, n_own + max_blocks) for stored prefixes (shared, never copied).
        self._n_own = 2 * num_blocks + 64
        self._prefix_base = self._n_own
        meta = torch.empty((self._n_own + max_blocks, block_size, 1), dtype=torch.uint8, device="meta")
        host = HostPool.new(host_pages, (1,), "uint8", buffer=torch.empty(0, device="meta"))
        self.core = OffloadCore(
            self.config,
            device_pool=EnginePages([meta], block_size),
            host_pool=host,
            accept=self._accept,
            storage=True,
            page_bytes=page_bytes,
        )
        self.core.refresh_observed()
        # kv_events: the core's KV events (stored / removed pages; each stored one's tag is
        # its vLLM Request), drained by the connector's take_events; None when not asked.
        self.kv_events: KVEvents | None = (
            self.core.kv.subscribe(max(4096, 2 * host_pages)) if kv_events else None
        )
        # _free_ids: stand-in ids no live lifecycle holds; _block_of[v]: the vLLM block of id v.
        # Invariant: not (set(self._free_ids) & set(self._block_of))
        self._free_ids: list[int] = list(range(self._n_own - 1, -1, -1))
        self._block_of: dict[int, int] = {}
        # _requests: live vLLM requests by their id (module doc: lookups only, never routing).
        self._requests: dict[str, _Request] = {}
        # _held: lifecycle id -> request id, for the finished requests whose blocks vLLM
        #   holds because request_finished returned True; reported in `release` at RELEASED.
        self._held: dict[int, str] = {}
        # _loads: loads whose workers have not all reported, by load id (the core's Load).
        self._loads: dict[int, Load] = {}
        # _reading: load id -> ranks on which a read of a reported load still runs
        #   (RankReport.reading's sum); _reading_loads: those loads every rank reported,
        #   with the result, kept from the core (READING: their host pages held) until
        #   their id leaves _reading. Invariant: a load is in at most one of _loads and
        #   _reading_loads, and in _reading_loads only while its id is in _reading.
        self._reading: dict[int, int] = {}
        self._reading_loads: dict[int, tuple[Load, int, str | None]] = {}
        # _h2d: the h2d copies the core just submitted for loads whose read returned:
        #   the workers did them already (read and copy are one job there).
        self._h2d: list[TransferId] = []
        # _refused_loads: ids (below 0) of the loads the core refused (reported, never begun).
        self._refused_loads = 0
        # _copy_of: in-flight copy id -> lifecycle id (for the preemption fence).
        self._copy_of: dict[int, int] = {}
        # _counts: ranks that reported each job so far, until world_size did.
        self._copy_counts: dict[int, tuple[int, str | None]] = {}
        self._write_counts: dict[int, tuple[int, int, str | None]] = {}
        self._load_counts: dict[int, tuple[int, int, str | None]] = {}
        # _sync: a synchronous load's job id -> (request id, the lifecycle admitted with
        #   it in the same step or None, pages promised), until every rank reported it.
        self._sync: dict[int, tuple[str, int | None, int]] = {}
        self._plan = StepPlan()
        self._refused_logged = False
        self._params_logged = False
        self.clock = clock

    # --- the core's sink ---------------------------------------------------------------

    def _accept(self, t: Transfer) -> None:
        """Each copy the core makes due goes into the next step's plan, its stand-in ids
        translated to vLLM's blocks (a KeyError here would be a bug: nothing changes)."""
        if t.direction == "h2d":  # a load's copy: the workers did it with the read
            self._h2d.append(t.id)
            return
        blocks = [self._block_of[v] for v in t.device_pages]
        self._plan.copies.append(
            CopyJob(t.id, blocks, list(t.host_pages), t.keys, t.lifecycle_id, t.first_token)
        )
        self._copy_of[t.id] = t.lifecycle_id

    def _ids(self, blocks: Sequence[int]) -> list[int]:
        """Fresh stand-in ids for ``blocks`` (raises KVOffloadError with none taken)."""
        if len(blocks) > len(self._free_ids):
            raise KVOffloadError(f"no stand-in page ids left for {len(blocks)} block(s)")
        out = [self._free_ids.pop() for _ in blocks]
        for v, b in zip(out, blocks, strict=True):
            self._block_of[v] = b
        return out

    def _released(self, lcs: list[Lifecycle]) -> None:
        """Lifecycles the core released: their stand-in ids return, and a held finished
        request is released to vLLM in the next plan."""
        try:
            for lc in lcs:
                for v in lc.device_pages:
                    if self._block_of.pop(v, None) is not None:
                        self._free_ids.append(v)
                rid = self._held.pop(lc.id, None)
                if rid is not None:
                    self._plan.release.append(rid)
        finally:
            self.core.told(lcs)

    # --- loads (point 3) -----------------------------------------------------------------

    def _record(self, request: Any) -> _Request:
        rid = request.request_id
        rec = self._requests.get(rid)
        if rec is None:
            why = refusal(request)
            if why is not None and not self._refused_logged:
                self._refused_logged = True
                logger.warning("vllm.request_refused", rid=rid, reason=why)
            seed = None if why else request_seed(self.namespace, request)
            store, load, problem = request_params(request)
            if problem is not None and not self._params_logged:
                self._params_logged = True
                logger.warning("vllm.request_params_ignored", rid=rid, problem=problem)
            rec = self._requests[rid] = _Request(request, seed, why is not None)
            rec.no_store, rec.no_load = not store, not load
        return rec

    def add(self, request: Any) -> None:
        """``on_new_request``: start the request's record (its seed, or its refusal)."""
        self._record(request)

    def matched(self, request: Any, num_computed: int) -> int:
        """``get_num_new_matched_tokens``: how many tokens beyond ``num_computed`` (the
        engine's own block-aligned prefix hit) the store has in whole blocks, never the
        request's last token (vLLM computes it to sample the next). Asks the store;
        changes nothing else; a store error counts as 0 (logged)."""
        rec = self._record(request)
        if rec.off or rec.no_load or rec.load_failed or rec.load is not None or rec.lc is not None:
            return 0
        bs = self.block_size
        rec.local = num_computed
        tokens = request.all_token_ids
        n_pages = (len(tokens) - 1) // bs
        first = num_computed // bs
        if n_pages <= first:
            return 0
        n_pages = min(n_pages, first + self.core.host_pool.free_pages)
        keys = page_keys(rec.seed, tokens, bs, n_pages)
        try:
            hit = int(self.lookup(keys))
        except Exception as exc:  # a store that fails or times out: a miss, never an error
            logger.warning("vllm.lookup_failed", rid=request.request_id, error=repr(exc))
            self.core.meters.lookup_failed()
            return 0
        self.core.meters.looked_up(len(keys), min(max(hit, 0), len(keys)))
        return max(0, min(hit, n_pages) - first) * bs

    def start_load(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        """``update_state_after_alloc``: load the ``num_external`` tokens after the
        engine's own prefix hit (the one :meth:`matched` was last asked beyond) into the
        blocks vLLM allocated for them (``block_ids``: the request's whole block table).
        The job leaves in the next plan; the request's id comes back in
        ``finished_recving`` once every worker finished it. With ``sync_loads`` the
        request is scheduled in the step this plan belongs to: the workers load before
        its forward and report only the blocks that did not load (vLLM drops that step's
        output of the request and recomputes from the first bad block); the lifecycle
        admitted in that step, whose copies read blocks computed on top of the load, is
        then aborted, so none of them is stored (F38), and a new one is admitted from
        where vLLM recomputes."""
        if num_external <= 0:
            return
        rec = self._record(request)
        bs = self.block_size
        first, n = rec.local // bs, num_external // bs
        keys = page_keys(rec.seed, request.all_token_ids, bs, first + n)[first:]
        blocks = list(block_ids[first : first + n])
        try:
            ids = self._ids(blocks)
            try:
                load = self.core.load_begin(request.request_id, keys, ids, tag=ids, first_page=first)
            except BaseException:
                self._forget(ids)
                raise
        except KVOffloadError as exc:  # never into vLLM: the workers still report it, every block an error
            logger.warning("vllm.load_refused", rid=request.request_id, error=repr(exc))
            rec.load_failed = True  # every block comes back an error: recomputed, not asked again
            self._refused_loads -= 1
            job = LoadJob(self._refused_loads, request.request_id, keys, blocks, [], self.sync_loads)
            self._plan.loads.append(job)
            return
        # A load the core ended at once (no host pages: MISSED) still goes to the
        # workers, with no host pages: they report the request (and its blocks as
        # load errors), which vLLM waits for.
        rec.load = self._loads[load.id] = load
        self._plan.loads.append(
            LoadJob(load.id, request.request_id, keys, blocks, load.host_pages, self.sync_loads)
        )

    def _load_done(self, load: Load, pages: int, error: str | None) -> None:
        """Every worker reported ``load`` and every read of it ended: the read's result
        goes to the core (which submits the h2d copy the workers already did, completed
        here at once, or frees the host pages of a failed one)."""
        self._loads.pop(load.id, None)
        self._reading_loads.pop(load.id, None)
        if not load.done:
            err = None if error is None else StorageError(error)
            self.core.load_read(load, min(pages, len(load.keys)), err)
            done, self._h2d = self._h2d, []
            if done:
                self._released(self.core.complete([(tid, None) for tid in done]))
        for ld in self.core.take_loads():
            self._forget([v for v in ld.tag if v in self._block_of])
            if ld.outcome is not LoadOutcome.LOADED:
                logger.warning(
                    "vllm.load_incomplete",
                    rid=ld.rid,
                    pages=len(ld.keys),
                    loaded=ld.pages_loaded,
                    reason=ld.reason,
                )
        self._load_outcome(load, pages, error)

    def _load_outcome(self, load: Load, pages: int, error: str | None) -> None:
        """What the request learns of its finished load (vLLM learned it from the
        workers): it is no longer loading, and failed when short."""
        rec = self._requests.get(load.rid)
        if rec is not None and rec.load is load:
            rec.load = None
            rec.load_failed = error is not None or pages < len(load.keys)

    # --- the step (points 1 and 2) ----------------------------------------------------

    def step(
        self,
        scheduled: Iterable[tuple[str, int]],
        block_ids: Callable[[str], Sequence[int]],
        preempted: Iterable[str] = (),
    ) -> StepPlan:
        """``build_connector_meta``: ``scheduled`` is each scheduled request with its
        number of scheduled tokens; ``block_ids(request_id)`` its block table now;
        ``preempted`` the ids vLLM preempted this step. Each scheduled request's
        lifecycle is admitted or extended by the tokens whose KV this step computes (and
        whose ids are known), so its newly full blocks go out while it decodes; a
        preempted request's lifecycle is aborted and its in-flight copies fenced.
        Returns the plan for the workers (and starts a new one)."""
        for rid in preempted:
            rec = self._requests.get(rid)
            if rec is not None and rec.lc is not None:
                lc, rec.lc = rec.lc, None
                self._plan.flush += [tid for tid, lid in self._copy_of.items() if lid == lc.id]
                if not lc.released and not lc.aborted:
                    self._released(self.core.abort(lc))
        for rid, n in scheduled:
            rec = self._requests.get(rid)
            if rec is None or rec.off or rec.no_store:
                continue
            request = rec.request
            try:
                self._advance(rec, request, n, block_ids)
            except KVOffloadError as exc:  # this request only (F32): it is no longer stored
                # rec.lc stays: its copies in flight still read the blocks (held at finish)
                rec.off = True
                logger.warning("vllm.offload_stopped", rid=request.request_id, error=repr(exc))
                live = rec.lc
                if live is not None and not live.released and not live.aborted:
                    self._released(self.core.abort(live))
        for load_job in self._plan.loads:
            if load_job.sync:  # its request was admitted just now, on top of the load
                got = self._requests.get(load_job.req_id)
                on = None if got is None or got.lc is None else got.lc.id
                self._sync[load_job.id] = (load_job.req_id, on, len(load_job.keys))
        for job in self.core.take_writes():
            self._plan.writes.append(
                WriteOrder(job.id, job.host_pages, job.keys, job.lifecycle_id, job.first_token)
            )
        plan, self._plan = self._plan, StepPlan()
        return plan

    def _advance(
        self, rec: _Request, request: Any, n: int, block_ids: Callable[[str], Sequence[int]]
    ) -> None:
        bs = self.block_size
        tokens = request.all_token_ids
        upto = min(request.num_computed_tokens + n, len(tokens))
        lc = rec.lc
        if lc is None:
            if upto <= 0:
                return
            blocks = list(block_ids(request.request_id))[: -(-upto // bs)]
            stored = min(request.num_computed_tokens - request.num_computed_tokens % bs, upto - upto % bs)
            shared = stored // bs
            ids = list(range(self._prefix_base, self._prefix_base + shared)) + self._ids(blocks[shared:])
            try:
                rec.lc = self.core.admit(
                    request.request_id,
                    list(tokens[:upto]),
                    pages=ids,
                    tag=request,  # (a KV event's way back to vLLM's block hashes)
                    chain_seed=rec.seed,
                    stored=stored,
                )
            except BaseException:
                self._forget(ids[shared:])
                raise
            return
        have = lc.committed
        if upto <= have:
            return
        held = len(lc.device_pages)
        need = -(-upto // bs) - held
        new: list[int] = []
        if need > 0:
            new = self._ids(list(block_ids(request.request_id))[held : held + need])
        try:
            self.core.extend(lc, list(tokens[have:upto]), pages=new)
        except BaseException:
            self._forget(new)
            raise

    def _forget(self, ids: list[int]) -> None:
        for v in ids:
            del self._block_of[v]
            self._free_ids.append(v)

    # --- the end of a request --------------------------------------------------------------

    def finished(self, request: Any, aborted: bool) -> bool:
        """``request_finished``: the request's lifecycle finishes (its page-aligned tail
        goes out, F12) or, when ``aborted``, aborts; a load in progress is cancelled.
        Returns whether vLLM must keep the request's blocks until its id comes back in
        ``finished_sending``: exactly while a copy still reads them (delay-free: the
        lifecycle is not RELEASED). A loading request returns False (vLLM holds its
        blocks until ``finished_recving``)."""
        rec = self._requests.pop(request.request_id, None)
        if rec is None:
            return False
        if rec.load is not None:
            load, rec.load = rec.load, None
            if not load.done:
                self.core.load_cancel(load)
                self._plan.cancels.append(load.id)
        lc, rec.lc = rec.lc, None
        if lc is None or lc.released:
            return False
        try:
            if lc.aborted:
                pass
            elif aborted:
                self._released(self.core.abort(lc))
            else:
                self._released(self.core.finish(lc))
        except KVOffloadError as exc:  # the tail's refusal: abort instead (its copies still fenced)
            logger.warning("vllm.finish_failed", rid=request.request_id, error=repr(exc))
            if not lc.released and not lc.aborted:
                self._released(self.core.abort(lc))
        if lc.state is _RELEASED:
            return False
        self._held[lc.id] = request.request_id
        return True

    # --- what the workers report ---------------------------------------------------------

    def apply(self, report: RankReport) -> None:
        """``update_connector_output``: count each job's ranks; a job every rank reported
        is delivered to the core (copies, writes) or finishes its load."""
        ws = self.world_size
        for lid, n in report.reading.items():  # before the loads: a read that ended frees
            left = self._reading.get(lid, 0) + n
            if left:
                self._reading[lid] = left
                continue
            self._reading.pop(lid, None)
            kept = self._reading_loads.get(lid)
            if kept is not None:
                self._load_done(*kept)
        # Loads first: a short synchronous load aborts the lifecycle admitted on top of
        # it before its copies are delivered, so the core discards them (never written).
        for lid, (n, pages, err) in report.loads.items():
            m, p, e = self._load_counts.pop(lid, (0, pages, None))
            m, p, e = m + n, min(p, pages), e if e is not None else err
            if m < ws:
                self._load_counts[lid] = (m, p, e)
                continue
            load = self._loads.get(lid)
            if load is not None and self._reading.get(lid):
                # a rank gave up on it, its read still running: the request goes on (its
                # blocks recomputed), the core keeps the host pages until the read ended
                del self._loads[lid]
                self._reading_loads[lid] = (load, p, e)
                self._load_outcome(load, p, e)
            elif load is not None:
                self._load_done(load, p, e)
            sync = self._sync.pop(lid, None)
            if sync is not None and (e is not None or p < sync[2]):
                self._sync_load_short(*sync[:2])
        done: list[tuple[Any, BaseException | None]] = []
        for tid, (n, err) in report.copies.items():
            m, e = self._copy_counts.pop(tid, (0, None))
            m, e = m + n, e if e is not None else err
            if m < ws:
                self._copy_counts[tid] = (m, e)
                continue
            if self._copy_of.pop(tid, None) is not None and tid in self.core.inflight:
                done.append((tid, None if e is None else BackendError(e)))
        if done:
            self._released(self.core.complete(done))
        for jid, (n, stored, err) in report.writes.items():
            m, s, e = self._write_counts.pop(jid, (0, _ALL, None))
            m, s, e = m + n, min(s, stored), e if e is not None else err
            if m < ws:
                self._write_counts[jid] = (m, s, e)
                continue
            job = self.core.writes.get(jid)
            if job is not None:  # per page (F34): the leading pages every rank stored
                total = len(job.host_pages)
                error: StorageError | None = None if e is None else StorageError(e)
                if 0 < s < total:
                    error = PartialWriteError(e or "not stored", [i < s for i in range(total)])
                self._released(self.core.write_done(jid, s >= total, error=error))

    def _sync_load_short(self, rid: str, lifecycle_id: int | None) -> None:
        """A synchronous load of ``rid`` came back short: vLLM recomputes from its first
        bad block, so the lifecycle admitted on top of the load (``lifecycle_id``) is
        aborted (its copies discarded) and the next step admits a new one from there."""
        rec = self._requests.get(rid)
        if rec is None:
            return
        rec.load_failed = True
        lc = rec.lc
        if lc is None or lc.id != lifecycle_id:
            return
        rec.lc = None
        # as at a preemption: its copies in flight finish before the next forward rewrites the blocks
        self._plan.flush += [tid for tid, lid in self._copy_of.items() if lid == lc.id]
        if not lc.released and not lc.aborted:
            self._released(self.core.abort(lc))

    # --- reading ---------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether work is left that needs more engine steps (copies, writes, loads,
        held requests, or a plan not sent yet): vLLM's ``has_pending_push_work``."""
        return bool(self.core.busy or self._loads or self._held or self._plan or self._copy_of)

    def request(self, request_id: str) -> Any:
        """The live vLLM request of that id, or ``None``."""
        rec = self._requests.get(request_id)
        return None if rec is None else rec.request

    def lifecycle(self, request_id: str) -> Lifecycle | None:
        """The live request's current lifecycle (for tests and statistics)."""
        rec = self._requests.get(request_id)
        return None if rec is None else rec.lc

    def check_invariants(self) -> None:
        """The core's ledger, and the stand-in ids: each either free or mapped, never both."""
        self.core.check_invariants()
        assert not (set(self._free_ids) & set(self._block_of)), "a stand-in id both free and mapped"
        assert len(self._free_ids) + len(self._block_of) == self._n_own, "a stand-in id lost"
        assert not (set(self._loads) & set(self._reading_loads)), "a load both reporting and kept"
        assert set(self._reading_loads) <= set(self._reading), "a load kept with no read running"
