"""kvoffload: the KV-offload lifecycle layer for LLM decode workers."""

from __future__ import annotations

# First: the kvoffload command (only it) stops quietly on INT/TERM from here on (F27).
import kvoffload._early_stop  # noqa: F401
from kvoffload.abc import EventBackend, Storage, Transfer
from kvoffload.config import OffloadConfig
from kvoffload.core.kv_events import BlockRemoved, BlockStored, KVEvents
from kvoffload.core.lifecycle import Lifecycle, LifecycleId
from kvoffload.core.loads import Load
from kvoffload.core.stats import Statistics
from kvoffload.drivers import OffloadManager, SyncOffloadManager
from kvoffload.errors import (
    BackendError,
    ConfigError,
    DrainTimeout,
    InvalidTokens,
    InvalidTransition,
    InvariantViolation,
    KVOffloadError,
    ManagerClosed,
    MissingDependency,
    PageError,
    PartialWriteError,
    PoolExhausted,
    RanksDiverged,
    RankTimeout,
    StorageError,
    UnsupportedKVPool,
    WrongThread,
)
from kvoffload.keys import chain_keys, namespace_seed, page_key
from kvoffload.lifecycle import SPEC, LifecycleState, LoadOutcome, LoadState, Outcome

__version__ = "0.1.0"

__all__ = [
    "SPEC",
    "BackendError",
    "BlockRemoved",
    "BlockStored",
    "ConfigError",
    "DrainTimeout",
    "EventBackend",
    "InvalidTokens",
    "InvalidTransition",
    "InvariantViolation",
    "KVEvents",
    "KVOffloadError",
    "Lifecycle",
    "LifecycleId",
    "LifecycleState",
    "Load",
    "LoadOutcome",
    "LoadState",
    "ManagerClosed",
    "MissingDependency",
    "OffloadConfig",
    "OffloadManager",
    "Outcome",
    "PageError",
    "PartialWriteError",
    "PoolExhausted",
    "RankTimeout",
    "RanksDiverged",
    "Statistics",
    "Storage",
    "StorageError",
    "SyncOffloadManager",
    "Transfer",
    "UnsupportedKVPool",
    "WrongThread",
    "__version__",
    "chain_keys",
    "namespace_seed",
    "page_key",
]
