"""kvoffload's SGLang drop-in side by side with SGLang 0.5.23's real
``DecodeKVCacheOffloadManager`` (sglang_side_by_side.py): the same scripted and seeded
random scenarios on both, the same frees (ranges, order, step), the same keys and
bytes; the intended differences asserted by name, anything else fails naming the
scenario, the step and what each side did."""

from __future__ import annotations

import sglang_cpu

sglang_cpu.require()

import ast  # noqa: E402
import dataclasses  # noqa: E402
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
    "copies_start_at_next_poll",  # backend="cpu" only: a copy launches at the next poll (F19)
    "arrival_told_at_next_poll",  # an arrival's tokens are told (one page-id read) at the next poll
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
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in stand_ins.KERNEL_NAMES:  # type: ignore[attr-defined]
                calls.append((module.__name__, node.func.id, node))  # type: ignore[attr-defined]
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
    """SGLang's ``DecodeKVCacheOffloadManager.__init__`` runs unchanged on the CPU: the
    page size, host ratio, io backend, layout and storage backend read from the
    published runtime context; its host pool from ``build_kv_host_pool`` (unpinned);
    a real ``HiCacheController`` whose streams and events are torch's own CPU ones;
    a real ``HiCacheFile`` in the directory SGLang's env names. Its device-to-host copy
    is synchronous here: the ack is in ``ack_write_queue`` when ``write()`` returns (so
    ``check_offload_progress`` acks it at the next iteration, what the driver relies
    on), and the host page holds the device's bytes."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with (
        sbs._env({"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)}),
        sbs.sr.engine(page_size=4, hicache_storage_backend="file", served_model_name=sbs.MODEL) as eng,
    ):
        with sbs.rank_zero():
            mgr = sbs.SGLangManager(eng.req_to_token_pool, eng.allocator, sbs.tp_group(), eng.tree_cache)
        try:
            assert "site-packages/sglang/" in inspect.getfile(type(mgr))
            cc, pool = mgr.cache_controller, mgr.decode_host_mem_pool
            assert (mgr.page_size, mgr.offload_stride, mgr.tp_world_size) == (4, 4, 1)
            assert type(pool).__name__ == "MHATokenToKVPoolHost" and pool.layout == "page_first"
            assert pool.pin_memory is torch.cuda.is_available()
            assert cc.io_backend == "kernel"
            assert isinstance(cc.l2_transfer_engine.device_to_host_stream, torch.cpu.Stream)
            assert isinstance(cc.storage_backend, HiCacheFile) and cc.storage_backend.file_path == str(
                tmp_path
            )
            req = eng.new_req("a", list(range(8)), 4)
            eng.admit(req)
            slots = torch.tensor(eng.row_slots(req, 0, 8), dtype=torch.int64)
            host = cc.write(device_indices=slots, node_id=1)
            assert host is not None and len(cc.ack_write_queue) == 1  # copied already
            cc.ack_write_queue[0].finish_event.synchronize()  # a CPU event: nothing to wait for
            for page in range(2):
                raw = pool.get_data_page(int(host[page * 4])).contiguous().view(torch.uint8).numpy().tobytes()
                got = sbs.canonical_from_sglang_page(raw, "page_first", "mha", 4, sbs.LAYERS, sbs.DTYPE)
                sc = sbs.Scenario("x")
                assert got == sbs.truth_page(sc, list(range(8)), page)
            cc.ack_write_queue.clear()
            pool.free(host)
        finally:
            cc.detach_storage_backend()
            mgr.release_host_resources()


def test_sglangs_manager_stores_under_its_own_keys(tmp_path: Path) -> None:
    """Driven by the side-by-side script, SGLang's manager stores the decoded page in
    SGLang's file (``<key>_<model>_<rank>_<size>.bin``) under its ``get_hash_str`` key,
    with the engine's bytes; prompt pages are the prefill's, never stored here."""
    sc = sbs.Scenario("build", requests=[sbs.ReqSpec("a", "a", list(range(8)), 6, 0)])
    record = sbs._Run(sc, "sglang", tmp_path, "sim").run()
    assert not record.errors, record.errors
    keys = record.chains["a"]  # 8 + 5 committed tokens: 3 whole pages, 2 of them the prompt's
    assert sorted(record.stored) == keys[2:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{keys[2]}_{sbs.MODEL}_0_1.bin"]
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
    assert not unexpected, (
        f"{outcome.scenario}: kvoffload and SGLang differ beyond the intended:\n" + "\n".join(unexpected)
    )
    assert set(outcome.differences) <= INTENDED, outcome.differences
    assert outcome.frees_compared > 0 and outcome.keys_compared > 0 and outcome.bytes_compared > 0


@pytest.mark.parametrize("scenario", sbs.fixed_scenarios(), ids=lambda s: s.name)
def test_scripted_scenario_side_by_side(scenario: sbs.Scenario) -> None:
    """The same frees (ranges, order, step), keys and bytes as SGLang's real manager;
    only the intended differences, and those the scenario exists for shown. A scenario
    with a stride of one page and a host pool that never fills shows no difference at
    all but the arrivals' return value before finish, which SGLang's scheduler ignores
    (so nothing but the named ones can hide in the others)."""
    outcome, _ = sbs.run_scenario(scenario)
    _check(outcome)
    must = MUST_SHOW.get(scenario.name, set())
    assert must <= set(outcome.differences), (must, outcome.differences)
    one_page = scenario.stride in (None, scenario.page_size)
    if one_page and scenario.name not in MUST_SHOW:
        assert set(outcome.differences) <= {"arrival_told_at_next_poll"}, outcome.details


@pytest.mark.parametrize("seed", range(40))
def test_seeded_random_scenario_side_by_side(seed: int) -> None:
    """Seeded random scenarios (MHA / MLA, page size 1 / 2 / 4, strides of 1-3 pages,
    1-3 tokens a step, small host pools, rids reused, aborts, retraction and resume):
    only the intended differences."""
    outcome, _ = sbs.run_scenario(sbs.random_scenario(seed))
    _check(outcome)


@pytest.mark.parametrize("name", ["retract-resume", "abort-mid-copy", "mla-ps1-stride4-tail"])
def test_cpu_backend_side_by_side(name: str) -> None:
    """kvoffload's real copy threads (``backend="cpu"``) instead of the simulated
    device: each request freed the same (ranges, per request in order), the same keys
    and bytes. Its copies start at the next poll (F19), so its releases may come an
    iteration later than SGLang's: named, never earlier."""
    sc = next(s for s in sbs.fixed_scenarios() if s.name == name)
    outcome, _ = sbs.run_scenario(sc, backend="cpu")
    _check(outcome)


def test_summary_names_every_count_and_kind(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary the closing note pastes (``python tests/integrations/sglang_side_by_side.py``)."""
    outcomes = [sbs.run_scenario(s)[0] for s in sbs.fixed_scenarios()[:3]]
    text = sbs.summary(outcomes)
    for line in (
        "scenarios run:   3",
        "frees compared:",
        "keys compared:",
        "bytes compared:",
        "differences by kind:",
    ):
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
def test_host_pool_holds_as_many_pages_as_sglangs(
    page_size: int, slots: int, settings: dict[str, float]
) -> None:
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
            assert ours.manager.config.host_pages == sglang_pages, (
                ours.manager.config.host_pages,
                sglang_pages,
            )
        finally:
            ours.release_host_resources()
            theirs.release_host_resources()


# --- the comparison finds what it is for (kvoffload broken on purpose) ----------------------


def test_a_release_that_frees_the_trees_prefix_is_caught() -> None:
    """F29 put back through the drop-in's ``release=``: freeing a finished request's row
    from position 0 frees the radix tree's matched prefix too; SGLang's debug allocator
    asserts on the page now free twice, and the side by side reports it as an
    unexpected error of kvoffload's run, with the step and where it was raised."""
    sc = next(s for s in sbs.fixed_scenarios() if s.name == "decode-radix-prefix")

    def extras(eng: sbs.sr.Engine) -> dict[str, object]:
        def release_from_zero(req: sbs.sr.Req) -> None:
            kv = req.kv
            eng.tree_cache.free_kv_row(kv, [(0, int(kv.kv_allocated_len))])
            eng.tree_cache.unlock(req.lock)
            req.lock = None
            eng.req_to_token_pool.free(req)
            kv.mark_kv_released()

        return {"release": release_from_zero}

    outcome, _ = sbs.run_scenario(sc, extras=extras)
    errors = [d for d in outcome.unexpected if d.startswith("unexpected:error")]
    assert any("_debug_check_no_duplicate_pages" in d for d in errors), outcome.details


def test_lost_pages_wrong_bytes_and_a_late_free_are_caught() -> None:
    """The comparison itself: a page kvoffload did not store, a page with other bytes,
    a free one step late and a free with another range are each an unexpected
    difference, by kind."""
    sc = next(s for s in sbs.fixed_scenarios() if s.name == "mha-ps4-stride1page")
    outcome, records = sbs.run_scenario(sc)
    assert set(outcome.differences) <= {"arrival_told_at_next_poll"}
    sgl, kvo = records["sglang"], records["kvoffload"]

    def truth(label: str, page: int) -> bytes:
        return sbs.truth_page(sc, sgl.tokens[label], page)

    keys = sorted(kvo.stored)
    lost = dataclasses.replace(kvo, stored={k: v for k, v in kvo.stored.items() if k != keys[0]})
    bad = dataclasses.replace(kvo, stored={**kvo.stored, keys[1]: b"\0" * len(kvo.stored[keys[1]])})
    i = next(n for n, f in enumerate(kvo.frees) if f[1] == "free_kv_row")
    step, op, label, ranges = kvo.frees[i]
    late = dataclasses.replace(
        kvo, frees=[*kvo.frees[:i], (step + 1, op, label, ranges), *kvo.frees[i + 1 :]]
    )
    wide = dataclasses.replace(
        kvo, frees=[*kvo.frees[:i], (step, op, label, [(0, 999)]), *kvo.frees[i + 1 :]]
    )
    for broken, kind in (
        (lost, "unexpected:only_sglang_stored"),
        (bad, "unexpected:bytes_differ"),
        (late, "unexpected:frees_differ"),
        (wide, "unexpected:frees_differ"),
    ):
        assert kind in sbs.compare(sc, sgl, broken, truth).differences, kind
