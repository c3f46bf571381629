"""Page pools: all-or-nothing allocation, frees checked before anything changes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

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


@given(
    held=st.lists(st.integers(0, 11), max_size=12, unique=True),
    counts=st.lists(st.integers(0, 6), max_size=8),
)
def test_take_each_hands_out_what_try_allocate_one_after_another_would(
    held: list[int], counts: list[int]
) -> None:
    """The batched step's allocation for a run of chunks: the same pages, in the same
    order, as successive ``try_allocate`` calls, ``None`` where the pool had too few at
    that point (a later, smaller count can still fit), and the free list left alike."""
    one, each = HostPool(torch.zeros(12, 1)), HostPool(torch.zeros(12, 1))
    for pool in (one, each):
        pool.take_pages(held)
    want = [one.try_allocate(n) for n in counts]
    assert each.take_each(counts) == want
    assert each._free == one._free and each._allocated == one._allocated
    each.check()


def test_take_each_refuses_a_negative_count_and_takes_nothing() -> None:
    pool = HostPool(torch.zeros(4, 1))
    with pytest.raises(kvo.PageError, match="cannot allocate -1"):
        pool.take_each([2, -1])
    assert pool.used == 0
    pool.check()
