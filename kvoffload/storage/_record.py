"""The on-store record of one page: a small header, then the page's bytes.

A page key is a hash of *tokens*, not of bytes, so a store cannot check a page by
rehashing it. Instead every record the file and redis stores write carries the key
it was written under, the payload length and a CRC-32 of the payload::

    magic "KVOP" | version u8 | pad u8 | key length u16 | payload length u64 | crc32 u32
    | key (utf-8) | payload

:func:`decode` returns the payload only when all of it agrees with the key asked
for; a truncated, corrupt, foreign or mis-keyed record reads as missing (``None``),
never as a page.
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["HEADER", "decode", "encode_header", "header_size", "payload_offset"]

MAGIC = b"KVOP"
VERSION = 1
#: The fixed part of the header (before the key).
HEADER = struct.Struct("<4sBxHQI")


def header_size(key: str) -> int:
    """Bytes before the payload in a record of ``key``."""
    return HEADER.size + len(key.encode())


def encode_header(key: str, page: bytes | memoryview) -> bytes:
    """The header of the record of ``page`` under ``key`` (write it, then the page)."""
    k = key.encode()
    if len(k) > 0xFFFF:
        raise ValueError(f"page key is {len(k)} bytes; at most 65535 allowed")
    return HEADER.pack(MAGIC, VERSION, len(k), len(page), zlib.crc32(page)) + k


def payload_offset(key: str, head: bytes | memoryview, total: int) -> tuple[int, int, int] | None:
    """Check a record's header against ``key`` and the record's ``total`` size.

    ``head`` is at least the first ``header_size(key)`` bytes of the record. Returns
    ``(offset, length, crc)`` of the payload, or ``None`` if the header is not this
    key's or the size does not match (a truncated or padded record).
    """
    k = key.encode()
    if len(head) < HEADER.size + len(k):
        return None
    magic, version, klen, plen, crc = HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION or klen != len(k):
        return None
    off = HEADER.size + klen
    if bytes(head[HEADER.size : off]) != k or total != off + plen:
        return None
    return off, plen, crc


def decode(key: str, record: bytes | None) -> bytes | None:
    """The page in ``record`` if it is a whole, intact record of ``key``; else ``None``."""
    if record is None:
        return None
    view = memoryview(record)
    found = payload_offset(key, view, len(view))
    if found is None:
        return None
    off, _, crc = found
    payload = view[off:]
    if zlib.crc32(payload) != crc:
        return None
    return bytes(payload)
