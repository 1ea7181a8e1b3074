"""Receiving replicas from peers into this node's RAM store.

Chunks arrive in order per file into a private incoming file next to the committed objects;
a complete file becomes the object named by its xxh3-128 only if its bytes hash to exactly that.
HOLD comes after the files it names: this node holds those whose objects are here (verified) in
its copy of the step's committed version (`OtherTiers.hold_files`) and names them in HELD; only
those does the sender count this node as a holder of. Paths and sizes were validated
by the protocol; offsets and lengths are checked here against what was announced.

A file whose chunks arrive in order is hashed as it arrives; the running hashes of transfers
abandoned midway (a sender killed, or gone to a newer version) are dropped once idle for
RUNNING_IDLE seconds or beyond the RUNNING_LIMIT most recently used. Dropping one is always
safe: if that file's chunks do come after all, it is read back and hashed whole at its end.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import trio
import xxhash

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.fs.ram_store import RamFull, write_all
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import PeerChannel

log = logging.getLogger(__name__)

INCOMING_PREFIX = reserved.INCOMING
# Files hashed as they arrive at once: many more than the senders keep in flight (a window of
# a few chunks per connection, one connection or two per peer).
RUNNING_LIMIT = 64
# Seconds without a chunk after which a file's transfer is taken as abandoned: a live sender
# fails its connection after IO_TIMEOUT (10 s) without an answer.
RUNNING_IDLE = 120.0


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
        self._threads = trio.CapacityLimiter(2)
        # incoming file -> the xxh3-128 of every byte written to it so far, while its chunks
        # arrive in order, one at a time: the file is checked as it arrives, not read back.
        # In order of last use (a used entry is put back at the end), for _prune.
        self._hashing: dict[Path, _Running] = {}
        self._running_limit = running_limit
        self._running_idle = running_idle
        self._swept_at = time.monotonic()
        # incoming files refused for want of room -> why (their later chunks are refused too)
        self._refused: dict[Path, str] = {}

    def _incoming(self, digest: str, peer: str) -> Path:
        return self.objects_dir / f"{INCOMING_PREFIX}{digest}-{peer}"

    async def put(self, message: proto.Message, channel: PeerChannel) -> None:
        digest, size, offset = message["xxh3"], message["size"], message["offset"]
        data = message.payload
        if len(digest) != 32 or any(c not in "0123456789abcdef" for c in digest):
            raise proto.ProtocolError("PUT with a malformed xxh3")
        if offset % mf.CHUNK_SIZE or offset + len(data) > size or (
                len(data) != min(mf.CHUNK_SIZE, size - offset)):
            raise proto.ProtocolError("PUT chunk does not fit the announced file")
        target = self.objects_dir / digest
        if target.exists():
            await channel.send("OK")  # already here (another step, or an earlier attempt)
            return
        incoming = self._incoming(digest, channel.peer_id)
        try:
            fd = os.open(incoming, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if offset == 0 else 0),
                         0o600)
        except FileNotFoundError:
            # a later chunk of a transfer whose earlier chunk was refused (the sender had it
            # in flight): not written, or it would make a file with a hole, refused again
            refused = self._refused.get(incoming)
            await channel.send(*(("NO_ROOM", refused) if refused is not None else (
                "ERROR", "the file's earlier chunks are not here: send it again")))
            return
        except OSError as exc:  # no room for the file itself (a full /dev/shm)
            await self._no_room(incoming, None, message, channel, exc.strerror or str(exc))
            return
        self._refused.pop(incoming, None)
        try:
            ino = os.fstat(fd).st_ino
            try:
                self.space.grow(ino, offset + len(data))
            except RamFull:
                await self._no_room(incoming, ino, message, channel, "its RAM tier is full")
                return
            running = self._running(incoming, offset)
            try:  # up to 8 MiB: off the trio thread, which serves the mount meanwhile
                await trio.to_thread.run_sync(_write, fd, data, offset, running,
                                              limiter=self._threads)
            except OSError as exc:  # the RAM dir's file system is full (a shared /dev/shm)
                why = exc.strerror or str(exc)
                await self._no_room(incoming, ino, message, channel,
                                    f"the file system of its RAM dir: {why}")
                return
            running = self._written(incoming, running, offset + len(data))
            if offset + len(data) < size:
                await channel.send("OK")
                return
            self._hashing.pop(incoming, None)
            if running is not None:
                found, found_size = running.hasher.hexdigest(), size
            else:  # written out of order or by two at once: read the file back
                whole = await trio.to_thread.run_sync(mf.hash_fd, fd, limiter=self._threads)
                found, found_size = whole.xxh3, whole.size
        finally:
            os.close(fd)
        if found != digest or found_size != size:
            await self._discard(incoming, ino, message, channel, "does not match its checksum",
                                "checksum mismatch")
            return
        os.rename(incoming, target)
        await channel.send("OK")

    async def _discard(self, incoming: Path, ino: int | None, message: proto.Message,
                       channel: PeerChannel, why: str, answer: str,
                       kind: str = "ERROR", level: int = logging.ERROR) -> None:
        """A replica that is not kept: its incoming file, running hash and RAM count go, and
        the sender is answered (`kind`: ERROR, or NO_ROOM: it makes the copy elsewhere)."""
        self._hashing.pop(incoming, None)
        if ino is not None:
            self.space.forget_inode(ino)
        incoming.unlink(missing_ok=True)
        log.log(level, "replica of %s/%s from %s %s: discarded", message["path"],
                message["name"], channel.peer_id, why)
        await channel.send(kind, message=answer)

    async def _no_room(self, incoming: Path, ino: int | None, message: proto.Message,
                       channel: PeerChannel, why: str) -> None:
        """No room for a replica here: discarded, its later chunks refused too without a
        write (`_refused`), and the sender told NO_ROOM. One warning per refusal, no more:
        the sender tries another node."""
        answer = f"no room on {why}"
        self._refused[incoming] = answer
        while len(self._refused) > RUNNING_LIMIT:
            del self._refused[next(iter(self._refused))]
        await self._discard(incoming, ino, message, channel, f"found no room ({why})", answer,
                            "NO_ROOM", logging.WARNING)

    def _running(self, incoming: Path, offset: int) -> _Running | None:
        """The running hash that the chunk at `offset` continues (a new one at offset 0), or
        None; any other write breaks the file's running hash (it is then read back)."""
        running = self._hashing.pop(incoming, None)
        if offset == 0:
            running = _Running()
        elif running is None or running.busy or running.position != offset:
            return None
        running.busy = True
        running.used = time.monotonic()
        self._hashing[incoming] = running
        self._prune(running.used)
        return running

    def _prune(self, now: float) -> None:
        """Drop the running hashes of transfers abandoned midway: idle for longer than
        running_idle, or the least recently used beyond running_limit (a chunk being written
        keeps its own). Every running_idle seconds, the incoming files left by abandoned
        transfers go too (`_sweep`)."""
        for incoming, running in list(self._hashing.items()):  # least recently used first
            if (len(self._hashing) <= self._running_limit
                    and now - running.used < self._running_idle):
                break  # the rest were used later still
            if not running.busy:
                del self._hashing[incoming]
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
                    if info.st_mtime >= oldest or Path(entry.path) in self._hashing:
                        continue
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                self.space.forget_inode(info.st_ino)
                log.info("removed %s: its transfer was abandoned", entry.name)

    def _written(self, incoming: Path, running: _Running | None,
                 end: int) -> _Running | None:
        """After a chunk's write: its running hash, if no other write to the file came in
        between (which removed or replaced it), now up to `end`."""
        if running is None or self._hashing.get(incoming) is not running:
            return None
        running.busy, running.position = False, end
        return running

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


class _Running:
    """The xxh3-128 of an incoming file's bytes [0, position), written in order."""

    def __init__(self) -> None:
        self.hasher = xxhash.xxh3_128()
        self.position = 0
        self.busy = False  # a chunk is being written: a write meanwhile breaks the hash
        self.used = 0.0  # time.monotonic() of its last chunk


def _write(fd: int, data: bytes | memoryview, offset: int, running: _Running | None) -> None:
    """In a worker thread: store a chunk and add it to its file's running hash."""
    write_all(fd, data, offset)
    if running is not None:
        running.hasher.update(data)
