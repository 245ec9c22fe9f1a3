"""A pool's whole configuration: what a snapshot carries and `create --if-missing` compares.

The segment header holds every setting (geometry, policy, flags, the tiers);
`read()` (Pool.configuration) reads them into one plain dict, the form a snapshot stores
(as JSON, see persist.py) and `Pool.create(..., exist_ok=True)` compares a
request against.  Each tier's part (its key is the tier's name) is the
tier's own (tier_table.py; lower.Configured): read, checked, compared and
shown by its class.  The remote URL is kept whole here (a snapshot is
private, mode 0600, like the segment that holds it already); `redacted()`
is the form to show.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

from .errors import PoolExists, SnapshotCorrupt
from .layout import FLAG_MULTI_THREADED, FLAG_RESERVED
from .tier_table import TIERS

if TYPE_CHECKING:
    from .core import Core
    from .layout import Geometry

# Bounds on what a snapshot's configuration block may hold (it is read from a file).
MAX_CONFIG_BYTES = 16 << 10

# Pool.create's keywords that configure a tier, with their defaults (each tier's OPTIONS).
TIER_OPTIONS: dict[str, Any] = {k: v for kind in TIERS for k, v in kind.OPTIONS.items()}
# The parameters of an engine adapter's configuration that give its pool a tier (integrations/pools.py).
ADAPTER_PARAMS: tuple[str, ...] = tuple(p for kind in TIERS for p in kind.ADAPTER_OPTIONS)


def read(core: "Core") -> dict[str, Any]:
    """The configuration of the pool whose Core (core.py) is `core`, read from its header (Pool.configuration)."""
    h = core.header[0]
    flags = int(h["flags"])
    out = {
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
    }
    for kind in TIERS:
        out[kind.name] = kind.read_config(core)
    return out


def redacted(cfg: dict[str, Any]) -> dict[str, Any]:
    """The configuration fit to print (the remote URL's password hidden)."""
    out = dict(cfg)
    for kind in TIERS:
        if out.get(kind.name):
            out[kind.name] = kind.redacted(out[kind.name])
    return out


def encode(cfg: dict[str, Any]) -> bytes:
    """The tier and operating part of a configuration, as a snapshot stores it."""
    part = {k: cfg[k] for k in ("reserve", "keep", *(kind.name for kind in TIERS))}
    if cfg.get("tier_admit", 1) != 1:  # written only when set: older readers see what they know
        part["tier_admit"] = cfg["tier_admit"]
    if cfg.get("created"):  # when the pool was first created (a restore gives it back; older readers skip it)
        part["created"] = float(cfg["created"])
    text = json.dumps(part, sort_keys=True, separators=(",", ":"))
    # `created` the same length at every persist (zeros after json's shortest form keep the value exact),
    # so a snapshot's size does not move with the digits of a timestamp.
    if "created" in part and "." in (shortest := json.dumps(part["created"])) and "e" not in shortest:
        text = text.replace(f'"created":{shortest}', f'"created":{shortest:0<{CREATED_DIGITS}}', 1)
    return text.encode()


CREATED_DIGITS = 24  # characters of `created` in a configuration block (json's shortest form, zero padded)


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
    out: dict[str, Any] = {"reserve": bool(cfg.get("reserve", True)), "keep": None,
                           **{kind.name: None for kind in TIERS}, "tier_admit": 1, "created": None}
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
    for kind in TIERS:
        part = cfg.get(kind.name)
        if part is not None:
            out[kind.name] = kind.decode_config(part, bad)
    return out


def tier_options(given: dict[str, Any]) -> dict[str, Any]:
    """Pool.create's tier keywords (`given`) with the defaults of the rest; TypeError for one no tier takes."""
    unknown = [k for k in given if k not in TIER_OPTIONS]
    if unknown:
        raise TypeError(f"create() got an unexpected keyword argument {unknown[0]!r}")
    return {**TIER_OPTIONS, **given}


def adapter_options(params: dict[str, Any]) -> dict[str, Any]:
    """Pool.create's tier keywords for an engine adapter's configuration `params` (ADAPTER_PARAMS)."""
    out: dict[str, Any] = {}
    for kind in TIERS:
        out.update(kind.adapter_options(params))
    return out


def wanted(opts: dict[str, Any], home: Callable[[str], str], admit: int) -> dict[str, dict[str, Any] | None]:
    """Each tier's part of the configuration a create request asks for (None: no such tier), checked:
    UsageError for a bad option.  `home(tier name)`: a tier's default directory; `admit`: the tier
    admission asked."""
    out = {}
    for kind in TIERS:
        want = kind.want(opts, home(kind.name))
        if want is not None:
            kind.check_admission(want, admit)
        out[kind.name] = want
    return out


def requested(geo: "Geometry", policy: str | None, mode: int, multi_threaded: bool, keep: int | None,
              tiers: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """What a create request fixes, in the form `differences` compares (`Pool.create(..., exist_ok=True)`):
    `geo` the geometry it asks for, `tiers` what `wanted` said of each tier; `policy` None: any."""
    want: dict[str, Any] = {"size": geo.data_size, "block_size": geo.block_size, "max_entries": geo.n_slots,
                            "mode": mode, "multi_threaded": multi_threaded, **tiers}
    if policy is not None:
        want["policy"] = policy
    if keep is not None:
        want["keep"] = keep
    return want


def differences(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What differs between a pool's configuration (`have`) and a create request (`want`: only what the
    request fixes)."""
    out = []
    for key in ("size", "block_size", "max_entries", "policy", "mode", "multi_threaded", "keep"):
        if key in want and want[key] != have[key]:
            out.append(f"{key.replace('_', '-')} {_show(key, have[key])} (asked {_show(key, want[key])})")
    for kind in TIERS:
        if kind.name in want:
            out += kind.differences(want[kind.name], have[kind.name])
    return out


def _show(key: str, value: Any) -> str:
    if key == "mode":
        return f"{value:04o}"
    if key in ("size", "block_size") and isinstance(value, int):
        from .units import format_size

        return f"{format_size(value)} ({value} bytes)"
    return str(value)


def require_same(name: str, have: dict[str, Any], want: dict[str, Any]) -> None:
    """PoolExists (exit 73) naming every difference, if pool `name` (configured as `have`) is not
    configured as asked."""
    diff = differences(have, want)
    if diff:
        raise PoolExists(f"pool {name!r} exists with another configuration: " + "; ".join(diff))


__all__ = ["read", "redacted", "encode", "decode", "differences", "requested", "require_same", "tier_options",
           "wanted", "adapter_options", "MAX_CONFIG_BYTES", "TIER_OPTIONS", "ADAPTER_PARAMS"]
