"""``kvoffload simulate`` and ``kvoffload graph``.

``simulate`` plays a seeded synthetic decode workload (:mod:`kvoffload.tools.workload`)
through the scheduler loop (:mod:`kvoffload.tools.scheduler`) on the embedded defaults —
the ``cpu`` backend and the file store in a temporary directory when they are
available, else the ``sim`` backend (the loop completes copies) and the memory
store — shows a progress bar, prints a summary and exits non-zero if the ledger
check fails. ``simulate --tp N`` runs the workload on N local tensor-parallel ranks
(gloo) and also fails unless every rank's ledger balanced and every rank released the
same lifecycles in the same steps. ``graph`` draws the lifecycle from its declaration.

Exit codes: 0 ok; 1 an invariant failed (or a completion did not carry the keys or
KV bytes that the lifecycle it reached committed, or tensor-parallel ranks disagreed
or crashed); 2 bad options, or a workload that could never run (a request that can
never fit the device pool, or a count or duration past its bound: see
:data:`MAX_REQUESTS`, :data:`MAX_TOKENS`, :data:`MAX_STEP_MS`,
:data:`MAX_COPY_DELAY_MS` and :func:`max_tp`; pool sizes are bounded by the
machine's RAM); 3 a missing optional dependency; 130 / 143 stopped by
SIGINT / SIGTERM (FAILURES F27): the run stops promptly (with --tp, its rank
processes too), removes its temporary store, prints one line and no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

__all__ = ["MAX_COPY_DELAY_MS", "MAX_REQUESTS", "MAX_STEP_MS", "MAX_TOKENS", "main", "max_tp"]

EXIT_OK, EXIT_INVARIANT, EXIT_USAGE, EXIT_MISSING = 0, 1, 2, 3
#: The signals that stop a run; each exits 128 + its number (130, 143).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """A stop signal arrived: unwind (every ``finally`` and context exit runs), then exit
    ``128 + signum``. A BaseException, so no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse ``type=``: ``convert`` the text, then insist on ``ok``; the error
    says ``expected <what>`` (argparse turns it into a usage error, exit 2)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


_positive_int = _checked(int, lambda v: v > 0, "a positive integer")
_share = _checked(float, lambda v: 0.0 <= v <= 1.0, "a share between 0 and 1")
_nonneg = _checked(float, lambda v: 0.0 <= v < float("inf"), "a finite number >= 0")

# Bounds of the counts and durations: a typo (--tp 1000000, --requests 1e9) is refused
# with the bound (exit 2) instead of spawning a million processes, planning a billion
# requests or running for ever. Pool sizes are bounded by the machine's RAM (OffloadConfig).
#: --requests: the plan is built in memory, one record a request.
MAX_REQUESTS = 1_000_000
#: --prompt-mean and --output-mean, in tokens (a prompt is a list in memory; its
#: length is drawn up to 4 times the mean).
MAX_TOKENS = 1_000_000
#: --step-ms: one decode step's sleep.
MAX_STEP_MS = 10_000.0
#: --copy-delay-ms: the sim copy engine's mean delay.
MAX_COPY_DELAY_MS = 60_000.0
#: --linger: seconds the metrics endpoint stays up after a run.
MAX_LINGER_S = 86_400.0
_linger_s = _checked(float, lambda v: 0.0 <= v <= MAX_LINGER_S, "seconds >= 0 and at most 86,400")
#: The most ranks --tp may start, whatever the machine.
_MAX_TP_CAP = 64


def max_tp() -> int:
    """The most ranks ``--tp`` may start here: 4 a CPU core (``os.cpu_count()``), at
    most 64. Each rank is a process of its own that imports torch."""
    return min(_MAX_TP_CAP, 4 * (os.cpu_count() or 1))


def _count(maximum: int, what: str = "") -> Callable[[str], Any]:
    """A positive integer of at most ``maximum`` (``what``: why the bound)."""
    why = f" ({what})" if what else ""
    return _checked(int, lambda v: 0 < v <= maximum, f"a positive integer at most {maximum:,}{why}")


def _duration(maximum: float) -> Callable[[str], Any]:
    return _checked(float, lambda v: 0.0 <= v <= maximum, f"a number of ms >= 0 and at most {maximum:,.0f}")


def _parser() -> argparse.ArgumentParser:
    from kvoffload.tools.graph import FORMATS
    from kvoffload.tools.workload import WorkloadSpec

    d = WorkloadSpec()
    p = argparse.ArgumentParser(prog="kvoffload", description="KV-offload lifecycles: simulate, draw.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{simulate,graph}")

    s = sub.add_parser(
        "simulate",
        help="run a synthetic decode workload and print a summary",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    w = s.add_argument_group("workload")
    w.add_argument("--requests", type=_count(MAX_REQUESTS), default=d.requests, help="requests (%(default)s)")
    w.add_argument("--arrival-rate", type=_nonneg, default=d.arrival_rate, help="arrivals/s (%(default)s)")
    w.add_argument("--prompt-mean", type=_count(MAX_TOKENS), default=d.prompt_mean, help="mean prompt tokens")
    w.add_argument("--output-mean", type=_count(MAX_TOKENS), default=d.output_mean, help="mean output tokens")
    w.add_argument("--reuse", type=_share, default=d.reuse, help="share reusing a finishing request's id")
    w.add_argument("--abort", type=_share, default=d.abort, help="share of requests aborted")
    w.add_argument("--fail", type=_share, default=d.fail, help="share of copies that fail (injected)")
    w.add_argument("--step-ms", type=_duration(MAX_STEP_MS), default=d.step_ms, help="decode step duration")
    delay = _duration(MAX_COPY_DELAY_MS)
    w.add_argument("--copy-delay-ms", type=delay, default=d.copy_delay_ms, help="sim: mean copy latency")
    w.add_argument("--seed", type=int, default=d.seed, help="seed (%(default)s)")
    c = s.add_argument_group("offload")
    c.add_argument("--page-size", type=_positive_int, default=16, help="tokens per page (%(default)s)")
    c.add_argument("--stride", type=_positive_int, default=64, help="tokens per chunk (%(default)s)")
    c.add_argument("--device-pages", type=_positive_int, default=8192, help="device pool pages")
    c.add_argument("--host-pages", type=_positive_int, default=256, help="host pool pages (%(default)s)")
    c.add_argument("--kv-dim", type=_positive_int, default=256, help="KV elements per token (%(default)s)")
    c.add_argument("--on-host-full", choices=("drop", "wait"), default="drop")
    c.add_argument("--stuck-after-ms", type=_nonneg, default=500.0, help="watchdog deadline")
    c.add_argument("--backend", default="auto", help="auto (cuda with a GPU, else cpu), cpu, cuda, sim")
    tp_bound = max_tp()
    why = f"4 a CPU core: {os.cpu_count() or 1} here, 64 at most; each rank is a process"
    c.add_argument(
        "--tp",
        type=_count(tp_bound, why),
        default=1,
        metavar="N",
        help=f"run N local tensor-parallel ranks (gloo, at most {tp_bound}), check they agree (1: no group)",
    )
    c.add_argument(
        "--tp-keys",
        choices=("rank", "shared"),
        default="rank",
        help="with --tp: each rank stores its shard under its own keys, or rank 0 stores for all (MLA)",
    )
    c.add_argument(
        "--store",
        default="auto",
        help="auto (file store in a temp dir), a directory, memory, none, a redis:// URL",
    )
    o = s.add_argument_group("output")
    o.add_argument("--json", type=Path, metavar="PATH", help="write the summary as JSON")
    o.add_argument("--trace", type=Path, metavar="PATH", help="write a Chrome-trace/Perfetto timeline")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--metrics-port",
        type=_checked(int, lambda v: 0 <= v <= 65535, "a TCP port in 0..65535 (0: any free one)"),
        metavar="PORT",
        help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics during the run (kvoffload[metrics])",
    )
    o.add_argument(
        "--linger",
        type=_linger_s,
        default=0.0,
        metavar="S",
        help="with --metrics-port: keep serving S seconds after the run ends (a stop signal ends it early)",
    )
    o.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="error",
        help="kvoffload events at or above this level go to stderr (%(default)s)",
    )

    g = sub.add_parser("graph", help="draw a lifecycle's state graph from its declaration")
    g.add_argument("--format", choices=FORMATS, default="mermaid")
    g.add_argument(
        "--lifecycle",
        choices=("offload", "load"),
        default="offload",
        help="offload: a request's offload (default); load: the way back, store -> host -> device pages",
    )
    g.add_argument("--output", "-o", type=Path, metavar="PATH", help="write here instead of stdout")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvoffload`` command; returns the exit code."""
    args = _parser().parse_args(argv)  # bad options: argparse prints usage, exits 2
    if args.command == "graph":
        return _graph(args)
    import structlog

    # The command line is an application: it chooses where kvoffload's events go (the
    # library never configures structlog), and puts the caller's configuration back.
    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(args.log_level.upper()),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        for sig in STOP_SIGNALS:  # outside the event loop: unwind from wherever we are
            signal.signal(sig, _raise_stopped)
        return _simulate(args)
    except (Stopped, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        name = signal.Signals(signum).name
        print(f"kvoffload: stopped by {name}; the run's temporary store was removed", file=sys.stderr)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        structlog.configure(**saved)


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def _fail(code: int, message: str) -> int:
    print(f"kvoffload: error: {message}", file=sys.stderr)
    return code


# --- graph ----------------------------------------------------------------------------


def _graph(args: argparse.Namespace) -> int:
    from kvoffload.errors import MissingDependency
    from kvoffload.tools.graph import LIFECYCLES, render

    if args.output is not None and not args.output.parent.is_dir():
        return _fail(EXIT_USAGE, f"--output: directory {args.output.parent} does not exist")
    try:
        out = render(args.format, LIFECYCLES[args.lifecycle])
    except MissingDependency as exc:
        return _fail(EXIT_MISSING, str(exc))
    if args.output is not None:
        if isinstance(out, bytes):
            args.output.write_bytes(out)
        else:
            args.output.write_text(out)
    elif isinstance(out, bytes):
        sys.stdout.buffer.write(out)
    else:
        sys.stdout.write(out)
    return EXIT_OK


# --- simulate -------------------------------------------------------------------------


def _simulate(args: argparse.Namespace) -> int:
    import kvoffload as kvo
    from kvoffload.errors import MissingDependency
    from kvoffload.tools.simulate import check_workload, choose_backend, choose_store, require_rich
    from kvoffload.tools.workload import WorkloadSpec

    try:
        require_rich()
    except MissingDependency as exc:
        return _fail(EXIT_MISSING, str(exc))

    for path, opt in ((args.json, "--json"), (args.trace, "--trace")):
        if path is not None and not path.parent.is_dir():
            return _fail(EXIT_USAGE, f"{opt}: directory {path.parent} does not exist")
    if args.tp > 1 and args.trace is not None:
        return _fail(EXIT_USAGE, "--trace records one manager's timeline: it is not available with --tp")
    if args.tp > 1 and args.metrics_port is not None:
        return _fail(EXIT_USAGE, "--metrics-port serves one manager's figures: it is not available with --tp")
    if args.linger and args.metrics_port is None:
        return _fail(EXIT_USAGE, "--linger keeps the metrics endpoint up: it needs --metrics-port")
    try:
        spec = WorkloadSpec(
            requests=args.requests,
            arrival_rate=args.arrival_rate,
            prompt_mean=args.prompt_mean,
            output_mean=args.output_mean,
            reuse=args.reuse,
            abort=args.abort,
            fail=args.fail,
            step_ms=args.step_ms,
            copy_delay_ms=args.copy_delay_ms,
            seed=args.seed,
        )
        config = kvo.OffloadConfig(
            page_size=args.page_size,
            stride=args.stride,
            device_pages=args.device_pages,
            host_pages=args.host_pages,
            kv_shape=(args.kv_dim,),
            on_host_full=args.on_host_full,
            stuck_after_s=args.stuck_after_ms / 1000,
            watchdog_interval_s=max(0.001, min(0.1, args.stuck_after_ms / 4000)),
            tp_size=args.tp,
            tp_keys=args.tp_keys,
        )
        check_workload(spec, config)  # a request that could never be admitted would hang the run
        backend = choose_backend(args.backend)
    except (kvo.ConfigError, ValueError) as exc:
        return _fail(EXIT_USAGE, str(exc))
    with ExitStack() as stack:
        try:
            storage, store_desc = choose_store(args.store, stack)
        except ValueError as exc:
            return _fail(EXIT_USAGE, str(exc))
        if args.tp > 1:
            return _simulate_tp(args, spec, config, backend, storage, store_desc)
        from kvoffload.tools.simulate import simulate

        registry = None
        if args.metrics_port is not None:
            try:
                registry = _serve_metrics(args.metrics_port, stack)
            except MissingDependency as exc:
                return _fail(EXIT_MISSING, str(exc))
            except OSError as exc:
                return _fail(EXIT_USAGE, f"--metrics-port {args.metrics_port}: {exc}")
        report = _run_until_stopped(
            lambda: simulate(
                spec,
                config,
                backend,
                storage,
                store_desc,
                progress=not args.no_progress,
                trace=args.trace,
                metrics_registry=registry,
            )
        )
        from kvoffload.tools.simulate import print_summary

        print_summary(report)
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        if args.trace is not None:
            print(f"timeline written to {args.trace} (open it in https://ui.perfetto.dev)")
        code = EXIT_OK if report["ledger"]["ok"] else EXIT_INVARIANT
        if registry is not None and args.linger > 0:
            _linger(args.linger)
    return code


def _serve_metrics(port: int, stack: ExitStack) -> Any:
    """A registry of its own, served at http://127.0.0.1:port/metrics until ``stack``
    closes (the URL goes to stderr: with port 0 it names the port chosen)."""
    from prometheus_client import CollectorRegistry

    from kvoffload.metrics import serve

    registry = CollectorRegistry()
    server = serve(port, registry)
    stack.callback(server.close)
    print(f"kvoffload: metrics at {server.url}", file=sys.stderr, flush=True)
    return registry


def _linger(seconds: float) -> None:
    """Keep the metrics endpoint up ``seconds`` after the run (a stop signal ends it:
    the run's exit code stands)."""
    print(f"kvoffload: run over; serving its metrics {seconds:g} s more", file=sys.stderr, flush=True)
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))  # (waiting is the point: the server thread answers scrapes)
    except (Stopped, KeyboardInterrupt):
        pass


def _simulate_tp(
    args: argparse.Namespace, spec: Any, config: Any, backend: str, storage: Any, desc: str
) -> int:
    """``simulate --tp N``: the ranks open the store themselves (a directory or a URL is
    shared by them; "memory" is one per rank), so they get its name, not the instance."""
    from kvoffload._testing.ranks import RanksFailed
    from kvoffload.tools.simulate import print_summary
    from kvoffload.tools.simulate_tp import simulate_tp

    root = getattr(storage, "root", None)
    where = None if storage is None else str(root) if root is not None else args.store
    if where == "auto":
        where = "memory"  # choose_store fell back to the memory store
    try:
        report = simulate_tp(spec, config, args.tp, backend, where, desc, log_level=args.log_level)
    except RanksFailed as exc:
        return _fail(EXIT_INVARIANT, f"a tensor-parallel rank failed: {exc}")
    print_summary(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return EXIT_OK if report["ledger"]["ok"] else EXIT_INVARIANT


def _run_until_stopped(make: Callable[[], Any]) -> Any:
    """Run the coroutine ``make()`` on a fresh event loop; a stop signal cancels it (its
    ``finally`` blocks and context exits run on the loop: the manager drains and closes)
    and then raises :class:`Stopped`. A second signal while it unwinds is ignored."""
    received: list[int] = []

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def stop(signum: int) -> None:
            if not received:
                received.append(signum)
                task.cancel()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop, sig)
        try:
            return await make()
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, _raise_stopped)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        if received:
            raise Stopped(received[0]) from None
        raise


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
