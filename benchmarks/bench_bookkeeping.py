"""Per-step bookkeeping cost of kvoffload against two baselines, in one run.

Steps, each for 512 live requests on the SimBackend:
  extend  — one decode step that submits nothing (a token is committed);
  submit  — a step that completes a stride and submits a chunk (keys, host pages);
  deliver — a completion delivered to its lifecycle (the batch loop of the manager).

Baselines doing the same steps:
  dict    — SGLang-style bookkeeping: per-request dicts keyed by request id, a free
            list of pages, the same SHA-256 key chain; no state machine, no checks.
  async   — a `transitions` AsyncMachine per request driving the same states.

Memory: library overhead per live lifecycle for 100,000 lifecycles (tracemalloc,
after admit, prompt of one page; the prompt tokens' own storage is excluded by
admitting page-aligned prompts, which leave no tail).

Targets (issue 2): within 2x of `dict`, at least 20x faster than `async`,
under 1 KB per lifecycle. Logging runs at its default: structlog is not configured,
so kvoffload's per-step debug events are off; the cost of that level-off gate is
printed too.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import statistics
import time
import timeit
import tracemalloc
from typing import Any

import structlog

import kvoffload as kvo
from kvoffload.testing import SimBackend

N = 512
PAGE = 16
STRIDE = 16
ROUNDS = 7


def cfg(n: int = N) -> kvo.OffloadConfig:
    return kvo.OffloadConfig(
        page_size=PAGE,
        stride=STRIDE,
        device_pages=n * 12,
        host_pages=n * 4,
        kv_shape=(1,),
        dtype="uint8",
    )


# --- kvoffload ----------------------------------------------------------------------------


async def bench_kvoffload() -> dict[str, float]:
    backend = SimBackend()
    out: dict[str, list[float]] = {"extend": [], "submit": [], "deliver": []}
    async with kvo.OffloadManager(cfg(), backend=backend) as mgr:
        lcs = [mgr.admit(f"r{i}", list(range(PAGE))) for i in range(N)]
        tok = [7]
        for _ in range(ROUNDS):
            # STRIDE - 1 steps that submit nothing ...
            t0 = time.perf_counter()
            for _ in range(STRIDE - 1):
                for lc in lcs:
                    lc.extend(tok)
            t1 = time.perf_counter()
            out["extend"].append((t1 - t0) / (N * (STRIDE - 1)))
            # ... then one that submits a chunk for every request.
            t0 = time.perf_counter()
            for lc in lcs:
                lc.extend(tok)
            t1 = time.perf_counter()
            out["submit"].append((t1 - t0) / N)
            pending = list(backend.pending)
            backend.pending.clear()
            backend._signalled += len(pending)  # signalled without moving bytes
            batch = [(t, None) for t in pending]
            t0 = time.perf_counter()
            mgr._deliver_batch(batch)  # what the delivery task does with a batch
            t1 = time.perf_counter()
            del batch
            out["deliver"].append((t1 - t0) / N)
            mgr.check_invariants()
        for lc in lcs:
            lc.abort()
    return {k: statistics.median(v) for k, v in out.items()}


# --- baseline: SGLang-style dicts ----------------------------------------------------------


def sha_chain(prev: str | None, tokens: list[int]) -> list[str]:
    keys = []
    for i in range(0, len(tokens), PAGE):
        h = hashlib.sha256(bytes.fromhex(prev)) if prev else hashlib.sha256()
        for t in tokens[i : i + PAGE]:
            h.update(t.to_bytes(4, "little", signed=False))
        prev = h.hexdigest()
        keys.append(prev)
    return keys


def sha_chain_fast(prev: str | None, tokens: list[int]) -> list[str]:
    import struct

    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    keys = []
    for i in range(0, len(packed), 4 * PAGE):
        h = hashlib.sha256(bytes.fromhex(prev)) if prev else hashlib.sha256()
        h.update(packed[i : i + 4 * PAGE])
        prev = h.hexdigest()
        keys.append(prev)
    return keys


def bench_dict() -> dict[str, float]:
    free_dev = list(range(N * 12))
    free_host = list(range(N * 4))
    reqs: dict[str, dict[str, Any]] = {}
    ops: dict[int, tuple[str, list[int]]] = {}
    for i in range(N):
        rid = f"r{i}"
        reqs[rid] = {
            "tokens": list(range(PAGE)),
            "pages": [free_dev.pop()],
            "done": PAGE,
            "last_hash": sha_chain_fast(None, list(range(PAGE)))[-1],
            "inflight": 0,
            "finished": False,
        }
    rids = list(reqs)
    out: dict[str, list[float]] = {"extend": [], "submit": [], "deliver": []}
    latencies: list[float] = []
    next_op = 0

    def step(rid: str, tokens: list[int]) -> None:
        nonlocal next_op
        st = reqs[rid]
        toks = st["tokens"]
        toks.extend(tokens)
        if len(toks) > len(st["pages"]) * PAGE:
            st["pages"].append(free_dev.pop())
        if len(toks) - st["done"] >= STRIDE:
            n = (len(toks) - st["done"]) // STRIDE * STRIDE
            seg = toks[st["done"] : st["done"] + n]
            keys = sha_chain_fast(st["last_hash"], seg)
            host = [free_host.pop() for _ in range(n // PAGE)]
            st["last_hash"] = keys[-1]
            st["done"] += n
            st["inflight"] += 1
            ops[next_op] = (rid, host, time.time())
            next_op += 1

    tok = [7]
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(STRIDE - 1):
            for rid in rids:
                step(rid, tok)
        t1 = time.perf_counter()
        out["extend"].append((t1 - t0) / (N * (STRIDE - 1)))
        t0 = time.perf_counter()
        for rid in rids:
            step(rid, tok)
        t1 = time.perf_counter()
        out["submit"].append((t1 - t0) / N)
        done = list(ops)
        t0 = time.perf_counter()
        for op in done:  # as SGLang's check_offload_progress: pop, latency, release if last
            rid, host, start = ops.pop(op)
            st = reqs[rid]
            st["inflight"] -= 1
            latencies.append(time.time() - start)
            if st["finished"] and st["inflight"] == 0:
                free_dev.extend(st["pages"])
                del reqs[rid]
            free_host.extend(host)
        latencies.clear()
        t1 = time.perf_counter()
        out["deliver"].append((t1 - t0) / N)
    return {k: statistics.median(v) for k, v in out.items()}


# --- baseline: a transitions AsyncMachine per request ----------------------------------------


class _Req:
    """A model whose guards read the two facts the declaration's guards are over."""

    def __init__(self) -> None:
        self.inflight = 0
        self.deferred = False

    def guard_idle(self) -> bool:
        return self.inflight == 0 and not self.deferred

    def guard_busy(self) -> bool:
        return not self.guard_idle()

    def guard_drained(self) -> bool:
        return self.inflight == 0

    def guard_copying(self) -> bool:
        return self.inflight > 0


def _machine(cls: Any, model: Any) -> Any:
    from kvoffload.lifecycle.table import _machine_transitions

    return cls(
        model=model,
        states=[s.name for s in kvo.LifecycleState],
        initial="PENDING",
        transitions=_machine_transitions(kvo.SPEC),
        auto_transitions=False,
    )


async def bench_transition_async_machine(n: int = 64) -> float:
    """Seconds per transition with a transitions AsyncMachine per request."""
    from transitions.extensions.asyncio import AsyncMachine

    reqs = [_Req() for _ in range(n)]
    for m in reqs:
        _machine(AsyncMachine, m)
    times: list[float] = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for m in reqs:
            await m.extend()  # type: ignore[attr-defined]
            m.inflight += 1
            await m.submit()  # type: ignore[attr-defined]
            m.inflight -= 1
            await m.chunk_done()  # type: ignore[attr-defined]
        times.append((time.perf_counter() - t0) / (3 * n))
    return statistics.median(times)


def bench_transition_machine(n: int = 64) -> float:
    """Seconds per transition with a (sync) transitions Machine per request."""
    from transitions import Machine

    reqs = [_Req() for _ in range(n)]
    for m in reqs:
        _machine(Machine, m)
    times: list[float] = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for m in reqs:
            m.extend()  # type: ignore[attr-defined]
            m.inflight += 1
            m.submit()  # type: ignore[attr-defined]
            m.inflight -= 1
            m.chunk_done()  # type: ignore[attr-defined]
        times.append((time.perf_counter() - t0) / (3 * n))
    return statistics.median(times)


async def bench_transition_table(n: int = 512) -> float:
    """Seconds per transition through the compiled table (OffloadManager._fire)."""
    from kvoffload.lifecycle.table import EVENT_INDEX

    ext, sub, done = EVENT_INDEX["extend"], EVENT_INDEX["submit"], EVENT_INDEX["chunk_done"]
    async with kvo.OffloadManager(cfg(), backend=SimBackend()) as mgr:
        lcs = [mgr.admit(i, []) for i in range(n)]
        fire = mgr._fire
        times: list[float] = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            for lc in lcs:
                fire(lc, ext)
                lc.inflight += 1
                fire(lc, sub)
                lc.inflight -= 1
                fire(lc, done)
            times.append((time.perf_counter() - t0) / (3 * n))
        for lc in lcs:
            lc.abort()
    return statistics.median(times)


# --- memory ------------------------------------------------------------------------------


async def bench_memory(n: int = 100_000) -> float:
    config = kvo.OffloadConfig(
        page_size=PAGE, stride=STRIDE, device_pages=n + 1, host_pages=4, kv_shape=(1,), dtype="uint8"
    )
    async with kvo.OffloadManager(config, backend=SimBackend()) as mgr:
        prompt = list(range(PAGE))
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        lcs = [mgr.admit(i, prompt) for i in range(n)]
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        total = sum(s.size_diff for s in after.compare_to(before, "filename"))
        # the caller's own list of references is not library overhead
        total -= lcs.__sizeof__()
        for lc in lcs:
            lc.abort()
    return total / n


def main() -> None:
    ours = asyncio.run(bench_kvoffload())
    base = bench_dict()
    print(f"per-step bookkeeping, {N} live requests, median of {ROUNDS} rounds (µs per request-step)")
    print(f"{'step':<10}{'kvoffload':>12}{'dict':>10}{'kvo/dict':>10}")
    for k in ("extend", "submit", "deliver"):
        print(f"{k:<10}{ours[k] * 1e6:>12.3f}{base[k] * 1e6:>10.3f}{ours[k] / base[k]:>9.2f}x")
    decode = {k: (ours[k], base[k]) for k in ("extend", "submit", "deliver")}
    step_ours = ((STRIDE - 1) * decode["extend"][0] + decode["submit"][0] + decode["deliver"][0]) / STRIDE
    step_base = ((STRIDE - 1) * decode["extend"][1] + decode["submit"][1] + decode["deliver"][1]) / STRIDE
    print(
        f"{'mean step':<10}{step_ours * 1e6:>12.3f}{step_base * 1e6:>10.3f}{step_ours / step_base:>9.2f}x"
        f"   (a stride of {STRIDE} decode steps: {STRIDE - 1} extends, 1 submit, 1 delivery)"
    )
    table = asyncio.run(bench_transition_table())
    machine = bench_transition_machine()
    amachine = asyncio.run(bench_transition_async_machine())
    print("per transition (µs): compiled table, transitions Machine, AsyncMachine (one per request)")
    print(
        f"  table {table * 1e6:.3f}   Machine {machine * 1e6:.3f} ({machine / table:.0f}x)"
        f"   AsyncMachine {amachine * 1e6:.3f} ({amachine / table:.0f}x)"
    )
    print(
        f"  a whole decode step, AsyncMachine-based (dict + one AsyncMachine transition): "
        f"{(step_base + amachine) * 1e6:.3f} µs = {(step_base + amachine) / step_ours:.1f}x kvoffload's"
    )
    from kvoffload.core.events import STRUCTLOG, debug_enabled

    def gate_check() -> bool:  # exactly the hot paths' test, minus the listeners read
        return bool(STRUCTLOG.is_configured and debug_enabled())

    empty = min(timeit.repeat(lambda: None, number=100_000, repeat=5)) / 100_000
    gate = min(timeit.repeat(gate_check, number=100_000, repeat=5)) / 100_000 - empty
    print(
        f"level-off event gate: {gate * 1e9:.0f} ns per transition "
        f"({gate / ours['extend']:.0%} of an extend step); structlog configured: {structlog.is_configured()}"
    )
    per = asyncio.run(bench_memory())
    print(f"memory: {per:.0f} bytes of library overhead per live lifecycle (100,000 live)")
    print("targets: kvo/dict <= 2.00x; AsyncMachine >= 20x the table; memory < 1024 bytes")


if __name__ == "__main__":
    main()
