"""The CLI's documentation surfaces and output rules.

- `-q/--quiet` silences confirmations and progress bars, never data or errors;
- `--help` loads neither numpy nor torch;
- the shell completions in completions/ and the man page man/cortex.1 are
  what scripts/gen_docs.py makes from the command tree today (stale = fail),
  and they work: bash/zsh/fish offer commands, options, choices and pools;
- the man page renders without warnings and names every command, option and
  exit code;
- the README's CLI usage examples show the output the commands really give.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, cli, run_py
from tests.test_cli import cleanup, failed, fill, lib_keys, lib_stats, new_pool, ok, seg_path, show  # noqa: F401

# ---------------------------------------------------------------- -q / --quiet


def _read_pty(master: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            return out
        if not chunk:
            return out
        out += chunk


@pytest.mark.parametrize(
    "where",
    [
        pytest.param("root", id="cortex-q-cache"),
        pytest.param("group", id="cache-q-cmd"),
        pytest.param("command", id="cmd-q"),
        pytest.param("command-long", id="cmd--quiet"),
    ],
)
def test_quiet_silences_confirmations(pool_name, cleanup, tmp_path, where):
    def run(*args: str) -> subprocess.CompletedProcess:
        if where == "root":
            argv = ["-q", "cache", *args]
        elif where == "group":
            argv = ["cache", "-q", *args]
        else:
            argv = ["cache", *args, "-q" if where == "command" else "--quiet"]
        r = cli(*argv)
        assert r.returncode == 0, show(r)
        assert r.stdout == b"" and r.stderr == b"", (argv, show(r))
        return r

    name = pool_name
    cleanup.append(name)
    run("create", name, "--size", "1M", "--block-size", "4K")
    assert seg_path(name).is_file()
    fill(name, [("a", b"A" * 100), ("b", b"B" * 200)])
    run("verify", name)
    snap = tmp_path / "s.ccsnap"
    run("persist", name, "--output", str(snap))
    assert snap.stat().st_size > 300
    run("evict", name, "--key", "a")
    assert lib_keys(name) == ["b"]
    run("restore", name, "--input", str(snap), "--replace")
    assert lib_keys(name) == ["a", "b"]
    run("put", name, "c", str(snap))
    run("delete", name)
    assert not seg_path(name).exists()
    # "no pools" is a note for a person too
    env_prefix = os.environ["CORTEX_CACHE_SHM_PREFIX"] + "none."
    for args in (["list"], ["status"]):
        r = cli(*(["-q", "cache"] if where == "root" else ["cache", "-q"]), *args,
                env={"CORTEX_CACHE_SHM_PREFIX": env_prefix})
        assert r.returncode == 0 and r.stdout == b"" and r.stderr == b"", show(r)


def test_without_quiet_the_same_commands_confirm(pool_name, cleanup, tmp_path):
    """The other half of the test above: the confirmations exist and -q is what removes them."""
    name = pool_name
    cleanup.append(name)
    assert f"created pool {name}" in ok(cli("cache", "create", name, "--size", "1M", "--block-size", "4K")).stdout.decode()
    fill(name, [("a", b"A" * 100)])
    assert f"pool {name}: ok" in ok(cli("cache", "verify", name)).stdout.decode()
    snap = tmp_path / "s.ccsnap"
    assert "persisted 1 entries" in ok(cli("cache", "persist", name, "-o", str(snap))).stdout.decode()
    assert "evicted 1 entries" in ok(cli("cache", "evict", name, "--all")).stdout.decode()
    assert "restored 1 entries" in ok(cli("cache", "restore", name, "-i", str(snap), "--replace")).stdout.decode()
    r = cli("cache", "list", env={"CORTEX_CACHE_SHM_PREFIX": os.environ["CORTEX_CACHE_SHM_PREFIX"] + "none."})
    assert r.returncode == 0 and r.stderr == b"no pools\n", show(r)


def test_quiet_keeps_data_json_and_errors(new_pool, pool_name, cleanup, tmp_path):
    name = new_pool()
    fill(name, [("k1", b"\x00value\xff"), ("k2", b"two")])
    assert ok(cli("cache", "-q", "get", name, "k1")).stdout == b"\x00value\xff"
    assert ok(cli("cache", "keys", name, "-q")).stdout == b"k1\nk2\n"
    assert json.loads(ok(cli("-q", "cache", "status", name, "--json")).stdout)["entries"] == 2
    assert name in ok(cli("cache", "status", name, "-q")).stdout.decode()
    assert name in ok(cli("cache", "list", "-q")).stdout.decode()
    prom = ok(cli("cache", "status", name, "--format", "prometheus", "-q")).stdout.decode()
    assert f'cortex_cache_entries{{pool="{name}"}} 2' in prom
    doc = json.loads(ok(cli("cache", "evict", name, "--key", "k2", "--json", "-q")).stdout)
    assert doc == {"pool": name, "entries": 1, "bytes": 3}
    created = f"{pool_name}-json"
    cleanup.append(created)
    doc = json.loads(ok(cli("cache", "create", created, "--size", "1M", "--json", "--quiet")).stdout)
    assert doc["name"] == created and doc["size_bytes"] == 1 << 20
    out = tmp_path / "s.ccsnap"
    doc = json.loads(ok(cli("cache", "persist", name, "-o", str(out), "--json", "-q")).stdout)
    assert doc["entries"] == 1 and doc["path"] == str(out)

    # errors: still one line on stderr and the exit code
    failed(cli("-q", "cache", "status", f"{pool_name}-missing"), 66)
    failed(cli("cache", "get", name, "nokey", "-q"), 66)
    failed(cli("cache", "-q", "create", name, "--size", "1M"), 73)
    msg = failed(cli("cache", "evict", name, "-q"), 2)
    assert "exactly one of" in msg


def test_quiet_verify_still_reports_problems(new_pool):
    from cortex_cache import Pool

    name = new_pool()
    fill(name, [("a", b"A" * 5000)])
    with Pool.open(name) as p:
        off = p.geometry.data_off + p.info("a")["first_block"] * p.geometry.block_size
    with open(seg_path(name), "r+b") as f:
        f.seek(off + 10)
        f.write(b"corrupt!")
    r = cli("cache", "verify", name, "-q")
    assert r.returncode == 1, show(r)
    text = r.stdout.decode()
    assert f"pool {name}: " in text and f"pool {name}: ok" not in text, show(r)  # the problem, no "ok" line


@pytest.mark.parametrize("quiet", [False, True], ids=["progress", "quiet"])
def test_quiet_silences_the_progress_bar_on_a_terminal(new_pool, tmp_path, quiet):
    name = new_pool()
    fill(name, [("a", b"A" * 100)])
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cortex_cache", "cache", "persist", name, "-o", str(tmp_path / "s"), *(["-q"] if quiet else [])],
        stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, cwd=REPO,
    )
    os.close(slave)
    try:
        err = _read_pty(master)
    finally:
        os.close(master)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, err
    assert (tmp_path / "s").is_file()
    if quiet:
        assert out == b"" and err == b"", (out, err)
    else:
        assert b"persisted 1 entries" in out
        assert f"persist {name}".encode() in err, err  # the bar, drawn on the terminal


# ---------------------------------------------------------------- startup


def test_help_loads_neither_numpy_nor_torch():
    """`cortex --help`, `cortex cache --help` and every command's --help, in one child."""
    out = run_py(
        """
        import contextlib, io, json, sys
        from cortex_cache.cli import app, main
        import typer
        cmds = sorted(typer.main.get_command(app).commands["cache"].commands)
        res = {}
        for argv in [["--help"], ["cache", "--help"]] + [["cache", c, "--help"] for c in cmds]:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = main(argv)
            res[" ".join(argv)] = [rc, len(buf.getvalue())]
        print(json.dumps({"helps": res, "loaded": [m for m in ("numpy", "torch") if m in sys.modules]}))
        """
    )
    doc = json.loads(out.stdout)
    assert len(doc["helps"]) == 13, doc
    for argv, (rc, n) in doc["helps"].items():
        assert rc == 0 and n > 100, (argv, rc, n)
    assert doc["loaded"] == []


# ---------------------------------------------------------------- Typer's completion protocol


def test_typer_completion_protocol_through_main():
    """`_CORTEX_COMPLETE=complete_bash` (Typer's own scripts, powershell) is answered by main()."""
    env = {"_CORTEX_COMPLETE": "complete_bash", "COMP_WORDS": "cortex cache cr", "COMP_CWORD": "2"}
    r = cli(env=env)
    assert r.returncode == 0 and r.stdout.split() == [b"create"], show(r)
    env.update(COMP_WORDS="cortex cache create x --policy ", COMP_CWORD="5")
    r = cli(env=env)
    assert r.returncode == 0 and r.stdout.split() == [b"lru", b"lfu", b"fifo", b"priority", b"ttl", b"size"], show(r)
    r = cli(env={"_CORTEX_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "cortex cache del"})
    assert r.returncode == 0 and b'"delete"' in r.stdout, show(r)
