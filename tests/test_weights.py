"""The identity of a model's weights (cortex_cache/weights.py), which every integration folds into its keys."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from cortex_cache.errors import UsageError
from cortex_cache.weights import ENV, UNKNOWN, identity, resolve


def _safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """A .safetensors file written by hand: 8-byte header length, the JSON header, the tensors' bytes."""
    header, data, off = {"__metadata__": {"format": "pt"}}, b"", 0
    for name, t in tensors.items():
        raw = t.astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def _checkpoint(d, seed: int = 0, middle: float | None = None):
    """A two-shard checkpoint of seeded random tensors; `middle`: one value in the middle of a tensor set."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    big = rng.standard_normal((64, 64))
    if middle is not None:
        big[32, 32] = middle
    _safetensors(d / "model-00001-of-00002.safetensors", {"embed": rng.standard_normal((16, 8)), "big": big})
    _safetensors(d / "model-00002-of-00002.safetensors", {"head": rng.standard_normal((8, 16))})
    (d / "config.json").write_text(json.dumps({"rope_theta": 10000.0}))
    (d / "tokenizer.json").write_text("{}")
    return d


def test_the_identity_follows_the_weights_values_not_where_they_lie(tmp_path):
    a = identity(_checkpoint(tmp_path / "a", seed=0))
    assert len(a) == 16 and int(a, 16) >= 0
    # Re-saved with another seed: the same names, shapes and headers, other values.
    assert identity(_checkpoint(tmp_path / "a", seed=1)) != a
    assert identity(_checkpoint(tmp_path / "a", seed=0)) == a  # and back
    # A copy elsewhere (another deployment of the same checkpoint) shares it; so does a symlinked tree.
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert identity(tmp_path / "copy") == a
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert resolve(tmp_path / "link").id == a
    # What is not the weights leaves it alone: the tokenizer, hidden folders (a git checkout's).
    (tmp_path / "a" / "tokenizer.json").write_text('{"changed": 1}')
    (tmp_path / "a" / ".git").mkdir()
    (tmp_path / "a" / ".git" / "x.bin").write_bytes(b"1234")
    assert identity(tmp_path / "a") == a
    # The model's config (RoPE, quantisation) is part of it, and so is a shard more.
    (tmp_path / "a" / "config.json").write_text(json.dumps({"rope_theta": 500000.0}))
    assert identity(tmp_path / "a") != a
    b = _checkpoint(tmp_path / "b")
    base = identity(b)
    (b / "extra.bin").write_bytes(bytes(range(256)) * 1000)  # an opaque weight file: sampled
    with_bin = identity(b)
    assert with_bin != base
    (b / "extra.bin").write_bytes(bytes(range(256)) * 999 + bytes(255) + b"\1")  # its last bytes changed
    assert identity(b) != with_bin
    # What the samples cannot see: a value in the middle of a tensor (documented; name such weights).
    assert identity(_checkpoint(tmp_path / "c", middle=5.0)) == identity(_checkpoint(tmp_path / "d", middle=6.0))


def test_a_damaged_header_is_read_as_bytes_and_never_raises(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    f = d / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 40) + b"not json")  # a header longer than the file
    one = identity(d)
    f.write_bytes(struct.pack("<Q", 8) + b"not json" + b"x" * 100)
    two = identity(d)
    f.write_bytes(struct.pack("<Q", 30) + b'{"t": {"data_offsets": [0, 1000]}}'[:30] + b"x" * 100)
    assert len({one, two, identity(d)}) == 3


def test_where_the_identity_comes_from(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    ck = _checkpoint(tmp_path / "m")
    w = resolve(ck)
    assert w.id == identity(ck) and w.known and str(ck) in w.source and "2 weight files" in w.source
    assert resolve(ck, override="ft-2026-12-05").id == "ft-2026-12-05"  # the operator's name wins
    monkeypatch.setenv(ENV, "v7")
    assert resolve(ck).id == "v7" and ENV in resolve(ck).source
    assert resolve(ck, override="v8").id == "v8"  # the configuration over the environment
    monkeypatch.delenv(ENV)
    # Nothing to read: a revision if the model names one, else unknown (the integrations say so at start).
    assert resolve("no-such-org/no-such-model-xyz", revision="abc123").id == "rev-abc123"
    gone = resolve(tmp_path / "nothing")
    assert gone.id == UNKNOWN and not gone.known and "no checkpoint" in gone.source
    empty = tmp_path / "empty"
    empty.mkdir()
    assert resolve(empty).id == UNKNOWN and "no weight files" in resolve(empty).source
    assert resolve(None).id == UNKNOWN
    for bad in ("a/b", "", "x" * 65, "sp ace", 3):
        if bad == "":
            continue  # empty means "not set"
        with pytest.raises(UsageError, match="invalid weights"):
            resolve(ck, override=bad)
    monkeypatch.setenv(ENV, "a/b")
    with pytest.raises(UsageError, match=ENV):
        resolve(ck)


def test_the_command_prints_a_checkpoints_identity(tmp_path):
    ck = _checkpoint(tmp_path / "m")
    r = subprocess.run([sys.executable, "-m", "cortex_cache.weights", str(ck)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == identity(ck)
    r = subprocess.run([sys.executable, "-m", "cortex_cache.weights", str(tmp_path / "none")], capture_output=True,
                       text=True)
    assert r.returncode == 66 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    (tmp_path / "e").mkdir()
    r = subprocess.run([sys.executable, "-m", "cortex_cache.weights", str(tmp_path / "e")], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "no weight files" in r.stderr
