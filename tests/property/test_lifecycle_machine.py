"""The lifecycle under every completion interleaving: the stateful suite.

``LifecycleMachine`` (kvoffload.testing) is the outside world; after every step it
checks the ledger, that each completion reached the lifecycle that issued it with the
keys of an independent chain, the bytes each copy moved, every device free, each
lifecycle's transition log against the ``transitions`` oracle, and garbage (F2).
"""

from __future__ import annotations

from hypothesis import settings

from kvoffload.testing import LifecycleMachine

#: Examples in the default (ci) profile. Measured on the mutants of tests/test_mutations.py
#: over 20 random seeds each, the suite found every one of F1/F3/F5/F8/F11 in at most
#: 208 examples (medians 2-20); 500 leaves a wide margin, and CI is derandomized.
CI_EXAMPLES = 500


class LifecycleSuite(LifecycleMachine):
    """The suite as shipped: the real OffloadManager."""


TestLifecycleSuite = LifecycleSuite.TestCase
TestLifecycleSuite.settings = settings(
    settings.default,
    max_examples=max(CI_EXAMPLES, settings.default.max_examples),
    stateful_step_count=30,
)
