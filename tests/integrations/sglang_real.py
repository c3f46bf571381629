"""SGLang 0.5.23's REAL objects on the CPU, built and driven the way SGLang's decode
scheduler builds and drives them: the harness of the real-class tests.

Every object here is SGLang's own class from the installed wheel
(``.venv-sglang/lib/python3.11/site-packages/sglang/``); every helper does what the
SGLang function named in its comment does to a request, calling SGLang's own functions
where they run on a CPU (``match_kv_cache``, ``alloc_for_decode_prealloc``,
``release_req``, ``restore_kv_cache``). Nothing is faked.

Use (in a test module, before anything imports sglang)::

    import sglang_cpu

    sglang_cpu.require()        # skip (or fail under KVOFFLOAD_REQUIRE_SGLANG=1) without sglang
    import sglang_real as sr

    with sr.engine(page_size=4, kv="mha", tree="unified", decode_radix=False) as eng:
        mgr = eng.manager(storage=..., backend=...)   # kvoffload's drop-in, SGLang's objects
        req = eng.new_req("a", list(range(10)), max_new_tokens=8)
        eng.admit(req)                                # prefilled: row, slots, KV, first token
        while not req.finished():
            eng.step(mgr, [req])                      # one decode-scheduler iteration
        ...
        assert eng.free_count() == eng.capacity       # nothing leaked
        eng.check_free_list()                         # nothing freed twice

The API (all of it):

- :func:`server_args` - a decode-side ``ServerArgs`` (``model_path="dummy"``, CPU,
  KV offload on); keyword overrides are ``ServerArgs`` fields.
- :func:`published` - context manager: publishes ``server_args`` as SGLang's scheduler
  process does (``runtime_context.publish(role="scheduler")``) and restores the
  previous process context on exit (SGLang's ``snapshot_context`` /
  ``restore_context``): no global state is left behind between tests.
- :func:`debug_memory_pool` - context manager: ``SGLANG_DEBUG_MEMORY_POOL=1`` (restored
  on exit); the paged allocator then asserts on every free that no page is on its free
  list twice.
- :func:`engine` - context manager yielding an :class:`Engine`: both of the above, then
  SGLang's ``ReqToTokenPool``, ``MHATokenToKVPool`` / ``MLATokenToKVPool`` on
  ``device="cpu"``, ``PagedTokenToKVPoolAllocator`` (``page_size > 1``) or
  ``TokenToKVPoolAllocator`` (``page_size == 1``), and ``UnifiedRadixCache`` or
  ``RadixCache`` through ``CacheInitParams`` (disabled unless ``decode_radix``, as
  SGLang's decode scheduler builds it without ``--disaggregation-decode-enable-radix-cache``).
- :class:`Engine` methods: ``new_req``, ``admit`` (SGLang's decode pre-allocation and
  transfer commit, with a prefix matched from the tree and ``req.lock`` taken when the
  decode radix cache is on), ``decode_step`` (SGLang's ``alloc_for_decode`` + the
  forward's KV write + the sampled token; ``stop=True``: a stop token, the request
  finishes early), ``step`` (one scheduler iteration with the
  offload manager's calls in SGLang's order), ``retract`` (``release_req``), ``resume``
  (decode pre-allocation + ``restore_kv_cache`` / ``Req.load_kv_cache``),
  ``seed_tree`` / ``evict`` (the radix tree's own pages), ``manager`` (kvoffload's
  drop-in built from these objects), ``free_slots`` / ``free_count`` /
  ``check_free_list`` (the allocator's free list: leaks and double frees),
  ``tree_slots`` (slots the tree holds), ``write_kv`` / ``kv_bytes`` /
  ``expected_kv_bytes`` (known KV bytes in the pool), ``tokens`` / ``row_slots`` (a
  request's tokens with KV written, the slots its row names).
- :func:`kv_value` - the KV the harness's "forward" writes for one token.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import sglang_cpu

sglang_cpu.install()  # torchvision stubbed before the first ``import sglang``

import torch  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN, Req, release_req  # noqa: E402
from sglang.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import match_kv_cache, restore_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

__all__ = [
    "Engine",
    "Req",
    "ServerArgs",
    "debug_memory_pool",
    "engine",
    "kv_value",
    "published",
    "server_args",
]

#: The pools' shapes (small: the tests read every byte).
HEADS, HEAD_DIM, KV_LORA_RANK, ROPE_DIM = 2, 4, 8, 4
#: The retraction backup SGLang picks on a decode server with KV offload on
#: (``kv_cache_builder.resolve_decode_retraction_backup``: offload owns the host pool,
#: so ``cpu_tensor``); the harness publishes it, as SGLang's model runner does.
RETRACTION_BACKUP = "cpu_tensor"


# --- the process-wide config ---------------------------------------------------------------


def server_args(**overrides: Any) -> ServerArgs:
    """A decode-side ``ServerArgs`` as ``--disaggregation-mode decode
    --disaggregation-decode-enable-offload-kvcache`` on a CPU, for a dummy model (no
    weights are read). ``overrides`` are ``ServerArgs`` fields (``page_size``,
    ``hicache_storage_backend``, ``hicache_ratio``, ...)."""
    fields: dict[str, Any] = {
        "model_path": "dummy",
        "device": "cpu",
        "page_size": 4,
        "disaggregation_mode": "decode",
        "disaggregation_decode_enable_offload_kvcache": True,
    }
    fields.update(overrides)
    return ServerArgs(**fields)


@contextlib.contextmanager
def published(args: ServerArgs) -> Iterator[ServerArgs]:
    """Publish ``args`` as SGLang's scheduler process does, for the ``with`` body.

    ``run_scheduler_process`` (sglang/srt/managers/scheduler.py) calls
    ``runtime_context.publish(server_args, role="scheduler", ranks=...)`` before it
    builds anything; SGLang's classes then read the published bags (``get_schedule()``,
    ``get_memory()``, ``get_disagg()``, ``get_serving()``, ``get_spec()``). The decode
    model runner then resolves the retraction backup and the host ratio into the bags
    (``kv_cache_builder.resolve_decode_retraction_backup``, through
    ``get_context().override``): done here the same way, for the fields it would set.
    On exit the process context is put back as it was (``snapshot_context`` /
    ``restore_context``, SGLang's own pair for a failed launch)."""
    state = runtime_context.snapshot_context()
    try:
        runtime_context.publish(args, role="scheduler")
        fields: dict[str, Any] = {}
        if runtime_context.get_disagg().disaggregation_decode_retraction_backup is None:
            fields["disaggregation_decode_retraction_backup"] = RETRACTION_BACKUP
        if runtime_context.get_memory().hicache_ratio is None:
            fields["hicache_ratio"] = 2.0  # kv_cache_builder: the standard HiCache default
        runtime_context.get_context().override("kv_cache_builder.decode_retraction", **fields)
        yield args
    finally:
        runtime_context.restore_context(state)


@contextlib.contextmanager
def debug_memory_pool(on: bool = True) -> Iterator[None]:
    """``SGLANG_DEBUG_MEMORY_POOL`` for the ``with`` body (restored on exit).

    ``PagedTokenToKVPoolAllocator.__init__`` reads it once (``get_bool_env_var``,
    allocator/paged.py) and then asserts after every free that no page is on the free
    list twice; ``memory_pool.py`` reads it through ``envs.SGLANG_DEBUG_MEMORY_POOL``.
    Build the allocator inside the ``with``."""
    old = os.environ.get("SGLANG_DEBUG_MEMORY_POOL")
    os.environ["SGLANG_DEBUG_MEMORY_POOL"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SGLANG_DEBUG_MEMORY_POOL", None)
        else:
            os.environ["SGLANG_DEBUG_MEMORY_POOL"] = old


# --- known KV ----------------------------------------------------------------------------


def kv_value(pos: int, token: int, layer: int, which: int, width: int, shard: int = 0) -> torch.Tensor:
    """The KV the harness's forward pass writes for one token: a function of its
    position, token id, layer, ``which`` buffer (0: K or MLA's latent, 1: V) and the TP
    ``shard`` (each rank holds other heads), ``width`` values, exact in float16
    (multiples of 1/32 below 64 + 8/32)."""
    base = float((pos * 37 + token * 11 + layer * 5 + which * 3 + shard * 13) % 256) / 4.0
    return (torch.arange(width, dtype=torch.float32) % 8) / 32.0 + base


def page_keys(
    tokens: Sequence[int], page_size: int, *, extra_key: str | None = None, cache_salt: str | None = None
) -> list[str]:
    """SGLang's storage key of every whole page of ``tokens``, computed by SGLang's own
    code as its decode offload manager does (``_compute_prefix_hash``): the chain starts
    at ``storage_namespace_seed(extra_key, cache_salt)``, each page's key is
    ``get_hash_str(page_tokens, prior_key)``."""
    keys: list[str] = []
    last = storage_namespace_seed(extra_key, cache_salt)
    for p in range(len(tokens) // page_size):
        last = get_hash_str(list(tokens[p * page_size : (p + 1) * page_size]), last)
        keys.append(last)
    return keys


# --- the engine ------------------------------------------------------------------------------


class Engine:
    """SGLang's decode-side memory objects (real) and the scheduler's work on a Req.

    Attributes: ``server_args``, ``page_size``, ``req_to_token_pool``, ``kv_pool``,
    ``allocator`` (``token_to_kv_pool_allocator``), ``tree_cache``, ``decode_radix``
    (the decode radix cache is on), ``capacity`` (slots the allocator hands out),
    ``shard`` (this TP rank's heads: its KV bytes differ per rank; 0 by default).
    """

    def __init__(
        self,
        args: ServerArgs,
        *,
        kv: str,
        tree: str,
        decode_radix: bool,
        slots: int,
        rows: int,
        max_context: int,
        layers: int,
        dtype: torch.dtype,
    ) -> None:
        ps = int(args.page_size or 1)
        self.server_args = args
        self.page_size = ps
        self.decode_radix = decode_radix
        self.shard = 0
        self._tokens = itertools.count(1000)  # what the "model" samples
        # ModelRunner builds these (model_executor/pool_configurator + kv_cache_builder).
        self.req_to_token_pool = ReqToTokenPool(
            size=rows, max_context_len=max_context, device="cpu", enable_memory_saver=False
        )
        if kv == "mha":
            self.kv_pool: Any = MHATokenToKVPool(
                size=slots,
                page_size=ps,
                dtype=dtype,
                head_num=HEADS,
                head_dim=HEAD_DIM,
                layer_num=layers,
                device="cpu",
                enable_memory_saver=False,
            )
        elif kv == "mla":
            self.kv_pool = MLATokenToKVPool(
                size=slots,
                page_size=ps,
                dtype=dtype,
                kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=ROPE_DIM,
                layer_num=layers,
                device="cpu",
                enable_memory_saver=False,
            )
        else:
            raise ValueError(f"kv={kv!r}: 'mha' or 'mla'")
        self.kv_kind = kv
        if ps == 1:
            self.allocator: Any = TokenToKVPoolAllocator(
                size=slots, dtype=dtype, device="cpu", kvcache=self.kv_pool, need_sort=False
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                size=slots, page_size=ps, dtype=dtype, device="cpu", kvcache=self.kv_pool, need_sort=False
            )
        self.capacity = int(self.allocator.available_size())
        # The scheduler's tree cache (mem_cache/registry.py): a UnifiedRadixCache with the
        # FULL component, disabled when the decode radix cache is off.
        params = CacheInitParams(
            disable=not decode_radix,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=ps,
        )
        if tree == "unified":
            params.tree_components = (ComponentType.FULL,)
            self.tree_cache: Any = UnifiedRadixCache(params)
        elif tree == "radix":
            self.tree_cache = RadixCache(params)
        else:
            raise ValueError(f"tree={tree!r}: 'unified' or 'radix'")

    # --- requests ------------------------------------------------------------------------------

    def new_req(
        self,
        rid: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> Req:
        """SGLang's ``Req`` as the scheduler makes it (``handle_generate_request``): the
        prompt as ``array("q")``, ``SamplingParams(max_new_tokens=...)`` normalized as
        the tokenizer manager does (``normalize(tokenizer)``; no tokenizer here: no stop
        strings)."""
        params = SamplingParams(max_new_tokens=max_new_tokens)
        params.normalize(None)
        return Req(
            rid,
            "",
            array("q", prompt),
            params,
            extra_key=extra_key,
            cache_salt=cache_salt,
        )

    def tokens(self, req: Req) -> list[int]:
        """The tokens whose KV the engine has written (the last output's is not yet)."""
        return [*req.origin_input_ids, *req.output_ids[:-1]] if req.output_ids else list(req.origin_input_ids)

    def admit(self, req: Req, first_token: int | None = None) -> int:
        """A prefilled request enters the decode batch, as SGLang's decode side does it
        (disaggregation/decode.py ``DecodePreallocQueue.pop_preallocated`` ->
        ``_match_prefix_and_lock`` / ``_pre_alloc`` -> ``alloc_for_decode_prealloc``,
        then ``DecodeTransferQueue._commit_transfer_to_req``):

        - with the decode radix cache on: ``match_kv_cache`` against the prompt and
          ``req.lock = tree_cache.lock(last_device_node)``; the matched slots
          (``tree_cache.prefix_device_indices(req)``) head the row and
          ``req.kv.cache_protected_len`` is the matched length (the tree's pages);
        - a row (``req_to_token_pool.alloc([req])``), ``kv_committed_len`` = the fill
          length (the prompt, or prompt + outputs but the last after a retraction),
          the slots past the prefix from the allocator (evicting the tree first when
          short, as ``_pre_alloc`` does), written into the row;
        - the prefill's KV transfer: the KV of every position past the prefix written;
        - the first output token (the prefill's sample) appended, unless it has outputs.

        Returns the matched prefix length."""
        prefix_indices = None
        prefix_len = 0
        if self.decode_radix and not req.output_ids:
            # decode.py _match_prefix_and_lock
            result = match_kv_cache(req, self.tree_cache, req.origin_input_ids)
            req.lock = self.tree_cache.lock(result.last_device_node)
            # decode_hicache_mixin.py _build_decode_prefix_match
            prefix_indices = self.tree_cache.prefix_device_indices(req)
            prefix_len = len(prefix_indices)
            if prefix_len == 0:
                prefix_indices = None
        self._pre_alloc(req, prefix_indices, prefix_len)
        # pop_preallocated: decode_req.req.kv.cache_protected_len = total_prefix_len
        req.kv.cache_protected_len = prefix_len
        # The prefill's KV (or the recomputed KV, on resume) for what is past the prefix.
        self.write_kv(req, prefix_len, req.kv.kv_committed_len)
        if not req.output_ids:  # _commit_transfer_to_req: the prefill's first token
            req.output_ids.append(next(self._tokens) if first_token is None else first_token)
        return prefix_len

    def _pre_alloc(self, req: Req, prefix_indices: Any, prefix_len: int) -> None:
        """decode.py ``DecodePreallocQueue._pre_alloc`` (no SWA, no HiSparse, no
        L2/L3 prefix: ``total_prefix_len == prefix_len``)."""
        rows = self.req_to_token_pool.alloc([req])
        assert rows is not None, "req_to_token_pool is full"
        # _pre_alloc_fill_len: the prompt (+ outputs but the last, after a retraction)
        fill_len = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
        req.kv.kv_committed_len = fill_len
        if prefix_len > 0:
            self.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, prefix_len)), prefix_indices)
        need = self._required_alloc_tokens(fill_len, prefix_len)
        if self.decode_radix and self.allocator.available_size() < need:
            self.tree_cache.evict_for_alloc(EvictParams(num_tokens=need - self.allocator.available_size()))
        kv_loc = alloc_for_decode_prealloc(
            self.allocator,
            req=req,
            fill_len=fill_len,
            delta_len=fill_len - prefix_len,
            prefix_len=prefix_len,
            total_prefix_len=prefix_len,
            prefix_indices=prefix_indices,
            uses_swa_tail=False,
            swa_tail_len=0,
            req_to_token_pool=self.req_to_token_pool,
        )
        assert kv_loc is not None, "KV cache is full"
        self.req_to_token_pool.write(
            (req.kv.req_pool_idx, slice(prefix_len, prefix_len + len(kv_loc))), kv_loc.to(torch.int32)
        )
        req.prefix_len = prefix_len
        req.extend_end = req.kv.kv_committed_len
        req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids

    def _required_alloc_tokens(self, fill_len: int, prefix_len: int) -> int:
        """decode.py ``_required_alloc_tokens``: whole new pages past the prefix."""
        ps = self.page_size
        if ps == 1:
            return fill_len - prefix_len
        return (-(-fill_len // ps) - -(-prefix_len // ps)) * ps

    def decode_step(self, req: Req, token: int | None = None, *, stop: bool = False) -> None:
        """One decode step of ``req``: SGLang's ``alloc_for_decode_default``
        (mem_cache/allocation.py: a slot for the last output token's position, written
        into the row, ``kv_allocated_len`` and ``kv_committed_len`` += 1, evicting the
        tree when short), the forward pass writing that position's KV, then the sampled
        token appended and ``req.update_finish_state()`` (batch_result_processor.py).
        ``stop``: the sampled token is a stop token (the request finishes now, before
        ``max_new_tokens``: SGLang's ``req.to_finish = FINISH_MATCHED_TOKEN(...)``)."""
        kv = req.kv
        pos = kv.kv_committed_len  # == seqlen - 1: the last output token's position
        row = kv.req_pool_idx
        assert row is not None and pos == req.seqlen - 1, (req.rid, pos, req.seqlen)
        if self.decode_radix and self.allocator.available_size() < self.page_size:
            self.tree_cache.evict_for_alloc(EvictParams(num_tokens=self.page_size))
        if self.page_size == 1:
            loc = self.allocator.alloc(1)
        else:
            last_loc = self.req_to_token_pool.req_to_token[row, pos - 1 : pos].to(torch.int64)
            seq_lens = torch.tensor([pos + 1], dtype=torch.int64)
            loc = self.allocator.alloc_decode(seq_lens, seq_lens.clone(), last_loc)
        assert loc is not None, "KV cache is full"
        self.req_to_token_pool.write((row, pos), loc.to(torch.int32))
        kv.kv_allocated_len += 1
        kv.kv_committed_len += 1
        self.write_kv(req, pos, pos + 1)
        req.output_ids.append(next(self._tokens) if token is None else token)
        if stop:
            req.to_finish = FINISH_MATCHED_TOKEN(matched=req.output_ids[-1])
        req.update_finish_state()

    def step(self, mgr: Any, reqs: Sequence[Req]) -> list[Req]:
        """One decode-scheduler iteration over the running ``reqs`` with the offload
        manager's calls in SGLang's order: ``check_offload_progress()`` (the event
        loop, decode.py), a decode step of every unfinished request, then per request
        (batch_result_processor.py ``_handle_finish_state_updated_req``):
        ``offload_kv_cache(req)`` while it runs; at finish ``if not
        offload_kv_cache(req): finalize_release_on_finish(req)``. Returns the requests
        that finished in this step."""
        mgr.check_offload_progress()
        running = [r for r in reqs if not r.finished()]
        for req in running:
            self.decode_step(req)
        done = []
        for req in running:
            if not req.finished():
                mgr.offload_kv_cache(req)
            else:
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
                done.append(req)
        return done

    def retract(self, req: Req) -> bool:
        """SGLang's retraction of a decoding request (``ScheduleBatch.retract_decode`` ->
        ``release_req``, managers/schedule_batch.py): the KV backed up to a CPU tensor
        (``backup_kv_cache`` -> ``Req.offload_kv_cache``), ``release_kv_cache(req,
        tree_cache, checkpoint=False)`` (frees ``[cache_protected_len, ...)``, unlocks
        ``req.lock``, frees the row), the tree evicted, ``req.reset_for_retract()``.
        The scheduler calls ``drain_before_retraction()`` first (scheduler.py); a
        priority preemption does not (call this without draining). Returns whether
        the backup was saved."""
        ok = release_req(
            req=req,
            remaing_req_count=1,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree_cache,
            hisparse_coordinator=None,
        )
        return bool(ok)

    def resume(self, req: Req) -> None:
        """SGLang's resume of a retracted request (decode.py
        ``DecodePreallocQueue.resume_retracted_reqs``): ``_pre_alloc(req)`` (a new row and
        slots for prompt + outputs but the last; no prefix match) then
        ``restore_kv_cache`` (``Req.load_kv_cache``: the backed-up KV copied into the new
        slots)."""
        req.is_retracted = False
        self._pre_alloc(req, None, 0)
        req.kv.cache_protected_len = 0
        restore_kv_cache(
            req,
            self.tree_cache,
            self.req_to_token_pool,
            self.allocator,
            runtime_context.get_disagg().disaggregation_decode_retraction_backup,
        )

    # --- the radix tree's own pages ------------------------------------------------------------

    def seed_tree(self, tokens: Sequence[int], *, extra_key: str | None = None) -> int:
        """Put the page-aligned head of ``tokens`` into the radix tree as an earlier
        request would have left it: slots from the allocator, their KV written, the
        key inserted with those slots as its value (``tree_cache.insert(InsertParams)``,
        the tree's own insert). The slots are the tree's from then on. Returns the
        tokens inserted."""
        assert self.decode_radix, "the decode radix cache is off: the tree is disabled"
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        if n == 0:
            return 0
        slots = self.allocator.alloc(n)
        assert slots is not None, "KV cache is full"
        for i in range(n):
            self._write_slot(int(slots[i]), i, int(tokens[i]))
        key = RadixKey(array("q", tokens[:n]), extra_key)
        self.tree_cache.insert(InsertParams(key=key, value=slots.to(torch.int64)))
        return n

    def evict(self, num_tokens: int | None = None) -> int:
        """Evict unlocked tree pages (all of them by default): the tree frees their
        slots to the allocator. Returns the tokens evicted."""
        if num_tokens is None:
            num_tokens = self.capacity
        result = self.tree_cache.evict(EvictParams(num_tokens=num_tokens))
        return int(result.num_tokens_evicted)

    # --- the allocator's free list ------------------------------------------------------------

    def free_slots(self) -> list[int]:
        """Every slot on the allocator's free list (staged frees included), sorted, a
        slot as often as it is listed (a page freed twice lists its slots twice)."""
        alloc = self.allocator
        if self.page_size == 1:
            ids = torch.cat((alloc.free_pages, alloc.release_pages))
            return sorted(int(s) for s in ids)
        pages = alloc.get_all_free_pages()
        ps = self.page_size
        return sorted(int(p) * ps + j for p in pages for j in range(ps))

    def free_count(self) -> int:
        """The allocator's ``available_size()`` (slots it can hand out now)."""
        return int(self.allocator.available_size())

    def check_free_list(self) -> None:
        """Raise AssertionError naming the slots on the free list more than once (a
        double free) or that are no slot at all (padding slot 0)."""
        slots = self.free_slots()
        dup = sorted({s for s in slots if slots.count(s) > 1})
        assert not dup, f"slots on the free list twice (freed twice): {dup[:16]}"
        bad = [s for s in slots if s < self.page_size]
        assert not bad, f"the padding page is on the free list: {bad}"

    def tree_slots(self) -> int:
        """Slots the tree holds (evictable + locked)."""
        if self.tree_cache.disable:
            return 0
        return int(self.tree_cache.evictable_size()) + int(self.tree_cache.protected_size())

    # --- known KV bytes ---------------------------------------------------------------------------

    def _buffers(self) -> list[tuple[int, int, torch.Tensor]]:
        """(layer, which, buffer) of every per-layer KV buffer, in kvoffload's order
        (MHA: K0, V0, K1, V1, ...; MLA: KV0, KV1, ...)."""
        pool = self.kv_pool
        if self.kv_kind == "mha":
            pairs = enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True))
            return [(i, w, b) for i, (k, v) in pairs for w, b in ((0, k), (1, v))]
        return [(i, 0, b) for i, b in enumerate(pool.kv_buffer)]

    def _write_slot(self, slot: int, pos: int, token: int) -> None:
        for layer, which, buf in self._buffers():
            value = kv_value(pos, token, layer, which, int(buf[slot].numel()), self.shard)
            buf[slot] = value.view(buf[slot].shape).to(buf.dtype)

    def write_kv(self, req: Req, start: int, end: int) -> None:
        """The forward pass writes the KV of positions ``start..end`` of ``req`` into the
        slots its row names (:func:`kv_value` of each position's token)."""
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        toks = [*req.origin_input_ids, *req.output_ids]
        for pos in range(start, end):
            self._write_slot(int(row[pos]), pos, int(toks[pos]))

    def kv_bytes(self, slots: Sequence[int]) -> bytes:
        """The pool's bytes at ``slots``, buffer by buffer (kvoffload's order), slot by
        slot within a buffer."""
        idx = torch.tensor(list(slots), dtype=torch.int64)
        return b"".join(_raw(buf[idx]) for _, _, buf in self._buffers())

    def expected_kv_bytes(self, tokens: Sequence[int], start: int, end: int) -> bytes:
        """What :meth:`kv_bytes` reads for positions ``start..end`` of a sequence of
        ``tokens`` written by this engine (same layout)."""
        parts = []
        for layer, which, buf in self._buffers():
            shape, width = buf[0].shape, int(buf[0].numel())
            rows = [
                kv_value(p, int(tokens[p]), layer, which, width, self.shard).view(shape).to(buf.dtype)
                for p in range(start, end)
            ]
            parts.append(_raw(torch.stack(rows)))
        return b"".join(parts)

    def row_slots(self, req: Req, start: int, end: int) -> list[int]:
        """The slots ``req``'s row names for positions ``start..end``."""
        row = req.kv.req_pool_idx
        return [int(s) for s in self.req_to_token_pool.req_to_token[row, start:end]]

    # --- kvoffload's drop-in -------------------------------------------------------------------

    def manager(self, tp_group: Any = None, server_args: Any = None, **kw: Any) -> Any:
        """SGLang's one line (scheduler.py builds the decode offload manager from its own
        objects), with kvoffload's drop-in: ``DecodeKVCacheOffloadManager(
        req_to_token_pool, token_to_kv_pool_allocator, tp_group, tree_cache)``;
        ``server_args`` and ``kw`` are the drop-in's extras."""
        from kvoffload.integrations.sglang import DecodeKVCacheOffloadManager

        return DecodeKVCacheOffloadManager(
            self.req_to_token_pool, self.allocator, tp_group, self.tree_cache, server_args, **kw
        )


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes (any dtype)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@contextlib.contextmanager
def engine(
    *,
    page_size: int = 4,
    kv: str = "mha",
    tree: str = "unified",
    decode_radix: bool = False,
    slots: int = 256,
    rows: int = 16,
    max_context: int = 512,
    layers: int = 2,
    dtype: torch.dtype = torch.float16,
    debug: bool = True,
    **args: Any,
) -> Iterator[Engine]:
    """SGLang's decode-side objects for the ``with`` body: ``server_args(page_size=...,
    disaggregation_decode_enable_radix_cache=decode_radix, **args)`` published,
    ``SGLANG_DEBUG_MEMORY_POOL=1`` (unless ``debug=False``), then the pools, the
    allocator (``slots`` token slots) and the tree cache (``tree``: ``"unified"`` or
    ``"radix"``). Everything global is restored on exit."""
    sa = server_args(page_size=page_size, disaggregation_decode_enable_radix_cache=decode_radix, **args)
    with debug_memory_pool(debug), published(sa):
        yield Engine(
            sa,
            kv=kv,
            tree=tree,
            decode_radix=decode_radix,
            slots=slots,
            rows=rows,
            max_context=max_context,
            layers=layers,
            dtype=dtype,
        )


# --- tensor parallelism: one rank (imported by name in the rank processes) ------------------


def tp_rank_run(
    ctx: Any,
    seed: int,
    root: str,
    drop_in_a_cycle: bool = False,
    kv: str = "mha",
    host_pages: int = 64,
    host_wait_steps: int | None = None,
) -> dict[str, Any]:
    """One TP rank of a replicated SGLang decode scheduler on SGLang's real objects: the
    same requests and calls on every rank (``ctx.group`` is the TP group), each rank's
    copies completing in its own random order and rounds (a ``SimBackend``), KV bytes
    that differ by rank (its heads; MLA's are the same). Returns what a test compares
    across ranks: per iteration the lifecycle counts, the iteration each request's KV
    was released in, and the allocator's state at the end.

    ``drop_in_a_cycle``: at iteration 6 the engine drops a running request mid-decode
    (its row kept), caught in a reference cycle; rank 0's collector runs at once, the
    others' never (F31); at iteration 12 the engine frees the row (SGLang's
    ``free_kv_row`` and ``free_rows``). ``host_pages`` / ``host_wait_steps``: the
    drop-in's host pool and its host-full wait bound (in scheduler steps)."""
    import gc
    import random

    from kvoffload.storage.file import FileStorage
    from kvoffload.testing import SimBackend

    rng = random.Random(seed * 1000 + ctx.rank)
    with engine(page_size=4, kv=kv) as eng:
        eng.shard = ctx.rank if kv == "mha" else 0
        sim = SimBackend()
        mgr = eng.manager(
            tp_group=ctx.group,
            storage=FileStorage(root),
            backend=sim,
            host_pages=host_pages,
            host_wait_steps=host_wait_steps,
            drain_timeout_s=20.0,
        )
        reqs = [eng.new_req(f"r{i % 3}", [i * 10 + j for j in range(3 + i)], 9 + 2 * i) for i in range(6)]
        names = [f"{r.rid}#{i}" for i, r in enumerate(reqs)]  # rids are reused: the name is the request
        waiting, running = list(reqs), []
        released_at: dict[int, list[str]] = {}
        done: set[str] = set()
        dropped: Any = None
        counts: list[tuple[int, ...]] = []
        if drop_in_a_cycle:
            gc.disable()
        try:
            for it in range(500):
                if waiting and it % 3 == 0:
                    r = waiting.pop(0)
                    eng.admit(r)
                    running.append(r)
                if drop_in_a_cycle and it == 6:
                    gone = running[0]
                    gone.cycle = gone  # type: ignore[attr-defined]  # only the collector frees it
                    dropped = gone.kv
                    running.remove(gone)
                    del names[reqs.index(gone)]
                    reqs.remove(gone)
                    del gone
                    if ctx.rank == 0:
                        gc.collect()
                if dropped is not None and it == 12:
                    eng.tree_cache.free_kv_row(
                        dropped, [(dropped.cache_protected_len, dropped.kv_allocated_len)]
                    )
                    eng.req_to_token_pool.free_rows([dropped.req_pool_idx])
                    dropped.req_pool_idx = None
                eng.step(mgr, running)
                running = [r for r in running if not r.finished()]
                s = mgr.statistics()
                counts.append(
                    (
                        it,
                        s.live_lifecycles,
                        s.released_aborted,
                        s.chunks_discarded,
                        s.device_pages_used,
                        s.chunks_deferred,
                        s.chunks_expired,
                        s.pages_lost,
                    )
                )
                # This rank's copy engine: a random subset of its copies, in a random order.
                pending = list(sim.pending)
                rng.shuffle(pending)
                for t in pending[: rng.randint(0, len(pending))]:
                    sim.complete(t)
                now = [
                    name
                    for name, r in zip(names, reqs, strict=True)
                    if name not in done and r.finished() and r.kv.req_pool_idx is None
                ]
                done.update(now)
                if now:
                    released_at[it] = now
                if not waiting and not running and not mgr.ongoing_offload:
                    break
                if not running and sim.pending and rng.random() < 0.5:
                    sim.complete_all()
            while mgr.ongoing_offload:
                sim.complete_all()
                mgr.check_offload_progress()
            mgr.manager.check_invariants()
            stats = mgr.statistics()
            mgr.release_host_resources()
        finally:
            gc.enable()
        eng.check_free_list()
        return {
            "counts": counts,
            "released_at": released_at,
            "released": sorted(done),
            "names": sorted(names),
            "pages_stored": stats.pages_stored,
            "live": stats.live_lifecycles,
            "host_used": stats.host_pages_used,
            "free": eng.free_count(),
            "capacity": eng.capacity,
            "rows_free": eng.req_to_token_pool.available_size(),
        }
