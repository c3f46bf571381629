"""Page keys: SGLang HiCache's hash chain, computed at submit time, and namespace seeds.

``key(page) = sha256(prior digest + the page's token ids).hexdigest()``, where the
prior digest is ``bytes.fromhex`` of the key of the page before (of the chain seed
for the first page; nothing when there is neither), and the ids are packed

- as 4-byte little-endian unsigned when every id of the page is below ``2**32``;
- else as ``b"\\xff"`` then 8-byte little-endian unsigned (SGLang 0.5.23's wide form;
  ids must be below ``2**63``).

The key of a page covers its whole prefix, so a chain can only be continued from
the key of the page before; it never restarts in the middle (FAILURES F11). A chain
seeded with :func:`namespace_seed` shares no key with another namespace's (F22).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Mapping, MappingView, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from kvoffload.errors import ConfigError, InvalidTokens

__all__ = [
    "INT_DTYPES",
    "TOKEN_TYPECODE",
    "WIDE_TYPECODE",
    "chain_keys",
    "chain_keys_packed",
    "check_seed",
    "namespace_seed",
    "pack_tokens",
    "page_key",
    "page_run_digests",
    "page_run_keys",
    "validate_tokens",
]

_U32 = 1 << 32
#: Token ids must be below this (SGLang hashes wide ids as uint64; 2**63 keeps int64 safe).
TOKEN_LIMIT = 1 << 63
#: array typecode of a 4-byte unsigned token id (the common, narrow form).
TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"
#: array typecode of an 8-byte unsigned token id (a run holding an id >= 2**32).
WIDE_TYPECODE = "Q"
assert array(TOKEN_TYPECODE).itemsize == 4 and array(WIDE_TYPECODE).itemsize == 8
_LITTLE = sys.byteorder == "little"
#: Marks a page hashed in the wide (uint64) form.
_WIDE_TAG = b"\xff"
_INT_TYPECODES = frozenset("bBhHiIlLqQ")
#: The integer dtypes (numpy's and torch's names) whose arrays and tensors hold token ids.
INT_DTYPES = frozenset(f"{s}int{b}" for s in ("", "u") for b in (8, 16, 32, 64))
#: Below this many ids, look at every element's type; above, only at the 0s and 1s.
_SCAN_ALL = 256


# --- token ids ------------------------------------------------------------------------


def validate_tokens(tokens: Sequence[int], what: str = "tokens") -> array[int]:
    """Return ``tokens`` as a compact ``array`` of token ids: typecode
    :data:`TOKEN_TYPECODE` (uint32) when every id is below ``2**32``, else
    :data:`WIDE_TYPECODE` (uint64).

    Accepted: a list, tuple, range, ``array.array`` of an integer typecode, a
    one-dimensional integer numpy array or torch tensor, or another iterable of ints
    (read once). Raises :class:`InvalidTokens` naming the first bad element, or what
    is wrong with the container: ids outside ``[0, 2**63)``, bools, floats, str and
    bytes, sets, dicts and dict views (no order of their own), float or bool arrays
    and tensors.
    """
    items: Any
    scan = True  # whether elements may be Python objects of any type (bools included)
    kind = type(tokens)
    if kind is list or kind is tuple:  # the common case first: no ABC checks
        try:
            out = array(TOKEN_TYPECODE, tokens)
        except (TypeError, OverflowError, ValueError):
            return _wide(tokens, what)
        if out:
            if len(out) == 1:
                if type(tokens[0]) is not int:
                    _refuse_bools(tokens, out, what)
            else:
                _refuse_bools(tokens, out, what)
        return out
    if isinstance(tokens, array):
        if tokens.typecode not in _INT_TYPECODES:
            raise InvalidTokens(f"{what} is an array of typecode {tokens.typecode!r}: token ids are integers")
        items, scan = tokens, False
    elif isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise InvalidTokens(f"{what} must be a sequence of token ids, not {type(tokens).__name__}")
    elif isinstance(tokens, (AbstractSet, Mapping, MappingView)):
        raise InvalidTokens(f"{what} must be an ordered sequence of token ids, not a {type(tokens).__name__}")
    elif kind is range:
        items, scan = tokens, False
    elif getattr(tokens, "dtype", None) is not None:  # a numpy array or a torch tensor
        dtype = str(tokens.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
        if dtype not in INT_DTYPES:
            raise InvalidTokens(f"{what} has dtype {dtype}: token ids are integers")
        shape = tuple(getattr(tokens, "shape", ()))
        if len(shape) != 1:
            raise InvalidTokens(f"{what} must be one-dimensional, got shape {shape}")
        items, scan = tokens.tolist(), False  # type: ignore[attr-defined]
    else:
        try:
            items = list(tokens)
        except TypeError:
            raise InvalidTokens(
                f"{what} must be a sequence of token ids, not {type(tokens).__name__}"
            ) from None
    try:
        out = array(TOKEN_TYPECODE, items)
    except (TypeError, OverflowError, ValueError):
        return _wide(items, what)
    if scan and out:
        _refuse_bools(items, out, what)
    return out


def _is_bool(t: object) -> bool:
    """A Python, numpy or torch bool (each converts to 0 or 1 without complaint)."""
    return type(t) is bool or str(getattr(t, "dtype", None)) in ("bool", "torch.bool")


def _refuse_bools(items: Sequence[Any], ids: array[int], what: str) -> None:
    """Raise if an element of ``items`` (whose ids are ``ids``) is a bool. A bool converts
    to 0 or 1, so a long sequence is checked only where its id is 0 or 1."""
    if len(ids) <= _SCAN_ALL:
        if set(map(type, items)) == {int}:
            return
        where: Sequence[int] = range(len(ids))
    else:
        import numpy as np

        where = np.flatnonzero(np.frombuffer(ids, dtype=f"u{ids.itemsize}") <= 1).tolist()
    for i in where:
        if _is_bool(items[i]):
            raise InvalidTokens(f"{what}[{i}] = {items[i]!r} is a bool, not a token id")


def _wide(items: Any, what: str) -> array[int]:
    """``items`` as uint64 ids (some id is >= 2**32 or does not fit uint32), or
    :class:`InvalidTokens` naming the first bad element."""
    try:
        out = array(WIDE_TYPECODE, items)
    except (TypeError, OverflowError, ValueError):
        pass
    else:
        if out and max(out) < TOKEN_LIMIT:
            if not isinstance(items, array) and not (type(items) is list and set(map(type, items)) == {int}):
                _refuse_bools(items, out, what)
            if max(out) < _U32:  # not wide after all (an element array("I") refused?)
                return array(TOKEN_TYPECODE, out)
            return out
    try:
        seq = list(items)
    except TypeError:
        raise InvalidTokens(f"{what} must be a sequence of token ids, not {type(items).__name__}") from None
    for i, t in enumerate(seq):
        if _is_bool(t):
            raise InvalidTokens(f"{what}[{i}] = {t!r} is a bool, not a token id")
        try:
            v = t.__index__()
        except (AttributeError, TypeError, ValueError, RuntimeError):
            raise InvalidTokens(f"{what}[{i}] = {t!r} is not an int token id") from None
        if not 0 <= v < TOKEN_LIMIT:
            raise InvalidTokens(f"{what}[{i}] = {v} is outside [0, 2**63)")
    raise InvalidTokens(f"{what} could not be read as token ids")  # pragma: no cover


def pack_tokens(tokens: array[int]) -> bytes:
    """The little-endian bytes of a token array, at its own width (4 bytes per id for
    :data:`TOKEN_TYPECODE`, 8 for :data:`WIDE_TYPECODE`)."""
    if _LITTLE:
        return tokens.tobytes()
    swapped = array(tokens.typecode, tokens)
    swapped.byteswap()
    return swapped.tobytes()


# --- keys -------------------------------------------------------------------------------


def chain_keys_packed(prev_key: str | None, packed: bytes, page_size: int) -> list[str]:
    """:func:`chain_keys` over narrow tokens already packed as little-endian uint32 bytes."""
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


def _page_bytes(page: array[int]) -> bytes:
    """What one page contributes to its hash: narrow ids, or the tag and wide ids."""
    if page.typecode == TOKEN_TYPECODE:
        return pack_tokens(page)
    if not page or max(page) < _U32:
        return pack_tokens(array(TOKEN_TYPECODE, page))
    return _WIDE_TAG + pack_tokens(page)


def page_run_keys(prev_key: str | None, tokens: array[int], page_size: int) -> list[str]:
    """Keys of the whole pages ``tokens`` holds, chained from ``prev_key``.

    ``tokens`` comes from :func:`validate_tokens` (narrow or wide); each page is hashed
    in the narrow form unless it holds an id ``>= 2**32``. ``len(tokens)`` must be a
    multiple of ``page_size``. This is what the core calls at submit time.
    """
    n = len(tokens)
    if n % page_size:
        raise ValueError(f"{n} tokens is not a whole number of {page_size}-token pages")
    if tokens.typecode == TOKEN_TYPECODE:
        return chain_keys_packed(prev_key, pack_tokens(tokens), page_size)
    keys: list[str] = []
    key = prev_key
    for off in range(0, n, page_size):
        h = hashlib.sha256(bytes.fromhex(key)) if key else hashlib.sha256()
        h.update(_page_bytes(tokens[off : off + page_size]))
        key = h.hexdigest()
        keys.append(key)
    return keys


def page_run_digests(prev: bytes, tokens: array[int], page_size: int) -> list[bytes]:
    """The chain of :func:`page_run_keys` as binary SHA-256 digests: what the core keeps
    (hex only where a key leaves the library). ``prev`` is the digest of the page before
    (or the seed's bytes; ``b""`` at the root)."""
    sha = hashlib.sha256
    out: list[bytes] = []
    d = prev
    if tokens.typecode == TOKEN_TYPECODE:
        packed = tokens.tobytes() if _LITTLE else pack_tokens(tokens)
        step = 4 * page_size
        for off in range(0, len(packed), step):
            d = sha(d + packed[off : off + step]).digest()
            out.append(d)
        return out
    for off in range(0, len(tokens), page_size):
        h = sha(d)
        h.update(_page_bytes(tokens[off : off + page_size]))
        d = h.digest()
        out.append(d)
    return out


def page_key(prev_key: str | None, page_tokens: Sequence[int]) -> str:
    """The key of one page given the key of the page before it (``None`` at the root,
    or a chain seed). Raises :class:`InvalidTokens` for bad ids, ``ValueError`` for a
    ``prev_key`` that is not hex."""
    toks = validate_tokens(page_tokens, "page_tokens")
    h = hashlib.sha256(bytes.fromhex(check_seed(prev_key, "prev_key") or ""))
    h.update(_page_bytes(toks))
    return h.hexdigest()


def chain_keys(prev_key: str | None, tokens: Sequence[int], page_size: int) -> list[str]:
    """Keys of the whole pages of ``tokens``, chained from ``prev_key`` (``None``, a
    page key, or a chain seed such as :func:`namespace_seed`'s).

    ``len(tokens)`` must be a multiple of ``page_size``; a trailing partial page has
    no key (it is not a page yet). Raises :class:`InvalidTokens` for bad ids,
    ``ValueError`` for a bad ``page_size`` or ``prev_key``.
    """
    if type(page_size) is not int or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    toks = validate_tokens(tokens)
    n = len(toks)
    if n % page_size:
        raise ValueError(f"{n} tokens is not a whole number of {page_size}-token pages")
    return page_run_keys(check_seed(prev_key, "prev_key"), toks, page_size)


# --- namespaces -------------------------------------------------------------------------

_NAMESPACE_DOMAIN = b"sglang-cache-namespace-v1"


def namespace_seed(extra_key: str | None = None, cache_salt: str | None = None) -> str | None:
    """The chain seed of a namespace, byte-compatible with SGLang's
    ``storage_namespace_seed(extra_key, cache_salt)``; ``None`` when both are ``None``
    (an unseeded chain, as before namespaces existed).

    ``extra_key`` names what the KV depends on besides the tokens (a LoRA adapter, a
    model, a tenant); ``cache_salt`` is a per-request salt. The seed hashes a domain
    tag, then each part as absent (``0x00``) or present (``0x01``, its UTF-8 length as
    uint64 little-endian, its UTF-8 bytes), so absent, empty and differently split
    parts all give different seeds. Pass it as ``chain_seed=`` or set
    ``OffloadConfig(namespace=extra_key)``. Raises :class:`~kvoffload.ConfigError` for a
    part that is not a ``str`` (or not encodable as UTF-8).
    """
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(_NAMESPACE_DOMAIN)
    for name, part in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if part is None:
            digest.update(b"\x00")
            continue
        if not isinstance(part, str):
            raise ConfigError(f"namespace_seed: {name} must be a str or None, got {type(part).__name__}")
        try:
            encoded = part.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"namespace_seed: {name} is not encodable as UTF-8: {exc}") from None
        digest.update(b"\x01" + struct.pack("<Q", len(encoded)) + encoded)
    return digest.hexdigest()


def check_seed(seed: str | None, what: str = "chain_seed") -> str | None:
    """``seed`` if it can prefix a chain (``None``, ``""`` or a hex string: a page key or a
    :func:`namespace_seed`); raises :class:`~kvoffload.ConfigError` naming ``what``."""
    if seed is None:
        return None
    if not isinstance(seed, str):
        raise ConfigError(f"{what} must be a hex str (a page key or namespace_seed()) or None, got {seed!r}")
    try:
        bytes.fromhex(seed)
    except ValueError:
        raise ConfigError(
            f"{what} must be a hex str (a page key or namespace_seed()), got {seed!r}"
        ) from None
    return seed
