"""The tiers a pool can be created with, below memory (docs/tiers.md, "Adding a tier").

Each is one `lower.Configured` class in a module of its own, owning all of
its behaviour and its configuration: `Pool.create`'s options, the pool's
configuration, snapshots, status and restore take them from here.  Adding a
tier is a module and a line in this table.  (The snapshot a restored pool is
still being filled from is a tier too, but no pool is created with one:
tiers.py attaches it while a fill runs.)
"""

from __future__ import annotations

from .disktier import DiskTier
from .lower import Configured
from .remote import RemoteTier

TIERS: tuple[type[Configured], ...] = (DiskTier, RemoteTier)

__all__ = ["TIERS"]
