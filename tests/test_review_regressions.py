"""Regressions found by an adversarial review of the core: each test names the rule
that must hold (ARCHITECTURE.md rules 1-6, FAILURES.md F1-F18, or "bad input is refused
with a typed error and changes nothing") and failed before its fix."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import structlog
from support import released, small_config, toks

import kvoffload as kvo
from kvoffload.testing import SimBackend

pytestmark = pytest.mark.asyncio

RELEASED = kvo.LifecycleState.RELEASED


def _raising_on(event: str) -> Any:
    def listener(name: str, fields: dict[str, Any]) -> None:
        if name == event:
            raise RuntimeError(f"listener bug on {name}")

    return listener


@pytest.mark.parametrize(
    "event",
    [
        "lifecycle.admitted",
        "lifecycle.transition",
        "transfer.submitted",
        "transfer.completed",
        "lifecycle.released",
        "storage.written",
    ],
)
async def test_a_raising_listener_never_corrupts_the_ledger_or_frees_a_page_under_a_copy(event: str) -> None:
    """A listener that raises is a bug in the listener, not in the lifecycle: the step
    that emitted the event still runs to completion (no device page freed under the
    in-flight copy, no lifecycle left half released, the delivery and storage tasks go
    on), and the error is logged. Before the fix a raise on ``transfer.submitted``
    made extend's rollback free the device pages the submitted copy reads (rule 2)."""
    backend = SimBackend()
    async with kvo.OffloadManager(small_config(), backend=backend, storage="memory") as mgr:
        mgr.add_listener(_raising_on(event))
        with structlog.testing.capture_logs() as logs:
            lc = mgr.admit("r1", prompt=toks(0, 4))
            lc.extend(toks(4, 12))  # a chunk of 2 pages goes out
            mgr.check_invariants()
            (t,) = backend.pending
            assert all(mgr.device_pool.is_allocated(p) for p in t.device_pages)
            assert set(t.device_pages) <= set(lc.device_pages)
            lc.finish()
            backend.complete_all()
            await released(lc)
            with anyio.fail_after(10):
                await mgr.settle()
        mgr.check_invariants()
        s = mgr.statistics()
        assert (s.live_lifecycles, s.device_pages_used, s.host_pages_used) == (0, 0, 0)
        assert s.pages_stored == 2
        assert any(e["event"] == "listener.failed" and e["event_name"] == event for e in logs)
