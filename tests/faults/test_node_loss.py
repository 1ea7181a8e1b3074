"""Node loss in a cluster of daemons on 127.0.0.1: a node killed while a step is streamed to
it, two nodes lost at once with --replicas 2, nodes that come back with stale data (an older
version of a step that was re-committed while they were away) which must never shadow the newer
commit, and a job that resumes from `latest` after any one node is lost at random moments
(right after a save, while its copy streams, after retention). Every loss is `kill -9` of a
daemon plus a lazy unmount. Counts go to tests/faults/results/node_loss.json."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, MountFactory, wait_until
from tests.faults.conftest import FULL, Trainer, report, scale, step_problems
from tests.test_cluster import Cluster
from tests.test_crash import save
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.faults

COUNTS: dict[str, Any] = {"node_losses": 0, "simultaneous_losses": 0, "stale_returns": 0,
                          "steps_checked_on_survivors": 0, "losses": 0}


@pytest.fixture(scope="module", autouse=True)
def counts() -> Any:
    yield COUNTS
    report("node_loss", COUNTS)


def hashes(files: dict[str, bytes]) -> dict[str, str]:
    import xxhash

    return {name: xxhash.xxh3_128_hexdigest(data) for name, data in files.items()}


def step_files(seed: int, mib: int) -> dict[str, bytes]:
    return {"__0_0.distcp": os.urandom(mib << 20), "__1_0.distcp": os.urandom(mib << 19),
            ".metadata": b"metadata %d" % seed}


def start_cluster(mounts: MountFactory, token_file: Path, etcd_server: Etcd, size: int,
                  *extra: str) -> Cluster:
    cluster = Cluster(mounts, token_file, size, etcd_server)
    for node_id in cluster.ports:
        cluster.nodes[node_id] = mounts.mount(*cluster.args(node_id), *extra)
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=20)
    return cluster


def check(cluster: Cluster, node_ids: list[str], expected: dict[str, dict[str, str]]) -> None:
    """Every expected step, on every listed node, is committed with exactly these bytes."""
    problems = []
    for node_id in node_ids:
        for relpath, files in expected.items():
            problems += [f"{node_id}: {p}"
                         for p in step_problems(cluster.nodes[node_id], relpath, files)]
            COUNTS["steps_checked_on_survivors"] += 1
    COUNTS["losses"] += len(problems)
    assert not problems, problems


def replicas(cluster: Cluster, node_id: str, relpath: str) -> list[str]:
    step = cluster.nodes[node_id].step(relpath)
    return step["replicas"] if step else []


def test_node_killed_while_a_step_streams_to_it(mounts: MountFactory, token_file: Path,
                                                 etcd_server: Etcd) -> None:
    cluster = start_cluster(mounts, token_file, etcd_server, 3)
    node0, node1 = cluster.nodes["node0"], cluster.nodes["node1"]
    files = step_files(1, scale(24, 64))
    incoming = node1.ram_dir / "objects"
    save(node0 / "run/step_1", files)
    # the first chunks have reached node1: kill it mid-stream
    wait_until(lambda: any(n.startswith(".tierfs-incoming-") or len(n) == 32
                           for n in os.listdir(incoming)), timeout=30, interval=0.002)
    node1.kill9()
    COUNTS["node_losses"] += 1
    # the writer restores a copy on the next live node, and every survivor serves the step
    wait_until(lambda: "node2" in replicas(cluster, "node0", "run/step_1"), timeout=60,
               interval=0.2)
    check(cluster, ["node0", "node2"], {"run/step_1": hashes(files)})
    # node1 comes back with its half-received objects: they are never served as a step
    cluster.start("node1")
    wait_until(lambda: cluster.nodes["node1"].step("run/step_1") is not None, timeout=30)
    check(cluster, ["node0", "node1", "node2"], {"run/step_1": hashes(files)})
    leftovers = [n for n in os.listdir(incoming) if n.startswith(".tierfs-incoming-")]
    assert not leftovers, f"half-received replicas left in node1's RAM dir: {leftovers}"


@pytest.mark.skipif(not FULL, reason="four nodes: in the full run (TIERFS_FAULTS=full)")
def test_two_simultaneous_losses_with_two_replicas(mounts: MountFactory,
                                                   token_file: Path, etcd_server: Etcd) -> None:
    cluster = start_cluster(mounts, token_file, etcd_server, 4, "--replicas", "2")
    node0 = cluster.nodes["node0"]
    expected = {}
    for number in (1, 2, 3):
        files = step_files(number, 4)
        save(node0 / f"run/step_{number}", files)
        expected[f"run/step_{number}"] = hashes(files)
    for relpath in expected:
        wait_until(lambda r=relpath: replicas(cluster, "node0", r) == ["node1", "node2"],
                   timeout=60, interval=0.2)
    # the writer and its first replica die at the same moment
    for node_id in ("node0", "node1"):
        os.kill(cluster.nodes[node_id].pid, 9)
    for node_id in ("node0", "node1"):
        cluster.nodes[node_id].kill9()  # waits for the death, then the lazy unmount
    COUNTS["node_losses"] += 2
    COUNTS["simultaneous_losses"] += 1
    check(cluster, ["node2", "node3"], expected)  # node3 holds nothing: it reads from node2
    assert os.readlink(cluster.nodes["node3"] / "run/latest") == "step_3"
    # the survivors restore copies among themselves: node3 comes to hold every step...
    wait_until(lambda: all((cluster.nodes["node3"].step(r) or {}).get("ram")
                           for r in expected), timeout=90, interval=0.3)
    # ...so even the loss of node2 too loses nothing
    cluster.nodes["node2"].kill9()
    COUNTS["node_losses"] += 1
    check(cluster, ["node3"], expected)


def wait_version(cluster: Cluster, node_id: str, relpath: str, version: int,
                 timeout: float = 30) -> None:
    def at_version() -> bool:
        step = cluster.nodes[node_id].step(relpath)
        return step is not None and step["version"] == version and step["state"] == "committed"
    try:
        wait_until(at_version, timeout=timeout, interval=0.3)
    except AssertionError:
        raise AssertionError(f"{node_id} shows {relpath} as "
                             f"{cluster.nodes[node_id].step(relpath)}, not v{version}") from None


def test_node_back_with_stale_replica_does_not_shadow_newer_commit(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    """node1 holds v1 of step_2 as node0's replica, is lost, and comes back after node0
    re-committed step_2 as v2: node1 must serve v2, and so must everyone else."""
    cluster = start_cluster(mounts, token_file, etcd_server, 3)
    node0 = cluster.nodes["node0"]
    first = {n: step_files(n, 2) for n in (1, 2)}
    for number, files in first.items():
        save(node0 / f"run/step_{number}", files)
        wait_until(lambda n=number: replicas(cluster, "node0", f"run/step_{n}") == ["node1"],
                   timeout=60, interval=0.2)
    cluster.nodes["node1"].kill9()
    COUNTS["node_losses"] += 1
    newer = step_files(20, 2)
    save(node0 / "run/step_2", newer)  # v2, while node1 is away
    third = step_files(3, 2)
    save(node0 / "run/step_3", third)
    wait_until(lambda: "node2" in replicas(cluster, "node0", "run/step_2"), timeout=60,
               interval=0.2)
    cluster.start("node1")  # with its old RAM dir: step_2 v1 in it
    COUNTS["stale_returns"] += 1
    expected = {"run/step_1": hashes(first[1]), "run/step_2": hashes(newer),
                "run/step_3": hashes(third)}
    for node_id in ("node0", "node1", "node2"):
        wait_version(cluster, node_id, "run/step_2", 2)
        wait_until(lambda n=node_id: cluster.nodes[n].step("run/step_3") is not None,
                   timeout=30)
    check(cluster, ["node0", "node1", "node2"], expected)
    assert os.readlink(cluster.nodes["node1"] / "run/latest") == "step_3"
    # with the writer gone, the others still serve v2, never node1's old bytes
    cluster.nodes["node0"].kill9()
    COUNTS["node_losses"] += 1
    check(cluster, ["node1", "node2"], expected)


def test_writer_back_with_stale_version_after_the_job_moved(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    """node0 wrote step_5 v1 and is lost; the job moves to node1 (which holds the replica) and
    re-saves step_5 as v2 there. node0 comes back owning v1: it must adopt v2, not push or
    serve v1."""
    cluster = start_cluster(mounts, token_file, etcd_server, 3)
    node0 = cluster.nodes["node0"]
    older = step_files(5, 2)
    save(node0 / "run/step_5", older)
    wait_until(lambda: replicas(cluster, "node0", "run/step_5") == ["node1"], timeout=60,
               interval=0.2)
    node0.kill9()
    COUNTS["node_losses"] += 1
    node1 = cluster.nodes["node1"]
    newer = step_files(50, 2)
    save(node1 / "run/step_5", newer)
    wait_version(cluster, "node1", "run/step_5", 2)
    wait_until(lambda: "node2" in replicas(cluster, "node1", "run/step_5"), timeout=60,
               interval=0.2)
    cluster.start("node0")
    COUNTS["stale_returns"] += 1
    for node_id in ("node0", "node1", "node2"):
        wait_version(cluster, node_id, "run/step_5", 2)
    time.sleep(3)  # commit events and a replication pass: v1 must not come back anywhere
    for node_id in ("node0", "node1", "node2"):
        wait_version(cluster, node_id, "run/step_5", 2, timeout=1)
    check(cluster, ["node0", "node1", "node2"], {"run/step_5": hashes(newer)})
    cluster.nodes["node1"].kill9()
    COUNTS["node_losses"] += 1
    check(cluster, ["node0", "node2"], {"run/step_5": hashes(newer)})


def test_node_back_with_stale_replica_when_only_the_store_has_the_newer_version(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd, tmp_path: Path) -> None:
    """node1 holds v1 of step_1 and is lost; node0 re-saves step_1 as v2, persists it, and is
    lost too. node1 comes back alone: its peers are down, only the persistent tier knows v2,
    and node1 must serve v2."""
    store = tmp_path / "store"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    for node_id in cluster.ports:
        cluster.nodes[node_id] = mounts.mount(*cluster.args(node_id), "--persist",
                                              f"file://{store}")
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=20)
    node0 = cluster.nodes["node0"]
    older = step_files(1, 2)
    save(node0 / "run/step_1", older)
    wait_until(lambda: replicas(cluster, "node0", "run/step_1") == ["node1"], timeout=60,
               interval=0.2)
    cluster.nodes["node1"].kill9()
    newer = step_files(10, 2)
    save(node0 / "run/step_1", newer)
    from tests.conftest import tierfs

    tierfs("flush", str(node0.mountpoint), "--timeout", "60")
    node0.kill9()
    COUNTS["node_losses"] += 2
    cluster.start("node1")
    COUNTS["stale_returns"] += 1
    wait_version(cluster, "node1", "run/step_1", 2, timeout=10)
    check(cluster, ["node1"], {"run/step_1": hashes(newer)})
    assert cluster.nodes["node1"].step("run/step_1")["persisted"] is True


def newest_readable(node: Mount, run: str) -> bool:
    """The node has judged its newest step of `run`: committed with a live copy of every
    file (the records' `copies`), or `incomplete` (then `latest` names an older one)."""
    steps = [s for s in node.status()["steps"] if s["path"].startswith(run + "/")]
    newest = max(steps, key=lambda s: s["step"] or -1, default=None)
    return newest is not None and (newest["state"] == "incomplete" or (
        newest["state"] == "committed" and newest["copies"] >= 1))


@pytest.mark.timeout(scale(240, 1200))
def test_a_job_resumes_from_latest_after_any_one_node_loss_in_every_timing(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd, trainer: Trainer) -> None:
    """K = 1 on three nodes, no store, --keep-ram 1: the trainer saves steps on node0; one
    node, chosen at random, is killed right after a save returned, while its copy streams
    (a random moment within the calibrated copy time), or after retention ran on the step
    (two newer steps saved and copied). A job restarting on a survivor loads `latest`: it
    must load whole, the newest step if a live node still holds every file of it, else the
    step before (`incomplete`). The victim comes back with its RAM dir before the next."""
    rng = random.Random(23)
    cluster = start_cluster(mounts, token_file, etcd_server, 3, "--keep-ram", "1")
    every = sorted(cluster.ports)
    mib = scale(8, 32)
    number = 0

    def save_step() -> int:
        nonlocal number
        number += 1
        trainer.save(cluster.nodes["node0"] / f"run/step_{number}", number, mib)
        return number

    def copied(n: int) -> bool:
        return replicas(cluster, "node0", f"run/step_{n}") != []

    first = save_step()
    began = time.monotonic()
    wait_until(lambda: copied(first), timeout=60, interval=0.002)
    copy_seconds = time.monotonic() - began
    timings = ["after the save", "during the copy", "after retention"] * scale(1, 5)
    resumed: dict[str, int] = {}
    for timing in timings:
        victim = rng.choice(every)
        saved = save_step()
        if timing == "during the copy":
            time.sleep(rng.uniform(0, copy_seconds))
        elif timing == "after retention":
            wait_until(lambda n=saved: copied(n), timeout=60)
            for _ in range(2):
                newer = save_step()
                wait_until(lambda n=newer: copied(n), timeout=60)
        cluster.nodes[victim].kill9()
        COUNTS["node_losses"] += 1
        survivor = cluster.nodes[rng.choice([n for n in every if n != victim])]
        wait_until(lambda s=survivor, v=victim: {p["node_id"]: p["up"] for p in
                                                 s.status()["peers"]}[v] is False, timeout=15)
        wait_until(lambda s=survivor: newest_readable(s, "run"), timeout=30, interval=0.2)
        latest = os.readlink(survivor / "run/latest")
        step = int(latest.rsplit("_", 1)[1])
        ok, error = trainer.load_matches(survivor / "run/latest", step, mib)
        COUNTS["steps_checked_on_survivors"] += 1
        if not ok:
            COUNTS["losses"] += 1
        assert ok, f"{timing}, {victim} killed: latest {latest} did not load: {error}"
        assert step >= saved - 1, (timing, victim, latest, saved)
        resumed[f"{timing}: {victim}"] = number - step  # 0: the newest step
        cluster.start(victim)
        for node_id in every:
            wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=20)
    COUNTS["latest_resumes"] = resumed
