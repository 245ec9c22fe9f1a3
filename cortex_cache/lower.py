"""The tiers below memory, each behind one small contract (docs/design.md, "One tier contract").

tiers.py orchestrates: on a memory miss it asks each tier below in order
(disk, the snapshot a restored pool is still being filled from, remote) and
promotes what the first one that has it returns; every put and delete is
offered to each.  A tier is a `Lower`:

- `lookup(kb, kh)`, lock held, only for a tier whose index lives in the
  segment (`in_segment`: the disk tier): it is asked in the same lock hold
  as memory, and its answer (`found`) is handed to `fetch`.
- `fetch(kb, kh, found, room)`, outside the lock: the value, checked against
  its checksum, as a `Fetched`; None for a miss or any fault of the tier (a
  fault is a miss); BufferTooSmall when the caller's `room` is too small.
- `still(got)`, lock held, just before the promotion reserves room: is `got`
  still the tier's current copy of the key?  (The tier counts its hit here.)
- `promoted(got)`, lock held, once the value is sealed in memory;
  `served(got, promoted)`, outside the lock, after either.
- `offer_put`, `offer_delete`: a put or delete of memory (the remote tier
  writes every put; the others keep what they have: the disk tier learns of
  puts and deletes in memory's lock hold, tiers.py).
- `forget(kb, kh)`, `contains(kb, kh)`, lock held: delete and membership
  (`delete`, `in`).

The disk tier also takes what memory evicts (its spill, begun in the
eviction's lock hold and written after it: tiers.py) and is written through
on puts when so configured; those stay tiers.py's, since only a tier in the
segment can take part in memory's lock holds.  The snapshot tier is read
only (snaptier.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .disklog import CORRUPT, Found
from .errors import BufferTooSmall
from .layout import H_DISK_BYTES_READ, H_DISK_ERRORS, H_DISK_HITS, H_DISK_PROMOTIONS, SLOT_FLAG_STR_KEY


class Fetched(NamedTuple):
    """A value a tier below memory had, checked against its checksum."""

    value: Any  # bytes-like
    flags: int  # SLOT_FLAG_STR_KEY or 0
    checksum: int  # xxh3_64 of the value: the pool's own checksum
    expiry: float  # absolute (the pool's clock), 0 = none
    priority: int
    token: Any  # the tier's own (the disk tier's DiskHit, the snapshot tier's place in its fill)


class Lower:
    """A tier below memory: the defaults are those of a tier that has nothing and keeps nothing."""

    name = ""
    in_segment = False  # its index is in the segment: looked up in memory's own lock hold

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

    def offer_put(self, kb: bytes, value: Any, flags: int, ttl: float | None) -> None:
        pass

    def offer_delete(self, kb: bytes) -> None:
        pass

    def forget(self, kb: bytes, kh: int) -> bool:
        return False

    def contains(self, kb: bytes, kh: int) -> bool:
        return False

    def close(self) -> None:
        pass


def too_small(room: int | None, length: int) -> None:
    if room is not None and room < length:
        raise BufferTooSmall(f"buffer of {room} bytes is too small for a value of {length} bytes")


class DiskBelow(Lower):
    """The disk tier (disktier.py, disklog.py): its index is in the segment, its records in files."""

    name = "disk"
    in_segment = True

    def __init__(self, core: Any, disk: Any) -> None:
        self.core = core
        self.disk = disk

    def lookup(self, kb: bytes, kh: int) -> Any:
        return self.disk.lookup(kb, kh)  # a DiskHit, SPILLING (Tiers.settled asks again) or None

    def fetch(self, kb: bytes, kh: int, found: Any, room: int | None) -> Fetched | None:
        if found is None:
            return None
        too_small(room, found.value_len)
        d, core, hit = self.disk, self.core, found
        for _ in range(4):  # the index can move on while we read; then look again
            log = d.log
            if log is None:
                core.locked(d.count, H_DISK_ERRORS)
                return None
            try:
                rec = log.read(hit.loc, kb)
            except OSError:
                core.locked(d.count, H_DISK_ERRORS)
                return None
            if rec.__class__ is Found and len(rec.value) == hit.value_len:
                return Fetched(rec.value, hit.flags, rec.checksum, rec.expiry, rec.priority, hit)
            bad = rec == CORRUPT or rec.__class__ is Found
            hit = core.locked(d.after_failed_read, kb, kh, hit, bad)
            if hit is None:
                return None
        return None

    def still(self, got: Fetched) -> bool:
        d, hit = self.disk, got.token
        d.count(H_DISK_HITS)
        d.count(H_DISK_BYTES_READ, hit.loc.length)
        return d.still(hit)

    def promoted(self, got: Fetched) -> None:
        d = self.disk
        d.count(H_DISK_PROMOTIONS)
        if not d.write_through and d.still(got.token):
            d.kill_slot(got.token.slot)  # exclusive tiers: the entry lives in memory now

    def forget(self, kb: bytes, kh: int) -> bool:
        return self.disk.forget(kb, kh)

    def contains(self, kb: bytes, kh: int) -> bool:
        return self.disk.contains(kb, kh)


class RemoteBelow(Lower):
    """The remote tier (remote.py): a Valkey/Redis server, written in the background, read on a miss."""

    name = "remote"

    def __init__(self, remote: Any) -> None:
        self.remote = remote

    def fetch(self, kb: bytes, kh: int, found: Any, room: int | None) -> Fetched | None:
        got = self.remote.get(kb)  # checked; None on a miss, a bad record or any trouble with the server
        if got is None:
            return None
        value, flags, checksum = got
        too_small(room, value.nbytes)
        return Fetched(value, flags & SLOT_FLAG_STR_KEY, checksum, 0.0, 0, None)

    def served(self, got: Fetched, promoted: bool) -> None:
        self.remote.count_hit(memoryview(got.value).nbytes, int(promoted))

    def offer_put(self, kb: bytes, value: Any, flags: int, ttl: float | None) -> None:
        self.remote.put(kb, value, flags, ttl)  # queued; the caller never waits on the network

    def offer_delete(self, kb: bytes) -> None:
        self.remote.delete(kb)


__all__ = ["Fetched", "Lower", "DiskBelow", "RemoteBelow", "too_small"]
