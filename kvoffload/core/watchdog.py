"""The stuck-transfer watchdog (FAILURES F18).

Reports each copy in flight longer than ``config.stuck_after_s`` (by the manager's
clock), once: a warning event ``lifecycle.stuck`` naming the lifecycle (in OFFLOADING
or FINISHING, since a chunk is in flight), its oldest stuck transfer and that copy's
age, and the ``stuck_reports`` counter. It goes by the age of copies, not by time in a
state: a long request whose copies each finish quickly stays OFFLOADING for as long as
it decodes, and is not stuck.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.core.events import logger, notify_listeners
from kvoffload.lifecycle.core import LifecycleId

if TYPE_CHECKING:
    from kvoffload.abc import Transfer
    from kvoffload.core.offload import OffloadCore

__all__ = ["report_stuck", "stuck_lifecycles"]


def stuck_lifecycles(mgr: OffloadCore) -> list[tuple[LifecycleId, Transfer, float]]:
    """(lifecycle id, its oldest transfer, that copy's age) for every lifecycle with a
    copy in flight past the deadline. O(chunks in flight)."""
    limit = mgr.config.stuck_after_s
    if limit is None:
        return []
    now = mgr.clock()
    oldest: dict[LifecycleId, Transfer] = {}
    for t in mgr.inflight.values():
        if now - t.submitted_at > limit:
            lid = LifecycleId(t.lifecycle_id)
            seen = oldest.get(lid)
            if seen is None or t.submitted_at < seen.submitted_at:
                oldest[lid] = t
    return [(lid, t, now - t.submitted_at) for lid, t in oldest.items()]


def report_stuck(mgr: OffloadCore) -> None:
    """Log and count every newly stuck copy (each transfer is reported once)."""
    reported = mgr.stuck_reported
    for lid, t, age in stuck_lifecycles(mgr):
        if t.id in reported:
            continue
        reported.add(t.id)
        lc = mgr.live[lid]  # a lifecycle with a copy in flight is never RELEASED: live
        mgr.counters.stuck_reports += 1
        logger.warning(
            "lifecycle.stuck",
            lifecycle=lid,
            rid=lc.rid,
            state=lc.state.name,
            transfer=t.id,
            seconds=round(age, 3),
            inflight=lc.inflight,
            seconds_in_state=round(mgr.clock() - lc.state_since, 3),
        )
        notify_listeners(
            mgr.listeners,
            "lifecycle.stuck",
            {
                "lifecycle": lid,
                "rid": lc.rid,
                "state": lc.state.name,
                "transfer": t.id,
                "seconds": age,
                "t": mgr.clock(),
            },
            mgr.listener_failures,
            mgr.clock,
        )
    inflight = mgr.inflight
    for tid in [tid for tid in reported if tid not in inflight]:
        reported.discard(tid)  # delivered: forget it
