"""A load's copy from the host pool into vLLM's blocks (the worker's ``copy_h2d``), on
CPU tensors laid out as vLLM's CPU attention lays them out (no vLLM needed).

What must hold: each block named gets exactly its host page's bytes, whatever the
order of the blocks and host pages (vLLM hands a request its blocks in any order; the
host pool's free pages come out descending), and no other block is written; the pages
are copied as runs consecutive on both sides, so a load in reversed order is one block
copy per tensor, not a copy per page or a gather and a scatter (what made the load of
49 pages take 100-250 ms inside vLLM, docs/integrations/vllm.md, Performance).
"""

from __future__ import annotations

import pytest
import torch

from kvoffload.integrations.vllm_worker import block_tensors, copy_h2d, h2d_runs
from kvoffload.pools import EnginePages, HostPool

NB, BS = 16, 4

ORDERS = {
    "ascending": ([2, 3, 4, 5], [0, 1, 2, 3]),
    "both reversed": ([9, 8, 7, 6, 5], [4, 3, 2, 1, 0]),  # vLLM's reused blocks, the pool's pages
    "blocks reversed": ([9, 8, 7, 6], [0, 1, 2, 3]),
    "mixed": ([3, 2, 1, 10, 11, 12, 13], [6, 5, 4, 3, 2, 1, 0]),
    "scattered": ([14, 0, 9, 3, 7], [2, 7, 0, 5, 1]),
}


def _setup() -> tuple[EnginePages, HostPool, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    # vLLM's CPU attention: (num_blocks, kv_heads, block_size, 2 * head_size) per layer
    layers = [torch.zeros(NB, 2, BS, 8) for _ in range(3)]
    tensors = [t for i, kv in enumerate(layers) for t in block_tensors(kv, NB, BS, f"l{i}")]
    device = EnginePages(tensors, BS)
    host = HostPool.new(8, (device.page_bytes,), "uint8", zero=True)
    host.tensor.copy_(torch.randint(0, 256, tuple(host.tensor.shape), generator=g, dtype=torch.uint8))
    return device, host, layers


def _block(layers: list[torch.Tensor], b: int) -> bytes:
    return b"".join(kv[b].contiguous().view(torch.uint8).numpy().tobytes() for kv in layers)


@pytest.mark.parametrize("order", list(ORDERS))
def test_each_block_gets_its_host_pages_bytes_in_any_order(order: str) -> None:
    """Block ``device_pages[i]`` holds exactly host page ``host_pages[i]``'s bytes after
    the copy; every block not named keeps its bytes (zeros)."""
    device_pages, host_pages = ORDERS[order]
    device, host, layers = _setup()
    copy_h2d(device, host, device_pages, host_pages)
    raw = host.tensor.view(host.n_pages, -1)
    for d, h in zip(device_pages, host_pages, strict=True):
        assert _block(layers, d) == raw[h].numpy().tobytes(), (order, d, h)
    zero = bytes(len(_block(layers, 0)))
    for b in set(range(NB)) - set(device_pages):
        assert _block(layers, b) == zero, (order, b)


def test_pages_are_copied_as_runs_consecutive_on_both_sides() -> None:
    """Reversed blocks from reversed host pages are one run; a reversed run of blocks
    from ascending host pages is a run per page (each a block copy); a mixed order
    splits only where either side breaks."""
    assert h2d_runs(*ORDERS["ascending"]) == [(2, 0, 4)]
    assert h2d_runs(*ORDERS["both reversed"]) == [(5, 0, 5)]
    assert h2d_runs(*ORDERS["blocks reversed"]) == [(9, 0, 1), (8, 1, 1), (7, 2, 1), (6, 3, 1)]
    assert h2d_runs(*ORDERS["mixed"]) == [(13, 0, 1), (12, 1, 1), (11, 2, 1), (10, 3, 1), (1, 4, 3)]
    assert h2d_runs([], []) == []
