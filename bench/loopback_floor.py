"""The loopback floor of the bench's peer rows: two plain processes move the same bytes over TCP
on 127.0.0.1 from a tmpfs file into a fresh tmpfs file, with 1 or N connections, and nothing
else: the sender `os.sendfile`s its share of the file to each connection, the receiver's
thread per connection `recv_into`s a reused 1 MiB buffer and `pwrite`s it at its offset. No
framing beyond one 16-byte header per connection, no hash, no MAC, no event loop. A peer row's
ratio to it is the share of this machine's copy rate tierfs reaches; no implementation that
puts the bytes into RAM on the other side over kernel TCP does much better.

With `--tls` (certificates of a CA in the given directory, `ca.crt`, `node.crt`,
`node.key`) the same in TLS 1.3 through Python's `ssl` (OpenSSL, AES-GCM), as `--peer-tls`
runs: the sender reads each MiB into its buffer and writes it through OpenSSL (no `sendfile`
through it without kernel TLS), the receiver reads through OpenSSL and `pwrite`s. That is the
floor of any TLS data plane built on Python's `ssl` here.

    python bench/loopback_floor.py --size 1G --connections 1,4 [--tls CERT_DIR]

Each measurement runs the two processes afresh (`measure`): the receiver listens, the sender
connects once told to go, and each reports the CPU seconds (all threads) it spent from the go
to its last byte; the time is the receiver's, from its first accepted connection to its last
byte written.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HEADER = struct.Struct(">QQ")  # offset, length of the share that follows
BUFFER = 1 << 20


@dataclass(frozen=True)
class Floor:
    connections: int
    seconds: float
    cpu_seconds: float  # both processes, every thread, from the go to the last byte

    def gb_per_s(self, size: int) -> float:
        return size / self.seconds / 1e9


def measure(source: Path, dest_dir: Path, connections: int, tls: Path | None = None) -> Floor:
    """Move `source` (a tmpfs file) into a new file in `dest_dir` (tmpfs) over `connections`
    loopback connections, in two fresh processes (in TLS with the certificates in `tls`); the
    new file is removed after."""
    secure = ["--tls", str(tls)] if tls is not None else []
    receiver = subprocess.Popen([sys.executable, __file__, "--receive", str(dest_dir),
                                 "--connections", str(connections), *secure],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    sender = None
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        sender = subprocess.Popen([sys.executable, __file__, "--send", str(source),
                                   "--port", str(port), "--connections", str(connections),
                                   *secure],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert sender.stdin is not None and sender.stdout is not None
        sender.stdout.readline()  # ready: imports done, file open
        sender.stdin.write("go\n")
        sender.stdin.flush()
        sent = json.loads(sender.stdout.readline())
        received = json.loads(receiver.stdout.readline())
    finally:
        for process in (sender, receiver):
            if process is not None:
                try:
                    process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    return Floor(connections, received["seconds"], sent["cpu"] + received["cpu"])


def _shares(size: int, connections: int) -> list[tuple[int, int]]:
    step = -(-size // connections)
    return [(start, min(step, size - start)) for start in range(0, size, step)] or [(0, 0)]


def _context(certs: Path | None, server: bool) -> ssl.SSLContext | None:
    """TLS 1.3 both ways with certificates of the CA in `certs`, as --peer-tls."""
    if certs is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cafile=str(certs / "ca.crt"))
    context.load_cert_chain(str(certs / "node.crt"), str(certs / "node.key"))
    return context


def _send(source: Path, port: int, connections: int, certs: Path | None) -> None:
    context = _context(certs, server=False)
    fd = os.open(source, os.O_RDONLY)
    size = os.fstat(fd).st_size
    print("ready", flush=True)
    sys.stdin.readline()
    cpu = time.process_time()
    shares = _shares(size, connections)

    def one(offset: int, length: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as plain:
            sock = plain if context is None else context.wrap_socket(plain)
            sock.sendall(HEADER.pack(offset, length))
            end = offset + length
            buffer = memoryview(bytearray(BUFFER))
            while offset < end:
                if context is None:
                    offset += os.sendfile(sock.fileno(), fd, offset, end - offset)
                    continue
                count = os.preadv(fd, [buffer[:min(BUFFER, end - offset)]], offset)
                sock.sendall(buffer[:count])
                offset += count
            if context is None:
                sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # the receiver closes once it wrote the share

    threads = [threading.Thread(target=one, args=share) for share in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"cpu": time.process_time() - cpu}), flush=True)


def _receive(dest_dir: Path, connections: int, certs: Path | None) -> None:
    context = _context(certs, server=True)
    listener = socket.create_server(("127.0.0.1", 0), backlog=connections)
    fd, path = tempfile.mkstemp(prefix="loopback-floor-", dir=dest_dir)
    print(listener.getsockname()[1], flush=True)
    started: list[float] = []
    cpu = 0.0

    def one(sock: socket.socket) -> None:
        buffer = bytearray(BUFFER)
        view = memoryview(buffer)
        if context is not None:
            sock = context.wrap_socket(sock, server_side=True)
        with sock:
            header = bytearray()
            while len(header) < HEADER.size:
                header += sock.recv(HEADER.size - len(header))
            offset, length = HEADER.unpack(header)
            end = offset + length
            while offset < end:
                filled = 0
                wanted = min(BUFFER, end - offset)
                while filled < wanted:
                    count = sock.recv_into(view[filled:wanted])
                    if not count:
                        raise ConnectionError("the sender closed early")
                    filled += count
                written = 0
                while written < filled:
                    written += os.pwrite(fd, view[written:filled], offset + written)
                offset += filled

    threads = []
    try:
        for _ in range(connections):
            sock, _addr = listener.accept()
            if not started:
                started.append(time.perf_counter())
                cpu = time.process_time()
            thread = threading.Thread(target=one, args=(sock,))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started[0]
        print(json.dumps({"seconds": seconds, "cpu": time.process_time() - cpu}), flush=True)
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="bytes to move (default 1G)")
    parser.add_argument("--connections", default="1,4",
                        help="connection counts to measure, comma-separated")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tls", type=Path, default=None, metavar="CERT_DIR",
                        help="in TLS, with ca.crt, node.crt and node.key from CERT_DIR")
    parser.add_argument("--send", help=argparse.SUPPRESS)
    parser.add_argument("--receive", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send:
        _send(Path(args.send), args.port, int(args.connections), args.tls)
        return
    if args.receive:
        _receive(Path(args.receive), int(args.connections), args.tls)
        return
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    size = int(args.size[:-1]) * units[args.size[-1]] if args.size[-1] in units \
        else int(args.size)
    work = Path(tempfile.mkdtemp(prefix="loopback-floor-", dir="/dev/shm"))
    try:
        source = work / "source"
        with open(source, "wb") as f:
            for _ in range(-(-size // (64 << 20))):
                f.write(os.urandom(min(64 << 20, size - f.tell())))
        for _ in range(args.reps):
            for count in (int(c) for c in args.connections.split(",")):
                floor = measure(source, work, count, args.tls)
                print(f"{count} connection(s): {floor.seconds:.2f} s, "
                      f"{floor.gb_per_s(size):.2f} GB/s, "
                      f"{floor.cpu_seconds / (size / 2**30):.2f} CPU-s/GiB", flush=True)
    finally:
        for name in os.listdir(work):
            os.unlink(work / name)
        os.rmdir(work)


if __name__ == "__main__":
    main()
