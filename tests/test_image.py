"""The container image (`make image`) run as the DaemonSet runs it (tests/daemonset_pod.py
reads the options from deploy/kubernetes/tierfs-daemonset.yaml): privileged, host network,
/dev/fuse, the node's /dev/shm for the RAM dir, the host's mount directory bind-mounted with
shared propagation, a --persist store (SeaweedFS) and a --cluster etcd on the host's loopback.
Jobs run on the host, outside the containers, through the mount the container made there.

`make test-image` builds the image (cached) and runs this module; `make test` leaves it out.
Each test cleans up even when it fails: its containers removed (podman rm -f), the mounts left
on its host directories lazily unmounted, its RAM dirs removed, its servers stopped by pid."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    finish_dcp_ranks,
    free_port,
    getxattr,
    run_dcp_ranks,
    start_dcp_ranks,
    tierfs,
    wait_until,
)
from tests.daemonset_pod import DaemonSetPod, Site, image_name, manifest_pod, podman
from tierfs.devtools.etcd import Etcd
from tierfs.devtools.seaweed import SeaweedS3
from tierfs.mount_helper.mounts import mount_at, mount_table

pytestmark = pytest.mark.image

MOUNT_IN_POD = "/checkpoints"  # the hostPath volume the daemon mounts tierfs on
DCP_TIMEOUT = 300  # two ranks that import torch on a busy 2-core machine


@pytest.fixture(scope="module")
def image() -> str:
    name = image_name()
    if podman("image", "exists", name, check=False).returncode != 0:
        pytest.fail(f"there is no image {name}: `make image` builds it "
                    f"(`make test-image` builds it and runs this)")
    return name


def persist_url() -> str:
    """The DaemonSet's --persist store: the test's SeaweedFS gets that bucket."""
    command = manifest_pod()["containers"][0]["command"]
    return command[command.index("--persist") + 1]


@dataclass
class Servers:
    s3: SeaweedS3
    etcd: Etcd


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    """A SeaweedFS S3 and an etcd on the host's loopback, of this test alone (the manifest's
    bucket and cluster prefix are fixed)."""
    with Etcd(tmp_path / "etcd") as etcd, SeaweedS3(tmp_path / "seaweed") as s3:
        s3.client().create_bucket(Bucket=persist_url().removeprefix("s3://").split("/")[0])
        yield Servers(s3, etcd)


class Node:
    """A node of the test: a DaemonSet pod whose /checkpoints is a host directory of its own
    (a shared mount, as a node's / is under systemd), with a RAM dir and peer port of its own."""

    def __init__(self, name: str, tmp_path: Path, servers: Servers, token: str,
                 image: str) -> None:
        self.name = name
        self.host_dir = tmp_path / name / "checkpoints"
        self.ram_dir = Path("/dev/shm") / f"tierfs-image-{uuid.uuid4().hex[:12]}"
        secret = {"etcd-endpoints": servers.etcd.endpoint, "token": token,
                  "aws-access-key-id": servers.s3.access_key,
                  "aws-secret-access-key": servers.s3.secret_key,
                  "s3-endpoint": servers.s3.endpoint}
        site = Site(node_name=name, node_ip="127.0.0.1", secret=secret,
                    host_paths={"/dev/fuse": Path("/dev/fuse"), "/dev/shm": Path("/dev/shm"),
                                MOUNT_IN_POD: self.host_dir},
                    options={"--ram-dir": str(self.ram_dir),
                             "--listen": f"$(NODE_IP):{free_port()}"},
                    # the init container makes it the node's --failure-domain
                    labels={"topology.kubernetes.io/zone": f"zone-{name}"})
        self.pod = DaemonSetPod(site, tmp_path / name, image)

    def share(self) -> None:
        """Make the host directory a shared mount: Bidirectional propagation needs one to
        propagate into (a node's / is shared under systemd; this machine's is not)."""
        self.host_dir.mkdir(parents=True)
        subprocess.run(["mount", "--bind", str(self.host_dir), str(self.host_dir)], check=True)
        subprocess.run(["mount", "--make-shared", str(self.host_dir)], check=True)

    def start(self) -> None:
        """A pod on this node, once ready: its mount on the host, its probe passing."""
        self.pod.start()

        def mounted() -> bool:
            if not self.pod.running():
                raise AssertionError(f"{self.name}'s container exited:\n"
                                     f"{self.pod.logs()[-3000:]}")
            entry = mount_at(self.host_dir)
            return entry is not None and entry.fstype == "fuse.tierfs"

        wait_until(mounted, timeout=60, interval=0.2)
        wait_until(self.pod.ready, timeout=60, interval=0.5)

    def status(self) -> dict[str, Any]:
        """`tierfs status --json` from the host."""
        return json.loads(tierfs("status", str(self.host_dir), "--json").stdout)

    def status_inside(self) -> dict[str, Any]:
        """`tierfs status --json` inside the pod's container."""
        return json.loads(self.pod.exec("tierfs", "status", MOUNT_IN_POD, "--json").stdout)

    def step(self, path: str) -> dict[str, Any] | None:
        return next((step for step in self.status()["steps"] if step["path"] == path), None)

    def peers_up(self) -> dict[str, bool]:
        return {peer["node_id"]: peer["up"] for peer in self.status()["peers"]}

    def log(self) -> str:
        return self.pod.logs()

    def cleanup(self) -> None:
        self.pod.remove()
        # A removed container's daemon was killed: its mount stays on the host, dead, over
        # the bind mount of the host directory. Both go, the top one first.
        for _ in [entry for entry in mount_table() if entry.mountpoint == str(self.host_dir)]:
            subprocess.run(["umount", "-l", str(self.host_dir)], capture_output=True)
        subprocess.run(["rm", "-rf", str(self.ram_dir)], check=False)


@pytest.fixture
def nodes(tmp_path: Path, servers: Servers, image: str) -> Iterator[Any]:
    """`nodes(name)`: a new node of one cluster (one token)."""
    token = os.urandom(32).hex()
    made: list[Node] = []

    def new(name: str) -> Node:
        node = Node(name, tmp_path, servers, token, image)
        made.append(node)
        node.share()
        return node

    try:
        yield new
    finally:
        for node in reversed(made):
            node.cleanup()


def test_a_dcp_job_on_the_host_saves_into_the_pods_mount_and_the_step_outlives_the_pod(
        nodes: Any, servers: Servers) -> None:
    node = nodes("node-a")
    node.start()
    inside, outside = node.status_inside(), node.status()
    assert inside["node_id"] == outside["node_id"] == "node-a"
    assert inside["ram_dir"] == outside["ram_dir"] == str(node.ram_dir)
    plain = tierfs("status", str(node.host_dir)).stdout  # the table a user reads, from outside
    assert "node node-a" in plain.splitlines()[0], plain

    step_dir = node.host_dir / "run1" / "step_100"
    run_dcp_ranks([step_dir, step_dir], timeout=DCP_TIMEOUT)  # two ranks on this node
    step = node.step("run1/step_100")
    assert step is not None and step["state"] == "committed" and step["ram"]
    assert getxattr(step_dir, "user.tierfs.state") == "committed"
    step_inside = next(s for s in node.status_inside()["steps"] if s["path"] == "run1/step_100")
    assert step_inside["state"] == "committed"

    node.pod.stop()  # preStop's flush (every step to the store), then SIGTERM: unmounted
    entry = mount_at(node.host_dir)
    assert entry is not None and entry.fstype != "fuse.tierfs", entry  # the bind mount only
    bucket, _, prefix = persist_url().removeprefix("s3://").partition("/")
    stored = servers.s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    assert stored.get("KeyCount", 0) > 0

    node.start()  # a new container on the same RAM dir: the step is there, in RAM
    step = node.step("run1/step_100")
    assert step is not None and step["state"] == "committed" and step["ram"], step
    assert step["persisted"] is True
    finish_dcp_ranks(start_dcp_ranks([step_dir, step_dir], "--load-only"), DCP_TIMEOUT)


def test_two_pods_form_a_cluster_and_replicate_a_two_node_job(nodes: Any) -> None:
    a, b = nodes("node-a"), nodes("node-b")
    a.start()
    b.start()
    wait_until(lambda: a.peers_up() == {"node-b": True} and b.peers_up() == {"node-a": True},
               timeout=30, interval=0.2)
    # rank 0 on node-a, rank 1 on node-b, each through its own node's mount
    step = "run2/step_7"
    run_dcp_ranks([a.host_dir / step, b.host_dir / step], timeout=DCP_TIMEOUT)
    for here, there in ((a, "node-b"), (b, "node-a")):
        wait_until(lambda h=here, t=there: (h.step(step) or {}).get("replicas") == [t],
                   timeout=60, interval=0.2)
        tiers = getxattr(here.host_dir / step, "user.tierfs.tiers").split(",")
        assert tiers[:2] == ["ram", f"peer:{there}"], tiers  # and `persist` once uploaded
    assert f"Step {step}: replicated to node-b" in a.log()
    # every file reads the same through either node's mount
    names = sorted(os.listdir(a.host_dir / step))
    assert names == sorted(os.listdir(b.host_dir / step)) and ".metadata" in names
    for name in names:
        assert (a.host_dir / step / name).read_bytes() == (b.host_dir / step / name).read_bytes()
