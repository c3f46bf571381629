"""Fakes shaped like the SGLang 0.5.23 objects the decode offload manager is handed,
and a scheduler loop that drives them only through the scheduler's calls.

- ``Req``: ``rid``, ``origin_input_ids``, ``output_ids``, ``kv`` (``req_pool_idx``,
  ``cache_protected_len``, ``kv_committed_len``, ``kv_allocated_len``,
  ``mark_kv_released()``), ``extra_key``, ``cache_salt``, ``lock`` (the prefix-cache
  ``TreeLock`` it holds, or None), ``finished()``.
- ``ReqToTokenPool``: ``req_to_token`` (padding row 0, then a row of token slots per
  request), ``free_slots``, ``alloc(reqs)`` (rows from the tail of ``free_slots``, the
  list of rows), ``free_rows(indices)``, ``free(req)`` (sets ``req.kv.req_pool_idx`` to
  None), as SGLang's.
- ``Allocator``: ``page_size``, ``get_kvcache()``, ``alloc(need_size)`` (a tensor of
  page-aligned slots, or None), ``free(slots)`` (the pages those slots are on; refuses a
  double free), ``free_pages`` (a tensor of page ids; page 0 is padding), handed out
  and given back as SGLang's ``PagedTokenToKVPoolAllocator`` (``page_size > 1``) or
  ``TokenToKVPoolAllocator`` (``page_size == 1``) do.
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
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvoffload.integrations.sglang import DecodeKVCacheOffloadManager

HEADS, DIM = 2, 4
Manager = DecodeKVCacheOffloadManager
_uids = itertools.count(1)


class KV:
    """``req.kv``: where a request's KV lives in the engine."""

    def __init__(self) -> None:
        self.req_pool_idx: int | None = None
        # The tree owns [0, cache_protected_len) (a prefix the decode radix cache matched).
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0

    def mark_kv_released(self) -> None:
        self.kv_allocated_len = 0  # SGLang's ReqKvInfo.mark_kv_released


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
        self.origin_input_ids = array("q", prompt)  # SGLang's Req holds array("q")s
        self.output_ids = array("q")
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
        rows = (n_pages + 1) * page_size  # one latent head: (rows, 1, kv_lora_rank + rope dim)
        self.kv_buffer = [torch.zeros(rows, 1, HEADS * DIM) for _ in range(layers)]

    def tensors(self) -> list[torch.Tensor]:
        return list(self.kv_buffer)


class Allocator:
    """``token_to_kv_pool_allocator``: SGLang's ``PagedTokenToKVPoolAllocator`` (page size
    > 1) or ``TokenToKVPoolAllocator`` (page size 1, a page is a slot): ``free_pages``
    holds page ids (page 0 is padding), ``alloc(need_size)`` hands out whole pages from
    the front as a tensor of their slots, ``free(slots)`` gives back the pages the slots
    are on (the paged one to the front, the page-size-1 one to the back, as SGLang's do
    without ``need_sort``). Freeing a page not handed out fails (a double free)."""

    def __init__(self, pool: Any, n_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.device = "cpu"
        self._kvcache = pool
        self.free_pages = torch.arange(1, n_pages + 1, dtype=torch.int64)
        # used: the pages handed out and not given back (the tests' leak check; SGLang's
        #   allocator keeps no such set).
        self.used: set[int] = set()

    def get_kvcache(self) -> Any:
        return self._kvcache

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        ps = self.page_size
        assert need_size % ps == 0, "The allocation size should be page-aligned"
        n = need_size // ps
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self.used.update(int(p) for p in pages)
        return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        ps = self.page_size
        pages = torch.unique(free_index // ps) if ps > 1 else free_index.to(torch.int64)
        for page in pages.tolist():
            assert page in self.used, f"page {page} freed twice (or never allocated)"
            self.used.remove(page)
            # The engine reuses freed memory at once: garbage where the page was.
            for t in self._kvcache.tensors():
                t[page * ps : (page + 1) * ps] = -1.0
        parts = (pages, self.free_pages) if ps > 1 else (self.free_pages, pages)
        self.free_pages = torch.cat(parts)


class ReqToTokenPool:
    """``req_to_token_pool``: SGLang's ``ReqToTokenPool``: row 0 is padding, each request
    holds one row of token slots; rows are handed out from the tail of ``free_slots``
    and given back to its end."""

    def __init__(self, rows: int, max_context: int) -> None:
        self.size = rows
        self.req_to_token = torch.zeros(rows + 1, max_context, dtype=torch.int32)
        self.free_slots = list(range(1, rows + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, reqs: Sequence[Any]) -> list[int] | None:
        need = sum(1 for r in reqs if r.kv.req_pool_idx is None)
        if need > len(self.free_slots):
            return None
        rows = iter(self.free_slots[len(self.free_slots) - need :])
        del self.free_slots[len(self.free_slots) - need :]
        for r in reqs:
            if r.kv.req_pool_idx is None:
                r.kv.req_pool_idx = next(rows)
        return [r.kv.req_pool_idx for r in reqs]

    def free_rows(self, indices: list[int]) -> None:
        self.free_slots.extend(indices)

    def free(self, req: Any) -> None:
        assert req.kv.req_pool_idx is not None, f"{req.rid}: request row freed twice"
        self.free_rows([req.kv.req_pool_idx])
        req.kv.req_pool_idx = None


class TreeCache:
    """The prefix cache's side of a release: the row's KV ranges, and its lock."""

    def __init__(self, allocator: Allocator, r2t: ReqToTokenPool) -> None:
        self.token_to_kv_pool_allocator = allocator
        self.req_to_token_pool = r2t
        self.released: list[str] = []  # rids, in release order

    def free_kv_row(self, kv: KV, ranges: list[tuple[int, int]]) -> None:
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        for start, end in ranges:
            self.token_to_kv_pool_allocator.free(row[start:end].to(torch.int64))

    def lock(self, node: Any) -> TreeLock:
        return TreeLock(node)

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
            buf[slot] = kv_value(uid, pos, tokens[pos], t).view(buf.shape[1:])

    def _grow(self, req: Req, n: int) -> None:
        """Allocate pages so the row holds ``n`` tokens."""
        ps = self.page_size
        row = req.kv.req_pool_idx
        while req.kv.kv_allocated_len < n:
            slots = self.allocator.alloc(ps)
            assert slots is not None, "KV cache is full"
            start = req.kv.kv_allocated_len
            self.r2t.req_to_token[row, start : start + ps] = slots.to(torch.int32)
            req.kv.kv_allocated_len += ps

    def prefill(self, req: Req) -> None:
        """Admit ``req`` (or resume it after retraction): a row, pages, the KV of every
        token known (the prompt, and the outputs but the last), a prefix-cache lock."""
        assert self.r2t.alloc([req]) is not None, "req_to_token_pool is full"
        n = len(req.tokens()) if req.output_ids else len(req.origin_input_ids)
        self._grow(req, n + 1)
        for pos in range(n):
            self._write(req, pos)
        req.kv.kv_committed_len = n
        req.lock = self.tree.lock(req.rid)
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
        done = offload_in_sglang_order(mgr, self.running)
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
        if kv.req_pool_idx is not None:
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


class ServerArgs:
    """The ``ServerArgs`` fields the drop-in reads (SGLang's own is a dataclass of
    hundreds; its real one is in the real-class runs): a host pool of half the device
    pool, the file store."""

    hicache_ratio = 0.5
    hicache_size = 0
    hicache_storage_backend = "file"


def collect() -> None:
    """Make the collector run weakref callbacks now."""
    gc.collect()


def offload_in_sglang_order(mgr: Any, running: list[Any]) -> list[Any]:
    """SGLang's result processing for the requests of a decode step
    (batch_result_processor.py): ``offload_kv_cache(req)`` while a request runs; at
    finish ``if not offload_kv_cache(req): finalize_release_on_finish(req)``. Returns
    the requests that finished."""
    done = []
    for req in running:
        if not req.finished():
            mgr.offload_kv_cache(req)
        else:
            if not mgr.offload_kv_cache(req):
                mgr.finalize_release_on_finish(req)
            done.append(req)
    return done
