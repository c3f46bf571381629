"""The core: pure, synchronous, deterministic bookkeeping (no anyio, no threads, no I/O).

:class:`~kvoffload.core.offload.OffloadCore` keeps the registry of lifecycles, chunks
and keys, host-page accounting, the ledger and the events; the drivers above it add
only waiting. Rooms: ``offload`` (the core), ``events`` (event names, listeners,
structlog gate), ``stats`` (counters and the statistics snapshot), ``ledger`` (the
invariant check), ``watchdog`` (stuck copies, F18). The lifecycle objects and their
compiled table are in :mod:`kvoffload.lifecycle`, which this layer shares.

This package imports nothing eagerly (``kvoffload.lifecycle`` imports its events room).
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
