"""kvoffload's KV events (issue 24 point 3) and series (point 2) through a real vLLM engine.

One in-process engine with ``kv_events_config`` (ZMQ publisher) and kvoffload's
connector on the file store, prefix caching on, so vLLM announces its GPU blocks too. The
test binds a ZMQ SUB socket on 127.0.0.1 (vLLM's publisher connects to it) and decodes
what arrives with vLLM's ``KVEventBatch``. What must hold: vLLM's publisher emits
kvoffload's ``BlockStored`` events (``medium="STORAGE"``) for exactly the blocks vLLM
announced on the GPU, under the same block hashes, with the same parents and tokens:
a router sees one block in two tiers. And vLLM's own stat loggers export the connector's
``kvoffload_*`` series (``build_prom_metrics``): the same four blocks stored, under
vLLM's ``model_name`` / ``engine`` labels. The runner's handshake (engine_run.py
``kv_events``) makes sure nothing is lost to ZMQ's slow joiner or to the engine's exit.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import vllm_engines as ve

ve.require()

import msgspec  # noqa: E402  (vLLM's dependencies: here only with vLLM)
import zmq  # noqa: E402
from vllm.distributed.kv_events import BlockStored, KVEventBatch  # noqa: E402

PROMPT = ve.tokens(50, 100)  # three whole blocks and 4 tokens
DECODED = 40  # the fourth block fills while it decodes
RECV_TIMEOUT_MS = int(ve.ENGINE_TIMEOUT_S * 1000)


class Subscriber:
    """A ZMQ SUB socket bound on 127.0.0.1 and a thread collecting vLLM's event batches;
    it answers the runner's handshake (ts=0.0: joined, ts=-1.0: done) with files."""

    def __init__(self, work: Path) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.joined, self.done = work / "kv-joined", work / "kv-done"
        self.events: list[Any] = []
        self.error: BaseException | None = None
        self.finished = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        try:
            while True:
                _topic, _seq, payload = self.sock.recv_multipart()  # raises zmq.Again on timeout
                batch = decoder.decode(payload)
                if batch.ts == 0.0:
                    self.joined.touch()
                elif batch.ts == -1.0:
                    self.finished = True
                    self.done.touch()
                    return
                else:
                    self.events += batch.events
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        self.done.touch()  # (an engine still waiting gives up at once)
        self.thread.join(ve.ENGINE_TIMEOUT_S)
        self.sock.close(linger=0)
        self.ctx.term()


def test_vllms_publisher_emits_kvoffloads_stored_blocks_under_vllms_hashes(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The run's STORAGE BlockStored events name the blocks of vLLM's GPU BlockStored
    events, in order, with their parents and tokens; each came once."""
    sub = Subscriber(tmp_path)
    try:
        kv = ve.kvoffload_connector(str(tmp_path / "store"), "events")
        phases = [{"name": "one", "requests": [ve.req("e0", PROMPT, DECODED)]}]
        spec = ve.spec(
            tiny_model,
            phases,
            kv,
            engine_args={"enable_prefix_caching": True},
            kv_events={"endpoint": sub.endpoint, "joined": str(sub.joined), "done": str(sub.done)},
            metrics=True,
        )
        result = ve.run_engine(spec, tmp_path, "events")
        sub.thread.join(ve.ENGINE_TIMEOUT_S)
        assert sub.error is None and sub.finished, f"the subscriber ended with {sub.error!r}"
        assert ve.engine_errors(result["log"]) == []
    finally:
        sub.close()
    stored = [e for e in sub.events if isinstance(e, BlockStored)]
    gpu = [e for e in stored if e.medium == "GPU"]
    ours = [e for e in stored if e.medium == "STORAGE"]
    gpu_blocks = {h: e for e in gpu for h in e.block_hashes}
    gpu_order = [h for e in gpu for h in e.block_hashes]
    our_order = [h for e in ours for h in e.block_hashes]
    whole = (len(PROMPT) + DECODED - 1) // ve.BLOCK  # blocks whose KV the engine computed
    assert len(our_order) == whole and our_order == gpu_order[:whole], (our_order, gpu_order)
    tokens_of = {
        h: e.token_ids[i * ve.BLOCK : (i + 1) * ve.BLOCK] for e in gpu for i, h in enumerate(e.block_hashes)
    }
    parent_of = {
        h: (e.parent_block_hash if i == 0 else e.block_hashes[i - 1])
        for e in gpu
        for i, h in enumerate(e.block_hashes)
    }
    for e in ours:
        assert e.block_size == ve.BLOCK and e.group_idx == 0
        assert e.parent_block_hash == parent_of[e.block_hashes[0]]
        for i, h in enumerate(e.block_hashes):
            assert h in gpu_blocks and e.token_ids[i * ve.BLOCK : (i + 1) * ve.BLOCK] == tokens_of[h]
    assert our_order[: len(PROMPT) // ve.BLOCK] == gpu_order[: len(PROMPT) // ve.BLOCK]
    assert [*PROMPT, *result["requests"]["e0"]["output"]][: whole * ve.BLOCK] == [
        t for e in ours for t in e.token_ids
    ]

    # The same run's kvoffload_* series, exported by vLLM's own stat loggers (point 2):
    # the four blocks stored, under vLLM's labels.
    lines = [m for m in result["metrics"] if m.startswith('kvoffload_pages_total{direction="h2s"')]
    assert len(lines) == 1 and 'engine="0"' in lines[0] and "model_name=" in lines[0], result["metrics"][:40]
    assert float(lines[0].rsplit(" ", 1)[1]) == whole
