"""Tensor parallelism (FAILURES F25): with a process group, every rank delivers the
same completions and releases the same lifecycles in the same poll, whatever order and
round each rank's copies finish in; nothing is released before every rank's copy of it
ended; a copy that fails on one rank fails its chunk on every rank.

Real gloo groups of 2 and 4 local ranks (spawned processes), a SimBackend per rank
whose copy engine finishes its copies in a rank-specific random order at
rank-specific rounds, driven by hypothesis-chosen schedules that every rank replays.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _rank_scenarios import (
    check_agreement,
    close_while_others_poll,
    diverged_admissions,
    mismatched_calls,
    partial_write,
    play,
    quiesce_timeout,
    storage_reads,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvoffload._testing.ranks import LocalRanks

#: A stray op of a replicated scheduler (any lifecycle, legal or not: a refused call
#: must be refused on every rank alike).
STRAY = st.one_of(
    st.tuples(st.just("extend"), st.integers(0, 50), st.integers(1, 16)),
    st.tuples(st.just("admit"), st.integers(1, 12)),
    st.tuples(st.sampled_from(["finish", "abort"]), st.integers(0, 50)),
)
#: A request: (arrival round, prompt tokens, output tokens, aborted half-way).
REQUESTS = st.tuples(st.integers(0, 8), st.integers(1, 12), st.integers(1, 40), st.booleans())


def decode_steps(requests: list[tuple[int, int, int, bool]], per_step: int) -> list[list[list[Any]]]:
    """The ops of a decode loop, round by round: arrivals are admitted, every running
    request commits ``per_step`` tokens, and finishes (or is aborted half-way) when it
    has its output."""
    steps: list[list[list[Any]]] = []
    running: dict[int, int] = {}  # admission index -> tokens still to decode
    order = sorted(range(len(requests)), key=lambda i: requests[i][0])
    admitted = 0
    r = 0
    while order or running:
        ops: list[list[Any]] = []
        for i in list(running):
            _, _, out, aborted = requests[i]
            if aborted and running[i] <= out // 2:
                ops.append(["abort", i])
                del running[i]
                continue
            ops.append(["extend", i, per_step])
            running[i] -= per_step
            if running[i] <= 0:
                ops.append(["finish", i])
                del running[i]
        while order and requests[order[0]][0] <= r:
            i = order.pop(0)
            ops.append(["admit", requests[i][1]])
            running[admitted] = requests[i][2]
            admitted += 1
        steps.append(ops)
        r += 1
    return steps


@st.composite
def tp_schedules(draw: st.DrawFn) -> dict[str, Any]:
    """A schedule every rank replays - a decode loop's ops per round with stray ops
    mixed in, max_completions per round, the chance a copy fails, the host-pool policy,
    the agreement's window and storage - and a seed from which each rank draws its own completion order and
    rounds."""
    requests = draw(st.lists(REQUESTS, min_size=1, max_size=6))
    steps = decode_steps(requests, draw(st.integers(1, 4)))
    for ops in steps:
        ops.extend(list(op) for op in draw(st.lists(STRAY, max_size=1)))
    policy = draw(st.sampled_from(["drop", "wait"]))
    return {
        "seed": draw(st.integers(0, 2**32 - 1)),
        "steps": steps,
        "limits": draw(
            st.lists(st.sampled_from([None, None, 0, 1, 3]), min_size=len(steps), max_size=len(steps))
        ),
        "fail": draw(st.sampled_from([0.0, 0.1, 0.3])),
        "config": {
            "on_host_full": policy,
            "host_wait_s": 0.005,
            "host_pages": draw(st.sampled_from([2, 16])),
            "tp_window": draw(st.sampled_from([64, 2])),  # 2: more in flight than the window
        },
        "storage": draw(st.sampled_from([None, "memory"])),
    }


CI = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize(("n", "examples"), [(2, 30), (4, 12)])
def test_every_rank_releases_the_same_lifecycles_in_the_same_poll(
    ranks: Callable[[int], LocalRanks], n: int, examples: int
) -> None:
    """Drawn schedules on n ranks: per-round release lists (and the ops' outcomes, the
    completions delivered, the statistics) identical on every rank; no release before
    every rank's copies of that lifecycle ended; FAILED exactly where a copy failed on
    some rank; every ledger balanced."""
    pool = ranks(n)

    @settings(CI, max_examples=examples)
    @given(sched=tp_schedules())
    def agree(sched: dict[str, Any]) -> None:
        check_agreement(pool.run(play, sched))

    agree()


def test_f25_ranks_release_the_same_lifecycle_in_the_same_poll_however_late_a_rank_finishes(
    ranks: Callable[[int], LocalRanks],
) -> None:
    """F25, scripted on 2 ranks. A and B each have a copy in flight and finish. Round 0:
    rank 0 finishes A's copy, rank 1 does not; round 1: B's copy fails on rank 0 and
    succeeds on rank 1; round 2: rank 1 finishes A's copy. Every rank releases B
    (FAILED, on both) in round 1 and A (COMPLETED) in round 2 - not rank 0 in round 0 -
    and A's pages stay held on rank 0 until then, though its own copy had ended."""
    sched = {
        "seed": 0,
        "steps": [
            [["admit", 4], ["admit", 4], ["extend", 0, 4], ["extend", 1, 4], ["finish", 0], ["finish", 1]],
            [],
            [],
        ],
        "limits": [None, None, None],
        "fail": 0.0,
        "script": {"0": {"0": [[0, False]], "1": [[1, True]]}, "1": {"1": [[1, False]], "2": [[0, False]]}},
    }
    results = ranks(2).run(play, sched)
    check_agreement(results)
    for res in results:
        by_round = [released for _, _, released, _ in res["trace"][:3]]
        assert by_round == [[], [[2, "failed"]], [[1, "completed"]]], res["trace"]
        assert res["pages_held"][:3] == [4, 2, 0]  # A holds its 2 pages until every rank's copy ended


def test_a_copy_that_fails_on_one_rank_of_four_fails_its_chunk_on_all_four(
    ranks: Callable[[int], LocalRanks],
) -> None:
    """Rank 3's copy fails, ranks 0-2's succeed (in other rounds): every rank releases the
    lifecycle FAILED in the same round - the round rank 3's failure came in, the last."""
    sched = {
        "seed": 0,
        "steps": [[["admit", 4], ["extend", 0, 4], ["finish", 0]], [], [], []],
        "limits": [None] * 4,
        "fail": 0.0,
        "script": {
            "0": {"0": [[0, False]]},
            "1": {"1": [[0, False]]},
            "2": {"0": [[0, False]]},
            "3": {"2": [[0, True]]},
        },
    }
    results = ranks(4).run(play, sched)
    check_agreement(results)
    for res in results:
        assert [released for _, _, released, _ in res["trace"][:4]] == [[], [], [[1, "failed"]], []]
        assert res["stats"]["chunks_failed"] == 1 and res["stats"]["released_failed"] == 1


def test_max_completions_is_agreed_the_smallest_any_rank_passed(ranks: Callable[[int], LocalRanks]) -> None:
    """Three copies ended everywhere; poll(max_completions=1) delivers one a round on
    every rank, the oldest first."""
    sched = {
        "seed": 0,
        "steps": [[["admit", 4], ["admit", 4], ["admit", 4]] + [["extend", i, 4] for i in range(3)], [], []],
        "limits": [1, 1, 1],
        "fail": 0.0,
        "script": {str(r): {"0": [[2, False], [0, False], [1, False]]} for r in range(2)},
    }
    results = ranks(2).run(play, sched)
    check_agreement(results)
    assert [n for *_, n in results[0]["trace"][:3]] == [1, 1, 1]


def test_quiesce_times_out_on_every_rank_when_it_times_out_on_one(ranks: Callable[[int], LocalRanks]) -> None:
    """A copy stays in flight on rank 1. Rank 0 quiesces with a 0.3 s timeout, rank 1
    with none: both raise DrainTimeout, in the same call (the decision is agreed, not
    each rank's own clock); once the copy ends, quiesce returns on both."""
    results = ranks(2).run(quiesce_timeout, [0.3, None])
    assert [r["first"] for r in results] == ["DrainTimeout", "DrainTimeout"]
    assert all(r["inflight"] == 0 for r in results)


def test_ranks_in_different_collectives_raise_ranks_diverged_on_every_rank(
    ranks: Callable[[int], LocalRanks],
) -> None:
    """Rank 0 in poll(), rank 1 in quiesce(): both raise RanksDiverged naming the two
    calls; nothing hangs."""
    results = ranks(2).run(mismatched_calls)
    assert all(r.startswith("RanksDiverged") and "poll() and quiesce()" in r for r in results), results


def test_a_rank_that_closes_while_the_others_poll_still_closes_and_both_are_told(
    ranks: Callable[[int], LocalRanks],
) -> None:
    """close() on rank 0 meets poll() on rank 1: RanksDiverged on both; rank 0's close
    finishes alone (its finished copy delivered, pages back, the manager closed), and
    so does rank 1's later close - nothing left half open."""
    results = ranks(2).run(close_while_others_poll)
    assert all("close() and poll()" in r["call"] or "poll() and close()" in r["call"] for r in results)
    assert all(r["state"] == "RELEASED" and r["closed"] for r in results), results


def test_ranks_that_admitted_differently_are_told_so_in_the_next_poll(
    ranks: Callable[[int], LocalRanks],
) -> None:
    """Rank 1 admitted a request rank 0 did not: the next poll raises RanksDiverged on
    both ranks (naming what differs), and every later collective raises at once."""
    results = ranks(2).run(diverged_admissions)
    for first, second in results:
        assert "lifecycles admitted differ across ranks (1 to 2)" in first
        assert "an earlier collective failed" in second


def test_each_rank_stores_its_shard_under_its_own_keys_and_lookup_agrees_on_the_minimum(
    ranks: Callable[[int], LocalRanks], tmp_path: Path
) -> None:
    """tp_keys="rank" (the default) on one shared file store: each rank copies and stores
    its own shard under ``<key>_<rank>_<size>``; after rank 1 loses its shard of the third
    page, lookup says 2 pages on every rank and fetch returns 2 pages on every rank,
    each rank its own shard's bytes."""
    results = ranks(2).run(storage_reads, str(tmp_path), "rank", 1)
    assert [r["copied_here"] for r in results] == [2, 2]
    assert [r["found"] for r in results] == [8, 8]
    assert [r["fetched"] for r in results] == [2, 2]
    assert results[0]["bytes"] != results[1]["bytes"]  # rank 0's shard is not rank 1's
    names = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert len(names) == 7  # 4 shards each, less the one rank 1 lost
    assert sum(n.endswith("_0_2") for n in names) == 4 and sum(n.endswith("_1_2") for n in names) == 3
    assert all(r["stats"]["pages_stored"] == 4 for r in results)


def test_shared_keys_one_rank_writes_and_every_rank_reads(
    ranks: Callable[[int], LocalRanks], tmp_path: Path
) -> None:
    """tp_keys="shared" (MLA: the same KV on every rank): rank 0 copies and writes under
    the plain page keys, rank 1 copies nothing; both see the 4 pages and read the same
    bytes; both count the pages as stored (rank 0's outcome)."""
    results = ranks(2).run(storage_reads, str(tmp_path), "shared", None)
    assert [r["copied_here"] for r in results] == [2, 0]
    assert [r["found"] for r in results] == [16, 16]
    assert results[0]["bytes"] == results[1]["bytes"]
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) == 4
    assert all(r["stats"]["pages_stored"] == 4 for r in results)


def test_the_suite_fails_on_ranks_that_deliver_without_agreeing(ranks: Callable[[int], LocalRanks]) -> None:
    """The meta-test: on a manager whose ranks each deliver what they finished without
    the all-reduce (what kvoffload did before F25), the property above fails within the
    CI budget, on 2 ranks."""
    pool = ranks(2)

    @settings(CI, max_examples=30, phases=[Phase.generate])
    @given(sched=tp_schedules())
    def agree(sched: dict[str, Any]) -> None:
        check_agreement(pool.run(play, sched, "unagreed"))

    with pytest.raises(AssertionError, match=r"round \d+: rank 0 saw|released in round"):
        agree()


def test_a_write_one_rank_stored_in_part_counts_the_same_confirmed_prefix_on_every_rank(
    ranks: Callable[[int], LocalRanks],
) -> None:
    """F34 under TP: a page is stored only when every rank's store confirmed its shard.
    Rank 1's store refuses its shard of the chunk's second page (and stores the third);
    every rank agrees on the prefix every rank stored - the prompt page and the chunk's
    first page - with the same statistics, the same hole (pages_lost) and lookup."""
    results = ranks(2).run(partial_write)
    assert [r["found"] for r in results] == [8, 8]
    assert [r["lost"] for r in results] == [2, 2]
    stats = [{k: r["stats"][k] for k in ("pages_stored", "pages_store_failed", "chunks_store_partial")}
             for r in results]  # fmt: skip
    assert stats == [{"pages_stored": 2, "pages_store_failed": 2, "chunks_store_partial": 1}] * 2
