"""The load path on the file store without the event loop's hops (the worker's
``Mover`` and the scheduler's ``PrefixLookup``, no vLLM needed).

What must hold: a synchronous load on the file store reads both halves on the load
threads through the store's blocking read (never its async API on the writer's loop),
and its blocks get exactly their pages' bytes; a page that fails its checksum or is
missing stops the load there and every block from it on is a load error (vLLM
recomputes it, F38); a read that hangs is waited for at most ``io_timeout_s`` and then
counts as nothing loaded, every block an error (F38: a request never waits for ever
on the store); the lookup counts the same prefix on its own thread as the stores' async
``exists_prefix`` does, the smallest over tensor-parallel ranks.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from connector_fakes import fill_store

from kvoffload.integrations.vllm_messages import LoadJob
from kvoffload.integrations.vllm_worker import Mover, PrefixLookup, block_tensors, rank_stores
from kvoffload.pools import HostPool
from kvoffload.storage.file import FileStorage
from kvoffload.storage.gate import WriteGate
from kvoffload.storage.memory import MemoryStorage
from kvoffload.storage.writer import ThreadWriter, WritePolicy

NB, BS, N = 40, 4, 12


def _mover(store: FileStorage, io_timeout_s: float = 30.0) -> tuple[Mover, list[torch.Tensor]]:
    layers = [torch.zeros(NB, 2, BS, 8) for _ in range(3)]
    tensors = [t for i, kv in enumerate(layers) for t in block_tensors(kv, NB, BS, f"l{i}")]
    return Mover(tensors, block_size=BS, host_pages=32, storage=store, io_timeout_s=io_timeout_s), layers


def _block(layers: list[torch.Tensor], b: int) -> bytes:
    return b"".join(kv[b].contiguous().view(torch.uint8).numpy().tobytes() for kv in layers)


def _no_async_reads(store: FileStorage) -> None:
    async def refused(*_: object) -> int:
        raise AssertionError("the load went through the store's async API")

    store.get_into_parts = refused  # type: ignore[method-assign]
    store.get_into = refused  # type: ignore[method-assign]
    store.exists_prefix = refused  # type: ignore[method-assign]


@pytest.mark.parametrize("damage", [None, "checksum 3", "missing 9"])
def test_a_sync_load_on_the_file_store_reads_blocking_on_the_load_threads(
    tmp_path: Path, damage: str | None
) -> None:
    store = FileStorage(tmp_path)
    m, layers = _mover(store)
    try:
        keys = [f"p{i}" for i in range(N)]
        pages = fill_store(m, store, keys, 2)
        want = N
        if damage is not None:
            what, at = damage.split()
            want = int(at)
            path = store.path(keys[want])
            if what == "missing":
                path.unlink()
            else:
                raw = bytearray(path.read_bytes())
                raw[-5] ^= 0x5A
                path.write_bytes(bytes(raw))
        _no_async_reads(store)
        threads: list[str] = []
        real = m._read_copy

        def spy(j: LoadJob, start: int, stop: int) -> int:
            threads.append(threading.current_thread().name)
            return real(j, start, stop)

        m._read_copy = spy  # type: ignore[method-assign]
        blocks = list(range(30, 30 - N, -1))
        job = LoadJob(1, "r1", keys, blocks, list(range(31, 31 - N, -1)), sync=True)
        m._load(job)
        ((got_job, loaded, error),) = list(m._loaded)
        assert got_job is job and loaded == want and error is None
        assert len(threads) == 2 and all("vllm-load-half" in t for t in threads), threads
        for i in range(want):
            assert _block(layers, blocks[i]) == pages[i]
        m.poll()
        assert m.take_load_errors() == set(blocks[want:])
    finally:
        m.close()


def test_a_small_or_async_load_on_the_file_store_is_bounded_too(tmp_path: Path) -> None:
    """A read that hangs: the load ends after io_timeout_s with nothing loaded and every
    block an error (recomputed); the engine thread is never held longer (F38)."""
    store = FileStorage(tmp_path)
    m, _layers = _mover(store, io_timeout_s=0.05)
    release = threading.Event()
    try:
        keys = [f"p{i}" for i in range(N)]
        fill_store(m, store, keys, 2)
        assert m._blocking is not None
        real, real_cached = m._blocking.read, m._blocking.cached

        def hangs(k: list[str], parts: list[list[memoryview]]) -> int:
            release.wait(30)
            return real(k, parts)

        def cached_hangs(k: list[str], parts: list[list[memoryview]], gate: WriteGate) -> int:
            release.wait(30)  # (its open or header read waits on the disk)
            return real_cached(k, parts, gate)

        m._blocking.read = hangs
        m._blocking.cached = cached_hangs
        for jid, sync, n in ((1, True, N), (2, True, 3), (3, False, 3)):
            job = LoadJob(jid, f"r{jid}", keys[:n], list(range(n)), list(range(n)), sync=sync)
            m._load(job)
            ((got_job, loaded, error),) = list(m._loaded)
            m._loaded.clear()
            assert got_job is job and loaded == 0 and error is not None, (jid, error)
    finally:
        release.set()
        m.close()


def test_the_lookup_counts_on_its_own_thread_what_exists_prefix_counts(tmp_path: Path) -> None:
    inner = FileStorage(tmp_path)
    io = ThreadWriter(inner, HostPool.new(1, (1,), "uint8"), WritePolicy())
    io.start()
    try:
        ranks = rank_stores(inner, 2)
        keys = [f"k{i}" for i in range(6)]
        io.call(ranks[0].put(keys, [b"x" * 8] * 6), 30)
        io.call(ranks[1].put(keys[:4], [b"y" * 8] * 4), 30)
        lookup = PrefixLookup(ranks, io, 30.0)
        for r in ranks:
            _no_async_reads(r.inner)  # type: ignore[attr-defined]
        assert lookup(keys) == 4 and lookup(keys[:3]) == 3 and lookup([]) == 0
        assert lookup(["nothing", *keys]) == 0
        lookup.close()
        # a store without blocking reads: the async route, all ranks at once
        mem = MemoryStorage()
        io.call(mem.put(keys[:2], [b"z" * 8] * 2), 30)
        assert PrefixLookup([mem], io, 30.0)(keys) == 2
    finally:
        io.stop()
        io.join(10)


def test_the_load_stage_benchmark_runs_and_prints_its_targets() -> None:
    """benchmarks/bench_vllm_load.py stays working (two rounds of small loads): it
    prints the machine first and a verdict per target (the figures are its own)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm_load.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--rounds", "2", "--pages", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("machine:"), proc.stdout
    for name in ("lookup now/async:", "load now/async:", "load now/floor:"):
        (line,) = [ln for ln in lines if ln.startswith(name)]
        assert "target" in line and ("ok" in line or "MISSED" in line) and "rounds" in line, line
