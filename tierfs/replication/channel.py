"""The peer protocol over a trio stream: framed send and receive with timeouts, connecting to a
peer, and the mutual authentication that must succeed before anything else is accepted."""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterator
from typing import Any

import trio

from tierfs.replication import protocol as proto

IO_TIMEOUT = 10.0
CONNECT_TIMEOUT = 3.0


class AuthError(proto.ProtocolError):
    """The peer does not know the token, or is not a member of the cluster."""


class ConnectionClosed(proto.ProtocolError):
    """The peer closed the connection cleanly, between messages or within one."""


@contextlib.contextmanager
def _connection_errors() -> Iterator[None]:
    try:
        yield
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise proto.ProtocolError(f"connection lost: {exc or type(exc).__name__}") from None


class PeerChannel:
    def __init__(self, stream: trio.abc.Stream, timeout: float = IO_TIMEOUT) -> None:
        self.stream = stream
        self.timeout = timeout
        self.peer_id = "?"
        self._decoder = proto.FrameDecoder()

    async def send(self, kind: str, payload: bytes = b"", **fields: Any) -> None:
        with trio.fail_after(self.timeout), _connection_errors():
            for buffer in proto.encode(kind, payload, **fields):
                if buffer:
                    await self.stream.send_all(buffer)

    async def receive(self, *expected: str, timeout: float | None = None) -> proto.Message:
        """The next message, which must be of one of the `expected` types (if any are given)."""
        with trio.fail_after(timeout or self.timeout), _connection_errors():
            while (message := self._decoder.next_message()) is None:
                data = await self.stream.receive_some(min(self._decoder.wanted(), 1 << 20))
                if not data:
                    raise ConnectionClosed("connection closed by the peer")
                self._decoder.feed(data)
        if expected and message.type not in expected:
            if message.type == "ERROR":
                raise proto.ProtocolError(f"peer {self.peer_id}: {message['message']}")
            raise proto.ProtocolError(f"expected {'/'.join(expected)}, got {message.type}")
        return message

    async def request(self, kind: str, payload: bytes = b"", *, expect: str = "OK",
                      **fields: Any) -> proto.Message:
        await self.send(kind, payload, **fields)
        return await self.receive(expect)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def authenticate(channel: PeerChannel, token: bytes, my_id: str,
                       members: Container[str], expected_peer: str | None = None) -> str:
    """Prove knowledge of the token and check the peer's proof; return the peer's node id."""
    nonce = proto.new_nonce()
    await channel.send("HELLO", node_id=my_id, nonce=nonce)
    hello = await channel.receive("HELLO")
    peer = hello["node_id"]
    if peer not in members or peer == my_id or (expected_peer and peer != expected_peer):
        raise AuthError(f"node {peer!r} is not a member of this cluster")
    await channel.send("PROOF", mac=proto.proof(token, hello["nonce"], my_id, peer))
    answer = await channel.receive("PROOF")
    if not proto.check_proof(token, nonce, peer, my_id, answer["mac"]):
        raise AuthError(f"node {peer!r} does not know the cluster token")
    channel.peer_id = peer
    return peer


async def connect(host: str, port: int, token: bytes, my_id: str, members: Container[str],
                  peer_id: str) -> PeerChannel:
    """An authenticated channel to `peer_id` at host:port (OSError or ProtocolError if not)."""
    with trio.fail_after(CONNECT_TIMEOUT):
        stream = await trio.open_tcp_stream(host, port)
    channel = PeerChannel(stream)
    try:
        await authenticate(channel, token, my_id, members, expected_peer=peer_id)
    except BaseException:
        await channel.aclose()
        raise
    return channel
