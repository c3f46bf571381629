"""kvoffload's connector inside real vLLM engines under tensor parallelism (issue 22,
points 5 and 7): two ranks, each a worker process of vLLM's multiprocessing executor,
on the file store.

vLLM's CPU build binds each rank's OpenMP threads to CPUs of their own
(``VLLM_CPU_OMP_THREADS_BIND``; its automatic binding wants a NUMA node per rank, which
a 2-core VM lacks), so the engines here bind rank 0 and rank 1 to one allowed CPU each.
Each engine is a process of its own, started once for the main requests (a shared
200-token prefix; ``d0`` decodes 64 tokens):

- **baseline**: two ranks, no connector: the outputs every run here must reproduce
  (tensor parallelism sums the heads' partial products in another order than one rank
  does, so the one-rank baseline of conftest.py is not the reference).
- **store**: an empty store: each rank stores its own heads' shard of every block under
  its own key (``<key>_<rank>_2``).
- **load**: a fresh engine on what **store** left: both ranks load, the outputs are the
  baseline's.
- **one rank corrupt**: a copy of the store with rank 1's shards flipped: rank 0's loads
  succeed, rank 1's fail their checksums; vLLM merges the ranks' load errors and
  recomputes, and the outputs are the baseline's.
- **one rank missing**: a copy of the store without rank 1's shards: a block counts as
  stored only when every rank's shard is, so nothing is loaded.

Skipped without vLLM unless ``KVOFFLOAD_REQUIRE_VLLM=1``, and where fewer than two CPUs
are allowed to this process (one per rank)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import vllm_engines as ve

ve.require()

TP = 2
NAMESPACE = "tenant-tp"
MAIN = [r["name"] for r in ve.main_requests() if r["name"] != "d0"]
SHARD = re.compile(r"^(?P<key>[0-9a-f]+)_(?P<rank>\d+)_(?P<size>\d+)$")


def _bind() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two ranks: one allowed CPU each."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < TP:
        pytest.skip(f"{TP} ranks need {TP} allowed CPUs (one each); this process has {len(cpus)}")
    return "|".join(str(c) for c in cpus[:TP])


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvoffload-tp")


def _run(model: Path, work: Path, name: str, store: str | None) -> dict[str, Any]:
    kv = ve.kvoffload_connector(str(work / store), NAMESPACE) if store else None
    phases = [{"name": "main", "requests": ve.main_requests()}]
    spec = ve.spec(model, phases, kv, engine_args={"tensor_parallel_size": TP}, inproc=False)
    return ve.run_engine(spec, work, name, env={"VLLM_CPU_OMP_THREADS_BIND": _bind()})


def _shards(root: Path) -> dict[str, set[int]]:
    """Per page key under ``root``: the ranks whose shard file is there (every file a
    shard of a 2-rank engine: anything else fails the test)."""
    found: dict[str, set[int]] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        m = SHARD.match(p.name)
        assert m is not None and int(m["size"]) == TP, f"not a shard of a {TP}-rank engine: {p}"
        found.setdefault(m["key"], set()).add(int(m["rank"]))
    return found


def _rank_files(root: Path, rank: int) -> list[Path]:
    return sorted(p for p in root.rglob(f"*_{rank}_{TP}") if p.is_file())


@pytest.fixture(scope="module")
def tp_baseline(tiny_model: Path, work: Path) -> dict[str, Any]:
    return _run(tiny_model, work, "baseline", None)


@pytest.fixture(scope="module")
def tp_stored(tiny_model: Path, work: Path) -> dict[str, Any]:
    return _run(tiny_model, work, "store", "store")


@pytest.fixture(scope="module")
def tp_loaded(tp_stored: dict[str, Any], tiny_model: Path, work: Path) -> dict[str, Any]:
    return _run(tiny_model, work, "load", "store")


def _flip_tail(p: Path) -> None:
    """Flip the last 8 bytes of ``p`` (inside the page: a record ends with its page)."""
    data = bytearray(p.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    p.write_bytes(bytes(data))


def _rank_1_altered(model: Path, work: Path, name: str, alter: Callable[[Path], None]) -> dict[str, Any]:
    """A fresh engine on a copy of the store whose rank-1 shards ``alter`` changed."""
    shutil.copytree(work / "store", work / name)
    shards = _rank_files(work / name, 1)
    assert shards, "the store engine left no shard of rank 1"
    for p in shards:
        alter(p)
    return _run(model, work, name, name)


@pytest.fixture(scope="module")
def tp_rank_corrupt(tp_stored: dict[str, Any], tiny_model: Path, work: Path) -> dict[str, Any]:
    return _rank_1_altered(tiny_model, work, "corrupt", _flip_tail)


@pytest.fixture(scope="module")
def tp_rank_missing(tp_stored: dict[str, Any], tiny_model: Path, work: Path) -> dict[str, Any]:
    return _rank_1_altered(tiny_model, work, "missing", Path.unlink)


def _cached(run: dict[str, Any], name: str) -> int:
    n: int = run["requests"][name]["num_cached_tokens"]
    return n


def _names(run: dict[str, Any]) -> list[str]:
    return sorted(run["requests"])


def test_each_rank_stores_its_own_shard_of_every_block(
    tp_stored: dict[str, Any], tp_baseline: dict[str, Any], work: Path
) -> None:
    """An empty store: nothing loaded, the baseline's outputs, and both ranks' shards of
    every block stored: the shared prefix's 6 whole blocks once (not once per request),
    and at least each request's whole prompt blocks."""
    assert ve.engine_errors(tp_stored["log"]) == []
    for n in _names(tp_stored):
        assert _cached(tp_stored, n) == 0, n
    ve.assert_same_outputs(tp_stored, tp_baseline, _names(tp_baseline), what="tp store")
    shards = _shards(work / "store")
    assert all(ranks == {0, 1} for ranks in shards.values()), shards
    # r0..r2 share 6 blocks and add 0 of their own; d0's prompt is 2 blocks and its 64
    # decoded tokens fill 2 more
    assert len(shards) >= 6 + 2, sorted(shards)


def test_a_fresh_two_rank_engine_loads_what_another_stored(
    tp_loaded: dict[str, Any], tp_baseline: dict[str, Any]
) -> None:
    """Both ranks load their shards: the shared prefix's whole blocks (192 tokens) for
    each main request, d0's prompt block(s), and the baseline's tokens and logprobs."""
    assert ve.engine_errors(tp_loaded["log"]) == []
    for n in MAIN:
        got = _cached(tp_loaded, n)
        assert ve.blocks_of(len(ve.PREFIX)) <= got <= tp_loaded["requests"][n]["prompt_len"] - 1, (n, got)
    assert _cached(tp_loaded, "d0") >= ve.BLOCK, _cached(tp_loaded, "d0")
    ve.assert_same_outputs(tp_loaded, tp_baseline, _names(tp_baseline), what="tp load")


def test_one_rank_failing_its_loads_is_recomputed_never_served(
    tp_rank_corrupt: dict[str, Any], tp_baseline: dict[str, Any]
) -> None:
    """Rank 1's shards fail their checksums while rank 0's load: vLLM merges the ranks'
    load errors, reschedules the requests and recomputes; the outputs are the baseline's
    (a block half loaded is never served)."""
    assert ve.engine_errors(tp_rank_corrupt["log"]) == []
    assert ve.recovered_tokens(tp_rank_corrupt["log"]) > 0, "no load failed with rank 1's shards corrupt"
    ve.assert_same_outputs(tp_rank_corrupt, tp_baseline, _names(tp_baseline), what="tp corrupt")


def test_a_block_missing_on_one_rank_is_not_stored(
    tp_rank_missing: dict[str, Any], tp_baseline: dict[str, Any]
) -> None:
    """Rank 0's shards are all there, rank 1's none: no block counts as stored, nothing
    is loaded (no load starts and fails), and the outputs are the baseline's."""
    assert ve.engine_errors(tp_rank_missing["log"]) == []
    for n in _names(tp_rank_missing):
        assert _cached(tp_rank_missing, n) == 0, n
    assert ve.recovered_tokens(tp_rank_missing["log"]) == 0
    ve.assert_same_outputs(tp_rank_missing, tp_baseline, _names(tp_baseline), what="tp missing")
