"""Process identity for crash recovery.

A pid alone is not enough to tell whether the process that reserved a slot or
pinned an entry is still alive: pids are reused.  We pair the pid with the
process's start time (field 22 of /proc/PID/stat, in clock ticks since boot),
which together name one process for the life of the machine.

Limitation: processes in different pid namespaces that share /dev/shm see
different pids; run all users of a pool in one pid namespace.
"""

from __future__ import annotations

import os


def start_time(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot, or 0 if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    # The command name (field 2) may contain spaces and parentheses: split
    # after the last ')'.  Field 22 is then index 19 of the rest.
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        if rest[0] in (b"Z", b"X") and _no_live_threads(pid):
            # Killed and not yet waited for by its parent: it holds nothing any more (its memory and
            # locks are gone), so its pins and reservations are a dead process's.  A leader whose other
            # threads still run shows Z too; it counts as alive.
            return 0
        return int(rest[19])
    except (IndexError, ValueError):
        return 0


def _no_live_threads(pid: int) -> bool:
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


_cached: tuple[int, int] | None = None


def me() -> tuple[int, int]:
    """(pid, start time) of the calling process; recomputed after fork."""
    global _cached
    pid = os.getpid()
    if _cached is None or _cached[0] != pid:
        _cached = (pid, start_time(pid))
    return _cached


def alive(pid: int, start: int) -> bool:
    """True if the process `pid` that started at `start` still runs; `start` 0: any process `pid` (for
    records that carry no start time).  Records that do carry one are checked with `record_alive`."""
    if pid <= 0:
        return False
    st = start_time(pid)
    if st == 0:
        return False
    return start == 0 or st == start


def record_alive(pid: int, start: int) -> bool:
    """True if the process named by a (pid, start time) record -- a pin, a writer's reservation --
    still runs.  Both must match, as for a lock's owner: a start of 0 (or any other time) on a live pid
    is not that process's record -- the pid was reused, or the record was forged by someone who can
    write the segment (pid 1, start 0 would otherwise hold a pin record for ever)."""
    if pid <= 0 or start <= 0:
        return False
    return start_time(pid) == start


def alive_checker():
    """A `record_alive(pid, start)` that asks /proc once per process, for one scan."""
    seen: dict[tuple[int, int], bool] = {}

    def check(pid: int, start: int) -> bool:
        key = (pid, start)
        if key not in seen:
            seen[key] = record_alive(pid, start)
        return seen[key]

    return check


__all__ = ["start_time", "me", "alive", "record_alive", "alive_checker", "describe"]


def describe(pid: int) -> dict[str, object]:
    """pid, command name and uid of a process (as `fuser -v` shows them); None where /proc hides them."""
    out: dict[str, object] = {"pid": pid, "command": None, "uid": None}
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            out["command"] = f.read().strip().decode("utf-8", "replace")
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    out["uid"] = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        pass
    return out
