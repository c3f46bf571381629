"""Local gloo ranks shared by the tensor-parallel tests: one group of 2 and one of 4,
spawned once per session (a rank costs seconds to start) and started again if a test
broke them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvoffload._testing.ranks import LocalRanks

#: Seconds one multi-rank call may take before the test fails (a hang guard, not a timing
#: assertion: every collective inside has its own tp_timeout_s).
RUN_S = 60.0


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], LocalRanks]]:
    """``ranks(n)``: the session's n local ranks (n = 2 or 4)."""
    pools: dict[int, LocalRanks] = {}

    def get(n: int) -> LocalRanks:
        pool = pools.get(n)
        if pool is None or pool.broken:
            pool = pools[n] = LocalRanks(n, timeout_s=RUN_S)
        return pool

    yield get
    for pool in pools.values():
        pool.close()
