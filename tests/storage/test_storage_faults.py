"""Faults (FAILURES F15): the storage tier goes away in the middle of a run, then comes
back. Decoding goes on, every lifecycle is released, every host page returns, the
failures are counted; after the tier is back new writes succeed; and no page that was
acknowledged as stored is lost or read back different."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from _redis_server import RedisServer
from _storage_helpers import device_bytes, fill_pages
from support import HANG_S

import kvoffload as kvo
from kvoffload.abc import Storage
from kvoffload.storage import WritePolicy
from kvoffload.storage.file import FileStorage
from kvoffload.storage.redis import RedisStorage
from kvoffload.testing import SimBackend, manager_in_task

pytestmark = pytest.mark.asyncio

CONFIG = kvo.OffloadConfig(
    page_size=4, stride=8, device_pages=128, host_pages=16, offload_prompt=True, drain_timeout_s=10
)
POLICY = WritePolicy(attempts=2, backoff_s=0)


class Run:
    """Drives requests through a manager and remembers what the store acknowledged."""

    def __init__(self, mgr: kvo.OffloadManager, backend: SimBackend) -> None:
        self.mgr = mgr
        self.backend = backend
        self.copied: dict[int, tuple[list[str], list[bytes]]] = {}
        # acked: page key -> bytes, for every chunk the writer reported stored.
        self.acked: dict[str, bytes] = {}
        self.seed = 0
        mgr.add_listener(self._on_event)

    def _on_event(self, name: str, fields: dict[str, Any]) -> None:
        if name == "storage.written":
            keys, pages = self.copied[fields["transfer"]]
            self.acked.update(zip(keys, pages, strict=True))

    def admit(self, rid: str) -> kvo.Lifecycle:
        self.seed += 1
        return self.mgr.admit(rid, [self.seed * 100 + i for i in range(8)])

    def extend(self, lc: kvo.Lifecycle) -> None:
        lc.extend([self.seed * 100 + lc.committed + i for i in range(8)])

    async def complete_all(self) -> None:
        """Complete every pending copy with distinct device bytes; wait for the writes."""
        for t in self.backend.pending:
            fill_pages(self.mgr, t.device_pages, seed=t.id)
            self.copied[t.id] = (t.keys, device_bytes(self.mgr, t.device_pages))
        self.backend.complete_all()
        await self.mgr.settle()


async def outage_scenario(
    store: Storage, break_store: Callable[[], None], restore_store: Callable[[], None]
) -> None:
    """Healthy, then broken mid-run (requests live, copies in flight), then restored."""
    backend = SimBackend()
    async with manager_in_task(CONFIG, backend=backend, storage=store, write_policy=POLICY) as mgr:
        run = Run(mgr, backend)
        live = [run.admit(f"r{i}") for i in range(4)]  # each submits its prompt (2 pages)
        await run.complete_all()
        s = mgr.statistics()
        assert s.pages_stored == 8 and s.pages_store_failed == 0
        acked_before = dict(run.acked)
        assert await store.get(list(acked_before)) == list(acked_before.values())

        break_store()  # mid-run: four requests decoding
        for lc in live:
            run.extend(lc)  # decoding goes on: chunks are submitted while the tier is down
        assert mgr.statistics().chunks_inflight == 4
        live[0].abort()  # one request aborted with its copy in flight
        live[1].finish()  # one finished with its copy in flight
        await run.complete_all()
        for lc in live[2:]:
            run.extend(lc)
            lc.finish()
        await run.complete_all()
        with anyio.fail_after(HANG_S):
            for lc in live:
                await lc.wait_released()
        s = mgr.statistics()
        assert s.live_lifecycles == 0 and s.host_pages_used == 0 and s.pages_in_write == 0
        assert s.pages_store_failed == s.pages_copied - 8 > 0
        assert s.pages_stored == 8
        assert [lc.outcome for lc in live] == [kvo.Outcome.ABORTED] + [kvo.Outcome.COMPLETED] * 3
        mgr.check_invariants()

        restore_store()
        lc = run.admit("after")
        run.extend(lc)
        lc.finish()
        await run.complete_all()
        await lc.wait_released()
        s = mgr.statistics()
        assert s.pages_stored == 8 + 4 and s.host_pages_used == 0
        mgr.check_invariants()
        after = {k: v for k, v in run.acked.items() if k not in acked_before}
        assert len(after) == 4
        assert await store.get(list(after)) == list(after.values())
        acked = run.acked
    if isinstance(store, FileStorage):  # the file store keeps everything it acknowledged
        reopened = FileStorage(store.root)
        assert await reopened.get(list(acked)) == list(acked.values())


async def test_file_store_directory_replaced_mid_run(tmp_path: Path) -> None:
    """The file store's directory stops taking writes in the middle of a run.

    Tests run as root, where a read-only chmod does not stop writes, so the failure is
    made real another way: the root directory is moved aside and a regular file put in
    its place (every write then fails with ENOTDIR); restoring moves it back.
    """
    store = FileStorage(tmp_path / "pages")
    aside = tmp_path / "aside"

    def break_store() -> None:
        store.root.rename(aside)
        store.root.write_bytes(b"a regular file where the directory was")

    def restore_store() -> None:
        store.root.unlink()
        aside.rename(store.root)

    await outage_scenario(store, break_store, restore_store)
    assert not list(store.root.rglob("*.tmp"))


async def test_redis_stopped_mid_run(own_redis: RedisServer) -> None:
    """The test's own redis-server is stopped in the middle of a run and started again
    on the same port (it has no persistence, so the restarted server is empty: the
    pages acknowledged before the stop are checked before it, the later ones after)."""
    store = RedisStorage(own_redis.url, timeout_s=2)
    await outage_scenario(store, own_redis.stop, own_redis.start)


async def test_file_store_root_deleted_mid_run_is_recreated(tmp_path: Path) -> None:
    """A root removed while running (e.g. a cache cleaner) is created again by the next
    write; nothing fails."""
    store = FileStorage(tmp_path / "pages")
    backend = SimBackend()
    async with manager_in_task(CONFIG, backend=backend, storage=store, write_policy=POLICY) as mgr:
        run = Run(mgr, backend)
        run.admit("a")
        await run.complete_all()
        shutil.rmtree(store.root)
        run.admit("b")
        await run.complete_all()
        s = mgr.statistics()
        assert (s.pages_stored, s.pages_store_failed) == (4, 0)
        latest = list(run.acked)[-2:]
        assert await store.get(latest) == [run.acked[k] for k in latest]
