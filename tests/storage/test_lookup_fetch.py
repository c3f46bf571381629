"""mgr.lookup(tokens) and mgr.fetch(tokens, n) on every store: the stored prefix of a
token sequence, whole pages only, and its bytes read back under their chain keys."""

from __future__ import annotations

import pytest
from _storage_helpers import device_bytes, fill_device

import kvoffload as kvo
from kvoffload.abc import Storage
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend, manager_in_task

pytestmark = pytest.mark.asyncio

TOKENS = list(range(100, 122))  # 22 tokens: 5 whole pages of 4, and 2 left over
CONFIG = kvo.OffloadConfig(
    page_size=4, stride=8, device_pages=32, host_pages=32, offload_prompt=True, drain_timeout_s=5
)


async def store_request(mgr: kvo.OffloadManager, backend: SimBackend, tokens: list[int]) -> list[bytes]:
    """Run one request through offload and write-behind; return its pages' device bytes."""
    lc = mgr.admit("r", tokens[:8])  # the prompt's 2 pages are the first chunk
    lc.extend(tokens[8:])  # a stride is due: 2 more pages
    lc.finish()  # the page-aligned remainder: 1 page
    fill_device(mgr, lc, seed=len(tokens))
    expected = device_bytes(mgr, lc.device_pages[: len(tokens) // 4])
    backend.complete_all()
    await lc.wait_released()
    await mgr.settle()
    assert mgr.statistics().pages_stored == len(tokens) // 4
    return expected


async def test_lookup_counts_whole_stored_pages_from_the_start(store: Storage) -> None:
    """lookup is the stored prefix in tokens: whole pages, stopping where the sequence
    leaves what was stored."""
    backend = SimBackend()
    async with manager_in_task(CONFIG, backend=backend, storage=store) as mgr:
        await store_request(mgr, backend, TOKENS)
        assert await mgr.lookup(TOKENS) == 20
        assert await mgr.lookup(TOKENS[:13]) == 12
        assert await mgr.lookup([*TOKENS, 1, 2, 3, 4, 5]) == 20
        assert await mgr.lookup([*TOKENS[:9], 7, 7, 7, 7]) == 8  # diverges in page 3
        assert await mgr.lookup([1, *TOKENS[1:]]) == 0  # diverges in page 1: the chain differs
        assert await mgr.lookup(TOKENS[:3]) == 0
        assert await mgr.lookup([]) == 0
        with pytest.raises(kvo.InvalidTokens):
            await mgr.lookup("abc")  # type: ignore[arg-type]


async def test_fetch_returns_the_copied_bytes_under_their_keys(store: Storage) -> None:
    """fetch(tokens, n) returns the bytes the device held for those pages, in order; it
    returns fewer pages where the store has fewer, never other bytes."""
    backend = SimBackend()
    async with manager_in_task(CONFIG, backend=backend, storage=store) as mgr:
        expected = await store_request(mgr, backend, TOKENS)
        assert await mgr.fetch(TOKENS, 20) == expected
        assert await mgr.fetch(TOKENS, 8) == expected[:2]
        assert await mgr.fetch(TOKENS, 0) == []
        assert await mgr.fetch([*TOKENS[:20], 9, 9, 9, 9], 24) == expected
        assert await mgr.fetch([*TOKENS[:9], 7, 7, 7, 7], 12) == expected[:2]
        for bad in (3, 24, -4):
            with pytest.raises(kvo.InvalidTokens, match="multiple of page_size"):
                await mgr.fetch(TOKENS, bad)


async def test_a_page_of_the_wrong_size_ends_the_fetch() -> None:
    """A page stored under the right key but not one host page long (another worker's
    layout) is not returned."""
    store = MemoryStorage()
    backend = SimBackend()
    async with manager_in_task(CONFIG, backend=backend, storage=store) as mgr:
        expected = await store_request(mgr, backend, TOKENS)
        keys = kvo.chain_keys(None, TOKENS[: len(TOKENS) - len(TOKENS) % 4], 4)
        await store.put(keys[2:3], [b"short"])
        assert await mgr.fetch(TOKENS, 20) == expected[:2]


async def test_the_prompt_taken_as_stored_by_prefill_is_not_found_when_it_is_not() -> None:
    """With offload_prompt off, the prompt's pages are the prefill side's to store: if
    they are not in the store, lookup finds nothing (counting from the first page)."""
    cfg = kvo.OffloadConfig(page_size=4, stride=8, device_pages=32, host_pages=32, drain_timeout_s=5)
    backend = SimBackend()
    async with manager_in_task(cfg, backend=backend, storage="memory") as mgr:
        lc = mgr.admit("r", TOKENS[:8])
        lc.extend(TOKENS[8:])
        lc.finish()
        backend.complete_all()
        await mgr.settle()
        assert mgr.statistics().pages_stored == 3
        assert await mgr.lookup(TOKENS) == 0


async def test_lookup_without_storage_is_a_storage_error() -> None:
    backend = SimBackend()
    async with manager_in_task(CONFIG, backend=backend) as mgr:
        with pytest.raises(kvo.StorageError, match="no storage"):
            await mgr.lookup(TOKENS)
        with pytest.raises(kvo.StorageError, match="no storage"):
            await mgr.fetch(TOKENS, 4)
