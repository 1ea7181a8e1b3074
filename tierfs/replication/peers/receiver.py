"""Receiving replicas from peers into this node's RAM store.

A sender spreads a file's chunks over several connections (`--peer-connections`), so they
arrive in any order, each connection's in a worker thread of its own: a chunk is streamed
(`PeerChannel.stream`) a MiB at a time into a private incoming file next to the committed
objects, at its offset (the incoming file of that content from that sender: one per file and
peer, whatever the connection), and its tags are checked at its end; a chunk whose tags fail
or that is cut off makes the whole transfer forgotten and its file removed, so that bytes that
are not the sender's never count, even if they hashed right. A complete file becomes the
object named by its xxh3-128 only if its bytes hash to exactly that. HOLD comes after the
files it names: this node holds those whose objects are here (verified) in its copy of the
step's committed version (`OtherTiers.hold_files`) and names them in HELD; only those does the
sender count this node as a holder of. Paths and sizes were validated by the protocol;
offsets and lengths are checked here against what was announced.

A file is hashed as its chunks are written (`tierfs.whole_hash`: a chunk next in order from
the bytes in hand, one ahead of the order read back once the ones before it are in); a chunk
written twice (a sender that tried again) makes it read back whole at its end. The states of
transfers abandoned midway (a sender killed, or gone to a newer version) are dropped once idle
for RUNNING_IDLE seconds or beyond the RUNNING_LIMIT most recently used; dropping one is
always safe: the file then never completes until its chunks are all sent again.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import trio

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.fs.store.ram_store import RamFull, write_all
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import BlockingChannel, PeerChannel
from tierfs.whole_hash import WholeHash

log = logging.getLogger(__name__)

INCOMING_PREFIX = reserved.INCOMING
# Files being received at once: many more than the senders keep in flight (a few per peer).
RUNNING_LIMIT = 64
# Seconds without a chunk after which a file's transfer is taken as abandoned: a live sender
# fails its connection after IO_TIMEOUT (10 s) without an answer.
RUNNING_IDLE = 120.0
# Chunks written at once (worker threads): one per connection a few senders keep busy.
WRITERS = 16
WRITE_SLICE = 1 << 20  # bytes of a chunk written, then hashed, at a time
# Chunks up to this size, in hand, are written and hashed on the loop: handing them to a
# thread and back costs more than the write (a step of many small files paid it per file).
INLINE_WRITE_BYTES = 64 << 10


class Space(Protocol):
    """The RAM store's accounting, as much of it as a receiver needs."""

    def grow(self, backing_ino: int, new_end: int) -> None:
        """Count the file as ending at `new_end`; RamFull if the RAM tier has no room."""

    def forget_inode(self, backing_ino: int) -> None: ...


# (step path, version, names, sender) -> the names now held, or None: `OtherTiers.hold_files`
Hold = Callable[[str, int, list[str], str], Awaitable[list[str] | None]]


class ReplicaReceiver:
    def __init__(self, objects_dir: Path, space: Space, hold: Hold,
                 running_limit: int = RUNNING_LIMIT,
                 running_idle: float = RUNNING_IDLE) -> None:
        self.objects_dir = objects_dir
        self.space = space
        self._hold = hold
        self._threads = trio.CapacityLimiter(WRITERS)
        # incoming file -> its transfer (fd, chunks written, running hash), in order of last
        # use (a used entry is put back at the end), for _prune
        self._incoming_files: dict[Path, _Incoming] = {}
        self._running_limit = running_limit
        self._running_idle = running_idle
        self._swept_at = time.monotonic()
        # incoming files refused for want of room -> why (their later chunks are refused too)
        self._refused: dict[Path, str] = {}
        self._small = itertools.count()  # a name of its own for each small file's incoming
        # bytes of completed transfers read back from their files for the whole-file hash
        # (chunks that came ahead of their file's order, or twice)
        self.read_back = 0

    def _incoming(self, digest: str, peer: str) -> Path:
        return self.objects_dir / f"{INCOMING_PREFIX}{digest}-{peer}"

    async def put(self, message: proto.Message, channel: PeerChannel) -> None:
        """A chunk of a file: its payload in hand, or streamed (`message.pending`: received,
        written and hashed a slice at a time by one worker thread, `_receive_chunk`)."""
        digest, size, offset = message["xxh3"], message["size"], message["offset"]
        length = message.pending or len(message.payload)
        if len(digest) != 32 or any(c not in "0123456789abcdef" for c in digest):
            raise proto.ProtocolError("PUT with a malformed xxh3")
        if offset % mf.CHUNK_SIZE or offset + length > size or (
                length != min(mf.CHUNK_SIZE, size - offset)):
            raise proto.ProtocolError("PUT chunk does not fit the announced file")
        if (self.objects_dir / digest).exists():
            await _drop_payload(message, channel)
            await channel.send("OK")  # already here (another step, or an earlier attempt)
            return
        path = self._incoming(digest, channel.peer_id)
        refused = self._refused.get(path)
        if refused is not None and offset:
            # a later chunk of a transfer refused for want of room (the sender had it in
            # flight): not written, refused again; its first chunk sent again starts it over
            await _drop_payload(message, channel)
            await channel.send("NO_ROOM", message=refused)
            return
        self._refused.pop(path, None)
        try:
            incoming = self._transfer(path, size)
        except OSError as exc:  # no room for the file itself (a full /dev/shm)
            await _drop_payload(message, channel)
            await self._no_room(path, None, message, channel, exc.strerror or str(exc))
            return
        try:
            self.space.grow(incoming.ino, offset + length)
        except RamFull:
            await _drop_payload(message, channel)
            await self._no_room(path, incoming, message, channel, "its RAM tier is full")
            return
        index = offset // mf.CHUNK_SIZE
        again = index in incoming.have or index in incoming.writing
        incoming.writing[index] += 1
        fd = os.dup(incoming.fd)  # its own: a discard meanwhile closes the transfer's
        whole = None if again else incoming.whole
        no_room: list[str] = []
        try:  # off the trio thread, which serves the mount meanwhile
            if message.pending:
                await channel.in_thread(_receive_chunk, fd, offset, whole, no_room)
            else:
                try:
                    if len(message.payload) <= INLINE_WRITE_BYTES:
                        _write(fd, message.payload, offset, whole)
                    else:
                        await trio.to_thread.run_sync(_write, fd, message.payload, offset,
                                                      whole, limiter=self._threads)
                except OSError as exc:
                    no_room.append(exc.strerror or str(exc))
        except BaseException:
            # a streamed chunk whose tags failed, or cut off: bytes that are not the sender's
            # may be in the file, which must never count (even if its xxh3 matched)
            if message.pending:
                self._forget(path, incoming)
                log.warning("replica of %s/%s from %s discarded: a chunk of it did not "
                            "arrive whole and authentic", message["path"], message["name"],
                            channel.peer_id)
            raise
        finally:
            os.close(fd)
            incoming.writing[index] -= 1
            if not incoming.writing[index]:
                del incoming.writing[index]
        if no_room:  # the RAM dir's file system is full (a shared /dev/shm)
            await self._no_room(path, incoming, message, channel,
                                f"the file system of its RAM dir: {no_room[0]}")
            return
        if self._incoming_files.get(path) is not incoming:
            await channel.send("OK")  # discarded meanwhile: nothing of it counts
            return
        incoming.rewritten |= again
        incoming.have.add(index)
        if len(incoming.have) < incoming.chunks or incoming.writing:
            await channel.send("OK")
            return
        del self._incoming_files[path]
        try:
            found, found_size = incoming.whole.digest(), size
            self.read_back += incoming.whole.read_back
            if incoming.rewritten or found is None:  # read the file back
                whole = await trio.to_thread.run_sync(mf.hash_fd, incoming.fd,
                                                      limiter=self._threads)
                found, found_size = whole.xxh3, whole.size
                self.read_back += size
        finally:
            os.close(incoming.fd)
        if found != digest or found_size != size:
            await self._discard(path, incoming, message, channel, "does not match its checksum",
                                "checksum mismatch")
            return
        os.rename(path, self.objects_dir / digest)
        await channel.send("OK")

    async def put_files(self, message: proto.Message, channel: PeerChannel) -> None:
        """PUT_FILES: small whole files at once, their bytes one after the other. Those not
        here yet are each checked against their xxh3-128 and written to an incoming file of
        its own, in one worker thread for the lot (`_write_small`); then each is charged to
        the RAM tier and becomes its object. Answered OK once every one is here; NO_ROOM if
        the RAM tier or its file system has no room for one (those before it stay); ERROR if
        a file's bytes do not match its digest (a holder's bad copy: that file is not kept,
        the others are; the sender tries again later)."""
        wanted: dict[str, tuple[str, memoryview]] = {}  # digest -> a name, its bytes
        for name, digest, data in zip(message["names"], message["digests"],
                                      proto.cut_files(message, message.payload), strict=True):
            if digest not in wanted and not os.path.exists(self.objects_dir / digest):
                wanted[digest] = (name, data)
        written, bad, full = await trio.to_thread.run_sync(
            self._write_small, wanted, channel.peer_id, limiter=self._threads)
        no_room = ""
        for digest, path, ino, size in written:
            if no_room or os.path.exists(self.objects_dir / digest):  # one came meanwhile
                path.unlink(missing_ok=True)
                continue
            try:
                self.space.grow(ino, size)
            except RamFull:
                path.unlink(missing_ok=True)
                no_room = "its RAM tier is full"
                continue
            os.rename(path, self.objects_dir / digest)
        no_room = no_room or full
        if no_room:
            log.warning("small files of %s from %s found no room (%s): refused",
                        message["path"], channel.peer_id, no_room)
            await channel.send("NO_ROOM", message=f"no room on {no_room}")
        elif bad:
            log.error("small files of %s from %s do not match their checksums: discarded "
                      "(%s)", message["path"], channel.peer_id, ", ".join(bad[:5]))
            await channel.send("ERROR", message="checksum mismatch: "
                               f"{len(bad)} of {len(message['names'])} files")
        else:
            await channel.send("OK")

    def _write_small(self, wanted: dict[str, tuple[str, memoryview]], peer: str
                     ) -> tuple[list[tuple[str, Path, int, int]], list[str], str]:
        """In a worker thread: each file of `wanted` whose bytes hash to its digest written to
        an incoming file of its own (digest, its path, its inode, its size); the names of
        those that do not; and why the RAM dir's file system took no more, if it did not."""
        written: list[tuple[str, Path, int, int]] = []
        bad: list[str] = []
        for digest, (name, data) in wanted.items():
            if mf.hash_bytes(data) != digest:
                bad.append(name)
                continue
            path = self.objects_dir / f"{INCOMING_PREFIX}{digest}-{peer}-{next(self._small)}"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    write_all(fd, data, 0)
                    written.append((digest, path, os.fstat(fd).st_ino, len(data)))
                finally:
                    os.close(fd)
            except OSError as exc:
                path.unlink(missing_ok=True)
                return written, bad, f"the file system of its RAM dir: {exc.strerror or exc}"
        return written, bad, ""

    def _transfer(self, path: Path, size: int) -> _Incoming:
        """The transfer of the incoming file at `path` (put back as the most recently used),
        or a new one: the file made `size` long (holes until its chunks come; an abandoned
        attempt's bytes count for nothing, each chunk must come again)."""
        incoming = self._incoming_files.pop(path, None)
        if incoming is not None and incoming.size != size:
            self._drop(incoming)  # another size for that content: a lying or broken sender
            incoming = None
        if incoming is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                raise
            incoming = _Incoming(fd, os.fstat(fd).st_ino, size)
        incoming.used = time.monotonic()
        self._incoming_files[path] = incoming
        self._prune(incoming.used)
        return incoming

    async def _discard(self, path: Path, incoming: _Incoming | None, message: proto.Message,
                       channel: PeerChannel, why: str, answer: str,
                       kind: str = "ERROR", level: int = logging.ERROR) -> None:
        """A replica that is not kept: its incoming file, its transfer and its RAM count go,
        and the sender is answered (`kind`: ERROR, it tries again later; or NO_ROOM, it
        makes the copy elsewhere)."""
        if incoming is not None:
            self._forget(path, incoming)
        else:
            path.unlink(missing_ok=True)
        log.log(level, "replica of %s/%s from %s %s: discarded", message["path"],
                message["name"], channel.peer_id, why)
        await channel.send(kind, message=answer)

    async def _no_room(self, path: Path, incoming: _Incoming | None, message: proto.Message,
                       channel: PeerChannel, why: str) -> None:
        """No room for a replica here: discarded, its later chunks refused too without a
        write (`_refused`), and the sender told NO_ROOM. One warning per refusal, no more:
        the sender tries another node."""
        answer = f"no room on {why}"
        self._refused[path] = answer
        while len(self._refused) > RUNNING_LIMIT:
            del self._refused[next(iter(self._refused))]
        await self._discard(path, incoming, message, channel, f"found no room ({why})", answer,
                            "NO_ROOM", logging.WARNING)

    def _forget(self, path: Path, incoming: _Incoming) -> None:
        """A transfer's end without its object: its state, its incoming file (unless a newer
        transfer's has the name now) and the RAM tier's count of it go. Chunks of it still
        being written go to the removed file, and count for nothing."""
        if self._incoming_files.get(path) is incoming:
            del self._incoming_files[path]
            self._drop(incoming)
        self.space.forget_inode(incoming.ino)
        try:
            if os.stat(path).st_ino == incoming.ino:
                path.unlink()
        except FileNotFoundError:
            pass

    @staticmethod
    def _drop(incoming: _Incoming) -> None:
        if incoming.fd >= 0:
            os.close(incoming.fd)
            incoming.fd = -1

    def _prune(self, now: float) -> None:
        """Drop the transfers abandoned midway: idle for longer than running_idle, or the
        least recently used beyond running_limit (one with a chunk being written stays).
        Every running_idle seconds, the incoming files left by abandoned transfers go too
        (`_sweep`)."""
        for path, incoming in list(self._incoming_files.items()):  # least recently used first
            if (len(self._incoming_files) <= self._running_limit
                    and now - incoming.used < self._running_idle):
                break  # the rest were used later still
            if not incoming.writing:
                del self._incoming_files[path]
                self._drop(incoming)
        if now - self._swept_at >= self._running_idle:
            self._swept_at = now
            self._sweep()

    def _sweep(self) -> None:
        """Remove the incoming files not written to for running_idle seconds, and the RAM
        tier's count of them: a sender gives up long before (it fails a connection after
        IO_TIMEOUT without an answer), and one that tries again starts the file over."""
        oldest = time.time() - self._running_idle
        with os.scandir(self.objects_dir) as entries:
            for entry in entries:
                if not entry.name.startswith(INCOMING_PREFIX):
                    continue
                try:
                    info = entry.stat()
                    if info.st_mtime >= oldest or Path(entry.path) in self._incoming_files:
                        continue
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                self.space.forget_inode(info.st_ino)
                log.info("removed %s: its transfer was abandoned", entry.name)

    async def hold(self, message: proto.Message, channel: PeerChannel) -> None:
        """HOLD: the sender has PUT these files of the step's committed version; this node
        holds those whose objects it has (verified as they arrived) and answers HELD with
        their names, or ERROR if it cannot hold that version at all."""
        path, version, names = message["path"], message["version"], list(message["names"])
        held = await self._hold(path, version, names, channel.peer_id)
        if held is None:
            # e.g. a newer version of the step is here: the sender must not count this node
            # as a holder of its version
            await channel.send("ERROR", message=f"{path} v{version} is not held here "
                               "(another version, the name is in use, or not committed)")
            return
        await channel.send("HELD", names=held)


class _Incoming:
    """One file being received from one peer: its open incoming file, the chunks written to
    it (and being written now), and its xxh3-128 so far."""

    def __init__(self, fd: int, ino: int, size: int) -> None:
        self.fd = fd
        self.ino = ino
        self.size = size
        self.chunks = max(1, mf.chunk_count(size))  # an empty file comes as one empty PUT
        self.have: set[int] = set()
        self.writing: Counter[int] = Counter()  # chunk -> its writes in progress
        self.whole = WholeHash(size, mf.CHUNK_SIZE)
        self.rewritten = False  # a chunk came twice: the running hash says nothing
        self.used = 0.0  # time.monotonic() of its last chunk


async def _drop_payload(message: proto.Message, channel: PeerChannel) -> None:
    """A streamed chunk that is not kept: its bytes are taken off the connection (and their
    tags checked) before the answer."""
    if message.pending:
        await channel.in_thread(lambda io: io.stream_payload(None))


def _receive_chunk(io: BlockingChannel, fd: int, offset: int, whole: WholeHash | None,
                   no_room: list[str]) -> None:
    """In a worker thread, on the channel lent to it: a streamed chunk's slices, each written
    at its place and hashed (`whole`, unless the chunk came before) while in the CPU's cache,
    then the chunk's tags checked (ProtocolError if they fail: the caller forgets the file).
    No room in the RAM dir's file system: the rest is taken off the connection unwritten and
    the reason put in `no_room`."""
    index = offset // mf.CHUNK_SIZE
    claimed = whole is not None and whole.claim(index)
    good = False

    def sink(piece: memoryview, at: int) -> None:
        if no_room:
            return
        try:
            write_all(fd, piece, offset + at)
        except OSError as exc:
            no_room.append(exc.strerror or str(exc))
            return
        if claimed:
            assert whole is not None
            whole.feed(piece)

    try:
        io.stream_payload(sink)
        good = not no_room
    finally:
        if whole is not None:
            whole.stored(fd, range(index, index + 1), good, claimed)


def _write(fd: int, data: bytes | memoryview, offset: int, whole: WholeHash | None) -> None:
    """In a worker thread: store a chunk and add it to its file's hash (`whole`, unless the
    chunk came before), a slice at a time: each is hashed while the write left it in the
    CPU's cache."""
    index = offset // mf.CHUNK_SIZE
    claimed = whole is not None and whole.claim(index)
    good = False
    view = memoryview(data)
    try:
        for start in range(0, max(len(view), 1), WRITE_SLICE):
            piece = view[start:start + WRITE_SLICE]
            write_all(fd, piece, offset + start)
            if claimed:
                assert whole is not None
                whole.feed(piece)
        good = True
    finally:
        if whole is not None:
            whole.stored(fd, range(index, index + 1), good, claimed)
