"""An in-process dict store: for tests and examples."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.abc import Storage

__all__ = ["MemoryStorage"]


class MemoryStorage(Storage):
    """Pages in a dict, keyed by page key. Not shared between processes."""

    name = "memory"

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        self.pages.update(zip(keys, (bytes(p) for p in pages), strict=True))

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.pages.get(k) for k in keys]
