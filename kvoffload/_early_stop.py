"""Stop signals for the ``kvoffload`` command from its first instruction (FAILURES F27).

``import kvoffload`` takes half a second or more (numpy), and :func:`kvoffload.tools.cli.main`
installs its own handlers only once it runs: a SIGINT in between printed a
``KeyboardInterrupt`` traceback. This module is the first one ``kvoffload/__init__.py``
imports. When - and only when - the process is the ``kvoffload`` command
(``python -m kvoffload`` or the console script, :func:`is_the_command`), it installs a
handler for SIGINT and SIGTERM that prints ``kvoffload: stopped by <SIGNAL>`` and exits
``128 + signum`` (a ``SystemExit``: no traceback). Nothing exists to remove yet:
``cli.main`` replaces the handler with its own before it creates anything (its
temporary store) and puts this one back when it is done. Any other program that
imports kvoffload keeps its own handlers: the library never touches them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["is_the_command"]

_COMMAND = "kvoffload"


def is_the_command(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether a process with these ``sys.argv`` / ``sys.orig_argv`` is the
    ``kvoffload`` command: ``python [options] -m kvoffload ...`` (while the package is
    being imported, ``sys.argv[0]`` is ``"-m"``) or the console script (``argv[0]``
    names a file called ``kvoffload``)."""
    if argv[:1] == ["-m"]:
        for i, arg in enumerate(orig_argv[1:], 1):
            if arg == "-m":
                return orig_argv[i + 1 : i + 2] == [_COMMAND]
            if arg.startswith("-m"):
                return arg[2:] == _COMMAND
        return False
    return bool(argv) and os.path.basename(argv[0]).removesuffix(".exe") == _COMMAND


def _stop(signum: int, frame: FrameType | None) -> None:
    print(f"kvoffload: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


if threading.current_thread() is threading.main_thread() and is_the_command(sys.argv, sys.orig_argv):
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _stop)
