"""The event-backend contract (kvoffload.abc.EventBackend), on every backend.

Each test runs on sim, cpu and (with a GPU) cuda through the ``harness`` fixture.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import anyio
import pytest
import torch

import kvoffload as kvo

if TYPE_CHECKING:
    from tests.backends.conftest import Harness

pytestmark = pytest.mark.asyncio


def _expect(h: Harness, device_pages: list[int]) -> torch.Tensor:
    return h.device_bytes(device_pages)


async def test_submit_returns_before_any_copy_finishes(harness: Harness) -> None:
    """submit() returns at once: with every copy held, all submits return and nothing
    has completed yet; released, each completes."""
    h = harness
    h.gate.clear()
    for p in range(4):
        h.fill(p, 100.0 * p)
    ts = [h.make([p], [p], stream=p % h.backend.streams) for p in range(4)]
    for t in ts:
        h.backend.submit(t)  # would hang here if submit waited for the held copy
    await h.wait_started()
    assert h.backend.signalled == 0
    h.gate.set()
    got = await h.collect(4)
    assert sorted(tid for tid, _ in got) == sorted(t.id for t in ts)


async def test_each_submitted_transfer_completes_exactly_once(harness: Harness) -> None:
    """Completions arrive for exactly the transfers submitted, once each, and
    ``signalled`` counts them."""
    h = harness
    ts = [
        h.make([2 * i, 2 * i + 1], [40 - 2 * i, 41 - 2 * i], stream=i % h.backend.streams) for i in range(12)
    ]
    for t in ts:
        h.backend.submit(t)
    got = await h.collect(len(ts))
    ids = [tid for tid, _ in got]
    assert len(set(ids)) == len(ids) == len(ts)
    assert set(ids) == {t.id for t in ts}
    assert all(err is None for _, err in got)
    await h.backend.aclose()  # everything drained: nothing more was signalled
    assert h.backend.signalled == len(ts)


async def test_completions_of_one_stream_come_in_submission_order(harness: Harness) -> None:
    """Per stream, completion order is submission order, whatever the copy sizes
    (big transfers first, so a reordering backend would show it)."""
    h = harness
    ts = []
    page = 0
    for i in range(16):
        n = 4 if i % 4 == 0 else 1
        ts.append(
            h.make(list(range(page, page + n)), list(range(page, page + n)), stream=i % h.backend.streams)
        )
        page += n
    for t in ts:
        h.backend.submit(t)
    got = await h.collect(len(ts))
    stream = {t.id: t.stream for t in ts}
    for s in range(h.backend.streams):
        assert [tid for tid, _ in got if stream[tid] == s] == [t.id for t in ts if t.stream == s]


async def test_a_failed_copy_fails_that_transfer_only(harness: Harness) -> None:
    """A failed copy is reported, with its error, for that transfer alone; the others
    complete with the right bytes."""
    h = harness
    for p in range(6):
        h.fill(p, 10.0 * p + 1)
    ts = [h.make([p], [10 + p], stream=p % h.backend.streams) for p in range(6)]
    boom = RuntimeError("injected copy failure")
    h.fail(ts[2], boom)
    for t in ts:
        h.backend.submit(t)
    got = dict(await h.collect(6))
    assert got.pop(ts[2].id) is boom
    assert all(err is None for err in got.values())
    for t in ts:
        if t is not ts[2]:
            assert torch.equal(h.host_bytes(t.host_pages), _expect(h, t.device_pages))


async def test_host_bytes_equal_device_bytes_at_submit(harness: Harness) -> None:
    """After a completion, its host pages hold exactly the device pages' bytes, for
    consecutive, reversed and scattered pages (one copy per run, gathers elsewhere)."""
    h = harness
    for p in range(64):
        h.fill(p, 1000.0 * p)
    cases = [
        ([0, 1, 2, 3], [8, 9, 10, 11]),  # one block
        ([7, 6, 5], [14, 13, 12]),  # the pool's LIFO order: descending runs
        ([30, 3, 17, 50, 21], [20, 21, 22, 40, 41]),  # scattered device, two host runs
        ([60, 61], [63, 30]),  # scattered host pages
    ]
    ts = [h.make(d, hp, stream=i % h.backend.streams) for i, (d, hp) in enumerate(cases)]
    expected = {t.id: _expect(h, t.device_pages) for t in ts}
    for t in ts:
        h.backend.submit(t)
    made = {t.id: t for t in ts}
    for tid, err in await h.collect(len(ts)):
        assert err is None
        t = made[tid]
        assert torch.equal(h.host_bytes(t.host_pages), expected[t.id]), t


async def test_the_loop_runs_while_a_big_copy_is_in_flight(harness: Harness) -> None:
    """The event loop is never blocked by a copy: while a 48-page copy is held on the
    copy thread, a loop-side task makes progress; the copy runs off the loop thread."""
    h = harness
    for p in range(48):
        h.fill(p, 3.0 * p)
    h.gate.clear()
    t = h.make(list(range(48)), list(range(16, 64)))
    h.backend.submit(t)
    await h.wait_started()
    ticks = 0

    async def counter() -> None:
        nonlocal ticks
        for _ in range(200):
            ticks += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(counter)
    assert ticks == 200 and h.backend.signalled == 0  # the copy is still held
    assert threading.get_ident() not in h.copy_threads
    h.gate.set()
    [(done, err)] = await h.collect(1)
    assert done == t.id and err is None
    assert torch.equal(h.host_bytes(t.host_pages), _expect(h, t.device_pages))


async def test_shutdown_drains_copies_in_flight(harness: Harness) -> None:
    """aclose() returns only once no copy runs: copies held at close finish first, their
    bytes land and their completions stay available; submit after close is refused."""
    h = harness
    for p in range(8):
        h.fill(p, 7.0 * p)
    h.gate.clear()
    ts = [h.make([p], [p + 8], stream=p % h.backend.streams) for p in range(8)]
    for t in ts:
        h.backend.submit(t)
    await h.wait_started()
    closed = False

    async def close() -> None:
        nonlocal closed
        await h.backend.aclose()
        closed = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(close)
        for _ in range(50):
            await anyio.sleep(0)
        # A backend that copies by itself is still draining; the sim runs no copy of its
        # own (its transfers move when the test completes them), so it closes at once.
        assert closed is (h.name == "sim")
        h.gate.set()
        got = await h.collect(len(ts))
    assert closed and h.backend.signalled == len(ts)
    assert {tid for tid, _ in got} == {t.id for t in ts}
    for t in ts:
        assert torch.equal(h.host_bytes(t.host_pages), _expect(h, t.device_pages))
    with pytest.raises(kvo.BackendError):
        h.backend.submit(h.make([0], [0]))


async def test_submit_refuses_a_transfer_it_cannot_copy(harness: Harness) -> None:
    """A transfer naming pages or a stream the backend lacks raises BackendError at
    submit, and nothing is started."""
    h = harness
    bad = [
        h.make([0, 1], [0]),  # lengths differ
        h.make([64], [0]),  # device page out of range
        h.make([0, 1], [3, 3]),  # a host page twice
        h.make([0], [0], stream=h.backend.streams),  # no such stream
    ]
    for t in bad:
        with pytest.raises(kvo.BackendError):
            h.backend.submit(t)
    ok = h.make([5], [6])
    h.fill(5, 42.0)
    h.backend.submit(ok)
    [(tid, err)] = await h.collect(1)
    assert tid == ok.id and err is None and h.backend.signalled == 1
