"""The lifecycle: its declaration (spec), compiled table, and Lifecycle objects."""

from __future__ import annotations

from kvoffload.lifecycle.core import Lifecycle, LifecycleId
from kvoffload.lifecycle.spec import SPEC, LifecycleState, Outcome

__all__ = ["SPEC", "Lifecycle", "LifecycleId", "LifecycleState", "Outcome"]
