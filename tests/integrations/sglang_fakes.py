"""Fakes shaped like the SGLang 0.5.23 objects the decode offload manager is handed,
and a scheduler loop that drives them only through the scheduler's calls.

- ``Req``: ``rid``, ``origin_input_ids``, ``output_ids``, ``kv`` (``req_pool_idx``,
  ``cache_protected_len``, ``kv_committed_len``, ``kv_allocated_len``,
  ``mark_kv_released()``), ``extra_key``, ``cache_salt``, ``lock`` (the prefix-cache
  ``TreeLock`` it holds, or None), ``finished()``.
- ``ReqToTokenPool``: ``req_to_token`` (rows of token slots), ``alloc(req)``,
  ``free(req)`` (sets ``req.kv.req_pool_idx`` to None, as SGLang's does).
- ``Allocator``: ``page_size``, ``get_kvcache()``, page ``alloc``/``free`` that refuse a
  double free.
- ``TreeCache``: ``free_kv_row(kv, ranges)`` (frees the row's pages in those ranges),
  ``unlock(lock)`` (SGLang 0.5.23's shape: it takes the ``TreeLock``, not the request,
  and reads ``lock.node``; ``None`` is a no-op; refuses a second unlock). The caller
  sets ``req.lock = None`` itself, as SGLang's release paths do.

The real classes are tests/integrations/sglang_real.py's; these fakes stay for the
fast suite and for what the real classes cannot do here (a copy engine whose copies
the test completes, per-rank KV), and keep the real signatures.

The engine writes each token's KV as a function of (request, position, token, layer)
into its slot when the forward pass "runs", and rewrites a freed page at once with
garbage: a copy that read a page after it was freed stores wrong bytes, which the
tests compare against :func:`expected_page`.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterable
from typing import Any

import torch

from kvoffload.integrations.sglang import DecodeKVCacheOffloadManager

HEADS, DIM = 2, 4
Manager = DecodeKVCacheOffloadManager
_uids = itertools.count(1)


class KV:
    """``req.kv``: where a request's KV lives in the engine."""

    def __init__(self) -> None:
        self.req_pool_idx: int | None = -1
        # The tree owns [0, cache_protected_len) (a prefix the decode radix cache matched).
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.released = 0

    def mark_kv_released(self) -> None:
        self.released += 1


class TreeLock:
    """SGLang's ``TreeLock`` (base_prefix_cache.py): ``node`` the lock holds (here the
    rid of the request that took it, so releases can be told apart)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.unlocked = False


class Req:
    """A request as SGLang's scheduler holds it."""

    def __init__(
        self,
        rid: str,
        prompt: list[int],
        max_new: int,
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.rid = rid
        self.uid = next(_uids)  # the engine's identity of the request's KV content
        self.origin_input_ids = list(prompt)
        self.output_ids: list[int] = []
        self.kv = KV()
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self.lock: TreeLock | None = None
        self.max_new = max_new
        self.finished_reason: str | None = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def tokens(self) -> list[int]:
        """Every token whose KV the engine has written (the last output's is not yet)."""
        return self.origin_input_ids + self.output_ids[:-1]


def shard_uid(uid: int, shard: int) -> int:
    """The KV identity of a request on one TP rank (each rank holds other heads)."""
    return uid + 100_003 * shard


def kv_value(uid: int, pos: int, token: int, tensor: int) -> torch.Tensor:
    """The KV the engine writes for one token of one tensor (exact in float32)."""
    base = float((uid * 7919 + pos * 131 + token * 17 + tensor * 3) % 1_000_003)
    return torch.arange(HEADS * DIM, dtype=torch.float32).reshape(HEADS, DIM) + base


def expected_page(uid: int, tokens: list[int], page: int, page_size: int, n_tensors: int) -> bytes:
    """The bytes kvoffload must store for page ``page`` of a request: the page's rows
    of every KV tensor, in order (K0, V0, K1, V1, ...)."""
    parts = []
    for t in range(n_tensors):
        rows = [kv_value(uid, p, tokens[p], t) for p in range(page * page_size, (page + 1) * page_size)]
        parts.append(torch.stack(rows).numpy().tobytes())
    return b"".join(parts)


class MHAPool:
    """``MHATokenToKVPool``: per-layer K and V buffers of ``size + page_size`` rows."""

    def __init__(self, n_pages: int, page_size: int, layers: int, device: str = "cpu") -> None:
        rows = (n_pages + 1) * page_size  # SGLang pads one page (slot 0 is never handed out)
        self.k_buffer = [torch.zeros(rows, HEADS, DIM, device=device) for _ in range(layers)]
        self.v_buffer = [torch.zeros(rows, HEADS, DIM, device=device) for _ in range(layers)]

    def tensors(self) -> list[torch.Tensor]:
        return [t for pair in zip(self.k_buffer, self.v_buffer, strict=True) for t in pair]


class MLAPool:
    """``MLATokenToKVPool``: one latent buffer per layer."""

    def __init__(self, n_pages: int, page_size: int, layers: int) -> None:
        rows = (n_pages + 1) * page_size
        self.kv_buffer = [torch.zeros(rows, HEADS, DIM) for _ in range(layers)]

    def tensors(self) -> list[torch.Tensor]:
        return list(self.kv_buffer)


class Allocator:
    """``token_to_kv_pool_allocator``: pages of ``page_size`` slots; page 0 is padding."""

    def __init__(self, pool: Any, n_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._pool = pool
        self.free_pages = list(range(n_pages, 0, -1))
        self.used: set[int] = set()

    def get_kvcache(self) -> Any:
        return self._pool

    def alloc_page(self) -> int:
        page = self.free_pages.pop()
        self.used.add(page)
        return page

    def free_page(self, page: int) -> None:
        assert page in self.used, f"page {page} freed twice (or never allocated)"
        self.used.remove(page)
        self.free_pages.append(page)
        # The engine reuses freed memory at once: garbage where the page was.
        ps = self.page_size
        for t in self._pool.tensors():
            t[page * ps : (page + 1) * ps] = -1.0


class ReqToTokenPool:
    """``req_to_token_pool``: one row of token slots per running request."""

    def __init__(self, rows: int, max_context: int) -> None:
        self.req_to_token = torch.zeros(rows, max_context, dtype=torch.int32)
        self.free_rows = list(range(rows))
        self.frees = 0

    def alloc(self, req: Req) -> None:
        req.kv.req_pool_idx = self.free_rows.pop(0)  # as SGLang's: from the front, freed to the back

    def free(self, req: Req) -> None:
        row = req.kv.req_pool_idx
        assert row is not None and row != -1, f"{req.rid}: request row freed twice"
        self.free_rows.append(row)
        req.kv.req_pool_idx = None
        self.frees += 1


class TreeCache:
    """The prefix cache's side of a release: the row's KV ranges, and its lock."""

    def __init__(self, allocator: Allocator, r2t: ReqToTokenPool) -> None:
        self.allocator = allocator
        self.r2t = r2t
        self.released: list[str] = []  # rids, in release order

    def free_kv_row(self, kv: KV, ranges: list[tuple[int, int]]) -> None:
        ps = self.allocator.page_size
        row = self.r2t.req_to_token[kv.req_pool_idx]
        for start, end in ranges:
            for p in range(start // ps, -(-end // ps)):
                self.allocator.free_page(int(row[p * ps]) // ps)

    def unlock(self, lock: TreeLock | None) -> None:
        if lock is None:  # SGLang's BasePrefixCache.unlock: nothing held, nothing to do
            return
        assert not lock.unlocked, f"{lock.node}: prefix lock released twice"
        lock.unlocked = True
        self.released.append(lock.node)


class Engine:
    """SGLang's decode scheduler, as far as the offload manager sees it."""

    def __init__(
        self,
        *,
        page_size: int = 4,
        n_pages: int = 256,
        layers: int = 2,
        rows: int = 16,
        max_context: int = 512,
        mla: bool = False,
        pool: Any = None,
    ) -> None:
        self.page_size = page_size
        if pool is None:
            pool = MLAPool(n_pages, page_size, layers) if mla else MHAPool(n_pages, page_size, layers)
        self.pool = pool
        self.n_tensors = len(pool.tensors()) if hasattr(pool, "tensors") else 0
        self.allocator = Allocator(pool, n_pages, page_size)
        self.r2t = ReqToTokenPool(rows, max_context)
        self.tree = TreeCache(self.allocator, self.r2t)
        self.running: list[Req] = []
        self.waiting: list[Req] = []
        self.mgr: DecodeKVCacheOffloadManager | None = None
        self._next_token = itertools.count(100)
        # shard: a TP rank's heads: its KV differs from the other ranks' (0: one rank).
        self.shard = 0

    def manager(self, tp_group: Any = None, server_args: Any = None, **kw: Any) -> Manager:
        """SGLang's one line: the scheduler builds the manager from its own objects."""
        mgr = DecodeKVCacheOffloadManager(self.r2t, self.allocator, tp_group, self.tree, server_args, **kw)
        self.mgr = mgr
        return mgr

    # --- the engine's own memory work ------------------------------------------------------

    def _write(self, req: Req, pos: int) -> None:
        """The forward pass writes token ``pos``'s KV into its slot."""
        slot = int(self.r2t.req_to_token[req.kv.req_pool_idx, pos])
        tokens = req.origin_input_ids + req.output_ids
        uid = shard_uid(req.uid, self.shard)
        for t, buf in enumerate(self.pool.tensors()):
            buf[slot] = kv_value(uid, pos, tokens[pos], t)

    def _grow(self, req: Req, n: int) -> None:
        """Allocate pages so the row holds ``n`` tokens."""
        ps = self.page_size
        row = req.kv.req_pool_idx
        while req.kv.kv_allocated_len < n:
            page = self.allocator.alloc_page()
            start = req.kv.kv_allocated_len
            self.r2t.req_to_token[row, start : start + ps] = torch.arange(page * ps, (page + 1) * ps)
            req.kv.kv_allocated_len += ps

    def prefill(self, req: Req) -> None:
        """Admit ``req`` (or resume it after retraction): a row, pages, the KV of every
        token known (the prompt, and the outputs but the last), a prefix-cache lock."""
        self.r2t.alloc(req)
        n = len(req.tokens()) if req.output_ids else len(req.origin_input_ids)
        self._grow(req, n + 1)
        for pos in range(n):
            self._write(req, pos)
        req.kv.kv_committed_len = n
        req.lock = TreeLock(req.rid)
        if not req.output_ids:
            req.output_ids.append(next(self._next_token))  # prefill samples the first token
        self.running.append(req)

    def forward(self) -> None:
        """One decode step for every running request: the last token's KV is written and
        the next token sampled; a request that reached max_new finishes."""
        for req in self.running:
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            self._grow(req, pos + 2)
            self._write(req, pos)
            req.kv.kv_committed_len = pos + 1
            req.output_ids.append(next(self._next_token))
            if len(req.output_ids) >= req.max_new:
                req.finished_reason = "length"

    def process_results(self) -> list[Req]:
        """SGLang's result processing: offload every running request; at finish,
        release through the manager. Returns the requests that finished."""
        mgr = self.mgr
        assert mgr is not None
        done = []
        for req in self.running:
            if not req.finished():
                mgr.offload_kv_cache(req)
            else:
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
                done.append(req)
        self.running = [r for r in self.running if not r.finished()]
        return done

    def iteration(self) -> list[Req]:
        """One scheduler loop iteration: progress first, then a decode step."""
        assert self.mgr is not None
        self.mgr.check_offload_progress()
        if not self.running:
            return []
        self.forward()
        return self.process_results()

    def retract(self, req: Req) -> None:
        """SGLang's retraction: drain, then the engine frees the request's row and pages
        itself and puts it back in the waiting queue (its outputs kept)."""
        assert self.mgr is not None
        self.mgr.drain_before_retraction()
        self._take_back(req)

    def preempt(self, req: Req) -> None:
        """SGLang's priority preemption (at batch selection, to make room for a request of
        higher priority): the request's row and pages are freed and it goes back to the
        waiting queue, as in a retraction - but without draining first (F32)."""
        self._take_back(req)

    def _take_back(self, req: Req) -> None:
        self.running.remove(req)
        kv = req.kv
        self.tree.free_kv_row(kv, [(0, kv.kv_allocated_len)])
        req.lock = None
        self.r2t.free(req)
        kv.kv_allocated_len = kv.kv_committed_len = 0
        self.waiting.append(req)

    def resume(self, req: Req) -> None:
        self.waiting.remove(req)
        self.prefill(req)

    def drop(self, req: Req) -> None:
        """The engine forgets ``req`` without finishing it (frees what it holds itself)."""
        self.running.remove(req)
        kv = req.kv
        if kv.req_pool_idx not in (None, -1):
            self.tree.free_kv_row(kv, [(0, kv.kv_allocated_len)])
            self.r2t.free(req)

    def run(self, reqs: Iterable[Req], steps: int = 10_000) -> None:
        for req in reqs:
            self.prefill(req)
        for _ in range(steps):
            self.iteration()
            if not self.running:
                return
        raise AssertionError("requests did not finish")


def collect() -> None:
    """Make the collector run weakref callbacks now."""
    gc.collect()


# --- tensor parallelism: what each rank runs (imported by name in the rank processes) ----


def tp_rank_run(
    ctx: Any, seed: int, root: str, mla: bool = False, drop_in_a_cycle: bool = False
) -> dict[str, Any]:
    """One TP rank of a replicated SGLang scheduler: the same requests and calls on
    every rank, each rank's copies completing in its own random order and rounds (a
    SimBackend), KV that differs by rank (its heads). Returns what the test compares:
    the iteration each request was released in, and what this rank stored.

    ``drop_in_a_cycle``: at iteration 6 the engine drops a running request mid-decode
    (its row kept), caught in a reference cycle; rank 0's collector runs at once, the
    others' never does (F31); at iteration 12 the engine frees the row."""
    import random

    from kvoffload.storage.file import FileStorage
    from kvoffload.testing import SimBackend

    rng = random.Random(seed * 1000 + ctx.rank)
    engine = Engine(page_size=4, mla=mla)
    engine.shard = ctx.rank if not mla else 0
    sim = SimBackend()
    mgr = engine.manager(
        tp_group=ctx.group, storage=FileStorage(root), backend=sim, host_pages=64, drain_timeout_s=20.0
    )
    reqs = [Req(f"r{i % 3}", [i * 10 + j for j in range(3 + i)], max_new=9 + 2 * i) for i in range(6)]
    for i, r in enumerate(reqs):
        r.uid = 1000 + i  # the same request identity on every rank
    released_at: dict[int, list[str]] = {}
    waiting = list(reqs)
    dropped: KV | None = None
    counts: list[tuple[int, ...]] = []  # after every iteration: what every rank must see alike
    if drop_in_a_cycle:
        gc.disable()
    for it in range(500):
        if waiting and it % 3 == 0:
            engine.prefill(waiting.pop(0))
        if drop_in_a_cycle and it == 6:
            gone = engine.running[0]
            gone.cycle = gone  # type: ignore[attr-defined]  # only the collector frees it
            dropped = gone.kv
            engine.running.remove(gone)
            reqs.remove(gone)
            del gone
            if ctx.rank == 0:
                gc.collect()
        if dropped is not None and it == 12:
            engine.tree.free_kv_row(dropped, [(0, dropped.kv_allocated_len)])
            engine.r2t.free_rows.append(dropped.req_pool_idx)  # type: ignore[arg-type]
            dropped.req_pool_idx = None
        before = len(engine.tree.released)
        engine.iteration()
        s = mgr.statistics()
        counts.append((it, s.live_lifecycles, s.released_aborted, s.chunks_discarded, s.device_pages_used))
        # This rank's copy engine: a random subset of its copies, in a random order.
        pending = list(sim.pending)
        rng.shuffle(pending)
        for t in pending[: rng.randint(0, len(pending))]:
            sim.complete(t)
        if len(engine.tree.released) > before:
            released_at[it] = engine.tree.released[before:]
        if not waiting and not engine.running and not mgr.ongoing_offload:
            break
        if not engine.running and sim.pending and rng.random() < 0.5:
            sim.complete_all()
    while mgr.ongoing_offload:
        sim.complete_all()
        mgr.check_offload_progress()
    mgr.manager.check_invariants()
    stats = mgr.statistics()
    mgr.release_host_resources()
    gc.enable()
    return {
        "counts": counts,
        "released_at": released_at,
        "released": list(engine.tree.released),
        "pages_stored": stats.pages_stored,
        "live": stats.live_lifecycles,
        "host_used": stats.host_pages_used,
        "engine_pages_held": len(engine.allocator.used),
        "reqs": [(r.rid, r.uid, r.origin_input_ids, r.output_ids, r.extra_key, r.cache_salt) for r in reqs],
        "n_tensors": engine.n_tensors,
    }
