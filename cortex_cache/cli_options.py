"""What every `cortex cache` command shares: the common options, the choice types, the checks of values.

The command modules (cli_pools, cli_values, cli_snapshots, cli_inspect)
declare their parameters with these, so that `-q`, `--debug`, `--json`,
NAME and the choices read the same in every `--help`, in the man page and
in the completions (scripts/gen_docs.py reads them from the command tree).
Like the rest of the CLI it imports nothing heavy: `cortex --help` stays fast.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

import typer

from .cli_render import Output
from .errors import UsageError
from .policy_names import POLICY_IDS

EXIT_CODES_HELP = (
    "Exit status: 0 ok; 1 verify found a problem; 2 usage error; 65 corrupt or "
    "incompatible data; 66 no such pool, key or snapshot; 69 service unavailable; "
    "70 internal error; 73 cannot create (exists, not enough memory); 74 I/O error; "
    "75 temporary failure (lock held, out of file descriptors); 77 permission denied; 130 interrupted by SIGINT; "
    "143 interrupted by SIGTERM (what the command had made is removed)."
)


def _set_quiet(value: bool) -> bool:
    # Any -q on the line (before or after the command) makes the whole run quiet.
    if value:
        Output.quiet = True
    return value


QUIET_HELP = "Print no confirmations or progress bars; data, --json output, warnings and errors still appear."
QUIET_OPT = typer.Option(False, "--quiet", "-q", help=QUIET_HELP, callback=_set_quiet)
# main() takes --debug off the line wherever it stands (before a "--") before Typer parses it; the
# option is declared on every command so that each --help, the man page and the completions show it.
DEBUG_OPT = typer.Option(False, "--debug", help="Show the traceback of an error (also CORTEX_CACHE_DEBUG=1); accepted anywhere before a -- argument.")
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}

NAME_ARG = typer.Argument(..., metavar="NAME", help="Pool name: 1-64 of A-Z a-z 0-9 . _ -, starting with a letter or digit.", show_default=False)
JSON_OPT = typer.Option(False, "--json", help="Print one JSON document on stdout.")


# ---------------------------------------------------------------- choices

Policy = Enum("Policy", {name: name for name in POLICY_IDS}, type=str)  # type: ignore[misc]


class Tier(str, Enum):
    cpu = "cpu"
    disk = "disk"


class DiskWrite(str, Enum):
    back = "back"
    through = "through"


class WhichTier(str, Enum):
    memory = "memory"
    disk = "disk"
    all = "all"
    remote = "remote"


class Format(str, Enum):
    table = "table"
    json = "json"
    prometheus = "prometheus"


# ---------------------------------------------------------------- values

# Bounds of numbers that the segment stores in fixed widths: a larger one is a usage error (2) before
# anything is made, not an overflow deep down (70).
MAX_KEEP = 2**32 - 1  # snapshots a pool keeps (u32 in the header)
MAX_DISK_ENTRIES = 2**31 - 2  # entries of a disk tier's index (i32 slot numbers)


def path_given(param: typer.CallbackParam, value: Optional[str]) -> Optional[str]:
    """The callback of every FILE or DIR option and argument: an empty string names no file (the shell's
    `-o "$unset"`), a usage error here rather than a file called '' or '.' further down."""
    if value == "":
        what = "a directory" if param.metavar == "DIR" else "a file name"
        raise UsageError(f"{_shown(param)} needs {what}, not an empty string")
    return value


def _shown(param: typer.CallbackParam) -> str:
    """An option as the user wrote it (its long name), or an argument by its metavar."""
    longs = [o for o in param.opts if o.startswith("--")]
    return longs[0] if longs and param.param_type_name == "option" else (param.metavar or param.name or "?").split("|")[0]


def parse_mode(text: str) -> int:
    """`--mode`: octal permission bits that include the owner's read and write."""
    t = text.lower().removeprefix("0o")
    try:
        mode = int(t, 8)
    except ValueError:
        raise UsageError(f"invalid mode {text!r}: give octal permission bits like 0600 or 0660") from None
    if mode & ~0o777 or mode & 0o600 != 0o600:
        raise UsageError(f"invalid mode {text!r}: must be within 0777 and include owner read/write (0600)")
    return mode


__all__ = [
    "EXIT_CODES_HELP", "QUIET_HELP", "QUIET_OPT", "DEBUG_OPT", "HELP_OPTIONS", "NAME_ARG", "JSON_OPT",
    "Policy", "Tier", "DiskWrite", "WhichTier", "Format", "MAX_KEEP", "MAX_DISK_ENTRIES", "path_given", "parse_mode",
]
