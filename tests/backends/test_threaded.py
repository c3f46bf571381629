"""The shared machinery of the cpu and cuda backends, driven on the CPU: copy plans,
the loop inbox (one wake-up per batch, nothing stranded), backend choice by name."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import PlainIssuer

import kvoffload as kvo
from kvoffload.backends import CpuBackend, resolve_backend
from kvoffload.backends._threaded import CompletionInbox, Run, plan_runs


def test_plan_runs_makes_one_block_per_run_of_consecutive_pages() -> None:
    """Consecutive pairs are one block copy, in either direction (the pool hands pages
    out in descending order); scattered device pages become a gather."""
    assert plan_runs([0, 1, 2], [5, 6, 7]) == [Run(5, 3, (0, 1, 2), 0)]
    assert plan_runs([2, 1, 0], [7, 6, 5]) == [Run(5, 3, (0, 1, 2), 0)]
    assert plan_runs([9, 3], [0, 1]) == [Run(0, 2, (9, 3), None)]
    assert plan_runs([1, 2], [4, 9]) == [Run(4, 1, (1,), 1), Run(9, 1, (2,), 2)]
    assert plan_runs([], []) == []


@given(st.lists(st.integers(0, 50), unique=True, min_size=1, max_size=20), st.randoms())
def test_plan_runs_covers_every_page_pair_exactly_once(host: list[int], rnd: Any) -> None:
    """Whatever the pages, the runs map each host page to its own device page, once."""
    device = rnd.sample(range(100), len(host))
    runs = plan_runs(device, host)
    pairs = [(r.host_start + k, d) for r in runs for k, d in enumerate(r.device)]
    assert sorted(pairs) == sorted(zip(host, device, strict=True))
    for r in runs:
        assert r.count == len(r.device) >= 1
        if r.device_start is not None:
            assert r.device == tuple(range(r.device_start, r.device_start + r.count))


def _fake_transfer(i: int) -> Any:
    return (i, None)


def test_inbox_wakes_the_driver_once_per_wake_up_not_once_per_completion() -> None:
    """Posts made while a wake-up is outstanding call the waker no more; once the driver
    took everything, the next post calls it exactly once (nothing is stranded)."""
    inbox = CompletionInbox()
    calls: list[int] = []
    inbox.set_waker(lambda: calls.append(1))
    for i in range(3):
        inbox.post([_fake_transfer(i)])
    assert len(calls) == 1 and inbox.signalled == 3 and inbox.ready == 3
    inbox.post([_fake_transfer(3)])
    assert len(calls) == 1  # the driver has not taken yet: no second wake-up
    assert inbox.take_nowait(2) == [_fake_transfer(0), _fake_transfer(1)]
    inbox.post([_fake_transfer(4)])
    assert len(calls) == 1  # still outstanding: two completions were left
    assert inbox.take_nowait() == [_fake_transfer(i) for i in (2, 3, 4)]
    inbox.post([_fake_transfer(5)])
    assert len(calls) == 2 and inbox.signalled == 6
    assert inbox.take_nowait() == [_fake_transfer(5)]
    assert inbox.take_nowait() == []


def test_inbox_wait_ready_blocks_until_a_post_from_another_thread() -> None:
    """The sync driver's wait: it returns as soon as another thread posts, or after
    its timeout with nothing ready."""
    inbox = CompletionInbox()
    assert inbox.wait_ready(0.01) is False
    t = threading.Timer(0.05, lambda: inbox.post([_fake_transfer(1)]))
    t.start()
    assert inbox.wait_ready(20) is True
    t.join()
    assert inbox.take_nowait() == [_fake_transfer(1)]


@pytest.mark.asyncio
async def test_inbox_strands_no_completion_under_concurrent_posts() -> None:
    """Two threads post 2000 completions while the loop waits: every one arrives,
    each thread's in its posting order, in fewer wake-ups than posts."""
    inbox = CompletionInbox()
    inbox.bind()
    n = 1000

    def poster(k: int) -> None:
        for i in range(n):
            inbox.post([((k, i), None)])  # type: ignore[list-item]

    threads = [threading.Thread(target=poster, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    got: list[Any] = []
    with anyio.fail_after(20):
        while len(got) < 2 * n:
            got.extend(c[0] for c in await inbox.wait())
    for t in threads:
        t.join()
    for k in range(2):
        assert [i for kk, i in got if kk == k] == list(range(n))
    assert inbox.signalled == 2 * n
    assert inbox.wakeups <= 2 * n


def test_inbox_outside_asyncio_says_what_it_needs() -> None:
    """Binding an inbox to the running asyncio loop with none running raises BackendError."""
    with pytest.raises(kvo.BackendError, match="asyncio"):
        CompletionInbox().bind()


def test_backends_are_chosen_by_name() -> None:
    """ "cpu" and "sim" by name; "auto" is cpu without a GPU and cuda with one; an
    unknown name is a ConfigError listing the choices."""
    assert resolve_backend("cpu").name == "cpu"
    assert resolve_backend("sim").name == "sim"
    assert resolve_backend("auto").name == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(kvo.ConfigError, match="auto"):
        resolve_backend("gpu")
    with pytest.raises(kvo.ConfigError):
        CpuBackend(streams=0)


def test_auto_follows_the_engines_kv_device_in_engine_owned_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine-owned mode: "auto" follows the device of ``device_kv``. With a GPU present
    (here: torch says so) CPU KV tensors get the cpu backend, not a cuda backend that
    would refuse them; owned mode still picks cuda when a GPU is present."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kv = [torch.zeros(8, 4, 2, 3) for _ in range(2)]
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=None, host_pages=8)
    with kvo.SyncOffloadManager(config, device_kv=kv) as mgr:
        assert mgr.backend.name == "cpu"
    assert resolve_backend("auto", torch.device("cpu")).name == "cpu"


def test_cuda_copies_on_the_gpu_that_holds_the_engines_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the engine's KV on ``cuda:3``, "auto" and "cuda" build the cuda backend on
    ``cuda:3``, not on the current GPU (a GPU-less stand-in records what it is built with)."""
    import kvoffload.backends._cuda as cuda_module

    built: list[object] = []

    class Recorder(cuda_module.CudaBackend):
        def __init__(self, device: object = None) -> None:
            built.append(device)

    monkeypatch.setattr(cuda_module, "CudaBackend", Recorder)
    gpu3 = torch.device("cuda", 3)
    assert isinstance(resolve_backend("auto", gpu3), Recorder)
    assert isinstance(resolve_backend("cuda", gpu3), Recorder)
    resolve_backend("cuda")
    assert built == [gpu3, gpu3, None]


@pytest.mark.asyncio
async def test_the_manager_defaults_to_auto() -> None:
    """OffloadManager without a backend picks "auto": the cpu backend on this machine
    when there is no GPU, and offloads through it."""
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=16, host_pages=16)
    async with kvo.OffloadManager(config) as mgr:
        assert mgr.backend.name == ("cuda" if torch.cuda.is_available() else "cpu")
        lc = mgr.admit("r", prompt=[1, 2, 3, 4])
        lc.extend([5, 6, 7, 8, 9])
        lc.finish()
        await lc.wait_released()
        assert lc.outcome is kvo.Outcome.COMPLETED
        mgr.check_invariants()


@pytest.mark.asyncio
async def test_an_exception_in_a_cpu_copy_fails_that_transfer_and_the_stream_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch error inside one copy is that transfer's failure; the worker thread
    lives on and copies the next transfer. (Transfers queued together are copied as one
    merged copy; when that fails, each is copied alone to find the one that fails.)"""
    import kvoffload.backends._cpu as cpu_mod
    from kvoffload.abc import Transfer

    real = cpu_mod.copy_transfer
    boom = RuntimeError("copy failed")

    def flaky(pairs: Any, t: Transfer) -> None:
        if 1 in t.device_pages:  # any copy that reads device page 1 fails, merged or not
            raise boom
        real(pairs, t)

    monkeypatch.setattr(cpu_mod, "copy_transfer", flaky)
    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=4, host_pages=4, dtype="float32")
    b = CpuBackend()
    dev, host = b.create_pools(config)
    dev.tensor.normal_()
    b.open(dev, host)
    ts = [Transfer(PlainIssuer(), [p], [p], [], 0, 4, 0.0) for p in range(3)]
    for t in ts:
        b.submit(t)
    b.launch()  # submit only accepts; the copies start here (F19)
    got: list[Any] = []
    with anyio.fail_after(20):
        while len(got) < 3:
            got.extend(await b.wait_completions())
    pages = {t.id: t.device_pages for t in ts}
    assert [(pages[tid], err) for tid, err in got] == [([0], None), ([1], boom), ([2], None)]
    assert torch.equal(host.tensor[[0, 2]], dev.tensor[[0, 2]])
    await b.aclose()


def test_cpu_stream_copies_queued_transfers_as_one_merged_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transfers queued together are copied by one merged copy (their runs of
    consecutive pages join into one block); if that copy fails, each is copied alone so
    only the transfer that fails is failed."""
    import kvoffload.backends._cpu as cpu_mod
    from kvoffload.abc import Transfer
    from kvoffload.backends._threaded import CompletionInbox, CopyHooks

    config = kvo.OffloadConfig(page_size=4, stride=4, device_pages=8, host_pages=8, dtype="float32")
    dev, host = CpuBackend().create_pools(config)
    dev.tensor.normal_()
    calls: list[list[int]] = []
    real = cpu_mod.copy_transfer
    fail_page: list[int] = []

    def spy(pairs: Any, t: Transfer) -> None:
        calls.append(list(t.device_pages))
        if set(fail_page) & set(t.device_pages):
            raise RuntimeError("copy failed")
        real(pairs, t)

    monkeypatch.setattr(cpu_mod, "copy_transfer", spy)
    stream = cpu_mod._CopyStream("test", CompletionInbox(), dev, host, CopyHooks())
    ts = [Transfer(PlainIssuer(), [2 * i, 2 * i + 1], [2 * i, 2 * i + 1], [], 0, 8, 0.0) for i in range(3)]
    done = stream.finish_batch(ts)
    assert [(tid, err) for tid, err in done] == [(t.id, None) for t in ts]
    assert calls == [[0, 1, 2, 3, 4, 5]]  # one merged copy
    assert torch.equal(host.tensor[:6], dev.tensor[:6])

    calls.clear()
    host.tensor.zero_()
    fail_page.append(3)
    done = stream.finish_batch(ts)
    assert [err is None for _, err in done] == [True, False, True]
    assert calls == [[0, 1, 2, 3, 4, 5], [0, 1], [2, 3], [4, 5]]  # merged, then one by one
    assert torch.equal(host.tensor[[0, 1, 4, 5]], dev.tensor[[0, 1, 4, 5]])
