"""The lifecycle's declaration: its spec (states, events, guards, transitions) and the
table compiled from it; and the load lifecycle's (``load_spec``, ``load_table``): the
way back, store -> host pool -> device pages. The live :class:`~kvoffload.Lifecycle`
and :class:`~kvoffload.Load` objects are the core's (``kvoffload.core``): this package
imports nothing of the core."""

from __future__ import annotations

from kvoffload.lifecycle.load_spec import LOAD_SPEC, LoadOutcome, LoadState
from kvoffload.lifecycle.spec import SPEC, LifecycleState, Outcome

__all__ = ["LOAD_SPEC", "SPEC", "LifecycleState", "LoadOutcome", "LoadState", "Outcome"]
