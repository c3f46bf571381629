"""Page keys and page bytes for the storage tests (importable as a plain module)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

import kvoffload as kvo
from kvoffload.abc import Storage
from kvoffload.errors import StorageError
from kvoffload.keys import chain_keys
from kvoffload.storage.memory import MemoryStorage

PAGE = 64


def keys_of(n: int, salt: int = 0) -> list[str]:
    """``n`` chained page keys (as the manager makes them)."""
    return chain_keys(None, [salt * 1000 + i for i in range(n * 4)], 4)


def pages_of(n: int, size: int = PAGE, salt: int = 0) -> list[bytes]:
    """``n`` distinct pages of ``size`` bytes."""
    return [bytes([(salt + i + j) % 251 for j in range(size)]) for i in range(n)]


class ScriptedStore(MemoryStorage):
    """A memory store whose writes the test controls: ``down`` fails every put,
    ``fail_next`` fails that many puts, ``gate`` (an event) holds every put until set;
    ``calls`` counts puts and ``order`` records each put's keys."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.fail_next = 0
        self.gate: anyio.Event | None = None
        self.calls = 0
        self.order: list[list[str]] = []
        self.error: type[Exception] = StorageError

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.down or self.fail_next > 0:
            self.fail_next = max(0, self.fail_next - 1)
            raise self.error("scripted storage failure")
        self.order.append(list(keys))
        await super().put(keys, pages)


def fill_device(mgr: kvo.OffloadManager, lc: kvo.Lifecycle, seed: int) -> None:
    """Give each device page of ``lc`` distinct contents (so wrong bytes show)."""
    fill_pages(mgr, lc.device_pages, seed)


def fill_pages(mgr: kvo.OffloadManager, pages: Sequence[int], seed: int) -> None:
    """Give each of these device pages distinct contents."""
    import torch

    for i, p in enumerate(pages):
        mgr.device_pool.tensor[p] = torch.full_like(mgr.device_pool.tensor[p], float((seed * 97 + i) % 1000))


def device_bytes(mgr: kvo.OffloadManager, pages: Sequence[int]) -> list[bytes]:
    """The bytes of device pages now."""
    return [bytes(mgr.device_pool.tensor[p].contiguous().view(-1).numpy().tobytes()) for p in pages]


#: rank_keys: one tensor-parallel rank's view of a file store (its keys suffixed).
#: mooncake: a Mooncake Store client (KVOFFLOAD_REQUIRE_MOONCAKE=1 in CI: it must not skip).
STORE_KINDS = ["memory", "file", "file_direct", "redis", "rank_keys", "mooncake"]


def mooncake_store(url: str, **options: object) -> Storage:
    """A Mooncake client on ``url`` under a prefix of its own (an empty store), lending
    no memory (pages live in the memory server)."""
    import uuid

    from kvoffload.storage.mooncake import MooncakeStore

    opts: dict[str, object] = {"prefix": f"t{uuid.uuid4().hex[:12]}:", "global_segment_size": 0}
    opts.update(options)
    return MooncakeStore(url, **opts)  # type: ignore[arg-type]


def make_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Storage:
    """A fresh, empty store of ``kind`` (redis: a flushed database)."""
    if kind == "memory":
        from kvoffload.storage.memory import MemoryStorage

        return MemoryStorage()
    if kind == "rank_keys":
        from kvoffload.storage.file import FileStorage
        from kvoffload.storage.rank_keys import RankKeys

        return RankKeys(FileStorage(tmp_path / "pages"), 1, 2)
    if kind == "file":
        from kvoffload.storage.file import FileStorage

        return FileStorage(tmp_path / "pages")
    if kind == "file_direct":  # O_DIRECT writes (through the page cache where refused)
        from kvoffload.storage.file import FileStorage

        return FileStorage(tmp_path / "pages", direct=True)
    if kind == "mooncake":
        return mooncake_store(request.getfixturevalue("mooncake_url"))
    from kvoffload.storage.redis import RedisStorage

    return RedisStorage(request.getfixturevalue("clean_redis"))
