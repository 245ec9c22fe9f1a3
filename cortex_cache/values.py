"""Turn the values users pass into flat byte views, without copying.

Accepted: bytes-like objects, C-contiguous numpy arrays and other buffer
exporters, and torch CPU tensors (detected without importing torch).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from xxhash import xxh3_64_intdigest

from .errors import UsageError
from .layout import MAX_KEY_BYTES, SLOT_FLAG_STR_KEY


def as_byte_view(value: Any) -> memoryview:
    """A flat, read-only-safe `memoryview` of format 'B' over `value`'s bytes."""
    if type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage"):
        return _tensor_view(value)
    try:
        mv = memoryview(value)
    except TypeError:
        raise UsageError(
            f"cannot store a value of type {type(value).__name__}: "
            "use bytes, a contiguous numpy array or a torch CPU tensor"
        ) from None
    if not mv.c_contiguous:
        raise UsageError("cannot store a non-contiguous array: make it contiguous first")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _tensor_view(t: Any) -> memoryview:
    if t.device.type != "cpu":
        raise UsageError(f"cannot store a tensor on {t.device}: move it to the CPU or use cortex_cache.gpu")
    if not t.is_contiguous():
        raise UsageError("cannot store a non-contiguous tensor: call .contiguous() first")
    import torch  # only reached when the caller already uses torch

    flat = t.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def key_bytes(key: str | bytes | bytearray | memoryview) -> tuple[bytes, bool]:
    """(encoded key, was_str) for a str or bytes-like key; UsageError for anything else."""
    if isinstance(key, str):
        try:
            kb, is_str = key.encode("utf-8", "surrogateescape"), True
        except UnicodeEncodeError as e:  # a lone surrogate that stands for no byte
            raise UsageError(f"key {key[:40]!r} is not valid text ({e.reason} at {e.start}): use bytes keys") from None
    elif isinstance(key, (bytes, bytearray, memoryview)):
        kb, is_str = bytes(key), False
    else:
        raise UsageError(f"keys are str or bytes, not {type(key).__name__}")
    if not 0 < len(kb) <= MAX_KEY_BYTES:
        raise UsageError(f"keys must be 1 to {MAX_KEY_BYTES} bytes long, not {len(kb)}")
    return kb, is_str


# The longest TTL: an expiry further off is no expiry a clock or a calendar can show (time_t, dates).
MAX_TTL = 100 * 365.25 * 86400


def put_args(core: Any, kb: bytes, is_str: bool, nbytes: int, ttl: Any, priority: Any) -> tuple[int, int, int]:
    """Check the arguments every put shares (key already made bytes): (key hash, slot flags, blocks).

    `core` is the pool's Core (core.py), which knows how many blocks `nbytes` takes.
    """
    if ttl is not None and not 0 < ttl <= MAX_TTL:  # nan and inf fail too
        raise UsageError(f"ttl must be a number of seconds above 0 and at most {MAX_TTL:.0f} (100 years; "
                         f"an entry without one never expires), not {ttl!r}")
    if priority.__class__ is not int and not isinstance(priority, (int, np.integer)) or not (
        -(2**63) <= priority < 2**63
    ):
        raise UsageError(f"priority must be a 64-bit integer, not {priority!r}")
    nblk = core.blocks_or_raise(nbytes)
    return xxh3_64_intdigest(kb), SLOT_FLAG_STR_KEY if is_str else 0, nblk


def valid_nbytes(nbytes: Any) -> int:
    """A value size asked for by a zero-copy put, as an int (UsageError unless a non-negative integer)."""
    if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes < 0:
        raise UsageError(f"nbytes must be a non-negative integer, not {nbytes!r}")
    return int(nbytes)


def writable_bytes(out: Any) -> memoryview:
    """`out` as a writable, flat memoryview of bytes (UsageError if it is not one)."""
    try:
        omv = memoryview(out)
    except TypeError:
        raise UsageError("get_into needs a writable buffer (bytearray, numpy array, ...)") from None
    if omv.readonly:
        raise UsageError("get_into needs a writable buffer, not a read-only one")
    if omv.format != "B" or omv.ndim != 1:
        if not omv.c_contiguous:
            raise UsageError("get_into needs a contiguous buffer")
        omv = omv.cast("B")
    return omv


def show_key(key: object) -> str:
    """A key as an error message shows it (repr, cut to 80 characters)."""
    s = repr(key)
    return s if len(s) <= 80 else s[:77] + "..."


__all__ = ["as_byte_view", "key_bytes", "put_args", "show_key", "writable_bytes"]

