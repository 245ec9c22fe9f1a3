#!/usr/bin/env bash
# Build a virtualenv holding SGLang 0.5.23 for a CPU-only machine, with this
# project installed in it: for the SGLang HiCache backend's tests and its
# benchmark.  SGLang's full dependency list is GPU serving (CUDA kernels,
# flashinfer, a pinned CUDA torch), so it gets a venv of its own holding only
# what its HiCache storage and host-memory-pool modules import.
#
#   scripts/sglang_venv.sh [DIR]        (default .sglang-venv)
#
# torch is installed first as exactly 2.13.0 (a CPU wheel here; SGLang pins a
# CUDA torch that would fetch GBs), then SGLang without its dependencies, then
# the packages that sglang.srt.mem_cache.{hicache_storage, storage.
# backend_factory, memory_pool_host} import on the CPU, each at the version
# SGLang's own metadata asks for where it names one.  torchvision is left out:
# the registry's build needs CUDA torch and cannot load beside the CPU one
# (the tests give SGLang's multimodal configs a stand-in; see
# tests/sglang_harness.py).
set -euo pipefail
DIR=${1:-.sglang-venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SGLANG=0.5.23
# The distributions behind the imports of those modules (found by importing
# them in a bare venv until nothing was missing).
NEEDED=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec
        pydantic pyzmq tqdm IPython aiohttp triton dill transformers tokenizers
        sentencepiece apache-tvm-ffi compressed-tensors gguf)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# pip warns that SGLang's other (GPU) requirements are missing: expected, so
# its output is shown only when it fails.
pip_quiet() {
    "$DIR/bin/pip" install -q --disable-pip-version-check "$@" > "$WORK/pip.log" 2>&1 \
        || { cat "$WORK/pip.log"; exit 1; }
}
python3 -m venv "$DIR"
pip_quiet torch==2.13.0
pip_quiet --no-deps "sglang==$SGLANG"
# Each needed distribution at SGLang's own pin when it has one.
"$DIR/bin/python" - "${NEEDED[@]}" > "$WORK/requirements.txt" <<'PY'
import importlib.metadata as md, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
pins = {}
for req in md.requires("sglang") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]
    pins[norm(name)] = req.split(";", 1)[0].strip()
for name in sys.argv[1:]:
    print(pins.get(norm(name), name))
PY
printf 'torch==2.13.0\n' > "$WORK/constraints.txt"
pip_quiet -c "$WORK/constraints.txt" -r "$WORK/requirements.txt"
pip_quiet -c "$WORK/constraints.txt" -e "$ROOT"
"$DIR/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
"$DIR/bin/python" -c "
import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory, cortex_cache
print('sglang $SGLANG ready in $DIR')"
