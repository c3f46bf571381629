#!/usr/bin/env bash
# The wheel installs beside another torch (issue 13): build kvoffload's wheel, make a
# fresh virtual environment that already holds torch $KVOFFLOAD_ALT_TORCH (default
# 2.14.1, a CUDA build on this machine's disk; CI's pin is 2.13.0), install the wheel
# into it, check that torch was left as it was and that `import kvoffload` loads no
# CLI or notebook dependency, then run examples/engine_loop.py against the wheel.
# Exit 77: that torch cannot be installed here (tests/test_packaging.py skips, naming it).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
alt=${KVOFFLOAD_ALT_TORCH:-2.14.1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
echo "== a fresh venv with torch==$alt"
if ! "$py" -m pip install -q "torch==$alt" "numpy>=1.26" >"$work/torch.log" 2>&1; then
  tail -5 "$work/torch.log" >&2
  echo "torch==$alt cannot be installed here" >&2
  exit 77
fi
echo "== the wheel"
"$py" -m pip wheel -q --no-deps -w "$work/dist" "$repo" >"$work/wheel.log" 2>&1 || { cat "$work/wheel.log" >&2; exit 1; }
ls "$work/dist"
"$py" -m pip install -q "$work"/dist/kvoffload-*.whl >"$work/install.log" 2>&1 || { cat "$work/install.log" >&2; exit 1; }
cd "$work"  # away from the source tree: the installed wheel is what is imported
echo "== import kvoffload"
"$py" - "$alt" <<'PY'
import importlib.metadata as md
import sys

import torch

import kvoffload
import kvoffload.integrations.sglang  # noqa: F401

alt = sys.argv[1]
assert torch.__version__.split("+")[0] == alt, f"installing the wheel changed torch to {torch.__version__}"
assert "site-packages" in kvoffload.__file__, kvoffload.__file__
extras = {"rich", "matplotlib", "graphviz", "redis", "hypothesis", "pytest", "IPython", "ipykernel", "nbformat"}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in extras)
assert not loaded, f"import kvoffload loaded {loaded}"
print(f"kvoffload {md.version('kvoffload')} (wheel) beside torch {torch.__version__}: imports none of {sorted(extras)}")
PY
echo "== examples/engine_loop.py"
"$py" "$repo/examples/engine_loop.py"
