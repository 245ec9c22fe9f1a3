"""The disk tier's storage engine: bounded files, checksummed records, recovery, many writers."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from cortex_cache import NoSpace, SegmentCorrupt, UsageError
from cortex_cache.disklog import ALIGN, CORRUPT, FILES, STALE, DiskLog, Found, Location
from tests.helpers import check_value, make_value, spawn_py

CAP = FILES * 64 * 1024  # 16 files of 64 KiB


@pytest.fixture
def tier(tmp_path):
    log = DiskLog.create(tmp_path / "tier", CAP)
    yield log
    log.close()


def test_append_and_read_back(tier, tmp_path):
    loc = tier.append(b"k1", b"hello", expiry=123.5, priority=7)
    got = tier.read(loc, b"k1")
    assert isinstance(got, Found) and got.value == b"hello" and got.expiry == 123.5 and got.priority == 7
    assert loc.offset % ALIGN == 0 and loc.length % ALIGN == 0
    assert tier.read(loc, b"k2") == STALE  # another key's location
    files = sorted(p.name for p in (tmp_path / "tier").iterdir())
    assert len(files) == FILES + 1  # bounded, whatever the number of entries
    for p in (tmp_path / "tier").iterdir():
        assert p.stat().st_mode & 0o777 == 0o600
        if p.name.endswith(".log"):
            assert p.stat().st_blocks * 512 >= 64 * 1024  # reserved, not sparse
    assert (tmp_path / "tier").stat().st_mode & 0o777 == 0o700


def test_the_ring_is_bounded_and_forgets_the_oldest(tier):
    value = os.urandom(20_000)  # 20 KiB on disk: 3 records per 64 KiB file
    n = 4 * FILES
    locs = [tier.append(f"k{i}".encode(), value) for i in range(n)]
    # The ring went round: the newest records read back, the oldest were overwritten.
    assert tier.read(locs[-1], f"k{n - 1}".encode()).value == value
    assert tier.read(locs[0], b"k0") == STALE
    readable = [isinstance(tier.read(loc, f"k{i}".encode()), Found) for i, loc in enumerate(locs)]
    assert sum(readable) <= 3 * FILES and readable[-3 * FILES + 3 :] == [True] * (3 * FILES - 3)
    assert tier.usage()["capacity"] == CAP


def test_damage_is_reported_never_returned(tier, tmp_path):
    loc = tier.append(b"k", b"x" * 5000)
    path = tmp_path / "tier" / f"tier-{loc.file:02d}.log"
    with open(path, "r+b") as f:
        f.seek(loc.offset + 64 + 1 + 100)
        f.write(b"Y")
    assert tier.read(loc, b"k") == CORRUPT
    assert tier.read(Location(99, 0, ALIGN, 1), b"k") == CORRUPT


def test_scan_finds_everything_after_a_restart(tmp_path):
    with DiskLog.create(tmp_path / "t", CAP) as log:
        written = {f"k{i}".encode(): make_value(i, 0, 1000 + 3000 * i) for i in range(10)}
        for k, v in written.items():
            log.append(k, v)
    with DiskLog.open(tmp_path / "t") as log:
        found = {r.key: log.read(r.loc, r.key) for r in log.scan()}
        assert {k: f.value for k, f in found.items()} == written
        loc = log.append(b"after", b"restart")  # the cursor carried on, not over old records
        assert all(isinstance(log.read(r.loc, r.key), Found) for r in log.scan() if r.key != b"after")
        assert log.read(loc, b"after").value == b"restart"


def test_bad_directories_and_sizes(tmp_path, monkeypatch):
    with pytest.raises(UsageError):
        DiskLog.create(tmp_path / "small", 1000)
    DiskLog.create(tmp_path / "t", CAP).close()
    with pytest.raises(UsageError):
        DiskLog.create(tmp_path / "t", CAP)  # already a tier there
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "cortex-tier.meta").write_bytes(b"not ours" * 100)
    with pytest.raises(SegmentCorrupt):
        DiskLog.open(tmp_path / "junk")

    def enospc(fd, off, length):  # a full disk, injected
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    with pytest.raises(NoSpace):
        DiskLog.create(tmp_path / "full", CAP)
    assert not (tmp_path / "full").exists()  # nothing half-made is left, not even the directory
    with pytest.raises(NoSpace):
        DiskLog.create(tmp_path / "a" / "b" / "full", CAP)
    assert not (tmp_path / "a").exists()  # nor the parents it made


def test_o_direct_or_its_fallback_round_trips(tmp_path):
    with DiskLog.create(tmp_path / "d", CAP, o_direct=True) as log:
        loc = log.append(b"k", make_value(1, 0, 10_000))
        assert check_value(log.read(loc, b"k").value) == (1, 0)


WRITER = """
import sys
from cortex_cache.disklog import DiskLog
from tests.helpers import make_value
path, wid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with DiskLog.open(path) as log:
    for i in range(n):
        loc = log.append(f"w{wid}-{i}".encode(), make_value(wid * 1000 + i, 0, 2000 + 37 * i))
        print(loc.file, loc.offset, loc.length, loc.seq, flush=True)
"""


def test_concurrent_appends_from_processes_never_overlap(tmp_path):
    big = FILES * 1024 * 1024
    DiskLog.create(tmp_path / "c", big).close()
    procs = [spawn_py(WRITER, str(tmp_path / "c"), str(w), "60") for w in range(3)]
    spans = []
    for w, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        for i, line in enumerate(out.decode().split("\n")[:-1]):
            f, off, length, seq = map(int, line.split())
            spans.append((f, off, off + length, w, i, seq))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        assert a[0] != b[0] or a[2] <= b[1], "two records overlap"
    assert len({s[5] for s in spans}) == len(spans)  # unique seqs
    with DiskLog.open(tmp_path / "c") as log:
        for f, off, end, w, i, seq in spans:
            got = log.read(Location(f, off, end - off, seq), f"w{w}-{i}".encode())
            assert check_value(got.value)[0] == w * 1000 + i


def test_sigkill_mid_append_leaves_the_rest_readable(tmp_path):
    DiskLog.create(tmp_path / "k", FILES * 1024 * 1024).close()
    child = spawn_py(WRITER, str(tmp_path / "k"), "5", "100000")
    for _ in range(25):
        child.stdout.readline()
    child.send_signal(signal.SIGKILL)
    child.wait()
    for f in (child.stdin, child.stdout, child.stderr):
        f.close()
    with DiskLog.open(tmp_path / "k") as log:
        found = list(log.scan())
        assert len(found) >= 25
        for r in found:
            check_value(log.read(r.loc, r.key).value)
        loc = log.append(b"after", b"kill")
        assert log.read(loc, b"after").value == b"kill"


def test_killed_records_stay_dead_after_a_restart(tmp_path):
    with DiskLog.create(tmp_path / "t", FILES * 64 * 1024) as log:
        keep = log.append(b"keep", b"k" * 100, flags=1)
        gone = log.append(b"gone", b"g" * 100)
        log.kill(gone)
        log.kill(Location(keep.file, keep.offset, keep.length, keep.seq + 99))  # not that record: no effect
        assert log.read(gone, b"gone") == STALE
        assert log.read(keep, b"keep").flags == 1
        assert log.read_key(keep, 4) == b"keep" and log.read_key(gone, 4) is None
    with DiskLog.open(tmp_path / "t") as log:
        assert [(r.key, r.flags, r.value_len) for r in log.scan()] == [(b"keep", 1, 100)]
        assert log.last_scan_corrupt == 0


def test_scan_counts_records_whose_value_was_damaged(tmp_path):
    with DiskLog.create(tmp_path / "t", FILES * 64 * 1024) as log:
        loc = log.append(b"k", b"v" * 3000)
        log.append(b"k2", b"w" * 3000)
    path = tmp_path / "t" / f"tier-{loc.file:02d}.log"
    with open(path, "r+b") as f:
        f.seek(loc.offset + 64 + 1 + 100)
        f.write(b"X")
    with DiskLog.open(tmp_path / "t") as log:
        assert [r.key for r in log.scan()] == [b"k2"]
        assert log.last_scan_corrupt == 1


def test_owner_and_destroy(tmp_path):
    with DiskLog.create(tmp_path / "t", FILES * 64 * 1024) as log:
        assert log.owner() == ""
        log.set_owner("cortex-cache.pool")
    with DiskLog.open(tmp_path / "t") as log:
        assert log.owner() == "cortex-cache.pool"
    assert DiskLog.exists(tmp_path / "t")
    DiskLog.destroy(tmp_path / "t")
    assert not (tmp_path / "t").exists()
