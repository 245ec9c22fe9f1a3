"""The batched calls behind Pool.put_many, get_many_into, view_many, release_many, contains_many, delete_many,
reserve_write_many, commit_many and abort_many.

An engine asks for a request's chunks together.  Each batched call does the
bookkeeping of all its keys in one lock hold and copies outside it; the
guarantees are the single-key calls' (a pinned entry cannot be reused under a
copy; a kill at any point leaves reservations and pins that the next lock
holder reclaims).  A key that fails gets its error in the result list; the
call itself raises only for a bad argument (before anything changed) or a
damaged pool, after undoing its pins.

Each function takes the pool's layers (`core`: core.py, `tiers`: tiers.py)
that `Pool` (pool.py) holds; `Pool`'s methods are thin wrappers over these.
"""

from __future__ import annotations

from typing import Any, Callable

from xxhash import xxh3_64_intdigest

from .core import COPY_IN_LOCK, READ_COUNTED, READ_HITS, SLOW, Core, Pinned
from .errors import CortexCacheError, KeyNotFound, PoolBusy, UsageError
from .handles import EntryView, EntryWriter
from .layout import MAX_KEY_BYTES, SLOT_FLAG_STR_KEY
from .tiers import Tiers, copy_hashing
from .values import as_byte_view, key_bytes, put_args, valid_nbytes, writable_bytes


def encoded(keys: Any) -> list[tuple[bytes, int]]:
    """(key bytes, key hash) of every key; UsageError for a bad one."""
    out = []
    for k in keys:
        # values.key_bytes, with the usual str key inlined (a batch's keys are mostly text).
        if k.__class__ is str and k.isascii() and 0 < len(k) <= MAX_KEY_BYTES:
            kb = k.encode()
        else:
            kb = key_bytes(k)[0]
        out.append((kb, xxh3_64_intdigest(kb)))
    return out


def put_many(core: Core, tiers: Tiers, items: Any, ttl: float | None, priority: int) -> list[Exception | None]:
    """Pool.put_many: small values in one lock hold, then large ones reserved, copied and sealed."""
    pairs = list(items.items() if isinstance(items, dict) else items)
    put_args(core, b"", False, 0, ttl, priority)  # the batch-wide arguments: raise before storing anything
    results: list[Exception | None] = [None] * len(pairs)
    small: list[tuple[int, bytes, int, int, memoryview, int]] = []
    large: list[tuple[int, bytes, int, int, memoryview, int]] = []
    prio = int(priority)
    for n, (key, value) in enumerate(pairs):
        try:
            kb, is_str = key_bytes(key)
            vb = as_byte_view(value)
            kh, flags, nblk = put_args(core, kb, is_str, vb.nbytes, ttl, prio)
        except CortexCacheError as e:
            results[n] = e
            continue
        (small if tiers.fast_ok and vb.nbytes <= COPY_IN_LOCK else large).append(
            (n, kb, kh, flags, vb, nblk))
    fast = core.fast
    if small and fast is not None:  # the C write path, in one lock hold (_fastpath_put.h)
        got = fast.put_many([t[1:] for t in small], ttl, prio)
        if got is not SLOW:
            for (n, *_), r in zip(small, got):
                results[n] = r
            small = [t for t, r in zip(small, got) if r is SLOW]  # what it left to the Python path
    if small:
        def put_all() -> None:
            for n, kb, kh, flags, vb, nblk in small:
                try:
                    core.put_small(kb, kh, flags, vb, nblk, xxh3_64_intdigest(vb), ttl, prio)
                    results[n] = None
                except CortexCacheError as e:  # PoolFull: the metadata is consistent, go on
                    results[n] = e
        core.locked(put_all)
    if large and tiers.fast_ok:
        put_large_many(core, large, results, ttl, prio)
    elif large:
        for n, kb, kh, flags, vb, nblk in large:  # a tier in memory's lock holds (the disk): key by key
            try:
                tiers.put(kb, kh, flags, vb, nblk, ttl, prio)
            except CortexCacheError as e:
                results[n] = e
    if tiers.takes_puts:
        for (key, value), err in zip(pairs, results):
            if err is None:
                kb, is_str = key_bytes(key)
                tiers.offer_put(kb, value if value.__class__ is bytes else as_byte_view(value),
                                SLOT_FLAG_STR_KEY if is_str else 0, ttl)
    return results


def put_large_many(core: Core, large: list, results: list, ttl: float | None, prio: int) -> None:
    """Reserve every large value in one lock hold, copy them outside it, seal them in one."""

    got = core.reserve_many([(kb, kh, flags, vb.nbytes, nblk) for _, kb, kh, flags, vb, nblk in large])
    reserved = []  # (n, slot, offset)
    for (n, *_), r in zip(large, got):
        if isinstance(r, Exception):
            results[n] = r
        else:
            reserved.append((n, *r))
    by_n = {t[0]: t for t in large}
    sums: list[int] = []
    try:
        for n, i, off in reserved:
            sums.append(copy_hashing(core.mv, off, by_n[n][4]))
    except BaseException:
        abort_taken(core, [i for _, i, _ in reserved])
        raise
    sealed = core.seal_many([(i, by_n[n][1], by_n[n][2], checksum, ttl, prio)
                               for (n, i, _), checksum in zip(reserved, sums)])
    for (n, _, _), ok in zip(reserved, sealed):
        if not ok:  # a repair took the reservation back (its owner looked dead)
            results[n] = PoolBusy(f"pool {core.name!r}: the reservation for this key was reclaimed")


def get_many_into(core: Core, tiers: Tiers, keys: Any, outs: Any) -> list[int | None | Exception]:
    """Pool.get_many_into: memory hits found in one lock hold and copied (the fast path: seqlock-checked,
    no pins; else pinned, copied, and unpinned in one); misses and the rest key by key."""
    enc = encoded(keys)
    omvs = [writable_bytes(o) for o in outs]
    if len(omvs) != len(enc):
        raise UsageError(f"get_many_into needs one buffer per key ({len(enc)} keys, {len(omvs)} buffers)")
    below = tiers.look_below
    fast = core.fast
    if fast is not None:
        # Per key: its length, None (a miss, counted), or SLOW: the key by key path below.
        results: list[Any] = fast.read_many(enc, omvs, READ_HITS if below else READ_COUNTED)
        for n, r in enumerate(results):
            if r is SLOW:
                try:
                    results[n] = read_into(core, tiers, enc[n], omvs[n])
                except CortexCacheError as e:
                    results[n] = e
        return results
    got = core.locked(core.pin_many, enc, [m.nbytes for m in omvs], not below)
    results = list(got)
    pinned = []
    try:
        for n, r in enumerate(got):
            if r.__class__ is Pinned:
                pinned.append(r)
                _, _, off, vlen = r
                omvs[n][:vlen] = core.mv[off : off + vlen]
                try:
                    core.check_copy(r, omvs[n][:vlen])
                    results[n] = vlen
                except CortexCacheError as e:
                    results[n] = e
    finally:
        if pinned:
            core.release_pins(pinned)
    if below:
        for n, r in enumerate(got):
            if r is None:
                try:
                    results[n] = read_into(core, tiers, enc[n], omvs[n])
                except CortexCacheError as e:
                    results[n] = e
    return results


def read_into(core: Core, tiers: Tiers, enc: tuple[bytes, int], omv: memoryview) -> int | None:
    """One key's value (memory, else the tiers below) copied into `omv`: its length, or None if absent."""
    kb, kh = enc
    return finish_read_into(core, tiers, kb, kh, tiers.settled(tiers.read, kb, kh, omv), omv)


def finish_read_into(core: Core, tiers: Tiers, kb: bytes, kh: int, r: Any, omv: memoryview) -> int | None:
    """Finish a read into `omv` given what `Core.read`/`Tiers.read` returned (`r`): the length copied
    (an int: copied under the lock; a Pinned entry: copied now, then unpinned), or the value brought from
    below; None if absent."""
    if r.__class__ is int:
        return r
    if r.__class__ is Pinned:
        _, _, off, n = r
        try:
            omv[:n] = core.mv[off : off + n]
            core.check_copy(r, omv[:n])
        finally:
            core.release_pins([r])
        return n
    value = tiers.from_below(kb, kh, r, omv.nbytes)
    if value is None:
        return None
    omv[: len(value)] = value
    return len(value)


def pin_many(core: Core, enc: list[tuple[bytes, int]], count_miss: bool) -> list[Any]:
    """`Core.pin_many` for the views (no buffers), through the fast path when it can: per key the fast
    path's Pin (it has the checksum), a (Pinned, checksum) pair, None (absent), or that key's error."""
    fast = core.fast
    got = fast.pin_many(enc, READ_COUNTED if count_miss else READ_HITS) if fast is not None else None
    if got is None:  # no fast path, or its lock was busy
        return [(r, core.checksum(r.slot)) if r.__class__ is Pinned else r
                for r in core.locked(core.pin_many, enc, None, count_miss)]
    for n, r in enumerate(got):
        if r is SLOW:  # expired, absent with a tier below, out of pin records...: the Python path
            r = core.locked(core.pin_many, [enc[n]], None, count_miss)[0]
            got[n] = (r, core.checksum(r.slot)) if r.__class__ is Pinned else r
    return got


def view_many(core: Core, tiers: Tiers, views: set, view_one: Callable[[Any], EntryView],
              keys: Any) -> list[EntryView | None | Exception]:
    """Pool.view_many: memory hits pinned in one lock hold (added to the handle's `views`); misses through
    `view_one` (Pool.view), which brings them in from below."""
    keys = list(keys)
    enc = encoded(keys)
    below = tiers.look_below
    got = pin_many(core, enc, not below)
    results = EntryView.of_pins(core, views, got)
    if core.verify_reads:
        for n, r in enumerate(results):
            if r.__class__ is EntryView:
                try:
                    verified(core, r)
                except CortexCacheError as e:
                    results[n] = e
    if below:
        for n, r in enumerate(results):
            if r is None:
                try:
                    results[n] = view_one(keys[n])
                except KeyNotFound:
                    pass
                except CortexCacheError as e:
                    results[n] = e
    return results


def verified(core: Core, view: EntryView) -> EntryView:
    """`view`, or with `verify_reads` ValueCorrupt (the view released) when its bytes do not match the
    checksum taken at put."""
    if core.verify_reads and not view.verify():
        view.release()
        raise core.value_corrupt()
    return view


def release_many(core: Core, views: Any) -> None:
    """Pool.release_many: unpin every EntryView among `views` in one lock hold."""
    pinned = EntryView.drop_all(views)
    if pinned and not core.closed:
        core.release_pins(pinned)


def contains_many(core: Core, tiers: Tiers, keys: Any) -> list[bool]:
    """Pool.contains_many: one lock hold for all; a bad key is simply not there."""
    enc = []
    for k in keys:
        try:
            enc.append(key_bytes(k)[0])
        except UsageError:
            enc.append(None)
    return core.locked(lambda: [kb is not None and tiers.contains(kb, xxh3_64_intdigest(kb)) for kb in enc])


def delete_many(core: Core, tiers: Tiers, keys: Any) -> list[bool]:
    """Pool.delete_many: every tier in one lock hold; the remote copies deleted in the background."""
    enc = encoded(keys)
    found = core.locked(lambda: [tiers.delete(kb, kh) for kb, kh in enc])
    if tiers.takes_deletes:
        for kb, _ in enc:
            tiers.offer_delete(kb)
    return found


def reserve_write_many(core: Core, tiers: Tiers, items: Any, ttl: float | None,
                       priority: int) -> list[EntryWriter | Exception]:
    """Pool.reserve_write_many: every (key, nbytes) reserved in one lock hold; per key its EntryWriter or the
    error it met (a bad key or size, ValueTooLarge, PoolFull)."""
    put_args(core, b"", False, 0, ttl, priority)  # the batch-wide arguments: raise before reserving anything
    prio = int(priority)
    results: list[Any] = []
    asked: list[tuple[bytes, int, int, int, int]] = []
    where: list[int] = []  # the item of each asked
    bs, most = core.geometry.block_size, core.geometry.n_blocks
    for n, (key, nbytes) in enumerate(items):
        # values.key_bytes, valid_nbytes and put_args, with the usual case (an ASCII str key, an int size that
        # fits) inlined: an engine reserves a request's chunks together, and this loop is its cost.
        if key.__class__ is str and nbytes.__class__ is int and key.isascii() and 0 < len(key) <= MAX_KEY_BYTES \
                and 0 <= nbytes and -(-nbytes // bs) <= most:
            kb = key.encode()
            asked.append((kb, xxh3_64_intdigest(kb), SLOT_FLAG_STR_KEY, nbytes, -(-nbytes // bs)))
        else:
            try:
                kb, is_str = key_bytes(key)
                nbytes = valid_nbytes(nbytes)
                kh, flags, nblk = put_args(core, kb, is_str, nbytes, ttl, prio)
            except CortexCacheError as e:
                results.append(e)
                continue
            asked.append((kb, kh, flags, nbytes, nblk))
        results.append(None)
        where.append(n)
    for n, a, r in zip(where, asked, core.reserve_many(asked)):
        results[n] = r if r.__class__ is not tuple else EntryWriter(tiers, r[0], a[0], a[1], a[2], r[1], a[3], ttl, prio)
    return results


def commit_many(core: Core, tiers: Tiers, writers: Any, checksums: Any) -> list[Exception | None]:
    """Pool.commit_many: checksums taken outside the lock, every writer sealed in one lock hold (key by key
    when a tier writes each put's record first: a write-through disk tier); per writer None or its error."""
    writers = list(writers)
    sums = [None] * len(writers) if checksums is None else list(checksums)
    if len(sums) != len(writers):
        raise UsageError(f"commit_many needs one checksum per writer ({len(writers)} writers, {len(sums)} checksums)")
    results: list[Exception | None] = [None] * len(writers)
    if tiers.writes_first:
        for n, (w, c) in enumerate(zip(writers, sums)):
            try:
                w.commit(c)
            except CortexCacheError as e:
                results[n] = e
        return results
    taken = []  # (index, writer, its memoryview): the writers this call now owns
    seals = []  # (slot, key bytes, key hash, checksum, ttl, priority) of each
    for n, (w, c) in enumerate(zip(writers, sums)):
        mv = w.take()
        if mv is None:
            results[n] = UsageError("this entry writer was already committed or aborted")
            continue
        kb, kh, _, ttl, prio = w.args
        seals.append((w.slot, kb, kh, xxh3_64_intdigest(mv) if c is None else int(c), ttl, prio))
        taken.append((n, w, mv))

    def seal_all() -> list[bool]:
        sealed = []
        for i, kb, kh, c, ttl, prio in seals:
            sealed.append(core.is_writing(i))
            if sealed[-1]:
                tiers.seal(i, c, kb, kh, ttl, prio)
        return sealed

    try:
        # No tier in memory's lock holds: the C write path where it runs; else Tiers.seal tells them (a disk
        # tier drops its stale copies).
        sealed = core.seal_many(seals) if tiers.fast_ok else core.locked(seal_all)
    except BaseException:
        abort_taken(core, [w.slot for _, w, _ in taken])
        raise
    finally:
        for _, _, mv in taken:
            mv.release()
    for (n, _, _), ok in zip(taken, sealed):
        if not ok:  # a repair took the reservation back (its owner looked dead)
            results[n] = PoolBusy(f"pool {core.name!r}: the reservation for this key was reclaimed")
    if tiers.takes_puts:
        for n, w, _ in taken:
            if results[n] is None:
                kb, _, flags, ttl, _ = w.args
                tiers.offer_put(kb, core.mv[w.offset : w.offset + w.nbytes].tobytes(), flags, ttl)
    return results


def abort_many(core: Core, writers: Any) -> None:
    """Pool.abort_many: give back the space of every writer not yet committed or aborted, in one lock hold."""
    slots = []
    for w in writers:
        if isinstance(w, EntryWriter):
            mv = w.take()
            if mv is not None:
                mv.release()
                slots.append(w.slot)
    abort_taken(core, slots)


def abort_taken(core: Core, slots: list[int]) -> None:
    """Abort the reserved `slots` (whatever state a failed seal left them in) in one lock hold."""
    if slots and not core.closed:
        core.locked(lambda: [core.abort(i) for i in slots if core.is_writing(i)])


__all__ = ["abort_many", "commit_many", "reserve_write_many", "contains_many", "delete_many", "encoded", "get_many_into", "put_many", "read_into", "finish_read_into", "release_many",
           "view_many"]
