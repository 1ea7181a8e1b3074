"""Steps whose files are written on several nodes with nothing naming them all: DeepSpeed's
ZeRO and Megatron-LM's `torch` format save each rank's files into one step directory on its own
node's mount, and rank 0 writes the tracker (DeepSpeed's without waiting for the other ranks:
its barrier comes after). Whichever node commits the step
takes every node's files of it, or waits: never a step committed with one node's files alone
(each node committed its own part as a version of its own, and the store got a mix)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, MountFactory, free_port, wait_until
from tests.harness import Cluster, check_step_bytes, file_records
from tests.test_cluster_persist import flush_all
from tests.test_frameworks import JOBS
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster

MODEL = "mp_rank_00_model_states.pt"


def zero_files(rank: int) -> list[str]:
    """The files DeepSpeed's rank `rank` writes into a step (ZeRO, one model-parallel rank)."""
    return [MODEL] * (rank == 0) + [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]


def save_zero_step(ranks: list[Mount], step: str) -> dict[str, bytes]:
    """Each rank's files written on its node's mount, as DeepSpeed's ranks do before rank 0
    writes `latest`."""
    saved = {}
    for rank, node in enumerate(ranks):
        (node / step).mkdir(parents=True, exist_ok=True)
        for name in zero_files(rank):
            saved[name] = os.urandom(1 << 20)
            (node / step / name).write_bytes(saved[name])
    return saved


def committed_with(node: Mount, step: str, names: set[str]) -> bool:
    found = node.step(step) or {}
    return found.get("state") == "committed" and found.get("files") == len(names) \
        and set(os.listdir(node / step)) == names


def test_a_step_saved_on_every_node_commits_whole_everywhere_and_in_the_store(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """Three nodes, one rank each, two saves and their `latest`: every node lists each step
    committed once (version 1) with every rank's files, `tierfs flush` exits 0 with every file
    in the store, and a requeued job on new nodes finds `latest` and every byte."""
    store = tmp_path / "store"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    nodes = cluster.start_all("--persist", f"file://{store}")
    saved = {}
    for number in (2, 4):
        step = f"ds/global_step{number}"
        saved[step] = save_zero_step(nodes, step)
        (nodes[0] / "ds/latest").write_text(f"global_step{number}")
    for node in nodes:
        for step, files in saved.items():
            wait_until(lambda n=node, s=step, f=files: committed_with(n, s, set(f)), timeout=15)
            assert node.step(step)["version"] == 1
    assert {r.node for r in file_records(cluster, "ds/global_step4").values()} == \
        {"node0", "node1", "node2"}
    for status, out, err in flush_all(cluster):
        assert status == 0, (out, err)
    for step, files in saved.items():
        for name, data in files.items():
            assert (store / step / name).read_bytes() == data
    assert (store / "ds/latest").read_text() == "global_step4"

    requeued = Cluster(mounts, token_file, 1, etcd_server)
    requeued.url = requeued.url + "-requeued"
    fresh, = requeued.start_all("--persist", f"file://{store}")
    assert (fresh / "ds/latest").read_text() == "global_step4"
    check_step_bytes(fresh, "ds/global_step4",
                     {name: mf.hash_bytes(data) for name, data in saved["ds/global_step4"].items()})


def test_a_step_waits_for_a_file_another_node_still_writes_and_for_a_writer_that_cannot_say(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """Rank 1 still has its file open on node1 when rank 0's tracker closes on node0: the
    step commits nowhere (not by the tracker, not by the quiet rules on either node) until the
    file is closed, then with it. A writer that cannot say which files it wrote (stopped)
    holds the next save back the same way until it answers."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--commit-idle", "1")
    step = "ds/global_step2"
    for node in (node0, node1):  # each rank makes the directory, then writes its files
        (node / step).mkdir(parents=True)
    (node0 / step / MODEL).write_bytes(b"m" * 1000)
    names = {MODEL, "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    with open(node1 / step / "zero_pp_rank_1_mp_rank_00_optim_states.pt", "wb") as late:
        late.write(b"z" * 1000)
        (node0 / "ds/latest").write_text("global_step2")
        time.sleep(3)  # three times --commit-idle
        for node in (node0, node1):
            assert (node.step(step) or {}).get("state") != "committed", node.step(step)
        late.write(b"z" * 1000)
    for node in (node0, node1):
        wait_until(lambda n=node: committed_with(n, step, names), timeout=15)
    assert (node0 / step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").read_bytes() == \
        b"z" * 2000

    step = "ds/global_step4"
    (node1 / step).mkdir(parents=True)
    (node1 / step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"y" * 1000)
    wait_until(lambda: "node1" in file_records_writers(cluster, step), timeout=10)
    os.kill(node1.pid, signal.SIGSTOP)
    try:
        (node0 / step).mkdir(parents=True, exist_ok=True)
        (node0 / step / MODEL).write_bytes(b"n" * 1000)
        time.sleep(8)  # the quiet rule's tries, each asking node1 for up to 5 s
        assert (node0.step(step) or {}).get("state") != "committed", node0.step(step)
        assert "did not say which" in node0.log()
    finally:
        os.kill(node1.pid, signal.SIGCONT)
    for node in (node0, node1):
        wait_until(lambda n=node: committed_with(
            n, step, {MODEL, "zero_pp_rank_1_mp_rank_00_optim_states.pt"}), timeout=20)


def test_each_ranks_own_directory_keeps_its_owner_and_mode_on_every_node_and_in_the_store(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """Megatron-LM's `torch` format as a job's user (uid 1000) writes it on two nodes: each
    rank makes `iter_N/mp_rank_0R/` on its own node (here mode 0750) and writes its file
    there, whose mode the job then changes (0640). The rank-1 directory and file read the
    same on node0 (which commits the step at rank 0's tracker), on node1 and on a node of a
    requeued job that reads the store: they were root's, 0755 and 0644 on the committer
    and in the store (the directory this daemon made for node1's file, and the file's record
    taken at its close), so the user could not delete files in the directory."""
    store = tmp_path / "store"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    nodes = cluster.start_all("--persist", f"file://{store}")
    step = "run/iter_0000010"
    for rank, node in enumerate(nodes):
        rank_dir = node / step / f"mp_rank_{rank:02d}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        for made in (node / "run", node / step, rank_dir):
            os.chown(made, 1000, 1000)
        rank_dir.chmod(0o750)
        (rank_dir / "model_optim_rng.pt").write_bytes(os.urandom(1 << 16))
        os.chown(rank_dir / "model_optim_rng.pt", 1000, 1000)
        (rank_dir / "model_optim_rng.pt").chmod(0o640)
    (nodes[0] / "run/latest_checkpointed_iteration.txt").write_text("10")
    expected = {f"mp_rank_{rank:02d}": (1000, 1000, 0o750) for rank in (0, 1)} | {
        f"mp_rank_{rank:02d}/model_optim_rng.pt": (1000, 1000, 0o640) for rank in (0, 1)}

    def attributes(node: Mount) -> dict[str, tuple[int, int, int]]:
        return {str(path.relative_to(node / step)): (st.st_uid, st.st_gid,
                                                      stat.S_IMODE(st.st_mode))
                for path in (node / step).rglob("*") if (st := path.stat())}

    for node in nodes:
        wait_until(lambda n=node: committed_with(n, step, {"mp_rank_00", "mp_rank_01"})
                   and n.step(step)["files"] == 2, timeout=15)
        assert attributes(node) == expected, node
    for status, out, err in flush_all(cluster):
        assert status == 0, (out, err)
    requeued = Cluster(mounts, token_file, 1, etcd_server)
    requeued.url = requeued.url + "-requeued"
    fresh, = requeued.start_all("--persist", f"file://{store}")
    assert attributes(fresh) == expected


def test_a_step_waits_for_a_writer_whose_daemon_restarts_and_commits_whole_on_both_nodes(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """Rank 1 wrote its file on node1, whose daemon then died (its RAM dir kept); rank 0's
    files and `latest` on node0 do not commit the step without it: status says it waits
    for the nodes that write it. Once node1's daemon is back, the step commits with both
    files on both nodes (node1 stayed `writing` for good, its file unsealed after the
    restart, and refused node0's copies as "not held here")."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--commit-idle", "1")
    step, zero = "ds/global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (node1 / step).mkdir(parents=True)
    data = os.urandom(1 << 20)
    (node1 / step / zero).write_bytes(data)
    wait_until(lambda: "node1" in file_records_writers(cluster, step), timeout=10)
    node1.kill9()
    (node0 / step).mkdir(parents=True, exist_ok=True)
    (node0 / step / MODEL).write_bytes(b"m" * 1000)
    (node0 / "ds/latest").write_text("global_step2")
    wait_until(lambda: (node0.step(step)["waiting_for"] or "").startswith(
        "the nodes that write it: node1 writes files of ds/global_step2"), timeout=10)
    time.sleep(2)  # --commit-idle twice over
    assert node0.step(step)["state"] == "writing"
    node1 = cluster.start("node1")
    for node in (node0, node1):
        wait_until(lambda n=node: committed_with(n, step, {MODEL, zero}), timeout=20)
    assert (node0 / step / zero).read_bytes() == data


def file_records_writers(cluster: Cluster, step: str) -> set[str]:
    return {r.node for r in file_records(cluster, step).values()}


def test_a_rank_that_begins_after_the_commit_has_its_files_in_the_next_version(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """A run's first save: rank 0 writes its files and `latest` before rank 1 even made the
    directory on node1 (DeepSpeed's rank 0 does not wait for the others before its tracker),
    so version 1 has rank 0's files alone; rank 1's file, written after, is in version 2 on
    both nodes (also when node1 wrote it before it learned of version 1:
    test_cluster_service)."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--commit-idle", "1")
    step = "ds/global_step2"
    (node0 / step).mkdir(parents=True)
    (node0 / step / MODEL).write_bytes(b"m" * 1000)
    (node0 / "ds/latest").write_text("global_step2")
    wait_until(lambda: committed_with(node0, step, {MODEL}), timeout=10)
    (node1 / step).mkdir(parents=True, exist_ok=True)
    late = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (node1 / step / late).write_bytes(b"z" * 1000)
    for node in (node0, node1):
        wait_until(lambda n=node: committed_with(n, step, {MODEL, late})
                   and n.step(step)["version"] == 2, timeout=20)
    assert (node0 / step / late).read_bytes() == b"z" * 1000
    assert (node1 / step / MODEL).read_bytes() == b"m" * 1000


def run_ranks(tmp_path: Path, save_dirs: list[Path],
              job_args: Callable[[Path, str], list[str]]) -> list[dict[str, Any]]:
    """A job of tests/framework_jobs.py (`job_args(save_dir, rendezvous port)`: its
    arguments), rank i saving to `save_dirs[i]` (its own node's mount), all ranks at once;
    each must succeed. Their JSON results."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(JOBS), *job_args(save_dir, port),
                               f"rank={rank}/{len(save_dirs)}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank, save_dir in enumerate(save_dirs)]
    results = []
    try:
        for rank in ranks:
            out, err = rank.communicate(timeout=240)
            assert rank.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for rank in ranks:
            rank.kill()
    return results


def test_hugging_face_trainer_saving_on_each_node_commits_one_checkpoint_on_both(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """transformers' Trainer with `save_on_each_node` on two nodes: each node's rank writes
    the whole checkpoint-N into its node's mount (the same step in the cluster; some files,
    trainer_state.json among them, with other bytes on each node) and rotates the old ones.
    Each checkpoint commits on both nodes as one version with the same bytes on both, the
    rotated ones are gone from both, and a fresh node that replaced node0 resumes from
    checkpoint-6 with node1. Before, the node that did not commit the checkpoint kept it
    `writing` (its files "have other content"), for good."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all()
    first = run_ranks(tmp_path, [node0 / "hf", node1 / "hf"],
                      lambda hf, port: ["hf", str(hf), "6", f"port={port}", "each-node"])
    assert [r["global_step"] for r in first] == [6, 6]
    for number in (4, 6):
        step = f"hf/checkpoint-{number}"
        wait_until(lambda s=step: all((n.step(s) or {}).get("state") == "committed"
                                      for n in (node0, node1)), timeout=30)
        wait_until(lambda s=step: node0.step(s)["version"] == node1.step(s)["version"]
                   and all(n.step(s)["state"] == "committed" for n in (node0, node1)),
                   timeout=30)
        for name in os.listdir(node0 / step):
            assert (node0 / step / name).read_bytes() == (node1 / step / name).read_bytes()
    for node in (node0, node1):
        wait_until(lambda n=node: sorted(os.listdir(n / "hf")) == [
            "checkpoint-4", "checkpoint-6", "latest"], timeout=10)
    wait_until(lambda: node0.step("hf/checkpoint-6")["copies"] == 2, timeout=30)

    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = cluster.start("node0")
    resumed = run_ranks(tmp_path, [fresh / "hf", node1 / "hf"],
                        lambda hf, port: ["hf", str(hf), "8", "resume", f"port={port}",
                                          "each-node"])
    for rank in resumed:
        assert (rank["global_step"], rank["steps_run"]) == (8, 2), resumed


def test_deepspeed_on_two_nodes_resumes_on_the_node_that_replaced_rank_0s(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """DeepSpeed's own engine, two gloo ranks (ZeRO stage 1: each rank saves its optimizer
    partition), each saving to its own node's mount, no store: steps 4 and 6 commit on both
    nodes with both ranks' files, rank 0's `latest` reaches node1, and once node0 is replaced
    by a fresh node both ranks resume at step 6 with the weights they saved."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all()
    first = run_ranks(tmp_path, [node0 / "ds", node1 / "ds"],
                      lambda ds, port: ["deepspeed", str(ds), "6", port, "nowait"])
    names = {MODEL, *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))}
    # (a run's first save may commit rank 0's files alone, rank 1's in its next version:
    # the bound in doc/CLUSTER.md; the later saves wait for the writers of the one before)
    for node in (node0, node1):
        for number in (4, 6):
            wait_until(lambda n=node, s=f"ds/global_step{number}": committed_with(n, s, names),
                       timeout=15)
    wait_until(lambda: (node0.step("ds/latest") or {}).get("replicas") == ["node1"]
               and node0.step("ds/global_step6")["copies"] == 2, timeout=30)

    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = cluster.start("node0")
    resumed = run_ranks(tmp_path, [fresh / "ds", node1 / "ds"],
                        lambda ds, port: ["deepspeed", str(ds), "8", port, "resume", "nowait"])
    for rank in (0, 1):
        assert resumed[rank]["loaded_step"] == 6
        assert resumed[rank]["weights_at_load"] == first[rank]["saved"]["6"]


def test_hugging_face_trainer_on_two_nodes_resumes_on_the_node_that_replaced_rank_0s(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """transformers' Trainer, DDP over gloo, one rank per node, each with its output_dir on its
    own node's mount: rank 0 writes each checkpoint-N (model, optimizer, scheduler, its RNG
    state, trainer_state.json) and rotates the old ones (save_total_limit=2), rank 1 writes
    its `rng_state_1.pth` into the same checkpoint on node1. Every kept checkpoint commits on
    both nodes with both ranks' files, the rotated ones are gone from both (also when both
    nodes committed a checkpoint at the same moment), and once node0 is replaced by a fresh
    node both ranks resume from checkpoint-6 (Trainer's own choice, each listing its own
    node's mount)."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all()
    first = run_ranks(tmp_path, [node0 / "hf", node1 / "hf"],
                      lambda hf, port: ["hf", str(hf), "6", f"port={port}"])
    assert [r["global_step"] for r in first] == [6, 6]
    rng_states = {"rng_state_0.pth", "rng_state_1.pth"}
    for node in (node0, node1):
        for number in (4, 6):
            step = f"hf/checkpoint-{number}"
            wait_until(lambda n=node, s=step: (n.step(s) or {}).get("state") == "committed"
                       and rng_states <= set(os.listdir(n / s)), timeout=20)
        wait_until(lambda n=node: sorted(os.listdir(n / "hf")) == [
            "checkpoint-4", "checkpoint-6", "latest"], timeout=10)
    names = set(os.listdir(node0 / "hf/checkpoint-6"))
    assert set(os.listdir(node1 / "hf/checkpoint-6")) == names
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= names
    wait_until(lambda: node0.step("hf/checkpoint-6")["copies"] == 2, timeout=30)

    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = cluster.start("node0")
    resumed = run_ranks(tmp_path, [fresh / "hf", node1 / "hf"],
                        lambda hf, port: ["hf", str(hf), "8", "resume", f"port={port}"])
    for rank in resumed:
        assert (rank["global_step"], rank["steps_run"]) == (8, 2), resumed


def test_a_ranks_files_deleted_before_rank_0s_tracker_are_not_in_the_commit(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """Rank 1 wrote its file on node1, then the step was removed there (`rm -r`) before
    rank 0's files and `latest` on node0: the step commits on both nodes with rank 0's files
    alone, every one of which reads back (not with node1's file, which is nowhere any
    more: EIO on read, copies short for good)."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--commit-idle", "1")
    step, zero = "ds/global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (node1 / step).mkdir(parents=True)
    (node1 / step / zero).write_bytes(os.urandom(1 << 20))
    wait_until(lambda: "node1" in file_records_writers(cluster, step), timeout=10)
    shutil.rmtree(node1 / step)
    (node0 / step).mkdir(parents=True, exist_ok=True)
    (node0 / step / MODEL).write_bytes(b"m" * 1000)
    (node0 / "ds/latest").write_text("global_step2")
    for node in (node0, node1):
        wait_until(lambda n=node: committed_with(n, step, {MODEL}), timeout=15)
        assert (node / step / MODEL).read_bytes() == b"m" * 1000
    assert file_records_writers(cluster, step) == {"node0"}
