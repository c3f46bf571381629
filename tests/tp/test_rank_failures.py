"""A rank that dies or stops polling (F25, issue 12): the other ranks raise RankTimeout
within tp_timeout_s, free no page under a copy, and nothing hangs - close() drains this
rank's own copies and returns. Each test starts ranks of its own: the failure breaks
their group."""

from __future__ import annotations

from pathlib import Path

import pytest
from _rank_scenarios import stop_polling

from kvoffload._testing.ranks import LocalRanks


@pytest.mark.parametrize("how", ["sleep", "die"])
def test_a_rank_that_stops_polling_or_dies_makes_the_others_raise_rank_timeout(
    how: str, tmp_path: Path
) -> None:
    """Rank 1 stops taking part (sleeps until rank 0 is done, past its 1 s tp_timeout_s,
    or exits: F39, no sleep of a fixed length). Rank 0's poll raises RankTimeout,
    delivering nothing: its lifecycle stays FINISHING with its pages held, though rank
    0's own copy ended; the next poll raises at once; close() returns, delivering rank
    0's own finished copy, and then the pages are back."""
    with LocalRanks(2, timeout_s=60) as pool:
        outcomes = pool.outcomes(stop_polling, how, str(tmp_path / "rank0-done"))
    rank0 = outcomes[0]
    assert rank0.ok, rank0.error
    out = rank0.value
    assert out["first"] == "RankTimeout", out
    assert "a rank died or stopped calling" in out["message"]
    assert out["state"] == "FINISHING" and out["pages_held"] == 2
    assert out["second"] == "RankTimeout"
    assert out["close"] == "closed" and out["after_close"] == "RELEASED" and out["pages_after_close"] == 0
    rank1 = outcomes[1]
    if how == "die":
        assert not rank1.ok and "died" in rank1.error
    else:  # rank 1 finds rank 0 gone from the collective too, and is not left waiting
        assert rank1.ok, rank1.error
        assert "RankTimeout" in (rank1.value["first"], rank1.value["second"]), rank1.value
