"""Copy backends, measured side by side in one run (a benchmark, not a test).

Prints, for the cpu backend (and, on a GPU, the cuda backend):

Structlog is set to INFO here (the library's debug events are then never built).

1. copy throughput through the backend (submit -> completion, whole chunks of pages)
   against a raw torch copy of the same bytes, trials interleaved; target >= 80%;
2. completion latency from the copy's end (on the copy thread) to the lifecycle's
   ``chunk_done`` transition on the loop: median and p99, one chunk at a time (idle
   loop) and in decode steps of 8 chunks; target median under 200 µs;
3. CPU time the event loop thread spends per completed chunk (admit, extend, submit,
   delivery and transition included), from ``time.thread_time()``;
4. engine-owned memory (issue 10): the cpu backend copying from an engine-shaped
   ``device_kv`` (2 x 32 per-layer tensors, each ``(num_pages, page_size, heads, dim)``)
   into host pages laid out as a page of every tensor, against raw per-tensor copies of
   the same bytes into per-tensor host buffers, trials interleaved; target >= 70%; the
   scattered-pages gather's GB/s beside raw per-tensor gathers.

Usage: ``python benchmarks/bench_copy.py [--quick]``; exits 1 when a target is MISSED.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch
from _machine import describe, spread, verdict

import kvoffload as kvo
from kvoffload.abc import EventBackend, Transfer
from kvoffload.backends import CpuBackend
from kvoffload.backends._threaded import ThreadedBackend


class _Owner:
    id = 0
    rid = "bench"
    tag = None


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _backend_copy(backend: EventBackend, chunks: list[tuple[list[int], list[int]]]) -> float:
    """Seconds to submit every chunk and receive every completion."""
    t0 = time.perf_counter()
    for dev, host in chunks:
        backend.submit(Transfer(_Owner(), dev, host, [], 0, 0, 0.0))
    backend.launch()  # the driver's next turn: the accepted copies start
    n = 0
    while n < len(chunks):
        batch = await backend.wait_completions()
        for _, err in batch:
            assert err is None, err
        n += len(batch)
    return time.perf_counter() - t0


async def throughput(
    make: Callable[[], EventBackend], config: kvo.OffloadConfig, chunk_pages: int, trials: int
) -> dict[str, float]:
    backend = make()
    device, host = backend.create_pools(config)
    backend.open(device, host)
    device.tensor.normal_()
    n = config.device_pages
    page_bytes = device.tensor[0].numel() * device.tensor.element_size()
    total = n * page_bytes
    contiguous = [
        (list(range(i, i + chunk_pages)), list(range(i, i + chunk_pages))) for i in range(0, n, chunk_pages)
    ]
    # Pages as the pool hands them out over time: runs, reversed, interleaved requests.
    order = list(range(n))
    scattered_dev = [p for k in range(4) for p in order[k::4]]
    scattered = [
        (scattered_dev[i : i + chunk_pages], list(range(i, i + chunk_pages)))
        for i in range(0, n, chunk_pages)
    ]
    is_cuda = device.tensor.is_cuda

    def raw(chunked: bool) -> float:
        """The same bytes by hand: one copy_ of the pool, or one per chunk, this thread."""
        t0 = time.perf_counter()
        if chunked:
            for i in range(0, n, chunk_pages):
                host.tensor[i : i + chunk_pages].copy_(
                    device.tensor[i : i + chunk_pages], non_blocking=is_cuda
                )
        else:
            host.tensor.copy_(device.tensor, non_blocking=is_cuda)
        if is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    raw(False)
    await _backend_copy(backend, contiguous)
    runs: dict[str, list[float]] = {"raw": [], "raw_chunks": [], "contiguous": [], "scattered": []}
    for _ in range(trials):  # interleaved, so drift hits all alike
        runs["raw"].append(raw(False))
        runs["raw_chunks"].append(raw(True))
        runs["contiguous"].append(await _backend_copy(backend, contiguous))
        runs["scattered"].append(await _backend_copy(backend, scattered))
    assert torch.equal(
        host.tensor[list(range(chunk_pages))].cpu(), device.tensor[scattered_dev[:chunk_pages]].cpu()
    )
    await backend.aclose()
    out: dict[str, float] = {"bytes": total}
    for k, v in runs.items():
        out[k] = total / statistics.median(v) / 1e9
    # Ratios per interleaved trial, then their median: robust to a noisy, shared machine.
    for k in ("contiguous", "scattered"):
        for base in ("raw", "raw_chunks"):
            out[f"{k}/{base}"] = statistics.median(r / b for r, b in zip(runs[base], runs[k], strict=True))
    RANGES["contiguous/raw"] = [r / b for r, b in zip(runs["raw"], runs["contiguous"], strict=True)]
    return out


async def _latency_run(
    make: Callable[[], EventBackend], config: kvo.OffloadConfig, n_chunks: int, mode: str
) -> tuple[float, float, int]:
    """Latencies (µs) from a copy's end on its thread to its chunk_done transition."""
    backend = make()
    copy_end: dict[int, int] = {}
    if isinstance(backend, ThreadedBackend):
        backend.hooks.after = lambda t: copy_end.__setitem__(t.id, time.perf_counter_ns())
    lat: list[float] = []
    last = [0]
    done = asyncio.Event()

    def listen(name: str, f: dict[str, Any]) -> None:
        # transfer.completed and then its lifecycle's transition are one synchronous step.
        if name == "transfer.completed":
            last[0] = f["transfer"]
        elif name == "lifecycle.transition" and f["trigger"] == "chunk_done":
            lat.append((time.perf_counter_ns() - copy_end[last[0]]) / 1e3)
            done.set()

    async with kvo.OffloadManager(config, backend=backend) as mgr:
        mgr.add_listener(listen)
        lcs = [mgr.admit(i, prompt=list(range(16))) for i in range(64)]
        for i in range(n_chunks):
            lc = lcs[i % len(lcs)]
            if mode == "paced":
                done.clear()
                lc.extend(list(range(16)))
                await done.wait()
                await asyncio.sleep(0.0002)  # the loop goes idle between chunks
            else:  # a decode step submits 8 chunks, then the loop is free for 0.5 ms
                lc.extend(list(range(16)))
                if i % 8 == 7:
                    await asyncio.sleep(0.0005)
            if lc.committed > 1000:
                lc.finish()
                await lc.wait_released()
                lcs[i % len(lcs)] = mgr.admit(i, prompt=list(range(16)))
        await mgr.wait_drained()
        for lc in lcs:
            lc.finish()
    block = max(1, len(lat) // 10)  # the medians of ten blocks of chunks in turn: its range
    RANGES[f"latency {mode}"] = [statistics.median(lat[i : i + block]) for i in range(0, len(lat), block)]
    return statistics.median(lat), _pct(lat, 0.99), len(lat)


async def latency_and_loop_cpu(make: Callable[[], EventBackend], n_chunks: int) -> dict[str, Any]:
    """Copy end -> chunk_done transition, paced (one chunk at a time) and in decode steps;
    and the loop thread's CPU time per completed chunk (a run with no listener)."""
    config = kvo.OffloadConfig(
        page_size=16, stride=16, device_pages=4096, host_pages=1024, kv_shape=(2, 64), dtype="float16"
    )
    results: dict[str, Any] = {}
    for mode in ("paced", "steps"):
        results[mode] = await _latency_run(make, config, n_chunks, mode)
    backend = make()
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        lcs = [mgr.admit(i, prompt=list(range(16))) for i in range(64)]
        c0 = time.thread_time()
        for i in range(n_chunks):
            lcs[i % 64].extend(list(range(16)))
            if i % 64 == 63:
                await mgr.wait_drained()
        await mgr.wait_drained()
        c1 = time.thread_time()
        chunks = mgr.statistics().chunks_copied
        wakeups = backend.inbox.wakeups if isinstance(backend, ThreadedBackend) else 0
        for lc in lcs:
            lc.finish()
    results["loop_cpu_us"] = (c1 - c0) / chunks * 1e6
    results["chunks"] = chunks
    results["wakeups"] = wakeups
    return results


async def engine_throughput(layers: int, chunk_pages: int, trials: int) -> dict[str, float]:
    """The cpu backend on an engine-shaped device_kv against raw per-tensor copies."""
    from kvoffload.pools import EnginePages

    page, heads, dim, n = 16, 2, 64, 256
    kv = [torch.randn(n, page, heads, dim).to(torch.float16) for _ in range(2 * layers)]
    device = EnginePages(kv, page)
    backend = CpuBackend()
    host = backend.create_host_pool(n, (device.page_bytes,), "uint8")
    backend.open(device, host)
    per_tensor = [torch.empty_like(t) for t in kv]  # the raw copy's per-tensor host buffers
    contiguous = [(list(range(i, i + chunk_pages)),) * 2 for i in range(0, n, chunk_pages)]
    scattered_dev = [p for k in range(4) for p in range(n)[k::4]]
    scattered = [
        (scattered_dev[i : i + chunk_pages], list(range(i, i + chunk_pages)))
        for i in range(0, n, chunk_pages)
    ]
    index = [torch.tensor(d, dtype=torch.long) for d, _ in scattered]

    def raw(gather: bool) -> float:
        t0 = time.perf_counter()
        for i, idx in zip(range(0, n, chunk_pages), index, strict=True):
            for t, out in zip(kv, per_tensor, strict=True):
                if gather:
                    torch.index_select(t, 0, idx, out=out[i : i + chunk_pages])
                else:
                    out[i : i + chunk_pages].copy_(t[i : i + chunk_pages])
        return time.perf_counter() - t0

    raw(False)
    await _backend_copy(backend, contiguous)
    runs: dict[str, list[float]] = {"raw": [], "raw_gather": [], "contiguous": [], "scattered": []}
    for _ in range(trials):
        runs["raw"].append(raw(False))
        runs["contiguous"].append(await _backend_copy(backend, contiguous))
        runs["raw_gather"].append(raw(True))
        runs["scattered"].append(await _backend_copy(backend, scattered))
    # The bytes landed as a page of every tensor, in order.
    want = b"".join(t[scattered_dev[0]].contiguous().view(torch.uint8).numpy().tobytes() for t in kv)
    assert host.tensor[0].numpy().tobytes() == want
    await backend.aclose()
    total = n * device.page_bytes
    out: dict[str, float] = {"bytes": total, "tensors": len(kv)}
    for k, v in runs.items():
        out[k] = total / statistics.median(v) / 1e9
    RANGES["engine contiguous/raw"] = [r / b for r, b in zip(runs["raw"], runs["contiguous"], strict=True)]
    out["contiguous/raw"] = statistics.median(RANGES["engine contiguous/raw"])
    out["scattered/raw_gather"] = statistics.median(
        r / b for r, b in zip(runs["raw_gather"], runs["scattered"], strict=True)
    )
    return out


#: The targets (docstring): copy throughput, completion latency, engine-owned copy.
TARGET_CONTIGUOUS, TARGET_LATENCY_US, TARGET_ENGINE = 0.8, 200.0, 0.7


#: The per-trial (per-block) values behind each figure with a target, for its range;
#: filled by the measurements of the backend being reported.
RANGES: dict[str, list[float]] = {}


def report_engine(tp: dict[str, float]) -> bool:
    """Print the engine-owned figures; True when the target was met."""
    print(f"== cpu backend, engine-owned device_kv ({tp['tensors']:.0f} per-layer tensors)")
    print(
        f"  copy of {tp['bytes'] / 2**20:.0f} MiB; GB/s: median of trials; ratios: median of per-trial ratios"
    )
    print(f"    raw: one copy_ per tensor per 32-page chunk    {tp['raw']:7.2f} GB/s")
    a = tp["contiguous/raw"]
    met = a >= TARGET_ENGINE
    print(f"    backend, contiguous pages                    {tp['contiguous']:7.2f} GB/s = {a:6.1%} of raw")
    print(
        f"    (target: >= {TARGET_ENGINE:.0%} of raw: {verdict(met)}; "
        f"{spread(RANGES.get('engine contiguous/raw', []), '.1%')})"
    )
    print(f"    raw: one index_select per tensor per chunk    {tp['raw_gather']:7.2f} GB/s")
    b = tp["scattered/raw_gather"]
    print(
        f"    backend, scattered device pages (gather)     {tp['scattered']:7.2f} GB/s "
        f"= {b:6.1%} of raw gathers"
    )
    return met


def report(name: str, tp: dict[str, float], lat: dict[str, Any], raw_name: str) -> bool:
    """Print one backend's figures, each target with its verdict; True when all were met."""
    print(f"== {name} backend")
    print(
        f"  copy of {tp['bytes'] / 2**20:.0f} MiB; GB/s: median of trials; ratios: median of per-trial ratios"
    )
    print(f"    raw: {raw_name:<40} {tp['raw']:7.2f} GB/s")
    print(f"    raw: the same, one copy_ per 32-page chunk        {tp['raw_chunks']:7.2f} GB/s")
    for k, label in (("contiguous", "contiguous pages"), ("scattered", "scattered device pages")):
        a, b = tp[f"{k}/raw"], tp[f"{k}/raw_chunks"]
        print(f"    backend, {label:<24} {tp[k]:7.2f} GB/s = {a:6.1%} of raw, {b:6.1%} of raw chunks")
    met = tp["contiguous/raw"] >= TARGET_CONTIGUOUS
    print(
        f"    (target: contiguous >= {TARGET_CONTIGUOUS:.0%} of raw: {verdict(met)}; "
        f"{spread(RANGES.get('contiguous/raw', []), '.1%')})"
    )
    for mode in ("paced", "steps"):
        med, p99, n = lat[mode]
        fast = med < TARGET_LATENCY_US
        met = met and fast
        print(
            f"  copy end -> chunk_done, {mode:<5} ({n} chunks): median {med:7.1f} µs, p99 {p99:7.1f} µs"
            f"   (target: median under {TARGET_LATENCY_US:.0f} µs: {verdict(fast)}; "
            f"{spread(RANGES.get(f'latency {mode}', []), '.1f')} µs, medians of 10 blocks of chunks)"
        )
    print(
        f"  event-loop CPU per completed chunk: {lat['loop_cpu_us']:.1f} µs "
        f"({lat['chunks']} chunks, {lat['wakeups']} loop wake-ups; submit, delivery, transitions; no target)"
    )
    return met


async def main(quick: bool) -> int:
    """Run every measurement; 0 when every target was met, 1 when one was MISSED."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    trials = 3 if quick else 7
    n_chunks = 500 if quick else 3000
    config = kvo.OffloadConfig(
        page_size=16, stride=16, device_pages=512, host_pages=512, kv_shape=(64, 128), dtype="float16"
    )
    threads = torch.get_num_threads()
    print(describe())
    print(f"torch {torch.__version__}, {threads} intra-op threads, python {sys.version.split()[0]}")
    print(f"page = {config.page_size} tokens x {config.kv_shape} {config.dtype}; chunks of 32 pages")
    tp = await throughput(CpuBackend, config, 32, trials)
    lat = await latency_and_loop_cpu(CpuBackend, n_chunks)
    met = report("cpu", tp, lat, "torch copy_ of the pool, one block")
    met = report_engine(await engine_throughput(32, 32, trials)) and met
    if torch.cuda.is_available():
        from kvoffload.backends import CudaBackend

        tp = await throughput(CudaBackend, config, 32, trials)
        lat = await latency_and_loop_cpu(CudaBackend, n_chunks)
        met = report("cuda", tp, lat, "pinned device->host copy_, one block") and met
    else:
        print("== cuda backend: skipped (no CUDA GPU: torch.cuda.is_available() is False)")
    print(f"targets: {'all ok' if met else 'some MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer trials and chunks")
    sys.exit(asyncio.run(main(ap.parse_args().quick)))
