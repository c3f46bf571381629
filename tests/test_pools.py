"""Page pools: all-or-nothing allocation, frees checked before anything changes."""

from __future__ import annotations

import pytest
import torch

import kvoffload as kvo
from kvoffload.pools import DevicePool, HostPool


def test_allocate_is_all_or_nothing_and_refuses_a_negative_count() -> None:
    pool = DevicePool(torch.zeros(4, 2))
    with pytest.raises(kvo.PoolExhausted):
        pool.allocate(5)
    with pytest.raises(kvo.PageError, match="cannot allocate -1"):
        pool.allocate(-1)
    with pytest.raises(kvo.PageError):
        pool.try_allocate(-2)
    assert pool.used == 0
    pages = pool.allocate(4)
    assert sorted(pages) == [0, 1, 2, 3] and pool.used == 4
    pool.check()


@pytest.mark.parametrize("bad", [[0, 0], [0, 9], [1, -1], [3]], ids=["twice", "range", "negative", "free"])
def test_a_bad_free_raises_page_error_and_returns_nothing(bad: list[int]) -> None:
    pool = HostPool(torch.zeros(4, 2))
    held = pool.allocate(3)  # pages 0, 1, 2 (3 stays free)
    assert sorted(held) == [0, 1, 2]
    with pytest.raises(kvo.PageError):
        pool.free(bad)
    assert pool.used == 3 and all(pool.is_allocated(p) for p in held)
    pool.check()
    pool.free(held)
    assert pool.used == 0


def test_take_one_hands_out_what_allocate_would_and_minus_one_when_empty() -> None:
    """The one-token step's allocation: the same page allocate(1) would give, marked
    allocated (a double free still raises), and -1 with nothing changed when empty."""
    a, b = DevicePool.create(3, 2, (1,), "float32"), DevicePool.create(3, 2, (1,), "float32")
    assert [a.take_one() for _ in range(3)] == [b.allocate(1)[0] for _ in range(3)]
    assert a.take_one() == -1 and a.free_pages == 0
    a.free([1])
    with pytest.raises(kvo.PageError):
        a.free([1])
    a.check()
