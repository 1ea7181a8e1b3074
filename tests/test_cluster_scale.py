"""The cluster at the sizes it exists for, on a real etcd and real daemons: a 16,000-file
multi-node DCP step (2,000 nodes x 8 ranks' worth of shards) commits, and every node lists it
with all its files and reads them; and an etcd restart in the middle of a run."""

from __future__ import annotations

import io
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, wait_until
from tests.harness import Cluster
from tests.test_etcd_cluster import grpc_requests
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster

FILES = int(os.environ.get("TIERFS_SCALE_FILES", "16000"))
WRITERS = 8  # threads writing the shards through each mount
OPEN_FILES = 512  # the daemons' limit (RLIMIT_NOFILE) in the test of many small files' copies


def shard_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def shard_data(rank: int) -> bytes:
    return b"%d\n" % rank


def dcp_metadata(names: list[str]) -> bytes:
    """A real DCP `.metadata` whose storage_data names every file in `names`."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    storage = {MetadataIndex(f"w{i}", None, None): _StorageInfo(name, 0, 1)
               for i, name in enumerate(names)}
    buffer = io.BytesIO()
    pickle.dump(Metadata(state_dict_metadata={}, storage_data=storage), buffer)
    return buffer.getvalue()


def write_shards(node: Mount, step: str, ranks: list[int]) -> None:
    def write(rank: int) -> None:
        (node / step / shard_name(rank)).write_bytes(shard_data(rank))

    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(write, ranks))


def listed_files(node: Mount, step: str) -> int | None:
    found = node.step(step)
    return found["files"] if found is not None and found["state"] == "committed" else None


def test_a_16000_file_multi_node_step_commits_and_every_node_lists_and_reads_it(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    for node_id in cluster.ports:
        cluster.start(node_id)
    nodes = list(cluster.nodes.values())
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
    step = "run/step_1"
    for node in nodes:
        (node / step).mkdir(parents=True)
    metadata = dcp_metadata([shard_name(r) for r in range(FILES)])
    started = time.monotonic()
    with ThreadPoolExecutor(len(nodes)) as pool:  # rank r on node r % 2, all nodes at once
        list(pool.map(lambda i: write_shards(nodes[i], step, list(range(i, FILES, len(nodes)))),
                      range(len(nodes))))
    written = time.monotonic()
    (nodes[0] / step / ".metadata").write_bytes(metadata)  # close() commits
    committed = time.monotonic()
    assert listed_files(nodes[0], step) == FILES + 1
    wait_until(lambda: all(listed_files(n, step) == FILES + 1 for n in nodes), timeout=30)
    everywhere = time.monotonic()
    print(f"\n{FILES} files written in {written - started:.1f} s; .metadata to committed "
          f"{committed - written:.2f} s; to listed on every node {everywhere - written:.2f} s")
    for node in nodes:
        assert len(os.listdir(node / step)) == FILES + 1
        for rank in random.Random(1).sample(range(FILES), 200):
            assert (node / step / shard_name(rank)).read_bytes() == shard_data(rank)
    assert committed - written < 30 and everywhere - written < 40


def test_a_step_of_many_small_files_is_copied_within_a_services_open_file_limit(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    """Both daemons run with half the open-file limit systemd and many container runtimes
    give a service (1,024, soft and hard), and a step of 3,000 small files still reaches its
    two copies, byte for byte on the peer. The sender kept every file of a batch of copies
    (up to 1,000) open until the batch's end: EMFILE at 512 here, and the copies never
    came; at 1,024 a daemon with its store's connections and uploads beside would have."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    limit = ["prlimit", f"--nofile={OPEN_FILES}:{OPEN_FILES}", "--"]
    for node_id in cluster.ports:
        cluster.nodes[node_id] = mounts.mount(*cluster.args(node_id), prefix=limit)
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
    node0, node1 = cluster.nodes["node0"], cluster.nodes["node1"]
    with open(f"/proc/{node0.pid}/limits") as limits:
        assert re.search(rf"Max open files\s+{OPEN_FILES}\s+{OPEN_FILES}", limits.read())
    files = {f"t{i:04}.distcp": b"%d\n" % i for i in range(3000)}
    (node0 / "run/step_1").mkdir(parents=True)
    for name, data in files.items():
        (node0 / "run/step_1" / name).write_bytes(data)
    (node0 / "run/step_1/.metadata").write_bytes(b"m")
    wait_until(lambda: (node0.step("run/step_1") or {}).get("copies") == 2, timeout=120)
    node0.kill9()  # what node1 reads is its own copy
    assert all((node1 / "run/step_1" / name).read_bytes() == data
               for name, data in files.items())


def test_files_created_in_a_step_being_written_do_not_each_ask_etcd(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """Creating a file looks its name up first, and the name is missing: only a missing
    `.metadata` (where a load starts) may ask etcd whether the step was committed elsewhere;
    a saver's every new file must not cost an etcd round trip."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node = cluster.start("node0")
    cluster.start("node1")
    (node / "run/step_1").mkdir(parents=True)
    before = grpc_requests(etcd_server)["Range"]
    for i in range(200):
        (node / f"run/step_1/__{i}_0.distcp").write_bytes(b"x")
    assert grpc_requests(etcd_server)["Range"] - before < 20
