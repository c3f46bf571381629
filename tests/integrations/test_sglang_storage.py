"""F30: what kvoffload's SGLang drop-in stores, SGLang's own prefill-side HiCache storage
finds under SGLang's keys and reads byte for byte into SGLang's host-page layout; and
kvoffload's lookup finds what SGLang stored, checked before writing, so a page is never
stored twice.

SGLang 0.5.23's real classes on the CPU: its KV pools (``MHATokenToKVPool`` /
``MLATokenToKVPool``, ``device="cpu"``), its allocator, host pools built by its
``build_kv_host_pool``, its storage backends built by its ``StorageBackendFactory``
(``HiCacheFile``), its ``HiCacheController`` (the prefetch: ``_storage_hit_query`` then
``_page_transfer``; the backup: ``write_storage`` on its backup thread), its runtime
config (``override_server_args``). The scheduler around the drop-in is
``sglang_fakes.Engine`` (writing each token's KV into SGLang's real pool). What is
faked, and why: pinned host memory (no CUDA here: the host pools are built unpinned),
and the device<->host copies of SGLang's controller (CUDA kernels): the tests put KV
into SGLang's host pool, and read it out, through the pool's own per-layer views
(``k_data_refs`` / ``v_data_refs`` / ``data_refs``), which those kernels read and write.
"""

from __future__ import annotations

import sglang_cpu

sglang_cpu.require()

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import sglang_storage_tp  # noqa: E402
import torch  # noqa: E402
from sglang_fakes import DIM, HEADS, Engine, Req, kv_value, shard_uid  # noqa: E402
from support import HANG_S  # noqa: E402

import kvoffload as kvo  # noqa: E402
from kvoffload.integrations.sglang import DecodeKVCacheOffloadManager, engine_kv_tensors  # noqa: E402
from kvoffload.integrations.sglang_storage import (  # noqa: E402
    LAYOUTS,
    ZERO_COPY_BACKENDS,
    PageFormat,
    SGLangFileFormat,
    SGLangHiCacheStorage,
    sglang_storage,
)

PS = 4
LAYERS = 2
N_PAGES = 64
MODEL = "org/tiny"


# --- SGLang's objects ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def unpinned_host_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake: SGLang's ``build_kv_host_pool`` builds pinned host pools (cudaHostRegister;
    ``get_dummy_flat_data_page`` allocates with ``pin_memory=True``), which needs CUDA.
    Here the host pool classes it picks are built with ``pin_memory=False``; nothing
    else about them changes."""
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as hpa

    def unpinned(cls: type) -> type:
        assert "pin_memory" in inspect.signature(cls.__init__).parameters  # type: ignore[misc]

        class Unpinned(cls):  # type: ignore[valid-type, misc]
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, pin_memory=False, **kw)

        Unpinned.__name__ = cls.__name__
        return Unpinned

    pick = hpa.get_mha_host_pool_cls
    monkeypatch.setattr(hpa, "get_mha_host_pool_cls", lambda info: unpinned(pick(info)))
    monkeypatch.setattr(hpa, "MLATokenToKVPoolHost", unpinned(hpa.MLATokenToKVPoolHost))
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)


@contextlib.contextmanager
def published(layout: str) -> Iterator[None]:
    """SGLang's runtime config as a scheduler process publishes it (page size, host
    layout, the CPU), and this process's place in the parallel groups (rank 0 of 1)."""
    from sglang.srt import runtime_context as rc

    ov = rc.get_context().override_server_args(page_size=PS, hicache_mem_layout=layout, device="cpu")
    ov.install()
    par = rc.get_parallel()
    par.override_permanently(tp_rank=0, pp_rank=0, attn_cp_rank=0, attn_dcp_rank=0)
    try:
        yield
    finally:
        par.clear_stamp()
        ov.restore()


def real_pool(kind: str, heads: int = HEADS) -> Any:
    """SGLang's real KV pool on the CPU, with ``tensors()``: the buffers the fake engine
    writes each token's KV through (SGLang's own buffers; MLA's as (rows, HEADS, DIM)
    views of its (rows, 1, kv_cache_dim) latent rows)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind == "mha":
        pool = MHATokenToKVPool(
            size=N_PAGES * PS,
            page_size=PS,
            dtype=torch.float32,
            head_num=heads,
            head_dim=DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        views = [t for pair in zip(pool.k_buffer, pool.v_buffer, strict=True) for t in pair]
    else:
        pool = MLATokenToKVPool(
            size=N_PAGES * PS,
            page_size=PS,
            dtype=torch.float32,
            kv_lora_rank=HEADS * DIM // 2,
            qk_rope_head_dim=HEADS * DIM // 2,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        views = [b.view(b.shape[0], HEADS, DIM) for b in pool.kv_buffer]
    pool.tensors = lambda: views
    return pool


def args(layout: str, root: Path, backend: str = "file", **extra: Any) -> Any:
    """The server args the drop-in reads its storage settings from."""
    return SimpleNamespace(
        hicache_storage_backend=backend,
        hicache_storage_backend_extra_config=json.dumps({"file_storage_path": str(root), **extra}),
        served_model_name=MODEL,
        hicache_mem_layout=layout,
        hicache_ratio=2.0,
        hicache_size=0,
    )


def settle(mgr: DecodeKVCacheOffloadManager) -> None:
    """Scheduler iterations until the copies and storage writes are done (bounded by
    HANG_S: a hang, never a slow machine)."""
    deadline = time.monotonic() + HANG_S
    mgr.drain_before_retraction()
    while mgr.ongoing_offload:
        assert time.monotonic() < deadline, f"never settled: {mgr.statistics()}"
        mgr.check_offload_progress()
        mgr.manager.wait_progress(0.05)


def decode(kind: str, layout: str, root: Path, prompt: list[int], max_new: int) -> tuple[Engine, Req, Any]:
    """The drop-in on SGLang's real KV pool offloads one request to the storage SGLang's
    config names; returns the engine, the request and the drop-in's store."""
    engine = Engine(page_size=PS, n_pages=N_PAGES, pool=real_pool(kind))
    mgr = engine.manager(server_args=args(layout, root), backend="cpu", host_pages=32, drain_timeout_s=5.0)
    req = Req("a", prompt, max_new=max_new)
    engine.run([req])
    settle(mgr)
    store = mgr.manager.storage
    mgr.release_host_resources()
    return engine, req, store


class Prefill:
    """SGLang's prefill side: its real HiCacheController over its real host pool and
    the storage backend its config names."""

    def __init__(self, kind: str, backend: str, extra: dict[str, Any], kv: Any = None) -> None:
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool

        self.kind = kind
        kv = real_pool(kind) if kv is None else kv
        alloc = PagedTokenToKVPoolAllocator(
            size=kv.size, page_size=PS, dtype=kv.dtype, device="cpu", kvcache=kv, need_sort=False
        )
        self.host = build_kv_host_pool(kv_pool=kv, page_size=PS, use_mla=kind == "mla")
        self.cc = HiCacheController(
            token_to_kv_pool_allocator=alloc,
            mem_pool_host=self.host,
            page_size=PS,
            tp_group=None,
            load_cache_event=threading.Event(),
            storage_backend=backend,
            model_name=MODEL,
            storage_backend_extra_config=dict(extra),
        )

    def prefetch(self, tokens: list[int]) -> tuple[int, Any]:
        """SGLang's prefetch of a new request's tokens: the hit query, then the page
        transfer into host pages; returns (pages loaded, their host indices)."""
        from sglang.srt.managers.cache_controller import PrefetchOperation

        op = PrefetchOperation("prefill", tokens)
        keys, hit_tokens = self.cc._storage_hit_query(op)
        op.hash_value = keys
        op.host_indices = self.host.alloc(hit_tokens)
        return self.cc._page_transfer(op), op.host_indices

    def backup(self, tokens: list[int], kv_of: Any) -> None:
        """SGLang's own write of ``tokens``' pages (its backup thread, ``write_storage``),
        from host pages holding ``kv_of(pos, tensor)`` (put there through the pool's
        per-layer views, where SGLang's device-to-host kernel writes)."""
        from sglang.srt.mem_cache.utils import get_hash_str

        n = len(tokens) // PS * PS
        idx = self.host.alloc(n)
        for pos in range(n):
            for i, ref in enumerate(self.layer_rows()):
                ref[int(idx[pos])] = kv_of(pos, i).reshape(ref[0].shape)
        keys, prior = [], None
        for p in range(n // PS):
            prior = get_hash_str(tokens[p * PS : (p + 1) * PS], prior)
            keys.append(prior)
        self.cc.write_storage(idx, tokens[:n], hash_value=keys)
        done = self.cc.ack_backup_queue.get(timeout=HANG_S)
        assert done.completed_tokens == n, "SGLang's own backup did not write every page"
        self.host.free(idx)

    def layer_rows(self) -> list[Any]:
        """The host pool's per-layer token rows, in kvoffload's tensor order (K0, V0,
        K1, V1, ... / KV0, KV1, ...): SGLang's own views its copy kernels use."""
        h = self.host
        if self.kind == "mla":
            return list(h.data_refs)
        return [r for pair in zip(h.k_data_refs, h.v_data_refs, strict=True) for r in pair]

    def close(self) -> None:
        self.cc.detach_storage_backend()


def expect_loaded(prefill: Prefill, host_idx: Any, req: Req, engine: Engine, pages: int) -> None:
    """Host pages ``host_idx`` hold the engine's KV of ``req``'s first ``pages`` pages,
    byte for byte, in every layer (read through SGLang's own per-layer views)."""
    tokens = [*req.origin_input_ids, *req.output_ids]
    uid = shard_uid(req.uid, engine.shard)
    rows = prefill.layer_rows()
    for pos in range(pages * PS):
        for i, ref in enumerate(rows):
            got = ref[int(host_idx[pos])]
            want = kv_value(uid, pos, tokens[pos], i).reshape(got.shape)
            assert torch.equal(got, want), f"token {pos}, tensor {i}: SGLang read other bytes"


# --- the drop-in's pages, read by SGLang ------------------------------------------------------


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_sglangs_prefill_prefetch_reads_what_the_drop_in_stored(
    kind: str, layout: str, tmp_path: Path
) -> None:
    """F30: the drop-in, configured as SGLang's decode node is (``file`` backend, its
    model name, its host layout), stores pages that SGLang's own prefill side - its
    real HiCacheController's hit query and page transfer, through HiCacheFile, into
    its real host pool - finds under its own keys and loads byte for byte."""
    with published(layout):
        engine, req, store = decode(kind, layout, tmp_path, [1, 2, 3], max_new=14)
        assert isinstance(store, SGLangHiCacheStorage)
        assert store.describe()["pages_written"] == 4  # 3 + 14 - 1 committed tokens: 4 pages
        prefill = Prefill(kind, "file", {"file_storage_path": str(tmp_path)})
        try:
            loaded, idx = prefill.prefetch([*req.origin_input_ids, *req.output_ids])
            assert loaded == 4
            expect_loaded(prefill, idx, req, engine, 4)
        finally:
            prefill.close()
    suffix = f"_org-tiny{'' if kind == 'mla' else '_0_1'}.bin"  # suffixed even at TP 1 (MHA)
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 4 and all(n.endswith(suffix) for n in names), names


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_sglangs_zero_copy_prefetch_reads_what_the_drop_in_stored(
    kind: str, layout: str, tmp_path: Path
) -> None:
    """F30, zero-copy backends (mooncake, 3fs, nixl, ...): the drop-in stages each page
    in a real SGLang host pool and calls ``batch_set_v1(keys, host_indices)``, as
    SGLang's controller does; a backend that reads the host pool by index (here the
    CPU stand-in of sglang_indexed_store) holds what SGLang's zero-copy prefetch
    (``batch_get_v1`` into its host pool) loads byte for byte."""
    import sglang_indexed_store as ix

    extra = {"backend_name": "indexed", "module_path": "sglang_indexed_store", "class_name": "IndexedStore",
             "interface_v1": 1, "store": "zc"}  # fmt: skip
    ix.STORES.pop("zc", None)
    ix.WRITES["zc"] = 0
    with published(layout):
        engine = Engine(page_size=PS, n_pages=N_PAGES, pool=real_pool(kind))
        a = SimpleNamespace(**{**vars(args(layout, tmp_path)), "hicache_storage_backend": "dynamic",
                               "hicache_storage_backend_extra_config": json.dumps(extra)})  # fmt: skip
        mgr = engine.manager(server_args=a, backend="cpu", host_pages=32, drain_timeout_s=5.0)
        assert mgr.manager.storage.describe()["write"] == "batch_set_v1"
        req = Req("a", [1, 2, 3], max_new=14)
        engine.run([req])
        settle(mgr)
        mgr.release_host_resources()
        assert ix.WRITES["zc"] == 4
        prefill = Prefill(kind, "dynamic", extra)
        try:
            assert prefill.cc.page_get_func == prefill.cc._page_get_zero_copy
            loaded, idx = prefill.prefetch([*req.origin_input_ids, *req.output_ids])
            assert loaded == 4
            expect_loaded(prefill, idx, req, engine, 4)
        finally:
            prefill.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_tp2_pages_carry_sglangs_rank_suffix(kind: str, tmp_path: Path) -> None:
    """F30 under TP 2: rank 1's MHA shard is stored as ``<key>_<model>_1_2.bin`` (its
    own heads: SGLang's HiCacheFile of rank 1 of 2 reads it byte for byte), MLA's
    replicated latent as ``<key>_<model>.bin``; kvoffload's own ``_<rank>_<size>`` key
    suffix (RankKeys) is not added on top."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    from kvoffload.drivers.distributed import RankAgreement

    heads = HEADS // 2 if kind == "mha" else HEADS
    with published("page_first"):
        pool = real_pool(kind, heads=heads)
        for t in engine_kv_tensors(pool, PS)[1]:
            t.copy_(torch.randn_like(t))
        store = sglang_storage(
            "file", {"file_storage_path": str(tmp_path)}, MODEL, 1, 2, "page_first", pool, page_size=PS
        )
        here = SimpleNamespace(per_rank_keys=True, rank=1, size=2)
        assert RankAgreement.key_space(here, store) is store  # type: ignore[arg-type]
        tensors = engine_kv_tensors(pool, PS)[1]
        pages = [b"".join(t[p].numpy().tobytes() for t in tensors) for p in (1, 2)]
        asyncio.run(store.put(["k1", "k2"], pages))
        suffix = "_org-tiny.bin" if kind == "mla" else "_org-tiny_1_2.bin"
        assert sorted(os.listdir(tmp_path)) == [f"k1{suffix}", f"k2{suffix}"]
        config = HiCacheStorageConfig(
            tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=kind == "mla", enable_storage_metrics=False, is_page_first_layout=True,
            model_name=MODEL, extra_config={"file_storage_path": str(tmp_path)},
        )  # fmt: skip
        theirs = HiCacheFile(config)
        host = store.host_pool
        for key, page in zip(["k1", "k2"], pages, strict=True):
            flat = theirs.get(key, host.get_dummy_flat_data_page())
            assert flat is not None
            assert store.fmt.to_kvoffload(flat.view(torch.uint8)).numpy().tobytes() == page


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_the_drop_in_on_sglangs_scheduler_objects_feeds_sglangs_prefill(
    kind: str, layout: str, tmp_path: Path
) -> None:
    """F30 end to end on SGLang's real decode-side objects (sglang_real: its Req, pools,
    allocator, tree cache, scheduler calls) with the settings read where SGLang's own
    manager reads them (the published runtime config: no server_args): what the drop-in
    stores, SGLang's prefill prefetch loads, byte for byte the engine's KV."""
    import sglang_real as sr
    from sglang.srt import runtime_context as rc
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    extra = {"file_storage_path": str(tmp_path)}
    with sr.engine(
        page_size=PS,
        kv=kind,
        hicache_storage_backend="file",
        hicache_storage_backend_extra_config=json.dumps(extra),
        hicache_mem_layout=layout,
        served_model_name=MODEL,
    ) as eng:
        rc.get_parallel().override_permanently(tp_rank=0, pp_rank=0, attn_cp_rank=0, attn_dcp_rank=0)
        try:
            mgr = eng.manager(backend="cpu", host_pages=32, drain_timeout_s=5.0)
            assert isinstance(mgr.manager.storage, SGLangHiCacheStorage)
            req = eng.new_req("a", [1, 2, 3], max_new_tokens=14)
            eng.admit(req)
            while not req.finished():
                eng.step(mgr, [req])
            settle(mgr)
            mgr.release_host_resources()
            tokens = eng.tokens(req)  # those whose KV was written
            pages = len(tokens) // PS
            pool = eng.kv_pool
            common = {"size": pool.size, "page_size": PS, "dtype": pool.dtype, "layer_num": LAYERS,
                      "device": "cpu", "enable_memory_saver": False}  # fmt: skip
            twin = (
                MHATokenToKVPool(head_num=sr.HEADS, head_dim=sr.HEAD_DIM, **common)
                if kind == "mha"
                else MLATokenToKVPool(kv_lora_rank=sr.KV_LORA_RANK, qk_rope_head_dim=sr.ROPE_DIM, **common)
            )
            prefill = Prefill(kind, "file", extra, kv=twin)
            try:
                loaded, idx = prefill.prefetch(tokens)
                assert loaded == pages
                got = b"".join(
                    torch.stack([ref[int(idx[pos])] for pos in range(pages * PS)])
                    .view(torch.uint8)
                    .numpy()
                    .tobytes()
                    for ref in prefill.layer_rows()
                )
                assert got == eng.expected_kv_bytes(tokens, 0, pages * PS)
            finally:
                prefill.close()
        finally:
            rc.get_parallel().clear_stamp()


def test_two_tp_ranks_store_what_each_ranks_hicachefile_reads(tmp_path: Path) -> None:
    """F30 under TP 2, two gloo ranks on SGLang's real objects: with MHA each rank's
    drop-in stores its own heads as ``<key>_<model>_<rank>_2.bin`` (kvoffload adds no
    suffix of its own), and SGLang's HiCacheFile of that rank reads them byte for byte;
    with MLA rank 0 alone writes ``<key>_<model>.bin``, which both ranks' HiCacheFile
    read. (One pair of rank processes runs both: starting them costs most of the time.)"""
    from kvoffload.testing import LocalRanks

    (tmp_path / "mha").mkdir()
    (tmp_path / "mla").mkdir()
    with LocalRanks(2, timeout_s=240.0) as ranks:
        mha = ranks.run(sglang_storage_tp.rank_stores_and_reads, str(tmp_path / "mha"), "mha")
        mla = ranks.run(sglang_storage_tp.rank_stores_and_reads, str(tmp_path / "mla"), "mla")
    for r in (*mha, *mla):
        assert r["pages"] == 4 and r["read"] == 4 and r["same"], r
    files = mha[0]["files"]
    assert mha[0]["written"] == mha[1]["written"] == 4
    assert len(files) == 8
    assert sum(f.endswith("_org-tiny_0_2.bin") for f in files) == 4
    assert sum(f.endswith("_org-tiny_1_2.bin") for f in files) == 4
    files = mla[0]["files"]
    assert (mla[0]["written"], mla[1]["written"]) == (4, 0)
    assert len(files) == 4 and all(f.endswith("_org-tiny.bin") for f in files), files


# --- what SGLang stored, found by kvoffload -----------------------------------------------------


def sglang_stores_first(kind: str, layout: str, root: Path, req: Req, engine: Engine, pages: int) -> None:
    """SGLang's own controller writes the first ``pages`` pages of ``req``'s tokens (the
    engine's KV for them) through HiCacheFile, as a prefill or SGLang decode node does."""
    tokens = [*req.origin_input_ids, *range(100, 100 + req.max_new)]  # the engine's tokens
    uid = shard_uid(req.uid, engine.shard)
    prefill = Prefill(kind, "file", {"file_storage_path": str(root)})
    try:
        prefill.backup(tokens[: pages * PS], lambda pos, i: kv_value(uid, pos, tokens[pos], i))
    finally:
        prefill.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pages_sglang_stored_are_found_and_never_written_again(
    kind: str, layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F30, the reverse: pages SGLang's own controller stored are found by kvoffload's
    lookup (SGLang's ``batch_exists``) and, when the drop-in offloads the same tokens,
    not written again (SGLang's backend is asked to write only the pages it lacks);
    every page SGLang's prefetch then loads has the engine's bytes."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with published(layout):
        engine = Engine(page_size=PS, n_pages=N_PAGES, pool=real_pool(kind))
        req = Req("a", [1, 2, 3], max_new=14)
        sglang_stores_first(kind, layout, tmp_path, req, engine, 2)
        before = {n: os.stat(tmp_path / n).st_mtime_ns for n in os.listdir(tmp_path)}
        writes: list[str] = []
        real_set = HiCacheFile.set

        def counted(self: Any, key: str, *a: Any, **k: Any) -> bool:
            writes.append(key)
            return bool(real_set(self, key, *a, **k))

        monkeypatch.setattr(HiCacheFile, "set", counted)
        mgr = engine.manager(
            server_args=args(layout, tmp_path), backend="cpu", host_pages=32, drain_timeout_s=5.0
        )
        tokens = [*req.origin_input_ids, *range(100, 100 + req.max_new)]
        assert mgr.manager.lookup(tokens) == 2 * PS  # what SGLang stored, found
        engine.run([req])
        settle(mgr)
        store = mgr.manager.storage
        mgr.release_host_resources()
        assert store.describe()["pages_found"] == 2 and store.describe()["pages_written"] == 2
        assert len(writes) == 2, writes  # only the two pages SGLang did not hold
        assert {n: os.stat(tmp_path / n).st_mtime_ns for n in before} == before
        prefill = Prefill(kind, "file", {"file_storage_path": str(tmp_path)})
        try:
            loaded, idx = prefill.prefetch([*req.origin_input_ids, *req.output_ids])
            assert loaded == 4
            expect_loaded(prefill, idx, req, engine, 4)
        finally:
            prefill.close()


# --- the format ------------------------------------------------------------------------------


def test_a_renamed_kvoffload_record_is_not_what_is_written(tmp_path: Path) -> None:
    """F30: the drop-in's files are SGLang's raw flat pages - exactly one page's bytes,
    no kvoffload header - not kvoffload records renamed. (A renamed record is worse
    than a miss: SGLang's HiCacheFile loads it without an error, as a corrupt page.)"""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    from kvoffload.storage.file import FileStorage

    with published("page_first"):
        pool = real_pool("mha")
        tensors = engine_kv_tensors(pool, PS)[1]
        for t in tensors:
            t.copy_(torch.randn_like(t))
        page = b"".join(t[1].numpy().tobytes() for t in tensors)
        ours = tmp_path / "ours"
        store = sglang_storage(
            "file", {"file_storage_path": str(ours)}, MODEL, 0, 1, "page_first", pool, page_size=PS
        )
        asyncio.run(store.put(["k1"], [page]))
        raw = (ours / "k1_org-tiny_0_1.bin").read_bytes()
        assert len(raw) == len(page) == store.fmt.page_bytes
        assert not raw.startswith(b"KVOP")
        assert (
            raw == store.fmt.to_sglang(torch.frombuffer(bytearray(page), dtype=torch.uint8)).numpy().tobytes()
        )
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name=MODEL,
            extra_config={"file_storage_path": str(ours)},
        )  # fmt: skip
        read = HiCacheFile(config).get("k1", store.host_pool.get_dummy_flat_data_page())
        assert read.view(torch.uint8).numpy().tobytes() == raw

        renamed = tmp_path / "renamed"
        kv_store = FileStorage(renamed)
        asyncio.run(kv_store.put(["k1"], [page]))
        record = kv_store.path("k1").read_bytes()
        assert record.startswith(b"KVOP") and len(record) > len(page)
        os.rename(kv_store.path("k1"), renamed / "k1_org-tiny_0_1.bin")
        config.extra_config = {"file_storage_path": str(renamed)}
        corrupt = HiCacheFile(config).get("k1", store.host_pool.get_dummy_flat_data_page())
        assert corrupt is not None  # no error: SGLang takes the record as a page
        assert corrupt.view(torch.uint8).numpy().tobytes() != raw


@pytest.mark.parametrize("layout", ["page_head", "page_unified", "page_first_kv_split", "nonsense"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_layouts_not_converted_are_refused_by_name(kind: str, layout: str, tmp_path: Path) -> None:
    """A host layout kvoffload does not convert exactly is refused at construction,
    naming it and the supported ones; nothing is built or written."""
    pattern = f"{layout}.*supported: layer_first, page_first, page_first_direct"
    with pytest.raises(kvo.UnsupportedKVPool, match=pattern):
        PageFormat(kind, layout, LAYERS, PS, 32)
    with published("page_first"):
        engine = Engine(page_size=PS, n_pages=N_PAGES, pool=real_pool(kind))
        with pytest.raises(kvo.UnsupportedKVPool, match=pattern):
            engine.manager(server_args=args(layout, tmp_path), backend="cpu", host_pages=32)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_every_accepted_layout_is_sglangs_own_page(kind: str, layout: str, tmp_path: Path) -> None:
    """Each layout accepted: a page staged in SGLang's host pool through
    ``set_from_flat_data_page`` sits where SGLang's ``get_data_page`` reads it, and the
    flat page is SGLang's order (checked against the pool's layout dims)."""
    assert layout in LAYOUTS[kind]
    with published(layout):
        pool = real_pool(kind)
        tensors = engine_kv_tensors(pool, PS)[1]
        for t in tensors:
            t.copy_(torch.randn_like(t))
        store = sglang_storage(
            "file", {"file_storage_path": str(tmp_path)}, MODEL, 0, 1, layout, pool, page_size=PS
        )
        host, fmt = store.host_pool, store.fmt
        assert host.layout == layout
        page = torch.frombuffer(
            bytearray(b"".join(t[3].numpy().tobytes() for t in tensors)), dtype=torch.uint8
        )
        idx = host.alloc(PS)
        host.set_from_flat_data_page(int(idx[0]), fmt.to_sglang(page).view(host.dtype))
        back = host.get_data_page(int(idx[0]), flat=True).contiguous().view(torch.uint8)
        assert torch.equal(fmt.to_kvoffload(back), page)
        # token t of layer l, K/V side s, as SGLang's page of this layout holds it
        shaped = host.get_data_page(int(idx[0]), flat=False)
        sides = 2 if kind == "mha" else 1
        for l_ in range(LAYERS):
            for t in range(PS):
                for side in range(sides):
                    at = {"page_first": (t, l_), "layer_first": (l_, t), "page_first_direct": (0, l_, t)}[
                        layout
                    ]
                    got = shaped[(side, *at)] if kind == "mha" else shaped[at]
                    want = tensors[sides * l_ + side][3][t]
                    assert torch.equal(got.reshape(-1), want.reshape(-1))
        host.free(idx)


def test_without_sglangs_runtime_config_the_file_format_is_written_exactly(tmp_path: Path) -> None:
    """The fallback (no published SGLang config, so no SGLang storage object): the
    ``file`` backend writes HiCacheFile's format itself, byte for byte the files
    SGLang's own storage object writes for the same pages, and skips a page on disk."""
    pool = real_pool("mha")
    tensors = engine_kv_tensors(pool, PS)[1]
    for t in tensors:
        t.copy_(torch.randn_like(t))
    pages = [b"".join(t[p].numpy().tobytes() for t in tensors) for p in (1, 2)]
    fallback = sglang_storage(
        "file", {"file_storage_path": str(tmp_path / "a")}, MODEL, 0, 1, "page_first", pool, page_size=PS
    )
    assert isinstance(fallback, SGLangFileFormat)
    asyncio.run(fallback.put(["k1", "k2"], pages))
    asyncio.run(fallback.put(["k1"], pages[:1]))
    assert fallback.pages_written == 2 and fallback.pages_found == 1
    with published("page_first"):
        through = sglang_storage(
            "file", {"file_storage_path": str(tmp_path / "b")}, MODEL, 0, 1, "page_first", pool, page_size=PS
        )
        assert isinstance(through, SGLangHiCacheStorage)
        asyncio.run(through.put(["k1", "k2"], pages))
    a, b = sorted(os.listdir(tmp_path / "a")), sorted(os.listdir(tmp_path / "b"))
    assert a == b == ["k1_org-tiny_0_1.bin", "k2_org-tiny_0_1.bin"]
    for n in a:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes()
    assert asyncio.run(fallback.get(["k1", "k2", "k3"])) == [*pages, None]
    assert asyncio.run(fallback.exists_prefix(["k1", "k2", "k3"])) == 2


def test_a_write_sglang_did_not_confirm_is_not_counted_stored(tmp_path: Path) -> None:
    """F34 through SGLang: a page SGLang's backend did not confirm fails the write (the
    chunk is not counted stored); the pages it did confirm are the ones on disk."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with published("page_first"):
        pool = real_pool("mha")
        tensors = engine_kv_tensors(pool, PS)[1]
        pages = [b"".join(t[p].numpy().tobytes() for t in tensors) for p in (1, 2, 3)]
        store = sglang_storage(
            "file", {"file_storage_path": str(tmp_path)}, MODEL, 0, 1, "page_first", pool, page_size=PS
        )
        backend = store.backend  # type: ignore[attr-defined]
        real_set = HiCacheFile.set

        def second_fails(key: str, value: Any = None, *a: Any) -> bool:
            return False if key == "k2" else bool(real_set(backend, key, value, *a))

        backend.set = second_fails
        with pytest.raises(kvo.StorageError, match="did not confirm 2 of 3"):
            asyncio.run(store.put(["k1", "k2", "k3"], pages))
        assert os.listdir(tmp_path) == ["k1_org-tiny_0_1.bin"]  # batch_set stops at the failure
        assert asyncio.run(store.exists_prefix(["k1", "k2"])) == 1


def test_a_batch_set_that_failed_in_part_says_which_pages_sglang_stored(tmp_path: Path) -> None:
    """F34 (SGLang #38316): SGLang's ``batch_set`` answers one bool for the batch; the
    adapter asks ``exists`` per page and raises PartialWriteError with one flag per
    page - k1 stored, k2 refused, k3 never written (HiCacheFile stops at the failure) -
    so kvoffload counts exactly the stored page, never the batch."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with published("page_first"):
        pool = real_pool("mha")
        tensors = engine_kv_tensors(pool, PS)[1]
        pages = [b"".join(t[p].numpy().tobytes() for t in tensors) for p in (1, 2, 3)]
        store = sglang_storage(
            "file", {"file_storage_path": str(tmp_path)}, MODEL, 0, 1, "page_first", pool, page_size=PS
        )
        backend = store.backend  # type: ignore[attr-defined]
        real_set = HiCacheFile.set

        def second_fails(key: str, value: Any = None, *a: Any) -> bool:
            return False if key == "k2" else bool(real_set(backend, key, value, *a))

        backend.set = second_fails
        with pytest.raises(kvo.PartialWriteError) as caught:
            asyncio.run(store.put(["k1", "k2", "k3"], pages))
        assert caught.value.stored == (True, False, False)
        assert caught.value.errors[0] is None and caught.value.errors[1] is not None


def test_a_zero_copy_batch_set_v1_stored_in_part_reports_its_per_key_results() -> None:
    """F34 (SGLang #38316) on a zero-copy backend: ``batch_set_v1`` answers one bool per
    key; the middle key refused, the adapter raises PartialWriteError (True, False,
    True), and exactly the confirmed pages read back."""
    import sglang_indexed_store as ix

    extra = {"backend_name": "indexed", "module_path": "sglang_indexed_store",
             "class_name": "IndexedStore", "interface_v1": 1, "store": "partial"}  # fmt: skip
    ix.STORES.pop("partial", None)
    ix.WRITES["partial"] = 0
    with published("page_first"):
        pool = real_pool("mha")
        tensors = engine_kv_tensors(pool, PS)[1]
        for t in tensors:
            t.copy_(torch.randn_like(t))
        pages = [b"".join(t[p].numpy().tobytes() for t in tensors) for p in (1, 2, 3)]
        store = sglang_storage("dynamic", extra, MODEL, 0, 1, "page_first", pool, page_size=PS)
        assert isinstance(store, SGLangHiCacheStorage) and store.zero_copy
        backend = store.backend
        real = type(backend).batch_set_v1

        def refuse_k2(keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
            got = real(backend, keys, host_indices, extra_info)
            for i, k in enumerate(keys):
                if k == "k2":
                    backend.data.pop(k + backend.suffix, None)
                    got[i] = False
            return got

        backend.batch_set_v1 = refuse_k2
        with pytest.raises(kvo.PartialWriteError) as caught:
            asyncio.run(store.put(["k1", "k2", "k3"], pages))
        assert caught.value.stored == (True, False, True)
        assert store.pages_written == 2
        assert asyncio.run(store.get(["k1", "k2", "k3"])) == [pages[0], None, pages[2]]
        assert asyncio.run(store.exists_prefix(["k1", "k2", "k3"])) == 1


def test_the_file_format_fallback_says_which_pages_of_a_batch_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F34 on the fallback writer (no SGLang storage object): the second page's rename
    into place fails (ENOSPC, scripted); the first page is written, and the
    PartialWriteError says so page by page."""
    import errno

    pool = real_pool("mha")
    tensors = engine_kv_tensors(pool, PS)[1]
    pages = [b"".join(t[p].numpy().tobytes() for t in tensors) for p in (1, 2, 3)]
    fallback = sglang_storage(
        "file", {"file_storage_path": str(tmp_path)}, MODEL, 0, 1, "page_first", pool, page_size=PS
    )
    assert isinstance(fallback, SGLangFileFormat)
    real_replace = os.replace

    def full_at_k2(src: str, dst: str) -> None:
        if dst == fallback.path("k2"):
            raise OSError(errno.ENOSPC, "No space left on device (scripted)")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_at_k2)
    with pytest.raises(kvo.PartialWriteError) as caught:
        asyncio.run(fallback.put(["k1", "k2", "k3"], pages))
    assert caught.value.stored == (True, False, False)
    assert asyncio.run(fallback.get(["k1"])) == pages[:1]


def test_zero_copy_backends_are_sglangs_own_list() -> None:
    """The backends written with ``batch_set_v1`` are those SGLang 0.5.23's controller
    picks its zero-copy page functions for (read from its source)."""
    from sglang.srt.managers.cache_controller import HiCacheController

    src = inspect.getsource(HiCacheController.attach_storage_backend)
    listed = src[src.index("in [") + 4 : src.index("]", src.index("in ["))]
    names = tuple(n.strip().strip('"') for n in listed.split(",") if n.strip())
    assert names == ZERO_COPY_BACKENDS


def test_a_host_pool_sglang_cannot_build_here_falls_back_for_file_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where SGLang's host pool cannot be built (SGLang pins it: a CPU-only machine has no
    CUDA for that), the ``file`` backend writes HiCacheFile's format itself; a backend
    kvoffload cannot write without SGLang's objects is refused, naming it and why."""
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as hpa

    def no_cuda(**_: Any) -> Any:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(hpa, "build_kv_host_pool", no_cuda)
    pool = real_pool("mla")
    with published("page_first"):
        store = sglang_storage(
            "file", {"file_storage_path": str(tmp_path)}, MODEL, 0, 1, None, pool, page_size=PS
        )
        assert isinstance(store, SGLangFileFormat) and store.suffix == "_org-tiny"
        with pytest.raises(kvo.ConfigError, match=r"mooncake.*CUDA"):
            sglang_storage("mooncake", None, MODEL, 0, 1, "page_first", pool, page_size=PS)


@pytest.mark.parametrize("backend", ["file", "dynamic"])
def test_a_chunk_larger_than_the_staging_pool_goes_out_in_parts(backend: str, tmp_path: Path) -> None:
    """The staging host pool holds about one stride of pages: a larger chunk (a tail
    flushed at finish) is staged and written in parts, every page confirmed, and read
    back (kvoffload's fetch path through SGLang's reads) byte for byte."""
    import sglang_indexed_store as ix

    extra: dict[str, Any] = {"file_storage_path": str(tmp_path)}
    if backend == "dynamic":
        extra = {"backend_name": "indexed", "module_path": "sglang_indexed_store",
                 "class_name": "IndexedStore", "interface_v1": 1, "store": "parts"}  # fmt: skip
        ix.STORES.pop("parts", None)
        ix.WRITES["parts"] = 0
    with published("page_first"):
        pool = real_pool("mha")
        tensors = engine_kv_tensors(pool, PS)[1]
        for t in tensors:
            t.copy_(torch.randn_like(t))
        pages = [b"".join(t[p].numpy().tobytes() for t in tensors) for p in range(1, 12)]
        keys = [f"k{p}" for p in range(len(pages))]
        store = sglang_storage(backend, extra, MODEL, 0, 1, "page_first", pool, page_size=PS, staging_pages=1)
        assert isinstance(store, SGLangHiCacheStorage)
        room = store.host_pool.available_size() // PS
        assert room < len(pages)
        asyncio.run(store.put(keys, pages))
        assert store.pages_written == len(pages)
        assert asyncio.run(store.exists_prefix(keys)) == len(pages)
        assert asyncio.run(store.get(keys)) == pages
        bufs = [memoryview(bytearray(len(p))) for p in pages]
        assert asyncio.run(store.get_into(keys, bufs)) == len(pages)
        assert [bytes(b) for b in bufs] == pages


def test_importing_the_storage_modules_imports_no_sglang() -> None:
    """``kvoffload.integrations.sglang_storage`` and ``sglang_format`` import SGLang only
    when SGLang's storage is built (here, where SGLang is installed)."""
    import subprocess
    import sys

    code = (
        "import sys, kvoffload.integrations.sglang_storage, kvoffload.integrations.sglang_format; "
        "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; "
        "print(bad); assert not bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
