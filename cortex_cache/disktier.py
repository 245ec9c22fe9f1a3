"""The disk tier: what memory evicts goes to a ring of checksummed files, and comes back on a miss.

One `lower.Configured` tier (docs/tiers.md, "Disk tier"; the contract is
lower.py's): its index lives in the pool's segment (diskindex.py), its
records in files (disklog.py).  Since its index is in the segment it is the
tier that takes part in memory's lock holds (`in_segment`): it is looked up
in the same lock hold as memory, told of every value memory seals (a copy of
an older value goes), and handed every entry memory evicts (`evicted`: the
spill).  Everything it does is here:

- spill on evict (write-back): begun in the eviction's lock hold (the bytes
  copied aside, the key indexed PENDING), written once the lock is let go
  (`core.after_unlock`), confirmed in another hold; an explicit `evict`, a
  failing tier or too much copied aside in one hold writes in place instead,
  so that an entry that cannot be written never leaves memory;
- write-through: a put's record written before memory takes the value,
  indexed when memory seals it;
- reads, promotions, keys, info, evict --tier disk, stats, verify;
- its configuration (`--tier disk`, `--disk-*`), its files at create, and
  what a restore does with it.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import xxhash
from xxhash import xxh3_64_intdigest

from . import segment
from .diskindex import DiskIndex, Spill, analyse_index, default_disk_entries, key_hash2
from .disklog import CORRUPT, DiskLog, Found
from .errors import CannotCreate, CortexCacheError, SpillLost, StorageIOError, UsageError
from .layout import (
    ADMIT_REUSED, DISK_O_DIRECT, DISK_ON, DISK_PATH_BYTES, DISK_WRITE_THROUGH, H_DISK_BYTES_READ, H_DISK_CORRUPT,
    H_DISK_ERRORS, H_DISK_HITS, H_DISK_PROMOTIONS, SLOT_FLAG_STR_KEY, Geometry,
)
from .lower import Configured, Context, Creating, Fetched, Plan, Restoring, Selector, too_small
from .safefs import unsafe_dir
from .units import entries, format_size, parse_size

# At most this many bytes of spills are copied aside in one lock hold; beyond, they are written in place.
SPILL_ASIDE = 64 << 20

# A write-through put's record on disk, indexed when its memory entry is sealed:
# (location, second key hash, value length, expiry, priority, flags).
Written = tuple


class DiskTier(Configured):
    """A pool's disk tier: its index in the segment (`index`) and this process's handle on its files."""

    name = "disk"
    distance = 0  # asked first: its lookup is part of memory's own lock hold
    in_segment = True
    takes_evictions = True
    promotes_as_read = True  # with admission, only entries read since their put came down here
    OPTIONS = {"tier": "cpu", "disk_path": None, "disk_size": None, "disk_write": "back", "disk_o_direct": False,
               "disk_max_entries": None}
    HEADER_FIELDS = ("disk_flags", "disk_size", "disk_path")
    ADAPTER_OPTIONS = ("disk_path", "disk_size", "disk_write")
    resize_refusal = ("has a disk tier: resize carries over memory tiers only for now (persist it, delete it, "
                      "create it again with the new --size and the same tier, then restore it)")

    def __init__(self, core: Any, index: DiskIndex) -> None:
        self.core = core
        self.index = index
        self.writes_first = index.write_through
        self.directory = index.path
        self._spills: list[Spill] = []  # begun under the lock; written after it (`_write_spills`)
        self._spill_bytes = 0  # bytes copied aside in `_spills`
        # Set once a spill written outside the lock failed: from then on this process spills in place,
        # so the next failure refuses its eviction instead of losing the entry; cleared by a success.
        self.spill_failing = False
        self._no_evict = False  # set while a failed spill's entry is put back: no eviction may make room

    @classmethod
    def attach(cls, core: Any, ctx: Context) -> "DiskTier | None":
        plan = ctx.plans.get(cls.name)
        index = DiskIndex.attach(core.seg.mm, core, plan.take_log() if plan is not None else None)
        if index is None:
            return None
        core.repair_hooks.append(lambda fix: analyse_index(index, fix))
        return cls(core, index)

    def close(self) -> None:
        self.index.close()

    # ------------------------------------------------------------------ reads

    def lookup(self, kb: bytes, kh: int) -> Any:
        return self.index.lookup(kb, kh)  # a DiskHit, SPILLING (Tiers.settled asks again) or None

    def fetch(self, kb: bytes, kh: int, found: Any, room: int | None) -> Fetched | None:
        if found is None:
            return None
        too_small(room, found.value_len)
        d, core, hit = self.index, self.core, found
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
        d, hit = self.index, got.token
        d.count(H_DISK_HITS)
        d.count(H_DISK_BYTES_READ, hit.loc.length)
        return d.still(hit)

    def promoted(self, got: Fetched) -> None:
        d = self.index
        d.count(H_DISK_PROMOTIONS)
        if not d.write_through and d.still(got.token):
            d.kill_slot(got.token.slot)  # exclusive tiers: the entry lives in memory now

    def forget(self, kb: bytes, kh: int) -> bool:
        return self.index.forget(kb, kh)

    def contains(self, kb: bytes, kh: int) -> bool:
        return self.index.contains(kb, kh)

    # ------------------------------------------------------------------ write-through

    def write_first(self, kb: bytes, flags: int, value: memoryview, expiry: float, priority: int) -> Written | None:
        """Write-through: put a record on disk (outside the lock); what `sealed` indexes, or None."""
        d, core = self.index, self.core
        where = core.locked(d.reserve, DiskLog.record_length(len(kb), value.nbytes))
        if where is None:
            return None
        try:
            loc = d.log.write(*where, kb, value, expiry, priority, flags)  # type: ignore[union-attr]
        except OSError:
            core.locked(d.count, H_DISK_ERRORS)
            return None
        return (loc, key_hash2(kb), value.nbytes, expiry, priority, flags)

    def unwrite(self, token: Written | None) -> None:
        if token is not None:
            self.index.log.kill(token[0])  # type: ignore[union-attr]

    def sealed(self, kb: bytes, kh: int, token: Written | None) -> None:
        """A new memory value of `kb` (lock held): index its write-through record, or drop a stale disk copy."""
        if token is None:
            self.index.forget(kb, kh)
        else:
            loc, kh2, vlen, expiry, priority, flags = token
            self.index.note_written(kh, kh2, len(kb), flags, loc, vlen, expiry, priority)

    # ------------------------------------------------------------------ spill on evict

    def ready_to_take(self) -> None:
        self.index.writable(f"pool {self.core.name!r}: evicting to the disk tier")

    def evicted(self, i: int, explicit: bool) -> None:
        """Begin spilling sealed entry `i`, about to leave memory (lock held): its bytes are copied aside
        and its disk entry made PENDING here; `_write_spills` writes it once the lock is free.  An explicit
        eviction (`evict`) writes its records here, before each entry leaves memory: a kill at any
        instant leaves the entry in one tier or the other (a spill copied aside is lost with its writer).

        An entry whose spill cannot happen never leaves memory: when this process cannot write the tier
        (it cannot open its files, a reservation or an in-place write fails), this raises and the
        eviction is refused -- an explicit `evict` fails, and so does a put that needed the room
        (docs/tiers.md, "When the disk tier cannot be written")."""
        if not explicit:
            self._spill(i, False)
            return
        try:
            self._spill(i, True)
        except StorageIOError as e:  # a record could not be written: that entry and the rest stay
            raise StorageIOError(f"pool {self.core.name!r}: evicting stopped: {e}; entries evicted before it "
                                 "went to disk (evict with --tier all to drop them without spilling)") from None

    def _spill(self, i: int, in_place: bool) -> None:
        core, d = self.core, self.index
        if self._no_evict:
            raise StorageIOError(f"pool {core.name!r}: no room to put back an entry its disk tier could not take")
        d.writable(f"pool {core.name!r}: evicting to the disk tier")
        off, vlen = core.value_at(i)  # each field read once and checked: impossible ones are SegmentCorrupt
        c = core.columns
        args = (core.key_bytes(i), int(c["key_hash"][i]), int(c["flags"][i]) & SLOT_FLAG_STR_KEY,
                core.mv[off : off + vlen], float(c["expiry"][i]), int(c["priority"][i]), core.checksum(i))
        if in_place or self.spill_failing or self._spill_bytes + vlen > SPILL_ASIDE:
            # One lock hold evicting a lot (evict --all of a big pool): write in place instead of
            # holding copies of it all.  A write that fails raises here, before the entry leaves memory.
            d.spill_now(*args)
            self.spill_failing = False
            return
        sp = d.begin_spill(*args)
        if sp is not None:
            if not self._spills:
                core.after_unlock.append(self._write_spills)
            self._spills.append(sp)
            self._spill_bytes += vlen

    def _write_spills(self) -> None:
        """Write the records of spills begun under the lock, without it; then finish them under it.

        The victims' bytes were copied aside, so the lock is free while the disk works: other
        processes go on, and a reader of a key being spilled waits for it (Tiers.settled)."""
        spills, self._spills, self._spill_bytes = self._spills, [], 0
        d = self.index
        if not spills or d.cols is None:  # closed meanwhile
            return
        written = [d.write_spill(sp) for sp in spills]
        lost: list[Spill] = []

        def finish() -> None:
            for sp, ok in zip(spills, written):
                if not d.finish_spill(sp, ok) and not self._put_back(sp):
                    lost.append(sp)

        try:
            self.core.locked(finish)
        except Exception:  # noqa: BLE001
            # The caller's own operation is done; this is the tier's business.  Entries left
            # PENDING read as misses once this process is gone, or go when their key is written.
            pass
        if not all(written):
            self.spill_failing = True  # spill in place from now on: the next failure refuses its eviction
        if lost:
            n = len(lost)
            raise SpillLost(
                f"pool {self.core.name!r}: {n} {'entry' if n == 1 else 'entries'} evicted to make room could not "
                f"be written to the disk tier in {d.path!r} and {'was' if n == 1 else 'were'} lost "
                f"(first: {lost[0].key[:60]!r}); the operation itself completed, and later evictions by this "
                "process are refused while the tier cannot be written"
            )

    def _put_back(self, sp: Spill) -> bool:
        """A spill whose record could not be written: put its value back in memory if there is room
        without evicting anything else (lock held).  False if it could not be (the entry is lost)."""
        core = self.core
        kb = sp.key
        kh = xxh3_64_intdigest(kb)
        if core.find(kb, kh) >= 0:
            return True  # written again meanwhile: nothing was lost
        if sp.expiry and sp.expiry <= core.clock():
            return True  # it expired meanwhile: gone anyway
        vlen = len(sp.value)
        self._no_evict = True
        try:
            i, off = core.reserve(kb, kh, sp.flags, vlen, core.blocks_or_raise(vlen))
        except CortexCacheError:
            return False
        finally:
            self._no_evict = False
        core.mv[off : off + vlen] = sp.value
        core.seal(i, kb, kh, sp.checksum, None, sp.priority, False, sp.expiry)
        return True

    # ------------------------------------------------------------------ an operator's requests

    def info(self, kb: bytes, kh: int) -> dict[str, Any] | None:
        d = self.index
        if d.contains(kb, kh):
            return d.info(d.find(kh, key_hash2(kb), len(kb)))
        return None

    def keys(self, pb: bytes, limit: int | None) -> list[Any]:
        """Keys on disk (read from the records, outside the lock) starting with `pb`, oldest written first."""
        return self._records(pb, False)

    def _records(self, pb: bytes, with_slots: bool) -> list[Any]:
        d = self.index
        if d.log is None:
            return []
        out: list[Any] = []
        for ds, seq, loc, klen, flags in self.core.locked(d.records):
            try:
                kb = d.log.read_key(loc, klen)
            except OSError:
                continue
            if kb is None or not kb.startswith(pb):
                continue  # overwritten since, or not a match
            k = kb.decode("utf-8", "surrogateescape") if flags & SLOT_FLAG_STR_KEY else kb
            out.append((ds, seq, kb, k) if with_slots else k)
        return out

    def remove(self, sel: Selector) -> tuple[int, int]:
        """Remove entries from the tier by one selector (their records are killed); by age, oldest written
        first, for a percent or a byte target."""
        d, core = self.index, self.core
        if sel.keys is not None:
            keys = sel.keys

            def by_key() -> list[int]:
                slots = (d.find(xxh3_64_intdigest(kb), key_hash2(kb), len(kb)) for kb in keys)
                return [s for s in slots if s >= 0]

            return core.locked(lambda: d.forget_slots(by_key()))
        if sel.prefix is not None:
            chosen = [(s, seq) for s, seq, _, _ in self._records(sel.prefix, True)]
            return core.locked(lambda: d.forget_slots([s for s, seq in chosen if d.is_live(s, seq)]))

        def select() -> list[int]:
            c = d.cols
            if sel.all:  # spills being written too, or they would land after the tier was emptied
                return list(map(int, d.indexed_slots()))
            idx = d.live_slots()
            if sel.expired:
                e = c["expiry"][idx]
                return list(map(int, idx[(e > 0) & (e <= core.clock())]))
            idx = idx[np.argsort(c["seq"][idx], kind="stable")]  # oldest written first
            goal = sel.target
            if goal is None:
                goal = int(np.ceil(int(c["value_len"][idx].sum()) * sel.percent / 100))
            sizes = np.cumsum(c["value_len"][idx].astype(np.int64))
            n = int(np.searchsorted(sizes, goal, side="left")) + 1 if goal > 0 else 0
            return list(map(int, idx[:n]))

        return core.locked(lambda: d.forget_slots(select()))

    def stats(self) -> dict[str, Any]:
        return self.index.stats()

    def verify(self, repair: bool, problems: list[str]) -> dict[str, Any]:
        """Read every record the index points at and check it (outside the lock)."""
        core, tier = self.core, self.index
        if tier.log is None:
            problems.append(f"disk tier unavailable: {tier.unavailable}")
            return {"disk_checked": 0}
        checked = 0
        bad: list[tuple[int, int, bool]] = []
        for d, seq, loc, klen, _flags in core.locked(tier.records):
            try:
                found = tier.log.read(loc, None)
            except OSError as e:
                problems.append(f"disk tier: cannot read file {loc.file}: {e.strerror}")
                break
            checked += 1
            if isinstance(found, Found):
                kh = xxhash.xxh3_64_intdigest(found.key)
                if (kh, key_hash2(found.key), len(found.key)) == (int(tier.cols["key_hash"][d]),
                                                                int(tier.cols["key_hash2"][d]), klen):
                    continue
            bad.append((d, seq, found == CORRUPT))

        def confirm() -> list[tuple[int, int, bool]]:
            return [(d, seq, corrupt) for d, seq, corrupt in bad if tier.is_live(d, seq)]  # not changed meanwhile

        still_bad = core.locked(confirm)
        for d, _seq, corrupt in still_bad:
            what = "fails its checksums" if corrupt else "is not the record the index expects"
            problems.append(f"disk entry in file {int(tier.cols['file'][d])} at {int(tier.cols['offset'][d])}: {what}")
        if repair and still_bad:
            def drop() -> None:
                for d, seq, corrupt in still_bad:
                    if tier.is_live(d, seq):
                        if corrupt:
                            tier.count(H_DISK_CORRUPT)
                        tier.kill_slot(d)

            core.locked(drop)
        return {"disk_checked": checked}

    def renamed(self, shm_path: str) -> None:
        if self.index.log is not None:
            self.index.log.set_owner(shm_path)

    def replaced(self) -> str:
        return f"emptied: {self.directory} now holds only what memory spills from the snapshot"

    # ------------------------------------------------------------------ configuration

    @classmethod
    def read_config(cls, core: Any) -> dict[str, Any] | None:
        h = core.header[0]
        flags = int(h["disk_flags"])
        if not flags & DISK_ON:
            return None
        return {
            "path": bytes(h["disk_path"]).decode("utf-8", "surrogateescape"),
            "size": int(h["disk_size"]),
            "write": "through" if flags & DISK_WRITE_THROUGH else "back",
            "o_direct": bool(flags & DISK_O_DIRECT),
            "max_entries": int(h["n_dslots"]),
        }

    @classmethod
    def decode_config(cls, part: Any, bad: Callable[[str], Exception]) -> dict[str, Any]:
        if not isinstance(part, dict):
            raise bad("has a bad disk tier")
        ok = (
            isinstance(part.get("path"), str) and part["path"].startswith("/")
            and isinstance(part.get("size"), int) and part["size"] > 0
            and part.get("write") in ("back", "through")
            and isinstance(part.get("o_direct"), bool)
            and isinstance(part.get("max_entries"), int) and 1 <= part["max_entries"] < 2**31 - 1
        )
        if not ok:
            raise bad("has a bad disk tier")
        if os.path.normpath(part["path"]) != part["path"]:
            raise bad(f"has a disk tier path that is not in normal form ({part['path']!r})")
        try:
            check_disk_path(part["path"])  # what `create --disk-path` refuses, a snapshot may not ask for
        except UsageError as e:
            raise bad(f"has a disk tier the command line would refuse: {e}") from None
        return {k: part[k] for k in ("path", "size", "write", "o_direct", "max_entries")}

    @classmethod
    def describe(cls, part: dict[str, Any]) -> str:
        return part["path"]

    @classmethod
    def want(cls, opts: dict[str, Any], home: str) -> dict[str, Any] | None:
        tier, path, size, n = opts["tier"], opts["disk_path"], opts["disk_size"], opts["disk_max_entries"]
        if tier not in ("cpu", "disk"):
            raise UsageError(f"unknown tier {tier!r}: choose cpu (shared memory) or disk (shared memory + disk)")
        if tier != "disk" and path is None:
            if size is not None or n is not None or opts["disk_o_direct"]:
                raise UsageError("disk tier options need --tier disk (or a disk path)")
            return None
        if opts["disk_write"] not in ("back", "through"):
            raise UsageError(f"unknown disk write mode {opts['disk_write']!r}: choose back or through")
        if n is not None and not 1 <= n < 2**31 - 1:
            raise UsageError(f"invalid disk max entries {n}")
        want: dict[str, Any] = {"path": check_disk_path(path if path is not None else home),
                                "write": opts["disk_write"], "o_direct": bool(opts["disk_o_direct"])}
        if size is not None:
            want["size"] = DiskLog.capacity_for(parse_size(size))
        if n is not None:
            want["max_entries"] = n
        return want

    @classmethod
    def adapter_options(cls, params: dict[str, Any]) -> dict[str, Any]:
        """An adapter's `disk_path` or `disk_size` gives its pool a disk tier (docs/integrations.md)."""
        if params.get("disk_path") is None and params.get("disk_size") is None:
            return {}
        return {"tier": "disk", "disk_path": params.get("disk_path"), "disk_size": params.get("disk_size"),
                "disk_write": params.get("disk_write", "back")}

    @classmethod
    def check_admission(cls, want: dict[str, Any], admit: int) -> None:
        if admit == ADMIT_REUSED and want["write"] == "through":
            raise UsageError("tier admission 2 needs a write-back disk tier: write-through puts every value on disk")

    @classmethod
    def differences(cls, want: dict[str, Any] | None, have: dict[str, Any] | None) -> list[str]:
        if want is None or have is None:
            return super().differences(want, have)
        out = []
        for key in ("path", "size", "write", "o_direct", "max_entries"):
            if key in want and want[key] != have[key]:
                out.append(f"disk-{key.replace('_', '-')} {_show(key, have[key])} (asked {_show(key, want[key])})")
        return out

    # ------------------------------------------------------------------ create

    @classmethod
    def plan(cls, want: dict[str, Any], opts: dict[str, Any], pool: Creating) -> "DiskPlan":
        """Open the tier in the directory asked (taking it over, its records found again) or make it, its
        space reserved now (NoSpace, exit 73, if the disk lacks it)."""
        path = want["path"]
        size = parse_size(opts["disk_size"]) if opts["disk_size"] is not None else None
        log, made = open_or_make_log(path, size, 4 * pool.data_size, want["o_direct"], pool.shm_path, pool.mode)
        flags = DISK_ON | (DISK_WRITE_THROUGH if want["write"] == "through" else 0)
        flags |= DISK_O_DIRECT if want["o_direct"] else 0
        n = opts["disk_max_entries"] or default_disk_entries(log.capacity, pool.block_size)
        return DiskPlan(log, made, path, flags, n, pool.shm_path)

    # ------------------------------------------------------------------ restore

    @classmethod
    def restoring(cls, part: dict[str, Any], target: str) -> Restoring:
        busy = live_owner(part["path"], segment.shm_path(target))
        if busy:
            # A copy restored beside the live pool that owns the tier (a clone, a check of the snapshot):
            # the tier stays that pool's, and the copy lives in memory alone.
            return Restoring({}, False, f"not attached: {part['path']} is the disk tier of a live pool ({busy}); "
                                        "restored into memory only")
        # An existing tier keeps its own capacity (its records are found again); a missing one is made anew.
        there = DiskLog.exists(part["path"])
        return Restoring({"disk_path": part["path"], "disk_size": None if there else part["size"],
                          "disk_write": part["write"], "disk_o_direct": part["o_direct"],
                          "disk_max_entries": part["max_entries"]}, False, None)

    @classmethod
    def restored(cls, part: dict[str, Any], made: dict[str, Any], tier: Configured | None) -> str:
        path = made["disk_path"]
        if made["disk_size"] is not None or tier is None:
            return f"made anew in {path} (it was gone)"
        return f"attached {path}: {entries(tier.stats()['entries'])} found on it"  # type: ignore[index]

    @classmethod
    def restore_failed(cls, made: dict[str, Any]) -> None:
        if made.get("disk_size") is not None:
            DiskLog.destroy(made["disk_path"])  # the tier this restore made anew goes with it

    def stand_in(self, directory: str) -> dict[str, Any]:
        """The pool swapped in is built with a throw-away tier of the same index size, and pointed at the
        real one just before the swap (its header fields)."""
        return {"disk_path": os.path.join(directory, "tier"), "disk_size": 2 * 16 * 4096,
                "disk_max_entries": int(self.core.geometry.n_dslots)}

    @classmethod
    def remove_stand_in(cls, directory: str) -> None:
        DiskLog.destroy(os.path.join(directory, "tier"))


class DiskPlan(Plan):
    """A disk tier being made for a new pool: its files are open (or were made), its index not yet."""

    finishes = True

    def __init__(self, log: DiskLog, made: bool, path: str, flags: int, n_entries: int, owner: str) -> None:
        self.log: DiskLog | None = log
        self.made, self.path, self.flags, self.n_entries, self.owner = made, path, flags, n_entries, owner

    def geometry(self) -> dict[str, Any]:
        return {"disk_entries": self.n_entries}

    def initialise(self, mm: Any, geo: Geometry) -> None:
        assert self.log is not None
        DiskIndex.initialise(mm, geo, self.flags, self.log, self.path)
        self.log.set_owner(self.owner)

    def take_log(self) -> DiskLog | None:
        """The pool's handle takes the open files over."""
        log, self.log = self.log, None
        return log

    def finish(self, tier: Any) -> None:
        """A tier taken over: its records found again, the index filled before anyone sees the pool."""
        if not self.made:
            tier.index.rebuild_from_scan()

    def undo(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None
        if self.made:
            DiskLog.destroy(self.path)


def _show(key: str, value: Any) -> str:
    if key == "size" and isinstance(value, int):
        return f"{format_size(value)} ({value} bytes)"
    return str(value)


def live_owner(path: str, owner: str) -> str | None:
    """The /dev/shm path of a live pool other than `owner` whose tier `path` is, or None.

    A tier that cannot be opened (missing, damaged, not ours) is None here:
    whoever opens it next reports why."""
    if not DiskLog.exists(path):
        return None
    try:
        log = DiskLog.open(path)
    except (CortexCacheError, OSError):
        return None
    try:
        was = log.owner()
    finally:
        log.close()
    if was and was != owner and was.startswith("/dev/shm/") and os.path.exists(was):
        return was
    return None


def _name_of(owner: str) -> str:
    """The pool name of a /dev/shm path of ours (segment.shm_path's inverse)."""
    base = os.path.basename(owner)
    return base[len(segment.prefix()):] if base.startswith(segment.prefix()) else base


def open_or_make_log(path: str, size: int | None, default_size: int, o_direct: bool,
                     owner: str, mode: int = 0o600) -> tuple[DiskLog, bool]:
    """Open the tier in `path` (taking it over from a pool that is gone) or make one; (log, made).

    `owner`: the /dev/shm path of the pool that will use it (a live other pool's tier is refused)."""
    if not DiskLog.exists(path):
        return DiskLog.create(path, size if size is not None else default_size, o_direct=o_direct, mode=mode), True
    log = DiskLog.open(path, o_direct=o_direct)
    try:
        if size is not None and DiskLog.capacity_for(size) != log.capacity:
            raise UsageError(
                f"{path!r} holds a disk tier of {log.capacity} bytes; give that --disk-size "
                f"(or none) to use it, or remove it with `cortex cache delete {_name_of(owner)} --force "
                f"--disk-path {path}`"
            )
        was = log.owner()
        if was and was != owner and was.startswith("/dev/shm/") and os.path.exists(was):
            raise CannotCreate(f"{path!r} is the disk tier of another pool ({was}); choose another --disk-path")
        return log, False
    except BaseException:
        log.close()
        raise


def check_disk_path(path: str | os.PathLike) -> str:
    raw = os.fspath(path)
    if not raw or (isinstance(raw, str) and not raw.strip()):
        raise UsageError("the disk path is empty: give a directory (or leave the option out for the default)")
    p = os.path.abspath(raw)
    if len(p.encode("utf-8", "surrogateescape")) >= DISK_PATH_BYTES or "\0" in p:
        raise UsageError(f"disk path is too long (at most {DISK_PATH_BYTES - 1} bytes): {p[:60]!r}...")
    why = unsafe_dir(p)  # a tier fills its directory with files of its own
    if why:
        raise UsageError(f"disk path {why}: give a directory of the pool's own, like /var/lib/cortex-cache/disk/NAME")
    return p


__all__ = ["DiskTier", "DiskPlan", "SPILL_ASIDE", "check_disk_path", "live_owner", "open_or_make_log"]
