"""The Storage contract (kvoffload/abc.py), run on every store: memory, file, redis,
mooncake (a real master; KVOFFLOAD_REQUIRE_MOONCAKE=1 makes it fail rather than skip), and
a tensor-parallel rank's view of a file store (RankKeys)."""

from __future__ import annotations

import os

import anyio
import pytest
from _storage_helpers import PAGE, keys_of, pages_of

from kvoffload.abc import Storage

pytestmark = pytest.mark.asyncio


def twin(store: Storage) -> Storage | None:
    """A second handle on the same stored pages (another worker's), or None for memory."""
    from kvoffload.storage.file import FileStorage
    from kvoffload.storage.rank_keys import RankKeys
    from kvoffload.storage.redis import RedisStorage

    if type(store).__name__ == "MooncakeStore":
        from kvoffload.storage.mooncake import MooncakeStore

        assert isinstance(store, MooncakeStore)
        return MooncakeStore(store.display_url, prefix=store.prefix, global_segment_size=0)

    if isinstance(store, RankKeys):
        inner = twin(store.inner)
        return None if inner is None else RankKeys(inner, 1, 2)
    if isinstance(store, FileStorage):
        return FileStorage(store.root)
    if isinstance(store, RedisStorage):
        return RedisStorage(store.url, prefix=store.prefix)
    return None


async def test_put_then_get_returns_the_same_bytes(store: Storage) -> None:
    """Every page put under a key is read back byte for byte, in key order."""
    keys, pages = keys_of(5), pages_of(5)
    await store.put(keys, pages)
    assert await store.get(keys) == pages
    assert await store.get(list(reversed(keys))) == list(reversed(pages))


async def test_missing_keys_read_as_none(store: Storage) -> None:
    """A key never stored reads as None, beside stored ones."""
    keys, pages = keys_of(3), pages_of(3)
    await store.put(keys[:1] + keys[2:], pages[:1] + pages[2:])
    assert await store.get(keys) == [pages[0], None, pages[2]]
    assert await store.get(keys_of(2, salt=9)) == [None, None]


async def test_exists_prefix_counts_from_the_first_key(store: Storage) -> None:
    """exists_prefix is the length of the stored prefix: it stops at the first gap."""
    keys, pages = keys_of(4), pages_of(4)
    assert await store.exists_prefix(keys) == 0
    await store.put(keys[1:], pages[1:])
    assert await store.exists_prefix(keys) == 0  # the first is missing
    await store.put(keys[:1], pages[:1])
    assert await store.exists_prefix(keys) == 4
    assert await store.exists_prefix(keys[:2] + keys_of(1, salt=5) + keys[2:]) == 2
    assert await store.exists_prefix([]) == 0


async def test_empty_batches_are_no_ops(store: Storage) -> None:
    await store.put([], [])
    assert await store.get([]) == []
    assert await store.get_into([], []) == 0


async def test_mismatched_batch_raises_value_error_and_stores_nothing(store: Storage) -> None:
    keys = keys_of(2)
    with pytest.raises(ValueError, match="2 keys for 1 pages"):
        await store.put(keys, pages_of(1))
    assert await store.get(keys) == [None, None]


async def test_rewriting_a_key_keeps_one_whole_page(store: Storage) -> None:
    """A key may be written twice (two workers, one prefix); a read sees one whole page."""
    keys = keys_of(1)
    await store.put(keys, pages_of(1, salt=1))
    await store.put(keys, pages_of(1, salt=2))
    assert await store.get(keys) == pages_of(1, salt=2)


async def test_get_into_fills_host_buffers_up_to_the_first_gap(store: Storage) -> None:
    """get_into writes each page into its buffer and counts the leading pages read; a
    missing page or one of the wrong size stops it."""
    keys, pages = keys_of(4), pages_of(4)
    await store.put(keys[:2] + keys[3:], pages[:2] + pages[3:])
    host = bytearray(4 * PAGE)
    dest = [memoryview(host)[i * PAGE : (i + 1) * PAGE] for i in range(4)]
    assert await store.get_into(keys, dest) == 2
    assert bytes(host[: 2 * PAGE]) == pages[0] + pages[1]
    wrong = [memoryview(bytearray(PAGE + 1))]
    assert await store.get_into(keys[:1], wrong) == 0
    with pytest.raises(ValueError):
        await store.get_into(keys, dest[:1])


async def test_get_into_parts_fills_each_pages_parts_up_to_the_first_gap(store: Storage) -> None:
    """get_into_parts writes page i's bytes, in order, across its buffers (an engine
    block across its layers' tensors) and counts the leading pages read; a missing page,
    or parts whose sizes do not add up to the page, stops it."""
    keys, pages = keys_of(4), pages_of(4)
    await store.put(keys[:2] + keys[3:], pages[:2] + pages[3:])
    cut = PAGE // 3
    bufs = [(bytearray(cut), bytearray(PAGE - cut)) for _ in range(4)]
    dest = [[memoryview(a), memoryview(b)] for a, b in bufs]
    assert await store.get_into_parts(keys, dest) == 2
    assert [bytes(a + b) for a, b in bufs[:2]] == pages[:2]
    assert await store.get_into_parts(keys[:1], [[memoryview(bytearray(PAGE - 1))]]) == 0
    too_big = [[memoryview(bytearray(PAGE)), memoryview(bytearray(1))]]
    assert await store.get_into_parts(keys[3:], too_big) == 0
    assert await store.get_into_parts([], []) == 0
    with pytest.raises(ValueError):
        await store.get_into_parts(keys, dest[:1])


async def test_large_pages_round_trip(store: Storage) -> None:
    """A 1 MiB page (a realistic KV page of all layers) is stored and read whole."""
    keys = keys_of(2)
    pages = [os.urandom(1 << 20), os.urandom(1 << 20)]
    await store.put(keys, pages)
    assert await store.get(keys) == pages
    bufs = [memoryview(bytearray(1 << 20)) for _ in range(2)]
    assert await store.get_into(keys, bufs) == 2
    assert [bytes(b) for b in bufs] == pages


async def test_concurrent_batches_all_land(store: Storage) -> None:
    """Batches put from several tasks at once are all stored."""
    batches = [(keys_of(3, salt=s), pages_of(3, salt=s)) for s in range(1, 7)]
    async with anyio.create_task_group() as tg:
        for keys, pages in batches:
            tg.start_soon(store.put, keys, pages)
    for keys, pages in batches:
        assert await store.get(keys) == pages


async def test_a_second_handle_sees_what_the_first_stored(store: Storage) -> None:
    """Another worker's handle on the same tier finds the pages (file, redis, mooncake)."""
    other = twin(store)
    if other is None:
        pytest.skip("the memory store is one process's dict: not shared by design")
    keys, pages = keys_of(3), pages_of(3)
    await store.put(keys, pages)
    try:
        assert await other.exists_prefix(keys) == 3
        assert await other.get(keys) == pages
    finally:
        await other.aclose()


async def test_describe_names_the_store(store: Storage) -> None:
    assert store.describe()["storage"] == store.name
