"""Free loopback ports for the servers that tests, the demo and the bench start (tierfs
daemons, etcd, SeaweedFS).

A port comes from below the kernel's ephemeral range (`ip_local_port_range`), never from
binding to port 0: a port the kernel chose could be taken by any outgoing connection before the
server bound it ("Address already in use"). A port is handed out once per process (until half
the range has been, by which time the servers given the first ones are long gone): a cluster
takes all its nodes' ports before any node binds one, and random picks could repeat. Under
pytest-xdist each worker process picks from its own slice of the range: two workers picking
the same port, the other's server binding it first, was a CI flake ("cannot listen for peers:
Address already in use").
"""

from __future__ import annotations

import os
import random
import socket
import threading

LOOPBACK = "127.0.0.1"


def _below_ephemeral() -> range:
    """Ports the kernel never gives an outgoing connection: those below its ephemeral range."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    return range(max(1024, low - 12000), low)


def share_of(ports: range, worker: str | None, workers: str | None) -> range:
    """The slice of `ports` a process picks from: all of them, or under pytest-xdist
    (`worker` "gwN" of `workers`, its PYTEST_XDIST_WORKER and _COUNT) the Nth of equal
    slices, so that no two workers ever hand out the same port."""
    if not worker or not worker.startswith("gw") or not workers:
        return ports
    index, count = int(worker[2:]), int(workers)
    size = len(ports) // count
    return range(ports.start + index * size, ports.start + (index + 1) * size)


PORTS = share_of(_below_ephemeral(), os.environ.get("PYTEST_XDIST_WORKER"),
                 os.environ.get("PYTEST_XDIST_WORKER_COUNT"))
_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port(below: int = 65536) -> int:
    """A loopback port nothing listens on now, below the ephemeral range (and below `below`),
    not handed out before by this process."""
    candidates = range(PORTS.start, min(PORTS.stop, below))
    if not candidates:
        raise RuntimeError(f"no port below {below} lies below the ephemeral range "
                           f"({PORTS.stop} and up)")
    with _lock:
        if len(_handed_out) > len(candidates) // 2:
            _handed_out.clear()
        for _attempt in range(10 * len(candidates)):
            port = random.choice(candidates)
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((LOOPBACK, port))
                except OSError:
                    continue  # in use, or waiting out a closed connection
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {candidates.start}-{candidates.stop - 1}")


def free_ports(count: int, below: int = 65536) -> list[int]:
    """`count` distinct ports, as `free_port` picks them."""
    return [free_port(below) for _ in range(count)]
