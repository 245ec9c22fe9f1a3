"""Size parsing: util-linux convention, exact integers, clean errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cortex_cache import InvalidSize, parse_size
from cortex_cache.units import format_size

BINARY = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("16G", 16 << 30), ("16g", 16 << 30), ("16GiB", 16 << 30), ("16gib", 16 << 30), ("16GB", 16 * 10**9),
        ("1.5G", 3 << 29), ("512", 512), ("512B", 512), (" 4 K ", 4096), ("0.5K", 512), (".5K", 512),
        ("1T", 1 << 40), ("2TB", 2 * 10**12), ("1MiB", 1 << 20), ("1MB", 10**6), (4096, 4096),
    ],
)
def test_known_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["0", "0G", "-1", "-1G", "abc", "", "G", "1.5.5G", "10Q", "1e9", "0.1", "1 G B", True, 0, -5])
def test_bad_sizes(bad):
    with pytest.raises(InvalidSize):
        parse_size(bad)


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(sorted(BINARY) + sorted(DECIMAL)), st.booleans())
def test_integer_with_unit_is_exact(n, unit, upper):
    factor = BINARY.get(unit) or DECIMAL[unit]
    text = f"{n}{unit.upper() if upper else unit}"
    assert parse_size(text) == n * factor


@given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=1, max_value=999), st.sampled_from(sorted(BINARY)))
def test_fractions_round_down_to_whole_bytes(whole, frac, unit):
    text = f"{whole}.{frac:03d}{unit}"
    expected = (whole * 1000 + frac) * BINARY[unit] // 1000
    assert parse_size(text) == expected


@given(st.text(max_size=12))
def test_arbitrary_text_is_a_size_or_a_clean_error(text):
    try:
        assert parse_size(text) > 0
    except InvalidSize:
        pass


def test_format_size():
    assert format_size(512) == "512B"
    assert format_size(16 << 30) == "16.0GiB"
    assert format_size(1536) == "1.5KiB"


def test_counts_in_words_agree_with_their_number():
    from cortex_cache.units import entries, plural

    assert entries(0) == "0 entries" and entries(1) == "1 entry" and entries(2) == "2 entries"
    assert entries(1, "expired entries") == "1 expired entry"
    assert plural(1, "checksum", "checksums") == "1 checksum" and plural(3, "checksum", "checksums") == "3 checksums"
