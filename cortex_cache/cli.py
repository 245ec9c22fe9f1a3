"""`cortex cache ...`: the operator CLI's entry point and its table of commands.

The CLI parses, calls the library, renders.  The commands live in four
modules by what they work on: cli_pools.py (create, delete, resize),
cli_values.py (put, get, keys, info, evict), cli_snapshots.py (persist,
restore, snapshots) and cli_inspect.py (list, status, verify, doctor); the
options they share are cli_options.py.  How results look is cli_render.py;
reading values, writing output, errors and exit codes cli_io.py.  This
module makes the Typer app, registers the commands in the order `--help`
lists them, and runs a command line (`main`, the console script).  Nothing
here imports the library (and so numpy): `cortex --help` stays fast.  Every
error ends as one line on stderr and a documented exit code (sysexits);
`--debug` or CORTEX_CACHE_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import os
import sys

import typer

from . import cli_inspect, cli_io, cli_pools, cli_snapshots, cli_values, interrupts
from .cli_options import DEBUG_OPT, EXIT_CODES_HELP, HELP_OPTIONS, QUIET_OPT
from .cli_render import Output


app = typer.Typer(
    name="cortex",
    help="cortex-cache: named KV-cache pools in POSIX shared memory.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=HELP_OPTIONS,
)
cache = typer.Typer(
    name="cache",
    help="Create, inspect, use and remove KV-cache pools.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=HELP_OPTIONS,
)
app.add_typer(cache, name="cache")


def _read_path() -> str:
    """Which read path pools opened here use (docs/internals.md, "The fast path"); without importing
    numpy, which `--version` does not need."""
    from importlib.util import find_spec

    if find_spec("cortex_cache._fastpath") is None:
        return "pure-Python path: the C fast path was not built"
    if os.environ.get("CORTEX_CACHE_PURE_PYTHON", "") not in ("", "0"):
        return "pure-Python path: CORTEX_CACHE_PURE_PYTHON is set"
    return "C fast path"


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("cortex-cache")
        except PackageNotFoundError:  # run from a source tree that was never installed
            v = "unknown"
        sys.stdout.write(f"cortex-cache {v} ({_read_path()})\n")
        raise typer.Exit(0)


VERSION_OPT = typer.Option(False, "--version", help="Print the version and exit.", callback=_show_version, is_eager=True)


@app.callback()
def _root(quiet: bool = QUIET_OPT, version: bool = VERSION_OPT, debug: bool = DEBUG_OPT) -> None:
    pass


@cache.callback()
def _cache(quiet: bool = QUIET_OPT, version: bool = VERSION_OPT, debug: bool = DEBUG_OPT) -> None:
    pass


# Typer writes a required argument as {NAME} in usage lines; the man page and
# every other tool write NAME.
def _usage_name(self) -> str:  # type: ignore[no-untyped-def]
    name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
    return name + ("..." if self.nargs != 1 else "")


if hasattr(typer.core.TyperArgument, "_usage_display_name"):
    typer.core.TyperArgument._usage_display_name = _usage_name  # type: ignore[method-assign]


# ---------------------------------------------------------------- the commands, in the order --help lists them

COMMANDS = [
    ("create", cli_pools.create),
    ("list", cli_inspect.list_pools),
    ("status", cli_inspect.status),
    ("delete", cli_pools.delete),
    ("put", cli_values.put),
    ("get", cli_values.get),
    ("keys", cli_values.keys),
    ("info", cli_values.info),
    ("evict", cli_values.evict),
    ("verify", cli_inspect.verify),
    ("persist", cli_snapshots.persist),
    ("restore", cli_snapshots.restore),
    ("resize", cli_pools.resize),
    ("snapshots", cli_snapshots.snapshots),
    ("doctor", cli_inspect.doctor),
]
for _name, _command in COMMANDS:
    cache.command(_name)(_command)


# ---------------------------------------------------------------- entry point


COMPLETE_VAR = "_CORTEX_COMPLETE"


def _watch_default(args: list[str]) -> list[str]:
    """`--watch` takes an optional SECONDS (like `redis-cli --stat`): supply 1 where none follows."""
    out = []
    for i, a in enumerate(args):
        out.append(a)
        if a == "--":  # what follows is data (a KEY), not options
            return out + args[i + 1 :]
        if a == "--watch":
            nxt = args[i + 1] if i + 1 < len(args) else None
            try:
                float(nxt)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                out.append("1")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return (and exit with) its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    Output.quiet = False
    if os.environ.get(COMPLETE_VAR):
        # A shell asking for completions the Typer way (e.g. _CORTEX_COMPLETE=complete_bash):
        # register Typer's shell classes, which add_completion=False leaves out.
        from typer.completion import completion_init

        completion_init()
    debug = os.environ.get("CORTEX_CACHE_DEBUG", "") not in ("", "0")
    # --debug is accepted anywhere before a "--" separator.
    options = args[: args.index("--")] if "--" in args else args
    if "--debug" in options:
        debug = True
        args.remove("--debug")
    as_json = "--json" in options  # errors, too, are JSON then (on stderr)
    args = _watch_default(args)
    # SIGINT and SIGTERM interrupt a command as an error would, its cleanup included (interrupts.py);
    # the CLI's own process (argv None) keeps the handlers to its exit.
    with interrupts.handled(keep=argv is None):
        return cli_io.run_guarded(
            lambda: typer.main.get_command(app).main(
                args=args, prog_name="cortex", complete_var=COMPLETE_VAR, standalone_mode=False
            ),
            debug,
            as_json,
        )


def run() -> None:
    sys.exit(main())


__all__ = ["app", "main", "run"]
