"""Names of the eviction policies, in the order of their ids in the segment, and how `--help` lists them.

Kept free of numpy so the CLI can offer `--policy` choices without loading
it; the implementations are in eviction.py, which checks it covers exactly
these names.  Append only: a segment stores a policy as its index here.
"""

import textwrap

POLICY_HELP: dict[str, str] = {
    "lru": "least recently read or written first",
    "lfu": "fewest accesses first; counts halve every aging epoch",
    "fifo": "oldest insert first",
    "priority": "lowest priority first, least recent among equals",
    "ttl": "soonest to expire first; entries without a TTL last",
    "size": "largest value first",
    "s3fifo": "S3-FIFO: new entries in a small FIFO, those read again kept in a main one; for small caches",
    "arc": "ARC: recency and frequency, balanced by what each recently lost; steady at every size",
    "auto": "adaptive: S3-FIFO's queues, learning online from the keys that come back whether the workload "
            "favours frequency, recency or a loop, and evicting as suits it",
}
POLICY_IDS: list[str] = list(POLICY_HELP)
DEFAULT_POLICY = "auto"
# The line `create --help` gives someone who does not know which to choose.  It names the default and
# why, with the figures in docs/performance.md ("Eviction policies"): change it with DEFAULT_POLICY.
IF_UNSURE = (
    f"If unsure: {DEFAULT_POLICY}, the default: within 0.01 of the best of lru, s3fifo and arc on every "
    "workload measured, KV-cache traces, loops and scans included (docs/performance.md, \"Eviction policies\"); "
    "lru where an exact, predictable recency order matters more than hits."
)


def policy_list(width: int = 76) -> str:
    """The policies as `--help` shows them: a heading, then one policy a line (its description wrapped under
    itself), the default marked.  Starts with click's \\b, which keeps the lines as they are."""
    name_width = max(map(len, POLICY_IDS)) + 2
    lines = ["\b", "Policies (--policy, in any case):"]
    for name, what in POLICY_HELP.items():
        if name == DEFAULT_POLICY:
            what += " (the default)"
        wrapped = textwrap.wrap(what, width - 2 - name_width)
        lines.append(f"  {name:<{name_width}}{wrapped[0]}")
        lines += [" " * (2 + name_width) + more for more in wrapped[1:]]
    return "\n".join(lines)


__all__ = ["POLICY_HELP", "POLICY_IDS", "DEFAULT_POLICY", "IF_UNSURE", "policy_list"]
