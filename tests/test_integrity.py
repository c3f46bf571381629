"""Data integrity end to end on the cpu backend: every page's KV is a known function
of (request, position), and after each completion the host pages hold exactly it.

The engine writes a token's KV before committing it with ``extend`` when its page is
already held, and right after ``extend`` when that token starts a new page (the
manager allocates it there; such a token is never in the chunk that extend submits).
"""

from __future__ import annotations

import random
import threading
from typing import Any

import anyio
import pytest
import torch

import kvoffload as kvo
from kvoffload.abc import Transfer
from kvoffload.backends import CpuBackend

pytestmark = pytest.mark.asyncio

PS = 4
KV = (2, 3)  # elements per token: a page is (PS, 2, 3) float32
E = KV[0] * KV[1]


def kv_of(uid: int, positions: range) -> torch.Tensor:
    """The KV of request ``uid`` at ``positions``: exact small integers in float32."""
    pos = torch.tensor(list(positions), dtype=torch.float32).view(-1, 1)
    return (uid * 100_000 + pos * E + torch.arange(E, dtype=torch.float32)).view(-1, *KV)


class RecordingCpu(CpuBackend):
    """The cpu backend, remembering each transfer; copies can be held with ``gate``."""

    def __init__(self) -> None:
        super().__init__(streams=2)
        self.by_id: dict[int, Transfer] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.holding = threading.Event()
        self.hooks.before = self._before

    def _before(self, t: Transfer) -> None:
        if not self.gate.is_set():
            self.holding.set()
            self.gate.wait()

    def submit(self, transfer: Transfer) -> None:
        super().submit(transfer)
        self.by_id[transfer.id] = transfer


class Engine:
    """A decode engine over one manager: writes KV into device pages, commits tokens,
    and checks each completed chunk's host pages against the KV function."""

    def __init__(self, mgr: kvo.OffloadManager, backend: RecordingCpu) -> None:
        self.mgr, self.backend = mgr, backend
        self.uid: dict[int, int] = {}  # lifecycle id -> request uid (its KV seed)
        self.next_uid = 1
        self.checked = 0
        mgr.add_listener(self._on_event)

    def _write(self, lc: kvo.Lifecycle, positions: range) -> None:
        dev = self.mgr.device_pool.tensor
        kv = kv_of(self.uid[lc.id], positions)
        for k, p in enumerate(positions):
            dev[lc.device_pages[p // PS], p % PS] = kv[k]

    def admit(self, rid: Any, n_prompt: int) -> kvo.Lifecycle:
        lc = self.mgr.admit(rid, prompt=list(range(n_prompt)))
        self.uid[lc.id] = self.next_uid
        self.next_uid += 1
        self._write(lc, range(n_prompt))
        return lc

    def decode(self, lc: kvo.Lifecycle) -> None:
        """One token: KV written before it is committed, unless its page is new."""
        p = lc.committed
        if p % PS:
            self._write(lc, range(p, p + 1))
            lc.extend([p % 7])
        else:
            lc.extend([p % 7])
            self._write(lc, range(p, p + 1))

    def _on_event(self, name: str, fields: dict[str, Any]) -> None:
        if name != "transfer.completed":
            return
        t = self.backend.by_id[fields["transfer"]]
        want = kv_of(self.uid[fields["lifecycle"]], range(t.first_token, t.first_token + t.n_tokens))
        got = self.mgr.host_pool.tensor[t.host_pages].reshape(-1, *KV)
        assert torch.equal(got, want), f"{t!r}: host pages do not hold the request's KV"
        self.checked += 1


async def test_random_decode_workload_host_pages_hold_exactly_the_kv() -> None:
    """Twelve requests (several reusing ids) decode, finish and abort in a random
    interleaving on two copy streams; every copied chunk's host pages hold exactly
    that request's KV at those positions, and the ledger balances."""
    rnd = random.Random(4)
    config = kvo.OffloadConfig(
        page_size=PS, stride=8, device_pages=256, host_pages=64, kv_shape=KV, dtype="float32"
    )
    backend = RecordingCpu()
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        eng = Engine(mgr, backend)
        live = [eng.admit(f"r{i % 4}", rnd.randrange(1, 9)) for i in range(6)]
        admitted = 6
        with anyio.fail_after(30):
            while live:
                lc = rnd.choice(live)
                r = rnd.random()
                if r < 0.04 or lc.committed > 60:
                    (lc.abort if r < 0.01 else lc.finish)()
                    live.remove(lc)
                    if admitted < 12:
                        live.append(eng.admit(f"r{admitted % 4}", rnd.randrange(1, 9)))
                        admitted += 1
                else:
                    eng.decode(lc)
                if rnd.random() < 0.2:
                    await anyio.sleep(0)  # let completions in
                mgr.check_invariants()
            await mgr.wait_drained()
        s = mgr.statistics()
        assert s.live_lifecycles == 0 and s.device_pages_used == 0 and s.host_pages_used == 0
        assert eng.checked == s.chunks_copied > 20
        mgr.check_invariants()


async def test_reused_pages_never_leak_into_an_old_chunk_in_flight() -> None:
    """The rid-reuse case: A's chunk is held in flight while A finishes. B (same rid)
    takes every free device page, writes its KV, is aborted and released; F (same rid
    again) gets B's freed pages and writes its own KV - all while A's copy is in flight.
    A's pages are never handed out before A is released, and A's host pages get exactly
    A's KV. C, admitted after A's release, reuses A's pages and its chunk gets C's KV."""
    config = kvo.OffloadConfig(
        page_size=PS, stride=8, device_pages=8, host_pages=8, kv_shape=KV, dtype="float32"
    )
    backend = RecordingCpu()
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        eng = Engine(mgr, backend)
        backend.gate.clear()
        a = eng.admit("r", 4)
        for _ in range(9):
            eng.decode(a)  # tokens 4..12: one chunk (positions 4..11) goes out
        assert a.inflight == 1
        a.finish()
        a_pages = set(a.device_pages)
        with anyio.fail_after(20):
            while not backend.holding.is_set():
                await anyio.sleep(0.001)
        b = eng.admit("r", PS * mgr.device_pool.free_pages)
        b_pages = set(b.device_pages)
        assert not b_pages & a_pages
        with pytest.raises(kvo.PoolExhausted):
            eng.admit("d", 1)
        b.abort()
        await b.wait_released()
        f = eng.admit("r", PS * len(b_pages))  # B's pages, rewritten with F's KV
        assert set(f.device_pages) == b_pages
        f.abort()
        await f.wait_released()
        assert a.state is kvo.LifecycleState.FINISHING and eng.checked == 0
        backend.gate.set()
        await a.wait_released()
        assert a.outcome is kvo.Outcome.COMPLETED and eng.checked == 1  # A's bytes, checked
        c = eng.admit("r", 4)
        for _ in range(9):
            eng.decode(c)
        assert set(c.device_pages) == a_pages  # freed last, reused first
        c.finish()
        await c.wait_released()
        assert eng.checked == 2  # C's chunk: C's bytes
        mgr.check_invariants()
