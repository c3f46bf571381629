"""Namespaces on a shared store (FAILURES F22): managers of different namespaces on one
file root, one Redis or one Mooncake master never see each other's pages, through either driver; managers
of one namespace share them; the keys are SGLang's seeded keys."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvoffload as kvo
from kvoffload.testing import SimBackend

TOKENS = list(range(500, 522))  # 5 whole pages of 4, and 2 tokens over
PAGES = 5


def config(namespace: str | None) -> kvo.OffloadConfig:
    return kvo.OffloadConfig(
        page_size=4, stride=8, device_pages=32, host_pages=32, offload_prompt=True, namespace=namespace
    )


@pytest.fixture(params=["file", "redis", "mooncake"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store several managers open by name: a file root, a flushed Redis, or a Mooncake
    master under a prefix of this test's own (KVOFFLOAD_REQUIRE_MOONCAKE=1: never skipped
    in CI)."""
    if request.param == "file":
        return str(tmp_path / "pages")
    if request.param == "mooncake":
        import uuid

        master: str = request.getfixturevalue("mooncake_url")
        return f"{master}?prefix=ns-{uuid.uuid4().hex[:12]}:&global_segment_size=0"
    url: str = request.getfixturevalue("clean_redis")
    return url


def sync_store(namespace: str | None, shared: str, chain_seed: str | None = None) -> list[str]:
    """Store TOKENS through a SyncOffloadManager of ``namespace``; return its page keys."""
    backend = SimBackend()
    with kvo.SyncOffloadManager(config(namespace), backend=backend, storage=shared) as mgr:
        lc = mgr.admit("r", TOKENS[:8], chain_seed=chain_seed)
        lc.extend(TOKENS[8:])
        lc.finish()
        keys = [k for t in backend.pending for k in t.keys]
        backend.complete_all()
        mgr.quiesce(timeout=10)
    assert mgr.statistics().pages_stored == PAGES  # close() waited for the writes
    return keys


def sync_reads(namespace: str | None, shared: str) -> tuple[int, int]:
    """(lookup, pages fetched) of TOKENS by a SyncOffloadManager of ``namespace``."""
    with kvo.SyncOffloadManager(config(namespace), backend=SimBackend(), storage=shared) as mgr:
        return mgr.lookup(TOKENS), len(mgr.fetch(TOKENS, PAGES * 4))


async def async_reads(namespace: str | None, shared: str) -> tuple[int, int]:
    """(lookup, pages fetched) of TOKENS by an OffloadManager of ``namespace``."""
    async with kvo.OffloadManager(config(namespace), backend=SimBackend(), storage=shared) as mgr:
        return await mgr.lookup(TOKENS), len(await mgr.fetch(TOKENS, PAGES * 4))


def test_f22_another_namespace_cannot_see_or_fetch_the_pages_sync(shared: str) -> None:
    """Tenant A's pages on a shared store: tenant B's lookup finds nothing (A's prompts
    are not revealed) and B's fetch serves nothing; an unnamespaced manager neither; a
    second manager of A finds and fetches all of them."""
    keys = sync_store("tenant-a", shared)
    assert keys == kvo.chain_keys(kvo.namespace_seed(extra_key="tenant-a"), TOKENS[:20], 4)
    assert sync_reads("tenant-b", shared) == (0, 0)
    assert sync_reads(None, shared) == (0, 0)
    assert sync_reads("tenant-a", shared) == (20, PAGES)


@pytest.mark.asyncio
async def test_f22_another_namespace_cannot_see_or_fetch_the_pages_async(shared: str) -> None:
    """The same through the asyncio driver, both writing and reading."""
    backend = SimBackend()
    async with kvo.OffloadManager(config("tenant-a"), backend=backend, storage=shared) as mgr:
        lc = mgr.admit("r", TOKENS[:8])
        lc.extend(TOKENS[8:])
        lc.finish()
        keys = [k for t in backend.pending for k in t.keys]
        backend.complete_all()
        await mgr.wait_drained()
        assert mgr.statistics().pages_stored == PAGES
        assert (await mgr.lookup(TOKENS), len(await mgr.fetch(TOKENS, 20))) == (20, PAGES)
    assert keys == kvo.chain_keys(kvo.namespace_seed(extra_key="tenant-a"), TOKENS[:20], 4)
    assert await async_reads("tenant-b", shared) == (0, 0)
    assert await async_reads(None, shared) == (0, 0)
    assert await async_reads("tenant-a", shared) == (20, PAGES)


def test_f22_an_unnamespaced_store_is_invisible_to_a_namespace(shared: str) -> None:
    """Pages stored without a namespace (SGLang's unseeded keys) are not served to a
    namespaced manager either."""
    keys = sync_store(None, shared)
    assert keys == kvo.chain_keys(None, TOKENS[:20], 4)
    assert sync_reads("tenant-a", shared) == (0, 0)
    assert sync_reads(None, shared) == (20, PAGES)


def test_an_explicit_chain_seed_overrides_the_namespace(shared: str) -> None:
    """admit(chain_seed=...) seeds that request's chain instead of the namespace (a
    per-request cache_salt); lookup and fetch with the same seed find it, the
    namespace's default seed does not; chain_seed="" is the unseeded chain."""
    seed = kvo.namespace_seed(extra_key="tenant-a", cache_salt="user-7")
    assert seed is not None
    keys = sync_store("tenant-a", shared, chain_seed=seed)
    assert keys == kvo.chain_keys(seed, TOKENS[:20], 4)
    assert sync_reads("tenant-a", shared) == (0, 0)
    with kvo.SyncOffloadManager(config("tenant-a"), backend=SimBackend(), storage=shared) as mgr:
        assert mgr.lookup(TOKENS, chain_seed=seed) == 20
        assert len(mgr.fetch(TOKENS, 20, chain_seed=seed)) == PAGES
        assert mgr.lookup(TOKENS, chain_seed="") == 0
        with pytest.raises(kvo.ConfigError, match="chain_seed must be a hex str"):
            mgr.lookup(TOKENS, chain_seed="not hex")
        with pytest.raises(kvo.ConfigError, match="chain_seed must be a hex str"):
            mgr.admit("r", TOKENS[:8], chain_seed=42)  # type: ignore[arg-type]
        assert mgr.statistics().admitted == 0
