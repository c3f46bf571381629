"""The host->device copy plans of every backend on CPU tensors: the cpu/sim copy
(``copy_pages_h2d``) and the cuda backend's (``queue_copy_h2d``, device-agnostic, run on
CPU tensors as ``test_engine_owned.py`` runs ``queue_copy``), for kvoffload's own pool
and for the engine's KV tensors (engine-owned mode).

What must hold: a page copied out (d2h) and back (h2d) into other device pages has
exactly its bytes there, for consecutive and scattered pages; no device page the
transfer does not name is written.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import PlainIssuer

import kvoffload as kvo
from kvoffload.abc import Transfer
from kvoffload.backends._cuda import queue_copy, queue_copy_h2d
from kvoffload.backends._threaded import copy_transfer_pages
from kvoffload.pools import DevicePool, EnginePages, HostPool

PAGE = 4
CASES = [
    ([3, 4, 5], [0, 1, 2], [10, 11, 12]),  # out of 3..5, back into 10..12: one block each
    ([9, 2, 14, 7, 11, 0], [7, 3, 4, 5, 1, 6], [1, 15, 6, 13, 8, 4]),  # scattered everywhere
]


def _pools(engine: bool) -> tuple[Any, HostPool, list[torch.Tensor]]:
    if engine:
        kv = [torch.randn(16, PAGE, 2, 3).to(torch.float16) for _ in range(3)]
        device: Any = EnginePages(kv, PAGE)
        return device, HostPool.new(8, (device.page_bytes,), "uint8", zero=True), kv
    device = DevicePool.create(16, PAGE, (2, 3), "float16")
    device.tensor.normal_()
    return device, HostPool.new(8, (PAGE, 2, 3), "float16", zero=True), [device.tensor]


def _page(tensors: list[torch.Tensor], p: int) -> bytes:
    return b"".join(t[p].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


@pytest.mark.parametrize("plan", ["cpu", "cuda"])
@pytest.mark.parametrize("engine", [False, True], ids=["owned", "engine"])
def test_a_page_copied_out_and_back_has_its_bytes_in_the_new_device_page(plan: str, engine: bool) -> None:
    """d2h from ``src`` into host pages, then h2d from them into ``dst``: each dst page
    holds its src page's bytes; the device pages named by neither are unchanged."""
    for src, host_pages, dst in CASES:
        device, host, tensors = _pools(engine)
        before = {p: _page(tensors, p) for p in range(16)}
        out = Transfer(PlainIssuer(), src, host_pages, [], 0, PAGE * len(src), 0.0)
        back = Transfer(PlainIssuer(), dst, host_pages, [], 0, PAGE * len(dst), 0.0, direction="h2d")
        if plan == "cuda":
            queue_copy(device, host, out, torch.device("cpu"))
            queue_copy_h2d(device, host, back, torch.device("cpu"))
        else:
            pairs = device.copy_pairs(host)
            copy_transfer_pages(pairs, out)
            copy_transfer_pages(pairs, back)
        for s, d in zip(src, dst, strict=True):
            assert _page(tensors, d) == before[s]
        for p in set(range(16)) - set(dst):
            assert _page(tensors, p) == before[p]


def test_a_transfer_direction_is_d2h_or_h2d() -> None:
    """Transfer(direction=...) takes "d2h" (the default) or "h2d"; anything else is a
    BackendError naming both."""
    owner = PlainIssuer()
    assert Transfer(owner, [0], [0], [], 0, 4, 0.0).direction == "d2h"
    with pytest.raises(kvo.BackendError, match="'d2h' or 'h2d'"):
        Transfer(owner, [0], [0], [], 0, 4, 0.0, direction="up")
