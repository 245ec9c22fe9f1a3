"""One exception hierarchy for the whole library.

Every error a user can meet derives from :class:`CortexCacheError` and carries
the exit code the CLI uses for it (sysexits; the table is in docs/cli.md,
"Exit status", and in `cortex --help`).  Library code
raises these; only the CLI turns them into messages and exit codes.
"""

from __future__ import annotations

import errno

EX_OK = 0
EX_PROBLEM = 1  # a check (verify) found a problem
EX_USAGE = 2
EX_DATAERR = 65
EX_NOINPUT = 66
EX_UNAVAILABLE = 69
EX_SOFTWARE = 70
EX_CANTCREAT = 73
EX_IOERR = 74
EX_TEMPFAIL = 75
EX_NOPERM = 77
EX_SIGINT = 130  # interrupted by SIGINT (128 + 2), what the command had made removed (interrupts.py)
EX_SIGTERM = 143  # interrupted by SIGTERM (128 + 15)


class CortexCacheError(Exception):
    """Root of every error raised by cortex_cache."""

    exit_code = EX_SOFTWARE


class UsageError(CortexCacheError, ValueError):
    """A bad argument: name, size, key, option combination."""

    exit_code = EX_USAGE


class InvalidName(UsageError):
    """A pool name that is not `[A-Za-z0-9][A-Za-z0-9._-]{0,63}`."""


class InvalidSize(UsageError):
    """A size that is zero, negative or not a size at all."""


class PoolNotFound(CortexCacheError, FileNotFoundError):
    """No pool of that name exists under the current prefix."""

    exit_code = EX_NOINPUT


class KeyNotFound(CortexCacheError, KeyError):
    """No live entry under that key (absent or expired)."""

    exit_code = EX_NOINPUT

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class BufferTooSmall(UsageError):
    """`get_into` was given a buffer smaller than the value."""


class PoolExists(CortexCacheError, FileExistsError):
    """A pool of that name already exists."""

    exit_code = EX_CANTCREAT


class CannotCreate(CortexCacheError):
    """An output file cannot be created where asked (missing directory)."""

    exit_code = EX_CANTCREAT


class OutputExists(CannotCreate, FileExistsError):
    """An output file (`-o FILE`) exists already and replacing it was not asked for (`--force`)."""


class NoSpace(CortexCacheError):
    """Not enough shared memory (or disk) to create what was asked."""

    exit_code = EX_CANTCREAT


class PoolFull(CortexCacheError):
    """No room for a value, and eviction could not make any."""

    exit_code = EX_CANTCREAT


class ValueTooLarge(CortexCacheError, ValueError):
    """A value (plus its key) larger than the whole pool's data region."""

    exit_code = EX_USAGE


class SegmentCorrupt(CortexCacheError):
    """A segment that is not a cortex pool, is damaged, or of another format version."""

    exit_code = EX_DATAERR


class IncompatibleVersion(SegmentCorrupt):
    """A segment written by another format version of cortex_cache."""


class ValueCorrupt(SegmentCorrupt):
    """A value read does not match its checksum (a read with `verify_reads`, `get --verify`)."""


class PermissionDenied(CortexCacheError, PermissionError):
    """The pool (or file) exists but this user may not open it."""

    exit_code = EX_NOPERM


class LockTimeout(CortexCacheError, TimeoutError):
    """The pool's lock was not acquired within the timeout."""

    exit_code = EX_TEMPFAIL


class PersistBusy(LockTimeout):
    """Another persist (or restore) of the same pool is running."""


class SnapshotCorrupt(SegmentCorrupt):
    """A snapshot that is truncated, damaged, foreign or of a newer format version."""


class SnapshotNotFound(PoolNotFound):
    """No snapshot file at the given path (or no latest snapshot of the pool)."""


class PoolBusy(CortexCacheError):
    """A temporary shortage (all pin slots taken); retry later."""

    exit_code = EX_TEMPFAIL


class TooManyOpenFiles(CortexCacheError, OSError):
    """This process (ulimit -n) or the system ran out of file descriptors (EMFILE, ENFILE); retry later."""

    exit_code = EX_TEMPFAIL


OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


def too_many_open_files(what: str, e: OSError) -> TooManyOpenFiles:
    """The error for an OSError whose errno is in OUT_OF_FILES, met doing `what`."""
    scope = "this process's limit (ulimit -n)" if e.errno == errno.EMFILE else "the system's limit"
    return TooManyOpenFiles(f"{what}: too many open files ({scope}); close some or raise the limit, and retry")


class PoolClosed(CortexCacheError, ValueError):
    """An operation on a pool handle that was closed."""

    exit_code = EX_SOFTWARE


class PoolSuperseded(CortexCacheError):
    """The pool this handle maps is no longer the pool of its name (replaced by restore --replace or resize,
    or deleted): `Pool.reopen` gives a handle on the pool now under the name."""

    exit_code = EX_TEMPFAIL


class ServiceUnavailable(CortexCacheError):
    """A facility the pool needs is missing (no /dev/shm, no CUDA)."""

    exit_code = EX_UNAVAILABLE


class GpuUnavailable(ServiceUnavailable):
    """CUDA was asked for and this machine (or this torch) has none."""


class LayoutMismatch(SegmentCorrupt):
    """A stored KV chunk was made by another model or layout: refused, never reinterpreted."""


class StorageIOError(CortexCacheError, OSError):
    """An I/O error reading or writing pool data or files."""

    exit_code = EX_IOERR


class SpillLost(StorageIOError):
    """Entries evicted to make room could not be written to the disk tier and are lost; the operation
    that evicted them (a put, a promotion) completed (docs/tiers.md)."""


__all__ = [name for name in dir() if name.endswith("Error") or name.startswith("EX_")] + [
    "InvalidName",
    "InvalidSize",
    "PoolNotFound",
    "KeyNotFound",
    "BufferTooSmall",
    "PoolExists",
    "NoSpace",
    "CannotCreate",
    "OutputExists",
    "PoolFull",
    "ValueTooLarge",
    "SegmentCorrupt",
    "IncompatibleVersion",
    "ValueCorrupt",
    "PermissionDenied",
    "LockTimeout",
    "PoolBusy",
    "PersistBusy",
    "SnapshotCorrupt",
    "SnapshotNotFound",
    "PoolClosed",
    "PoolSuperseded",
    "TooManyOpenFiles",
    "OUT_OF_FILES",
    "too_many_open_files",
    "ServiceUnavailable",
    "GpuUnavailable",
    "LayoutMismatch",
]
