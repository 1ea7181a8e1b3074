"""A small HTTP proxy on 127.0.0.1 between tierfs and a real S3 server (SeaweedFS), which injects
the trouble a real object store has: 503 SlowDown storms, slow responses, connections dropped
before or after the request reached the store, a multipart upload whose part is cut in the
middle, and a store that is down (every connection reset at once).

Requests are passed through unchanged (same method, path, headers and body, so SigV4 signatures
still match); what to do with each request is decided by `plan`, a function of the request that
returns a `Fault` or None. Every fault injected is counted in `counts`."""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b'<Message>Please reduce your request rate.</Message></Error>')
NO_BODY_STATUSES = {204, 304}


@dataclass(frozen=True)
class Request:
    method: str
    path: str   # without the query
    query: str

    @property
    def is_upload_part(self) -> bool:
        return self.method == "PUT" and "partNumber=" in self.query and "uploadId=" in self.query

    @property
    def part_number(self) -> int:
        for item in self.query.split("&"):
            if item.startswith("partNumber="):
                return int(item.split("=", 1)[1])
        return 0

    @property
    def is_write(self) -> bool:
        return self.method in ("PUT", "POST")


@dataclass(frozen=True)
class Fault:
    """What to do to one request.

    kind: "slowdown" (503 SlowDown after reading the body), "slow" (forward after `delay` s),
    "distant" (a store `delay` s away: each round trip takes that long, the answer to the
    headers of a request sent with `Expect: 100-continue` too),
    "drop" (reset the connection after reading `fraction` of the body, before the store sees
    it), "lost_reply" (forward, then reset instead of answering), "down" (reset at once)."""

    kind: str
    delay: float = 0.0
    fraction: float = 0.5


Plan = Callable[[Request], Fault | None]


class RateLimit:
    """A plan that answers SlowDown past `read_rps` reads (GET, HEAD) and `write_rps` other
    requests a second, as S3 does past its per-prefix rates: a token bucket per kind,
    `burst` seconds deep. `accepted` holds the time of each request let through, per kind."""

    def __init__(self, read_rps: float, write_rps: float, burst: float = 0.2) -> None:
        self._rates = {"read": read_rps, "write": write_rps}
        self._burst = burst
        self._tokens = {kind: rate * burst for kind, rate in self._rates.items()}
        self._stamp = time.monotonic()
        self._lock = threading.Lock()
        self.accepted: dict[str, list[float]] = {"read": [], "write": []}

    def __call__(self, request: Request) -> Fault | None:
        kind = "read" if request.method in ("GET", "HEAD") else "write"
        with self._lock:
            now = time.monotonic()
            for name, rate in self._rates.items():
                self._tokens[name] = min(rate * self._burst,
                                         self._tokens[name] + (now - self._stamp) * rate)
            self._stamp = now
            if self._tokens[kind] < 1:
                return Fault("slowdown")
            self._tokens[kind] -= 1
            self.accepted[kind].append(now)
        return None

    def busiest_second(self, kind: str) -> int:
        """The most requests of `kind` let through in any one second."""
        times = self.accepted[kind]
        return max((sum(1 for t in times[i:] if t - start < 1.0)
                    for i, start in enumerate(times)), default=0)


class S3Proxy:
    def __init__(self, upstream: str) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.plan: Plan | None = None
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    @property
    def faults(self) -> int:
        return sum(n for kind, n in self.counts.items() if kind.startswith("fault:"))

    def start(self) -> None:
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.block_on_close = False
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> S3Proxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: S3Proxy

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # tierfs's log says what it saw; the counters say what was injected

    def handle_one_request(self) -> None:
        self._planned: tuple[Fault | None] | None = None  # this request's fault, once asked
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError, OSError):
            self.close_connection = True

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self) -> None:  # noqa: N802
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET  # noqa: N815

    def _reset(self) -> None:
        """Close with a TCP reset, as a crashed server or a broken network would."""
        self.close_connection = True
        sock = self.connection
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        except OSError:
            pass

    def _read_body(self, limit: int | None = None) -> bytes:
        """The request body as sent (raw chunked framing kept), or its first `limit` bytes."""
        length = self.headers.get("Content-Length")
        if length is not None:
            size = int(length)
            return self.rfile.read(size if limit is None else min(size, limit))
        if "chunked" not in (self.headers.get("Transfer-Encoding") or "").lower():
            return b""
        raw = bytearray()
        while True:
            line = self.rfile.readline()
            raw += line
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if limit is not None and len(raw) >= limit:
                return bytes(raw)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = self.rfile.readline()
                    raw += trailer
                    if trailer in (b"\r\n", b"\n", b""):
                        return bytes(raw)
            raw += self.rfile.read(size + 2)

    def _fault(self) -> Fault | None:
        """What the plan does to this request (asked once: a rate limit counts it)."""
        if self._planned is None:
            path, _, query = self.path.partition("?")
            plan = self.owner.plan
            self._planned = (plan(Request(self.command, path, query)) if plan else None,)
        return self._planned[0]

    def handle_expect_100(self) -> bool:
        self.owner.count("expect-100-continue")
        fault = self._fault()
        if fault is not None and fault.kind == "distant":  # "100 Continue" comes from afar too
            time.sleep(fault.delay)
        return super().handle_expect_100()

    def _proxy(self) -> None:
        owner = self.owner
        path, _, query = self.path.partition("?")
        request = Request(self.command, path, query)
        fault = self._fault()
        owner.count("requests")
        if fault is not None:
            owner.count(f"fault:{fault.kind}")
            if request.is_upload_part:
                owner.count(f"fault:{fault.kind}:upload_part")
        if fault is not None and fault.kind == "down":
            self._reset()
            return
        if fault is not None and fault.kind == "drop":
            length = int(self.headers.get("Content-Length") or 0)
            self._read_body(limit=int(length * fault.fraction))
            self._reset()
            return
        body = self._read_body()
        if fault is not None and fault.kind == "slowdown":
            self._answer(503, "Slow Down", [("Content-Type", "application/xml")], SLOWDOWN_BODY)
            return
        if fault is not None and fault.kind in ("slow", "distant"):
            time.sleep(fault.delay)
        try:
            status, reason, headers, data = self._forward(body)
        except OSError:
            self._reset()  # the store itself is unreachable: so is the proxy
            return
        if fault is not None and fault.kind == "lost_reply":
            self._reset()  # the store did it; the client never hears so
            return
        self._answer(status, reason, headers, data)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=120)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in ("connection", "expect"):
                    conn.putheader(name, value)
            conn.endheaders(body if body else None)
            reply = conn.getresponse()
            data = reply.read()
            headers = [(k, v) for k, v in reply.getheaders()
                       if k.lower() not in ("transfer-encoding", "connection")
                       and not (k.lower() == "content-length" and self.command != "HEAD")]
            return reply.status, reply.reason, headers, data
        finally:
            conn.close()

    def _answer(self, status: int, reason: str, headers: list[tuple[str, str]],
                data: bytes) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        if self.command != "HEAD" and status not in NO_BODY_STATUSES:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD" and status not in NO_BODY_STATUSES:
            self.wfile.write(data)
        self.wfile.flush()
