"""A private network of Linux network namespaces for the fault tests, and the faults it can take.

Every host of the test (etcd, each tierfs node) gets a namespace of its own with one interface,
`eth0`, an address in a private /24 chosen at random among 10.200-250.x.0/24 (none the machine
routes already), and a veth to a bridge that lives in a namespace of its own (the switch), so
nothing is bridged, filtered or routed by the machine's own tables. The test's namespace gets
one more veth to the switch (address .254), from which it reaches etcd and the nodes; it is
never cut off.

Processes enter a host's network namespace only (`nsenter --net`), not a mount namespace:
a FUSE mount a daemon makes there is the machine's, so the test and the training job (which
runs in the test's namespace, its own collectives on loopback as on a separate fabric) see it.

Faults, each undone by `heal()` (and all of them by `close()`):
- `drop(sources, targets)`: packets from every source to every target vanish (a one-way cut);
  `partition(a, b)` both ways, `isolate(group)` a group from everyone else;
- `loss(sources, targets, p)`: each packet from a source to a target is dropped with
  probability p (iptables' `statistic` match);
- `rate(host, kbit)`: the host's link in both directions through a token bucket (`tc tbf`);
- `delay(ms)`: every TCP connection a node opens to another host passes through the node's
  delaying proxy (tests/faults/delay_proxy.py: this kernel has no `netem`), which holds each
  byte back by `ms` each way.
Drops are iptables rules (`iptables-legacy`, Debian package `iptables`) in the receiving
host's INPUT chain (and, for a cut of a source, in its OUTPUT chain too).

Cleanup kills the processes started here by pid, then every process still inside the
namespaces (their pids from `ip netns pids`), then deletes the namespaces, which takes their
interfaces, addresses, rules and qdiscs with them. A namespace's name carries the pid of the
test process that made it: one left by a test process that died is removed by the next
`Network` made on the machine.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.waiting import wait_until

PREFIX = "tierfs-"  # every namespace made here: tierfs-<pid>-<net id>-<host>
IPTABLES = "iptables-legacy"
PROXY_PORT = 15000  # the delaying proxy's port inside each node's namespace
PROXY_MARK = 0x4654  # the proxy's own connections carry this mark, so they are not redirected
SWITCH = "switch"
HOST_LINK_ADDRESS = 254


class NetworkError(RuntimeError):
    """A command that builds or changes the network failed."""


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(name: str) -> None:
    """Kill every process inside namespace `name` (by pid), then delete it."""
    for _attempt in range(50):
        pids = [int(p) for p in run("ip", "netns", "pids", name, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    run("ip", "netns", "del", name, check=False)


def sweep_leftovers() -> list[str]:
    """Remove the namespaces of test processes that died without cleaning up; their names."""
    removed = []
    for line in run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if not name.startswith(PREFIX) or len(parts) < 3 or not parts[1].isdigit():
            continue
        if not _alive(int(parts[1])):
            _kill_namespace(name)
            removed.append(name)
    return removed


def _taken_networks() -> list[ipaddress.IPv4Network]:
    routes = json.loads(run("ip", "-j", "route", "show", "table", "all").stdout or "[]")
    taken = []
    for route in routes:
        destination = route.get("dst", "")
        if destination in ("", "default") or ":" in destination:
            continue
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(destination, strict=False))
    return taken


def free_subnet() -> ipaddress.IPv4Network:
    """A random private /24 that no route of the machine overlaps."""
    taken = _taken_networks()
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(other) for other in taken):
            return net
    raise NetworkError("no free 10.200-250.x.0/24 on this machine")


@dataclass
class Host:
    """One host of the network: its namespace, its address, and (for nodes) its proxy."""

    name: str
    namespace: str
    address: str
    proxied: bool
    proxy_control: Path | None = None

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.namespace}"

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host's network namespace (and only that namespace)."""
        return ["nsenter", f"--net={self.netns_path}", "--", *argv]


@dataclass
class Fault:
    """One fault in force: what it is (for the history) and the rules that make it."""

    kind: str
    detail: str
    rules: list[tuple[str, list[str]]] = field(default_factory=list)  # (host, iptables args)


class Network:
    """The namespaces, the switch, the addresses, and the faults; see the module docstring.

    Use as a context manager, or call `close()` in a `finally`: cleanup runs even when the
    build failed half way."""

    def __init__(self, workdir: Path, proxied: list[str], plain: list[str] = ()) -> None:
        self.workdir = Path(workdir)
        self.id = uuid.uuid4().hex[:6]
        self.subnet = free_subnet()
        self.hosts: dict[str, Host] = {}
        self.faults: list[Fault] = []
        self._pids: list[int] = []
        self._namespaces: list[str] = []
        self._rates: set[str] = set()
        self._delay = 0
        self.host_link = f"tfh{self.id[:8]}"
        self._names = [*plain, *proxied]
        self._proxied = set(proxied)

    def __enter__(self) -> Network:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def address(self, index: int) -> str:
        return str(self.subnet.network_address + index)

    def _namespace(self, name: str) -> str:
        return f"{PREFIX}{os.getpid()}-{self.id}-{name}"

    def build(self) -> None:
        sweep_leftovers()
        switch = self._namespace(SWITCH)
        self._add_namespace(switch)
        run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", switch, "link", "set", "br0", "up")
        for index, name in enumerate(self._names, start=2):
            namespace = self._namespace(name)
            self._add_namespace(namespace)
            host = Host(name, namespace, self.address(index), name in self._proxied)
            self.hosts[name] = host
            run("ip", "link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name",
                f"v-{name}"[:15], "netns", switch)
            self._attach(switch, f"v-{name}"[:15])
            run("ip", "-n", namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            run("ip", "-n", namespace, "link", "set", "eth0", "up")
        # the test's own way in: never cut off
        run("ip", "link", "add", self.host_link, "type", "veth", "peer", "name", "v-test",
            "netns", switch)
        self._attach(switch, "v-test")
        run("ip", "addr", "add", f"{self.address(HOST_LINK_ADDRESS)}/24", "dev", self.host_link)
        run("ip", "link", "set", self.host_link, "up")
        for host in self.hosts.values():
            if host.proxied:
                self._start_proxy(host)

    def _add_namespace(self, namespace: str) -> None:
        run("ip", "netns", "add", namespace)
        self._namespaces.append(namespace)
        run("ip", "-n", namespace, "link", "set", "lo", "up")

    def _attach(self, switch: str, port: str) -> None:
        run("ip", "-n", switch, "link", "set", port, "master", "br0")
        run("ip", "-n", switch, "link", "set", port, "up")

    def _start_proxy(self, host: Host) -> None:
        host.proxy_control = self.workdir / f"proxy-{host.name}.sock"
        log = open(self.workdir / f"proxy-{host.name}.log", "wb")  # noqa: SIM115 - the child's
        with log:
            proc = subprocess.Popen(
                host.command(sys.executable, str(Path(__file__).with_name("delay_proxy.py")),
                             "--port", str(PROXY_PORT), "--mark", hex(PROXY_MARK),
                             "--control", str(host.proxy_control)),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._pids.append(proc.pid)
        with contextlib.suppress(AssertionError):  # not within the time: said below
            wait_until(lambda: host.proxy_control.exists() or proc.poll() is not None,
                       timeout=20)
        if not host.proxy_control.exists():
            raise NetworkError(f"the delaying proxy of {host.name} did not start: "
                               f"{(self.workdir / f'proxy-{host.name}.log').read_text()}")
        # Every TCP connection the node opens to another host goes through the proxy; its
        # own address (a daemon reaching itself) and the test's link do not.
        for argv in (["-d", f"{host.address}/32", "-j", "RETURN"],
                     ["-d", f"{self.address(HOST_LINK_ADDRESS)}/32", "-j", "RETURN"],
                     ["-p", "tcp", "-d", str(self.subnet), "-m", "mark", "!", "--mark",
                      hex(PROXY_MARK), "-j", "REDIRECT", "--to-ports", str(PROXY_PORT)]):
            self.iptables(host.name, "-t", "nat", "-A", "OUTPUT", *argv)

    # -- processes ----------------------------------------------------------------------------

    def popen(self, host: str, argv: list[str], log: Path, **kwargs: object
              ) -> subprocess.Popen[bytes]:
        """Start `argv` in `host`'s network namespace, its output to `log`; killed by pid at
        close if still running."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.hosts[host].command(*argv), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, **kwargs)
        self._pids.append(proc.pid)
        return proc

    def iptables(self, host: str, *argv: str) -> None:
        run(*self.hosts[host].command(IPTABLES, "-w", *argv))

    # -- faults -------------------------------------------------------------------------------

    def _drop_rules(self, sources: list[str], targets: list[str], extra: list[str]
                    ) -> list[tuple[str, list[str]]]:
        rules = []
        for source in sources:
            for target in targets:
                if source == target:
                    continue
                rules.append((target, ["INPUT", "-s", self.hosts[source].address, *extra,
                                       "-j", "DROP"]))
        return rules

    def _apply(self, fault: Fault) -> Fault:
        for host, rule in fault.rules:
            self.iptables(host, "-A", *rule)
        self.faults.append(fault)
        return fault

    def drop(self, sources: list[str], targets: list[str]) -> Fault:
        """Packets from each source to each target are lost (one way)."""
        return self._apply(Fault("drop", f"{','.join(sources)} -> {','.join(targets)}",
                                 self._drop_rules(sources, targets, [])))

    def partition(self, group: list[str], others: list[str]) -> Fault:
        """No packet between `group` and `others`, either way."""
        rules = self._drop_rules(group, others, []) + self._drop_rules(others, group, [])
        return self._apply(Fault("partition", f"{','.join(group)} | {','.join(others)}", rules))

    def isolate(self, group: list[str]) -> Fault:
        """`group` cut from every other host (the test's link stays)."""
        return self.partition(group, [name for name in self.hosts if name not in group])

    def loss(self, sources: list[str], targets: list[str], probability: float) -> Fault:
        extra = ["-m", "statistic", "--mode", "random", "--probability", f"{probability:.4f}"]
        return self._apply(Fault("loss", f"{','.join(sources)} -> {','.join(targets)} "
                                 f"{probability:.1%}", self._drop_rules(sources, targets, extra)))

    def rate(self, host: str, kbit: int) -> Fault:
        """The host's link limited to `kbit` each way (a token bucket on both ends)."""
        burst = max(kbit * 1000 // 8 // 50, 4096)  # bytes: 20 ms worth, at least one page
        for namespace, device in ((self.hosts[host].namespace, "eth0"),
                                  (self._namespace(SWITCH), f"v-{host}"[:15])):
            run("tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate",
                f"{kbit}kbit", "burst", str(burst), "latency", "400ms")
        self._rates.add(host)
        fault = Fault("rate", f"{host} {kbit} kbit/s")
        self.faults.append(fault)
        return fault

    def delay(self, milliseconds: int) -> Fault:
        """Every connection between nodes, and from nodes to etcd, `milliseconds` each way."""
        self._set_delay(milliseconds)
        fault = Fault("delay", f"{milliseconds} ms each way")
        self.faults.append(fault)
        return fault

    def _set_delay(self, milliseconds: int) -> None:
        for host in self.hosts.values():
            if host.proxy_control is None:
                continue
            with socket.socket(socket.AF_UNIX) as control:
                control.settimeout(10)
                control.connect(str(host.proxy_control))
                control.sendall(f"delay {milliseconds}\n".encode())
                if control.recv(16).strip() != b"ok":
                    raise NetworkError(f"the proxy of {host.name} refused the delay")
        self._delay = milliseconds

    def heal(self) -> list[Fault]:
        """Undo every fault; the faults that were in force."""
        healed, self.faults = self.faults, []
        for name in self.hosts:
            self.iptables(name, "-F", "INPUT")
        for host in sorted(self._rates):
            for namespace, device in ((self.hosts[host].namespace, "eth0"),
                                      (self._namespace(SWITCH), f"v-{host}"[:15])):
                run("tc", "-n", namespace, "qdisc", "del", "dev", device, "root", check=False)
        self._rates.clear()
        if self._delay:
            self._set_delay(0)
        return healed

    # -- cleanup ------------------------------------------------------------------------------

    def close(self) -> None:
        for pid in self._pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._pids.clear()
        for namespace in reversed(self._namespaces):
            _kill_namespace(namespace)
        self._namespaces.clear()
        run("ip", "link", "del", self.host_link, check=False)  # gone with the switch already

    def leftovers(self) -> list[str]:
        """What of this network is still on the machine (namespaces, the test's link)."""
        names = run("ip", "netns", "list", check=False).stdout
        found = [line.split()[0] for line in names.splitlines()
                 if line.startswith(f"{PREFIX}{os.getpid()}-{self.id}-")]
        if run("ip", "link", "show", self.host_link, check=False).returncode == 0:
            found.append(self.host_link)
        return found
