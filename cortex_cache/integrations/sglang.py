"""SGLang HiCache backend: a cortex pool as SGLang's shared storage tier (L3), sglang 0.5.x.

SGLang's hierarchical cache keeps KV pages on the GPU, then in a host-memory
pool private to each instance, then in a storage backend ("L3") that
instances may share.  This backend makes a cortex pool that L3: every SGLang
process on the host reads the pages any of them wrote, at memory speed,
bounded by the pool's size and policy, checksummed, surviving restarts
(`persist`/`restore`) and spilling to the pool's disk tier (or its Valkey/Redis tier).

Load it through SGLang's `dynamic` storage backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config \\
      '{"backend_name": "cortex", "module_path": "cortex_cache.integrations.sglang",
        "class_name": "CortexHiCacheStorage", "interface_v1": 1, "pool": "qwen"}'

SGLang's factory builds `CortexHiCacheStorage(storage_config, kwargs)`, then
calls `register_mem_pool_host(host_pool)`; its controller threads call
`batch_exists`, `batch_get_v1`/`batch_set_v1` (the zero-copy interface, with
"interface_v1": 1) or the older `get`/`set`/`batch_get`/`batch_set`/`exists`.

Extra-config keys (besides SGLang's own, listed in `_SGLANG_KEYS`):
  pool        pool name (required)
  create      create the pool if it does not exist (default false); then:
  size        its size (required with create), block_size (default 64K),
  policy      eviction policy (default auto, as `cortex cache create`),
  disk_path, disk_size, disk_write   a disk tier under it
  (the pool parameters every adapter takes: integrations/pools.py)
  namespace   prefix of the pool keys (default "sglang/")
  weights     a name for the model's weights (default: computed from the checkpoint
              at the model's path, cortex_cache/weights.py; or CORTEX_CACHE_WEIGHTS)
  verify      check every loaded page against its checksum (default true)
  workers     threads that copy and checksum the pages of a v1 batch in
              parallel (default: up to 4, one per CPU; copies and checksums
              release the GIL)

Keys.  A page is stored under
`<namespace><model>/<weights>/mha/tp<rank>of<size>/<format>/<page hash>` (an
MHA shard is one tensor-parallel rank's heads) or
`<namespace><model>/<weights>/mla/<format>/<page hash>` (MLA KV is the same on
every rank, so ranks share it), `<weights>` the identity of the model's
weights (SGLang's page hashes name tokens only: without it, pages of weights
re-saved under the same path would be served); `.pp<r>of<n>`,
`.cp<r>of<n>` and `.dcp<r>of<n>` follow the shard when those are in use.
`<format>` is 8 hex digits of the page format below (instances whose host
pools differ keep apart rather than replace each other's pages);
`<page hash>` is SGLang's own (a SHA-256 chain over the page's tokens).

Each value is a 64-byte header and then the page's bytes::

    0  4s magic b"CXSG"   4 u16 version (1)   6 u16 reserved
    8  16s format: first 16 bytes of SHA-256 of the layout tag (model, weights, MHA/MLA,
           shard, host pool class, layout, dtype, geometry, page size, and
           "v1" or "flat": which interface's byte order the page is in)
    24 16s first 16 bytes of BLAKE2b(pool key)   40 u64 payload bytes   48..63 zero

A page whose header is not this backend's format and key (another model,
layout or interface; a value copied under another key; anything else) is a
miss, counted in `stats["foreign"]`.  With `verify` a loaded page is checked
against the checksum the pool took when it was stored; a page damaged in
place is wiped from SGLang's buffer and is a miss (`stats["corrupt"]`).

The v1 path copies each page once, straight between SGLang's host pool and
the pool's shared memory: `host_pool.get_page_buffer_meta(indices)` names
the page's pieces (one K and one V run per page in the page-first layouts,
one per layer in layer-first), each checked to lie inside the host pool's
buffers before it is touched.  The legacy path stores the host pool's flat
data page (`get_data_page(index, flat=True)`).

Nothing on the data path raises: SGLang's controller threads treat an
exception as fatal.  A missing pool (not made yet, deleted, being
re-created), a full one, a damaged or foreign page, a peer killed while
writing: each is a miss or a failed store, counted in `stats` and logged
once per kind.  A pool deleted under a running SGLang is let go (so its
memory is freed) and the pool of that name is attached at the first call
after it exists (integrations/pools.py: NameWatch).  Importing this module does not
import SGLang (nor torch); the class is made on first access.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import struct
import threading
import time
from typing import Any

import numpy as np

from .. import segment
from ..copyhash import copy_hash_many
from ..errors import UsageError
from ..pool import Pool
from ..weights import ENV as WEIGHTS_ENV
from ..weights import Weights, resolve
from .copiers import Copiers
from .pools import POOL_PARAMS, Attachment

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<4sHH16s16sQ16x")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 64
MAGIC = b"CXSG"
VERSION = 1
DEFAULT_NAMESPACE = "sglang/"
_PARAMS = (*POOL_PARAMS, "namespace", "weights", "verify", "workers")
_PARALLEL_BYTES = 4 << 20  # smaller batches are copied by the calling thread alone
# Keys of the extra config that SGLang itself reads (or pops before we see them).
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
                "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys")
_GEOMETRY = ("layer_num", "start_layer", "end_layer", "head_num", "head_dim", "v_head_dim", "kv_lora_rank",
             "qk_rope_head_dim", "kv_cache_dim", "dcp_size", "dcp_rank")
_HOST_BUFFERS = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")
_COUNTERS = ("stored", "already_stored", "store_failed", "hits", "misses", "foreign", "corrupt", "unavailable",
             "errors")


class _Layout:
    """What a registered host pool's pages look like, for one interface's byte order."""

    def __init__(self, tag: bytes, page_bytes: int, pieces: int) -> None:
        self.tag = tag
        self.fingerprint = hashlib.sha256(tag).digest()[:16]
        self.page_bytes = page_bytes  # payload: the page's bytes
        self.pieces = pieces  # runs of host memory per page (v1)


_BYTE_ARRAYS: dict[int, Any] = {}


def _weights(model: str, override: Any) -> Weights:
    """The identity of the weights SGLang serves (cortex_cache/weights.py): the operator's name, else the
    checkpoint at the model's path.  SGLang names the model by its path unless --served-model-name is
    given, and may add "-<page format>" (storage_model_name); else its server arguments name the path."""
    if override is not None or os.environ.get(WEIGHTS_ENV):
        return resolve(None, override=override)
    for path in (model, model.rsplit("-", 1)[0]):
        if os.path.isabs(path) and os.path.exists(path):
            return resolve(path)
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        path, revision = getattr(args, "model_path", None), getattr(args, "revision", None)
    except Exception:  # not inside an SGLang server, or another SGLang
        path, revision = None, None
    return resolve(path or model, revision=revision)


def _host_bytes(ptr: int, n: int) -> np.ndarray:
    """n bytes of this process's memory at ptr, as a writable uint8 array (no copy)."""
    t = _BYTE_ARRAYS.get(n)
    if t is None:
        t = _BYTE_ARRAYS[n] = ctypes.c_ubyte * n
    return np.frombuffer(t.from_address(ptr), np.uint8)


class CortexHiCache:
    """The backend's logic; `CortexHiCacheStorage` is this plus SGLang's `HiCacheStorage` base."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        unknown = sorted(set(extra) - set(_PARAMS) - set(_SGLANG_KEYS))
        if unknown:
            raise UsageError(f"unknown hicache-storage-backend-extra-config keys {', '.join(unknown)}: "
                             f"valid are {', '.join(_PARAMS)}")
        name = extra.get("pool")
        if not name or not isinstance(name, str):
            raise UsageError('hicache-storage-backend-extra-config needs "pool": the name of a cortex pool')
        segment.validate_name(name)
        if extra.get("create") and extra.get("size") is None:
            raise UsageError('hicache-storage-backend-extra-config "create" needs "size" (e.g. "16G")')
        self.namespace = str(extra.get("namespace", DEFAULT_NAMESPACE))
        self.verify = bool(extra.get("verify", True))
        workers = extra.get("workers", min(4, os.cpu_count() or 1))
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise UsageError(f'hicache-storage-backend-extra-config "workers" must be a positive integer, '
                             f'not {workers!r}')
        self._copiers = Copiers(workers, f"cortex-hicache-{name}") if workers > 1 else None
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self.storage_config = storage_config
        self.model = str(getattr(storage_config, "model_name", None) or "default")
        self.weights = _weights(self.model, extra.get("weights"))
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self.model_prefix = f"{self.namespace}{self.model}/{self.weights.id}/"  # every page of these weights
        self.shard_prefix = f"{self.model_prefix}{self._shard()}/"
        if self.weights.known:
            logger.info("cortex HiCache backend (pool %r, model %r): pages keyed to weights %s (%s); retire them "
                        "with: cortex cache evict %s --prefix %s --tier all", name, self.model, self.weights.id,
                        self.weights.source, name, self.model_prefix)
        else:
            logger.warning("cortex HiCache backend (pool %r, model %r): pages not tied to the weights (%s): pages "
                           "of other weights under this model name would be served; give \"weights\" a name for "
                           "them (or set CORTEX_CACHE_WEIGHTS)", name, self.model, self.weights.source)
        self.key_prefix = self.shard_prefix  # + the page format, once the host pool is registered
        self.stats = dict.fromkeys(_COUNTERS, 0)
        self._stats_lock = threading.Lock()
        self._logged: set[str] = set()
        self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._pgs: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                      "backup_bandwidth": []}
        self.mem_pool_host: Any = None
        self._v1: _Layout | None = None
        self._flat: _Layout | None = None
        self._ranges: list[tuple[int, int]] = []
        self._attachment = Attachment(name, extra)
        with self._attachment.use() as pool:
            if pool is None:
                self._log_once("unavailable", f"cortex pool {name!r} is not available yet "
                               f"({self._attachment.last_error}); SGLang runs without it and attaches "
                               "once it exists")

    def _shard(self) -> str:
        c = self.storage_config
        shard = "mla" if self.is_mla else f"mha/tp{c.tp_rank}of{c.tp_size}"
        for part, rank, size in (("pp", "pp_rank", "pp_size"), ("cp", "attn_cp_rank", "attn_cp_size"),
                                 ("dcp", "dcp_rank", "dcp_size")):
            n = int(getattr(c, size, 1) or 1)
            if n > 1:
                shard += f".{part}{getattr(c, rank)}of{n}"
        return shard

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's page format; pages are stored and loaded through it."""
        self.mem_pool_host = mem_pool_host
        host = mem_pool_host
        base = [f"cortex-sglang/{VERSION}", self.model, f"weights={self.weights.id}", self._shard(),
                type(host).__name__,
                str(getattr(host, "layout", "")), str(getattr(host, "dtype", "")).removeprefix("torch."),
                f"page{host.page_size}"]
        base += [f"{a}={getattr(host, a)}" for a in _GEOMETRY if isinstance(getattr(host, a, None), int)]
        self._ranges = _buffer_ranges(host)
        self._v1 = self._flat = None
        try:
            import torch

            page = int(getattr(host, "logical_page_size", host.page_size))
            ptrs, sizes = host.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
            if ptrs and self._ranges:
                self._v1 = _Layout("\0".join([*base, "v1", ",".join(map(str, sizes))]).encode(),
                                   sum(sizes), len(sizes))
        except Exception as e:
            self._log_once("errors", f"host pool {type(host).__name__} has no zero-copy page buffers "
                           f"({type(e).__name__}: {e}); batch_get_v1/batch_set_v1 will miss")
        try:
            nbytes = host.get_dummy_flat_data_page().nbytes
            self._flat = _Layout("\0".join([*base, "flat", str(nbytes)]).encode(), nbytes, 1)
        except Exception as e:
            self._log_once("errors", f"host pool {type(host).__name__} has no flat data pages "
                           f"({type(e).__name__}: {e}); get/set will miss")

        used = self._exists_layout
        if used is not None:
            # Instances whose host pools differ in layout or geometry keep apart
            # instead of replacing each other's pages.
            self.key_prefix = f"{self.shard_prefix}{used.fingerprint[:4].hex()}/"

    @property
    def _exists_layout(self) -> _Layout | None:
        return self._v1 if self.interface_v1 else self._flat

    # ------------------------------------------------------------------ counting and logging

    def _count(self, what: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[what] += n

    def _log_once(self, what: str, message: str) -> None:
        if what not in self._logged:
            self._logged.add(what)
            logger.warning("cortex HiCache backend: %s (further ones are counted in get_stats(), not logged)",
                           message)

    def _fault(self, what: str, n: int, message: str) -> None:
        self._count(what, n)
        self._log_once(what, message)

    # ------------------------------------------------------------------ keys and headers

    def _key(self, page_hash: str) -> str:
        return self.key_prefix + page_hash

    def _header(self, layout: _Layout, pkey: str) -> bytes:
        return HEADER.pack(MAGIC, VERSION, 0, layout.fingerprint,
                           hashlib.blake2b(pkey.encode(), digest_size=16).digest(), layout.page_bytes)

    def _ours(self, view: memoryview, layout: _Layout, pkey: str) -> bool:
        return view.nbytes == HEADER_SIZE + layout.page_bytes and bytes(view[:HEADER_SIZE]) == self._header(
            layout, pkey)

    def _present_many(self, pool: Pool, layout: _Layout, page_hashes: list) -> list[bool]:
        """Is each page stored, and ours?  Pinned and released in one lock hold each."""
        pkeys = [self._key(h) for h in page_hashes]
        views = pool.view_many(pkeys)
        try:
            out = [ev is not None and not isinstance(ev, Exception) and self._ours(ev.memoryview, layout, pkey)
                   for pkey, ev in zip(pkeys, views)]
        finally:
            pool.release_many(views)
        foreign = sum(1 for ok, ev in zip(out, views) if not ok and ev is not None and not isinstance(ev, Exception))
        if foreign:
            self._count("foreign", foreign)
        return out

    # ------------------------------------------------------------------ v1: zero copy over the host pool

    def _pieces(self, layout: _Layout, host_indices: Any, n_pages: int) -> list[list[tuple[int, int]]] | None:
        """Each page's runs of host memory (address, bytes), checked against the host pool's buffers."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != n_pages * layout.pieces or len(sizes) != len(ptrs):
            return None
        pages = []
        for i in range(n_pages):
            run = list(zip(ptrs[i * layout.pieces : (i + 1) * layout.pieces],
                           sizes[i * layout.pieces : (i + 1) * layout.pieces]))
            if sum(n for _, n in run) != layout.page_bytes or not all(self._inside(p, n) for p, n in run):
                return None
            pages.append(run)
        return pages

    def _inside(self, ptr: int, n: int) -> bool:
        return any(lo <= ptr and ptr + n <= hi for lo, hi in self._ranges)

    def batch_set_v1(self, keys: list, host_indices: Any, extra_info: Any = None) -> list:
        n = len(keys)
        start = time.perf_counter()
        layout = self._v1
        try:
            with self._attachment.use() as pool:
                if pool is None or layout is None:
                    self._unavailable(n, layout)
                    return [False] * n
                pages = self._pieces(layout, host_indices, n)
                if pages is None:
                    self._fault("errors", n, "the host pool's page buffers do not match its registered layout")
                    return [False] * n
                out = self._store_pages(pool, layout, keys, pages)
        except Exception as e:  # never into SGLang's thread
            self._fault("errors", n, f"batch_set_v1: {type(e).__name__}: {e}")
            return [False] * n
        self._record("backup", sum(out), layout.page_bytes, start)
        return out

    def _store_pages(self, pool: Pool, layout: _Layout, page_hashes: list,
                     pages: list[list[tuple[int, int]]]) -> list[bool]:
        """Store the pages not stored yet: reserved in one lock hold, filled (on the copy threads when
        large), committed in one.  Per page, is it stored now?"""
        out = self._present_many(pool, layout, page_hashes)
        self._count("already_stored", sum(out))
        if all(out):
            return out
        todo = [n for n, ok in enumerate(out) if not ok]
        pkeys = [self._key(page_hashes[n]) for n in todo]
        writers = pool.reserve_write_many([(k, HEADER_SIZE + layout.page_bytes) for k in pkeys])
        try:
            sums = self._map(lambda kw, run: self._fill(layout, *kw, run), list(zip(pkeys, writers)),
                             [pages[n] for n in todo], layout)
        except BaseException:
            pool.abort_many(writers)
            raise
        filled = [(w, c) for w, c in zip(writers, sums) if c is not None]
        committed = iter(pool.commit_many([w for w, _ in filled], [c for _, c in filled]))
        for n, w, c in zip(todo, writers, sums):
            err = w if c is None else next(committed)
            if err is None:
                out[n] = True
                self._count("stored")
            else:  # full (everything pinned), too large, reclaimed
                self._fault("store_failed", 1, f"cannot store a page in pool {pool.name!r}: "
                            f"{type(err).__name__}: {err}")
        return out

    def _fill(self, layout: _Layout, pkey: str, w: Any, run: list[tuple[int, int]]) -> int | None:
        """Copy one page's pieces into its reserved entry after the header; the entry's checksum, or
        None if the reservation failed (`w` is then its error)."""
        if isinstance(w, Exception):
            return None
        mv = w.memoryview
        head = self._header(layout, pkey)
        mv[:HEADER_SIZE] = head
        dsts, srcs, off = [], [], HEADER_SIZE
        for ptr, nbytes in run:
            dsts.append(mv[off : off + nbytes])
            srcs.append(_host_bytes(ptr, nbytes))
            off += nbytes
        # The pieces gathered and the pool's checksum taken in one pass, each step hashed while in the
        # CPU cache, the GIL let go (copyhash.py).
        return copy_hash_many(dsts, srcs, head)

    def batch_get_v1(self, keys: list, host_indices: Any, extra_info: Any = None) -> list:
        """Load each page into its host slots; True for the leading run of hits only (all SGLang uses).

        One thread stops at the first miss; copy threads load the whole batch at once."""
        n = len(keys)
        start = time.perf_counter()
        out = [False] * n
        layout = self._v1
        try:
            with self._attachment.use() as pool:
                if pool is None or layout is None:
                    self._unavailable(n, layout)
                    return out
                pages = self._pieces(layout, host_indices, n)
                if pages is None:
                    self._fault("errors", n, "the host pool's page buffers do not match its registered layout")
                    return out
                got = self._load_pages(pool, layout, keys, pages)
                lead = got.index(False) if False in got else len(got)
                out[:lead] = [True] * lead
        except Exception as e:  # never into SGLang's thread
            self._fault("errors", 1, f"batch_get_v1: {type(e).__name__}: {e}")
            return out
        self._record("prefetch", sum(out), layout.page_bytes, start)
        return out

    def _load_pages(self, pool: Pool, layout: _Layout, page_hashes: list,
                    pages: list[list[tuple[int, int]]], upto_first_miss: bool = True) -> list[bool]:
        """Load pages into their host slots: pinned in one lock hold, copied, released in one.  Copy threads
        load the whole batch at once; one thread stops at the first page it cannot load, unless
        `upto_first_miss` is False (an answer for every page)."""
        pkeys = [self._key(h) for h in page_hashes]
        views = pool.view_many(pkeys)
        try:
            if self._parallel(len(pkeys), layout):
                return self._map(lambda kv, run: self._load(layout, *kv, run), list(zip(pkeys, views)), pages,
                                 layout)
            got = []
            for pkey, ev, run in zip(pkeys, views, pages):
                got.append(self._load(layout, pkey, ev, run))
                if not got[-1] and upto_first_miss:
                    break
            return got + [False] * (len(pkeys) - len(got))
        finally:
            pool.release_many(views)

    def _parallel(self, n: int, layout: _Layout) -> bool:
        return self._copiers is not None and n > 1 and n * layout.page_bytes >= _PARALLEL_BYTES

    def _map(self, fn: Any, keys: list, pages: list, layout: _Layout) -> list:
        """fn over the pages of a batch: on the copy threads when it moves enough bytes to pay for them."""
        if self._parallel(len(keys), layout):
            return self._copiers.map(fn, keys, pages)  # type: ignore[union-attr]
        return [fn(k, run) for k, run in zip(keys, pages)]

    def _load(self, layout: _Layout, pkey: str, ev: Any, run: list[tuple[int, int]]) -> bool:
        """Copy one pinned page (`ev`: its view, None if absent, or its error) into its host slots."""
        if ev is None or isinstance(ev, Exception):
            self._count("misses")
            return False
        src = ev.memoryview
        if not self._ours(src, layout, pkey):
            self._count("foreign")
            return False
        dsts, srcs, off = [], [], HEADER_SIZE
        for ptr, nbytes in run:
            dsts.append(_host_bytes(ptr, nbytes))
            srcs.append(src[off : off + nbytes])
            off += nbytes
        if not self.verify:
            for dst, piece in zip(dsts, srcs):
                np.copyto(dst, np.frombuffer(piece, np.uint8))  # GIL released
        # What SGLang got, checked in the same pass while still in the CPU cache (copyhash.py).
        elif copy_hash_many(dsts, srcs, src[:HEADER_SIZE]) != ev.checksum:
            for ptr, nbytes in run:
                _host_bytes(ptr, nbytes)[:] = 0  # nothing of a damaged page is left to SGLang
            self._fault("corrupt", 1, f"page {pkey!r} failed its checksum (damaged in place)")
            return False
        self._count("hits")
        return True

    def _unavailable(self, n: int, layout: _Layout | None) -> None:
        if layout is None:
            self._fault("unavailable", n, "no host pool registered (or its pages are not supported)")
        else:
            self._fault("unavailable", n, f"cortex pool {self._attachment.name!r} is not available "
                        f"({self._attachment.last_error or 'deleted'}); pages miss until it exists again")

    def _record(self, kind: str, pages: int, page_bytes: int, start: float) -> None:
        if self._metrics and pages:
            took = max(time.perf_counter() - start, 1e-9)
            with self._stats_lock:
                self._pgs[f"{kind}_pgs"].append(pages)
                self._pgs[f"{kind}_bandwidth"].append(pages * page_bytes / took / 1e9)

    # ------------------------------------------------------------------ lookups

    def batch_exists(self, keys: list, extra_info: Any = None) -> int:
        """How many leading pages are stored (and ours); stops at the first that is not."""
        try:
            with self._attachment.use() as pool:
                layout = self._exists_layout
                if pool is None or layout is None:
                    self._unavailable(len(keys), layout)
                    return 0
                present = self._present_many(pool, layout, list(keys))
                return present.index(False) if False in present else len(present)
        except Exception as e:
            self._fault("errors", 1, f"batch_exists: {type(e).__name__}: {e}")
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ the older interface: flat pages

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Load page `key` into `target_location` (a flat page tensor, else a new one); it, or None."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list, target_locations: Any = None, target_sizes: Any = None) -> list:
        """Load each page into its target (a flat page tensor, else a new one): per key it, or None.

        The whole batch is pinned in one lock hold, copied (on the copy threads when large) and
        released in one."""
        keys = list(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        out: list = [None] * len(keys)
        try:
            with self._attachment.use() as pool:
                layout = self._flat
                if pool is None or layout is None:
                    self._unavailable(len(keys), layout)
                    return out
                todo, pages, dsts = [], [], []
                for n, t in enumerate(targets[: len(keys)]):
                    dst = t if t is not None else self.mem_pool_host.get_dummy_flat_data_page()
                    run = _flat_page(layout, dst)
                    if run is None:
                        self._fault("errors", 1, "get() was given a buffer that is not one flat host page")
                        continue
                    todo.append(n)
                    pages.append(run)
                    dsts.append(dst)
                got = self._load_pages(pool, layout, [keys[n] for n in todo], pages, upto_first_miss=False)
                for n, dst, ok in zip(todo, dsts, got):
                    out[n] = dst if ok else None
        except Exception as e:
            self._fault("errors", 1, f"batch_get: {type(e).__name__}: {e}")
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store the flat page tensor `value` (a host pool's `get_data_page(i, flat=True)`) under `key`."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list, values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store each flat page tensor under its key, reserved in one lock hold and sealed in one; True
        if every page was stored."""
        keys, values = list(keys), list(values or [])
        try:
            with self._attachment.use() as pool:
                layout = self._flat
                if pool is None or layout is None:
                    self._unavailable(len(keys), layout)
                    return False
                todo, pages = [], []
                for key, value in zip(keys, values):
                    run = _flat_page(layout, value)
                    if run is None:
                        self._fault("store_failed", 1, "set() was given a value that is not one flat host page")
                        continue
                    todo.append(key)
                    pages.append(run)
                stored = self._store_pages(pool, layout, todo, pages) if todo else []
                return len(keys) == len(values) == len(todo) and all(stored)
        except Exception as e:
            self._fault("errors", 1, f"batch_set: {type(e).__name__}: {e}")
            return False

    # ------------------------------------------------------------------ housekeeping

    def clear(self) -> bool:
        """Remove this instance's pages (this model, shard and page format) from the pool."""
        try:
            with self._attachment.use() as pool:
                if pool is None:
                    return False
                for k in pool.keys(prefix=self.key_prefix):
                    pool.delete(k)
                return True
        except Exception as e:
            self._fault("errors", 1, f"clear: {type(e).__name__}: {e}")
            return False

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages and GB/s per batch since the last call); counters are in `stats`."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:
            return None
        m = StorageMetrics()
        with self._stats_lock:
            for name, values in self._pgs.items():
                getattr(m, name).extend(values)
                values.clear()
        return m

    def close(self) -> None:
        if self._copiers is not None:
            self._copiers.close()
        self._attachment.close()


def _flat_page(layout: _Layout, t: Any) -> list[tuple[int, int]] | None:
    """The one piece (address, bytes) of flat page tensor `t`, or None if it is not one page of `layout`."""
    buf = _tensor_bytes(t)
    if buf is None or buf.nbytes != layout.page_bytes:
        return None
    return [(buf.ctypes.data, buf.nbytes)]


def _tensor_bytes(t: Any) -> np.ndarray | None:
    """A CPU tensor's bytes as a uint8 array over its memory (None for anything else)."""
    if t is None or not hasattr(t, "data_ptr") or getattr(getattr(t, "device", None), "type", "cpu") != "cpu":
        return None
    if not t.is_contiguous():
        return None
    return _host_bytes(t.data_ptr(), t.numel() * t.element_size())


def _buffer_ranges(host: Any) -> list[tuple[int, int]]:
    """Address ranges of the host pool's CPU buffers: the only memory the v1 path will touch."""
    ranges = []
    for name in _HOST_BUFFERS:
        try:
            value = getattr(host, name, None)
        except Exception:
            continue
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(t, "data_ptr") and getattr(t, "device", None) is not None and t.device.type == "cpu" \
                    and t.is_contiguous() and t.numel():
                ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    return ranges


def __getattr__(name: str) -> Any:
    # SGLang's factory wants a subclass of its HiCacheStorage: made on first
    # access, so importing this module needs no SGLang.
    if name != "CortexHiCacheStorage":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    cls = type("CortexHiCacheStorage", (CortexHiCache, HiCacheStorage),
               {"__module__": __name__, "__doc__": "A cortex pool as SGLang's HiCache storage (see the module doc)."})
    globals()[name] = cls
    return cls


__all__ = ["CortexHiCache", "CortexHiCacheStorage", "HEADER_SIZE"]
