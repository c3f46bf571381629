"""Shared fixtures: a small config, a SimBackend, and an open manager on it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

import kvoffload as kvo
from kvoffload.testing import SimBackend


@pytest.fixture
def config() -> kvo.OffloadConfig:
    return kvo.OffloadConfig(page_size=4, stride=4, device_pages=64, host_pages=64, drain_timeout_s=5)


@pytest.fixture
def backend() -> SimBackend:
    return SimBackend()


@pytest_asyncio.fixture
async def mgr(config: kvo.OffloadConfig, backend: SimBackend) -> AsyncIterator[kvo.OffloadManager]:
    async with kvo.OffloadManager(config, backend=backend) as m:
        yield m
        backend.complete_all()  # let the manager drain; tests leave nothing running
        await m.settle()
        m.check_invariants()
