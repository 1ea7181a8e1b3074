"""The peer protocol over a trio stream: framed send and receive with timeouts, connecting to a
peer, and the mutual authentication that must succeed before anything else is accepted."""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Container, Iterable, Iterator
from typing import Any

import outcome
import trio

from tierfs.replication.peers import protocol as proto
from tierfs.thread_buffers import ThreadBuffer

IO_TIMEOUT = 10.0
CONNECT_TIMEOUT = 3.0
WINDOW = 4  # requests in flight on one connection (pipeline)
# A payload at least this large is received in a worker thread, in blocking steps woken only
# once LOW_WATER bytes (or the rest) are in: a few wakeups per chunk instead of one per
# segment on the trio thread, which serves the mount meanwhile.
BULK = 1 << 18
LOW_WATER = 1 << 20
# Bytes of a file read at a time for its MAC, into a buffer each worker thread keeps (no new
# buffer, its pages faulted in again, for every frame): small enough to stay in the CPU's
# cache for the MAC that follows the read, large enough that the reads, each of which lets
# the GIL go and waits to take it back, stay few.
TAG_READ = 1 << 20
_TAG_BUFFER = ThreadBuffer(TAG_READ)
# Bytes of frames this process sent to each peer, by node id, once it authenticated (one
# daemon per process): the `tierfs_peer_sent_bytes` metric and `served_to_peers` in status.
SENT_TO: collections.Counter[str] = collections.Counter()
_POLL_SLICE_MS = 100  # how soon a blocking receive notices a cancellation


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
    """Why TLS failed, if `exc` (a trio error wrapping an SSLError) says it did."""
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
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        if (why := tls_failure(exc)) is not None:  # a TLS alert: the peer refused this end
            raise TlsRefused(f"TLS refused: {why}") from None
        raise ConnectionLost(f"connection lost: {exc or type(exc).__name__}") from None


class PeerChannel:
    """Framed messages over one stream. Over a TCP socket, payloads are received straight into
    the decoder's reused buffer (recv_into) and file bytes are sent straight from their file
    (sendfile); any other stream (tests) goes through the stream's own calls. Large payloads
    are tagged and checked (their MAC) in worker threads.

    A channel is `reusable` (for the pool) only while it is in step with its peer: no I/O
    failed, timed out or was cancelled on it, no frame is half read, and every request sent
    was answered.

    A new channel accepts only handshake-sized frames (proto.HANDSHAKE_LIMITS) until
    `authenticate` has checked the peer's proof."""

    def __init__(self, stream: trio.abc.Stream, timeout: float = IO_TIMEOUT) -> None:
        self.stream = stream
        self.timeout = timeout
        self.peer_id = "?"
        self._decoder = proto.FrameDecoder(proto.HANDSHAKE_LIMITS)
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._sent = 0
        self._received = 0
        self._broken = False
        self._send_mac: proto.FrameMac | None = None  # from the handshake on

    def authenticated(self, peer_id: str, send_key: bytes, receive_key: bytes) -> None:
        """The peer proved the token: full-sized frames from now on, each with its MAC, both
        ways (called between frames, so the next frame is the first checked against the new
        limits and its MAC)."""
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

    async def send(self, kind: str, payload: bytes | memoryview = b"", **fields: Any) -> None:
        header = proto.encode_header(kind, len(payload), **fields)
        with self._io():
            if self._send_mac is not None and len(payload) >= BULK:
                tag = await trio.to_thread.run_sync(self._send_mac.tag, header, payload)
            else:
                tag = self._tag(header, payload)
            await self._send_frame(header, payload, tag)

    async def _send_frame(self, header: bytes, payload: bytes | memoryview,
                          tag: bytes) -> None:
        if len(payload) <= 1 << 16:  # small: one write
            await self.stream.send_all(b"".join([header, payload, tag]))
        else:
            await self.stream.send_all(header)
            await self.stream.send_all(payload)
            await self.stream.send_all(tag)
        self._sent += 1
        self._count_sent(len(header) + len(payload))

    def _tag(self, header: bytes, payload: bytes | memoryview) -> bytes:
        return b"" if self._send_mac is None else self._send_mac.tag(header, payload)

    async def send_file(self, kind: str, fd: int, offset: int, length: int, /,
                        **fields: Any) -> None:
        """A message whose payload is `length` bytes of the file `fd` from `offset`, sent from
        the file to the socket by the kernel (sendfile: no copy through Python), its MAC
        computed meanwhile in a worker thread (on a descriptor of its own, which the caller's
        close cannot take from it). The message's own fields (which may include an `offset`
        too) are the keyword arguments."""
        header = proto.encode_header(kind, length, **fields)
        with self._io():
            if self._socket is None:
                tag = await trio.to_thread.run_sync(self._tag_file, header, os.dup(fd), offset,
                                                    length)
                data = await trio.to_thread.run_sync(os.pread, fd, length, offset)
                await self._send_frame(header, data, tag)
                return
            tagging = _in_thread(self._tag_file, header, os.dup(fd), offset, length)
            await self.stream.send_all(header)
            await _sendfile(self._socket, fd, offset, length)  # meanwhile, the tag is made
            await self.stream.send_all(await tagging())
            self._sent += 1
            self._count_sent(len(header) + length)

    def _tag_file(self, header: bytes, fd: int, offset: int, length: int) -> bytes:
        """The tag of a frame whose payload is that part of the file, read with pread (a file
        mapped instead would kill the daemon with SIGBUS if it shrank meanwhile; one that
        changes before it is sent fails its MAC at the peer: a dropped connection, never bad
        data). Closes `fd`, a duplicate made for this thread."""
        try:
            if self._send_mac is None:
                return b""
            mac = self._send_mac.start()
            mac.update(header)
            for piece in _TAG_BUFFER.read(fd, offset, offset + length):
                mac.update(piece)
                length -= len(piece)
            if length:
                raise proto.ProtocolError("cannot read the payload to send: the file is "
                                          "shorter than it was")
            return mac.finalize()
        finally:
            os.close(fd)

    def _count_sent(self, nbytes: int) -> None:
        if self.peer_id != "?":  # the handshake's few bytes are not counted
            SENT_TO[self.peer_id] += nbytes

    async def receive(self, *expected: str, timeout: float | None = None,
                      into: memoryview | None = None) -> proto.Message:
        """The next message, which must be of one of the `expected` types (if any are given).
        Its payload is valid until the next receive (see proto.Message), unless it was
        received `into` the caller's buffer (if it fits there), which it then is a view of."""
        self._decoder.offer(into)
        with self._io(timeout):
            while (message := self._decoder.next_message()) is None:
                buffer = self._decoder.writable()
                if self._socket is not None:
                    if self._decoder.in_payload and len(buffer) >= BULK:
                        # the decoder is advanced in the worker thread, chunk by chunk: the
                        # payload's MAC is computed there as the bytes come
                        if not await _receive_bulk(self._socket, buffer, self._decoder.advance):
                            raise ConnectionClosed("connection closed by the peer")
                        continue
                    count = await self._socket.recv_into(buffer)
                else:
                    data = await self.stream.receive_some(len(buffer))
                    count = len(data)
                    buffer[:count] = data
                if not count:
                    raise ConnectionClosed("connection closed by the peer")
                self._decoder.advance(count)
        self._decoder.offer(None)
        self._received += 1
        if expected and message.type not in expected:
            if message.type == "ERROR":
                raise proto.ProtocolError(f"peer {self.peer_id}: {message['message']}")
            if message.type == "NO_ROOM":
                raise NoRoom(f"{self.peer_id} has no room ({message['message']})")
            raise proto.ProtocolError(f"expected {'/'.join(expected)}, got {message.type}")
        return message

    def take_payload(self, message: proto.Message) -> memoryview:
        """The payload of `message`, the last one received, for keeps: the channel receives
        the next payload elsewhere (no copy of this one)."""
        self._decoder.give_away_payload()
        return memoryview(message.payload)

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
        if self._socket is None:
            return False
        poll = select.poll()
        poll.register(self._socket.fileno(), select.POLLIN)
        return bool(poll.poll(0))  # readable: at its end, or bytes nobody asked for

    async def aclose(self) -> None:
        self._broken = True
        if isinstance(self.stream, trio.SSLStream):  # no close_notify to wait for: frames
            await trio.aclose_forcefully(self.stream)  # are counted and MAC'd
            return
        with trio.CancelScope(shield=True):  # closing must happen even in a cancelled task
            await self.stream.aclose()


async def _receive_bulk(sock: trio.socket.SocketType, buffer: memoryview,
                        received: Callable[[int], None]) -> int:
    """Fill `buffer` from the socket in a worker thread, calling `received` there with the
    count of each read (the total, 0 if the peer closed first). The trio deadline in force
    applies; a cancellation is noticed within _POLL_SLICE_MS."""
    deadline = trio.current_effective_deadline()
    remaining = deadline - trio.current_time()
    expires = time.monotonic() + remaining if remaining != float("inf") else float("inf")
    return await trio.to_thread.run_sync(_fill_blocking, sock, buffer, expires, received)


def _fill_blocking(sock: trio.socket.SocketType, buffer: memoryview, expires: float,
                   received: Callable[[int], None]) -> int:
    """In a worker thread: read the socket (non-blocking, as trio keeps it) until `buffer` is
    full, waiting in poll for LOW_WATER bytes at a time. SO_RCVLOWAT is set back to 1
    before returning, for the trio side's waits on small frames."""
    fd = sock.fileno()
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    filled = low_water = 0
    try:
        while filled < len(buffer):
            if low_water != (wanted := min(LOW_WATER, len(buffer) - filled)):
                low_water = wanted
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low_water)
            try:
                count = os.readv(fd, [buffer[filled:]])
            except BlockingIOError:
                left = expires - time.monotonic()
                if left <= 0:
                    raise trio.TooSlowError from None
                trio.from_thread.check_cancelled()
                poll.poll(min(_POLL_SLICE_MS, int(left * 1000) + 1))
                continue
            if not count:
                break
            received(count)
            filled += count
    finally:
        if low_water != 1:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    return filled


def _in_thread(function: Callable[..., bytes], *args: Any) -> Callable[[], Awaitable[bytes]]:
    """Start `function(*args)` in a worker thread now; the call returned waits for its result
    (a cancelled wait leaves the thread to finish alone)."""
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    results: list[outcome.Outcome[bytes]] = []

    def deliver(result: outcome.Outcome[bytes]) -> None:
        results.append(result)
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    trio.lowlevel.start_thread_soon(lambda: function(*args), deliver)

    async def result() -> bytes:
        await done.wait()
        return results[0].unwrap()
    return result


async def _sendfile(sock: trio.socket.SocketType, fd: int, offset: int, length: int) -> None:
    end = offset + length
    while offset < end:
        try:
            sent = os.sendfile(sock.fileno(), fd, offset, end - offset)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        if sent == 0:
            raise proto.ProtocolError("the file is shorter than the payload announced")
        offset += sent
    await trio.lowlevel.checkpoint()


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


async def open_stream(host: str, port: int, tls: ssl.SSLContext | None = None
                      ) -> trio.abc.Stream:
    """A connection to a peer port, in TLS if `tls` (`--peer-tls`): OSError, TlsRefused, or
    trio.TooSlowError if it is not made in CONNECT_TIMEOUT."""
    with trio.fail_after(CONNECT_TIMEOUT):
        stream = await trio.open_tcp_stream(host, port)
        if tls is None:
            return stream
        secure = trio.SSLStream(stream, tls, https_compatible=True)  # see server._secure
        try:
            await secure.do_handshake()
        except BaseException as exc:
            await trio.aclose_forcefully(stream)
            if isinstance(exc, trio.BrokenResourceError):
                why = tls_failure(exc)
                raise TlsRefused(f"TLS handshake failed: {why or exc.__cause__ or exc}") \
                    from None
            raise
        return secure


async def connect(host: str, port: int, token: bytes, my_id: str, members: Container[str],
                  peer_id: str, tls: ssl.SSLContext | None = None) -> PeerChannel:
    """An authenticated channel to `peer_id` at host:port (OSError or ProtocolError if not;
    trio.TooSlowError if the connection is not made in CONNECT_TIMEOUT), in TLS if `tls`.
    `peer_id` may be `my_id` (a node checking that it reaches itself)."""
    channel = PeerChannel(await open_stream(host, port, tls))
    try:
        await authenticate(channel, token, my_id, members, expected_peer=peer_id,
                           allow_self=peer_id == my_id)
    except BaseException:
        await channel.aclose()
        raise
    return channel
