"""The KV-chunk layer: KV tensors in and out of a pool, keyed by token prefixes.

Chunk keys (identical across processes, restarts, machines and Python
versions: no `hash()`, no pickle)::

    tag      = b"cortex-kv/1\\0" + model + b"\\0" + layout [+ b"\\0weights:" + weights]
    layout   = b"<dtype>:<num_layers>x2x<chunk_tokens>x<num_heads>x<head_dim>"  e.g. b"float16:32x2x256x8x128"
    digest_0 = SHA-256(32 zero bytes || tokens[0:C] as uint32 little-endian || tag)
    digest_i = SHA-256(digest_{i-1} || tokens[i*C:(i+1)*C] as uint32 little-endian || tag)
    key_i    = "kv/<model>/" [+ "<weights>/"] + hex(digest_i)

`weights` names the model's weights (cortex_cache/weights.py: a name of
yours, or `cortex_cache.weights.identity(checkpoint_path)`), so that KV
computed by other weights under the same model name is never served; without
it (and without CORTEX_CACHE_WEIGHTS) the keys name model and layout only.

so chunk i's key names the whole prefix up to its end, and two prompts that
share a prefix share its chunks.  SHA-256, not a fast non-cryptographic
hash: prompts come from users, and a collision crafted by one user must not
hand them another user's KV (the reason vLLM moved its prefix cache to
SHA-256).  It costs ~11 ns a token given as an array or tensor, ~35 ns
from a Python list (`benchmarks/bench_kv.py`).

Partial last chunk: only whole chunks are stored and looked up; the tokens
after the last whole chunk are left to the engine to recompute, so
`lookup` and `retrieve` return multiples of `chunk_tokens`.

Each entry is a 64-byte header and then the chunk's KV, a C-contiguous
`[num_layers, 2, chunk_tokens, num_heads, head_dim]` array of `dtype`::

    0  4s  magic b"CKV1"        4  u16 version (1)   6 u16 reserved
    8  16s fingerprint: the first 16 bytes of SHA-256(tag)
    24 u64 payload bytes        32 u32 chunk tokens   36 .. 63 zero

A chunk whose header is not ours -- another model or layout, or anything
else stored under the key -- is refused (a miss, counted in `refused`),
never reinterpreted.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import KeyNotFound, UsageError
from .lookups import DEFAULT_CAPACITY, LookupMemo
from .weights import ENV, check_id

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .pool import Pool

HEADER = struct.Struct("<4sHH16sQI28x")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 64
MAGIC = b"CKV1"
# Chunks pinned at once to check their headers: well under a pool's pin records (1024 by default).
PRESENT_BATCH = 256
VERSION = 1
_MODEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


def token_bytes(tokens: Any) -> bytes:
    """Token ids as uint32 little-endian bytes; UsageError for anything that is not ids in [0, 2**32)."""
    if type(tokens).__module__.startswith("torch"):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise UsageError("tokens must be a 1-D sequence of integer token ids")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
        raise UsageError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chunk_digests(tokens: Any, chunk_tokens: int, tag: bytes, prev: bytes = bytes(32)) -> list[bytes]:
    """SHA-256 chain digests of every whole chunk of `tokens` (see the module doc); `prev`: the digest of
    the chunk before `tokens[0]` (the chain of a longer prompt goes on from its last known digest)."""
    raw = token_bytes(tokens)
    step = 4 * chunk_tokens
    out = []
    for start in range(0, len(raw) - step + 1, step):
        prev = hashlib.sha256(prev + raw[start : start + step] + tag).digest()
        out.append(prev)
    return out


class KVCache:
    """KV chunks of one model and layout in a pool.

    `kv` tensors are `[num_layers, 2, tokens, num_heads, head_dim]` (2: keys,
    values), on the CPU or a CUDA device.  Any number of processes can use
    KVCaches over the same pool at once.
    """

    def __init__(
        self, pool: "Pool", *, model: str, num_layers: int, num_heads: int, head_dim: int, dtype: Any,
        chunk_tokens: int = 256, weights: str | None = None,
    ) -> None:
        from .gpu import as_dtype, torch_module

        if not isinstance(model, str) or not _MODEL_RE.fullmatch(model):
            raise UsageError(f"invalid model tag {model!r}: 1-128 of A-Z a-z 0-9 . _ : / @ + -")
        for name, v in (("num_layers", num_layers), ("num_heads", num_heads), ("head_dim", head_dim),
                        ("chunk_tokens", chunk_tokens)):
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"{name} must be a positive integer, not {v!r}")
        torch = torch_module()
        self.pool = pool
        self.model = model
        self.dtype = as_dtype(dtype)
        self.chunk_tokens = chunk_tokens
        self.chunk_shape = (num_layers, 2, chunk_tokens, num_heads, head_dim)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.payload_bytes = int(np.prod(self.chunk_shape)) * self.itemsize
        dname = str(self.dtype).removeprefix("torch.")
        layout = f"{dname}:{num_layers}x2x{chunk_tokens}x{num_heads}x{head_dim}".encode()
        self.tag = b"cortex-kv/1\0" + model.encode() + b"\0" + layout
        # The weights' name: given, else the environment's; checked (UsageError), never computed here.
        env = os.environ.get(ENV)
        self.weights = check_id(weights) if weights is not None else check_id(env, ENV) if env else None
        self.prefix = f"kv/{model}/"
        if self.weights is not None:
            self.tag += b"\0weights:" + self.weights.encode()
            self.prefix += self.weights + "/"
        self.fingerprint = hashlib.sha256(self.tag).digest()[:16]
        self._header = HEADER.pack(MAGIC, VERSION, 0, self.fingerprint, self.payload_bytes, chunk_tokens)
        self.refused = 0  # chunks found under our keys but not ours
        # Lookups remembered per request id (lookups.py): chunks of ours, found by _present_many.
        self.memo = LookupMemo(self.prefix, DEFAULT_CAPACITY, lambda pool, keys: self._present_many(keys, leading=True))

    # ------------------------------------------------------------------ keys

    def keys(self, tokens: Any) -> list[str]:
        """The pool keys of every whole chunk of `tokens`, in order."""
        return [self.prefix + d.hex() for d in chunk_digests(tokens, self.chunk_tokens, self.tag)]

    def _check_kv(self, kv: "torch.Tensor", n_tokens: int) -> None:
        want = self.chunk_shape
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != (want[0], 2, want[3], want[4]):
            raise UsageError(f"kv has shape {tuple(kv.shape)}; this cache takes "
                             f"[{want[0]}, 2, tokens, {want[3]}, {want[4]}]")
        if kv.dtype != self.dtype:
            raise UsageError(f"kv is {kv.dtype}; this cache holds {self.dtype}")
        if kv.shape[2] < n_tokens:
            raise UsageError(f"kv holds {kv.shape[2]} tokens, fewer than the {n_tokens} to store")

    def _ours(self, header: bytes | memoryview) -> bool:
        return bytes(header[:HEADER_SIZE]) == self._header

    # ------------------------------------------------------------------ store

    def store(self, tokens: Any, kv: "torch.Tensor", *, ttl: float | None = None, priority: int = 0) -> int:
        """Store the KV of every whole chunk of `tokens` not already cached; return the tokens covered.

        `kv[:, :, t]` is the KV of `tokens[t]`.  Values go straight from `kv`
        (CPU or GPU) into reserved pool memory, one chunk at a time.
        """
        from .gpu import copy_executor, copy_with_pool, host_tensor, raise_first, wait_jobs
        from xxhash import xxh3_64_intdigest

        keys = self.keys(tokens)
        self._check_kv(kv, len(keys) * self.chunk_tokens)
        c = self.chunk_tokens
        present = self._present_many(keys)  # one lock hold for the whole request
        todo = [i for i, ok in enumerate(present) if not ok]
        # The missing chunks reserved in one lock hold; those before the first that finds no room
        # are stored, the rest given back, and that error raised.
        writers = self.pool.reserve_write_many(
            [(keys[i], HEADER_SIZE + self.payload_bytes) for i in todo], ttl=ttl, priority=priority)
        fit = next((n for n, w in enumerate(writers) if isinstance(w, Exception)), len(writers))
        self.pool.abort_many(writers[fit:])
        # A chunk is checksummed on a worker thread while the next one is
        # copied (xxhash releases the GIL); all are committed in one lock hold.
        jobs: list = []
        try:
            for w, i in zip(writers[:fit], todo):
                w.memoryview[:HEADER_SIZE] = self._header  # type: ignore[index]
                dst = host_tensor(self.pool, w.offset + HEADER_SIZE, self.payload_bytes, self.dtype,
                                   self.chunk_shape)
                copy_with_pool(dst, kv[:, :, i * c : (i + 1) * c], self.pool, w.offset + HEADER_SIZE)
                del dst
                jobs.append(copy_executor().submit(xxh3_64_intdigest, w.memoryview))
            sums = [j.result() for j in jobs]
        except BaseException:
            wait_jobs(jobs)
            self.pool.abort_many(writers)
            raise
        raise_first(self.pool, self.pool.commit_many(writers[:fit], sums) + writers[fit:fit + 1], writers)
        return len(keys) * c

    # ------------------------------------------------------------------ lookup and retrieve

    def _present(self, key: str) -> bool:
        """Is a chunk of ours stored under `key`?  (Refuses and counts anything else.)"""
        try:
            with self.pool.view(key) as mv:
                ok = mv.nbytes == HEADER_SIZE + self.payload_bytes and self._ours(mv)
        except KeyNotFound:
            return False
        if not ok:
            self.refused += 1
        return ok

    def _present_many(self, keys: list[str], leading: bool = False) -> list[bool]:
        """`_present` of many keys, PRESENT_BATCH at a time, each batch pinned and released in one lock
        hold each (a pool's pin records are few: 1024 by default, shared by every process); `leading`:
        stop after the batch with the first False (the rest left out of the answer)."""
        out: list[bool] = []
        for a in range(0, len(keys), PRESENT_BATCH):
            views = self.pool.view_many(keys[a : a + PRESENT_BATCH])
            try:
                for ev in views:
                    if ev is None or isinstance(ev, Exception):
                        out.append(False)
                        continue
                    mv = ev.memoryview
                    ok = mv.nbytes == HEADER_SIZE + self.payload_bytes and self._ours(mv)
                    if not ok:
                        self.refused += 1
                    out.append(ok)
            finally:
                self.pool.release_many(views)
            if leading and False in out[a:]:
                break
        return out

    def lookup(self, tokens: Any, request_id: Any = None) -> int:
        """How many leading tokens of `tokens` have their KV cached (a multiple of chunk_tokens).

        `request_id` (any hashable): the answer is remembered for that request, so that its next lookup
        hashes only tokens added since and looks up only chunks that may have changed (`cortex_cache.
        LookupMemo`; the same answers, exact across processes).  Under one request id `tokens` only grow;
        `forget(request_id)` when the request is done (at most 4096 are remembered, least recent out).
        """
        if request_id is not None:
            return self.memo.leading(self.pool, request_id, self._request_digests(request_id, tokens)) \
                * self.chunk_tokens
        n = 0
        for ok in self._present_many(self.keys(tokens), leading=True):
            if not ok:
                break
            n += self.chunk_tokens
        return n

    def forget(self, request_id: Any) -> None:
        """Drop what `lookup` remembers of `request_id` (nothing if none)."""
        self.memo.forget(request_id)

    def _request_digests(self, request_id: Any, tokens: Any) -> list[bytes]:
        """The chain digests of `tokens`: those remembered for the request, and the new chunks' hashed on.

        The remembered ones are used if the first and the last remembered chunks still have the same
        tokens (hashed again: two chunks, not the prompt); otherwise the whole prompt is hashed afresh.
        A change only in the chunks between is not seen: under one request id, tokens only grow."""
        if getattr(tokens, "ndim", 1) != 1 or not hasattr(tokens, "__len__"):
            token_bytes(tokens)  # its UsageError for anything that is not a 1-D sequence
            tokens = list(tokens)
        if type(tokens).__module__.startswith("torch") and tokens.device.type == "cpu":
            # A view of the same memory: a slice converted below then costs half what a tensor's does.
            tokens = tokens.detach().numpy()
        c = self.chunk_tokens
        known = self.memo.digests(request_id)
        whole, k = len(tokens) // c, len(known)
        if k and (whole < k or not self._same_ends(tokens, known, whole)):
            known, k = [], 0
        if not k:
            token_bytes(tokens[whole * c :])  # the partial last chunk is checked, as without a request id
        if whole == k:
            return known
        return known + chunk_digests(tokens[k * c : whole * c], c, self.tag, known[-1] if k else bytes(32))

    def _same_ends(self, tokens: Any, digests: list[bytes], whole: int) -> bool:
        """Do the first and the last of `digests` (k <= whole chunks) still name chunks 0 and k - 1 of
        `tokens`?  The partial last chunk's ids are checked in the same conversion (UsageError)."""
        c, k = self.chunk_tokens, len(digests)
        spans = [tokens[:c], tokens[(k - 1) * c : k * c], tokens[whole * c :]]
        # One conversion (and range check) of an array's three pieces costs what one of them would.
        raw = token_bytes(np.concatenate(spans)) if isinstance(tokens, np.ndarray) else \
            b"".join(token_bytes(s) for s in spans)
        step = 4 * c
        sha, tag = hashlib.sha256, self.tag
        return sha(bytes(32) + raw[:step] + tag).digest() == digests[0] and \
            sha((digests[k - 2] if k > 1 else bytes(32)) + raw[step : 2 * step] + tag).digest() == digests[k - 1]

    def retrieve(self, tokens: Any, out: "torch.Tensor | None" = None, device: Any = None) -> tuple[int, "torch.Tensor"]:
        """Copy the cached KV of the leading chunks of `tokens` into `out`; (tokens retrieved, out).

        `out`: `[num_layers, 2, >= tokens, num_heads, head_dim]`, on any
        device; else a new CPU tensor (or on `device`) of the retrieved
        length.  Stops at the first chunk missing or not ours.
        """
        from .gpu import copy_with_pool, device_of, torch_module

        torch = torch_module()
        keys = self.keys(tokens)
        c = self.chunk_tokens
        if out is not None:
            self._check_kv(out, 0)
            if out.shape[2] < len(keys) * c:
                keys = keys[: out.shape[2] // c]
        parts: list = []
        n = 0
        views = self.pool.view_many(keys)  # the request's chunks pinned in one lock hold
        try:
            for ev in views:
                if ev is None or isinstance(ev, Exception):
                    break
                mv = ev.memoryview
                if mv.nbytes != HEADER_SIZE + self.payload_bytes or not self._ours(mv):
                    self.refused += 1
                    break
                src = _chunk_tensor(torch, mv, self.payload_bytes, self.dtype, self.chunk_shape)
                if out is not None:
                    copy_with_pool(out[:, :, n : n + c], src, self.pool, ev.offset + HEADER_SIZE)
                else:
                    parts.append(src.clone())
                del src
                n += c
        finally:
            self.pool.release_many(views)
        if out is None:
            dev = device_of(device) if device is not None else torch.device("cpu")
            if parts:
                out = torch.cat(parts, dim=2).to(dev)
            else:
                out = torch.empty((*self.chunk_shape[:2], 0, *self.chunk_shape[3:]), dtype=self.dtype, device=dev)
        return n, out


def _chunk_tensor(torch: Any, mv: memoryview, nbytes: int, dtype: Any, shape: tuple) -> "torch.Tensor":
    """The payload of a read-only view as a tensor, without a copy.

    torch warns about read-only memory; nothing writes to this tensor, so the warning is silenced."""
    import warnings

    arr = np.frombuffer(mv, np.uint8, nbytes, HEADER_SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr).view(dtype).view(shape)


__all__ = ["KVCache", "chunk_digests", "token_bytes", "HEADER_SIZE"]
