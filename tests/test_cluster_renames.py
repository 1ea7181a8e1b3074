"""Renames of steps whose files several nodes wrote (a multi-node DCP save), on a node that holds
only some of them: the rename is a delete of the old name and a commit of the new one on every
node, promptly (the rename does not block), and the step reads back whole everywhere under its
new name, committed on the renaming node too, none keeping the old name."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.conftest import (
    MountFactory,
    finish_dcp_ranks,
    getxattr,
    start_dcp_ranks,
    wait_until,
)
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster


def committed(cluster: Cluster) -> dict[str, list[str]]:
    return {node_id: sorted(s["path"] for s in mount.status()["steps"]
                            if s["state"] == "committed")
            for node_id, mount in cluster.nodes.items()}


def test_a_multi_node_step_renamed_on_a_node_holding_part_of_it(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    nodes = cluster.start_all("--replicas", "1")
    finish_dcp_ranks(start_dcp_ranks([m / "run/step_10" for m in nodes], "--save-only",
                                     "--seed", "10"), 120)
    # every file has its copy: node1 holds its own shard and node0's, not node2's
    wait_until(lambda: all((m.step("run/step_10") or {}).get("copies") == 2 for m in nodes),
               timeout=30)
    tiers = getxattr(nodes[1] / "run/step_10/__2_0.distcp", "user.tierfs.tiers").split(",")
    assert "ram" not in tiers, tiers
    started = time.monotonic()
    os.rename(nodes[1] / "run/step_10", nodes[1] / "run/step_15")
    took = time.monotonic() - started
    wait_until(lambda: set(map(tuple, committed(cluster).values())) == {("run/step_15",)},
               timeout=30)
    assert took < 10, f"the rename blocked {took:.1f} s"
    for mount in nodes:
        assert os.readlink(mount / "run/latest") == "step_15"
    finish_dcp_ranks(start_dcp_ranks([m / "run/step_15" for m in nodes], "--load-only",
                                     "--seed", "10"), 120)
