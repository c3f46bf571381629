"""Drivers: thin layers over the core that own the threads and tasks, nothing else.

- :class:`~kvoffload.drivers.asyncio.OffloadManager` - for asyncio schedulers.
- :class:`~kvoffload.drivers.sync.SyncOffloadManager` - for synchronous scheduler loops.

Both build the same :class:`~kvoffload.core.OffloadCore` and movers; they differ only
in how they wait.
"""

from __future__ import annotations

from kvoffload.drivers.asyncio import OffloadManager
from kvoffload.drivers.sync import SyncOffloadManager

__all__ = ["OffloadManager", "SyncOffloadManager"]
