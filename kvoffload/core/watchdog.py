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

from kvoffload.core.events import logger
from kvoffload.core.lifecycle import LifecycleId

if TYPE_CHECKING:
    from kvoffload.abc import Transfer
    from kvoffload.core.chunks import Chunks
    from kvoffload.core.registry import Registry

__all__ = ["Watchdog"]


class Watchdog:
    """The stuck-copy watchdog of one core: which copies it reported (each once)."""

    def __init__(self, registry: Registry, chunks: Chunks) -> None:
        self.registry = registry
        self.chunks = chunks
        # reported: ids of in-flight transfers reported stuck; a delivered one is forgotten.
        # Invariant (after report()): self.reported <= set(chunks.inflight)
        self.reported: set[int] = set()

    def stuck(self) -> list[tuple[LifecycleId, Transfer, float]]:
        """(lifecycle id, its oldest transfer, that copy's age) for every lifecycle with a
        copy in flight past the deadline. O(chunks in flight)."""
        limit = self.registry.config.stuck_after_s
        if limit is None:
            return []
        now = self.registry.events.clock()
        oldest: dict[LifecycleId, Transfer] = {}
        for t in self.chunks.inflight.values():
            if now - t.submitted_at > limit:
                lid = LifecycleId(t.lifecycle_id)
                seen = oldest.get(lid)
                if seen is None or t.submitted_at < seen.submitted_at:
                    oldest[lid] = t
        return [(lid, t, now - t.submitted_at) for lid, t in oldest.items()]

    def report(self) -> None:
        """Log and count every newly stuck copy (each transfer is reported once)."""
        reported = self.reported
        registry = self.registry
        clock = registry.events.clock
        for lid, t, age in self.stuck():
            if t.id in reported:
                continue
            reported.add(t.id)
            lc = registry.live[lid]  # a lifecycle with a copy in flight is live
            registry.counters.stuck_reports += 1
            logger.warning(
                "lifecycle.stuck",
                lifecycle=lid,
                rid=lc.rid,
                state=lc.state.name,
                transfer=t.id,
                seconds=round(age, 3),
                inflight=lc.inflight,
                seconds_in_state=round(clock() - lc.state_since, 3),
            )
            registry.events.notify(
                "lifecycle.stuck",
                {
                    "lifecycle": lid,
                    "rid": lc.rid,
                    "state": lc.state.name,
                    "transfer": t.id,
                    "seconds": age,
                    "t": clock(),
                },
            )
        inflight = self.chunks.inflight
        for tid in [tid for tid in reported if tid not in inflight]:
            reported.discard(tid)  # delivered: forget it
