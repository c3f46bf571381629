"""The SGLang integration's cost on the scheduler's hot path: `offload_kv_cache(req)`
for every running request after every decode step, and `check_offload_progress()` once
per iteration, against the same per-step work SGLang's own manager does before its
copy (shaped like it: the row lookup, `origin_input_ids + output_ids[:-1]`, the
stride arithmetic; its copy and hashing left out). Rounds interleaved, ratios of
medians measured side by side in one run.

    python benchmarks/bench_sglang.py [--requests 256] [--context 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _machine import describe

from kvoffload.integrations.sglang import DecodeKVCacheOffloadManager
from kvoffload.testing import SimBackend

PAGE, STRIDE = 64, 64


class KV:
    def __init__(self, row: int) -> None:
        self.req_pool_idx = row
        self.kv_committed_len = 0
        self.kv_allocated_len = 0


class Req:
    def __init__(self, rid: int, prompt: int, row: int) -> None:
        self.rid = f"r{rid}"
        self.origin_input_ids = list(range(prompt))
        self.output_ids = [1]
        self.kv = KV(row)
        self.extra_key = self.cache_salt = None

    def finished(self) -> bool:
        return False


class Pool:
    def __init__(self, n_pages: int) -> None:
        self.k_buffer = [torch.zeros(n_pages * PAGE, 1, 8)]
        self.v_buffer = [torch.zeros(n_pages * PAGE, 1, 8)]


class Alloc:
    page_size = PAGE

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def get_kvcache(self) -> Pool:
        return self.pool


def sglang_shaped(req_to_token: torch.Tensor, state: dict[int, int], req: Req) -> bool:
    """SGLang 0.5.23's offload_kv_cache up to its copy: what it does on every step."""
    if req.kv.req_pool_idx == -1 or len(req.output_ids) == 0:
        return False
    token_indices = req_to_token[req.kv.req_pool_idx]
    if token_indices.dim() == 0 or token_indices.numel() == 0:
        return False
    all_tokens = req.origin_input_ids + req.output_ids[:-1]
    prefill = len(req.origin_input_ids) // PAGE * PAGE
    inc = state.get(id(req), 0)
    new = len(all_tokens) - prefill - inc
    aligned = new // STRIDE * STRIDE
    if aligned == 0:
        return False
    start = prefill + inc
    _ = all_tokens[start : start + aligned], token_indices[start : start + aligned]
    state[id(req)] = inc + aligned
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=2 * STRIDE, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n, ctx = args.requests, args.context
    per_req_pages = (ctx + args.steps * args.rounds * 2) // PAGE + 2
    n_pages = n * per_req_pages + 1
    req_to_token = torch.zeros(n, per_req_pages * PAGE, dtype=torch.int32)
    for r in range(n):  # request r holds pages 1 + r*per_req_pages ... in order
        first = 1 + r * per_req_pages
        req_to_token[r] = torch.arange(first * PAGE, (first + per_req_pages) * PAGE, dtype=torch.int32)
    r2t: Any = type("R2T", (), {"req_to_token": req_to_token, "free": lambda self, req: None})()
    tree: Any = type("Tree", (), {"free_kv_row": lambda *a: None, "unlock": lambda *a: None})()
    sim = SimBackend()
    mgr = DecodeKVCacheOffloadManager(
        r2t, Alloc(Pool(n_pages)), None, tree, host_pages=4 * n, storage=None, backend=sim
    )
    ours = [Req(i, ctx, i) for i in range(n)]
    base = [Req(i, ctx, i) for i in range(n)]
    state: dict[int, int] = {}
    for r in ours:  # admit (hashes the prompt once, as SGLang's first call does)
        mgr.offload_kv_cache(r)

    def run_ours() -> float:
        t0 = time.perf_counter()
        for step in range(args.steps):
            mgr.check_offload_progress()
            for r in ours:
                r.output_ids.append(step)
                mgr.offload_kv_cache(r)
            sim.complete_all()
        return (time.perf_counter() - t0) / (args.steps * n)

    def run_base() -> float:
        t0 = time.perf_counter()
        for step in range(args.steps):
            for r in base:
                r.output_ids.append(step)
                sglang_shaped(req_to_token, state, r)
        return (time.perf_counter() - t0) / (args.steps * n)

    run_ours(), run_base()  # warm up
    a, b = [], []
    for _ in range(args.rounds):
        a.append(run_ours())
        b.append(run_base())
    mgr.release_host_resources()
    ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
    print(describe())
    print(
        f"SGLang integration, {n} running requests, prompts of {ctx} tokens, page {PAGE}, stride {STRIDE}; "
        f"{args.rounds} rounds of {args.steps} steps, interleaved"
    )
    ours_us, base_us = statistics.median(a) * 1e6, statistics.median(b) * 1e6
    print(f"  kvoffload (offload_kv_cache, its share of the check): {ours_us:7.2f} µs/request-step")
    print(f"  SGLang-shaped offload_kv_cache, before its copy:      {base_us:7.2f} µs/request-step")
    print(f"  ratio kvoffload / SGLang-shaped: {ratio:.2f}x (median of per-round ratios)")


if __name__ == "__main__":
    main()
