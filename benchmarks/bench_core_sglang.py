"""kvoffload's core per request-step beside SGLang 0.5.23's own decode offload manager,
in one process, rounds interleaved (issue 25, point 3: "the kept side-by-side
measurement").

The rows, each ``--requests`` running requests (512), page 16, stride 64, a round one
stride of decode steps, at 16-token and at ``--long``-token (32k) prompts:

- **kvoffload per-request**: ``lc.extend([token])`` for each request, then
  ``mgr.poll()``, on a :class:`~kvoffload.SyncOffloadManager` whose copies move no bytes
  (``bench_bookkeeping.Kvo``: its chunks are due, keyed, submitted and delivered);
- **kvoffload extend_batch**: ``mgr.extend_batch(lifecycles, tokens)`` for the same
  step, then ``mgr.poll()``;
- **SGLang**: SGLang's real ``DecodeKVCacheOffloadManager`` built by
  ``bench_sglang.sglang_engine`` (its real ``__init__``, ``ReqToTokenPool``,
  ``MHATokenToKVPool``, allocator, host pool and ``HiCacheController`` on the CPU; the
  device copy and the storage tier acknowledged at once, as there), doing exactly
  what SGLang's scheduler has it do per decode iteration: ``check_offload_progress()``
  once per iteration (disaggregation/decode.py, ``process_decode_queue``: queue sizes,
  the finished copies' page hashes and storage writes, the finished backups' host
  pages freed), and for each request the sampled token appended to ``req.output_ids``
  (SGLang's manager reads its tokens from there: what ``[token]`` is to kvoffload) and
  ``offload_kv_cache(req)`` (batch_result_processor.py, per running request)
  (the row lookup, ``origin_input_ids + output_ids[:-1]``, the stride arithmetic, and
  every stride the device slice, ``cache_controller.write`` and the ack bookkeeping).
  Its stride is set through SGLang's own ``SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE``.

Every round ends with its copies delivered on both sides: kvoffload's last ``poll()``
after the copies end, SGLang's two closing ``check_offload_progress()`` calls (the
copies' acks, then their backups'), all timed. Ratios are medians of per-round ratios.
Needs sglang (``.venv-sglang``); without it the script says so and exits 2.

    python benchmarks/bench_core_sglang.py [--requests 512] [--long 32768] [--rounds 9]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import bench_bookkeeping as bb
from _machine import describe, spread, target_line
from bench_sglang import Req, sglang_engine

PAGE, STRIDE = bb.PAGE, bb.STRIDE  # 16, 64
SHORT = 16
TARGET = 0.15  # kvoffload / SGLang per request-step (issue 25, point 3)
FLAT = 1.1  # the long prompt's step / the 16-token step, kvoffload per-request


class SGLangSide:
    """SGLang's own manager and its running requests (one manager for both prompt
    lengths, as one scheduler holds one: a round of one batch leaves nothing queued
    for the other)."""

    def __init__(self, mgr: Any, rows: Any, reqs: dict[int, list[Req]]) -> None:
        self.mgr = mgr
        self.rows = rows
        self.reqs = reqs

    def round(self, prompt: int) -> float:
        """Seconds per request-step of one stride (copies, hashes and backups included)."""
        mgr, batch = self.mgr, self.reqs[prompt]
        check, offload = mgr.check_offload_progress, mgr.offload_kv_cache
        t0 = time.perf_counter()
        for _ in range(STRIDE):
            check()
            for r in batch:
                r.output_ids.append(7)
                offload(r)
        check()  # the last step's copies: their acks (page hashes, storage writes) ...
        check()  # ... and their backups (host pages freed)
        return (time.perf_counter() - t0) / (len(batch) * STRIDE)


def sglang_side(n: int, long: int, steps: int) -> SGLangSide | None:
    """SGLang's manager (stride ``STRIDE``) on SGLang's real pools, with ``n`` requests at
    each prompt length; None when sglang does not import here."""
    per_req = {p: -(-(p + steps + 4 * STRIDE) // PAGE) for p in (SHORT, long)}
    n_pages = n * sum(per_req.values()) + 1
    os.environ["SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE"] = str(STRIDE)
    real = sglang_engine(2 * n, n_pages, max(per_req.values()) * PAGE, PAGE)
    if real is None:
        return None
    rows, _alloc, build = real
    mgr = build()
    assert mgr.offload_stride == STRIDE and mgr.page_size == PAGE, (mgr.offload_stride, mgr.page_size)
    import torch

    r2t = rows.req_to_token
    reqs: dict[int, list[Req]] = {}
    first = 1
    for k, p in enumerate((SHORT, long)):
        reqs[p] = []
        for i in range(n):
            row = 1 + k * n + i  # row 0 is SGLang's padding
            pages = per_req[p]
            r2t[row, : pages * PAGE] = torch.arange(first * PAGE, (first + pages) * PAGE, dtype=torch.int32)
            first += pages
            reqs[p].append(Req(k * n + i, p, row))
    side = SGLangSide(mgr, rows, reqs)
    for r in reqs[SHORT] + reqs[long]:  # admission: the prefill's page hashes, once
        mgr.offload_kv_cache(r)
    return side


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--long", type=int, default=32768, help="the long prompts' tokens")
    ap.add_argument("--rounds", type=int, default=bb.ROUNDS)
    args = ap.parse_args()
    n, long = args.requests, args.long
    bb.ROUNDS = max(bb.ROUNDS, args.rounds)  # (Kvo sizes its device pool by it)
    steps = STRIDE * (args.rounds + 1)
    sgl = sglang_side(n, long, steps)
    if sgl is None:
        print("bench_core_sglang: sglang does not import here (run it in .venv-sglang)", file=sys.stderr)
        return 2
    rows: dict[str, Callable[[], float]] = {}
    kvos: list[bb.Kvo] = []
    for p in (SHORT, long):
        for batched in (False, True):
            k = bb.Kvo(n, p, batched)
            kvos.append(k)
            rows[f"{'extend_batch' if batched else 'per-request'} {p}"] = k.round
        rows[f"sglang {p}"] = partial(sgl.round, p)
    out: dict[str, list[float]] = {name: [] for name in rows}
    names = list(rows)
    gc.collect()
    try:
        for fn in rows.values():
            fn()  # warm-up
        for r in range(args.rounds):  # interleaved, the order rotating (no place favoured)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                out[name].append(rows[name]())
    finally:
        for k in kvos:
            k.close()
        sgl.mgr.release_host_resources()

    def ratios(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(out[a], out[b], strict=True)]

    print(describe())
    print(
        f"kvoffload core beside SGLang 0.5.23's DecodeKVCacheOffloadManager (real __init__, pools, "
        f"controller; device copy and store acknowledged at once), {n} running requests, page {PAGE}, "
        f"stride {STRIDE}; {args.rounds} rounds of {STRIDE} steps, rows interleaved; ratios: median of "
        "per-round ratios"
    )
    label = {SHORT: "16 tokens", long: f"{long // 1024}k tokens" if long % 1024 == 0 else f"{long} tokens"}
    print(f"  {'µs per request-step':<34}{'median':>8}   range")
    for name in names:
        what, p = name.rsplit(" ", 1)
        xs = [x * 1e6 for x in out[name]]
        print(f"  {what + ', ' + label[int(p)]:<34}{statistics.median(xs):>8.3f}   {spread(xs, '.3f')}")
    results = []
    for p in (SHORT, long):
        for path in ("per-request", "extend_batch"):
            xs = ratios(f"{path} {p}", f"sglang {p}")
            name = f"ratio kvoffload {path}/sglang {label[p]}"
            line = target_line(name, statistics.median(xs), TARGET, at_most=True, xs=xs)
            results.append(statistics.median(xs) <= TARGET)
            print(line)
    flat = ratios(f"per-request {long}", f"per-request {SHORT}")
    results.append(statistics.median(flat) <= FLAT)
    print(
        target_line(
            f"ratio kvoffload per-request {label[long]}/16 tokens",
            statistics.median(flat),
            FLAT,
            at_most=True,
            xs=flat,
        )
    )
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
