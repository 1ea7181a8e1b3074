"""A write that failed for want of room (ENOSPC) never becomes a committed step: the file its
saver closed after the error may be cut short, so its step stays `writing`, says why, goes to
no peer and no store, until the file is written again; with passthrough (the kernel writes,
the daemon never sees the error: a small tmpfs RAM dir that filled) and without (the RAM
tier's limit)."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, wait_until
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.faults

MiB = 1 << 20
IDLE = 1  # --commit-idle: a step quiet this long commits by itself


def write_refused(path: Path, size: int) -> None:
    """A saver writing `size` bytes that fails with ENOSPC, and closes the file (as torch.save
    does when its write raises)."""
    with pytest.raises(OSError) as refused, open(path, "wb") as f:
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))
    assert refused.value.errno == errno.ENOSPC


def stays_writing(node: Mount, relpath: str) -> dict[str, object]:
    """The step is `writing` through several --commit-idle periods (its quiet time is what is
    tested here), saying why; its status line."""
    time.sleep(3 * IDLE)
    step = node.step(relpath)
    assert step is not None and step["state"] == "writing", step
    assert "failed for want of room" in str(step["waiting_for"]), step
    return step


def test_a_file_step_cut_short_by_a_full_tmpfs_is_not_committed_nor_copied(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        small_tmpfs: Path) -> None:
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0 = cluster.nodes["node0"] = mounts.mount(*cluster.args("node0"), "--commit-idle",
                                                  str(IDLE), ram_dir=small_tmpfs / "ram")
    node1 = cluster.nodes["node1"] = mounts.mount(*cluster.args("node1"))
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
    assert node0.status()["passthrough"]
    (node0 / "run").mkdir()
    write_refused(node0 / "run/model_1000.pt", 40 * MiB)
    stays_writing(node0, "run/model_1000.pt")
    assert node1.step("run/model_1000.pt") is None  # no copy of it anywhere
    assert "it may be cut short" in node0.log()
    # saved again, whole this time: it commits and is copied
    (node0 / "run/model_1000.pt").write_bytes(b"w" * (4 * MiB))
    wait_until(lambda: (node1.step("run/model_1000.pt") or {}).get("state") == "committed",
               timeout=30)


def test_a_step_cut_short_at_the_ram_limit_is_not_committed(mounts: MountFactory) -> None:
    node = mounts.mount("--no-passthrough", "--ram-limit", "16M", "--commit-idle", str(IDLE))
    (node / "run/step_1").mkdir(parents=True)
    (node / "run/step_1/config.json").write_bytes(b"{}")
    write_refused(node / "run/step_1/model.pt", 40 * MiB)
    stays_writing(node, "run/step_1")
    (node / "run/model_7.pt").write_bytes(b"x")  # other saves are not held up
    wait_until(lambda: (node.step("run/model_7.pt") or {}).get("state") == "committed")
    (node / "run/step_1/model.pt").write_bytes(b"m" * MiB)  # written again: it commits
    wait_until(lambda: node.step("run/step_1")["state"] == "committed", timeout=15)
