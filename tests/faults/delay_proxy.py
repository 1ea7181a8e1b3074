"""A delaying TCP proxy for one network namespace of the fault harness (tests/faults/network.py).

The kernel here has no `netem`, so latency comes from this process instead. It runs inside a
node's namespace; an iptables REDIRECT rule there sends every TCP connection the node opens to
another host of the test's network to this proxy's port, and the proxy opens the real
connection (the original destination from conntrack, `SO_ORIGINAL_DST`) from the node's own
address, marked so that the rule lets it pass. Every byte it relays, in both directions, is
held back by the delay in force when it arrived (order kept), so a connection the node opens
sees the delay each way: 2 x delay of round trip, as `netem delay` on every node's link gives.
Drops, loss and rate limits stay with iptables and tc, on the real connection the proxy opens.

    python delay_proxy.py --port P --mark 0x4654 --control /path/to/socket

The control socket (a path: reachable from the test's own namespace) takes one line per
connection, `delay MS`, and answers `ok`. The delay starts at 0.

An upstream that cannot be reached leaves the node's connection open and silent, as a SYN lost
in a partition would (the node's own timeouts end it); one that refuses, or resets, resets the
node's connection.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import struct

import trio

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
CHUNK = 256 * 1024
IN_FLIGHT = 64  # chunks held per direction: backpressure beyond delay x bandwidth
ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class Proxy:
    def __init__(self, mark: int) -> None:
        self.mark = mark
        self.delay = 0.0  # seconds

    async def serve_control(self, path: str) -> None:
        if os.path.exists(path):
            os.unlink(path)
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await listener.bind(path)
        listener.listen(8)
        async with trio.SocketListener(listener) as server:
            while True:
                stream = await server.accept()
                async with stream:
                    verb, _, value = (await stream.receive_some(256)).decode().strip().partition(
                        " ")
                    if verb == "delay":
                        self.delay = float(value) / 1000
                        await stream.send_all(b"ok\n")
                    else:
                        await stream.send_all(b"unknown\n")

    async def handle(self, client: trio.SocketStream) -> None:
        raw = client.socket.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, address = struct.unpack("!2xH4s8x", raw)
        upstream_sock = trio.socket.socket()
        upstream_sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, self.mark)
        upstream = trio.SocketStream(upstream_sock)
        connected = trio.Event()
        async with client, upstream, trio.open_nursery() as nursery:

            async def connect() -> None:
                try:
                    await upstream_sock.connect((socket.inet_ntoa(address), port))
                except OSError:
                    reset(client)
                    nursery.cancel_scope.cancel()
                    return
                connected.set()

            nursery.start_soon(connect)
            nursery.start_soon(self._relay, client, upstream, connected, nursery.cancel_scope,
                               True)
            nursery.start_soon(self._relay, upstream, client, connected, nursery.cancel_scope,
                               False)

    async def _relay(self, source: trio.SocketStream, target: trio.SocketStream,
                     connected: trio.Event, scope: trio.CancelScope, outbound: bool) -> None:
        """One direction: what `source` sends reaches `target` `delay` later, in order, its
        end (EOF) too. A reset either way resets both; the connection ends once both
        directions have (the nursery of `handle`)."""
        send, receive = trio.open_memory_channel[tuple[float, bytes]](IN_FLIGHT)
        client = source if outbound else target

        async def write() -> None:
            async with receive:
                async for due, data in receive:
                    await trio.sleep_until(due)
                    await connected.wait()
                    try:
                        await (target.send_all(data) if data else target.send_eof())
                    except ERRORS:
                        reset(client)
                        scope.cancel()
                        return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            async with send:
                if not outbound:
                    await connected.wait()
                while True:
                    try:
                        data = await source.receive_some(CHUNK)
                    except ERRORS:
                        reset(client)
                        scope.cancel()
                        return
                    if not data and not connected.is_set():
                        scope.cancel()  # the node gave up before the connection was made
                        return
                    await send.send((trio.current_time() + self.delay, data))
                    if not data:
                        return


def reset(stream: trio.SocketStream) -> None:
    """Make the close of `stream` a RST (SO_LINGER 0), as a refusing or resetting peer's."""
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mark", type=lambda text: int(text, 0), required=True)
    parser.add_argument("--control", required=True)
    args = parser.parse_args()
    proxy = Proxy(args.mark)
    listeners = await trio.open_tcp_listeners(args.port, host="127.0.0.1", backlog=4096)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(proxy.serve_control, args.control)
        nursery.start_soon(trio.serve_listeners, proxy.handle, listeners)


if __name__ == "__main__":
    trio.run(main)
