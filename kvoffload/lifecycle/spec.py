"""The lifecycle, declared once as data.

Everything else is derived from this module: the compiled runtime table
(:mod:`kvoffload.lifecycle.table`), the ``transitions`` machine that validates the
declaration and serves as the test oracle, and the diagrams (:mod:`kvoffload.tools.graph`).
No transition lives only in an ``if`` chain.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "EVENTS",
    "GUARDS",
    "GUARD_PREDICATES",
    "INITIAL",
    "SPEC",
    "TRANSITIONS",
    "LifecycleSpec",
    "LifecycleState",
    "Outcome",
    "TransitionSpec",
]


class LifecycleState(enum.Enum):
    """Where a request's offload is. Device pages are held in every state but RELEASED."""

    PENDING = 0
    """Admitted; no chunk in flight."""
    OFFLOADING = 1
    """One or more chunks in flight; still decoding."""
    FINISHING = 2
    """Finished or aborted; waiting for in-flight chunks (and the tail flush)."""
    RELEASED = 3
    """Terminal: every chunk completed, device pages returned exactly once."""


class Outcome(enum.Enum):
    """How a lifecycle ended; recorded when it reaches RELEASED."""

    COMPLETED = "completed"
    """Finished, and no submitted chunk failed. Chunks never submitted because the host
    pool was full (a policy drop, FAILURES F9) and storage writes that failed are not in
    the outcome: what the request should have offloaded and did not is
    ``lc.pages_lost`` (and ``statistics().pages_lost``, their sum)."""
    ABORTED = "aborted"
    """Aborted (retraction, preemption, cancellation); in-flight chunks were discarded."""
    FAILED = "failed"
    """Finished, but at least one chunk's copy failed."""


#: Guards are predicates over two facts about a lifecycle, evaluated *after* the
#: event's effect: ``copying`` (a chunk is in flight) and ``deferred`` (a chunk waits
#: for host pages under the ``"wait"`` policy). They are declared here as data so the
#: compiler can check, for every combination, that exactly one transition applies.
GUARDS: dict[str, str] = {
    "idle": "no chunk in flight and none waiting for host pages",
    "busy": "a chunk is in flight or waiting for host pages",
    "drained": "no chunk in flight (one may wait for host pages)",
    "copying": "at least one chunk in flight",
}

#: The guards as predicates of (copying, deferred).
GUARD_PREDICATES: dict[str, tuple[tuple[bool, bool], ...]] = {
    "idle": ((False, False),),
    "busy": ((True, False), (False, True), (True, True)),
    "drained": ((False, False), (False, True)),
    "copying": ((True, False), (True, True)),
}

#: Events, with what each means. ``admit`` creates a lifecycle in the initial state.
EVENTS: dict[str, str] = {
    "admit": "the request is admitted; its prompt's pages are allocated",
    "extend": "tokens are committed (their KV is in device pages)",
    "submit": "a chunk was handed to the copy backend (host pages already held)",
    "chunk_done": "a chunk's copy completed",
    "chunk_failed": "a chunk's copy failed",
    "chunk_dropped": "a chunk that waited for host pages past host_wait_s was dropped",
    "finish": "the request finished decoding (after the tail flush)",
    "abort": "the request was aborted; no new chunks, in-flight ones are discarded",
}

INITIAL = LifecycleState.PENDING


@dataclass(frozen=True, slots=True)
class TransitionSpec:
    """One declared transition: ``event`` in ``source`` goes to ``dest`` when ``guard`` holds."""

    event: str
    source: LifecycleState
    dest: LifecycleState
    guard: str | None = None


_P, _O, _F, _R = (
    LifecycleState.PENDING,
    LifecycleState.OFFLOADING,
    LifecycleState.FINISHING,
    LifecycleState.RELEASED,
)

TRANSITIONS: tuple[TransitionSpec, ...] = (
    TransitionSpec("extend", _P, _P),
    TransitionSpec("extend", _O, _O),
    TransitionSpec("submit", _P, _O),
    TransitionSpec("submit", _O, _O),
    TransitionSpec("submit", _F, _F),
    TransitionSpec("chunk_done", _O, _P, "drained"),
    TransitionSpec("chunk_done", _O, _O, "copying"),
    TransitionSpec("chunk_done", _F, _R, "idle"),
    TransitionSpec("chunk_done", _F, _F, "busy"),
    TransitionSpec("chunk_failed", _O, _P, "drained"),
    TransitionSpec("chunk_failed", _O, _O, "copying"),
    TransitionSpec("chunk_failed", _F, _R, "idle"),
    TransitionSpec("chunk_failed", _F, _F, "busy"),
    TransitionSpec("chunk_dropped", _P, _P),
    TransitionSpec("chunk_dropped", _O, _O),
    TransitionSpec("chunk_dropped", _F, _R, "idle"),
    TransitionSpec("chunk_dropped", _F, _F, "busy"),
    TransitionSpec("finish", _P, _R, "idle"),
    TransitionSpec("finish", _P, _F, "busy"),
    TransitionSpec("finish", _O, _F),
    TransitionSpec("abort", _P, _R, "idle"),
    TransitionSpec("abort", _P, _F, "busy"),
    TransitionSpec("abort", _O, _F),
    TransitionSpec("abort", _F, _R, "idle"),
    TransitionSpec("abort", _F, _F, "busy"),
)


@dataclass(frozen=True, slots=True)
class LifecycleSpec:
    """The whole declaration: states, events, guards, transitions, initial and terminal."""

    states: tuple[LifecycleState, ...]
    events: dict[str, str]
    guards: dict[str, str]
    transitions: tuple[TransitionSpec, ...]
    initial: LifecycleState
    creation_event: str
    terminal: frozenset[LifecycleState]
    live: frozenset[LifecycleState]


SPEC = LifecycleSpec(
    states=tuple(LifecycleState),
    events=EVENTS,
    guards=GUARDS,
    transitions=TRANSITIONS,
    initial=INITIAL,
    creation_event="admit",
    terminal=frozenset({_R}),
    live=frozenset({_P, _O, _F}),
)
