"""Shared fixtures: a small config, a SimBackend, and an open manager on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import structlog

import kvoffload as kvo
from kvoffload.testing import SimBackend, manager_in_task


@pytest.fixture
def config() -> kvo.OffloadConfig:
    return kvo.OffloadConfig(page_size=4, stride=4, device_pages=64, host_pages=64, drain_timeout_s=5)


@pytest.fixture
def backend() -> SimBackend:
    return SimBackend()


@pytest_asyncio.fixture
async def mgr(config: kvo.OffloadConfig, backend: SimBackend) -> AsyncIterator[kvo.OffloadManager]:
    # The manager's context runs in a task of its own: pytest-asyncio tears a fixture
    # down in another task than it set it up in (tests/test_mgr_fixture.py).
    async with manager_in_task(config, backend=backend) as m:
        yield m
        backend.complete_all()  # let the manager drain; tests leave nothing running
        await m.settle()
        m.check_invariants()


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """Each test starts and ends with structlog unconfigured (capture_logs leaves it
    configured, which would turn kvoffload's debug events on for later tests)."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
