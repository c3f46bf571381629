"""A redis-server child process on a loopback port, for the tests that need Redis."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_ping(host: str, port: int) -> bool:
    """Whether a Redis server answers PING at host:port (a raw RESP round trip)."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A ``redis-server`` child process on a loopback port, without persistence."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        assert REDIS_SERVER is not None
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None
        assert REDIS_SERVER is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port)]
        argv += ["--save", "", "--appendonly", "no"]  # no persistence: a stop loses the data
        argv += ["--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):  # bounded: at most ~10 s
            if redis_ping("127.0.0.1", self.port):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        log = (self.workdir / "redis.log").read_text() if (self.workdir / "redis.log").exists() else ""
        raise RuntimeError(f"redis-server did not come up on port {self.port}: {log[-2000:]}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s); its data is gone."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
