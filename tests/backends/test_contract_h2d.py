"""The event-backend contract for a load's host->device copies (``Transfer.direction
"h2d"``), on every backend: sim, cpu and (with a GPU) cuda, through the ``harness``
fixture, as ``test_contract.py`` checks it for the offload copies (``"d2h"``).

What must hold: the device pages of a completed h2d transfer hold exactly the bytes
its host pages held when it was launched (consecutive, reversed and scattered pages);
each transfer completes once, per stream in submission order, also mixed with d2h
copies on one stream; a failed copy fails that transfer only; ``check_fits`` refuses
an h2d transfer it cannot copy (and one that writes a device page twice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

import kvoffload as kvo
from kvoffload.abc import Transfer

if TYPE_CHECKING:
    from tests.backends.conftest import Harness

pytestmark = pytest.mark.asyncio


class _Load:
    """A stand-in for the load an h2d transfer names (backends never read it)."""

    def __init__(self, i: int) -> None:
        self.id = i
        self.rid = f"load{i}"
        self.tag = None


def h2d(h: Harness, device_pages: list[int], host_pages: list[int], stream: int = 0) -> Transfer:
    n = len(device_pages) * 4
    return Transfer(
        _Load(len(device_pages)), device_pages, host_pages, [], 0, n, 0.0, stream, direction="h2d"
    )


def fill_host(h: Harness, page: int, value: float) -> None:
    """Write ``value`` + a per-element ramp into host page ``page`` (what a store read left)."""
    ramp = torch.arange(h.host.tensor[page].numel(), dtype=torch.float32) - value
    h.host.tensor[page] = ramp.view_as(h.host.tensor[page]).to(h.host.tensor)


async def test_h2d_device_bytes_equal_host_bytes_at_submit(harness: Harness) -> None:
    """After an h2d completion its device pages hold exactly its host pages' bytes, for
    consecutive, reversed and scattered pages on both sides; no other device page is
    written."""
    h = harness
    for p in range(64):
        fill_host(h, p, 1000.0 * p)
        h.fill(p, -5.0)
    cases = [
        ([0, 1, 2, 3], [8, 9, 10, 11]),  # one block
        ([7, 6, 5], [14, 13, 12]),  # descending runs
        ([30, 4, 17, 50, 21], [20, 21, 22, 40, 41]),  # scattered device, two host runs
        ([60, 61], [63, 33]),  # scattered host pages
    ]
    ts = [h2d(h, d, hp, stream=i % h.backend.streams) for i, (d, hp) in enumerate(cases)]
    expected = {t.id: h.host_bytes(t.host_pages) for t in ts}
    untouched = [p for p in range(64) if not any(p in d for d, _ in cases)]
    before = h.device_bytes(untouched)
    for t in ts:
        h.backend.submit(t)
    made = {t.id: t for t in ts}
    for tid, err in await h.collect(len(ts)):
        assert err is None
        t = made[tid]
        assert torch.equal(h.device_bytes(t.device_pages), expected[t.id]), t
    assert torch.equal(h.device_bytes(untouched), before)


async def test_h2d_each_transfer_completes_once_in_stream_order(harness: Harness) -> None:
    """h2d transfers mixed with d2h ones on the same streams: each completes exactly
    once, and per stream in submission order."""
    h = harness
    ts: list[Transfer] = []
    for i in range(16):
        s = i % h.backend.streams
        if i % 2:
            ts.append(h2d(h, [i], [32 + i], stream=s))
        else:
            ts.append(h.make([i], [32 + i], stream=s))
    for t in ts:
        h.backend.submit(t)
    got = await h.collect(len(ts))
    ids = [tid for tid, _ in got]
    assert sorted(ids) == sorted(t.id for t in ts) and len(set(ids)) == len(ids)
    assert all(err is None for _, err in got)
    stream = {t.id: t.stream for t in ts}
    for s in range(h.backend.streams):
        assert [tid for tid in ids if stream[tid] == s] == [t.id for t in ts if t.stream == s]


async def test_h2d_a_failed_copy_fails_that_transfer_only(harness: Harness) -> None:
    """A failed h2d copy is reported with its error for that transfer alone; the others
    land their bytes."""
    h = harness
    for p in range(6):
        fill_host(h, 10 + p, 3.0 * p + 1)
    ts = [h2d(h, [p], [10 + p], stream=p % h.backend.streams) for p in range(6)]
    boom = RuntimeError("injected h2d failure")
    h.fail(ts[3], boom)
    for t in ts:
        h.backend.submit(t)
    got = dict(await h.collect(6))
    assert got.pop(ts[3].id) is boom
    assert all(err is None for err in got.values())
    for t in ts:
        if t is not ts[3]:
            assert torch.equal(h.device_bytes(t.device_pages), h.host_bytes(t.host_pages))


async def test_h2d_submit_refuses_a_transfer_it_cannot_copy(harness: Harness) -> None:
    """An h2d transfer naming pages or a stream the backend lacks - or writing one device
    page twice - raises BackendError at submit, and nothing is started."""
    h = harness
    bad = [
        h2d(h, [0, 1], [0]),  # lengths differ
        h2d(h, [64], [0]),  # device page out of range
        h2d(h, [0], [64]),  # host page out of range
        h2d(h, [0, 1], [3, 3]),  # a host page twice
        h2d(h, [2, 2], [3, 4]),  # a device page written twice
        h2d(h, [0], [0], stream=h.backend.streams),  # no such stream
    ]
    for t in bad:
        with pytest.raises(kvo.BackendError):
            h.backend.submit(t)
    assert h.backend.signalled == 0
    ok = h2d(h, [5], [6])
    fill_host(h, 6, 42.0)
    h.backend.submit(ok)
    [(tid, err)] = await h.collect(1)
    assert tid == ok.id and err is None and h.backend.signalled == 1
    assert torch.equal(h.device_bytes([5]), h.host_bytes([6]))
