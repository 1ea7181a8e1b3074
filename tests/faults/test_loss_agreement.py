"""After a node loss every node tells the same story, within a stated bound: `latest`, the
step's state, `copies` and `replicas` come from the cluster's records and its live members (a
node learns a loss from etcd once the lost node's lease is gone: doc/CLUSTER.md states the
bound), also on nodes that come back empty under the lost ids; a read that finds no live
holder while the holder's lease still lives waits for it (or for its loss) instead of failing
at once; and a holder cut off while its lease lives is waited for once, not by every read."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MountFactory, wait_until
from tests.faults.tcp_proxy import TcpProxy
from tests.harness import Cluster
from tests.test_crash import save
from tierfs.devtools.etcd import Etcd
from tierfs.replication.coordination.membership import DEFAULT_TTL, REJOIN_MARGIN

pytestmark = pytest.mark.faults

# Seconds until every node agrees after a node's loss is known (doc/CLUSTER.md): its lease
# ends within the ttl (3 s) after its last keepalive, the watch event reaches every node,
# and each reads the records of the steps that loss may touch.
AGREE = 5.0
HOLDER_WAIT = DEFAULT_TTL + REJOIN_MARGIN  # PeerReader.holder_wait at the default --lease-ttl
# The --lease-ttl of a test whose killed daemon must be back within its lease: a daemon's
# start took 3.3 s once on a loaded machine, past the default's 3.
RESTART_TTL = 8


def story(cluster: Cluster, node_id: str, step: str) -> dict[str, Any]:
    """What a node says of a step: its state, copies and replicas, and its run's `latest`."""
    node = cluster.nodes[node_id]
    found = node.step(step) or {}
    try:  # (no islink first: `latest` may go between the two, as a step turns incomplete)
        latest: str | None = os.readlink(node / os.path.dirname(step) / "latest")
    except OSError:  # none, or not a link
        latest = None
    return {"state": found.get("state"), "copies": found.get("copies"),
            "replicas": found.get("replicas"), "latest": latest}


def agreed(cluster: Cluster, step: str, expected: dict[str, Any]) -> bool:
    return all(story(cluster, node_id, step) == expected for node_id in cluster.nodes)


def save_across(cluster: Cluster, step: str) -> None:
    """A multi-node DCP step: node i writes rank i's shard, node0 the `.metadata` naming
    them all, which commits it across the cluster."""
    from tests.test_cluster_scale import dcp_metadata

    names = []
    for rank, node_id in enumerate(sorted(cluster.nodes)):
        node = cluster.nodes[node_id]
        (node / step).mkdir(parents=True, exist_ok=True)
        (node / step / f"__{rank}_0.distcp").write_bytes(os.urandom(256 << 10))
        names.append(f"__{rank}_0.distcp")
    (cluster.nodes["node0"] / step / ".metadata").write_bytes(dcp_metadata(names))


@pytest.mark.parametrize("later", [False, True], ids=["back_at_once", "back_later"])
@pytest.mark.parametrize("lost_ids", [("node2", "node3"), ("node0", "node1")],
                         ids=["rank2", "committer"])
def test_nodes_back_empty_under_lost_ids_agree_with_the_survivors(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        lost_ids: tuple[str, str], later: bool) -> None:
    """K = 1 on four nodes (each file's copy on the next node): step_5 written on node0,
    step_10 across all four. Two neighbours are lost at once (a shard and its copy: rank 2's,
    or rank 0's with the `.metadata`, the committer's, and step_5 whole) and come back with
    empty RAM dirs under the same ids. Every node, the two that came back too, says within
    AGREE that step_10 is incomplete (no copy of that shard, no node holding every file) and
    that `latest` is step_5 (none when step_5 went too): whether they come back at once or
    once the survivors know the loss."""
    cluster = Cluster(mounts, token_file, 4, etcd_server)
    cluster.start_all()
    save(cluster.nodes["node0"] / "run/step_5", {"__0_0.distcp": b"five", ".metadata": b"m"})
    save_across(cluster, "run/step_10")
    wait_until(lambda: all(story(cluster, n, "run/step_10")["copies"] == 2
                           and story(cluster, n, "run/step_5")["copies"] == 2
                           for n in cluster.nodes), timeout=30)
    assert agreed(cluster, "run/step_10", {"state": "committed", "copies": 2, "replicas": [],
                                           "latest": "step_10"})
    for node_id in lost_ids:
        cluster.nodes[node_id].kill9()
        shutil.rmtree(cluster.nodes[node_id].ram_dir)
    if later:  # the survivors know the loss first
        survivor = next(n for n in cluster.nodes if n not in lost_ids)
        wait_until(lambda: story(cluster, survivor, "run/step_10")["state"] != "committed",
                   timeout=30)
    for node_id in lost_ids:
        cluster.start(node_id)
    back = time.monotonic()
    lost = {"state": "incomplete", "copies": 0, "replicas": [],
            "latest": None if "node0" in lost_ids else "step_5"}
    try:
        wait_until(lambda: agreed(cluster, "run/step_10", lost), timeout=AGREE)
    except AssertionError:
        raise AssertionError({n: story(cluster, n, "run/step_10")
                              for n in cluster.nodes}) from None
    print(f"\nevery node agrees {time.monotonic() - back:.1f} s after the last mount")


def read_in_background(path: Path) -> tuple[threading.Thread, dict[str, Any]]:
    """Read `path` whole in a thread: the result holds `data` or `error`, and `seconds`."""
    result: dict[str, Any] = {}

    def read() -> None:
        started = time.monotonic()
        try:
            result["data"] = path.read_bytes()
        except OSError as exc:
            result["error"] = exc
        result["seconds"] = time.monotonic() - started

    reader = threading.Thread(target=read)
    reader.start()
    return reader, result


@pytest.mark.parametrize("size", [2, 4])
def test_a_read_waits_for_a_holder_whose_lease_lives(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        size: int) -> None:
    """No copies (--replicas 0): node0 alone holds step_1. Its daemon is killed and a read on
    node1 begins at once: the holder's lease still lives, so the read waits instead of
    failing, and gets the bytes once node0 is back on its RAM dir. Killed for good, the next
    read fails (EIO) once the loss is known, within the bound, and the step is incomplete on
    every live node. (Leases of RESTART_TTL s: a restart must fit in one.)"""
    cluster = Cluster(mounts, token_file, size, etcd_server)
    node0, node1, *_others = cluster.start_all("--replicas", "0",
                                               "--lease-ttl", str(RESTART_TTL))
    data, other = os.urandom(3 << 20), os.urandom(1 << 20)
    save(node0 / "run/step_1", {"__0_0.distcp": data, "__0_1.distcp": other,
                                ".metadata": b"m"})
    wait_until(lambda: story(cluster, "node1", "run/step_1")["state"] == "committed",
               timeout=10)
    node0.kill9()
    reader, result = read_in_background(node1 / "run/step_1/__0_0.distcp")
    cluster.start("node0")  # the same RAM dir, within the lease's ttl
    reader.join(timeout=60)
    assert result.get("data") == data, result.get("error")

    cluster.nodes["node0"].kill9()  # (the file read is in node1's RAM now: the other one)
    reader, result = read_in_background(node1 / "run/step_1/__0_1.distcp")
    reader.join(timeout=60)
    assert isinstance(result.get("error"), OSError) and result["error"].errno == errno.EIO, \
        result
    # It waited for node0's lease of RESTART_TTL s to end (5.3 s or more after the kill, its
    # last keepalive at most a third of it before), past the default's wait.
    assert HOLDER_WAIT < result["seconds"] < RESTART_TTL + REJOIN_MARGIN + 3, result["seconds"]
    for node_id in cluster.nodes:
        if node_id != "node0":
            wait_until(lambda n=node_id: story(cluster, n, "run/step_1")["state"]
                       == "incomplete", timeout=AGREE - HOLDER_WAIT + RESTART_TTL + REJOIN_MARGIN)


@pytest.mark.parametrize("etcd_too", [False, True], ids=["holder_cut", "etcd_cut_too"])
def test_reads_wait_once_for_a_live_holder_nobody_reaches(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        etcd_too: bool) -> None:
    """No copies (--replicas 0): node0 alone holds step_1, and its peers reach it only
    through a proxy, which is then cut as a partition would be (node0 keeps its lease: it
    reaches etcd). A read on node1 waits for node0 (HOLDER_WAIT) and fails (EIO); once
    node1's probes find node0's link failing, each later read fails at once instead of
    waiting for it again (a load of many files waited tens of seconds), also when node1 is
    cut off from etcd as well (a minority cut: each read asked etcd who holds the file,
    2 s each). Healed, the files read whole again."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    files = {f"__0_{i}.distcp": os.urandom(1 << 20) for i in range(4)}
    host, port = etcd_server.endpoint.split(":")
    with TcpProxy(("127.0.0.1", cluster.ports["node0"])) as proxy, \
            TcpProxy((host, int(port))) as etcd_proxy:
        node0 = cluster.nodes["node0"] = mounts.mount(
            *cluster.args("node0"), "--advertise", proxy.endpoint, "--replicas", "0")
        node1_args = [arg.replace(etcd_server.endpoint, etcd_proxy.endpoint)
                      for arg in cluster.args("node1")]
        node1 = cluster.nodes["node1"] = mounts.mount(*node1_args, "--replicas", "0")
        wait_until(lambda: all(cluster.peers_up("node1").values()), timeout=15)
        save(node0 / "run/step_1", {**files, ".metadata": b"m"})
        wait_until(lambda: story(cluster, "node1", "run/step_1")["state"] == "committed",
                   timeout=10)
        proxy.cut()
        if etcd_too:
            etcd_proxy.cut()
        names = sorted(files)
        reader, result = read_in_background(node1 / "run/step_1" / names[0])
        reader.join(timeout=90)
        assert isinstance(result.get("error"), OSError), result.get("seconds")
        assert result["error"].errno == errno.EIO, result

        def link() -> object:
            return next(p for p in node1.status()["peers"] if p["node_id"] == "node0")["state"]

        wait_until(lambda: link() == "up, unreachable", timeout=30)
        for name in names[1:]:
            reader, result = read_in_background(node1 / "run/step_1" / name)
            reader.join(timeout=90)
            assert isinstance(result.get("error"), OSError) and \
                result["error"].errno == errno.EIO, result
            assert result["seconds"] < 1.0, (name, result["seconds"])
        # the log says where the file is, not that it was lost with a node that lives
        assert "(held by node0, up but not reachable from this node;" in node1.log()
        proxy.heal()
        etcd_proxy.heal()
        wait_until(lambda: link() == "up", timeout=30)
        for name in names:
            assert (node1 / "run/step_1" / name).read_bytes() == files[name]
