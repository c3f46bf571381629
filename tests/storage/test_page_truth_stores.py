"""Each store reports a batched write per page (FAILURES F34).

A store that stored part of a batch raises :class:`~kvoffload.PartialWriteError`
whose ``stored[i]`` is True exactly where page ``i`` is readable afterwards, and whose
``errors[i]`` says why a page was not stored. The file store knows which renames
happened; the redis store reads one reply per SET of its pipeline. (The memory store
cannot fail a page; its fault wrapper is in ``tests/test_page_truth.py``.) Through a
manager, the pages a store confirmed before the first one it did not are the ones
counted stored and found by ``lookup``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from _storage_helpers import keys_of, pages_of

import kvoffload as kvo
from kvoffload.errors import PartialWriteError, StorageError
from kvoffload.pools import HostPool
from kvoffload.storage.file import FileStorage
from kvoffload.storage.redis import RedisStorage

pytestmark = pytest.mark.asyncio


# --- file: one page's rename fails -----------------------------------------------------------------


async def test_the_file_store_reports_which_pages_of_a_batch_it_renamed_into_place(tmp_path: Path) -> None:
    """F34, file: the second page's final name is a directory, so its rename fails (the
    real ``os.replace`` error); the first and third pages are renamed into place. The
    store raises PartialWriteError (True, False, True), the failed page's reason names
    its path, and what reads back is exactly the confirmed pages."""
    fs = FileStorage(tmp_path / "pages")
    keys, pages = keys_of(3), pages_of(3)
    blocked = fs.path(keys[1])
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.mkdir()  # a directory where the page's file would go: its rename fails
    with pytest.raises(PartialWriteError) as caught:
        await fs.put(keys, pages)
    err = caught.value
    assert err.stored == (True, False, True)
    assert err.errors[0] is None and err.errors[2] is None
    assert err.errors[1] is not None and str(blocked) in err.errors[1]
    assert await fs.get(keys) == [pages[0], None, pages[2]]
    assert await fs.exists_prefix(keys) == 1
    assert not [n for n in os.listdir(blocked.parent) if n.endswith(".tmp")], "a temporary file was left"


async def test_the_file_store_from_host_pages_reports_per_page_too(tmp_path: Path) -> None:
    """The writer's path (``put_pages``, from the host pool's memory) reports per page
    the same way."""
    fs = FileStorage(tmp_path / "pages")
    keys = keys_of(3)
    pool = HostPool.new(3, (16,), "int32", zero=True)
    fs.path(keys[0]).parent.mkdir(parents=True, exist_ok=True)
    fs.path(keys[0]).mkdir()
    with pytest.raises(PartialWriteError) as caught:
        await fs.put_pages(keys, pool, [0, 1, 2])
    assert caught.value.stored == (False, True, True)
    assert [p is not None for p in await fs.get(keys)] == [False, True, True]


async def test_the_file_store_that_stores_no_page_raises_a_plain_storage_error(tmp_path: Path) -> None:
    """Every page failed: a StorageError that is not partial (no page confirmed)."""
    fs = FileStorage(tmp_path / "pages")
    keys, pages = keys_of(2), pages_of(2)
    for k in keys:
        fs.path(k).parent.mkdir(parents=True, exist_ok=True)
        fs.path(k).mkdir()
    with pytest.raises(StorageError) as caught:
        await fs.put(keys, pages)
    assert not isinstance(caught.value, PartialWriteError)


def _config() -> kvo.OffloadConfig:
    return kvo.OffloadConfig(
        page_size=4, stride=4, device_pages=64, host_pages=64, drain_timeout_s=5, offload_prompt=True
    )


async def test_through_a_manager_a_file_page_that_was_not_renamed_is_a_hole(tmp_path: Path) -> None:
    """F34 end to end on the file store: a chunk of three pages whose middle page cannot
    be renamed into place; ``pages_stored`` counts the prompt page and the first page
    of the chunk, ``lookup`` reaches exactly them, the third page is in the store but
    counted unreachable."""
    from kvoffload.keys import chain_keys
    from kvoffload.storage.writer import WritePolicy
    from kvoffload.testing import SimBackend, manager_in_task

    fs = FileStorage(tmp_path / "pages")
    tokens = list(range(16))
    keys = chain_keys(None, tokens, 4)
    blocked = fs.path(keys[2])
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.mkdir()
    backend = SimBackend()
    policy = WritePolicy(attempts=2, backoff_s=0)
    async with manager_in_task(_config(), backend=backend, storage=fs, write_policy=policy) as mgr:
        lc = mgr.admit("r", tokens[:4])
        lc.extend(tokens[4:16])
        backend.complete_all()
        await mgr.settle()
        s = mgr.statistics()
        assert (s.pages_stored, s.pages_store_failed, s.pages_store_unreachable) == (2, 1, 1)
        assert (s.chunks_store_partial, s.pages_store_retried) == (1, 1)
        assert await mgr.lookup(tokens) == 8
        assert await fs.get(keys[3:]) != [None]
        lc.finish()
        await lc.wait_released()
        assert lc.pages_lost == 2
        mgr.check_invariants()


# --- redis: a SET refused mid-pipeline, on a real server ----------------------------------------------


@pytest.fixture
def limited_redis(clean_redis: str) -> Iterator[str]:
    """A URL of ``clean_redis`` logged in as a user allowed to write only keys under
    ``pt:ok:`` (Redis ACL): a SET of any other key is refused with its own error reply
    (NOPERM) while the SETs around it in the same pipeline succeed."""
    import redis

    admin = redis.Redis.from_url(clean_redis)
    user = ("kvo-partial", "reset", "on", ">s3cret-partial", "~pt:ok:*", "+@all")
    admin.execute_command("ACL", "SETUSER", *user)
    parts = urlsplit(clean_redis)
    netloc = f"kvo-partial:s3cret-partial@{parts.hostname}:{parts.port}"
    try:
        yield urlunsplit(parts._replace(netloc=netloc))
    finally:
        admin.execute_command("ACL", "DELUSER", "kvo-partial")
        admin.close()


async def test_the_redis_store_reports_which_sets_of_its_pipeline_the_server_refused(
    limited_redis: str,
) -> None:
    """F34, redis: one pipeline of three SETs, the middle one refused by the server
    (an ACL refusal: its own error reply, mid-pipeline). The store raises
    PartialWriteError (True, False, True), the refused page's reason is the server's
    reply (the password never shown, F23), and exactly the confirmed pages read back."""
    import redis

    store = RedisStorage(limited_redis, prefix="pt:")
    keys = ["ok:a", "no:b", "ok:c"]
    pages = pages_of(3)
    try:
        with pytest.raises(PartialWriteError) as caught:
            await store.put(keys, pages)
        err = caught.value
        assert err.stored == (True, False, True)
        assert err.errors[1] is not None and "NOPERM" in err.errors[1].upper()
        assert "s3cret-partial" not in str(err) and all("s3cret-partial" not in (e or "") for e in err.errors)
        plain_url = limited_redis.replace("kvo-partial:s3cret-partial@", "")
        reader = RedisStorage(plain_url, prefix="pt:")  # (the limited user may not read pt:no:)
        assert await reader.get(keys) == [pages[0], None, pages[2]]
        await reader.aclose()
        admin = redis.Redis.from_url(plain_url)
        assert sorted(k.decode() for k in admin.keys("pt:*")) == ["pt:ok:a", "pt:ok:c"]
        admin.close()
        await store.put(["ok:d"], pages[:1])  # the connection stayed in step
        assert await store.get(["ok:d"]) == pages[:1]
    finally:
        await store.aclose()


async def test_the_redis_store_whose_every_set_is_refused_raises_a_plain_storage_error(
    limited_redis: str,
) -> None:
    """No SET confirmed: a StorageError that is not partial."""
    store = RedisStorage(limited_redis, prefix="pt:")
    try:
        with pytest.raises(StorageError) as caught:
            await store.put(["no:a", "no:b"], pages_of(2))
        assert not isinstance(caught.value, PartialWriteError)
    finally:
        await store.aclose()
