"""The fault schedule of the partition suite: episodes, each a fault (or several) applied to a
running `PartitionRun` around the job's saves and loads, then healed and settled. Every choice
(which node, when) comes from the run's seeded random generator, so a run replays from its
seed. The checker judges the whole history at the end; an episode asserts only what is its own
(a failure domain cut off: the other domain still reads every step).

Rank r writes on node r % N, and rank 0's node commits; the DCP job's own traffic (gloo) runs
on loopback, as on a fabric of its own: only tierfs's links (peers, etcd) are faulted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tests.conftest import wait_until
from tests.faults.netcluster import ETCD
from tests.faults.partition_run import RUN, SAVE_BOUND, SETTLE_BOUND, TTL, PartitionRun
from tierfs.replication.coordination import placement


def _hold(run: PartitionRun, seconds: float) -> None:
    """Let the fault last `seconds` more, the job loading meanwhile (a load takes ~0.1 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        run.load()
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def writer_cut_from_peers(run: PartitionRun) -> None:
    """A writer loses its peers (not etcd) during a save and stays cut right after it."""
    run.save()
    writer = run.rng.choice(run.node_ids)
    others = [n for n in run.node_ids if n != writer]
    run.nemesis.later(run.rng.uniform(0.0, 0.1), lambda: run.network.partition([writer], others),
                      cut=run.node_ids)
    run.save()
    run.load(others[0])
    run.load(writer)
    _hold(run, TTL + 1)
    run.save()
    run.heal_and_settle()
    run.load()


def node_cut_from_etcd(run: PartitionRun, committer: bool) -> None:
    """One node loses etcd (not its peers) for longer than its lease, a save made meanwhile;
    the node is rank 0's (the committer) or another writer's."""
    run.save()
    node = run.node_ids[0] if committer else run.rng.choice(run.node_ids[1:])
    run.nemesis.apply(lambda: run.network.partition([node], [ETCD]), cut=run.node_ids)
    run.save()
    _hold(run, TTL + 1)
    run.save()
    run.heal_and_settle()
    run.load()


def minority_cut(run: PartitionRun) -> None:
    """A minority (one node of three) cut from the majority and from etcd, past its lease."""
    run.save()
    node = run.rng.choice(run.node_ids)
    run.nemesis.apply(lambda: run.network.isolate([node]), cut=run.node_ids)
    run.save()
    majority = [n for n in run.node_ids if n != node]
    run.load(run.rng.choice(majority))
    _hold(run, TTL + 1)
    run.save()
    run.load(run.rng.choice(majority))
    run.heal_and_settle()
    run.load()


def one_way_between_holders(run: PartitionRun) -> None:
    """Every packet from a node to the node that holds its copies is lost; the other way
    works."""
    run.save()
    source = run.rng.choice(run.node_ids)
    target = placement.replica_targets(placement.ring(run.node_ids), source, 1)[0]
    run.nemesis.apply(lambda: run.network.drop([source], [target]), cut=run.node_ids)
    run.save()
    run.load(target)
    _hold(run, TTL + 1)
    run.save()
    run.load(target)
    run.heal_and_settle()
    run.load()


def slow_lossy_links(run: PartitionRun) -> None:
    """200 ms each way and 1 % loss on every link (peers and etcd) through saves, their
    replication and restores (loads through every node, most of it fetched from peers)."""
    run.save()
    hosts = list(run.network.hosts)
    run.nemesis.apply(lambda: run.network.delay(200), cut=[])
    run.nemesis.apply(lambda: run.network.loss(hosts, hosts, 0.01), cut=[])
    for _ in range(2):
        run.save()
        for node in run.node_ids:
            run.load(node)
    run.heal_and_settle()
    run.load()


def slow_link(run: PartitionRun) -> None:
    """A writer's link at 2 Mbit/s each way while its shards replicate and others read them."""
    run.save()
    writer = run.rng.choice(run.node_ids)
    run.nemesis.apply(lambda: run.network.rate(writer, 2000), cut=[])
    run.save()
    for node in run.node_ids:
        if node != writer:
            run.load(node)
    run.save()
    run.heal_and_settle()
    run.load()


def heal_during_moves(run: PartitionRun) -> None:
    """A node cut off; a delete, a rename and a re-save of committed steps start, and the
    partition heals while they are in flight."""
    deleted, renamed, resaved = (run.next_step() for _ in range(3))
    for path in (deleted, renamed, resaved):
        run.save(path)
    node = run.rng.choice(run.node_ids)
    run.nemesis.apply(lambda: run.network.isolate([node]), cut=run.node_ids)
    moves: list[Callable[[], object]] = [
        lambda: run.workload.delete(run.rng.choice(run.node_ids), deleted),
        lambda: run.workload.rename(run.rng.choice(run.node_ids), renamed,
                                    f"{RUN}/step_{int(renamed.rsplit('_', 1)[1]) + 5}"),
        lambda: run.save(resaved, seed=int(resaved.rsplit("_", 1)[1]) + 1000),
    ]
    threads = [threading.Thread(target=move) for move in moves]
    for thread in threads:
        thread.start()
    time.sleep(run.rng.uniform(0.2, 3.0))
    healed = run.nemesis.heal()  # while the moves are in flight
    for thread in threads:
        thread.join(SAVE_BOUND + 60)
    run.workload.settle(RUN, SETTLE_BOUND, healed)
    run.load()


def domain_cut(run: PartitionRun) -> None:
    """A whole failure domain cut off (from the other domain and from etcd) once every step
    has its copy: every step stays readable whole through every node of the other domain."""
    for _ in range(2):
        run.save()
    assert run.domains
    lost = run.rng.choice(sorted(set(run.domains.values())))
    cut = [n for n in run.node_ids if run.domains[n] == lost]
    survivors = [n for n in run.node_ids if n not in cut]
    for path in run.acknowledged:
        wait_until(lambda p=path: all((run.cluster.nodes[n].step(p) or {}).get("copies", 0) >= 2
                                      for n in run.node_ids), timeout=60, interval=0.3)
    for node in run.node_ids:  # status names each copy's domain, and each peer's
        status = run.cluster.nodes[node].status()
        assert status["failure_domain"] == run.domains[node]
        assert {p["node_id"]: p.get("domain") for p in status["peers"]} == {
            n: d for n, d in run.domains.items() if n != node}
        for step in status["steps"]:
            assert step["domains"] == {h: run.domains[h] for h in step["holders"]}, step
            assert set(step["domains"].values()) == set(run.domains.values()), step
    run.nemesis.apply(lambda: run.network.isolate(cut), cut=run.node_ids)
    time.sleep(TTL + 2)  # the cut nodes' leases end: down for the survivors
    for node in survivors:
        for path in run.acknowledged:
            assert run.load(node, path), f"{path} unreadable through {node} with {cut} cut off"
    run.save()  # ranks on the cut nodes: this save may fail, and must say so
    run.heal_and_settle()
    run.load()


EPISODES: dict[str, Callable[[PartitionRun], None]] = {
    "writer-cut-from-peers": writer_cut_from_peers,
    "committer-cut-from-etcd": lambda run: node_cut_from_etcd(run, committer=True),
    "writer-cut-from-etcd": lambda run: node_cut_from_etcd(run, committer=False),
    "minority-cut": minority_cut,
    "one-way-between-holders": one_way_between_holders,
    "delay-and-loss": slow_lossy_links,
    "slow-link": slow_link,
    "heal-during-moves": heal_during_moves,
}
