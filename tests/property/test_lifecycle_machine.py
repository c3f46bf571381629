"""The lifecycle under completion interleavings: the stateful suite, on every layer.

The same rules (kvoffload.testing) drive the bare core - as integer-encoded programs,
2,000 examples, fast - and the asyncio and sync drivers as hypothesis state machines,
on their production delivery paths (an example draws whether a listener is attached).
After every step the observer checks the ledger, each lifecycle's state against the
spec's meaning, in-flight counts against the backend's, the keys of every delivered
chunk against an independent chain, the bytes every copy moved (drivers), every device
free, and garbage (F2).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings

from kvoffload.testing import (
    CoreLifecycleMachine,
    LifecycleMachine,
    SyncLifecycleMachine,
    open_arguments,
    programs,
    run_program,
)

#: Examples in the default (ci) profile. The core runs four times as many as v0.1's
#: 500 through the asyncio manager, in less time; each driver runs its own share.
CORE_EXAMPLES = 2000
DRIVER_EXAMPLES = 300


class CoreSuite(CoreLifecycleMachine):
    """The suite on the bare core (owned and engine-owned memory)."""

    engine_owned_mode = True


class AsyncSuite(LifecycleMachine):
    """The suite through the asyncio driver (OffloadManager)."""

    engine_owned_mode = True


class SyncSuite(SyncLifecycleMachine):
    """The suite through the sync driver (SyncOffloadManager)."""

    engine_owned_mode = True


@settings(max_examples=max(CORE_EXAMPLES, settings.default.max_examples))
@given(open_kwargs=open_arguments(), program=programs())
def test_core_suite(open_kwargs: dict[str, Any], program: list[int]) -> None:
    """Every rule holds on the bare core after every step of every program."""
    run_program(CoreSuite, open_kwargs, program)


def _settings(examples: int) -> settings:
    return settings(
        settings.default,
        max_examples=max(examples, settings.default.max_examples),
        stateful_step_count=30,
    )


TestAsyncSuite = AsyncSuite.TestCase
TestAsyncSuite.settings = _settings(DRIVER_EXAMPLES)
TestSyncSuite = SyncSuite.TestCase
TestSyncSuite.settings = _settings(DRIVER_EXAMPLES)
