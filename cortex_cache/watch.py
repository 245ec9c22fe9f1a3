"""Interval rates of a pool's counters, for `cortex cache status NAME --watch`.

Like `redis-cli --stat` or `vmstat 1`: every interval, what happened in it
(puts/s, gets/s, the interval's hit ratio, evictions/s, disk spills and
promotions/s, disk and remote bytes/s).  The clock and the sleep are injected,
so tests run intervals without waiting.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from .pool import Pool


def _counters(st: dict[str, Any]) -> dict[str, int]:
    d, r = st.get("disk") or {}, st.get("remote") or {}
    return {
        "puts": st["puts"], "hits": st["hits"], "misses": st["misses"], "evictions": st["evictions"],
        "expirations": st["expirations"],
        "spills": d.get("spills", 0), "promotions": d.get("promotions", 0) + r.get("promotions", 0),
        "disk_bytes_written": d.get("bytes_written", 0), "disk_bytes_read": d.get("bytes_read", 0),
        "remote_bytes_written": r.get("bytes_written", 0), "remote_bytes_read": r.get("bytes_read", 0),
    }


def rates(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """What happened between two `stats()` taken `seconds` apart, per second (and the interval's hit ratio)."""
    a, b = _counters(before), _counters(after)
    d = {k: max(0, b[k] - a[k]) for k in a}
    per = 1.0 / seconds if seconds > 0 else 0.0
    gets = d["hits"] + d["misses"]
    return {
        "seconds": round(seconds, 3),
        "puts_per_s": d["puts"] * per,
        "gets_per_s": gets * per,
        "hit_ratio": d["hits"] / gets if gets else None,
        "evictions_per_s": d["evictions"] * per,
        "expirations_per_s": d["expirations"] * per,
        "spills_per_s": d["spills"] * per,
        "promotions_per_s": d["promotions"] * per,
        "disk_write_bytes_per_s": d["disk_bytes_written"] * per,
        "disk_read_bytes_per_s": d["disk_bytes_read"] * per,
        "remote_write_bytes_per_s": d["remote_bytes_written"] * per,
        "remote_read_bytes_per_s": d["remote_bytes_read"] * per,
        "entries": after["entries"],
        "used_bytes": after["used_bytes"],
    }


def watch(
    sample: "Callable[[], dict[str, Any]] | Pool",
    interval: float,
    count: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[dict[str, Any]]:
    """Yield `rates()` of each interval, `count` times (forever with None).

    `sample` gives the pool's `stats()`: a pool handle, or a function (the CLI's opens the pool by name
    for each sample, so a watch between samples holds no mapping: `delete` does not count it as a user,
    and a pool replaced under the name is followed)."""
    take = sample.stats if hasattr(sample, "stats") else sample
    before, t0 = take(), clock()
    n = 0
    while count is None or n < count:
        sleep(interval)
        after, t1 = take(), clock()
        yield rates(before, after, t1 - t0)
        before, t0 = after, t1
        n += 1


__all__ = ["rates", "watch"]
