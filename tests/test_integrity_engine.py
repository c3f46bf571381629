"""Integrity, proven on the bytes (issue 10): every stored page equals the KV the engine
wrote, on sim and cpu, engine-owned and owned memory, under both drivers.

The engine here is a seeded random workload: requests arrive with ids from a small pool
(reused while the old request may still finish), prompts that are offloaded whole
(``offload_prompt=True``), decode steps of one token or four, aborts; in engine-owned
mode it allocates pages from its own free list and frees them only in ``on_released``,
so pages are reused across requests. The engine writes each token's KV right after the
call that committed it. The sim backend completes copies in a random order. At the end
every whole page of every completed request is read back from the store and compared.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import torch

import kvoffload as kvo
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend

PAGE = 4
INNER = 3  # elements per token per tensor
TENSORS = 4  # 2 layers x (K, V)
DEVICE_PAGES = 96
REQUESTS = 400


def value(uid: int, pos: int, j: int) -> float:
    return float(uid * 10_000 + pos * 10 + j)


class Engine:
    """One combination's engine; ``steps()`` yields whenever the driver gets a turn."""

    def __init__(self, backend: str, engine_owned: bool, driver: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.engine_owned = engine_owned
        self.kv = [torch.zeros(DEVICE_PAGES, PAGE, INNER) for _ in range(TENSORS)] if engine_owned else None
        config = kvo.OffloadConfig(
            page_size=PAGE,
            stride=2 * PAGE,
            device_pages=None if engine_owned else DEVICE_PAGES,
            host_pages=24,
            kv_shape=(INNER * TENSORS,),
            dtype="float32",
            offload_prompt=True,
            on_host_full="wait",
            host_wait_s=60,
            drain_timeout_s=20,
        )
        self.sim = SimBackend() if backend == "sim" else None
        self.store = MemoryStorage()
        cls = kvo.SyncOffloadManager if driver == "sync" else kvo.OffloadManager
        self.mgr: Any = cls(
            config,
            backend=self.sim if self.sim is not None else backend,
            storage=self.store,
            device_kv=self.kv,
            on_released=self.released,
        )
        self.free = list(range(DEVICE_PAGES))
        self.rng.shuffle(self.free)
        self.tokens: dict[int, list[int]] = {}  # lifecycle id -> tokens committed
        self.uid: dict[int, int] = {}
        self.done: list[kvo.Lifecycle] = []

    def released(self, lc: kvo.Lifecycle) -> None:
        if self.engine_owned:  # the engine frees its pages only now
            self.free.extend(self.pages_of[lc.id])
        self.done.append(lc)

    def write(self, lc: kvo.Lifecycle, first: int) -> None:
        pages = self.pages_of[lc.id] if self.engine_owned else lc.device_pages
        for pos in range(first, len(self.tokens[lc.id])):
            page, slot = pages[pos // PAGE], pos % PAGE
            uid = self.uid[lc.id]
            if self.kv is not None:
                for j, t in enumerate(self.kv):
                    t[page, slot] = value(uid, pos, j)
            else:
                row = torch.tensor([value(uid, pos, j) for j in range(TENSORS) for _ in range(INNER)])
                self.mgr.device_pool.tensor[page, slot] = row

    def new_pages(self, lc: kvo.Lifecycle | None, n_before: int, n_after: int) -> list[int] | None:
        need = -(-n_after // PAGE) - -(-n_before // PAGE)
        if not self.engine_owned:
            return None
        got = [self.free.pop() for _ in range(need)]
        return got

    def steps(self) -> Iterator[None]:
        rng = self.rng
        running: list[tuple[kvo.Lifecycle, int]] = []  # (lifecycle, steps left)
        self.pages_of: dict[int, list[int]] = {}
        uid = 0
        while uid < REQUESTS or running:
            if uid < REQUESTS and len(running) < 6 and (not self.engine_owned or len(self.free) > 24):
                prompt = [rng.randrange(50_000) for _ in range(rng.randrange(0, 14))]
                pages = self.new_pages(None, 0, len(prompt))
                try:
                    lc = self.mgr.admit(f"req-{uid % 4}", prompt, pages=pages)
                except kvo.PoolExhausted:
                    assert pages is None
                else:
                    self.uid[lc.id], self.tokens[lc.id] = uid, list(prompt)
                    self.pages_of[lc.id] = list(pages or [])
                    self.write(lc, 0)  # right after the call, before the driver's turn
                    running.append((lc, rng.randrange(1, 13)))
                    uid += 1
            still = []
            for lc, left in running:
                n = len(self.tokens[lc.id])
                k = rng.choice((1, 1, 4))
                pages = self.new_pages(lc, n, n + k)
                new = [rng.randrange(50_000) for _ in range(k)]
                try:
                    lc.extend(new, pages=pages)
                except kvo.PoolExhausted:
                    lc.abort()
                    continue
                self.tokens[lc.id] += new
                self.pages_of[lc.id] += pages or []
                self.write(lc, n)
                if left <= 1:
                    lc.abort() if rng.random() < 0.1 else lc.finish()
                else:
                    still.append((lc, left - 1))
            running = still
            if self.sim is not None:  # out-of-order completions
                pending = list(self.sim.pending)
                rng.shuffle(pending)
                for t in pending[: rng.randrange(0, len(pending) + 1)]:
                    self.sim.complete(t)
            yield

    def drain_sim(self) -> None:
        if self.sim is not None:
            self.sim.complete_all()


def _run(backend: str, engine_owned: bool, driver: str, seed: int) -> tuple[int, int]:
    """Play one combination; return (pages checked, pages wrong)."""
    e = Engine(backend, engine_owned, driver, seed)
    if driver == "sync":
        with e.mgr:
            for _ in e.steps():
                e.mgr.poll()  # the driver's turn
            while e.mgr.statistics().live_lifecycles:
                e.drain_sim()
                e.mgr.poll()
                e.mgr.wait_progress(0.01)
            while e.mgr.writes_pending:
                e.mgr.wait_progress(0.01)
                e.mgr.poll()
    else:

        async def main() -> None:
            async with e.mgr:
                for _ in e.steps():
                    await asyncio.sleep(0)  # the driver's turn: launch, then delivery
                    await asyncio.sleep(0)
                while e.mgr.statistics().live_lifecycles:
                    e.drain_sim()
                    await asyncio.sleep(0.001)
                await e.mgr.wait_drained()

        asyncio.run(main())
    checked = wrong = 0
    for lc in e.done:
        if lc.outcome is not kvo.Outcome.COMPLETED:
            continue
        tokens = e.tokens[lc.id]
        whole = len(tokens) - len(tokens) % PAGE
        keys = kvo.chain_keys(None, tokens[:whole], PAGE)
        uid = e.uid[lc.id]
        for i, key in enumerate(keys):
            raw = e.store.pages.get(key)
            checked += 1
            if raw is None:
                wrong += 1
                continue
            got = torch.frombuffer(bytearray(raw), dtype=torch.float32)
            if e.engine_owned:  # a page of every tensor, in order
                order = [(s, j) for j in range(TENSORS) for s in range(PAGE)]
            else:  # the owned pool's page: each token's row of all tensors
                order = [(s, j) for s in range(PAGE) for j in range(TENSORS)]
            want = torch.tensor([value(uid, i * PAGE + s, j) for s, j in order for _ in range(INNER)])
            wrong += not torch.equal(got, want)
    e.mgr.check_invariants()
    assert e.mgr.statistics().device_pages_used == 0
    return checked, wrong


def test_every_stored_page_is_the_engines_kv_on_every_backend_mode_and_driver(capsys: Any) -> None:
    """0 wrong pages over at least 10,000 stored, across sim/cpu x owned/engine-owned x
    sync/asyncio (the figures are printed)."""
    total_checked = total_wrong = 0
    rows = []
    for i, (backend, engine_owned, driver) in enumerate(
        (b, m, d) for b in ("sim", "cpu") for m in (False, True) for d in ("sync", "asyncio")
    ):
        checked, wrong = _run(backend, engine_owned, driver, seed=i)
        mode = "engine-owned" if engine_owned else "owned"
        rows.append(f"  {backend:<4} {mode:<13} {driver:<8} {checked:>6} {wrong:>6}")
        total_checked += checked
        total_wrong += wrong
    with capsys.disabled():
        print("\nintegrity: backend mode driver, pages checked, wrong\n" + "\n".join(rows))
        print(f"  total {total_checked} pages checked, {total_wrong} wrong")
    assert total_wrong == 0
    assert total_checked >= 10_000
