"""The simulated engine of ``kvoffload simulate`` (kvoffload.tools.scheduler) must itself be
a correct engine, or the run's delivery check blames the library for the engine's bug.

Found running ``kvoffload simulate`` from a fresh clone (issue 19): about one run in
five failed with "its host pages do not hold the engine's KV". A request that finished
with nothing in flight was released at once (owned mode: its device pages back in
the pool); the same step admitted a request into those pages; and only then did the
engine write the step's KV - the finished request's last token and the new request's
prompt in one indexed store, to the same slot, where which value lands is undefined.
"""

from __future__ import annotations

import pytest
from support import run_cli, small_config

import kvoffload as kvo
from kvoffload.testing import SimBackend
from kvoffload.tools.delivery_check import EngineRecord


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_simulate_writes_a_steps_kv_before_it_releases_a_request(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default run (seeded) writes each step's KV before any request of that step is
    finished or aborted, so no KV lands in pages another request was given."""
    code, out, err = run_cli(["simulate", "--no-progress", "--backend", backend], capsys)
    assert code == 0, out + err
    assert "0 mismatched" in out and "after it was released" not in out


def test_kv_written_after_its_lifecycle_was_released_is_refused() -> None:
    """The engine record refuses to write a released lifecycle's KV (it would write
    into pages that may be another request's), naming the lifecycle."""
    with kvo.SyncOffloadManager(small_config(), backend=SimBackend()) as mgr:
        engine = EngineRecord(4, device=mgr.device_pool, host=mgr.host_pool)
        lc = mgr.admit("r1", [0, 1, 2, 3])
        engine.commit(lc, [0, 1, 2, 3])
        lc.extend([4])
        engine.commit(lc, [4])
        lc.finish()  # nothing in flight: RELEASED at once, its pages back in the pool
        assert lc.released
        with pytest.raises(kvo.InvariantViolation, match="after it was released"):
            engine.write_kv()
