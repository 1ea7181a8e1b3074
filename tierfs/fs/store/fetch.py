"""Bringing a committed file that is not in RAM back from another tier, range by range.

A read of a non-resident file fetches only what it touches, from the first read source that
has it (peers, then the persistent tier), checks it against the manifest before a byte of it is
returned, and stores it in a partial file in the RAM store. The unit is the block
(manifest.BLOCK_SIZE, 1 MiB, checked against its xxh3-64) where the manifest has block digests,
else the chunk (manifest.CHUNK_SIZE, 8 MiB, its xxh3-64): a read of one tensor of a large file
moves the tensor's blocks, not the file. Once every unit is in and the whole file matches its
xxh3-128, the partial file becomes the file's committed object again. A mismatch anywhere is an
error and a log line, never data: no byte is served that its block's or chunk's check did not
pass, and the file is not adopted unless the whole passes too. A fetched range is checked,
written into the partial file and fed to the xxh3-128 (`tierfs.whole_hash`) in one call
(`Fetch._check_and_write`; a range of blocks a block at a time), made by the worker thread that
received it from a peer (the source's `read_and_store`), and its units are marked
present only once it matched (bytes written before a failed check stay in units no reader is
given); a chunk stored ahead of the ones before it (several are in flight) is hashed for the
whole file from the buffer it was received in, kept until those are in (`HASH_HOLD` bytes of
them at most; beyond, read again from the partial file). When the RAM tier has no room the
bytes are still checked and returned, just not kept.

Reads that follow each other (`_Pattern`) fetch whole chunks and read ahead; a file read back to
back from its first byte is filled whole in the background (`FetchBack.read_remote`), and opens
after that use passthrough. A small file opened for reading while passthrough is on is fetched
whole before the open returns (`fill`, WHOLE_IN_FLIGHT chunks at a time), so that its reads go
to the RAM store, not through the daemon (see
`tierfs.fs.lifecycle.fetch_back.FetchBack.fetch_whole`).

Chunks of a partial file are served to other readers as soon as they are in (`relay_chunk`):
after a data-parallel restart every node reads the same file, and the holders send readers
to each other (`tierfs.replication.peers.sources`). Such a copy stays a read-back cache.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import trio
import xxhash

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.fs.store.committed_files import apply_attributes
from tierfs.fs.store.ram_store import RamFull, RamStore, write_all
from tierfs.fs.store.tier_errors import TierError
from tierfs.whole_hash import WholeHash

log = logging.getLogger(__name__)

PART_PREFIX = reserved.PART
READ_AHEAD = 4  # chunks fetched ahead of a sequential reader, at most
SEQUENTIAL_RUN = 4 << 20  # bytes read back to back before a reader counts as sequential
RUN_GAP = 2 << 20  # how far past a run's end a read still continues it
WHOLE_IN_FLIGHT = 8  # chunks on their way at once when a file is fetched whole
SMALL_RANGE = 64 << 10  # bytes stored from the trio thread, into a buffer of their own size
# Bytes of a fetched range checked, stored and hashed at a time (`Fetch._check_and_write`):
# a block, each checked against its own digest (a whole chunk's digest is fed slice by slice
# and checked at its end), so that each slice is read from the CPU's cache by the write and
# the hashes after the first. (When the frames' MAC held the GIL, eight slices per chunk cost
# more in waits for the GIL than their cache locality saved; it no longer does.)
STORE_SLICE = mf.BLOCK_SIZE
RELAY_WAIT = 8.0  # seconds a peer sent here for a chunk waits for it to come in (< IO_TIMEOUT)



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


# Chunk buffers kept: those of the chunks in flight, and as many lent to whole-file hashes.
_BUFFERS = _Buffers(keep=2 * WHOLE_IN_FLIGHT)
# Bytes of chunks stored ahead of their file's order that a fetch's whole-file hash keeps in
# the buffers they arrived in until the chunks before them are in (hashed from there, not
# read back from the partial file); beyond it, they are read back.
HASH_HOLD = WHOLE_IN_FLIGHT * mf.CHUNK_SIZE


@dataclass
class _Loan:
    """A chunk buffer offered to the whole-file hash (`WholeHash.stored`); `taken`: it keeps
    it, and gives it back to the pool once it hashed it."""

    buffer: bytearray
    taken: bool = False

    def give_back(self) -> None:
        _BUFFERS.give(self.buffer)


class Slots:
    """Chunks in flight shared by the fills of a step's read-ahead (a `trio.CapacityLimiter`
    of them), which give way to a reader waiting for a file: while any `urgent()` block runs
    (an open waiting for its file whole, fetched by its own fill), no chunk of the read-ahead
    starts (those on their way finish). A loader opens its files in an order of its own (a DCP
    load: its plan's, not the step's listing): the file it waits for gets the bandwidth, and
    the read-ahead goes on once it came."""

    def __init__(self, total: int) -> None:
        self._limiter = trio.CapacityLimiter(total)
        self._urgent = 0
        self._clear = trio.Event()
        self._clear.set()

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """A reader waits for a file: no read-ahead chunk starts until it is in."""
        if not self._urgent:
            self._clear = trio.Event()
        self._urgent += 1
        try:
            yield
        finally:
            self._urgent -= 1
            if not self._urgent:
                self._clear.set()

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        while True:
            await self._clear.wait()
            await self._limiter.acquire_on_behalf_of(borrower)
            if not self._urgent:
                return
            self._limiter.release_on_behalf_of(borrower)  # a reader began to wait meanwhile

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(borrower)


class ReadSource(Protocol):
    """A tier that can serve byte ranges of committed files (peers, the persistent tier).
    `read_range` raises ObjectMissing if the tier has no object for the file, TierError if it
    cannot serve it now. A source may also offer `read_into(step_path, entry, offset, buffer)`
    (the bytes received into `buffer`) and, with `can_store = True`,
    `read_and_store(step_path, entry, offset, buffer, store)`: `store` (a `Store`) called by
    the thread that received the bytes; (the bytes, whether `store` took them)."""

    name: str

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes: ...


class FilesSource(Protocol):
    """A source that can also give many whole small files of one step at once (a peer: one
    request for them all): `read_files` returns those of `entries` it got, by name, unchecked
    (a fetch checks them as it checks any range, `GivenBytes`); the rest are read one by one."""

    async def read_files(self, step_path: str, entries: list[mf.FileEntry]
                         ) -> dict[str, memoryview]: ...


class GivenBytes:
    """The bytes of one file that came with others (`FilesSource.read_files`), as the first
    source of its fetch: checked as any source's (a range that does not match its digest sends
    the fetch to the next source)."""

    def __init__(self, data: bytes | memoryview, name: str) -> None:
        self.data = data
        self.name = name  # the source they came from: for the log of a mismatch

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes | memoryview:
        return self.data[offset:offset + length]


class _Pattern:
    """How a file is being read: the run of back-to-back reads the last read belongs to. A
    read up to RUN_GAP past the run's end continues it: the kernel's readahead requests may
    arrive out of order."""

    def __init__(self) -> None:
        self.start = self.end = -1

    def note(self, offset: int, size: int) -> None:
        if 0 <= self.start <= offset <= self.end + RUN_GAP:
            self.end = max(self.end, offset + size)
        else:
            self.start, self.end = offset, offset + size

    @property
    def sequential(self) -> bool:
        return self.end - self.start >= SEQUENTIAL_RUN

    @property
    def from_start(self) -> bool:
        """Read back to back from its first byte: a copy, a load; the file will be read whole."""
        return self.sequential and self.start == 0


# Fetched bytes checked against the manifest and stored (`Fetch`): whether they matched. A
# source that can (`can_store`) calls it in the worker thread that received them.
Store = Callable[[bytes | memoryview], bool]


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


def _matches(entry: mf.FileEntry, offset: int, data: bytes | memoryview) -> bool:
    """Whether `data`, the bytes at `offset` (a whole chunk, or whole blocks of an entry that
    has block digests), are what the manifest says."""
    whole_chunk = offset % mf.CHUNK_SIZE == 0 and \
        len(data) == min(mf.CHUNK_SIZE, entry.size - offset)
    if whole_chunk:
        return mf.chunk_digest(data) == entry.chunks[offset // mf.CHUNK_SIZE]
    if not entry.blocks or offset % mf.BLOCK_SIZE:
        return False
    view, first = memoryview(data), offset // mf.BLOCK_SIZE
    return all(mf.block_digest(view[start:start + mf.BLOCK_SIZE])
               == mf.block_digest_of(entry, first + start // mf.BLOCK_SIZE)
               for start in range(0, len(view), mf.BLOCK_SIZE))


async def fetch_range(sources: list[ReadSource], remote: RemoteFile, offset: int,
                      length: int, buffer: memoryview | None = None,
                      store: Store | None = None) -> bytes | memoryview:
    """`length` bytes at `offset` of `remote` (a whole chunk, or whole blocks inside one chunk
    of an entry with block digests), verified, from the first source that delivers them (into
    `buffer`, a chunk's room, if given and the source can). `store` checks them and stores
    them as it does (`Fetch`): called by a source that can (`can_store`: a peer) in the worker
    thread that received the bytes, else off the trio thread once they are in; without it,
    `_matches` checks them."""
    entry = remote.entry
    failures = []
    for source in sources:
        read_into = getattr(source, "read_into", None)
        try:
            if store is not None and buffer is not None and getattr(source, "can_store", False):
                data, good = await source.read_and_store(  # type: ignore[attr-defined]
                    remote.step_path, entry, offset, buffer[:length], store)
            else:
                if buffer is not None and read_into is not None:
                    data = await read_into(remote.step_path, entry, offset, buffer[:length])
                else:
                    data = await source.read_range(remote.step_path, entry, offset, length)
                good = len(data) == length and (
                    _matches(entry, offset, data) if store is None
                    else await _store_off_trio(store, data))
        except TierError as exc:  # a source's failure is a reason to try the next one
            failures.append(f"{source.name}: {exc}")
            continue
        if good:
            return data
        failures.append(f"{source.name}: the range at {offset} does not match its checksum")
        log.error("checksum mismatch: %s/%s bytes [%d, +%d) from %s", remote.step_path,
                  entry.name, offset, length, source.name)
    raise FetchError(f"{remote.step_path}/{entry.name} [{offset}, +{length}): "
                     + ("; ".join(failures) or "no tier holds it"))


async def _store_off_trio(store: Store, data: bytes | memoryview) -> bool:
    """`store(data)`, in a worker thread unless the bytes are few (a few pages: less than the
    hop to a thread)."""
    if len(data) <= SMALL_RANGE:
        return store(data)
    return await trio.to_thread.run_sync(store, data)


async def fetch_chunk(sources: list[ReadSource], remote: RemoteFile, index: int,
                      buffer: memoryview | None = None) -> bytes | memoryview:
    """Chunk `index` of `remote`, verified (`fetch_range`)."""
    offset = index * mf.CHUNK_SIZE
    return await fetch_range(sources, remote, offset,
                             min(mf.CHUNK_SIZE, remote.entry.size - offset), buffer)


class Fetch:
    """The partial copy of one non-resident file in the RAM store, filled unit by unit: by
    block (mf.BLOCK_SIZE) where the manifest has block digests, else by chunk.

    A read that is not part of a sequential run fetches only the units it touches (its first
    bytes come after one block's round trip, whatever the file's size); a sequential one
    fetches whole chunks and reads ahead; a run from the file's first byte asks for the whole
    file (`wants_whole`, which `FetchBack` fills in the background)."""

    def __init__(self, store: RamStore, remote: RemoteFile,
                 spawn: Callable[..., None] = trio.lowlevel.spawn_system_task) -> None:
        self.store = store
        self.remote = remote
        self._spawn = spawn  # read-ahead runs under the namespace's owner (fs.lifecycle.background)
        size = remote.entry.size
        self._unit = mf.BLOCK_SIZE if remote.entry.blocks else mf.CHUNK_SIZE
        self._per_chunk = mf.CHUNK_SIZE // self._unit
        self._chunks = mf.chunk_count(size)
        self._have = bytearray(-(-size // self._unit))  # 1: the unit is in the partial file
        self._coming: dict[int, trio.Event] = {}  # unit -> the fetch bringing it
        self._pattern = _Pattern()
        self.filling = False  # a background fill of the whole file runs (FetchBack)
        self.path = os.path.join(os.fsencode(store.objects),
                                 f"{PART_PREFIX}{remote.entry.xxh3}-{id(self):x}".encode())
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.backing_ino = os.fstat(self.fd).st_ino
        self._whole = WholeHash(size, self._unit, hold=HASH_HOLD)

    @property
    def complete(self) -> bool:
        return all(self._have)

    @property
    def busy(self) -> bool:
        """Bytes are on their way: the partial file must stay."""
        return bool(self._coming)

    @property
    def wants_whole(self) -> bool:
        """The file is being read back to back from its start: fetch the rest of it."""
        return self._pattern.from_start and not self.complete

    def _unit_bytes(self, unit: int) -> int:
        return min(self._unit, self.remote.entry.size - unit * self._unit)

    @property
    def missing_bytes(self) -> int:
        """What the RAM tier must still take for the file to be complete."""
        return sum(self._unit_bytes(unit) for unit, have in enumerate(self._have) if not have)

    @property
    def stored_bytes(self) -> int:
        """What the partial file holds in the RAM tier."""
        return self.remote.entry.size - self.missing_bytes

    def _chunk_units(self, index: int) -> range:
        return range(index * self._per_chunk,
                     min((index + 1) * self._per_chunk, len(self._have)))

    def _chunk_in(self, index: int) -> bool:
        return all(self._have[unit] for unit in self._chunk_units(index))

    async def read(self, sources: list[ReadSource], offset: int, size: int) -> bytes:
        size = max(0, min(size, self.remote.entry.size - offset))
        if size == 0:
            return b""
        self._pattern.note(offset, size)
        if self._pattern.sequential:  # whole chunks, and the next ones on their way
            first, last = offset // mf.CHUNK_SIZE, (offset + size - 1) // mf.CHUNK_SIZE
            run_chunks = (self._pattern.end - self._pattern.start) // mf.CHUNK_SIZE
            self._read_ahead(sources, last + 1, min(READ_AHEAD, max(1, run_chunks)))
            units = range(first * self._per_chunk, self._chunk_units(last).stop)
        else:  # only what the read touches
            units = range(offset // self._unit, (offset + size - 1) // self._unit + 1)
        # Read from a duplicate taken before the wait: another task may complete the fetch
        # meanwhile and the file be adopted (its fd closed, its number free for another file).
        fd = os.dup(self.fd)
        try:
            unkept = await self._ensure(sources, units)
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        if not unkept:
            return data
        joined = bytearray(size)
        joined[:len(data)] = data
        for start, piece in unkept:  # over the holes those bytes left in the partial file
            low, high = max(offset, start), min(offset + size, start + len(piece))
            if low < high:
                joined[low - offset:high - offset] = piece[low - start:high - start]
        return bytes(joined)

    def _read_ahead(self, sources: list[ReadSource], start: int, count: int) -> None:
        """Fetch the next chunks in the background, in parallel: a sequential reader will want
        them, and one chunk at a time would wait on every round trip."""
        for index in range(start, min(start + count, self._chunks)):
            units = self._chunk_units(index)
            if not self._chunk_in(index) and not any(u in self._coming for u in units):
                self._spawn(self._fetch_ahead, sources, units)

    async def _fetch_ahead(self, sources: list[ReadSource], units: range) -> None:
        try:
            await self._ensure(sources, units)
        except (FetchError, RamFull, OSError) as exc:  # the read that needs it will try again
            log.debug("read-ahead of %s at %d failed: %s", self.remote.entry.name,
                      units.start * self._unit, exc)

    async def relay_chunk(self, index: int, wait: float = RELAY_WAIT) -> int | None:
        """For another reader sent here for chunk `index` (`replication.peers.sources`): a
        duplicate of the partial file's fd once the chunk is in it, waiting up to `wait`
        seconds for its bytes on their way; None if it is not here, not coming, or not kept."""
        if not 0 <= index < self._chunks:
            return None
        units = self._chunk_units(index)
        with trio.move_on_after(wait):
            while not self._chunk_in(index) and self.fd >= 0:
                pending = next((self._coming[u] for u in units if u in self._coming), None)
                if pending is None:
                    return None
                await pending.wait()
        if not self._chunk_in(index) or self.fd < 0:
            return None
        return os.dup(self.fd)

    async def fill(self, sources: list[ReadSource], in_flight: int = READ_AHEAD, *,
                   limiter: trio.CapacityLimiter | Slots | None = None,
                   underway: trio.Event | None = None) -> None:
        """Fetch every missing chunk, `in_flight` at a time (for a writer, a prefetch, a
        read-only open, a sequential reader), asked for in the file's order; raises RamFull
        if there is no room to keep them. `limiter`, if given, bounds the chunks in flight
        instead (shared by the fills of a step's read-ahead: the files overlap, the earlier
        file's chunks first); `underway` is set once every missing chunk is on its way (or the
        fill ended): the next file's fill may start then, so that the pipe does not drain at
        each file's end."""
        limiter = limiter if limiter is not None else trio.CapacityLimiter(in_flight)
        unkept = False

        async def fetch_one(index: int, borrower: object) -> None:
            nonlocal unkept
            try:
                if await self._ensure(sources, self._chunk_units(index)):
                    unkept = True
            finally:
                limiter.release_on_behalf_of(borrower)

        try:
            async with trio.open_nursery() as nursery:
                for index in range(self._chunks):
                    if not self._chunk_in(index):
                        # taken here, in order, so that the chunks go out in the file's order
                        borrower = object()
                        await limiter.acquire_on_behalf_of(borrower)
                        nursery.start_soon(fetch_one, index, borrower)
                if underway is not None:
                    underway.set()
        except* FetchError as failures:
            raise failures.exceptions[0] from None
        finally:
            if underway is not None:
                underway.set()
        if unkept:
            raise RamFull

    async def _ensure(self, sources: list[ReadSource],
                      units: range) -> list[tuple[int, bytes]]:
        """Make `units` present; the bytes of those that could not be kept, as (offset, bytes).
        Each fetch is one run of units inside one chunk that nobody else is bringing."""
        unkept: list[tuple[int, bytes]] = []
        covered: set[int] = set()  # not kept, but in `unkept`
        while True:
            missing = [u for u in units if not self._have[u] and u not in covered]
            if not missing:
                return unkept
            free = {u for u in missing if u not in self._coming}
            if not free:
                await self._coming[missing[0]].wait()
                continue
            low = high = min(free)
            chunk_end = self._chunk_units(low // self._per_chunk).stop
            while high + 1 < min(units.stop, chunk_end) and high + 1 in free:
                high += 1
            data = await self._fetch_units(sources, range(low, high + 1))
            if data is not None:
                unkept.append((low * self._unit, data))
                covered.update(range(low, high + 1))

    async def _fetch_units(self, sources: list[ReadSource], span: range) -> bytes | None:
        """Fetch, check and store a run of units nobody is bringing; their bytes if not kept.
        The RAM tier's room for them is taken first; the thread that receives them checks them,
        writes them into the partial file and feeds the whole-file hash (`_check_and_write`)
        in one go. The write goes to a duplicate of the fd, so a discard meanwhile cannot let
        it land in another file that reused the fd's number."""
        done = trio.Event()
        for unit in span:
            self._coming[unit] = done
        offset = span.start * self._unit
        length = sum(self._unit_bytes(unit) for unit in span)
        # A small range gets a buffer of its size: a fresh chunk buffer (when the kept ones
        # are in use) is 8 MiB zeroed for each of a many-file step's 4 KiB files.
        buffer = _BUFFERS.take() if length > SMALL_RANGE else bytearray(length)
        kept = self._charge(length)  # room for them in the RAM tier (False: store nothing)
        fd = os.dup(self.fd) if kept else None
        no_room = False  # the RAM dir's file system was full although the count had room
        # The buffer may be lent to the whole-file hash if the bytes are in it (a source that
        # received them elsewhere, a channel's own buffer, must have them back).
        loan = _Loan(buffer) if len(buffer) == mf.CHUNK_SIZE else None

        def store(data: bytes | memoryview) -> bool:
            nonlocal no_room
            if fd is not None and not no_room:
                try:
                    lend = loan if isinstance(data, memoryview) and data.obj is buffer \
                        else None
                    return self._check_and_write(fd, data, span, lend)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    no_room = True  # as without room: checked, returned, not kept
            return self._check_and_write(None, data, span)

        stored = False
        try:
            data = await fetch_range(sources, self.remote, offset, length, memoryview(buffer),
                                     store)
            if no_room:
                log.info("%s/%s: no room in the RAM dir's file system; read without keeping "
                         "it", self.remote.step_path, self.remote.entry.name)
            if loan is not None and loan.taken and self.fd < 0:
                # discarded meanwhile, its bytes lent to the hash (given back to the pool at
                # any time): fetched again, unkept, by the caller's loop
                return None
            if not kept or no_room or self.fd < 0:
                # no room, or discarded meanwhile (its fd number may be another file's now)
                return bytes(data)
            stored = True
            for unit in span:
                self._have[unit] = 1
            return None
        finally:
            if fd is not None:
                os.close(fd)
            self._uncharge(kept and not stored, length)
            if loan is not None and not loan.taken:
                _BUFFERS.give(buffer)  # nothing refers to it any more: unkept bytes are a copy
            for unit in span:
                del self._coming[unit]
            done.set()

    def _charge(self, nbytes: int) -> bool:
        """Account `nbytes` about to be stored; False (store nothing) if the fetch was
        discarded or the RAM tier has no room for them."""
        if self.fd < 0:
            return False
        try:  # units come in any order: each stores its own bytes, holes nothing
            self.store.grow_by(self.backing_ino, nbytes)
        except RamFull:
            return False
        return True

    def _uncharge(self, charged: bool, nbytes: int) -> None:
        if charged:
            self.store.give_back(self.backing_ino, nbytes)

    def _check_and_write(self, fd: int | None, data: bytes | memoryview, span: range,
                         lend: _Loan | None = None) -> bool:
        """The units' checksum (a whole chunk's xxh3-64, or each block's, a block at a time),
        their write into the partial file at `fd` (if given) and the whole-file hash (if they
        are next in order; if not, from `lend`'s buffer, which holds `data`, once they are,
        if the hash takes it), in one call; whether they matched (blocking: a worker
        thread's for large ranges)."""
        entry = self.remote.entry
        offset = span.start * self._unit
        view = memoryview(data)
        whole_chunk = offset % mf.CHUNK_SIZE == 0 and \
            len(view) == min(mf.CHUNK_SIZE, entry.size - offset)
        if not whole_chunk and (not entry.blocks or offset % mf.BLOCK_SIZE):
            return False
        chunk = xxhash.xxh3_64() if whole_chunk else None
        pieces = STORE_SLICE
        feeding = fd is not None and self._whole.claim(span.start)
        good = False
        try:
            for start in range(0, len(view), pieces):
                piece = view[start:start + pieces]
                if chunk is not None:
                    chunk.update(piece)
                elif mf.block_digest(piece) != mf.block_digest_of(
                        entry, (offset + start) // mf.BLOCK_SIZE):
                    return False
                if fd is not None:
                    write_all(fd, piece, offset + start)
                if feeding:
                    self._whole.feed(piece)
            good = chunk is None or chunk.hexdigest() == entry.chunks[offset // mf.CHUNK_SIZE]
            return good
        finally:
            if fd is not None:
                kept = self._whole.stored(fd, span, good, feeding,
                                          None if lend is None else (view, lend.give_back))
                if lend is not None:
                    lend.taken = kept

    def verify(self) -> bool:
        """Whole-file check once complete; the partial file may then become the object."""
        if self.fd < 0:
            return False  # discarded (the node moved on): nothing to adopt
        xxh3 = self._whole.digest()  # every stored unit went into it (`_write`)
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

    def adopted(self) -> None:
        """The partial file became the file's object (`Residents.adopt_fetch`): its fd closes,
        and no later use of this fetch may take the fd's number, which another file may have
        then."""
        os.close(self.fd)
        self.fd = -1

    def discard(self) -> None:
        os.close(self.fd)
        self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.store.remove(self.path)
        self.store.forget_inode(self.backing_ino)
