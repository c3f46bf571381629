"""A request's own say (no vLLM needed): ``kv_transfer_params={"kvoffload": {"store":
False}}`` (or ``"load": False``) in its ``SamplingParams(extra_args=)``.

What must hold: a request that asks not to be stored puts nothing in the store while it
decodes or at its end, and still loads what is there; one that asks not to load computes
everything and is still stored; a value or key the connector does not understand is
logged once and left at its default (True), never failing the request.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from connector_fakes import BS, FakeRequest, Rig

from kvoffload.integrations.vllm_plan import request_params
from kvoffload.storage.file import FileStorage


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _run(rig: Rig, req: FakeRequest, steps: int = 6) -> int:
    n = rig.add(req)
    for _ in range(steps):
        rig.step()
    rig.finish(req.request_id)
    rig.settle()
    return n


def test_a_request_that_asks_not_to_be_stored_stores_nothing_and_still_loads(tmp_path: Path) -> None:
    prompt = list(range(2000, 2013))  # 3 whole blocks + 1
    rig = Rig(FileStorage(tmp_path), stride=BS)
    try:
        assert (
            _run(rig, FakeRequest("quiet", prompt, kv_transfer_params={"kvoffload": {"store": False}})) == 0
        )
        assert _files(tmp_path) == 0  # nothing while decoding, nothing at its end
        _run(rig, FakeRequest("a", prompt))
        stored = _files(tmp_path)
        assert stored >= 3
        again = FakeRequest("again", [*prompt, 5], kv_transfer_params={"kvoffload": {"store": False}})
        assert _run(rig, again) == 3 * BS  # it loads what "a" stored ...
        assert _files(tmp_path) == stored  # ... and adds nothing
        assert rig.load_errors == set()
        rig.planner.check_invariants()
    finally:
        rig.close()


def test_a_request_that_asks_not_to_load_computes_and_is_stored(tmp_path: Path) -> None:
    prompt = list(range(2100, 2113))
    rig = Rig(FileStorage(tmp_path), stride=BS)
    try:
        _run(rig, FakeRequest("a", prompt))
        before = len(rig.lookups)
        fresh = FakeRequest("b", [*prompt, 1, 2, 3, 4], kv_transfer_params={"kvoffload": {"load": False}})
        assert _run(rig, fresh) == 0
        assert len(rig.lookups) == before  # not even asked
        assert rig.recvd == []
        rig.planner.check_invariants()
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("params", "want", "problem"),
    [
        (None, (True, True), None),
        ({"other_connector": 1}, (True, True), None),
        ({"kvoffload": {"store": False}}, (False, True), None),
        ({"kvoffload": {"load": False, "store": True}}, (True, False), None),
        ({"kvoffload": {"store": "no"}}, (True, True), "'store'='no'"),
        ({"kvoffload": {"stor": False}}, (True, True), "'stor'=False"),
        ({"kvoffload": ["store"]}, (True, True), "must be a dict"),
    ],
)
def test_request_params_read_what_is_understood_and_name_the_rest(
    params: object, want: tuple[bool, bool], problem: str | None
) -> None:
    store, load, why = request_params(FakeRequest("r", [1], kv_transfer_params=params))  # type: ignore[arg-type]
    assert (store, load) == want
    if problem is None:
        assert why is None
    else:
        assert why is not None and problem in why


def test_params_not_understood_are_logged_and_the_request_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(FileStorage(tmp_path), stride=BS)
    try:
        caplog.set_level("WARNING")
        _run(rig, FakeRequest("r", list(range(2200, 2213)), kv_transfer_params={"kvoffload": {"store": 0}}))
        assert _files(tmp_path) >= 3  # stored: its default
        assert "vllm.request_params_ignored" in caplog.text and "store\\'=0 not understood" in caplog.text
    finally:
        rig.close()
