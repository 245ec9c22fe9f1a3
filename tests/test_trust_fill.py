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
import subprocess
import sys

import pytest

from cortex_cache import Pool
from cortex_cache import persist as snap
from cortex_cache.fill import FILL_BYTE
from cortex_cache.layout import FILL_RUNNING
from cortex_cache.lock import RecordLock

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


# ---------------------------------------------------------------- item 1: the fill mark is another process's word


def forge_mark(pool: Pool, path: str | bytes, snapshot=None) -> None:
    """Write pool's fill mark as any writer of its segment can: RUNNING, naming `path`, and (given the
    snapshot) with the checksum, entries and bytes that make the mark agree with it."""
    h = pool.core.header[0]
    h["fill_gen"] = int(h["fill_gen"]) + 1
    h["fill_path"] = path.encode() if isinstance(path, str) else path
    h["fill_done"] = 0
    if snapshot is not None:
        h["fill_check"], h["fill_total"], h["fill_bytes_total"] = snapshot
    h["fill_state"] = FILL_RUNNING


def mark_of(path) -> tuple[int, int, int]:
    with snap.Snapshot(path, verify=False) as s:
        return s.file_check, s.entries, s.value_bytes


def persisted_elsewhere(make_pool, directory, size="4M", puts=(("secret", b"not this pool's"),), **kw):
    """A snapshot in `directory` (a snapshot directory of its own) of a pool made for the purpose, deleted since:
    its manifest's path."""
    q = make_pool(size, **kw)
    for k, v in puts:
        q.put(k, v)
    old = os.environ.get("CORTEX_CACHE_SNAPSHOT_DIR")
    os.environ["CORTEX_CACHE_SNAPSHOT_DIR"] = str(directory)
    try:
        snap.persist(q)
    finally:
        os.environ["CORTEX_CACHE_SNAPSHOT_DIR"] = old
    return str(snap.latest_path(q.name, directory).resolve())


@root_only
def test_a_group_member_cannot_point_roots_process_at_a_snapshot_of_theirs(make_pool, tmp_path, snapshot_dir):
    p = make_pool("4M", mode=0o660)
    os.chown(p.core.seg.fd, -1, GROUP)
    theirs = tmp_path / "theirs"
    manifest = persisted_elsewhere(make_pool, theirs)  # a whole, genuine snapshot of the pool's shape...
    for f in [theirs, *theirs.iterdir()]:
        os.chown(f, OTHER_UID, OTHER_UID)  # ... that the group member wrote
    forged = mark_of(manifest)

    def member() -> int:
        with Pool.open(p.name) as q:
            forge_mark(q, manifest, forged)
        return 0

    assert as_user(member, OTHER_UID, GROUP) == 0
    with Pool.open(p.name) as mine:  # root opens the pool: the member's snapshot is never served to it
        assert "secret" not in mine and mine.get("secret") is None
    r = cli("cache", "persist", p.name)  # never held up by a fill it would not follow
    assert r.returncode == 0, r.stderr
    r = cli("cache", "restore", p.name, "--if-missing", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["skipped"] and "not followed" in json.loads(r.stdout)["fill_not_resumed"]


@needs_strace
def test_a_forged_mark_never_makes_a_process_open_the_file_it_names(make_pool, tmp_path):
    p = make_pool("4M")
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not a snapshot")
    forge_mark(p, str(secret))
    log = tmp_path / "trace"
    code = "import sys; from cortex_cache import Pool; q = Pool.open(sys.argv[1]); q.get('k'); 'k' in q; q.close()"
    r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=open,openat,openat2", "-o", str(log), sys.executable,
                        "-c", code, p.name], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert "cortex" in log.read_text() and str(secret) not in log.read_text()


def test_a_mark_naming_a_snapshot_of_another_pool_is_not_followed(make_pool, tmp_path, snapshot_dir):
    """Ours, whole, with the checksum the mark says -- but of another, larger pool: its entries (another
    pool's data) are never served through this one, nor indexed at every open."""
    p = make_pool("4M")
    other = persisted_elsewhere(make_pool, tmp_path / "other", size="8M", block_size="4K",
                                puts=[(f"o{i}", b"x") for i in range(300)])
    forge_mark(p, other, mark_of(other))
    with Pool.open(p.name) as q:
        assert q.get("o1") is None and "o2" not in q and q.leading(["o3"]) == 0


def test_a_forged_running_mark_holds_up_neither_persist_nor_the_boot_restore(make_pool, snapshot_dir):
    p = make_pool("4M")
    p.put("k", b"v")
    forge_mark(p, "/etc/shadow")
    r = cli("cache", "persist", p.name)
    assert r.returncode == 0, r.stderr
    r = cli("cache", "restore", p.name, "--if-missing")
    assert r.returncode == 0, r.stderr
    assert b"exists; nothing restored" in r.stdout
    r = cli("cache", "snapshots", p.name, "--prune", "--keep", "1")
    assert r.returncode == 0, r.stderr


def test_status_shows_a_forged_path_with_its_escape_sequences_escaped(make_pool):
    p = make_pool("4M")
    forge_mark(p, b"/tmp/\x1b[31mred\x1b]0;title\x07[bold]x.ccsnap")
    RecordLock(p.core.seg.fd, FILL_BYTE).acquire()  # as a filler would: status says "filling ... from PATH"
    r = cli("cache", "status", p.name)
    assert r.returncode == 0, r.stderr
    assert b"\x1b" not in r.stdout and b"\x07" not in r.stdout and b"\\x1b[31mred" in r.stdout
    r = cli("cache", "status", p.name, "--json")
    assert b"\x1b" not in r.stdout and json.loads(r.stdout)["fill"]["snapshot"].startswith("/tmp/\x1b[31m")


WORKER = """
import sys
from cortex_cache import fill, persist
calls = 0

def progress(done, total):
    global calls
    calls += 1
    if calls == 1:
        print("paused", flush=True)
        sys.stdin.readline()

pool, report = persist.restore(None, name=sys.argv[1], progress=progress)
pool.close()
"""

READER = """
import sys
from cortex_cache import Pool
q = Pool.open(sys.argv[1])
assert "k7" in q  # indexed: the snapshot tier would bring it
assert q.get("k8") is not None  # brought from the pack: it is mapped now
print("indexed", flush=True)
sys.stdin.readline()
print(q.get("k7") is None, flush=True)
q.close()
"""


def test_a_pack_cut_short_under_a_process_reading_it_is_a_miss_not_a_sigbus(make_pool, snapshot_dir):
    p = make_pool("32M")
    for i in range(12):
        p.put(f"k{i}", make_value(i, 0, MIB))
    snap.persist(p)
    name = p.name
    p.close()
    Pool.unlink(name)
    w = spawn_py(WORKER, name)
    reader = None
    try:
        assert w.stdout.readline() == b"paused\n", w.stderr.read().decode()
        reader = spawn_py(READER, name)
        assert reader.stdout.readline() == b"indexed\n", reader.stderr.read().decode()
        pack = next(snapshot_dir.glob("*.ccpack"))
        os.truncate(pack, 4096)  # its owner cuts it short under the reader's mapping
        out, err = reader.communicate(b"\n", timeout=60)
        assert reader.returncode == 0, (reader.returncode, err.decode()[-1000:])  # not -SIGBUS
        assert out == b"True\n"
    finally:
        for child in (reader, w):
            if child is not None and child.poll() is None:
                child.send_signal(signal.SIGKILL)
                child.wait(timeout=60)
        if Pool.exists(name):
            Pool.unlink(name)
