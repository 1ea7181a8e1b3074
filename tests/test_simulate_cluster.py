"""bench/simulate_cluster.py at a small scale: the simulation still drives the real placement
and commit-record code, and what it reports is consistent (so that `make simulate` cannot rot)."""

from __future__ import annotations

import math

import pytest

from bench.simulate_cluster import MANIFEST_FILE, STEP, Cluster, Params, drive, main
from tierfs.cluster import placement
from tierfs.cluster.etcd import MAX_TXN_OPS

pytestmark = pytest.mark.core


def small(**changes: object) -> Params:
    fields: dict[str, object] = {"nodes": 12, "ranks": 3, "params_b": 0.05, **changes}
    return Params(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("holders, follow", [("cas", "records"), ("batch", "event"),
                                             ("batch", "peer")])
def test_every_file_gets_k_copies_once_and_a_loss_is_restored(replicas: int, holders: str,
                                                               follow: str) -> None:
    cluster = Cluster(small(replicas=replicas, holder_updates=holders, follow=follow))
    result = cluster.run_checkpoint()
    assert 0 < result.committed <= result.visible_all <= result.copies_ram
    assert result.copies_ram <= result.copies_recorded
    assert drive(cluster.records.commit_of(STEP)) is not None
    records = drive(cluster.records.files(STEP))
    assert set(records) == set(cluster.files)  # .metadata and every shard
    for name, record in records.items():  # K + 1 copies: the writer and its replica targets
        writer = cluster.files[name][0]
        assert set(record.holders) == set(placement.desired_holders(cluster.ring, writer,
                                                                    replicas))
    copies = {(name, node) for name, node in cluster.net.sent if name != MANIFEST_FILE}
    assert len(copies) == replicas * len(cluster.files)  # each copy made once
    if follow == "peer":  # the manifest from the committer to every other node, etcd unread
        assert cluster.manifest_read == []
        assert len(cluster.net.sent) - len(copies) == len(cluster.nodes) - 1

    victim = cluster.nodes[5]
    result = cluster.lose(victim)
    assert result.restore_peers > 0 and result.restore_s3 > 0
    assert set(result.holders) == set(cluster.files)
    for name, holders_now in result.holders.items():
        assert len(holders_now) == replicas + 1, name
        assert victim not in holders_now


def test_records_go_in_put_alls_transactions() -> None:
    """Request counts come from the real client: a node's sealed files are recorded in
    transactions of at most MAX_TXN_OPS puts."""
    ranks = MAX_TXN_OPS + 2
    cluster = Cluster(small(nodes=3, ranks=ranks, replicas=1, holder_updates="batch",
                            follow="event"))
    sealed = {name: cluster.sealed_record(name) for name in cluster.by_node["n00001"]}
    trace = cluster.traced(cluster.records.record_files(STEP, sealed))
    assert [r.path for r in trace] == ["kv/txn"] * math.ceil(ranks / MAX_TXN_OPS)
    assert sum(r.keys for r in trace) == ranks


def test_command_line_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--nodes", "8", "--ranks", "2", "--params-b", "0.02", "--links", "100",
          "--ks", "1", "--variants", "batch:event"])
    out = capsys.readouterr().out
    assert "committed" in out and "restore peers" in out
    assert len([line for line in out.splitlines() if line.strip().startswith("100 |")]) == 1
