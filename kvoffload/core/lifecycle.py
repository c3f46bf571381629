"""Lifecycle objects: one per admitted request, driven by the compiled table.

A :class:`Lifecycle` is a small ``__slots__`` object: the caller's handle (its public
reads and events) and the core's record of the request (the core-owned fields, below:
written only by the core's rooms in this package, read by anyone through the public
properties). It holds its core and, through the core, its driver (the
:class:`LifecycleHost` protocol declared here, so the arrow still points down: the
lifecycle never imports a driver); the core holds it only while it is live, so once
RELEASED and dropped by the caller it is garbage (FAILURES F2).

Every method checks that it runs on the owner thread (the driver's: the event loop's
thread, or the thread that opened the sync manager) before it changes anything (F24).
"""

from __future__ import annotations

from _thread import get_ident
from array import array
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NewType, Protocol

from kvoffload.errors import KVOffloadError, wrong_thread
from kvoffload.keys import INT_DTYPES, TOKEN_TYPECODE
from kvoffload.lifecycle.spec import LifecycleState, Outcome
from kvoffload.lifecycle.table import EVENT_INDEX, TABLE

__all__ = [
    "EXTEND_SELF_LOOP",
    "STATES",
    "Lifecycle",
    "LifecycleCore",
    "LifecycleHost",
    "LifecycleId",
    "Waker",
    "requiet",
]

LifecycleId = NewType("LifecycleId", int)

#: States by table index (``LifecycleState.value``).
STATES: tuple[LifecycleState, ...] = tuple(LifecycleState)

_EXTEND = EVENT_INDEX["extend"]
#: For each state: is ``extend`` a self-loop there under every condition? (From the table.)
EXTEND_SELF_LOOP: tuple[bool, ...] = tuple(
    all(dest == s for dest in TABLE[s][_EXTEND]) for s in range(len(STATES))
)


class Waker(Protocol):
    """What the core sets when a lifecycle a driver waits on changes (an ``anyio.Event``,
    a ``threading.Event``): the core only calls ``set()``."""

    def set(self) -> None: ...


class LifecycleHost(Protocol):
    """What a lifecycle asks of the driver that admitted it (both drivers implement it).

    Each method is called on the owner thread, after the owner check; each applies the
    event through the core and then does the driver's part (starting copies on the next
    turn, calling ``on_released``).
    """

    def finish_lifecycle(self, lc: Lifecycle) -> None: ...

    def abort_lifecycle(self, lc: Lifecycle) -> None: ...

    def wait_lifecycle(self, lc: Lifecycle, released: bool) -> Awaitable[None]: ...


class LifecycleCore(Protocol):
    """What a lifecycle asks of its core (:class:`~kvoffload.core.offload.OffloadCore`):
    the decode step's entry points (its fast paths call them), the driver, whether the
    core closed, and the batch rows whose tokens ``committed`` counts."""

    @property
    def host(self) -> LifecycleHost: ...

    @property
    def closing(self) -> bool: ...

    @property
    def rows_step(self) -> int: ...

    def extend(
        self, lc: Lifecycle, tokens: Sequence[int], *, pages: Any = None, ready: Any = None
    ) -> None: ...

    def extend_due(self, lc: Lifecycle, t: int) -> bool: ...

    def grow_one(self, lc: Lifecycle) -> bool: ...

    def grow(self, lc: Lifecycle, committed: int) -> bool: ...


def _dtype_name(tokens: Any) -> str:
    """A numpy array's or torch tensor's dtype as ``validate_tokens`` names it."""
    return str(tokens.dtype).removeprefix("torch.")


def requiet(lc: Lifecycle, observed: bool) -> None:
    """Recompute ``lc._quiet``, the fast path's one comparison (see the record below).
    No fast path while someone observes events (``observed``): the full path emits them."""
    quiet = (
        EXTEND_SELF_LOOP[lc._s]
        and lc._tail.typecode == TOKEN_TYPECODE
        and not observed
        and lc._row < 0  # a row's tokens are not in the tail yet: no fast path
    )
    lc._quiet = lc.due - 1 if quiet else -1


class Lifecycle:
    """The offload lifecycle of one admitted request.

    Created by ``admit`` on a manager; never constructed directly. Every method is
    called from the owner thread (else :class:`~kvoffload.WrongThread`, nothing
    changed). ``extend``, ``finish`` and ``abort`` are synchronous, run-to-completion
    steps; waiting is ``await wait_*()`` (asyncio manager) or the sync manager's
    ``wait_released(lc)`` / ``quiesce()``.

    Illegal events raise :class:`~kvoffload.InvalidTransition` and change nothing.
    """

    __slots__ = (
        "__weakref__",
        "_aborted",
        "_cap",
        "_chain",
        "_committed",
        "_core",
        "_deferred_poll",
        "_deferred_since",
        "_failed",
        "_from",
        "_front",
        "_log",
        "_owner",
        "_quiet",
        "_quiet_ev",
        "_released_ev",
        "_row",
        "_s",
        "_stop",
        "_tail",
        "_wchain",
        "device_pages",
        "due",
        "id",
        "inflight",
        "outcome",
        "pages_lost",
        "rid",
        "state_since",
        "submitted",
        "tag",
    )

    # The handle (set at admit, never changed):
    # id: unique for the core's life; never reused (request ids may be).
    # rid: the caller's request id; a label for logs and metrics only.
    # tag: the engine's handle (e.g. its Req); carried, never read by kvoffload.
    # _core: the core (facade) that admitted it; _owner: the owner thread's ident, which
    #   every method checks first (F24).
    #
    # The core's record of the request: written only by the core's rooms (the modules
    # of kvoffload.core, each field by the room named), read by anyone through the
    # public properties. Outside kvoffload.core nothing writes them.
    #
    # Registry (core/registry.py) - its state and how it ended:
    # _s: index of the current state in STATES; changed only by Registry.fire.
    # state_since: clock time it entered its state.
    # outcome: None until RELEASED, then how it ended.
    # _aborted: abort() was called (the facade sets it); _failed: a copy failed or a
    #   finishing lifecycle's tail was refused (the chunks set it).
    # pages_lost: whole pages this request should have offloaded and did not (F33, F9):
    #   0 while live; set at RELEASED (never for an aborted one), raised later by a
    #   storage write of it that fails after its release (Writes.hole).
    # Invariant: self.pages_lost >= 0 and (self.pages_lost == 0 or self._s == RELEASED)
    #
    # DecodeStep (core/step.py, core/rows.py, and the fast paths of extend below) - what
    # is committed:
    # committed (a property): tokens whose KV is in device pages (prompt + extends):
    #   _committed, plus the tokens its extend_batch row holds that the tail does not yet.
    # _row: its row in the step's DecodeRows, -1 when it holds none; _from: the rows'
    #   step since which the row holds its tokens.
    # _tail: token ids committed[submitted:], kept to compute keys at submit time (F11);
    #   the chunks take a sent chunk's tokens off its front.
    # Invariant: len(self._tail) + (rows' step - self._from if self._row >= 0 else 0)
    #   == self.committed - self.submitted
    # device_pages: the device pages holding this request's KV, in token order; at
    #   RELEASED still the pages it held while on_released(lc) runs (the engine frees
    #   them from there), then [] once the call that released it told the engine.
    # _cap: tokens the device pages can hold; changed only where device pages are added.
    # Invariant: self._cap == len(self.device_pages) * page_size
    # Invariant: len(self.device_pages) == ceil(self.committed / page_size) while live; [] once
    #   RELEASED and the driver's on_released calls for it returned
    # _quiet: the largest `committed` an extend may reach on the fast path: due - 1 while
    #   extend is a self-loop of the state (PENDING, OFFLOADING), the tail is narrow, it
    #   holds no row and no one observes events (the full path emits them), else -1.
    #   Recomputed by requiet() wherever one of those changes.
    # Invariant: self._quiet == (self.due - 1 if self._s in (0, 1) and narrow tail
    #   and self._row < 0 and not core.observed else -1)
    #
    # Chunks (core/chunks.py) - what is sent:
    # submitted: tokens covered by submitted chunks, or already stored; page-aligned.
    # Invariant: 0 <= self.submitted <= self.committed and self.submitted % page_size == 0
    # _chain: SHA-256 digest of the page that ends at `submitted` (the chain seed's bytes
    #   before the first page; b"" at the root). Its hex is `chain_key`.
    # due: `committed` at which the next chunk is due (a stride past the last attempt).
    # inflight: chunks submitted and not yet delivered.
    # Invariant: self.inflight >= 0 and (self.inflight == 0 or state in (OFFLOADING, FINISHING))
    # _deferred_since: clock time a chunk started waiting for host pages, else None.
    # _deferred_poll: the poll count when that wait began (read only while
    #   _deferred_since is not None: the wait's bound in polls, host_wait_polls).
    # _stop: the token at which offload stopped - a chunk from there failed, or its store
    #   write did (F33) - else -1. No chunk is submitted once it is set (due is NEVER).
    #   At RELEASED (not aborted): where the stored chain ends (the registry sets it).
    # Invariant: self._stop == -1 or self._s == RELEASED or (self._stop <= self.submitted
    #   and self._deferred_since is None)
    #
    # Writes (core/writes.py) - what is stored:
    # _front: with storage, the first token of its oldest chunk whose copy has not been
    #   delivered (== submitted when none); a chunk is queued for its write only from
    #   there, so its writes go to the store in chain order whatever order copies end in.
    # _wchain: what its write jobs share (the core's WriteChain), None before the first.
    #
    # This class's own: _released_ev / _quiet_ev, a driver's Waker (waker()), set when
    # the lifecycle is RELEASED / quiescent, None when nobody waits. _log: its bound
    # logger, made by the core's events on the first debug event.

    def __init__(self, core: LifecycleCore, lid: LifecycleId, rid: Any, now: float, owner: int) -> None:
        self._core = core
        self._owner = owner
        self.id = lid
        self.rid = rid
        self.tag: Any = None
        self._s = 0  # PENDING
        self._committed = 0
        self._row = -1
        self._from = 0
        self.submitted = 0
        self._tail: array[int] = array(TOKEN_TYPECODE)
        self._chain = b""
        self.due = 0
        self._quiet = -1
        self.device_pages: list[int] = []
        self._cap = 0
        self.inflight = 0
        self._deferred_since: float | None = None
        self._deferred_poll = 0
        self._failed = False
        self._aborted = False
        self.outcome: Outcome | None = None
        self.pages_lost = 0
        self._stop = -1
        self._front = 0
        self._wchain: Any = None
        self.state_since = now
        self._released_ev: Waker | None = None
        self._quiet_ev: Waker | None = None
        self._log: Any = None

    # --- reading -------------------------------------------------------------------

    @property
    def committed(self) -> int:
        """Tokens whose KV is in device pages: the prompt and every extend."""
        if self._row < 0:
            return self._committed
        return self._committed + self._core.rows_step - self._from

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
    def manager(self) -> Any:
        """The manager (driver) that admitted this lifecycle."""
        return self._core.host

    @property
    def chain_key(self) -> str | None:
        """Key of the last submitted (or stored) page, hex; the chain seed before the
        first page; ``None`` at the root of an unseeded chain."""
        return self._chain.hex() if self._chain else None

    # --- events (sync, run to completion) ------------------------------------------

    def extend(self, tokens: Sequence[int], *, pages: Sequence[int] | None = None, ready: Any = None) -> None:
        """Commit ``tokens`` (their KV is now in device pages); submit a chunk when a
        stride is due.

        Legal in PENDING and OFFLOADING. Owned mode: allocates device pages for the new
        tokens first (a full device pool raises :class:`~kvoffload.PoolExhausted` and
        changes nothing; ``pages`` must be None or empty). Engine-owned mode: ``pages``
        are the engine's ids of exactly the new pages these tokens start, in token order
        (None or ``[]`` when none; a set is refused: see
        :func:`kvoffload.pools.page_ids`). Every path of this call - its fast paths, the
        full one, with or without a listener - accepts and refuses the same input, with
        nothing changed on refusal. ``ready`` is what the copy must wait for on a
        GPU. Never blocks: a full host pool drops (or defers) the chunk. A chunk made
        due here is submitted at once, but no copy reads a page before control returns
        to the driver (F19).
        """
        if get_ident() != self._owner:
            raise wrong_thread(self._owner, "Lifecycle.extend()")
        # Fast path, the common decode step: a list of valid token ids, in a state where
        # extend is a pure self-loop (from the compiled table), no chunk due; a new page
        # is allocated inline. Everything else - errors included - takes the full path.
        # One comparison decides it: _quiet is due - 1 in a state where extend is a
        # self-loop with a narrow tail, else -1. A uint64 tail takes the full path
        # (array("Q") would take ids >= 2**63), and so does a bool (array("I") takes it).
        # pages: only None or [] ("no pages", as on the full path); anything else - a numpy
        # array whose truth value says nothing of its length included - takes the full path.
        if type(tokens) is list and (pages is None or (type(pages) is list and not pages)) and ready is None:
            if len(tokens) == 1:  # one decode step of one token: the hottest path
                t = tokens[0]
                committed = self._committed + 1
                if committed > self._quiet:
                    if committed == self._quiet + 1 and type(t) is int and self._core.extend_due(self, t):
                        return  # this token made a chunk due: it went out
                elif type(t) is int:
                    tail = self._tail
                    try:
                        tail.append(t)  # OverflowError for an id < 0 or >= 2**32: not appended
                    except OverflowError:
                        pass  # the full path raises the typed error
                    else:
                        if committed <= self._cap or self._core.grow_one(self):
                            self._committed = committed
                            return
                        tail.pop()  # no page here: the full path asks for it (or raises)
            committed = self._committed + len(tokens)
            if committed <= self._quiet:
                tail = self._tail
                n0 = len(tail)
                try:
                    tail.extend(tokens)
                    if (
                        (type(tokens[0]) is not int)
                        if len(tokens) == 1
                        else (True in tokens or False in tokens)
                    ):
                        raise TypeError  # a bool (or an id equal to one: the full path tells them apart)
                    if committed > self._cap and not self._core.grow(self, committed):
                        raise TypeError  # engine-owned: the full path asks for the page
                except (TypeError, OverflowError, ValueError, KVOffloadError):
                    del tail[n0:]  # atomic: the full path raises the typed error
                else:
                    self._committed = committed
                    return
        elif getattr(tokens, "ndim", None) == 1 and _dtype_name(tokens) in INT_DTYPES:
            # A one-dimensional integer numpy array or torch tensor (next_token_ids[i:i+1],
            # un-listed): exactly the ids its tolist() gives - what the full path reads of
            # it too - so it takes the fast path as that list (no silent cliff).
            self.extend(tokens.tolist(), pages=pages, ready=ready)  # type: ignore[attr-defined]
            return
        self._core.extend(self, tokens, pages=pages, ready=ready)

    def finish(self) -> None:
        """The request finished decoding: flush the page-aligned remainder (F12), then
        go to FINISHING until the last in-flight chunk completes, or straight to
        RELEASED when nothing is in flight. Legal in PENDING and OFFLOADING (else
        :class:`~kvoffload.InvalidTransition`; :class:`~kvoffload.ManagerClosed` once the
        manager closed). Called by a listener while the manager delivers a batch, it is
        applied once the batch is (an error then comes out of the manager's call)."""
        if get_ident() != self._owner:
            raise wrong_thread(self._owner, "Lifecycle.finish()")
        self._core.host.finish_lifecycle(self)

    def abort(self) -> None:
        """Stop offloading: no new chunks; in-flight ones are discarded when they
        complete (host pages freed, nothing stored); RELEASED with outcome ABORTED
        after the last one. Legal in every live state.

        A no-op on a RELEASED lifecycle (a client disconnect racing the request's own
        finish) and after the manager closed (closing aborted it): returns None and
        changes nothing - no event, outcome and counters as they were. (``finish()``
        after RELEASED stays an :class:`~kvoffload.InvalidTransition`.) Called by a
        listener while the manager delivers a batch, it is applied once the batch is
        (the lifecycle changes before the manager's call returns)."""
        if get_ident() != self._owner:
            raise wrong_thread(self._owner, "Lifecycle.abort()")
        if self._s == 3 or (self._aborted and self._core.closing):
            return
        self._core.host.abort_lifecycle(self)

    # --- waiting (asyncio manager) ---------------------------------------------------

    async def wait_released(self) -> None:
        """Wait until RELEASED (device pages returned). Returns at once if already.
        Raises :class:`~kvoffload.KVOffloadError` when the manager is closed and a chunk
        of this lifecycle is still in flight or deferred: nothing will finish it. On a
        :class:`~kvoffload.SyncOffloadManager`'s lifecycle, use ``mgr.wait_released(lc)``."""
        if get_ident() != self._owner:
            raise wrong_thread(self._owner, "Lifecycle.wait_released()")
        if self._s != 3:
            await self._core.host.wait_lifecycle(self, True)

    async def wait_quiescent(self) -> None:
        """The barrier of every path that wants this request's device pages back
        (retraction, preemption): wait until no chunk is in flight or waiting for
        host pages. Returns at once if already quiescent (FAILURES F6). Raises like
        :meth:`wait_released` on a closed manager."""
        if get_ident() != self._owner:
            raise wrong_thread(self._owner, "Lifecycle.wait_quiescent()")
        if not self.quiescent:
            await self._core.host.wait_lifecycle(self, False)

    async def retract(self) -> None:
        """Retraction / preemption: abort (if still live) and wait until RELEASED, so
        the device pages are back in the pool when this returns and no copy reads them."""
        if get_ident() != self._owner:
            raise wrong_thread(self._owner, "Lifecycle.retract()")
        if self._s != 3:
            if not self._aborted:
                self.abort()
            await self.wait_released()

    def waker(self, released: bool, make: Callable[[], Waker]) -> Waker:
        """The waker a driver waits on until this lifecycle is RELEASED (``released``) or
        quiescent: the one already set, else a new one from ``make()``. One per kind,
        shared by every waiter; the core sets it once, then forgets it."""
        ev = self._released_ev if released else self._quiet_ev
        if ev is None:
            ev = make()
            if released:
                self._released_ev = ev
            else:
                self._quiet_ev = ev
        return ev

    def _wake_released(self) -> None:
        """RELEASED: set the waker of whoever waits for it."""
        ev = self._released_ev
        if ev is not None:
            self._released_ev = None
            ev.set()

    def _wake_quiet(self) -> None:
        """Set the waker of whoever waits for quiescence, if it is quiescent now."""
        ev = self._quiet_ev
        if ev is not None and self.inflight == 0 and self._deferred_since is None:
            self._quiet_ev = None
            ev.set()

    def wake(self) -> None:
        """Set every waiter's waker (the manager closed): each looks again and raises or
        returns. Called by the drivers."""
        for ev in (self._released_ev, self._quiet_ev):
            if ev is not None:
                ev.set()
        self._released_ev = self._quiet_ev = None

    def __repr__(self) -> str:
        return f"<Lifecycle #{self.id} rid={self.rid!r} {STATES[self._s].name} inflight={self.inflight}>"
