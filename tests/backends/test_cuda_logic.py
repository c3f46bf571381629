"""The cuda backend's stream logic - waiter thread, polling fallback, event reuse - on
the CPU, driven by fake events; and its behaviour without a GPU. The GPU-only checks
(F17 stream ordering, the poll mode end to end) are skipped with the reason here."""

from __future__ import annotations

import inspect
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import pytest_asyncio
import torch
from cuda_on_cpu import CpuCudaEvent, CpuCudaStream, gpu_less_cuda_backend
from support import PlainIssuer

import kvoffload as kvo
from kvoffload.backends._cuda import EventStream, InFlight, poll_completions
from kvoffload.backends._threaded import CompletionInbox, CopyHooks

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="no CUDA GPU here (torch.cuda.is_available() is False)")


class FakeEvent:
    """A CUDA event stand-in: ``query()`` is whether the copy ended; ``synchronize()``
    blocks until it does (or raises ``error``)."""

    def __init__(self, name: str, error: BaseException | None = None) -> None:
        self.name = name
        self.done = threading.Event()
        self.error = error
        self.syncs = 0
        self.waiting = threading.Event()  # set while a thread blocks in synchronize()

    def query(self) -> bool:
        if self.error is not None and self.done.is_set():
            raise self.error
        return self.done.is_set()

    def synchronize(self) -> None:
        self.syncs += 1
        self.waiting.set()
        self.done.wait()
        if self.error is not None:
            raise self.error


class _T:
    """A transfer stand-in: the stream logic only passes it through."""

    def __init__(self, i: int) -> None:
        self.id = i


class Rig:
    """An EventStream on a bound inbox, its recycled events, and the items put so far."""

    def __init__(self, hooks: CopyHooks | None = None, threaded: bool = True) -> None:
        self.inbox = CompletionInbox()
        self.inbox.bind()
        self.recycled: list[Any] = []
        self.stream = EventStream(
            "test-stream", self.inbox, hooks or CopyHooks(), self.recycled.append, None, threaded
        )
        self.events: list[FakeEvent] = []

    def put(self, *events: FakeEvent) -> None:
        for e in events:
            self.stream.put(InFlight(_T(len(self.events)), e))  # type: ignore[arg-type]
            self.events.append(e)

    async def collect(self, n: int) -> list[Any]:
        got: list[Any] = []
        with anyio.fail_after(20):
            while len(got) < n:
                got.extend(await self.inbox.wait())
        return got


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig()
    yield r
    for e in r.events:
        e.done.set()
    r.stream.close()
    if r.stream.is_alive():
        await anyio.to_thread.run_sync(r.stream.join)


async def _wait_until(flag: threading.Event) -> None:
    with anyio.fail_after(20):
        while not flag.is_set():
            await anyio.sleep(0.001)


@pytest.mark.asyncio
async def test_waiter_delivers_every_completed_head_in_one_batch_in_order(rig: Rig) -> None:
    """Events 1 and 2 complete before 0: the waiter blocks on 0 (the oldest), then
    posts 0, 1, 2 together, in submission order; nothing is posted before 0 is done."""
    evs = [FakeEvent(f"e{i}") for i in range(3)]
    evs[1].done.set()
    evs[2].done.set()
    rig.stream.start()
    rig.put(*evs)
    await _wait_until(evs[0].waiting)
    assert rig.inbox.signalled == 0 and rig.recycled == []  # no event reused before consumed
    evs[0].done.set()
    with anyio.fail_after(20):
        batch = await rig.inbox.wait()  # one batch: the waiter posted all three at once
    assert [tid for tid, _ in batch] == [0, 1, 2] and all(err is None for _, err in batch)
    assert rig.recycled == evs
    assert evs[1].syncs == evs[2].syncs == 0  # the query fast path: no blocking wait


@pytest.mark.asyncio
async def test_waiter_takes_the_query_fast_path_for_a_finished_event(rig: Rig) -> None:
    """An event already complete at the waiter's first look is never synchronized."""
    e = FakeEvent("e")
    e.done.set()
    rig.put(e)
    rig.stream.start()
    [(tid, err)] = await rig.collect(1)
    assert tid == 0 and err is None and e.syncs == 0 and rig.recycled == [e]


@pytest.mark.asyncio
async def test_a_failed_event_fails_its_transfer_only_and_is_not_reused(rig: Rig) -> None:
    """A CUDA error on one event fails that transfer; later ones still complete; the
    failed event is not returned to the pool."""
    boom = RuntimeError("CUDA error: an illegal memory access")
    evs = [FakeEvent("a"), FakeEvent("b", error=boom), FakeEvent("c")]
    for e in evs:
        e.done.set()
    rig.stream.start()
    rig.put(*evs)
    got = await rig.collect(3)
    assert [tid for tid, _ in got] == [0, 1, 2]
    assert [err for _, err in got] == [None, boom, None]
    assert rig.recycled == [evs[0], evs[2]]


@pytest.mark.asyncio
async def test_an_injected_failure_is_reported_after_the_copy_ended() -> None:
    """hooks.before failing a transfer: the waiter still waits for its event (the copy
    may be writing the host pages), then reports the error for that transfer only."""
    boom = RuntimeError("injected")
    r = Rig(CopyHooks(before=lambda t: boom if t.id == 0 else None))
    evs = [FakeEvent("a"), FakeEvent("b")]
    evs[1].done.set()
    r.stream.start()
    r.put(*evs)
    await _wait_until(evs[0].waiting)
    assert r.inbox.signalled == 0
    evs[0].done.set()
    got = await r.collect(2)
    assert got == [(0, boom), (1, None)]
    r.stream.close()
    await anyio.to_thread.run_sync(r.stream.join)


@pytest.mark.asyncio
async def test_close_drains_the_waiter_before_its_thread_exits(rig: Rig) -> None:
    """close() with events pending: the thread waits for each, posts them, then exits."""
    evs = [FakeEvent(str(i)) for i in range(3)]
    rig.stream.start()
    rig.put(*evs)
    rig.stream.close()
    with pytest.raises(kvo.BackendError):
        rig.put(FakeEvent("late"))
    await _wait_until(evs[0].waiting)
    assert rig.stream.is_alive()
    for e in evs:
        e.done.set()
    await anyio.to_thread.run_sync(rig.stream.join)
    assert [tid for tid, _ in rig.inbox.take_nowait()] == [0, 1, 2] and rig.stream.queued == 0


@pytest.mark.asyncio
async def test_poll_mode_delivers_only_from_the_head_in_order() -> None:
    """The polling fallback (no thread): a later event done first is not delivered
    before the oldest; once the oldest is done both come in one batch, in order. The
    copy-end hook runs; the before-hook (which may block) does not, on the loop. A CUDA
    error on an event fails that transfer (polling does not stall on it)."""
    ended: list[int] = []
    rig = Rig(
        CopyHooks(before=lambda t: RuntimeError("must not run"), after=lambda t: ended.append(t.id)), False
    )
    e1, e2 = FakeEvent("1"), FakeEvent("2")
    rig.put(e1, e2)
    e2.done.set()
    with anyio.move_on_after(0.05) as scope:
        await poll_completions([rig.stream], rig.inbox)
    assert scope.cancelled_caught and rig.inbox.signalled == 0 and rig.recycled == []
    e1.done.set()
    with anyio.fail_after(20):
        batch = await poll_completions([rig.stream], rig.inbox)
    assert batch == [(0, None), (1, None)] and rig.recycled == [e1, e2]
    assert e1.syncs == e2.syncs == 0 and ended == [0, 1]  # polling never blocks
    boom = RuntimeError("CUDA error: unspecified launch failure")
    e3 = FakeEvent("3", error=boom)
    e3.done.set()
    rig.put(e3)
    with anyio.fail_after(20):
        [(tid, err)] = await poll_completions([rig.stream], rig.inbox)
    assert tid == 2 and err is boom and e3 not in rig.recycled  # a failed event is not reused


@pytest.mark.skipif(CUDA, reason="a GPU is present: the no-GPU error cannot be shown")
def test_cuda_without_a_gpu_raises_a_clear_backend_error() -> None:
    """backend="cuda" without a GPU raises BackendError saying so and naming the way out."""
    from kvoffload.backends import CudaBackend

    with pytest.raises(kvo.BackendError, match=r"needs a CUDA GPU.*backend='cpu'"):
        CudaBackend()
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=8, host_pages=8)
    with pytest.raises(kvo.BackendError, match="CUDA GPU"):
        kvo.OffloadManager(config, backend="cuda")


@needs_gpu
@pytest.mark.asyncio
async def test_the_copy_waits_for_the_compute_stream_f17() -> None:
    """F17: the model writes a page on the compute stream after a long kernel; a copy
    submitted right after (before the write ran) still reads the written bytes,
    because the side stream waits on the compute stream first."""
    from kvoffload.abc import Transfer
    from kvoffload.backends import CudaBackend

    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=8, host_pages=8, dtype="float32")
    b = CudaBackend()
    dev, host = b.create_pools(config)
    b.open(dev, host)
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the "model" is busy on the compute stream
        dev.tensor[3].fill_(7.0)  # queued after the sleep on the compute stream
        t = Transfer(PlainIssuer(), [3], [5], [], 0, 4, 0.0)
        b.submit(t)
        b.launch()  # the driver's next turn
        with anyio.fail_after(60):
            [(done, err)] = await b.wait_completions()
        assert done == t.id and err is None
        assert torch.all(host.tensor[5] == 7.0)
    finally:
        await b.aclose()


@needs_gpu
@pytest.mark.asyncio
async def test_the_copy_waits_for_the_engines_own_forward_stream_f26() -> None:
    """F26: the engine computes on its own forward stream, not the current one; with
    ``ready`` = that stream (or an event recorded on it) the copy reads the written bytes,
    though the current stream is idle when the copy is launched."""
    from kvoffload.abc import Transfer
    from kvoffload.backends import CudaBackend

    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=8, host_pages=8, dtype="float32")
    b = CudaBackend()
    dev, host = b.create_pools(config)
    b.open(dev, host)
    forward = torch.cuda.Stream()
    try:
        for page, use_event in ((3, False), (4, True)):
            torch.cuda.synchronize()
            with torch.cuda.stream(forward):
                torch.cuda._sleep(200_000_000)  # the forward pass, on its own stream
                dev.tensor[page].fill_(float(page))
                ready: Any = forward
                if use_event:
                    ready = torch.cuda.Event()
                    ready.record(forward)
            t = Transfer(PlainIssuer(), [page], [page], [], 0, 4, 0.0)
            t.ready = ready
            b.submit(t)
            b.launch()
            with anyio.fail_after(60):
                [(done, err)] = await b.wait_completions()
            assert done == t.id and err is None
            assert torch.all(host.tensor[page] == float(page))
    finally:
        await b.aclose()


@needs_gpu
def test_engine_owned_device_kv_is_copied_on_the_gpu() -> None:
    """Engine-owned mode on a GPU: per-layer tensors on the device, pages handed over
    with extend(pages=, ready=), each stored host page a page of every tensor in order."""
    kv = [torch.randn(16, 4, 2, 8, device="cuda").to(torch.float16) for _ in range(4)]
    config = kvo.OffloadConfig(
        page_size=4, stride=8, device_pages=None, host_pages=8, offload_prompt=True, drain_timeout_s=30
    )
    with kvo.SyncOffloadManager(config, backend="cuda", device_kv=kv, storage="memory") as mgr:
        lc = mgr.admit("r", list(range(4)), pages=[9])
        ev = torch.cuda.Event()
        ev.record()
        lc.extend(list(range(4, 8)), pages=[2], ready=ev)
        lc.finish()
        mgr.quiesce(30)
        while mgr.writes_pending:
            mgr.wait_progress(0.01)
            mgr.poll()
        pages = mgr.fetch(list(range(8)), 8)
        assert len(pages) == 2
        for raw, page in zip(pages, (9, 2), strict=True):
            assert raw == b"".join(t[page].cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in kv)


@needs_gpu
@pytest.mark.asyncio
async def test_poll_mode_offloads_end_to_end_on_the_gpu() -> None:
    """completion="poll": a manager offloads and releases with the right host bytes."""
    from kvoffload.backends import CudaBackend

    config = kvo.OffloadConfig(page_size=4, stride=8, device_pages=32, host_pages=32, dtype="float32")
    async with kvo.OffloadManager(config, backend=CudaBackend(completion="poll")) as mgr:
        lcs = [mgr.admit(i, prompt=[1, 2, 3, 4]) for i in range(4)]
        for lc in lcs:
            lc.extend(list(range(20)))
            lc.finish()
        for lc in lcs:
            await lc.wait_released()
            assert lc.outcome is kvo.Outcome.COMPLETED
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_the_waiter_thread_selects_its_gpu_before_it_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """By reading (issue 19): a new thread's current CUDA device is GPU 0, so a waiter
    that never selects its device makes every TP rank's process create a context on
    GPU 0. The waiter thread calls ``torch.cuda.set_device(device)`` before waiting on
    any event; here ``set_device`` is recorded per thread (no GPU needed)."""
    selected: dict[int, Any] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: selected.__setitem__(threading.get_ident(), d))
    device = torch.device("cuda", 3)
    seen: list[Any] = []

    class DeviceEvent(FakeEvent):
        def query(self) -> bool:  # the device current on the thread that waits
            seen.append(selected.get(threading.get_ident()))
            return super().query()

    inbox = CompletionInbox()
    inbox.bind()
    stream = EventStream("gpu3-wait", inbox, CopyHooks(), lambda e: None, None, True, device=device)
    stream.start()
    ev = DeviceEvent("0")
    ev.done.set()
    stream.put(InFlight(_T(0), ev))  # type: ignore[arg-type]
    with anyio.fail_after(20):
        got = await inbox.wait()
    stream.close()
    await anyio.to_thread.run_sync(stream.join)
    assert [tid for tid, _ in got] == [0]
    assert seen and all(d == device for d in seen), seen


def test_the_cuda_backend_gives_each_waiter_its_device() -> None:
    """The backend hands its device to every waiter it makes (the wiring of the test
    above; the backend is built without a GPU)."""
    stand_in = SimpleNamespace(cuda=SimpleNamespace(Stream=lambda device: ("side stream", device)))
    backend = gpu_less_cuda_backend(device=torch.device("cuda", 2), torch_ns=stand_in)
    worker = backend._make_worker(0)
    assert worker.device == torch.device("cuda", 2) and worker.stream == (
        "side stream",
        torch.device("cuda", 2),
    )


@pytest.mark.asyncio
async def test_wait_completions_wakes_when_the_waiter_posts_with_no_driver_attached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found on the first GPU run: ``await backend.wait_completions()`` (the way tests,
    benchmarks and tools drive a backend without a driver) waited for ever in waiter
    mode, because it waited on the inbox, which is woken only through a driver's waker.
    Here the waiter thread posts after the caller is already waiting; the call returns."""
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    backend = gpu_less_cuda_backend(device=torch.device("cuda", 3), make_event=lambda: FakeEvent("pool"))
    worker = backend._make_worker(0)
    backend._workers = [worker]
    worker.start()
    ev = FakeEvent("copy")
    worker.put(InFlight(_T(7), ev))  # type: ignore[arg-type]
    got: list[Any] = []

    async def wait() -> None:
        got.extend(await backend.wait_completions())

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await anyio.wait_all_tasks_blocked()
                await anyio.to_thread.run_sync(ev.waiting.wait)  # the waiter sleeps in synchronize()
                ev.done.set()  # the copy ends: the waiter posts its completion
    finally:
        ev.done.set()
        worker.close()
        await anyio.to_thread.run_sync(worker.join)
    assert got == [(7, None)]


@pytest.mark.parametrize(
    ("stand_in", "real"), [(CpuCudaEvent, torch.cuda.Event), (CpuCudaStream, torch.cuda.Stream)]
)
def test_the_stand_ins_have_torch_cudas_signatures(stand_in: type, real: type) -> None:
    """The CPU stand-ins of cuda_on_cpu.py (the contract suite's ``cuda-on-cpu`` case)
    take what torch.cuda's Event and Stream take, and each method the same parameters:
    a backend that calls them wrongly fails here as it would on a GPU."""
    assert (
        list(inspect.signature(stand_in.__init__).parameters)[1:]
        == list(inspect.signature(real.__new__).parameters)[1:]
    )
    methods = [m for m in vars(stand_in) if not m.startswith("_")]
    assert methods
    for m in methods:
        if callable(getattr(stand_in, m)):
            assert list(inspect.signature(getattr(stand_in, m)).parameters) == list(
                inspect.signature(getattr(real, m)).parameters
            ), m


@pytest.mark.asyncio
async def test_the_side_stream_waits_for_what_the_copy_must_follow_on_cpu_stand_ins() -> None:
    """F17 and F26 with the cuda backend's own code (cuda_on_cpu.py): a transfer with no
    ``ready`` gets an event recorded at submit, and its side stream waits on exactly that
    event before the copy is queued; a ``ready`` stream is waited on as a stream. (That
    the GPU honours the wait is the GPU-only test above.)"""
    from kvoffload.abc import Transfer

    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=8, host_pages=8, dtype="float32")
    b = gpu_less_cuda_backend()
    dev, host = b.create_pools(config)
    b.open(dev, host)
    side = b._workers[0].stream
    try:
        dev.tensor[3].fill_(7.0)
        t = Transfer(PlainIssuer(), [3], [5], [], 0, 4, 0.0)
        b.submit(t)
        assert isinstance(t.ready, CpuCudaEvent) and t.ready.recorded == 1 and side.waited == []
        b.launch()
        assert side.waited == [t.ready]
        forward = CpuCudaStream()
        dev.tensor[4].fill_(4.0)
        t2 = Transfer(PlainIssuer(), [4], [4], [], 0, 4, 0.0)
        t2.ready = forward
        b.submit(t2)
        b.launch()
        assert side.waited == [t.ready, forward]
        got: list[Any] = []
        with anyio.fail_after(20):
            while len(got) < 2:
                got.extend(await b.wait_completions())
        assert sorted(got) == sorted([(t.id, None), (t2.id, None)])
        assert torch.all(host.tensor[5] == 7.0) and torch.all(host.tensor[4] == 4.0)
    finally:
        await b.aclose()
