"""bench/simulate_cluster.py at a small scale: the simulation still drives the real placement
and commit-record code, and what it reports is consistent (so that `make simulate` cannot rot)."""

from __future__ import annotations

import math

import pytest

from bench.simulate_cluster import (
    MANIFEST_FILE,
    STEP,
    Cluster,
    Params,
    S3Limits,
    ddp_restore,
    drive,
    get_requests,
    main,
    put_requests,
    rack_loss,
    s3_transfer,
)
from tierfs.replication.coordination import placement
from tierfs.replication.coordination.etcd import MAX_TXN_OPS

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
          "--ks", "1", "--variants", "batch:event", "--node-rates", "0,20"])
    out = capsys.readouterr().out
    assert "committed" in out and "restore peers" in out
    assert "swarm (now)" in out and "holders (before)" in out and "SlowDown" in out
    assert "Gb/s each way per core" in out  # the measured rate, and what it projects
    rows = [line.split("|") for line in out.splitlines() if line.strip().startswith("100 |")]
    assert sorted(row[1].strip() for row in rows) == ["20", "link"]


def test_a_data_plane_slower_than_the_link_slows_the_copies() -> None:
    """The per-node rate caps what a node moves to and from its peers: copies and a restore
    from peers take longer at 10 Gb/s than at the link's 100; the commit does not."""
    at_link = Cluster(small()).run_checkpoint()
    slow = Cluster(small(node_gbps=10.0)).run_checkpoint()
    assert slow.committed == at_link.committed
    assert slow.copies_ram > at_link.copies_ram
    assert ddp_restore(small(node_gbps=10.0), 1.0, True, 8).seconds > \
        ddp_restore(small(), 1.0, True, 8).seconds


def test_one_writer_many_readers_the_swarm_loads_in_about_one_nodes_time() -> None:
    """Every node reads node 0's file: from the holders alone their uplinks send it once per
    reader; routed by the real `sources.ChunkRoutes`, each holder sends its chunks about once
    and every node has the file within 2x one node's time."""
    p = small(nodes=200, replicas=1)
    before = ddp_restore(p, file_gb=1.0, swarm=False, sample_chunks=32)
    now = ddp_restore(p, file_gb=1.0, swarm=True, sample_chunks=32)
    assert before.holder_sent > 90  # 198 readers over two holders
    assert before.seconds > 50 * before.one_node
    assert now.holder_sent <= 0.6  # half the chunks each, once
    assert now.relay_sent <= 2.0
    assert now.seconds <= 2 * now.one_node
    assert 1 < now.depth < 20


def test_above_s3s_request_rate_requests_are_slowed_down_never_lost() -> None:
    """More requests than the prefix takes: some are answered SlowDown and retried after the
    retry policy's pause; every one is accepted in the end, at no more than the rate."""
    p = small(nodes=50)
    limits = S3Limits(put_rps=200.0, streams=4)
    requests = [put_requests(40 << 20, 16 << 20) for _ in range(50)]  # 5 requests a node
    result = s3_transfer("test", requests, limits.put_rps, p, limits)
    assert result.requests == 250
    assert result.slowdowns > 0
    assert result.seconds >= 250 / limits.put_rps * 0.9
    assert put_requests(10 << 20, 16 << 20) == [10 << 20]  # one PUT when it fits a part
    assert len(get_requests(61_000_000, 8 << 20)) == 8


def test_a_rack_lost_whole_loses_nothing_with_copies_across_racks() -> None:
    """Racks of consecutive node ids, K = 1: on the plain ring a node's copy is its neighbour's,
    in its own rack, and a rack lost takes files with it; with the racks as failure domains
    (the real `placement` with domains) every file has a copy in another rack, none is lost,
    and the survivors bring every file back to K + 1 copies."""
    before = rack_loss(small(nodes=40, racks=4, replicas=1, placement="ring",
                             holder_updates="batch", follow="event"))
    now = rack_loss(small(nodes=40, racks=4, replicas=1, placement="domains",
                          holder_updates="batch", follow="event"))
    assert before.nodes_lost == now.nodes_lost == 10
    assert before.min_racks == 1 and before.files_lost > 0
    assert now.min_racks == 2 and now.files_lost == 0 and now.bytes_lost == 0
    assert now.restore_bytes > 0 and now.restore_peers > 0
