"""Drop-in integrations with serving engines, each built on the public API only.

- :mod:`kvoffload.integrations.sglang`: ``DecodeKVCacheOffloadManager``, the class
  SGLang's decode scheduler owns, on a :class:`~kvoffload.SyncOffloadManager` with the
  engine's own KV memory.

- :mod:`kvoffload.integrations.sglang_storage` (and ``sglang_format``): storage SGLang's
  own HiCache reads, written through SGLang's ``HiCacheStorage``; SGLang is imported
  there lazily, only when that storage is built.

- :mod:`kvoffload.integrations.vllm`: ``KVOffloadConnector``, a vLLM KV connector
  (imports vLLM); its two sides on plain data, without vLLM, in ``vllm_plan`` (the
  scheduler's lifecycles), ``vllm_worker`` (the movers), ``vllm_messages``,
  ``vllm_settings`` and ``vllm_keys``.

No engine module is imported at import time: an integration works with the engine's
objects it is handed (duck-typed) and is tested with SGLang's real classes where they
run on a CPU, and with fakes shaped like them.
"""
