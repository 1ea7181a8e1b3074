"""`latest` is a promise to a restarting job: it names the newest step that can be read whole.

Three daemons on a real etcd, K = 1, a two-rank DCP job (rank 0 on node0, rank 1 on node1). A
writer killed right after `dcp.save` returned, before its shard was copied anywhere, leaves a
committed step with a file that no live node holds: that step is `incomplete` on every node,
`latest` moves back to the step before, and a job restarted from `latest` loads that step,
whole. The step comes back when its writer does."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import (
    Mount,
    finish_dcp_ranks,
    getxattr,
    resume_rank,
    run_dcp_ranks,
    start_dcp_ranks,
    tierfs,
    wait_until,
    wait_written,
)
from tests.harness import Cluster, copies_everywhere, file_records
from tierfs.replication.coordination import membership

pytestmark = pytest.mark.cluster


def latest(node: Mount) -> str | None:
    try:
        return os.readlink(node / "run/latest")
    except FileNotFoundError:
        return None


def test_latest_resumes_from_the_step_before_a_writer_lost_before_its_copies(
        cluster3: Cluster) -> None:  # noqa: F811
    node0, node1, node2 = (cluster3.nodes[f"node{i}"] for i in range(3))
    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    writers = [node0, node1]
    # step_10: saved, and every file copied to a second node
    run_dcp_ranks([n / "run/step_10" for n in writers], timeout=240)
    wait_until(lambda: copies_everywhere(cluster3, "run/step_10", set(cluster3.ports), 2),
               timeout=30)

    # step_20: rank 1's shard is written and recorded in etcd; then node1 hangs (no copy can
    # leave it), the save returns, and node1 dies before its shard was copied anywhere
    ranks = start_dcp_ranks([n / "run/step_20" for n in writers], "--save-only", "--seed",
                            "20", paused=1)
    try:
        wait_written(ranks[1])
        written = set(os.listdir(node1 / "run/step_20"))
        wait_until(lambda: written <= set(file_records(cluster3, "run/step_20")), timeout=30)
        os.kill(node1.pid, signal.SIGSTOP)
        resume_rank(ranks[1])
        finish_dcp_ranks(ranks, timeout=120)  # dcp.save returned on every rank
    finally:
        for rank in ranks:
            rank.kill()
    assert node0.step("run/step_20")["state"] == "committed"
    node1.kill9()
    # Once incomplete, it stays so while node1's lease ends and its grace to register again
    # passes (node0 forgot node1's failed handshakes as it left the live members: the step
    # looked whole for those 4 s).
    seen = []
    deadline = time.monotonic() + membership.DEFAULT_TTL + membership.REJOIN_MARGIN + 3
    while time.monotonic() < deadline:
        seen.append(getxattr(node0 / "run/step_20", "user.tierfs.state"))
        time.sleep(0.05)
    assert seen[-1] == "incomplete" and "committed" not in seen[seen.index("incomplete"):], seen
    rank1_files = sorted(n for n, r in file_records(cluster3, "run/step_20").items()
                         if r.node == "node1")

    for node in (node0, node2):
        wait_until(lambda n=node: n.step("run/step_20")["state"] == "incomplete", timeout=30)
        step = node.step("run/step_20")
        assert step["lost"]["shown"] == [
            {"name": name, "holders": ["node1"],
             "why": "lost with node1 before its copies were made"} for name in rank1_files]
        assert getxattr(node / "run/step_20", "user.tierfs.state") == "incomplete"
        assert latest(node) == "step_10"
        text = tierfs("status", str(node.mountpoint)).stdout
        assert "run/step_20 is incomplete" in text and "__1_0.distcp (lost with node1" in text
    assert "run/step_20 v1 is incomplete" in node0.log()

    # the job restarts on the survivors and resumes from `latest`: step_10, whole
    resumed = start_dcp_ranks([node0 / "run/latest", node2 / "run/latest"], "--load-only",
                              "--seed", "0")
    finish_dcp_ranks(resumed, timeout=240)
    # a read of the lost file fails, and the log says what is lost
    try:
        (node2 / "run/step_20/__1_0.distcp").read_bytes()
        raise AssertionError("a file no node holds was read")
    except OSError as exc:
        assert exc.errno == 5
    assert ("no node reachable from here and no store holds it (lost with node1 before"
            in node2.log())

    # its writer comes back with its RAM: the step is whole again, and `latest` with it
    cluster3.start("node1")
    for node in (node0, node2):
        wait_until(lambda n=node: n.step("run/step_20")["state"] == "committed", timeout=30)
        wait_until(lambda n=node: latest(n) == "step_20", timeout=5)

