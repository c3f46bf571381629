"""The stuck-transfer watchdog (FAILURES F18).

Reports, once per stuck spell, each lifecycle that has stayed in OFFLOADING or
FINISHING longer than ``config.stuck_after_s`` (by the manager's clock): a warning
event ``lifecycle.stuck`` and the ``stuck_reports`` counter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload._events import logger
from kvoffload._flow import notify_listeners
from kvoffload.lifecycle.core import LifecycleId

if TYPE_CHECKING:
    from kvoffload.manager import OffloadManager

__all__ = ["report_stuck", "stuck_lifecycles"]


def stuck_lifecycles(mgr: OffloadManager) -> list[tuple[LifecycleId, float]]:
    """(lifecycle id, seconds in state) of every live lifecycle past the deadline."""
    limit = mgr.config.stuck_after_s
    if limit is None:
        return []
    now = mgr.clock()
    return [
        (lc.id, now - lc.state_since)
        for lc in mgr._live.values()
        if lc._s in (1, 2) and now - lc.state_since > limit
    ]


def report_stuck(mgr: OffloadManager) -> None:
    """Log and count every newly stuck lifecycle (once per entry into its state)."""
    reported = mgr._stuck_reported
    for lid, age in stuck_lifecycles(mgr):
        lc = mgr._live[lid]
        mark = (lid, lc.state_since)
        if mark in reported:
            continue
        reported.add(mark)
        mgr.counters.stuck_reports += 1
        oldest = min((t.submitted_at for t in mgr._inflight.values() if t.lifecycle is lc), default=None)
        logger.warning(
            "lifecycle.stuck",
            lifecycle=lid,
            rid=lc.rid,
            state=lc.state.name,
            seconds=round(age, 3),
            inflight=lc.inflight,
            oldest_transfer_age_s=None if oldest is None else round(mgr.clock() - oldest, 3),
        )
        notify_listeners(
            mgr._listeners,
            "lifecycle.stuck",
            {"lifecycle": lid, "rid": lc.rid, "state": lc.state.name, "seconds": age, "t": mgr.clock()},
        )
    live = mgr._live
    for mark in [m for m in reported if m[0] not in live or live[m[0]].state_since != m[1]]:
        reported.discard(mark)
