"""The on-store record of one page: a small header, then the page's bytes.

A page key is a hash of *tokens*, not of bytes, so a store cannot check a page by
rehashing it. Instead every record the file and redis stores write carries the key
it was written under, the payload length and a checksum of the payload::

    version 2 (written):  magic "KVOP" | 2 u8 | pad u8 | key length u16 | payload length u64
                          | xxh3_64 u64 | key (utf-8) | payload
    version 1 (read):     magic "KVOP" | 1 u8 | pad u8 | key length u16 | payload length u64
                          | crc32 u32   | key (utf-8) | payload

All integers little-endian. Version 2's checksum is xxHash's XXH3-64 (seed 0): in
each of 3 runs of ``benchmarks/bench_storage.py`` on a shared 2-vCPU machine it was
about 15x zlib's CRC-32 and 2.5x a hardware CRC-32C, and it is fast on any CPU, where
CRC-32C falls back to software without SSE 4.2 or ARMv8 CRC (docs/storage.md has the
figures). Records
of version 1 are still read.

:func:`decode` returns the payload only when all of it agrees with the key asked
for; a truncated, corrupt, foreign or mis-keyed record reads as missing (``None``),
never as a page.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import NamedTuple

from xxhash import xxh3_64, xxh3_64_intdigest

__all__ = [
    "HEADER",
    "Found",
    "checksum",
    "decode",
    "encode_header",
    "header_size",
    "intact",
    "intact_parts",
    "payload_offset",
]

MAGIC = b"KVOP"
#: The version this code writes.
VERSION = 2
#: The fixed part of a version 2 header (before the key).
HEADER = struct.Struct("<4sBxHQQ")
#: The fixed part of a version 1 header.
HEADER_V1 = struct.Struct("<4sBxHQI")
#: Bytes enough to read the version of a record and, for either version, its fixed part.
_PREFIX = struct.Struct("<4sB")


class Found(NamedTuple):
    """Where a record's payload is, and what checks it."""

    offset: int
    length: int
    version: int
    checksum: int


def checksum(payload: bytes | memoryview) -> int:
    """The version 2 checksum of ``payload`` (XXH3-64), read in place (no copy)."""
    return xxh3_64_intdigest(payload)


def header_size(key: str) -> int:
    """Bytes before the payload in a record of ``key`` written now (version 2); a
    version 1 record's header is 4 bytes shorter."""
    return HEADER.size + len(key.encode())


def encode_header(key: str, page: bytes | memoryview) -> bytes:
    """The header of the record of ``page`` under ``key`` (write it, then the page)."""
    k = key.encode()
    if len(k) > 0xFFFF:
        raise ValueError(f"page key is {len(k)} bytes; at most 65535 allowed")
    view = memoryview(page)
    return HEADER.pack(MAGIC, VERSION, len(k), view.nbytes, xxh3_64_intdigest(view)) + k


def payload_offset(key: str, head: bytes | memoryview, total: int) -> Found | None:
    """Check a record's header against ``key`` and the record's ``total`` size.

    ``head`` is at least the first ``header_size(key)`` bytes of the record (or all of
    it, if shorter). Returns where the payload is and its checksum, or ``None`` if the
    header is not this key's or the size does not match (a truncated or padded record).
    """
    k = key.encode()
    if len(head) < _PREFIX.size:
        return None
    magic, version = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        return None
    fixed = HEADER if version == VERSION else HEADER_V1 if version == 1 else None
    if fixed is None or len(head) < fixed.size + len(k):
        return None
    _, _, klen, plen, crc = fixed.unpack_from(head)
    if klen != len(k):
        return None
    off = fixed.size + klen
    if bytes(head[fixed.size : off]) != k or total != off + plen:
        return None
    return Found(off, plen, version, crc)


def intact(found: Found, payload: bytes | memoryview) -> bool:
    """Whether ``payload`` matches the checksum of its record."""
    if found.version == 1:
        return zlib.crc32(payload) == found.checksum
    return xxh3_64_intdigest(payload) == found.checksum


def intact_parts(found: Found, parts: Sequence[memoryview]) -> bool:
    """Whether the payload held by ``parts`` (in order) matches its record's checksum."""
    if found.version == 1:
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return crc == found.checksum
    h = xxh3_64()
    for part in parts:
        h.update(part)
    return bool(h.intdigest() == found.checksum)


def decode(key: str, record: bytes | None) -> bytes | None:
    """The page in ``record`` if it is a whole, intact record of ``key``; else ``None``."""
    if record is None:
        return None
    view = memoryview(record)
    found = payload_offset(key, view, len(view))
    if found is None:
        return None
    payload = view[found.offset :]
    if not intact(found, payload):
        return None
    return bytes(payload)


def encode_v1(key: str, page: bytes) -> bytes:
    """A whole version 1 record (CRC-32), as kvoffload 0.1 wrote it: for tests."""
    k = key.encode()
    return HEADER_V1.pack(MAGIC, 1, len(k), len(page), zlib.crc32(page)) + k + page
