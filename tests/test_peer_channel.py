"""The peer channel on real TCP connections over 127.0.0.1, in one process, plain and in TLS
(`ssl.SSLSocket`, certificates of a CA made here): file payloads sent by a worker thread
(`sendfile`, or through OpenSSL) and received, tags checked, by another; a channel lent to a
worker thread (`in_thread`) for several frames; a worker waiting on a silent peer gives up at
the channel's timeout and notices a cancellation, and leaves the channel unusable."""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from tierfs.devtools import certificates
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers import tls as peer_tls
from tierfs.replication.peers import wire as wires
from tierfs.replication.peers.channel import (
    BlockingChannel,
    PeerChannel,
    authenticate,
)

pytestmark = pytest.mark.core

TOKEN = b"channel-test-token"
PUT = {"path": "run/step_1", "name": "f", "xxh3": "c" * 32, "offset": 0}


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        left = socket.create_connection(listener.getsockname())
        right, _addr = listener.accept()
    return left, right


def tls_contexts(tmp: Path) -> peer_tls.PeerTls:
    certificates.make_ca(tmp, "ca")
    certificates.make_cert(tmp, "ca", "node", ip="127.0.0.1")
    return peer_tls.load(peer_tls.PeerTlsFiles(str(tmp / "ca.crt"), str(tmp / "node.crt"),
                                               str(tmp / "node.key")))


@asynccontextmanager
async def channels(tmp: Path, tls: bool, timeout: float = 5.0
                   ) -> AsyncIterator[tuple[PeerChannel, PeerChannel]]:
    """Two authenticated channels, node0's and node1's ends of one TCP connection."""
    left: socket.socket
    right: socket.socket
    left, right = tcp_pair()
    if tls:
        contexts = tls_contexts(tmp)
        secured: list[ssl.SSLSocket] = []

        async def secure(sock: socket.socket, server: bool) -> None:
            context = contexts.server if server else contexts.client
            secured.append(await wires.secure(sock, context, server_side=server))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(secure, left, False)
            await trio.sleep(0)
            nursery.start_soon(secure, right, True)
        by_side = {s.server_side: s for s in secured}
        left, right = by_side[False], by_side[True]
    a, b = PeerChannel(left, timeout=timeout), PeerChannel(right, timeout=timeout)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(authenticate, a, TOKEN, "node0", {"node0", "node1"})
            nursery.start_soon(authenticate, b, TOKEN, "node1", {"node0", "node1"})
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_file_payload_goes_by_a_worker_thread_and_comes_checked(
        tmp_path: Path, tls: bool) -> None:
    """A 9 MiB + 5 file range sent by `send_file` (sendfile, or read and sent through
    OpenSSL) arrives whole, into the receiver's buffer; a run of frames sent and answered
    within one worker thread keeps both ends' counts and tags in step with trio's."""
    data = os.urandom(9 * (1 << 20) + 5)
    path = tmp_path / "object"
    path.write_bytes(b"x" * 100 + data)
    async with channels(tmp_path, tls) as (a, b):
        fd = os.open(path, os.O_RDONLY)
        try:
            mine = bytearray(len(data))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: a.send_file("PUT", fd, 100, len(data),
                                                       size=len(data), **PUT))
                message = await b.receive("PUT", into=memoryview(mine))
            assert message.payload.obj is mine and mine == data  # type: ignore[union-attr]
            await b.send("OK")
            await a.receive("OK")

            def ask_twice(io: BlockingChannel) -> list[bytes]:
                answers = []
                for _ in range(2):
                    io.send_file("PUT", fd, 100, len(data), size=len(data), **PUT)
                    answers.append(bytes(io.receive("DATA").payload))
                return answers

            async def answer() -> None:
                for _ in range(2):
                    got = await b.receive("PUT")
                    await b.send("DATA", bytes(got.payload)[::-1][:1000])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer)
                answers = await a.in_thread(ask_twice)
            assert answers == [data[::-1][:1000]] * 2
            await a.send("PING", node_id="node0")  # on trio again, both ends in step
            assert (await b.receive("PING"))["node_id"] == "node0"
            await b.send("PONG", node_id="node1")
            await a.receive("PONG")
        finally:
            os.close(fd)
        assert a.reusable and b.reusable


async def test_a_worker_waiting_on_a_silent_peer_times_out_or_is_cancelled(
        tmp_path: Path) -> None:
    """A worker thread waiting for a frame that does not come gives up at the channel's
    timeout (TooSlowError), and one whose task is cancelled stops within a fraction of a
    second; either way the channel is not lent again."""
    async with channels(tmp_path, False, timeout=0.5) as (a, _b):
        started = time.monotonic()
        with pytest.raises(trio.TooSlowError):
            await a.in_thread(lambda io: io.receive("OK"))
        assert 0.4 < time.monotonic() - started < 3 and not a.reusable
    async with channels(tmp_path, False, timeout=60) as (a, _b):
        with trio.move_on_after(0.3) as scope:
            await a.in_thread(lambda io: io.receive("OK"))
        assert scope.cancelled_caught and not a.reusable


async def test_a_frame_altered_in_flight_over_a_socket_is_refused_by_the_worker(
        tmp_path: Path) -> None:
    """Bytes of a large payload flipped on the wire (written by another party into the
    receiver's end): the worker that receives it finds its tags wrong; nothing is returned."""
    async with channels(tmp_path, False) as (a, b):
        payload = os.urandom(2 << 20)
        mac = proto.FrameMac(b"k" * 32)  # not the connection's key: an attacker's frame
        header, body = proto.encode("PUT", payload, size=len(payload), **PUT)
        raw = a.wire.sock  # type: ignore[attr-defined]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.wire.send_all, header + body + mac.tag(header, body))
            with pytest.raises(proto.ProtocolError, match="MAC"):
                await b.receive()
        assert raw.fileno() >= 0 and not b.reusable
