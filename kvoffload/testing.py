"""Helpers for tests of kvoffload and of code that uses it.

``SimBackend`` completes nothing until the test says so.
"""

from __future__ import annotations

from kvoffload.backends.sim import SimBackend

__all__ = ["SimBackend"]
