"""The tools built on kvoffload: what a user runs, not what an engine links.

- :mod:`~kvoffload.tools.cli`: the ``kvoffload`` command (``simulate``, ``graph``;
  also ``python -m kvoffload``).
- :mod:`~kvoffload.tools.simulate`, :mod:`~kvoffload.tools.simulate_tp`: the body of
  ``kvoffload simulate`` (one process, or N local tensor-parallel ranks).
- :mod:`~kvoffload.tools.workload`: the seeded synthetic workload, the failure-injecting
  backend wrapper and the summary's listener.
- :mod:`~kvoffload.tools.scheduler`: the demo decode loop that uses kvoffload as an
  engine would (``examples/scheduler.py``).
- :mod:`~kvoffload.tools.delivery_check`: the independent check of what each completion
  delivered.
- :mod:`~kvoffload.tools.trace`: Chrome-trace / Perfetto timelines of a run.
- :mod:`~kvoffload.tools.graph`: the lifecycle drawn from its declaration.

The tools sit on top of the layers (the vocabulary, ``core``, ``lifecycle``,
``backends``, ``storage``, ``drivers``, ``integrations``) and may import any of them;
no layer module imports this package (``tests/test_layers.py`` checks it).
Importing this package imports none of the tools: each is imported by its own path.
"""
