"""Parse and format byte sizes (util-linux convention).

`K/M/G/T` and `KiB/MiB/GiB/TiB` are powers of 1024, `KB/MB/GB/TB` powers of
1000; case-insensitive; a bare number is bytes; fractions allowed (`1.5G`).
"""

from __future__ import annotations

import re

from .errors import InvalidSize

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Return the number of bytes `text` names; raise InvalidSize otherwise.

    Fractional results are rounded down to whole bytes; a size that rounds to
    zero is refused like zero itself.
    """
    if isinstance(text, bool):
        raise InvalidSize(f"invalid size {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise InvalidSize(f"invalid size {text}: must be positive")
        return text
    m = _SIZE_RE.match(str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise InvalidSize(
            f"invalid size {text!r}: use a number with an optional unit "
            "(K, M, G, T, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        )
    number, unit = m.groups()
    # Integer arithmetic where possible so "16G" is exact, never a float.
    if "." in number:
        whole, _, frac = number.partition(".")
        value = (int(whole or "0") * 10 ** len(frac) + int(frac or "0")) * _UNITS[unit] // 10 ** len(frac)
    else:
        value = int(number) * _UNITS[unit]
    if value <= 0:
        raise InvalidSize(f"invalid size {text!r}: must be at least one byte")
    return value


def format_size(nbytes: int | float) -> str:
    """Human-readable binary size: `16.0GiB`, `512B`."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)}B" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"  # pragma: no cover - loop always returns


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plural(n: int, one: str, many: str) -> str:
    """A count in words: plural(1, "entry", "entries") is "1 entry", plural(2, ...) "2 entries"."""
    return f"{n} {one if n == 1 else many}"


def entries(n: int, what: str = "entries") -> str:
    """"1 entry", "2 entries", "1 expired entry": a count of entries in words."""
    return plural(n, what[:-3] + "y", what)


__all__ = ["parse_size", "format_size", "ceil_div", "plural", "entries"]

