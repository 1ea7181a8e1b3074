"""One writer, many readers (a data-parallel restart): every node reads the file rank 0 saved
on node0, at once. Readers serve the chunks they fetched to each other
(`replication.peers.sources`), so node0's uplink sends the file about once whatever the number of
readers (the `tierfs_peer_sent_bytes` metric), every reader gets the same bytes, and a reader
that dies mid-way stalls nobody. Several ranks reading one file on one node start one fetch."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, free_port, wait_until
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tests.test_crash import save
from tierfs import manifest as mf
from tierfs import reserved
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster

STEP = "ddp/step_1"
# The file every node reads: 96 MiB in `make test`; the 1 GiB with
# TIERFS_MANY_READERS_MIB=1024 (about a minute on a 2-core machine).
FILE_MIB = int(os.environ.get("TIERFS_MANY_READERS_MIB", "96"))


def sent_bytes(metrics_port: int) -> dict[str, float]:
    """`tierfs_peer_sent_bytes` per peer, scraped from a daemon's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {peer: float(value) for peer, value in
            re.findall(r'^tierfs_peer_sent_bytes_total\{peer="([^"]+)"\} (\S+)$', text, re.M)}


def start_cluster(mounts: MountFactory, token_file: Path, etcd: Etcd, size: int,  # noqa: F811
                  *options: str) -> tuple[Cluster, int]:
    """`size` nodes, node0 serving metrics; the port of node0's metrics."""
    cluster = Cluster(mounts, token_file, size, etcd)
    metrics = free_port()
    for node_id in cluster.ports:
        extra = ["--metrics", f"127.0.0.1:{metrics}"] if node_id == "node0" else []
        cluster.nodes[node_id] = mounts.mount(*cluster.args(node_id), *options, *extra)
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=30)
    return cluster, metrics


def committed_on(node: Mount) -> bool:
    return (node.step(STEP) or {}).get("state") == "committed"


def size_of(path: Path) -> int:
    """A file's size; 0 once it is gone (a partial file becomes the object)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def start_cat(path: Path) -> subprocess.Popen[bytes]:
    """`cat` of the file, its bytes hashed as they come (no copy kept)."""
    return subprocess.Popen(["sh", "-c", f"cat '{path}' | sha256sum"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)


def test_ranks_on_one_node_reading_one_file_start_one_fetch(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster, metrics = start_cluster(mounts, token_file, etcd_server, 2, "--replicas", "0")
    node0, node1 = cluster.nodes["node0"], cluster.nodes["node1"]
    data = os.urandom(3 * mf.CHUNK_SIZE + 4321)
    save(node0 / STEP, {"model.pt": data, ".metadata": b"m"})
    wait_until(lambda: committed_on(node1), timeout=15)
    before = sent_bytes(metrics).get("node1", 0)
    ranks = [start_cat(node1 / STEP / "model.pt") for _ in range(8)]
    digests = {rank.communicate(timeout=60)[0].split()[0].decode() for rank in ranks}
    assert digests == {hashlib.sha256(data).hexdigest()}
    sent = sent_bytes(metrics)["node1"] - before
    assert len(data) <= sent < 1.05 * len(data), sent  # once, not once per rank
    assert node1.log().count(f"{STEP}/model.pt is back in RAM") == 1


def test_every_node_reads_one_writers_file_at_once_and_the_writer_sends_it_about_once(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster, metrics = start_cluster(mounts, token_file, etcd_server, 8, "--replicas", "1")
    nodes = [cluster.nodes[f"node{i}"] for i in range(8)]
    data = os.urandom(FILE_MIB << 20)
    save(nodes[0] / STEP, {"model.pt": data, ".metadata": b"m"})
    wait_until(lambda: nodes[0].step(STEP)["replicas"] == ["node1"], timeout=60)
    for node in nodes[2:]:  # every reader knows both holders before it reads
        wait_until(lambda n=node: sorted((n.step(STEP) or {}).get("replicas") or [])
                   == ["node0", "node1"], timeout=15)
    victim = nodes[7]
    cats = {node.mountpoint: start_cat(node / STEP / "model.pt") for node in nodes[1:]}
    # node7 dies once the first chunks reached it: others may have been sent to it for them
    objects = victim.ram_dir / "objects"
    wait_until(lambda: any(p.name.startswith(reserved.PART) and size_of(p)
                           for p in objects.iterdir()), timeout=30, interval=0.002)
    victim.kill9()
    started = time.monotonic()
    expected = hashlib.sha256(data).hexdigest()
    for node in nodes[1:7]:
        out, _err = cats[node.mountpoint].communicate(timeout=60 + FILE_MIB / 10)
        assert out.split()[0].decode() == expected, node.mountpoint
    cats[victim.mountpoint].communicate(timeout=30)
    # the dead reader stalled nobody for long (a relay waits at most ~10 s for a chunk)
    assert time.monotonic() - started < 30 + FILE_MIB / 20
    sent = sum(sent_bytes(metrics).values())
    print(f"node0 sent {sent / len(data):.2f}x the file")  # -s shows it (README)
    assert sent <= 2 * len(data), f"node0 sent {sent / len(data):.2f}x the file"
    relayed = sum(node.status()["served_to_peers"]["relayed"] for node in nodes[1:7])
    assert relayed > 0
