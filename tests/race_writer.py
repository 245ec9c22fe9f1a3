"""A hostile writer for the racing-writer fuzz (tests/test_fuzz.py): flips slot fields of a mapped pool
segment between a good and a bad value, without the pool's lock, as fast as Python can.

Run as `python -m tests.race_writer SEGMENT_PATH`; commands on stdin, one per line:

    go OFF SIZE BAD GOOD [OFF SIZE BAD GOOD ...]   flip these fields (byte offset, 4 or 8 bytes)
    pause                                          put every field back to GOOD, answer "ok"
    stop                                           put them back, answer the number of flips, exit
"""

from __future__ import annotations

import mmap
import os
import select
import sys


def main(path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 0)
    mv = memoryview(mm)
    words = {4: mv.cast("i"), 8: mv.cast("q")}  # signed: a chain link of -1 is "none"
    targets: list[tuple] = []
    flips = 0
    pending = b""  # commands read but not yet run (read unbuffered: select() must see every one)
    while True:
        if b"\n" not in pending:
            if targets and not select.select([0], [], [], 0)[0]:
                for _ in range(256):
                    for arr, idx, bad, good in targets:
                        arr[idx] = bad
                        arr[idx] = good
                flips += 256 * len(targets)
                continue
            chunk = os.read(0, 65536)
            pending += chunk
            if chunk:
                continue
            pending += b"\nstop\n"  # the reader went away
        line, pending = pending.split(b"\n", 1)
        words_of = line.decode().split()
        for arr, idx, bad, good in targets:
            arr[idx] = good
        if not words_of:
            continue
        if words_of[0] == "stop":
            print(flips, flush=True)
            return
        if words_of[0] == "pause":
            targets = []
            print("ok", flush=True)
        elif words_of[0] == "go":
            nums = list(map(int, words_of[1:]))
            targets = [(words[size], off // size, bad, good)
                       for off, size, bad, good in zip(nums[::4], nums[1::4], nums[2::4], nums[3::4])]


if __name__ == "__main__":
    main(sys.argv[1])
