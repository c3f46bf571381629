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
        ({"watchdog_interval_s": 0}, "watchdog_interval_s must be > 0"),
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
