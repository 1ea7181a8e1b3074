"""etcd restarted in the middle of a run of real daemons: saves go on locally while it is down,
and once it is back the commit records are written and every node lists every step."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.conftest import (
    MountFactory,
    finish_dcp_ranks,
    resume_rank,
    run_dcp_ranks,
    start_dcp_ranks,
    wait_until,
    wait_written,
)
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tests.test_cluster_scale import dcp_metadata
from tierfs.devtools.etcd import Etcd
from tierfs.replication.coordination.commit_records import CommitRecord, CommitRecords
from tierfs.replication.coordination.etcd import Etcd as EtcdClient
from tierfs.replication.coordination.etcd import parse_cluster_url

pytestmark = pytest.mark.cluster


def state(node: object, step: str) -> str | None:
    found = node.step(step)  # type: ignore[attr-defined]
    return found["state"] if found is not None else None


def commit_record(url: str, step: str) -> CommitRecord | None:
    """The step's commit record in the cluster's etcd, as a node starting would read it."""
    async def read() -> CommitRecord | None:
        cluster = parse_cluster_url(url)
        etcd = EtcdClient(cluster.endpoints)
        try:
            return await CommitRecords(etcd, cluster).commit_of(step)
        finally:
            await etcd.aclose()

    return trio.run(read)


@contextlib.contextmanager
def two_nodes(mounts: MountFactory, token_file: Path,  # noqa: F811
              tmp_path: Path) -> Iterator[tuple[Etcd, Cluster]]:
    """Two daemons on an etcd of the test's own (which the test may stop and start)."""
    with Etcd(tmp_path / "etcd") as server:
        cluster = Cluster(mounts, token_file, 2, server)
        for node_id in cluster.ports:
            cluster.start(node_id)
        wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
        try:
            yield server, cluster
        finally:
            mounts.cleanup()  # the daemons go before their etcd


def test_saves_go_on_while_etcd_is_down_and_commits_resume_after(
        mounts: MountFactory, token_file: Path, tmp_path: Path) -> None:  # noqa: F811
    with two_nodes(mounts, token_file, tmp_path) as (server, cluster):
        node0, node1 = cluster.nodes["node0"], cluster.nodes["node1"]
        server.stop()  # by pid; its data dir and ports stay

        # a single-node step commits here at once, etcd or not
        started = time.monotonic()
        (node0 / "run/step_1").mkdir(parents=True)
        (node0 / "run/step_1/model.pt").write_bytes(b"weights")
        (node0 / "run/step_1/.metadata").write_bytes(b"m")
        assert state(node0, "run/step_1") == "committed"
        assert time.monotonic() - started < 10
        # a multi-node DCP step: rank 1 on node1, rank 0 and .metadata on node0; it waits
        for node in (node0, node1):
            (node / "run/step_2").mkdir(parents=True)
        (node1 / "run/step_2/__1_0.distcp").write_bytes(b"rank 1")
        (node0 / "run/step_2/__0_0.distcp").write_bytes(b"rank 0")
        saver = threading.Thread(target=(node0 / "run/step_2/.metadata").write_bytes,
                                 args=(dcp_metadata(["__0_0.distcp", "__1_0.distcp"]),))
        saver.start()
        wait_until(lambda: state(node0, "run/step_2") is not None, timeout=10)
        assert state(node0, "run/step_2") != "committed"

        server.start()  # the same port and data
        back = time.monotonic()
        for node in (node0, node1):
            for step in ("run/step_1", "run/step_2"):
                wait_until(lambda n=node, s=step: state(n, s) == "committed", timeout=30)
        print(f"\nevery node lists both steps {time.monotonic() - back:.1f} s after etcd is back")
        saver.join(timeout=30)
        assert not saver.is_alive()
        for node in (node0, node1):
            assert (node / "run/step_1/model.pt").read_bytes() == b"weights"
            assert (node / "run/step_2/__0_0.distcp").read_bytes() == b"rank 0"
            assert (node / "run/step_2/__1_0.distcp").read_bytes() == b"rank 1"
        wait_until(lambda: all(cluster.peers_up("node0").values())
                   and all(cluster.peers_up("node1").values()), timeout=15)
        # and new saves commit across the cluster as before
        (node1 / "run/step_3").mkdir()
        (node1 / "run/step_3/.metadata").write_bytes(b"m3")
        wait_until(lambda: state(node0, "run/step_3") == "committed", timeout=10)


def test_a_save_while_etcd_hangs_fails_within_its_bound_and_commits_once_etcd_is_back(
        mounts: MountFactory, token_file: Path, tmp_path: Path) -> None:  # noqa: F811
    """etcd stopped (SIGSTOP: it hangs, longer than the leases live) during a two-node DCP
    save: the close of `.metadata` waits --commit-timeout (4 s here; 20 s by default) and
    fails, so dcp.save raises ETIMEDOUT on every rank; the step stays `writing`, waiting for
    etcd. Once etcd answers again the step commits by itself, every rank loads it (no peer
    refused: every lease ended in the stall, the live nodes' too), and the next save works."""
    with Etcd(tmp_path / "etcd") as server:
        cluster = Cluster(mounts, token_file, 2, server)
        node0, node1 = cluster.start_all("--commit-timeout", "4")
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            ranks = start_dcp_ranks([node0 / "run/step_1", node1 / "run/step_1"],
                                    "--save-only")
            outputs = [rank.communicate(timeout=120) for rank in ranks]
            assert all(rank.returncode != 0 for rank in ranks), outputs
            assert "[Errno 110] Connection timed out" in outputs[0][1], outputs[0][1][-3000:]
            step = node0.step("run/step_1")
            assert step["state"] == "writing" and "etcd" in step["waiting_for"], step
            assert "within 4 s; the step stays writing" in node0.log()
        finally:
            os.kill(server.pid, signal.SIGCONT)
        for node in (node0, node1):
            wait_until(lambda n=node: state(n, "run/step_1") == "committed", timeout=30)
        finish_dcp_ranks(start_dcp_ranks([node0 / "run/step_1", node1 / "run/step_1"],
                                         "--load-only"), timeout=120)
        run_dcp_ranks([node0 / "run/step_2", node1 / "run/step_2"], timeout=120)
        for node in (node0, node1):
            assert "is not a member" not in node.log()
        mounts.cleanup()  # the daemons go before their etcd


def test_the_saver_call_that_commits_waits_no_longer_than_its_bound_when_etcd_hangs(
        mounts: MountFactory, token_file: Path, tmp_path: Path) -> None:  # noqa: F811
    """etcd hangs (SIGSTOP) once both ranks' shards are written: the save fails within
    --commit-timeout of going on (4 s; a little more for DCP's own steps), not that plus two
    etcd request timeouts: the kernel's lookups of `.metadata` on the way to its rename asked
    etcd whether another node had committed the step, 2 s each (found by the partition suite:
    the call took 14 s with --commit-timeout 10)."""
    with Etcd(tmp_path / "etcd") as server:
        cluster = Cluster(mounts, token_file, 2, server)
        node0, node1 = cluster.start_all("--commit-timeout", "4")
        assert server.pid is not None
        ranks = start_dcp_ranks([node0 / "run/step_1", node1 / "run/step_1"], "--save-only",
                                paused=0)
        wait_written(ranks[0])
        os.kill(server.pid, signal.SIGSTOP)
        try:
            # the leases' keepalives find etcd silent (2 s each): it is known to be away
            wait_until(lambda: "lease keepalive failed" in node0.log(), timeout=15)
            resume_rank(ranks[0])
            outputs = [rank.communicate(timeout=120) for rank in ranks]
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert all(rank.returncode != 0 for rank in ranks), outputs
        assert "[Errno 110] Connection timed out" in outputs[0][1], outputs[0][1][-3000:]
        # the saver's call, as the rank timed it (the process's teardown after it is not the
        # save's: gloo and torch take a second or more to exit on a busy machine)
        timed = re.search(r"the save failed ([\d.]+) s after", outputs[0][1])
        assert timed, outputs[0][1][-3000:]
        took = float(timed.group(1))
        assert took < 4 + 1.5, f"the save failed {took:.1f} s after it went on"
        mounts.cleanup()  # the daemons go before their etcd


def test_a_step_committed_while_etcd_is_down_survives_its_node_crashing(
        mounts: MountFactory, token_file: Path, tmp_path: Path) -> None:  # noqa: F811
    """The commit record of a step committed without etcd is written after a restart too (the
    daemon died before etcd came back): the other node lists it and holds its copy."""
    with two_nodes(mounts, token_file, tmp_path) as (server, cluster):
        node0, node1 = cluster.nodes["node0"], cluster.nodes["node1"]
        server.stop()
        (node0 / "run/step_1").mkdir(parents=True)
        (node0 / "run/step_1/model.pt").write_bytes(b"weights")
        (node0 / "run/step_1/.metadata").write_bytes(b"m")
        assert state(node0, "run/step_1") == "committed"
        node0.kill9()
        server.start()
        node0 = cluster.start("node0")
        wait_until(lambda: state(node1, "run/step_1") == "committed", timeout=30)
        wait_until(lambda: node0.step("run/step_1")["replicas"] == ["node1"], timeout=30)
        assert (node1 / "run/step_1/model.pt").read_bytes() == b"weights"


def test_a_step_deleted_while_its_node_is_down_stays_deleted(
        mounts: MountFactory, token_file: Path, tmp_path: Path) -> None:  # noqa: F811
    """A node back from a crash does not list again, anywhere, a step deleted meanwhile, even
    when it was down long enough not to be among the peers the delete was sent to."""
    with two_nodes(mounts, token_file, tmp_path) as (_server, cluster):
        node0, node1 = cluster.nodes["node0"], cluster.nodes["node1"]
        (node0 / "run/step_1").mkdir(parents=True)
        (node0 / "run/step_1/model.pt").write_bytes(b"weights")
        (node0 / "run/step_1/.metadata").write_bytes(b"m")
        wait_until(lambda: node0.step("run/step_1")["replicas"] == ["node1"], timeout=30)
        node0.kill9()
        wait_until(lambda: not cluster.peers_up("node1").get("node0"), timeout=15)
        shutil.rmtree(node1 / "run/step_1")
        assert state(node1, "run/step_1") is None
        node0 = cluster.start("node0")
        # node0 applied what it missed and wrote the commit records it found missing ...
        wait_until(lambda: node0.status()["caught_up"], timeout=30)
        assert state(node0, "run/step_1") is None
        # ... and node1 took every commit record written before a later one (commit records
        # reach each node in the order etcd wrote them)
        (node0 / "run/step_2").mkdir(parents=True)
        (node0 / "run/step_2/model.pt").write_bytes(b"later")
        (node0 / "run/step_2/.metadata").write_bytes(b"m")
        wait_until(lambda: state(node1, "run/step_2") == "committed", timeout=30)
        assert state(node1, "run/step_1") is None
        assert state(node0, "run/step_1") is None
        assert commit_record(cluster.url, "run/step_1") is None  # nor any node after them
