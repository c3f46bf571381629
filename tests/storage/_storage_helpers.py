"""Page keys and page bytes for the storage tests (importable as a plain module)."""

from __future__ import annotations

from kvoffload.keys import chain_keys

PAGE = 64


def keys_of(n: int, salt: int = 0) -> list[str]:
    """``n`` chained page keys (as the manager makes them)."""
    return chain_keys(None, [salt * 1000 + i for i in range(n * 4)], 4)


def pages_of(n: int, size: int = PAGE, salt: int = 0) -> list[bytes]:
    """``n`` distinct pages of ``size`` bytes."""
    return [bytes([(salt + i + j) % 251 for j in range(size)]) for i in range(n)]
