"""One node cut off from etcd alone (a TCP proxy in front of etcd that stops forwarding, as a
partition drops packets), its peers still reachable: a multi-node DCP save whose shards that
node wrote cannot commit (the committer never sees their records), so it must fail on every
rank within --commit-timeout, never return success for a step committed nowhere; once the
partition heals, the step commits by itself and every rank loads it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    MountFactory,
    finish_dcp_ranks,
    resume_rank,
    start_dcp_ranks,
    tierfs,
    wait_until,
    wait_written,
)
from tests.faults.tcp_proxy import TcpProxy
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.faults

COMMIT_TIMEOUT = 6  # --commit-timeout: the bound a saver's call waits on etcd


@pytest.fixture
def etcd_proxy(etcd_server: Etcd) -> Iterator[TcpProxy]:
    host, port = etcd_server.endpoint.split(":")
    with TcpProxy((host, int(port))) as proxy:
        yield proxy


def cluster_behind(mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
                   proxy: TcpProxy, size: int, cut_off: str, *options: str) -> Cluster:
    """`size` daemons on one etcd; node `cut_off` reaches it through `proxy`."""
    cluster = Cluster(mounts, token_file, size, etcd_server)
    direct = etcd_server.endpoint
    for node_id in cluster.ports:
        args = cluster.args(node_id)
        if node_id == cut_off:
            args = [arg.replace(direct, proxy.endpoint) for arg in args]
        cluster.nodes[node_id] = mounts.mount(*args, *options)
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=20)
    return cluster


def state(cluster: Cluster, node_id: str, step: str) -> str | None:
    found = cluster.nodes[node_id].step(step)
    return found["state"] if found is not None else None


@pytest.mark.parametrize("size", [3, 4])
def test_a_save_with_a_writer_cut_off_from_etcd_fails_and_commits_once_healed(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        etcd_proxy: TcpProxy, size: int) -> None:
    cluster = cluster_behind(mounts, token_file, etcd_server, etcd_proxy, size, "node1",
                             "--commit-timeout", str(COMMIT_TIMEOUT))
    nodes = [cluster.nodes[f"node{i}"] for i in range(size)]
    steps = [node / "run/step_20" for node in nodes]
    # one rank per node; node1 loses etcd, then rank 1 writes its shard there (cut once the
    # shard was written, node1 could record it in etcd first, and the step commit rightly)
    ranks = start_dcp_ranks(steps, "--save-only", paused=1, pause="before")
    wait_written(ranks[1], said="writing")
    etcd_proxy.cut()
    try:
        started = time.monotonic()
        resume_rank(ranks[1])
        outputs = [rank.communicate(timeout=180) for rank in ranks]
        took = time.monotonic() - started
        # every rank's dcp.save raised: none returned success for a step committed nowhere
        assert all(rank.returncode != 0 for rank in ranks), [o[1][-2000:] for o in outputs]
        assert "[Errno 110] Connection timed out" in outputs[0][1], outputs[0][1][-3000:]
        assert took < COMMIT_TIMEOUT + 30, took
        for node_id in cluster.ports:
            assert state(cluster, node_id, "run/step_20") != "committed", node_id
        waiting = cluster.nodes["node0"].step("run/step_20")
        assert waiting["state"] == "writing" and "etcd" in waiting["waiting_for"], waiting
        assert "node1" in cluster.nodes["node0"].log()  # the log names the node cut off
        # `tierfs flush` does not call that done: it waits, and names the step and why
        flushed = tierfs("flush", str(nodes[0].mountpoint), "--timeout", "2", check=False)
        assert flushed.returncode == 1, flushed.stdout
        assert "1 step is not committed yet: run/step_20 (waits for etcd" in flushed.stderr, \
            flushed.stderr
    finally:
        etcd_proxy.heal()
    healed = time.monotonic()
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: state(cluster, n, "run/step_20") == "committed",
                   timeout=60)
    print(f"\ncommitted on every node {time.monotonic() - healed:.1f} s after the heal")
    for node in nodes:  # each shard has its copy on a live peer
        tierfs("flush", str(node.mountpoint), "--timeout", "60")
    finish_dcp_ranks(start_dcp_ranks(steps, "--load-only"), timeout=180)


def test_a_metadata_written_before_its_shards_on_a_cluster_node_waits_for_them(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """The other side of the rule above: `cp -r` of a DCP step writes `.metadata` before the
    shards it names, which no node has yet (every node says so): that close succeeds within
    a moment (it does not wait out --commit-timeout, nor fail), and the step commits once
    the shards are there."""
    from tests.test_cluster_scale import dcp_metadata

    cluster = Cluster(mounts, token_file, 3, etcd_server)
    node0, node1, _node2 = cluster.start_all("--commit-timeout", str(COMMIT_TIMEOUT))
    step = node0 / "run/step_5"
    step.mkdir(parents=True)
    started = time.monotonic()
    (step / ".metadata").write_bytes(dcp_metadata(["__0_0.distcp", "__1_0.distcp"]))
    assert time.monotonic() - started < COMMIT_TIMEOUT - 2
    assert state(cluster, "node0", "run/step_5") == "writing"
    (step / "__0_0.distcp").write_bytes(b"rank 0")
    (step / "__1_0.distcp").write_bytes(b"rank 1")
    wait_until(lambda: state(cluster, "node1", "run/step_5") == "committed", timeout=30)
    assert (node1 / "run/step_5/__1_0.distcp").read_bytes() == b"rank 1"
