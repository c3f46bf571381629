"""Private rooms behind :mod:`kvoffload.testing` (the public face): the outside-world
checks (``observer``), the state machine (``machine``), schedule strategies
(``strategies``), the transition capture (``capture``) and local tensor-parallel
ranks (``ranks``)."""
