"""Page keys of vLLM requests: kvoffload's chain, stable across processes and machines.

vLLM's own block hashes cannot name a page in a store that outlives the process:
they chain from ``NONE_HASH``, which is random per process unless
``PYTHONHASHSEED`` is set. The connector keys pages with kvoffload's chain instead
(:mod:`kvoffload.keys`: the chain ``lookup()`` and ``fetch()`` use, SGLang HiCache's),
seeded with what vLLM's own prefix keys depend on besides the tokens:

- the connector's ``namespace`` (a model, a tenant): another namespace's pages are
  invisible (FAILURES F22);
- the request's LoRA adapter (``lora_request.lora_name``);
- the request's ``cache_salt``.

Without a LoRA adapter the seed is ``namespace_seed(extra_key=namespace,
cache_salt=cache_salt)``, so a kvoffload manager with ``OffloadConfig(namespace=...)``
finds what the connector stored (and the reverse); with one, the extra key also names
the adapter (``["vllm-lora", namespace, lora_name]`` as JSON, which no plain namespace
string equals by accident).

Refused (:func:`refusal`): multimodal requests (their KV depends on the images as
well as the placeholder token ids; vLLM's keys include the mm hashes, kvoffload's
chain does not) and requests given as embeddings (no token ids to key). A refused
request is neither stored nor loaded: it is computed as without the connector.

Nothing here imports vLLM: the functions read the request's attributes by name.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvoffload.keys import chain_keys, namespace_seed

__all__ = ["lora_name", "page_keys", "refusal", "request_seed", "seed"]


def lora_name(request: Any) -> str | None:
    """The name of the request's LoRA adapter (``request.lora_request.lora_name``), or
    ``None`` without one."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    name = getattr(lora, "lora_name", None)
    return str(name) if name is not None else str(getattr(lora, "lora_int_id", lora))


def seed(namespace: str | None, lora: str | None = None, cache_salt: str | None = None) -> str | None:
    """The chain seed of a request in ``namespace`` with LoRA adapter ``lora`` and
    ``cache_salt`` (see the module doc); ``None`` when all three are ``None``."""
    extra = namespace if lora is None else json.dumps(["vllm-lora", namespace, lora])
    return namespace_seed(extra_key=extra, cache_salt=cache_salt)


def request_seed(namespace: str | None, request: Any) -> str | None:
    """:func:`seed` of a vLLM ``Request`` (its ``lora_request`` and ``cache_salt``)."""
    return seed(namespace, lora_name(request), getattr(request, "cache_salt", None))


def refusal(request: Any) -> str | None:
    """Why the connector neither stores nor loads ``request``, or ``None`` when it may:
    multimodal inputs (``mm_features``) or embeddings without token ids."""
    if getattr(request, "mm_features", None):
        return "multimodal request: kvoffload's keys do not cover its images (it is computed as usual)"
    if getattr(request, "prompt_embeds", None) is not None:
        return "request given as embeddings: no token ids to key its pages"
    return None


def page_keys(chain_seed: str | None, tokens: Sequence[int], page_size: int, n_pages: int) -> list[str]:
    """Keys of the first ``n_pages`` whole pages of ``tokens`` (each covering its whole
    prefix), chained from ``chain_seed``: what the core computes at submit time."""
    return chain_keys(chain_seed, list(tokens[: n_pages * page_size]), page_size)
