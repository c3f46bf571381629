"""One rank's view of a shared storage tier under tensor parallelism
(``OffloadConfig(tp_keys="rank")``): its shard of each page under its own key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.abc import Storage

if TYPE_CHECKING:
    from kvoffload.pools import HostPool

__all__ = ["RankKeys"]


class RankKeys(Storage):
    """A storage tier seen through one rank's key space (``tp_keys="rank"``): every key
    suffixed ``_<rank>_<size>`` (kvoffload's own key space: SGLang's HiCacheFile names
    ``<key>_<model>_<rank>_<size>.bin``; a store that suffixes per rank itself, such as
    the SGLang integration's, is not wrapped). The page keys themselves (the chain) are
    the same on every rank; only where each rank's shard is stored differs. Called where
    the wrapped store is."""

    def __init__(self, inner: Storage, rank: int, size: int) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # report the wrapped store's name
        self.suffix = f"_{rank}_{size}"

    def _keys(self, keys: Sequence[str]) -> list[str]:
        s = self.suffix
        return [k + s for k in keys]

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        await self.inner.put(self._keys(keys), pages)

    async def put_pages(self, keys: Sequence[str], host_pool: HostPool, host_pages: Sequence[int]) -> None:
        await self.inner.put_pages(self._keys(keys), host_pool, host_pages)

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self.inner.get(self._keys(keys))

    async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
        return await self.inner.get_into(self._keys(keys), dest)

    async def get_into_parts(self, keys: Sequence[str], dest: Sequence[Sequence[memoryview]]) -> int:
        return await self.inner.get_into_parts(self._keys(keys), dest)

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        return await self.inner.exists_prefix(self._keys(keys))

    async def aclose(self) -> None:
        await self.inner.aclose()

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "tp_key_suffix": self.suffix}

    def __repr__(self) -> str:
        return f"<RankKeys *{self.suffix} of {self.inner!r}>"
