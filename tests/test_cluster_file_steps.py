"""Single-file checkpoints in a cluster: a file step (`epoch=0-step=5.ckpt`) and a loose file
(`last.ckpt`, committed when quiet) written on one node are listed on the others, get their
K copies, and survive the loss of their writer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import MountFactory, wait_until
from tests.harness import Cluster
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster


def test_file_steps_and_loose_files_are_replicated_and_survive_their_writer(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    for node_id in cluster.ports:
        cluster.start(node_id)
    writer, others = cluster.nodes["node0"], [cluster.nodes["node1"], cluster.nodes["node2"]]
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
    data = {"run/epoch=0-step=5.ckpt": os.urandom(3 << 20), "run/last.ckpt": os.urandom(1 << 20)}
    (writer / "run").mkdir()
    for path, content in data.items():
        (writer / path).write_bytes(content)

    def copied(path: str) -> bool:
        step = writer.step(path)
        return step is not None and step["state"] == "committed" and step.get("copies") == 2

    for path in data:  # each at its close (the loose file, written whole, a moment after)
        wait_until(lambda path=path: copied(path), timeout=30)
        for node in others:
            wait_until(lambda node=node, path=path: node.step(path) is not None, timeout=10)
    writer.kill9()
    for node in others:
        for path, content in data.items():
            assert (node / path).read_bytes() == content
