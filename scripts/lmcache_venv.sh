#!/usr/bin/env bash
# Build a virtualenv holding LMCache 0.5.6 for a CPU-only machine, with this
# project installed in it: for the LMCache adapter's harness test and the
# LMCache benchmarks.  LMCache pins an older numpy and asks for CUDA-only
# packages, so it gets a venv of its own.
#
#   scripts/lmcache_venv.sh [DIR]        (default .lmcache-venv)
#
# torch is installed first as exactly 2.13.0 (a CPU wheel here; LMCache's
# unpinned torch would fetch a multi-GB CUDA build), then LMCache without
# its dependencies, then those read from its wheel minus torch and the
# CUDA-only ones (cupy-cuda13x, cuda-python, cufile-python): LMCache runs
# on the CPU without them.
set -euo pipefail
DIR=${1:-.lmcache-venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv "$DIR"
PIP=("$DIR/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$DIR/bin/pip" download -q --disable-pip-version-check --no-deps lmcache==0.5.6 -d "$WORK"
"${PIP[@]}" --no-deps "$WORK"/lmcache-0.5.6-*.whl
"$DIR/bin/python" - "$WORK"/lmcache-0.5.6-*.whl > "$WORK/requirements.txt" <<'PY'
import re, sys, zipfile
skip = {"torch", "cupy-cuda13x", "cuda-python", "cufile-python"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name not in skip:
        print(req)
PY
printf 'torch==2.13.0\n' > "$WORK/constraints.txt"
"${PIP[@]}" -c "$WORK/constraints.txt" -r "$WORK/requirements.txt"
"${PIP[@]}" -c "$WORK/constraints.txt" -e "$ROOT"
"$DIR/bin/python" -c "import lmcache, cortex_cache; print('lmcache', lmcache.__version__ if hasattr(lmcache, '__version__') else '?', 'ready in', '$DIR')"
