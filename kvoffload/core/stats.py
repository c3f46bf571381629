"""The manager's counters, and the frozen :class:`Statistics` snapshot of them.

The ledger (ARCHITECTURE.md rule 6), checked by ``OffloadManager.check_invariants``:

- ``admitted == live_lifecycles + released``
- ``chunks_submitted == chunks_inflight + chunks_copied + chunks_discarded + chunks_failed``
  (and the same for pages). A *dropped* chunk never got host pages, so it was never
  submitted: drops are counted beside the ledger, not in it.
- ``pages_copied == pages_stored + pages_store_failed + pages_store_unreachable +
  pages_store_skipped + pages_in_write + pages_not_stored`` (per page, F34: a page is in
  ``pages_stored`` only when its store confirmed it and every page before it in its chunk)
- ``chunks_store_partial <= pages_store_unconfirmed <= pages_store_failed`` (a partial
  chunk has at least one page its store did not confirm)
- ``loads_begun == loads_live + loads_loaded + loads_partial + loads_missed +
  loads_failed + loads_cancelled``
- no count is negative.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Counters", "Statistics"]


@dataclass(slots=True)
class Counters:
    """Mutable counters, changed only by the core, on its owner thread."""

    admitted: int = 0
    chunks_copied: int = 0
    chunks_deferred: int = 0
    chunks_discarded: int = 0
    chunks_dropped: int = 0
    chunks_expired: int = 0
    chunks_failed: int = 0
    chunks_inflight: int = 0
    chunks_refused: int = 0
    # Per page (F34): a chunk stored in part has at least one page not confirmed.
    # Invariant: chunks_store_partial <= pages_store_unconfirmed <= pages_store_failed
    chunks_store_partial: int = 0
    chunks_submitted: int = 0
    completions_delivered: int = 0
    load_pages_inflight: int = 0
    load_pages_missed: int = 0
    loads_begun: int = 0
    loads_cancelled: int = 0
    loads_failed: int = 0
    loads_loaded: int = 0
    loads_missed: int = 0
    loads_partial: int = 0
    pages_copied: int = 0
    pages_discarded: int = 0
    pages_dropped: int = 0
    pages_failed: int = 0
    pages_in_write: int = 0
    pages_inflight: int = 0
    pages_lost: int = 0
    pages_refused: int = 0
    pages_not_stored: int = 0
    pages_store_failed: int = 0
    pages_store_retried: int = 0
    pages_store_skipped: int = 0
    pages_store_unconfirmed: int = 0
    # pages_store_unreachable: confirmed after a page of their chunk that was not, so in
    # the store but never counted stored. Invariant: in the pages ledger (module doc).
    pages_store_unreachable: int = 0
    pages_stored: int = 0
    pages_submitted: int = 0
    released_aborted: int = 0
    released_completed: int = 0
    released_failed: int = 0
    stuck_reports: int = 0
    pages_loaded: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        """Every counter name."""
        return tuple(f.name for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        """Every counter by name (each is also a :class:`Statistics` field)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class Statistics:
    """A snapshot of a manager's state and counters (``mgr.statistics()``)."""

    live_lifecycles: int
    """Lifecycles admitted and not yet RELEASED."""
    pending: int
    """Live lifecycles in PENDING."""
    offloading: int
    """Live lifecycles in OFFLOADING."""
    finishing: int
    """Live lifecycles in FINISHING."""
    admitted: int
    """Lifecycles ever admitted."""
    released_completed: int
    released_aborted: int
    released_failed: int
    device_pages_used: int
    device_pages_total: int
    host_pages_used: int
    host_pages_total: int
    chunks_inflight: int
    """Chunks submitted to the backend whose completion has not been delivered."""
    chunks_submitted: int
    chunks_copied: int
    """Chunks whose copy completed for a lifecycle that was not aborted."""
    chunks_discarded: int
    """Chunks whose copy completed after their lifecycle was aborted, or after a hole in
    its chain - an earlier chunk failed to copy or to store (F33) - not stored."""
    chunks_failed: int
    """Chunks whose copy failed."""
    chunks_dropped: int
    """Chunks never submitted because the host pool was full (retried a stride later)."""
    chunks_deferred: int
    """Chunks that had to wait for host pages (``on_host_full="wait"``)."""
    chunks_expired: int
    """Deferred chunks whose wait for host pages ran out (``host_wait_s``,
    ``host_wait_polls``, or the manager closing): dropped, each also counted in
    ``chunks_dropped``; what a finished request never sent is in ``pages_lost``."""
    chunks_refused: int
    """Chunks the copy backend refused outside a caller's call (a deferred chunk's retry,
    a tail flushed after the first of its chunks): dropped, counted, retried a stride
    later while decoding (FAILURES F20). Each is also counted in ``chunks_dropped``."""
    completions_delivered: int
    """Completions applied to their lifecycles (what ``poll()`` returns, summed)."""
    pages_inflight: int
    pages_submitted: int
    pages_copied: int
    pages_discarded: int
    pages_failed: int
    pages_dropped: int
    """Pages of dropped chunks, per attempt: a page dropped, retried a stride later and
    dropped again counts twice. What was lost for good is ``pages_lost``."""
    pages_lost: int
    """Whole pages a finished request should have offloaded and did not: the sum of
    every released lifecycle's ``pages_lost``. Counted when it is released - pages never
    sent (drops or refusals never made good, a ``"wait"`` that expired) and every page
    from a hole in its chain on (a failed copy or storage write: F33) - and raised when a
    storage write of it fails after its release. An aborted request loses nothing."""
    pages_refused: int
    pages_stored: int
    """Pages written to the storage tier and reachable: each confirmed by the store (F34),
    as was every page before it in its chain."""
    pages_store_failed: int
    """Pages whose storage write failed (after retries): not confirmed by the store;
    their host pages were returned."""
    chunks_store_partial: int
    """Chunks whose storage write ended (after retries) with some pages confirmed by the
    store and others not (F34): only the confirmed ones before the first unconfirmed
    page count as stored; the chain breaks there (F33)."""
    pages_store_unconfirmed: int
    """Pages of those partial chunks the store never confirmed, dropped after their
    retries (each also counted in ``pages_store_failed``)."""
    pages_store_unreachable: int
    """Pages the store confirmed after an unconfirmed page of the same chunk (F34): in the
    store, but no lookup reaches them past the hole, so not counted as stored."""
    pages_store_retried: int
    """Pages re-sent by a retried storage write: a retry re-sends only the pages the store
    has not confirmed (a chunk of n pages retried once after a plain failure adds n)."""
    pages_store_skipped: int
    """Copied pages never written because an earlier page of their request's chain was
    not stored (its copy or write failed, or the request was aborted first): written,
    no lookup could have reached them (F33). Their host pages were returned."""
    pages_in_write: int
    """Pages copied to the host and waiting for (or in) their storage write."""
    pages_not_stored: int
    """Pages copied while the manager had no storage tier."""
    stuck_reports: int
    """Watchdog reports of a lifecycle past ``stuck_after_s`` in OFFLOADING/FINISHING."""
    loads_live: int
    """Loads begun and not yet DONE (the load path: store -> host -> device pages)."""
    load_host_pages: int
    """Host pages the live loads hold."""
    loads_begun: int
    """Loads ever begun (``loads_begun == loads_live`` + every outcome below)."""
    loads_loaded: int
    """Loads that ended LOADED: every page asked for is in its device page."""
    loads_partial: int
    """Loads that ended PARTIAL: a leading run loaded, the rest missing or corrupt (F38)."""
    loads_missed: int
    """Loads that ended MISSED: no page read (none stored, the first corrupt, or no host pages)."""
    loads_failed: int
    """Loads that ended FAILED: the store read raised or the copy failed (F38)."""
    loads_cancelled: int
    """Loads that ended CANCELLED: the engine took the device pages back first."""
    pages_loaded: int
    """Pages whose bytes a load put in device pages (the sum of ``pages_loaded``)."""
    load_pages_missed: int
    """Pages asked for by loads that ended (not cancelled) and not loaded: the engine
    recomputes them."""
    load_pages_inflight: int
    """Pages in a load's host->device copy in flight."""

    def as_dict(self) -> dict[str, int]:
        """The snapshot as a plain dict (for JSON and logs)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
