"""The partition suite's network (tests/faults/network.py) does what it says: hosts in namespaces
of their own reach each other on its private addresses, and each fault really cuts, drops,
delays or slows their TCP (the same connections tierfs makes), a heal undoes it, and nothing of
it is left on the machine afterwards, also when the test process that made it died."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.faults.network import PREFIX, Network, run, sweep_leftovers

pytestmark = pytest.mark.faults

PORT = 7070
# An echo server (it also sends N bytes on request "send N"), and a client that connects,
# sends one line and prints the seconds it took (or the error).
SERVER = f"""
import socket, threading
def serve(c):
    with c:
        while line := c.recv(65536):
            if line.startswith(b"send "):
                c.sendall(b"x" * int(line.split()[1]))
            else:
                c.sendall(line)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT})); s.listen()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
CLIENT = f"""
import socket, sys, time
started = time.monotonic()
try:
    c = socket.create_connection((sys.argv[1], {PORT}), timeout=3)
    c.sendall(sys.argv[2].encode())
    want = int(sys.argv[2].split()[1]) if sys.argv[2].startswith("send ") else len(sys.argv[2])
    got = 0
    while got < want:
        chunk = c.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        got += len(chunk)
    print(round(time.monotonic() - started, 3))
except OSError as exc:
    print("error", type(exc).__name__)
"""


def talk(net: Network, source: str, target: str, line: str = "ping") -> float | None:
    """Seconds `source` took to connect to `target` and get `line` answered; None if it
    could not."""
    done = subprocess.run(net.hosts[source].command(sys.executable, "-c", CLIENT,
                                                    net.hosts[target].address, line),
                          capture_output=True, text=True, timeout=60)
    out = done.stdout.strip()
    return None if out.startswith("error") or not out else float(out)


def test_faults_cut_delay_slow_and_heal(tmp_path: Path) -> None:
    with Network(tmp_path, ["n0", "n1"], ["etcd"]) as net:
        for name in ("n1", "etcd"):
            net.popen(name, [sys.executable, "-c", SERVER], tmp_path / f"{name}.log")
        wait_until(lambda: talk(net, "n0", "n1") is not None, timeout=20, interval=0.2)
        assert talk(net, "n0", "etcd") is not None
        assert len({h.address for h in net.hosts.values()}) == 3
        assert all(ipaddress.ip_address(h.address) in net.subnet for h in net.hosts.values())
        assert net.subnet.is_private

        net.partition(["n0"], ["n1"])
        assert talk(net, "n0", "n1") is None and talk(net, "n1", "n0") is None
        assert talk(net, "n0", "etcd") is not None  # only the link named is cut
        net.heal()
        assert talk(net, "n0", "n1") is not None

        net.drop(["n0"], ["etcd"])  # one way: n0's packets never reach etcd
        assert talk(net, "n0", "etcd") is None
        assert talk(net, "n0", "n1") is not None
        net.heal()

        net.delay(150)  # each way: a connection and its first answer take 2 round trips
        took = talk(net, "n0", "n1")
        assert took is not None and took >= 0.3, took
        net.heal()
        took = talk(net, "n0", "n1")
        assert took is not None and took < 0.2, took

        net.rate("n1", 1000)  # 1 Mbit/s: 256 KiB take about 2 s
        took = talk(net, "n0", "n1", f"send {256 << 10}")
        assert took is not None and took > 1.5, took
        net.heal()
        took = talk(net, "n0", "n1", f"send {256 << 10}")
        assert took is not None and took < 1.0, took

        net.loss(["n1"], ["n0"], 1.0)  # every packet: as good as a one-way cut
        assert talk(net, "n0", "n1") is None
        assert net.faults and net.heal()
        assert talk(net, "n0", "n1") is not None
        names = list(net.hosts)
    assert net.leftovers() == []
    listed = run("ip", "netns", "list").stdout
    assert not any(f"-{name}" in listed and net.id in listed for name in names)


def test_a_network_left_by_a_dead_test_process_is_removed(tmp_path: Path) -> None:
    """Its namespaces carry the dead pid: the next Network (here: the sweep it runs first)
    kills what runs in them and removes them."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{PREFIX}{dead.pid}-abcdef-n0"
    alive = f"{PREFIX}{os.getpid()}-abcdef-n0"  # this process's: stays
    run("ip", "netns", "add", name)
    run("ip", "netns", "add", alive)
    sleeper = subprocess.Popen(["nsenter", f"--net=/run/netns/{name}", "--", "sleep", "600"])
    try:
        wait_until(lambda: str(sleeper.pid) in run("ip", "netns", "pids", name).stdout)
        removed = sweep_leftovers()
        assert name in removed and alive not in removed
        listed = run("ip", "netns", "list").stdout
        assert name not in listed and alive in listed
        assert sleeper.wait(timeout=10) != 0  # killed by pid
    finally:
        sleeper.kill()
        run("ip", "netns", "del", name, check=False)
        run("ip", "netns", "del", alive, check=False)
