"""A buffer per worker thread, reused from call to call (blocking reads of file bytes into
memory to hash or MAC them): a new large bytearray at every call would be zeroed, its pages
faulted in and given back each time."""

from __future__ import annotations

import threading


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
