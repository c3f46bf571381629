"""kvoffload's KV events as vLLM's: what the connector's ``take_events()`` returns.

The scheduler side's core announces a page stored when every worker's store confirmed
it (``write_done``) and removed when a load found it gone (``load_read``; see
:mod:`kvoffload.core.kv_events`), keyed by kvoffload's chain. vLLM's publisher and the
routers that read it (Dynamo's) know a block by vLLM's own block hash, so
:func:`vllm_events` translates each event to vLLM's
``vllm.distributed.kv_events.BlockStored`` / ``BlockRemoved`` with the request's vLLM
block hashes at the same block positions (``Request.block_hashes``, the hashes vLLM's
own GPU events carry, converted as vLLM converts them for events:
``maybe_convert_block_hash``), its tokens, vLLM's block size, its LoRA adapter, and
``medium="STORAGE"`` (vLLM's ``MEDIUM_STORAGE``: the store behind kvoffload's host
staging pool; ``group_idx=0``: the connector supports one KV cache group). A router
then sees a block vLLM's GPU cache evicted as still held by the store tier.

Where the request comes from: a stored event carries the lifecycle's tag, which the
planner sets to the vLLM ``Request`` (so the event outlives ``request_finished``); a
removed one is a load's, found by its request id among the live requests (a request
aborted before its load's read returned is not announced: its hashes are gone with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

from kvoffload.core import kv_events as kvo_events

__all__ = ["vllm_events"]


def _hashes(request: Any, hash_block_size: int, block_size: int) -> Any:
    raw = getattr(request, "block_hashes", None)
    if raw is None:
        return None
    return resolve_block_hashes(raw, hash_block_size, block_size)


def _lora(request: Any) -> tuple[int | None, str | None]:
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None, None
    return getattr(lora, "adapter_id", None), getattr(lora, "name", None)


def vllm_events(
    events: Iterable[kvo_events.BlockStored | kvo_events.BlockRemoved],
    *,
    block_size: int,
    hash_block_size: int | None = None,
    request_of: Callable[[str], Any] = lambda rid: None,
) -> list[KVCacheEvent]:
    """vLLM's events for kvoffload's ``events``, in order (see the module doc). A stored
    event's request is its ``tag``; a removed one's is ``request_of(rid)``. An event whose
    vLLM hashes cannot be found (no request, or fewer hashes than pages) is left out:
    announcing a block under a hash vLLM never gave it would mislead a router."""
    hbs = block_size if hash_block_size is None else hash_block_size
    out: list[KVCacheEvent] = []
    for e in events:
        if isinstance(e, kvo_events.BlockStored):
            hashes = _hashes(e.tag, hbs, block_size)
            p0, n = e.first_token // block_size, len(e.block_hashes)
            if hashes is None or len(hashes) < p0 + n:
                continue
            lora_id, lora_name = _lora(e.tag)
            out.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(hashes[p]) for p in range(p0, p0 + n)],
                    parent_block_hash=maybe_convert_block_hash(hashes[p0 - 1]) if p0 > 0 else None,
                    token_ids=list(e.token_ids),
                    block_size=block_size,
                    lora_id=lora_id,
                    medium=MEDIUM_STORAGE,
                    lora_name=lora_name,
                    group_idx=0,
                )
            )
        else:
            hashes = _hashes(request_of(e.rid), hbs, block_size)
            if hashes is None or len(hashes) <= e.page:
                continue
            out.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(hashes[e.page])],
                    medium=MEDIUM_STORAGE,
                    group_idx=0,
                )
            )
    return out
