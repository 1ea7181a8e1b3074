"""A replica target whose RAM dir's file system is full (a small tmpfs, a /dev/shm others
filled): the copies go to another live node instead of being retried there for ever, the
writer's status says why a step was short of copies meanwhile, the full node's status says
its file system is full, and its refusals are what they are (no checksum mismatch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import MountFactory, fill, tierfs, wait_until
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tests.test_crash import save
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("size", [3, 4])
def test_copies_go_to_another_node_when_a_target_has_no_room(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        small_tmpfs: Path, size: int) -> None:
    """K = 1 on three and four nodes; node1, the writer node0's replica target, has its RAM
    dir on a tmpfs another process filled. node0's step gets its second copy on another live
    node (node2, the next on the ring); meanwhile its status said node1 had no room; node1's
    status warns that its file system is full, and every node counts the same 2 copies."""
    cluster = Cluster(mounts, token_file, size, etcd_server)
    for node_id in cluster.ports:
        ram_dir = small_tmpfs / "ram" if node_id == "node1" else None
        cluster.nodes[node_id] = mounts.mount(*cluster.args(node_id), ram_dir=ram_dir)
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
    node0, node1, node2 = (cluster.nodes[f"node{i}"] for i in range(3))
    fill(small_tmpfs / "hog")  # another user of the file system takes what is left
    save(node0 / "run/step_1", {"__0_0.distcp": os.urandom(8 << 20), ".metadata": b"m"})
    wait_until(lambda: node0.step("run/step_1")["copies"] == 2, timeout=60)
    step = node0.step("run/step_1")
    assert step["holders"] == ["node0", "node2"], step
    assert (node2 / "run/step_1/__0_0.distcp").stat().st_size == 8 << 20
    log0 = node0.log()
    assert "node1 has no room" in log0, log0[-3000:]
    text = tierfs("status", str(node1.mountpoint)).stdout
    assert "warning: the file system of the RAM dir" in text and "% full" in text, text
    assert node1.status()["ram"]["fs_free_bytes"] < 1 << 20
    assert "checksum" not in node1.log()
    # Every node with room tells the same story; the full one cannot record the step, so it
    # lists it only once it has room again (and says so meanwhile), with the same holders.
    for node_id, node in cluster.nodes.items():
        if node_id != "node1":
            wait_until(lambda n=node: n.step("run/step_1")["holders"] == ["node0", "node2"],
                       timeout=10)
    assert node1.step("run/step_1") is None
    assert "run/step_1 v1 is not listed here yet: No space left on device" in node1.log()
    (small_tmpfs / "hog").unlink()
    wait_until(lambda: (node1.step("run/step_1") or {}).get("holders") == ["node0", "node2"],
               timeout=30)


def test_a_step_short_of_copies_says_why(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        small_tmpfs: Path) -> None:
    """Two nodes, the only target full: the step stays at one copy, and the writer's status
    says so and why (in `copies_wait` and a warning line); once the target has room again,
    the copy is made."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0 = cluster.nodes["node0"] = mounts.mount(*cluster.args("node0"))
    cluster.nodes["node1"] = mounts.mount(*cluster.args("node1"),
                                          ram_dir=small_tmpfs / "ram")
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
    fill(small_tmpfs / "hog")
    save(node0 / "run/step_1", {"__0_0.distcp": os.urandom(8 << 20), ".metadata": b"m"})
    wait_until(lambda: node0.step("run/step_1")["copies_wait"], timeout=60)
    step = node0.step("run/step_1")
    assert step["copies"] == 1 and "node1 has no room" in step["copies_wait"]["reason"], step
    text = tierfs("status", str(node0.mountpoint)).stdout
    assert "warning: run/step_1 has fewer copies than --replicas asks" in text, text
    (small_tmpfs / "hog").unlink()  # room again: the copy is made (after the pause)
    wait_until(lambda: node0.step("run/step_1")["copies"] == 2, timeout=90)
    assert node0.step("run/step_1")["copies_wait"] is None
