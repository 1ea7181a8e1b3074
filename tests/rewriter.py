"""The writer of issue 30's reproducer, run by tests/test_commit_writers.py as a process of its
own, so that the `tierfs commit` processes the test starts never hold a duplicate of its
descriptor (a forked child's close of one is a close of the file for FUSE).

`python tests/rewriter.py FILE SECONDS CLOSES` rewrites FILE for SECONDS: open, 20 writes of
4 KiB at random page offsets below 256 KiB, close, and again. It prints "ready" after its first
close and, when it is done, writes the xxh3-128 of the file's bytes at each of its closes to
CLOSES, one a line.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import xxhash

PAGE = 4096
PAGES = 64  # offsets: random pages below 256 KiB
WRITES = 20  # per open


def main(path: str, seconds: float, closes_file: str) -> None:
    rng = random.Random(30)
    content = bytearray()
    closes = []
    deadline = time.monotonic() + seconds
    while not closes or time.monotonic() < deadline:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            for _ in range(WRITES):
                offset = rng.randrange(PAGES) * PAGE
                data = rng.randbytes(PAGE)
                os.pwrite(fd, data, offset)
                content.extend(bytes(max(0, offset + PAGE - len(content))))
                content[offset:offset + PAGE] = data
        finally:
            os.close(fd)
        closes.append(xxhash.xxh3_128_hexdigest(bytes(content)))
        if len(closes) == 1:
            print("ready", flush=True)
    Path(closes_file).write_text("".join(f"{digest}\n" for digest in closes))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
