"""A peer connection's bytes: its socket (plain TCP, or TLS on a standard `ssl.SSLSocket`),
non-blocking, driven either from trio (waiting on readiness) or from a worker thread (waiting
in poll), by one of them at a time (`PeerChannel` lends it to one thread for a transfer).

Over a trio stream instead (tests' memory streams), the same calls work: a worker thread's
ones are run on trio (`trio.from_thread.run`).

TLS runs on OpenSSL's own socket I/O, not a memory BIO: its records are encrypted and
decrypted in whichever thread moves them, with the GIL let go, and OpenSSL may hand them to
the kernel (kernel TLS, `OP_ENABLE_KTLS`, where the kernel and OpenSSL offer it). File bytes go
to a plain socket with `sendfile` (the kernel copies them from the file, no Python buffer);
to a TLS socket they are read into a buffer each thread keeps and written through OpenSSL.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, Protocol

import trio

from tierfs.thread_buffers import ThreadBuffer

# A worker waits for bytes this many at a time (SO_RCVLOWAT, plain sockets): a few wakeups
# per chunk instead of one per segment.
LOW_WATER = 1 << 20
POLL_SLICE_MS = 100  # how soon a worker waiting on the socket notices a cancellation
# File bytes read at a time for a TLS socket (no sendfile through OpenSSL without kTLS),
# into a buffer each worker thread keeps.
TLS_FILE_READ = 1 << 20
_TLS_FILE_BUFFER = ThreadBuffer(TLS_FILE_READ)
SOL_TLS, TLS_TX, TLS_RX = 282, 1, 2  # linux/tls.h: getsockopt succeeds once kTLS is on


class Closed(Exception):
    """The peer closed the connection (at its end, cleanly or not)."""


class Wire(Protocol):
    """What a channel moves its frames over."""

    threaded: bool  # its blocking calls may run in a worker thread of their own

    async def recv_into(self, view: memoryview) -> int: ...

    async def send_all(self, data: bytes | memoryview) -> None: ...

    def fill_blocking(self, view: memoryview, expires: float,
                      received: Callable[[int], None]) -> int: ...

    def recv_blocking(self, view: memoryview, expires: float) -> int: ...

    def send_all_blocking(self, data: bytes | memoryview, expires: float) -> None: ...

    def sendfile_blocking(self, fd: int, offset: int, length: int, expires: float) -> None: ...

    def readable_now(self) -> bool: ...

    async def aclose(self) -> None: ...


def _expired(expires: float) -> float:
    """Milliseconds to wait in poll (at most POLL_SLICE_MS); trio.TooSlowError past
    `expires`, trio.Cancelled if the trio task that lent the thread was cancelled."""
    left = expires - time.monotonic()
    if left <= 0:
        raise trio.TooSlowError
    trio.from_thread.check_cancelled()
    return min(POLL_SLICE_MS, int(left * 1000) + 1)


class SocketWire:
    """A connected socket, plain or TLS, kept non-blocking (trio's side waits on readiness, a
    worker's in poll)."""

    threaded = True

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._fd = sock.fileno()
        self._low_water = 1

    # -- from trio ------------------------------------------------------------------------

    async def recv_into(self, view: memoryview) -> int:
        """Some bytes into `view` (0: the peer closed)."""
        while True:
            try:
                count = self.sock.recv_into(view)
            except (BlockingIOError, ssl.SSLWantReadError):
                await trio.lowlevel.wait_readable(self.sock)
                continue
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0  # a TLS close, with close_notify or without: the framing tells
            await trio.lowlevel.checkpoint()
            return count

    async def send_all(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                sent = self.sock.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError):
                await trio.lowlevel.wait_writable(self.sock)
                continue
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            view = view[sent:]
        await trio.lowlevel.checkpoint()

    def readable_now(self) -> bool:
        """Whether bytes (or the peer's close) wait to be read; never blocks."""
        if self.tls and self.sock.pending():  # type: ignore[attr-defined]
            return True
        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        return bool(poll.poll(0))

    async def aclose(self) -> None:
        self.sock.close()
        await trio.lowlevel.checkpoint()

    # -- from a worker thread -------------------------------------------------------------

    def _wait(self, events: int, expires: float) -> None:
        poll = select.poll()
        poll.register(self._fd, events)
        poll.poll(_expired(expires))

    def recv_blocking(self, view: memoryview, expires: float) -> int:
        """Some bytes into `view` (0: the peer closed), waiting for them until `expires`."""
        while True:
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, ssl.SSLWantReadError):
                self._wait(select.POLLIN, expires)
            except ssl.SSLWantWriteError:
                self._wait(select.POLLOUT, expires)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    def fill_blocking(self, view: memoryview, expires: float,
                      received: Callable[[int], None]) -> int:
        """Fill `view`, calling `received` with the count of bytes read, LOW_WATER or more at a
        time (the rest at the end); the total (short if the peer closed first). A plain socket
        is woken once LOW_WATER bytes (or the rest) are in; SO_RCVLOWAT goes back to 1 before
        returning, for trio's waits on small frames. (Not on TLS: OpenSSL may hold part of a
        record, which the kernel's count would not see; there a read returns one record, 16
        KiB at most, and they are counted together.)"""
        filled = pending = 0
        try:
            while filled < len(view):
                if not self.tls:
                    self._set_low_water(min(LOW_WATER, len(view) - filled))
                count = self.recv_blocking(view[filled:], expires)
                if not count:
                    break
                filled += count
                pending += count
                if pending >= LOW_WATER:
                    received(pending)
                    pending = 0
        finally:
            if not self.tls:
                self._set_low_water(1)
        if pending:
            received(pending)
        return filled

    def _set_low_water(self, count: int) -> None:
        if count != self._low_water:
            self._low_water = count
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, count)

    def send_all_blocking(self, data: bytes | memoryview, expires: float) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                sent = self.sock.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._wait(select.POLLOUT, expires)
                continue
            except ssl.SSLWantReadError:
                self._wait(select.POLLIN, expires)
                continue
            view = view[sent:]

    def sendfile_blocking(self, fd: int, offset: int, length: int, expires: float) -> None:
        """`length` bytes of the file `fd` from `offset`: by the kernel on a plain socket, read
        and written through OpenSSL on a TLS one. OSError(EIO) if the file is shorter."""
        end = offset + length
        if self.tls:
            for piece in _TLS_FILE_BUFFER.read(fd, offset, end):
                self.send_all_blocking(piece, expires)
                offset += len(piece)
        while offset < end and not self.tls:
            try:
                sent = os.sendfile(self._fd, fd, offset, end - offset)
            except BlockingIOError:
                self._wait(select.POLLOUT, expires)
                continue
            if sent == 0:
                break
            offset += sent
        if offset < end:
            raise ShortFile("the file is shorter than the payload announced")


class ShortFile(OSError):
    """A file sent as a payload ended before the length its frame announced."""


class StreamWire:
    """A trio stream (tests' memory streams, or any other): the worker's calls run on trio."""

    threaded = False

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def recv_into(self, view: memoryview) -> int:
        data = await self.stream.receive_some(len(view))
        view[:len(data)] = data
        return len(data)

    async def send_all(self, data: bytes | memoryview) -> None:
        await self.stream.send_all(data)

    def readable_now(self) -> bool:
        return False

    async def aclose(self) -> None:
        if isinstance(self.stream, trio.SSLStream):
            await trio.aclose_forcefully(self.stream)
            return
        await self.stream.aclose()

    def recv_blocking(self, view: memoryview, expires: float) -> int:
        return _on_trio(self.recv_into, view, expires=expires)

    def fill_blocking(self, view: memoryview, expires: float,
                      received: Callable[[int], None]) -> int:
        filled = 0
        while filled < len(view):
            count = self.recv_blocking(view[filled:], expires)
            if not count:
                break
            received(count)
            filled += count
        return filled

    def send_all_blocking(self, data: bytes | memoryview, expires: float) -> None:
        _on_trio(self.send_all, data, expires=expires)

    def sendfile_blocking(self, fd: int, offset: int, length: int, expires: float) -> None:
        data = os.pread(fd, length, offset)
        if len(data) < length:
            raise ShortFile("the file is shorter than the payload announced")
        self.send_all_blocking(data, expires)


def _on_trio(function: Callable[..., Any], *args: Any, expires: float) -> Any:
    """`await function(*args)` on trio, from a worker thread, within `expires`."""
    async def bounded() -> Any:
        with trio.fail_after(max(0.0, expires - time.monotonic())):
            return await function(*args)
    return trio.from_thread.run(bounded)


async def secure(sock: socket.socket, context: ssl.SSLContext, *, server_side: bool
                 ) -> ssl.SSLSocket:
    """`sock` in TLS, its handshake driven from trio (SSLError if it fails; the socket is
    closed then)."""
    sock.setblocking(False)
    tls = context.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False)
    try:
        while True:
            try:
                tls.do_handshake()
                return tls
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(tls)
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(tls)
    except BaseException:
        tls.close()
        raise
