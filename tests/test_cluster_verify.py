"""`tierfs verify` tells "every copy reachable" from "fewer than K + 1 copies, each file still
reachable" from "a file with no reachable copy": exit 0, exit 0 with a warning line, exit 1
naming each lost file and the nodes that held it last. A node that unmounted cleanly is
unreachable, not a fault of the copies it held."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, tierfs, wait_until
from tests.harness import Cluster
from tests.test_crash import save
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster


def verify(node: Mount, relpath: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return tierfs("verify", str(node / relpath), *extra, check=False, timeout=120)


def test_verify_tells_whole_from_short_from_lost(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0 = mounts.mount(*cluster.args("node0"))  # K = 1
    node1 = mounts.mount(*cluster.args("node1"), "--replicas", "0")  # its steps: one copy
    cluster.nodes.update(node0=node0, node1=node1)
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
    save(node0 / "run/step_1", {"model.pt": os.urandom(1 << 20), ".metadata": b"m1"})
    save(node1 / "run/step_2", {"model.pt": os.urandom(1 << 20), ".metadata": b"m2"})
    wait_until(lambda: node0.step("run/step_1")["replicas"] == ["node1"], timeout=30)
    wait_until(lambda: (node0.step("run/step_2") or {}).get("state") == "committed", timeout=10)

    # K + 1 good copies of every file: exit 0, no warning
    done = verify(node0, "run/step_1")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "every copy good" in done.stdout
    # every file reachable, on one node only: exit 0 with a warning line
    done = verify(node0, "run/step_2")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ("tierfs: warning: 2 files of run/step_2 have fewer than 2 copies "
                           "reachable (K + 1, at most one per node) and none in the "
                           "persistent tier: .metadata (1 copy), model.pt (1 copy)\n"), done.stderr

    # node1 unmounts cleanly: nothing of step_1 is lost (node0 holds it), all of step_2 is
    subprocess.run(["fusermount3", "-u", str(node1.mountpoint)], check=True)
    wait_until(lambda: not cluster.peers_up("node0")["node1"], timeout=15)
    done = verify(node0, "run/step_1")
    assert done.returncode == 0, done.stderr
    assert "1 copy" in done.stderr and "warning" in done.stderr
    assert "UNREACHABLE: could not ask node1" in done.stdout
    done = verify(node0, "run")
    assert done.returncode == 1
    assert done.stderr == ("tierfs: verify: 2 files of run/step_2 have no reachable copy: "
                           ".metadata (last held by node1), model.pt (last held by node1)\n"), \
        done.stderr
    report = json.loads(verify(node0, "run", "--json").stdout)
    by_path = {step["path"]: step for step in report["steps"]}
    assert by_path["run/step_2"]["lost"] == {".metadata": ["node1"], "model.pt": ["node1"]}
    assert by_path["run/step_1"]["lost"] == {} and by_path["run/step_1"]["short"] == {
        ".metadata": 1, "model.pt": 1}


def test_verify_wants_no_more_copies_than_there_are_nodes(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """--replicas 2 on a cluster of two nodes: each file has a copy on both, all the nodes
    there are (the replica-count rule's cap, as status has it): verify finds nothing short."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, _node1 = cluster.start_all("--replicas", "2")
    save(node0 / "run/step_1", {"model.pt": os.urandom(1 << 20), ".metadata": b"m1"})
    wait_until(lambda: node0.step("run/step_1")["replicas"] == ["node1"], timeout=30)
    done = verify(node0, "run/step_1")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "every copy good" in done.stdout
    # one of the two gone: a file on one node is short of the two there were
    subprocess.run(["fusermount3", "-u", str(cluster.nodes["node1"].mountpoint)], check=True)
    wait_until(lambda: not cluster.peers_up("node0")["node1"], timeout=15)
    done = verify(node0, "run/step_1")
    assert done.returncode == 0, done.stderr
    assert "fewer than 2 copies reachable" in done.stderr, done.stderr
