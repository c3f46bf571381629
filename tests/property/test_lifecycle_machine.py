"""The lifecycle under every completion interleaving: the stateful suite.

``LifecycleMachine`` (kvoffload.testing) is the outside world; after every step it
checks the ledger, that each completion reached the lifecycle that issued it with the
keys of an independent chain, the bytes each copy moved, every device free, each
lifecycle's transition log against the ``transitions`` oracle, and garbage (F2).
"""

from __future__ import annotations

from hypothesis import settings

from kvoffload.testing import LifecycleMachine

#: Examples in the default (ci) profile: enough to find a six-step bug every time
#: (tests/test_mutations.py shows it for each catalogued bug).
CI_EXAMPLES = 300


class LifecycleSuite(LifecycleMachine):
    """The suite as shipped: the real OffloadManager."""


TestLifecycleSuite = LifecycleSuite.TestCase
TestLifecycleSuite.settings = settings(
    settings.default,
    max_examples=max(CI_EXAMPLES, settings.default.max_examples),
    stateful_step_count=30,
)
