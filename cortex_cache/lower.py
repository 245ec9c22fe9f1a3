"""The contract of a tier below memory (docs/design.md, "One tier contract").

Each tier is one `Lower`, in a module of its own that owns all of its
behaviour: the disk tier (disktier.py), the snapshot a restored pool is still
being filled from (snaptier.py), the Valkey/Redis tier (remote.py).
`tiers.Tiers` holds the tiers a pool has and drives them; nothing above it
names one.  A tier answers:

- reads: `lookup` (lock held, only a tier whose index lives in the segment:
  `in_segment`, asked in the same lock hold as memory), `fetch` (outside the
  lock: the value checked against its checksum, a `Fetched`; None for a miss
  or any fault of the tier; BufferTooSmall for too small a `room`), `still`
  (lock held, before the promotion: is it still the tier's current copy?),
  `promoted` (lock held, sealed in memory), `served` (outside the lock).
- writes: `offer_put`/`offer_delete` (outside the lock, a tier that
  `takes_puts`/`takes_deletes`), `write_first` and `unwrite` (a tier that
  `writes_first`: a put's record written before memory seals it), `sealed`
  (lock held, an `in_segment` tier: memory has a new value of a key),
  `supersede` (lock held, a tier that `supersedes`: memory is about to
  take a new value of a key, a put or a promotion; told before it does;
  `never_holds`: outside the lock, a put of a key it can never hold may
  skip it and take the C write path),
  `evicted` (lock held, a tier that `takes_evictions`: an entry leaves
  memory; a tier that takes puts gets evictions instead when the pool's
  admission lets only reused entries down), `ready_to_take` (before an
  explicit eviction), `forget` (lock held, before memory deletes the key),
  `contains` (lock held).
- an operator's requests: `info`, `keys`, `remove` (evict --tier NAME),
  `stats`, `verify`, `flush`.
- its life: `attach` (a class method: this process's handle on the pool's
  tier, or None when it has none), `ended` (a tier whose time is over, as the
  snapshot's once its fill ended, is dropped), `stop`, `close`.

A tier a pool is created with is a `Configured` tier (tier_table.py lists
them): it also owns its configuration (its `Pool.create` options, their
defaults and checks, the part of `Pool.configuration()` that is its own, how
a snapshot stores it), what it makes at create (`plan`), and what a restore
does with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from .errors import BufferTooSmall

if TYPE_CHECKING:
    from .core import Core
    from .layout import Geometry

# What `lookup` answers for a key the tier is writing right now (another process's spill): Tiers.settled asks
# again, a moment later, until it is settled or a deadline passes.
BUSY = "busy"


class Fetched(NamedTuple):
    """A value a tier below memory had, checked against its checksum."""

    value: Any  # bytes-like
    flags: int  # SLOT_FLAG_STR_KEY or 0
    checksum: int  # xxh3_64 of the value: the pool's own checksum
    expiry: float  # absolute (the pool's clock), 0 = none
    priority: int
    token: Any  # the tier's own (the disk tier's DiskHit, the snapshot tier's place in its fill)


class Selector(NamedTuple):
    """Which entries an eviction takes: exactly one of these is set (eviction.check_selector)."""

    keys: list[bytes] | None
    prefix: bytes | None
    all: bool
    expired: bool
    percent: float | None
    target: int | None  # bytes


class Context(NamedTuple):
    """What `Lower.attach` is handed besides the core."""

    plans: dict[str, Any]  # a pool being created: each tier's `Plan` by name (its files already open)
    reopen: Callable[[], Any]  # another handle on the pool (`.core`, `.close()`), for a tier's own thread
    snapshot: bool  # False: a handle that only reads stats, which does not index a filling snapshot


class Lower:
    """A tier below memory: the defaults are those of a tier that has nothing and keeps nothing."""

    name = ""  # its name in status, configuration and `--tier`
    distance = 0  # a miss asks the nearest first
    in_segment = False  # its index is in the segment: it takes part in memory's lock holds
    supersedes = False  # told of every new value before memory seals it (`supersede`): no C write path then
    shared = False  # shared with other hosts: `--tier all` and restore --replace leave it as it is
    takes_puts = False
    takes_deletes = False
    takes_evictions = False
    writes_first = False
    promotes_as_read = False  # what it holds was admitted as reused: promoted, it counts as read
    directory: str | None = None  # where its files are, if it has any
    ended = False  # set by a tier whose time is over (the snapshot's, once its fill ended): Tiers drops it

    @classmethod
    def attach(cls, core: "Core", ctx: Context) -> "Lower | None":
        """This process's handle on the pool's tier, or None when the pool has none."""
        raise NotImplementedError

    # ------------------------------------------------------------------ reads

    def lookup(self, kb: bytes, kh: int) -> Any:
        return None

    def fetch(self, kb: bytes, kh: int, found: Any, room: int | None) -> Fetched | None:
        return None

    def still(self, got: Fetched) -> bool:
        return True

    def promoted(self, got: Fetched) -> None:
        pass

    def served(self, got: Fetched, promoted: bool) -> None:
        pass

    # ------------------------------------------------------------------ writes

    def offer_put(self, kb: bytes, value: Any, flags: int, ttl: float | None) -> None:
        pass

    def offer_delete(self, kb: bytes) -> None:
        pass

    def write_first(self, kb: bytes, flags: int, value: memoryview, expiry: float, priority: int) -> Any:
        """A put's record, written before memory takes the value (outside the lock); what `sealed` gets."""
        return None

    def unwrite(self, token: Any) -> None:
        """The put `write_first` wrote for failed: no record of it may come back."""

    def sealed(self, kb: bytes, kh: int, token: Any) -> None:
        """Lock held: memory has a new value of `kb` (a put, whose `write_first` gave `token`, or a promotion
        from another tier: None).  A copy of the old value here must go."""

    def never_holds(self, kb: bytes) -> bool:
        """Outside the lock, a tier that `supersedes`: is `kb` surely nowhere in it, now or later (a put of it
        needs no `supersede`, and may take the C write path)?  False when it cannot tell."""
        return False

    def supersede(self, kb: bytes, kh: int) -> None:
        """Lock held, before memory seals a new value of `kb` (a put, a promotion from any tier): a copy here
        is no longer the answer, and must not come back even if this process dies before the seal."""

    def evicted(self, i: int, explicit: bool) -> None:
        """Lock held: memory's entry `i` is about to leave (`explicit`: an `evict`, not room for a put).
        Raising refuses the eviction: the entry stays."""

    def ready_to_take(self) -> None:
        """Before an explicit eviction whose entries this tier takes: raise if this process cannot."""

    def forget(self, kb: bytes, kh: int) -> bool:
        return False

    def contains(self, kb: bytes, kh: int) -> bool:
        return False

    # ------------------------------------------------------------------ an operator's requests

    def info(self, kb: bytes, kh: int) -> dict[str, Any] | None:
        """Lock held: the metadata of `kb`'s entry here (Pool.info), or None."""
        return None

    def keys(self, pb: bytes, limit: int | None) -> list[Any]:
        """Outside the lock: the keys here starting with `pb` (at least `limit` of them, when there are)."""
        return []

    def remove(self, sel: Selector) -> tuple[int, int]:
        """Remove entries from this tier now (evict --tier NAME); (entries, value bytes)."""
        return 0, 0

    def stats(self) -> dict[str, Any] | None:
        return None

    def verify(self, repair: bool, problems: list[str]) -> dict[str, Any]:
        """Check what this tier holds (Pool.verify with checksums), appending to `problems`; report fields."""
        return {}

    def flush(self, timeout: float | None) -> bool:
        """Wait until this handle's queued writes were sent; False on timeout."""
        return True

    # ------------------------------------------------------------------ lifecycle

    def stop(self, forked: bool) -> None:
        """The handle closes: finish (or, in a forked child, abandon) background work."""

    def close(self) -> None:
        pass


def too_small(room: int | None, length: int) -> None:
    if room is not None and room < length:
        raise BufferTooSmall(f"buffer of {room} bytes is too small for a value of {length} bytes")


class Plan:
    """What a `Configured` tier makes for a pool being created (its files, its header fields), in steps:
    `geometry` (the segment's regions for it), `initialise` (its header fields and regions, init lock
    held), `finish` (once the pool is attached, before anyone else may open it), `undo` (the create
    failed)."""

    finishes = False  # `finish` has work: the pool is published only after it

    def geometry(self) -> dict[str, Any]:
        return {}

    def initialise(self, mm: Any, geo: "Geometry") -> None:
        pass

    def finish(self, tier: Lower) -> None:
        pass

    def undo(self) -> None:
        pass


class Restoring(NamedTuple):
    """What a restore does with a tier of the snapshot's configuration (Configured.restoring)."""

    create: dict[str, Any]  # Pool.create options of the new pool ({} when it is recorded later or left out)
    later: bool  # recorded in the header once the pool has its real name (`Configured.record`)
    note: str | None  # the report's line when it is not attached (None: it is)


class Configured(Lower):
    """A tier a pool is created with: its configuration is its own (tier_table.TIERS lists these tiers)."""

    OPTIONS: dict[str, Any] = {}  # Pool.create's keywords of this tier, with their defaults
    HEADER_FIELDS: tuple[str, ...] = ()  # the header fields that hold its configuration
    ADAPTER_OPTIONS: tuple[str, ...] = ()  # the parameters an engine adapter's configuration may give it

    @classmethod
    def adapter_options(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Pool.create's keywords for this tier from an engine adapter's parameters ({}: none asked)."""
        return {}

    # ------------------------------------------------------------------ configuration

    @classmethod
    def read_config(cls, core: "Core") -> dict[str, Any] | None:
        """Its part of Pool.configuration(), read from the header; None without it."""
        raise NotImplementedError

    @classmethod
    def decode_config(cls, part: Any, bad: Callable[[str], Exception]) -> dict[str, Any]:
        """Its part of a snapshot's configuration block, checked as `create` checks its options (`bad(why)`:
        the error to raise)."""
        raise NotImplementedError

    @classmethod
    def redacted(cls, part: dict[str, Any]) -> dict[str, Any]:
        """Its part of a configuration, fit to print."""
        return part

    @classmethod
    def describe(cls, part: dict[str, Any]) -> str:
        """One line naming it (a restore's report of what it did not attach)."""
        raise NotImplementedError

    @classmethod
    def want(cls, opts: dict[str, Any], home: str) -> dict[str, Any] | None:
        """The part of a configuration these `Pool.create` options ask for, checked (UsageError): only what
        they fix; None for no such tier.  `home`: its default directory, should it keep files."""
        raise NotImplementedError

    @classmethod
    def check_admission(cls, want: dict[str, Any], admit: int) -> None:
        """UsageError if it cannot work under this tier admission."""

    @classmethod
    def differences(cls, want: dict[str, Any] | None, have: dict[str, Any] | None) -> list[str]:
        """What differs between what a create request asks of it (`want`) and what the pool has."""
        if (want is None) != (have is None):
            return [f"a {cls.name} tier" + (" (asked none)" if want is None else " none (asked one)")]
        return []

    # ------------------------------------------------------------------ create

    @classmethod
    def plan(cls, want: dict[str, Any], opts: dict[str, Any], pool: "Creating") -> Plan:
        """Check what this process needs to create the pool with this tier, and make its files; a `Plan`."""
        return Plan()

    @classmethod
    def record(cls, header: Any, part: dict[str, Any]) -> None:
        """Write its configuration into a pool's header (create; a restore under the real name)."""

    # ------------------------------------------------------------------ restore

    @classmethod
    def restoring(cls, part: dict[str, Any], target: str) -> Restoring:
        """A pool created from a snapshot's configuration: how to create it with this tier."""
        raise NotImplementedError

    @classmethod
    def restored(cls, part: dict[str, Any], made: dict[str, Any], tier: "Configured | None") -> str:
        """The report's line once the restored pool has it: just created with it (`made`: `restoring`'s
        create options; `tier`: the new pool's) or, for a tier recorded later, recorded (`tier` None)."""
        return "attached"

    def renamed(self, shm_path: str) -> None:
        """The pool this handle is on takes another name (a restore publishes it): `shm_path`, its segment's."""

    @classmethod
    def restore_failed(cls, made: dict[str, Any]) -> None:
        """The restore failed before the pool was published: undo what `restoring`'s options made."""

    def stand_in(self, directory: str) -> dict[str, Any]:
        """restore --replace builds the new pool beside the old one (whose header fields configuring its tiers
        it then takes over): for a tier in the segment, the Pool.create options of a throw-away one of the same
        index size in `directory`."""
        return {}

    @classmethod
    def remove_stand_in(cls, directory: str) -> None:
        """Remove what `stand_in` made in `directory` (after the swap, or what a killed restore left)."""

    def replaced(self) -> str:
        """restore --replace swapped a new pool in: what happens to this tier (its report line)."""
        return "left as it is"

    resize_refusal: str | None = None  # why a pool with this tier cannot be resized, if it cannot


class Creating(NamedTuple):
    """The pool being created, as a tier's `plan` sees it."""

    name: str
    shm_path: str  # its segment's path: the owner a tier's files record
    mode: int
    data_size: int
    block_size: int


__all__ = ["BUSY", "Configured", "Context", "Creating", "Fetched", "Lower", "Plan", "Restoring", "Selector",
           "too_small"]
