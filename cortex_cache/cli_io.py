"""Where the CLI meets files and the process: values in, values out, errors and exit codes.

A value to store is read from a file or stdin, never more than the pool can
hold; a value read back goes to stdout or to a new file that is removed
rather than left short when the disk fills.  `run_guarded` runs a parsed
command and turns whatever escapes it into one line on stderr (JSON with
--json) and its documented exit code (sysexits): the library's errors, the
parser's usage errors (2), output that cannot be written (74), and bugs
(70, a traceback only with --debug).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from typing import Any, Callable, Optional

import typer

from . import interrupts
from .cli_render import now_iso
from .errors import EX_IOERR, EX_SOFTWARE, EX_USAGE, CortexCacheError, UsageError
from .interrupts import Interrupted

# ---------------------------------------------------------------- values in and out


def read_value(source: Optional[str], limit: int) -> bytes:
    """The value from FILE or stdin, read up to `limit` bytes: one byte more is ValueTooLarge, so
    /dev/zero or an endless pipe costs a pool's size of memory at most."""
    from .errors import ValueTooLarge

    def bounded(f) -> bytes:
        data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueTooLarge(f"the value is larger than the pool's {limit} bytes; nothing was stored")
        return data

    if source is None or source == "-":
        if source is None and sys.stdin.isatty():
            raise UsageError("give a FILE, or '-' and pipe the value on stdin")
        return bounded(sys.stdin.buffer)
    try:
        with open(source, "rb") as f:
            return bounded(f)
    except FileNotFoundError:
        from .errors import PoolNotFound  # exit 66: no such input

        raise PoolNotFound(f"no such file {source!r}") from None
    except IsADirectoryError:
        raise UsageError(f"{source!r} is a directory") from None
    except PermissionError:
        from .errors import PermissionDenied

        raise PermissionDenied(f"permission denied reading {source!r}") from None


def create_output(output: str) -> int:
    """A new file (mode 0600) for a value, opened for writing: made before the pool is read, so a bad
    path changes nothing in the pool."""
    try:
        return os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        from .errors import PoolExists

        raise PoolExists(f"{output!r} already exists; remove it first") from None
    except FileNotFoundError:
        from .errors import CannotCreate

        raise CannotCreate(f"cannot create {output!r}: no such directory") from None
    except OSError as e:
        from .errors import StorageIOError

        raise StorageIOError(f"cannot create {output!r}: {e.strerror}") from None


def discard_output(fd: int, output: str) -> None:
    """Close and remove a file from create_output that will not get its value."""
    os.close(fd)
    os.unlink(output)


def write_value(value: bytes, fd: int = -1, output: str | None = None) -> None:
    """Write `value` to stdout (fd < 0) or into the file create_output opened, synced: a full disk
    removes the file (never a truncated one left behind) and is StorageIOError."""
    if fd < 0:
        sys.stdout.buffer.write(value)
        sys.stdout.flush()
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(value)
            f.flush()
            os.fsync(f.fileno())  # a full disk shows here, not later as a short file
    except OSError as e:
        os.unlink(output)  # type: ignore[arg-type]  # never a truncated file left behind
        from .errors import StorageIOError

        raise StorageIOError(f"cannot write {output!r}: {e.strerror or e}; nothing was written") from None


# ---------------------------------------------------------------- errors and exit codes


def one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def error(msg: str, code: int, as_json: bool) -> None:
    """An error: one line on stderr; with --json a JSON document {"time", "error", "exit"}."""
    if as_json:
        sys.stderr.write(json.dumps({"time": now_iso(), "error": msg, "exit": code}, separators=(",", ":")) + "\n")
    else:
        sys.stderr.write(f"cortex: error: {msg}\n")


def usage_words(msg: str) -> str:
    """The parser's message in our words: no validation-library phrasing ("Input should be ...")."""
    msg = one_line(msg)
    return re.sub(r"Input should be (greater|less) than or equal to (\S+)", r"must be at \1 \2", msg).replace(
        "at greater", "at least").replace("at less", "at most")


def is_usage_error(e: BaseException) -> bool:
    # Typer vendors its parser's exception classes privately; recognise them
    # by name instead of importing a private module.
    return any(c.__name__ in ("UsageError", "ClickException") for c in type(e).__mro__) and hasattr(
        e, "format_message"
    )


IO_ERRNOS = {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.ENXIO}


def drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what could not be written stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except OSError:
        pass


def run_guarded(command: Callable[[], Any], debug: bool, as_json: bool) -> int:
    """Run `command` (the parser, which runs the chosen command); return the exit status."""
    code = 0
    try:
        rc = command()
        # Without standalone mode, the parser turns `raise typer.Exit(n)` into a return value.
        if isinstance(rc, int):
            code = rc
        sys.stdout.flush()  # a full disk or /dev/full shows here, as exit 74, not at interpreter exit
        late = interrupts.pending()
        if late is not None:  # it arrived once the command's work was committed: that stands
            sys.stderr.write(f"cortex: {late} arrived after the command had completed; its result stands\n")
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        code = 130
    except Interrupted as e:
        # Raised by the handlers of cortex_cache.interrupts: what the command had made is removed
        # already (the cleanup every error gets ran on the way here).
        error(f"interrupted by {e.signal_name}: " + (e.kept or "stopped before it completed, and removed what it "
                                                              "had made"), e.exit_code, as_json)
        code = e.exit_code
    except CortexCacheError as e:
        if debug:
            import traceback

            traceback.print_exc()
        error(f"{one_line(str(e))}", e.exit_code, as_json)
        code = e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("cortex: interrupted\n")
        code = 130
    except BrokenPipeError:
        # Reader went away (e.g. `| head`): not an error worth a message.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0
    except OSError as e:
        if e.errno not in IO_ERRNOS:
            raise
        # Writing our output failed (a full disk, /dev/full, a dead device): an I/O error, exit 74.
        if debug:
            import traceback

            traceback.print_exc()
        error(f"I/O error writing output: {e.strerror or e}", EX_IOERR, as_json)
        drop_stdout()
        code = EX_IOERR
    except Exception as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `cortex` / `cortex cache`: show help
            sys.stderr.write(e.format_message() + "\n")  # type: ignore[attr-defined]
            return EX_USAGE
        if is_usage_error(e):
            # The parser's own errors (unknown option, bad choice): one line, exit 2.
            error(f"{usage_words(e.format_message())} (see --help)", EX_USAGE, as_json)  # type: ignore[attr-defined]
            return EX_USAGE
        # Anything else is a bug: say so in one line, traceback with --debug.
        if debug:
            import traceback

            traceback.print_exc()
        if as_json:
            error(f"internal error: {one_line(f'{type(e).__name__}: {e}')}", EX_SOFTWARE, True)
        else:
            sys.stderr.write(f"cortex: internal error: {one_line(f'{type(e).__name__}: {e}')} (rerun with --debug for a traceback)\n")
        code = EX_SOFTWARE
    return code


__all__ = [
    "read_value", "create_output", "discard_output", "write_value", "one_line", "error", "usage_words",
    "is_usage_error", "IO_ERRNOS", "drop_stdout", "run_guarded",
]
