"""A file's xxh3-128 made while its parts arrive in any order, from several worker threads (a
file fetched back range by range, a replica received over several connections): a part that is
next in order is hashed as it is stored, from the bytes in hand (still in the CPU's cache); one
that comes ahead of the order is hashed from the buffer it arrived in, if its caller lends it
(`stored`'s `lend`, up to `hold` bytes at a time: a fetch's chunk buffers), else read back from
the file once the parts before it are in."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from typing import Any

import xxhash

from tierfs.thread_buffers import ThreadBuffer

READ_BACK_SLICE = 1 << 20
_READ_BACK = ThreadBuffer(READ_BACK_SLICE)  # parts read back for the hash


class WholeHash:
    """The file's xxh3-128 over its units (chunks or blocks) in file order, fed as units are
    stored (in worker threads, in any order). A range that is next in order is fed as it is
    checked and stored, slice by slice from the CPU's cache (`claim`, `feed`); one stored
    ahead of the order is hashed once the units before it are in: from the buffer it arrived
    in if its caller lent it (within `hold` bytes), else read back from the file a slice at a
    time into a buffer the thread keeps (in cache, and no new buffer for every unit)."""

    def __init__(self, size: int, unit: int, hold: int = 0) -> None:
        self._hasher = xxhash.xxh3_128()
        self._size = size
        self._unit = unit
        self._count = -(-size // unit)
        self._next = 0  # the first unit not hashed yet
        self._ahead: set[int] = set()  # stored, not hashed yet
        self._lock = threading.Lock()
        self._claimed = False  # a range that is next in order is being fed
        self._before: Any = None  # the hash before that range: a range that fails its check
        self.read_back = 0  # bytes read back from the file (units stored ahead of the order)
        # Ranges stored ahead of the order whose bytes are still in the buffer they came in
        # (first unit -> its range, the bytes, what gives the buffer back), at most `hold`
        # bytes: hashed from there once the units before them are in, never read back.
        self._hold = hold
        self._held: dict[int, tuple[range, memoryview, Callable[[], None]]] = {}
        self._held_bytes = 0

    def claim(self, first: int) -> bool:
        """Whether the caller, about to store units from `first` on, may `feed` them as it
        goes: `first` is next in order and no other range is being fed."""
        with self._lock:
            if self._claimed or first != self._next:
                return False
            self._claimed = True
            self._before = self._hasher.copy()
            return True

    def feed(self, piece: bytes | memoryview) -> None:
        """The next bytes of the claimed range (its claimer only, in order)."""
        self._hasher.update(piece)

    def stored(self, fd: int, span: range, good: bool, claimed: bool,
               lend: tuple[memoryview, Callable[[], None]] | None = None) -> bool:
        """Units `span` of the file `fd` were checked (`good`: they matched and are stored);
        `claimed`: they were fed as they went, and are taken back if they did not match
        (blocking: a worker thread's). `lend`: their bytes, in a buffer the caller lets this
        keep until they are hashed (then given back by calling the second item), for units
        stored ahead of the order; whether it kept them (if not, the caller keeps the
        buffer)."""
        kept = False
        with self._lock:
            if claimed:
                self._claimed = False
                if good:
                    self._next = span.stop
                else:
                    self._hasher = self._before
                self._before = None
            elif good:
                self._ahead.update(span)
                if lend is not None and self._held_bytes + len(lend[0]) <= self._hold:
                    self._held[span.start] = (span, lend[0], lend[1])
                    self._held_bytes += len(lend[0])
                    kept = True
            if self._claimed:
                return kept  # its claimer hashes the units stored ahead once it is done
            self._catch_up(fd)
        return kept

    def _catch_up(self, fd: int) -> None:
        """Hash the units stored ahead that are next in order now: from the buffer they came
        in if it was lent, else read back from `fd` (the caller holds the lock)."""
        while self._next in self._ahead:
            held = self._held.pop(self._next, None)
            if held is not None:
                span, data, give_back = held
                self._held_bytes -= len(data)
                try:
                    self._hasher.update(data)
                finally:
                    give_back()
                self._ahead.difference_update(span)
                self._next = span.stop
                continue
            self._ahead.discard(self._next)
            offset = self._next * self._unit
            length = min(self._unit, self._size - offset)
            self.read_back += length
            # a slice at a time, into a buffer that stays in cache
            for piece in _READ_BACK.read(fd, offset, offset + length):
                self._hasher.update(piece)
                length -= len(piece)
            if length:
                raise OSError(errno.EIO, "a stored unit is shorter than it was")
            self._next += 1

    def digest(self) -> str | None:
        """The whole file's xxh3-128, once every unit is in; None before."""
        with self._lock:
            return self._hasher.hexdigest() if self._next == self._count else None
