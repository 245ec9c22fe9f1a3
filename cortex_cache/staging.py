"""Pools built aside under a staging name: making them, sweeping what killed builders left, filling entries in.

restore.py and resize.py build a pool under a staging name (`staging_name`:
"restoring-PID-START-HEX") and publish it by a rename; a builder killed
before that leaves the segment (and, for restore --replace, a temp tier
directory), which the next builder sweeps (`sweep_stale_staging`,
`sweep_stale_tmp`) and `doctor` reports (`stale_tmp_dirs`).
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import tempfile
import time
from typing import Any, Protocol, TYPE_CHECKING

import xxhash

from . import procs, segment
from .core import COPY_IN_LOCK, Core
from .errors import CortexCacheError, NoSpace, PoolNotFound
from .layout import SLOT_FLAG_STR_KEY
from .tier_table import TIERS

if TYPE_CHECKING:
    from .snapfile import Record


class PoolHandle(Protocol):
    """What restore, resize and staging use of an open pool (pool.Pool is one).  Named here, not imported:
    pool.py is above them (its restore and resize call into them, handing them the class)."""

    name: str
    core: Any
    tiers: Any

    def close(self) -> None: ...


class PoolClass(Protocol):
    """What they use of the pool class they are handed (pool.Pool)."""

    def create(self, name: str, size: Any, **kw: Any) -> PoolHandle: ...
    def open(self, name: str, **kw: Any) -> PoolHandle: ...
    def unlink(self, name: str) -> Any: ...


STAGING_PREFIX = "restoring-"
STAGING_STALE_AFTER = 60.0  # seconds without a change, and no process mapping it
# Staging segments and restore --replace's temp tier directories name their restore: pid, start time.
WRITER_RE = re.compile(r"(\d+)-(\d+)-\w+$")  # mkdtemp's random part: letters, digits, _
TMP_PREFIX = "cortex-restore-"


def staging_name() -> str:
    pid, start = procs.me()
    return f"{STAGING_PREFIX}{pid}-{start}-{secrets.token_hex(4)}"


def writer_dead(rest: str) -> bool:
    """Is the restore named in `rest` ("PID-START-HEX") gone?  False for a name without one."""
    m = WRITER_RE.match(rest)
    return m is not None and not procs.alive(int(m.group(1)), int(m.group(2)))


def sweep_stale_staging() -> None:
    """Remove the staging segments of restores that were killed (nobody maps them, and their restore is
    gone or they sit still for a minute).

    Only our own: anyone can plant such names in /dev/shm, and root must not
    remove another user's files.  One directory pass and one pass over /proc,
    whatever is planted."""
    now = time.time()
    stale = [e.name for e in segment.scan() if e.name.startswith(STAGING_PREFIX) and e.ours
             and (now - max(e.mtime, e.ctime) >= STAGING_STALE_AFTER
                  or writer_dead(e.name[len(STAGING_PREFIX):]))]
    if not stale:
        return
    attached = segment.attached_map()
    for n in stale:
        if attached.get(n):
            continue
        try:
            segment.unlink(n)
        except CortexCacheError:
            pass


def stale_tmp_dirs() -> list[str]:
    """restore --replace's temp tier directories (TMPDIR/cortex-restore-PID-START-XXXX) of ours whose
    restore is gone: what a SIGKILL left behind (`doctor` reports them, the next restore --replace sweeps)."""
    top = tempfile.gettempdir()
    out = []
    try:
        with os.scandir(top) as it:
            for e in it:
                if not e.name.startswith(TMP_PREFIX) or not writer_dead(e.name[len(TMP_PREFIX):]):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                    out.append(e.path)
    except OSError:
        pass
    return out


def sweep_stale_tmp() -> None:
    """Remove what killed restores left in TMPDIR: the throw-away tier's files (by their names, never a
    tree walk) and the directory."""
    for d in stale_tmp_dirs():
        try:
            for kind in TIERS:
                kind.remove_stand_in(d)
            os.rmdir(d)
        except OSError:
            pass


def create_staging(Pool: "PoolClass", target: str, staging: str, size: int, **kw: Any) -> "PoolHandle":
    """Pool.create of the staging segment; its NoSpace names the pool being restored, not the staging name."""
    try:
        return Pool.create(staging, size, **kw)
    except NoSpace as e:
        raise NoSpace(str(e).replace(staging, target)) from None


def discard(Pool: "PoolClass", pool: "PoolHandle", staging: str) -> None:
    pool.close()
    try:
        segment.unlink(staging)  # never published: nobody follows its name
    except PoolNotFound:
        pass


def tier_header(core: Core) -> dict[str, Any]:
    """The header fields that configure a pool's tiers, and its retention (copied onto its replacement)."""
    h = core.header[0]
    fields = [f for kind in TIERS for f in kind.HEADER_FIELDS]
    return {f: h[f].copy() if hasattr(h[f], "copy") else h[f] for f in (*fields, "snapshot_keep", "tier_admit")}


def restore_entry(core: Core, rec: "Record", base: int) -> None:
    """Insert one snapshot record with its metadata (like a put; large values copied outside the lock)."""
    kb, vb = rec.key, rec.value
    vlen = len(vb)
    nblk = core.blocks_or_raise(vlen, "snapshot entry")
    kh = xxhash.xxh3_64_intdigest(kb)
    flags = rec.flags & SLOT_FLAG_STR_KEY
    meta = (rec.created, rec.last_access, rec.expiry, base + rec.insert_seq, base + rec.access_seq, rec.access_count)
    if vlen <= COPY_IN_LOCK:
        core.locked(put_restored, core, kb, kh, flags, vb, nblk, rec.checksum, rec.priority, meta)
        return
    i, off = core.locked(core.reserve, kb, kh, flags, vlen, nblk)

    def copy() -> int:
        # Through the segment's fd, not the mapping: the kernel fills the
        # pages without a page fault each (~1.5x faster into fresh memory).
        done = 0
        while done < vlen:
            done += os.pwrite(core.seg.fd, vb[done:], off + done)
        return rec.checksum

    core.fill(i, copy, seal_restored, core, kb, kh, rec.priority, meta)


def put_restored(core: Core, kb: bytes, kh: int, flags: int, vb: Any, nblk: int, checksum: int, priority: int,
                  meta: tuple) -> None:
    i = core.put_small(kb, kh, flags, vb, nblk, checksum, None, priority)
    core.restore_meta(i, *meta)


def seal_restored(i: int, checksum: int, core: Core, kb: bytes, kh: int, priority: int, meta: tuple) -> None:
    if not core.is_writing(i):
        return  # a repair took the reservation back
    core.seal(i, kb, kh, checksum, None, priority)
    core.restore_meta(i, *meta)


def restore_end(core: Core, counters: dict[str, int] | None) -> None:
    if counters:
        for c, v in counters.items():
            if c != "seq":
                core.header[c] = v
    core.victims.invalidate()


__all__ = ["STAGING_PREFIX", "STAGING_STALE_AFTER", "TMP_PREFIX", "staging_name", "writer_dead", "sweep_stale_staging",
           "stale_tmp_dirs", "sweep_stale_tmp", "create_staging", "discard", "tier_header", "restore_entry",
           "restore_end"]
