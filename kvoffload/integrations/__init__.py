"""Drop-in integrations with serving engines, each built on the public API only.

- :mod:`kvoffload.integrations.sglang`: ``DecodeKVCacheOffloadManager``, the class
  SGLang's decode scheduler owns, on a :class:`~kvoffload.SyncOffloadManager` with the
  engine's own KV memory.

No engine module is imported here or there: an integration works with the engine's
objects it is handed (duck-typed) and is tested with fakes shaped like them.
"""
