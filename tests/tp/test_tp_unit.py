"""Tensor parallelism in one process: the core's submission numbers, the config and group
checks, and a manager on a gloo group of one rank (which takes the collective path with
itself), so the single-rank behaviour is the plain driver's."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch.distributed as dist

import kvoffload as kvo
from kvoffload.drivers.distributed import HEADER
from kvoffload.storage.memory import MemoryStorage
from kvoffload.testing import SimBackend


def cfg(**changes: Any) -> kvo.OffloadConfig:
    fields: dict[str, Any] = dict(page_size=4, stride=4, device_pages=64, host_pages=64, drain_timeout_s=5)
    fields.update(changes)
    return kvo.OffloadConfig(**fields)


def solo_group() -> Any:
    """A gloo process group of one rank, without touching torch.distributed's globals."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))


class Refusing(SimBackend):
    refuse = False

    def submit(self, transfer: kvo.Transfer) -> None:
        if self.refuse:
            raise kvo.BackendError("simulated: the copy engine refused")
        super().submit(transfer)


# --- Transfer.seq -------------------------------------------------------------------------


def test_the_core_numbers_its_submissions_in_order_and_a_refusal_takes_no_number() -> None:
    """seq is 0, 1, 2... per core, in submission order (Transfer.id is process-wide, so
    two managers' first transfers have different ids but the same seq); a submission the
    backend refuses consumes no number."""
    seqs = []
    for _ in range(2):
        backend = Refusing()
        with kvo.SyncOffloadManager(cfg(), backend=backend) as mgr:
            a, b = mgr.admit("a", [1, 2, 3, 4]), mgr.admit("b", [1, 2, 3, 4])
            a.extend([5, 6, 7, 8])
            backend.refuse = True
            with pytest.raises(kvo.BackendError):
                b.extend([5, 6, 7, 8])
            backend.refuse = False
            b.extend([5, 6, 7, 8])
            a.extend([9, 10, 11, 12])
            seqs.append([(t.seq, t.id) for t in backend.pending])
            assert [t.seq for t in mgr.core.inflight.values()] == [0, 1, 2]
            mgr.check_invariants()
            backend.complete_all()
    assert [s for s, _ in seqs[0]] == [s for s, _ in seqs[1]] == [0, 1, 2]
    assert seqs[0][0][1] != seqs[1][0][1]


# --- config and group checks --------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"tp_size": 0}, "tp_size must be None or an int >= 1"),
        ({"tp_size": True}, "tp_size must be None or an int >= 1"),
        ({"tp_keys": "per-rank"}, "tp_keys must be 'rank'"),
        ({"tp_timeout_s": float("inf")}, "nothing waits for ever"),
        ({"tp_timeout_s": 0}, "tp_timeout_s must be a finite number > 0"),
        ({"tp_window": 0}, "tp_window must be an int between 1 and 4096"),
        ({"tp_window": 4097}, "tp_window must be an int between 1 and 4096"),
    ],
)
def test_bad_tensor_parallel_settings_are_refused_naming_the_field(
    changes: dict[str, Any], match: str
) -> None:
    with pytest.raises(kvo.ConfigError, match=match):
        cfg(**changes)


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ([0, 1], "group must be a torch.distributed ProcessGroup .* got list"),
        ("tp", "group must be a torch.distributed ProcessGroup .* got str"),
        (-100, "NON_GROUP_MEMBER: this process is not a member"),
    ],
)
def test_a_group_that_is_not_a_process_group_is_refused(group: Any, match: str) -> None:
    """Not a ProcessGroup, or the sentinel dist.new_group returns to ranks outside it:
    ConfigError naming what was passed."""
    with pytest.raises(kvo.ConfigError, match=match):
        kvo.SyncOffloadManager(cfg(), backend="sim", group=group)


def test_a_group_of_another_size_than_tp_size_is_refused() -> None:
    with pytest.raises(kvo.ConfigError, match=r"group has 1 rank\(s\) but config.tp_size is 2"):
        kvo.SyncOffloadManager(cfg(tp_size=2), backend="sim", group=solo_group())


def test_no_group_when_tp_size_says_tensor_parallel_is_refused() -> None:
    """tp_size=2 and no group: each rank would deliver on its own (F25) - refused, on
    both drivers (the asyncio one has no tensor parallelism at all)."""
    with pytest.raises(kvo.ConfigError, match="tp_size is 2 but no group was given"):
        kvo.SyncOffloadManager(cfg(tp_size=2), backend="sim")
    with pytest.raises(kvo.ConfigError, match="asyncio OffloadManager has no tensor parallelism"):
        kvo.OffloadManager(cfg(tp_size=2), backend="sim")
    with pytest.raises(kvo.ConfigError, match="asyncio OffloadManager has no tensor parallelism"):
        kvo.OffloadManager(cfg(), backend="sim", group=solo_group())  # a clear error, not a TypeError
    kvo.SyncOffloadManager(cfg(tp_size=1), backend="sim")  # one rank needs no group


def test_max_completions_must_be_a_count() -> None:
    with kvo.SyncOffloadManager(cfg(), backend="sim") as mgr:
        for bad in (-1, 1.5, "2"):
            with pytest.raises(kvo.ConfigError, match="max_completions must be None or an int >= 0"):
                mgr.poll(bad)  # type: ignore[arg-type]


# --- one rank -------------------------------------------------------------------------------


def test_one_rank_group_delivers_as_the_plain_driver_does() -> None:
    """The same scenario with and without a group of one: the same releases, outcomes
    and statistics; the collective carries 2 * tp_window + HEADER int64."""
    runs = []
    for group in (None, solo_group()):
        backend = SimBackend()
        released: list[kvo.Lifecycle] = []
        mgr = kvo.SyncOffloadManager(cfg(), backend=backend, group=group, on_released=released.append)
        with mgr:
            lcs = [mgr.admit(f"r{i}", [1, 2, 3, 4]) for i in range(3)]
            for lc in lcs:
                lc.extend([5, 6, 7, 8, 9])
            lcs[0].finish()
            lcs[1].abort()
            backend.fail(backend.pending[2])
            backend.complete(backend.pending[0])
            assert mgr.poll(max_completions=1) == 1
            mgr.poll()
            backend.complete_all()
            mgr.quiesce(5)
            lcs[2].finish()
            mgr.poll()
            mgr.check_invariants()
        runs.append(([lc.id for lc in released], [lc.outcome for lc in lcs], mgr.statistics().as_dict()))
        if group is not None:
            assert mgr._tp is not None and mgr._tp._buf.numel() == HEADER + 2 * mgr.config.tp_window
            assert HEADER == 14  # as the docs and OffloadConfig.tp_window say
    assert runs[0][:2] == runs[1][:2]
    assert runs[0][2] == runs[1][2]


def test_a_refusal_under_a_group_fails_the_chunk_at_the_next_poll_instead_of_raising() -> None:
    """Under a group a backend refusal cannot raise from extend (the other ranks' cores
    would have the chunk and this one not): the chunk fails at the next poll, on every
    rank alike, and its lifecycle is released FAILED."""
    backend = Refusing()
    with kvo.SyncOffloadManager(cfg(), backend=backend, group=solo_group()) as mgr:
        lc = mgr.admit("a", [1, 2, 3, 4])
        backend.refuse = True
        lc.extend([5, 6, 7, 8])  # no raise
        backend.refuse = False
        assert lc.inflight == 1 and not backend.pending
        lc.finish()
        mgr.poll()
        assert lc.outcome is kvo.Outcome.FAILED
        assert mgr.statistics().chunks_failed == 1
        mgr.check_invariants()


@pytest.mark.parametrize(("keys", "suffix"), [("rank", "_0_1"), ("shared", "")])
def test_storage_keys_carry_the_rank_unless_shared(keys: str, suffix: str) -> None:
    """tp_keys="rank": pages are stored under ``<page key>_<rank>_<size>``, lookup and
    fetch read them back; "shared": under the page keys themselves."""
    store = MemoryStorage()
    backend = SimBackend()
    with kvo.SyncOffloadManager(
        cfg(tp_keys=keys, offload_prompt=True), backend=backend, storage=store, group=solo_group()
    ) as mgr:
        lc = mgr.admit("a", list(range(8)))
        lc.finish()
        backend.complete_all()
        for _ in range(500):
            mgr.poll()
            if not mgr.writes_pending:
                break
            mgr.wait_progress(0.01)
        want = kvo.chain_keys(None, list(range(8)), 4)
        assert sorted(store.pages) == sorted(k + suffix for k in want)
        assert mgr.lookup(list(range(8))) == 8
        assert len(mgr.fetch(list(range(8)), 8)) == 2
        assert (mgr.storage is store) == (keys == "shared")
        assert mgr.statistics().pages_stored == 2
