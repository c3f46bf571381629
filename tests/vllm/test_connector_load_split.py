"""A synchronous load read and copied in two halves at once (the worker's
``Mover._read_copy_split``, no vLLM needed): it runs before the forward, when the
engine's cores are free.

What must hold: the blocks get exactly their pages' bytes, as a load in one piece gives
them; a load reports its leading pages loaded whichever half comes back short, so every
block past the first page missing is reported as a load error (vLLM recomputes it, F38);
both halves have ended when the load is reported; an asynchronous load is not split.
"""

from __future__ import annotations

import threading

import pytest
import torch
from connector_fakes import fill_store

from kvoffload.integrations import vllm_worker
from kvoffload.integrations.vllm_messages import LoadJob
from kvoffload.integrations.vllm_worker import Mover, block_tensors
from kvoffload.storage.memory import MemoryStorage

NB, BS, N = 40, 4, 12


def _mover() -> tuple[Mover, list[torch.Tensor], MemoryStorage]:
    layers = [torch.zeros(NB, 2, BS, 8) for _ in range(3)]
    tensors = [t for i, kv in enumerate(layers) for t in block_tensors(kv, NB, BS, f"l{i}")]
    store = MemoryStorage()
    return Mover(tensors, block_size=BS, host_pages=32, storage=store), layers, store


def _block(layers: list[torch.Tensor], b: int) -> bytes:
    return b"".join(kv[b].contiguous().view(torch.uint8).numpy().tobytes() for kv in layers)


@pytest.mark.parametrize("missing", [None, 3, 9], ids=["whole", "first half short", "second half short"])
def test_a_split_sync_load_reports_its_leading_pages_and_their_bytes(missing: int | None) -> None:
    m, layers, store = _mover()
    try:
        keys = [f"p{i}" for i in range(N)]
        pages = fill_store(m, store, keys, 1, missing)
        blocks = list(range(30, 30 - N, -1))  # reversed, as vLLM hands them
        job = LoadJob(1, "r1", keys, blocks, list(range(31, 31 - N, -1)), sync=True)
        halves: list[str] = []
        real = m._read_copy

        def spy(j: LoadJob, start: int, stop: int) -> int:
            halves.append(f"{start}:{stop} on {threading.current_thread().name}")
            return real(j, start, stop)

        m._read_copy = spy  # type: ignore[method-assign,assignment]
        m._load(job)
        ((got_job, loaded, error),) = list(m._loaded)
        want = N if missing is None else missing
        assert got_job is job and loaded == want and error is None
        assert sorted(h.split(" on ")[0] for h in halves) == ["0:6", "6:12"]
        assert any("vllm-load-half" in h for h in halves), halves  # the second half on its thread
        for i in range(want):
            assert _block(layers, blocks[i]) == pages[i]
        m.poll()
        assert m.take_load_errors() == set(blocks[want:])
    finally:
        m.close()


def test_an_async_load_or_a_small_one_is_read_in_one_piece() -> None:
    m, _layers, store = _mover()
    try:
        keys = [f"p{i}" for i in range(N)]
        fill_store(m, store, keys, 1)
        calls: list[tuple[int, int]] = []
        real = m._read_copy

        def spy(j: LoadJob, start: int, stop: int) -> int:
            calls.append((start, stop))
            return real(j, start, stop)

        m._read_copy = spy  # type: ignore[method-assign,assignment]
        m._load(LoadJob(1, "r1", keys, list(range(N)), list(range(N)), sync=False))
        small = vllm_worker._SPLIT_MIN - 1
        m._load(
            LoadJob(
                2, "r2", keys[:small], list(range(20, 20 + small)), list(range(20, 20 + small)), sync=True
            )
        )
        assert calls == [(0, N), (0, small)]
    finally:
        m.close()
