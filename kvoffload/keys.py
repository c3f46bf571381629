"""Page keys: SGLang HiCache's hash chain, computed at submit time.

``key(page) = sha256(bytes.fromhex(prev_key) if prev_key else b"" +
token ids as 4-byte little-endian unsigned).hexdigest()``

The key of a page covers its whole prefix, so a chain can only be continued from
the key of the page before; it never restarts in the middle (FAILURES F11).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

from kvoffload.errors import InvalidTokens

__all__ = ["TOKEN_TYPECODE", "chain_keys", "chain_keys_packed", "pack_tokens", "page_key", "validate_tokens"]

_U32 = 1 << 32
#: array typecode of a 4-byte unsigned token id.
TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"
assert array(TOKEN_TYPECODE).itemsize == 4
_LITTLE = sys.byteorder == "little"


def validate_tokens(tokens: Sequence[int], what: str = "tokens") -> array[int]:
    """Return ``tokens`` as a compact ``array`` of uint32 token ids.

    Raises :class:`InvalidTokens` naming the first bad element when ``tokens`` is not
    a sequence of ints in ``[0, 2**32)`` (str and bytes are refused outright).
    """
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise InvalidTokens(f"{what} must be a sequence of token ids, not {type(tokens).__name__}")
    try:
        return array(TOKEN_TYPECODE, tokens)
    except (TypeError, OverflowError, ValueError):
        pass
    try:
        items = list(tokens)
    except TypeError:
        raise InvalidTokens(f"{what} must be a sequence of token ids, not {type(tokens).__name__}") from None
    for i, t in enumerate(items):
        if not hasattr(t, "__index__"):
            raise InvalidTokens(f"{what}[{i}] = {t!r} is not an int token id")
        if not 0 <= t.__index__() < _U32:
            raise InvalidTokens(f"{what}[{i}] = {t} is outside [0, 2**32)")
    raise InvalidTokens(f"{what} could not be read as uint32 token ids")  # pragma: no cover


def chain_keys_packed(prev_key: str | None, packed: bytes, page_size: int) -> list[str]:
    """:func:`chain_keys` over tokens already packed as little-endian uint32 bytes."""
    keys: list[str] = []
    key = prev_key
    step = 4 * page_size
    sha = hashlib.sha256
    fromhex = bytes.fromhex
    for off in range(0, len(packed), step):
        h = sha(fromhex(key)) if key else sha()
        h.update(packed[off : off + step])
        key = h.hexdigest()
        keys.append(key)
    return keys


def pack_tokens(tokens: array[int]) -> bytes:
    """The little-endian uint32 bytes of a token array."""
    if _LITTLE:
        return tokens.tobytes()
    swapped = array(TOKEN_TYPECODE, tokens)
    swapped.byteswap()
    return swapped.tobytes()


def page_key(prev_key: str | None, page_tokens: Sequence[int]) -> str:
    """The key of one page given the key of the page before it (``None`` at the root)."""
    h = hashlib.sha256()
    if prev_key:
        h.update(bytes.fromhex(prev_key))
    h.update(struct.pack(f"<{len(page_tokens)}I", *page_tokens))
    return h.hexdigest()


def chain_keys(prev_key: str | None, tokens: Sequence[int], page_size: int) -> list[str]:
    """Keys of the whole pages of ``tokens``, chained from ``prev_key``.

    ``len(tokens)`` must be a multiple of ``page_size``; a trailing partial page has
    no key (it is not a page yet).
    """
    n = len(tokens)
    if n % page_size:
        raise ValueError(f"{n} tokens is not a whole number of {page_size}-token pages")
    return chain_keys_packed(prev_key, struct.pack(f"<{n}I", *tokens), page_size)
