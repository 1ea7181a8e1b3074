"""A cluster prefix used again, as a requeued job does (a scheduler reuses the job id, so the
`--cluster .../$JOB_ID` prefix is the same): the records an earlier incarnation left in etcd
belong to it. Records of a step that no node holds any more (and that is not in the store) are
cleaned up, and a step saved again under an old name commits the same way as a new one."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

from tests.conftest import (
    MountFactory,
    finish_dcp_ranks,
    getxattr,
    pid_alive,
    run_dcp_ranks,
    start_dcp_ranks,
    tierfs,
    wait_until,
)
from tests.test_cluster import (  # noqa: F401
    Cluster,
    _copies_everywhere,
    _file_records,
    cluster3,
    token_file,
)
from tests.test_commit import write_step
from tierfs.devtools.etcd import Etcd
from tierfs.replication.coordination.commit_records import CommitRecords
from tierfs.replication.coordination.etcd import Etcd as EtcdClient
from tierfs.replication.coordination.etcd import parse_cluster_url

pytestmark = pytest.mark.cluster


def commit_record(cluster: Cluster, step: str) -> object:
    url = parse_cluster_url(cluster.url)
    return trio.run(CommitRecords(EtcdClient(url.endpoints), url).commit_of, step)


def test_a_requeued_job_saves_again_under_the_same_prefix(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all()
    run_dcp_ranks([node0 / "run/step_10", node1 / "run/step_10"], timeout=240)
    assert commit_record(cluster, "run/step_10") is not None

    # the job ends: both nodes unmount, and their RAM dirs are wiped
    for node in (node0, node1):
        subprocess.run(["fusermount3", "-u", str(node.mountpoint)], check=True)
        wait_until(lambda n=node: not pid_alive(n.pid), timeout=30)
        shutil.rmtree(node.ram_dir)
    # it is requeued: fresh daemons with the same ids, ports and prefix
    node0, node1 = cluster.start("node0"), cluster.start("node1")
    # no node holds anything of the old step_10 and no store has it: its records go
    wait_until(lambda: commit_record(cluster, "run/step_10") is None, timeout=15)
    for node in (node0, node1):
        wait_until(lambda n=node: n.step("run/step_10") is None, timeout=10)
        assert not os.path.lexists(node / "run/latest")

    # the same job saves step_10 again: it commits on both nodes, as a new step does
    run_dcp_ranks([node0 / "run/step_10", node1 / "run/step_10"], timeout=240)
    for node in (node0, node1):
        wait_until(lambda n=node: (n.step("run/step_10") or {}).get("state") == "committed",
                   timeout=10)
        assert os.readlink(node / "run/latest") == "step_10"
        assert "kept as writing" not in node.log()
    records = _file_records(cluster, "run/step_10")
    wait_until(lambda: all(len(r.holders) == 2 for r in _file_records(
        cluster, "run/step_10").values()), timeout=30)
    assert {r.node for r in records.values()} == {"node0", "node1"}


def test_a_step_saved_again_commits_on_a_node_that_held_only_part_of_it(
        cluster3: Cluster) -> None:  # noqa: F811
    """The same, old records or not: rank 0 on node1 (the committer), rank 1 on node0, which
    holds only its own shard of v1 (the others' copies are on node2). Saved again, v2 commits
    on node0 too: the files of v1 it did not hold are no reason to keep its copy `writing`."""
    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    node0, node1 = cluster3.nodes["node0"], cluster3.nodes["node1"]
    step = "run/step_10"
    finish_dcp_ranks(start_dcp_ranks([node1 / step, node0 / step], "--save-only"),
                     timeout=240)
    wait_until(lambda: _copies_everywhere(cluster3, step, set(cluster3.ports), 2), timeout=30)
    assert not getxattr(node0 / step / ".metadata", "user.tierfs.tiers").startswith("ram")
    finish_dcp_ranks(start_dcp_ranks([node1 / step, node0 / step], "--seed", "1"),
                     timeout=240)
    for node in cluster3.nodes.values():
        wait_until(lambda n=node: (n.step(step) or {}).get("version") == 2
                   and n.step(step)["state"] == "committed", timeout=10)
        assert "kept as writing" not in node.log()


def test_a_step_saved_again_by_ranks_on_other_nodes_takes_their_new_files(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """v1 of a step: both ranks on node0. v2 (a job restarted with its ranks placed
    elsewhere): rank 1 on node1. node0, which commits v2, still holds rank 1's v1 shard as it
    was: the commit takes node1's new shard, never the old copy (a step mixing two saves)."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all()
    step = "run/step_10"
    finish_dcp_ranks(start_dcp_ranks([node0 / step, node0 / step], "--save-only"),
                     timeout=240)
    finish_dcp_ranks(start_dcp_ranks([node0 / step, node1 / step], "--seed", "1"),
                     timeout=240)
    records = _file_records(cluster, step)
    for name in ("__1_0.distcp", "__1_1.distcp"):
        if name in records:
            assert records[name].node == "node1"
            assert getxattr(node0 / step / name, "user.tierfs.xxh3") == records[name].xxh3
    for node in (node0, node1):
        assert node.step(step)["version"] == 2 and node.step(step)["state"] == "committed"


def test_a_new_cluster_does_not_count_the_copies_an_old_one_made(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """A node mounted with its RAM dir into a new cluster (another prefix): its step's copy on
    a node of the old cluster is no copy here. Before, status listed that node as a replica
    (from the marks its RAM dir kept)."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all()
    write_step(node0 / "run/step_1", {"a.bin": b"x" * 5000})
    wait_until(lambda: node0.step("run/step_1")["replicas"] == ["node1"], timeout=30)
    for node in (node0, node1):
        subprocess.run(["fusermount3", "-u", str(node.mountpoint)], check=True)
        wait_until(lambda n=node: not pid_alive(n.pid), timeout=30)

    new = etcd_server.cluster_url(f"test/{mounts.tmp_path.name}-new")
    again = mounts.mount("--node-id", "node0", "--cluster", new, "--listen",
                         f"127.0.0.1:{cluster.ports['node0']}", "--token-file", str(token_file),
                         ram_dir=node0.ram_dir, mountpoint=node0.mountpoint)
    wait_until(lambda: again.status()["caught_up"], timeout=30)
    step = again.step("run/step_1")
    assert step["replicas"] == [] and step["holders"] == ["node0"], step
    assert step["copies"] == 1 and step["only_here"] is True
    assert "node1" not in tierfs("status", str(again.mountpoint)).stdout
