"""Storage reads: ``OffloadManager.lookup`` and ``OffloadManager.fetch``.

A token sequence is named page by page with the same chain keys as write-behind
(from the root, as SGLang does), so any worker that stored a prefix, and any
SGLang prefill node, is found. Reads never touch lifecycles or pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvoffload.errors import InvalidTokens, StorageError
from kvoffload.keys import chain_keys_packed, pack_tokens, validate_tokens

if TYPE_CHECKING:
    from kvoffload.abc import Storage
    from kvoffload.manager import OffloadManager

__all__ = ["fetch", "lookup", "page_keys"]


def page_keys(tokens: Sequence[int], page_size: int, n: int | None = None) -> list[str]:
    """Chain keys of the whole pages of ``tokens[:n]`` (all whole pages when ``n`` is None)."""
    toks = validate_tokens(tokens)
    if n is None:
        n = len(toks) - len(toks) % page_size
    return chain_keys_packed(None, pack_tokens(toks[:n]), page_size)


def _storage(mgr: OffloadManager) -> Storage:
    if mgr.storage is None:
        raise StorageError("this OffloadManager has no storage tier (storage=None): nothing to look up")
    return mgr.storage


async def lookup(mgr: OffloadManager, tokens: Sequence[int]) -> int:
    """See :meth:`OffloadManager.lookup`."""
    storage = _storage(mgr)
    ps = mgr.config.page_size
    keys = page_keys(tokens, ps)
    if not keys:
        return 0
    return await storage.exists_prefix(keys) * ps


async def fetch(mgr: OffloadManager, tokens: Sequence[int], n: int) -> list[bytes]:
    """See :meth:`OffloadManager.fetch`."""
    storage = _storage(mgr)
    ps = mgr.config.page_size
    toks = validate_tokens(tokens)
    if type(n) is not int or not 0 <= n <= len(toks) or n % ps:
        raise InvalidTokens(
            f"fetch n={n!r} must be a multiple of page_size ({ps}) between 0 and len(tokens) ({len(toks)})"
        )
    keys = page_keys(toks, ps, n)
    if not keys:
        return []
    page_nbytes = mgr.host_pool.tensor[0].nbytes if mgr.host_pool.n_pages else -1
    out: list[bytes] = []
    for page in await storage.get(keys):
        if page is None or len(page) != page_nbytes:
            break
        out.append(page)
    return out
