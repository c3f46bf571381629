"""Lifecycle objects: one per admitted request, driven by the compiled table.

A :class:`Lifecycle` is a small ``__slots__`` object (about 50 bytes of state plus
its page list). It holds its manager; the manager holds it only while it is live,
so once RELEASED and dropped by the caller it is garbage (FAILURES F2).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NewType

import anyio

from kvoffload._events import STRUCTLOG, debug_enabled
from kvoffload.errors import KVOffloadError
from kvoffload.keys import TOKEN_TYPECODE
from kvoffload.lifecycle.spec import LifecycleState, Outcome
from kvoffload.lifecycle.table import EVENT_INDEX, TABLE

if TYPE_CHECKING:
    from kvoffload.manager import OffloadManager

__all__ = ["STATES", "Lifecycle", "LifecycleId"]

LifecycleId = NewType("LifecycleId", int)

#: States by table index (``LifecycleState.value``).
STATES: tuple[LifecycleState, ...] = tuple(LifecycleState)

_EXTEND = EVENT_INDEX["extend"]
#: For each state: is ``extend`` a self-loop there under every condition? (From the table.)
_EXTEND_SELF_LOOP: tuple[bool, ...] = tuple(
    all(dest == s for dest in TABLE[s][_EXTEND]) for s in range(len(STATES))
)


class Lifecycle:
    """The offload lifecycle of one admitted request.

    Created by :meth:`OffloadManager.admit`; never constructed directly. Every method
    is called from the event loop thread. ``extend``, ``finish`` and ``abort`` are
    synchronous, run-to-completion steps; waiting is ``await wait_*()``.

    Illegal events raise :class:`~kvoffload.InvalidTransition` and change nothing.
    """

    __slots__ = (
        "__weakref__",
        "_aborted",
        "_cap",
        "_deferred_since",
        "_failed",
        "_log",
        "_mgr",
        "_quiet_ev",
        "_released_ev",
        "_s",
        "_tail",
        "chain_key",
        "committed",
        "device_pages",
        "due",
        "id",
        "inflight",
        "outcome",
        "rid",
        "state_since",
        "submitted",
    )

    # id: unique for the manager's life; never reused (request ids may be).
    # rid: the caller's request id; a label for logs and metrics only.
    # _s: index of the current state in STATES; changed only by OffloadManager._fire.
    # committed: tokens whose KV is in device pages (prompt + extends).
    # submitted: tokens covered by submitted chunks or by the prefill side; page-aligned.
    # Invariant: 0 <= self.submitted <= self.committed and self.submitted % page_size == 0
    # _tail: token ids committed[submitted:], kept to compute keys at submit time (F11).
    # Invariant: len(self._tail) == self.committed - self.submitted
    # chain_key: key of the page that ends at `submitted` (None before the first page).
    # due: `committed` at which the next chunk is due (a stride past the last attempt).
    # device_pages: the device pages holding this request's KV, in token order.
    # _cap: tokens the device pages can hold; changed only where device pages are allocated.
    # Invariant: self._cap == len(self.device_pages) * page_size
    # Invariant: len(self.device_pages) == ceil(self.committed / page_size) while live; [] once RELEASED
    # inflight: chunks submitted and not yet delivered.
    # Invariant: self.inflight >= 0 and (self.inflight == 0 or state in (OFFLOADING, FINISHING))
    # _deferred_since: clock time a chunk started waiting for host pages, else None.
    # outcome: None until RELEASED, then how it ended.

    def __init__(self, mgr: OffloadManager, lid: LifecycleId, rid: Any, now: float) -> None:
        self._mgr = mgr
        self.id = lid
        self.rid = rid
        self._s = 0  # PENDING
        self.committed = 0
        self.submitted = 0
        self._tail: array[int] = array(TOKEN_TYPECODE)
        self.chain_key: str | None = None
        self.due = 0
        self.device_pages: list[int] = []
        self._cap = 0
        self.inflight = 0
        self._deferred_since: float | None = None
        self._failed = False
        self._aborted = False
        self.outcome: Outcome | None = None
        self.state_since = now
        self._released_ev: anyio.Event | None = None
        self._quiet_ev: anyio.Event | None = None
        self._log: Any = None

    # --- reading -------------------------------------------------------------------

    @property
    def state(self) -> LifecycleState:
        """The current state."""
        return STATES[self._s]

    @property
    def released(self) -> bool:
        """Whether the lifecycle reached RELEASED (its device pages are returned)."""
        return self._s == 3

    @property
    def aborted(self) -> bool:
        """Whether ``abort()`` was called."""
        return self._aborted

    @property
    def deferred(self) -> bool:
        """Whether a chunk is waiting for host pages (``on_host_full="wait"``)."""
        return self._deferred_since is not None

    @property
    def quiescent(self) -> bool:
        """No chunk in flight and none waiting: nothing reads this request's device pages."""
        return self.inflight == 0 and self._deferred_since is None

    @property
    def manager(self) -> OffloadManager:
        """The manager that admitted this lifecycle."""
        return self._mgr

    # --- events (sync, run to completion) ------------------------------------------

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` (their KV is now in device pages); submit a chunk when a
        stride is due.

        Legal in PENDING and OFFLOADING. Allocates device pages for the new tokens
        first: a full device pool raises :class:`~kvoffload.PoolExhausted` and
        changes nothing. Never blocks: a full host pool drops (or defers) the chunk.
        """
        # Fast path, the common decode step: a list of valid token ids, in a state where
        # extend is a pure self-loop (from the compiled table), no new page, no chunk due.
        # Everything else - errors included - goes through the manager's full path.
        if type(tokens) is list and _EXTEND_SELF_LOOP[self._s]:
            tail = self._tail
            n0 = len(tail)
            committed = self.committed + len(tokens)
            if committed <= self._cap and committed < self.due:
                try:
                    tail.extend(tokens)
                except (TypeError, OverflowError, ValueError):
                    del tail[n0:]  # atomic: the full path raises the typed error
                else:
                    self.committed = committed
                    mgr = self._mgr
                    if mgr._listeners or (STRUCTLOG.is_configured and debug_enabled()):
                        mgr._emit_transition(self, self._s, self._s, _EXTEND)
                    return
        self._mgr._extend(self, tokens)

    def finish(self) -> None:
        """The request finished decoding: flush the page-aligned remainder (F12), then
        go to FINISHING until the last in-flight chunk completes, or straight to
        RELEASED when nothing is in flight. Legal in PENDING and OFFLOADING."""
        self._mgr._finish(self)

    def abort(self) -> None:
        """Stop offloading: no new chunks; in-flight ones are discarded when they
        complete (host pages freed, nothing stored); RELEASED with outcome ABORTED
        after the last one. Legal in every live state."""
        self._mgr._abort(self)

    # --- waiting ---------------------------------------------------------------------

    async def wait_released(self) -> None:
        """Wait until RELEASED (device pages returned). Returns at once if already.
        Raises :class:`~kvoffload.KVOffloadError` when the manager is closed and a chunk
        of this lifecycle is still in flight or deferred: nothing will finish it."""
        while self._s != 3:
            self._check_open()
            if self._released_ev is None:
                self._released_ev = anyio.Event()
            await self._released_ev.wait()

    async def wait_quiescent(self) -> None:
        """The barrier of every path that wants this request's device pages back
        (retraction, preemption): wait until no chunk is in flight or waiting for
        host pages. Returns at once if already quiescent (FAILURES F6). Raises like
        :meth:`wait_released` on a closed manager."""
        while not self.quiescent:
            self._check_open()
            if self._quiet_ev is None:
                self._quiet_ev = anyio.Event()
            await self._quiet_ev.wait()

    def _check_open(self) -> None:
        if self._mgr._closed and not self.quiescent:
            raise KVOffloadError(f"{self!r}: the manager is closed; its chunk in flight will never complete")

    def _wake(self) -> None:
        """Wake every waiter (the manager closed): each looks again and raises or returns."""
        for ev in (self._released_ev, self._quiet_ev):
            if ev is not None:
                ev.set()
        self._released_ev = self._quiet_ev = None

    async def retract(self) -> None:
        """Retraction / preemption: abort (if still live) and wait until RELEASED, so
        the device pages are back in the pool when this returns and no copy reads them."""
        if self._s != 3:
            if not self._aborted:
                self.abort()
            await self.wait_released()

    def __repr__(self) -> str:
        return f"<Lifecycle #{self.id} rid={self.rid!r} {STATES[self._s].name} inflight={self.inflight}>"
