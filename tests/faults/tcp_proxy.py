"""A TCP proxy on 127.0.0.1 that a test can cut like a network partition: between one daemon
and its etcd, say, while the daemon's peers still reach both.

While forwarding, bytes pass both ways unchanged. `cut()` stops them where they are, as
dropped packets would: nothing is closed or reset, bytes read already are held, new connections
are accepted (the kernel's backlog would take them) but carry nothing; a client sees its
requests time out. `heal()` lets the held bytes and everything after them through, as a
partition healing lets TCP's retransmissions through. Connections are closed when either end
closes, or at `stop()`."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

BUFFER = 64 << 10


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._open = threading.Event()  # set: forwarding; clear: cut
        self._open.set()
        self._stopped = threading.Event()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.connections = 0  # accepted so far

    @property
    def port(self) -> int:
        assert self._listener is not None
        return self._listener.getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Stop every byte where it is (see the module docstring)."""
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def stop(self) -> None:
        self._stopped.set()
        self._open.set()  # the pumps wake up and see the stop
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()
            self._sockets.clear()

    def __enter__(self) -> TcpProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                client, _addr = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        with self._lock:
            self._sockets.add(client)
        self._wait_open()  # a connection made during a cut does not reach the other end
        if self._stopped.is_set():
            self._close(client)
            return
        try:
            server = socket.create_connection(self.upstream, timeout=10)
            server.settimeout(None)
        except OSError:
            self._close(client)
            return
        with self._lock:
            self._sockets.add(server)
        for source, target in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _wait_open(self) -> None:
        while not self._open.wait(0.1):
            if self._stopped.is_set():
                return

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            for data in self._chunks(source):
                self._wait_open()  # held while cut, delivered once healed
                if self._stopped.is_set():
                    break
                target.sendall(data)
        except OSError:
            pass
        finally:
            self._close(source)
            self._close(target)

    def _chunks(self, source: socket.socket) -> Iterator[bytes]:
        while True:
            self._wait_open()  # while cut, nothing is read either
            if self._stopped.is_set():
                return
            data = source.recv(BUFFER)
            if not data:
                return
            yield data

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()
