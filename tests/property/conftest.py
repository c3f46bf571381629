"""Hypothesis profiles for the property suite: ``ci`` (default) and ``long``.

``ci`` is derandomized and database-less, so every CI run tries the same examples and
a failure reproduces bit for bit; ``HYPOTHESIS_PROFILE=long`` runs 10,000+ examples of
the lifecycle machine (see docs/testing.md).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("long", settings.get_profile("ci"), derandomize=False, max_examples=10_000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
