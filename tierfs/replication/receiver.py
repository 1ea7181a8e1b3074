"""Receiving replicas from peers into this node's RAM store.

Chunks arrive in order per file into a private incoming file next to the committed objects;
a complete file becomes the object named by its xxh3-128 only if its bytes hash to exactly that.
A replica's manifest arrives last and is accepted only when every file it names is present and
verified; only then does the sender count this node as a holder. Paths and sizes were validated
by the protocol; offsets and lengths are checked here against what was announced.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import trio

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.replication import protocol as proto
from tierfs.replication.channel import PeerChannel

log = logging.getLogger(__name__)

INCOMING_PREFIX = reserved.INCOMING


class Space(Protocol):
    """The RAM store's accounting, as much of it as a receiver needs."""

    def grow(self, backing_ino: int, new_end: int) -> None: ...

    def forget_inode(self, backing_ino: int) -> None: ...


class ReplicaReceiver:
    def __init__(self, objects_dir: Path, space: Space,
                 adopt: Callable[[mf.StepManifest, str], bool]) -> None:
        self.objects_dir = objects_dir
        self.space = space
        self._adopt = adopt
        self._threads = trio.CapacityLimiter(2)

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
        fd = os.open(incoming, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if offset == 0 else 0),
                     0o600)
        try:
            ino = os.fstat(fd).st_ino
            try:
                self.space.grow(ino, offset + len(data))
            except Exception:
                await channel.send("ERROR", message="RAM tier full on the receiving node")
                return
            # up to 8 MiB: off the trio thread, which serves the mount meanwhile
            await trio.to_thread.run_sync(os.pwrite, fd, data, offset, limiter=self._threads)
            if offset + len(data) < size:
                await channel.send("OK")
                return
            digest_found = await trio.to_thread.run_sync(mf.hash_fd, fd, limiter=self._threads)
        finally:
            os.close(fd)
        if digest_found.xxh3 != digest or digest_found.size != size:
            self.space.forget_inode(ino)
            incoming.unlink()
            log.error("replica of %s/%s from %s does not match its checksum: discarded",
                      message["path"], message["name"], channel.peer_id)
            await channel.send("ERROR", message="checksum mismatch")
            return
        os.rename(incoming, target)
        await channel.send("OK")

    async def put_manifest(self, message: proto.Message, channel: PeerChannel) -> None:
        try:
            manifest = mf.decode(message["manifest"])
        except mf.ManifestError as exc:
            raise proto.ProtocolError(f"bad replica manifest: {exc}") from None
        for entry in manifest.files:
            try:
                size = (self.objects_dir / entry.xxh3).stat().st_size
            except FileNotFoundError:
                size = -1
            if size != entry.size:
                await channel.send("ERROR", message=f"{entry.name} was not received")
                return
        if not self._adopt(manifest, channel.peer_id):
            # e.g. a newer version of the step is here: the sender must not count this node
            # as a holder of its version
            await channel.send("ERROR", message=f"{manifest.path} v{manifest.version} is not "
                               "held here (another version, or the name is in use)")
            return
        await channel.send("OK")
