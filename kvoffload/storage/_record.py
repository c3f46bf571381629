"""The on-store record of one page: a small header, then the page's bytes.

A page key is a hash of *tokens*, not of bytes, so a store cannot check a page by
rehashing it. Instead every record the file, redis and mooncake stores write carries
the key it was written under, the payload length and a checksum of the payload::

    version 3 (written):  magic "KVOP" | 3 u8 | pad u8 | key length u16 | payload length u64
                          | xxh3_64 u64 | key (utf-8) | zero bytes up to a multiple of 64
                          | payload
    version 2 (read):     as version 3 (2 u8), with no zero bytes: the payload follows the key
    version 1 (read):     magic "KVOP" | 1 u8 | pad u8 | key length u16 | payload length u64
                          | crc32 u32   | key (utf-8) | payload

All integers little-endian. The checksum is xxHash's XXH3-64 (seed 0): in each of 3
runs of ``benchmarks/bench_storage.py`` on a shared 2-vCPU machine it was about 15x
zlib's CRC-32 and 2.5x a hardware CRC-32C, and it is fast on any CPU, where CRC-32C
falls back to software without SSE 4.2 or ARMv8 CRC (docs/storage.md has the figures).

**Why version 3 pads.** A host page of a KV cache (a multiple of 64 bytes) starts on a
64-byte boundary of the pool, and a record is written by copying its page behind its
header (the kernel into the page cache; a memcpy into a registered arena). Behind a
24-byte header and a 64-byte key (88 bytes), the copy's destination sat 24 bytes off
the source's alignment: on an AMD EPYC VM a 64 KiB page then took ~24 us longer to
write to tmpfs than behind a 64-, 96- or 128-byte header (~3 us), and the file store
ran at 0.83 of a plain writer of the raw page; padded, at 1.02-1.03
(``benchmarks/bench_storage.py``; docs/storage.md). So the payload starts a multiple
of :data:`ALIGN` bytes into the record; the padding costs at most 63 bytes a page.
Records of versions 1 and 2 are still read.

:func:`decode` returns the payload only when all of it agrees with the key asked
for; a truncated, corrupt, foreign or mis-keyed record (or one whose padding is not
zero) reads as missing (``None``), never as a page.
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
    "ALIGN",
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
VERSION = 3
#: A version 3 record's payload starts at a multiple of this many bytes (a cache line).
ALIGN = 64
#: The fixed part of a version 3 and version 2 header (before the key).
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
    """The checksum (versions 2 and 3) of ``payload`` (XXH3-64), read in place (no copy)."""
    return xxh3_64_intdigest(payload)


def _aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def header_size(key: str) -> int:
    """Bytes before the payload in a record of ``key`` written now (version 3: a
    multiple of :data:`ALIGN`); older records' headers are never longer."""
    return _aligned(HEADER.size + len(key.encode()))


def encode_header(key: str, page: bytes | memoryview) -> bytes:
    """The header of the record of ``page`` under ``key`` (write it, then the page):
    ``header_size(key)`` bytes, the key padded with zero bytes."""
    k = key.encode()
    if len(k) > 0xFFFF:
        raise ValueError(f"page key is {len(k)} bytes; at most 65535 allowed")
    view = memoryview(page)
    head = HEADER.pack(MAGIC, VERSION, len(k), view.nbytes, xxh3_64_intdigest(view)) + k
    return head + bytes(_aligned(len(head)) - len(head))


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
    fixed = HEADER if version in (2, 3) else HEADER_V1 if version == 1 else None
    if fixed is None:
        return None
    end = fixed.size + len(k)  # where the key ends
    off = _aligned(end) if version == 3 else end  # where the payload starts
    if len(head) < off:
        return None
    _, _, klen, plen, crc = fixed.unpack_from(head)
    if klen != len(k) or bytes(head[fixed.size : end]) != k or total != off + plen:
        return None
    if off > end and any(head[end:off]):  # version 3's padding is zero bytes
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


def encode_v2(key: str, page: bytes) -> bytes:
    """A whole version 2 record (the payload right after the key, no padding), as
    kvoffload wrote it before version 3: for tests."""
    k = key.encode()
    return HEADER.pack(MAGIC, 2, len(k), len(page), xxh3_64_intdigest(page)) + k + page


def encode_v1(key: str, page: bytes) -> bytes:
    """A whole version 1 record (CRC-32), as kvoffload 0.1 wrote it: for tests."""
    k = key.encode()
    return HEADER_V1.pack(MAGIC, 1, len(k), len(page), zlib.crc32(page)) + k + page
