"""Write-behind: a copied chunk's host pages go to the storage tier under their keys.

Runs in the manager's storage-writer task (:func:`write_loop`), one chunk at a time
in the order the copies completed, so the pages of one request reach the store in
chain order and ``exists_prefix`` stays a prefix for every reader. A lifecycle never
waits on this (it may be RELEASED long before); the chunk's host pages return to the
pool when its write finishes, stored or failed (FAILURES F15).

Failure policy (:class:`WritePolicy`): a chunk is tried up to ``attempts`` times with
exponential backoff; then its pages are counted as failed and its host pages
returned. After a chunk has failed, the store is taken as down: the next chunks get
one try each (no retries, no backoff) until one succeeds, so a dead store costs one
failed call per chunk and never stalls the queue. Failures are logged once per
*burst*: a ``storage.failed`` warning when the first chunk fails, a reminder at most
every ``log_interval_s`` while it lasts, and ``storage.recovered`` with the burst's
totals at the first success.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from kvoffload._events import STRUCTLOG, debug_enabled, logger
from kvoffload._flow import notify_listeners
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from kvoffload.abc import Storage, Transfer
    from kvoffload.manager import OffloadManager

__all__ = ["WritePolicy", "page_bytes", "write_chunk", "write_loop"]

#: Chunks larger than this are read out of the host pool on a worker thread.
_THREAD_COPY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class WritePolicy:
    """How the write-behind task retries and logs (``OffloadManager(write_policy=...)``)."""

    attempts: int = 3
    """Tries per chunk while the store is healthy (1: never retry)."""
    backoff_s: float = 0.05
    """Sleep before the first retry; doubled before each next one."""
    backoff_max_s: float = 1.0
    """Upper bound of one backoff sleep."""
    log_interval_s: float = 30.0
    """While failures go on, at most one ``storage.failed`` reminder per this many
    seconds of the manager's clock."""

    def __post_init__(self) -> None:
        if type(self.attempts) is not int or self.attempts < 1:
            raise ConfigError(f"attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("backoff_s", "backoff_max_s", "log_interval_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")

    def backoff(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (0-based)."""
        return float(min(self.backoff_s * (2**retry), self.backoff_max_s))


class _Burst:
    """The current run of failed chunks, for logging once per burst."""

    __slots__ = ("chunks", "last_log", "logged_pages", "pages", "since")

    def __init__(self) -> None:
        # since: clock time of the burst's first failure; None while the store is healthy.
        # Invariant: (self.since is None) == (self.chunks == 0)
        self.since: float | None = None
        self.chunks = 0
        self.pages = 0
        self.last_log = 0.0
        self.logged_pages = 0  # pages of the burst already reported in a log line


def page_bytes(mgr: OffloadManager, host_pages: list[int]) -> list[bytes]:
    """The raw bytes of each host page (a copy: the pages return to the pool after).

    A pool is page-major, so each page is one contiguous block: one memcpy per page.
    """
    import torch

    pool = mgr.host_pool.tensor
    if pool.is_contiguous() and pool.device.type == "cpu":
        rows = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()
        return [rows[p].tobytes() for p in host_pages]
    picked = pool[torch.tensor(host_pages, dtype=torch.long)].cpu().contiguous()
    flat = picked.view(torch.uint8).reshape(len(host_pages), -1).numpy()
    return [flat[i].tobytes() for i in range(len(host_pages))]


async def _read_pages(mgr: OffloadManager, host_pages: list[int]) -> list[bytes]:
    pool = mgr.host_pool
    size = len(host_pages) * pool.tensor[0].nbytes if pool.n_pages else 0
    if size > _THREAD_COPY_BYTES:  # host pages are held: stable for a worker thread to read
        return await anyio.to_thread.run_sync(page_bytes, mgr, host_pages)
    return page_bytes(mgr, host_pages)


async def write_chunk(
    mgr: OffloadManager, storage: Storage, t: Transfer, policy: WritePolicy, burst: _Burst
) -> bool:
    """Write ``t``'s pages under ``t.keys`` with bounded retries; count the outcome.

    Returns whether the pages were stored. Never raises an ordinary storage failure
    (it is counted and logged once per burst); cancellation propagates.
    """
    c = mgr.counters
    n = len(t.host_pages)
    pages = await _read_pages(mgr, t.host_pages)
    attempts = 1 if burst.since is not None else policy.attempts
    error: Exception | None = None
    for attempt in range(attempts):
        if attempt:
            c.pages_store_retried += n
            await anyio.sleep(policy.backoff(attempt - 1))
        try:
            await storage.put(t.keys, pages)
        except Exception as exc:  # a store may raise anything; it is this chunk's failure
            error = exc
            continue
        c.pages_stored += n
        if burst.since is not None:
            _recovered(mgr, burst, t)
        if mgr._listeners or (STRUCTLOG.is_configured and debug_enabled()):
            fields = _notify(mgr, "storage.written", t, attempts=attempt + 1)
            if STRUCTLOG.is_configured and debug_enabled():
                logger.debug("storage.written", **fields)
        return True
    assert error is not None
    c.pages_store_failed += n
    _failed(mgr, burst, t, n, attempts, error)
    return False


def _failed(mgr: OffloadManager, burst: _Burst, t: Transfer, n: int, attempts: int, error: Exception) -> None:
    now = mgr.clock()
    if burst.since is None:
        burst.since = now
        burst.last_log = now
        burst.logged_pages = n
        logger.warning(
            "storage.failed",
            storage=mgr.storage.name if mgr.storage is not None else None,
            transfer=t.id,
            pages=n,
            attempts=attempts,
            error=repr(error),
        )
    elif now - burst.last_log >= mgr.write_policy.log_interval_s:
        logger.warning(
            "storage.failed",
            storage=mgr.storage.name if mgr.storage is not None else None,
            pages_failed_since_last_log=burst.pages + n - burst.logged_pages,
            burst_s=now - burst.since,
            error=repr(error),
        )
        burst.last_log = now
        burst.logged_pages = burst.pages + n
    burst.chunks += 1
    burst.pages += n
    if mgr._listeners:
        _notify(mgr, "storage.failed", t, attempts=attempts, error=repr(error))


def _recovered(mgr: OffloadManager, burst: _Burst, t: Transfer) -> None:
    assert burst.since is not None
    fields = {
        "chunks_failed": burst.chunks,
        "pages_failed": burst.pages,
        "burst_s": mgr.clock() - burst.since,
    }
    logger.info("storage.recovered", **fields)
    burst.since = None
    burst.chunks = burst.pages = burst.logged_pages = 0
    if mgr._listeners:
        _notify(mgr, "storage.recovered", t, **fields)


def _notify(mgr: OffloadManager, name: str, t: Transfer, **extra: object) -> dict[str, object]:
    """Send event ``name`` about ``t`` to the listeners; return its fields."""
    n = len(t.host_pages)
    lc = t.lifecycle
    fields: dict[str, object] = {"lifecycle": lc.id, "rid": lc.rid, "transfer": t.id, "pages": n}
    fields.update(bytes=n * mgr.page_bytes, t=mgr.clock(), **extra)
    notify_listeners(mgr._listeners, name, fields)
    return fields


async def write_loop(mgr: OffloadManager) -> None:
    """The storage-writer task: write queued chunks in order, for ever.

    ``mgr._writes`` holds the copied chunks whose host pages wait for their write; the
    head is the one being written. After each write, success or failure, the manager
    takes the chunk off the queue and returns its host pages (``_write_done``).
    """
    storage = mgr.storage
    assert storage is not None
    policy = mgr.write_policy
    burst = _Burst()
    writes = mgr._writes
    while True:
        if not writes:
            mgr._write_ev = anyio.Event()
            await mgr._write_ev.wait()
            mgr._write_ev = None
            continue
        t = writes[0]
        await write_chunk(mgr, storage, t, policy, burst)
        mgr._write_done(t)
        del t  # hold no transfer (so no lifecycle) while waiting for the next (F2)
