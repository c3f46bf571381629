"""Test the test, for the load path: a broken ``Loads`` room put into the core (as
``tests/test_mutations.py`` does for the offload rooms) must make the load property
test (``tests/property/test_load_interleavings.py``) fail.

- ``SubmitsAfterCancel``: a read that returns after the engine took the pages back
  still submits the copy (the abort-mid-load bug the load path exists to prevent);
- ``CopiesPastTheRead``: a short read (a page missing or corrupt) copies every host
  page anyway - bytes never read, or corrupt, reach the device (F38);
- ``EndsAtCancel``: a cancel ends the load at once, its host pages freed and its
  device pages handed back while its copy is still in flight.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import HypothesisException
from hypothesis.stateful import run_state_machine_as_test

import kvoffload.core.offload as offload
from kvoffload.core.loads import Load, Loads
from kvoffload.lifecycle.load_spec import LoadOutcome, LoadState

_CANCELLING = LoadState.CANCELLING.value
_READING = LoadState.READING.value


class SubmitsAfterCancel(Loads):
    def read(self, ld: Load, n_ok: int, error: BaseException | None = None) -> list[Load]:
        if ld._s == _CANCELLING and error is None and n_ok:
            ld._s = _READING  # the cancel is forgotten
        return super().read(ld, n_ok, error)


class CopiesPastTheRead(Loads):
    def read(self, ld: Load, n_ok: int, error: BaseException | None = None) -> list[Load]:
        if error is None and n_ok:
            n_ok = len(ld.keys)  # the short read is ignored
        return super().read(ld, n_ok, error)


class EndsAtCancel(Loads):
    def cancel(self, ld: Load) -> list[Load]:
        t = ld._transfer
        if t is None or ld.done:
            return super().cancel(ld)
        del self.copying[t.id]
        self.counters.load_pages_inflight -= len(t.device_pages)
        ld._transfer = None
        super().cancel(ld)
        self.fire(ld, 5, LoadOutcome.CANCELLED)  # copy_done from CANCELLING, at once
        return []


def _machine() -> type:
    here = str(Path(__file__).resolve().parent / "property")
    if here not in sys.path:
        sys.path.insert(0, here)
    module = importlib.import_module("test_load_interleavings")
    return module.LoadInterleavings  # type: ignore[no-any-return]


CI = settings(
    max_examples=300,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


#: Each mutant and what the property test's failure on it must say.
CAUGHT_BY: dict[type, str] = {
    SubmitsAfterCancel: "a copy submitted after its cancel",
    CopiesPastTheRead: r"copies pages its read did not fill \(F38\)",
    EndsAtCancel: "a cancel never stops a copy in flight|completed twice or was never submitted",
}


def _chain(error: BaseException) -> list[BaseException]:
    """``error``, a group's errors, and what each was raised while handling."""
    out: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if e in out:
            continue
        out.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo += list(e.exceptions)
        todo += [c for c in (e.__context__, e.__cause__) if c is not None]
    return out


@pytest.mark.parametrize("mutant", list(CAUGHT_BY), ids=lambda m: m.__name__)
def test_the_load_property_test_catches_the_mutant(mutant: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """The property test fails on a core with ``mutant`` in place of its Loads room,
    for the reason that mutant's bug should be caught by (not hypothesis giving up)."""
    from kvoffload.lifecycle.load_table import LOAD_EVENT_INDEX

    assert LOAD_EVENT_INDEX["copy_done"] == 5  # (EndsAtCancel steps by index)
    machine = _machine()
    monkeypatch.setattr(offload, "Loads", mutant)
    with pytest.raises(BaseException) as info:
        run_state_machine_as_test(machine, settings=CI)
    assert not isinstance(info.value, HypothesisException), repr(info.value)
    assert any(re.search(CAUGHT_BY[mutant], str(e)) for e in _chain(info.value)), repr(info.value)


def test_the_real_room_passes_the_same_run() -> None:
    """Without a mutant the same run passes (so the failures above are the mutants')."""
    run_state_machine_as_test(_machine(), settings=CI)
