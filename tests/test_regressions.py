"""Failures the property suite found, pasted as plain deterministic tests.

Each test's body is the shrunk schedule hypothesis printed (``state.<rule>(...)``
and ``state.outside_rules_hold()``, the after-step check), pasted verbatim: it replays
on :class:`~kvoffload.testing.LifecycleMachine` exactly as in the failing run.
"""

from __future__ import annotations

import gc
import weakref

import pytest

import kvoffload as kvo
from kvoffload.testing import LifecycleMachine, SimBackend


@pytest.mark.asyncio
@pytest.mark.parametrize("storage", [None, "memory"])
async def test_delivery_task_does_not_pin_the_last_delivered_lifecycle(storage: str | None) -> None:
    """Found by the suite (F2 check): the completion-delivery task kept its last batch
    (and the loop variable) alive while it waited for the next one, so a released,
    dropped lifecycle stayed referenced until some other copy completed. The storage
    writer task had the same fault with its last written transfer."""
    config = kvo.OffloadConfig(page_size=2, stride=2, device_pages=6, host_pages=1)
    backend = SimBackend()
    async with kvo.OffloadManager(config, backend=backend, storage=storage) as mgr:
        lc = mgr.admit("r1", prompt=[])
        lc.extend([0, 0])
        lc.finish()
        ref = weakref.ref(lc)
        del lc
        backend.complete(backend.pending[0])
        await mgr.settle()
        gc.collect()
        assert ref() is None, gc.get_referrers(ref())


def test_shrunk_released_lifecycle_pinned_by_delivery_task() -> None:
    """The schedule the suite printed for the failure above."""
    state = LifecycleMachine()
    state.open(
        page_size=2,
        stride_pages=1,
        device_pages=6,
        spare_host_pages=0,
        on_host_full="drop",
        offload_prompt=False,
        storage=False,
    )
    state.outside_rules_hold()
    state.admit(prompt=[], slot=1)
    state.outside_rules_hold()
    state.extend(slot=1, tokens=[0, 0])
    state.outside_rules_hold()
    state.abort(slot=1)
    state.outside_rules_hold()
    state.complete(pos=0)
    state.outside_rules_hold()
    state.drop(slot=1)
    state.outside_rules_hold()
    state.teardown()
