"""Hypothesis strategies for request streams and completion orders, and a player.

A :class:`Schedule` is a list of requests (ids drawn from a small pool, so they are
reused, possibly while the earlier request with that id is still live) and one
interleaving of their events with copy completions. :func:`run_schedule` plays it
against a manager on a :class:`~kvoffload.testing.SimBackend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hypothesis import strategies as st

from kvoffload.errors import PoolExhausted

if TYPE_CHECKING:
    from kvoffload.backends._sim import SimBackend
    from kvoffload.core.lifecycle import Lifecycle
    from kvoffload.drivers.asyncio import OffloadManager

__all__ = ["Request", "Schedule", "Step", "completion_orders", "request_streams", "run_schedule", "schedules"]

StepKind = Literal["admit", "decode", "end", "complete", "fail"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its id, prompt, the tokens of each decode step, and how it ends."""

    rid: str
    prompt: tuple[int, ...]
    decode: tuple[tuple[int, ...], ...]
    aborted: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    """``admit``/``decode``/``end`` of request ``index``; or ``complete``/``fail`` of the
    in-flight transfer at position ``index`` (modulo how many are in flight)."""

    kind: StepKind
    index: int


@dataclass(frozen=True, slots=True)
class Schedule:
    """Requests and one interleaving of their events with completions."""

    requests: tuple[Request, ...]
    steps: tuple[Step, ...]


def request_streams(
    *,
    min_size: int = 1,
    max_size: int = 8,
    rids: int = 3,
    max_prompt: int = 12,
    max_steps: int = 6,
    max_step_tokens: int = 8,
    vocab: int = 4,
    abort: bool = True,
) -> st.SearchStrategy[list[Request]]:
    """Lists of requests whose ids come from a pool of ``rids`` (so ids are reused)."""
    tokens = st.integers(0, vocab - 1)
    request = st.builds(
        Request,
        rid=st.integers(0, rids - 1).map(lambda i: f"r{i}"),
        prompt=st.lists(tokens, max_size=max_prompt).map(tuple),
        decode=st.lists(
            st.lists(tokens, min_size=1, max_size=max_step_tokens).map(tuple), max_size=max_steps
        ).map(tuple),
        aborted=st.booleans() if abort else st.just(False),
    )
    return st.lists(request, min_size=min_size, max_size=max_size)


def completion_orders(n: int) -> st.SearchStrategy[list[int]]:
    """Orders in which ``n`` in-flight copies complete: every permutation of ``range(n)``."""
    return st.permutations(range(n))


@st.composite
def schedules(
    draw: st.DrawFn,
    requests: st.SearchStrategy[list[Request]] | None = None,
    *,
    failures: bool = True,
) -> Schedule:
    """A request stream and one interleaving of its events (each request's own events
    in order: admit, decode steps, end) with completions (and failures) of whatever
    is in flight, picked by position so completions come in any order."""
    reqs = draw(requests if requests is not None else request_streams())
    queues = [
        [Step("admit", i), *(Step("decode", i) for _ in r.decode), Step("end", i)] for i, r in enumerate(reqs)
    ]
    heads = [0] * len(reqs)
    steps: list[Step] = []
    kinds: list[StepKind] = ["complete", "fail"] if failures else ["complete"]
    while True:
        open_ = [i for i, q in enumerate(queues) if heads[i] < len(q)]
        if not open_:
            break
        choice = draw(st.integers(0, len(open_)))
        if choice == len(open_):
            steps.append(Step(draw(st.sampled_from(kinds)), draw(st.integers(0, 7))))
            continue
        i = open_[choice]
        steps.append(queues[i][heads[i]])
        heads[i] += 1
    return Schedule(tuple(reqs), tuple(steps))


def run_schedule(mgr: OffloadManager, backend: SimBackend, schedule: Schedule) -> list[Lifecycle | None]:
    """Play ``schedule`` (synchronously; call it from the manager's event loop, then
    ``await mgr.settle()``). A request whose admission or decode step found the device
    pool full is aborted (its admission refused: ``None``). Returns each request's
    lifecycle, in request order. Completions left in flight stay in flight."""
    lcs: list[Lifecycle | None] = [None] * len(schedule.requests)
    decoded = [0] * len(schedule.requests)
    refused = [False] * len(schedule.requests)
    for step in schedule.steps:
        if step.kind in ("complete", "fail"):
            if backend.pending:
                t = backend.pending[step.index % len(backend.pending)]
                backend.complete(t) if step.kind == "complete" else backend.fail(t)
            continue
        req = schedule.requests[step.index]
        lc = lcs[step.index]
        if refused[step.index]:
            continue
        try:
            if step.kind == "admit":
                lcs[step.index] = mgr.admit(req.rid, req.prompt)
            elif lc is not None and step.kind == "decode":
                lc.extend(req.decode[decoded[step.index]])
                decoded[step.index] += 1
            elif lc is not None:
                lc.abort() if req.aborted else lc.finish()
        except PoolExhausted:
            refused[step.index] = True
            if lc is not None:
                lc.abort()
    return lcs
