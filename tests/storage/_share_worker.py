"""Worker process for test_sharing (Redis) and test_mooncake_faults (a Mooncake master;
KVOFFLOAD_REQUIRE_MOONCAKE is that test's guard): offload one request, print what it stored.

Usage: python _share_worker.py REDIS_URL|MOONCAKE_URL PREFIX. Prints one JSON line:
{"tokens": [...], "pages": [hex of each page's bytes], "stored": n}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _storage_helpers import device_bytes, fill_device

import kvoffload as kvo
from kvoffload.storage.redis import RedisStorage
from kvoffload.testing import SimBackend

CONFIG = kvo.OffloadConfig(page_size=4, stride=8, device_pages=32, host_pages=32, offload_prompt=True)
TOKENS = list(range(500, 522))


async def main(url: str, prefix: str) -> None:
    backend = SimBackend()
    if url.startswith("mooncake://"):
        from _storage_helpers import mooncake_store

        storage = mooncake_store(url, prefix=prefix)  # lends no memory: the pages outlive this process
    else:
        storage = RedisStorage(url, prefix=prefix)
    async with kvo.OffloadManager(CONFIG, backend=backend, storage=storage) as mgr:
        lc = mgr.admit("worker-a", TOKENS[:8])
        lc.extend(TOKENS[8:])
        lc.finish()
        fill_device(mgr, lc, seed=os.getpid())
        pages = device_bytes(mgr, lc.device_pages[: len(TOKENS) // 4])
        backend.complete_all()
        await lc.wait_released()
        await mgr.settle()
        stored = mgr.statistics().pages_stored
    print(json.dumps({"tokens": TOKENS, "pages": [p.hex() for p in pages], "stored": stored}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
