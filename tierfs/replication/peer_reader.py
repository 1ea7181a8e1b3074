"""Peers as a read source: byte ranges of committed files from a node that holds them, and
serving such ranges to peers. Reads of the same file are spread over its holders by offset, so
that a restore on every node at once (DDP) does not fall on the writer alone."""

from __future__ import annotations

import os
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from tierfs import manifest as mf
from tierfs.replication import protocol as proto
from tierfs.replication.channel import PeerChannel
from tierfs.replication.membership import Membership

_HEX = set("0123456789abcdef")


class PeerReader:
    name = "peer"

    def __init__(self, membership: Membership, holders: Callable[[str, str], list[str]],
                 refresh: Callable[[str, str], Awaitable[list[str]]] | None = None) -> None:
        self.membership = membership
        self._holders = holders
        # Who holds a file now, asked when every holder known here failed: copies made
        # since this node last read the file's record (e.g. of a file it holds nothing of).
        self._refresh = refresh

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> memoryview:
        """The bytes (a view the caller owns: received in place, not copied) from the first
        of the file's own holders that answers (a multi-node step's files are on different
        nodes), over a pooled connection."""
        return await self._read(step_path, entry, offset, length, None)

    async def read_into(self, step_path: str, entry: mf.FileEntry, offset: int,
                        buffer: memoryview) -> memoryview:
        """As read_range for len(buffer) bytes, received straight into `buffer` (the view of
        it that holds the bytes, which may be shorter)."""
        return await self._read(step_path, entry, offset, len(buffer), buffer)

    async def _read(self, step_path: str, entry: mf.FileEntry, offset: int, length: int,
                    into: memoryview | None) -> memoryview:
        failures: list[str] = []
        tried: set[str] = set()
        holders = self._holders(step_path, entry.name)
        for _attempt in range(2):
            untried = [h for h in holders if h != self.membership.me and h not in tried]
            tried.update(untried)
            data = await self._read_from(untried, step_path, entry, offset, length, into,
                                         failures)
            if data is not None:
                return data
            if self._refresh is None:
                break
            holders = await self._refresh(step_path, entry.name)
        raise proto.ProtocolError("; ".join(failures) or "no peer holds it")

    async def _read_from(self, holders: list[str], step_path: str, entry: mf.FileEntry,
                         offset: int, length: int, into: memoryview | None,
                         failures: list[str]) -> memoryview | None:
        """The bytes from the first of `holders` that gives them (None if none does: each
        failure is added to `failures`)."""
        if not holders:
            return None
        start = zlib.crc32(f"{entry.xxh3}:{offset}".encode()) % len(holders)
        rotated = holders[start:] + holders[:start]
        # Live holders first; the others too, since a peer may be up before a heartbeat says so.
        ordered = sorted(rotated, key=lambda h: not self.membership.is_up(h))
        for node_id in ordered:
            try:
                async with self.membership.channel(node_id) as channel:
                    await channel.send("GET", path=step_path, name=entry.name,
                                       xxh3=entry.xxh3, offset=offset, length=length)
                    reply = await channel.receive("DATA", into=into)
                    payload = reply.payload
                    if isinstance(payload, memoryview) and into is not None and (
                            payload.obj is into.obj):
                        return payload  # in the caller's buffer already
                    return channel.take_payload(reply)
            except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
                failures.append(f"{node_id}: {exc or 'timed out'}")
        return None


class RangeServer:
    """Answers GET from the committed objects in RAM (immutable, named by their xxh3-128), or
    from a sealed file of a step being committed on another node (multi-node DCP)."""

    def __init__(self, objects_dir: Path,
                 sealed_path: Callable[[str, str, str], bytes | None]) -> None:
        self.objects_dir = objects_dir
        self._sealed_path = sealed_path
        self.served_requests = 0
        self.served_bytes = 0

    async def on_get(self, message: proto.Message, channel: PeerChannel) -> None:
        digest = message["xxh3"]
        if len(digest) != 32 or not set(digest) <= _HEX:
            raise proto.ProtocolError("GET with a malformed xxh3")
        path = self.objects_dir / digest
        if not path.exists():
            path = self._sealed_path(message["path"], message["name"], digest)  # type: ignore[assignment]
        try:
            if path is None:
                raise FileNotFoundError
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            await channel.send("ERROR", message=f"{message['path']}/{message['name']} is not "
                               "in this node's RAM")
            return
        try:
            # the bytes that exist from the offset on, as pread would have returned them
            size = os.fstat(fd).st_size
            length = max(0, min(message["length"], size - message["offset"]))
            await channel.send_file("DATA", fd, message["offset"], length)
        finally:
            os.close(fd)
        self.served_requests += 1
        self.served_bytes += length
