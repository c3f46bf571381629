"""The connector's load path and keys on plain data (no vLLM): issue 22 points 3
(the connector half) and 4.

What must hold: a fresh scheduler and fresh workers find what another process stored
and load exactly the KV computing would write; the lookup counts whole blocks beyond
the engine's own hit and never the last prompt token; a corrupt or missing page is
reported as load errors (its block and every later one) so vLLM recomputes them,
never served (F38); an abort mid-load cancels it and the request is reported in
finished_recving only once no copy writes its blocks; keys are the same in every
process and change with the namespace, LoRA adapter and cache salt (F22).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from connector_fakes import BS, FakeRequest, HeldReads, Rig, kv_value

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm_keys import page_keys, request_seed, seed
from kvoffload.integrations.vllm_plan import RankReport, Settings
from kvoffload.storage.file import FileStorage


def _store_prompt(root: Path, prompt: list[int], namespace: str | None = None) -> None:
    """One process stores ``prompt`` (and a few decoded tokens)."""
    rig = Rig(FileStorage(root), namespace=namespace)
    try:
        rig.add(FakeRequest("a", prompt))
        for _ in range(3):
            rig.step()
        rig.finish("a")
        rig.settle()
    finally:
        rig.close()


def _expected(rig: Rig, rid: str, tokens: list[int], n_blocks: int) -> None:
    """Blocks 0..n_blocks of ``rid`` hold what computing ``tokens`` writes there."""
    for i in range(n_blocks):
        b = rig.blocks[rid][i]
        for layer, kv in enumerate(rig.kv[0]):
            for slot in range(BS):
                want = kv_value(tokens, i * BS + slot, 0, layer)
                assert torch.all(kv[b, :, slot, :] == want), f"block {i} slot {slot} layer {layer}"


def test_a_fresh_process_loads_what_another_stored(tmp_path: Path) -> None:
    """A new planner and new workers on the same store: the lookup finds the stored
    whole blocks beyond the engine's hit, the load copies them into the blocks vLLM
    allocated, the request comes back in finished_recving, and the blocks hold the KV
    computing would write."""
    prompt = list(range(1000, 1013))  # 3 whole blocks + 1
    _store_prompt(tmp_path, prompt)
    rig = Rig(FileStorage(tmp_path))
    try:
        req = FakeRequest("b", [*prompt[:12], 5, 6, 7])
        assert rig.add(req) == 3 * BS
        (plan,) = [rig.step_idle()]
        assert [(j.req_id, len(j.keys)) for j in plan.loads] == [("b", 3)]
        rig.settle()
        assert rig.recvd == ["b"] and rig.load_errors == set()
        _expected(rig, "b", req.all_token_ids, 3)
        assert req.num_computed_tokens == 3 * BS
        rig.planner.check_invariants()
    finally:
        rig.close()


def test_an_inline_load_is_reported_by_the_step_that_hands_it_over(tmp_path: Path) -> None:
    """An asynchronous load that the worker runs inline (``Mover(inline_loads=True)``;
    the connector's ``loads="inline"`` makes loads synchronous instead:
    test_connector_sync_load.py): the worker reads the store and copies into the blocks
    in that step's ``start_load_kv``, so the same step's ``get_finished`` reports the
    request, with the KV computing would write; a page that does not match its key is
    still a load error, never served (F38)."""
    prompt = list(range(1400, 1413))  # 3 whole blocks + 1
    _store_prompt(tmp_path, prompt)
    rig = Rig(FileStorage(tmp_path), inline_loads=True)
    try:
        req = FakeRequest("b", list(prompt))
        assert rig.add(req) == 3 * BS
        rig.step_idle()
        assert rig.recvd == ["b"] and rig.load_errors == set()  # no later step needed
        _expected(rig, "b", req.all_token_ids, 3)
        rig.planner.check_invariants()
    finally:
        rig.close()
    page = sorted(p for p in tmp_path.rglob("*") if p.is_file())[0]
    raw = bytearray(page.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    page.write_bytes(bytes(raw))
    rig = Rig(FileStorage(tmp_path), inline_loads=True)
    try:
        req = FakeRequest("c", list(prompt))
        assert rig.add(req) == 3 * BS  # the lookup sees the page's record: it is listed
        rig.step_idle()
        assert rig.recvd == ["c"]
        assert rig.load_errors, "a corrupt page was served"  # it and every later one
        rig.settle()
        rig.planner.check_invariants()
    finally:
        rig.close()


def test_the_lookup_never_counts_the_last_prompt_token(tmp_path: Path) -> None:
    """A prompt of exactly two stored blocks: one block is loaded, vLLM computes the
    second (it needs the last token's logits); beyond the engine's own hit only."""
    prompt = list(range(1100, 1108))
    _store_prompt(tmp_path, [*prompt, 1, 2])
    rig = Rig(FileStorage(tmp_path))
    try:
        req = FakeRequest("b", prompt)
        rig.planner.add(req)
        assert rig.planner.matched(req, 0) == BS
        assert rig.planner.matched(req, BS) == 0
        longer = FakeRequest("c", [*prompt, 1, 2, 3])
        rig.planner.add(longer)
        assert rig.planner.matched(longer, BS) == BS
    finally:
        rig.close()


def _corrupt(root: Path, key: str) -> None:
    path = FileStorage(root).path(key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_bad_page_is_a_load_error_never_served(tmp_path: Path, damage: str) -> None:
    """F38: the 2nd page of a promised load is corrupt (its checksum fails) or gone
    after the lookup: blocks 1 and 2 are reported in the load errors, the request
    keeps only block 0 as loaded (vLLM truncates at the first bad block), and it
    recomputes the rest: in the end every block holds the right KV."""
    prompt = list(range(1200, 1213))
    _store_prompt(tmp_path, prompt)
    rig = Rig(FileStorage(tmp_path))
    try:
        req = FakeRequest("b", prompt)
        assert rig.add(req) == 3 * BS
        key = page_keys(request_seed(None, req), prompt, BS, 2)[1]
        if damage == "corrupt":
            _corrupt(tmp_path, key)
        else:
            FileStorage(tmp_path).path(key).unlink()
        rig.settle()
        assert rig.recvd == ["b"]
        assert rig.load_errors == set(rig.blocks["b"][1:3])
        assert req.num_computed_tokens == BS
        rig.step()  # recomputes blocks 1.. from the tokens
        _expected(rig, "b", req.all_token_ids, 3)
    finally:
        rig.close()


def test_abort_mid_load_cancels_it_and_reports_once_no_copy_writes(tmp_path: Path) -> None:
    """request_finished on a loading request cancels its load: the next plan carries
    the cancel, the worker copies nothing it had not copied, and the request appears
    in finished_recving only once the load job ended (vLLM frees the blocks then)."""
    prompt = list(range(1300, 1313))
    _store_prompt(tmp_path, prompt)
    held = HeldReads(FileStorage(tmp_path))
    rig = Rig(held)
    try:
        req = FakeRequest("b", prompt)
        assert rig.add(req) == 3 * BS
        rig.step_idle()
        assert held.reading.wait(30)
        assert rig.finish("b", aborted=True) is False  # vLLM holds a loading request's blocks itself
        plan = rig.step_idle()
        assert len(plan.cancels) == 1 and rig.recvd == [] and "b" in rig.blocks
        blocks = list(rig.blocks["b"])
        held.go.set()
        rig.settle()
        assert rig.recvd == ["b"] and "b" not in rig.blocks
        assert all(torch.all(kv[b] == 0) for b in blocks for kv in rig.kv[0])  # nothing written
        rig.planner.check_invariants()
    finally:
        held.go.set()
        rig.close()


def test_another_namespace_finds_nothing(tmp_path: Path) -> None:
    """F22: pages stored under namespace "a" are invisible to namespace "b" and to no
    namespace; namespace "a" finds them."""
    prompt = list(range(1400, 1413))
    _store_prompt(tmp_path, prompt, namespace="a")
    for ns, want in (("b", 0), (None, 0), ("a", 3 * BS)):
        rig = Rig(FileStorage(tmp_path), namespace=ns)
        try:
            req = FakeRequest("x", prompt)
            rig.planner.add(req)
            assert rig.planner.matched(req, 0) == want, ns
        finally:
            rig.close()


_KEYS_SCRIPT = """
import json, sys
from types import SimpleNamespace
from kvoffload.integrations.vllm_keys import page_keys, request_seed
req = SimpleNamespace(lora_request=SimpleNamespace(lora_name="ad"), cache_salt="s", mm_features=[])
print(json.dumps(page_keys(request_seed("ns", req), list(range(64)), 16, 4)))
"""


def test_keys_are_the_same_in_two_processes() -> None:
    """Point 4: two processes with different hash seeds compute the same keys (vLLM's
    block hashes, from a per-process random NONE_HASH, would not)."""
    outs = []
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        run = subprocess.run(
            [sys.executable, "-c", _KEYS_SCRIPT], capture_output=True, text=True, env=env, timeout=120
        )
        assert run.returncode == 0, run.stderr
        outs.append(json.loads(run.stdout))
    assert outs[0] == outs[1] and len(outs[0]) == 4


def test_namespace_lora_and_salt_change_every_key() -> None:
    """Each of namespace, LoRA adapter and cache salt gives other keys; with none of
    them and with only a namespace, the seed is kvoffload's own namespace seed (a
    kvoffload manager with OffloadConfig(namespace=...) finds the same pages)."""
    from kvoffload.keys import namespace_seed

    base = seed("ns")
    assert base == namespace_seed(extra_key="ns") and seed(None) is None
    variants = [seed("other"), seed("ns", lora="a"), seed("ns", cache_salt="x"), seed(None, lora="a"), None]
    keys = {v: page_keys(v, list(range(8)), 4, 2)[0] for v in [base, *variants]}
    assert len(set(keys.values())) == len(keys)
    assert seed("ns", lora="a") != seed("ns", lora="b")


def test_settings_refuse_what_is_not_a_setting() -> None:
    """kv_connector_extra_config: storage is required, an unknown key (a typo) and bad
    values are refused with what is allowed."""
    with pytest.raises(ConfigError, match="storage"):
        Settings.from_extra({})
    with pytest.raises(ConfigError, match=r"unknown.*host_page"):
        Settings.from_extra({"storage": "x/", "host_page": 3})
    with pytest.raises(ConfigError, match="lookup_timeout_s"):
        Settings.from_extra({"storage": "x/", "lookup_timeout_s": float("inf")})
    s = Settings.from_extra({"storage": "x/", "namespace": "n", "host_pages": 8})
    assert (s.namespace, s.host_pages_for(10_000), Settings("x/").host_pages_for(100)) == ("n", 8, 64)
    assert Settings("x/").host_pages_for(100_000, 1 << 20) == 1024  # at most 1 GiB by default
    with pytest.raises(ConfigError, match="loads must be"):
        Settings.from_extra({"storage": "x/", "loads": "sometimes"})
    assert Settings.from_extra({"storage": "x/"}).loads == "auto"


def test_rank_reports_merge_as_vllm_aggregates_them() -> None:
    """Worker reports merge: rank counts add up, the first error wins, a write is
    stored only if every rank stored it, a load counts its fewest pages."""
    a = RankReport({1: (1, None)}, {2: (1, True, None)}, {3: (1, 4, None)})
    b = RankReport({1: (1, "boom")}, {2: (1, False, "down")}, {3: (1, 2, "short")})
    m = a.merge(b)
    assert (
        m.copies == {1: (2, "boom")}
        and m.writes == {2: (2, False, "down")}
        and m.loads == {3: (2, 2, "short")}
    )


def test_a_load_the_core_refuses_is_still_reported_every_block_an_error(tmp_path: Path) -> None:
    """vLLM waits for finished_recving of every request it made wait for a load: when
    the core refuses to begin one (here a broken core part raises), the workers still
    report the request, with every promised block a load error (recomputed), and
    nothing raises into vLLM."""
    prompt = list(range(1500, 1513))
    _store_prompt(tmp_path, prompt)
    rig = Rig(FileStorage(tmp_path))
    try:

        def refuse(*args: object, **kwargs: object) -> object:
            from kvoffload.errors import PageError

            raise PageError("refused")

        rig.planner.core.load_begin = refuse  # type: ignore[method-assign]
        req = FakeRequest("b", prompt)
        assert rig.add(req) == 3 * BS
        rig.settle()
        assert rig.recvd == ["b"] and rig.load_errors == set(rig.blocks["b"][:3])
        assert req.num_computed_tokens == 0
        rig.planner.check_invariants()
    finally:
        rig.close()
