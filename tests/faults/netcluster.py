"""A tierfs cluster in network namespaces: etcd and each node on a host of its own on a private
network (tests/faults/network.py), each daemon listening on and advertising its own address,
its FUSE mount made in the machine's mount namespace (only the network namespace is the
host's), so the test and the training job use the mounts as any other.

    with Network(tmp_path, ["n0", "n1", "n2"], ["etcd"]) as net:
        cluster = NetCluster(tmp_path, mounts, net, token_file)
        cluster.start_all("--replicas", "1")
        net.partition(["n2"], ["n0", "n1", "etcd"])
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import Mount, MountFactory, wait_until
from tests.faults.network import Network
from tierfs.devtools.etcd import etcd_binary

ETCD = "etcd"  # the etcd host's name in the network
ETCD_PORT = 2379
PEER_PORT = 7070  # every node's --listen port (each has an address of its own)


class NetCluster:
    """The nodes of `network` (every host but etcd) as one tierfs cluster on its etcd."""

    def __init__(self, workdir: Path, mounts: MountFactory, network: Network,
                 token_file: Path, domains: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.mounts = mounts
        self.network = network
        self.token_file = token_file
        self.domains = domains or {}
        self.node_ids = [name for name in network.hosts if name != ETCD]
        self.nodes: dict[str, Mount] = {}
        self.etcd_address = network.hosts[ETCD].address
        self.url = f"etcd://{self.etcd_address}:{ETCD_PORT}/tierfs-faults"
        self._start_etcd()

    def _start_etcd(self) -> None:
        client = f"http://{self.etcd_address}:{ETCD_PORT}"
        peer = f"http://{self.etcd_address}:{ETCD_PORT + 1}"
        data = self.workdir / "etcd-data"
        self.etcd = self.network.popen(ETCD, [
            etcd_binary(), "--name", "faults", "--data-dir", str(data),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"faults={peer}", "--initial-cluster-state", "new",
            "--logger", "zap", "--log-outputs", "stderr"], self.workdir / "etcd.log")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def healthy() -> bool:
            assert self.etcd.poll() is None, (self.workdir / "etcd.log").read_text()[-2000:]
            try:
                with opener.open(f"{client}/health", timeout=1) as reply:
                    return json.loads(reply.read()).get("health") == "true"
            except OSError:
                return False

        wait_until(healthy, timeout=30, interval=0.1)

    def args(self, node_id: str) -> list[str]:
        address = self.network.hosts[node_id].address
        domain = self.domains.get(node_id)
        return ["--node-id", node_id, "--cluster", self.url,
                "--listen", f"{address}:{PEER_PORT}", "--token-file", str(self.token_file),
                *(["--failure-domain", domain] if domain else [])]

    def start(self, node_id: str, *options: str) -> Mount:
        """Mount `node_id` (again, on its RAM dir, if it was mounted before)."""
        old = self.nodes.get(node_id)
        prefix = self.network.hosts[node_id].command()
        if old is None:
            self.nodes[node_id] = self.mounts.mount(*self.args(node_id), *options,
                                                    prefix=prefix)
        else:
            self.nodes[node_id] = self.mounts.remount(old, *old.extra)
        return self.nodes[node_id]

    def start_all(self, *options: str) -> list[Mount]:
        """Every node, with these options too, once each sees all the others up."""
        for node_id in self.node_ids:
            self.start(node_id, *options)
        for node_id in self.node_ids:
            wait_until(lambda n=node_id: self.all_up(n), timeout=30)
        return [self.nodes[n] for n in self.node_ids]

    def peers(self, node_id: str) -> list[dict[str, Any]]:
        return self.nodes[node_id].status()["peers"]

    def all_up(self, node_id: str) -> bool:
        """Whether `node_id` sees every other node up, its link to each one working."""
        peers = {p["node_id"]: p for p in self.peers(node_id)}
        return all(peers.get(other, {}).get("state") == "up"
                   for other in self.node_ids if other != node_id)
