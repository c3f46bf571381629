"""The registry: the live lifecycles, their state counts, the one table step, release.

Every state change of every lifecycle goes through :meth:`Registry.fire`, one step of
the compiled table (:mod:`kvoffload.lifecycle.table`); RELEASED is reached there and
nowhere else, and :meth:`Registry.release` is the one place device pages go back
(FAILURES F2-F8). The registry holds lifecycles by lifecycle id, never by request id
(F1): a request id is a label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvoffload.core.events import Events
from kvoffload.core.lifecycle import EXTEND_SELF_LOOP, STATES, Lifecycle, LifecycleHost, LifecycleId
from kvoffload.core.meters import Meters
from kvoffload.core.stats import Counters
from kvoffload.errors import InvalidTransition, ManagerClosed
from kvoffload.lifecycle.spec import LifecycleState, Outcome
from kvoffload.lifecycle.table import EVENT_NAMES, TABLE

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig
    from kvoffload.pools import DevicePool, EnginePages

__all__ = ["QUIET_MOVES", "Registry"]

_RELEASED = LifecycleState.RELEASED.value
_FINISHING = LifecycleState.FINISHING.value
#: For each state: whether a table step into it from another state changes only the
#: counts (live, and extend stays a self-loop there: no row to give back) - when
#: nobody observes, :meth:`Registry.move` is that whole step.
QUIET_MOVES: tuple[bool, ...] = tuple(s != _RELEASED and EXTEND_SELF_LOOP[s] for s in range(len(STATES)))


class Registry:
    """The live lifecycles of one core and the table step that moves them.

    ``detach_row`` is the decode step's slot (set by the core that wires the rooms): a
    lifecycle leaving a state where extend is a self-loop gives its batch row back."""

    def __init__(
        self,
        config: OffloadConfig,
        counters: Counters,
        device_pool: DevicePool | EnginePages,
        events: Events,
        owner: int,
        host: LifecycleHost,
        meters: Meters | None = None,
    ) -> None:
        self.config = config
        self.counters = counters
        self.device_pool = device_pool
        self.events = events
        # owner: the thread every lifecycle checks its calls against (the driver sets it).
        self.owner = owner
        # host: the driver lifecycles call back into (the driver sets it).
        self.host = host
        # closing: no request may be admitted and no copy may start; set once by close().
        self.closing = False
        # live: every lifecycle admitted and not RELEASED, by lifecycle id (never by rid).
        # Invariant: all(lc._s != RELEASED for lc in self.live.values())
        self.live: dict[LifecycleId, Lifecycle] = {}
        self.next_id = 1
        # state_counts[s]: live lifecycles in state s.
        # Invariant: self.state_counts[s] == sum(lc._s == s for lc in self.live.values())
        self.state_counts = [0, 0, 0, 0]
        # released: lifecycles released by the current call, returned by it (take_released).
        self.released: list[Lifecycle] = []
        self.detach_row: Callable[[Lifecycle], None] = _no_rows
        # moves[s][d]: table steps from state s to another state d, ever (kvoffload.metrics).
        self.moves = [[0] * len(STATES) for _ in STATES]
        # meters: the release delay (finish -> RELEASED) is observed at each release.
        self.meters = meters if meters is not None else Meters(0, events.clock)

    # --- admission ---------------------------------------------------------------------

    def new(self, core: Any, rid: Any, tag: Any) -> Lifecycle:
        """A new lifecycle in PENDING, not yet registered (:meth:`add` registers it)."""
        lc = Lifecycle(core, LifecycleId(self.next_id), rid, self.events.clock(), self.owner)
        lc.tag = tag
        return lc

    def take_id(self) -> int:
        """An id for an issuer that is not a lifecycle (a load), drawn from the lifecycles'
        own numbering: no live lifecycle or load shares it (a completion finds its issuer
        by id, F1)."""
        lid = self.next_id
        self.next_id += 1
        return lid

    def add(self, lc: Lifecycle) -> None:
        """Register ``lc`` (made by :meth:`new`): live, PENDING, counted as admitted."""
        self.next_id += 1
        self.live[lc.id] = lc
        self.state_counts[0] += 1
        self.counters.admitted += 1

    def withdraw(self, lc: Lifecycle) -> None:
        """Undo :meth:`add` of a lifecycle still PENDING (its admission was refused)."""
        del self.live[lc.id]
        self.state_counts[0] -= 1
        self.counters.admitted -= 1

    def lifecycles(self, rid: Any = None) -> list[Lifecycle]:
        """Live lifecycles, oldest first; with ``rid``, those labelled ``rid`` (there may be
        several: a reused id). For observability: O(live)."""
        if rid is None:
            return list(self.live.values())
        return [lc for lc in self.live.values() if lc.rid == rid]

    # --- the table step -----------------------------------------------------------------

    def check(self, lc: Lifecycle, e: int) -> None:
        """Raise unless event ``e`` is legal in ``lc``'s state (nothing changed)."""
        if TABLE[lc._s][e][0] < 0:
            if self.closing:  # close() aborted it: say so, not which state refuses the event
                raise ManagerClosed(
                    f"{lc!r}: {EVENT_NAMES[e]}() after its manager was closed (closing aborted "
                    "every live lifecycle); nothing was changed"
                )
            self.illegal(lc, e)

    def illegal(self, lc: Lifecycle, e: int) -> None:
        raise InvalidTransition(lc, STATES[lc._s], EVENT_NAMES[e])

    def fire(self, lc: Lifecycle, e: int, now: float | None = None) -> None:
        """Apply event ``e`` to ``lc`` after its effect on the counts: one table step, the
        only one (the delivery and submit loops call it when the state changes)."""
        s = lc._s
        dest = TABLE[s][e][((lc.inflight > 0) << 1) | (lc._deferred_since is not None)]
        if dest < 0:
            self.illegal(lc, e)
        if dest != s:
            counts = self.state_counts
            counts[s] -= 1
            self.moves[s][dest] += 1
            since = lc.state_since
            lc._s = dest
            lc.state_since = t = self.events.clock() if now is None else now
            if not EXTEND_SELF_LOOP[dest]:
                if lc._row >= 0:  # extend is no longer its plain step
                    self.detach_row(lc)
                lc._quiet = -1
            if dest == _RELEASED:  # (finish or abort -> released: FINISHING's wait, else none)
                self.meters.release_delay.observe(t - since if s == _FINISHING else 0.0)
                if self.events.observed:
                    self.emit_transition(lc, s, dest, e)
                self.release(lc)
                return
            counts[dest] += 1
        if self.events.observed:
            self.emit_transition(lc, s, dest, e)

    def move(self, lc: Lifecycle, dest: int, now: float) -> None:
        """The state change of a table step that needs nothing else: to ``dest``, which
        the caller read from TABLE, a live state where extend stays a self-loop
        (``QUIET_MOVES[dest]``), while nobody observes events - what :meth:`fire` does
        for it, without looking the step up again (the submit and delivery loops)."""
        counts = self.state_counts
        counts[lc._s] -= 1
        counts[dest] += 1
        self.moves[lc._s][dest] += 1
        lc._s = dest
        lc.state_since = now

    def fire_all(self, lcs: list[Lifecycle], e: int, now: float) -> None:
        """:meth:`fire` of event ``e`` for each of ``lcs``, in order (a batched step's run:
        each lifecycle once); unobserved, the steps that change only the counts are done
        in one loop (as :meth:`move`), the others by :meth:`fire`."""
        if self.events.observed:
            for lc in lcs:
                self.fire(lc, e, now)
            return
        counts = self.state_counts
        for lc in lcs:
            s = lc._s
            dest = TABLE[s][e][((lc.inflight > 0) << 1) | (lc._deferred_since is not None)]
            if dest == s:
                continue
            if dest >= 0 and QUIET_MOVES[dest]:
                counts[s] -= 1
                counts[dest] += 1
                self.moves[s][dest] += 1
                lc._s = dest
                lc.state_since = now
            else:
                self.fire(lc, e, now)

    def emit_transition(self, lc: Lifecycle, s: int, dest: int, e: int) -> None:
        """The ``lifecycle.transition`` event of one table step."""
        self.events.emit(
            "lifecycle.transition",
            lc,
            trigger=EVENT_NAMES[e],
            **{"from": STATES[s].name, "to": STATES[dest].name},
        )

    # --- release ------------------------------------------------------------------------

    def release(self, lc: Lifecycle) -> None:
        """RELEASED: the one place device pages are returned (F2-F8). Runs once per
        lifecycle because RELEASED is terminal in the table."""
        assert lc.inflight == 0 and lc._deferred_since is None, "released with a copy pending"
        pages = lc.device_pages  # still listed until the engine was told (on_released)
        self.device_pool.free(pages)
        lc._tail = lc._tail[:0]
        outcome = Outcome.ABORTED if lc._aborted else Outcome.FAILED if lc._failed else Outcome.COMPLETED
        lc.outcome = outcome
        del self.live[lc.id]
        c = self.counters
        if not lc._aborted:  # whole pages not offloaded: never sent, or after a hole (F33)
            reach = lc._stop if lc._stop >= 0 else lc.submitted
            lost = (lc.committed - reach) // self.config.page_size
            lc.pages_lost = lost
            lc._stop = reach
            c.pages_lost += lost
            if lc._wchain is not None:
                lc._wchain.released(reach)
        if outcome is Outcome.COMPLETED:
            c.released_completed += 1
        elif outcome is Outcome.ABORTED:
            c.released_aborted += 1
        else:
            c.released_failed += 1
        if self.events.observed:
            self.events.emit("lifecycle.released", lc, outcome=outcome.value, device_pages=len(pages))
        self.released.append(lc)
        lc._wake_released()
        lc._wake_quiet()

    def told(self, released: Iterable[Lifecycle]) -> None:
        """The engine was told about ``released`` (``on_released`` ran): they stop
        listing their device pages. Until then a RELEASED lifecycle still lists the
        pages it held - already back in the pool (owned mode) or the engine's to free -
        so its callback can hand them back."""
        for lc in released:
            if lc._s == _RELEASED:
                lc.device_pages = []

    def take_released(self) -> list[Lifecycle]:
        """What the current call released, handed over once."""
        out = self.released
        if out:
            self.released = []
        return out


def _no_rows(lc: Lifecycle) -> None:
    raise AssertionError(f"{lc!r} holds a batch row, but no decode step was wired to this registry")
