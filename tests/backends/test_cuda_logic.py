"""The cuda backend's stream logic - waiter thread, polling fallback, event reuse - on
the CPU, driven by fake events; and its behaviour without a GPU. The GPU-only checks
(F17 stream ordering, the poll mode end to end) are skipped with the reason here."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch

import kvoffload as kvo
from kvoffload.backends._threaded import CompletionInbox, CopyHooks
from kvoffload.backends.cuda import EventStream, InFlight, poll_completions

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


def _stream(inbox: CompletionInbox, hooks: CopyHooks | None = None) -> tuple[EventStream, list[Any]]:
    recycled: list[Any] = []
    return EventStream("test-stream", inbox, hooks or CopyHooks(), recycled.append), recycled


async def _wait_until(flag: threading.Event) -> None:
    with anyio.fail_after(20):
        while not flag.is_set():
            await anyio.sleep(0.001)


@pytest.mark.asyncio
async def test_waiter_delivers_every_completed_head_in_one_batch_in_order() -> None:
    """Events 2 and 3 complete before 1: the waiter blocks on 1 (the oldest), then
    posts 1, 2, 3 together, in submission order; nothing is posted before 1 is done."""
    inbox = CompletionInbox()
    inbox.bind()
    s, recycled = _stream(inbox)
    evs = [FakeEvent(f"e{i}") for i in range(3)]
    ts = [_T(i) for i in range(3)]
    evs[1].done.set()
    evs[2].done.set()
    s.start()
    for t, e in zip(ts, evs, strict=True):
        s.put(InFlight(t, e))  # type: ignore[arg-type]
    await _wait_until(evs[0].waiting)
    assert inbox.signalled == 0 and recycled == []  # no event reused before it was consumed
    evs[0].done.set()
    with anyio.fail_after(20):
        batch = await inbox.wait()
    assert [t for t, _ in batch] == ts and all(err is None for _, err in batch)
    assert recycled == evs
    assert evs[1].syncs == evs[2].syncs == 0  # the query fast path: no blocking wait
    s.close()
    await anyio.to_thread.run_sync(s.join)


@pytest.mark.asyncio
async def test_waiter_takes_the_query_fast_path_for_a_finished_event() -> None:
    """An event already complete at the waiter's first look is never synchronized."""
    inbox = CompletionInbox()
    inbox.bind()
    s, recycled = _stream(inbox)
    e = FakeEvent("e")
    e.done.set()
    s.put(InFlight(_T(1), e))  # type: ignore[arg-type]
    s.start()
    with anyio.fail_after(20):
        [(t, err)] = await inbox.wait()
    assert t.id == 1 and err is None and e.syncs == 0 and recycled == [e]
    s.close()
    await anyio.to_thread.run_sync(s.join)


@pytest.mark.asyncio
async def test_a_failed_event_fails_its_transfer_only_and_is_not_reused() -> None:
    """A CUDA error on one event fails that transfer; later ones still complete; the
    failed event is not returned to the pool."""
    inbox = CompletionInbox()
    inbox.bind()
    s, recycled = _stream(inbox)
    boom = RuntimeError("CUDA error: an illegal memory access")
    evs = [FakeEvent("a"), FakeEvent("b", error=boom), FakeEvent("c")]
    for e in evs:
        e.done.set()
    s.start()
    for i, e in enumerate(evs):
        s.put(InFlight(_T(i), e))  # type: ignore[arg-type]
    got: list[Any] = []
    with anyio.fail_after(20):
        while len(got) < 3:
            got.extend(await inbox.wait())
    assert [t.id for t, _ in got] == [0, 1, 2]
    assert [err for _, err in got] == [None, boom, None]
    assert recycled == [evs[0], evs[2]]
    s.close()
    await anyio.to_thread.run_sync(s.join)


@pytest.mark.asyncio
async def test_close_drains_the_waiter_before_its_thread_exits() -> None:
    """close() with events pending: the thread waits for each, posts them, then exits."""
    inbox = CompletionInbox()
    inbox.bind()
    s, _ = _stream(inbox)
    evs = [FakeEvent(str(i)) for i in range(3)]
    s.start()
    for i, e in enumerate(evs):
        s.put(InFlight(_T(i), e))  # type: ignore[arg-type]
    s.close()
    with pytest.raises(kvo.BackendError):
        s.put(InFlight(_T(9), FakeEvent("late")))  # type: ignore[arg-type]
    await _wait_until(evs[0].waiting)
    assert s.is_alive()
    for e in evs:
        e.done.set()
    await anyio.to_thread.run_sync(s.join)
    assert [t.id for t, _ in inbox.take_nowait()] == [0, 1, 2] and s.queued == 0


@pytest.mark.asyncio
async def test_poll_mode_delivers_only_from_the_head_in_order() -> None:
    """The polling fallback (no thread): a later event done first is not delivered
    before the oldest; once the oldest is done both come in one batch, in order."""
    inbox = CompletionInbox()
    inbox.bind()
    s, recycled = _stream(inbox)
    e1, e2 = FakeEvent("1"), FakeEvent("2")
    s.put(InFlight(_T(1), e1))  # type: ignore[arg-type]
    s.put(InFlight(_T(2), e2))  # type: ignore[arg-type]
    e2.done.set()
    with anyio.move_on_after(0.05) as scope:
        await poll_completions([s], inbox)
    assert scope.cancelled_caught and inbox.signalled == 0 and recycled == []
    e1.done.set()
    with anyio.fail_after(20):
        batch = await poll_completions([s], inbox)
    assert [t.id for t, _ in batch] == [1, 2] and recycled == [e1, e2]
    assert e1.syncs == e2.syncs == 0  # polling never blocks


@pytest.mark.skipif(CUDA, reason="a GPU is present: the no-GPU error cannot be shown")
def test_cuda_without_a_gpu_raises_a_clear_backend_error() -> None:
    """backend="cuda" without a GPU raises BackendError saying so and naming the way out."""
    from kvoffload.backends.cuda import CudaBackend

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
    from kvoffload.backends.cuda import CudaBackend

    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=8, host_pages=8, dtype="float32")
    b = CudaBackend()
    dev, host = b.create_pools(config)
    b.open(dev, host)
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the "model" is busy on the compute stream
        dev.tensor[3].fill_(7.0)  # queued after the sleep on the compute stream
        t = Transfer(object(), [3], [5], [], 0, 4, 0.0)  # type: ignore[arg-type]
        b.submit(t)
        with anyio.fail_after(60):
            [(done, err)] = await b.wait_completions()
        assert done is t and err is None
        assert torch.all(host.tensor[5] == 7.0)
    finally:
        await b.aclose()


@needs_gpu
@pytest.mark.asyncio
async def test_poll_mode_offloads_end_to_end_on_the_gpu() -> None:
    """completion="poll": a manager offloads and releases with the right host bytes."""
    from kvoffload.backends.cuda import CudaBackend

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
