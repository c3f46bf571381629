"""The vLLM connector's settings: ``kv_connector_extra_config``, checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvoffload.errors import ConfigError

__all__ = ["SETTING_KEYS", "Settings"]


# --- the connector's settings (kv_connector_extra_config) ----------------------------

#: The keys of ``kv_connector_extra_config`` the connector reads (all optional but
#: ``storage``); anything else is refused, so a typo is an error, not a silent default.
SETTING_KEYS = (
    "storage",
    "namespace",
    "host_pages",
    "stride",
    "lookup_timeout_s",
    "io_timeout_s",
    "tp_keys",
    "on_load_error",
    "loads",
)


@dataclass(frozen=True, slots=True)
class Settings:
    """``kv_connector_extra_config``, checked (:meth:`from_extra`)."""

    storage: Any
    """Where pages go: a directory (``"kv-store/"``, ``file://...``), a ``redis://`` URL,
    ``"memory"`` (this process only: a test's), or a :class:`~kvoffload.abc.Storage`."""
    namespace: str | None = None
    """The deployment's namespace (model, tenant): seeds every key (F22)."""
    host_pages: int | None = None
    """Host staging pages per worker, for stores and loads (default: a quarter of
    vLLM's blocks, at least 64, at most 4096 and at most 1 GiB)."""
    stride: int | None = None
    """Tokens per copy while decoding, a multiple of the block size (default one block)."""
    lookup_timeout_s: float = 5.0
    """The most one store lookup (``get_num_new_matched_tokens``) waits: then a miss."""
    io_timeout_s: float = 30.0
    """The most one load's read, or the preemption fence, waits."""
    tp_keys: str = "rank"
    """Under tensor parallelism each rank stores its shard under its own keys."""
    on_load_error: str = "recompute"
    """``"recompute"``: the connector sets vLLM's ``kv_load_failure_policy`` to
    ``"recompute"``, so a failed load costs recompute (F38); ``"fail"``: vLLM's policy
    as configured (its default fails the request)."""
    loads: str = "auto"
    """How a load runs: ``"inline"``, synchronously (``get_num_new_matched_tokens`` says
    ``(n, False)``: vLLM schedules the request in the step that allocates its blocks, and
    each worker reads the store and copies into them in ``start_load_kv``, before that
    step's forward; the first token comes one step after the load, not two),
    ``"thread"``, asynchronously (on a load thread of its own; the request waits in
    vLLM's ``WAITING_FOR_REMOTE_KVS`` until it is reported in ``finished_recving``, and
    the engine's steps go on meanwhile), or ``"auto"``: inline where the KV is in host
    memory (vLLM's CPU build: the read and the copy compete with the forward for the
    same cores anyway, and a load thread's hand-offs of the GIL against a stepping engine
    made one 100 MB load take 1.4 s instead of tens of ms), a thread where it is on a GPU
    (the copy overlaps other requests' forwards)."""

    def sync_loads(self, device_type: str) -> bool:
        """Whether loads are synchronous on an engine whose KV is on ``device_type``
        (vLLM's ``device_config.device_type``: ``"cpu"`` for its CPU build)."""
        return self.loads == "inline" or (self.loads == "auto" and device_type == "cpu")

    @classmethod
    def from_extra(cls, extra: Any) -> Settings:
        """The settings of ``kv_connector_extra_config`` (a mapping); raises
        :class:`~kvoffload.ConfigError` naming a missing, unknown or bad key."""
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
        unknown = sorted(set(extra) - set(SETTING_KEYS))
        if unknown:
            raise ConfigError(
                f"KVOffloadConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known: {list(SETTING_KEYS)}"
            )
        if extra.get("storage") in (None, ""):
            raise ConfigError(
                'KVOffloadConnector needs kv_connector_extra_config={"storage": <a directory or URL>, ...}'
            )
        ns = extra.get("namespace")
        if ns is not None and (not isinstance(ns, str) or not ns):
            raise ConfigError(f"namespace must be a non-empty str or None, got {ns!r}")
        for key in ("host_pages", "stride"):
            v = extra.get(key)
            if v is not None and (type(v) is not int or v <= 0):
                raise ConfigError(f"{key} must be a positive int or None, got {v!r}")
        for key in ("lookup_timeout_s", "io_timeout_s"):
            v = extra.get(key, 5.0)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
                raise ConfigError(f"{key} must be a finite number > 0 (nothing waits for ever), got {v!r}")
        if extra.get("tp_keys", "rank") != "rank":
            raise ConfigError(
                f"tp_keys must be 'rank' (each rank stores its own shard), got {extra['tp_keys']!r}"
            )
        if extra.get("on_load_error", "recompute") not in ("recompute", "fail"):
            raise ConfigError(f"on_load_error must be 'recompute' or 'fail', got {extra['on_load_error']!r}")
        if extra.get("loads", "auto") not in ("auto", "inline", "thread"):
            raise ConfigError(f"loads must be 'auto', 'inline' or 'thread', got {extra['loads']!r}")
        return cls(**{k: extra[k] for k in SETTING_KEYS if k in extra})

    def host_pages_for(self, num_blocks: int, page_bytes: int = 0) -> int:
        """Host pages for stores and loads, given vLLM's number of blocks and the bytes
        of one block (all layers; the scheduler and every worker compute the same)."""
        if self.host_pages is not None:
            return self.host_pages
        n = max(64, min(4096, num_blocks // 4))
        if page_bytes > 0:  # at most 1 GiB of host memory per worker by default
            n = min(n, max(16, (1 << 30) // page_bytes))
        return n
