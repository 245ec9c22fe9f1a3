"""SIGINT and SIGTERM: an interrupted command cleans up as on an error; a finished one stays finished.

The CLI runs every command under `handled()`: both signals raise
`Interrupted` (a BaseException) in the main thread, so the cleanup each
operation already has for an error runs (`finally`, `except BaseException`:
a staging segment discarded, a temp file unlinked).  Only the first signal
interrupts; another one arriving during that cleanup is noted, not raised,
so the cleanup runs to its end.

Commit points -- the rename that publishes a restored pool or a snapshot,
the few unlinks of a delete -- run inside `commit()`: the signals wait while
it runs (blocked in this thread, deferred by the handler), and once it has
run, the operation has happened.  Under the CLI's handlers a signal after
it no longer interrupts: the command finishes and reports what it did
(exit 0), so a restore that completed never reports 130.  Without them (the
Python API) a signal that waited is delivered when the block ends.

Exit statuses of an interrupted command: 130 for SIGINT, 143 for SIGTERM
(128 + the signal number, as shells report them).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A command stopped by SIGINT or SIGTERM (raised by the CLI's handler).

    A BaseException like KeyboardInterrupt, so `except Exception` never swallows it, but not one: the
    command parser turns a KeyboardInterrupt into a silent exit 130 before the CLI could report it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        # What stays when the command had published something before the signal (the CLI says it in
        # place of "removed what it had made"); None: nothing of it stays.
        self.kept: str | None = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class _State:
    installed = False  # the CLI's handlers are in place
    depth = 0  # commit() blocks entered
    done = False  # a commit point has run: later signals wait for the command to end
    raised = False  # Interrupted was raised once: later signals only wait
    pending: int | None = None  # a signal that arrived while it could not interrupt


_state = _State()


def _handler(signum: int, frame: object) -> None:
    s = _state
    if s.depth or s.done or s.raised:
        if s.pending is None:
            s.pending = signum
        return
    s.raised = True
    raise Interrupted(signum)


@contextmanager
def handled(keep: bool = False) -> Iterator[None]:
    """Run a command with SIGINT and SIGTERM raising `Interrupted`; the previous handlers come back after,
    unless `keep` (the CLI's own process, about to exit): then a signal after the command waits for the
    exit, so a command that did its work is never killed on its way out.

    Outside the main thread (where Python cannot set handlers) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _handler) for s in SIGNALS}
    saved = (_state.installed, _state.depth, _state.done, _state.raised, _state.pending)
    _state.installed, _state.depth, _state.done, _state.raised, _state.pending = True, 0, False, False, None
    try:
        yield
    finally:
        if keep:
            # Ignored to the exit: the interpreter puts the default action back for a handler of ours as
            # it finalises (not for SIG_IGN), and a signal then, delivered to any thread, would kill a
            # process whose command is done.
            _state.done = True
            for s in SIGNALS:
                signal.signal(s, signal.SIG_IGN)
        else:
            for s, h in old.items():
                signal.signal(s, h)
            _state.installed, _state.depth, _state.done, _state.raised, _state.pending = saved


@contextmanager
def commit() -> Iterator[None]:
    """A commit point: SIGINT and SIGTERM wait while the block runs; under `handled()`, once it has run
    they wait for the command to end (it has done what it was asked)."""
    with atomic():
        yield
        if _state.installed:
            _state.done = True


@contextmanager
def atomic() -> Iterator[None]:
    """SIGINT and SIGTERM wait while the block runs (a step and the note of what it made, such as a temp
    directory and the variable its cleanup reads), and interrupt after it."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS) if main else None
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if not _state.depth and _state.pending is not None and not (_state.done or _state.raised):
            signum, _state.pending = _state.pending, None  # it waited for the block: it interrupts now
            _state.raised = True
            raise Interrupted(signum)


def pending() -> str | None:
    """The name of a signal that arrived after a commit point (or during cleanup) and waited, or None."""
    return signal.Signals(_state.pending).name if _state.pending is not None else None


__all__ = ["Interrupted", "handled", "commit", "atomic", "pending", "SIGNALS"]
