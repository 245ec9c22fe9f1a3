"""An identity of a model's weights, so that KV keys change when the weights do.

KV computed with one set of weights is wrong for another, yet an engine's
own keys name only the model and its KV layout: re-save different weights
under the same path (a fine-tune, a fixed checkpoint, a new revision),
restart, and a pool that outlived the engine would serve the old KV -- a
wrong answer, silently.  Every integration folds `Weights.id` into the tag
its keys are derived from (and into the key's path, so that one model's KV
of one set of weights can be evicted by prefix).

Where the identity comes from, first found wins (`resolve`):

1. the operator: the integration's `weights` parameter, else the
   ``CORTEX_CACHE_WEIGHTS`` environment variable (any name for the weights:
   a revision, a date, a checksum you trust; 1-64 of ``A-Z a-z 0-9 . _ : @ + -``);
2. the checkpoint on this host: `identity(path)` of the model's directory
   (or file), or of its snapshot in the Hugging Face cache for a hub name;
3. the revision the model names (a hub revision that is not in the cache);
4. none: keys carry ``unknown``, and the integration says at start that
   its KV is not tied to the weights.

`identity(path)` is 16 hex digits of SHA-256 over every checkpoint file
under `path` (hidden folders skipped, names in order): its name relative
to `path` and its size; for a ``.safetensors`` file its JSON header (names,
dtypes, shapes, offsets) and the first and last 32 bytes of each tensor's
data; for other weight files (``.bin .pt .pth .ckpt .gguf .npz .h5
.msgpack``) 16 pieces of 4 KiB spread over the file; and the whole of
``config.json``, ``params.json`` and ``*quant*.json`` (RoPE or quantisation
settings change the KV too).  It reads a few bytes per tensor -- a few
hundred reads for a large model, mostly from the page cache once the engine
has loaded the weights -- so it costs milliseconds at start.  The data
samples are what tell weights re-saved with other values apart (a header
holds only names and shapes); an edit that leaves the first and last 32
bytes of every tensor as they were is not seen: name such weights with
`weights`.  A copy of the same files elsewhere has the same identity, so
two deployments of one checkpoint share their KV.

``python -m cortex_cache.weights PATH`` prints a checkpoint's identity (the
segment to give `cortex cache evict NAME --prefix` to retire its KV).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
import sys
from dataclasses import dataclass
from typing import Any

from .errors import UsageError

ENV = "CORTEX_CACHE_WEIGHTS"
UNKNOWN = "unknown"
_ID_RE = re.compile(r"[A-Za-z0-9._:@+-]{1,64}")
_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".h5", ".msgpack")
_SAMPLES, _SAMPLE_BYTES = 16, 4096  # pieces of an opaque weight file
_EDGE = 32  # bytes of each safetensors tensor's start and end
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is treated as opaque bytes


@dataclass(frozen=True)
class Weights:
    """What an integration keys KV by: `id` (in tags and key paths) and where it came from (for the log)."""

    id: str
    source: str

    @property
    def known(self) -> bool:
        return self.id != UNKNOWN


def check_id(value: object, what: str = "weights") -> str:
    """An operator's name for weights, checked (UsageError, one line, for anything else)."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise UsageError(f"invalid {what} {value!r}: 1-64 of A-Z a-z 0-9 . _ : @ + - (it goes into keys)")
    return value


def resolve(model: str | os.PathLike | None, *, override: object = None, revision: str | None = None) -> Weights:
    """The identity of `model`'s weights (see the module doc for the order); never raises for a model it
    cannot read (that is `unknown`), only UsageError for an invalid `override` or CORTEX_CACHE_WEIGHTS."""
    if override is not None and override != "":
        return Weights(check_id(override), "set by the configuration")
    env = os.environ.get(ENV, "")
    if env:
        return Weights(check_id(env, ENV), f"set by {ENV}")
    path = None if model is None else os.fspath(model)
    if path and os.path.exists(path):
        return _of_path(path)
    if path:
        snap = _hub_snapshot(path, revision)
        if snap is not None:
            return _of_path(snap, f"the Hugging Face cache's snapshot of {path}")
    if revision:
        return Weights("rev-" + re.sub(r"[^A-Za-z0-9._:@+-]", "_", revision)[:60], f"revision {revision!r}")
    return Weights(UNKNOWN, f"no checkpoint found at {path!r}" if path else "no model named")


def _of_path(path: str, what: str | None = None) -> Weights:
    try:
        ident, files = _identity(path)
    except OSError as e:
        return Weights(UNKNOWN, f"{path} could not be read ({e.strerror or e})")
    where = what or path
    if not files:
        return Weights(UNKNOWN, f"{where} holds no weight files")
    return Weights(ident, f"{where}: {files} weight file{'s' * (files != 1)}")


def identity(path: str | os.PathLike) -> str:
    """16 hex digits naming the checkpoint at `path` (a directory or one file); see the module doc.
    OSError when it cannot be read; UsageError when it holds no weight files."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    ident, files = _identity(path)
    if not files:
        raise UsageError(f"{path} holds no weight files")
    return ident


def _identity(path: str) -> tuple[str, int]:
    """(identity, weight files seen) of a directory or file."""
    h = hashlib.sha256(b"cortex-weights/1\0")
    files = 0
    for rel, full in _files(path):
        name = os.path.basename(rel)
        kind = _kind(name)
        if kind is None:
            continue
        files += kind != "config"
        with open(full, "rb") as f:  # follows symlinks: a hub snapshot's files point into its blobs
            size = os.fstat(f.fileno()).st_size
            _feed(h, rel.encode(), struct.pack("<Q", size), kind.encode())
            if kind == "config":
                _feed(h, f.read(1 << 20))
            elif kind == "safetensors":
                _safetensors(h, f.fileno(), size)
            else:
                _opaque(h, f.fileno(), size)
    return h.hexdigest()[:16], files


def _files(path: str):
    """(name relative to `path`, full path) of every file under `path`, hidden folders and files skipped."""
    if not os.path.isdir(path):
        yield os.path.basename(path), path
        return
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            if not n.startswith("."):
                full = os.path.join(root, n)
                yield os.path.relpath(full, path), full


def _kind(name: str) -> str | None:
    low = name.lower()
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith(_WEIGHT_SUFFIXES):
        return "opaque"
    if low in ("config.json", "params.json") or (low.endswith(".json") and "quant" in low):
        return "config"
    return None


def _feed(h: Any, *parts: bytes) -> None:
    for p in parts:  # each part with its length: no two lists of parts hash alike
        h.update(struct.pack("<Q", len(p)))
        h.update(p)


def _safetensors(h: Any, fd: int, size: int) -> None:
    """The header, and each tensor's first and last `_EDGE` bytes (offsets from the header, bounds-checked)."""
    head = os.pread(fd, 8, 0)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    if not 0 < n <= min(_MAX_HEADER, size - 8):
        return _opaque(h, fd, size)
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw)
        spans = sorted((int(t["data_offsets"][0]), int(t["data_offsets"][1]))
                       for k, t in header.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return _opaque(h, fd, size)
    _feed(h, raw)
    base = 8 + n
    for a, b in spans:
        if not 0 <= a <= b <= size - base:
            continue  # a damaged header: its bytes are in the identity already
        if b - a <= 2 * _EDGE:
            _feed(h, os.pread(fd, b - a, base + a))
        else:
            _feed(h, os.pread(fd, _EDGE, base + a), os.pread(fd, _EDGE, base + b - _EDGE))


def _opaque(h: Any, fd: int, size: int) -> None:
    """`_SAMPLES` pieces of `_SAMPLE_BYTES` spread evenly over the file (the whole file when it is small)."""
    if size <= _SAMPLES * _SAMPLE_BYTES:
        _feed(h, os.pread(fd, size, 0))
        return
    step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
    for i in range(_SAMPLES):
        _feed(h, os.pread(fd, _SAMPLE_BYTES, i * step))


def _hub_snapshot(repo: str, revision: str | None) -> str | None:
    """The folder of `repo`'s snapshot in the local Hugging Face cache, or None (not a hub name, not
    cached, huggingface_hub not installed).  Reads the cache only: never the network."""
    if repo.count("/") > 1 or repo.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json", revision=revision)
    except Exception:
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m cortex_cache.weights PATH", file=sys.stderr)
        return 2
    try:
        print(identity(args[0]))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {args[0]}: {e.strerror or e}", file=sys.stderr)
        return 66 if isinstance(e, FileNotFoundError) else 74
    return 0


__all__ = ["ENV", "UNKNOWN", "Weights", "check_id", "identity", "resolve"]

if __name__ == "__main__":
    sys.exit(main())

