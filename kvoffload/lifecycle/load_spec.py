"""The load lifecycle, declared once as data: store -> host pool -> the engine's device pages.

A load is the way back: the pages a request's prefix left in the storage tier are read
into host pages (READING), copied from there into device pages the engine names
(COPYING), and the load ends (DONE) with an :class:`LoadOutcome`. The engine may take
its device pages back at any time (an abort, a preemption): the load is then
CANCELLING until no read and no copy touches its pages any more, and ends CANCELLED.

Everything else is derived from this module, as for the offload lifecycle
(:mod:`kvoffload.lifecycle.spec`): the compiled runtime table and the ``transitions``
oracle (:mod:`kvoffload.lifecycle.load_table`) and the diagram (``kvoffload graph
--lifecycle load``). The live loads are the core's (``kvoffload.core.loads``). There
are no guards: what decides a step is which event happened, and each transition
declares the outcomes a load may end with when it takes that step (``outcomes``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "LOAD_EVENTS",
    "LOAD_INITIAL",
    "LOAD_SPEC",
    "LOAD_TRANSITIONS",
    "LoadOutcome",
    "LoadSpec",
    "LoadState",
    "LoadTransitionSpec",
]


class LoadState(enum.Enum):
    """Where a load is. Host pages are held in every state but DONE."""

    READING = 0
    """The store read fills the load's host pages (on the driver's writer thread, or in
    a remote worker); nothing is copied to the device yet."""
    COPYING = 1
    """The host->device copy of the pages read is in flight: it writes the load's device
    pages (``load.device_busy``)."""
    CANCELLING = 2
    """Cancelled while a read or a copy still touches its pages: DONE (CANCELLED) when
    that read returns or that copy completes; nothing new is ever submitted for it."""
    DONE = 3
    """Terminal: host pages returned exactly once; nothing touches any of its pages."""


class LoadOutcome(enum.Enum):
    """How a load ended; recorded when it reaches DONE."""

    LOADED = "loaded"
    """Every page asked for is in its device page."""
    PARTIAL = "partial"
    """A leading run of the pages asked for is in its device pages (``pages_loaded``);
    the rest were missing, corrupt or unreadable: the engine recomputes them (F38)."""
    MISSED = "missed"
    """No page was read (none stored, the first corrupt, or no host pages to read
    into): the engine recomputes them all."""
    FAILED = "failed"
    """The store read raised or the host->device copy failed: nothing usable
    (``pages_loaded`` 0), the engine recomputes them all (F38)."""
    CANCELLED = "cancelled"
    """The engine took the device pages back first; nothing of the load is usable."""


#: Events, with what each means. ``begin`` creates a load in the initial state.
LOAD_EVENTS: dict[str, str] = {
    "begin": "a load of a run of stored pages into device pages is begun; its host pages are allocated",
    "host_full": "the host pool had no room for the load's pages: nothing is read",
    "read_ok": "the store read filled a leading run of the host pages; the h2d copy of them is submitted",
    "read_missed": "the store read found no page (the first missing or corrupt)",
    "read_failed": "the store read raised",
    "copy_done": "the host->device copy completed",
    "copy_failed": "the host->device copy failed",
    "cancel": "the engine takes the device pages back; nothing new is submitted",
}

LOAD_INITIAL = LoadState.READING


@dataclass(frozen=True, slots=True)
class LoadTransitionSpec:
    """One declared transition: ``event`` in ``source`` goes to ``dest``; a step into the
    terminal state names the outcomes the load may end with (``outcomes``, empty
    otherwise): the core picks one by what the pages say (e.g. LOADED or PARTIAL)."""

    event: str
    source: LoadState
    dest: LoadState
    outcomes: tuple[LoadOutcome, ...] = ()


_RD, _CP, _CX, _DN = LoadState.READING, LoadState.COPYING, LoadState.CANCELLING, LoadState.DONE
_L = LoadOutcome

LOAD_TRANSITIONS: tuple[LoadTransitionSpec, ...] = (
    LoadTransitionSpec("host_full", _RD, _DN, (_L.MISSED,)),
    LoadTransitionSpec("read_ok", _RD, _CP),
    LoadTransitionSpec("read_missed", _RD, _DN, (_L.MISSED,)),
    LoadTransitionSpec("read_failed", _RD, _DN, (_L.FAILED,)),
    LoadTransitionSpec("cancel", _RD, _CX),
    LoadTransitionSpec("copy_done", _CP, _DN, (_L.LOADED, _L.PARTIAL)),
    LoadTransitionSpec("copy_failed", _CP, _DN, (_L.FAILED,)),
    LoadTransitionSpec("cancel", _CP, _CX),
    # Cancelled: whatever the read or copy in flight reports, the load ends CANCELLED.
    LoadTransitionSpec("read_ok", _CX, _DN, (_L.CANCELLED,)),
    LoadTransitionSpec("read_missed", _CX, _DN, (_L.CANCELLED,)),
    LoadTransitionSpec("read_failed", _CX, _DN, (_L.CANCELLED,)),
    LoadTransitionSpec("copy_done", _CX, _DN, (_L.CANCELLED,)),
    LoadTransitionSpec("copy_failed", _CX, _DN, (_L.CANCELLED,)),
    LoadTransitionSpec("cancel", _CX, _CX),
)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """The whole declaration: states, events, transitions, initial and terminal."""

    states: tuple[LoadState, ...]
    events: dict[str, str]
    transitions: tuple[LoadTransitionSpec, ...]
    initial: LoadState
    creation_event: str
    terminal: frozenset[LoadState]
    live: frozenset[LoadState]
    #: The event the engine may send in every live state (taking its pages back).
    cancel_event: str = "cancel"


LOAD_SPEC = LoadSpec(
    states=tuple(LoadState),
    events=LOAD_EVENTS,
    transitions=LOAD_TRANSITIONS,
    initial=LOAD_INITIAL,
    creation_event="begin",
    terminal=frozenset({_DN}),
    live=frozenset({_RD, _CP, _CX}),
)
