"""OffloadConfig: the sizes and policies of one manager, validated at construction."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from kvoffload.errors import ConfigError

__all__ = ["MAX_TP_WINDOW", "MIN_WATCHDOG_INTERVAL_S", "OffloadConfig", "physical_memory"]

#: Bytes per element of each dtype a pool may have.
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "uint8": 1, "int8": 1, "int32": 4}
_DTYPES = tuple(_ITEMSIZE)
#: The watchdog looks at most this often: an idle manager must not spin (1 ms).
MIN_WATCHDOG_INTERVAL_S = 1e-3
#: Largest ``tp_window``: the collective of every poll carries two slots per transfer.
MAX_TP_WINDOW = 4096


def physical_memory() -> int | None:
    """Bytes of RAM on this machine (``None`` where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _number(v: object) -> bool:
    """A real number: an int or float, not a bool (``True`` is an int to Python)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Sizes and policies of an :class:`~kvoffload.OffloadManager`.

    Every field is checked at construction; a bad value raises
    :class:`~kvoffload.ConfigError` naming the field, the value and what is allowed.
    """

    page_size: int
    """Tokens per page (device and host pages are the same size)."""
    stride: int
    """Committed tokens per chunk: a chunk is submitted once ``stride`` new tokens are
    committed beyond the last submitted one. A multiple of ``page_size``."""
    device_pages: int | None
    """Pages in kvoffload's own device pool (owned mode: simulation and tests), or
    ``None``: engine-owned mode - the engine owns the KV memory and its page ids,
    passes its KV tensors as ``device_kv=`` and its page ids with ``admit(pages=)`` and
    ``extend(pages=)``; kvoffload allocates and frees no device memory."""
    host_pages: int
    """Pages in the host (pinned) staging pool."""
    kv_shape: tuple[int, ...] = (8,)
    """Owned mode: elements of KV per token (all layers, K and V); a page is
    ``(page_size, *kv_shape)``. Engine-owned mode takes a page's layout from ``device_kv``."""
    dtype: str = "float16"
    """Owned mode: torch dtype name of the KV pages."""
    offload_prompt: bool = False
    """Offload the prompt's page-aligned part too (as the first chunk). By default the
    prefill side is taken to have stored it already. A ``bool``: ``"no"`` is refused."""
    on_host_full: Literal["drop", "wait"] = "drop"
    """When the host pool has no room for a chunk: ``"drop"`` counts a drop and retries
    one stride later; ``"wait"`` defers the chunk until host pages return, for at most
    ``host_wait_s`` seconds (and ``host_wait_polls`` polls, when set), then counts a
    drop. Neither ever blocks the caller."""
    host_wait_s: float | None = 1.0
    """Bound of the ``"wait"`` policy, in seconds of the manager's clock; ``None``: no
    bound in time (the chunk waits until host pages return, the manager closes, or
    ``host_wait_polls`` runs out)."""
    host_wait_polls: int | None = None
    """Bound of the ``"wait"`` policy in scheduler steps: a chunk that waited through
    more than this many ``SyncOffloadManager.poll()`` calls is dropped (``None``: no
    bound in steps). The same on every TP rank (every rank makes the same calls),
    whatever the wall clock does. The asyncio manager has no ``poll()`` and refuses it."""
    drain_timeout_s: float | None = 30.0
    """Leaving the manager waits at most this long for in-flight copies (``None``: for ever)."""
    stuck_after_s: float | None = None
    """Watchdog: a copy in flight longer than this is reported (its lifecycle, the
    transfer, its age), once per transfer."""
    watchdog_interval_s: float = 1.0
    """How often the watchdog looks, in seconds (at least 1 ms)."""
    host_zero: bool = False
    """Zero-fill the host pool when it is created (by default its memory is left as the
    allocator gives it: a page is read only after a copy wrote it)."""
    namespace: str | None = None
    """The deployment's namespace (a model, a LoRA adapter, a tenant): every chain,
    ``lookup`` and ``fetch`` of the manager is seeded with
    ``namespace_seed(extra_key=namespace)`` unless the call passes its own
    ``chain_seed``. Managers of other namespaces on the same store never see these
    pages (FAILURES F22). ``None``: unseeded chains, SGLang's keys for requests without
    an ``extra_key``."""
    tp_size: int | None = None
    """Tensor parallelism: how many ranks the manager's ``group`` must have
    (``SyncOffloadManager(group=)``). ``None``: any group, or none. Set it to the
    engine's TP degree and a manager built without a group, or with a group of another
    size, is refused instead of delivering on its own (FAILURES F25)."""
    tp_keys: Literal["rank", "shared"] = "rank"
    """Tensor parallelism: the storage key space. ``"rank"`` (the default, right for any
    model): each rank copies and stores its own shard of a page under its own key, the
    page key suffixed ``_<rank>_<size>`` (the TP part of SGLang HiCacheFile's suffix);
    ``lookup`` and ``fetch`` count a page only when every rank has its shard.
    ``"shared"``: the KV is the same on every rank (MLA): group rank 0 copies and
    writes, the others copy nothing, and every rank reads the unsuffixed keys. Without
    a group this has no effect."""
    tp_timeout_s: float = 300.0
    """Tensor parallelism: seconds one collective waits for the other ranks before
    raising :class:`~kvoffload.RankTimeout` (a rank died or stopped polling). Finite:
    nothing waits for ever."""
    tp_window: int = 64
    """Tensor parallelism: how many of the oldest in-flight copies (and of the oldest
    storage writes) the ranks agree on in one poll. The collective carries
    ``2 * tp_window + 14`` int64; completions beyond the window wait for a later poll."""

    def __post_init__(self) -> None:
        for name in ("page_size", "stride", "device_pages", "host_pages"):
            value = getattr(self, name)
            if name == "device_pages" and value is None:
                continue  # engine-owned mode
            if type(value) is not int or value <= 0:
                allowed = (
                    "a positive int, or None (engine-owned)" if name == "device_pages" else "a positive int"
                )
                raise ConfigError(f"{name} must be {allowed}, got {value!r}")
        if self.stride % self.page_size:
            raise ConfigError(f"stride ({self.stride}) must be a multiple of page_size ({self.page_size})")
        if self.stride // self.page_size > self.host_pages:
            raise ConfigError(
                f"a stride is {self.stride // self.page_size} pages but host_pages is "
                f"{self.host_pages}: one chunk could never fit"
            )
        if (
            not isinstance(self.kv_shape, tuple)
            or not self.kv_shape
            or any(type(d) is not int or d <= 0 for d in self.kv_shape)
        ):
            raise ConfigError(f"kv_shape must be a non-empty tuple of positive ints, got {self.kv_shape!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("offload_prompt", "host_zero"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.on_host_full not in ("drop", "wait"):
            raise ConfigError(f"on_host_full must be 'drop' or 'wait', got {self.on_host_full!r}")
        if self.host_wait_s is not None and (
            not _number(self.host_wait_s) or not math.isfinite(self.host_wait_s) or self.host_wait_s < 0
        ):
            raise ConfigError(f"host_wait_s must be a finite number >= 0 or None, got {self.host_wait_s!r}")
        hwp = self.host_wait_polls
        if hwp is not None and (type(hwp) is not int or hwp < 0):
            raise ConfigError(f"host_wait_polls must be None or an int >= 0, got {hwp!r}")
        v = self.watchdog_interval_s
        if not _number(v) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"watchdog_interval_s must be a finite number >= 0, got {v!r}")
        if self.watchdog_interval_s < MIN_WATCHDOG_INTERVAL_S:
            raise ConfigError(  # a shorter one makes an idle manager's watchdog spin
                f"watchdog_interval_s must be >= {MIN_WATCHDOG_INTERVAL_S} (1 ms), "
                f"got {self.watchdog_interval_s!r}"
            )
        for name in ("drain_timeout_s", "stuck_after_s"):
            v = getattr(self, name)
            if v is not None and (not _number(v) or v < 0 or math.isnan(v)):
                raise ConfigError(f"{name} must be None or a number >= 0, got {v!r}")
        if self.namespace is not None and (not isinstance(self.namespace, str) or not self.namespace):
            raise ConfigError(f"namespace must be a non-empty str or None, got {self.namespace!r}")
        if self.namespace is not None:
            try:
                self.namespace.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ConfigError(f"namespace is not encodable as UTF-8: {exc}") from None
        self._check_tp()
        ram = physical_memory()
        for name in ("device_pages", "host_pages") if self.device_pages is not None else ("host_pages",):
            size = getattr(self, name) * self.page_bytes
            if ram is not None and size > ram:  # refused before torch tries (and the OOM killer acts)
                raise ConfigError(
                    f"{name}={getattr(self, name)} is a pool of {size:,} bytes ({self.page_bytes:,} bytes a "
                    f"page), more than this machine's {ram:,} bytes of RAM"
                )

    def _check_tp(self) -> None:
        if self.tp_size is not None and (type(self.tp_size) is not int or self.tp_size < 1):
            raise ConfigError(f"tp_size must be None or an int >= 1, got {self.tp_size!r}")
        if self.tp_keys not in ("rank", "shared"):
            raise ConfigError(
                f"tp_keys must be 'rank' (each rank stores its shard under its own keys) or 'shared' "
                f"(KV identical on every rank, e.g. MLA: rank 0 writes, all read), got {self.tp_keys!r}"
            )
        v = self.tp_timeout_s
        if not _number(v) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"tp_timeout_s must be a finite number > 0 (nothing waits for ever), got {v!r}")
        w = self.tp_window
        if type(w) is not int or not 1 <= w <= MAX_TP_WINDOW:
            raise ConfigError(f"tp_window must be an int between 1 and {MAX_TP_WINDOW}, got {w!r}")

    @property
    def engine_owned(self) -> bool:
        """Whether the engine owns the device memory (``device_pages=None``)."""
        return self.device_pages is None

    @property
    def page_bytes(self) -> int:
        """Owned mode: bytes of one page, ``page_size * prod(kv_shape) * itemsize(dtype)``
        (engine-owned mode: ``EnginePages.page_bytes`` of the engine's tensors)."""
        return self.page_size * math.prod(self.kv_shape) * _ITEMSIZE[self.dtype]

    @property
    def stride_pages(self) -> int:
        """Pages per full stride."""
        return self.stride // self.page_size
