"""A fresh node restoring a step that a peer holds: once it starts reading the step (a DCP
load's `.metadata`, a `cp -r` reading a file from its first byte), the step's other files are
fetched ahead, whole, through the peers' worker threads into the RAM tier, so that each open
finds its file in RAM or on its way instead of fetching it then. `tierfs status --json` counts
them (`fetched_ahead`)."""

from __future__ import annotations

import filecmp
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import MountFactory, getxattr, tierfs, wait_until
from tests.test_cluster_many_readers import committed_on, start_cluster
from tests.test_crash import save
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster

STEP = "ddp/step_1"  # committed_on's step
SHARDS = 4
SHARD = 4 * mf.CHUNK_SIZE + 4321  # larger than a file an open alone fetches whole


@pytest.mark.parametrize("metadata", [True, False], ids=["dcp-step", "files-step"])
def test_a_fresh_node_reading_a_peers_step_fetches_its_next_files_ahead(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,
        tmp_path: Path, metadata: bool) -> None:
    """node1 holds nothing of the step (K = 0: node0 alone holds it). Once it starts reading
    the step as a restore does (a DCP load opens `.metadata`; `cp -r` or `torch.load` of
    each file reads a file from its first byte), the step's other shards come into its RAM
    without being opened, each verified, and its `cp -r` of the step reads every file
    right."""
    cluster, _metrics = start_cluster(mounts, token_file, etcd_server, 2, "--replicas", "0")
    files = {f"model_{i}.pt": os.urandom(SHARD) for i in range(SHARDS)}
    if metadata:
        save(cluster.nodes["node0"] / STEP, files | {".metadata": b"m"})
    else:  # no .metadata: committed by `tierfs commit`
        step = cluster.nodes["node0"] / STEP
        step.mkdir(parents=True)
        for name, data in files.items():
            (step / name).write_bytes(data)
        tierfs("commit", str(step))
    node1 = cluster.nodes["node1"]
    wait_until(lambda: committed_on(node1), timeout=15)
    step = node1 / STEP
    assert getxattr(step / "model_0.pt", "user.tierfs.tiers") == "peer:node0"
    before = node1.status()["fetched_ahead"]
    first = ".metadata" if metadata else "model_0.pt"
    assert (step / first).read_bytes() == (b"m" if metadata else files[first])
    others = [name for name in files if name != first]
    wait_until(lambda: all(getxattr(step / name, "user.tierfs.tiers").startswith("ram")
                           for name in others), timeout=60)  # none of them opened
    ahead = node1.status()["fetched_ahead"]
    assert ahead["files"] - before["files"] == len(others), ahead
    assert ahead["bytes"] - before["bytes"] == len(others) * SHARD, ahead
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(step), str(copy)], check=True, timeout=120)
    for name, data in files.items():
        assert (copy / name).read_bytes() == data, name
    assert not filecmp.dircmp(step, copy).diff_files
