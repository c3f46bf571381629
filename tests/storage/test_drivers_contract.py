"""Every backend and every storage tier under both drivers: one engine-shaped scenario.

Per (driver, backend, storage): requests with one-token and multi-token steps, the
prompt offloaded (a chunk whose pages the same call handed out, F19), an id reused
while the old request finishes, an abort mid-copy. The engine writes each token's KV
right after the call that committed it, as ``docs/integration.md`` says it may. Then:
every lifecycle released once (``on_released``), every page back, the ledger balanced,
and - with a store - every stored page equal to the engine's KV, read back with
``fetch`` under the request's keys, and ``lookup`` finding exactly the stored prefix.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import kvoffload as kvo
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import ManagerHost, SimBackend, SyncManagerHost

PAGE = 4
CONFIG = kvo.OffloadConfig(
    page_size=PAGE,
    stride=2 * PAGE,
    device_pages=64,
    host_pages=16,
    kv_shape=(2,),
    dtype="float32",
    offload_prompt=True,
    drain_timeout_s=10,
)


def kv(uid: int, pos: int) -> list[float]:
    """The KV the engine writes for token ``pos`` of request ``uid``."""
    return [float(uid * 1000 + pos), float(-uid)]


def _storage(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    if kind == "none":
        return None
    if kind == "memory":
        return MemoryStorage()
    if kind == "file":
        return str(tmp_path / "store")
    url: str = request.getfixturevalue("clean_redis")
    return url


@pytest.mark.parametrize("storage_kind", ["none", "memory", "file", "redis"])
@pytest.mark.parametrize("backend_name", ["sim", "cpu"])
@pytest.mark.parametrize("driver", ["asyncio", "sync"])
def test_engine_scenario_under_every_driver_backend_and_store(
    driver: str, backend_name: str, storage_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    backend: Any = SimBackend() if backend_name == "sim" else backend_name
    storage = _storage(storage_kind, tmp_path, request)
    released: list[kvo.Lifecycle] = []
    cls = kvo.SyncOffloadManager if driver == "sync" else kvo.OffloadManager
    mgr: Any = cls(CONFIG, backend=backend, storage=storage, on_released=released.append)
    host: Any = SyncManagerHost(mgr) if driver == "sync" else ManagerHost(mgr)
    sim = mgr.backend if isinstance(mgr.backend, SimBackend) else None
    tokens: dict[int, list[int]] = {}
    uids: dict[int, int] = {}  # lifecycle id -> request uid

    def write(lc: kvo.Lifecycle, first: int) -> None:
        toks = tokens[lc.id]
        pool = mgr.device_pool.tensor
        for pos in range(first, len(toks)):
            pool[lc.device_pages[pos // PAGE], pos % PAGE] = torch.tensor(kv(uids[lc.id], pos))

    def admit(uid: int, rid: str, n: int) -> kvo.Lifecycle:
        prompt = [uid * 100 + i for i in range(n)]
        lc: kvo.Lifecycle = mgr.admit(rid, prompt)
        tokens[lc.id], uids[lc.id] = list(prompt), uid
        write(lc, 0)  # right after the call that handed the pages out
        return lc

    def extend(lc: kvo.Lifecycle, n: int) -> None:
        first = len(tokens[lc.id])
        new = [uids[lc.id] * 100 + first + i for i in range(n)]
        lc.extend(new)
        tokens[lc.id] += new
        write(lc, first)

    def settle(cond: Any) -> None:
        deadline = time.monotonic() + 20
        while not host.call(cond):
            assert time.monotonic() < deadline, f"hung: {mgr!r}"
            if sim is not None:
                host.call(sim.complete_all)
            time.sleep(0.001)

    try:
        a = host.call(lambda: admit(0, "r0", 9))  # the prompt's 2 pages go out at once
        for _ in range(6):
            host.call(lambda: extend(a, 1))
        host.call(lambda: extend(a, 7))  # speculative decoding: several tokens, new pages
        host.call(a.finish)
        b = host.call(lambda: admit(1, "r0", 5))  # reuses r0 while a may still finish
        c = host.call(lambda: admit(2, "r2", 3))
        host.call(lambda: extend(c, 8))
        host.call(c.abort)  # mid-copy
        for _ in range(3):
            host.call(lambda: extend(b, 3))
        host.call(b.finish)
        settle(lambda: a.released and b.released and c.released)
        if storage is not None:
            settle(lambda: mgr.statistics().pages_in_write == 0)
        assert sorted(lc.id for lc in released) == sorted([a.id, b.id, c.id])
        assert (a.outcome, b.outcome, c.outcome) == (
            kvo.Outcome.COMPLETED,
            kvo.Outcome.COMPLETED,
            kvo.Outcome.ABORTED,
        )
        s = host.call(mgr.statistics)
        assert (s.live_lifecycles, s.device_pages_used, s.host_pages_used) == (0, 0, 0)
        host.call(mgr.check_invariants)
        if storage is None:
            return
        assert s.pages_stored == s.pages_copied and s.pages_stored > 0
        for lc in (a, b):
            toks = tokens[lc.id]
            n = len(toks) - len(toks) % PAGE
            if driver == "sync":
                pages = mgr.fetch(toks, n)
                found = mgr.lookup(toks)
            else:
                pages = host.run(lambda toks=toks, n=n: mgr.fetch(toks, n))
                found = host.run(lambda toks=toks: mgr.lookup(toks))
            assert found == n and len(pages) == n // PAGE
            for i, raw in enumerate(pages):
                got = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(PAGE, 2)
                want = torch.tensor([kv(uids[lc.id], i * PAGE + k) for k in range(PAGE)])
                assert torch.equal(got, want), f"{lc!r} page {i}: {got} != {want}"
    finally:
        host.close()
