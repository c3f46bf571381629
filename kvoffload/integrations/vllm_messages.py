"""What travels between the two sides of the vLLM connector: plain, picklable data.

The scheduler's :class:`~kvoffload.integrations.vllm_plan.Planner` makes a
:class:`StepPlan` per step (vLLM carries it to every worker in the connector metadata);
each worker's :class:`~kvoffload.integrations.vllm_worker.Mover` answers with a
:class:`RankReport` (in the worker metadata, merged across ranks by vLLM). Ids, page
ids, host page ids, keys and error strings only: no lifecycle, no tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CopyJob", "LoadJob", "RankReport", "StepPlan", "WriteOrder"]


# --- what travels between the scheduler and the workers (plain, picklable) -------------


@dataclass(slots=True)
class CopyJob:
    """A device -> host copy of whole pages (a core :class:`~kvoffload.abc.Transfer`):
    vLLM block ids, host page ids, the pages' keys. A worker copies it after the step's
    forward wrote the blocks (``wait_for_save``), never before (F19)."""

    id: int
    device_pages: list[int]
    host_pages: list[int]
    keys: list[str]
    lifecycle_id: int
    first_token: int


@dataclass(slots=True)
class WriteOrder:
    """Host pages a finished copy filled, to be written to the store under ``keys``
    (a core :class:`~kvoffload.abc.WriteJob`)."""

    id: int
    host_pages: list[int]
    keys: list[str]
    lifecycle_id: int
    first_token: int


@dataclass(slots=True)
class LoadJob:
    """Pages to read from the store (``keys``) into host pages and copy into vLLM's
    blocks ``device_pages`` (one fused job on each worker). ``req_id`` is what the
    worker reports in ``finished_recving`` once no copy of it writes a block.

    ``sync``: a synchronous load (``get_num_new_matched_tokens`` said ``(n, False)``):
    the request is scheduled in this very step, so the worker loads in
    ``start_load_kv``, before the forward, and reports blocks that did not load in this
    step's ``get_block_ids_with_load_errors`` only (never ``finished_recving``)."""

    id: int
    req_id: str
    keys: list[str]
    device_pages: list[int]
    host_pages: list[int]
    sync: bool = False


@dataclass(slots=True)
class StepPlan:
    """The connector metadata of one step, from the scheduler to every worker.

    ``flush``: copy ids a worker must see finished before this step's forward (their
    request was preempted: its blocks may be reused by this step). ``cancels``: load ids
    whose request was aborted (skip what has not been copied yet). ``release``: request
    ids whose last copy is delivered: each worker reports them in ``finished_sending``
    this step, and vLLM frees their blocks."""

    copies: list[CopyJob] = field(default_factory=list)
    writes: list[WriteOrder] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    release: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.copies or self.writes or self.loads or self.cancels or self.flush or self.release)


@dataclass(slots=True)
class RankReport:
    """What one or more workers did since their last report (plain data).

    ``copies[id] = (ranks, error)``, ``writes[id] = (ranks, pages_stored, error)``,
    ``loads[id] = (ranks, pages_loaded, error)``: ``ranks`` counts the workers that
    reported the job (1 from one worker; :meth:`merge` adds them up), ``error`` is the
    first failure's text or ``None``, ``pages_stored`` is the fewest leading pages of
    the job any rank's store confirmed (per page, F34: a page is stored only where
    every rank stored its shard), ``pages_loaded`` the fewest leading pages any rank
    loaded. ``reading[id] = ranks``: a load reported in ``loads`` while a store read of
    it still ran (the rank gave up waiting: the load failed, its blocks are the
    engine's, but the read may still write its host pages) counts +1, and -1 once every
    read of it on that rank ended; the scheduler keeps the load's host pages until the
    sum is back to 0 (absent)."""

    copies: dict[int, tuple[int, str | None]] = field(default_factory=dict)
    writes: dict[int, tuple[int, int, str | None]] = field(default_factory=dict)
    loads: dict[int, tuple[int, int, str | None]] = field(default_factory=dict)
    reading: dict[int, int] = field(default_factory=dict)

    def merge(self, other: RankReport) -> RankReport:
        """Both reports as one (vLLM aggregates its workers' outputs this way)."""
        copies = dict(self.copies)
        for k, (n, e) in other.copies.items():
            m, f = copies.get(k, (0, None))
            copies[k] = (m + n, f if f is not None else e)
        writes = dict(self.writes)
        for k, (n, s, e) in other.writes.items():
            if k in writes:
                m, t, f = writes[k]
                writes[k] = (m + n, min(t, s), f if f is not None else e)
            else:
                writes[k] = (n, s, e)
        loads = dict(self.loads)
        for k, (n, p, e) in other.loads.items():
            if k in loads:
                m, q, f = loads[k]
                loads[k] = (m + n, min(p, q), f if f is not None else e)
            else:
                loads[k] = (n, p, e)
        reading = dict(self.reading)
        for k, n in other.reading.items():
            left = reading.get(k, 0) + n
            if left:
                reading[k] = left
            else:
                reading.pop(k, None)
        return RankReport(copies, writes, loads, reading)

    def __bool__(self) -> bool:
        return bool(self.copies or self.writes or self.loads or self.reading)
