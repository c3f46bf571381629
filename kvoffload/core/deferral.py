"""The deferral FIFO: chunks that wait for host pages (``on_host_full="wait"``).

A chunk that finds the host pool full under the ``"wait"`` policy is not dropped: its
lifecycle joins this FIFO and the chunk goes out, oldest first, as host pages return
(:meth:`HostWait.pump`: after deliveries, finished writes, and each tick or poll). A
wait is bounded - by ``host_wait_s`` on the clock, by ``host_wait_polls`` in scheduler
steps - and expires into a counted drop (F9); once the core closes, every wait does.
A later chunk of a waiting lifecycle waits behind it (its tokens stay in the tail).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvoffload.core.events import Events
from kvoffload.core.lifecycle import Lifecycle
from kvoffload.core.registry import Registry
from kvoffload.core.stats import Counters
from kvoffload.lifecycle.spec import LifecycleState
from kvoffload.lifecycle.table import EVENT_INDEX

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig
    from kvoffload.pools import HostPool

__all__ = ["HostWait", "Sender"]

_DROPPED = EVENT_INDEX["chunk_dropped"]
_FINISHING = LifecycleState.FINISHING.value
_RELEASED = LifecycleState.RELEASED.value


class Sender(Protocol):
    """What the FIFO asks of the chunks (:class:`kvoffload.core.chunks.Chunks`) to retry
    a waiting chunk, or to count it dropped."""

    def submit(self, lc: Lifecycle, n: int) -> bool: ...

    def flush(self, lc: Lifecycle) -> None: ...

    def refused(self, lc: Lifecycle, npages: int, error: BaseException) -> None: ...

    def drop(self, lc: Lifecycle, npages: int) -> None: ...


class HostWait:
    """The deferral FIFO of one core.

    ``chunks`` (the chunks that retry a waiting chunk) and ``sync_row`` (the decode
    step's: a waiting lifecycle's batch row writes its tokens to its tail) are set by
    the core that wires the rooms."""

    chunks: Sender
    sync_row: Callable[[Lifecycle], None]

    def __init__(
        self,
        config: OffloadConfig,
        counters: Counters,
        host_pool: HostPool,
        registry: Registry,
        events: Events,
        page_bytes: int,
    ) -> None:
        self.config = config
        self.counters = counters
        self.host_pool = host_pool
        self.registry = registry
        self.events = events
        self.page_bytes = page_bytes
        # queue: lifecycles whose next chunk waits for host pages, FIFO.
        # Invariant: all(lc._deferred_since is not None for lc in self.queue)
        self.queue: deque[Lifecycle] = deque()
        # polls: SyncOffloadManager.poll() calls so far (scheduler steps; the same on every
        # TP rank): the clock of host_wait_polls. Only the sync driver counts it.
        self.polls = 0

    def defer(self, lc: Lifecycle, npages: int) -> None:
        """``lc``'s chunk of ``npages`` found the host pool full: it waits (once)."""
        if lc._deferred_since is None:
            lc._deferred_since = self.events.clock()
            lc._deferred_poll = self.polls
            self.queue.append(lc)
            self.counters.chunks_deferred += 1
            if self.events.observed:
                self.events.emit("chunk.deferred", lc, pages=npages, bytes=npages * self.page_bytes)

    def cancel(self, lc: Lifecycle) -> None:
        """``lc``'s waiting chunk is given up (an abort, a hole): it leaves the FIFO."""
        lc._deferred_since = None
        self.queue.remove(lc)
        lc._wake_quiet()

    def pump(self) -> None:
        """Submit deferred chunks, oldest first, while host pages last; drop the expired.
        A mover's refusal fails that chunk only (F20). Once the core is closing, every
        deferred chunk is dropped: no copy may start."""
        q = self.queue
        cfg = self.config
        ps = cfg.page_size
        now = self.events.clock()
        fire = self.registry.fire
        chunks = self.chunks
        while q:
            lc = q[0]
            since = lc._deferred_since
            if since is None or lc._s == _RELEASED:
                q.popleft()
                continue
            pending = lc.committed - lc.submitted
            final = lc._s == _FINISHING
            wanted = pending - pending % (ps if final else cfg.stride)
            n = min(wanted, cfg.host_pages * ps)
            expired = (
                self.registry.closing
                or (cfg.host_wait_s is not None and now - since > cfg.host_wait_s)
                or (cfg.host_wait_polls is not None and self.polls - lc._deferred_poll > cfg.host_wait_polls)
            )
            if not expired and n > 0 and self.host_pool.free_pages < n // ps:
                break  # FIFO: later ones wait behind this one
            q.popleft()
            lc._deferred_since = None
            if expired or n <= 0:  # (n <= 0: nothing left to send, a prompt chunk sent with a later one)
                if expired:
                    self.counters.chunks_expired += 1
                    chunks.drop(lc, wanted // ps)  # every page not sent, as submit counts
                lc._wake_quiet()
                fire(lc, _DROPPED)
                continue
            if lc._row >= 0:  # visited every step while deferred: nothing held (made sure)
                self.sync_row(lc)
            if final:
                chunks.flush(lc)  # may defer the rest again: it rejoins the queue
            else:
                try:
                    chunks.submit(lc, n)
                except Exception as exc:
                    chunks.refused(lc, wanted // ps, exc)
            if lc.quiescent:  # nothing went out: a refused or dropped chunk
                lc._wake_quiet()
                fire(lc, _DROPPED)
