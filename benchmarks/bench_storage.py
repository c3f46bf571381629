"""Storage write throughput: each kvoffload store next to the plain way of writing the
same bytes, measured side by side in one run, rounds interleaved.

    python benchmarks/bench_storage.py [--pages 512] [--page-kib 64] [--batch 16] [--rounds 9]

The pages are rows of a host pool (as the storage writer hands them over), written in
batches of ``--batch`` pages (one chunk each):

- ``file``: ``FileStorage.put_pages`` (record header + XXH3-64, temporary name,
  ``O_NOFOLLOW`` opens under the root, rename) vs ``plain file``: for each page,
  open a temporary name, write the raw page, close, rename it over the real name.
  Both on tmpfs (``/dev/shm`` when it exists, else ``--dir``), both one worker-thread
  hop per batch (as any store that keeps the event loop free), neither fsyncs. The
  target is against this writer. Beside it, with no target, ``plain file, dir fds``:
  the same writer opening each name relative to its directory's descriptor as the
  store does (no path walked per page), against a second ``file (2)`` row: the part
  of the store's margin that its way of opening gives it.
- ``redis``: ``RedisStorage.put_pages`` (record header + XXH3-64, one round trip per
  batch) vs ``plain redis-py``: a redis-py pipeline of SETs of the raw pages, each
  client connected before the clock starts.
- ``write-behind``: the same pages through an OffloadManager (sim copies) to each
  store, timed from delivery to the last write.
- ``mooncake``: ``MooncakeStore.put_pages`` (record header + XXH3-64 and the page staged
  in a registered arena, one ``batch_upsert_from`` per batch) vs ``raw mooncake``:
  ``batch_put_from`` of the raw pages straight from the pool on the same client and
  master (one worker-thread hop per batch on both sides); then reads of what each
  wrote into the pool's pages: ``get_into`` (``batch_get_into`` into a registered
  arena, header and checksum checked there, then the page copied) vs
  ``batch_get_into`` straight into the pool. The master is KVOFFLOAD_MOONCAKE_URL
  (scripts/mooncake.sh), or a ``mooncake_master`` and a memory server this script
  starts on loopback ports (its rows are left out without the ``kvoffload[mooncake]``
  wheel). What each round wrote there is removed after it.
- ``read``: ``get_into`` of each round's pages into the pool (file, redis, mooncake).

Every round runs every row once, in an order rotated each round. The pairs a target
compares (file / plain file, redis / plain redis-py, mooncake / raw mooncake, each
way) are timed batch by batch, the two sides alternating which goes first, and a
pair's ratio in a round is the median over its batches of (plain time / kvoffload
time), so that a burst of the machine's load falls on one pair of batches, not on one
side of a round. (Redis was timed as whole rows: the row that wrote first after a
pause paid for the server's memory coming back - on a VM that hands freed memory to
its host - and the kvoffload row ran first in most rounds.) The median over rounds is
printed with its range over rounds and its verdict against
the targets of issue 25 (file >= 0.9), issue 11 (redis >= 0.92) and issue 23 (mooncake
write and read >= 0.9 of raw). Redis is KVOFFLOAD_REDIS_URL, or a redis-server this
script starts on a loopback port (its rows are left out if neither is available). The
checksum table times each candidate on one page of this run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio.to_thread
import structlog
from _machine import describe, spread, target_line

import kvoffload as kvo
from kvoffload.abc import Storage
from kvoffload.keys import chain_keys
from kvoffload.pools import HostPool, page_views
from kvoffload.storage.file import FileStorage
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend

#: Lower bounds of kvoffload / plain (issue 25 point 5, issue 11, issue 23 point 5).
TARGETS = {"file": 0.9, "redis": 0.92, "mooncake": 0.9}

Batches = list[tuple[list[str], list[int]]]
#: One batch's work: (keys, host pages) -> awaitable.
BatchFn = Callable[[list[str], list[int]], Awaitable[object]]


def make_pool(n_pages: int, page_bytes: int) -> HostPool:
    import torch

    pool = HostPool.create(n_pages, 1, (page_bytes,), "uint8")
    pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, dtype=torch.uint8))
    return pool


def make_batches(n_pages: int, batch: int, salt: int) -> Batches:
    keys = chain_keys(None, [salt * 10_000_000 + i for i in range(n_pages)], 1)
    pages = list(range(n_pages))
    return [(keys[i : i + batch], pages[i : i + batch]) for i in range(0, n_pages, batch)]


async def time_store(store: Storage, pool: HostPool, batches: Batches) -> float:
    t0 = time.perf_counter()
    for keys, pages in batches:
        await store.put_pages(keys, pool, pages)
    return time.perf_counter() - t0


async def time_pair(a: BatchFn, b: BatchFn, batches: Batches, first: int) -> tuple[float, float, float]:
    """Times of ``a`` and ``b`` over the same batches, and the median over batches of
    (b's time / a's time). Batch by batch, the two sides alternate which goes first
    (``first`` picks the side of batch 0): a pair is a millisecond or two apart, so a
    burst of the machine's load falls on one pair, not on one side of a round."""
    ta = tb = 0.0
    ratios: list[float] = []
    for i, (keys, pages) in enumerate(batches):
        order = ((a, 0), (b, 1)) if (i + first) % 2 == 0 else ((b, 1), (a, 0))
        dt = [0.0, 0.0]
        for fn, side in order:
            t0 = time.perf_counter()
            await fn(keys, pages)
            dt[side] = time.perf_counter() - t0
        ta, tb = ta + dt[0], tb + dt[1]
        ratios.append(dt[1] / dt[0])
    return ta, tb, statistics.median(ratios)


def _plain_batch(root: Path, keys: list[str], views: list[memoryview]) -> None:
    for key, view in zip(keys, views, strict=True):
        d = root / key[:2]
        tmp = d / f".{key}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, view)
        finally:
            os.close(fd)
        os.replace(tmp, d / key)


def _plain_batch_dirfd(root: Path, keys: list[str], views: list[memoryview]) -> None:
    """The plain writer with the store's way of opening: each name relative to a
    descriptor of its directory (one per directory per batch), no path walked per page."""
    root.mkdir(parents=True, exist_ok=True)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    dirs: dict[str, int] = {}
    try:
        for key, view in zip(keys, views, strict=True):
            dfd = dirs.get(key[:2])
            if dfd is None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(key[:2], 0o700, dir_fd=root_fd)
                dfd = dirs[key[:2]] = os.open(key[:2], os.O_RDONLY | os.O_DIRECTORY, dir_fd=root_fd)
            fd = os.open(f".{key}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
            try:
                os.write(fd, view)
            finally:
                os.close(fd)
            os.replace(f".{key}.tmp", key, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        for fd in dirs.values():
            os.close(fd)
        os.close(root_fd)


def plain_file_batch(root: Path, pool: HostPool, *, dirfd: bool = False) -> BatchFn:
    """The plain writer of one batch: one worker-thread hop, as the store's."""
    write = _plain_batch_dirfd if dirfd else _plain_batch

    async def run(keys: list[str], pages: list[int]) -> None:
        await anyio.to_thread.run_sync(write, root, keys, page_views(pool, pages))

    return run


def plain_redis_batch(client: Any, pool: HostPool) -> BatchFn:
    """The plain writer of one batch: a redis-py pipeline of SETs of the raw pages."""

    async def run(keys: list[str], pages: list[int]) -> None:
        pipe = client.pipeline(transaction=False)
        for key, view in zip(keys, page_views(pool, pages), strict=True):
            pipe.set("plain:" + key, view)
        await pipe.execute()

    return run


async def redis_pair(url: str, pool: HostPool, batches: Batches, first: int) -> tuple[float, float, float]:
    """RedisStorage.put_pages against the plain pipeline, paired batch by batch (as the
    file and mooncake pairs): both clients connected before the clock starts."""
    import redis.asyncio

    from kvoffload.storage.redis import RedisStorage

    rs = RedisStorage(url, prefix="bench:")
    client = redis.asyncio.Redis.from_url(url)
    try:
        await rs.get(["warm-up"])
        await client.ping()
        return await time_pair(store_write(rs, pool), plain_redis_batch(client, pool), batches, first)
    finally:
        await rs.aclose()
        await client.aclose()


async def write_behind(storage: Storage, n_pages: int, page_bytes: int, batch: int) -> float:
    """Pages through the manager: one chunk of ``batch`` pages per request, copies
    completed by the sim backend, timed from their delivery to the last write."""
    page_size = 16
    cfg = kvo.OffloadConfig(
        page_size=page_size,
        stride=page_size * batch,
        device_pages=n_pages + batch,
        host_pages=n_pages + batch,
        kv_shape=(page_bytes // page_size,),
        dtype="uint8",
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


class OwnMooncake:
    """A mooncake_master and a memory server (``memory_mb``) on free loopback ports."""

    def __init__(self, memory_mb: int) -> None:
        import mooncake

        bin_dir = Path(next(iter(mooncake.__path__)))
        ports = []
        for _ in range(3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        self.port, metrics, client = ports
        self.dir = tempfile.mkdtemp(prefix="kvo-bench-mooncake-")
        master = [str(bin_dir / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}"]
        master += ["--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--default_kv_lease_ttl=200"]
        memory = [str(bin_dir / "mooncake_client"), "--host=127.0.0.1", "--metadata_server=P2PHANDSHAKE"]
        memory += [f"--master_server_address=127.0.0.1:{self.port}", f"--port={client}", "--protocol=tcp"]
        memory += [f"--global_segment_size={memory_mb << 20}"]
        log = open(Path(self.dir) / "log", "wb")  # noqa: SIM115 - the children hold it
        self.procs = [subprocess.Popen(master, stdout=log, stderr=log)]
        self._wait(self.port)
        self.procs.append(subprocess.Popen(memory, stdout=log, stderr=log))
        self._wait(client)
        log.close()
        self.url = f"mooncake://127.0.0.1:{self.port}"

    def _wait(self, port: int) -> None:
        for _ in range(150):  # bounded: ~15 s
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError("mooncake did not start: " + (Path(self.dir) / "log").read_text()[-2000:])

    def close(self) -> None:
        from kvoffload.storage.mooncake import close_clients

        close_clients()
        for p in reversed(self.procs):
            p.terminate()
            p.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


async def time_reads(store: Storage, pool: HostPool, batches: Batches) -> float:
    """``get_into`` of each batch's keys into its pool pages (what a load does)."""
    from kvoffload.drivers._base import load_buffers

    t0 = time.perf_counter()
    for keys, pages in batches:
        n = await store.get_into(keys, load_buffers(pool, pages))
        assert n == len(keys), f"{store!r}: read {n} of {len(keys)}"
    return time.perf_counter() - t0


def raw_mooncake(client: object, op: str, pool: HostPool) -> BatchFn:
    """``batch_put_from`` / ``batch_get_into`` of one batch's raw pages from / into the
    pool, one worker-thread hop (as any store that keeps the event loop free)."""
    base = pool.tensor.data_ptr()
    size = pool.tensor[0].numel() * pool.tensor.element_size()
    call = getattr(client, "batch_put_from" if op == "write" else "batch_get_into")
    want = 0 if op == "write" else size

    async def run(keys: list[str], pages: list[int]) -> None:
        names, ptrs = ["raw:" + k for k in keys], [base + p * size for p in pages]
        codes = await anyio.to_thread.run_sync(call, names, ptrs, [size] * len(pages))
        assert all(c == want for c in codes), f"raw mooncake {op}: {codes}"

    return run


def store_write(store: Storage, pool: HostPool) -> BatchFn:
    async def run(keys: list[str], pages: list[int]) -> None:
        await store.put_pages(keys, pool, pages)

    return run


def store_read(store: Storage, pool: HostPool) -> BatchFn:
    from kvoffload.drivers._base import load_buffers

    async def run(keys: list[str], pages: list[int]) -> None:
        n = await store.get_into(keys, load_buffers(pool, pages))
        assert n == len(keys), f"{store!r}: read {n} of {len(keys)}"

    return run


def forget_mooncake(store: Storage, batches: Batches) -> None:
    """Remove what a round wrote on the master (both sides), so that a run of any
    length fits a memory server; untimed. A key a read lease still holds stays."""
    from kvoffload.storage.mooncake import MooncakeStore

    assert isinstance(store, MooncakeStore)
    keys = [k for ks, _ in batches for k in ks]
    names = [store.prefix + k for k in keys] + ["raw:" + k for k in keys]
    store._client.batch_remove(names, True)


def checksum_table(page: memoryview) -> list[tuple[str, float]]:
    """(name, GB/s) of each checksum candidate on ``page``, best of several runs."""
    import xxhash

    candidates: list[tuple[str, Callable[[memoryview], object]]] = [
        ("zlib.crc32 (record v1)", zlib.crc32),
        ("xxh3_64 (record v2)", xxhash.xxh3_64_intdigest),
    ]
    try:
        import crc32c

        candidates.append((f"crc32c ({'hardware' if crc32c.hardware_based else 'software'})", crc32c.crc32c))
    except ImportError:
        candidates.append(("crc32c (not installed)", lambda _: None))
    out = []
    for name, fn in candidates:
        if "not installed" in name:
            out.append((name, float("nan")))
            continue
        t = min(timeit.repeat(lambda fn=fn: fn(page), number=200, repeat=5)) / 200
        out.append((name, page.nbytes / t / 1e9))
    return out


async def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="pages per put (one chunk)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dir", type=Path, default=None, help="where files go (default /dev/shm, else $TMPDIR)")
    args = ap.parse_args()
    n, page_bytes, batch = args.pages, args.page_kib * 1024, args.batch
    shape = (n, page_bytes, batch)
    base = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir()))
    tmp = Path(tempfile.mkdtemp(prefix="kvo-bench-", dir=base))
    pool = make_pool(n, page_bytes)

    ap_mc = os.environ.get("KVOFFLOAD_MOONCAKE_URL")
    own_mc: OwnMooncake | None = None
    mc_store = None
    try:
        import mooncake.store  # noqa: F401 - needs libibverbs1

        from kvoffload.storage.mooncake import MooncakeStore

        if not ap_mc:
            own_mc = OwnMooncake(256 + (4 * n * page_bytes >> 20))  # a round's pages, twice: removed after
            ap_mc = own_mc.url
        mc_store = MooncakeStore(f"{ap_mc}?prefix=bench:&global_segment_size=0")
        warm = make_batches(batch, batch, salt=0)
        await time_store(mc_store, pool, warm)  # the staging arenas are made and registered
        await time_reads(mc_store, pool, warm)
    except ImportError:
        ap_mc = None

    own: OwnRedis | None = None
    url = os.environ.get("KVOFFLOAD_REDIS_URL")
    if not url and shutil.which("redis-server"):
        own = OwnRedis()
        url = own.url
    results: dict[str, list[float]] = {}

    async def redis_write_behind(_: Batches) -> float:
        from kvoffload.storage.redis import RedisStorage

        assert url is not None
        return await write_behind(RedisStorage(url, prefix="wb:"), *shape)

    # A row: the names it fills and what times them (one time per name, in order).
    Times = Callable[[Batches], Awaitable[tuple[float, ...]]]
    Row = tuple[tuple[str, ...], Times]

    def single(fn: Callable[[Batches], Awaitable[float]]) -> Times:
        async def run(b: Batches) -> tuple[float, ...]:
            return (await fn(b),)

        return run

    def pair(a: BatchFn, b: BatchFn, first: int) -> Times:
        return lambda batches: time_pair(a, b, batches, first)

    # pair_ratios[kvoffload row]: a pair's per-round ratio (plain / kvoffload).
    pair_ratios: dict[str, list[float]] = {}

    def record(names: tuple[str, ...], times: tuple[float, ...]) -> None:
        for name, t in zip(names, times[:2] if len(names) == 2 else times, strict=True):
            results.setdefault(name, []).append(t)
        if len(names) == 2:
            pair_ratios.setdefault(names[0], []).append(times[2])

    try:
        for rnd in range(args.rounds):
            batches = make_batches(n, batch, salt=rnd + 1)
            d = tmp / f"r{rnd}"
            fs = FileStorage(d / "kvo")
            file_pair = pair(store_write(fs, pool), plain_file_batch(d / "plain", pool), rnd)
            fs2 = FileStorage(d / "kvo2")
            dirfd_pair = pair(
                store_write(fs2, pool), plain_file_batch(d / "plain2", pool, dirfd=True), rnd + 1
            )
            runs: list[Row] = [
                (("file", "plain file"), file_pair),
                (("file (2)", "plain file, dir fds"), dirfd_pair),
                (("memory",), single(lambda b: time_store(MemoryStorage(), pool, b))),
                (
                    ("write-behind -> file",),
                    single(lambda b, d=d: write_behind(FileStorage(d / "wb"), *shape)),
                ),
            ]
            if url:
                runs += [
                    (("redis", "plain redis-py"), functools.partial(redis_pair, url, pool, first=rnd)),
                    (("write-behind -> redis",), single(redis_write_behind)),
                ]
            if mc_store is not None:  # the raw calls beside, on the same client
                raw_w = raw_mooncake(mc_store._client, "write", pool)
                runs.append((("mooncake", "raw mooncake"), pair(store_write(mc_store, pool), raw_w, rnd)))
            for names, run in runs[rnd % len(runs) :] + runs[: rnd % len(runs)]:
                if url:
                    flush(url)
                record(names, await run(batches))
            # reads of what the rows above wrote ("file" and "mooncake"; redis: written now)
            reads: list[Row] = [(("file read",), single(lambda b, fs=fs: time_reads(fs, pool, b)))]
            if url:
                from kvoffload.storage.redis import RedisStorage

                rs = RedisStorage(url, prefix="bench:")
                await time_store(rs, pool, batches)
                reads.append((("redis read",), single(lambda b, rs=rs: time_reads(rs, pool, b))))
            if mc_store is not None:
                raw_r = raw_mooncake(mc_store._client, "read", pool)
                mc_read = pair(store_read(mc_store, pool), raw_r, rnd + 1)
                reads.append((("mooncake read", "raw mooncake read"), mc_read))
            for names, run in reads[rnd % len(reads) :] + reads[: rnd % len(reads)]:
                record(names, await run(batches))
            if url:
                await rs.aclose()
            if mc_store is not None:
                forget_mooncake(mc_store, batches)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if own is not None:
            own.close()
        if mc_store is not None:
            await mc_store.aclose()
        if own_mc is not None:
            own_mc.close()

    mb = n * page_bytes / 1e6
    print(describe())
    print(
        f"storage writes: {n} pages x {args.page_kib} KiB ({mb:.1f} MB), {batch} pages per batch, "
        f"{args.rounds} rounds interleaved; files on {base}; python {sys.version.split()[0]}, "
        f"{os.cpu_count()} cpu(s)"
    )
    print(f"{'store':<24} {'pages/s':>10} {'MB/s':>9}")
    for name, times in results.items():
        t = statistics.median(times)
        pages = n // batch * batch if name.startswith("write-behind") else n
        print(f"{name:<24} {pages / t:>10.0f} {pages * page_bytes / 1e6 / t:>9.1f}")
    print(
        "kvoffload vs plain, median over rounds of each round's ratio (plain time / kvoffload time; "
        "paired rows: a round's median over its batches):"
    )
    for store, plain in (("file", "plain file"), ("redis", "plain redis-py")):
        if store not in results or plain not in results:
            print(
                f"ratio kvoffload/{plain}: skipped (no Redis: KVOFFLOAD_REDIS_URL, or install redis-server)"
            )
            continue
        ratios = pair_ratios.get(store) or [
            p / k for p, k in zip(results[plain], results[store], strict=True)
        ]
        name = f"ratio kvoffload/{plain}"
        print(target_line(name, statistics.median(ratios), TARGETS[store], at_most=False, xs=ratios))
    if "file (2)" in pair_ratios:  # no target: what the store's own way of opening is worth
        xs = pair_ratios["file (2)"]
        print(f"ratio kvoffload/plain file, dir fds: {statistics.median(xs):.3f} (no target; {spread(xs)})")
    for op, kvo_row in (("write", "mooncake"), ("read", "mooncake read")):
        name = f"ratio kvoffload/raw mooncake {op}"
        if kvo_row not in results:
            print(f"{name}: skipped (pip install 'kvoffload[mooncake]')")
            continue
        ratios = pair_ratios[kvo_row]
        print(target_line(name, statistics.median(ratios), TARGETS["mooncake"], at_most=False, xs=ratios))
    print(f"checksums on one {args.page_kib} KiB page:")
    for name, gbs in checksum_table(page_views(pool, [0])[0]):
        print(f"  {name:<26} {gbs:>7.2f} GB/s")


if __name__ == "__main__":
    asyncio.run(main())
