"""Evictions by a process that cannot write the disk tier never lose entries silently (issue 29, item 5).

A process that cannot open the tier's files (another user's tier, a low
descriptor limit) or whose writes to it fail must not evict entries that
were meant to go to disk: the eviction is refused (the entry stays in
memory and the command fails), or an entry that did leave memory and could
not be written is reported as an error -- never an exit 0.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from cortex_cache import Pool
from tests.helpers import REPO, as_user, run_py

VALUE = 20_000  # five 4 KiB blocks
LIMIT = 12  # descriptors: enough for the interpreter and a segment, not for the tier's 17 files


def low_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, hard))


def cli_limited(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cortex_cache", *args], capture_output=True, cwd=REPO,
                          preexec_fn=low_fd_limit, timeout=60)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    err = r.stderr.decode()
    assert r.returncode != 0, (r.returncode, r.stdout, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def tier_pool(make_pool, tmp_path, n: int = 3, **kw) -> Pool:
    p = make_pool("256K", block_size="4K", disk_path=tmp_path / "tier", disk_size="1M", **kw)
    for i in range(n):
        p.put(f"k{i}", bytes([i]) * VALUE)
    return p


def present(p: Pool, n: int) -> list[str]:
    return [f"k{i}" for i in range(n) if p.get(f"k{i}") == bytes([i % 256]) * VALUE]


def test_evict_by_a_process_that_cannot_open_the_tier_keeps_the_entries(make_pool, tmp_path):
    p = tier_pool(make_pool, tmp_path)
    r = cli_limited("cache", "evict", p.name, "--all")
    err = one_line_error(r)
    assert r.returncode in (71, 74, 75, 77), err
    assert "disk tier" in err and "--tier all" in err
    assert len(p) == 3 and present(p, 3) == ["k0", "k1", "k2"]
    assert p.stats()["evictions"] == 0
    # Dropping them without spilling is still possible, and says so.
    r = cli_limited("cache", "evict", p.name, "--all", "--tier", "all")
    assert r.returncode == 0, r.stderr
    assert len(p) == 0


def test_evict_by_key_and_percent_refused_too(make_pool, tmp_path):
    p = tier_pool(make_pool, tmp_path)
    for sel in (["--key", "k1"], ["--percent", "50"], ["--prefix", "k"], ["--bytes", "1"]):
        one_line_error(cli_limited("cache", "evict", p.name, *sel))
    assert present(p, 3) == ["k0", "k1", "k2"]
    # Expired entries are not spilled: evicting them needs no tier.
    r = cli_limited("cache", "evict", p.name, "--expired")
    assert r.returncode == 0, r.stderr


def test_puts_that_need_room_refuse_to_evict_what_cannot_be_spilled(make_pool, tmp_path):
    p = tier_pool(make_pool, tmp_path)
    code = f"""
    import json, os, resource
    from cortex_cache import Pool, CortexCacheError
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
    q = Pool.open({p.name!r})
    assert not q.stats()["disk"]["available"]
    stored, errors = [], []
    for i in range(3, 40):
        try:
            q.put(f"k{{i}}", bytes([i]) * {VALUE})
            stored.append(i)
        except CortexCacheError as e:
            errors.append((type(e).__name__, e.exit_code, str(e)))
    q.close()
    print(json.dumps({{"stored": stored, "errors": errors}}))
    """
    out = json.loads(run_py(code).stdout)
    assert out["errors"], "a full pool whose tier this process cannot write accepted every put"
    assert all(code in (71, 74, 75, 77) and "disk tier" in msg for _, code, msg in out["errors"]), out["errors"]
    # Nothing that was stored is gone: the old entries and every put that succeeded are still there.
    want = [f"k{i}" for i in [0, 1, 2, *out["stored"]]]
    assert present(p, 40) == sorted(want, key=lambda k: int(k[1:]))


FAILING_WRITES = """
import errno, json, re, sys
from cortex_cache import Pool, CortexCacheError
from cortex_cache.disklog import DiskLog
def fail(*a, **k):
    raise OSError(errno.EIO, "Input/output error")
DiskLog.write = fail
"""


def test_a_failed_spill_write_never_loses_an_entry_silently(make_pool, tmp_path):
    p = tier_pool(make_pool, tmp_path)
    code = FAILING_WRITES + f"""
q = Pool.open({p.name!r})
stored, lost, refused = [], 0, 0
for i in range(3, 30):
    try:
        q.put(f"k{{i}}", bytes([i]) * {VALUE})
        stored.append(i)
    except CortexCacheError as e:
        assert e.exit_code == 74 and "disk tier" in str(e), str(e)
        if "lost" in str(e):
            lost += int(re.search(r"(\\d+) entr", str(e)).group(1))
            stored.append(i)  # the put itself stored its value; an evicted entry was lost and said so
        else:
            refused += 1
q.close()
print(json.dumps({{"stored": stored, "lost": lost, "refused": refused}}))
"""
    out = json.loads(run_py(code).stdout)
    assert out["refused"] > 0
    want = [0, 1, 2, *out["stored"]]
    missing = [i for i in want if p.get(f"k{i}") != bytes([i]) * VALUE]
    # Every entry that is gone was reported as lost by the put that evicted it.
    assert len(missing) <= out["lost"], (missing, out)


def test_explicit_evict_whose_spill_write_fails_keeps_the_entry(make_pool, tmp_path):
    p = tier_pool(make_pool, tmp_path)
    code = FAILING_WRITES + f"""
from cortex_cache.cli import main
sys.exit(main(["cache", "evict", {p.name!r}, "--all"]))
"""
    r = run_py(code, check=False)
    err = one_line_error(r)
    assert r.returncode == 74 and "disk tier" in err, err
    assert present(p, 3) == ["k0", "k1", "k2"]
    assert p.stats()["disk"]["entries"] == 0



OTHER_UID = 65534


def _unreadable_to_other_user() -> str | None:
    """Which of the package's and its libraries' files the other user cannot read (None: it can read them
    all).  A checkout or a venv under a directory only its owner may enter (a clone in a 0700 home) keeps
    them out of that user's reach: the command's lazy imports would fail there (rich's, at its first
    message), a failure of the machine, not of what these tests test."""
    import cortex_cache
    import rich
    import typer

    dirs = [os.path.dirname(m.__file__) for m in (cortex_cache, rich, typer)]

    def probe() -> int:  # 0, or 1 + the index of the first directory it cannot read
        for n, d in enumerate(dirs):
            try:
                for name in os.listdir(d):
                    if name.endswith(".py"):
                        with open(os.path.join(d, name), "rb"):
                            pass
            except OSError:
                return 1 + n
        return 0

    got = as_user(probe, OTHER_UID)
    return None if got == 0 else dirs[got - 1] if got <= len(dirs) else f"the probe failed ({got})"


def as_other_user(argv: list[str]) -> int:
    """The CLI's exit status for `argv`, run in a forked child as another user (stderr to /dev/null).

    The interpreter's own files may be out of that user's reach: what the command imports is imported
    here first (a read-only command of the same pool, and what an error message needs); where the
    package's own files are out of its reach the test is skipped, saying so."""
    import colorsys  # noqa: F401  (imported lazily by rich, to print)
    import fractions  # noqa: F401  (imported lazily by the size parser)

    from cortex_cache.cli import main

    unreadable = _unreadable_to_other_user()
    if unreadable is not None:
        pytest.skip(f"uid {OTHER_UID} cannot read the package's files ({unreadable}): the checkout or its venv "
                    "is in a directory other users cannot enter; run from one they can to test another user")
    main(["cache", "keys", argv[2], "--limit", "1"])

    def run() -> int:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        return main(argv)

    return as_user(run, OTHER_UID)


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's process needs root to start")
def test_another_users_evict_all_keeps_the_entries_it_cannot_spill(make_pool, tmp_path):
    p = tier_pool(make_pool, tmp_path, mode=0o666)  # a pool anyone may write; its tier stays the owner's
    assert as_other_user(["cache", "evict", p.name, "--all"]) == 77
    assert present(p, 3) == ["k0", "k1", "k2"]
    # What it may do: drop them without spilling, as asked.
    assert as_other_user(["cache", "evict", p.name, "--all", "--tier", "all"]) == 0
    assert len(p) == 0
