"""Copy threads for the engine adapters: a batch's copies cut into one share per thread.

A batch of 32 values handed to a thread pool one value at a time pays 32
hand-offs (a future, a queue, a wake-up each: tens of microseconds apiece in
CPython); cut into one contiguous share per thread it pays one per thread,
and the calling thread copies its own share instead of waiting.  Copies and
checksums (numpy, xxhash) release the GIL, so the shares run in parallel.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence


class Copiers:
    """The calling thread and `workers - 1` helper threads, copying a batch's values in parallel."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self._helpers = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix=name) if workers > 1 else None

    def map(self, fn: Callable[[Any, Any], Any], items: Sequence[Any], args: Sequence[Any]) -> list:
        """[fn(item, arg) for each pair], in `workers` shares; an error is raised only once every share has
        finished (a share still copying must never outlive the pins and reservations of its batch)."""
        n = len(items)
        shares = min(self.workers, n)
        if self._helpers is None or shares < 2:
            return [fn(a, b) for a, b in zip(items, args)]
        cut = [n * s // shares for s in range(shares + 1)]

        def share(s: int) -> list:
            return [fn(items[i], args[i]) for i in range(cut[s], cut[s + 1])]

        futures = [self._helpers.submit(share, s) for s in range(1, shares)]
        try:
            out = share(0)
        finally:
            for f in futures:  # wait for all, whatever happened here
                f.exception()
        for f in futures:
            out.extend(f.result())
        return out

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown()


__all__ = ["Copiers"]
