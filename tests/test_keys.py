"""Page keys and namespace seeds are SGLang's, byte for byte (SGLang 0.5.23 reference
values), wide token ids included; every bad token raises InvalidTokens, in the key
functions as in the managers."""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import kvoffload as kvo
from kvoffload.keys import TOKEN_TYPECODE, WIDE_TYPECODE, validate_tokens
from kvoffload.testing import SimBackend

# --- reference values --------------------------------------------------------------------

SGLANG_SEEDS = [
    (None, None, None),
    ("lora-x", "salt-1", "e61665025bc31936ef0878573fdfe12f29802ba4b71ce7194f2a039be28c16f4"),
    ("lora-x", None, "da1b83db28cc6bd5f69b1217d748c26776c076d8ecd88f582ea3125379f6e49b"),
    (None, "salt-1", "c1d0107dc7ce488c66270bff3bd297e7dd97235fcc7216221f83ecf8259f3f3d"),
]


@pytest.mark.parametrize(("extra_key", "cache_salt", "expected"), SGLANG_SEEDS)
def test_namespace_seed_equals_sglang_storage_namespace_seed(
    extra_key: str | None, cache_salt: str | None, expected: str | None
) -> None:
    """kvo.namespace_seed gives SGLang 0.5.23's storage_namespace_seed values."""
    assert kvo.namespace_seed(extra_key, cache_salt) == expected
    assert kvo.namespace_seed(extra_key=extra_key, cache_salt=cache_salt) == expected


def test_namespace_seeds_tell_absent_empty_and_split_parts_apart() -> None:
    """Absent, empty, and the same bytes split differently are all different seeds."""
    seeds = [
        kvo.namespace_seed("", None),
        kvo.namespace_seed(None, ""),
        kvo.namespace_seed("", ""),
        kvo.namespace_seed("ab", "c"),
        kvo.namespace_seed("a", "bc"),
        kvo.namespace_seed("abc", None),
    ]
    assert None not in seeds and len(set(seeds)) == len(seeds)


@pytest.mark.parametrize("bad", [b"lora", 3, ("a",)])
def test_a_namespace_part_that_is_not_a_str_is_a_config_error(bad: Any) -> None:
    with pytest.raises(kvo.ConfigError, match="extra_key must be a str or None"):
        kvo.namespace_seed(bad)
    with pytest.raises(kvo.ConfigError, match="cache_salt must be a str or None"):
        kvo.namespace_seed("x", bad)


def test_a_wide_token_page_equals_sglang() -> None:
    """The single-token page [2**32] with no prior: SGLang 0.5.23's value."""
    expected = "51e2a39324194d5161469fa264a9384235bfab266722e69a80a15cd932185a33"
    assert kvo.page_key(None, [4294967296]) == expected
    assert kvo.chain_keys(None, [4294967296], 1) == [expected]


def reference(seed: str | None, tokens: Sequence[int], page_size: int) -> list[str]:
    """The SGLang chain written out with hashlib and struct only: a page is uint32 LE,
    or 0xFF then uint64 LE when any of its ids is >= 2**32."""
    keys: list[str] = []
    prior = bytes.fromhex(seed) if seed else b""
    for off in range(0, len(tokens), page_size):
        page = tokens[off : off + page_size]
        if max(page) >= 2**32:
            data = b"\xff" + struct.pack(f"<{len(page)}Q", *page)
        else:
            data = struct.pack(f"<{len(page)}I", *page)
        prior = hashlib.sha256(prior + data).digest()
        keys.append(prior.hex())
    return keys


MIXED = [1, 2, 3, 4, 5, 2**32, 7, 8, 9, 10, 11, 12, 2**63 - 1, 0, 2**40, 3]


def test_chain_keys_hash_each_page_in_its_own_form() -> None:
    """A chain over narrow and wide pages: each page narrow unless it holds a wide id;
    seeded or not."""
    seed = kvo.namespace_seed("lora-x")
    for s in (None, seed):
        assert kvo.chain_keys(s, MIXED, 4) == reference(s, MIXED, 4)
        keys = kvo.chain_keys(s, MIXED, 4)
        assert kvo.page_key(keys[1], MIXED[8:12]) == keys[2]  # a narrow page after a wide one


BAD = [
    pytest.param([0, 1, 2, -1], id="negative"),
    pytest.param([0, 1, 2, 2**63], id="2**63"),
    pytest.param([0, 1, 2, 2**64], id="2**64"),
    pytest.param([0, 1, 2, True], id="bool"),
    pytest.param([0, 1, 2, 3.0], id="float"),
    pytest.param([0, 1, 2, "3"], id="str-element"),
    pytest.param([0, 1, 2, None], id="None-element"),
    pytest.param({0, 1, 2, 3}, id="set"),
    pytest.param({0: 1, 2: 3, 4: 5, 6: 7}, id="dict"),
    pytest.param("abcd", id="str"),
    pytest.param(b"abcd", id="bytes"),
    pytest.param(torch.tensor([0.0, 1.0, 2.0, 3.0]), id="float-tensor"),
    pytest.param(torch.tensor([True, False, True, False]), id="bool-tensor"),
    pytest.param(np.array([0.5, 1.0, 2.0, 3.0]), id="float-ndarray"),
    pytest.param(np.array([True, False, True, False]), id="bool-ndarray"),
    pytest.param(array("d", [0, 1, 2, 3]), id="float-array"),
    pytest.param([0, 1, 2, torch.tensor(True)], id="bool-tensor-element"),
    pytest.param([0, 1, 2, np.bool_(True)], id="numpy-bool-element"),
    pytest.param(7, id="int"),
    pytest.param(None, id="None"),
]


@pytest.mark.parametrize("bad", BAD)
def test_key_functions_raise_invalid_tokens(bad: Any) -> None:
    """page_key and chain_keys refuse every bad token with InvalidTokens (never
    struct.error or a raw TypeError)."""
    with pytest.raises(kvo.InvalidTokens):
        kvo.chain_keys(None, bad, 4)
    with pytest.raises(kvo.InvalidTokens):
        kvo.page_key(None, bad)


def test_a_bool_anywhere_in_a_long_sequence_is_found() -> None:
    """Long sequences are checked where an id is 0 or 1: a bool there is still named."""
    tokens: list[Any] = list(range(2, 5000))
    for i, b in ((0, True), (2500, False), (4997, True)):
        bad = [*tokens[:i], b, *tokens[i:]]
        with pytest.raises(kvo.InvalidTokens, match=rf"tokens\[{i}\] = {b} is a bool"):
            validate_tokens(bad)
    assert validate_tokens([*tokens, 0, 1]).tolist() == [*tokens, 0, 1]  # ints 0 and 1 are fine


def test_validate_tokens_is_narrow_unless_an_id_is_wide() -> None:
    """uint32 while every id fits, uint64 once one does not; every container kind."""
    assert validate_tokens([1, 2]).typecode == TOKEN_TYPECODE
    assert validate_tokens(np.arange(4, dtype=np.int64)).typecode == TOKEN_TYPECODE
    assert validate_tokens(torch.arange(4)).typecode == TOKEN_TYPECODE
    assert validate_tokens(range(4)).typecode == TOKEN_TYPECODE
    assert validate_tokens(iter([1, 2])).tolist() == [1, 2]
    wide = validate_tokens([1, 2**32])
    assert wide.typecode == WIDE_TYPECODE and wide.tolist() == [1, 2**32]
    assert validate_tokens(torch.tensor([2**40, 5])).tolist() == [2**40, 5]
    assert validate_tokens(np.array([2**63 - 1], dtype=np.uint64)).tolist() == [2**63 - 1]


def test_chain_keys_refuse_a_bad_page_size_or_prior() -> None:
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        kvo.chain_keys(None, [1, 2], 0)
    with pytest.raises(ValueError, match="not a whole number"):
        kvo.chain_keys(None, [1, 2, 3], 2)
    with pytest.raises(kvo.ConfigError, match="prev_key must be a hex str"):
        kvo.chain_keys("zz", [1, 2], 2)


# --- through the managers -----------------------------------------------------------------

CONFIG = kvo.OffloadConfig(page_size=4, stride=8, device_pages=32, host_pages=32, offload_prompt=True)
PROMPT = [10, 11, 12, 2**32 + 5, 14, 15, 16, 17]
DECODE = [18, 2**50, 20, 21, 22, 23, 24, 25]


@pytest.mark.asyncio
async def test_wide_ids_get_sglang_keys_through_the_asyncio_manager() -> None:
    """A request with ids >= 2**32 in its prompt and its decode steps (one token a
    step: the quick path) is keyed as SGLang keys it; lookup and fetch find it."""
    backend = SimBackend()
    async with kvo.OffloadManager(CONFIG, backend=backend, storage="memory") as mgr:
        lc = mgr.admit("r", PROMPT)
        for tok in DECODE:
            lc.extend([tok])
        lc.finish()
        keys = [k for t in backend.pending for k in t.keys]
        assert keys == reference(None, PROMPT + DECODE, 4)
        backend.complete_all()
        await mgr.wait_drained()
        assert await mgr.lookup(PROMPT + DECODE) == 16
        assert len(await mgr.fetch(PROMPT + DECODE, 16)) == 4


def test_wide_ids_get_sglang_keys_through_the_sync_manager_seeded() -> None:
    """The same on the sync driver, seeded by a namespace; the default-prompt path
    (prompt taken as stored) seeds the chain with the wide prompt's keys."""
    seed = kvo.namespace_seed("lora-x")
    config = kvo.OffloadConfig(page_size=4, stride=8, device_pages=32, host_pages=32, namespace="lora-x")
    backend = SimBackend()
    with kvo.SyncOffloadManager(config, backend=backend) as mgr:
        lc = mgr.admit("r", PROMPT)
        assert lc.chain_key == reference(seed, PROMPT, 4)[-1]
        lc.extend(DECODE[:3])
        lc.extend(np.array(DECODE[3:]))  # the full path
        (t,) = backend.pending
        assert t.keys == reference(seed, PROMPT + DECODE, 4)[2:]
        backend.complete_all()
        mgr.quiesce(timeout=10)
        lc.finish()
        mgr.poll()
        assert lc.released


@pytest.mark.asyncio
async def test_a_bad_id_after_a_wide_one_is_refused_on_the_quick_path_too() -> None:
    """Once a wide id made a lifecycle's tail uint64, a one-token step of an id >= 2**63
    or a bool is still refused, with nothing changed."""
    backend = SimBackend()
    config = kvo.OffloadConfig(page_size=4, stride=64, device_pages=32, host_pages=32)
    async with kvo.OffloadManager(config, backend=backend) as mgr:
        lc = mgr.admit("r", [1, 2, 3, 4, 5])
        lc.extend([2**40])
        for bad in ([2**63], [True], [2**64 - 1], [-1]):
            with pytest.raises(kvo.InvalidTokens):
                lc.extend(bad)
            assert lc.committed == 6
            mgr.check_invariants()
        narrow = mgr.admit("n", [1, 2, 3, 4, 5])
        for bad in ([True], [False], [2**64]):
            with pytest.raises(kvo.InvalidTokens):
                narrow.extend(bad)
            assert narrow.committed == 5
        narrow.extend([1])  # the id 1 equals True: it takes the full path, and is fine
        narrow.extend([0])
        assert narrow.committed == 7
        mgr.check_invariants()
        lc.abort()
        narrow.abort()
