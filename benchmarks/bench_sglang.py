"""The SGLang integration's cost on the scheduler's hot path, beside SGLang's own
manager: ``offload_kv_cache(req)`` for every running request after every decode step
and ``check_offload_progress()`` once per iteration, in SGLang's order (batch_result_
processor.py, ``process_batch_result_decode``: ``kv_committed_len`` advanced for the
whole batch before the forward, as ``prepare_for_decode`` does; then, request by request,
the sampled token appended and that request's call). Rounds interleaved, each path
timed on the scheduler's thread; ratios are medians of per-round ratios, measured side
by side in one run.

The paths, each without the device copy itself:

- **kvoffload**: the drop-in, its page ids read from ``req_to_token`` in at most two
  reads per iteration (the running requests' pages, the arrivals'; issue 20, point 5);
  copies on a ``SimBackend`` (no copy), ``storage=None``
  (page keys are still computed at submit).
- **kvoffload, one read per request**: the same drop-in with the page-id read it had
  before (each request entering a page reads its own row slice with ``tolist()``).
- **SGLang**: SGLang 0.5.23's own ``DecodeKVCacheOffloadManager``, when sglang imports
  here (``.venv-sglang``): built through its real ``__init__`` from SGLang's published
  runtime config, on SGLang's real ``MHATokenToKVPool``, ``PagedTokenToKVPoolAllocator``,
  ``ReqToTokenPool``, host pool and ``HiCacheController``, all on the CPU (io backend
  ``direct``). Stand-ins only for what kvoffload's side leaves out too, or what needs
  CUDA: the device copy (``L2TransferEngine.submit_device_to_host`` returns its
  completion without copying), the storage tier (``write_storage`` acknowledged at once;
  SGLang's own page hash still runs) and host-memory pinning. Both managers get the
  same pools and rows. Without sglang (the plain ``.venv``) the SGLang figure is a
  re-implementation of its per-request work, said so in the output:
  decode_kvcache_offload_manager.py lines 193-257 (``offload_kv_cache``: the row
  lookup, ``origin_input_ids + output_ids[:-1]``, the stride arithmetic, the device
  slice ``token_indices[start:end].to(torch.int64)``, the ack bookkeeping; the
  ``cache_controller.write`` call left out) and lines 264-276 (the per-iteration queue
  sizes of ``check_offload_progress``).

On a CPU a host read of ``req_to_token`` is no device sync, so these figures are host
cost only. What the batched read saves on a GPU (a device sync per request entering a
page) is counted, not timed: the script prints the host reads of ``req_to_token`` per
iteration. SGLang hands the device slice to its copy (line 226, 240) and reads none.

    python benchmarks/bench_sglang.py [--requests 256] [--context 4096] [--aligned]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import torch
from _machine import describe
from _machine import spread as spread_of

from kvoffload.integrations.sglang import DecodeKVCacheOffloadManager
from kvoffload.testing import SimBackend

PAGE, STRIDE = 64, 64


class KV:
    def __init__(self, row: int, committed: int) -> None:
        self.req_pool_idx = row
        self.kv_committed_len = committed
        self.kv_allocated_len = committed
        self.cache_protected_len = 0


class Req:
    """What both managers read of SGLang's ``Req``, with SGLang 0.5.23's types: the
    prompt and the outputs are ``array("q")`` (schedule_batch.py, ``Req.__init__``)."""

    def __init__(self, rid: int, prompt: int, row: int) -> None:
        self.rid = f"r{rid}"
        self.origin_input_ids = array("q", [(rid * 131 + j) % 50_000 for j in range(prompt)])
        self.output_ids = array("q", [1])  # the prefill side's first token
        self.kv = KV(row, prompt)
        self.extra_key = self.cache_salt = None
        self.lock = None

    def finished(self) -> bool:
        return False


# --- the engine's objects: SGLang's real ones when it imports, else shaped like them ---


class Rows:
    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token

    def free(self, req: Any) -> None:
        pass


class Pool:
    def __init__(self, n_pages: int) -> None:
        self.k_buffer = [torch.zeros((n_pages + 1) * PAGE, 1, 8, dtype=torch.float16)]
        self.v_buffer = [torch.zeros((n_pages + 1) * PAGE, 1, 8, dtype=torch.float16)]


class Alloc:
    page_size = PAGE

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def get_kvcache(self) -> Pool:
        return self.pool


class Tree:
    def free_kv_row(self, *a: Any) -> None:
        pass

    def unlock(self, *a: Any) -> None:
        pass


def sglang_engine(
    n_rows: int, n_pages: int, max_context: int, page: int = PAGE
) -> tuple[Any, Any, Callable[[], Any]] | None:
    """SGLang's real rows, KV pool and allocator on the CPU (pages of ``page`` tokens),
    and a builder of SGLang's own manager on them; None when sglang does not import
    here. SGLang's manager reads its stride from ``SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE``
    when it is built (unset: one page)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests", "integrations"))
    try:
        import sglang_cpu  # the torchvision stub SGLang's import chain needs here
    except ImportError:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from anywhere
    ok, _ = sglang_cpu.available()
    if not ok:
        return None
    import logging
    import queue

    import sglang.srt.mem_cache.l2_transfer as l2
    import sglang.srt.mem_cache.pool_host.common as host_common
    import torch.distributed as dist
    from sglang.srt import runtime_context
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
        DecodeKVCacheOffloadManager as SGLangManager,
    )
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.utils import get_hash_str
    from sglang.srt.server_args import ServerArgs

    logging.getLogger("sglang").setLevel(logging.WARNING)
    server_args = ServerArgs(
        model_path="dummy",  # SGLang's own short circuit: no model config is loaded
        page_size=page,
        device="cpu",
        hicache_ratio=2.0,
        hicache_size=0,
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
    )
    runtime_context.publish(server_args, role="scheduler")
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    size = n_pages * page
    kv = MHATokenToKVPool(
        size=size,
        page_size=page,
        dtype=torch.float16,
        head_num=1,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = PagedTokenToKVPoolAllocator(
        size=size, page_size=page, dtype=torch.float16, device="cpu", kvcache=kv, need_sort=False
    )
    rows = ReqToTokenPool(size=n_rows, max_context_len=max_context, device="cpu", enable_memory_saver=False)
    # Host pinning registers memory with CUDA: nothing to register on this CPU.
    host_common._cuda_host_register = lambda *a, **k: None

    def build() -> Any:
        mgr = SGLangManager(rows, alloc, dist.group.WORLD, Tree())
        cc = mgr.cache_controller

        def copy(transfers: Any) -> Any:  # the device copy: its completion, no copy
            start, finish, timing = l2.make_timing_event_pair()
            return l2.TransferCompletion(start, finish, timing)

        cc.l2_transfer_engine.submit_device_to_host = copy
        acks: queue.Queue[Any] = queue.Queue()
        ids = iter(range(1, 1 << 62))

        class Stored:  # the storage tier: every backup acknowledged at once
            def __init__(self) -> None:
                self.id = next(ids)

        def write_storage(host_indices: Any, token_ids: Any, hash_value: Any = None, **kw: Any) -> int:
            op = Stored()
            acks.put(op)
            return op.id

        cc.ack_backup_queue = acks
        cc.write_storage = write_storage
        cc.get_hash_str = get_hash_str  # what attaching a storage backend sets
        return mgr

    return rows, alloc, build


def sglang_shaped(rows: Rows) -> Any:
    """SGLang 0.5.23's manager re-implemented (decode_kvcache_offload_manager.py lines
    193-257 and 264-276, the copy call left out): for the plain venv only."""

    class State:
        def __init__(self) -> None:
            self.inc_len = 0
            self.last_hash = None

    class Shaped:
        def __init__(self) -> None:
            self.offloaded_state: WeakKeyDictionary[Any, State] = WeakKeyDictionary()
            self.offload_inflight: WeakKeyDictionary[Any, int] = WeakKeyDictionary()
            self.ongoing_offload: dict[int, Any] = {}
            self.request_counter = 0
            self.acks: list[int] = []

        def offload_kv_cache(self, req: Any) -> bool:
            if req.kv.req_pool_idx == -1 or len(req.output_ids) == 0:
                return False
            token_indices = rows.req_to_token[req.kv.req_pool_idx]
            if token_indices.dim() == 0 or token_indices.numel() == 0:
                return False
            all_tokens = req.origin_input_ids + req.output_ids[:-1]
            prefill = len(req.origin_input_ids) // PAGE * PAGE
            state = self.offloaded_state.get(req)
            if state is None:
                state = self.offloaded_state[req] = State()
            new = len(all_tokens) - prefill - state.inc_len
            aligned = new // STRIDE * STRIDE
            if aligned == 0:
                return False
            start = prefill + state.inc_len
            tokens = all_tokens[start : start + aligned]
            indices = token_indices[start : start + aligned].to(torch.int64)
            self.request_counter += 1
            ack = self.request_counter
            self.offload_inflight[req] = self.offload_inflight.get(req, 0) + 1
            self.ongoing_offload[ack] = (req, indices, tokens, time.time(), [])
            self.acks.append(ack)
            state.inc_len += aligned
            return True

        def check_offload_progress(self) -> None:
            n_write, _ = map(int, torch.tensor([len(self.acks), 0], dtype=torch.int).tolist())
            for ack in self.acks[:n_write]:
                req = self.ongoing_offload.pop(ack)[0]
                count = self.offload_inflight.get(req, 0)
                if count <= 1:
                    self.offload_inflight.pop(req, None)
                else:
                    self.offload_inflight[req] = count - 1
            del self.acks[:n_write]

        def release_host_resources(self) -> None:
            pass

    return Shaped()


def per_request_reads(mgr: DecodeKVCacheOffloadManager) -> DecodeKVCacheOffloadManager:
    """The drop-in as it was before issue 20.5: each request that enters a page reads
    its own row slice (one host read each)."""
    mgr._step_pages = lambda e, row, have, committed: mgr._pages(row, have, committed)  # type: ignore[method-assign]
    return mgr


class Counted(torch.Tensor):
    """``req_to_token`` counting its ``tolist()`` calls (the drop-in's one host read)."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.tolist:
            Counted.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=2 * STRIDE, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--aligned",
        action="store_true",
        help="every request enters a page in the same iteration (default: spread over the page)",
    )
    args = ap.parse_args()
    n, ctx = args.requests, args.context
    prompts = [ctx + (0 if args.aligned else (i * 37) % PAGE) for i in range(n)]
    tokens_max = max(prompts) + args.steps * (args.rounds + 2) + 2 * PAGE
    per_req_pages = -(-tokens_max // PAGE)
    n_pages = n * per_req_pages + 1
    real = sglang_engine(n, n_pages, per_req_pages * PAGE)
    if real is not None:
        rows, alloc, build_sglang = real
        sglang: Any = build_sglang()
        label = "SGLang 0.5.23's own manager (real __init__, pools, controller; copy and store stubbed)"
    else:
        rows, alloc = Rows(torch.zeros(n + 1, per_req_pages * PAGE, dtype=torch.int32)), Alloc(Pool(n_pages))
        sglang = sglang_shaped(rows)
        label = "SGLang's offload_kv_cache re-implemented (sglang does not import here)"
    r2t = rows.req_to_token
    for r in range(n):  # request r has row r + 1 (row 0 is SGLang's padding) and its own pages
        first = 1 + r * per_req_pages
        r2t[r + 1] = torch.arange(first * PAGE, (first + per_req_pages) * PAGE, dtype=torch.int32)
    sims = [SimBackend(), SimBackend()]
    ours, before = (
        DecodeKVCacheOffloadManager(rows, alloc, None, Tree(), host_pages=8 * n, storage=None, backend=sim)
        for sim in sims
    )
    per_request_reads(before)
    paths: list[tuple[str, Any, SimBackend | None]] = [
        ("kvoffload", ours, sims[0]),
        ("kvoffload, one read per request", before, sims[1]),
        ("sglang", sglang, None),
    ]
    reqs = {name: [Req(i, prompts[i], i + 1) for i in range(n)] for name, _, _ in paths}
    token = iter(range(10**9))
    for name, mgr, _ in paths:  # admission (each hashes the prompt once) and a first step
        for r in reqs[name]:
            mgr.offload_kv_cache(r)

    def run(name: str, mgr: Any, sim: SimBackend | None, steps: int) -> float:
        batch = reqs[name]
        t0 = time.perf_counter()
        for _ in range(steps):
            mgr.check_offload_progress()
            for r in batch:  # prepare_for_decode: the forward writes every request's KV
                r.kv.kv_committed_len += 1
            for r in batch:  # process_batch_result_decode, request by request
                r.output_ids.append(next(token) % 50_000)
                mgr.offload_kv_cache(r)
            if sim is not None:
                sim.complete_all()
        return (time.perf_counter() - t0) / (steps * n)

    for name, mgr, sim in paths:  # warm up
        run(name, mgr, sim, args.steps)

    def pages_copied(mgr: Any) -> int:
        if isinstance(mgr, DecodeKVCacheOffloadManager):
            return int(mgr.statistics().pages_submitted)
        return int(mgr.request_counter) * STRIDE // PAGE  # SGLang: one write per stride

    times: dict[str, list[float]] = {name: [] for name, _, _ in paths}
    copied = {name: -pages_copied(mgr) for name, mgr, _ in paths}
    for k in range(args.rounds):  # interleaved, each path first in turn (no place favoured)
        for name, mgr, sim in paths[k % 3 :] + paths[: k % 3]:
            times[name].append(run(name, mgr, sim, args.steps))
    for name, mgr, _ in paths:
        copied[name] += pages_copied(mgr)
    # Host reads of req_to_token per iteration, counted (not timed) over one page of steps.
    reads: dict[str, list[int]] = {}
    rows.req_to_token = r2t.as_subclass(Counted)
    for name, mgr, sim in paths[:2]:
        counts = []
        for _ in range(PAGE):
            Counted.reads = 0
            run(name, mgr, sim, 1)
            counts.append(Counted.reads)
        reads[name] = counts
    rows.req_to_token = r2t
    for _, mgr, _ in paths:
        mgr.release_host_resources()

    def ratio(a: str, b: str) -> str:
        """The median of per-round ratios a/b and their range over rounds (no target:
        what the drop-in costs beside SGLang's manager; bench_core_sglang holds the
        core's targets)."""
        xs = [x / y for x, y in zip(times[a], times[b], strict=True)]
        return f"{statistics.median(xs):.2f}x (no target; {spread_of(xs)})"

    print(describe())
    spread = "all entering a page in the same iteration" if args.aligned else "spread over the page"
    print(
        f"SGLang decode offload, {n} running requests, prompts of {ctx}+ tokens ({spread}), "
        f"page {PAGE}, stride {STRIDE}; {args.rounds} rounds of {args.steps} steps, interleaved"
    )
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    before = "kvoffload, one read per request"
    print(f"  SGLang path: {label}")
    print(f"  kvoffload, batched reads per iteration:   {us['kvoffload']:7.2f} µs/request-step")
    print(f"  kvoffload, one read per request entering: {us[before]:7.2f} µs/request-step")
    print(f"  SGLang:                                   {us['sglang']:7.2f} µs/request-step")
    print(f"  ratio kvoffload / SGLang:           {ratio('kvoffload', 'sglang')}")
    print(f"  ratio kvoffload before / SGLang:    {ratio(before, 'sglang')}")
    print(f"  ratio kvoffload / kvoffload before: {ratio('kvoffload', before)}")
    print("  pages copied in the timed rounds: " + ", ".join(f"{k} {v}" for k, v in copied.items()))
    for name, counts in reads.items():
        print(
            f"  host reads of req_to_token per iteration, {name}: max {max(counts)}, "
            f"mean {statistics.mean(counts):.2f} (a device sync each on a GPU; SGLang: none)"
        )


if __name__ == "__main__":
    main()
