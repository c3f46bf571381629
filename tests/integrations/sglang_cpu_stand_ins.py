"""What SGLang 0.5.23's own decode offload manager needs on this CPU machine beyond
its real code: two stand-ins, each for something that only runs on a GPU.

SGLang's real ``DecodeKVCacheOffloadManager.__init__`` runs here unchanged: it reads
the published ``runtime_context`` (``get_schedule().page_size``, ``get_memory()``'s
hicache settings, ``get_serving().served_model_name``), asks
``torch.distributed.get_world_size(group=tp_group)`` (a gloo group of one on
127.0.0.1), builds its host pool with SGLang's ``build_kv_host_pool`` and a real
``HiCacheController`` with a real ``HiCacheFile`` storage backend and its backup
thread. ``torch.cpu.Stream`` / ``torch.cpu.Event`` (what SGLang's
``get_device_module()`` returns without an accelerator) exist in torch's CPU build, so
no stream or event is faked: on the CPU they do nothing, and the device-to-host copy
runs synchronously inside ``HiCacheController.write()``.

What does not run on a CPU, found by building it (facts, SGLang 0.5.23, torch 2.13 cpu):

1. **Pinned host memory.** ``build_kv_host_pool`` builds ``MHATokenToKVPoolHost`` /
   ``MLATokenToKVPoolHost`` with their default ``pin_memory=True``; the buffer is then
   registered with ``cudaHostRegister`` (``pool_host/common.py``
   ``_cuda_host_register`` -> ``torch.cuda.cudart()``): ``AssertionError: Torch not
   compiled with CUDA enabled``. (``torch.empty(..., pin_memory=True)`` fails the same
   way: "no pinned memory allocator is available".) Stand-in: the same two
   ``__init__`` functions with ``pin_memory`` defaulting to False (SGLang's own
   parameter; the code object is SGLang's, only the default differs), so the host
   pool is pageable CPU memory.
2. **The copy kernels.** SGLang's host pools copy device KV to host with
   ``sgl_kernel.kvcacheio`` ops (CUDA kernels), imported only when
   ``is_cuda() or is_hip()``: on a CPU the names are never bound and the first
   ``HiCacheController.write()`` raises ``NameError``. Stand-ins: the ops the
   device-to-host path calls, written with ``ctypes.memmove`` over the same pointer
   tables and byte strides the kernels take (``item_size``, ``dst_layout_dim``), or
   torch indexing for ``transfer_kv_direct``; bound into ``pool_host.mha`` /
   ``pool_host.mla`` where SGLang's code looks them up. Their signatures are
   sgl_kernel's Python wrappers' (``sgl-kernel/python/sgl_kernel/kvcacheio.py``;
   sgl_kernel itself is not installable here) and every call SGLang's host pools
   make to them binds to them (``test_sglang_side_by_side``). Load kernels (host to
   device) are not provided: the decode offload path never loads.

:func:`install` puts both in place (idempotent) and :data:`STAND_INS` lists them.
"""

from __future__ import annotations

import ctypes
import types
from typing import Any

import torch

#: (what, why) for each stand-in; printed by the side-by-side summary.
STAND_INS: tuple[tuple[str, str], ...] = (
    (
        "MHATokenToKVPoolHost/MLATokenToKVPoolHost.__init__ pin_memory default False",
        "pinning calls cudaHostRegister (torch.cuda.cudart()): no CUDA in torch's CPU build",
    ),
    (
        "sgl_kernel.kvcacheio transfer_kv_all_layer{,_lf_pf,_mla,_mla_lf_pf}, transfer_kv_direct",
        "CUDA kernels; SGLang binds them only on CUDA/ROCm, so on a CPU the names do not exist",
    ),
)

#: The copy ops provided (device to host, every layer at once).
KERNEL_NAMES = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
)

_ORIGINAL_INITS: dict[type, Any] = {}


def _ptrs(table: torch.Tensor) -> list[int]:
    return [int(p) for p in table.tolist()]


def _memmove_rows(
    dst_base: list[int],
    dst_stride: int,
    dst_layer_offset: int,
    src_base: list[int],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
) -> None:
    """The kernels' byte copy: for each layer and token, ``item_size`` bytes from row
    ``src`` of the layer's source buffer to row ``dst`` of the destination."""
    pairs = list(zip(src_indices.tolist(), dst_indices.tolist(), strict=True))
    for layer in range(num_layers):
        src = src_base[layer]
        dst = dst_base[0 if len(dst_base) == 1 else layer] + layer * dst_layer_offset
        for s, d in pairs:
            ctypes.memmove(dst + int(d) * dst_stride, src + int(s) * item_size, item_size)


# The signatures below are sgl_kernel's (kvcacheio.py); block_quota / num_warps_per_block
# only tune the CUDA launch.


def transfer_kv_all_layer(
    src_k_layers: torch.Tensor,
    dst_k_layers: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """Layer-first to layer-first (pointer tables on both sides)."""
    for src, dst in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        _memmove_rows(_ptrs(dst), item_size, 0, _ptrs(src), src_indices, dst_indices, item_size, num_layers)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """Layer-first device rows to a page-first host buffer: token ``d``'s layer ``l``
    lands at ``d * dst_layout_dim + l * item_size`` bytes."""
    for src, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        _memmove_rows(
            [dst.data_ptr()],
            dst_layout_dim,
            item_size,
            _ptrs(src),
            src_indices,
            dst_indices,
            item_size,
            num_layers,
        )


def transfer_kv_all_layer_mla(
    src_layers: torch.Tensor,
    dst_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """MLA, layer-first to layer-first."""
    _memmove_rows(
        _ptrs(dst_layers), item_size, 0, _ptrs(src_layers), src_indices, dst_indices, item_size, num_layers
    )


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """MLA, layer-first device rows to a page-first host buffer."""
    _memmove_rows(
        [dst.data_ptr()],
        dst_layout_dim,
        item_size,
        _ptrs(src_layers),
        src_indices,
        dst_indices,
        item_size,
        num_layers,
    )


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """The ``direct`` io backend: each layer's rows ``src_indices`` into ``dst_indices``
    (``page_size`` only lets the kernel copy whole pages at once)."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


def _unpinned(init: Any) -> Any:
    """``init`` (SGLang's function, its code object and closure) with ``pin_memory``
    defaulting to False instead of True."""
    import inspect

    names = list(inspect.signature(init).parameters)
    positional = init.__code__.co_argcount
    defaults = list(init.__defaults__ or ())
    first_default = positional - len(defaults)
    i = names.index("pin_memory")
    assert first_default <= i < positional, "pin_memory is not a positional parameter with a default"
    assert defaults[i - first_default] is True
    defaults[i - first_default] = False
    new = types.FunctionType(
        init.__code__, init.__globals__, init.__name__, tuple(defaults), init.__closure__
    )
    new.__kwdefaults__ = init.__kwdefaults__
    new.__qualname__ = init.__qualname__
    new.__doc__ = init.__doc__
    new.__module__ = init.__module__
    new.__annotations__ = init.__annotations__
    return new


def host_pool_classes() -> tuple[type, ...]:
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return (MHATokenToKVPoolHost, MLATokenToKVPoolHost)


def original_init(cls: type) -> Any:
    """SGLang's own ``cls.__init__`` (before :func:`install`)."""
    return _ORIGINAL_INITS.get(cls, cls.__init__)


def install() -> None:
    """Put the stand-ins in place (idempotent). Call after ``sglang_cpu.install()``."""
    if torch.cuda.is_available():  # a GPU: SGLang's own kernels and pinned memory run
        return
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.srt.mem_cache.pool_host.mla as mla

    for cls in host_pool_classes():
        if cls not in _ORIGINAL_INITS:
            _ORIGINAL_INITS[cls] = cls.__init__
            cls.__init__ = _unpinned(cls.__init__)  # type: ignore[misc]
    for module in (mha, mla):
        for name in KERNEL_NAMES:
            setattr(module, name, globals()[name])
