"""The eviction policy's state across a persist and a restore: what a snapshot's records do not carry.

A snapshot's records bring back each entry's own metadata (core.restore_meta: access and insert sequence
numbers, access count, expiry, priority, length), which is all LRU, FIFO, priority, TTL and size order by.
What they do not carry is written beside them as one blob, `capture`, and laid back over the restored
entries by `apply`, so that a restored pool evicts as the pool that never stopped would:

- every policy: the pool's clocks (seq, ops, the LFU epoch, the hits counter);
- lfu: each entry's age in LFU epochs (its count is halved once per epoch it was not read);
- s3fifo, arc, auto: each entry's queue, read count (freq) and place in its queue (qseq), the two ghost
  rings (the keys each queue lost lately, oldest first, holes kept: a ghost's depth is its distance from
  the newest), the queues' clock, queue 0's target (ARC's p, or the share), and auto's regime and rates.

Entries are keyed by their key's stored hash (xxh3_64, the slot's key_hash), never by slot or by the
snapshot's order: the restored pool lays its entries out as it likes.

`capture` takes short lock holds of its own (CHUNK_SLOTS slots each).  `apply` runs once the restore's
entries are in (lock held): at the end of a foreground restore, or in the lock hold where a background fill
ends, after `prepare` matched the blob to the slots and built the ghost rings outside it (docs/design.md,
"Lock holds").  Entries put while the fill ran (their insert_seq is past the snapshot's seq) keep their
state and stay newer than every restored one in their queue; a restored entry read meanwhile keeps those
reads (its freq, its promotion).  A blob that is damaged, of another version or
of another policy is ignored, and the report says why: the restore stands, as without the blob.

Bytes (little-endian; docs/design.md, "Policy state")::

    0    4   magic b"CCPS"
    4    2   version (VERSION)
    6    2   policy: its index in policy_names.POLICY_IDS
    8    4   fields: how many entries the directory holds
    12   4   reserved, zero
    16   8   total: the blob's length in bytes, trailer included
    24   24 x fields  the directory: per field its name (8 bytes ASCII, NUL-padded), its numpy type
                      (8 bytes ASCII: "<u1", "<u4", "<u8" or "<f8", NUL-padded) and its count (u64)
    ...  the fields' values in directory order, each padded with zeros to a multiple of 8 bytes
    -8   8   xxh3_64 of every byte before it

FIELDS names every field a writer may put in; a reader ignores names it does not know, so a later
version may add fields without a new version number.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import xxhash

from .chains import build_chains
from .layout import SEALED
from .policy_names import POLICY_IDS
from .queues import AUTO_ADAPTIVE, AUTO_LOOP, MAX_FREQ

if TYPE_CHECKING:
    from .core import Core

MAGIC = b"CCPS"
VERSION = 1
HEAD = struct.Struct("<4sHHII Q")  # magic, version, policy, fields, reserved, total
ENTRY = struct.Struct("<8s8sQ")  # name, numpy type, count
TRAILER = struct.Struct("<Q")
TYPES = ("<u1", "<u4", "<u8", "<f8")
MAX_LFU_AGE = 63  # an age past it halves a count to zero, as the scores do (eviction.LFU)

# Every field a version 1 writer may put in: (name, numpy type, what it is).  Scalars have a count of 1.
FIELDS: dict[str, tuple[str, str]] = {
    "seq": ("<u8", "the pool's seq at capture: restored entries have insert_seq <= it"),
    "ops": ("<u8", "puts and hits counted (the LFU epoch advances every lfu_period of them)"),
    "lfuepoch": ("<u8", "the LFU epoch"),
    "hits": ("<u8", "the hits counter"),
    "hash": ("<u8", "per entry: its key's xxh3_64 (the key to every per-entry field)"),
    "lfuage": ("<u1", "per entry (lfu): LFU epochs since its last read, at most 63"),
    "queue": ("<u1", "per entry (queue policies): 0 or 1"),
    "freq": ("<u1", "per entry (queue policies): reads since it joined its queue, at most 3"),
    "qseq": ("<u8", "per entry (queue policies): its place in its queue (the queues' clock when it joined)"),
    "qclock": ("<u8", "the queues' clock (q_seq)"),
    "qtarget": ("<f8", "queue 0's target: ARC's p in entries, or the share of entries"),
    "qregime": ("<u4", "auto's regime (AUTO_ADAPTIVE, AUTO_LOOP)"),
    "qghost": ("<f8", "auto's ghost rate"),
    "qhitrate": ("<f8", "auto's hit rate"),
    "qhitseen": ("<u8", "the hits counter at auto's last put"),
    "ghosts0": ("<u8", "ring 0's window, oldest first: key hashes, 0 for a place forgotten"),
    "ghosts1": ("<u8", "ring 1's window, the same"),
}
PER_ENTRY = ("lfuage", "queue", "freq", "qseq")


class Ignored(Exception):
    """Why a blob is not applied (apply's report, never raised out of it)."""


# ---------------------------------------------------------------- capture


CHUNK_SLOTS = 1 << 16  # slots whose per-entry state one lock hold of capture copies (about 1 ms at 1M)


def capture(core: "Core") -> bytes:
    """The policy state of `core`'s pool as a blob, taken in short lock holds (not held by the caller).

    The per-entry columns are copied CHUNK_SLOTS slots per hold, like persist's listing (capture.py), so a
    writer waits a millisecond, not the whole copy (6-64 ms at 1,000,000 entries in one hold).  What keeps
    the blob exact where the pool stands still, and consistent where it does not:

    - an entry is in it only if it was put no later than the pool's seq at the first hold (the blob's
      "seq"): one put again meanwhile is newer, and apply gives it its own state, as a put during the fill;
    - the clocks, queue 0's target, auto's words and the ghost rings are read in the last hold, after every
      chunk: each copied qseq is at most that clock, each LFU epoch at most that epoch (ages are taken
      against it);
    - an entry copied, then evicted before the last hold, is a ghost in the rings read there: its row is
      dropped, so that no key is both an entry and a ghost of the blob (the rings' invariant).
    """
    policy = core.policy
    q = core.queues
    per_entry = policy == "lfu" or q is not None

    def first() -> tuple[int, int]:
        return int(core.fields.seq[0]), core.columns["state"].size

    seq, n_slots = core.locked(first)
    names = (["lfu_epoch"] if policy == "lfu" else []) + (["queue", "freq", "qseq"] if q is not None else [])
    parts: list[dict[str, np.ndarray]] = []
    if per_entry:
        for start in range(0, n_slots, CHUNK_SLOTS):
            parts.append(core.locked(_chunk, core, start, min(n_slots, start + CHUNK_SLOTS), seq, names))

    def last() -> tuple[dict[str, Any], list[np.ndarray]]:
        h = core.header[0]
        words = {name: h[col].item() for name, col in (("ops", "ops"), ("lfuepoch", "lfu_epoch"), ("hits", "hits"))}
        rings = []
        if q is not None:
            qh = q.header[0]
            words.update({name: qh[col].item() for name, col in (
                ("qclock", "q_seq"), ("qtarget", "q_target"), ("qregime", "q_regime"), ("qghost", "q_ghost_rate"),
                ("qhitrate", "q_hit_rate"), ("qhitseen", "q_hits_seen"))})
            rings = [_window(ring.hashes, int(qh[f"g{r}_head"]), int(qh[f"g{r}_tail"])) for r, ring in enumerate(q.ghosts)]
        return words, rings

    words, rings = core.locked(last)
    fields: list[tuple[str, np.ndarray]] = [(name, np.array([seq if name == "seq" else words[name]], FIELDS[name][0]))
                                            for name in ("seq", "ops", "lfuepoch", "hits")]
    if per_entry:
        cols = {name: np.concatenate([p[name] for p in parts]) for name in ["hash", *names]}
        if rings:  # copied, then evicted before the last hold: a ghost now, not an entry
            ghosts = np.sort(np.concatenate(rings))
            if ghosts.size and cols["hash"].size:
                at = np.minimum(np.searchsorted(ghosts, cols["hash"]), ghosts.size - 1)
                keep = ghosts[at] != cols["hash"]
                cols = {name: v[keep] for name, v in cols.items()}
        fields.append(("hash", cols["hash"]))
        if policy == "lfu":
            age = np.minimum(int(words["lfuepoch"]) - cols["lfu_epoch"].astype(np.int64), MAX_LFU_AGE)
            fields.append(("lfuage", np.maximum(age, 0)))
        if q is not None:
            fields += [("queue", cols["queue"]), ("freq", cols["freq"]), ("qseq", cols["qseq"])]
            fields += [(name, np.array([words[name]], FIELDS[name][0]))
                       for name in ("qclock", "qtarget", "qregime", "qghost", "qhitrate", "qhitseen")]
            fields += [(f"ghosts{r}", window) for r, window in enumerate(rings)]
    return _pack(POLICY_IDS.index(policy), fields)


def _chunk(core: "Core", start: int, stop: int, seq: int, names: list[str]) -> dict[str, np.ndarray]:
    """Lock held: the key hash and the per-entry policy columns `names` of the sealed slots in [start, stop)
    put no later than `seq`."""
    cols = core.columns
    sel = start + np.flatnonzero((cols["state"][start:stop] == SEALED) & (cols["insert_seq"][start:stop] <= np.uint64(seq)))
    out = {"hash": cols["key_hash"][sel]}
    for name in names:
        out[name] = (cols[name] if name == "lfu_epoch" else core.queues.cols[name])[sel]
    return out


def _window(hashes: np.ndarray, head: int, tail: int) -> np.ndarray:
    """A ring's ghosts from its oldest to its newest (place p holds sequence number s with s % n == p)."""
    n = hashes.size
    if not n or head <= tail:
        return np.zeros(0, np.uint64)
    seqs = np.arange(max(tail, head - n), head, dtype=np.uint64)
    out = hashes[(seqs % np.uint64(n)).astype(np.int64)]
    held = np.flatnonzero(out)
    return out[held[0]:] if held.size else out[:0]  # leading holes say nothing about any depth


def _pack(policy: int, fields: list[tuple[str, np.ndarray]]) -> bytes:
    directory, data = [], []
    for name, values in fields:
        kind = FIELDS[name][0]
        raw = np.ascontiguousarray(values, dtype=kind).tobytes()
        directory.append(ENTRY.pack(name.encode(), kind.encode(), len(values)))
        data.append(raw + bytes(-len(raw) % 8))
    body = b"".join(directory) + b"".join(data)
    total = HEAD.size + len(body) + TRAILER.size
    out = HEAD.pack(MAGIC, VERSION, policy, len(fields), 0, total) + body
    return out + TRAILER.pack(xxhash.xxh3_64_intdigest(out))


# ---------------------------------------------------------------- reading


def parse(blob: bytes) -> tuple[str, dict[str, np.ndarray]]:
    """(policy name, fields by name) of a blob; Ignored, saying why, if it is damaged or not one we read."""
    mv = memoryview(blob)
    if len(mv) < HEAD.size + TRAILER.size:
        raise Ignored(f"policy state of {len(mv)} bytes is too short")
    magic, version, policy, n_fields, _reserved, total = HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise Ignored("policy state has no CCPS magic")
    if total != len(mv) or xxhash.xxh3_64_intdigest(mv[:-TRAILER.size]) != TRAILER.unpack_from(mv, total - 8)[0]:
        raise Ignored("policy state fails its checksum")
    if version != VERSION:
        raise Ignored(f"policy state is version {version}; this cortex-cache reads version {VERSION}")
    if policy >= len(POLICY_IDS):
        raise Ignored(f"policy state names policy {policy}, which this cortex-cache does not know")
    pos = HEAD.size + n_fields * ENTRY.size
    if pos > total - TRAILER.size:
        raise Ignored("policy state's directory runs past its end")
    fields: dict[str, np.ndarray] = {}
    for k in range(n_fields):
        name_b, kind_b, count = ENTRY.unpack_from(mv, HEAD.size + k * ENTRY.size)
        kind = kind_b.rstrip(b"\0").decode("ascii", "replace")
        if kind not in TYPES:
            raise Ignored(f"policy state has a field of unknown type {kind!r}")
        size = count * np.dtype(kind).itemsize
        if pos + size > total - TRAILER.size:
            raise Ignored("policy state's fields run past its end")
        name = name_b.rstrip(b"\0").decode("ascii", "replace")
        if name in FIELDS and FIELDS[name][0] == kind:  # a field of another type is one we do not know
            fields[name] = np.frombuffer(mv, kind, count, pos)
        pos += size + (-size % 8)
    n = fields["hash"].size if "hash" in fields else 0
    for name in PER_ENTRY:
        if name in fields and fields[name].size != n:
            raise Ignored(f"policy state's {name} has {fields[name].size} values for {n} entries")
    return POLICY_IDS[policy], fields


def _scalar(fields: dict[str, np.ndarray], name: str, default: Any = None) -> Any:
    v = fields.get(name)
    if v is None or v.size != 1:
        if default is None:
            raise Ignored(f"policy state lacks its {name}")
        return default
    return v[0].item()


# ---------------------------------------------------------------- apply


class Prepared(NamedTuple):
    """apply's costly half, done before its lock hold (`prepare`): the blob parsed (or why it is ignored)
    and its entries matched to the pool's sealed slots as they were read without the lock."""

    parsed: tuple[str, dict[str, np.ndarray]] | str
    sealed: np.ndarray
    hashes: np.ndarray
    iseq: np.ndarray
    where: np.ndarray
    rows: np.ndarray
    rings: Any = None  # queue policies: (the rings' words and windows read, what _ring_arrays built of them)


def prepare(core: "Core", blob: bytes) -> Prepared:
    """Lock not held: parse `blob`, match its entries to the pool's sealed slots (two sorts of a million
    hashes: 0.2 s of apply's 0.3-0.4 s hold at 1,000,000 entries) and, for the queue policies, build the
    ghost rings with their hash chains (most of the rest).  The slots and rings are read without the lock,
    so apply checks in its hold that they are still what was read -- the same sealed slots, with the same
    key hashes and insert sequence numbers; the rings' words and windows -- and redoes there what moved: a
    put that raced the end of the fill costs the hold its old length, never a wrong state."""
    empty = np.zeros(0, np.int64)
    try:
        parsed: tuple[str, dict[str, np.ndarray]] | str = parse(blob)
    except Ignored as e:
        return Prepared(str(e), empty, empty, empty, empty, empty)
    if "hash" not in parsed[1]:  # no per-entry state (lru, fifo, ...): nothing to match
        return Prepared(parsed, empty, empty, empty, empty, empty)
    cols = core.columns
    sealed = np.flatnonzero(cols["state"] == SEALED)
    hashes, iseq = cols["key_hash"][sealed], cols["insert_seq"][sealed]  # copies
    fields = parsed[1]
    where, rows = _match(hashes, fields["hash"])
    rings = None
    q = core.queues
    if q is not None and parsed[0] == core.policy and "seq" in fields and fields["seq"].size == 1:
        # The ghost rings too (their hash chains: most of what is left of the hold), from the entries put
        # while the fill ran -- those the blob does not give a state -- and the rings read now.
        restored = np.zeros(sealed.size, bool)
        restored[where[iseq[where] <= fields["seq"][0]]] = True
        later = _later(q)
        rings = (later, _ring_arrays(q, fields, hashes[~restored], [w for _, w in later]))
    return Prepared(parsed, sealed, hashes, iseq, where, rows, rings)


def apply(core: "Core", blob: bytes, prepared: Prepared | None = None) -> dict[str, Any]:
    """Lay the policy state `blob` (capture's) over `core`'s restored entries (lock held); `prepared`:
    `prepare(core, blob)`'s, done before the hold (what it matched is checked here, and redone if stale).

    Returns a report: "applied" (bool), "entries" (restored entries given their state), "ghosts" (ghosts
    remembered again) and "note": None, or why the blob was ignored (damaged, another version or
    policy, values out of range): then nothing was changed, and the pool stays as the restore left it."""
    try:
        parsed = parse(blob) if prepared is None else prepared.parsed
        if isinstance(parsed, str):
            raise Ignored(parsed)
        policy, fields = parsed
        if policy != core.policy:
            raise Ignored(f"policy state is {policy}'s, and the pool's policy is {core.policy}")
        plan = _plan(core, fields, prepared)
    except Ignored as e:
        return {"applied": False, "entries": 0, "ghosts": 0, "note": str(e)}
    return {"applied": True, **_write(core, fields, plan), "note": None}


def _plan(core: "Core", fields: dict[str, np.ndarray], prepared: Prepared | None = None) -> dict[str, Any]:
    """Everything apply checks before it changes anything: matched slots and their rows, scalars in range."""
    cols = core.columns
    sealed = np.flatnonzero(cols["state"] == SEALED)
    seq = _scalar(fields, "seq")
    plan: dict[str, Any] = {"seq": seq, "ops": _scalar(fields, "ops"), "epoch": _scalar(fields, "lfuepoch"),
                            "hits": _scalar(fields, "hits")}
    if prepared is not None and "hash" in fields and np.array_equal(sealed, prepared.sealed) and \
            np.array_equal(cols["key_hash"][sealed], prepared.hashes) and \
            np.array_equal(cols["insert_seq"][sealed], prepared.iseq):
        where, rows = prepared.where, prepared.rows  # the slots matched are still those
        plan["rings"] = prepared.rings  # (checked against the rings themselves where they are laid)
    else:
        where, rows = _match(cols["key_hash"][sealed], fields.get("hash", np.zeros(0, np.uint64)))
    restored = cols["insert_seq"][sealed[where]] <= np.uint64(seq)  # not put again while the fill ran
    where, rows = where[restored], rows[restored]
    others = np.ones(sealed.size, bool)
    others[where] = False
    # others: entries put while the fill ran, and any the blob does not know (they keep their own state)
    plan.update(sealed=sealed, slots=sealed[where], rows=rows, others=sealed[others])
    q = core.queues
    if q is None:
        if core.policy == "lfu" and "lfuage" not in fields:
            raise Ignored("policy state lacks lfu's ages")
        return plan
    for name in ("queue", "freq", "qseq"):
        if name not in fields:
            raise Ignored(f"policy state lacks its {name}")
    if (fields["queue"] > 1).any() or (fields["freq"] > MAX_FREQ).any():
        raise Ignored("policy state has an entry in no queue, or read more often than counted")
    target = _scalar(fields, "qtarget")
    limit = float(cols["state"].size) if q.arc else 1.0
    regime = _scalar(fields, "qregime", AUTO_ADAPTIVE)
    rates = (_scalar(fields, "qghost", 0.0), _scalar(fields, "qhitrate", 0.0))
    if not (0.0 <= target <= limit and regime in (AUTO_ADAPTIVE, AUTO_LOOP) and 0.0 <= rates[0] <= 1.0
            and 0.0 <= rates[1] < float("inf")):
        raise Ignored("policy state's queue target, regime or rates are out of range")
    if not q.auto and (regime or rates != (0.0, 0.0)):
        raise Ignored("policy state has auto's regime for a pool that is not auto's")
    plan.update(qclock=_scalar(fields, "qclock"), target=target, regime=regime, rates=rates,
                hitseen=_scalar(fields, "qhitseen", plan["hits"]))
    return plan


def _match(slot_hashes: np.ndarray, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions in slot_hashes, rows of hashes) of the pairs with the same hash, each hash once on each
    side (two keys of one hash are left as the restore made them: which state is whose cannot be told).
    Both sides sorted first: the search then walks memory in order (at 1,000,000 entries, 4x faster)."""
    if not hashes.size or not slot_hashes.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ob = np.argsort(hashes, kind="stable")
    sb = hashes[ob]
    osl = np.argsort(slot_hashes, kind="stable")
    ss = slot_hashes[osl]
    pos = np.minimum(np.searchsorted(sb, ss), sb.size - 1)
    found = (sb[pos] == ss) & _once(ss) & _once(sb)[pos]
    return osl[found], ob[pos[found]]


def _once(sorted_values: np.ndarray) -> np.ndarray:
    """Which of the sorted values occur once."""
    out = np.ones(sorted_values.size, bool)
    same = sorted_values[1:] == sorted_values[:-1]
    out[1:] &= ~same
    out[:-1] &= ~same
    return out


def _write(core: "Core", fields: dict[str, np.ndarray], plan: dict[str, Any]) -> dict[str, int]:
    cols, h = core.columns, core.header[0]
    slots, rows = plan["slots"], plan["rows"]
    # The clocks: the LFU epoch goes on from the snapshot's; an entry not given its age keeps its own.
    epoch = plan["epoch"]
    if core.policy == "lfu":  # (the column means nothing to the other policies)
        others = plan["others"]
        age = int(h["lfu_epoch"]) - cols["lfu_epoch"][others].astype(np.int64)
        cols["lfu_epoch"][others] = np.maximum(epoch - np.maximum(age, 0), 0).astype(np.uint64)
        cols["lfu_epoch"][slots] = np.maximum(epoch - fields["lfuage"][rows].astype(np.int64), 0).astype(np.uint64)
    h["ops"] = plan["ops"]
    h["lfu_epoch"] = epoch
    if int(h["seq"]) < plan["seq"]:
        h["seq"] = plan["seq"]
    ghosts = 0
    if core.queues is not None:
        ghosts = _write_queues(core, fields, plan)
    core.victims.invalidate()  # every order just changed behind the lists' backs
    return {"entries": int(slots.size), "ghosts": ghosts}


def _write_queues(core: "Core", fields: dict[str, np.ndarray], plan: dict[str, Any]) -> int:
    q = core.queues
    cols, qcols, qh = core.columns, q.cols, q.header[0]
    slots, rows = plan["slots"], plan["rows"]
    queue, freq, qseq = qcols["queue"], qcols["freq"], qcols["qseq"]
    # Entries put while the fill ran, and any this blob does not know, join after every restored one, in
    # the order they joined (their qseq is the fill's clock).
    others = plan["others"]
    others = others[np.argsort(qseq[others], kind="stable")]
    qseq[others] = plan["qclock"] + 1 + np.arange(others.size, dtype=np.uint64)
    qh["q_seq"] = plan["qclock"] + others.size
    # A restored entry read while the fill ran keeps those reads (and the promotion one may have earned).
    read = cols["access_seq"][slots] > np.uint64(plan["seq"])
    queue[slots] = np.where(read, np.maximum(queue[slots], fields["queue"][rows]), fields["queue"][rows])
    freq[slots] = np.where(read, np.minimum(freq[slots] + fields["freq"][rows], MAX_FREQ), fields["freq"][rows])
    qseq[slots] = fields["qseq"][rows]
    sealed = plan["sealed"]
    n1 = int(np.count_nonzero(queue[sealed] == 1))
    qh["q_count0"], qh["q_count1"] = sealed.size - n1, n1
    qh["q_target"] = plan["target"]
    qh["q_regime"] = plan["regime"]
    qh["q_ghost_rate"], qh["q_hit_rate"] = plan["rates"]
    # Hits since auto's last put: the snapshot's, and those served since the fill's last put.
    hits_now = int(core.header[0]["hits"])
    since = max(0, hits_now - max(int(qh["q_hits_seen"]), plan["hits"]))
    fresh = max(0, plan["hits"] - plan["hitseen"]) + since
    qh["q_hits_seen"] = max(0, hits_now - fresh)
    # The rings, from the blob's and what the fill's own rings took meanwhile: built by prepare before the
    # hold if nothing moved since (the same slots matched, the rings' words and windows the same), else here.
    later = _later(q)
    ready = plan.get("rings")
    if ready is None or any(a[0] != b[0] or not np.array_equal(a[1], b[1]) for a, b in zip(ready[0], later)):
        ready = (later, _ring_arrays(q, fields, cols["key_hash"][others], [w for _, w in later]))
    total = 0
    for r, (ring, built) in enumerate(zip(q.ghosts, ready[1])):
        if built is None:
            continue
        hashes, buckets, nxt, size = built
        ring.hashes[:] = hashes
        ring.buckets_arr[:] = buckets
        ring.nxt_arr[:] = nxt
        qh[f"g{r}_head"], qh[f"g{r}_tail"], qh[f"g{r}_live"] = size, 0, int(np.count_nonzero(hashes))
        total += int(qh[f"g{r}_live"])
    return total


def _later(q: Any) -> list[tuple[tuple[int, int], np.ndarray]]:
    """Each ring's (head, tail) and window (_window): what the fill's own rings hold now."""
    qh = q.header[0]
    out = []
    for r, ring in enumerate(q.ghosts):
        head, tail = int(qh[f"g{r}_head"]), int(qh[f"g{r}_tail"])
        out.append(((head, tail), _window(ring.hashes, head, tail)))
    return out


def _ring_arrays(q: Any, fields: dict[str, np.ndarray], in_pool: np.ndarray, later: list[np.ndarray]) -> list[Any]:
    """Per ring, what it becomes (None: a ring of no places): (its places, bucket heads, links, window size),
    built aside, as Ghosts.repair would build them from the window laid at places 0...

    A ghost of the blob whose key is in the pool again (`in_pool`: put while the fill ran) or was lost
    again since (in `later`, a window of the fill's own rings: newer) is forgotten there: its place becomes
    a hole, so every other ghost keeps its depth.  (The blob's rings, like every ring, hold each key once
    and no key in the pool.)"""
    gone = np.sort(np.concatenate([in_pool, *later]))
    out: list[Any] = []
    for r, ring in enumerate(q.ghosts):
        if not ring.n:
            out.append(None)
            continue
        window = fields.get(f"ghosts{r}", np.zeros(0, np.uint64)).copy()
        if gone.size and window.size:
            pos = np.minimum(np.searchsorted(gone, window), gone.size - 1)
            window[gone[pos] == window] = 0
        window = np.concatenate([window, later[r]])[-ring.n:]
        hashes = np.zeros(ring.n, ring.hashes.dtype)
        hashes[: window.size] = window
        members = np.flatnonzero(hashes)
        buckets, nxt = build_chains(members, hashes[members], ring.buckets_arr.size - 1, ring.buckets_arr.size,
                                    ring.n, np.empty(0, np.int64))
        out.append((hashes, buckets, nxt, window.size))
    return out


__all__ = ["capture", "prepare", "Prepared", "apply", "parse", "Ignored", "FIELDS", "MAGIC", "VERSION", "CHUNK_SLOTS"]
