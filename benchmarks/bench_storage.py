"""Storage write throughput: each kvoffload store next to the plain way of writing the
same bytes, measured side by side in one run.

    python benchmarks/bench_storage.py [--pages 512] [--page-kib 64] [--batch 16] [--repeat 5]

Rows: ``memory``; ``file`` (kvoffload FileStorage: header + CRC, temporary name,
rename) vs ``plain file`` (open/write/close of the raw page under its final name);
``redis`` (kvoffload RedisStorage: header + CRC, one pipeline per batch) vs ``plain
redis-py`` (a pipeline of SETs of the raw pages); and ``write-behind`` rows, which
run the same pages through an OffloadManager (sim copies) to each store. Redis is
KVOFFLOAD_REDIS_URL, or a redis-server this script starts on a loopback port (its
rows are left out if neither is available). Figures are the median of ``--repeat``
runs; ratios compare rows of this one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

import kvoffload as kvo
from kvoffload.abc import Storage
from kvoffload.keys import chain_keys
from kvoffload.storage.file import FileStorage
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend

Batches = list[tuple[list[str], list[bytes]]]


def make_batches(n_pages: int, page_bytes: int, batch: int, salt: int) -> Batches:
    keys = chain_keys(None, [salt * 10_000_000 + i for i in range(n_pages)], 1)
    blob = os.urandom(page_bytes)
    pages = [blob[i % 7 :] + blob[: i % 7] for i in range(n_pages)]  # distinct, cheap
    return [(keys[i : i + batch], pages[i : i + batch]) for i in range(0, n_pages, batch)]


async def time_store(store: Storage, batches: Batches) -> float:
    t0 = time.perf_counter()
    for keys, pages in batches:
        await store.put(keys, pages)
    return time.perf_counter() - t0


def plain_file_writes(root: Path, batches: Batches) -> float:
    t0 = time.perf_counter()
    made: set[Path] = set()
    for keys, pages in batches:
        for key, page in zip(keys, pages, strict=True):
            d = root / key[:2]
            if d not in made:
                d.mkdir(parents=True, exist_ok=True)
                made.add(d)
            with open(d / key, "wb") as f:
                f.write(page)
    return time.perf_counter() - t0


async def plain_redis_pipeline(url: str, batches: Batches) -> float:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)
    try:
        await client.ping()
        t0 = time.perf_counter()
        for keys, pages in batches:
            pipe = client.pipeline(transaction=False)
            for key, page in zip(keys, pages, strict=True):
                pipe.set("plain:" + key, page)
            await pipe.execute()
        return time.perf_counter() - t0
    finally:
        await client.aclose()


async def write_behind(storage: Storage, n_pages: int, page_bytes: int, batch: int) -> float:
    """Pages through the manager: one chunk of ``batch`` pages per request, copies
    completed by the sim backend, timed from their delivery to the last write (host
    pages read out, written, returned)."""
    page_size = 16
    elems = page_bytes // (page_size * 2)  # float16
    cfg = kvo.OffloadConfig(
        page_size=page_size,
        stride=page_size * batch,
        device_pages=n_pages + batch,
        host_pages=n_pages + batch,
        kv_shape=(elems,),
        offload_prompt=True,
    )
    backend = SimBackend()
    async with kvo.OffloadManager(cfg, backend=backend, storage=storage) as mgr:
        salt = int.from_bytes(os.urandom(3), "little")
        for r in range(n_pages // batch):
            mgr.admit(r, [salt + r * 100_000 + i for i in range(page_size * batch)]).finish()
        backend.complete_all()  # the sim copies device -> host now: not a storage cost
        t0 = time.perf_counter()
        await mgr.settle()
        elapsed = time.perf_counter() - t0
        assert mgr.statistics().pages_stored == n_pages // batch * batch
    return elapsed


def flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()


class OwnRedis:
    """A redis-server on a free loopback port, no persistence (only if none was given)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="kvo-bench-redis-")
        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        argv += ["--appendonly", "no", "--dir", self.dir]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        for _ in range(100):  # bounded: ~10 s
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(8).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError("redis-server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


async def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="pages per put (one chunk)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n, page_bytes, batch = args.pages, args.page_kib * 1024, args.batch
    shape = (n, page_bytes, batch)

    own: OwnRedis | None = None
    url = os.environ.get("KVOFFLOAD_REDIS_URL")
    if not url and shutil.which("redis-server"):
        own = OwnRedis()
        url = own.url
    tmp = Path(tempfile.mkdtemp(prefix="kvo-bench-"))
    results: dict[str, list[float]] = {}

    async def redis_store(batches: Batches) -> float:
        from kvoffload.storage.redis import RedisStorage

        assert url is not None
        rs = RedisStorage(url, prefix="bench:")
        try:
            await rs.get(["warm-up"])  # connect before timing, as the plain client does
            return await time_store(rs, batches)
        finally:
            await rs.aclose()

    async def redis_write_behind(_: Batches) -> float:
        from kvoffload.storage.redis import RedisStorage

        assert url is not None
        return await write_behind(RedisStorage(url, prefix="wb:"), *shape)

    try:
        for rep in range(args.repeat):
            batches = make_batches(n, page_bytes, batch, salt=rep + 1)
            d = tmp / f"r{rep}"
            runs: list[tuple[str, Callable[[Batches], Awaitable[float]]]] = [
                ("memory", lambda b: time_store(MemoryStorage(), b)),
                ("file", lambda b, d=d: time_store(FileStorage(d / "kvo"), b)),
                ("plain file", lambda b, d=d: asyncio.to_thread(plain_file_writes, d / "plain", b)),
                ("write-behind -> memory", lambda b: write_behind(MemoryStorage(), *shape)),
                ("write-behind -> file", lambda b, d=d: write_behind(FileStorage(d / "wb"), *shape)),
            ]
            if url:
                runs += [
                    ("redis", redis_store),
                    ("plain redis-py", lambda b: plain_redis_pipeline(url, b)),
                    ("write-behind -> redis", redis_write_behind),
                ]
            # Rotate the order each round, so no row always runs first (cold disk/cache).
            for name, run in runs[rep % len(runs) :] + runs[: rep % len(runs)]:
                if url:
                    flush(url)
                results.setdefault(name, []).append(await run(batches))
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if own is not None:
            own.close()

    mb = n * page_bytes / 1e6
    print(
        f"storage writes: {n} pages x {args.page_kib} KiB ({mb:.1f} MB), {batch} pages per batch, "
        f"median of {args.repeat}; python {sys.version.split()[0]}, {os.cpu_count()} cpu(s)"
    )
    print(f"{'store':<24} {'pages/s':>10} {'MB/s':>9}  vs plain")
    baseline = {"file": "plain file", "redis": "plain redis-py"}
    for name, times in results.items():
        t = statistics.median(times)
        pages = n // batch * batch if name.startswith("write-behind") else n
        line = f"{name:<24} {pages / t:>10.0f} {pages * page_bytes / 1e6 / t:>9.1f}"
        if name in baseline and baseline[name] in results:
            line += f"  {statistics.median(results[baseline[name]]) / t:.2f}x"
        print(line)
    if not url:
        print("redis: skipped (no KVOFFLOAD_REDIS_URL and no redis-server installed)")


if __name__ == "__main__":
    asyncio.run(main())
