"""The settings every rank must share are checked when the managers are built, before
any collective that depends on them; and a rank that never copies ("shared" keys, rank
above 0) holds no host memory.

Real gloo groups of 2 local ranks (the session's, from conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _settings_scenarios import differing_settings, host_pool_bytes

from kvoffload._testing.ranks import LocalRanks


def test_ranks_whose_tp_window_differs_are_refused_at_construction_not_aborted(
    ranks: Callable[[int], LocalRanks],
) -> None:
    """tp_window sizes the all-reduce of every poll: ranks of 64 and 32 slots would hand
    gloo buffers of different lengths (it aborts the process, SIGABRT, no Python
    error). Building the managers raises ConfigError on both ranks, naming the field
    and each rank's value, and the group is still usable after it."""
    pool = ranks(2)
    results = pool.run(differing_settings, {"1": {"tp_window": 32}})
    for res in results:
        assert res["first"].startswith("ConfigError: "), res
        assert "tp_window (rank 0: 64, rank 1: 32)" in res["first"], res["first"]
        assert res["after"] == "completed", res


def test_ranks_whose_shared_settings_differ_are_told_every_field_that_differs(
    ranks: Callable[[int], LocalRanks],
) -> None:
    """page_size, stride, host_pages, tp_keys, on_host_full and namespace decide which
    transfers each rank makes and which keys it stores under: ranks that differ in any
    would diverge later (or store what the others never find). Every rank raises at
    construction, naming each differing field with every rank's value - and only those."""
    changes: dict[str, dict[str, Any]] = {
        "0": {"namespace": "tenant-a"},
        "1": {
            "page_size": 8,
            "stride": 8,
            "host_pages": 32,
            "tp_keys": "shared",
            "on_host_full": "wait",
            "namespace": "tenant-b",
        },
    }
    results = ranks(2).run(differing_settings, changes)
    want = [
        "page_size (rank 0: 4, rank 1: 8)",
        "stride (rank 0: 4, rank 1: 8)",
        "host_pages (rank 0: 16, rank 1: 32)",
        "tp_keys (rank 0: 'rank', rank 1: 'shared')",
        "on_host_full (rank 0: 'drop', rank 1: 'wait')",
        "namespace (rank 0: 'tenant-a', rank 1: 'tenant-b')",
    ]
    for res in results:
        assert res["first"].startswith("ConfigError: "), res
        for field in want:
            assert field in res["first"], (field, res["first"])
        assert "tp_window" not in res["first"] and "device_pages" not in res["first"]
        assert res["after"] == "completed", res
    assert results[0]["first"].split(": ", 2)[2] == results[1]["first"].split(": ", 2)[2]


@pytest.mark.parametrize("engine_owned", [False, True], ids=["owned", "engine-owned"])
def test_under_shared_keys_only_the_rank_that_copies_holds_host_memory(
    ranks: Callable[[int], LocalRanks], engine_owned: bool
) -> None:
    """tp_keys="shared" (MLA): rank 0 copies and writes, the others copy nothing. Every
    rank keeps the host pool's page accounting (their decisions must stay the same), but
    only rank 0 allocates its memory; under "rank" keys every rank does."""
    shared = ranks(2).run(host_pool_bytes, "shared", engine_owned)
    per_rank = ranks(2).run(host_pool_bytes, "rank", engine_owned)
    full = 16 * shared[0]["page_bytes"]
    assert full > 0
    assert [r["nbytes"] for r in shared] == [full, 0]
    assert [r["nbytes"] for r in per_rank] == [full, full]
    assert [r["pages"] for r in shared + per_rank] == [16] * 4


def test_the_shared_settings_are_config_fields_and_the_digest_has_a_fixed_size() -> None:
    """Every name ranks compare is an OffloadConfig field (a rename cannot silently drop
    one from the check); the digest of any config fits the fixed-size exchange, and two
    configs differing in one shared field differ in exactly that slot."""
    import dataclasses

    import kvoffload as kvo
    from kvoffload.drivers.distributed import _DIGEST_SLOTS, SHARED_SETTINGS, settings_digest

    fields = {f.name for f in dataclasses.fields(kvo.OffloadConfig)}
    assert set(SHARED_SETTINGS) <= fields
    base = kvo.OffloadConfig(page_size=4, stride=4, device_pages=8, host_pages=8)
    other = dataclasses.replace(base, namespace="tenant-b")
    a, b = settings_digest(base), settings_digest(other)
    assert len(a) <= _DIGEST_SLOTS
    assert [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y] == [
        1 + SHARED_SETTINGS.index("namespace")
    ]
    assert settings_digest(dataclasses.replace(base, drain_timeout_s=1.0)) == a  # a rank's own


def test_a_rank_killed_by_a_signal_is_reported_by_the_signal_name() -> None:
    """gloo aborts a rank's process on a collective mismatch (SIGABRT, no Python error):
    LocalRanks says so by name instead of a bare negative exit code."""
    from kvoffload._testing.ranks import _exit_text

    assert _exit_text(-6) == "killed by SIGABRT"
    assert _exit_text(3) == "exit code 3"
