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
