"""The cluster's file records list only real holders, on real daemons and a real etcd: a copy
that leaves RAM leaves the records first (and is not replaced), a node back with an empty RAM
dir is taken out of them at start (and its copies are restored)."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MountFactory, run_dcp_ranks, wait_until
from tests.test_cluster import (  # noqa: F401  (cluster3, token_file: fixtures)
    Cluster,
    _check_step_bytes,
    _copies_everywhere,
    _file_records,
    cluster3,
    token_file,
)
from tests.test_crash import save
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster


@contextmanager
def own_etcd(mounts: MountFactory, tmp_path: Path) -> Iterator[Etcd]:
    """An etcd of the test's own (which it may stop and start); the daemons started on it are
    cleaned up before it stops, whether the test passed or not."""
    with Etcd(tmp_path / "etcd") as server:
        try:
            yield server
        finally:
            mounts.cleanup()  # the daemons go before their etcd


def _only_real_holders(cluster: Cluster, step: str, live: set[str]) -> bool:
    """Every live node the records list as a holder of a file of the step has its object."""
    return all((cluster.nodes[h].ram_dir / "objects" / r.xxh3).exists()
               for r in _file_records(cluster, step).values() for h in set(r.holders) & live)


def test_after_retention_any_one_node_may_be_lost_without_a_store(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """K = 1 on three nodes, no store, --keep-ram 1: a DCP step written on all three (each
    rank's shard on its own node, `.metadata` on node0) is copied once per file; then each
    node saves a newer step, so step_1 is beyond --keep-ram everywhere and retention runs on
    every node. Every file keeps its K + 1 = 2 copies in RAM (before, each writer dropped its
    own shard once one peer held it: one copy per file). Each node in turn is killed and the
    survivors read every file of step_1; it comes back with its RAM dir before the next."""
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    nodes = cluster.start_all("--keep-ram", "1")
    step = "run/step_1"
    run_dcp_ranks([node / step for node in nodes], timeout=240)
    every = set(cluster.ports)
    wait_until(lambda: _copies_everywhere(cluster, step, every, 2), timeout=30)
    expected = {name: r.xxh3 for name, r in _file_records(cluster, step).items()}
    for number, node in enumerate(nodes, start=2):  # each node's copies verified: retention
        save(node / f"run/step_{number}", {"f": b"%d" % number, ".metadata": b"m"})
    for number, node in enumerate(nodes, start=2):
        wait_until(lambda n=number, w=node: f"Step run/step_{n}: replicated to" in w.log(),
                   timeout=30)
    # Retention of step_1 runs in the background, once each node's copies of its newer step
    # are verified (just now): a moment for it (evictions take milliseconds; none is due)
    with contextlib.suppress(AssertionError):
        wait_until(lambda: any(f"evicted {step}" in node.log() for node in nodes), timeout=2)
    for node_id in sorted(every):
        cluster.nodes[node_id].kill9()
        for survivor in sorted(every - {node_id}):
            _check_step_bytes(cluster.nodes[survivor], step, expected)
        cluster.start(node_id)
        for other in sorted(every):
            wait_until(lambda n=other: all(cluster.peers_up(n).values()), timeout=15)
        wait_until(lambda: _copies_everywhere(cluster, step, every, 2), timeout=30)


def test_a_copy_let_go_once_persisted_is_not_replaced_and_a_lost_one_is_elsewhere(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
        tmp_path: Path) -> None:
    """K = 2 on four nodes with a store: node0's step is copied to node1 and node2, persisted,
    then leaves node0's RAM (--keep-ram 1 there; the others keep 3, so their copies stay,
    though every node knows the store holds it): the records list node1 and node2 only, node0
    as one that left (the store holds the file). node1 dies: the file is copied from node2 to
    node3 (not back to node0), every listed holder has it, and it reads byte-identical on
    every live node."""
    store = tmp_path / "store"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 4, etcd_server)
    for node_id in cluster.ports:
        cluster.nodes[node_id] = mounts.mount(
            *cluster.args(node_id), "--replicas", "2", "--persist", f"file://{store}",
            *(["--keep-ram", "1"] if node_id == "node0" else []))
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
    node0 = cluster.nodes["node0"]
    step = "run/step_1"
    save(node0 / step, {"f": os.urandom(1 << 20), ".metadata": b"m"})
    wait_until(lambda: node0.step(step)["replicas"] == ["node1", "node2"], timeout=30)
    save(node0 / "run/step_2", {"f": b"2", ".metadata": b"m2"})  # step_1 beyond --keep-ram
    wait_until(lambda: not node0.step(step)["ram"], timeout=30)
    expected = {name: r.xxh3 for name, r in _file_records(cluster, step).items()}
    wait_until(lambda: all(r.left == ("node0",) for r in _file_records(cluster, step).values()),
               timeout=10)

    cluster.nodes["node1"].kill9()
    live = {"node0", "node2", "node3"}
    wait_until(lambda: _copies_everywhere(cluster, step, live, 2), timeout=30)
    records = _file_records(cluster, step)
    assert {name: (r.holders, r.left) for name, r in records.items()} == {
        name: (("node1", "node2", "node3"), ("node0",)) for name in expected}
    assert _only_real_holders(cluster, step, live)
    assert not any((node0.ram_dir / "objects" / x).exists() for x in expected.values())
    for node_id in sorted(live):
        _check_step_bytes(cluster.nodes[node_id], step, expected)


def test_a_node_back_with_an_empty_ram_dir_is_no_holder_and_its_copies_are_restored(
        cluster3: Cluster) -> None:  # noqa: F811
    """K = 1: node0's step is copied to node1; node1 is killed and comes back at once under
    the same id with an empty RAM dir. The records stop listing it as a holder of what it
    lost, the copies are made again, and nothing is lost."""
    node0 = cluster3.nodes["node0"]
    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    step = "run/step_3"
    save(node0 / step, {"f": os.urandom(1 << 20), "g": b"g" * 1000, ".metadata": b"m"})
    every = set(cluster3.ports)
    wait_until(lambda: _copies_everywhere(cluster3, step, every, 2), timeout=30)
    expected = {name: r.xxh3 for name, r in _file_records(cluster3, step).items()}
    assert all(r.holders == ("node0", "node1") for r in _file_records(cluster3, step).values())

    replaced = cluster3.nodes["node1"]
    replaced.kill9()
    shutil.rmtree(replaced.ram_dir)
    back = cluster3.start("node1")
    wait_until(lambda: _copies_everywhere(cluster3, step, every, 2), timeout=30)
    assert _only_real_holders(cluster3, step, every)
    assert "not in RAM (lost)" in back.log()
    for node_id in sorted(every):
        _check_step_bytes(cluster3.nodes[node_id], step, expected)
    wait_until(lambda: node0.step(step)["copies"] == 2, timeout=10)



def test_status_of_a_step_is_the_same_on_every_node(cluster3: Cluster) -> None:  # noqa: F811
    """A DCP step written on node0 (rank 0, `.metadata`) and node1 (rank 1), K = 1: once its
    copies are made, `tierfs status` of the step says the same on every node, the one that
    holds none of it too: `copies`, `holders` and TIERS come from the records of its files
    (before, each node judged from what it held: copies and TIERS differed, `-` on some);
    none warns that the step is only in its RAM; each writer's replication line gives the
    bytes it sent (its own shard), not the step's size."""
    import json

    from tests.conftest import tierfs
    from tierfs.observe import human_size

    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    nodes = [cluster3.nodes[f"node{i}"] for i in range(3)]
    step = "run/step_1"
    run_dcp_ranks([nodes[0] / step, nodes[1] / step], timeout=240)
    every = set(cluster3.ports)
    wait_until(lambda: _copies_everywhere(cluster3, step, every, 2), timeout=30)
    records = _file_records(cluster3, step)
    holders = sorted({h for r in records.values() for h in r.holders})

    def seen(node: Any) -> tuple[Any, ...]:
        status = json.loads(tierfs("status", str(node.mountpoint), "--json").stdout)
        [entry] = [s for s in status["steps"] if s["path"] == step]
        text = tierfs("status", str(node.mountpoint)).stdout
        [row] = [line.split() for line in text.splitlines() if line.startswith(step + " ")]
        assert "only in this node's RAM" not in text, text
        without_age = row[:7] + row[8:]
        return entry["copies"], entry.get("holders"), entry.get("tiers"), without_age

    wait_until(lambda: all(seen(node)[0] == 2 for node in nodes), timeout=10)
    views = [seen(node) for node in nodes]
    assert views[0] == views[1] == views[2], views
    assert views[0][1] == holders and views[0][0] == 2
    assert views[0][2].startswith("peer:node0")
    total = sum(r.size for r in records.values())
    replicated = f"Step {step}: replicated to "
    for writer in ("node0", "node1"):
        # What it sent: some of its own files (a peer may hold one already, e.g. the
        # `.metadata` another node fetched to learn the step's files), never the step's size.
        own = [r.size for r in records.values() if r.node == writer]
        assert sum(own) < total
        sizes = {human_size(sum(chosen)) for n in range(1, len(own) + 1)
                 for chosen in itertools.combinations(own, n)}
        logged = wait_until(lambda w=writer: [text for text in cluster3.nodes[w].log()
                                              .splitlines() if replicated in text])
        assert all(any(f"({size}, " in text for size in sizes) for text in logged), logged


def test_a_copy_stays_in_ram_while_etcd_cannot_record_that_it_leaves(
        mounts: MountFactory, token_file: Path, tmp_path: Path) -> None:  # noqa: F811
    """Three nodes with their own etcd: node1 writes step_1 (8 MiB) with --replicas 2, so
    node0 and node2 hold copies; node0 (K = 1, RAM tier 16 MiB) may let its copy go, since
    K + 1 = 2 other live nodes hold it. etcd stops and a save of 10 MiB on node0 needs
    step_1's room: step_1 stays in RAM (the records would still count node0) and the save is
    refused; once etcd is back the save goes through, step_1 leaves node0's RAM and the
    records list node1 and node2 only (no `left`: a later loss may copy it back here)."""
    with own_etcd(mounts, tmp_path) as server:
        cluster = Cluster(mounts, token_file, 3, server)
        extra = {"node0": ["--ram-limit", "16M"], "node1": ["--replicas", "2"]}
        for node_id in cluster.ports:
            cluster.nodes[node_id] = mounts.mount(*cluster.args(node_id),
                                                  *extra.get(node_id, []))
        node0, node1 = cluster.nodes["node0"], cluster.nodes["node1"]
        for node_id in cluster.ports:
            wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
        step = "run/step_1"
        save(node1 / step, {"f": os.urandom(8 << 20), ".metadata": b"m"})
        wait_until(lambda: node1.step(step)["replicas"] == ["node0", "node2"], timeout=30)
        wait_until(lambda: (node0.step(step) or {}).get("copies") == 3, timeout=10)
        newer = {"f": os.urandom(10 << 20), ".metadata": b"m2"}
        server.stop()
        with pytest.raises(OSError) as refused:
            save(node0 / "run/step_2", newer)
        assert refused.value.errno == errno.ENOSPC
        assert "leave RAM here" in node0.log() and node0.step(step)["ram"]
        server.start()

        def saved() -> bool:
            try:
                save(node0 / "run/step_2", newer)
            except OSError:
                return False
            return True

        wait_until(saved, timeout=30, interval=0.5)
        assert not node0.step(step)["ram"]
        records = _file_records(cluster, step)
        assert all(r.holders == ("node1", "node2") and r.left == () for r in records.values())
        _check_step_bytes(node0, step, {n: r.xxh3 for n, r in records.items()})


def test_a_copy_read_back_leaves_ram_while_k_plus_1_others_hold_it(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """K = 1 on three nodes, no store: node0's step_1 is copied to node1; node2 reads it back
    (a copy in its RAM that the records do not count). Beyond --keep-ram on node2 that copy
    leaves its RAM (node0 and node1, K + 1, hold the file), and the records are unchanged;
    node0's and node1's copies stay (each has one other holder only)."""
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    node0, node1, node2 = cluster.start_all("--keep-ram", "1")
    step = "run/step_1"
    files = {"f": os.urandom(1 << 20), ".metadata": b"m"}
    save(node0 / step, files)
    wait_until(lambda: _copies_everywhere(cluster, step, {"node0", "node1"}, 2), timeout=30)
    wait_until(lambda: (node2.step(step) or {}).get("state") == "committed", timeout=10)
    for name, data in files.items():
        assert (node2 / step / name).read_bytes() == data
    wait_until(lambda: node2.step(step)["ram"], timeout=10)
    before = _file_records(cluster, step)
    save(node2 / "run/step_2", {"f": b"2", ".metadata": b"m2"})  # step_1 beyond --keep-ram
    wait_until(lambda: not node2.step(step)["ram"], timeout=30)
    assert _file_records(cluster, step) == before
    assert node0.step(step)["ram"] and node1.step(step)["ram"]
    assert _copies_everywhere(cluster, step, set(cluster.ports), 2)
