"""A storage URL's password is never shown (FAILURES F23): not in the simulate summary,
its JSON, repr(), describe(), StorageError messages, nor the storage.failed log lines."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from _storage_helpers import keys_of, pages_of

from kvoffload.errors import ConfigError, StorageError
from kvoffload.storage import resolve_storage
from kvoffload.storage._url import redact, scrub
from kvoffload.storage.redis import RedisStorage

PW_USERINFO = "Hunter2-userinfo"
PW_QUERY = "Hunter2-query"
SECRETS = (PW_USERINFO, PW_QUERY)


def dead_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def secret_urls(host: str, port: int) -> list[str]:
    return [
        f"redis://:{PW_USERINFO}@{host}:{port}/0",
        f"redis://worker:{PW_USERINFO}@{host}:{port}/0?prefix=t23:",
        f"redis://{host}:{port}/0?password={PW_QUERY}&prefix=t23:",
    ]


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{where} shows the password {secret!r}:\n{text}"


@pytest.mark.parametrize("server", ["live", "dead"])
def test_f23_simulate_never_prints_the_password(
    server: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """`kvoffload simulate --store <URL with a password>`, run as a process with the
    store's warnings on: stdout, stderr and the --json report never show the password,
    whether the server refuses the password (live) or cannot be reached (dead); the
    summary still names the store, redacted."""
    if server == "live":
        parts = urlsplit(request.getfixturevalue("clean_redis"))
        host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    else:
        host, port = "127.0.0.1", dead_port()
    for i, url in enumerate(secret_urls(host, port)):
        report = tmp_path / f"report{i}.json"
        argv = [sys.executable, "-m", "kvoffload", "simulate", "--requests", "6", "--prompt-mean", "40"]
        argv += ["--output-mean", "24", "--page-size", "4", "--stride", "8", "--step-ms", "0.2"]
        argv += ["--backend", "sim", "--no-progress", "--log-level", "warning", "--store", url]
        argv += ["--json", str(report)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode in (0, 1), proc.stderr
        assert_no_secret(proc.stdout, "stdout")
        assert_no_secret(proc.stderr, "stderr")
        text = report.read_text()
        assert_no_secret(text, "the JSON report")
        data = json.loads(text)
        assert data["setup"]["store"] == redact(url) and "***" in data["setup"]["store"]
        # A dead server fails every write; a live one without requirepass refuses a user
        # and password (WRONGPASS) and shrugs off a bare password: then nothing fails.
        if server == "dead" or "worker:" in url:
            assert data["pages"]["store_failed"] > 0
            assert "storage.failed" in proc.stdout + proc.stderr  # the log lines were there to check


@pytest.mark.asyncio
async def test_f23_repr_describe_and_errors_hide_the_password() -> None:
    """repr(), describe() and every StorageError of a store whose URL carries a password
    (userinfo or ?password=) show it redacted; so do ConfigErrors about the URL."""
    for url in secret_urls("127.0.0.1", dead_port()):
        s = RedisStorage(url)
        try:
            assert_no_secret(repr(s), "repr")
            assert_no_secret(str(s.describe()), "describe()")
            assert "***" in repr(s) and "***" in s.describe()["url"]
            for call in (s.put(keys_of(1), pages_of(1)), s.get(keys_of(1)), s.exists_prefix(keys_of(1))):
                with pytest.raises(StorageError) as info:
                    await call
                assert_no_secret(str(info.value) + repr(info.value), "StorageError")
        finally:
            await s.aclose()
    with pytest.raises(ConfigError) as bad:
        RedisStorage(f"redis://:{PW_USERINFO}@127.0.0.1:notaport/0?password={PW_QUERY}")
    assert_no_secret(str(bad.value), "ConfigError")
    with pytest.raises(ConfigError) as unknown:
        resolve_storage(f"s3://key:{PW_USERINFO}@bucket/x?token={PW_QUERY}")
    assert_no_secret(str(unknown.value), "ConfigError")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://u:pw@h/0?prefix=a&Password=x&db=1", "redis://u:***@h/0?prefix=a&Password=***&db=1"),
        ("redis://u@h/0", "redis://u@h/0"),
        ("redis://:p?w/d#s@h/0", "redis://:***@h/0"),
        ("unix://:pw@/run/redis.sock?db=0&token=t", "unix://:***@/run/redis.sock?db=0&token=***"),
        ("redis://h/0?password=a#b", "redis://h/0?password=***#***"),
        ("redis://[::1/0?password=z", "redis://***"),
        ("/var/kv", "/var/kv"),
        ("memory", "memory"),
    ],
)
def test_redact_masks_passwords_and_secret_parameters(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_scrub_takes_every_form_of_a_secret_out_of_a_message() -> None:
    url = "redis://u:p%40ss@h/0?password=q+q"
    assert scrub("p%40ss p@ss q+q q q", url) == "*** *** *** ***"
