"""Local tensor-parallel ranks: ``size`` spawned processes joined in one gloo process
group, each running the functions it is sent. What the multi-rank tests, the TP
benchmark and ``kvoffload simulate --tp`` run on.

The group is rendezvoused over a loopback port found free at run time. Every wait is
bounded: a rank that does not answer within the timeout, or dies, is reported and the
ranks are stopped (by their process ids), never waited for for ever.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LocalRanks", "RankContext", "RankOutcome", "RanksFailed", "free_port"]

#: Seconds a rank may take to start (import torch, join the group).
_START_S = 120.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class RankContext:
    """What a function run on a rank gets first: its rank, the group's size, and the
    group (``torch.distributed.group.WORLD``, a gloo group)."""

    rank: int
    size: int
    group: Any


@dataclass(frozen=True)
class RankOutcome:
    """One rank's answer to :meth:`LocalRanks.outcomes`: ``ok`` and ``value``, or the
    ``error`` (the rank's traceback, or how it died)."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""


class RanksFailed(AssertionError):
    """A function raised on a rank, a rank died, or a rank did not answer in time."""


def _rank_main(rank: int, size: int, port: int, conn: Any, timeout_s: float) -> None:
    """A rank's process: join the group, then run what arrives until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the ranks, by pid
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        ctx = RankContext(rank, size, dist.group.WORLD)
    except BaseException as exc:
        conn.send(("error", "".join(traceback.format_exception(exc))))
        os._exit(1)
    conn.send(("ok", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if msg is None:
            break
        fn, args = msg
        try:
            reply = ("ok", fn(ctx, *args))
        except BaseException as exc:
            reply = ("error", "".join(traceback.format_exception(exc)))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            break
    conn.close()
    os._exit(0)  # no teardown of a group whose peers may be gone: it could wait on them


class LocalRanks:
    """``size`` local ranks in one gloo group. ``run(fn, *args)`` calls
    ``fn(RankContext, *args)`` on every rank at once and returns their values, rank
    order; ``fn`` must be importable by name (a module-level function). Use as a
    context manager, or :meth:`close`.

    ``timeout_s`` bounds each :meth:`run` (and is the group's own timeout). A rank that
    dies or overruns makes the ranks ``broken``: they are stopped and later runs raise.
    """

    def __init__(self, size: int, *, timeout_s: float = 60.0) -> None:
        if type(size) is not int or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self.size = size
        self.timeout_s = timeout_s
        self.broken = False
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, size, port, child, timeout_s), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        started = self._collect(_START_S)
        if not all(o.ok for o in started):
            self.close()
            raise RanksFailed("local ranks did not start:\n" + _describe(started))

    def outcomes(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[RankOutcome]:
        """Run ``fn(ctx, *args)`` on every rank; each rank's outcome, value or error.
        Raises :class:`RanksFailed` only when the ranks are broken already."""
        if self.broken:
            raise RanksFailed("these ranks are broken (a rank died or overran); start new ones")
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(self.timeout_s if timeout is None else timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; their values, in rank order. Raises
        :class:`RanksFailed` with every rank's error when one failed."""
        out = self.outcomes(fn, *args, timeout=timeout)
        if not all(o.ok for o in out):
            raise RanksFailed(f"{getattr(fn, '__name__', fn)} failed:\n" + _describe(out))
        return [o.value for o in out]

    def _collect(self, timeout: float) -> list[RankOutcome]:
        deadline = time.monotonic() + timeout
        out = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True)):
            left = max(0.0, deadline - time.monotonic())
            try:
                ready = conn.poll(left)
                status, value = conn.recv() if ready else ("error", f"no answer within {timeout}s")
            except (EOFError, OSError):
                proc.join(1.0)
                status, value = "error", f"rank {rank} died ({_exit_text(proc.exitcode)})"
            if status == "ok":
                out.append(RankOutcome(rank, True, value))
            else:
                self.broken = self.broken or not proc.is_alive() or value.startswith("no answer")
                out.append(RankOutcome(rank, False, error=value))
        if self.broken:
            self._stop()
        return out

    def _stop(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)

    def close(self) -> None:
        """Tell the ranks to stop, and stop those that do not within a few seconds."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._stop()
        for conn in self._conns:
            conn.close()
        self.broken = True

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        self._stop()  # leaving on an error (a stop signal): the ranks may be mid-run
        self.close()


def _exit_text(code: int | None) -> str:
    """How a rank process ended: ``exit code 3``, or the signal that killed it (gloo
    aborts a process on a collective mismatch: SIGABRT, no Python error)."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _describe(outcomes: list[RankOutcome]) -> str:
    return "\n".join(f"--- rank {o.rank}: {'ok' if o.ok else o.error}" for o in outcomes)
