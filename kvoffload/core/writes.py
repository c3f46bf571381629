"""Storage write-behind: the write jobs of copied chunks, in chain order (FAILURES F33).

A copied chunk's host pages are held until the storage tier has them (rule 3). A
request's chunks may finish copying out of order; their writes go to the store in chain
order: a chunk whose earlier chunk is still in flight is *held* here and joins the
queue when that one did. A failed write is a hole in the request's chain: the core
stops its offload there (live) or counts the pages after it lost (released).

Per page (FAILURES F34): a write the store confirmed in part (the writer's
:class:`~kvoffload.PartialWriteError`, one flag per page) is a hole at its first
unconfirmed page. The pages before it count as stored; the confirmed pages after it are
in the store but unreachable (``pages_store_unreachable``); the others failed.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from kvoffload.abc import Transfer, WriteChain, WriteJob
from kvoffload.core.events import DEBUG, Events, logger
from kvoffload.core.lifecycle import Lifecycle, LifecycleId
from kvoffload.core.stats import Counters
from kvoffload.errors import KVOffloadError, PartialWriteError

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig
    from kvoffload.pools import HostPool

__all__ = ["Writes"]


class _Burst:
    """The current run of failed storage writes, for logging once per burst."""

    __slots__ = ("chunks", "last_log", "logged_pages", "pages", "since")

    def __init__(self) -> None:
        # since: clock time of the burst's first failure; None while the store is healthy.
        # Invariant: (self.since is None) == (self.chunks == 0)
        self.since: float | None = None
        self.chunks = 0
        self.pages = 0
        self.last_log = 0.0
        self.logged_pages = 0  # pages of the burst already reported in a log line


class _Chain(WriteChain):
    """The core's record of one lifecycle's write jobs (F33), shared by them: the
    writer's ``broken`` flag, and what a write that finishes after the lifecycle's
    release needs - a weak reference to it (the core never keeps a released one) and
    where its stored chain ends."""

    __slots__ = ("lc", "reach")

    def __init__(self, lc: Lifecycle) -> None:
        super().__init__()
        self.lc = weakref.ref(lc)
        # reach: -1 while live (or aborted); set at RELEASED: the token where the chain
        # the store holds (or will hold) ends; moves back when a later write fails.
        self.reach = -1

    def released(self, reach: int) -> None:
        """The lifecycle was RELEASED (not aborted) with its stored chain ending at ``reach``."""
        self.reach = reach


class Writes:
    """The write jobs of one core: queued, held for an earlier copy, or being written."""

    def __init__(
        self,
        config: OffloadConfig,
        counters: Counters,
        host_pool: HostPool,
        events: Events,
        page_bytes: int,
        log_interval_s: float,
    ) -> None:
        self.config = config
        self.counters = counters
        self.host_pool = host_pool
        self.events = events
        self.page_bytes = page_bytes
        self.log_interval_s = log_interval_s
        # jobs: copied chunks handed to the writer (or about to be: out) whose storage
        # write has not finished (host pages held), in the order handed over.
        # Invariant: sum(len(j.host_pages) for j in self.jobs.values())
        #   + sum(len(j.host_pages) for d in self.held.values() for j in d.values())
        #   == counters.pages_in_write
        self.jobs: dict[int, WriteJob] = {}
        # held: copied chunks whose write waits for an earlier chunk of the same
        # lifecycle to be copied: by lifecycle id, then by the chunk's first token. Their
        # host pages are held; they join jobs (and out) when the earlier ones did, so a
        # write that waits for a copy is not pending (writes_pending, a TP window).
        # Invariant: all(job.first_token > live[lid]._front for lid, d in held.items() for job in d.values())
        self.held: dict[LifecycleId, dict[int, WriteJob]] = {}
        # out: write jobs not yet taken by the driver's writer (a subset of jobs).
        self.out: list[WriteJob] = []
        self.burst = _Burst()

    def queue(self, t: Transfer, lc: Lifecycle) -> None:
        """``t`` of ``lc`` was copied: its write job goes out now when every earlier chunk
        of ``lc`` was copied (``t`` starts at ``lc._front``), followed by the later ones
        that waited for it; else it waits (held) - so a request's writes reach the store
        in chain order whatever order its copies completed in (F33)."""
        chain = lc._wchain
        if chain is None:
            chain = lc._wchain = _Chain(lc)
        first = t.first_token
        job = WriteJob(t.id, t.keys, t.host_pages, lc.id, lc.rid, chain=chain, first_token=first)
        if first != lc._front:  # an earlier chunk is still in flight
            self.held.setdefault(lc.id, {})[first] = job
            return
        self.jobs[t.id] = job
        self.out.append(job)
        front = lc._front = first + t.n_tokens
        waiting = self.held.get(lc.id) if self.held else None
        if waiting:
            ps = self.config.page_size
            while front in waiting:
                job = waiting.pop(front)
                self.jobs[job.id] = job
                self.out.append(job)
                front += len(job.host_pages) * ps
            lc._front = front
            if not waiting:
                del self.held[lc.id]

    def skip_held(self, lc: Lifecycle, first: int) -> None:
        """The held write jobs of ``lc`` from token ``first`` on are never written (a hole
        or an abort before them, F33): their host pages return, counted as skipped."""
        waiting = self.held.get(lc.id)
        if not waiting:
            return
        c = self.counters
        for start in [f for f in waiting if f >= first]:
            job = waiting.pop(start)
            n = len(job.host_pages)
            c.pages_in_write -= n
            c.pages_store_skipped += n
            self.host_pool.free(job.host_pages)
        if not waiting:
            del self.held[lc.id]

    def take(self) -> list[WriteJob]:
        """The write jobs queued since the last call, in completion order (a request's
        chunks in chain order). Their host pages stay held until :meth:`finish`."""
        out, self.out = self.out, []
        return out

    def pop(self, job_id: int, attempts: int) -> WriteJob:
        """The writer finished job ``job_id`` after ``attempts`` tries: it leaves the
        queue and its host pages return (rule 3). The caller makes a failed job a hole
        (:meth:`hole`), then counts the outcome (:meth:`count`)."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            raise KVOffloadError(f"storage write {job_id} finished twice or was never queued")
        if self.out and any(j is job for j in self.out):  # finished before it was taken
            self.out = [j for j in self.out if j is not job]
        n = len(job.host_pages)
        c = self.counters
        c.pages_in_write -= n
        retried = (attempts - 1) * n if job.resent is None else job.resent
        if retried > 0:
            c.pages_store_retried += retried
        self.host_pool.free(job.host_pages)
        return job

    def done(
        self, job_id: int, stored: bool, attempts: int, error: BaseException | None
    ) -> tuple[Lifecycle | None, int]:
        """The writer finished job ``job_id``: it leaves the queue (:meth:`pop`), a page
        not stored is a hole (:meth:`hole`) and the outcome is counted per page
        (:meth:`count`). Returns the live lifecycle whose offload must stop, and the
        token where (the job's first page not confirmed, F34), or ``(None, -1)``.

        The job's pages confirmed by the store: all when ``stored``; else the flags of
        ``error`` when it is a :class:`~kvoffload.PartialWriteError` with one flag per
        page of the job; else none."""
        job = self.pop(job_id, attempts)
        n = len(job.host_pages)
        reach, after = n, 0  # leading pages confirmed; pages confirmed after the first not
        if not stored:
            flags = error.stored if isinstance(error, PartialWriteError) else ()
            if len(flags) != n:
                flags = ()
            reach = flags.index(False) if False in flags else len(flags)
            after = sum(flags[reach:])
        lc: Lifecycle | None = None
        at = -1
        if reach < n:
            at = job.first_token + reach * self.config.page_size
            lc = self.hole(job, at)
        self.count(job, reach, after, attempts, error)
        return lc, at

    def count(
        self, job: WriteJob, reach: int, after: int, attempts: int, error: BaseException | None
    ) -> None:
        """Count a finished job's outcome per page: ``reach`` leading pages confirmed
        (stored), ``after`` pages confirmed after the first unconfirmed one (unreachable),
        the rest failed - or skipped, after 0 attempts. A burst of failures is logged once."""
        n = len(job.host_pages)
        c = self.counters
        if reach == n:
            c.pages_stored += n
            if self.burst.since is not None:
                self._recovered(job)
            if self.events.observed:
                fields = self._notify("storage.written", job, attempts=attempts)
                if DEBUG.on:
                    logger.debug("storage.written", **fields)
        elif attempts == 0:  # not written: its chain broke before it (F33)
            c.pages_store_skipped += n
        else:
            failed = n - reach - after
            c.pages_stored += reach
            c.pages_store_unreachable += after
            c.pages_store_failed += failed
            if reach or after:  # the store confirmed part of the chunk (F34)
                c.chunks_store_partial += 1
                c.pages_store_unconfirmed += failed
            self._store_failed(job, attempts, error, failed, reach, after)

    def hole(self, job: WriteJob, first: int | None = None) -> Lifecycle | None:
        """Job ``job`` was not stored from token ``first`` on (default: its first token):
        its lifecycle's chain ends there (F33, F34). Returns the live lifecycle whose
        offload must stop there (the core stops it); for a released one (not aborted)
        the pages from there on are lost, counted on the lifecycle (while anyone holds
        it) and in ``pages_lost``, and it returns None."""
        chain = job.chain
        if not isinstance(chain, _Chain):
            return None
        if first is None:
            first = job.first_token
        lc = chain.lc()
        if chain.reach < 0:  # live (or aborted)
            return lc if lc is not None and not lc.released else None
        if first < chain.reach:
            lost = (chain.reach - first) // self.config.page_size
            chain.reach = first
            self.counters.pages_lost += lost
            if lc is not None:
                lc.pages_lost += lost
                lc._stop = first
        return None

    def _store_failed(
        self,
        job: WriteJob,
        attempts: int,
        error: BaseException | None,
        n: int,
        stored: int = 0,
        unreachable: int = 0,
    ) -> None:
        """``n`` pages of ``job`` failed (``stored`` of its pages were stored and
        ``unreachable`` confirmed after the hole: a partial write, F34)."""
        burst = self.burst
        now = self.events.clock()
        partial = {"pages_stored": stored, "pages_unreachable": unreachable}  # (a partial write, F34)
        if burst.since is None:
            burst.since = now
            burst.last_log = now
            burst.logged_pages = n
            logger.warning(
                "storage.failed", transfer=job.id, pages=n, attempts=attempts, error=repr(error), **partial
            )
        elif now - burst.last_log >= self.log_interval_s:
            logger.warning(
                "storage.failed",
                pages_failed_since_last_log=burst.pages + n - burst.logged_pages,
                burst_s=now - burst.since,
                error=repr(error),
            )
            burst.last_log = now
            burst.logged_pages = burst.pages + n
        burst.chunks += 1
        burst.pages += n
        if self.events.listeners:
            self._notify("storage.failed", job, n, attempts=attempts, error=repr(error), **partial)

    def _recovered(self, job: WriteJob) -> None:
        burst = self.burst
        assert burst.since is not None
        fields = {
            "chunks_failed": burst.chunks,
            "pages_failed": burst.pages,
            "burst_s": self.events.clock() - burst.since,
        }
        logger.info("storage.recovered", **fields)
        burst.since = None
        burst.chunks = burst.pages = burst.logged_pages = 0
        if self.events.listeners:
            self._notify("storage.recovered", job, **fields)

    def _notify(self, name: str, job: WriteJob, n: int | None = None, /, **extra: Any) -> dict[str, object]:
        if n is None:
            n = len(job.host_pages)
        fields: dict[str, object] = {"lifecycle": job.lifecycle_id, "rid": job.rid, "transfer": job.id}
        fields.update(pages=n, bytes=n * self.page_bytes, t=self.events.clock(), **extra)
        self.events.notify(name, fields)
        return fields
