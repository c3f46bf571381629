"""The redis store against a real server: prefixes, bad values, a server that is gone,
and the optional dependency."""

from __future__ import annotations

import sys

import pytest
from _redis_server import free_port
from _storage_helpers import keys_of, pages_of

from kvoffload.errors import ConfigError, MissingDependency, StorageError
from kvoffload.storage.redis import DEFAULT_PREFIX, RedisStorage

pytestmark = pytest.mark.asyncio


async def test_pages_live_under_the_prefix_and_prefixes_do_not_mix(clean_redis: str) -> None:
    """Each page is one value at <prefix><key>; stores with other prefixes do not see it."""
    import redis

    a = RedisStorage(clean_redis, prefix="a:")
    b = RedisStorage(clean_redis + "?prefix=b:")
    keys, pages = keys_of(2), pages_of(2)
    try:
        assert b.prefix == "b:"
        await a.put(keys, pages)
        assert await b.get(keys) == [None, None]
        assert await b.exists_prefix(keys) == 0
        sync = redis.Redis.from_url(clean_redis)
        assert sorted(k.decode() for k in sync.keys("*")) == sorted("a:" + k for k in keys)
        sync.close()
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_bad_value_reads_as_missing(clean_redis: str) -> None:
    """A value that is truncated, raw or written under another key reads as missing."""
    import redis

    s = RedisStorage(clean_redis)
    keys, pages = keys_of(3), pages_of(3)
    try:
        await s.put(keys, pages)
        sync = redis.Redis.from_url(clean_redis)
        k0, k1, k2 = (DEFAULT_PREFIX + k for k in keys)
        sync.set(k0, sync.get(k0)[:-1])  # truncated
        sync.set(k1, pages[1])  # no header
        sync.set(k2, sync.get(DEFAULT_PREFIX + keys[0]) or b"")  # another key's record
        sync.close()
        assert await s.get(keys) == [None, None, None]
    finally:
        await s.aclose()


async def test_ttl_expires_pages(clean_redis: str) -> None:
    """ttl_s sets an expiry on every page written (Redis evicts them later)."""
    import redis

    s = RedisStorage(clean_redis + "?ttl_s=60")
    try:
        await s.put(keys_of(1), pages_of(1))
        sync = redis.Redis.from_url(clean_redis)
        ttl = sync.pttl(DEFAULT_PREFIX + keys_of(1)[0])
        sync.close()
        assert 0 < ttl <= 60_000
    finally:
        await s.aclose()


async def test_a_server_that_is_not_there_is_a_storage_error() -> None:
    """Nothing listening: every call raises StorageError naming the URL, quickly."""
    s = RedisStorage(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1)
    try:
        with pytest.raises(StorageError, match=r"127\.0\.0\.1"):
            await s.put(keys_of(1), pages_of(1))
        with pytest.raises(StorageError):
            await s.get(keys_of(1))
        with pytest.raises(StorageError):
            await s.exists_prefix(keys_of(1))
    finally:
        await s.aclose()


async def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="ttl_s"):
        RedisStorage("redis://127.0.0.1:1/0?ttl_s=soon")
    with pytest.raises(ConfigError, match="ttl_s"):
        RedisStorage("redis://127.0.0.1:1/0", ttl_s=0)


async def test_the_password_is_not_shown(clean_redis: str) -> None:
    s = RedisStorage("redis://user:hunter2@127.0.0.1:1/0")
    try:
        assert "hunter2" not in repr(s) and "hunter2" not in str(s.describe())
    finally:
        await s.aclose()


async def test_without_the_redis_extra_a_missing_dependency_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """With redis not importable, creating the store raises MissingDependency naming
    the kvoffload[redis] extra (and `import kvoffload` never needed it)."""
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(MissingDependency, match=r"kvoffload\[redis\]"):
        RedisStorage("redis://127.0.0.1:1/0")
