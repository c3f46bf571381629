"""Private rooms behind :mod:`kvoffload.testing` (the public face): the outside-world
checks (``observer``), the state machine (``machine``), schedule strategies
(``strategies``) and the transition capture (``capture``)."""
