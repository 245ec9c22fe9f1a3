"""/dev/shm filled by another process mid-run: clean errors, no SIGBUS, nothing changed or left behind.

Filling the host's /dev/shm (24 GiB here) is not something a test may do, so
the child runs in a mount namespace of its own (`unshare -m`, root) with a
48 MiB tmpfs over /dev/shm: the host's is untouched, and the small one
vanishes with the namespace.  Skipped where mount namespaces are not allowed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO

CHILD = r'''
import json, os, subprocess, sys
from cortex_cache import NoSpace, Pool
from tests.helpers import check_value, make_value

tmp = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=1777", "tmpfs", "/dev/shm"], check=True)
out = {}
a = Pool.create("a", "16M", block_size="16K")
for i in range(200):
    a.put(f"k{i}", make_value(i, 0, 30_000))
snap = str(a.persist(os.path.join(tmp, "a.ccsnap")))

# Another process takes every free page of /dev/shm; write() tells it ENOSPC (it maps nothing).
subprocess.run([sys.executable, "-c", FILL], check=True)
st = os.statvfs("/dev/shm")
out["free_after_fill"] = st.f_bavail * st.f_frsize

# The pool's pages were reserved at create: it keeps working, evicting as it fills; no SIGBUS.
for i in range(200, 1200):
    a.put(f"k{i}", make_value(i, 1, 30_000 + i % 7 * 1000))
    if i % 3 == 0:
        a.delete(f"k{i - 1}")
seen = 0
for i in range(1200):
    v = a.get(f"k{i}")
    if v is not None:
        check_value(v)
        seen += 1
with a.view("k1199") as view:
    check_value(bytes(view))
out["entries_after_fill"] = seen
out["evictions"] = a.stats()["evictions"]
keys_before = sorted(a.keys())


def refused(fn):
    try:
        fn()
    except NoSpace as e:
        return [e.exit_code, str(e)]
    return None


# New segments (a pool from the API or the CLI, a restore): clean errors, nothing left behind.
out["create"] = refused(lambda: Pool.create("b", "1M"))
out["b_exists"] = Pool.exists("b")
r = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", "create", "c", "--size", "1M"],
                   capture_output=True)
out["cli"] = [r.returncode, r.stderr.decode().splitlines()]
out["restore"] = refused(lambda: Pool.restore(snap, name="d"))
# A sparse pool's metadata is written by create itself: refused (73) before any page could be missing.
r = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", "create", "e", "--size", "256M", "--no-reserve"],
                   capture_output=True)
out["no_reserve"] = [r.returncode, r.stderr.decode().splitlines()]
# Replacing a pool builds the new one beside it before the swap: it needs the room, and changes nothing without.
out["replace"] = refused(lambda: Pool.restore(snap, name="a", replace=True))
out["a_unchanged"] = sorted(a.keys()) == keys_before and all(check_value(a.get(k)) for k in keys_before)
out["segments_while_full"] = sorted(n for n in os.listdir("/dev/shm") if n != "filler")

# Space back: the same restores work.  (A handle on a replaced pool keeps its memory until it
# closes, as after a delete: closed here so that the second restore below has room too.)
os.unlink("/dev/shm/filler")
a.close()
with Pool.restore(snap, name="a", replace=True) as again:
    out["replaced"] = sorted(again.keys()) == sorted(f"k{i}" for i in range(200)) and all(
        check_value(again.get(f"k{i}")) == (i, 0) for i in range(200))
with Pool.restore(snap, name="d") as d:
    out["restored_after"] = len(d)
Pool.unlink("d")
Pool.unlink("a")
out["left"] = os.listdir("/dev/shm")
print(json.dumps(out))
'''

FILL = '''
import errno, os
fd = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY, 0o600)
page = b"f" * 4096
while True:
    try:
        os.write(fd, page)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
        break
'''

UNSHARE = ["unshare", "--mount", "--propagation", "private"]


def _private_shm_possible() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    r = subprocess.run([*UNSHARE, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _private_shm_possible(),
                    reason="needs root and mount namespaces (unshare --mount) for a private /dev/shm")
def test_dev_shm_filled_by_another_process_gives_clean_errors_and_no_sigbus(tmp_path):
    code = CHILD.replace("FILL]", repr(FILL) + "]")
    r = subprocess.run([*UNSHARE, sys.executable, "-c", code, str(tmp_path)], capture_output=True, cwd=REPO,
                       timeout=240)
    assert r.returncode == 0, f"exit {r.returncode} (-7 is SIGBUS):\n{r.stderr.decode()[-3000:]}"
    out = json.loads(r.stdout)
    assert out["free_after_fill"] < 16 << 10
    assert out["entries_after_fill"] > 300 and out["evictions"] > 0
    for what in ("create", "restore", "replace"):
        assert out[what] is not None and out[what][0] == 73, (what, out[what])
    assert not out["b_exists"] and out["a_unchanged"] and out["replaced"]
    code, stderr = out["no_reserve"]
    assert code == 73 and len(stderr) == 1, out["no_reserve"]  # not -7 (SIGBUS), and nothing left behind
    code, stderr = out["cli"]
    assert code == 73 and len(stderr) == 1 and "not enough shared memory" in stderr[0], out["cli"]
    assert out["segments_while_full"] == [os.environ["CORTEX_CACHE_SHM_PREFIX"] + "a"], out["segments_while_full"]
    assert out["restored_after"] == 200 and out["left"] == []
