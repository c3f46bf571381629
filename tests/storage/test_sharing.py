"""Sharing across workers: what one process's manager stored in Redis, another
process's manager finds and fetches, byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvoffload as kvo
from kvoffload.storage.redis import RedisStorage
from kvoffload.testing import SimBackend, manager_in_task

WORKER = Path(__file__).with_name("_share_worker.py")


@pytest.mark.asyncio
async def test_a_second_worker_process_finds_and_fetches_what_the_first_stored(clean_redis: str) -> None:
    """Worker A (a child process) offloads a request to Redis and exits; worker B (this
    process, its own manager) looks the token sequence up and fetches the same bytes."""
    prefix = "kvo-share:"
    out = subprocess.run(
        [sys.executable, str(WORKER), clean_redis, prefix], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    a = json.loads(out.stdout.strip().splitlines()[-1])
    tokens: list[int] = a["tokens"]
    pages = [bytes.fromhex(h) for h in a["pages"]]
    assert a["stored"] == len(pages) == 5

    config = kvo.OffloadConfig(page_size=4, stride=8, device_pages=32, host_pages=32, offload_prompt=True)
    store = RedisStorage(clean_redis, prefix=prefix)
    async with manager_in_task(config, backend=SimBackend(), storage=store) as b:
        assert await b.lookup(tokens) == 20
        assert await b.lookup([*tokens[:12], 0, 0, 0, 0]) == 12
        assert await b.fetch(tokens, 20) == pages
    other = RedisStorage(clean_redis, prefix="another-prefix:")
    try:
        assert await other.exists_prefix(kvo.chain_keys(None, tokens[:20], 4)) == 0
    finally:
        await other.aclose()
