"""Consistency check and repair of a pool.

The slot records are the truth; everything else (block map, hash chains,
free-slot list, entry and block counters, pin counts) is derived from them and
rebuilt here.  `analyse` runs with the pool lock held and changes nothing
unless asked to fix; it is the core's repairer (core.py), run automatically
when a lock holder finds the dirty mark left by a process that died inside a
critical section.  Everything here goes through the core's interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import xxhash

from . import procs
from .errors import PoolBusy, SegmentCorrupt
from .chains import build_chains, chain_members
from .layout import FREE, KEY_CELL, MAX_KEY_BYTES, SEALED, WRITING, ZOMBIE

if TYPE_CHECKING:
    from .core import Core
    from .lower import Lower

_CHECKSUM_BATCH = 64


def analyse(core: "Core", fix: bool) -> list[str]:
    """Find (and with `fix`, repair) every inconsistency in the memory tier's metadata; lock held."""
    s = core.columns
    g = core.geometry
    n, bs, n_blocks, n_kcells = g.n_slots, g.block_size, g.n_blocks, g.n_kcells
    state = s["state"].copy()
    problems: list[str] = []
    alive = procs.alive_checker()

    h = core.fields
    if h.dirty[0]:
        problems.append("a process died while changing the pool's metadata")
    problems += _header_sanity(core, fix)

    bad_state = np.flatnonzero(state > ZOMBIE)
    if bad_state.size:
        problems.append(f"{bad_state.size} slot(s) with an invalid state")
        state[bad_state] = FREE

    # Entries whose geometry is impossible cannot be trusted at all.
    used = np.flatnonzero(state != FREE)
    first, nblk = s["first_block"][used], s["n_blocks"][used]
    vlen, klen = s["value_len"][used], s["key_len"][used].astype(np.uint64)
    kcell = s["key_cell"][used]
    ok = (nblk <= n_blocks) & (first <= n_blocks - np.minimum(nblk, n_blocks))
    # A value fills exactly ceil(value_len / block_size) blocks (layout.blocks_for).
    ok &= (vlen <= nblk * np.uint64(bs)) & (vlen + np.uint64(bs) > nblk * np.uint64(bs))
    kn = (klen + np.uint64(KEY_CELL - 1)) // np.uint64(KEY_CELL)
    nk = np.uint64(n_kcells)
    ok &= (klen >= 1) & (klen <= MAX_KEY_BYTES) & (kcell <= nk - np.minimum(kn, nk))
    if not ok.all():
        problems.append(f"{int((~ok).sum())} entr(y/ies) with impossible size or position")
        state[used[~ok]] = FREE

    # Pin records: keep those of live processes on entries that can be pinned.
    pr = core.pin_records
    ppid, pslot, pstart = pr["pid"], pr["slot"], pr["start"]
    keep_pin = np.zeros(ppid.size, dtype=bool)
    for j in map(int, np.flatnonzero(ppid != 0)):
        i = int(pslot[j])
        if 0 <= i < n and state[i] in (SEALED, ZOMBIE) and alive(int(ppid[j]), int(pstart[j])):
            keep_pin[j] = True
    dead_pins = int(np.count_nonzero((ppid != 0) & ~keep_pin))
    if dead_pins:
        problems.append(f"{dead_pins} pin(s) held by dead processes")
    pins = np.bincount(pslot[keep_pin].astype(np.int64), minlength=n)[:n].astype(np.uint32)
    if not dead_pins and (pins != s["pins"]).any():
        problems.append("pin counts did not match the pin records")

    writing = np.flatnonzero(state == WRITING)
    dead_writers = [int(i) for i in writing if not alive(int(s["owner_pid"][i]), int(s["owner_start"][i]))]
    if dead_writers:
        problems.append(f"{len(dead_writers)} unfinished write(s) of dead processes")
        state[dead_writers] = FREE
    zombies = np.flatnonzero((state == ZOMBIE) & (pins == 0))
    if zombies.size:
        problems.append(f"{zombies.size} deleted entr(y/ies) whose readers are gone")
        state[zombies] = FREE
    # Their blocks and key cells are still marked in use; that is explained above, not a leak of its own.
    released = np.asarray(dead_writers + zombies.tolist(), dtype=np.int64)

    # Overlapping runs of blocks or of key cells: keep the most recently inserted entry of each clash.
    key_len = s["key_len"].astype(np.int64)
    kcells = (key_len + KEY_CELL - 1) // KEY_CELL
    clash = _drop_overlaps(state, s["first_block"].astype(np.int64), s["n_blocks"].astype(np.int64), s["insert_seq"])
    clash += _drop_overlaps(state, s["key_cell"].astype(np.int64), kcells, s["insert_seq"])
    if clash:
        problems.append(f"{clash} entr(y/ies) overlapping another")

    # Duplicate keys among sealed entries: keep the newest.
    sealed = np.flatnonzero(state == SEALED)
    kh = s["key_hash"][sealed]
    srt = np.argsort(kh, kind="stable")
    dup_groups = np.flatnonzero(kh[srt][1:] == kh[srt][:-1])
    dups = 0
    seen: dict[bytes, int] = {}
    for g in dup_groups:
        for i in (int(sealed[srt[g]]), int(sealed[srt[g + 1]])):
            if state[i] != SEALED:
                continue
            k = core.key_bytes(i)
            j = seen.get(k)
            if j is None or j == i:
                seen[k] = i
                continue
            loser = i if int(s["insert_seq"][i]) < int(s["insert_seq"][j]) else j
            state[loser] = FREE
            seen[k] = j if loser == i else i
            dups += 1
    if dups:
        problems.append(f"{dups} duplicate entr(y/ies) of one key")

    # Derived structures, rebuilt from the surviving slots.
    used = np.flatnonzero(state != FREE)
    blockmap = _coverage(n_blocks, s["first_block"][used].astype(np.int64), s["n_blocks"][used].astype(np.int64))
    keymap = _coverage(n_kcells, s["key_cell"][used].astype(np.int64), kcells[used])
    explained = (_coverage(n_blocks, s["first_block"][released].astype(np.int64), s["n_blocks"][released].astype(np.int64)),
                 _coverage(n_kcells, s["key_cell"][released].astype(np.int64), kcells[released]))
    for what, built, cur, why in (("block", blockmap, core.block_map, explained[0]),
                                  ("key", keymap, core.key_map, explained[1])):
        leaked = int(np.count_nonzero(cur.astype(bool) & ~built.astype(bool) & ~why.astype(bool)))
        lost = int(np.count_nonzero(~cur.astype(bool) & built.astype(bool)))
        if leaked or lost:
            unit = "block(s)" if what == "block" else "key cell(s)"
            problems.append(f"{what} map out of step: {leaked} leaked {unit}, {lost} in use but marked free")

    sealed = np.flatnonzero(state == SEALED)
    free = np.flatnonzero(state == FREE).astype(np.int32)
    buckets, nxt = build_chains(sealed, s["key_hash"][sealed], g.n_buckets - 1, g.n_buckets, n, free)
    if not fix:  # a repair rebuilds the chains anyway; only a check needs to walk them
        # Walk them: equal bucket heads say nothing about the links behind them.
        chains_ok = np.array_equal(chain_members(core.buckets, s["next"]), chain_members(buckets, nxt))
        if not chains_ok and not problems:
            problems.append("hash index out of step with the entries")
        if not problems and not _free_list_ok(int(h.free_slot[0]), s["state"], s["next"]):
            problems.append("free-slot list out of step with the entries")
    counts_ok = int(h.n_entries[0]) == sealed.size and int(h.used_blocks[0]) == int(blockmap.sum())
    counts_ok &= int(h.used_kcells[0]) == int(keymap.sum())
    if not counts_ok and not problems:
        problems.append("entry or block counters out of step")

    if fix:
        s["state"][:] = state
        s["pins"][:] = pins
        ppid[~keep_pin] = 0
        pslot[~keep_pin] = -1
        core.block_map[:] = blockmap
        core.key_map[:] = keymap
        core.buckets[:] = buckets
        s["next"][:] = nxt
        h.free_slot[0] = int(free[0]) if free.size else -1
        h.n_entries[0] = sealed.size
        h.used_blocks[0] = int(blockmap.sum())
        h.alloc_hint[0] = 0
        h.used_kcells[0] = int(keymap.sum())
        h.key_hint[0] = 0
        h.cand_valid[0] = 0
    return problems


_COUNTERS = ("seq", "hits", "misses", "puts", "deletes", "evictions", "expirations", "bytes_evicted", "repairs",
             "ops", "lfu_epoch", "disk_hits", "disk_misses", "disk_spills", "disk_promotions", "disk_bytes_written",
             "disk_bytes_read", "disk_corrupt", "disk_dropped", "disk_errors", "disk_evictions", "remote_hits",
             "remote_misses", "remote_promotions", "remote_errors", "remote_corrupt", "remote_sent", "remote_written",
             "remote_dropped", "remote_bytes_written", "remote_bytes_read")
_IMPOSSIBLE = 1 << 63  # no counter of ours reaches this in centuries: a value past it is damage


def _header_sanity(core: "Core", fix: bool) -> list[str]:
    """Header fields and per-entry counters whose damage would break every later operation."""
    problems = []
    hdr = core.header[0]
    s = core.columns
    if int(hdr["lfu_period"]) < 1:
        problems.append("LFU period was 0")
        if fix:
            hdr["lfu_period"] = max(1024, core.geometry.n_slots)
    wild = [c for c in _COUNTERS if int(hdr[c]) >= _IMPOSSIBLE]
    if wild:
        problems.append(f"counter(s) {', '.join(wild)} out of range")
        if fix:
            for c in wild:
                if c == "seq":
                    seqs = np.concatenate([s["insert_seq"], s["access_seq"]])
                    hdr[c] = int(seqs[seqs < _IMPOSSIBLE].max(initial=0))
                else:
                    hdr[c] = 0
    epoch = int(hdr["lfu_epoch"])
    ahead = s["lfu_epoch"] > np.uint64(epoch)
    huge = s["access_count"] >= np.uint64(_IMPOSSIBLE)
    if ahead.any() or huge.any():
        problems.append(f"{int((ahead | huge).sum())} entr(y/ies) with impossible access counts")
        if fix:
            s["lfu_epoch"][ahead] = epoch
            s["access_count"][huge] = 1
    return problems


def _drop_overlaps(state: np.ndarray, starts: np.ndarray, lengths: np.ndarray, iseq: np.ndarray) -> int:
    """Free (in `state`) the older entry of each pair whose runs [start, start + length) overlap; how many."""
    used = np.flatnonzero((state != FREE) & (lengths > 0))  # an empty run overlaps nothing
    order = used[np.argsort(starts[used], kind="stable")]
    clash = 0
    last = -1
    for i in map(int, order):
        if last >= 0 and starts[i] < starts[last] + lengths[last]:
            loser = i if int(iseq[i]) < int(iseq[last]) else last
            state[loser] = FREE
            clash += 1
            if loser == last:
                last = i
        else:
            last = i
    return clash


def _coverage(n: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A map of `n` cells, 1 where one of the runs [start, start + length) lies."""
    cover = np.zeros(n + 1, dtype=np.int64)
    np.add.at(cover, starts, 1)
    np.add.at(cover, starts + lengths, -1)
    return (np.cumsum(cover[:-1]) > 0).astype(np.uint8)


def _free_list_ok(head: int, state: np.ndarray, nxt: np.ndarray) -> bool:
    """Does the free list run over exactly the free slots, in range, without a loop?"""
    n, seen, i = state.size, 0, head
    while i >= 0:
        if i >= n or state[i] != FREE or seen >= n:
            return False
        i = int(nxt[i])
        seen += 1
    return i == -1 and seen == int(np.count_nonzero(state == FREE))


def _pin_or_check(core: "Core", slots: list[int]) -> tuple[list[Any], int, list[tuple[int, int]]]:
    """Pin the sealed entries among `slots` to check them outside the lock (lock held); an entry that
    finds no free pin record (a process holding many views, records forged by a writer) is checked
    now, under the lock, so verify never depends on the pin table having room.  (pinned, checked here,
    bad ones found here)."""
    pinned: list[Any] = []
    checked = 0
    bad: list[tuple[int, int]] = []
    for i in slots:
        try:
            got = core.pin_batch([i])
        except PoolBusy:
            if not core.is_sealed(i):
                continue
            try:
                off, vlen = core.value_at(i)
            except SegmentCorrupt:
                continue  # the structural pass reports it
            if xxhash.xxh3_64_intdigest(core.mv[off : off + vlen]) != core.checksum(i):
                bad.append((i, core.insert_seq(i)))
            checked += 1
            continue
        pinned += got
    return pinned, checked, bad


def verify(core: "Core", repair: bool, checksums: bool, below: "Sequence[Lower]" = ()) -> dict[str, Any]:
    """Check metadata (lock held briefly) and entry checksums (outside the lock); with `repair`, fix what
    is wrong and drop entries whose bytes no longer match.  `below`: the pool's tiers below memory, each
    checking what it holds (lower.Lower.verify) with the checksums."""

    def check() -> tuple[list[str], list[int]]:
        problems = core.check()
        if repair and problems:
            core.repair()
        return problems, [int(i) for i in np.flatnonzero(core.columns["state"] == SEALED)]

    problems, sealed = core.inspect(check)
    if problems and not repair:
        # A corrupt index makes entry checksums meaningless: report what we have.
        return {"ok": False, "problems": problems, "repaired": False, "entries": len(sealed), "checked": 0}
    checked = 0
    bad: list[tuple[int, int]] = []
    if checksums:
        for k in range(0, len(sealed), _CHECKSUM_BATCH):
            batch, done, failed = core.locked(_pin_or_check, core, sealed[k : k + _CHECKSUM_BATCH])
            bad += failed
            checked += done
            try:
                for p in batch:
                    if xxhash.xxh3_64_intdigest(core.mv[p.offset : p.offset + p.length]) != core.checksum(p.slot):
                        bad.append((p.slot, core.insert_seq(p.slot)))
                checked += len(batch)
            finally:
                core.locked(core.unpin_batch, batch)
        for i, _iseq in bad:
            problems.append(f"entry {_show(core, i)}: value does not match its checksum")
        if repair and bad:
            core.locked(_drop_entries, core, bad)
    report: dict[str, Any] = {}
    if checksums:
        for tier in below:
            report.update(tier.verify(repair, problems))
    return {
        "ok": not problems,
        "problems": problems,
        "repaired": bool(repair and problems),
        "entries": int(core.fields.n_entries[0]),
        "checked": checked,
        **report,
    }


def _show(core: "Core", i: int) -> str:
    try:
        return repr(core.key_of(i))[:80]
    except Exception:
        return f"#{i}"


def _drop_entries(core: "Core", bad: list[tuple[int, int]]) -> None:
    for i, iseq in bad:
        if core.is_sealed(i) and core.insert_seq(i) == iseq:
            core.remove(i)


__all__ = ["analyse", "verify"]
