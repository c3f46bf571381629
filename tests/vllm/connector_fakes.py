"""Plain-data stand-ins for the connector's unit tests (no vLLM needed).

- :class:`FakeRequest`: the attributes of vLLM's ``Request`` the planner reads
  (``tests/vllm/test_connector_vllm.py`` checks them against the real class).
- :class:`Rig`: a tiny engine loop around a :class:`Planner` and one :class:`Mover` per
  rank, on CPU tensors laid out as vLLM's CPU attention lays them out
  (``(num_blocks, kv_heads, block_size, 2 * head_size)`` per layer), in the order of a
  vLLM step: schedule (blocks allocated), ``build_connector_meta``, then on each rank
  ``handle_preemptions``, ``start_load_kv``, the forward (writes the KV of the
  scheduled tokens), ``wait_for_save``, ``get_finished``, load errors and the worker
  report, then ``update_connector_output`` with the ranks' reports merged.

The KV a "forward" writes for the token at position ``p`` is a function of the tokens
``0..p`` and the rank and layer only (:func:`kv_value`), so equal prefixes have equal
KV, and a test can check that a block holds exactly what computing it would write.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from kvoffload.abc import Storage
from kvoffload.integrations.vllm_plan import Planner, RankReport, StepPlan
from kvoffload.integrations.vllm_worker import Mover, block_tensors, rank_stores

BS = 4  # tokens per block
HEADS, HEAD = 2, 4
LAYERS = 2


class Forwarding(Storage):
    """A store that passes every call to ``inner`` (a test overrides what it watches)."""

    name = "forwarding"

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
        await self.inner.put(keys, pages)

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self.inner.get(keys)

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        return await self.inner.exists_prefix(keys)

    async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
        return await self.inner.get_into(keys, dest)

    async def get_into_parts(self, keys: Sequence[str], dest: Sequence[Sequence[memoryview]]) -> int:
        return await self.inner.get_into_parts(keys, dest)


class HeldReads(Forwarding):
    """A store whose reads (on the writer's loop) wait until ``go`` is set, then really
    read (``reading`` is set once one waits): a load held in flight, or one that
    outlives the worker's ``io_timeout_s``."""

    name = "held"

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.go = threading.Event()
        self.reading = threading.Event()

    async def _hold(self) -> None:
        self.reading.set()
        await asyncio.to_thread(self.go.wait, 30)

    async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
        await self._hold()
        return await self.inner.get_into(keys, dest)

    async def get_into_parts(self, keys: Sequence[str], dest: Sequence[Sequence[memoryview]]) -> int:
        await self._hold()
        return await self.inner.get_into_parts(keys, dest)


def fill_store(
    mover: Mover, store: Storage, keys: list[str], seed: int, skip: int | None = None
) -> list[bytes]:
    """Put one random page (``mover``'s page size, seeded) under each of ``keys`` through
    ``mover``'s writer loop, all but the one at ``skip``; returns every page's bytes."""
    g = torch.Generator().manual_seed(seed)
    pages = [
        torch.randint(0, 256, (mover.device.page_bytes,), generator=g, dtype=torch.uint8).numpy().tobytes()
        for _ in keys
    ]
    assert mover.writer is not None
    kept = [(k, p) for i, (k, p) in enumerate(zip(keys, pages, strict=True)) if i != skip]
    mover.writer.call(store.put([k for k, _ in kept], [p for _, p in kept]), 30)
    return pages


class FakeRequest:
    """vLLM ``Request``'s attributes the connector reads, nothing else."""

    def __init__(
        self,
        request_id: str,
        prompt: Iterable[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.kv_transfer_params = kv_transfer_params
        self._tokens = list(prompt)
        self.num_prompt_tokens = len(self._tokens)
        self.num_computed_tokens = 0
        self.lora_request = SimpleNamespace(lora_name=lora_name, lora_int_id=1) if lora_name else None
        self.cache_salt = cache_salt
        self.mm_features: list[Any] = [object()] if mm else []
        self.prompt_embeds = None
        self.status = "WAITING"

    @property
    def all_token_ids(self) -> list[int]:
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def append(self, token: int) -> None:
        self._tokens.append(token)


def kv_value(tokens: list[int], p: int, rank: int, layer: int) -> float:
    """The KV value a forward writes for position ``p`` (a function of tokens[:p+1])."""
    h = hashlib.sha256(repr((tokens[: p + 1], rank, layer)).encode()).digest()
    return float(int.from_bytes(h[:3], "little"))


class Rig:
    """A tiny engine around the connector's two sides (see the module doc)."""

    def __init__(
        self,
        store: Storage,
        *,
        num_blocks: int = 32,
        host_pages: int = 16,
        world_size: int = 1,
        stride: int | None = None,
        namespace: str | None = None,
        inline_loads: bool = False,
        sync_loads: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.store = store
        stores = rank_stores(store, world_size)
        self.kv: list[list[torch.Tensor]] = []
        self.movers: list[Mover] = []
        for r in range(world_size):
            layers = [torch.zeros(num_blocks, HEADS, BS, 2 * HEAD) for _ in range(LAYERS)]
            self.kv.append(layers)
            tensors = [t for i, kv in enumerate(layers) for t in block_tensors(kv, num_blocks, BS, f"l{i}")]
            mover = Mover(
                tensors,
                block_size=BS,
                host_pages=host_pages,
                storage=stores[r],
                inline_loads=inline_loads,
            )
            self.movers.append(mover)
        self.lookups: list[list[str]] = []
        self.planner = Planner(
            block_size=BS,
            num_blocks=num_blocks,
            host_pages=host_pages,
            lookup=self._lookup,
            world_size=world_size,
            stride=stride,
            namespace=namespace,
            sync_loads=sync_loads,
        )
        self.sync_loads = sync_loads
        self.free = list(range(num_blocks - 1, -1, -1))
        self.blocks: dict[str, list[int]] = {}
        self.running: dict[str, FakeRequest] = {}
        self.waiting_kv: dict[str, FakeRequest] = {}  # loads in flight
        self.held: set[str] = set()  # finished, blocks held for the connector
        self.plans: list[StepPlan] = []
        self.sent: list[str] = []
        self.recvd: list[str] = []
        self.load_errors: set[int] = set()
        self._counts: dict[tuple[str, str], int] = {}
        self._preempted: set[str] = set()

    # --- the store lookup, bounded as the connector's is ------------------------------

    def _lookup(self, keys: list[str]) -> int:
        import asyncio

        self.lookups.append(keys)
        stores = rank_stores(self.store, len(self.movers))

        async def count() -> int:
            return min([await s.exists_prefix(keys) for s in stores])

        return asyncio.run(count())

    # --- requests -------------------------------------------------------------------

    def _alloc(self, rid: str, upto: int) -> None:
        have = self.blocks.setdefault(rid, [])
        while len(have) * BS < upto:
            have.append(self.free.pop())

    def add(self, req: FakeRequest, *, load: bool = True) -> int:
        """Admit ``req``; returns the tokens the connector will load (0: none). A
        synchronous load (``sync_loads``) is vLLM's: the request runs at once, its
        loaded tokens counted computed, and the next step loads and computes the rest."""
        self.planner.add(req)
        n = self.planner.matched(req, 0) if load else 0
        if n and self.sync_loads:
            self._alloc(req.request_id, n)
            self.planner.start_load(req, self.blocks[req.request_id], n)
            req.num_computed_tokens = n
            req.status = "RUNNING"
            self.running[req.request_id] = req
        elif n:
            self._alloc(req.request_id, n)
            self.planner.start_load(req, self.blocks[req.request_id], n)
            req.num_computed_tokens = n
            req.status = "WAITING_FOR_REMOTE_KVS"
            self.waiting_kv[req.request_id] = req
        else:
            req.status = "RUNNING"
            self.running[req.request_id] = req
        return n

    def finish(self, rid: str, *, aborted: bool = False) -> bool:
        """``request_finished``; frees the blocks unless the connector holds them."""
        req = self.running.pop(rid, None) or self.waiting_kv.pop(rid)
        loading = req.status == "WAITING_FOR_REMOTE_KVS"
        req.status = "FINISHED_ABORTED" if aborted else "FINISHED_STOPPED"
        delay = self.planner.finished(req, aborted)
        if delay or loading:
            self.held.add(rid)
        else:
            self._free(rid)
        return delay

    def _free(self, rid: str) -> None:
        self.free += reversed(self.blocks.pop(rid, []))

    def preempt(self, rid: str) -> None:
        req = self.running.pop(rid)
        req.num_computed_tokens = 0
        req.status = "PREEMPTED"
        self._free(rid)
        self._preempted.add(rid)

    # --- one engine step ---------------------------------------------------------------

    def step(self, decode: dict[str, int] | None = None, sample: bool = True) -> StepPlan:
        """One step: every running request is scheduled (its uncomputed tokens, or one);
        decoding requests get the next token from ``decode`` (or a default)."""
        scheduled: dict[str, int] = {}
        for rid, req in self.running.items():
            n = req.num_tokens - req.num_computed_tokens
            if n <= 0:
                continue
            self._alloc(rid, req.num_computed_tokens + n)
            scheduled[rid] = n
        preempted, self._preempted = self._preempted, set()
        plan = self.planner.step(scheduled.items(), lambda rid: self.blocks[rid], preempted)
        self.plans.append(plan)
        merged = RankReport()
        errors: set[int] = set()  # this step's load errors, every rank's
        for r, mover in enumerate(self.movers):
            mover.fence(plan)
            mover.start(plan)
            for rid, n in scheduled.items():  # the forward
                req = self.running[rid]
                toks = req.all_token_ids
                for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                    b = self.blocks[rid][p // BS]
                    for layer, kv in enumerate(self.kv[r]):
                        kv[b, :, p % BS, :] = kv_value(toks, p, r, layer)
            mover.save(plan)
            sending, recving = mover.finished(plan)
            errors |= mover.take_load_errors()
            report = mover.take_report()
            if report is not None:
                merged = merged.merge(report)
            self.load_errors |= errors
            self._tally(sending, recving, r)
        # vLLM's _update_requests_with_invalid_blocks over its running requests (the
        # synchronous loads): a request whose computed blocks hold a load error goes
        # back to its first bad block, and this step's output of it is dropped.
        failed: set[str] = set()
        for rid in scheduled:
            req = self.running[rid]
            computed = self.blocks[rid][: -(-req.num_computed_tokens // BS)]
            bad = [i for i, b in enumerate(computed) if b in errors]
            if bad:
                req.num_computed_tokens = min(bad) * BS
                failed.add(rid)
        self.planner.apply(merged)
        for rid, n in scheduled.items():
            req = self.running[rid]
            if rid in failed:
                continue
            req.num_computed_tokens += n
            if sample and req.num_computed_tokens == req.num_tokens:
                req.append((decode or {}).get(rid, 7 + req.num_tokens % 50))
        return plan

    def _tally(self, sending: set[str], recving: set[str], rank: int) -> None:
        # vLLM's KVOutputAggregator: a request counts once every rank reported it.
        for rid in sending:
            self._counts[("s", rid)] = self._counts.get(("s", rid), 0) + 1
            if self._counts[("s", rid)] == len(self.movers):
                del self._counts[("s", rid)]
                self.sent.append(rid)
                self.held.discard(rid)
                self._free(rid)
        for rid in recving:
            self._counts[("r", rid)] = self._counts.get(("r", rid), 0) + 1
            if self._counts[("r", rid)] == len(self.movers):
                del self._counts[("r", rid)]
                self.recvd.append(rid)
                req = self.waiting_kv.pop(rid, None)
                if req is None:  # aborted while loading: vLLM frees the blocks now
                    self.held.discard(rid)
                    self._free(rid)
                else:
                    bad = [i for i, b in enumerate(self.blocks[rid]) if b in self.load_errors]
                    if bad:
                        req.num_computed_tokens = min(bad) * BS
                    if req.num_computed_tokens >= req.num_tokens:
                        req.num_computed_tokens = req.num_tokens - 1
                    req.status = "RUNNING"
                    self.running[rid] = req

    def settle(self, timeout: float = 20.0) -> None:
        """Empty steps until the connector has nothing left in flight (bounded)."""
        deadline = time.monotonic() + timeout
        while self.planner.busy or not all(m.idle for m in self.movers):
            assert time.monotonic() < deadline, "the connector did not settle"
            self.step_idle()
            for m in self.movers:
                m.wait_progress(0.05)

    def step_idle(self) -> StepPlan:
        """A step that schedules nothing (vLLM's no-forward path)."""
        saved, self.running = self.running, {}
        try:
            return self.step(sample=False)
        finally:
            self.running = {**saved, **self.running}

    def block_kv(self, rank: int, block: int) -> list[torch.Tensor]:
        return [kv[block].clone() for kv in self.kv[rank]]

    def close(self) -> None:
        for m in self.movers:
            m.close(10.0)
