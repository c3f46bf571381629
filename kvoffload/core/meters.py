"""Meters: the figures the counters cannot give - how long and how big each transfer
was, how long a finished request waited for its release, how long a poll took, what
lookups found - kept as plain numbers for whoever reads them (``kvoffload.metrics``
turns them into Prometheus series at scrape time).

Everything here is per transfer, per storage job, per load, per release or per poll:
never per token, and never through a listener (a listener turns the core's fast paths
off). It costs a few additions and one bisect where it runs, and nothing at all while
nobody reads it. Written on the core's owner thread only; a reader on another thread
(a scrape) copies a histogram's list in one call and may see it one observation behind
its sum, never a torn count.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from kvoffload.abc import Completion, Transfer, WriteJob


class _Issued(Protocol):
    """A load as the meters see it (kvoffload.core.loads imports the registry, which
    holds the meters: no import of it here)."""

    @property
    def id(self) -> int: ...


L = TypeVar("L", bound=_Issued)

__all__ = [
    "DIRECTIONS",
    "DURATION_BUCKETS",
    "POLL_BUCKETS",
    "RELEASE_BUCKETS",
    "SIZE_BUCKETS",
    "Histogram",
    "Meters",
]

#: The four legs of a page's trip: device -> host (offload copy), host -> store (write),
#: store -> host (a load's read), host -> device (a load's copy).
DIRECTIONS = ("d2h", "h2s", "s2h", "h2d")
#: Transfer sizes in bytes: vLLM's ``TRANSFER_SIZE_BUCKETS`` (``vllm:kv_offload_*_size``).
SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
#: Transfer durations in seconds (10 us .. 10 s).
DURATION_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
#: Finish -> released, in seconds (0 for a request released at its finish).
RELEASE_BUCKETS = (1e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
#: A poll's (or delivery batch's) duration, in seconds: vLLM's lookup-delay buckets.
POLL_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)


class Histogram:
    """Observations counted per bucket: ``counts[i]`` holds those ``<= bounds[i]`` and
    ``> bounds[i - 1]``, the last slot those above every bound (Prometheus's ``le``
    buckets, not yet cumulative)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        # Invariant: len(self.counts) == len(self.bounds) + 1; sum of observed values in sum.
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> tuple[list[int], float]:
        """(per-bucket counts, sum), copied: safe to read from another thread."""
        return list(self.counts), self.sum


class Meters:
    """The core's meters (see the module doc). ``page_bytes``: the bytes of one page
    (0 when unknown: sizes are then 0)."""

    def __init__(self, page_bytes: int, clock: Callable[[], float]) -> None:
        self.page_bytes = page_bytes
        self.clock = clock
        # sizes[d][n]: transfers of leg d that moved n pages (a size histogram, bucketed
        # at scrape time: n pages are n * page_bytes bytes).
        self.sizes: dict[str, dict[int, int]] = {d: {} for d in DIRECTIONS}
        self.duration = {d: Histogram(DURATION_BUCKETS) for d in DIRECTIONS}
        self.release_delay = Histogram(RELEASE_BUCKETS)
        # timed: whether the drivers time their polls (kvoffload.metrics.register sets it:
        # two clock reads a poll are for someone who reads them).
        self.timed = False
        # poll: by op ("poll", "collective" under a group, "deliver" for the asyncio driver).
        self.poll: dict[str, Histogram] = {}
        # store_ops[(op, outcome)]: storage operations finished (write, read, lookup).
        self.store_ops: dict[tuple[str, str], int] = {}
        # lookup_pages[result]: pages asked of the store by lookups ("hit" / "miss").
        self.lookup_pages = {"hit": 0, "miss": 0}
        # pages_read: pages a load's store read returned (checked bytes): s2h pages.
        self.pages_read = 0
        # writing[job id]: when the driver took the write job (take_writes), until done.
        # Invariant: every key is a write job handed out and not yet finished
        self.writing: dict[int, float] = {}
        # reading[load id]: when the load began (its store read), until the read returned.
        # Invariant: every key is a live load whose read is outstanding
        self.reading: dict[int, float] = {}

    # --- transfers -------------------------------------------------------------------

    def transfer(self, direction: str, npages: int, seconds: float) -> None:
        """One finished transfer of ``npages`` pages that took ``seconds``."""
        sizes = self.sizes[direction]
        sizes[npages] = sizes.get(npages, 0) + 1
        self.duration[direction].observe(seconds)

    def copies(
        self,
        batch: Iterable[Completion],
        inflight: Mapping[int, Transfer],
        loads: Mapping[int, Any],
        now: float,
    ) -> None:
        """The copies of ``batch`` finished at ``now`` (called before the batch is
        applied): each d2h chunk and h2d load copy, up to the first completion that names
        no copy in flight (the core raises there, and what follows is not applied).
        One loop, the d2h histograms' updates inlined (it runs per copy)."""
        get = inflight.get
        sizes = self.sizes["d2h"]
        h = self.duration["d2h"]
        counts, bounds = h.counts, h.bounds
        total = 0.0
        try:
            for tid, _ in batch:
                t = get(tid)
                if t is None:
                    ld = loads.get(tid)
                    t = None if ld is None else ld.transfer
                    if t is None:
                        return
                    self.transfer(t.direction, len(t.host_pages), now - t.submitted_at)
                    continue
                n = len(t.host_pages)
                sizes[n] = sizes.get(n, 0) + 1
                d = now - t.submitted_at
                counts[bisect_left(bounds, d)] += 1
                total += d
        finally:
            h.sum += total

    def taken(self, jobs: list[WriteJob]) -> list[WriteJob]:
        """The write jobs were handed to the writer now; returns them."""
        if jobs:
            now = self.clock()
            writing = self.writing
            for job in jobs:
                writing[job.id] = now
        return jobs

    def written(self, job: WriteJob, stored: bool, attempts: int) -> None:
        """Write job ``job`` finished (stored, failed after ``attempts``, or skipped: 0)."""
        outcome = "stored" if stored else "skipped" if attempts == 0 else "failed"
        self.count("write", outcome)
        since = self.writing.pop(job.id, None)
        if since is not None and stored:
            self.transfer("h2s", len(job.host_pages), self.clock() - since)

    # --- loads -------------------------------------------------------------------------

    def wrap_loads(
        self, begin: Callable[..., L], read: Callable[..., list[L]]
    ) -> tuple[Callable[..., L], Callable[..., list[L]]]:
        """The load room's ``begin`` and ``read`` with the store read metered (s2h)."""
        reading, clock = self.reading, self.clock

        def load_begin(*args: Any, **kwargs: Any) -> L:
            ld = begin(*args, **kwargs)
            if getattr(ld, "reading", False):  # (a host pool too full to read into: DONE at once)
                reading[ld.id] = clock()
            return ld

        def load_read(ld: L, n_ok: int, error: BaseException | None = None) -> list[L]:
            done = read(ld, n_ok, error)
            since = reading.pop(ld.id, None)
            if since is not None:
                self.count("read", "error" if error is not None else "hit" if n_ok else "miss")
                if error is None and n_ok:
                    self.pages_read += n_ok
                    self.transfer("s2h", n_ok, clock() - since)
            return done

        load_begin.__doc__, load_read.__doc__ = begin.__doc__, read.__doc__
        return load_begin, load_read

    # --- storage operations, polls -----------------------------------------------------

    def count(self, op: str, outcome: str) -> None:
        """One storage operation ``op`` ended with ``outcome``."""
        key = (op, outcome)
        self.store_ops[key] = self.store_ops.get(key, 0) + 1

    def looked_up(self, asked: int, found: int) -> None:
        """A lookup asked the store for ``asked`` pages and found the first ``found``."""
        self.count("lookup", "ok")
        self.lookup_pages["hit"] += found
        self.lookup_pages["miss"] += asked - found

    def lookup_failed(self) -> None:
        """A lookup raised (the store could not answer)."""
        self.count("lookup", "error")

    def polled(self, op: str, seconds: float) -> None:
        """One poll (``op``) took ``seconds`` (the drivers time them while ``timed``)."""
        h = self.poll.get(op)
        if h is None:
            h = self.poll[op] = Histogram(POLL_BUCKETS)
        h.counts[bisect_left(h.bounds, seconds)] += 1
        h.sum += seconds
