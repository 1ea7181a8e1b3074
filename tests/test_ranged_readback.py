"""Ranged read-back from a peer: a node reads part of a large file that only another node holds
(a fresh node, a file evicted from its RAM). The read fetches the 1 MiB blocks it touches,
each checked against its digest, and returns before the rest of the file is anywhere near:
`safe_open` of one tensor moves that tensor and a few MiB, not the shard (node0's
`tierfs_peer_sent_bytes` counts what it sent). A file read back to back from its first byte
comes in whole in the background, and the next open of it is served by passthrough."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.conftest import MountFactory, finish_dcp_ranks, getxattr, start_dcp_ranks, wait_until
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tests.test_cluster_many_readers import committed_on, sent_bytes, start_cluster
from tests.test_crash import save
from tests.test_passthrough import daemon_io
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster

STEP = "ddp/step_1"  # committed_on's step
FILE = 64 << 20  # well above what an open fetches whole


def two_nodes(mounts: MountFactory, token_file: Path,  # noqa: F811
              etcd: Etcd, files: dict[str, bytes]) -> tuple[Cluster, int]:
    """node0 saves `files` in STEP; node1 (which holds none of it) sees the step committed.
    Returns the cluster and node0's metrics port."""
    cluster, metrics = start_cluster(mounts, token_file, etcd, 2, "--replicas", "0")
    save(cluster.nodes["node0"] / STEP, files | {".metadata": b"m"})
    wait_until(lambda: committed_on(cluster.nodes["node1"]), timeout=15)
    return cluster, metrics


def sent_to_node1(metrics: int) -> float:
    return sent_bytes(metrics).get("node1", 0)


def test_a_small_range_of_a_large_file_on_a_peer_moves_its_blocks_not_the_file(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    data = os.urandom(FILE)
    cluster, metrics = two_nodes(mounts, token_file, etcd_server, {"model.bin": data})
    path = cluster.nodes["node1"] / STEP / "model.bin"
    before = sent_to_node1(metrics)
    at = FILE // 2 + 12345
    with open(path, "rb") as f:
        f.seek(at)
        assert f.read(4096) == data[at:at + 4096]
        sent = sent_to_node1(metrics) - before
        assert sent <= 2 * mf.BLOCK_SIZE, f"{sent / 2**20:.1f} MiB moved for 4 KiB"
        f.seek(1000)  # elsewhere, still only what is read
        assert f.read(10) == data[1000:1010]
    sent = sent_to_node1(metrics) - before
    assert sent <= 4 * mf.BLOCK_SIZE, f"{sent / 2**20:.1f} MiB moved for two small reads"
    assert "ram" not in getxattr(path, "user.tierfs.tiers").split(",")


def test_safe_open_of_one_tensor_moves_the_tensor_and_a_few_mib(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    tensors = {f"layer{i}.weight": torch.randn(512, 1024) for i in range(32)}  # 2 MiB each
    shard = safetensors_torch.save(tensors)
    cluster, metrics = two_nodes(mounts, token_file, etcd_server, {"model.safetensors": shard})
    before = sent_to_node1(metrics)
    with safe_open(cluster.nodes["node1"] / STEP / "model.safetensors", "pt") as f:
        tensor = f.get_tensor("layer17.weight")
    assert torch.equal(tensor, tensors["layer17.weight"])
    sent = sent_to_node1(metrics) - before
    wanted = tensor.numel() * tensor.element_size()
    print(f"one tensor of {wanted >> 20} MiB from a {len(shard) >> 20} MiB shard: "
          f"{sent / 2**20:.1f} MiB moved")
    assert sent <= wanted + 4 * mf.BLOCK_SIZE, f"{sent / 2**20:.1f} MiB moved"


def test_a_file_read_from_its_start_comes_in_whole_and_passthrough_resumes(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    data = os.urandom(FILE)
    cluster, metrics = two_nodes(mounts, token_file, etcd_server, {"model.bin": data})
    node1 = cluster.nodes["node1"]
    path = node1 / STEP / "model.bin"
    before = sent_to_node1(metrics)
    assert path.read_bytes() == data
    wait_until(lambda: getxattr(path, "user.tierfs.tiers").startswith("ram"), timeout=30)
    sent = sent_to_node1(metrics) - before
    assert FILE <= sent < 1.05 * FILE, f"{sent / FILE:.2f}x the file moved"  # once
    if node1.status()["passthrough"]:
        read_before, written_before = daemon_io(node1)
        assert path.read_bytes() == data
        read_after, written_after = daemon_io(node1)
        assert (read_after - read_before) + (written_after - written_before) < FILE // 10


def test_a_load_of_a_step_brings_each_shard_it_opens_whole(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """A DCP load opens `.metadata`, then each shard it needs from its start: the shard comes
    whole before its open returns (then read by passthrough), and then the step's other
    shards of the same writer (one node wrote them all here) come in the background, each
    once, while the loader reads the first."""
    shards = {f"__{i}_0.distcp": os.urandom(FILE // 2) for i in range(2)}
    cluster, metrics = two_nodes(mounts, token_file, etcd_server, shards)
    step = cluster.nodes["node1"] / STEP
    assert (step / ".metadata").read_bytes() == b"m"  # the load starts
    with open(step / "__0_0.distcp", "rb") as f:
        assert getxattr(step / "__0_0.distcp", "user.tierfs.tiers").startswith("ram")
        assert f.read() == shards["__0_0.distcp"]
    wait_until(lambda: getxattr(step / "__1_0.distcp", "user.tierfs.tiers").startswith("ram"),
               timeout=30)
    assert (step / "__1_0.distcp").read_bytes() == shards["__1_0.distcp"]
    sent = sent_to_node1(metrics)
    assert FILE <= sent < 1.05 * FILE, f"{sent / FILE:.2f}x the step moved"


def test_a_load_on_the_node_that_holds_the_metadata_brings_the_other_shards_whole(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """A multi-node DCP step: node0 holds rank 0's shard and `.metadata`, node1 rank 1's.
    A load on node0 opens its own `.metadata` (in RAM): node1's shard comes whole at its
    open, as on a node that holds none of the step."""
    cluster, _metrics = start_cluster(mounts, token_file, etcd_server, 2, "--replicas", "0")
    node0, node1 = cluster.nodes["node0"], cluster.nodes["node1"]
    finish_dcp_ranks(start_dcp_ranks([node0 / STEP, node1 / STEP], "--save-only",
                                     "--extra-mib", "32"), timeout=240)
    wait_until(lambda: committed_on(node0), timeout=15)
    shard = node0 / STEP / "__1_0.distcp"
    assert getxattr(shard, "user.tierfs.tiers") == "peer:node1"
    assert getxattr(node0 / STEP / ".metadata", "user.tierfs.tiers").startswith("ram")
    (node0 / STEP / ".metadata").read_bytes()  # the load starts
    with open(shard, "rb"):
        assert getxattr(shard, "user.tierfs.tiers").startswith("ram")


def test_a_load_reads_ahead_only_the_shards_of_the_writer_of_the_one_it_opened(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """A multi-node DCP step, ranks 0 and 1 on node0, ranks 2 and 3 on node1 (K = 0); node2,
    which holds none of it, loads rank 0's shard: rank 1's (node0's too) comes after it in
    the background, node1's shards stay where they are (node1's ranks read those)."""
    cluster, _metrics = start_cluster(mounts, token_file, etcd_server, 3, "--replicas", "0")
    node0, node1, node2 = (cluster.nodes[f"node{i}"] for i in range(3))
    finish_dcp_ranks(start_dcp_ranks([node0 / STEP, node0 / STEP, node1 / STEP, node1 / STEP],
                                     "--save-only", "--extra-mib", "8"), timeout=240)
    wait_until(lambda: committed_on(node2), timeout=15)
    step = node2 / STEP
    (step / ".metadata").read_bytes()  # the load starts
    with open(step / "__0_0.distcp", "rb") as f:
        assert getxattr(step / "__0_0.distcp", "user.tierfs.tiers").startswith("ram")
        assert f.read() == (node0 / STEP / "__0_0.distcp").read_bytes()
    wait_until(lambda: getxattr(step / "__1_0.distcp", "user.tierfs.tiers").startswith("ram"),
               timeout=30)
    time.sleep(2)  # a read-ahead that went on past node0's shards would have them by now
    for theirs in ("__2_0.distcp", "__3_0.distcp"):
        assert not getxattr(step / theirs, "user.tierfs.tiers").startswith("ram"), theirs
