"""The file store's read path as the vLLM connector's load uses it (F38).

What must hold: a tensor-parallel rank's view (``RankKeys``) reads pages into an engine
block's parts through the file store's own ``preadv``, never through ``get`` and a copy;
the blocking reads (``blocking_exists_prefix`` / ``blocking_get_into_parts``, run on a
thread of the caller's own) count and read exactly what the async ones do: a page whose
checksum fails, a truncated or missing page, or a symlink stops the prefix there, never
served (F38).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvoffload.storage.file import FileStorage
from kvoffload.storage.rank_keys import RankKeys

PAGE = 3 * 64


def _pages(n: int) -> list[bytes]:
    return [bytes((i * 7 + j) % 251 for j in range(PAGE)) for i in range(n)]


def _parts(n: int) -> tuple[list[bytearray], list[list[memoryview]]]:
    bufs = [bytearray(PAGE) for _ in range(n)]
    return bufs, [[memoryview(b)[k * 64 : (k + 1) * 64] for k in range(3)] for b in bufs]


def test_a_rank_reads_into_parts_through_the_file_store_never_through_get(tmp_path: Path) -> None:
    """F38 under TP: RankKeys forwards get_into_parts (the file store's preadv into the
    parts, checked there); the default went through get (every page read out as bytes,
    then copied)."""
    inner = FileStorage(tmp_path)
    rank = RankKeys(inner, 1, 2)
    keys, pages = ["a0", "a1"], _pages(2)
    asyncio.run(rank.put(keys, pages))

    async def no_get(*_: object) -> list[bytes | None]:
        raise AssertionError("get_into_parts went through get (a copy)")

    inner.get = no_get  # type: ignore[method-assign]
    rank.get = no_get  # type: ignore[method-assign]
    bufs, parts = _parts(2)
    assert asyncio.run(rank.get_into_parts(keys, parts)) == 2
    assert [bytes(b) for b in bufs] == pages


@pytest.mark.parametrize("damage", ["none", "checksum", "truncated", "missing", "symlink"])
def test_blocking_reads_count_and_read_what_the_async_ones_do(tmp_path: Path, damage: str) -> None:
    """F38: the blocking reads (no event loop, no thread hop) stop at the same page as
    the async ones: a page that fails its check is never counted as read."""
    store = FileStorage(tmp_path / "s")
    keys, pages = [f"k{i}" for i in range(4)], _pages(4)
    asyncio.run(store.put(keys, pages))
    bad = store.path(keys[2])
    if damage == "checksum":
        raw = bytearray(bad.read_bytes())
        raw[-1] ^= 0xFF
        bad.write_bytes(bytes(raw))
    elif damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:-1])
    elif damage == "missing":
        bad.unlink()
    elif damage == "symlink":
        target = tmp_path / "elsewhere"
        target.write_bytes(bad.read_bytes())
        bad.unlink()
        os.symlink(target, bad)
    want = 4 if damage == "none" else 2
    header_ok = damage in ("none", "checksum")  # the lookup reads headers only
    assert store.blocking_exists_prefix(keys) == asyncio.run(store.exists_prefix(keys))
    assert store.blocking_exists_prefix(keys) == (4 if header_ok else 2)
    bufs, parts = _parts(4)
    assert store.blocking_get_into_parts(keys, parts) == want
    abufs, aparts = _parts(4)
    assert asyncio.run(store.get_into_parts(keys, aparts)) == want
    assert [bytes(b) for b in bufs[:want]] == pages[:want] == [bytes(b) for b in abufs[:want]]
    assert store.blocking_exists_prefix([]) == 0 and store.blocking_get_into_parts([], []) == 0
    with pytest.raises(ValueError, match="2 keys for 1 pages"):
        store.blocking_get_into_parts(keys[:2], parts[:1])
