"""Polls with nothing to agree on skip the collective, on every rank alike (F25;
kvoffload.drivers.distributed, "Polls that skip").

The skip schedule is computed from state every rank shares (nothing in flight,
pending or deferred; nothing submitted or admitted since the last collective; at most
IDLE_SKIPS in a row), never from a rank's own readiness: ranks that make the same
calls skip the same polls, deliver the same completions at the same polls as without
the skip, and ranks whose schedules differ are told so (RanksDiverged on every rank,
within IDLE_SKIPS polls) instead of hanging or drifting apart. Real gloo groups of 2
and 4 spawned ranks; every wait bounded (tp_timeout_s, the pool's RUN_S).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _skip_scenarios import decode_with_quiet_stretches, one_rank_never_skips

from kvoffload._testing.ranks import LocalRanks
from kvoffload.drivers.distributed import IDLE_SKIPS


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("seed", [1, 7])
def test_every_rank_skips_the_same_polls_and_delivers_the_same_completions(
    size: int, seed: int, ranks: Callable[[int], LocalRanks]
) -> None:
    """F25: a decode loop with quiet stretches, each rank's copies finishing at its own
    random steps. Every rank skips exactly the same polls, and delivers and releases
    the same completions and lifecycles at every poll; some polls skip, some do not,
    and never more than IDLE_SKIPS in a row."""
    out = ranks(size).run(decode_with_quiet_stretches, seed, None)
    logs = [o["polls"] for o in out]
    assert all(log == logs[0] for log in logs[1:]), "the ranks' polls differ"
    skips = [p[0] for p in logs[0]]
    assert 0 < sum(skips) < len(skips), skips
    run = longest = 0
    for s in skips:
        run = run + 1 if s else 0
        longest = max(longest, run)
    assert longest <= IDLE_SKIPS
    assert any(p[1] for p in logs[0]), "no completion was delivered: the schedule tests nothing"


@pytest.mark.parametrize("size", [2, 4])
def test_the_skip_delivers_every_completion_at_the_same_poll_as_without_it(
    size: int, ranks: Callable[[int], LocalRanks]
) -> None:
    """F25: the same schedule and the same per-rank copy timing, with the skip as
    shipped and with it off (IDLE_SKIPS 0 on every rank): every poll delivers the same
    completions and releases the same lifecycles in both runs."""
    pool = ranks(size)
    with_skip = pool.run(decode_with_quiet_stretches, 3, None)
    without = pool.run(decode_with_quiet_stretches, 3, 0)
    assert all(o["skipped"] == 0 for o in without)
    assert with_skip[0]["skipped"] > 0
    for a, b in zip(with_skip, without, strict=True):
        assert [p[1:] for p in a["polls"]] == [p[1:] for p in b["polls"]]


def test_a_rank_that_runs_the_collective_while_another_skips_raises_ranks_diverged_on_both() -> None:
    """F25: rank 1 computes the schedule differently (never skips) while rank 0 skips
    as shipped. Without the call number in the header, rank 0's next collective would
    pair with rank 1's earlier one and both would go on one call apart (a later hang
    or wrong deliveries). With it, both raise RanksDiverged naming the call numbers:
    rank 1 in its second poll, rank 0 in the first poll after IDLE_SKIPS skipped."""
    with LocalRanks(2, timeout_s=60) as pool:  # the failure breaks the group: a pool of its own
        out = pool.run(one_rank_never_skips)
    assert out[0]["raised_at"] == IDLE_SKIPS + 2, out
    assert out[1]["raised_at"] == 2, out
    for o in out:
        assert o["error"].startswith("RanksDiverged"), o
        assert "different collective calls" in o["error"], o


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("seed", [3, 11])
def test_the_compact_exchange_delivers_what_the_full_one_does_at_every_poll(
    size: int, seed: int, ranks: Callable[[int], LocalRanks]
) -> None:
    """F25: every call starts with the compact exchange (2 int64) and goes on to the
    full one only when the MIN says a rank needs it (a failure, a copy finished out of
    order, differing state). The same schedule and per-rank copy timing with the
    compact exchange as shipped and with every call taking the full exchange
    (FULL_EVERY 1): every poll delivers the same completions and releases the same
    lifecycles on every rank, and the compact exchange decided some calls alone (the
    same number on every rank) while others went on to the full one."""
    pool = ranks(size)
    compact = pool.run(decode_with_quiet_stretches, seed, None, None)
    full = pool.run(decode_with_quiet_stretches, seed, None, 1)
    assert all(o["compact"] == 0 for o in full)
    assert len({o["compact"] for o in compact}) == 1
    o = compact[0]
    assert 0 < o["compact"] < o["calls"] - o["skipped"], o  # (quiesce and close: the full one)
    for a, b in zip(compact, full, strict=True):
        assert a["polls"] == b["polls"]
