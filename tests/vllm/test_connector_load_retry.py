"""A request whose load failed is not promised the same pages again (F38), on plain data.

Found by the engine test ``test_engine_kvoffload.py::test_a_corrupted_store_is_recomputed_never_served``:
vLLM (``kv_load_failure_policy="recompute"``) puts a request whose load failed back in
its waiting queue with the KV before the first bad block, and asks the connector's
``get_num_new_matched_tokens`` again when it schedules it. The corrupt page is still in
the store (a lookup sees a file), so the connector promised it again, vLLM loaded it,
failed, rescheduled: the engine span for ever ("Recovered from KV load failure" without
end). After a failed load the request must recompute what is left.
"""

from __future__ import annotations

from pathlib import Path

from connector_fakes import BS, FakeRequest, Rig

from kvoffload.integrations.vllm_keys import page_keys, request_seed
from kvoffload.storage.file import FileStorage


def _store_prompt(root: Path, prompt: list[int]) -> None:
    rig = Rig(FileStorage(root))
    try:
        rig.add(FakeRequest("a", prompt))
        for _ in range(3):
            rig.step()
        rig.finish("a")
        rig.settle()
    finally:
        rig.close()


def test_after_a_failed_load_the_request_is_not_offered_the_pages_again(tmp_path: Path) -> None:
    """F38: the 2nd of 3 promised pages is corrupt: the load reports blocks 1 and 2 as
    errors and the request keeps block 0. Asked again beyond block 0 (as vLLM asks when
    it reschedules the request), the connector promises nothing: the request recomputes
    the rest instead of loading the corrupt page again and again."""
    prompt = list(range(1200, 1213))
    _store_prompt(tmp_path, prompt)
    rig = Rig(FileStorage(tmp_path))
    try:
        req = FakeRequest("b", prompt)
        assert rig.add(req) == 3 * BS
        key = page_keys(request_seed(None, req), prompt, BS, 2)[1]
        path = FileStorage(tmp_path).path(key)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
        rig.settle()
        assert rig.recvd == ["b"] and rig.load_errors == set(rig.blocks["b"][1:3])
        assert req.num_computed_tokens == BS
        assert rig.planner.matched(req, req.num_computed_tokens) == 0
    finally:
        rig.close()
