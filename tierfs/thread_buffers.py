"""A buffer per worker thread, reused from call to call (blocking reads of file bytes into
memory to hash or MAC them): a new large bytearray at every call would be zeroed, its pages
faulted in and given back each time."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator


class ThreadBuffer:
    """`size` bytes for the calling thread, the same ones at each of its calls."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._local = threading.local()

    def get(self) -> memoryview:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = memoryview(bytearray(self.size))
        return buffer

    def read(self, fd: int, offset: int, end: int) -> Iterator[memoryview]:
        """The bytes [offset, end) of the file `fd`, a buffer at a time (each piece good until
        the next); fewer if the file ends first (the caller counts what it was given)."""
        buffer = self.get()
        while offset < end:
            count = os.preadv(fd, [buffer[:min(self.size, end - offset)]], offset)
            if not count:
                return
            yield buffer[:count]
            offset += count
