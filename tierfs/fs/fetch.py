"""Bringing a committed file that is not in RAM back from another tier, range by range.

A read of a non-resident file fetches only the chunks (manifest.CHUNK_SIZE) it touches, from the
first read source that has them (peers, then the persistent tier), checks each chunk's xxh3-64
against the manifest before a byte of it is returned, and stores it in a partial file in the RAM
store. Once every chunk is in and the whole file matches its xxh3-128, the partial file becomes
the file's committed object again. A mismatch anywhere is an error and a log line, never data.
The xxh3-128 runs as the chunks are stored (`_WholeHash`): a restore reads each byte once, not
again for the check; only chunks stored ahead of the ones before them are read back.
When the RAM tier has no room the chunk is still returned, just not kept.

A file opened for reading while passthrough is on is fetched whole before the open returns
(`fill`, WHOLE_IN_FLIGHT chunks at a time), so that its reads go to the RAM store, not through
the daemon (see `tierfs.fs.residency.Residency.fetch_whole`).

Chunks of a partial file are served to other readers as soon as they are in (`relay_chunk`):
after a data-parallel restart every node reads the same file, and the holders send readers
to each other (`tierfs.replication.peers.sources`). Such a copy stays a read-back cache.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio
import xxhash

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.fs.ram_store import RamFull, RamStore
from tierfs.fs.tier_errors import TierError

log = logging.getLogger(__name__)

PART_PREFIX = reserved.PART
READ_AHEAD = 4  # chunks fetched ahead of a sequential reader
WHOLE_IN_FLIGHT = 8  # chunks on their way at once when a file is fetched whole
RELAY_WAIT = 8.0  # seconds a peer sent here for a chunk waits for it to come in (< IO_TIMEOUT)



def apply_attributes(target: int | bytes | str, entry: mf.FileEntry) -> None:
    """Give a regular file (a path or an fd) made again from a committed entry (fetched,
    received from a peer, linked from an object) the owner, mode and mtime recorded at commit.
    Owner first: chown clears set-id bits that chmod then sets."""
    if entry.uid != mf.NO_OWNER and entry.gid != mf.NO_OWNER:
        os.chown(target, entry.uid, entry.gid)
    os.chmod(target, entry.mode)
    if entry.mtime_ns:
        os.utime(target, ns=(entry.mtime_ns, entry.mtime_ns))


class _Buffers:
    """Chunk-sized receive buffers reused from chunk to chunk: a fresh 8 MiB bytearray is
    zeroed page by page as it is filled and unmapped when freed, for every chunk. A source
    that can (`read_into`) receives a chunk straight into one."""

    def __init__(self, keep: int) -> None:
        self._free: list[bytearray] = []
        self._keep = keep

    def take(self) -> bytearray:
        return self._free.pop() if self._free else bytearray(mf.CHUNK_SIZE)

    def give(self, buffer: bytearray) -> None:
        if len(self._free) < self._keep:
            self._free.append(buffer)


_BUFFERS = _Buffers(keep=WHOLE_IN_FLIGHT)


class _WholeHash:
    """The file's xxh3-128 over its chunks in file order, fed as chunks are stored (in worker
    threads, in any order): a stored chunk that is next in order is hashed from the bytes just
    written; one stored ahead of the order is read back from the file once the chunks before
    it are in."""

    def __init__(self, size: int) -> None:
        self._hasher = xxhash.xxh3_128()
        self._size = size
        self._count = mf.chunk_count(size)
        self._next = 0  # the first chunk not hashed yet
        self._ahead: set[int] = set()  # stored, not hashed yet
        self._lock = threading.Lock()

    def stored(self, fd: int, index: int, data: bytes | memoryview) -> None:
        """Chunk `index` of the file `fd` now holds `data` (blocking: a worker thread's)."""
        with self._lock:
            self._ahead.add(index)
            while self._next in self._ahead:
                self._ahead.discard(self._next)
                offset = self._next * mf.CHUNK_SIZE
                self._hasher.update(data if self._next == index else
                                    os.pread(fd, min(mf.CHUNK_SIZE, self._size - offset),
                                             offset))
                self._next += 1

    def digest(self) -> str | None:
        """The whole file's xxh3-128, once every chunk is in; None before."""
        with self._lock:
            return self._hasher.hexdigest() if self._next == self._count else None


class ReadSource(Protocol):
    """A tier that can serve byte ranges of committed files (peers, the persistent tier).
    `read_range` raises ObjectMissing if the tier has no object for the file, TierError if it
    cannot serve it now."""

    name: str

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes: ...


class FetchError(Exception):
    """No source could deliver verified bytes."""


@dataclass(frozen=True)
class RemoteFile:
    """Where a non-resident file's bytes live: the committed step's path and its entry;
    `in_store`: the persistent tier holds them there (a commit may name them as they are, a
    rename moves them in the store without fetching them)."""

    step_path: str
    entry: mf.FileEntry
    in_store: bool = False


async def fetch_chunk(sources: list[ReadSource], remote: RemoteFile, index: int,
                      buffer: memoryview | None = None) -> bytes | memoryview:
    """Chunk `index` of `remote`, verified, from the first source that delivers it (into
    `buffer`, a chunk's room, if given and the source can)."""
    entry = remote.entry
    offset = index * mf.CHUNK_SIZE
    length = min(mf.CHUNK_SIZE, entry.size - offset)
    failures = []
    for source in sources:
        read_into = getattr(source, "read_into", None)
        try:
            if buffer is not None and read_into is not None:
                data = await read_into(remote.step_path, entry, offset, buffer[:length])
            else:
                data = await source.read_range(remote.step_path, entry, offset, length)
        except TierError as exc:  # a source's failure is a reason to try the next one
            failures.append(f"{source.name}: {exc}")
            continue
        if len(data) == length and mf.chunk_digest(data) == entry.chunks[index]:
            return data
        failures.append(f"{source.name}: chunk {index} does not match its checksum")
        log.error("checksum mismatch: %s/%s chunk %d from %s", remote.step_path, entry.name,
                  index, source.name)
    raise FetchError(f"{remote.step_path}/{entry.name} chunk {index}: "
                     + ("; ".join(failures) or "no tier holds it"))


class Fetch:
    """The partial copy of one non-resident file in the RAM store, filled chunk by chunk."""

    def __init__(self, store: RamStore, remote: RemoteFile,
                 spawn: Callable[..., None] = trio.lowlevel.spawn_system_task) -> None:
        self.store = store
        self.remote = remote
        self._spawn = spawn  # read-ahead runs under the namespace's owner (fs.background)
        count = mf.chunk_count(remote.entry.size)
        self.present = [False] * count
        self._inflight: dict[int, trio.Event] = {}
        self.path = os.path.join(os.fsencode(store.objects),
                                 f"{PART_PREFIX}{remote.entry.xxh3}-{id(self):x}".encode())
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.backing_ino = os.fstat(self.fd).st_ino
        self._whole = _WholeHash(remote.entry.size)

    @property
    def complete(self) -> bool:
        return all(self.present)

    @property
    def busy(self) -> bool:
        """A chunk is on its way: the partial file must stay."""
        return bool(self._inflight)

    @property
    def missing_bytes(self) -> int:
        """What the RAM tier must still take for the file to be complete."""
        size = self.remote.entry.size
        return sum(min(mf.CHUNK_SIZE, size - index * mf.CHUNK_SIZE)
                   for index, present in enumerate(self.present) if not present)

    async def read(self, sources: list[ReadSource], offset: int, size: int) -> bytes:
        size = max(0, min(size, self.remote.entry.size - offset))
        if size == 0:
            return b""
        first, last = offset // mf.CHUNK_SIZE, (offset + size - 1) // mf.CHUNK_SIZE
        self._read_ahead(sources, last + 1)
        unkept: dict[int, bytes] = {}
        for index in range(first, last + 1):
            data = await self._ensure(sources, index)
            if data is not None:
                unkept[index] = data
        if not unkept:
            return os.pread(self.fd, size, offset)
        pieces = []
        for index in range(first, last + 1):
            chunk = unkept.get(index)
            if chunk is None:
                chunk = os.pread(self.fd, mf.CHUNK_SIZE, index * mf.CHUNK_SIZE)
            pieces.append(chunk)
        joined = b"".join(pieces)
        start = offset - first * mf.CHUNK_SIZE
        return joined[start:start + size]

    def _read_ahead(self, sources: list[ReadSource], start: int) -> None:
        """Fetch the next chunks in the background, in parallel: a file read from another tier
        is usually read to its end, and one chunk at a time would wait on every round trip."""
        for index in range(start, min(start + READ_AHEAD, len(self.present))):
            if not self.present[index] and index not in self._inflight:
                self._spawn(self._fetch_ahead, sources, index)

    async def _fetch_ahead(self, sources: list[ReadSource], index: int) -> None:
        try:
            await self._ensure(sources, index)
        except (FetchError, RamFull, OSError) as exc:  # the read that needs it will try again
            log.debug("read-ahead of chunk %d of %s failed: %s", index, self.remote.entry.name,
                      exc)

    async def relay_chunk(self, index: int, wait: float = RELAY_WAIT) -> int | None:
        """For another reader sent here for chunk `index` (`replication.peers.sources`): a
        duplicate of the partial file's fd once the chunk is in it, waiting up to `wait`
        seconds for one on its way; None if it is not here, not coming, or not kept."""
        if not 0 <= index < len(self.present):
            return None
        with trio.move_on_after(wait):
            while not self.present[index] and self.fd >= 0:
                pending = self._inflight.get(index)
                if pending is None:
                    return None
                await pending.wait()
        if not self.present[index] or self.fd < 0:
            return None
        return os.dup(self.fd)

    async def fill(self, sources: list[ReadSource], in_flight: int = READ_AHEAD) -> None:
        """Fetch every missing chunk, `in_flight` at a time (for a writer, a prefetch, a
        read-only open); raises RamFull if there is no room to keep them."""
        limiter = trio.CapacityLimiter(in_flight)
        unkept = False

        async def fetch_one(index: int) -> None:
            nonlocal unkept
            async with limiter:
                if await self._ensure(sources, index) is not None:
                    unkept = True

        try:
            async with trio.open_nursery() as nursery:
                for index in range(len(self.present)):
                    nursery.start_soon(fetch_one, index)
        except* FetchError as failures:
            raise failures.exceptions[0] from None
        if unkept:
            raise RamFull

    async def _ensure(self, sources: list[ReadSource], index: int) -> bytes | None:
        """Make chunk `index` present; return its bytes only if they could not be kept."""
        while not self.present[index]:
            pending = self._inflight.get(index)
            if pending is not None:
                await pending.wait()
                continue
            done = self._inflight[index] = trio.Event()
            buffer = _BUFFERS.take()
            try:
                unkept = await self._fetch_and_store(sources, index, memoryview(buffer))
                if unkept is not None:
                    return unkept
                self.present[index] = True
            finally:
                _BUFFERS.give(buffer)  # nothing refers to it any more: unkept bytes are a copy
                del self._inflight[index]
                done.set()
        return None

    async def _fetch_and_store(self, sources: list[ReadSource], index: int,
                               buffer: memoryview) -> bytes | None:
        """Fetch chunk `index` (perhaps into `buffer`) and store it; its bytes if not kept."""
        data = await fetch_chunk(sources, self.remote, index, buffer)
        if self.fd < 0:
            return bytes(data)  # discarded meanwhile: its fd number may be another file's now
        try:  # chunks come in any order: each stores its own bytes, holes nothing
            self.store.grow_by(self.backing_ino, len(data))
        except RamFull:
            return bytes(data)
        if not await self._store_chunk(data, index):
            return bytes(data)
        return None

    async def _store_chunk(self, data: bytes | memoryview, index: int) -> bool:
        """Write a chunk into the partial file off the trio thread (up to 8 MiB); False if the
        fetch was discarded meanwhile. The write goes to a duplicate of the fd, so a discard
        during it cannot let it land in another file that reused the fd's number."""
        fd = os.dup(self.fd)
        try:
            await trio.to_thread.run_sync(self._write, fd, data, index)
        finally:
            os.close(fd)
        return self.fd >= 0

    def _write(self, fd: int, data: bytes | memoryview, index: int) -> None:
        """Store a chunk (a worker thread's): all of it, since the check that follows is over
        `data`, not over what the file holds."""
        view, offset = memoryview(data), index * mf.CHUNK_SIZE
        while view:
            written = os.pwrite(fd, view, offset)
            if not written:
                raise OSError(errno.ENOSPC, "no room for a fetched chunk")
            view, offset = view[written:], offset + written
        self._whole.stored(fd, index, data)

    def verify(self) -> bool:
        """Whole-file check once complete; the partial file may then become the object."""
        if self.fd < 0:
            return False  # discarded (the node moved on): nothing to adopt
        xxh3 = self._whole.digest()  # every stored chunk went into it (`_write`)
        if xxh3 is None:
            return False  # not complete: nothing to adopt
        size = os.fstat(self.fd).st_size
        if xxh3 == self.remote.entry.xxh3 and size == self.remote.entry.size:
            apply_attributes(self.fd, self.remote.entry)  # it becomes the file: as committed
            return True
        log.error("checksum mismatch: %s/%s fetched whole has xxh3 %s, manifest says %s",
                  self.remote.step_path, self.remote.entry.name, xxh3,
                  self.remote.entry.xxh3)
        return False

    def discard(self) -> None:
        os.close(self.fd)
        self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.store.remove(self.path)
        self.store.forget_inode(self.backing_ino)
