"""A cluster's steps in the persistent tier: what a requeued job on new nodes finds there.

A multi-node DCP step's shards stay on the nodes that wrote them (and their copies); the store
must get every one of them, whoever holds it, and its manifest last. `tierfs flush` on a node
exits 0 only once the store holds every committed step whole (a copy on a peer is not the
store), and every node shows a step the store holds as persisted."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.conftest import (
    MountFactory,
    finish_dcp_ranks,
    run_dcp_ranks,
    start_dcp_ranks,
    tierfs,
    wait_until,
)
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster

STEPS = (10, 20, 30)


def flush_all(cluster: Cluster) -> list[tuple[int, str, str]]:
    """`tierfs flush` on every node at once (each node's epilog), as (status, out, err)."""
    done: dict[str, tuple[int, str, str]] = {}

    def flush(node_id: str) -> None:
        run = tierfs("flush", str(cluster.nodes[node_id].mountpoint), "--timeout", "120",
                     check=False, timeout=180)
        done[node_id] = (run.returncode, run.stdout, run.stderr)

    threads = [threading.Thread(target=flush, args=(n,)) for n in cluster.nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [done[n] for n in sorted(done)]


def test_a_requeued_job_on_new_nodes_finds_every_step_in_the_store(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """4 nodes, a 4-rank job saving and loading steps 10, 20, 30 with a file:// store, then
    `tierfs flush` on each node right away and `tierfs umount`; a new cluster of 4 nodes with
    empty RAM dirs on the same store lists every step, `latest` names step_30, and the job
    loads it."""
    store = tmp_path / "store"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 4, etcd_server)
    nodes = cluster.start_all("--persist", f"file://{store}")
    for number in STEPS:
        run_dcp_ranks([node / f"run/step_{number}" for node in nodes], timeout=180)
    for status, out, err in flush_all(cluster):
        assert status == 0, (out, err)
    for node_id in cluster.ports:  # every node shows every step persisted
        for number in STEPS:
            step = cluster.nodes[node_id].step(f"run/step_{number}")
            assert step["persisted"] and "persist" in step["tiers"], (node_id, step)
    for node in nodes:
        tierfs("umount", str(node.mountpoint))
    for number in STEPS:  # the store holds each step whole: its manifest, every shard
        assert (store / f"run/step_{number}/.tierfs-manifest").exists()
        assert {p.name for p in (store / f"run/step_{number}").glob("__*.distcp")} == \
            {f"__{rank}_{n}.distcp" for rank in range(4) for n in range(2)}  # 2 threads

    fresh = Cluster(mounts, token_file, 4, etcd_server)
    fresh.url = fresh.url + "-requeued"  # the requeued job's prefix
    fresh_nodes = fresh.start_all("--persist", f"file://{store}")
    for node in fresh_nodes:
        for number in STEPS:
            step = node.step(f"run/step_{number}")
            assert step is not None and step["state"] == "committed", (number, step)
        assert (node / "run/latest").readlink() == Path("step_30")
    finish_dcp_ranks(start_dcp_ranks([node / "run/latest" for node in fresh_nodes],
                                     "--load-only", "--seed", "0"), timeout=180)



def test_every_node_shows_a_stored_step_persisted_whoever_uploaded_it(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """3 nodes, K = 1: node0 writes step_10, node1 holds its copy, node2 nothing of it. Once
    `tierfs flush` on node0 exits 0, every node's status says the step is persisted, with
    `persist` among its tiers (the nodes that did not upload it said `persisted: false`)."""
    from tests.test_crash import save

    store = tmp_path / "store"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    node0, _node1, _node2 = cluster.start_all("--persist", f"file://{store}")
    save(node0 / "run/step_10", {"__0_0.distcp": b"shard" * 1000, ".metadata": b"m"})
    tierfs("flush", str(node0.mountpoint), "--timeout", "60")
    assert (store / "run/step_10/.tierfs-manifest").exists()
    for node_id, node in cluster.nodes.items():
        wait_until(lambda n=node: n.step("run/step_10")["persisted"], timeout=5)
        step = node.step("run/step_10")
        assert "persist" in step["tiers"] and step["state"] == "committed", (node_id, step)


def test_the_files_of_a_lost_writer_reach_the_store_from_their_copies(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """The store is away while a 3-rank job saves; the node that wrote rank 1's shards is
    then lost. Once the store is back, the node holding their copies sends them (the writer
    cannot), the committer writes the manifest, `tierfs flush` exits 0 on the survivors, and
    a fresh node loads the step from the store alone."""
    store, away = tmp_path / "store", tmp_path / "store.away"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    nodes = cluster.start_all("--persist", f"file://{store}")
    store.rename(away)
    run_dcp_ranks([node / "run/step_10" for node in nodes], timeout=180)
    for node in nodes:  # every file has its copy on the next node
        wait_until(lambda n=node: (n.step("run/step_10") or {}).get("copies") == 2,
                   timeout=60)
    nodes[1].kill9()
    wait_until(lambda: not cluster.peers_up("node0")["node1"], timeout=20)
    assert not nodes[0].step("run/step_10")["persisted"]
    away.rename(store)
    for node in (nodes[0], nodes[2]):
        done = tierfs("flush", str(node.mountpoint), "--timeout", "120", check=False)
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert node.step("run/step_10")["persisted"]
    assert {p.name for p in (store / "run/step_10").glob("__1_*.distcp")} == \
        {"__1_0.distcp", "__1_1.distcp"}
    assert "for another node to write its manifest" in nodes[2].log()
    for node in (nodes[0], nodes[2]):
        tierfs("umount", str(node.mountpoint))
    fresh = mounts.mount("--persist", f"file://{store}")
    assert fresh.step("run/step_10")["state"] == "committed"
    finish_dcp_ranks(start_dcp_ranks([fresh / "run/step_10"] * 3, "--load-only"),
                     timeout=180)


def test_flush_says_at_once_when_a_step_can_never_be_whole_in_the_store(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """No copies (--replicas 0) and the store away while a two-node step commits; the node
    that wrote one of its shards is then lost. No wait can bring that shard to the store:
    `tierfs flush` exits 1 at once naming the step and the lost file, not after its timeout,
    and never 0."""
    from tests.test_cluster_scale import dcp_metadata

    store, away = tmp_path / "store", tmp_path / "store.away"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--replicas", "0", "--persist", f"file://{store}")
    store.rename(away)
    for node in (node0, node1):
        (node / "run/step_1").mkdir(parents=True)
    (node1 / "run/step_1/__1_0.distcp").write_bytes(b"rank 1")
    (node0 / "run/step_1/__0_0.distcp").write_bytes(b"rank 0")
    (node0 / "run/step_1/.metadata").write_bytes(
        dcp_metadata(["__0_0.distcp", "__1_0.distcp"]))
    assert node0.step("run/step_1")["state"] == "committed"
    node1.kill9()
    away.rename(store)
    wait_until(lambda: node0.step("run/step_1")["lost"] is not None, timeout=30)
    done = tierfs("flush", str(node0.mountpoint), "--timeout", "600", check=False,
                  timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "can never be whole" in done.stderr and "run/step_1" in done.stderr, done.stderr
    assert "__1_0.distcp" in done.stderr, done.stderr
    assert not (store / "run/step_1/.tierfs-manifest").exists()
