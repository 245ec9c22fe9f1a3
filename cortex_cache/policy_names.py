"""Names of the eviction policies, in the order of their ids in the segment.

Kept free of numpy so the CLI can offer `--policy` choices without loading
it; the implementations are in eviction.py, which checks it covers exactly
these names.  Append only: a segment stores a policy as its index here.
"""

POLICY_HELP: dict[str, str] = {
    "lru": "least recently read or written first",
    "lfu": "fewest accesses first; counts halve every aging epoch",
    "fifo": "oldest insert first",
    "priority": "lowest priority first, least recent among equals",
    "ttl": "soonest to expire first; entries without a TTL last",
    "size": "largest value first",
    "s3fifo": "S3-FIFO: new entries in a small FIFO, those read again kept in a main one; for small caches",
    "arc": "ARC: recency and frequency, balanced by what each recently lost; steady at every size",
    "auto": "S3-FIFO with ARC's adaptation and a longer memory: hits best on KV-cache traces",
}
POLICY_IDS: list[str] = list(POLICY_HELP)
DEFAULT_POLICY = "auto"
