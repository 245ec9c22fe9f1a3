"""A pool's whole configuration: what a snapshot carries and `create --if-missing` compares.

The segment header holds every setting (geometry, policy, flags, the tiers);
`read()` (Pool.configuration) reads them into one plain dict, the form a snapshot stores
(as JSON, see persist.py) and `Pool.create(..., exist_ok=True)` compares a
request against.  The remote URL is kept whole here (a snapshot is private,
mode 0600, like the segment that holds it already); `redacted()` is the form
to show.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .errors import PoolExists, SnapshotCorrupt, UsageError
from .layout import (
    DISK_O_DIRECT, DISK_ON, DISK_WRITE_THROUGH, FLAG_MULTI_THREADED, FLAG_RESERVED, REMOTE_CLUSTER, REMOTE_ON,
)

if TYPE_CHECKING:
    from .core import Core
    from .layout import Geometry
    from .pool import Pool

# Bounds on what a snapshot's configuration block may hold (it is read from a file).
MAX_CONFIG_BYTES = 16 << 10


def read(core: "Core") -> dict[str, Any]:
    """The configuration of the pool whose Core (core.py) is `core`, read from its header (Pool.configuration)."""
    h = core.header[0]
    flags = int(h["flags"])
    dflags, rflags = int(h["disk_flags"]), int(h["remote_flags"])
    disk = None
    if dflags & DISK_ON:
        disk = {
            "path": bytes(h["disk_path"]).decode("utf-8", "surrogateescape"),
            "size": int(h["disk_size"]),
            "write": "through" if dflags & DISK_WRITE_THROUGH else "back",
            "o_direct": bool(dflags & DISK_O_DIRECT),
            "max_entries": int(h["n_dslots"]),
        }
    remote = None
    if rflags & REMOTE_ON:
        remote = {"url": bytes(h["remote_url"]).decode("utf-8", "replace"), "cluster": bool(rflags & REMOTE_CLUSTER)}
    return {
        "size": core.geometry.data_size,
        "block_size": core.geometry.block_size,
        "max_entries": core.geometry.n_slots,
        "policy": core.policy,
        "mode": int(h["mode"]) & 0o777,
        "multi_threaded": bool(flags & FLAG_MULTI_THREADED),
        "reserve": bool(flags & FLAG_RESERVED),
        "lfu_period": int(h["lfu_period"]),
        "keep": int(core.fields.snapshot_keep[0]) or None,
        "tier_admit": max(1, int(h["tier_admit"])),
        "disk": disk,
        "remote": remote,
    }


def redacted(cfg: dict[str, Any]) -> dict[str, Any]:
    """The configuration fit to print: the remote URL's password hidden."""
    from .remote import redact

    out = dict(cfg)
    if out.get("remote"):
        out["remote"] = {**out["remote"], "url": redact(out["remote"]["url"])}
    return out


def encode(cfg: dict[str, Any]) -> bytes:
    """The tier and operating part of a configuration, as a snapshot stores it."""
    part = {k: cfg[k] for k in ("reserve", "keep", "disk", "remote")}
    if cfg.get("tier_admit", 1) != 1:  # written only when set: older readers see what they know
        part["tier_admit"] = cfg["tier_admit"]
    if cfg.get("created"):  # when the pool was first created (a restore gives it back; older readers skip it)
        part["created"] = cfg["created"]
    return json.dumps(part, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes, where: str) -> dict[str, Any]:
    """Parse and check a snapshot's configuration block; SnapshotCorrupt if it is not one."""

    def bad(why: str) -> SnapshotCorrupt:
        return SnapshotCorrupt(f"snapshot {where!r} is damaged: configuration {why}")

    try:
        cfg = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise bad("is not JSON") from None
    if not isinstance(cfg, dict):
        raise bad("is not an object")
    out: dict[str, Any] = {"reserve": bool(cfg.get("reserve", True)), "keep": None, "disk": None, "remote": None,
                           "tier_admit": 1, "created": None}
    created = cfg.get("created")
    if created is not None:
        if not isinstance(created, (int, float)) or isinstance(created, bool) or not 0 < created < 2**40:
            raise bad(f"has an impossible creation time {created!r}")
        out["created"] = float(created)
    admit = cfg.get("tier_admit", 1)
    if admit not in (1, 2) or isinstance(admit, bool):
        raise bad(f"has an impossible tier admission {admit!r}")
    out["tier_admit"] = admit
    keep = cfg.get("keep")
    if keep is not None:
        if not isinstance(keep, int) or not 1 <= keep < 2**32:
            raise bad(f"has an impossible keep {keep!r}")
        out["keep"] = keep
    disk = cfg.get("disk")
    if disk is not None:
        if not isinstance(disk, dict):
            raise bad("has a bad disk tier")
        ok = (
            isinstance(disk.get("path"), str) and disk["path"].startswith("/")
            and isinstance(disk.get("size"), int) and disk["size"] > 0
            and disk.get("write") in ("back", "through")
            and isinstance(disk.get("o_direct"), bool)
            and isinstance(disk.get("max_entries"), int) and 1 <= disk["max_entries"] < 2**31 - 1
        )
        if not ok:
            raise bad("has a bad disk tier")
        if os.path.normpath(disk["path"]) != disk["path"]:
            raise bad(f"has a disk tier path that is not in normal form ({disk['path']!r})")
        from .disktier import check_disk_path

        try:
            check_disk_path(disk["path"])  # what `create --disk-path` refuses, a snapshot may not ask for
        except UsageError as e:
            raise bad(f"has a disk tier the command line would refuse: {e}") from None
        out["disk"] = {k: disk[k] for k in ("path", "size", "write", "o_direct", "max_entries")}
    remote = cfg.get("remote")
    if remote is not None:
        if not (isinstance(remote, dict) and isinstance(remote.get("url"), str)
                and isinstance(remote.get("cluster"), bool)):
            raise bad("has a bad remote tier")
        from .remote import check_url

        try:
            check_url(remote["url"])  # what `create --remote` refuses, a snapshot may not ask for
        except UsageError as e:
            raise bad(f"has a remote tier the command line would refuse: {e}") from None
        out["remote"] = {"url": remote["url"], "cluster": remote["cluster"]}
    return out


def requested(geo: "Geometry", policy: str, mode: int, multi_threaded: bool, keep: int | None, disk_path: str | None,
              disk_size: int | str | None, disk_write: str, disk_o_direct: bool, disk_max_entries: int | None,
              remote: str | None, remote_cluster: bool) -> dict[str, Any]:
    """What a create request fixes, in the form `differences` compares (`Pool.create(..., exist_ok=True)`):
    `geo` the geometry it asks for, `disk_path` its checked disk tier directory (None: no disk tier)."""
    want: dict[str, Any] = {"size": geo.data_size, "block_size": geo.block_size, "max_entries": geo.n_slots,
                            "policy": policy, "mode": mode, "multi_threaded": multi_threaded}
    if keep is not None:
        want["keep"] = keep
    if disk_path is not None:
        d: dict[str, Any] = {"path": disk_path, "write": disk_write, "o_direct": disk_o_direct}
        if disk_size is not None:
            from .disklog import DiskLog
            from .units import parse_size

            d["size"] = DiskLog.capacity_for(parse_size(disk_size))
        if disk_max_entries is not None:
            d["max_entries"] = disk_max_entries
        want["disk"] = d
    else:
        want["disk"] = None
    want["remote"] = {"url": remote, "cluster": remote_cluster} if remote is not None else None
    return want


def differences(pool: "Pool", want: dict[str, Any]) -> list[str]:
    """What differs between `pool` and a create request (`want`: only what the request fixes)."""
    have = pool.configuration()
    out = []
    for key in ("size", "block_size", "max_entries", "policy", "mode", "multi_threaded", "keep"):
        if key in want and want[key] != have[key]:
            out.append(f"{key.replace('_', '-')} {_show(key, have[key])} (asked {_show(key, want[key])})")
    wd, hd = want.get("disk", "any"), have["disk"]
    if wd != "any":
        if (wd is None) != (hd is None):
            out.append("a disk tier" + (" (asked none)" if wd is None else " none (asked one)"))
        elif wd is not None and hd is not None:
            for key in ("path", "size", "write", "o_direct", "max_entries"):
                if key in wd and wd[key] != hd[key]:
                    out.append(f"disk-{key.replace('_', '-')} {_show(key, hd[key])} (asked {_show(key, wd[key])})")
    wr, hr = want.get("remote", "any"), have["remote"]
    if wr != "any":
        if (wr is None) != (hr is None):
            out.append("a remote tier" + (" (asked none)" if wr is None else " none (asked one)"))
        elif wr is not None and hr is not None and wr != hr:
            from .remote import redact

            out.append(f"remote {redact(hr['url'])}{' (cluster)' if hr['cluster'] else ''} "
                       f"(asked {redact(wr['url'])}{' (cluster)' if wr['cluster'] else ''})")
    return out


def _show(key: str, value: Any) -> str:
    if key == "mode":
        return f"{value:04o}"
    if key in ("size", "block_size") and isinstance(value, int):
        from .units import format_size

        return f"{format_size(value)} ({value} bytes)"
    return str(value)


def require_same(pool: "Pool", want: dict[str, Any]) -> None:
    """PoolExists (exit 73) naming every difference, if `pool` is not configured as asked."""
    diff = differences(pool, want)
    if diff:
        raise PoolExists(f"pool {pool.name!r} exists with another configuration: " + "; ".join(diff))


__all__ = ["read", "redacted", "encode", "decode", "differences", "requested", "require_same", "MAX_CONFIG_BYTES"]
