"""The shared `mgr` fixture (tests/conftest.py) itself."""

from __future__ import annotations

import pytest

import kvoffload as kvo


@pytest.mark.asyncio
async def test_the_mgr_fixture_opens_and_tears_down_cleanly(mgr: kvo.OffloadManager) -> None:
    """A test can use `mgr` and its teardown (complete, settle, check_invariants, leave)
    runs without error. pytest-asyncio sets an async fixture up and tears it down in two
    different tasks, while the manager's anyio task group must be left in the task that
    entered it: the fixture must run the manager's context in one task of its own."""
    lc = mgr.admit("r1", [0, 1, 2, 3])
    lc.extend([4, 5, 6, 7, 8])
    assert lc.inflight == 1
