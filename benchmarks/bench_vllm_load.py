"""The stages of kvoffload's synchronous load inside vLLM, in isolation (no engine):
what ``bench_vllm.py``'s kvoffload column does before its first token, on the same
shapes (issue 22 point 6). Runs wherever kvoffload and torch import::

    python benchmarks/bench_vllm_load.py [--rounds 30] [--pages 49]

A file store of ``--pages`` records of one vLLM block each (8 layers of 256 KiB: the
benchmark model's, 2 MiB a page), read back into a CPU KV cache's block views (blocks
in the reversed order vLLM hands them out). Stages, rounds interleaved (each round runs
every stage once, in a rotated order), medians and ranges over rounds:

- **lookup**: the scheduler's ``PrefixLookup`` (the page headers: an open, one
  ``fstat`` and a ``pread`` each), through the file store's blocking read on a lookup
  thread of its own (now), or through its async ``exists_prefix`` on the I/O writer's
  event loop (the async route, every other store's: a hop to the loop, one to the
  store's thread);
- **load**: the worker's ``Mover`` loading the pages straight into the blocks (two
  halves at once, xxh3 checked), blocking reads on the load threads from the page
  cache (now), or the async route every store without blocking reads takes: its
  ``get_into`` on the writer's loop into the load's host pages, then copied into the
  blocks (a read that may outlive its wait never writes the blocks themselves);
- **floor**: the same bytes with no kvoffload at all: ``preadv`` of each payload into
  its blocks plus its xxh3, two halves on two threads (load), or the headers' open /
  ``pread`` / close on the calling thread (lookup).

Printed: the machine, each stage's median and range (ms), then the targets (medians of
per-round ratios): the file store's route no slower than the async route, for the
lookup and the load, and the load within 1.25x of its floor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from _machine import describe, spread, target_line

LAYERS, BLOCKS, BS, KV_HEADS, HEAD_DIM = 8, 160, 32, 8, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--pages", type=int, default=49, help="pages loaded (bench_vllm's prefix: 49)")
    a = p.parse_args()
    print(describe())

    import torch
    import xxhash

    from kvoffload.abc import Storage
    from kvoffload.integrations.vllm_messages import LoadJob
    from kvoffload.integrations.vllm_worker import Mover, PrefixLookup, block_tensors
    from kvoffload.pools import HostPool
    from kvoffload.storage._record import header_size
    from kvoffload.storage.file import FileStorage
    from kvoffload.storage.writer import ThreadWriter, WritePolicy

    class AsyncOnly(Storage):
        """The file store seen through its async API only: the async route."""

        name = "file"

        def __init__(self, inner: FileStorage) -> None:
            self.inner = inner

        async def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> None:
            await self.inner.put(keys, pages)

        async def get(self, keys: Sequence[str]) -> list[bytes | None]:
            return await self.inner.get(keys)

        async def get_into(self, keys: Sequence[str], dest: Sequence[memoryview]) -> int:
            return await self.inner.get_into(keys, dest)

        async def get_into_parts(self, keys: Sequence[str], dest: Sequence[Sequence[memoryview]]) -> int:
            return await self.inner.get_into_parts(keys, dest)

        async def exists_prefix(self, keys: Sequence[str]) -> int:
            return await self.inner.exists_prefix(keys)

    n = a.pages
    root = tempfile.mkdtemp(prefix="bench-vllm-load-")
    movers: list[Mover] = []
    io = None
    try:
        store = FileStorage(root)
        layers = [torch.zeros(BLOCKS, KV_HEADS, BS, 2 * HEAD_DIM) for _ in range(LAYERS)]
        tensors = [t for i, kv in enumerate(layers) for t in block_tensors(kv, BLOCKS, BS, f"l{i}")]
        now = Mover(tensors, block_size=BS, host_pages=n, storage=store)
        before = Mover(tensors, block_size=BS, host_pages=n, storage=AsyncOnly(store))
        movers += [now, before]
        page_bytes = now.device.page_bytes
        print(
            f"{n} pages of {page_bytes / 2**20:.1f} MiB ({LAYERS} layers x "
            f"{page_bytes // LAYERS // 1024} KiB), file store under {root}; {a.rounds} rounds"
        )
        keys = [f"{i:04x}" + "ab" * 30 for i in range(n)]
        pages = [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8).numpy().tobytes() for _ in keys]
        assert now.writer is not None
        now.writer.call(store.put(keys, pages), 120)
        del pages
        io = ThreadWriter(store, HostPool.new(1, (1,), "uint8"), WritePolicy())
        io.start()
        look_now = PrefixLookup([store], io, 30.0)
        look_before = PrefixLookup([AsyncOnly(store)], io, 30.0)
        blocks = list(range(BLOCKS - 1, BLOCKS - 1 - n, -1))
        views = now._block_views
        assert views is not None
        floor_threads = ThreadPoolExecutor(max_workers=2)
        jobs = iter(range(1, 10**9))

        def load(m: Mover) -> None:
            job = LoadJob(next(jobs), "r", keys, blocks, list(range(n)), sync=True)
            m._load(job)
            ((_, got, err),) = list(m._loaded)
            m._loaded.clear()
            assert got == n and err is None, (got, err)

        def floor_half(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                fd = os.open(store.path(keys[i]), os.O_RDONLY)
                try:
                    parts = [memoryview(v[blocks[i]]) for v in views]
                    os.preadv(fd, parts, header_size(keys[i]))
                    h = xxhash.xxh3_64()
                    for part in parts:
                        h.update(part)
                finally:
                    os.close(fd)

        def floor_load() -> None:
            half = n // 2
            f = [floor_threads.submit(floor_half, 0, half), floor_threads.submit(floor_half, half, n)]
            for x in f:
                x.result()

        def floor_lookup() -> None:
            for k in keys:
                fd = os.open(store.path(k), os.O_RDONLY)
                try:
                    os.fstat(fd)
                    os.pread(fd, header_size(k), 0)
                finally:
                    os.close(fd)

        def check_lookup(look: PrefixLookup) -> None:
            assert look(keys) == n

        stages: dict[str, Callable[[], None]] = {
            "lookup now": lambda: check_lookup(look_now),
            "lookup async": lambda: check_lookup(look_before),
            "lookup floor": floor_lookup,
            "load now": lambda: load(now),
            "load async": lambda: load(before),
            "load floor": floor_load,
        }
        for fn in stages.values():  # warm: threads started, pages in the page cache
            fn()
        ms: dict[str, list[float]] = {k: [] for k in stages}
        names = list(stages)
        for r in range(a.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t = time.perf_counter()
                stages[name]()
                ms[name].append((time.perf_counter() - t) * 1e3)
        for name, xs in ms.items():
            print(f"{name:<14} median {statistics.median(xs):7.3f} ms  ({spread(xs, '.3f')})")

        def ratios(num: str, den: str) -> list[float]:
            return [x / y for x, y in zip(ms[num], ms[den], strict=True)]

        for label, num, den, target, at_most in (
            ("lookup now/async", "lookup now", "lookup async", 1.0, True),
            ("load now/async", "load now", "load async", 1.0, True),
            ("load now/floor", "load now", "load floor", 1.25, True),
            ("lookup now/floor", "lookup now", "lookup floor", None, True),
        ):
            xs = ratios(num, den)
            med = statistics.median(xs)
            if target is None:
                print(f"{label}: {med:.3f} (no target; {spread(xs)})")
            else:
                print(target_line(label, med, target, at_most=at_most, xs=xs))
        look_now.close()
        look_before.close()
        floor_threads.shutdown()
    finally:
        for m in movers:
            m.close()
        if io is not None:
            io.stop()
            io.join(10)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
