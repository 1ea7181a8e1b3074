"""The peer protocol over one connection: framed send and receive with timeouts, connecting to
a peer, and the mutual authentication that must succeed before anything else is accepted.

trio keeps the control: the handshake, requests and answers, small frames. File payloads move
in worker threads that let the GIL go while they copy: a frame of a file goes out with
`sendfile` from the RAM store's file (its tags made from a buffer the thread keeps), and a
payload comes in with `recv_into` a reused buffer, its slices tagged as they arrive
(`protocol.FrameTags`), in the same thread. A caller that does more than one frame's work per
round trip (send a run of chunks and read their answers, receive a chunk and store it) hands
the channel to one worker thread for all of it (`in_thread`: the same frames, blocking, the
same counts and tags). One task or one thread uses a channel at a time.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Container, Iterable, Iterator
from typing import Any, TypeVar

import trio

from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers import wire as wires
from tierfs.thread_buffers import ThreadBuffer

IO_TIMEOUT = 10.0
CONNECT_TIMEOUT = 3.0
WINDOW = 4  # requests in flight on one connection (pipeline)
# A payload at least this large moves in a worker thread (the rest of its frame after the
# header): a few wakeups per chunk off the trio thread, which serves the mount meanwhile.
BULK = 1 << 18
# A file's bytes are read for their tags a slice at a time, into a buffer each worker thread
# keeps (no new buffer, its pages faulted in again, for every frame): a slice stays in the
# CPU's cache for the tag that follows the read.
_TAG_BUFFER = ThreadBuffer(proto.TAG_SLICE)
_STREAM_BUFFER = ThreadBuffer(proto.TAG_SLICE)  # a streamed payload's slices, received
# What takes a streamed payload's slices (a slice, its offset in the payload), in the worker
# thread that receives them.
Sink = Callable[[memoryview, int], None]
# Bytes of frames this process sent to each peer, by node id, once it authenticated (one
# daemon per process): the `tierfs_peer_sent_bytes` metric and `served_to_peers` in status.
SENT_TO: collections.Counter[str] = collections.Counter()
_SENT_LOCK = threading.Lock()  # worker threads count too

T = TypeVar("T")


class AuthError(proto.ProtocolError):
    """The peer does not know the token, or is not a member of the cluster."""


class WrongPeer(AuthError):
    """Another node than the one asked for answered (`found`): a member of the cluster all
    the same, at an address the caller took for another node's."""

    def __init__(self, found: str, expected: str) -> None:
        super().__init__(f"the node answering is {found!r}, not {expected!r}")
        self.found = found


class TokenRefused(AuthError):
    """The peer's proof of the token is wrong: the two nodes were given different tokens."""


class TlsRefused(proto.ProtocolError):
    """The TLS handshake failed (`--peer-tls`): a certificate not of the cluster's CA at
    either end, or one end without TLS."""


def tls_failure(exc: BaseException) -> str | None:
    """Why TLS failed, if `exc` (an SSLError, or a trio error wrapping one) says it did."""
    cause = exc if isinstance(exc, ssl.SSLError) else exc.__cause__ or exc.__context__
    if not isinstance(cause, ssl.SSLError):
        return None
    return str(cause.reason or cause).lower().replace("_", " ")


class NoRoom(proto.ProtocolError):
    """The peer refused a request for want of room (NO_ROOM): its RAM tier, or the file system
    of its RAM dir, is full."""


class ConnectionClosed(proto.ProtocolError):
    """The peer closed the connection cleanly, between messages or within one."""


class ConnectionLost(proto.ProtocolError):
    """The connection broke (reset, or cut) under a send or a receive."""


@contextlib.contextmanager
def _connection_errors() -> Iterator[None]:
    try:
        yield
    except wires.ShortFile as exc:
        raise proto.ProtocolError(str(exc)) from None
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        if (why := tls_failure(exc)) is not None:  # a TLS alert: the peer refused this end
            raise TlsRefused(f"TLS refused: {why}") from None
        raise ConnectionLost(f"connection lost: {exc or type(exc).__name__}") from None


class PeerChannel:
    """Framed messages over one connection: a socket (`socket.socket`, or an `ssl.SSLSocket`
    with --peer-tls), or any trio stream (tests), whose worker-thread calls then run on trio.

    A channel is `reusable` (for the pool) only while it is in step with its peer: no I/O
    failed, timed out or was cancelled on it, no frame is half read, and every request sent
    was answered.

    A new channel accepts only handshake-sized frames (proto.HANDSHAKE_LIMITS) until
    `authenticate` has checked the peer's proof."""

    def __init__(self, transport: trio.abc.Stream | socket.socket,
                 timeout: float = IO_TIMEOUT) -> None:
        self.wire: wires.Wire = wires.SocketWire(transport) \
            if isinstance(transport, socket.socket) else wires.StreamWire(transport)
        self.timeout = timeout
        self.peer_id = "?"
        self._decoder = proto.FrameDecoder(proto.HANDSHAKE_LIMITS)
        self._sent = 0
        self._received = 0
        self._broken = False
        self._send_mac: proto.FrameMac | None = None  # from the handshake on

    def authenticated(self, peer_id: str, send_key: bytes, receive_key: bytes) -> None:
        """The peer proved the token: full-sized frames from now on, each with its tags, both
        ways (called between frames, so the next frame is the first checked against the new
        limits and its tags)."""
        self.peer_id = peer_id
        self._decoder.limits = proto.LIMITS
        self._decoder.mac = proto.FrameMac(receive_key)
        self._send_mac = proto.FrameMac(send_key)

    @property
    def reusable(self) -> bool:
        return not self._broken and self._decoder.idle and self._received >= self._sent

    @contextlib.contextmanager
    def _io(self, timeout: float | None = None) -> Iterator[None]:
        try:
            with trio.fail_after(timeout or self.timeout), _connection_errors():
                yield
        except BaseException:  # a timeout or cancellation leaves a frame half sent or read
            self._broken = True
            raise

    def _expires(self, timeout: float | None = None) -> float:
        """When a worker's wait for the peer gives up (time.monotonic(), TooSlowError): after
        `timeout` (the channel's). A deadline of the calling task (a cancel scope's) reaches
        the worker as a cancellation, which it notices while it waits."""
        return time.monotonic() + (timeout or self.timeout)

    # -- on trio --------------------------------------------------------------------------

    async def send(self, kind: str, payload: bytes | memoryview = b"", **fields: Any) -> None:
        if len(payload) >= BULK and self.wire.threaded:  # tagged and sent by a worker
            await self.in_thread(lambda io: io.send(kind, payload, **fields))
            return
        header = proto.encode_header(kind, len(payload), **fields)
        with self._io():
            tags = self._tags(header, payload)
            if len(payload) <= 1 << 16:  # small: one write
                await self.wire.send_all(b"".join([header, payload, tags]))
            else:
                for part in (header, payload, tags):
                    await self.wire.send_all(part)
            self._count_sent(len(header) + len(payload))

    async def send_file(self, kind: str, fd: int, offset: int, length: int, /,
                        **fields: Any) -> None:
        """A message whose payload is `length` bytes of the file `fd` from `offset`, sent by a
        worker thread (`BlockingChannel.send_file`), or from trio if it is small (a few pages
        read: less than the hop to a thread). The message's own fields (which may include an
        `offset` too) are the keyword arguments."""
        if length < BULK:
            data = os.pread(fd, length, offset)
            if len(data) < length:
                raise proto.ProtocolError("the file is shorter than the payload announced")
            await self.send(kind, data, **fields)
            return
        await self.in_thread(lambda io: io.send_file(kind, fd, offset, length, **fields))

    async def receive(self, *expected: str, timeout: float | None = None,
                      into: memoryview | None = None) -> proto.Message:
        """The next message, which must be of one of the `expected` types (if any are given).
        Its payload is valid until the next receive (see proto.Message), unless it was
        received `into` the caller's buffer (if it fits there), which it then is a view of.
        A large payload is received (and its slices tagged) by a worker thread."""
        self._decoder.offer(into)
        with self._io(timeout):
            while (message := self._decoder.next_message()) is None:
                buffer = self._decoder.writable()
                if self._decoder.in_payload and len(buffer) >= BULK and self.wire.threaded:
                    await trio.to_thread.run_sync(self._rest_of_frame,
                                                  self._expires(timeout))
                    continue
                count = await self.wire.recv_into(buffer)
                if not count:
                    raise ConnectionClosed("connection closed by the peer")
                self._decoder.advance(count)
        self._decoder.offer(None)
        return self._accept(message, expected)

    async def in_thread(self, function: Callable[..., T], *args: Any) -> T:
        """`function(io, *args)` in a worker thread, `io` this channel's blocking face
        (`BlockingChannel`): each of its waits on the peer gives up after the channel's
        timeout, and a cancellation of the calling task (a deadline of its, too) is noticed
        while it waits. The channel is broken by any error, as on trio."""
        io = BlockingChannel(self)
        try:
            with _connection_errors():
                return await trio.to_thread.run_sync(function, io, *args)
        except BaseException:
            self._broken = True
            raise

    def take_payload(self, message: proto.Message) -> memoryview:
        """The payload of `message`, the last one received, for keeps: the channel receives
        the next payload elsewhere (no copy of this one)."""
        self._decoder.give_away_payload()
        return memoryview(message.payload)

    def stream(self, types: Iterable[str]) -> None:
        """Large payloads of these message types are streamed: their message is returned with
        the payload `pending`, which the receiver takes with `BlockingChannel.stream_payload`
        (in a worker thread) before anything else is received."""
        self._decoder.streamed = frozenset(types)

    async def request(self, kind: str, payload: bytes = b"", *, expect: str = "OK",
                      **fields: Any) -> proto.Message:
        await self.send(kind, payload, **fields)
        return await self.receive(expect)

    async def pipeline(self, requests: Iterable[Callable[[], Awaitable[None]]], expect: str,
                       window: int = WINDOW,
                       on_reply: Callable[[proto.Message], None] = lambda message: None) -> None:
        """Send each request (a call that sends one message) with up to `window` unanswered,
        and hand each reply, in order (the peer answers in order), to `on_reply` before the
        next receive reuses its payload. The first ERROR or unexpected reply raises."""
        unanswered = 0
        for send in requests:
            if unanswered == window:
                on_reply(await self.receive(expect))
                unanswered -= 1
            await send()
            unanswered += 1
        for _ in range(unanswered):
            on_reply(await self.receive(expect))

    def closed_by_peer(self) -> bool:
        """Whether the peer closed (or wrote unasked) while the channel sat idle: such a
        channel must not be used again. Never blocks."""
        return self.wire.readable_now()

    async def aclose(self) -> None:
        self._broken = True
        # closing must happen even in a cancelled task
        with trio.CancelScope(shield=True), contextlib.suppress(OSError,
                                                                trio.BrokenResourceError):
            await self.wire.aclose()

    # -- shared by both faces -------------------------------------------------------------

    def _tags(self, header: bytes, payload: bytes | memoryview) -> bytes:
        return b"" if self._send_mac is None else self._send_mac.tag(header, payload)

    def _accept(self, message: proto.Message, expected: tuple[str, ...]) -> proto.Message:
        self._received += 1
        if expected and message.type not in expected:
            if message.type == "ERROR":
                raise proto.ProtocolError(f"peer {self.peer_id}: {message['message']}")
            if message.type == "NO_ROOM":
                raise NoRoom(f"{self.peer_id} has no room ({message['message']})")
            raise proto.ProtocolError(f"expected {'/'.join(expected)}, got {message.type}")
        return message

    def _count_sent(self, nbytes: int) -> None:
        self._sent += 1
        if self.peer_id != "?":  # the handshake's few bytes are not counted
            with _SENT_LOCK:
                SENT_TO[self.peer_id] += nbytes

    def _rest_of_frame(self, expires: float) -> None:
        """In a worker thread: the rest of the frame being read (its payload, tagged slice by
        slice as it comes, and its tags), until the decoder holds the message."""
        decoder = self._decoder
        while not decoder.ready:
            buffer = decoder.writable()
            if decoder.in_payload:
                if self.wire.fill_blocking(buffer, expires, decoder.advance) < len(buffer):
                    raise ConnectionClosed("connection closed by the peer")
                continue
            count = self.wire.recv_blocking(buffer, expires)
            if not count:
                raise ConnectionClosed("connection closed by the peer")
            decoder.advance(count)


class BlockingChannel:
    """A channel lent to a worker thread (`PeerChannel.in_thread`): the same frames, sent and
    received with blocking waits, each within the channel's timeout; a cancellation of the
    task that lent it is noticed while it waits."""

    def __init__(self, channel: PeerChannel) -> None:
        self.channel = channel
        self.peer_id = channel.peer_id

    def _expires(self) -> float:
        return self.channel._expires()

    def send(self, kind: str, payload: bytes | memoryview = b"", **fields: Any) -> None:
        channel = self.channel
        header = proto.encode_header(kind, len(payload), **fields)
        tags = channel._tags(header, payload)
        expires = self._expires()
        for part in (header, payload, tags):
            if part:
                channel.wire.send_all_blocking(part, expires)
        channel._count_sent(len(header) + len(payload))

    def send_file(self, kind: str, fd: int, offset: int, length: int, /,
                  **fields: Any) -> None:
        """A message whose payload is `length` bytes of the file `fd` from `offset`. Its tags
        are made from the file read a slice at a time (pread into this thread's buffer, never
        a mapping: a file that shrank would kill the daemon with SIGBUS; one that changes
        before it is sent fails its tags at the peer, a dropped connection, never bad data);
        then the header, the payload by `sendfile` (the kernel's copy, no Python buffer) and
        the tags go. Over TLS each slice is sent from the buffer it was tagged in."""
        channel = self.channel
        wire = channel.wire
        header = proto.encode_header(kind, length, **fields)
        expires = self._expires()
        if channel._send_mac is None:
            wire.send_all_blocking(header, expires)
            wire.sendfile_blocking(fd, offset, length, expires)
            channel._count_sent(len(header) + length)
            return
        tags = channel._send_mac.start(length)
        tags.head(header)
        zero_copy = isinstance(wire, wires.SocketWire) and not wire.tls
        if not zero_copy:
            wire.send_all_blocking(header, expires)
        for piece in _file_slices(fd, offset, length):
            tags.slice(piece)
            if not zero_copy:
                wire.send_all_blocking(piece, self._expires())
        if zero_copy:
            wire.send_all_blocking(header, expires)
            wire.sendfile_blocking(fd, offset, length, self._expires())
        wire.send_all_blocking(tags.digest(), self._expires())
        channel._count_sent(len(header) + length)

    def receive(self, *expected: str, into: memoryview | None = None) -> proto.Message:
        """The next message (as PeerChannel.receive), waiting in this thread."""
        channel = self.channel
        decoder = channel._decoder
        decoder.offer(into)
        expires = self._expires()
        while (message := decoder.next_message()) is None:
            buffer = decoder.writable()
            if decoder.in_payload and len(buffer) >= BULK:
                if channel.wire.fill_blocking(buffer, expires, decoder.advance) < len(buffer):
                    raise ConnectionClosed("connection closed by the peer")
                continue
            count = channel.wire.recv_blocking(buffer, expires)
            if not count:
                raise ConnectionClosed("connection closed by the peer")
            decoder.advance(count)
        decoder.offer(None)
        return channel._accept(message, expected)

    def take_payload(self, message: proto.Message) -> memoryview:
        return self.channel.take_payload(message)

    def stream_payload(self, sink: Sink | None) -> None:
        """Take the payload of the streamed message just received (`PeerChannel.stream`), a
        tag slice at a time into a buffer this thread keeps (it stays in the CPU's cache):
        each slice is tagged, then given to `sink(slice, its offset in the payload)` (None:
        dropped). Then its tags are checked: ProtocolError if they fail, after the sink took
        every slice. So the sink's caller must treat what it took as unchecked until this
        returns, and undo it if this raises."""
        channel = self.channel
        decoder = channel._decoder
        length, tags = decoder.take_stream()
        buffer = _STREAM_BUFFER.get()
        expires = self._expires()
        done = 0
        while done < length:
            piece = buffer[:min(proto.TAG_SLICE, length - done)]
            if channel.wire.fill_blocking(piece, expires, _ignore) < len(piece):
                raise ConnectionClosed("connection closed by the peer")
            if tags is not None:
                tags.slice(piece)
            if sink is not None:
                sink(piece, done)
            done += len(piece)
        if tags is not None:
            trailer = bytearray(proto.tag_length(length))
            if channel.wire.fill_blocking(memoryview(trailer), expires, _ignore) < len(trailer):
                raise ConnectionClosed("connection closed by the peer")
            if not tags.matches(trailer):
                raise proto.ProtocolError("a frame failed its MAC (injected, replayed, "
                                          "reordered or altered)")
        decoder.stream_done()


def _ignore(_count: int) -> None:
    pass


def _file_slices(fd: int, offset: int, length: int) -> Iterator[memoryview]:
    """The bytes [offset, offset + length) of the file `fd`, a tag slice at a time, in this
    thread's buffer (each piece good until the next); ShortFile if the file ends first."""
    end = offset + length
    for piece in _TAG_BUFFER.read(fd, offset, end):
        yield piece
        offset += len(piece)
    if offset < end:
        raise wires.ShortFile("cannot read the payload to send: the file is shorter than it "
                              "was")


async def authenticate(channel: PeerChannel, token: bytes, my_id: str,
                       members: Container[str], expected_peer: str | None = None,
                       allow_self: bool = False) -> str:
    """Prove knowledge of the token and check the peer's proof; return the peer's node id.
    A peer with this node's own id is refused unless `allow_self` (the server, which a node
    connects to through its advertised address at mount to check it reaches itself)."""
    nonce = proto.new_nonce()
    await channel.send("HELLO", node_id=my_id, nonce=nonce)
    hello = await channel.receive("HELLO")
    peer = hello["node_id"]
    itself = peer == my_id
    if expected_peer and peer != expected_peer:
        raise WrongPeer(peer, expected_peer)
    if not ((itself and allow_self) or (peer in members and not itself)):
        raise AuthError(f"node {peer!r} is not a member of this cluster")
    await channel.send("PROOF", mac=proto.proof(token, hello["nonce"], my_id, peer))
    answer = await channel.receive("PROOF")
    if not proto.check_proof(token, nonce, peer, my_id, answer["mac"]):
        raise TokenRefused(f"node {peer!r} does not know the cluster token")
    channel.authenticated(
        peer, send_key=proto.frame_key(token, my_id, peer, nonce, hello["nonce"]),
        receive_key=proto.frame_key(token, peer, my_id, hello["nonce"], nonce))
    return peer


async def open_socket(host: str, port: int, tls: ssl.SSLContext | None = None
                      ) -> socket.socket:
    """A connection to a peer port, in TLS if `tls` (`--peer-tls`: an `ssl.SSLSocket`, its
    handshake done): OSError, TlsRefused, or trio.TooSlowError if it is not made in
    CONNECT_TIMEOUT."""
    with trio.fail_after(CONNECT_TIMEOUT):
        stream = await trio.open_tcp_stream(host, port)
        sock = socket.socket(fileno=stream.socket.detach())
        if tls is None:
            return sock
        try:
            return await wires.secure(sock, tls, server_side=False)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, ssl.SSLError) or (isinstance(exc, OSError)
                                                 and tls_failure(exc)):
                raise TlsRefused(f"TLS handshake failed: {tls_failure(exc) or exc}") from None
            raise


async def connect(host: str, port: int, token: bytes, my_id: str, members: Container[str],
                  peer_id: str, tls: ssl.SSLContext | None = None) -> PeerChannel:
    """An authenticated channel to `peer_id` at host:port (OSError or ProtocolError if not;
    trio.TooSlowError if the connection is not made, or its handshake not done, in
    CONNECT_TIMEOUT each), in TLS if `tls`. `peer_id` may be `my_id` (a node checking that it
    reaches itself). The handshake is bounded as the server bounds it (`admission`): a peer
    that takes the connection and then says nothing is as unreachable as one that never
    takes it, and a read waiting for it would otherwise wait IO_TIMEOUT per try."""
    channel = PeerChannel(await open_socket(host, port, tls))
    try:
        with trio.fail_after(CONNECT_TIMEOUT):
            await authenticate(channel, token, my_id, members, expected_peer=peer_id,
                               allow_self=peer_id == my_id)
    except BaseException:
        await channel.aclose()
        raise
    return channel
