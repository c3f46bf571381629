"""One fixture, ``harness``, that runs every backend contract test on every backend:
sim, cpu, cuda where a GPU is present (skipped with the reason elsewhere), and
``cuda-on-cpu``: the cuda backend's own code with torch.cuda's streams and events stood
in by CPU ones (``cuda_on_cpu.py``), everywhere.

A :class:`Harness` drives its backend the same way on each: ``make(...)`` builds a
transfer over chosen pages, ``collect(n)`` waits for ``n`` completions (completing
the sim's pending transfers, which otherwise never complete), ``fail(t)`` makes ``t``'s
copy fail, and ``gate`` holds copies in flight on the copy thread until released.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import anyio
import pytest
import pytest_asyncio
import torch

import kvoffload as kvo
from kvoffload.abc import Completion, EventBackend, Transfer
from kvoffload.backends import resolve_backend
from kvoffload.backends._threaded import ThreadedBackend
from kvoffload.pools import DevicePool, HostPool
from kvoffload.testing import SimBackend

CUDA = torch.cuda.is_available()
NO_GPU = (
    "no CUDA GPU here (torch.cuda.is_available() is False); "
    "the cuda backend's own code runs this test as cuda-on-cpu (CPU stand-ins of torch.cuda's "
    "streams and events) and its stream logic is tested in test_cuda_logic.py"
)


def _make(name: str) -> EventBackend:
    """Each backend as the suite runs it: threaded ones with two streams."""
    if name == "cpu":
        from kvoffload.backends import CpuBackend

        return CpuBackend(streams=2)
    if name == "cuda":
        from kvoffload.backends import CudaBackend

        return CudaBackend(streams=2)
    if name == "cuda-on-cpu":  # the cuda backend's own code, torch.cuda's streams stood in
        from cuda_on_cpu import gpu_less_cuda_backend

        return gpu_less_cuda_backend(streams=2)
    return resolve_backend(name)


BACKEND_PARAMS = [
    pytest.param("sim", id="sim"),
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not CUDA, reason=NO_GPU)),
    pytest.param("cuda-on-cpu", id="cuda-on-cpu"),
]

CONFIG = kvo.OffloadConfig(
    page_size=4, stride=4, device_pages=64, host_pages=64, kv_shape=(2, 16), dtype="float32"
)


class _Owner:
    """A stand-in for the lifecycle a transfer names (backends never read it)."""

    def __init__(self, i: int) -> None:
        self.id = i
        self.rid = f"r{i}"
        self.tag = None


class Harness:
    """A backend opened on its own pools, and the tools to drive it from a test."""

    def __init__(self, backend: EventBackend) -> None:
        self.backend = backend
        self.name = backend.name
        self.device: DevicePool
        self.host: HostPool
        self.device, self.host = backend.create_pools(CONFIG)
        # Faults: transfer id -> the error its copy fails with.
        self.faults: dict[int, BaseException] = {}
        # While gate is clear, copies are held on the copy thread (the sim: not completed).
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()  # set when a copy thread reached a transfer
        self.copy_threads: set[int] = set()
        if isinstance(backend, ThreadedBackend):
            backend.hooks.before = self._before

    def _before(self, t: Transfer) -> BaseException | None:
        self.copy_threads.add(threading.get_ident())
        self.started.set()
        self.gate.wait()
        return self.faults.get(t.id)

    def fill(self, page: int, value: float) -> None:
        """Write ``value`` + a per-element ramp into device page ``page`` (engine side)."""
        ramp = torch.arange(self.device.tensor[page].numel(), dtype=torch.float32)
        self.device.tensor[page] = (ramp + value).view_as(self.device.tensor[page]).to(self.device.tensor)

    def make(self, device_pages: list[int], host_pages: list[int], stream: int = 0) -> Transfer:
        owner = _Owner(len(device_pages))
        n = len(device_pages) * CONFIG.page_size
        return Transfer(owner, device_pages, host_pages, [], 0, n, 0.0, stream)

    def fail(self, t: Transfer, error: BaseException) -> None:
        self.faults[t.id] = error

    def _pump(self) -> None:
        b = self.backend
        b.launch()  # a driver's next turn: submitted copies start (F19)
        if isinstance(b, SimBackend):
            if b.pending:
                self.started.set()
            if not self.gate.is_set():
                return
            for t in list(b.pending):
                err = self.faults.get(t.id)
                if err is None:
                    b.complete(t)
                else:
                    b.fail(t, err)

    async def collect(self, n: int) -> list[Completion]:
        """Wait (at most 20 s) for exactly ``n`` completions; they may come in batches."""
        got: list[Completion] = []
        with anyio.fail_after(20):
            while len(got) < n:
                self._pump()
                got.extend(await self.backend.wait_completions())
        assert len(got) == n, f"{len(got)} completions, {n} expected"
        return got

    async def wait_started(self) -> None:
        """Yield to the loop until a copy thread holds a transfer (no sleeping)."""
        with anyio.fail_after(20):
            while not self.started.is_set():
                self._pump()
                await anyio.sleep(0.001)

    def host_bytes(self, pages: list[int]) -> torch.Tensor:
        return self.host.tensor[pages].cpu().clone()

    def device_bytes(self, pages: list[int]) -> torch.Tensor:
        return self.device.tensor[pages].cpu().clone()


@pytest_asyncio.fixture(params=BACKEND_PARAMS)
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    h = Harness(_make(request.param))
    h.backend.open(h.device, h.host)
    yield h
    h.gate.set()
    await h.backend.aclose()
