"""The SGLang environment itself: SGLang's real classes import here (CI's SGLang run
sets ``KVOFFLOAD_REQUIRE_SGLANG=1``, so this fails there instead of skipping)."""

from __future__ import annotations

import sglang_cpu

sglang_cpu.require()


def test_real_sglang_classes_import_on_the_cpu() -> None:
    """The classes the real-class tests build are SGLang 0.5.23's own, not stand-ins."""
    import importlib.metadata as md
    import inspect

    from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    assert md.version("sglang") == sglang_cpu.SGLANG_VERSION
    for cls in (DecodeKVCacheOffloadManager, Req, MHATokenToKVPool, ReqToTokenPool):
        assert "site-packages/sglang/" in inspect.getfile(cls), cls
    import torchvision  # the one stub (sglang_cpu.STUBBED)

    assert torchvision.__version__ == "0.0.0"
