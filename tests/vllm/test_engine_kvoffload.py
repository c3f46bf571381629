"""kvoffload's connector inside real vLLM engines (issue 22, point 5), on the file store.

Each engine is a process of its own (``engine_run.py``), started once for many requests:

- **store**: an engine with an empty store, in vLLM's deployed topology (EngineCore in a
  process of its own): the main requests (a shared 200-token prefix; ``d0`` decodes 64
  tokens) and a batch sharing two prefixes.
- **load**: a fresh engine on what **store** left: the same requests, and ``f0``, which
  repeats ``d0``'s prompt and answer.
- **other namespace**: a fresh engine on the same directory under another namespace.
- **corrupt**: a fresh engine on a copy of the store with bytes flipped in every other
  page file; in both load modes (``loads="auto"``: synchronous on the CPU build, and
  ``"thread"``: asynchronous).
- **abort / preempt**: a fresh engine with a small KV cache (32 blocks): requests aborted
  while they wait for their load (asynchronous loads) or right after the step that
  loaded them (synchronous loads), then more requests than fit (the scheduler
  preempts), then the aborted prompts again; in both load modes.

**load** runs the default (synchronous on the CPU build); the asynchronous mode's loads
are compared with the engine without a connector by **abort / preempt** (thread).

Every output is compared with the engine that ran the same prompts without a connector
(conftest.py ``baseline``). Skipped without vLLM unless ``KVOFFLOAD_REQUIRE_VLLM=1``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import vllm_engines as ve

ve.require()

NAMESPACE = "tenant-a"
MAIN = [r["name"] for r in ve.main_requests() if r["name"] != "d0"]
CONNECTOR = "KVOffloadConnector"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvoffload")


def _kv(work: Path, namespace: str = NAMESPACE, store: str = "store", **extra: Any) -> dict[str, Any]:
    return ve.kvoffload_connector(str(work / store), namespace, **extra)


@pytest.fixture(scope="module")
def stored(tiny_model: Path, work: Path) -> dict[str, Any]:
    phases = [
        {"name": "main", "requests": ve.main_requests()},
        {"name": "batch", "requests": ve.batch_requests()},
    ]
    return ve.run_engine(ve.spec(tiny_model, phases, _kv(work), inproc=False), work, "store")


def _follow_up(stored: dict[str, Any]) -> list[int]:
    return [*ve.DECODE_PROMPT, *stored["requests"]["d0"]["output"], *ve.FOLLOW_TAIL]


@pytest.fixture(scope="module")
def loaded(stored: dict[str, Any], tiny_model: Path, work: Path) -> dict[str, Any]:
    main = [r for r in ve.main_requests() if r["name"] != "d0"]
    phases = [
        {"name": "main", "requests": [*main, ve.req("f0", _follow_up(stored))]},
        {"name": "batch", "requests": ve.batch_requests()},
    ]
    return ve.run_engine(ve.spec(tiny_model, phases, _kv(work)), work, "load")


@pytest.fixture(scope="module")
def other_namespace(stored: dict[str, Any], tiny_model: Path, work: Path) -> dict[str, Any]:
    phases = [{"name": "main", "requests": [r for r in ve.main_requests() if r["name"] != "d0"]}]
    return ve.run_engine(ve.spec(tiny_model, phases, _kv(work, "tenant-b")), work, "other")


def corrupt_every_other_page(root: Path) -> list[Path]:
    """Flip the last 8 bytes (inside the page's payload: a record ends with its page) of
    every other page file under ``root``, in path order; the files flipped."""
    pages = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
    flipped = pages[::2]
    for p in flipped:
        data = bytearray(p.read_bytes())
        for i in range(max(0, len(data) - 8), len(data)):
            data[i] ^= 0xFF
        p.write_bytes(bytes(data))
    return flipped


@pytest.fixture(scope="module", params=["auto", "thread"])
def corrupted(
    request: pytest.FixtureRequest, stored: dict[str, Any], tiny_model: Path, work: Path
) -> dict[str, Any]:
    mode = request.param
    store = f"corrupt-{mode}"
    shutil.copytree(work / "store", work / store)
    flipped = corrupt_every_other_page(work / store)
    assert flipped, "the store engine left no page files"
    main = [r for r in ve.main_requests() if r["name"] != "d0"]
    phases = [
        {"name": "main", "requests": main},
        {"name": "batch", "requests": ve.batch_requests()},
    ]
    kv = _kv(work, store=store, loads=mode)
    run = ve.run_engine(ve.spec(tiny_model, phases, kv), work, store)
    run["flipped"] = len(flipped)
    run["mode"] = mode
    return run


ABORTED = ["x0", "x1"]


def _abort_preempt(tiny_model: Path, work: Path, mode: str) -> dict[str, Any]:
    # asynchronous loads on the load thread: an abort then lands while the read or the
    # copy may still run; synchronous ones end in the step that schedules the request,
    # which is aborted right after it (its copies may still be in flight).
    abort = "abort_waiting_for_load" if mode == "thread" else "abort_after_first_step"
    phases = [
        {
            "name": "abort",
            "mode": "step",
            "requests": [
                ve.req("x0", ve.MAIN["r0"]),
                ve.req("x1", ve.MAIN["r1"]),
                ve.req("y0", ve.BYSTANDERS["y0"]),
            ],
            abort: ABORTED,
        },
        {"name": "after-abort", "requests": [ve.req("y1", ve.BYSTANDERS["y1"]), ve.req("r2", ve.MAIN["r2"])]},
        {"name": "preempt", "requests": [ve.req(n, p, ve.PREEMPT_TOKENS) for n, p in ve.PREEMPT.items()]},
        {"name": "again", "requests": [ve.req("r0", ve.MAIN["r0"]), ve.req("r1", ve.MAIN["r1"])]},
    ]
    small = {"num_gpu_blocks_override": 32, "max_model_len": 768}
    kv = _kv(work, loads=mode)
    return ve.run_engine(ve.spec(tiny_model, phases, kv, engine_args=small), work, f"abort-{mode}")


@pytest.fixture(scope="module")
def abort_preempt(stored: dict[str, Any], tiny_model: Path, work: Path) -> dict[str, Any]:
    """Asynchronous loads (``loads="thread"``)."""
    return _abort_preempt(tiny_model, work, "thread")


@pytest.fixture(scope="module")
def abort_preempt_sync(stored: dict[str, Any], tiny_model: Path, work: Path) -> dict[str, Any]:
    """Synchronous loads (``loads="inline"``, the CPU build's default)."""
    return _abort_preempt(tiny_model, work, "inline")


def _cached(run: dict[str, Any], name: str) -> int:
    n: int = run["requests"][name]["num_cached_tokens"]
    return n


def _check_engine(run: dict[str, Any], what: str) -> None:
    """The engine built kvoffload's connector (in-process runs say which class), logged
    no error, and left no request behind."""
    if "connector" in run:
        assert run["connector"] is not None and run["connector"].endswith(CONNECTOR), (what, run["connector"])
        assert run["connector"].startswith("kvoffload.integrations.vllm"), (what, run["connector"])
        assert run["scheduler_stats"]["requests_left"] == 0, (what, run["scheduler_stats"])
    assert ve.engine_errors(run["log"]) == [], what


def test_the_storing_engine_loads_nothing_and_matches_no_connector(
    stored: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """An empty store: nothing loaded, the outputs of the engine without a connector (the
    connector's stores change nothing the engine computes)."""
    _check_engine(stored, "store")
    names = [*MAIN, "d0", *ve.BATCH]
    for n in names:
        assert _cached(stored, n) == 0, n
    ve.assert_same_outputs(stored, baseline, names, what="store")


def test_a_fresh_engine_loads_what_another_stored(loaded: dict[str, Any], baseline: dict[str, Any]) -> None:
    """(a) A fresh engine process (vLLM's block hashes seeded anew: PYTHONHASHSEED unset)
    loads at least the shared prefix's whole blocks (192 tokens) of each main request and
    generates the greedy tokens and logprobs of the engine without a connector."""
    _check_engine(loaded, "load")
    for n in MAIN:
        got = _cached(loaded, n)
        assert ve.blocks_of(len(ve.PREFIX)) <= got <= loaded["requests"][n]["prompt_len"] - 1, (n, got)
    ve.assert_same_outputs(loaded, baseline, MAIN, what="load")


def test_decoded_tokens_are_stored_while_decoding(
    stored: dict[str, Any], loaded: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """(b) ``d0`` decoded 64 tokens past a 70-token prompt in the storing engine; a fresh
    engine asked for its prompt + answer + 10 tokens (``f0``) loads past the prompt's
    whole blocks (64 tokens): the blocks decoding filled were stored. Same outputs as
    without a connector (the baseline built ``f0`` from its own ``d0``: the same tokens)."""
    assert stored["requests"]["d0"]["output"] == baseline["requests"]["d0"]["output"]
    assert loaded["requests"]["f0"]["prompt_len"] == baseline["requests"]["f0"]["prompt_len"]
    got = _cached(loaded, "f0")
    assert got > ve.blocks_of(len(ve.DECODE_PROMPT)), got
    ve.assert_same_outputs(loaded, baseline, ["f0"], what="follow-up")


def test_a_batch_sharing_prefixes_loads_them(loaded: dict[str, Any], baseline: dict[str, Any]) -> None:
    """(e) Six requests in one batch over two shared prefixes (two of them the same prompt),
    stored by one batch and loaded by another: each loads at least its prefix's whole
    blocks, and every output is the no-connector one."""
    for n, prefix in ve.BATCH_PREFIX.items():
        got = _cached(loaded, n)
        assert ve.blocks_of(prefix) <= got <= loaded["requests"][n]["prompt_len"] - 1, (n, got)
    ve.assert_same_outputs(loaded, baseline, list(ve.BATCH), what="batch")


def test_another_namespace_loads_nothing(other_namespace: dict[str, Any], baseline: dict[str, Any]) -> None:
    """(c) The same directory, the same prompts, another namespace: nothing is loaded."""
    _check_engine(other_namespace, "other namespace")
    for n in MAIN:
        assert _cached(other_namespace, n) == 0, n
    ve.assert_same_outputs(other_namespace, baseline, MAIN, what="other namespace")


def test_a_corrupted_store_is_recomputed_never_served(
    corrupted: dict[str, Any], loaded: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """(d, F38) Bytes flipped in every other page file, in both load modes: the engine's
    outputs are still the no-connector ones (a corrupt page is a miss vLLM recomputes),
    vLLM says it recomputed tokens because loads failed, and no request counts more
    cached tokens than from the intact store. Asynchronous loads count fewer in all
    (vLLM sets a request's cached tokens when it schedules it: after an asynchronous
    load's failure, but in the very step of a synchronous one, before its failure)."""
    _check_engine(corrupted, "corrupt")
    names = [*MAIN, *ve.BATCH]
    ve.assert_same_outputs(corrupted, baseline, names, what="corrupt")
    assert ve.recovered_tokens(corrupted["log"]) > 0, "no load failed on a corrupted store"
    for n in names:
        assert _cached(corrupted, n) <= _cached(loaded, n), n
    if "thread" in corrupted["mode"]:
        assert sum(_cached(corrupted, n) for n in names) < sum(_cached(loaded, n) for n in names)


def test_abort_while_waiting_for_a_load(abort_preempt: dict[str, Any], baseline: dict[str, Any]) -> None:
    """(f) Requests aborted (``LLMEngine.abort_request``) right after the step that left
    them waiting for their load (``WAITING_FOR_REMOTE_KVS``): no assert in vLLM's
    scheduler, nothing left behind, and the requests served next (reusing the blocks the
    aborted ones held) get the no-connector outputs."""
    _check_engine(abort_preempt, "abort/preempt")
    aborts = abort_preempt["aborts"]
    for n in ABORTED:
        assert aborts[n]["status"] == "WAITING_FOR_REMOTE_KVS", (n, aborts[n])
        assert n not in abort_preempt["requests"], n
    ve.assert_same_outputs(abort_preempt, baseline, ["y0", "y1", "r2", "r0", "r1"], what="after abort")
    for n in ("r0", "r1", "r2"):
        assert _cached(abort_preempt, n) >= ve.blocks_of(len(ve.PREFIX)), n


def test_abort_right_after_a_synchronous_load(
    abort_preempt_sync: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """(f) Synchronous loads: requests aborted right after the step that loaded them
    and computed on the load (their copies may still be in flight): no assert in vLLM's
    scheduler, nothing left behind, and the requests served next get the no-connector
    outputs, loading the shared prefix."""
    run = abort_preempt_sync
    _check_engine(run, "abort/preempt (sync)")
    for n in ABORTED:
        assert run["aborts"][n]["status"] == "RUNNING", (n, run["aborts"][n])
        assert run["aborts"][n]["computed"] >= ve.blocks_of(len(ve.PREFIX)), (n, run["aborts"][n])
        assert n not in run["requests"], n
    ve.assert_same_outputs(run, baseline, ["y0", "y1", "r2", "r0", "r1"], what="after abort (sync)")
    for n in ("r0", "r1", "r2"):
        assert _cached(run, n) >= ve.blocks_of(len(ve.PREFIX)), n


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_preemption_among_loading_requests(
    mode: str, request: pytest.FixtureRequest, baseline: dict[str, Any]
) -> None:
    """(f) Eight requests loading a shared prefix into a KV cache too small for them all,
    asynchronous and synchronous loads: the scheduler preempts (counted by vLLM), the
    requests still load and every output is the no-connector one."""
    run = request.getfixturevalue("abort_preempt" if mode == "thread" else "abort_preempt_sync")
    names = list(ve.PREEMPT)
    preemptions = sum(run["requests"][n]["num_preemptions"] for n in names)
    assert preemptions > 0, "the KV cache was large enough: nothing was preempted"
    for n in names:
        assert _cached(run, n) > 0, n
    ve.assert_same_outputs(run, baseline, names, what=f"preempt ({mode})")
