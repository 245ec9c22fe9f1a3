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
import stat
import sys
from typing import Any, Callable, Optional

import typer

from . import interrupts, safefs
from .cli_render import JSON_SCHEMA, now_iso
from .errors import (
    EX_IOERR,
    EX_SOFTWARE,
    EX_USAGE,
    CannotCreate,
    CortexCacheError,
    PermissionDenied,
    PoolNotFound,
    StorageIOError,
    UsageError,
    ValueTooLarge,
)
from .interrupts import Interrupted

# ---------------------------------------------------------------- values in and out


def read_value(source: Optional[str], limit: int) -> bytes:
    """The value from FILE or stdin, read up to `limit` bytes: one byte more is ValueTooLarge, so
    /dev/zero or an endless pipe costs a pool's size of memory at most."""
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
        raise PoolNotFound(f"no such file {source!r}") from None  # exit 66: no such input
    except IsADirectoryError:
        raise UsageError(f"{source!r} is a directory") from None
    except PermissionError:
        raise PermissionDenied(f"permission denied reading {source!r}") from None


class OutputFile:
    """The file `-o FILE` names, written whole or not at all: the value goes into a temporary file
    beside it (mode 0600), synced, then takes the name in one step.  The one rule of every `-o`
    (get, persist): an existing file is refused (OutputExists, 73) unless `replace` (--force), and
    then replaced atomically, never left short.  Made before the pool is read, so a bad path changes
    nothing in the pool."""

    def __init__(self, path: str, replace: bool = False) -> None:
        self.path, self.replace, self.tmp, self.fd = path, replace, None, -1
        if _stream(path):  # /dev/null, /dev/stdout, a FIFO: written into, as a shell's > would
            self.fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            return
        safefs.refuse_existing(path, replace)
        directory = os.path.dirname(path) or "."
        try:
            self.fd, self.tmp = _temp_beside(path)
        except FileNotFoundError:
            raise CannotCreate(f"cannot create {path!r}: no directory {directory!r}") from None
        except OSError as e:
            raise safefs.os_error(e, f"cannot create {path!r}") from None

    def write(self, value: bytes) -> None:
        """Write `value`, sync it and give it the name; a full disk removes it (StorageIOError)."""
        try:
            with os.fdopen(self.fd, "wb") as f:
                self.fd = -1
                f.write(value)
                f.flush()
                if self.tmp is not None:
                    os.fsync(f.fileno())  # a full disk shows here, not later as a short file
        except OSError as e:
            self.discard()
            raise StorageIOError(f"cannot write {self.path!r}: {e.strerror or e}; nothing was written") from None
        except BaseException:  # SIGINT or SIGTERM mid-write (interrupts.Interrupted): no temp file left
            self.discard()
            raise
        if self.tmp is None:  # a device or FIFO, written into
            return
        with interrupts.commit():  # named: a signal now waits, and the command reports success
            try:
                safefs.publish(self.tmp, self.path, self.replace)  # type: ignore[arg-type]
            except BaseException:
                self.discard()
                raise
            self.tmp = None

    def discard(self) -> None:
        """Remove the temporary file (a value that will not come, an error): the name is untouched."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.tmp is not None:
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass
            self.tmp = None


def _stream(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _temp_beside(path: str) -> tuple[int, str]:
    import secrets

    directory, base = os.path.split(path)
    tmp = os.path.join(directory, f".{base}.tmp-{secrets.token_hex(6)}")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600), tmp


def write_stdout(value: bytes) -> None:
    sys.stdout.buffer.write(value)
    sys.stdout.flush()


# ---------------------------------------------------------------- errors and exit codes


def one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def error(msg: str, code: int, as_json: bool, kind: str = "error") -> None:
    """An error: one line on stderr; with --json a JSON document {"time", "schema", "error", "exit"}.
    `kind` "note": what ends the command is no fault (`restore --if-missing` on a first boot), said as
    `cortex: note: ...` (and "note" in the JSON document) with its exit code all the same."""
    if as_json:
        doc = {"time": now_iso(), "schema": JSON_SCHEMA, kind: msg, "exit": code}
        sys.stderr.write(json.dumps(doc, separators=(",", ":")) + "\n")
    else:
        sys.stderr.write(f"cortex: {kind}: {msg}\n")


# The parser's messages in our words: no validation-library phrasing ("Input should be ...", "Value error,").
_USAGE_WORDS = [
    (r"Invalid value for '([^']+)': Value error, '(.*)' is not one of (.*?)\.?$",
     lambda m: f"invalid {m[1]} '{m[2]}': choose one of {m[3].replace(chr(39), '')} (in any case)"),
    (r"Invalid value for '([^']+)': Input should be a valid integer.*$", r"invalid \1: give a whole number"),
    (r"Invalid value for '([^']+)': Input should be a valid number.*$", r"invalid \1: give a number"),
    (r"Invalid value for '([^']+)': Input should be a valid string.*$", r"invalid \1: not UTF-8 text"),
    (r"Input should be greater than or equal to (\S+)", r"must be at least \1"),
    (r"Input should be less than or equal to (\S+)", r"must be at most \1"),
    (r"Input should be greater than (\S+)", r"must be more than \1"),
    (r"Input should be less than (\S+)", r"must be less than \1"),
    (r"Invalid value for '([^']+)': ", r"invalid \1: "),
    (r"Value error, ", ""),
]


def usage_words(msg: str) -> str:
    """The parser's message in our words, one line."""
    msg = one_line(msg)
    for pattern, words in _USAGE_WORDS:
        msg = re.sub(pattern, words, msg)
    return msg


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
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `cortex` / `cortex cache`: the help asked for
            sys.stdout.write(e.format_message() + "\n")  # type: ignore[attr-defined]
            sys.stdout.flush()
            return 0
        if is_usage_error(e) and getattr(e, "ctx", None) is not None and e.format_message() == "Missing command.":
            # Options but no command (`cortex -q`, `cortex cache --debug`): no command either, so the help too.
            sys.stdout.write(e.ctx.get_help() + "\n")  # type: ignore[attr-defined]
            sys.stdout.flush()
            return 0
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
    "read_value", "OutputFile", "write_stdout", "one_line", "error", "usage_words",
    "is_usage_error", "IO_ERRNOS", "drop_stdout", "run_guarded",
]
