"""Resuming on a node that replaced a lost one, made from its peers alone (no store): what the
job finds there is what it left, also at the edges ordinary deployments hit (a job running as
its own user through a root daemon)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, free_port, wait_until
from tests.test_cluster import token_file  # noqa: F401 - a fixture
from tests.test_other_users import WORKTREE, RunAs, dir_attributes, run_as, trainer  # noqa: F401
from tierfs.demo.etcd import Etcd

pytestmark = pytest.mark.cluster


def test_a_replaced_node_shows_a_users_directories_as_they_were(
        public_dir: Path, trainer: str, run_as: RunAs, mounts: MountFactory,  # noqa: F811
        token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """A job running as its own user (daemons as root, --allow-other --uid USER) saves on
    node0; node0 is lost and replaced by a node with an empty RAM dir, which lists the steps
    from the cluster and reads them from node1: its directories have the owner, mode and
    times the job gave them (they came back root:root 0755, and the job's next mkdir and its
    rotation's rm got EACCES)."""
    url = etcd_server.cluster_url(f"test/{mounts.tmp_path.name}")
    ports = {"node0": free_port(), "node1": free_port()}

    def start(node_id: str, ram_dir: Path | None = None) -> Mount:
        return mounts.mount(
            "--node-id", node_id, "--cluster", url, "--listen", f"127.0.0.1:{ports[node_id]}",
            "--token-file", str(token_file), "--allow-other", "--uid", trainer,
            "--commit-idle", "1", mountpoint=public_dir / node_id, ram_dir=ram_dir)

    node0, node1 = start("node0"), start("node1")
    wait_until(lambda: all(p["up"] for p in node0.status()["peers"]), timeout=15)
    run_as(trainer, "-c", f"import os; os.mkdir({str(node0 / 'run')!r}, 0o700)")
    run_as(trainer, str(WORKTREE / "tests" / "user_job.py"), str(node0 / "run"))
    dirs = ("run", "run/step_100", "run/step_200")
    for step in ("run/step_100", "run/step_200"):
        wait_until(lambda s=step: (node0.step(s) or {}).get("replicas") == ["node1"],
                   timeout=30)
    before = dir_attributes(node0.mountpoint, *dirs)
    assert before["run"][2] == 0o700

    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = start("node0", ram_dir=node0.ram_dir)
    wait_until(lambda: (fresh.step("run/step_200") or {}).get("state") == "committed",
               timeout=15)
    assert dir_attributes(fresh.mountpoint, *dirs) == before
    refused = run_as("nobody", "-c", f"import os; os.listdir({str(fresh / 'run')!r})",
                     check=False)
    assert "PermissionError" in refused.stderr
    # the job goes on there: its next step, and the rotation of an old one
    run_as(trainer, "-c", f"import os, shutil; os.mkdir({str(fresh / 'run/step_300')!r}); "
                          f"shutil.rmtree({str(fresh / 'run/step_100')!r})")
    assert sorted(os.listdir(fresh / "run")) == ["latest", "step_200", "step_300"]
    assert dir_attributes(node1.mountpoint, "run")["run"][:3] == before["run"][:3]

