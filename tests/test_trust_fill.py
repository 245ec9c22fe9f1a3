"""What a pool's fill mark and a snapshot's files can make another process do (issue 40, items 1 and 4).

The fill mark lives in the segment's header, so anyone who may write the
pool (a member of a 0660 pool's group) may write it.  A process follows it
only as far as it would trust the snapshot itself: a manifest of this user
or root, in a directory nobody else may write, never through a symlink, of
the pool's geometry, with the size and checksum the mark says; otherwise the
mark is not followed at all (no file opened, no index built, no persist or
boot restore held up by it).  And every snapshot file or pack mapped is
fenced against SIGBUS as the segment is: one cut short while it is read is
an error naming the file (exit 65), and nothing read from it is published.
Real processes, real files; the other user is uid 65534 (root only).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys

import pytest

from cortex_cache import Pool, SnapshotCorrupt
from cortex_cache import persist as snap
from cortex_cache.layout import FILL_RUNNING

from .helpers import as_user, cli, make_value, run_py, spawn_py

OTHER_UID, GROUP = 65534, 54321
MIB = 1 << 20
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root to make")
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")


def one_line(r, code: int) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- item 4: files cut short while read


TRUNCATING_RESTORE = """
import os, sys
from cortex_cache import SnapshotCorrupt, persist
path, name, victim, replace = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
calls = 0

def progress(done, total):
    global calls
    calls += 1
    if calls == 1:  # the owner truncates the file while it is read
        os.truncate(victim, 4096)

try:
    pool, _ = persist.restore(None if path == "-" else path, name=name, replace=replace, progress=progress)
except SnapshotCorrupt as e:
    print(e, flush=True)
    sys.exit(65)
pool.close()
"""


def test_a_snapshot_file_cut_short_while_it_is_restored_is_an_error_naming_it(make_pool, tmp_path, pool_name):
    p = make_pool("32M")
    for i in range(12):
        p.put(f"k{i}", make_value(i, 0, MIB))
    path = tmp_path / "s.ccsnap"
    snap.persist(p, path)
    r = run_py(TRUNCATING_RESTORE, str(path), pool_name, str(path), "0", check=False)
    assert r.returncode == 65, (r.returncode, r.stderr.decode()[-800:])  # not -SIGBUS
    assert str(path) in r.stdout.decode() and "cut short" in r.stdout.decode()
    assert not Pool.exists(pool_name)  # nothing published


def test_a_pack_cut_short_while_it_is_restored_leaves_the_pool_as_it_was(make_pool, snapshot_dir):
    p = make_pool("32M")
    for i in range(12):
        p.put(f"k{i}", make_value(i, 0, MIB))
    snap.persist(p)
    p.put("k0", b"kept")
    pack = next(snapshot_dir.glob("*.ccpack"))
    r = run_py(TRUNCATING_RESTORE, "-", p.name, str(pack), "1", check=False)
    assert r.returncode == 65, (r.returncode, r.stderr.decode()[-800:])
    assert str(pack) in r.stdout.decode() and "cut short" in r.stdout.decode()
    assert not p.superseded and p.get("k0") == b"kept" and len(p) == 12


def test_snapshots_verify_of_a_pack_cut_short_is_a_damaged_snapshot(make_pool, snapshot_dir):
    p = make_pool("32M")
    for i in range(12):
        p.put(f"k{i}", make_value(i, 0, MIB))
    snap.persist(p)
    pack = next(snapshot_dir.glob("*.ccpack"))
    code = """
import os, sys
from cortex_cache import SnapshotCorrupt
from cortex_cache.snapshot import Snapshot
with Snapshot(sys.argv[1], verify=False, private=True) as s:
    reader = s.pack_reader(0)
    os.truncate(sys.argv[2], 4096)  # mapped whole, then cut short: the verify reads past its new end
    try:
        s.verify()
    except SnapshotCorrupt as e:
        print(e)
        sys.exit(65)
"""
    r = run_py(code, str(snap.latest_path(p.name)), str(pack), check=False)
    assert r.returncode == 65 and "cut short" in r.stdout.decode() and str(pack) in r.stdout.decode(), r
