"""The lifecycle's declaration: its spec (states, events, guards, transitions) and the
table compiled from it. The live :class:`~kvoffload.Lifecycle` objects are the core's
(``kvoffload.core.lifecycle``): this package imports nothing of the core."""

from __future__ import annotations

from kvoffload.lifecycle.spec import SPEC, LifecycleState, Outcome

__all__ = ["SPEC", "LifecycleState", "Outcome"]
