"""The machine a benchmark ran on, printed first by each script, so that a figure
copied from its output names the machine (and how busy it was) with it."""

from __future__ import annotations

import os
import platform


def describe() -> str:
    """CPUs, CPU model, Python, torch and the load average, on one line."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    try:
        import torch

        torch_v = torch.__version__
    except ImportError:
        torch_v = "absent"
    try:
        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = "load average unknown"
    return (
        f"machine: {os.cpu_count()} cpu(s), {model}; python {platform.python_version()}, "
        f"torch {torch_v}; {load}"
    )


def verdict(ok: bool) -> str:
    """A target's verdict as every benchmark prints it: ``ok`` or ``MISSED``."""
    return "ok" if ok else "MISSED"


def spread(xs: list[float], fmt: str = ".2f") -> str:
    """The range over rounds of a figure whose median is printed: ``rounds A..B (N)``."""
    if not xs:
        return "rounds none"
    return f"rounds {min(xs):{fmt}}..{max(xs):{fmt}} ({len(xs)})"


def target_line(
    name: str, value: float, target: float, *, at_most: bool, xs: list[float], fmt: str = ".3f"
) -> str:
    """One target on one line: ``NAME: VALUE (target <= T: ok; rounds A..B (N))``.
    ``at_most``: the target is an upper bound (a cost ratio); else a lower bound."""
    ok = value <= target if at_most else value >= target
    op = "<=" if at_most else ">="
    return f"{name}: {value:{fmt}} (target {op} {target:g}: {verdict(ok)}; {spread(xs)})"
