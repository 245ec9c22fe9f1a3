"""A newcomer's pass over the restart (issue 39's loose ends): what was wrong, each found by trying it.

- `delete` of a pool whose background fill runs was refused naming a pid nobody had started (the filler's):
  it now says that a restore fills the pool, and that --force stops the fill too (which it does).
- `restore --mode 0777` of a 0600 snapshot suggested `--mode 0711`: execute bits mean nothing to a pool, so
  the suggestion is the read and write bits it may have.
- `persist --output -` wrote a file named "-" and `restore --input -` read one, where `get -o -` and `put -`
  mean the standard streams: refused in one line (exit 2), `./-` names such a file.
"""

from __future__ import annotations

import os
import subprocess
import sys

from cortex_cache import Pool
from cortex_cache import persist as snap

from .fillers import go_on, no_filler_left, start  # noqa: F401 (no_filler_left: autouse)
from .helpers import cli, make_value

N = 40


def one_line(r, code: int) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_delete_during_a_background_fill_names_the_fill_and_force_stops_it(make_pool, snapshot_dir):
    p = make_pool("4M", block_size=4096)
    for i in range(N):
        p.put(f"k{i}", make_value(i, 0, 2048))
    snap.persist(p)
    name = p.name
    p.close()
    Pool.unlink(name)
    w = start(name)  # a restore, paused after its first batch: the fill runs
    err = one_line(cli("cache", "delete", name), 75)
    assert f"pid {w.pid}" in err and "a restore is filling it from its snapshot" in err and "--force" in err
    with Pool.open(name) as q:  # nothing changed
        assert q.stats()["fill"]["state"] == "filling" and q.get(f"k{N - 1}") == make_value(N - 1, 0, 2048)
    r = cli("cache", "delete", name, "--force")
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert not Pool.exists(name)
    report = go_on(w)  # the filler sees its pool gone: it stops, and makes nothing again
    assert report["ended"] == "stopped" and not Pool.exists(name)


def test_a_delete_of_a_pool_in_use_without_a_fill_says_nothing_of_one(make_pool):
    p = make_pool("1M")
    r = cli("cache", "delete", p.name)
    err = one_line(r, 75)
    assert "in use" in err and "fill" not in err and Pool.exists(p.name)


def test_a_mode_wider_than_the_snapshot_suggests_read_and_write_bits_only(make_pool, tmp_path, pool_name):
    p = make_pool("1M")
    p.put("k", b"v")
    path = tmp_path / "s.ccsnap"
    snap.persist(p, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    err = one_line(cli("cache", "restore", pool_name, "--input", str(path), "--mode", "0777"), 77)
    assert "give --mode 0600 or narrower" in err
    assert not Pool.exists(pool_name)


def test_a_dash_for_a_snapshot_file_is_refused_not_taken_as_a_file_named_dash(make_pool, tmp_path, pool_name):
    """`get -o -` writes stdout and `put -` reads stdin; `persist --output -` wrote a file named "-" in the
    current directory and `restore --input -` read one: both are one line, exit 2, nothing made."""
    p = make_pool("1M")
    p.put("k", b"v")
    (tmp_path / "sub").mkdir()
    here = tmp_path / "sub"

    def cli_in(*args: str):  # the CLI run in `here`, where a file named "-" would land
        return subprocess.run([sys.executable, "-m", "cortex_cache", *args], capture_output=True, cwd=here,
                              timeout=60)

    r = cli_in("cache", "persist", p.name, "--output", "-")
    assert "stdout" in one_line(r, 2) and not os.listdir(tmp_path / "sub")
    snap.persist(p, tmp_path / "sub" / "-")
    r = cli_in("cache", "restore", pool_name, "--input", "-")
    assert "stdin" in one_line(r, 2) and not Pool.exists(pool_name)
    r = cli_in("cache", "restore", pool_name, "--input", "./-")  # the way to name it
    assert r.returncode == 0, r.stderr
    Pool.unlink(pool_name)
