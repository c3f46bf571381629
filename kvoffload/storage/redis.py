"""A Redis tier shared by many decode workers (``pip install kvoffload[redis]``).

Each page is one string value under ``<prefix><page key>``; the value is a record
(:mod:`kvoffload.storage._record`: the key, the payload length and a checksum, then
the page), so a value that is truncated, corrupt or was written under another key
reads as missing. A batch is one pipeline (no MULTI): one round trip per chunk,
and one reply per SET, so a batch the server refused in part says which pages it
stored (:class:`~kvoffload.PartialWriteError`, F34).
Writes pack their SETs by hand so that a record goes out as its header and the page's
own memory (a host page is never copied on the way; redis-py's pipeline would need
the value as one ``bytes``).

The client is ``redis.asyncio``; it is imported when a store is created, never by
``import kvoffload``. redis-py's own retries are turned off: the write-behind task
retries whole chunks with its own bound (see ``docs/storage.md``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio

from kvoffload.abc import Storage
from kvoffload.errors import ConfigError, MissingDependency, PartialWriteError, StorageError
from kvoffload.pools import page_views
from kvoffload.storage._record import decode, encode_header
from kvoffload.storage._url import redact, scrub

if TYPE_CHECKING:
    import redis.asyncio

    from kvoffload.pools import HostPool

__all__ = ["DEFAULT_PREFIX", "RedisStorage"]

#: Key prefix when none is given.
DEFAULT_PREFIX = "kvoffload:page:"


def _redis_asyncio() -> Any:
    try:
        import redis.asyncio
    except ImportError as exc:
        raise MissingDependency(
            "the redis storage needs the redis client: pip install 'kvoffload[redis]'"
        ) from exc
    return redis.asyncio


@functools.cache
def _get_connection_takes_no_argument() -> bool:
    """redis-py >= 5.3 deprecates get_connection's command name; 5.0 requires it."""
    try:
        from redis.asyncio.connection import ConnectionPool

        params = list(inspect.signature(ConnectionPool.get_connection).parameters.values())[1:]
    except (ImportError, TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


class RedisStorage(Storage):
    """Pages in Redis at ``url`` under ``prefix``; many workers may share one server.

    ``url`` is a ``redis://`` / ``rediss://`` / ``unix://`` URL as redis-py reads it;
    the query may also carry ``prefix=`` and ``ttl_s=`` (taken out before redis-py
    sees the URL). ``ttl_s`` expires pages that many seconds after their last write
    (``None``: never; use Redis's ``maxmemory-policy`` to evict instead). Creating the
    store does not connect; the first command does.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str | None = None,
        ttl_s: float | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        opts = {k: v for k, v in query if k in ("prefix", "ttl_s")}
        rest = [(k, v) for k, v in query if k not in ("prefix", "ttl_s")]
        if prefix is None:
            prefix = opts.get("prefix", DEFAULT_PREFIX)
        if ttl_s is None and "ttl_s" in opts:
            try:
                ttl_s = float(opts["ttl_s"])
            except ValueError:
                bad = opts["ttl_s"]
                raise ConfigError(f"redis storage: ttl_s={bad!r} in the URL is not a number") from None
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"redis storage: ttl_s must be > 0 or None, got {ttl_s!r}")
        self.url = urlunsplit(parts._replace(query=urlencode(rest)))
        # For repr, describe(), logs and errors: the URL without its secrets (F23).
        self.display_url = redact(url)
        self._raw_url = url
        self.prefix = prefix
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        aredis = _redis_asyncio()
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        try:
            self.client: redis.asyncio.Redis = aredis.Redis.from_url(
                self.url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        except ValueError as exc:
            raise ConfigError(
                f"redis storage: bad URL {self.display_url!r}: {scrub(str(exc), url)}"
            ) from None

    def _k(self, key: str) -> str:
        return self.prefix + key

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if keys:
            await self._set(keys, pages)

    async def put_pages(self, keys: Sequence[str], host_pool: HostPool, host_pages: Sequence[int]) -> None:
        """Write each host page from the pool's memory: no copy of a page is made here."""
        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys for {len(host_pages)} pages")
        if keys:
            await self._set(keys, page_views(host_pool, host_pages))

    async def _set(self, keys: Sequence[str], pages: Sequence[bytes | memoryview]) -> None:
        """``SET <prefix><key> <record> [PX ttl]`` for each page, in one round trip on one
        pooled connection. Every reply is read before an error is raised, so the
        connection stays in step; a connection left mid-way (an I/O error, a
        cancellation) is dropped, never reused."""
        from redis.exceptions import RedisError, ResponseError

        ttl = self.ttl_ms
        head = b"*3\r\n$3\r\nSET\r\n" if ttl is None else b"*5\r\n$3\r\nSET\r\n"
        tail = b"\r\n" if ttl is None else b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(ttl)), ttl)
        chunks: list[bytes | memoryview] = []
        for key, page in zip(keys, pages, strict=True):
            view = memoryview(page).cast("B")
            header = encode_header(key, view)
            name = self._k(key).encode()
            record = len(header) + view.nbytes
            chunks += (b"%s$%d\r\n%s\r\n$%d\r\n%s" % (head, len(name), name, record, header), view, tail)
        pool = self.client.connection_pool
        try:
            get: Any = pool.get_connection  # untyped in redis-py
            conn = await (get() if _get_connection_takes_no_argument() else get("SET"))
        except (RedisError, OSError) as exc:
            raise self._error("write", exc) from exc
        # refused[i]: the server's error reply to page i's SET, None where it replied OK (F34).
        refused: list[BaseException | None] = []
        in_step = False
        try:
            await conn.send_packed_command(chunks)
            del chunks  # the pages' views: nothing holds them after this call
            for _ in range(len(keys)):
                try:
                    await conn.read_response()
                except ResponseError as exc:  # this SET was refused (OOM, a read-only replica, an ACL)
                    refused.append(exc)
                else:
                    refused.append(None)
            in_step = True
        except (RedisError, OSError) as exc:
            raise self._error("write", exc) from exc
        finally:
            with anyio.CancelScope(shield=True):
                if not in_step:
                    await conn.disconnect(nowait=True)
                await pool.release(conn)
        bad = [e for e in refused if e is not None]
        if not bad:
            return
        if len(bad) == len(refused):
            raise self._error("write", bad[0]) from bad[0]
        first = self._error("write", bad[0])
        raise PartialWriteError(
            f"{first} ({len(bad)} of {len(refused)} SET(s) refused)",
            [e is None for e in refused],
            [None if e is None else str(self._error("write", e)) for e in refused],
        ) from bad[0]

    def _error(self, what: str, exc: BaseException) -> StorageError:
        detail = scrub(repr(exc), self._raw_url)
        return StorageError(f"redis storage at {self.display_url}: {what} failed: {detail}")

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._k(key))
        records = await self._run(pipe, "read")
        return [decode(key, rec) for key, rec in zip(keys, records, strict=True)]

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """One pipelined EXISTS per key; the record itself is checked on read."""
        if not keys:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._k(key))
        n = 0
        for found in await self._run(pipe, "read"):
            if not found:
                break
            n += 1
        return n

    async def _run(self, pipe: Any, what: str) -> list[Any]:
        from redis.exceptions import RedisError

        try:
            result: list[Any] = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise self._error(what, exc) from exc
        return result

    async def aclose(self) -> None:
        await self.client.aclose()

    def describe(self) -> dict[str, Any]:
        return {"storage": self.name, "url": self.display_url, "prefix": self.prefix}

    def __repr__(self) -> str:
        return f"<RedisStorage {self.display_url} prefix={self.prefix!r}>"
