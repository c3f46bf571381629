"""Fixtures for the storage tests: one ``store`` fixture over every storage tier, and
Redis servers.

Redis: ``KVOFFLOAD_REDIS_URL`` names a server the tests may flush (scripts/test.sh
starts one on a loopback port via scripts/redis.sh). Without it, a private
``redis-server`` is started for the session when the binary is installed; without
either, the redis tests are skipped with the reason, unless ``KVOFFLOAD_REQUIRE_REDIS=1``
(set by CI), which turns the skip into a failure.

Mooncake: ``KVOFFLOAD_MOONCAKE_URL`` names a master (with a memory server) that
scripts/mooncake.sh started; without it, a private one is started for the session when
the ``kvoffload[mooncake]`` wheel is installed; without either, the mooncake tests skip
with the reason, unless ``KVOFFLOAD_REQUIRE_MOONCAKE=1`` (set by CI) makes that a failure.
Each test's stores use a prefix of their own, so a shared master looks empty to them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import pytest_asyncio
from _mooncake_server import (
    MOONCAKE_BIN,
    MOONCAKE_MISSING,
    MooncakeServer,
    env_url,
    listening,
    mooncake_unavailable,
)
from _redis_server import REDIS_SERVER, RedisServer, redis_ping
from _storage_helpers import STORE_KINDS, make_store

from kvoffload.abc import Storage


def _unavailable(reason: str) -> None:
    if os.environ.get("KVOFFLOAD_REQUIRE_REDIS") == "1":
        pytest.fail(f"KVOFFLOAD_REQUIRE_REDIS=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def mooncake_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a Mooncake master on loopback with a memory server behind it."""
    if MOONCAKE_BIN is None:
        mooncake_unavailable(MOONCAKE_MISSING)
    url = env_url()
    if url:
        port = urlsplit(url).port
        if port is None or not listening(port):
            mooncake_unavailable(f"no Mooncake master answers at KVOFFLOAD_MOONCAKE_URL={url}")
        yield url
        return
    server = MooncakeServer(tmp_path_factory.mktemp("mooncake-session"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def own_mooncake(tmp_path: Path) -> Iterator[MooncakeServer]:
    """A private master (and memory server) for this test only; it may kill the master."""
    if MOONCAKE_BIN is None:
        mooncake_unavailable(MOONCAKE_MISSING)
    server = MooncakeServer(tmp_path / "mooncake")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a Redis server the tests own (they flush it)."""
    url = os.environ.get("KVOFFLOAD_REDIS_URL")
    if url:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 6379
        if not redis_ping(host, port):
            _unavailable(f"no Redis answers at KVOFFLOAD_REDIS_URL={url}")
        yield url
        return
    if REDIS_SERVER is None:
        _unavailable("no Redis server: set KVOFFLOAD_REDIS_URL or install redis-server (scripts/redis.sh)")
    server = RedisServer(tmp_path_factory.mktemp("redis-session"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def flush(url: str) -> None:
    """Empty the database of ``url`` (tests that need Redis start from a clean one)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


@pytest.fixture
def clean_redis(redis_url: str) -> str:
    """``redis_url``, its database flushed first."""
    flush(redis_url)
    return redis_url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server for this test only, which the test may stop and restart."""
    if REDIS_SERVER is None:
        _unavailable("redis-server is not installed (scripts/redis.sh installs it)")
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture(params=STORE_KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Storage]:
    """Every storage tier in turn, empty."""
    s = make_store(request.param, tmp_path, request)
    try:
        yield s
    finally:
        await s.aclose()
