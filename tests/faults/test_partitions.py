"""Real network faults, judged in the manner of Jepsen: a cluster of daemons and etcd in network
namespaces of their own (tests/faults/network.py, netcluster.py), a real multi-rank DCP job
saving and loading through its mounts, a nemesis cutting, dropping, delaying and slowing the
links on a seeded schedule (episodes.py), and a checker over the recorded history
(checker.py): every acknowledged save survives with the right bytes on every node, no load
ever reads mixed or wrong bytes, `latest` never goes back and never names a step a load cannot
read, every node agrees within the documented bound after each heal, and a saver's call is
bounded. doc/RELIABILITY.md lists the faults and properties.

`make test` runs a seeded sample (two episodes one after the other on one cluster, and a
failure domain cut off whole); `make test-faults` (TIERFS_FAULTS=full) runs every episode on a
cluster of its own, and the whole schedule in a seeded order on one cluster.
TIERFS_FAULTS_SEED=N replays (or explores) another seed; each run's counts and history go to
tests/faults/results/partitions-*.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.conftest import MountFactory
from tests.faults.episodes import EPISODES, domain_cut
from tests.faults.partition_run import PartitionRun
from tests.faults.results_io import FULL, pick

pytestmark = pytest.mark.faults

SEED = int(os.environ.get("TIERFS_FAULTS_SEED") or 46)
QUICK_SAMPLE = 2  # episodes `make test` runs, on one cluster


def schedule() -> list[str]:
    """The episodes of the schedule, in the seed's order: all of them in the full run, the
    first QUICK_SAMPLE in the quick one."""
    order = random.Random(SEED).sample(sorted(EPISODES), len(EPISODES))
    return order if FULL else order[:QUICK_SAMPLE]


@pytest.mark.skipif(not FULL, reason="every episode alone runs in make test-faults")
@pytest.mark.parametrize("episode", sorted(EPISODES))
def test_episode(episode: str, tmp_path: Path, mounts: MountFactory, token_file: Path) -> None:
    """One episode on a 3-node cluster of its own, K = 1, between saves before and after."""
    with PartitionRun.open(tmp_path, mounts, token_file, f"partitions-{episode}",
                           SEED) as run:
        run.save()
        EPISODES[episode](run)
        run.save()
        run.finish(episodes=[episode])


def test_a_failure_domain_cut_off_whole_loses_no_step(tmp_path: Path, mounts: MountFactory,
                                                      token_file: Path) -> None:
    """Two racks of two nodes (--failure-domain), K = 1: one rack cut off from the other and
    from etcd; every step committed before reads back whole through the other rack, and
    status names each copy's domain."""
    domains = {"n0": "rack-a", "n1": "rack-a", "n2": "rack-b", "n3": "rack-b"}
    with PartitionRun.open(tmp_path, mounts, token_file, "partitions-domain-cut", SEED,
                           nodes=4, domains=domains) as run:
        domain_cut(run)
        run.save()
        run.finish(episodes=["domain-cut"])


# the whole schedule: about 5 minutes, and loads through a node cut off from the holders of
# what they read block for up to 100 s each (doc/RELIABILITY.md): beyond the 300 s default
@pytest.mark.timeout(pick(300, 1200))
def test_the_schedule_on_one_cluster(tmp_path: Path, mounts: MountFactory,
                                    token_file: Path) -> None:
    """The episodes of the schedule (all of them in the full run), in an order drawn from the
    seed, one after the other on one cluster and one job, judged as one history."""
    order = schedule()
    with PartitionRun.open(tmp_path, mounts, token_file, "partitions-schedule", SEED) as run:
        run.save()
        for episode in order:
            EPISODES[episode](run)
        run.finish(episodes=order)
