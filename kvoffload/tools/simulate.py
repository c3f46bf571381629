"""The body of ``kvoffload simulate``: run a workload, gather the figures, print them.

:func:`run_simulation` opens an :class:`~kvoffload.OffloadManager`, attaches the
:class:`~kvoffload.tools.workload.RunMonitor` (and a :class:`~kvoffload.tools.trace.TraceRecorder`
when a timeline is asked for), drives the :class:`~kvoffload.tools.scheduler.DecodeScheduler`
and returns a plain dict (the ``--json`` output). :func:`print_summary` prints it as
rich tables. Both are usable from a notebook.
"""

from __future__ import annotations

import asyncio
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvoffload.abc import Storage
from kvoffload.config import OffloadConfig
from kvoffload.pools import DevicePool
from kvoffload.tools.workload import WorkloadSpec

__all__ = [
    "build_report",
    "check_workload",
    "describe_error",
    "choose_backend",
    "choose_store",
    "print_summary",
    "require_rich",
    "run_simulation",
    "simulate",
    "verdict",
]


def choose_backend(name: str = "auto") -> str:
    """The backend name to use: ``auto`` is what the manager's ``"auto"`` picks (``cuda``
    with a GPU, else ``cpu``). Raises ``ValueError`` for a name not here, or ``cuda``
    without a GPU."""
    import torch

    from kvoffload.backends import BACKENDS

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in BACKENDS:
        raise ValueError(
            f"--backend {name!r} is not available here; choose auto or one of {sorted(BACKENDS)}"
        )
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--backend cuda needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use --backend cpu or auto"
        )
    return name


def check_workload(spec: WorkloadSpec, config: OffloadConfig) -> None:
    """Raise :class:`~kvoffload.ConfigError` when a request of ``spec`` can never run on
    ``config``: its prompt needs more device pages than the pool has, so its admit
    would wait for ever (the scheduler retries it as pages come back, and none ever
    would be enough). A request that outgrows the pool while decoding is preempted,
    not stuck, and is fine."""
    from kvoffload.errors import ConfigError
    from kvoffload.tools.workload import plan

    ps = config.page_size
    worst = max(plan(spec), key=lambda p: p.prompt_len, default=None)
    if (
        worst is not None
        and config.device_pages is not None
        and -(-worst.prompt_len // ps) > config.device_pages
    ):
        need = -(-worst.prompt_len // ps)
        raise ConfigError(
            f"request {worst.index}'s prompt of {worst.prompt_len} tokens needs {need} device pages of "
            f"{ps} tokens, but the device pool has {config.device_pages}: it could never be admitted "
            "(raise --device-pages, or lower --prompt-mean)"
        )


def choose_store(name: str, stack: ExitStack) -> tuple[Any, str]:
    """(storage for the manager, a description) for ``name``: ``auto`` is the file store
    in a temporary directory (removed when ``stack`` closes) when this build has it,
    else the memory store; ``none``; or anything ``resolve_storage`` accepts (a name,
    a directory, a URL). Raises ``ValueError`` for one it does not."""
    from kvoffload.errors import ConfigError
    from kvoffload.storage import resolve_storage

    if name == "none":
        return None, "none"
    if name == "auto":
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvoffload-sim-"))
        try:
            return resolve_storage(tmp), f"file ({tmp}, removed at exit)"
        except ConfigError:
            return resolve_storage("memory"), "memory (no file store in this build)"
    from kvoffload.storage._url import redact, scrub

    try:
        store = resolve_storage(name)
    except ConfigError as exc:
        raise ValueError(f"--store: {scrub(str(exc), name)}") from None
    return store, redact(name)  # the summary and its JSON never show a password (F23)


async def simulate(
    spec: WorkloadSpec,
    config: OffloadConfig,
    backend: str = "sim",
    storage: str | Storage | None = "memory",
    store_desc: str | None = None,
    *,
    progress: bool = False,
    trace: Any = None,
    metrics_registry: Any = None,
) -> dict[str, Any]:
    """Run ``spec`` on a fresh manager; return the summary dict (see the module doc).

    ``trace`` is a :class:`~kvoffload.tools.trace.TraceRecorder` to attach, or a path to
    write one to. ``metrics_registry``: a prometheus_client registry the manager's
    series are registered on (:func:`kvoffload.metrics.register`; they stay there,
    frozen at the run's end, once it is over). Never raises for a broken invariant:
    ``report["ledger"]["ok"]`` is False and ``report["ledger"]["error"]`` says why.
    """
    from kvoffload.backends import resolve_backend
    from kvoffload.drivers.asyncio import OffloadManager
    from kvoffload.keys import namespace_seed
    from kvoffload.tools.delivery_check import EngineRecord
    from kvoffload.tools.scheduler import DecodeScheduler, SchedulerResult
    from kvoffload.tools.trace import TraceRecorder
    from kvoffload.tools.workload import FaultyBackend, RunMonitor, plan

    check_workload(spec, config)
    requests = plan(spec)
    monitor = RunMonitor()
    recorder = trace if isinstance(trace, TraceRecorder) else TraceRecorder() if trace is not None else None
    faulty = FaultyBackend(resolve_backend(backend), spec.fail, spec.seed, on_submit=monitor.submitted)
    error: str | None = None
    result = SchedulerResult()
    bar = _progress(len(requests)) if progress else None
    mgr = OffloadManager(config, backend=faulty, storage=storage)
    mgr.add_listener(monitor)
    if metrics_registry is not None:
        from kvoffload.metrics import register

        register(mgr, metrics_registry)
    if recorder is not None:
        mgr.add_listener(recorder)
    try:
        if bar is not None:
            bar[0].start()
        async with mgr:
            # The engine writes KV where the pools are CPU tensors; on a GPU only keys are
            # checked (the copy waits for the stream current at extend, and this engine
            # writes a step's KV after its extends).
            pool = mgr.device_pool
            on_cpu = isinstance(pool, DevicePool) and pool.tensor.device.type == "cpu"
            monitor.engine = EngineRecord(
                config.page_size,
                seed=namespace_seed(extra_key=config.namespace),
                device=pool if on_cpu and isinstance(pool, DevicePool) else None,
                host=mgr.host_pool if on_cpu else None,
            )
            sched = DecodeScheduler(
                mgr,
                requests,
                spec,
                on_release=(lambda n: bar[0].advance(bar[1], n)) if bar else None,
                engine=monitor.engine,
            )
            try:
                await sched.run()
            except Exception as exc:
                error = describe_error(exc)
            result = sched.result
    except Exception as exc:  # DrainTimeout, or an error of a background task
        error = error or describe_error(exc)
    finally:
        if bar is not None:
            bar[0].stop()
    stats = mgr.statistics()
    error = verdict(mgr, monitor, error)
    if recorder is not None and not isinstance(trace, TraceRecorder):
        recorder.write(Path(trace))
    from kvoffload.storage._url import redact

    shown = redact(store_desc or str(storage))  # F23: a URL handed in directly is shown redacted too
    return build_report(spec, config, faulty.name, shown, result, monitor, stats, error, faulty)


def verdict(mgr: Any, monitor: Any, error: str | None) -> str | None:
    """What went wrong in a finished run of ``mgr`` (either driver), or ``None``: the
    run's own ``error`` first, else a ledger that does not balance, a completion that
    reached a lifecycle that did not submit it (``monitor``, a
    :class:`~kvoffload.tools.workload.RunMonitor`), or lifecycles and pages still held."""
    from kvoffload.errors import KVOffloadError

    if error is not None:
        return error
    try:
        mgr.check_invariants()
    except KVOffloadError as exc:
        return f"{type(exc).__name__}: {exc}"
    if monitor.mismatched:
        return (
            f"{monitor.mismatched} completion(s) do not carry what the lifecycle they reached "
            f"committed; the first: {monitor.first_mismatch}"
        )
    stats = mgr.statistics()
    if stats.live_lifecycles or stats.device_pages_used or stats.host_pages_used:
        return (
            f"leak: {stats.live_lifecycles} live lifecycles, {stats.device_pages_used} device and "
            f"{stats.host_pages_used} host pages still held after the run"
        )
    return None


def run_simulation(
    spec: WorkloadSpec,
    config: OffloadConfig,
    backend: str,
    storage: str | Storage | None,
    store_desc: str,
    *,
    progress: bool = False,
    trace: Any = None,
) -> dict[str, Any]:
    """:func:`simulate` on a fresh asyncio event loop (for the command line)."""
    return asyncio.run(simulate(spec, config, backend, storage, store_desc, progress=progress, trace=trace))


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of a kvoffload error, looking inside exception groups; any
    other exception is a bug of this program and propagates."""
    from kvoffload.errors import KVOffloadError

    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_error(e) for e in exc.exceptions)
    if isinstance(exc, KVOffloadError):
        return f"{type(exc).__name__}: {exc}"
    raise exc


def require_rich() -> None:
    """Raise :class:`~kvoffload.MissingDependency` naming the extra when rich (what
    ``kvoffload simulate`` prints its progress and summary with) is not installed."""
    try:
        import rich  # noqa: F401
    except ImportError:
        from kvoffload.errors import MissingDependency

        raise MissingDependency(
            "kvoffload simulate prints its progress and summary with rich: pip install 'kvoffload[cli]'"
        ) from None


def _progress(total: int) -> tuple[Any, Any]:
    require_rich()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests released"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    return p, p.add_task("requests", total=total)


def build_report(
    spec: WorkloadSpec,
    config: OffloadConfig,
    backend: str,
    store: str,
    r: Any,
    m: Any,
    stats: Any,
    error: str | None,
    faulty: Any,
) -> dict[str, Any]:
    """The summary dict of one run (what ``--json`` writes): from the run's
    configuration, the scheduler's result, the monitor, the final statistics, the error
    (None: the ledger balanced) and the (faulty) backend."""
    from kvoffload.tools.workload import percentiles

    wall = max(r.wall_s, 1e-9)
    ms = {k: round(v * 1e3, 3) for k, v in percentiles(m.transfer_latency_s).items()}
    rel = {k: round(v * 1e3, 3) for k, v in percentiles(r.release_latency_s).items()}
    return {
        "setup": {
            "backend": backend,
            "store": store,
            "workload": spec.as_dict(),
            "config": {
                "page_size": config.page_size,
                "stride": config.stride,
                "device_pages": config.device_pages,
                "host_pages": config.host_pages,
                "kv_shape": list(config.kv_shape),
                "dtype": config.dtype,
                "on_host_full": config.on_host_full,
                "stuck_after_s": config.stuck_after_s,
            },
        },
        "requests": {
            "admitted": stats.admitted,
            "completed": stats.released_completed,
            "aborted": stats.released_aborted,
            "failed": stats.released_failed,
            "preempted": r.preempted,
            "reused_ids": r.reused_ids,
        },
        "pages": {
            "submitted": stats.pages_submitted,
            "offloaded": stats.pages_copied,
            "dropped": stats.pages_dropped,
            "lost": stats.pages_lost,
            "failed": stats.pages_failed,
            "discarded": stats.pages_discarded,
            "stored": stats.pages_stored,
            "store_failed": stats.pages_store_failed,
            "not_stored": stats.pages_not_stored,
            "injected_copy_failures": faulty.injected,
        },
        "throughput": {
            "wall_s": round(r.wall_s, 3),
            "decode_steps": r.steps,
            "requests_per_s": round(stats.admitted / wall, 1),
            "pages_offloaded_per_s": round(stats.pages_copied / wall, 1),
            "mb_copied_per_s": round(m.bytes_copied / wall / 1e6, 2),
            "mb_stored": round(m.bytes_stored / 1e6, 2),
        },
        "latency_ms": {"transfer": ms, "release": rel},
        "deliveries": {
            "checked": m.checked,
            "bytes_checked": m.bytes_checked,
            "mismatched": m.mismatched,
            "late_while_id_reused": m.late_completions,
        },
        "watchdog": {"stuck_reports": stats.stuck_reports},
        "ledger": {"ok": error is None, "error": error, "checks": r.invariant_checks},
        "statistics": stats.as_dict(),
    }


def print_summary(report: dict[str, Any], console: Any = None) -> None:
    """Print ``report`` (from :func:`simulate`) as tables (needs rich: the ``cli`` extra)."""
    require_rich()
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    s = report["setup"]
    t = Table(title=f"kvoffload simulate — backend {s['backend']}, store {s['store']}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("figures")
    q = report["requests"]
    t.add_row(
        "requests",
        f"{q['admitted']} admitted: {q['completed']} completed, {q['aborted']} aborted "
        f"({q['preempted']} preempted), {q['failed']} failed; {q['reused_ids']} reused a finishing id",
    )
    p = report["pages"]
    t.add_row(
        "pages",
        f"{p['submitted']} submitted: {p['offloaded']} offloaded, {p['failed']} failed "
        f"({p['injected_copy_failures']} chunks injected), {p['discarded']} discarded; "
        f"{p['dropped']} drop attempts (host full), {p['lost']} lost for good; "
        f"{p['stored']} stored, {p['store_failed']} store failed",
    )
    h = report["throughput"]
    t.add_row(
        "throughput",
        f"{h['wall_s']} s, {h['decode_steps']} decode steps; {h['requests_per_s']} req/s, "
        f"{h['pages_offloaded_per_s']} pages/s, {h['mb_copied_per_s']} MB/s copied, "
        f"{h['mb_stored']} MB stored",
    )
    for name, label in (("transfer", "copy latency"), ("release", "finish→released")):
        lat = report["latency_ms"][name]
        t.add_row(label, "  ".join(f"{k} {v:.2f} ms" for k, v in lat.items()))
    d = report["deliveries"]
    t.add_row(
        "deliveries",
        f"{d['checked']} completions checked against what the lifecycle they reached committed "
        f"(keys; KV bytes of {d['bytes_checked']}): {d['mismatched']} mismatched; "
        f"{d['late_while_id_reused']} arrived while their request id was reused",
    )
    t.add_row("watchdog", f"{report['watchdog']['stuck_reports']} stuck reports")
    tp = report.get("tp")
    if tp is not None:
        t.add_row(
            "tensor parallel",
            f"{tp['ranks']} ranks (gloo, keys {tp['keys']}): every ledger balanced: "
            f"{'yes' if tp['ledgers_balanced'] else 'NO'}; release sequences identical: "
            f"{'yes' if tp['identical_releases'] else 'NO'} ({tp['released']} releases in "
            f"{tp['release_steps']} steps); copy failures injected per rank: {tp['injected']}",
        )
    led = report["ledger"]
    t.add_row(
        "ledger",
        f"[green]OK[/green] ({led['checks']} checks)" if led["ok"] else f"[red]FAILED[/red]: {led['error']}",
    )
    console.print(t)
