"""One TP rank of a decode node whose kvoffload drop-in stores into SGLang's own L3
storage, on SGLang's real objects (sglang_real), then SGLang's HiCacheFile of that rank
reading the pages back into SGLang's real host pool (imported by name in the rank
processes of ``kvoffload.testing.LocalRanks``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import sglang_cpu

sglang_cpu.install()

import torch  # noqa: E402

PS = 4
MODEL = "org/tiny"


def unpin() -> None:
    """Fake (this process only): SGLang's build_kv_host_pool pins its host pool, which
    needs CUDA; the host pool classes it picks are built with ``pin_memory=False``."""
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as hpa

    def unpinned(cls: type) -> type:
        class Unpinned(cls):  # type: ignore[valid-type, misc]
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, pin_memory=False, **kw)

        Unpinned.__name__ = cls.__name__
        return Unpinned

    if not getattr(hpa, "_kvoffload_unpinned", False):
        pick = hpa.get_mha_host_pool_cls
        hpa.get_mha_host_pool_cls = lambda info: unpinned(pick(info))
        hpa.MLATokenToKVPoolHost = unpinned(hpa.MLATokenToKVPoolHost)
        hpa._kvoffload_unpinned = True


def rank_stores_and_reads(ctx: Any, root: str, kind: str) -> dict[str, Any]:
    """This rank's drop-in offloads one request (its own heads' KV under MHA) into
    SGLang's file backend; then SGLang's HiCacheFile of this rank reads every page of it
    into SGLang's host pool. Returns the file names this rank wrote, how many pages
    SGLang read back, and whether they held this rank's KV byte for byte."""
    import sglang_real as sr
    from sglang.srt import runtime_context as rc
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool

    unpin()
    extra = {"file_storage_path": root}
    with sr.engine(
        page_size=PS,
        kv=kind,
        hicache_storage_backend="file",
        hicache_storage_backend_extra_config=json.dumps(extra),
        hicache_mem_layout="page_first",
        served_model_name=MODEL,
    ) as eng:
        rc.get_parallel().override_permanently(pp_rank=0, attn_cp_rank=0, attn_dcp_rank=0)
        try:
            eng.shard = ctx.rank if kind == "mha" else 0
            mgr = eng.manager(tp_group=ctx.group, backend="cpu", host_pages=32, drain_timeout_s=20.0)
            req = eng.new_req("a", [1, 2, 3], max_new_tokens=14)
            eng.admit(req)
            while not req.finished():
                eng.step(mgr, [req])
            deadline = time.monotonic() + 60.0
            mgr.drain_before_retraction()
            while mgr.ongoing_offload:
                assert time.monotonic() < deadline, "never settled"
                mgr.check_offload_progress()
                mgr.manager.wait_progress(0.05)
            written = mgr.manager.storage.describe()["pages_written"]
            mgr.release_host_resources()
            torch.distributed.barrier(group=ctx.group)  # both ranks' files are there
            tokens = eng.tokens(req)
            keys = sr.page_keys(tokens, PS)
            config = HiCacheStorageConfig(
                tp_rank=ctx.rank,
                tp_size=2,
                pp_rank=0,
                pp_size=1,
                attn_cp_rank=0,
                attn_cp_size=1,
                is_mla_model=kind == "mla",
                enable_storage_metrics=False,
                is_page_first_layout=True,
                model_name=MODEL,
                extra_config=extra,
            )
            theirs = HiCacheFile(config)
            host = build_kv_host_pool(kv_pool=eng.kv_pool, page_size=PS, use_mla=kind == "mla")
            rows = list(host.data_refs) if kind == "mla" else [
                r for pair in zip(host.k_data_refs, host.v_data_refs, strict=True) for r in pair
            ]  # fmt: skip
            idx = host.alloc(len(keys) * PS)
            read = 0
            for p, key in enumerate(keys):
                flat = theirs.get(key, host.get_dummy_flat_data_page())
                if flat is None:
                    break
                host.set_from_flat_data_page(int(idx[p * PS]), flat)
                read += 1
            got = b"".join(
                torch.stack([ref[int(idx[pos])] for pos in range(read * PS)])
                .view(torch.uint8)
                .numpy()
                .tobytes()
                for ref in rows
            )
            same = got == eng.expected_kv_bytes(tokens, 0, read * PS)
            return {
                "written": written,
                "files": sorted(os.listdir(root)),
                "read": read,
                "pages": len(keys),
                "same": same,
            }
        finally:
            rc.get_parallel().clear_stamp()
