"""The one engine interface test_sglang.py drives: on the fakes of sglang_fakes.py
(fast) and on SGLang 0.5.23's REAL classes through sglang_real.py (the runs that
decide; :data:`KINDS`). A test written against this interface runs unchanged on each.

- :class:`FakeEngine`: sglang_fakes.Engine, plus the interface's names.
- :class:`RealEngine`: sglang_real.Engine (SGLang's ``Req``, ``ReqToTokenPool``,
  ``MHATokenToKVPool`` / ``MLATokenToKVPool`` on the CPU, ``PagedTokenToKVPoolAllocator``
  or ``TokenToKVPoolAllocator``, ``UnifiedRadixCache`` or ``RadixCache``, the published
  runtime context, ``SGLANG_DEBUG_MEMORY_POOL=1``), driven as SGLang's decode scheduler
  drives it, with kvoffload's drop-in in SGLang's manager's place. The only thing
  added to SGLang's objects is a recorder on ``req_to_token_pool.free`` (it calls
  SGLang's own), which tells the release path's frees from the engine's own.
- :func:`make` builds either by kind; :data:`KINDS` names them.

The interface (both classes): ``kind``, ``page_size``, ``running``, ``waiting``,
``mgr``, ``shard``, ``n_tensors``; ``manager(...)``, ``new_req(rid, prompt, max_new,
extra_key=, cache_salt=)``, ``prefill(req)``, ``forward()``, ``process_results()``,
``iteration()``, ``retract(req)``, ``preempt(req)``, ``resume(req)``, ``drop(req)``,
``run(reqs)``; ``released`` (rids released through SGLang's release path, in order),
``releases(req)``, ``held()`` (slots requests hold: 0 when every page came back; the
real engine also checks its free list for double frees), ``take_back(kv)`` (the
engine frees a dropped request's row and slots itself), ``next_row(row)``,
``reverse_free_pages()``, ``finish_now(req)``, ``next_step_takes_a_page(req)``,
``row_pages(req)``, ``expected(uid, tokens, page)`` (the KV bytes kvoffload must store
for one page: every KV tensor's rows of the page, K0, V0, K1, V1, ... or MLA's KV0,
KV1, ...).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import sglang_fakes as fakes

#: The engines test_sglang.py runs on: the fakes; SGLang's real classes with each of its
#: two tree caches, the decode radix cache off (as SGLang's decode server builds it by
#: default); and on (``--disaggregation-decode-enable-radix-cache``) with every prompt's
#: whole pages already in the tree, so each request's row starts with the tree's pages
#: (``cache_protected_len`` > 0) and it holds a lock on the tree.
KINDS = ["fake", "real-unified", "real-radix", "real-unified-prefix"]


class _Releases:
    """Records each release through SGLang's path: the drop-in's
    ``req_to_token_pool.free(req)`` (a wrapper that calls the pool's own), told apart
    from the engine's own frees (retraction, a dropped request)."""

    def _record_releases(self, pool: Any) -> None:
        # _released: (rid, Req) of each release through SGLang's path, in order;
        # _own: the engine itself is freeing (not a release).
        self._released: list[tuple[str, weakref.ref[Any]]] = []
        self._own = False
        pool_free = pool.free

        def free(req: Any) -> None:
            if not self._own:
                self._released.append((req.rid, weakref.ref(req)))
            pool_free(req)

        pool.free = free

    @contextlib.contextmanager
    def _engine_frees(self) -> Iterator[None]:
        self._own = True
        try:
            yield
        finally:
            self._own = False

    @property
    def released(self) -> list[str]:
        return [rid for rid, _ in self._released]

    def releases(self, req: Any) -> int:
        return sum(1 for _, ref in self._released if ref() is req)


class FakeEngine(_Releases, fakes.Engine):
    """sglang_fakes.Engine with the interface's names."""

    kind = "fake"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._record_releases(self.r2t)

    @property
    def req_to_token_pool(self) -> Any:
        return self.r2t

    @property
    def tree_cache(self) -> Any:
        return self.tree

    def new_req(
        self,
        rid: str,
        prompt: list[int],
        max_new: int,
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> Any:
        return fakes.Req(rid, prompt, max_new, extra_key=extra_key, cache_salt=cache_salt)

    def _take_back(self, req: Any) -> None:
        with self._engine_frees():
            super()._take_back(req)

    def drop(self, req: Any) -> None:
        with self._engine_frees():
            super().drop(req)

    def held(self) -> int:
        return len(self.allocator.used) * self.page_size

    def take_back(self, kv: Any) -> None:
        self.tree.free_kv_row(kv, [(kv.cache_protected_len, kv.kv_allocated_len)])
        self.r2t.free_rows([kv.req_pool_idx])
        kv.req_pool_idx = None
        kv.mark_kv_released()

    def next_row(self, row: int) -> None:
        self.r2t.free_slots.remove(row)
        self.r2t.free_slots.append(row)  # rows are handed out from the tail

    def reverse_free_pages(self) -> None:
        self.allocator.free_pages = self.allocator.free_pages.flip(0)

    def finish_now(self, req: Any) -> None:
        req.finished_reason = "stop"

    def next_step_takes_a_page(self, req: Any) -> bool:
        return len(req.origin_input_ids) + len(req.output_ids) + 1 > req.kv.kv_allocated_len

    def row_pages(self, req: Any) -> list[int]:
        row, ps = req.kv.req_pool_idx, self.page_size
        n = -(-req.kv.kv_allocated_len // ps)
        return [int(self.r2t.req_to_token[row, p * ps]) // ps for p in range(n)]

    def expected(self, uid: int, tokens: list[int], page: int) -> bytes:
        uid = fakes.shard_uid(uid, self.shard)
        return fakes.expected_page(uid, tokens, page, self.page_size, self.n_tensors)


class RealEngine(_Releases):
    """SGLang's real decode-side objects (sglang_real.Engine) behind the interface. Build
    it with :func:`make` (inside the published runtime context it needs)."""

    def __init__(self, eng: Any, kind: str) -> None:
        self.kind = kind
        self.real = eng
        self.prefix = bool(eng.decode_radix) and kind.endswith("-prefix")
        self.page_size: int = eng.page_size
        self.running: list[Any] = []
        self.waiting: list[Any] = []
        self.mgr: Any = None
        self.n_tensors = len(eng._buffers())
        self._record_releases(eng.req_to_token_pool)

    @property
    def req_to_token_pool(self) -> Any:
        return self.real.req_to_token_pool

    @property
    def tree_cache(self) -> Any:
        return self.real.tree_cache

    @property
    def shard(self) -> int:
        return int(self.real.shard)

    @shard.setter
    def shard(self, value: int) -> None:
        self.real.shard = value

    def manager(self, tp_group: Any = None, server_args: Any = None, **kw: Any) -> Any:
        self.mgr = self.real.manager(tp_group, server_args, **kw)
        return self.mgr

    def new_req(
        self,
        rid: str,
        prompt: list[int],
        max_new: int,
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> Any:
        return self.real.new_req(rid, prompt, max_new, extra_key=extra_key, cache_salt=cache_salt)

    # --- the scheduler ------------------------------------------------------------------

    def prefill(self, req: Any) -> None:
        """Admission of a prefilled request (SGLang's decode pre-allocation and transfer
        commit: a row, slots, the prompt's KV, the first output token); with the decode
        radix cache on, the prompt's whole pages are in the tree first (a prefix match)."""
        if self.prefix:
            self._seed(req)
        matched = self.real.admit(req)
        if self.prefix:
            n = len(req.origin_input_ids)
            assert matched == req.kv.cache_protected_len == n - n % self.page_size, "no prefix matched"
        self.running.append(req)

    def _seed(self, req: Any) -> None:
        """Put the whole pages of ``req``'s prompt into the radix tree, as an earlier
        request with that prompt left them: slots from the allocator with the prompt's
        KV, inserted under the request's key (``tree_cache.insert``). The slots of a part
        already in the tree are duplicates: ``UnifiedRadixCache.insert`` frees them
        itself, ``RadixCache``'s caller does (as its ``cache_finished_req`` does)."""
        from array import array

        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        ps, toks = self.page_size, req.origin_input_ids
        n = len(toks) - len(toks) % ps
        if n == 0:
            return
        slots = self.real.allocator.alloc(n)
        assert slots is not None, "KV cache is full"
        for i in range(n):
            self.real._write_slot(int(slots[i]), i, int(toks[i]))
        key = RadixKey(array("q", toks[:n]), req.extra_key, cache_salt=req.cache_salt)
        result = self.real.tree_cache.insert(InsertParams(key=key, value=slots.to(torch.int64)))
        if result.prefix_len and type(self.real.tree_cache).__name__ == "RadixCache":
            self.real.allocator.free(slots[: result.prefix_len])

    def forward(self) -> None:
        """One decode step of every running request (SGLang's ``alloc_for_decode``, the
        forward's KV write, the sampled token, ``update_finish_state``)."""
        for req in self.running:
            self.real.decode_step(req)

    def process_results(self) -> list[Any]:
        """SGLang's result processing (batch_result_processor.py): ``offload_kv_cache``
        while a request runs; at finish ``if not offload_kv_cache(req):
        finalize_release_on_finish(req)``. Returns the requests that finished."""
        mgr = self.mgr
        done = fakes.offload_in_sglang_order(mgr, self.running)
        self.running = [r for r in self.running if not r.finished()]
        return done

    def iteration(self) -> list[Any]:
        """One scheduler loop iteration: ``check_offload_progress()``, then a decode step."""
        self.mgr.check_offload_progress()
        if not self.running:
            return []
        self.forward()
        return self.process_results()

    def retract(self, req: Any) -> None:
        """SGLang's retraction: ``drain_before_retraction()``, then ``release_req``."""
        self.mgr.drain_before_retraction()
        self._take_back(req)

    def preempt(self, req: Any) -> None:
        """SGLang's priority preemption: ``release_req`` without a drain first (F32)."""
        self._take_back(req)

    def _take_back(self, req: Any) -> None:
        self.running.remove(req)
        with self._engine_frees():
            assert self.real.retract(req), f"{req.rid}: SGLang's retraction backup failed"
        self.waiting.append(req)

    def resume(self, req: Any) -> None:
        """SGLang's resume of a retracted request (pre-allocation, ``restore_kv_cache``)."""
        self.waiting.remove(req)
        self.real.resume(req)
        self.running.append(req)

    def drop(self, req: Any) -> None:
        """The engine forgets ``req`` unfinished and frees what it holds itself
        (SGLang's ``release_kv_cache(req, tree_cache, checkpoint=False)``)."""
        from sglang.srt.mem_cache.common import release_kv_cache

        self.running.remove(req)
        if req.kv.req_pool_idx is not None:
            with self._engine_frees():
                release_kv_cache(req, self.real.tree_cache, checkpoint=False)

    def run(self, reqs: Iterable[Any], steps: int = 10_000) -> None:
        for req in reqs:
            self.prefill(req)
        for _ in range(steps):
            self.iteration()
            if not self.running:
                return
        raise AssertionError("requests did not finish")

    # --- what the tests read and do -----------------------------------------------------

    def held(self) -> int:
        """Slots the allocator handed out that are neither free nor the tree's, after
        checking that no slot is on the free list twice."""
        self.real.check_free_list()
        return self.real.capacity - self.real.free_count() - self.real.tree_slots()

    def take_back(self, kv: Any) -> None:
        """The engine frees a dropped request's row and slots itself (what it owns:
        past ``cache_protected_len``)."""
        with self._engine_frees():
            self.real.tree_cache.free_kv_row(kv, [(kv.cache_protected_len, kv.kv_allocated_len)])
            self.real.req_to_token_pool.free_rows([kv.req_pool_idx])
            kv.req_pool_idx = None
            kv.mark_kv_released()

    def next_row(self, row: int) -> None:
        """The next ``req_to_token_pool.alloc`` hands out ``row`` (it pops from the tail)."""
        slots = self.real.req_to_token_pool.free_slots
        slots.remove(row)
        slots.append(row)

    def reverse_free_pages(self) -> None:
        alloc = self.real.allocator
        alloc.free_pages = alloc.free_pages.flip(0)

    def finish_now(self, req: Any) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))

    def next_step_takes_a_page(self, req: Any) -> bool:
        return bool(req.kv.kv_committed_len % self.page_size == 0)

    def row_pages(self, req: Any) -> list[int]:
        ps = self.page_size
        slots = self.real.row_slots(req, 0, req.kv.kv_allocated_len)
        return [slots[i] // ps for i in range(0, len(slots), ps)]

    def expected(self, uid: int, tokens: list[int], page: int) -> bytes:
        ps = self.page_size
        return bytes(self.real.expected_kv_bytes(tokens, page * ps, (page + 1) * ps))

    def sglang_keys(self, tokens: list[int], extra_key: str | None, cache_salt: str | None) -> list[str]:
        """SGLang's own storage keys of the whole pages of ``tokens``
        (sglang_real.page_keys: its manager's ``_compute_prefix_hash``)."""
        import sglang_real as sr

        return sr.page_keys(tokens, self.page_size, extra_key=extra_key, cache_salt=cache_salt)


def make(stack: contextlib.ExitStack, kind: str, *, page_size: int = 4, mla: bool = False, **kw: Any) -> Any:
    """An engine of ``kind`` (one of :data:`KINDS`). A real one lives in the published
    runtime context ``stack`` holds (closed by the caller). ``kw``: the fake's
    ``n_pages`` / ``rows`` (the real engine gets the same slots and rows), or the real
    engine's ``ServerArgs`` fields."""
    if kind == "fake":
        return FakeEngine(page_size=page_size, mla=mla, **kw)
    import sglang_cpu

    sglang_cpu.require()
    import sglang_real as sr

    tree = kind.removeprefix("real-").removesuffix("-prefix")
    if kind.endswith("-prefix"):
        kw["decode_radix"] = True
    n_pages = kw.pop("n_pages", 256)
    eng = stack.enter_context(
        sr.engine(page_size=page_size, kv="mla" if mla else "mha", tree=tree, slots=n_pages * page_size, **kw)
    )
    return RealEngine(eng, kind)


# --- tensor parallelism: what each rank runs (imported by name in the rank processes) ----


def tp_rank_run(
    ctx: Any, kind: str, seed: int, root: str, mla: bool = False, drop_in_a_cycle: bool = False
) -> dict[str, Any]:
    """One TP rank of a replicated SGLang scheduler on an engine of ``kind``: the same
    requests and calls on every rank, each rank's copies completing in its own random
    order and rounds (a SimBackend), KV that differs by rank (its heads). Returns what
    the test compares: the iteration each request was released in, and what this rank
    stored.

    ``drop_in_a_cycle``: at iteration 6 the engine drops a running request mid-decode
    (its row kept), caught in a reference cycle; rank 0's collector runs at once, the
    others' never does (F31); at iteration 12 the engine frees the row."""
    import gc
    import random

    from kvoffload.storage.file import FileStorage
    from kvoffload.testing import SimBackend

    rng = random.Random(seed * 1000 + ctx.rank)
    with contextlib.ExitStack() as stack:
        engine = make(stack, kind, page_size=4, mla=mla)
        engine.shard = ctx.rank if not mla else 0
        sim = SimBackend()
        mgr = engine.manager(
            tp_group=ctx.group, storage=FileStorage(root), backend=sim, host_pages=64, drain_timeout_s=20.0
        )
        reqs = [engine.new_req(f"r{i % 3}", [i * 10 + j for j in range(3 + i)], 9 + 2 * i) for i in range(6)]
        for i, r in enumerate(reqs):
            r.uid = 1000 + i  # the same request identity on every rank (the fake's KV)
        released_at: dict[int, list[str]] = {}
        waiting = list(reqs)
        dropped: Any = None
        counts: list[tuple[int, ...]] = []  # after every iteration: what every rank must see alike
        if drop_in_a_cycle:
            gc.disable()
        try:
            for it in range(500):
                if waiting and it % 3 == 0:
                    engine.prefill(waiting.pop(0))
                if drop_in_a_cycle and it == 6:
                    gone = engine.running[0]
                    gone.cycle = gone  # only the collector frees it
                    dropped = gone.kv
                    engine.running.remove(gone)
                    reqs.remove(gone)
                    del gone
                    if ctx.rank == 0:
                        gc.collect()
                if dropped is not None and it == 12:
                    engine.take_back(dropped)
                before = len(engine.released)
                engine.iteration()
                s = mgr.statistics()
                counts.append(
                    (it, s.live_lifecycles, s.released_aborted, s.chunks_discarded, s.device_pages_used)
                )
                # This rank's copy engine: a random subset of its copies, in a random order.
                pending = list(sim.pending)
                rng.shuffle(pending)
                for t in pending[: rng.randint(0, len(pending))]:
                    sim.complete(t)
                if len(engine.released) > before:
                    released_at[it] = engine.released[before:]
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
        finally:
            gc.enable()
        return {
            "counts": counts,
            "released_at": released_at,
            "released": list(engine.released),
            "pages_stored": stats.pages_stored,
            "live": stats.live_lifecycles,
            "host_used": stats.host_pages_used,
            "engine_slots_held": engine.held(),
            "reqs": [
                (r.rid, r.uid, list(r.origin_input_ids), list(r.output_ids), r.extra_key, r.cache_salt)
                for r in reqs
            ],
        }
