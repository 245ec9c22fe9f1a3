"""Hybrid models: KV cache groups of several attention kinds, as one pool value per block position.

vLLM's hybrid KV cache manager (HMA) splits a model whose layers attend
differently -- full attention in some, a sliding window or chunked local
attention in others -- into KV cache groups, each with a block table of
its own: position i of a request's prompt is block `ids[g][i]` in group g.
A group with a window frees the blocks that leave it, and puts vLLM's null
block (id 0) in their place; full attention keeps every block.

The connector keeps one chain of keys per request, as for a model of one
group, and a block position's value holds every group's layers of that
position, group after group (`PagedGroups`): the engine computes every
group's blocks of the positions a step completes, so a save finds them all
there.  A load writes each group's blocks of the positions it is given and
skips those vLLM left null (outside a window: the engine will not read
them).  So a hit needs one key a position, as before, and the pool holds a
windowed group's old positions too (what a longer hit may need).

Positions travel as tuples of block ids, one per group (`positions`); a
model of one group keeps plain ids, and its values and keys are unchanged.

What cannot be served that way is refused at start with one line
(`check_groups`): groups of another kind than attention over blocks (mamba
state, cross-attention, a circular buffer, ...), groups vLLM marks as not
transferable, and groups of different block sizes (positions would not
line up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ...errors import UsageError
from .blocks import HEADER_SIZE

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

    from .blocks import PagedLayers

# vLLM's null block: the BlockPool hands out block 0 to no request, and puts it where a window freed a block.
NULL_BLOCK = 0
# The KV cache specs a hybrid model may combine: attention whose blocks hold the tokens of their position.
# A windowed kind frees old positions (null in its table); none of them reuses a block for another position.
HYBRID_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "SlidingWindowMLASpec",
                "ChunkedLocalAttentionSpec")


def check_groups(groups: Sequence[Any], block_tokens: int) -> None:
    """Refuse, with one line, a layout of several groups the connector cannot serve (see the module doc)."""
    if len(groups) < 2:
        return
    for i, g in enumerate(groups):
        kind = type(g.kv_cache_spec).__name__
        if kind not in HYBRID_SPECS:
            raise UsageError(f"CortexConnector cannot serve this hybrid model: its KV cache group {i} is {kind} "
                             f"(not attention over blocks: it serves {', '.join(HYBRID_SPECS)}); "
                             "run this model without the connector")
        if not getattr(g, "enable_kv_transfer", True) or getattr(g, "host_resident", False):
            raise UsageError(f"CortexConnector cannot serve this hybrid model: its KV cache group {i} is not "
                             "transferable KV (vLLM rebuilds it, or keeps it in host memory of its own); "
                             "run it without the connector")
        size = int(getattr(g.kv_cache_spec, "block_size", block_tokens))
        if size != block_tokens:
            raise UsageError(f"CortexConnector cannot serve this hybrid model: its KV cache group {i} has blocks of "
                             f"{size} tokens and the engine's are {block_tokens}; run it without the connector")


def describe(spec: Any) -> str:
    """What makes a group's blocks differ from another's of the same shape: its kind and window."""
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    return type(spec).__name__ + (f"/{window}" if window else "")


def positions(block_ids: Sequence[Sequence[int]] | None, groups: int) -> list:
    """A request's block ids as the connector keeps them: group 0's ids for a model of one group, else one
    tuple of every group's id per position.  None when the groups' tables do not line up (then the request
    is neither loaded nor saved)."""
    if not block_ids:
        return []
    if groups == 1:
        return list(block_ids[0])
    if len(block_ids) != groups or len({len(ids) for ids in block_ids}) != 1:
        return None  # type: ignore[return-value]
    return list(zip(*block_ids))


def block_numbers(ids: Sequence[Any]) -> set[int]:
    """The engine's block ids in `ids` (plain ids, or positions of a hybrid model), less the null block."""
    out: set[int] = set()
    for b in ids:
        out.update(b) if isinstance(b, tuple) else out.add(b)
    out.discard(NULL_BLOCK)
    return out


def has_null(position: Any) -> bool:
    return isinstance(position, tuple) and NULL_BLOCK in position


class PagedGroups:
    """The paged KV caches of a hybrid model's groups (blocks.PagedLayers each) as one row per position:
    group 0's layers, then group 1's, ...  Block ids are positions (tuples of one id per group).  The same
    calls as PagedLayers, for the connector's loads and saves."""

    def __init__(self, groups: "Sequence[PagedLayers]") -> None:
        self.groups = list(groups)
        first = self.groups[0]
        self.dtype, self.device = first.dtype, first.device
        self.offsets, off = [], 0
        for p in self.groups:
            self.offsets.append(off)
            off += p.payload_bytes
        self.payload_bytes = off
        self.shape = "|".join(p.shape for p in self.groups)

    def host_layers(self) -> "list[np.ndarray] | None":
        out: list = []
        for p in self.groups:
            layers = p.host_layers()
            if layers is None:
                return None
            out += layers
        return out

    def gather_host(self, block_ids: Sequence[tuple[int, ...]], rows: "np.ndarray", offset: int = HEADER_SIZE) -> bool:
        return all(p.gather_host([ids[g] for ids in block_ids], rows, offset + off)
                   for g, (p, off) in enumerate(zip(self.groups, self.offsets)))

    def gather(self, block_ids: Sequence[tuple[int, ...]], rows: "torch.Tensor", offset: int = HEADER_SIZE) -> None:
        for g, (p, off) in enumerate(zip(self.groups, self.offsets)):
            p.gather([ids[g] for ids in block_ids], rows, offset + off)

    def layer_parts(self) -> "list[tuple[PagedLayers, int, int, int | None]]":
        """Every group's layers in the order of a position's row (as PagedLayers.layer_parts), with its group."""
        return [(p, i, off + a, g) for g, (p, off) in enumerate(zip(self.groups, self.offsets))
                for _, i, a, _ in p.layer_parts()]

    def scatter(self, block_ids: Sequence[tuple[int, ...]], data: "torch.Tensor") -> None:
        """Write each group's part of `data`'s rows into its blocks, but none into the null block."""
        for g, (p, off) in enumerate(zip(self.groups, self.offsets)):
            rows = [i for i, ids in enumerate(block_ids) if ids[g] != NULL_BLOCK]
            if not rows:
                continue
            part = data[:, off : off + p.payload_bytes]
            if len(rows) < len(block_ids):
                part = part[rows]  # a windowed group's positions outside the window: not written
            p.scatter([block_ids[i][g] for i in rows], part)


__all__ = ["PagedGroups", "check_groups", "describe", "positions", "block_numbers", "has_null", "NULL_BLOCK",
           "HYBRID_SPECS"]
