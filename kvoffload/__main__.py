"""``python -m kvoffload`` is the ``kvoffload`` command."""

from __future__ import annotations

from kvoffload.tools.cli import main

raise SystemExit(main())
