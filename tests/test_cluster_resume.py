"""Resuming on a node that replaced a lost one, made from its peers alone (no store): what the
job finds there is what it left, also at the edges ordinary deployments hit (a job running as
its own user through a root daemon)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, free_port, wait_until
from tests.harness import Cluster
from tests.test_other_users import WORKTREE, RunAs, dir_attributes, run_as, trainer  # noqa: F401
from tierfs.devtools.etcd import Etcd

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



def test_a_rename_undone_leaves_no_trace_on_a_replaced_node(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """`mv run run_q; mv run_q run` and `mv step_1 step_2; mv step_2 step_1` on node0, no
    store: the middle names leave node1 and the cluster's records, and the node that
    replaces node0 lists none of them (the renames' records each waited for the other for
    ever: node1 and a fresh node listed run_q/step_10 and run/step_2)."""
    from tests.test_deletes import assert_files, deletes_done, files, listed, save_step

    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--commit-idle", "1")
    saved = {n: files(n) for n in (1, 10)}
    for number, content in saved.items():
        save_step(node0 / f"run/step_{number}", content)
    for number in saved:
        wait_until(lambda n=number: (node0.step(f"run/step_{n}") or {}).get("replicas")
                   == ["node1"], timeout=30)

    os.rename(node0 / "run", node0 / "run_q")
    os.rename(node0 / "run_q", node0 / "run")
    os.rename(node0 / "run/step_1", node0 / "run/step_2")
    os.rename(node0 / "run/step_2", node0 / "run/step_1")
    expected = ["run/step_1", "run/step_10"]
    wait_until(lambda: listed(node0) == expected and all(
        s["state"] == "committed" for s in node0.status()["steps"]), timeout=30)
    versions = {s["path"]: s["version"] for s in node0.status()["steps"]}
    # copied again to node1 at their names (the middle names' copies went)
    wait_until(lambda: {s["path"]: (s["version"], s["ram"]) for s in node1.status()["steps"]}
               == {path: (version, True) for path, version in versions.items()}, timeout=30)
    wait_until(lambda: deletes_done(node0), timeout=30)

    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = cluster.start("node0")
    wait_until(lambda: listed(fresh) == expected, timeout=15)
    assert sorted(os.listdir(fresh.mountpoint)) == ["run"]
    for number, content in saved.items():
        assert_files(fresh / f"run/step_{number}", content)
    assert listed(node1) == expected


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="not installed: deepspeed")
def test_a_replaced_node_resumes_deepspeed_from_the_tracker_its_peer_holds(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """DeepSpeed's own engine on node0, saving at steps 2, 4 and 6 faster than --commit-idle
    (120 s here; 5 s by default against saves seconds apart), no store: its `latest` commits
    at each close, with the step it names, and reaches node1 once node1 holds that step. The
    node that replaces node0 resumes from it (the tracker never committed: the replaced node
    had no `latest`, `load_checkpoint` returned None and training restarted at step 0)."""
    from tests.test_frameworks import run_job

    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--commit-idle", "120")
    first = run_job(tmp_path, "deepspeed", str(node0 / "ds"), "6", str(free_port()), "nowait")
    saved = ("ds/global_step6", "ds/latest")
    wait_until(lambda: all((node0.step(s) or {}).get("replicas") == ["node1"] for s in saved),
               timeout=30, explain=lambda: {s: (node0.step(s), node1.step(s)) for s in saved})
    assert (node1 / "ds/latest").read_text() == "global_step6"

    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = cluster.start("node0")
    resumed = run_job(tmp_path, "deepspeed", str(fresh / "ds"), "8", str(free_port()),
                      "resume", "nowait")
    assert resumed["loaded_step"] == 6
    assert resumed["weights_at_load"] == first["saved"]["6"]


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="not installed: lightning")
def test_a_replaced_node_resumes_lightning_from_the_last_ckpt_its_peer_holds(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """Lightning on node0 with `save_last=True` (a regular `last.ckpt`, written whole again at
    each save, beside `epoch=0-step=N.ckpt`), no store, --commit-idle 120 s: `last.ckpt`
    commits a moment after each close and reaches node1, and the node that replaces node0
    resumes from it (`fit(ckpt_path="last")`). Before, it waited to be quiet: a node lost
    within --commit-idle of the job's last save left no `last.ckpt` anywhere, and the new
    node trained from 0."""
    from tests.test_frameworks import run_job

    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--commit-idle", "120")
    assert run_job(tmp_path, "lightning", str(node0 / "run"), "6")["global_step"] == 6

    def replicated(path: str) -> bool:
        step = node0.step(path) or {}
        return step.get("state") == "committed" and step["replicas"] == ["node1"]

    # (Lightning copies each file's times and mode onto it after its close: a version of new
    # attributes only, committed a moment later, not once quiet)
    wait_until(lambda: replicated("run/epoch=0-step=6.ckpt") and replicated("run/last.ckpt"),
               timeout=30)
    assert (node1 / "run/last.ckpt").read_bytes() == (node0 / "run/last.ckpt").read_bytes()

    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = cluster.start("node0")
    resumed = run_job(tmp_path, "lightning", str(fresh / "run"), "8", "last")
    assert resumed == {"global_step": 8, "start_step": 6}


def test_a_tracker_of_a_multi_node_step_reaches_a_peer_once_every_file_has_its_copies(
        cluster3: Cluster) -> None:
    """Megatron-LM's torch_dist format on three nodes (K = 1, no store): ranks on node0 and
    node2 save `iter_0000010` with DCP, rank 0 writes the tracker on node0. The tracker's copy
    goes to node1, which holds none of node2's shards (their copy is on node0, node2's next on
    the ring): it goes once every file of the step has its two copies, wherever they are (it
    waited for node1 to hold every file, which it never would), and a node that replaces node0
    resumes from it."""
    from tests.conftest import run_dcp_ranks
    from tests.harness import check_step_bytes, copies_everywhere, file_records

    node0, node1, node2 = (cluster3.nodes[f"node{i}"] for i in range(3))
    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    step, tracker = "run/iter_0000010", "run/latest_checkpointed_iteration.txt"
    run_dcp_ranks([node0 / step, node2 / step], timeout=240)
    wait_until(lambda: copies_everywhere(cluster3, step, set(cluster3.ports), 2), timeout=30)
    expected = {name: r.xxh3 for name, r in file_records(cluster3, step).items()}
    assert any("node1" not in r.holders for r in file_records(cluster3, step).values())
    (node0 / tracker).write_text("10")
    wait_until(lambda: (node0.step(tracker) or {}).get("replicas") == ["node1"], timeout=30)

    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = cluster3.start("node0")
    assert (fresh / tracker).read_text() == "10"
    check_step_bytes(fresh, step, expected)


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="not installed: lightning")
def test_a_replaced_node_resumes_lightning_from_its_last_link_held_by_a_peer(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """Lightning on node0, no store: ModelCheckpoint keeps the newest checkpoint alone
    (`save_top_k=1`: each save removes the one before) and `last.ckpt`, a link to it. node1
    shows the run as node0 left it (the removed checkpoints gone there too, the link there),
    and the node that replaces node0 resumes at the step saved last (`fit(ckpt_path="last")`;
    it trained from step 0 when the link was lost with node0). Links changed on either node
    are changed on the other."""
    from tests.test_frameworks import run_job

    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all()
    first = run_job(tmp_path, "lightning-link", str(node0 / "run"), "6", "keep=1")
    assert first["global_step"] == 6
    kept = ["epoch=0-step=6.ckpt", "last.ckpt"]
    assert sorted(os.listdir(node0 / "run")) == kept
    # (the link's change comes through etcd, the older checkpoint's delete from node0 itself:
    # either may come first)
    wait_until(lambda: sorted(os.listdir(node1 / "run")) == kept
               and os.readlink(node1 / "run/last.ckpt") == "epoch=0-step=6.ckpt"
               and (node0.step("run/epoch=0-step=6.ckpt") or {}).get("copies") == 2,
               timeout=30)

    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = cluster.start("node0")
    assert sorted(os.listdir(fresh / "run")) == kept
    resumed = run_job(tmp_path, "lightning-link", str(fresh / "run"), "8", "last", "keep=1")
    assert resumed == {"global_step": 8, "start_step": 6}

    def links(node: Mount) -> dict[str, str]:
        found = {}
        for path in (node / "run").iterdir():
            with contextlib.suppress(FileNotFoundError):  # removed since it was listed
                if path.is_symlink():
                    found[path.name] = os.readlink(path)
        return found

    wait_until(lambda: links(node1) == links(fresh), timeout=10)
    assert "epoch=0-step=8.ckpt" in links(node1).values()
    for name in links(node1):  # removed on the other node: gone here too
        os.unlink(node1 / "run" / name)
    wait_until(lambda: links(fresh) == {}, timeout=10)
