"""The cluster's file records list only real holders, on real daemons and a real etcd: a copy
that leaves RAM leaves the records first (and is not replaced), a node back with an empty RAM
dir is taken out of them at start (and its copies are restored)."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import MountFactory, wait_until
from tests.test_cluster import (  # noqa: F401  (cluster3, token_file: fixtures)
    Cluster,
    _check_step_bytes,
    _copies_everywhere,
    _file_records,
    cluster3,
    token_file,
)
from tests.test_crash import save
from tierfs.demo.etcd import Etcd

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


def test_an_evicted_writer_is_not_counted_and_a_lost_copy_is_restored_elsewhere(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """K = 2 on four nodes: node0's step is copied to node1 and node2, then leaves node0's RAM
    (--keep-ram 1): the records list node1 and node2 only, node0 as one that left. node1
    dies: the file is copied from node2 to node3 (not back to node0), every listed holder
    has it, and it reads byte-identical on every live node."""
    cluster = Cluster(mounts, token_file, 4, etcd_server)
    cluster.start_all("--keep-ram", "1", "--replicas", "2")
    node0 = cluster.nodes["node0"]
    step = "run/step_1"
    save(node0 / step, {"f": os.urandom(1 << 20), ".metadata": b"m"})
    wait_until(lambda: node0.step(step)["replicas"] == ["node1", "node2"], timeout=30)
    save(node0 / "run/step_2", {"f": b"2", ".metadata": b"m2"})  # step_1 beyond --keep-ram
    wait_until(lambda: not node0.step(step)["ram"], timeout=30)
    expected = {name: r.xxh3 for name, r in _file_records(cluster, step).items()}

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



def test_a_copy_stays_in_ram_while_etcd_cannot_record_that_it_leaves(
        mounts: MountFactory, token_file: Path, tmp_path: Path) -> None:  # noqa: F811
    """K = 1 on two nodes with their own etcd, node0's RAM tier 16 MiB: its step_1 (8 MiB) is
    copied to node1, then etcd stops and a save of 10 MiB needs step_1's room. step_1 stays
    in RAM (the records would still count node0) and the save is refused; once etcd is back
    the save goes through, step_1 leaves RAM and node0 is listed as one that left it."""
    with own_etcd(mounts, tmp_path) as server:
        cluster = Cluster(mounts, token_file, 2, server)
        for node_id in cluster.ports:
            extra = ["--ram-limit", "16M"] if node_id == "node0" else []
            cluster.nodes[node_id] = mounts.mount(*cluster.args(node_id), *extra)
        node0 = cluster.nodes["node0"]
        wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
        step = "run/step_1"
        save(node0 / step, {"f": os.urandom(8 << 20), ".metadata": b"m"})
        wait_until(lambda: node0.step(step)["replicas"] == ["node1"], timeout=30)
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
        assert all(r.holders == ("node1",) and r.left == ("node0",) for r in records.values())
        _check_step_bytes(node0, step, {n: r.xxh3 for n, r in records.items()})
