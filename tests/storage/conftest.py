"""Fixtures for the storage tests: one ``store`` fixture over every storage tier, and
Redis servers.

Redis: ``KVOFFLOAD_REDIS_URL`` names a server the tests may flush (scripts/test.sh
starts one on a loopback port via scripts/redis.sh). Without it, a private
``redis-server`` is started for the session when the binary is installed; without
either, the redis tests are skipped with the reason, unless ``KVOFFLOAD_REQUIRE_REDIS=1``
(set by CI), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

from kvoffload.abc import Storage

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_ping(host: str, port: int) -> bool:
    """Whether a Redis server answers PING at host:port (a raw RESP round trip)."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A ``redis-server`` child process on a loopback port, without persistence."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        assert REDIS_SERVER is not None
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None
        assert REDIS_SERVER is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
            + ["--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):  # bounded: at most ~10 s
            if redis_ping("127.0.0.1", self.port):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        log = (self.workdir / "redis.log").read_text() if (self.workdir / "redis.log").exists() else ""
        raise RuntimeError(f"redis-server did not come up on port {self.port}: {log[-2000:]}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s); its data is gone."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _unavailable(reason: str) -> None:
    if os.environ.get("KVOFFLOAD_REQUIRE_REDIS") == "1":
        pytest.fail(f"KVOFFLOAD_REQUIRE_REDIS=1 but {reason}")
    pytest.skip(reason)


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


STORE_KINDS = ["memory", "file", "redis"]


def make_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Storage:
    """A fresh, empty store of ``kind`` (redis: a flushed database)."""
    if kind == "memory":
        from kvoffload.storage.memory import MemoryStorage

        return MemoryStorage()
    if kind == "file":
        from kvoffload.storage.file import FileStorage

        return FileStorage(tmp_path / "pages")
    from kvoffload.storage.redis import RedisStorage

    return RedisStorage(request.getfixturevalue("clean_redis"))


@pytest_asyncio.fixture(params=STORE_KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Storage]:
    """Every storage tier in turn, empty."""
    s = make_store(request.param, tmp_path, request)
    try:
        yield s
    finally:
        await s.aclose()
