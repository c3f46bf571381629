"""kvoffload's SGLang drop-in side by side with SGLang 0.5.23's real
``DecodeKVCacheOffloadManager`` (sglang_side_by_side.py): the same scripted and seeded
random scenarios on both, the same frees (ranges, order, step), the same keys and
bytes; the intended differences asserted by name, anything else fails naming the
scenario, the step and what each side did."""

from __future__ import annotations

import sglang_cpu

sglang_cpu.require()

import ast  # noqa: E402
import inspect  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import sglang_cpu_stand_ins as stand_ins  # noqa: E402
import sglang_side_by_side as sbs  # noqa: E402
import torch  # noqa: E402

#: The differences docs/integrations/sglang.md names ("What differs, on purpose").
INTENDED = {
    "tail_flushed_at_finish",  # the page-aligned tail is flushed at finish (F12)
    "release_waits_for_its_last_copy",  # ... so the release waits for that copy's ack
    "finish_returns_release_deferred",  # offload_kv_cache at finish: True when the release is deferred
    "keys_fixed_at_submit",  # F11: SGLang's keys computed at completion can leave the chain
    "host_full_waits",  # a full host pool defers the chunk (on_host_full="wait"); SGLang drops it
}


@pytest.fixture(autouse=True)
def _quiet() -> object:
    """SGLang's manager logs an error per chunk it drops for a full host pool."""
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)


# --- the CPU stand-ins: only what cannot run on a CPU, each checked against SGLang --------


def test_host_pool_stand_in_is_sglangs_init_with_pin_memory_off() -> None:
    """The host pools' ``__init__`` is SGLang's own function (same code object, same
    parameters) with one default changed: ``pin_memory`` False (pinning needs CUDA)."""
    for cls in stand_ins.host_pool_classes():
        real, used = stand_ins.original_init(cls), cls.__init__
        if torch.cuda.is_available():
            assert used is real
            continue
        assert used.__code__ is real.__code__
        a, b = inspect.signature(real).parameters, inspect.signature(used).parameters
        assert list(a) == list(b)
        for name in a:
            if name == "pin_memory":
                assert (a[name].default, b[name].default) == (True, False)
            else:
                assert a[name] == b[name], name


def _kernel_calls() -> list[tuple[str, str, ast.Call]]:
    """Every call SGLang's MHA / MLA host pools make to a copy op the stand-ins provide."""
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.srt.mem_cache.pool_host.mla as mla

    calls = []
    for module in (mha, mla):
        tree = ast.parse(Path(inspect.getfile(module)).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in stand_ins.KERNEL_NAMES:
                    calls.append((module.__name__, node.func.id, node))
    return calls


def test_copy_kernel_stand_ins_take_every_call_sglang_makes() -> None:
    """Each call SGLang's host pools make to a provided sgl_kernel op (keywords, as SGLang
    writes them) binds to the stand-in's signature (sgl_kernel's own wrapper's), and the
    stand-ins are what those modules look the names up as."""
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.srt.mem_cache.pool_host.mla as mla

    calls = _kernel_calls()
    assert {name for _, name, _ in calls} == set(stand_ins.KERNEL_NAMES)
    for module_name, name, call in calls:
        assert not call.args, f"{module_name}: {name} called with positional arguments"
        sig = inspect.signature(getattr(stand_ins, name))
        sig.bind(**{kw.arg: None for kw in call.keywords if kw.arg is not None})
    if not torch.cuda.is_available():
        for module in (mha, mla):
            for name in stand_ins.KERNEL_NAMES:
                assert getattr(module, name) is getattr(stand_ins, name)


# --- SGLang's own manager, built through its real __init__ ----------------------------------


def test_sglangs_real_manager_builds_and_copies_on_the_cpu(tmp_path: Path) -> None:
    """SGLang's ``DecodeKVCacheOffloadManager.__init__`` runs unchanged on the CPU: its
    host pool from ``build_kv_host_pool`` (unpinned), a real ``HiCacheController`` with a
    real ``HiCacheFile`` in the directory SGLang's env names; its copy is synchronous
    here (the ack is queued when ``write()`` returns), which the driver relies on; and
    its page lands in SGLang's file under SGLang's key with the engine's bytes."""
    sc = sbs.Scenario("build", requests=[sbs.ReqSpec("a", "a", list(range(8)), 6, 0)])
    run = sbs._Run(sc, "sglang", tmp_path, "sim")
    record = run.run()
    assert "site-packages/sglang/" in inspect.getfile(sbs.SGLangManager)
    assert record.host_pages > 0
    assert not record.errors, record.errors
    keys = record.chains["a"]
    # prompt pages are the prefill's; the decode side stores what it decoded (13 tokens: 3 pages)
    assert sorted(record.stored) == sorted(keys[2:3])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"{keys[2]}_{sbs.MODEL}_0_1.bin"], files
    assert record.stored[keys[2]] == sbs.truth_page(sc, record.tokens["a"], 2)


# --- the scenarios ---------------------------------------------------------------------------

#: What each scripted scenario must show: the intended differences it exists for.
MUST_SHOW = {
    "mha-ps4-stride3pages-tail": {"tail_flushed_at_finish", "release_waits_for_its_last_copy"},
    "mla-ps1-stride4-tail": {"tail_flushed_at_finish", "release_waits_for_its_last_copy"},
    "multi-token-stride2-tail": {"tail_flushed_at_finish"},
    "abort-mid-copy-stride2": {"tail_flushed_at_finish"},
    "host-pool-full": {"host_full_waits"},
}


def _check(outcome: sbs.Outcome) -> None:
    unexpected = outcome.unexpected
    assert not unexpected, f"{outcome.scenario}: kvoffload and SGLang differ beyond the intended:\n" + "\n".join(
        unexpected
    )
    assert set(outcome.differences) <= INTENDED, outcome.differences
    assert outcome.frees_compared > 0 and outcome.keys_compared > 0 and outcome.bytes_compared > 0


@pytest.mark.parametrize("scenario", sbs.fixed_scenarios(), ids=lambda s: s.name)
def test_scripted_scenario_side_by_side(scenario: sbs.Scenario) -> None:
    """The same frees (ranges, order, step), keys and bytes as SGLang's real manager;
    only the intended differences, and those the scenario exists for shown. A scenario
    with a stride of one page and a host pool that never fills shows no difference at
    all (so nothing but the named ones can hide in the others)."""
    outcome, _ = sbs.run_scenario(scenario)
    _check(outcome)
    must = MUST_SHOW.get(scenario.name, set())
    assert must <= set(outcome.differences), (must, outcome.differences)
    one_page = scenario.stride in (None, scenario.page_size)
    if one_page and scenario.name not in MUST_SHOW:
        assert not outcome.differences, outcome.details


@pytest.mark.parametrize("seed", range(12))
def test_seeded_random_scenario_side_by_side(seed: int) -> None:
    """Seeded random scenarios (MHA / MLA, page size 1 / 2 / 4, strides of 1-3 pages,
    1-3 tokens a step, small host pools, rids reused, aborts, retraction and resume):
    only the intended differences."""
    outcome, _ = sbs.run_scenario(sbs.random_scenario(seed))
    _check(outcome)


def test_cpu_backend_side_by_side() -> None:
    """kvoffload's real copy threads (``backend="cpu"``) instead of the simulated
    device: the same frees (ranges, order) and the same keys and bytes."""
    sc = next(s for s in sbs.fixed_scenarios() if s.name == "retract-resume")
    outcome, _ = sbs.run_scenario(sc, backend="cpu")
    _check(outcome)


def test_summary_names_every_count_and_kind(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary the closing note pastes (``python tests/integrations/sglang_side_by_side.py``)."""
    outcomes = [sbs.run_scenario(s)[0] for s in sbs.fixed_scenarios()[:3]]
    text = sbs.summary(outcomes)
    for line in ("scenarios run:   3", "frees compared:", "keys compared:", "bytes compared:", "differences by kind:"):
        assert line in text, text
    assert "tail_flushed_at_finish" in text


@pytest.mark.parametrize(
    ("page_size", "slots", "settings"),
    [
        (4, 256, {}),
        (4, 160, {"hicache_ratio": 0.1}),
        (1, 100, {"hicache_ratio": 1.5}),
        (2, 64, {"hicache_size": 1e-4}),
    ],
)
def test_host_pool_holds_as_many_pages_as_sglangs(page_size: int, slots: int, settings: dict[str, float]) -> None:
    """kvoffload's host pool, sized from SGLang's published settings, holds as many pages
    as the one SGLang's own manager builds from them (``HostKVCache.__init__``:
    ``size // page_size + 1`` pages, every one of them allocatable); a full host pool
    then comes at the same moment on both sides."""
    with sbs.sr.engine(page_size=page_size, slots=slots, **settings) as eng:
        with sbs.rank_zero():
            theirs = sbs.SGLangManager(eng.req_to_token_pool, eng.allocator, sbs.tp_group(), eng.tree_cache)
        pool = theirs.decode_host_mem_pool
        sglang_pages = int(pool.available_size()) // page_size
        ours = eng.manager(sbs.tp_group(), backend=sbs.SimBackend())
        try:
            assert ours.manager.config.host_pages == sglang_pages, (ours.manager.config.host_pages, sglang_pages)
        finally:
            ours.release_host_resources()
            theirs.release_host_resources()
