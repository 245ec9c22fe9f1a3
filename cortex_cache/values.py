"""Turn the values users pass into flat byte views, without copying.

Accepted: bytes-like objects, C-contiguous numpy arrays and other buffer
exporters, and torch CPU tensors (detected without importing torch).
"""

from __future__ import annotations

from typing import Any

from .errors import UsageError
from .layout import MAX_KEY_BYTES


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


__all__ = ["as_byte_view", "key_bytes"]

