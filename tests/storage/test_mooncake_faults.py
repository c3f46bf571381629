"""Faults of the Mooncake Store tier, with a real ``mooncake_master`` (and memory server)
per test: the master killed and restarted mid-run, a full segment, a read lease still live
on a key being replaced; and pages shared by two managers in two processes.

Each test bounds its waits (``HANG_S``); none depends on how fast the machine runs. They
skip with the reason without the ``kvoffload[mooncake]`` wheel, or fail under
``KVOFFLOAD_REQUIRE_MOONCAKE=1`` (CI), through the ``own_mooncake`` / ``mooncake_url``
fixtures in conftest.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import anyio
import pytest
from _mooncake_server import MooncakeServer
from _storage_helpers import device_bytes, fill_pages, keys_of, mooncake_store, pages_of
from support import HANG_S
from test_storage_faults import POLICY, outage_scenario

import kvoffload as kvo
from kvoffload.errors import PartialWriteError, StorageError
from kvoffload.testing import SimBackend, manager_in_task

pytestmark = pytest.mark.asyncio

WORKER = Path(__file__).with_name("_share_worker.py")


def capacity(server: MooncakeServer) -> int:
    """The bytes of memory the master knows mounted (its metrics, on 127.0.0.1)."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("master_total_capacity_bytes "):
            return int(float(line.split()[1]))
    return 0


def restart_master(server: MooncakeServer) -> None:
    """Start the master again on its port and wait (bounded) until the memory server has
    mounted its segment on it again: then a write can succeed."""
    server.start_master()
    deadline = time.monotonic() + HANG_S * 2
    while capacity(server) == 0:
        assert time.monotonic() < deadline, "the memory server never mounted on the restarted master"
        time.sleep(0.1)  # polling a condition, bounded above


async def test_master_killed_and_restarted_mid_run(own_mooncake: MooncakeServer) -> None:
    """The master is SIGKILLed while requests decode and copies are in flight: the writes
    fail and are counted, every lifecycle is released and every host page returns, the
    manager runs on. After a restart (empty metadata) new writes are stored and read back,
    and the pages acknowledged before the kill read as missing, never as other bytes."""
    from kvoffload.pools import page_views

    store = mooncake_store(own_mooncake.url, timeout_s=2)
    before: dict[str, bytes] = {}  # what the store acknowledged before the kill
    real_put = store.put_pages

    async def put_pages(keys: list[str], pool: object, pages: list[int]) -> None:
        await real_put(keys, pool, pages)  # type: ignore[arg-type]
        if own_mooncake.master is not None and not after_restart:
            before.update(zip(keys, (bytes(v) for v in page_views(pool, pages)), strict=True))  # type: ignore[arg-type]

    def restart() -> None:
        nonlocal after_restart
        after_restart = True
        restart_master(own_mooncake)

    after_restart = False
    store.put_pages = put_pages  # type: ignore[method-assign]
    try:
        await outage_scenario(store, own_mooncake.kill_master, restart)
        assert len(before) == 8
        reader = mooncake_store(own_mooncake.url, prefix=store.prefix)  # the manager closed its store
        try:
            got = await reader.get(list(before))
            bufs = [memoryview(bytearray(len(p))) for p in before.values()]
            assert await reader.get_into(list(before), bufs) == 0
        finally:
            await reader.aclose()
        assert all(g is None or g == before[k] for k, g in zip(before, got, strict=True))
        assert got == [None] * len(before)  # a restarted master knows none of them
    finally:
        await store.aclose()


async def test_a_full_segment_refuses_puts_as_counted_drops(tmp_path: Path) -> None:
    """The pool has 16 MiB and the run writes far more, with reads holding no page: puts
    are refused (Mooncake's NO_AVAILABLE_HANDLE, as a StorageError or a
    PartialWriteError), counted as failed pages, never a hang; every lifecycle is
    released, every host page returns, and every page the store acknowledged and still
    holds reads back as written."""
    from _mooncake_server import MOONCAKE_BIN, MOONCAKE_MISSING

    if MOONCAKE_BIN is None:
        from _mooncake_server import mooncake_unavailable

        mooncake_unavailable(MOONCAKE_MISSING)
    server = MooncakeServer(tmp_path / "mc", memory_mb=16)
    server.start()
    store = mooncake_store(server.url)
    cfg = kvo.OffloadConfig(
        page_size=4,
        stride=16,
        device_pages=64,
        host_pages=32,
        kv_shape=(1 << 16,),  # 4 tokens x 64 Ki floats: 1 MiB a page
        dtype="float32",
        offload_prompt=True,
        drain_timeout_s=HANG_S,
    )
    errors: list[BaseException] = []
    real_put = store.put_pages

    async def put_pages(*args: object) -> None:
        try:
            await real_put(*args)  # type: ignore[arg-type]
        except StorageError as exc:
            errors.append(exc)
            raise

    store.put_pages = put_pages  # type: ignore[method-assign]
    try:
        backend = SimBackend()
        async with manager_in_task(cfg, backend=backend, storage=store, write_policy=POLICY) as mgr:
            copied: dict[str, bytes] = {}
            for r in range(8):  # 8 requests x 4 pages x 1 MiB = 32 MiB into 16 MiB
                lc = mgr.admit(f"r{r}", [r * 1000 + i for i in range(16)])
                lc.finish()
                for t in backend.pending:
                    fill_pages(mgr, t.device_pages, seed=t.id)
                    copied.update(zip(t.keys, device_bytes(mgr, t.device_pages), strict=True))
                backend.complete_all()
                with anyio.fail_after(HANG_S):
                    await lc.wait_released()
                    await mgr.settle()
            s = mgr.statistics()
            assert s.live_lifecycles == 0 and s.host_pages_used == 0 and s.pages_in_write == 0
            # Mooncake may refuse a chunk's first page and take a later one: that page
            # is in the store but unreachable (F34), so it is in the ledger's sum too.
            accounted = (
                s.pages_stored
                + s.pages_store_failed
                + s.pages_store_unreachable
                + s.pages_store_skipped
                + s.pages_not_stored
            )
            assert accounted == s.pages_copied == 32
            assert s.pages_store_failed > 0 and s.pages_stored > 0
            mgr.check_invariants()
        assert errors and all("NO_AVAILABLE_HANDLE" in str(e) for e in errors)
        assert all(isinstance(e, StorageError) for e in errors)
        assert any(isinstance(e, PartialWriteError) or "no page" in str(e) for e in errors)
        keys = list(copied)
        reader = mooncake_store(server.url, prefix=store.prefix)  # the manager closed its store
        try:
            got = await reader.get(keys)
        finally:
            await reader.aclose()
        held = [(k, g) for k, g in zip(keys, got, strict=True) if g is not None]
        assert held and all(g == copied[k] for k, g in held)
    finally:
        await store.aclose()
        server.stop()


async def test_a_lease_still_live_on_a_key_being_replaced(mooncake_url: str) -> None:
    """A read takes a lease on its object (200 ms on the test master; 10 s by default),
    during which Mooncake refuses to remove it (OBJECT_HAS_LEASE). Writing that key
    again while the lease lives neither fails nor hangs: the key is replaced in place of
    a removal, and a read sees one whole page, the new one."""
    store = mooncake_store(mooncake_url)
    other = mooncake_store(mooncake_url, prefix=getattr(store, "prefix", ""))
    try:
        keys = keys_of(2)
        await store.put(keys, pages_of(2, salt=1))
        assert await other.get(keys) == pages_of(2, salt=1)  # the lease is live from here
        raw = store._client  # type: ignore[attr-defined]
        assert raw.remove(store.prefix + keys[0]) == -706  # type: ignore[attr-defined]
        with anyio.fail_after(HANG_S):
            await store.put(keys, pages_of(2, salt=2))
        assert await other.get(keys) == pages_of(2, salt=2)
        bufs = [memoryview(bytearray(len(p))) for p in pages_of(2)]
        assert await other.get_into(keys, bufs) == 2
        assert [bytes(b) for b in bufs] == pages_of(2, salt=2)
    finally:
        await store.aclose()
        await other.aclose()


async def test_two_managers_in_two_processes_share_pages(mooncake_url: str) -> None:
    """Worker A (a child process, its own manager and client, lending no memory) offloads
    a request and exits; this process's manager finds the token sequence and fetches the
    same bytes from the memory server. A store under another prefix finds nothing."""
    prefix = f"share-{time.monotonic_ns()}:"
    out = subprocess.run(
        [sys.executable, str(WORKER), mooncake_url, prefix], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    a = json.loads(out.stdout.strip().splitlines()[-1])
    tokens: list[int] = a["tokens"]
    pages = [bytes.fromhex(h) for h in a["pages"]]
    assert a["stored"] == len(pages) == 5

    config = kvo.OffloadConfig(page_size=4, stride=8, device_pages=32, host_pages=32, offload_prompt=True)
    store = mooncake_store(mooncake_url, prefix=prefix)
    async with manager_in_task(config, backend=SimBackend(), storage=store) as b:
        assert await b.lookup(tokens) == 20
        assert await b.lookup([*tokens[:12], 0, 0, 0, 0]) == 12
        assert await b.fetch(tokens, 20) == pages
    other = mooncake_store(mooncake_url)
    try:
        assert await other.exists_prefix(kvo.chain_keys(None, tokens[:20], 4)) == 0
    finally:
        await other.aclose()


async def test_a_dead_master_fails_reads_and_lookups_with_storage_errors(
    own_mooncake: MooncakeServer,
) -> None:
    """With the master gone, lookups and reads raise StorageError (a load counts them as
    misses) within their bounds; nothing hangs."""
    store = mooncake_store(own_mooncake.url, timeout_s=2)
    try:
        await store.put(keys_of(2), pages_of(2))
        own_mooncake.kill_master()
        with anyio.fail_after(HANG_S):
            with pytest.raises(StorageError, match="RPC"):
                await store.exists_prefix(keys_of(2))
            with pytest.raises(StorageError, match="RPC"):
                await store.get_into(keys_of(2), [memoryview(bytearray(64)) for _ in range(2)])
            with pytest.raises(StorageError):
                await store.put(keys_of(1, salt=4), pages_of(1))
    finally:
        with anyio.fail_after(HANG_S):
            await store.aclose()
