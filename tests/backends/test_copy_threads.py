"""CPU copies off the main thread start no OpenMP team (kvoffload.backends._threaded).

What must hold: a torch CPU op big enough to run in parallel, called on a thread of
kvoffload's (a copy stream, a load thread), would start a second OpenMP team of torch's
intra-op threads next to the model's; libgomp then throttles every team's spin-wait,
the model's too, and a vLLM CPU engine decoded about 1.3x slower while kvoffload stored
(issue 22's ``decode kvoffload/none``). So a copy on such a thread adds no OS thread to
the process, and copies exactly the bytes the torch path copies, for every page plan
(block runs and scattered pages, both directions) and dtypes numpy lacks (bfloat16).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy  # noqa: F401 - imported here, on the main thread: its own threads start now
import pytest
import torch
from support import PlainIssuer

import kvoffload as kvo
from kvoffload.abc import Transfer
from kvoffload.backends import CpuBackend
from kvoffload.backends._threaded import copy_pages, copy_pages_h2d
from kvoffload.pools import EnginePages, HostPool

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc (Linux)"
)


def _native_threads() -> set[int]:
    """OS threads of this process that are not Python threads (OpenMP workers among them)."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - python


@pytest.fixture
def two_intra_op_threads() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a team has workers even on a one-core runner
    yield
    torch.set_num_threads(before)


def test_a_copy_on_a_stream_thread_starts_no_openmp_team(two_intra_op_threads: None) -> None:
    """A CpuBackend copy of pages far above torch's parallel grain, on its stream
    thread, leaves the process with the native threads it had (the main thread's team
    already running), where torch's own copy on that thread starts a team."""
    config = kvo.OffloadConfig(
        page_size=256, stride=256, device_pages=8, host_pages=8, kv_shape=(2, 128), dtype="float32"
    )  # a page: 65,536 items, twice torch's parallel grain
    b = CpuBackend()
    dev, host = b.create_pools(config)
    dev.tensor.normal_()
    # the main thread's team is up (its workers are counted before): a parallel op and
    # the check's own indexing, both run here first
    assert torch.equal(host.tensor[[0, 1, 4, 5]] + 1, host.tensor[[0, 1, 4, 5]].add(1))
    b.open(dev, host)
    before = _native_threads()
    pages = [0, 1, 3, 6], [0, 1, 4, 5]  # device pages 0, 1: a block run; 3, 6 scattered
    t = Transfer(PlainIssuer(), *pages, [], 0, 4 * 256, 0.0)
    b.submit(t)
    b.launch()
    done: list[Any] = []
    while not done:
        assert b.wait_ready(30), "the copy did not finish in 30 s"
        done.extend(b.take_completions())
    assert done == [(t.id, None)]
    assert torch.equal(host.tensor[[0, 1, 4, 5]], dev.tensor[[0, 1, 3, 6]])
    assert _native_threads() - before == set(), "a copy on the stream thread started OpenMP workers"
    b.close()
    assert b.join(30)


def _engine(dtype: torch.dtype) -> tuple[EnginePages, HostPool, list[torch.Tensor]]:
    kv = [torch.randn(12, 4, 2, 64).to(dtype) for _ in range(2)]
    device = EnginePages(kv, 4)
    return device, HostPool.new(8, (device.page_bytes,), "uint8", zero=True), kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("device_pages", "host_pages"),
    [([2, 3, 4], [0, 1, 2]), ([9, 2, 7, 0], [5, 3, 4, 6])],
    ids=["run", "scattered"],
)
def test_the_single_threaded_copy_moves_what_the_torch_copy_moves(
    dtype: torch.dtype, device_pages: list[int], host_pages: list[int]
) -> None:
    """Out (d2h) on a worker thread, then back (h2d) into other pages on a worker
    thread: the host pages hold exactly what torch's copy on the main thread puts
    there, and the pages written back hold the source pages' bytes; no other device
    page changes."""
    device, host, kv = _engine(dtype)
    want_host = HostPool.new(8, (device.page_bytes,), "uint8", zero=True)
    copy_pages(device.copy_pairs(want_host), device_pages, host_pages)  # main thread: torch's copy

    def on_worker(fn: Any, *args: Any) -> None:
        err: list[BaseException] = []

        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # re-raised on the test's thread
                err.append(exc)

        th = threading.Thread(target=run)
        th.start()
        th.join(30)
        assert not th.is_alive() and not err, err

    on_worker(copy_pages, device.copy_pairs(host), device_pages, host_pages)
    assert torch.equal(host.tensor, want_host.tensor)
    back = [11 - k for k in range(len(device_pages))]  # pages none of the cases reads
    before = [t.clone() for t in kv]
    on_worker(copy_pages_h2d, device.copy_pairs(host), back, host_pages)
    for t, old in zip(kv, before, strict=True):
        for src, dst in zip(device_pages, back, strict=True):
            assert torch.equal(t[dst].view(torch.uint8), old[src].view(torch.uint8))
        untouched = [p for p in range(12) if p not in back]
        assert torch.equal(t[untouched].view(torch.uint8), old[untouched].view(torch.uint8))
