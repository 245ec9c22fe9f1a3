"""A filler paused where a test wants it: a restore in a process of its own (test_fill.py, test_gone.py).

`start` runs WORKER, which restores pool NAME from the snapshot directory and stops at the chosen point of
its fill -- after its n-th batch ("batch"), or inside a batch, its reservations made, before its n-th value
is copied ("value") -- printing "paused" and waiting on its stdin until `go_on` (then it prints restore's
report as JSON) or `kill`.  "seal" is not paused: the filler kills itself inside the lock hold that seals its
n-th entry (the lock left dirty).  `jump` moves its clock forward once it goes on (TTLs run out during the
fill); `band` sets fill.BAND_BYTES.

The worker's own clock keeps its handle off the C fast path, so by default the fill runs fill.py's Python
batches.  `c=True` gives it the real clock and the fill by columns in C (fill_columns.py); there "value"
pauses before the n-th batch's values are written (its reservations made), and "seal" kills the filler
inside the n-th batch's seal hold, after C sealed it and before the mark moves past it.

A test that fails with its filler paused would leave it waiting for ever: every filler `start` made is
killed after the test by the fixture `no_filler_left` (autouse: import it into the test module).
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from .helpers import spawn_py

WORKER = """
import json, os, signal, sys, time
from cortex_cache import core, fill, fill_columns, persist
name, where, n, jump, band = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
in_c = sys.argv[6] == "1"
if band:
    fill.BAND_BYTES = band
calls = 0
ahead = [0.0]

def clock():
    return time.time() + ahead[0]

def pause():
    print("paused", flush=True)
    sys.stdin.readline()
    ahead[0] = jump

progress = None
if where == "batch":  # after the n-th batch was sealed
    def progress(done, total):
        global calls
        calls += 1
        if calls == n:
            pause()
elif where == "value" and in_c:  # inside the n-th batch, its reservations made, before its values are written
    real_write = fill_columns._write
    def write(*a):
        global calls
        calls += 1
        if calls == n:
            pause()
        return real_write(*a)
    fill_columns._write = write
elif where == "seal" and in_c:  # killed in the n-th batch's seal hold, after C sealed it, before the mark moves
    real_advance = fill_columns._advance
    def advance(*a):
        global calls
        calls += 1
        if calls == n:
            print("paused", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_advance(*a)
    fill_columns._advance = advance
elif where == "value":  # inside a batch, its reservations made: before the n-th value is copied into the pool
    real = fill._store
    def store(*a):
        global calls
        calls += 1
        if calls == n:
            pause()
        return real(*a)
    fill._store = store
else:  # "seal": killed inside the lock hold that seals, at the n-th entry it seals
    real_seal = core.Core.seal
    def seal(self, *a, **kw):
        global calls
        calls += 1
        if calls == n:
            print("paused", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_seal(self, *a, **kw)
    core.Core.seal = seal
pool, report = persist.restore(None, name=name, progress=progress, clock=None if in_c else clock)
pool.close()
print(json.dumps(report), flush=True)
"""

_workers: list[subprocess.Popen] = []


def start(name: str, where: str = "batch", n: int = 1, jump: float = 0.0, band: int = 0,
          c: bool = False) -> subprocess.Popen:
    """A filler of pool `name`, returned once it says "paused" (see the module's docstring)."""
    assert not (c and jump), "a jump of the clock needs the Python path"
    w = spawn_py(WORKER, name, where, str(n), str(jump), str(band), "1" if c else "0")
    _workers.append(w)
    assert w.stdout.readline() == b"paused\n", w.stderr.read().decode()
    return w


def go_on(w: subprocess.Popen, timeout: float = 120) -> dict:
    """Let a paused filler go on to its end: restore's report."""
    w.stdin.write(b"\n")
    w.stdin.flush()
    line = w.stdout.readline()
    assert w.wait(timeout=timeout) == 0, w.stderr.read().decode()
    return json.loads(line)


def kill(w: subprocess.Popen) -> None:
    w.send_signal(signal.SIGKILL)
    w.wait(timeout=60)


@pytest.fixture(autouse=True)
def no_filler_left():
    """A filler a failed test left paused is killed (it would wait on its stdin for ever)."""
    yield
    while _workers:
        w = _workers.pop()
        if w.poll() is None:
            kill(w)
        for pipe in (w.stdin, w.stdout, w.stderr):
            pipe.close()
