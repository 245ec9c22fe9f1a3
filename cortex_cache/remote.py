"""The remote tier: a Valkey/Redis server (standalone or cluster) below memory and disk.

One `lower.Configured` tier (the contract is lower.py's): its reads, its
writes, its operator's requests (`keys --tier remote`, `evict --tier
remote`), its configuration (`--remote`, `--remote-cluster`) and what a
restore does with it are all here.

Not a distributed store of our own: a server operators already run, shared
by pools on many hosts.  Each process that uses a pool with a remote tier has
one `RemoteTier`: a redis-py client (imported lazily; extra `remote`) and
one background writer thread.

- Put: the value is queued for the writer (a bytes value is queued as is,
  any other buffer is copied), and the caller returns at once.  The queue is
  bounded (entries and bytes); over the bound a write is dropped and counted.
- Get: a miss in memory and on disk asks the server (the caller waits for
  that one round trip, bounded by a short socket timeout), checks the value
  and promotes it into memory.
- Faults: any error counts, and the tier then rests for `backoff` seconds
  (lookups answer "miss" at once, writes wait in the queue) before it tries
  the server again; redis-py reconnects by itself.  Nothing a server does
  ever raises into a put or a get.
- Delete: the key is deleted on the server too (queued like a put).

Keys on the server: ``cortex:1:<pool name>:<key>`` -- pools of one name on
different hosts share entries, pools of different names never collide, and
the KV layer's keys name the model and layout themselves (kv.py).  Values:
a 32-byte header, then the bytes::

    0 4s magic b"CXRM"   4 u16 version (1)   6 u16 flags (bit 0: str key)
    8 u64 value length   16 u64 xxh3_64 of the value   24 u64 xxh3_64 of the key

A value whose header does not check out (another writer's, a truncated one,
damaged bytes) is a counted miss (`remote.corrupt`), never returned.

The URL (redis://, rediss://, unix://; password and database in it) is kept
in the segment, readable by whoever may open the pool; `redact()` is what
status, logs and errors show.
"""

from __future__ import annotations

import collections
import struct
import threading
import time
from typing import Any, Callable
from urllib.parse import unquote, unquote_plus, urlsplit, urlunsplit

import numpy as np
import xxhash

from .stats import hit_stats
from .errors import ServiceUnavailable, UsageError
from .layout import (
    HEADER_DTYPE, REMOTE_CLUSTER, REMOTE_ON, SLOT_FLAG_STR_KEY,
    H_REMOTE_BYTES_READ, H_REMOTE_BYTES_WRITTEN, H_REMOTE_CORRUPT, H_REMOTE_DROPPED, H_REMOTE_SENT,
    H_REMOTE_ERRORS, H_REMOTE_HITS, H_REMOTE_MISSES, H_REMOTE_PROMOTIONS, H_REMOTE_WRITTEN,
)
from .lower import Configured, Context, Creating, Fetched, Plan, Restoring, Selector, too_small

HEADER = struct.Struct("<4sHHQQQ")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32
MAGIC = b"CXRM"
VERSION = 1
SCHEMES = ("redis", "rediss", "unix")
MAX_QUEUE_ENTRIES = 4096
MAX_QUEUE_BYTES = 256 << 20
SOCKET_TIMEOUT = 2.0
BACKOFF = 1.0
CLOSE_FLUSH = 5.0  # seconds close() lets queued writes finish
_BATCH = 500  # keys per round trip of an operator's request (evict, entries)


def check_url(url: str) -> str:
    """The URL if it is one we can use; UsageError (with the credentials hidden) if not."""
    if not isinstance(url, str) or not url:
        raise UsageError("remote URL must be a non-empty string like redis://host:6379/0")
    try:
        url.encode()
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except (ValueError, UnicodeError) as e:  # a malformed IPv6 literal, a port out of range, a lone surrogate
        raise UsageError(f"remote URL {redact(url)!r}: {_why(e)}") from None
    if parts.scheme not in SCHEMES:
        raise UsageError(f"remote URL {redact(url)!r}: scheme must be one of {', '.join(SCHEMES)}")
    if parts.scheme == "unix" and not parts.path:
        raise UsageError(f"remote URL {redact(url)!r}: unix:// needs a socket path")
    if parts.scheme != "unix" and not parts.hostname:
        raise UsageError(f"remote URL {redact(url)!r}: no host")
    if len(url.encode()) >= 1024:
        raise UsageError("remote URL is too long (at most 1023 bytes)")
    return url


def redis_missing() -> str | None:
    """Why this process cannot talk to a server (redis-py not installed), or None."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed: pip install 'cortex-cache[remote]'"
    return None


def _why(e: Exception) -> str:
    msg = str(e)
    if "IPv6" in msg:
        return "malformed IPv6 address (write it in brackets: redis://[::1]:6379/0)"
    if isinstance(e, UnicodeError):
        return "not valid text"
    return "bad port" if "port" in msg.lower() else "malformed"


# Query parameters redis-py's from_url passes on as credentials (redis.connection.parse_url).
_SECRET_QUERY = ("password", "username")


def redact(url: str) -> str:
    """The URL with every credential hidden: the whole user-info part and `password`/`username` query values."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = parts.query
    if query:
        items = []
        for item in query.split("&"):
            k, eq, _v = item.partition("=")
            items.append(f"{k}=***" if eq and unquote(k).lower() in _SECRET_QUERY else item)
        query = "&".join(items)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def secrets_of(url: str) -> list[str]:
    """The credential strings in `url`, raw and decoded, longest first (for scrubbing messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url] if url else []
    found: set[str] = set()
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        for piece in (userinfo, *userinfo.split(":", 1)):
            found.update({piece, unquote(piece)})
    for item in parts.query.split("&"):
        k, eq, v = item.partition("=")
        if eq and unquote(k).lower() in _SECRET_QUERY:
            found.update({v, unquote(v), unquote_plus(v)})
    return sorted((x for x in found if x), key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text` (an error message) with `url` and every credential in it hidden."""
    text = text.replace(url, redact(url))
    for secret in secrets_of(url):
        text = text.replace(secret, "***")
    return text


def remote_key(pool_name: str, kb: bytes) -> bytes:
    return b"cortex:1:" + pool_name.encode() + b":" + kb


def encode(kb: bytes, value: memoryview, flags: int) -> list:
    head = HEADER.pack(MAGIC, VERSION, flags, value.nbytes, xxhash.xxh3_64_intdigest(value),
                       xxhash.xxh3_64_intdigest(kb))
    return [head, value]


def read_head(kb: bytes, data: bytes) -> tuple[int, int, int] | None:
    """(flags, value length, xxh3_64 of the value) if `data` starts with a header of a record of `kb`."""
    if len(data) < HEADER_SIZE:
        return None
    magic, version, flags, n, vcheck, kcheck = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or kcheck != xxhash.xxh3_64_intdigest(kb):
        return None
    return flags, n, vcheck


def decode(kb: bytes, data: bytes) -> tuple[memoryview, int, int] | None:
    """(value, flags, xxh3_64 of the value) if `data` is a record of `kb` that checks out, else None."""
    head = read_head(kb, data)
    if head is None or head[1] != len(data) - HEADER_SIZE:
        return None
    flags, _, vcheck = head
    value = memoryview(data)[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(value) != vcheck:
        return None
    return value, flags, vcheck


class RemoteTier(Configured):
    """This process's client and writer for one pool's remote tier."""

    name = "remote"
    distance = 2  # asked last: a round trip to the server
    shared = True  # other hosts' pools of the same name use it too
    takes_puts = True  # every put is queued for the server (with admission: what memory evicts, reused)
    takes_deletes = True
    OPTIONS = {"remote": None, "remote_cluster": False}
    HEADER_FIELDS = ("remote_flags", "remote_url")

    def __init__(self, url: str, cluster: bool, core: Any, reopen: Callable[[], Any], *,
                 socket_timeout: float = SOCKET_TIMEOUT, backoff: float = BACKOFF,
                 max_entries: int = MAX_QUEUE_ENTRIES, max_bytes: int = MAX_QUEUE_BYTES) -> None:
        """`core`: the caller's pool core (counts of lookups, made in the caller's thread); `reopen()` opens
        another handle on the pool (with a `core` and a `close()`) for the writer thread's counts."""
        self.url = url
        self.cluster = cluster
        self.pool_name = core.name
        self._core = core
        self._reopen = reopen
        self._writer_pool: Any = None  # the writer thread's own handle (an OFD lock excludes threads only across handles)
        self.socket_timeout = socket_timeout
        self.backoff = backoff
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.monotonic: Callable[[], float] = time.monotonic
        self.unavailable: str | None = None
        self._client: Any = None
        self._retry_at = 0.0
        self.last_error: str | None = None
        self._queue: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._cv = threading.Condition()  # guards the queue only: nobody holds it across the network
        self._client_lock = threading.Lock()  # guards making and dropping the client (redis-py's is thread-safe)
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._abandoned = False  # a forked child's copy: the writer thread is its parent's
        self.unavailable = redis_missing()

    @classmethod
    def attach(cls, core: Any, ctx: Context) -> "RemoteTier | None":
        flags = int(core.fields.remote_flags[0])
        if not flags & REMOTE_ON:
            return None
        url = bytes(core.fields.remote_url[0]).decode("utf-8", "replace")
        return cls(url, bool(flags & REMOTE_CLUSTER), core, ctx.reopen)

    # ------------------------------------------------------------------ the tier contract (lower.py)

    def fetch(self, kb: bytes, kh: int, found: Any, room: int | None) -> Fetched | None:
        got = self.get(kb)  # checked; None on a miss, a bad record or any trouble with the server
        if got is None:
            return None
        value, flags, checksum = got
        too_small(room, value.nbytes)
        return Fetched(value, flags & SLOT_FLAG_STR_KEY, checksum, 0.0, 0, None)

    def served(self, got: Fetched, promoted: bool) -> None:
        self.count_hit(memoryview(got.value).nbytes, int(promoted))

    def offer_put(self, kb: bytes, value: Any, flags: int, ttl: float | None) -> None:
        self.put(kb, value, flags, ttl)  # queued; the caller never waits on the network

    def offer_delete(self, kb: bytes) -> None:
        self.delete(kb)

    def evicted(self, i: int, explicit: bool) -> None:
        """With admission (lock held): memory lets entry `i`, read since its put, go; queued for the server,
        which is written after the lock is let go."""
        core = self._core
        off, vlen = core.value_at(i)
        e = float(core.columns["expiry"][i])
        ttl = e - core.clock() if e else None
        if ttl is None or ttl > 0:
            self.put(core.key_bytes(i), core.mv[off : off + vlen].tobytes(),
                     int(core.columns["flags"][i]) & SLOT_FLAG_STR_KEY, ttl)

    def keys(self, pb: bytes, limit: int | None) -> list[Any]:
        return [e["key"] for e in self.entries(pb, limit)]

    def remove(self, sel: Selector) -> tuple[int, int]:
        if sel.percent is not None or sel.target is not None or sel.expired:
            raise UsageError("the remote tier evicts by --key, --prefix or --all "
                             "(the server expires and evicts by its own policy)")
        if sel.keys is not None:
            return self.evict(keys=sel.keys)
        return self.evict(prefix=sel.prefix or b"")

    def stop(self, forked: bool) -> None:
        if forked:
            self._abandoned = True  # its thread is the parent's; nothing to drain here
        else:
            self.close()  # lets queued writes finish (a few seconds at most)

    def replaced(self) -> str:
        return f"left as it is: {redact(self.url)} is shared with other hosts (evict --tier remote empties it)"

    # ------------------------------------------------------------------ configuration

    @classmethod
    def read_config(cls, core: Any) -> dict[str, Any] | None:
        h = core.header[0]
        flags = int(h["remote_flags"])
        if not flags & REMOTE_ON:
            return None
        return {"url": bytes(h["remote_url"]).decode("utf-8", "replace"), "cluster": bool(flags & REMOTE_CLUSTER)}

    @classmethod
    def decode_config(cls, part: Any, bad: Callable[[str], Exception]) -> dict[str, Any]:
        if not (isinstance(part, dict) and isinstance(part.get("url"), str) and isinstance(part.get("cluster"), bool)):
            raise bad("has a bad remote tier")
        try:
            check_url(part["url"])  # what `create --remote` refuses, a snapshot may not ask for
        except UsageError as e:
            raise bad(f"has a remote tier the command line would refuse: {e}") from None
        return {"url": part["url"], "cluster": part["cluster"]}

    @classmethod
    def redacted(cls, part: dict[str, Any]) -> dict[str, Any]:
        return {**part, "url": redact(part["url"])}

    @classmethod
    def describe(cls, part: dict[str, Any]) -> str:
        return redact(part["url"])

    @classmethod
    def want(cls, opts: dict[str, Any], home: str) -> dict[str, Any] | None:
        if opts["remote"] is None:
            if opts["remote_cluster"]:
                raise UsageError("remote_cluster needs a remote URL")
            return None
        return {"url": check_url(opts["remote"]), "cluster": bool(opts["remote_cluster"])}

    @classmethod
    def differences(cls, want: dict[str, Any] | None, have: dict[str, Any] | None) -> list[str]:
        if want is None or have is None or want == have:
            return super().differences(want, have)
        return [f"remote {redact(have['url'])}{' (cluster)' if have['cluster'] else ''} "
                f"(asked {redact(want['url'])}{' (cluster)' if want['cluster'] else ''})"]

    @classmethod
    def plan(cls, want: dict[str, Any], opts: dict[str, Any], pool: Creating) -> Plan:
        why = redis_missing()
        if why:
            raise ServiceUnavailable(f"pool {pool.name!r} cannot have a remote tier: {why}")
        return _Recorded(cls, want)

    @classmethod
    def record(cls, header: Any, part: dict[str, Any]) -> None:
        header["remote_flags"] = REMOTE_ON | (REMOTE_CLUSTER if part["cluster"] else 0)
        header["remote_url"] = part["url"].encode()

    @classmethod
    def restoring(cls, part: dict[str, Any], target: str) -> Restoring:
        why = redis_missing()
        if why:
            raise ServiceUnavailable(f"the snapshot's pool has a remote tier ({redact(part['url'])}): {why}")
        # Recorded under the real name only: the staging handle must never talk to the server.
        return Restoring({}, True, None)

    @classmethod
    def restored(cls, part: dict[str, Any], made: dict[str, Any], tier: Configured | None) -> str:
        return f"attached {redact(part['url'])}" + (" (cluster)" if part["cluster"] else "")

    # ------------------------------------------------------------------ connection

    def _connect(self) -> Any:
        with self._client_lock:
            if self._client is None:
                import redis
                from redis.cluster import RedisCluster

                kw = {"socket_timeout": self.socket_timeout, "socket_connect_timeout": self.socket_timeout}
                if self.cluster:
                    self._client = RedisCluster.from_url(self.url, **kw)
                else:
                    self._client = redis.Redis.from_url(self.url, **kw)
            return self._client

    def _resting(self) -> bool:
        return self.monotonic() < self._retry_at

    def _failed(self, e: BaseException, writer: bool) -> None:
        # The error is recorded and counted before the rest begins: whoever sees the tier resting
        # (another thread's lookup, status) also sees why.  A command already in flight in another
        # thread when the rest began fails too, on the client closed below (redis-py then raises
        # whatever its closed socket gives, a TypeError): the first error says why, not that one.
        if self._resting():
            return
        self.last_error = f"{type(e).__name__}: {scrub(str(e), self.url)}"[:300]
        self._count(H_REMOTE_ERRORS, writer=writer)
        self._retry_at = self.monotonic() + self.backoff
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:  # a fresh client (and connections) after the rest
            try:
                client.close()
            except Exception:
                pass

    def _count(self, field: int, n: int = 1, writer: bool = False) -> None:
        """Add to a shared counter, under the pool lock of this thread's own handle."""
        _add(self._writer_core() if writer else self._core, ((field, n),))

    # ------------------------------------------------------------------ reads (caller's thread)

    def get(self, kb: bytes) -> tuple[memoryview, int, int] | None:
        """(value, flags, checksum) of `kb` from the server, checked; None on a miss, a bad record or any error.

        A hit is counted by the caller (`count_hit`), with its promotion, in one lock hold."""
        if self.unavailable or self._resting():
            self._count(H_REMOTE_MISSES)
            return None
        try:
            data = self._connect().get(remote_key(self.pool_name, kb))
        except Exception as e:  # noqa: BLE001 - the server's trouble never reaches the caller
            self._failed(e, writer=False)
            return None
        if data is None:
            self._count(H_REMOTE_MISSES)
            return None
        got = decode(kb, data)
        if got is None:
            self._count_many(((H_REMOTE_CORRUPT, 1), (H_REMOTE_MISSES, 1)))
            return None
        return got

    def count_hit(self, nbytes: int, promoted: int) -> None:
        self._count_many(((H_REMOTE_HITS, 1), (H_REMOTE_BYTES_READ, HEADER_SIZE + nbytes),
                          (H_REMOTE_PROMOTIONS, promoted)))

    def _count_many(self, pairs: tuple) -> None:
        _add(self._core, pairs)

    # ------------------------------------------------------------------ writes (background)

    def put(self, kb: bytes, value: Any, flags: int, ttl: float | None = None) -> None:
        """Queue a write; never blocks on the network (drops and counts when the queue is full)."""
        self._enqueue(("set", kb, value, flags, ttl))

    def delete(self, kb: bytes) -> None:
        self._enqueue(("del", kb, None, 0, None))

    def _enqueue(self, item: tuple) -> None:
        if self.unavailable:  # no redis-py here: the write is lost, and says so in status
            self._count(H_REMOTE_DROPPED)
            return
        value = item[2]
        n = 0
        if value is not None:
            if value.__class__ is not bytes:
                value = memoryview(value).tobytes()  # the caller may reuse its buffer
                item = (item[0], item[1], value, item[3], item[4])
            n = len(value)
        with self._cv:
            if self._stop:
                return
            drop = len(self._queue) >= self.max_entries or self._queued_bytes + n > self.max_bytes
            if not drop:
                self._queue.append(item)
                self._queued_bytes += n
                drop = False
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=f"cortex-remote-{self.pool_name}",
                                                    daemon=True)
                    self._thread.start()
                self._cv.notify()
        if drop:
            self._count(H_REMOTE_DROPPED)

    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + (1 if self._busy else 0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent (or failed); False on timeout.

        `timeout=None` waits the library's lock timeout (lock.default_timeout):
        a server that stops answering never holds the caller for ever."""
        from .lock import default_timeout

        # Real time, never the rest period's clock (`self.monotonic`, which tests may stop):
        # a flush always returns.
        deadline = time.monotonic() + (default_timeout() if timeout is None else timeout)
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(None if left == float("inf") else left)
        return True

    def _run(self) -> None:
        try:
            self._writer_pool = self._reopen()
        except Exception:
            self._writer_pool = None  # the pool is gone: write anyway, count nothing
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._stop:
                        self._cv.wait()
                    if not self._queue:
                        return
                    rest = self._retry_at - self.monotonic()
                    if rest > 0 and not self._stop:
                        self._cv.wait(rest)  # resting after an error; close() wakes us
                        continue
                    op, kb, value, flags, ttl = self._queue.popleft()
                    self._queued_bytes -= len(value) if value is not None else 0
                    self._busy = True
                    abandon = self._stop and self._resting()
                try:
                    ok = None if abandon else self._send(op, kb, value, flags, ttl)  # the queue is free meanwhile
                    # Counted before the write stops being "busy": flush() returns with the counts in place.
                    if ok is None:
                        self._count(H_REMOTE_DROPPED, writer=True)
                    elif ok:
                        nbytes = HEADER_SIZE + len(value) if value is not None else 0
                        self._count_writer(((H_REMOTE_SENT, 1), (H_REMOTE_WRITTEN, 1), (H_REMOTE_BYTES_WRITTEN, nbytes)))
                    else:
                        self._count(H_REMOTE_SENT, writer=True)
                finally:
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()
        finally:
            if self._writer_pool is not None:
                self._writer_pool.close()
                self._writer_pool = None

    def _count_writer(self, pairs: tuple) -> None:
        _add(self._writer_core(), pairs)

    def _send(self, op: str, kb: bytes, value: bytes | None, flags: int, ttl: float | None) -> bool:
        """One command; False (counted, and the tier rests) if it failed."""
        try:
            client = self._connect()
            key = remote_key(self.pool_name, kb)
            if op == "set":
                assert value is not None
                head, _ = encode(kb, memoryview(value), flags)
                # A TTL goes with it, so the server forgets the entry when the pool would.
                client.set(key, head + value, px=max(1, int(ttl * 1000)) if ttl else None)
            else:
                client.delete(key)
            return True
        except Exception as e:  # noqa: BLE001
            self._failed(e, writer=True)
            return False

    # ------------------------------------------------------------------ evict (an operator's request)

    def evict(self, keys: list[bytes] | None = None, prefix: bytes | None = None) -> tuple[int, int]:
        """Delete this pool's entries on the server now: the given `keys`, or those starting with
        `prefix` (b"" for all of them); return (entries, value bytes) removed.

        Unlike puts and gets, this answers for the server: trouble raises ServiceUnavailable (69).
        This process's queued writes are sent first, so none of them brings an evicted key back.
        """
        self.flush(CLOSE_FLUSH)

        def run(client: Any) -> tuple[int, int]:
            if keys is not None:
                names = [remote_key(self.pool_name, kb) for kb in keys]
            else:
                names = self._scan(client, prefix or b"")
            count = nbytes = 0
            for k in range(0, len(names), _BATCH):
                c, b = _unlink_batch(client, names[k : k + _BATCH])
                count, nbytes = count + c, nbytes + b
            return count, nbytes

        return self._answer(run)

    def entries(self, prefix: bytes = b"", limit: int | None = None) -> list[dict[str, Any]]:
        """This pool's entries on the server whose keys start with `prefix`, in key order (at most
        `limit`): key (str or bytes, as put), size and TTL, read from each record's header.

        Records that are not ours (no valid header) are left out.  Trouble raises ServiceUnavailable.
        """
        base_len = len(remote_key(self.pool_name, b""))

        def run(client: Any) -> list[dict[str, Any]]:
            names = sorted(self._scan(client, prefix))
            out: list[dict[str, Any]] = []
            for k in range(0, len(names), _BATCH):
                batch = names[k : k + _BATCH]
                pipe = client.pipeline(transaction=False)
                for name in batch:
                    pipe.getrange(name, 0, HEADER_SIZE - 1)
                    pipe.pttl(name)
                got = pipe.execute()
                for name, data, pttl in zip(batch, got[0::2], got[1::2]):
                    kb = name[base_len:]
                    head = read_head(kb, data)
                    if head is None:
                        continue  # gone meanwhile, or not a record of ours
                    flags, n, _ = head
                    out.append({"key": kb.decode("utf-8", "surrogateescape") if flags & SLOT_FLAG_STR_KEY else kb,
                                "tier": "remote", "size": n, "priority": None,
                                "ttl_remaining": pttl / 1000 if pttl is not None and pttl >= 0 else None})
                    if limit is not None and len(out) >= limit:
                        return out
            return out

        return self._answer(run)

    def _scan(self, client: Any, prefix: bytes) -> list[bytes]:
        """Names of this pool's keys starting with `prefix` (SCAN; every primary of a cluster)."""
        match = _glob_escape(remote_key(self.pool_name, prefix)) + b"*"
        return list(client.scan_iter(match=match, count=1000))

    def _answer(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(client)` for an operator's request: the server's trouble is ServiceUnavailable (69), counted."""
        if self.unavailable:
            raise ServiceUnavailable(f"remote tier {redact(self.url)}: {self.unavailable}")
        try:
            return fn(self._connect())
        except Exception as e:  # noqa: BLE001
            self._failed(e, writer=False)
            raise ServiceUnavailable(f"remote tier {redact(self.url)}: {self.last_error}") from None

    # ------------------------------------------------------------------ lifecycle

    def close(self, flush: float = CLOSE_FLUSH) -> None:
        """Let queued writes finish (up to `flush` seconds), then stop the thread and the client."""
        if self._abandoned:
            return
        if self._thread is not None:
            self.flush(flush)
        with self._cv:
            self._stop = True
            left = len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if left:
            self._count(H_REMOTE_DROPPED, left)  # the writer has stopped: counted from this thread
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None

    def _writer_core(self) -> Any:
        return self._writer_pool.core if self._writer_pool is not None else None

    def stats(self) -> dict[str, Any]:
        h = self._core.counters
        enq = h[H_REMOTE_SENT]
        return {
            "url": redact(self.url),
            "cluster": self.cluster,
            "available": self.unavailable is None,
            **hit_stats(h[H_REMOTE_HITS], h[H_REMOTE_MISSES]),
            "promotions": h[H_REMOTE_PROMOTIONS],
            "errors": h[H_REMOTE_ERRORS],
            "corrupt": h[H_REMOTE_CORRUPT],
            "writes_sent": enq,
            "writes_done": h[H_REMOTE_WRITTEN],
            "writes_dropped": h[H_REMOTE_DROPPED],
            "bytes_written": h[H_REMOTE_BYTES_WRITTEN],
            "bytes_read": h[H_REMOTE_BYTES_READ],
            "queue_depth": self.pending(),  # this process's
            **({"error": self.unavailable} if self.unavailable else {}),
            **({"last_error": self.last_error} if self.last_error else {}),
        }


class _Recorded(Plan):
    """A tier whose configuration is only header fields: written at create, nothing to undo."""

    def __init__(self, kind: type[Configured], part: dict[str, Any]) -> None:
        self.kind, self.part = kind, part

    def initialise(self, mm: Any, geo: Any) -> None:
        self.kind.record(np.frombuffer(mm, HEADER_DTYPE, 1, 0), self.part)


def _glob_escape(pattern: bytes) -> bytes:
    """`pattern` with Redis glob specials escaped, so a key prefix matches only itself."""
    out = bytearray()
    for b in pattern:
        if b in b"\\*?[]":
            out += b"\\"
        out.append(b)
    return bytes(out)


def _unlink_batch(client: Any, names: list[bytes]) -> tuple[int, int]:
    """Unlink `names`; (how many existed, their value bytes)."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.strlen(name)
    sizes = pipe.execute()
    removed = client.unlink(*names)
    return int(removed), sum(max(0, int(n) - HEADER_SIZE) for n in sizes if n)


def _add(core: Any, pairs: tuple) -> None:
    """Add (field, n) pairs to a pool's shared counters under its lock; best effort (it may be closing)."""
    if core is None or core.closed:
        return

    def add() -> None:
        for field, n in pairs:
            core.counters[field] += n

    try:
        core.locked(add)
    except Exception:
        pass


__all__ = ["RemoteTier", "check_url", "redact", "scrub", "remote_key", "encode", "decode"]
