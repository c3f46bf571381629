"""The cuda backend's own code on a machine without a GPU: ``torch.cuda``'s streams and
events replaced by CPU stand-ins, everything else (submit, launch, the copy plans, the
waiter threads, completion delivery, ``wait_completions``) the backend's real code.

The first GPU run found ``wait_completions`` hanging in every contract test's cuda case,
a bug of this pure-Python wiring that no test could reach without a GPU. With these
stand-ins the contract suite runs its cuda case here too (``cuda-on-cpu``), and
:func:`test_the_stand_ins_have_torch_cudas_signatures` keeps the stand-ins' methods those
of ``torch.cuda.Event`` and ``torch.cuda.Stream``.

Semantics: the pools are CPU tensors, so a copy queued "on a stream" runs when queued
(``queue_copy`` with a CPU device); an event is then complete once recorded. Waiting
(``synchronize``, the waiter's slow path) is covered by ``test_cuda_logic.py``'s fake
events, which complete when a test says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from kvoffload.backends._cuda import CudaBackend, EventStream, _EventPool
from kvoffload.backends._threaded import ThreadedBackend


class CpuCudaEvent:
    """``torch.cuda.Event`` for work that ran when it was queued: done once recorded
    (as a real event that was never recorded, ``query()`` is then True too)."""

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> None:
        self.blocking = blocking
        self.recorded = 0

    def record(self, stream: Any = None) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


class CpuCudaStream:
    """``torch.cuda.Stream`` whose queued work already ran; it records what it was told
    to wait for (the ordering the backend asks of a side stream, F17 and F26)."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = device
        self.waited: list[Any] = []

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)

    def wait_stream(self, stream: Any) -> None:
        self.waited.append(stream)

    def record_event(self, event: Any = None) -> Any:
        event = event if event is not None else CpuCudaEvent()
        event.record(self)
        return event


def _current_stream(device: Any = None) -> CpuCudaStream:
    return CpuCudaStream(device)


#: What the cuda backend reads of ``torch`` (``self._torch``), on the CPU.
CPU_TORCH = SimpleNamespace(
    cuda=SimpleNamespace(
        Event=CpuCudaEvent,
        Stream=CpuCudaStream,
        stream=lambda stream: contextlib.nullcontext(stream),
        current_stream=_current_stream,
    )
)


def gpu_less_cuda_backend(
    streams: int = 1,
    completion: str = "waiter",
    device: torch.device | None = None,
    torch_ns: Any = None,
    make_event: Callable[[], Any] | None = None,
) -> CudaBackend:
    """A CudaBackend as its constructor builds one (the constructor needs a GPU), with
    ``torch_ns`` in place of ``torch`` for its streams and events.

    ``device`` None: a backend that copies between CPU pools (``cuda-on-cpu``): pools
    unpinned, and its waiters select no GPU. Else the backend names that GPU, for tests
    of what it hands its waiters (it then cannot copy)."""
    backend = CudaBackend.__new__(CudaBackend)
    ThreadedBackend.__init__(backend, streams)
    backend.completion = completion  # type: ignore[assignment]
    backend._run_threads = completion == "waiter"
    backend._torch = torch_ns if torch_ns is not None else CPU_TORCH
    backend._events = _EventPool(make_event or (lambda: CpuCudaEvent(blocking=True)))
    if device is not None:
        backend.device = device
        return backend
    backend.device = torch.device("cpu")
    backend.device_type = "cpu"  # type: ignore[misc]
    backend.pins_host = False  # type: ignore[misc]

    def make_worker(index: int) -> EventStream:
        worker = CudaBackend._make_worker(backend, index)
        worker.device = None  # this CPU build has no GPU to select
        return worker

    backend._make_worker = make_worker  # type: ignore[method-assign]
    return backend
