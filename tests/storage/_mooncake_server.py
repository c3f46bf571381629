"""A Mooncake Store on loopback for the tests that need one: ``mooncake_master`` (RPC and
metrics on 127.0.0.1, a short lease, no HTTP metadata server) and, optionally, a
``mooncake_client`` memory server that lends the pool its DRAM (so pages outlive the
clients that wrote them, as in a deployment with memory nodes).

The binaries come with the ``mooncake-transfer-engine-non-cuda`` wheel (the
``kvoffload[mooncake]`` extra); ``MOONCAKE_BIN`` is the folder they are in, or ``None``
when the wheel (or Debian's ``libibverbs1``) is missing, with ``MOONCAKE_MISSING`` the
reason (the tests then skip, or fail under ``KVOFFLOAD_REQUIRE_MOONCAKE=1``: conftest.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from _redis_server import free_port


def _find() -> tuple[Path | None, str]:
    try:
        import mooncake.store  # fails without libibverbs1
    except ImportError as exc:
        return None, f"Mooncake's client cannot be imported ({exc}): pip install 'kvoffload[mooncake]' " + (
            "and apt-get install -y libibverbs1"
        )
    import mooncake

    d = Path(next(iter(mooncake.__path__)))
    if not (d / "mooncake_master").is_file():
        return None, f"mooncake_master is not in {d}"
    return d, ""


MOONCAKE_BIN, MOONCAKE_MISSING = _find()

#: The lease a read takes on an object, in ms (Mooncake's default is 10 s).
LEASE_MS = 200


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class MooncakeServer:
    """A master (and a memory server lending ``memory_mb`` MiB, unless 0) on loopback
    ports; the master may be killed and started again on the same port."""

    def __init__(self, workdir: Path, *, memory_mb: int = 256) -> None:
        assert MOONCAKE_BIN is not None
        self.workdir = workdir
        self.port = free_port()
        self.metrics_port = free_port()
        self.client_port = free_port()
        self.memory_mb = memory_mb
        self.master: subprocess.Popen[bytes] | None = None
        self.memory: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def _wait_listening(self, proc: subprocess.Popen[bytes], port: int, name: str) -> None:
        for _ in range(300):  # bounded: at most ~15 s
            if listening(port):
                return
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        log = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"{name} did not come up on 127.0.0.1:{port}: {log}")

    def start(self) -> None:
        self.start_master()
        if self.memory_mb:
            assert MOONCAKE_BIN is not None
            argv = [str(MOONCAKE_BIN / "mooncake_client"), "--host=127.0.0.1"]
            argv += ["--metadata_server=P2PHANDSHAKE"]
            argv += [f"--master_server_address=127.0.0.1:{self.port}", f"--port={self.client_port}"]
            argv += [f"--global_segment_size={self.memory_mb << 20}", "--protocol=tcp"]
            self.memory = self._spawn("memory", argv)
            self._wait_listening(self.memory, self.client_port, "memory")

    def start_master(self) -> None:
        assert self.master is None and MOONCAKE_BIN is not None
        argv = [str(MOONCAKE_BIN / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}"]
        argv += ["--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}"]
        argv += [f"--default_kv_lease_ttl={LEASE_MS}", "--client_ttl=3", "--rpc_thread_num=2"]
        self.master = self._spawn("master", argv)
        self._wait_listening(self.master, self.port, "master")

    def kill_master(self) -> None:
        """SIGKILL the master (its metadata is gone: a new one knows no page)."""
        proc, self.master = self.master, None
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)

    def pids(self) -> list[int]:
        return [p.pid for p in (self.master, self.memory) if p is not None and p.poll() is None]

    def stop(self) -> None:
        """Close this process's idle clients of this master (while it still answers), then
        stop the memory server and the master."""
        from kvoffload.storage.mooncake import close_clients

        if self.master is not None:
            close_clients(f"127.0.0.1:{self.port}")
        for attr in ("memory", "master"):
            proc = getattr(self, attr)
            setattr(self, attr, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def env_url() -> str | None:
    """The master scripts/mooncake.sh started (``KVOFFLOAD_MOONCAKE_URL``), if any."""
    return os.environ.get("KVOFFLOAD_MOONCAKE_URL") or None


def mooncake_unavailable(reason: str) -> None:
    """Skip a mooncake test, or fail it under ``KVOFFLOAD_REQUIRE_MOONCAKE=1`` (CI). Here,
    not in conftest.py: ``from conftest import`` finds whichever conftest pytest imported
    first when the whole suite runs (tests/vllm has one too)."""
    import pytest

    if os.environ.get("KVOFFLOAD_REQUIRE_MOONCAKE") == "1":
        pytest.fail(f"KVOFFLOAD_REQUIRE_MOONCAKE=1 but {reason}")
    pytest.skip(reason)
