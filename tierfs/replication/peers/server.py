"""The peer port: every connection authenticates first, then each request goes to its handler.
A connection that fails authentication or sends anything malformed is closed with one log
line; whatever happens on one connection, the daemon keeps serving."""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Container, Iterable

import trio

from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers import wire as wires
from tierfs.replication.peers.channel import (
    IO_TIMEOUT,
    ConnectionClosed,
    PeerChannel,
    authenticate,
    tls_failure,
)

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 60.0
Handler = Callable[[proto.Message, PeerChannel], Awaitable[None]]


class PeerServer:
    def __init__(self, me: str, token: bytes, members: Container[str],
                 handlers: dict[str, Handler], tls: ssl.SSLContext | None = None,
                 streamed: Iterable[str] = ()) -> None:
        self.me = me
        # message types whose large payloads their handler takes itself, a slice at a time
        # (`PeerChannel.stream`): a replica's chunk goes straight into its file
        self.streamed = frozenset(streamed)
        self.tls = tls  # --peer-tls: every connection is TLS, with a certificate of the CA
        self.token = token
        self.members = members
        self.handlers = {"PING": self._pong, **handlers}

    async def run(self, host: str, port: int,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started()
        await trio.serve_listeners(self._serve, listeners)

    async def _serve(self, stream: trio.SocketStream) -> None:
        try:
            host, port = stream.socket.getpeername()[:2]
            where = f"{host}:{port}"
        except OSError:
            where = "?"
        # the socket itself, off trio's stream: its bytes move in worker threads too
        sock = socket.socket(fileno=stream.socket.detach())
        channel = None
        try:
            try:
                channel = PeerChannel(await self._secure(sock, where))
            except BaseException:
                sock.close()
                raise
            try:
                await authenticate(channel, self.token, self.me, self.members,
                                   allow_self=True)
            except ConnectionClosed:  # before a word (a check of this port): no fault
                return
            channel.stream(self.streamed)
            while True:
                try:
                    message = await channel.receive(timeout=IDLE_TIMEOUT)
                except ConnectionClosed:
                    return
                handler = self.handlers.get(message.type)
                if channel.peer_id == self.me and message.type != "PING":
                    # this node's own id is let in for the check at mount that it
                    # reaches itself (a PING), never to store, read or delete
                    raise proto.ProtocolError(f"{message.type} from this node's own id")
                if handler is None:
                    raise proto.ProtocolError(f"unexpected {message.type}")
                await handler(message, channel)
        except _Refused:
            return
        except (proto.ProtocolError, trio.TooSlowError) as exc:
            log.warning("peer connection from %s (%s) dropped: %s", where,
                        channel.peer_id if channel else "?", exc or "timed out")
        except Exception:
            log.exception("peer connection from %s (%s) failed", where,
                          channel.peer_id if channel else "?")
        finally:
            if channel is not None:
                await channel.aclose()

    async def _secure(self, sock: socket.socket, where: str) -> socket.socket:
        """The connection as the protocol runs over it: in TLS with --peer-tls (_Refused,
        logged, if its handshake fails). A peer's close without TLS's close_notify is an end
        like a TCP close (pooled connections are closed so), not an error; the framing and
        every frame's tags tell a cut frame from a whole one."""
        if self.tls is None:
            return sock
        try:
            with trio.fail_after(IO_TIMEOUT):
                return await wires.secure(sock, self.tls, server_side=True)
        except (OSError, trio.TooSlowError) as exc:
            log.warning("peer connection from %s refused: TLS handshake failed: %s", where,
                        tls_failure(exc) or exc or "timed out")
            raise _Refused from None

    async def _pong(self, message: proto.Message, channel: PeerChannel) -> None:
        await channel.send("PONG", node_id=self.me)


class _Refused(Exception):
    """A connection refused before the protocol (logged where it was)."""
