"""The one port picker of tests, the demo, the bench and the local servers
(`tierfs.devtools.free_ports`): ports below the kernel's ephemeral range, so that no outgoing
connection can take one before its server binds it, and never the same one twice in a
process. In process, no server."""

from __future__ import annotations

import socket

import pytest

from tests import conftest
from tierfs.devtools import free_ports, local_server

pytestmark = pytest.mark.core


def ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_the_local_servers_and_the_tests_pick_ports_the_same_way() -> None:
    """etcd's and SeaweedFS's ports (LocalServer.start) come from the picker the tests use,
    below the ephemeral range (port 0's picks are in it)."""
    ports = local_server.free_ports(20)
    assert all(port < ephemeral_low() for port in ports), ports
    assert conftest.free_port is free_ports.free_port
    capped = free_ports.free_ports(20, below=local_server.MAX_PORT)  # SeaweedFS adds 10000
    assert all(port < local_server.MAX_PORT for port in capped), capped


def test_a_port_is_handed_out_once_and_is_free_when_it_is() -> None:
    ports = [free_ports.free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
    assert all(free_ports.PORTS.start <= port < ephemeral_low() for port in ports)
    with socket.socket() as sock:
        port = free_ports.free_port()
        sock.bind(("127.0.0.1", port))  # nothing held it


def test_a_bound_below_the_range_is_one_line() -> None:
    with pytest.raises(RuntimeError, match="below the ephemeral range"):
        free_ports.free_port(below=free_ports.PORTS.start)


def test_each_xdist_worker_picks_from_a_slice_of_its_own() -> None:
    """Two workers never hand out the same port (one's server bound the port the other
    picked for a node before that node started: "Address already in use")."""
    ports = range(20000, 32000)
    first, second = (free_ports.share_of(ports, f"gw{i}", "2") for i in (0, 1))
    assert first == range(20000, 26000) and second == range(26000, 32000)
    assert free_ports.share_of(ports, None, None) == ports  # one process: all of them
