"""Peers as a read source: byte ranges of committed files from a node that holds them, and
serving such ranges to peers. Reads of the same file are spread over its holders by offset,
and each holder sends a chunk it already sent to readers that have it (`sources`), so that
a restore on every node at once (DDP) leaves the writer's uplink about once.

A large range (a block or a chunk) is asked for, received, checked and stored by one worker
thread (`read_and_store`, `PeerChannel.in_thread`): the request, the reply's payload into the
fetch's buffer with its tags, and the fetch's check and write into the RAM tier's partial file,
with no hop through the event loop in between; the holder sends it from its RAM file by
`sendfile` from a worker thread of its own (`RangeServer`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from tierfs import manifest as mf
from tierfs.fs.model.ports import Store, TierError
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers import sources
from tierfs.replication.peers.channel import (
    BULK,
    BlockingChannel,
    ConnectionClosed,
    ConnectionLost,
    PeerChannel,
)
from tierfs.replication.peers.directory import PeerDirectory

log = logging.getLogger(__name__)

RETRY_EVERY = 0.5  # seconds between tries meanwhile (a holder restarted at the same address)
# Seconds between two failed reads of a holder beyond which the second starts a new outage
# (and a new `holder_wait`): a holder no read asked meanwhile may have come back and gone again.
OUTAGE_GAP = 10.0


@dataclass
class _Outage:
    """Reads of one holder failing since `since` (trio time), the last at `last`."""

    since: float
    last: float
    told: bool = False  # the wait for it was logged


class PeerReader:
    name = "peer"
    can_store = True  # `read_and_store`: the bytes checked and stored where they came in

    def __init__(self, directory: PeerDirectory, holders: Callable[[str, str], list[str]],
                 refresh: Callable[[str, str], Awaitable[list[str]]] | None = None) -> None:
        self.directory = directory
        self._holders = holders
        # Who holds a file now, asked when every holder known here failed: copies made
        # since this node last read the file's record (e.g. of a file it holds nothing of).
        self._refresh = refresh
        self._outages: dict[str, _Outage] = {}  # holders that reads here failed to reach
        # Seconds the reads wait for a holder that does not answer while its lease lives, from
        # the first read it failed: a killed daemon's lease ends within its ttl after its last
        # keepalive, and the watch tells every node; a daemon restarting at its address
        # answers within it (the members' rejoin grace: the ttl and a keepalive's margin).
        self.holder_wait = directory.live.rejoin_grace

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> memoryview:
        """The bytes (a view the caller owns: received in place, not copied) from the first
        of the file's own holders that answers (a multi-node step's files are on different
        nodes), over a pooled connection."""
        data, _good = await self._read(step_path, entry, offset, length, None, None)
        return data

    async def read_into(self, step_path: str, entry: mf.FileEntry, offset: int,
                        buffer: memoryview) -> memoryview:
        """As read_range for len(buffer) bytes, received straight into `buffer` (the view of
        it that holds the bytes, which may be shorter)."""
        data, _good = await self._read(step_path, entry, offset, len(buffer), buffer, None)
        return data

    async def read_and_store(self, step_path: str, entry: mf.FileEntry, offset: int,
                             buffer: memoryview, store: Store) -> tuple[memoryview, bool]:
        """As read_into, and `store(the bytes)` (`fetch.Store`: they are checked and stored)
        called by the thread that received them, if they are the whole range; the bytes and
        whether they matched."""
        return await self._read(step_path, entry, offset, len(buffer), buffer, store)

    async def read_files(self, step_path: str, entries: list[mf.FileEntry]
                         ) -> dict[str, memoryview]:
        """`fs.store.fetch.FilesSource`: whole small files of one step, by name, as many of
        `entries` as the first holder of the first that answers has in RAM, in one GET_FILES
        per MAX_NAMES names ({} if none answers: each file is then read on its own, which
        waits for a holder as `_read` does). Unchecked: the caller's fetch checks each."""
        got: dict[str, memoryview] = {}
        if not entries:
            return got
        holders = [h for h in self._holders(step_path, entries[0].name)
                   if h != self.directory.me]
        for node_id in self._ask_order(holders, entries[0].xxh3, 0):
            try:
                async with self.directory.channel(node_id) as channel:
                    for batch in proto.name_batches(entries, lambda e: e.name):
                        await channel.send("GET_FILES", path=step_path,
                                           names=[entry.name for entry in batch],
                                           digests=[entry.xxh3 for entry in batch])
                        reply = await channel.receive("FILES_DATA")
                        got.update(_cut(batch, reply, channel.take_payload(reply)))
                return got
            except (OSError, trio.TooSlowError, ConnectionClosed, ConnectionLost,
                    proto.ProtocolError) as exc:
                log.info("%s: small files of %s not read at once from %s (%s); one by one",
                         step_path, node_id, exc or "timed out")
        return got

    async def _read(self, step_path: str, entry: mf.FileEntry, offset: int, length: int,
                    into: memoryview | None, store: Store | None) -> tuple[memoryview, bool]:
        """The bytes (and whether `store` took them) from the file's holders (those known
        here, then those its record names now). When none gives them and one that could not
        be reached is still a live member (its lease lives: a daemon just killed, or
        restarting), the read waits for it, or for its loss to be known, trying again at each
        change of the members and every RETRY_EVERY: a node learns a loss only when the lease
        ends, and a holder back within it serves the read. The reads of this node wait for a
        holder `holder_wait` seconds from the first that failed to reach it, not each as long
        (a load of many files through a node cut off from a live holder would wait for it
        file by file, chunk by chunk); then TierError, EIO to the reader."""
        while True:
            failures: list[str] = []
            unreachable: set[str] = set()
            got = await self._read_once(step_path, entry, offset, length, into, store,
                                        failures, unreachable)
            if got is not None:
                return got
            now = trio.current_time()
            waiting = {h: self._outages[h] for h in unreachable
                       if h in self._outages and self.directory.is_up(h)}
            deadline = max((o.since + self.holder_wait for o in waiting.values()), default=now)
            if deadline <= now:
                raise TierError("; ".join(failures) or "no peer holds it")
            untold = sorted(h for h, o in waiting.items() if not o.told)
            if untold:
                for node_id in untold:
                    waiting[node_id].told = True
                log.warning("%s/%s: %s does not answer but is a live member: reads of its "
                            "files wait up to %.0f s for it or for its loss", step_path,
                            entry.name, ", ".join(untold), self.holder_wait)
            changed = self.directory.changed
            with trio.move_on_at(min(deadline, now + RETRY_EVERY)):
                await changed.wait()

    def _ask_order(self, holders: list[str], xxh3: str, offset: int) -> list[str]:
        """`sources.holder_order`, without the holders this node's reads have failed to
        reach for `holder_wait` seconds or more and whose peer handshake still fails here (or
        whose lease ended): a read does not wait out a connection timeout for each of them
        (`handshakes` probes them every few seconds; once one answers, reads ask it again)."""
        now = trio.current_time()
        asked = []
        for node_id in sources.holder_order(holders, xxh3, offset, self.directory.is_up):
            outage = self._outages.get(node_id)
            if outage is not None and now - outage.since >= self.holder_wait \
                    and not self.directory.may_be_up(node_id):
                outage.last = now  # the outage goes on, untried
                continue
            asked.append(node_id)
        return asked

    def _unreached(self, node_id: str) -> None:
        now = trio.current_time()
        outage = self._outages.get(node_id)
        if outage is None or now - outage.last > OUTAGE_GAP:
            self._outages[node_id] = _Outage(now, now)
        else:
            outage.last = now

    async def _read_once(self, step_path: str, entry: mf.FileEntry, offset: int, length: int,
                         into: memoryview | None, store: Store | None, failures: list[str],
                         unreachable: set[str]) -> tuple[memoryview, bool] | None:
        """One round: the holders known here, then those the file's record names now."""
        tried: set[str] = set()
        holders = self._holders(step_path, entry.name)
        for _attempt in range(2):
            untried = [h for h in holders if h != self.directory.me and h not in tried]
            tried.update(untried)
            got = await self._read_from(untried, step_path, entry, offset, length, into, store,
                                        failures, unreachable)
            if got is not None:
                return got
            if self._refresh is None:
                break
            holders = await self._refresh(step_path, entry.name)
        return None

    async def _read_from(self, holders: list[str], step_path: str, entry: mf.FileEntry,
                         offset: int, length: int, into: memoryview | None,
                         store: Store | None, failures: list[str], unreachable: set[str]
                         ) -> tuple[memoryview, bool] | None:
        """The bytes from the first of `holders` that gives them, or from the reader it sends
        this node to (None if none does: each failure is added to `failures`, and a holder
        that could not be reached, not one that answered without the bytes, to
        `unreachable`)."""
        asked = self._ask_order(holders, entry.xxh3, offset)
        failures += [f"{node_id}: not reachable from this node" for node_id in holders
                     if node_id not in asked]
        for node_id in asked:
            try:
                got = await self._from_holder(node_id, step_path, entry, offset, length, into,
                                              store)
                self._outages.pop(node_id, None)
                return got
            except (OSError, trio.TooSlowError, ConnectionClosed, ConnectionLost) as exc:
                failures.append(f"{node_id}: {exc or 'timed out'}")
                unreachable.add(node_id)
                self._unreached(node_id)
            except proto.ProtocolError as exc:
                failures.append(f"{node_id}: {exc}")
        return None

    async def _from_holder(self, holder: str, step_path: str, entry: mf.FileEntry,
                           offset: int, length: int, into: memoryview | None,
                           store: Store | None) -> tuple[memoryview, bool]:
        """The bytes from `holder`, or from the relay it names (`sources.ChunkRoutes`); a
        relay that fails is named back to the holder, which chooses again, and after
        MAX_HOPS failed relays is asked for the bytes themselves (plain GET)."""
        request = {"path": step_path, "name": entry.name, "xxh3": entry.xxh3,
                   "offset": offset, "length": length}
        # Relays serve whole chunks: a few blocks of one (a ranged read) come from the holder.
        whole_chunk = offset % mf.CHUNK_SIZE == 0 and \
            length == min(mf.CHUNK_SIZE, entry.size - offset)
        avoid: list[str] = []
        while True:
            async with self.directory.channel(holder) as channel:
                if len(avoid) >= sources.MAX_HOPS or not whole_chunk:
                    reply = await _ask(channel, "GET", request, into, store)
                else:
                    reply = await _ask(channel, "SWARM_GET", {**request, "avoid": avoid}, into,
                                       store)
            if reply.relay is None:
                return reply.data, reply.good
            try:
                async with self.directory.channel(reply.relay) as channel:
                    reply = await _ask(channel, "GET", request, into, store)
                return reply.data, reply.good
            except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
                log.info("chunk at %d of %s/%s: relay %s failed (%s); asking %s again",
                         offset, step_path, entry.name, reply.relay, exc or "timed out", holder)
                avoid.append(reply.relay)


def _cut(asked: list[mf.FileEntry], reply: proto.Message,
         payload: memoryview) -> dict[str, memoryview]:
    """A FILES_DATA's files by name: those it names that were asked for at their sizes."""
    wanted = {entry.name: entry.size for entry in asked}
    return {name: data for name, data in zip(reply["names"], proto.cut_files(reply, payload),
                                             strict=True)
            if wanted.get(name) == len(data)}


@dataclass
class _Reply:
    """A holder's answer: the bytes and whether `store` took them, or the relay it names."""

    data: memoryview = memoryview(b"")
    good: bool = False
    relay: str | None = None


async def _ask(channel: PeerChannel, kind: str, request: dict[str, Any],
               into: memoryview | None, store: Store | None) -> _Reply:
    """`kind` (GET or SWARM_GET) and its answer, DATA (its bytes given to `store`, if any) or
    SOURCE: a range large enough to be worth it in one worker thread, start to end, else on
    trio."""
    if store is not None and request["length"] >= BULK:
        return await channel.in_thread(_ask_blocking, kind, request, into, store)
    await channel.send(kind, **request)
    reply = await channel.receive(*_ANSWERS[kind], into=into)
    if reply.type == "SOURCE":
        return _Reply(relay=reply["node"])
    data = _payload(channel, reply, into)
    good = store is not None and len(data) == request["length"] and store(data)
    return _Reply(data, good)


_ANSWERS = {"GET": ("DATA",), "SWARM_GET": ("DATA", "SOURCE")}


def _ask_blocking(io: BlockingChannel, kind: str, request: dict[str, Any],
                  into: memoryview | None, store: Store) -> _Reply:
    """`_ask` in a worker thread: the request, its answer's payload (tagged as it comes) and
    the fetch's check and write of it, in one go."""
    io.send(kind, **request)
    reply = io.receive(*_ANSWERS[kind], into=into)
    if reply.type == "SOURCE":
        return _Reply(relay=reply["node"])
    data = _payload(io, reply, into)
    return _Reply(data, len(data) == request["length"] and store(data))


def _payload(channel: PeerChannel | BlockingChannel, reply: proto.Message,
             into: memoryview | None) -> memoryview:
    """A DATA reply's bytes: the view of `into` they were received in, or taken from the
    channel's buffer."""
    payload = reply.payload
    if isinstance(payload, memoryview) and into is not None and payload.obj is into.obj:
        return payload  # in the caller's buffer already
    return channel.take_payload(reply)


class RangeServer:
    """Answers GET from the committed objects in RAM (immutable, named by their xxh3-128), or
    from a sealed file of a step being committed on another node (multi-node DCP), or from a
    file this node is fetching itself (`partial`: a chunk another reader was sent here for,
    once it is in). Answers SWARM_GET, as a holder, with the bytes or with the reader to get
    them from (`sources.RouteBook`)."""

    def __init__(self, objects_dir: Path,
                 sealed_path: Callable[[str, str, str], bytes | None], me: str = "",
                 partial: Callable[[str, int], Awaitable[int | None]] | None = None) -> None:
        self.objects_dir = objects_dir
        self._sealed_path = sealed_path
        self._partial = partial
        self.routes = sources.RouteBook(me)
        self.step_readers = sources.StepReaders()  # whom GET_FILES answers in full
        self.served_requests = 0
        self.served_bytes = 0
        self.relayed_requests = 0  # GETs answered from a file being fetched here
        self.routed_requests = 0  # SWARM_GETs answered with another reader to ask

    def _held(self, message: proto.Message) -> bytes | Path | None:
        digest = message["xxh3"]
        if not proto.is_xxh3_128(digest):
            raise proto.ProtocolError(f"{message.type} with a malformed xxh3")
        path = self.objects_dir / digest
        if path.exists():
            return path
        return self._sealed_path(message["path"], message["name"], digest)

    async def on_get(self, message: proto.Message, channel: PeerChannel) -> None:
        path = self._held(message)
        if path is None:
            fd = await self._from_partial(message)
            if fd is not None:
                self.relayed_requests += 1
                await self._send(message, channel, fd)
                return
        await self._serve(message, channel, path)

    async def on_swarm_get(self, message: proto.Message, channel: PeerChannel) -> None:
        path = self._held(message)
        if path is not None:
            source = self.routes.route(message["xxh3"], channel.peer_id,
                                       message["offset"] // mf.CHUNK_SIZE, message["avoid"],
                                       trio.current_time())
            if source != self.routes.me:
                self.routed_requests += 1
                await channel.send("SOURCE", node=source)
                return
        await self._serve(message, channel, path)

    async def on_get_files(self, message: proto.Message, channel: PeerChannel) -> None:
        """GET_FILES: the asked objects this node holds whole in RAM, in the asked order, as
        many as one payload takes; none for a reader beyond the step's first FILES_READERS
        (`sources.StepReaders`: it reads them one by one, through the swarm)."""
        if not self.step_readers.admit(message["path"], channel.peer_id, trio.current_time()):
            await channel.send("FILES_DATA", names=[], sizes=[])
            return
        names, sizes, parts = await trio.to_thread.run_sync(
            self._objects, message["names"], message["digests"])
        payload = b"".join(parts)
        await channel.send("FILES_DATA", payload, names=names, sizes=sizes)
        self.served_requests += 1
        self.served_bytes += len(payload)

    def _objects(self, names: list[str], digests: list[str]
                 ) -> tuple[list[str], list[int], list[bytes]]:
        """The names, sizes and bytes of those of the objects (by digest) in RAM here, up to
        proto.MAX_PAYLOAD bytes in all."""
        found: list[str] = []
        sizes: list[int] = []
        parts: list[bytes] = []
        room = proto.MAX_PAYLOAD
        for name, digest in zip(names, digests, strict=True):
            try:
                with open(self.objects_dir / digest, "rb") as file:
                    data = file.read(room + 1)
            except FileNotFoundError:
                continue
            if len(data) > room:
                break
            room -= len(data)
            found.append(name)
            sizes.append(len(data))
            parts.append(data)
        return found, sizes, parts

    async def _from_partial(self, message: proto.Message) -> int | None:
        """An fd of this node's partial copy of the file once the asked chunk is in it (a
        whole chunk, at its boundary), or None."""
        offset, length = message["offset"], message["length"]
        if self._partial is None or offset % mf.CHUNK_SIZE or length > mf.CHUNK_SIZE:
            return None
        return await self._partial(message["xxh3"], offset // mf.CHUNK_SIZE)

    async def _serve(self, message: proto.Message, channel: PeerChannel,
                     path: bytes | Path | None) -> None:
        try:
            if path is None:
                raise FileNotFoundError
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            await channel.send("ERROR", message=f"{message['path']}/{message['name']} is not "
                               "in this node's RAM")
            return
        await self._send(message, channel, fd)

    async def _send(self, message: proto.Message, channel: PeerChannel, fd: int) -> None:
        """The asked range of `fd` (closed here) as DATA."""
        try:
            # the bytes that exist from the offset on, as pread would have returned them
            size = os.fstat(fd).st_size
            length = max(0, min(message["length"], size - message["offset"]))
            await channel.send_file("DATA", fd, message["offset"], length)
        finally:
            os.close(fd)
        self.served_requests += 1
        self.served_bytes += length
