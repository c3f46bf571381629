"""OffloadConfig refuses bad values with a ConfigError that names the field."""

from __future__ import annotations

from typing import Any

import pytest

import kvoffload as kvo

GOOD: dict[str, Any] = dict(page_size=4, stride=8, device_pages=16, host_pages=16)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"stride": 6}, "multiple of page_size"),
        ({"page_size": 0}, "page_size must be a positive int"),
        ({"page_size": -4}, "page_size must be a positive int"),
        ({"stride": 0}, "stride must be a positive int"),
        ({"device_pages": 0}, "device_pages must be a positive int"),
        ({"host_pages": -1}, "host_pages must be a positive int"),
        ({"host_pages": 1}, "one chunk could never fit"),
        ({"page_size": 2.0}, "page_size must be a positive int"),
        ({"dtype": "float64x"}, "dtype must be one of"),
        ({"kv_shape": (0,)}, "kv_shape"),
        ({"on_host_full": "block"}, "on_host_full"),
        ({"host_wait_s": -1}, "host_wait_s"),
        ({"drain_timeout_s": -1}, "drain_timeout_s"),
        ({"watchdog_interval_s": 0}, "watchdog_interval_s must be >= 0.001"),
        ({"watchdog_interval_s": 1e-12}, "watchdog_interval_s must be >= 0.001"),
        ({"watchdog_interval_s": float("inf")}, "watchdog_interval_s must be a finite number"),
        ({"offload_prompt": "no"}, "offload_prompt must be True or False, got 'no'"),
        ({"offload_prompt": 1}, "offload_prompt must be True or False"),
        ({"host_wait_s": True}, "host_wait_s must be a finite number"),
        ({"host_wait_polls": -1}, "host_wait_polls must be None or an int >= 0"),
        ({"host_wait_polls": 2.0}, "host_wait_polls must be None or an int >= 0"),
        ({"drain_timeout_s": False}, "drain_timeout_s must be None or a number"),
        ({"namespace": ""}, "namespace must be a non-empty str or None"),
        ({"namespace": b"lora"}, "namespace must be a non-empty str or None"),
        ({"namespace": "\ud800"}, "namespace is not encodable as UTF-8"),
    ],
)
def test_bad_config_raises_config_error_naming_the_field(change: dict[str, Any], words: str) -> None:
    with pytest.raises(kvo.ConfigError, match=words):
        kvo.OffloadConfig(**{**GOOD, **change})


def test_good_config() -> None:
    cfg = kvo.OffloadConfig(**GOOD)
    assert cfg.stride_pages == 2
    assert isinstance(kvo.ConfigError("x"), ValueError)


def test_unknown_backend_and_storage_are_config_errors() -> None:
    cfg = kvo.OffloadConfig(**GOOD)
    with pytest.raises(kvo.ConfigError, match="unknown backend 'gpu'"):
        kvo.OffloadManager(cfg, backend="gpu")
    with pytest.raises(kvo.ConfigError, match="unknown storage"):
        kvo.OffloadManager(cfg, storage=42)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["device_pages", "host_pages"])
def test_a_pool_larger_than_the_machine_is_refused_with_its_byte_count(field: str) -> None:
    """A pool that could never be allocated is a ConfigError naming the field and the
    pool's size in bytes, raised by the config, before torch tries (and the OOM killer
    acts): no manager, no tensor."""
    from kvoffload.config import physical_memory

    ram = physical_memory()
    if ram is None:
        pytest.skip("this OS does not report its RAM (os.sysconf)")
    pages = ram // 4096 + 1  # pages of 4096 bytes: one page more than the machine has
    change = {field: pages, "kv_shape": (1024,), "dtype": "float32", "page_size": 1, "stride": 1}
    with pytest.raises(kvo.ConfigError, match=rf"{field}={pages} is a pool of {pages * 4096:,} bytes"):
        kvo.OffloadConfig(**{**GOOD, **change})


def test_page_bytes_and_namespace_are_kept() -> None:
    cfg = kvo.OffloadConfig(**GOOD, kv_shape=(3, 5), dtype="bfloat16", namespace="lora-a")
    assert cfg.page_bytes == 4 * 15 * 2
    assert cfg.namespace == "lora-a"


def test_the_asyncio_manager_refuses_a_wait_bounded_in_polls() -> None:
    """``host_wait_polls`` counts ``SyncOffloadManager.poll()`` calls; the asyncio manager
    has none: refused by name at construction."""
    from kvoffload.testing import SimBackend

    cfg = kvo.OffloadConfig(
        page_size=4, stride=4, device_pages=8, host_pages=8, on_host_full="wait", host_wait_polls=3
    )
    with pytest.raises(kvo.ConfigError, match="host_wait_polls is 3"):
        kvo.OffloadManager(cfg, backend=SimBackend())
    kvo.SyncOffloadManager(cfg, backend=SimBackend())  # the sync manager counts its polls
