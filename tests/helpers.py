"""Helpers for tests that spawn processes: run Python code or the CLI in a child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_py(code: str, *args: str, check: bool = True, timeout: float = 60, input: bytes | None = None,
           env: dict | None = None):
    """Run `code` in a fresh Python process (same env and prefix, plus `env`); return CompletedProcess."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        timeout=timeout,
        input=input,
        cwd=REPO,
        env={**os.environ, **env} if env else None,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stderr.decode()}")
    return proc


def spawn_py(code: str, *args: str) -> subprocess.Popen:
    """Start `code` in a fresh Python process with pipes; the caller waits or kills it."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )


def cli(*args: str, input: bytes | None = None, env: dict | None = None, timeout: float = 60):
    """Run `python -m cortex_cache ARGS`; return CompletedProcess (bytes)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "cortex_cache", *args],
        capture_output=True,
        input=input,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
    )


def as_user(fn, uid: int = 65534, gid: int | None = None) -> int:
    """fn() in a forked child running as another user (no exec; no supplementary groups, group `gid`,
    default `uid`): its return value (an exit status, 0-255), 98 if it raised, 97 if it died."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 98
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            code = int(fn())
        except BaseException:
            code = 98
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    return got[0] if got else 97


def make_value(key_id: int, version: int, size: int) -> bytes:
    """A self-describing value: readers can check it is whole and untorn."""
    import struct

    import numpy as np

    body = ((np.arange(max(0, size - 12), dtype=np.uint64) * 7 + key_id * 31 + version) % 251).astype(np.uint8)
    return struct.pack("<III", key_id, version, size) + body.tobytes()


def check_value(value: bytes) -> tuple[int, int]:
    """(key_id, version) of a value made by make_value; AssertionError if torn."""
    import struct

    key_id, version, size = struct.unpack_from("<III", value)
    assert len(value) == size, f"value of key {key_id} v{version}: length {len(value)} != {size}"
    assert value == make_value(key_id, version, size), f"value of key {key_id} v{version} is torn"
    return key_id, version


# What reading damaged input may cost: a damaged length or count must be checked against the real
# size of what holds it, never trusted with an allocation.  The fuzz tests run under this bound.
FUZZ_MEMORY_BOUND = 256 << 20

# Cases the damage fuzz (test_fuzz.py, test_persist.py) draws in its largest tests: 200 in the default
# run, 1,000 in the long form .ci/run runs (CORTEX_FUZZ_EXAMPLES=1000); the others draw a share of it.
FUZZ_EXAMPLES = int(os.environ.get("CORTEX_FUZZ_EXAMPLES", "200"))


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


class memory_bound:
    """Within the block, this process may map at most `extra` bytes more than it has now (RLIMIT_AS).

    An allocation beyond it raises MemoryError (or fails an mmap), which no fuzz test accepts.
    """

    def __init__(self, extra: int = FUZZ_MEMORY_BOUND) -> None:
        self.extra = extra

    def __enter__(self) -> "memory_bound":
        import resource

        self._saved = resource.getrlimit(resource.RLIMIT_AS)
        hard = self._saved[1]
        soft = _vm_size() + self.extra
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        return self

    def __exit__(self, *exc) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, self._saved)
