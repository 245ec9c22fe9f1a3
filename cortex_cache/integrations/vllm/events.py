"""The pool's blocks as vLLM KV cache events, for routers that send a request where its prefix is.

vLLM publishes KV cache events (`--kv-events-config`: blocks stored and
removed, by vLLM's own block hashes) and lets a connector add its own
through `take_events`, which its scheduler calls once a step.  `PoolEvents`
is the connector's scheduler side of that:

- **Stored.** The blocks this engine asked its workers to save
  (`planned`) are reported once every rank's copy is in the pool -- checked
  at the next steps with one index probe a rank (no value read) -- as
  `BlockStored` with vLLM's own block hashes, the blocks' token ids, the
  parent's hash, `medium` "CPU" (host memory) and `ownership`
  "cortex:<pool>".  A save that never lands (a full pool) is dropped
  unreported after `PENDING_S`.
- **Removed.** A block reported stored may leave the pool by any process's
  doing (eviction, `evict`, `delete`, `restore --replace`, another engine's
  reset).  When the pool's `gone_seq` (bumped whenever an entry leaves
  memory, in any process) has moved, or the pool under the name is another
  or none, the blocks reported are probed again (at most every
  `probe_every` seconds, one index probe a rank), and those gone on any
  rank are reported as `BlockRemoved`.  At most `limit` blocks are followed,
  the oldest let go first (silently: a router may keep one of those longer
  than the pool does; it is then a miss, never a wrong answer).

A hybrid model (several KV cache groups, groups.py): one pool value holds
every group's block of a position, so a block stored or removed is so for
every group at once.  vLLM's own publisher reports a hybrid model's blocks
once per group (its BlockPool caches each group's blocks under the group's
index, and KVCacheManager.take_events annotates each with the group's
attention kind and window); a router that follows groups -- and needs a
windowed group's blocks too before it counts a prefix as held -- reads ours
the same way: each event is made once per group, with that group's
`group_idx`, `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` (as
vLLM annotates its own; a model of one group gets one event, group 0).

Nothing here raises into vLLM: a pool that breaks makes no events.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...layout import H_GONE_SEQ

if TYPE_CHECKING:  # pragma: no cover
    from .blocks import BlockStore, Faults, PoolRef

PENDING_S = 60.0  # a planned save not in the pool after this long is dropped unreported
MEDIUM = "CPU"  # vLLM's medium for host memory (vllm.distributed.kv_events.MEDIUM_CPU)


@dataclass
class _Block:
    """A block whose save was planned: what its BlockStored says."""

    digest: bytes
    hash: Any  # vLLM's block hash, in its external form
    parent: Any  # the hash of the block before it, or None
    tokens: list[int]
    lora: tuple[int | None, str | None]
    since: float


class PoolEvents:
    """What the scheduler's connector reports through `take_events` (see the module doc)."""

    def __init__(self, pool: "PoolRef", stores: "Sequence[BlockStore]", faults: "Faults", block_tokens: int,
                 ownership: str, limit: int = 16384, probe_every: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 groups: "Sequence[tuple[str | None, int | None]]" = ((None, None),)) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored_cls, self._removed_cls, self._external = BlockStored, BlockRemoved, maybe_convert_block_hash
        self._pool, self._stores, self._faults = pool, list(stores), faults
        self._bs, self.ownership, self._limit = block_tokens, ownership, limit
        self._probe_every, self._clock = probe_every, clock
        self._groups = list(groups) or [(None, None)]  # per KV cache group: its kind and window, as vLLM says them
        self._pending: deque[_Block] = deque()
        self._reported: OrderedDict[bytes, Any] = OrderedDict()  # digest -> vLLM's hash, oldest first
        self._seen: tuple[int, int] | None = None  # (id of the pool handle, its gone_seq) at the last probe
        self._next_probe = 0.0

    def planned(self, digests: Sequence[bytes], block_hashes: Sequence[Any], first: int, tokens: Sequence[int],
                lora_id: int | None = None, lora_name: str | None = None) -> None:
        """Saves of blocks `first`, `first + 1`, ... of a request were planned (`digests` theirs, `block_hashes`
        and `tokens` the request's whole)."""
        ext, bs, now = self._external, self._bs, self._clock()
        parent = ext(block_hashes[first - 1]) if 0 < first <= len(block_hashes) else None
        # vLLM hashes blocks only with its prefix cache on: without, there is nothing a router could match.
        for i, d in enumerate(digests[: max(0, len(block_hashes) - first)]):
            h = ext(block_hashes[first + i])
            self._pending.append(_Block(d, h, parent, list(tokens[(first + i) * bs : (first + i + 1) * bs]),
                                        (lora_id, lora_name), now))
            parent = h

    def take(self) -> list:
        """This step's events: blocks now stored, blocks now gone."""
        try:
            with self._pool.use() as pool:
                events = self._confirm(pool) if self._pending else []
                return events + self._removed(pool)
        except Exception as e:  # no events rather than an error in vLLM's scheduler
            self._faults.fault("error", e)
            return []

    def _held(self, pool: Any, digests: Sequence[bytes]) -> list[bool]:
        """Does every rank's copy of each block live in the pool?  One index probe a rank."""
        held = [True] * len(digests)
        for store in self._stores:
            for i, h in enumerate(pool.contains_many([store.key(d) for d in digests])):
                held[i] = held[i] and h
        return held

    def _confirm(self, pool: Any) -> list:
        """BlockStored for the planned blocks now in the pool on every rank: one event per chain of them."""
        if pool is None:
            return []
        blocks = list(self._pending)
        self._pending.clear()
        events: list = []
        run: list[_Block] = []
        now = self._clock()
        for b, held in zip(blocks, self._held(pool, [b.digest for b in blocks])):
            if not held:
                if now - b.since < PENDING_S:
                    self._pending.append(b)  # its save is still in flight: looked at again next step
                continue
            if run and (b.parent != run[-1].hash or b.lora != run[-1].lora):
                events += self._stored(run)
                run = []
            run.append(b)
        if run:
            events += self._stored(run)
        return events

    def _stored(self, run: "list[_Block]") -> list:
        for b in run:
            self._reported[b.digest] = b.hash
            self._reported.move_to_end(b.digest)
        while len(self._reported) > self._limit:
            self._reported.popitem(last=False)
        lora_id, lora_name = run[0].lora
        return [self._stored_cls(block_hashes=[b.hash for b in run], parent_block_hash=run[0].parent,
                                 token_ids=[t for b in run for t in b.tokens], block_size=self._bs, lora_id=lora_id,
                                 medium=MEDIUM, lora_name=lora_name, group_idx=g, kv_cache_spec_kind=kind,
                                 kv_cache_spec_sliding_window=window, ownership=self.ownership)
                for g, (kind, window) in enumerate(self._groups)]

    def _removed(self, pool: Any) -> list:
        if not self._reported:
            return []
        if pool is None:
            gone = list(self._reported)  # no pool under the name: none of them is there
        else:
            seen = (id(pool), int(pool.core.counters[H_GONE_SEQ]))
            if self._seen is None:  # the first blocks reported were found in the pool just now
                self._seen = seen
                return []
            now = self._clock()
            if seen == self._seen or now < self._next_probe:
                return []
            self._next_probe = now + self._probe_every
            self._seen = seen  # read before the probe: a removal during it is probed again
            digests = list(self._reported)
            gone = [d for d, ok in zip(digests, self._held(pool, digests)) if not ok]
        if not gone:
            return []
        hashes = [self._reported.pop(d) for d in gone]
        return [self._removed_cls(block_hashes=hashes, medium=MEDIUM, group_idx=g, ownership=self.ownership)
                for g in range(len(self._groups))]


__all__ = ["PoolEvents", "MEDIUM", "PENDING_S"]
