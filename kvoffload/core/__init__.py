"""The core: pure, synchronous, deterministic bookkeeping (no anyio, no threads, no I/O).

:class:`~kvoffload.core.offload.OffloadCore` is the facade; each group of state has
one owner, its invariants beside it: ``lifecycle`` (the Lifecycle objects and their
record of core-owned fields), ``registry`` (live lifecycles, state counts, the one
table step, release), ``chunks`` (host pages, copies in flight, the submit planner,
drops, holes, completions), ``deferral`` (chunks waiting for host pages), ``writes``
(storage write jobs in chain order), ``step`` (every path that commits tokens, and
the one undo) with ``rows`` (the batch rows it owns); ``events`` (listeners, the
structlog gate), ``stats`` (counters and the snapshot), ``ledger`` (the invariant
check), ``watchdog`` (stuck copies, F18). The lifecycle's declaration and compiled
table are :mod:`kvoffload.lifecycle`, which imports nothing of the core.

This package imports nothing eagerly.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Counters", "OffloadCore", "Statistics"]


def __getattr__(name: str) -> Any:
    if name == "OffloadCore":
        from kvoffload.core.offload import OffloadCore

        return OffloadCore
    if name in ("Counters", "Statistics"):
        from kvoffload.core import stats

        return getattr(stats, name)
    raise AttributeError(f"module 'kvoffload.core' has no attribute {name!r}")
