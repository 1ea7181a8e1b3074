"""The cluster's coordination (tierfs/replication/coordination) against a real etcd on
loopback: the --cluster URL, membership under leases, placement on the ring, shard and commit
records, and an etcd restart. No FUSE here: daemons are stood in for by `Membership` objects
in this process, and by a child process where a crash (kill -9) is the point."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd as EtcdServer
from tierfs.replication.coordination import placement
from tierfs.replication.coordination.cluster_commit import ClusterCommits
from tierfs.replication.coordination.commit_records import (
    CommitEvent,
    CommitRecords,
    CommitTimeout,
    Deletion,
    FileRecord,
)
from tierfs.replication.coordination.etcd import (
    POOL_SIZE,
    WATCH_POOL_SIZE,
    ClusterUrl,
    ClusterUrlError,
    Endpoint,
    Etcd,
    EtcdError,
    EtcdUnavailable,
    LeaseExpired,
    Snapshot,
    WatchCompacted,
    WatchEvent,
    parse_cluster_url,
)
from tierfs.replication.coordination.membership import MemberEvent, Membership, NodeIdInUse

pytestmark = pytest.mark.store

TTL = 2  # seconds: etcd's smallest lease with its default election timeout



def drain(channel: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    """Everything already waiting in `channel`, without waiting for more."""
    items = []
    while True:
        try:
            items.append(channel.receive_nowait())
        except trio.WouldBlock:
            return items

def new_cluster(server: EtcdServer) -> ClusterUrl:
    """A fresh cluster prefix on the shared server, so tests never see each other's keys."""
    return parse_cluster_url(server.cluster_url(f"tierfs-test/{uuid.uuid4().hex[:10]}"))



@asynccontextmanager
async def members(cluster: ClusterUrl, *node_ids: str,
                  ttl: int = TTL) -> AsyncIterator[dict[str, Membership]]:
    """Registered `Membership`s for these node ids, left cleanly (lease revoked) on exit."""
    etcd = Etcd(cluster.endpoints)
    async with trio.open_nursery() as nursery:
        started = {}
        for i, node_id in enumerate(node_ids):
            member = Membership(etcd, cluster, node_id, f"127.0.0.1:{7000 + i}", ttl=ttl)
            await nursery.start(member.run)
            started[node_id] = member
        yield started
        nursery.cancel_scope.cancel()


# --- the --cluster URL -----------------------------------------------------------------------


def test_cluster_url_parses_endpoints_and_prefix() -> None:
    url = parse_cluster_url("etcd://10.0.0.1:2379,etcd-b:2379,[::1]:2380/tierfs/job-7/")
    assert url.endpoints == (Endpoint("10.0.0.1", 2379), Endpoint("etcd-b", 2379),
                             Endpoint("::1", 2380))
    assert url.prefix == "tierfs/job-7"
    assert url.key("members", "n1") == "/tierfs/job-7/members/n1"
    assert str(url) == "etcd://10.0.0.1:2379,etcd-b:2379,[::1]:2380/tierfs/job-7"


@pytest.mark.parametrize("text, says", [
    ("http://h:2379/p", "must start with etcd://"),
    ("h:2379/p", "must start with etcd://"),
    ("etcd:///p", "no etcd endpoint"),
    ("etcd://h:2379", "no key prefix"),
    ("etcd://h:2379/", "no key prefix"),
    ("etcd://h/p", "is not HOST:PORT"),
    ("etcd://h:port/p", "endpoint 'h:port'"),
    ("etcd://h:70000/p", "endpoint 'h:70000'"),
    ("etcd://h:0/p", "port 0"),
    ("etcd://h:2379,/p", "endpoint ''"),
    ("etcd://user@h:2379/p", "is not HOST:PORT"),
    ("etcd://h:2379,h:2379/p", "named twice"),
    ("etcd://h:2379/a//b", "prefix"),
    ("etcd://h:2379/a/../b", "prefix"),
    ("etcd://h:2379/a b", "prefix"),
])
def test_cluster_url_errors_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ClusterUrlError, match="--cluster") as error:
        parse_cluster_url(text)
    assert says in str(error.value)


async def test_unreachable_etcd_is_etcd_unavailable() -> None:
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    etcd = Etcd([Endpoint("127.0.0.1", port)], timeout=0.5)
    with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{port}"):
        await etcd.get("/x")


async def test_second_endpoint_answers_when_first_is_down(etcd_server: EtcdServer) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        dead = Endpoint("127.0.0.1", sock.getsockname()[1])
    cluster = new_cluster(etcd_server)
    etcd = Etcd([dead, *cluster.endpoints], timeout=0.5)
    await etcd.put(cluster.key("k"), b"v")
    kv = await etcd.get(cluster.key("k"))
    assert kv is not None and kv.value == b"v"


async def test_a_watch_from_compacted_history_is_watch_compacted(etcd_server: EtcdServer
                                                                 ) -> None:
    """etcd compacted the history a watch starts from (`--auto-compaction-retention`): the
    watch says so (the follower reads the prefix again) instead of reopening for ever."""
    cluster = new_cluster(etcd_server)
    etcd = Etcd(cluster.endpoints, timeout=2)
    first = await etcd.put(cluster.key("k"), b"1")
    last = await etcd.put(cluster.key("k"), b"2")
    compaction = json.dumps({"revision": str(last), "physical": True}).encode()
    urllib.request.urlopen(urllib.request.Request(  # etcd's own API: tierfs never compacts
        f"http://{cluster.endpoints[0]}/v3/kv/compaction", data=compaction), timeout=5).read()
    send, _receive = trio.open_memory_channel[Any](10)
    with trio.fail_after(10):
        with pytest.raises(WatchCompacted):
            await etcd.watch_prefix(cluster.key(""), first, send)


# --- membership ------------------------------------------------------------------------------


async def test_calls_go_through_while_watches_hold_their_streams(etcd_server: EtcdServer
                                                                 ) -> None:
    """A watch is a stream held open for minutes. Sharing the calls' connection pool, enough
    of them (a node follows several prefixes, a test many) left a call waiting for a
    connection until it timed out, which read as etcd being down."""
    cluster = new_cluster(etcd_server)
    etcd = Etcd(cluster.endpoints, timeout=2)
    send, _receive = trio.open_memory_channel[list[WatchEvent]](1000)
    try:
        now = await etcd.put(cluster.key("start"), b"")  # a revision not compacted away
        watches = grpc_requests(etcd_server)["Watch"]
        async with trio.open_nursery() as nursery:
            for index in range(POOL_SIZE):  # as many as the calls have connections
                nursery.start_soon(etcd.watch_prefix, cluster.key(f"w{index}/"), now, send)
            async def watches_open() -> bool:
                requests = await trio.to_thread.run_sync(grpc_requests, etcd_server)
                return requests["Watch"] >= watches + WATCH_POOL_SIZE  # type: ignore[no-any-return]

            # until the streams the watches' pool allows are open
            await wait_until_async(watches_open, timeout=10, interval=0.05)
            with trio.fail_after(5):
                for index in range(POOL_SIZE):
                    await etcd.put(cluster.key(f"k{index}"), b"v")
                assert (await etcd.get(cluster.key("k0"))).value == b"v"
            # the other watches wait for a stream of their own pool, not a call's connection
            assert grpc_requests(etcd_server)["Watch"] == watches + WATCH_POOL_SIZE
            nursery.cancel_scope.cancel()
    finally:
        await etcd.aclose()


async def test_watch_sees_joins_and_clean_leaves(etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    async with members(cluster, "n2", "n1") as nodes:
        observer = nodes["n1"]
        events = observer.subscribe()
        await wait_until_async(lambda: observer.ring == ["n1", "n2"])
        assert observer.members["n2"].address == "127.0.0.1:7000"
        async with members(cluster, "n3") as late:
            await wait_until_async(lambda: observer.ring == ["n1", "n2", "n3"])
            assert late["n3"].ring == ["n1", "n2", "n3"]  # a joiner sees everyone at once
        left = time.monotonic()
        await wait_until_async(lambda: observer.ring == ["n1", "n2"], timeout=1)
        assert time.monotonic() - left < 1  # a clean leave revokes the lease: no ttl wait
        seen = drain(events)
        assert [(e.kind, e.node_id) for e in seen if e.node_id == "n3"] == \
            [("up", "n3"), ("down", "n3")]


def grpc_requests(server: EtcdServer) -> Counter[str]:
    """Requests etcd has received so far, by gRPC method (the gateway's included)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{server.endpoint}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        match = re.match(r'grpc_server_msg_received_total\{.*grpc_method="(\w+)".*\} (\S+)', line)
        if match:
            counts[match[1]] += int(float(match[2]))
    return counts


async def test_idle_members_cost_one_keepalive_each(etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    ids = [f"n{i}" for i in range(8)]
    async with members(cluster, *ids) as nodes:
        await wait_until_async(lambda: all(node.ring == ids for node in nodes.values()))
        before = grpc_requests(etcd_server)
        idle = 2.0
        await trio.sleep(idle)  # the measured idle period
        delta = grpc_requests(etcd_server) - before
    # No reads, writes or polling of the others: per node only its keepalive, every ttl / 3.
    assert {method for method in delta if method != "LeaseKeepAlive"} <= {"Watch"}, delta
    assert delta["LeaseKeepAlive"] <= len(ids) * (idle / (TTL / 3) + 1)


MEMBER_SCRIPT = """
import sys, trio
from tierfs.replication.coordination.etcd import Etcd, parse_cluster_url
from tierfs.replication.coordination.membership import Membership
cluster = parse_cluster_url(sys.argv[1])
async def main():
    await Membership(Etcd(cluster.endpoints), cluster, sys.argv[2], "127.0.0.1:7999",
                     ttl=int(sys.argv[3])).run()
trio.run(main)
"""


async def test_killed_member_is_down_within_ttl(etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    async with members(cluster, "n1") as nodes:
        observer = nodes["n1"]
        daemon = subprocess.Popen([sys.executable, "-c", MEMBER_SCRIPT, str(cluster), "crash",
                                   str(TTL)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            await wait_until_async(lambda: observer.is_up("crash"), timeout=15)
            os.kill(daemon.pid, signal.SIGKILL)  # no lease revoke: only expiry can tell
            killed = time.monotonic()
            await trio.to_thread.run_sync(daemon.wait)
            await wait_until_async(lambda: not observer.is_up("crash"), timeout=TTL + 1)
            down_after = time.monotonic() - killed
            # admitted until its lease is known dead: it did not register again in its grace
            generation = observer.generation
            assert observer.admits("crash")
            await wait_until_async(lambda: not observer.admits("crash"),
                           timeout=observer.rejoin_grace + 1)
            assert observer.generation > generation
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
        assert down_after <= TTL + 1
        assert observer.ring == ["n1"]


async def test_node_id_held_by_a_live_daemon_elsewhere_is_refused(
        etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    async with members(cluster, "n1") as nodes:
        intruder = Membership(Etcd(cluster.endpoints), cluster, "n1", "127.0.0.1:9999", ttl=TTL)
        with pytest.raises(NodeIdInUse, match="127.0.0.1:7000"):
            await intruder.run()
        assert nodes["n1"].members["n1"].address == "127.0.0.1:7000"
        # The same daemon restarted in place (same address) takes its key over at once.
        again = Membership(Etcd(cluster.endpoints), cluster, "n1", "127.0.0.1:7000", ttl=TTL)
        async with trio.open_nursery() as nursery:
            with trio.fail_after(1):
                await nursery.start(again.run)
            nursery.cancel_scope.cancel()


async def test_lost_lease_registers_again(etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    async with members(cluster, "n1", "n2") as nodes:
        observer, victim = nodes["n1"], nodes["n2"]
        events = observer.subscribe()
        kv = await observer.etcd.get(victim.key)
        assert kv is not None
        await observer.etcd.revoke(kv.lease)  # as if n2 had lost etcd for longer than the ttl
        await observer.etcd.revoke(kv.lease)  # a lease already gone is not an error
        with pytest.raises(LeaseExpired):
            await observer.etcd.keepalive(kv.lease)
        down = await events.receive()
        assert (down.kind, down.node_id) == ("down", "n2")
        # down at once (the ring, what eviction counts), but still admitted (its peer
        # connections, its copies reachable): an etcd that hangs past the ttl ends the leases
        # of live nodes too, and they register again at their next keepalive
        assert not observer.is_up("n2") and observer.ring == ["n1"]
        assert observer.admits("n2") and observer.admitted["n2"].address == "127.0.0.1:7001"
        with trio.fail_after(TTL):  # its next keepalive finds the lease gone
            up = await events.receive()
        assert (up.kind, up.node_id) == ("up", "n2")
        assert observer.ring == ["n1", "n2"]


# --- placement -------------------------------------------------------------------------------


def test_replica_targets_are_the_next_k_live_nodes_after_the_writer() -> None:
    ring = placement.ring(["n3", "n1", "n4", "n2", "n1"])
    assert ring == ["n1", "n2", "n3", "n4"]
    assert placement.replica_targets(ring, "n2", 2) == ["n3", "n4"]
    assert placement.replica_targets(ring, "n4", 2) == ["n1", "n2"]  # wraps around
    assert placement.replica_targets(ring, "n1", 9) == ["n2", "n3", "n4"]  # at most N - 1
    assert placement.replica_targets(["n1"], "n1", 1) == []
    # A writer that is down has no place on the ring: the next live nodes after where it was.
    assert placement.replica_targets(["n1", "n3"], "n2", 1) == ["n3"]


def test_restore_plan_after_a_loss() -> None:
    files = {
        "__0_0.distcp": placement.Placement("n1", frozenset({"n1", "n2"})),
        "__1_0.distcp": placement.Placement("n2", frozenset({"n2", "n3"})),
        "__2_0.distcp": placement.Placement("n3", frozenset({"n3", "n1"})),
    }
    plan = placement.restore_plan(files, ["n1", "n3", "n4"], replicas=1)  # n2 is lost
    assert plan.lost == []
    assert sorted((c.file, c.source, c.target) for c in plan.copies) == [
        ("__0_0.distcp", "n1", "n3"),  # n1 and its next live node n3
        ("__1_0.distcp", "n3", "n4"),  # writer gone: the next two live nodes after it, n3 n4
    ]  # __2_0 still has two live copies (n3, n1): n4 joining the ring moves nothing
    assert plan.for_source("n3") == [placement.Copy("__1_0.distcp", "n3", "n4")]
    both_gone = placement.restore_plan(files, ["n3", "n4"], replicas=1)
    assert "__0_0.distcp" in both_gone.lost


def test_restore_plan_does_not_replace_a_copy_let_go() -> None:
    """K = 2 on n1..n4: n1 wrote f, n2 and n3 hold copies, and n1 evicted its own (`left`)."""
    evicted = placement.Placement("n1", frozenset({"n2", "n3"}), frozenset({"n1"}))
    ring = ["n1", "n2", "n3", "n4"]
    # the writer's leave is no loss: with the writer gone from the holders the file wants K
    assert placement.restore_plan({"f": evicted}, ring, replicas=2).copies == []
    # n2 is lost: one copy, from the first real holder after the writer, to n4: not back to
    # n1, first clockwise from the writer but the node that evicted it
    plan = placement.restore_plan({"f": evicted}, ["n1", "n3", "n4"], replicas=2)
    assert plan.copies == [placement.Copy("f", "n3", "n4")] and plan.lost == []
    # what the records said before: n1 still listed, the planned source, without the bytes
    stale = placement.Placement("n1", frozenset({"n1", "n2", "n3"}))
    assert placement.restore_plan({"f": stale}, ["n1", "n3", "n4"], 2).copies == [
        placement.Copy("f", "n1", "n4")]
    # the writer is dead too: its leave lowers nothing, the ring without it wants K + 1
    assert placement.restore_plan({"f": evicted}, ["n3", "n4"], 2).copies == [
        placement.Copy("f", "n3", "n4")]
    # K = 1 on three nodes: the writer left once n2 held it; nothing to restore
    k1 = placement.Placement("n1", frozenset({"n2"}), frozenset({"n1"}))
    assert placement.restore_plan({"f": k1}, ["n1", "n2", "n3"], replicas=1).copies == []
    # a replica holder left (the step is persisted): its copy is not replaced either
    persisted = placement.Placement("n1", frozenset({"n1"}), frozenset({"n2"}))
    assert placement.restore_plan({"f": persisted}, ["n1", "n2", "n3"], 1).copies == []


def test_restore_plan_with_leavers_is_the_same_on_every_node() -> None:
    """The same records in any order, the ring from any listing: the same plan."""
    files = {f"f{i}": placement.Placement(w, frozenset(h), frozenset(gone)) for i, (w, h, gone)
             in enumerate([("n1", {"n2"}, {"n1"}), ("n2", {"n2", "n4"}, {"n3"}),
                           ("n3", {"n4"}, {"n3", "n1"}), ("n4", {"n1"}, set())])}
    plans = [placement.restore_plan(dict(order), placement.ring(ring), replicas=2)
             for order, ring in [(sorted(files.items()), ["n1", "n2", "n4", "n5"]),
                                 (sorted(files.items(), reverse=True),
                                  ["n5", "n4", "n2", "n1", "n2"])]]
    assert plans[0] == plans[1] and plans[0].copies


node_ids = st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=12,
                    unique=True)


@settings(max_examples=300, deadline=None)
@given(nodes=node_ids, replicas=st.integers(0, 4), data=st.data())
def test_restore_plan_properties_with_leavers(nodes: list[str], replicas: int,
                                              data: st.DataObject) -> None:
    """Holders and leavers drawn at random (disjoint): each file ends with
    min(K + 1, live) - live leavers live holders (or more if it had more), and no copy goes to
    a node that left it."""
    ring = placement.ring(data.draw(st.lists(st.sampled_from(nodes), unique=True)))
    files = {}
    for i in range(data.draw(st.integers(0, 6))):
        holders = frozenset(data.draw(st.lists(st.sampled_from(nodes), unique=True)))
        left = frozenset(data.draw(st.lists(st.sampled_from(nodes), unique=True))) - holders
        files[f"f{i}"] = placement.Placement(data.draw(st.sampled_from(nodes)), holders, left)
    plan = placement.restore_plan(files, ring, replicas)
    live = set(ring)
    for name, where in files.items():
        targets = [c.target for c in plan.copies if c.file == name]
        assert not set(targets) & where.left and len(targets) == len(set(targets))
        if name in plan.lost:
            assert not where.holders & live
            continue
        wanted = min(replicas + 1, len(live)) - len(where.left & live)
        assert len(where.holders & live) + len(targets) == max(len(where.holders & live),
                                                                wanted)


@settings(max_examples=300, deadline=None)
@given(nodes=node_ids, replicas=st.integers(0, 4), data=st.data())
def test_placement_properties(nodes: list[str], replicas: int, data: st.DataObject) -> None:
    ring = placement.ring(nodes)
    writer = data.draw(st.sampled_from(nodes))
    targets = placement.replica_targets(ring, writer, replicas)
    assert writer not in targets
    assert len(targets) == len(set(targets)) == min(replicas, len(ring) - 1)
    assert placement.replica_targets(placement.ring(reversed(nodes)), writer, replicas) == targets
    # Files placed on this ring, then some nodes lost: the plan restores every file that still
    # has a live holder to K + 1 copies (as many as live nodes allow), from live holders only.
    files = {f"f{i}": placement.Placement(w, frozenset(
        [w, *placement.replica_targets(ring, w, replicas)]))
        for i, w in enumerate(data.draw(st.lists(st.sampled_from(nodes), max_size=8)))}
    survivors = data.draw(st.lists(st.sampled_from(nodes), unique=True))
    plan = placement.restore_plan(files, placement.ring(survivors), replicas)
    live = set(survivors)
    for name, where in files.items():
        after = (where.holders & live) | {c.target for c in plan.copies if c.file == name}
        if name in plan.lost:
            assert not where.holders & live
            continue
        assert len(after) == max(len(where.holders & live), min(replicas + 1, len(live)))
    for copy in plan.copies:
        assert copy.source in files[copy.file].holders & live
        assert copy.target in live and copy.target not in files[copy.file].holders
    if live and len(set(nodes) - live) <= replicas:
        assert plan.lost == []  # any K nodes lost (one left at least): nothing lost


# --- shard and commit records ----------------------------------------------------------------


def shard(node: str, i: int) -> FileRecord:
    return FileRecord.sealed(node, 1000 + i, f"{i:032x}")


async def test_concurrent_committers_exactly_one_wins(etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    names = [f"__{i}_0.distcp" for i in range(4)]
    await records.record_files("run/step_10", {n: shard(f"n{i}", i) for i, n in enumerate(names)})
    results = []

    async def commit(node: str) -> None:
        results.append(await records.commit("run/step_10", node, names, timeout=5))

    async with trio.open_nursery() as nursery:
        for node in ("n0", "n1", "n2", "n3", "n4"):
            nursery.start_soon(commit, node)
    assert sorted(won for _, won in results) == [False] * 4 + [True]
    winner = next(record for record, won in results if won)
    assert all(record == winner for record, _ in results)  # the losers learn the same commit
    assert await records.commit_of("run/step_10") == winner


async def test_records_read_again_decode_only_what_changed(
        etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's records are read again and again while it is copied, uploaded and shown
    (10,000 took about 65 ms of the daemon's loop to decode each time): a read decodes only
    the records whose bytes changed since the last, none of those this node wrote itself
    (its seals, which its commit reads back; the copies it recorded), and answers what etcd
    holds now."""
    decoded: list[bytes] = []
    decode = FileRecord.decode
    monkeypatch.setattr(FileRecord, "decode", classmethod(
        lambda _cls, value: decoded.append(value) or decode(value)))
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    other = CommitRecords(Etcd(cluster.endpoints), cluster)  # another node's
    await records.record_files("s/1", {f"f{i}": shard("n0", i) for i in range(50)})
    first = await records.files("s/1")
    assert decoded == []  # the seals this node recorded (a commit reads them back)
    await other.add_holders("s/1", "n1", {"f3": first["f3"].xxh3})
    await other.delete_files("s/1", ["f4"])
    decoded.clear()
    again = await records.files("s/1")
    assert len(decoded) == 1  # f3's
    assert again == {**{name: record for name, record in first.items() if name != "f4"},
                     "f3": first["f3"].with_holder("n1")}
    await records.add_holders("s/1", "n2", {"f5": first["f5"].xxh3})
    assert (await records.files("s/1"))["f5"].holders == ("n0", "n2")
    assert len(decoded) == 1


def count_records_sent(etcd: Etcd) -> list[int]:
    """The number of key-values each `get_prefix` of `etcd` brings, in order, from now on."""
    sent: list[int] = []
    get_prefix = etcd.get_prefix

    async def counted(prefix: str, changed_after: int = 0) -> Snapshot:
        snapshot = await get_prefix(prefix, changed_after)
        sent.append(len(snapshot.kvs))
        return snapshot

    etcd.get_prefix = counted  # type: ignore[method-assign]
    return sent


async def test_a_step_read_again_brings_only_the_records_changed_since(
        etcd_server: EtcdServer) -> None:
    """A status, a copy's plan and an upload's read a step's records again and again: a
    read after the first asks etcd only for the records put since (one here, not 50), and
    still answers what etcd holds now, deletions included (a deletion and a new record
    between two reads leave the count unchanged: read whole again)."""
    cluster = new_cluster(etcd_server)
    etcd = Etcd(cluster.endpoints)
    records = CommitRecords(etcd, cluster)
    sent = count_records_sent(etcd)
    await records.record_files("s/1", {f"f{i:02}": shard("n0", i) for i in range(50)})
    first = await records.files("s/1")
    assert await records.files("s/1") == first and sent == [50, 0]
    await records.add_holders("s/1", "n1", {"f03": first["f03"].xxh3})
    expected = {**first, "f03": first["f03"].with_holder("n1")}
    assert await records.files("s/1") == expected and sent[2:] == [1]
    await records.record_files("s/1", {"f50": shard("n0", 50)})
    again = await records.files("s/1")
    assert again == {**expected, "f50": shard("n0", 50)} and sent[3:] == [1]
    assert list(again) == sorted(again)  # in the keys' order, as a whole read
    await records.delete_files("s/1", ["f04"])
    await records.record_files("s/1", {"f51": shard("n0", 51)})
    expected = {name: record for name, record in again.items() if name != "f04"}
    assert await records.files("s/1") == {**expected, "f51": shard("n0", 51)}
    assert sent[4:] == [1, 51]  # f51 alone, then the step whole: f04 went
    assert await records.files("s/1") == {**expected, "f51": shard("n0", 51)}
    assert sent[6:] == [0]


async def test_reads_of_one_step_at_once_read_it_whole_once(etcd_server: EtcdServer) -> None:
    """Right after a many-file commit the copies' plan, a status and the commit itself read
    the step's records at about the same time (a 50,000-file step's whole read took about
    0.8 s of the daemon's loop): a read that starts while another of the same step is on its
    way waits for it and asks only for what changed since, not for the step whole again."""
    cluster = new_cluster(etcd_server)
    etcd = Etcd(cluster.endpoints)
    records = CommitRecords(etcd, cluster)
    sent = count_records_sent(etcd)
    await records.record_files("s/1", {f"f{i:02}": shard("n0", i) for i in range(50)})
    results: list[dict[str, FileRecord]] = []

    async def read() -> None:
        results.append(await records.files("s/1"))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(read)
    assert sorted(sent) == [0, 0, 50]
    assert results[0] == results[1] == results[2] and len(results[0]) == 50


async def test_a_step_read_again_from_an_etcd_with_another_history_is_read_whole(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """Records read again after etcd was wiped or restored from a backup (its revisions
    start again lower, the same keys under them): what it holds now, not the last read's."""
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    await records.record_files("s/1", {f"f{i}": shard("n0", i) for i in range(5)})
    for node in ("n1", "n2"):  # history the other etcd lacks
        await records.add_holders("s/1", node, {"f0": shard("n0", 0).xxh3})
    await records.files("s/1")
    with EtcdServer(tmp_path / "restored") as restored:
        moved = parse_cluster_url(restored.cluster_url(cluster.prefix))
        elsewhere = CommitRecords(Etcd(moved.endpoints), moved)
        await elsewhere.record_files("s/1", {f"f{i}": shard("n9", i) for i in range(5)})
        records.etcd = records.reads.etcd = elsewhere.etcd
        assert {r.node for r in (await records.files("s/1")).values()} == {"n9"}


async def test_holders_of_many_files_of_a_step_read_before_take_no_read_per_key(
        etcd_server: EtcdServer) -> None:
    """The copies of a step's files are counted right after the step's records were read
    (the copies' plan): the holders of 300 files are written with the keys' versions from
    the step's changes since that read (one range request), not read again 128 keys per
    transaction; a record another node changed meanwhile keeps its change."""
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    other = CommitRecords(Etcd(cluster.endpoints), cluster)
    await records.record_files("s/1", {f"f{i:03}": shard("n0", i) for i in range(300)})
    first = await records.files("s/1")
    await other.add_holders("s/1", "n2", {"f005": first["f005"].xxh3})
    before = grpc_requests(etcd_server)
    found = await records.add_holders("s/1", "n1", {n: r.xxh3 for n, r in first.items()})
    requests = grpc_requests(etcd_server) - before
    assert requests["Txn"] == 3 and requests["Range"] == 1  # 3 x 128 puts, the changes
    assert found["f005"].holders == ("n0", "n1", "n2")
    assert await other.files("s/1") == found
    assert all(record.holders == ("n0", "n1") for name, record in found.items()
               if name != "f005")


class Following(Etcd):
    """The real client; `following` is set once a mirror of a prefix (`follow_prefix`) has
    delivered its first snapshot: its reader has read the keys and waits for changes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.following = trio.Event()

    async def follow_prefix(self, prefix: str,
                            send: trio.abc.SendChannel[Snapshot | list[WatchEvent]]) -> None:
        relay, receive = trio.open_memory_channel[Snapshot | list[WatchEvent]](0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(super().follow_prefix, prefix, relay)
            async for item in receive:
                await send.send(item)
                self.following.set()


async def test_commit_waits_for_every_record(etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    etcd = Following(cluster.endpoints)
    records = CommitRecords(etcd, cluster)
    names = ["a/__0_0.distcp", "__1_0.distcp", ".metadata"]
    await records.record_files("s/1", {".metadata": shard("n0", 0)})
    outcome = []

    async def commit() -> None:
        outcome.append(await records.commit("s/1", "n0", names, timeout=10))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(commit)
        with trio.fail_after(5):  # the committer read the records and waits for the others
            await etcd.following.wait()
        assert await records.commit_of("s/1") is None and not outcome
        await records.record_files("s/1", {"a/__0_0.distcp": shard("n1", 1)})
        await records.record_files("s/1", {"__1_0.distcp": shard("n2", 2)})
    assert outcome[0][1] is True
    assert set(await records.files("s/1")) == set(names)
    with pytest.raises(CommitTimeout, match="never_written") as error:
        await records.commit("s/2", "n0", [".metadata", "never_written"], timeout=0.5)
    assert error.value.missing == [".metadata", "never_written"]
    assert await records.commit_of("s/2") is None


async def test_commit_visible_to_every_watcher_within_a_second(
        etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    etcd = Etcd(cluster.endpoints)
    records = CommitRecords(etcd, cluster)
    await records.record_files("old", {"f": shard("n0", 0)})
    await records.commit("old", "n0", ["f"], timeout=5)
    send, receive = trio.open_memory_channel[CommitEvent](100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(CommitRecords(Etcd(cluster.endpoints), cluster).follow_commits, send)
        first = await receive.receive()  # what was committed before the watch started
        assert (first.kind, first.step) == ("committed", "old")
        await records.record_files("run/step_2", {"f": shard("n0", 1), "g": shard("n1", 2)})
        committed, _ = await records.commit("run/step_2", "n1", ["f", "g"], timeout=5)
        done = time.monotonic()
        with trio.fail_after(1):
            event = await receive.receive()
        assert time.monotonic() - done < 1
        assert event == CommitEvent("committed", "run/step_2", committed, created=True)
        await records.delete_step(Deletion("run/step_2", committed.version, committed.committed_ns))
        with trio.fail_after(1):
            assert await receive.receive() == CommitEvent("removed", "run/step_2", None)
        nursery.cancel_scope.cancel()
    assert await records.files("run/step_2") == {}


def test_file_records_without_left_read_as_before() -> None:
    """`left` is new: a record written before it reads with none, and a record with none is
    written exactly as before (older daemons read it)."""
    old = b'{"holders":["n1","n0"],"node":"n0","size":5,"xxh3":"%s"}' % (b"0" * 32)
    record = FileRecord.decode(old)
    assert record.left == () and record.holders == ("n0", "n1")
    assert record.encode() == b'{"holders":["n0","n1"],"node":"n0","size":5,"xxh3":"%s"}' % (
        b"0" * 32)
    gone = record.left_by("n0")
    assert gone.holders == ("n1",) and gone.left == ("n0",)
    assert FileRecord.decode(gone.encode()) == gone
    assert gone.left_by("n9") == gone  # not a holder: nothing to leave
    assert gone.with_holder("n0") == record  # a copy back: a holder again, not one that left
    assert gone.without_holder("n1").left == ("n0",)


async def test_a_node_leaving_its_copies_and_one_losing_them(etcd_server: EtcdServer) -> None:
    """`leave_files` (an eviction) lists the node in `left`, `drop_holders` (a loss) does
    not; both only for the content given, and only where the node was a holder."""
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    await records.record_files("s", {"a": shard("n0", 0), "b": shard("n0", 1),
                                     "c": shard("n1", 2)})
    await records.add_holders("s", "n1", {"a": shard("n0", 0).xxh3, "b": shard("n0", 1).xxh3})
    found = await records.leave_files("s", "n0", {"a": shard("n0", 0).xxh3,
                                                  "b": "f" * 32,  # another content: kept
                                                  "c": shard("n1", 2).xxh3})  # not held
    assert found["a"].holders == ("n1",) and found["a"].left == ("n0",)
    assert found["b"].holders == ("n0", "n1") and found["c"] == shard("n1", 2)
    await records.drop_holders("s", "n1", {"a": None, "c": None})
    files = await records.files("s")
    assert files["a"].holders == () and files["a"].left == ("n0",)
    assert files["c"].holders == () and files["c"].left == ()
    await records.add_holders("s", "n0", {"a": shard("n0", 0).xxh3})
    assert (await records.files("s"))["a"] == replace(shard("n0", 0), holders=("n0",))


async def test_a_leave_is_refused_when_the_record_lacks_live_holders_at_cas_time(
        etcd_server: EtcdServer) -> None:
    """K = 1 (a copy leaves only while K + 1 = 2 other live holders remain): W wrote "a",
    "b", "c"; R and S hold copies, but R came back with an empty RAM dir and dropped its copy
    of "a" before W's eviction reached etcd (W still believes R holds it). W's guarded leave
    of "a" is refused: the record keeps W; of "b" it goes through, and W is no holder (not
    one that `left`: a later loss of R or S makes a copy again, W may be its target); a dead
    other holder counts for nothing; a persisted step (need 0) leaves whatever the record
    says, listed in `left`."""
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    xxh3 = {name: shard("W", i).xxh3 for i, name in enumerate("abc")}
    await records.record_files("s", {name: shard("W", i) for i, name in enumerate("abc")})
    await records.add_holders("s", "R", xxh3)
    await records.add_holders("s", "S", xxh3)
    await records.drop_holders("s", "R", {"a": None})  # R lost its copy of "a"
    found = await records.leave_files("s", "W", {n: xxh3[n] for n in "ab"}, need=2,
                                      live=lambda _n: True)
    assert found["a"].holders == ("S", "W") and found["a"].left == ()
    assert found["b"].holders == ("R", "S") and found["b"].left == ()
    assert (await records.files("s"))["a"].holders == ("S", "W")
    # R is not live: its listed copy of "c" is not counted
    found = await records.leave_files("s", "W", {"c": xxh3["c"]}, need=2,
                                      live=lambda node: node != "R")
    assert found["c"].holders == ("R", "S", "W") and found["c"].left == ()
    # persisted: nothing is needed elsewhere
    found = await records.leave_files("s", "W", {"a": xxh3["a"]}, need=0)
    assert found["a"].holders == ("S",) and found["a"].left == ("W",)


async def test_two_holders_leaving_at_once_never_drop_a_file_below_k_plus_1(
        etcd_server: EtcdServer) -> None:
    """K = 1, a file held by W, R and S (one copy more than K + 1): R and S evict it at the
    same moment, each seeing two other live holders. The compare-and-swap lets exactly one
    go: two holders remain. Their own view (`ClusterCommits.leave_files`) agrees: the
    one refused keeps its copy in RAM."""
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    names = [f"f{i}" for i in range(20)]
    await records.record_files("s", {name: shard("W", i) for i, name in enumerate(names)})
    xxh3 = {name: shard("W", i).xxh3 for i, name in enumerate(names)}
    await records.add_holders("s", "R", xxh3)
    await records.add_holders("s", "S", xxh3)
    manifest = step_manifest("s", names, "W")
    allowed: dict[str, set[str] | None] = {}

    async def leave(node: str) -> None:
        node_commits = ClusterCommits(CommitRecords(Etcd(cluster.endpoints), cluster), node,
                                      lambda _path: None)
        allowed[node] = await node_commits.leave_files(manifest, names, 2, lambda _n: True)

    async with trio.open_nursery() as nursery:
        for node in ("R", "S"):
            nursery.start_soon(leave, node)
    files = await records.files("s")
    for name in names:
        assert len(files[name].holders) == 2 and "W" in files[name].holders, files[name]
        gone = {"R", "S"} - set(files[name].holders)
        assert {node for node, names_left in allowed.items() if name in (names_left or ())} \
            == gone


async def test_get_all_reads_many_keys_in_few_transactions(etcd_server: EtcdServer) -> None:
    """The keys asked for that exist, across more than one transaction's worth of keys."""
    cluster = new_cluster(etcd_server)
    etcd = Etcd(cluster.endpoints)
    await etcd.put_all([(cluster.key(f"k/{i:04d}"), b"%d" % i) for i in range(300)])
    wanted = [cluster.key(f"k/{i:04d}") for i in range(0, 400, 2)]
    found = await etcd.get_all(wanted)
    assert sorted(found) == wanted[:150]
    assert all(found[k].value == b"%d" % int(k[-4:]) for k in found)


class OverlapEtcd(Etcd):
    """An `Etcd` that notes the most transactions it had in flight at once, and may fail the
    n-th (`fail_at`) with an EtcdError."""

    def __init__(self, endpoints: Any, fail_at: int = 0) -> None:
        super().__init__(endpoints)
        self.in_flight = self.most = self.sent = 0
        self.fail_at = fail_at

    async def _call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.sent += 1
        if self.sent == self.fail_at:
            raise EtcdError("refused (the test's)")
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            return await super()._call(path, payload)
        finally:
            self.in_flight -= 1


async def test_many_keys_go_in_transactions_at_once_and_a_failure_is_the_callers(
        etcd_server: EtcdServer) -> None:
    """The transactions of one call over many keys go several at a time (etcd syncs its log
    once for the writes that reach it together: one after the other, each waited for a disk
    sync of its own); one refused makes the call raise that EtcdError, as before."""
    cluster = new_cluster(etcd_server)
    etcd = OverlapEtcd(cluster.endpoints)
    items = [(cluster.key(f"m/{i:04d}"), b"%d" % i) for i in range(1000)]  # 8 transactions
    await etcd.put_all(items)
    assert etcd.most > 1
    found = await etcd.get_all([key for key, _value in items])
    assert {k: kv.value for k, kv in found.items()} == dict(items)
    failing = OverlapEtcd(cluster.endpoints, fail_at=3)
    with pytest.raises(EtcdError, match="the test's"):
        await failing.put_all(items)


async def test_holders_grow_per_file_under_concurrent_updates(etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    await records.record_files("s", {"__0_0.distcp": shard("n0", 0)})
    await records.record_files("s", {"__1_0.distcp": shard("n1", 1)})
    async with trio.open_nursery() as nursery:
        for node in ("n1", "n2", "n3", "n4", "n5"):
            nursery.start_soon(records.add_holder, "s", "__0_0.distcp", node)
    files = await records.files("s")
    assert files["__0_0.distcp"].holders == ("n0", "n1", "n2", "n3", "n4", "n5")
    assert files["__1_0.distcp"].holders == ("n1",)  # per file, not per step
    await records.drop_holders("s", "n3", {"__0_0.distcp": None})
    assert (await records.files("s"))["__0_0.distcp"].holders == ("n0", "n1", "n2", "n4", "n5")


async def test_large_step_records_are_paged(etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    names = [f"rank{i:05d}/__{i}_0.distcp" for i in range(2500)]  # > 2 pages of 1000
    await records.record_files("big", {n: shard(f"n{i % 7}", i) for i, n in enumerate(names)})
    record, won = await records.commit("big", "n0", names, timeout=10)
    assert won and record.files == 2500
    assert sorted(await records.files("big")) == names


# --- etcd restarted mid-run ------------------------------------------------------------------


async def test_etcd_restart_membership_stays_and_commits_resume(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    await trio.to_thread.run_sync(server.start)
    try:
        cluster = parse_cluster_url(server.cluster_url("restart"))
        records = CommitRecords(Etcd(cluster.endpoints), cluster)
        send, receive = trio.open_memory_channel[CommitEvent](100)
        async with members(cluster, "n1", "n2") as nodes, trio.open_nursery() as nursery:
            n1 = nodes["n1"]
            events: trio.MemoryReceiveChannel[MemberEvent] = n1.subscribe()
            nursery.start_soon(records.follow_commits, send)
            await trio.to_thread.run_sync(server.stop)
            await trio.sleep(TTL / 2 + 0.5)  # keepalives and watches fail meanwhile
            with pytest.raises(EtcdUnavailable):  # not a CommitTimeout blaming the nodes
                await records.commit("s0", "n1", ["f"], timeout=0.5)
            await trio.to_thread.run_sync(server.start)
            # A commit made after the restart reaches the watcher opened before it.
            await records.record_files("s1", {"f": shard("n1", 0)})
            committed, won = await records.commit("s1", "n2", ["f"], timeout=10)
            assert won
            with trio.fail_after(3):
                assert await receive.receive() == CommitEvent("committed", "s1", committed,
                                                              created=True)
            # Membership went on: both still registered, and a new node joining is seen.
            assert n1.ring == ["n1", "n2"]
            async with members(cluster, "n3"):
                await wait_until_async(lambda: n1.ring == ["n1", "n2", "n3"], timeout=3)
            nursery.cancel_scope.cancel()
        # Registration survived or was renewed: nobody was seen down for long, if at all.
        seen = drain(events)
        assert ("up", "n3") in [(e.kind, e.node_id) for e in seen]
    finally:
        await trio.to_thread.run_sync(server.stop)


def big_shard(node: str, i: int) -> FileRecord:
    """The record of a 10 GB shard: 1,280 chunk hashes, about 60 kB of JSON."""
    chunks = [f"{i:016x}{c:016x}" for c in range(1280)]
    entry = (f"__{i}_0.distcp", 10 << 30, f"{i:032x}", 0, 0o100644, chunks, 0, 0)
    return FileRecord.sealed(node, 10 << 30, f"{i:032x}", entry)


async def test_records_of_large_files_fit_etcd_request_and_reply_limits(
        etcd_server: EtcdServer) -> None:
    """A 10 GB shard's record is ~60 kB: 128 of them in one transaction would pass etcd's
    default 1.5 MiB request limit, so records are written in transactions cut by size too;
    they are read back in pages."""
    cluster = new_cluster(etcd_server)
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    names = [f"__{i}_0.distcp" for i in range(300)]
    await records.record_files("huge", {n: big_shard("n0", i) for i, n in enumerate(names)})
    found = await records.files("huge")
    assert sorted(found) == sorted(names)
    assert found["__7_0.distcp"] == big_shard("n0", 7)


class CountingEtcd(Etcd):
    """An `Etcd` that counts its requests by kind (kv/range, kv/txn, ...)."""

    def __init__(self, endpoints: Any) -> None:
        super().__init__(endpoints)
        self.calls: Counter[str] = Counter()

    async def _call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.calls[path] += 1
        return await super()._call(path, payload)


def entries(names: list[str]) -> list[mf.FileEntry]:
    return [mf.FileEntry(name, 10 + i, f"{i:032x}", chunks=(f"{i:016x}",))
            for i, name in enumerate(names)]


def step_manifest(path: str, names: list[str], node: str) -> mf.StepManifest:
    return mf.StepManifest(path, 1, 1, node, time.time_ns(), tuple(entries(names)))


def commits(cluster: ClusterUrl, node: str) -> tuple[ClusterCommits, CountingEtcd]:
    etcd = CountingEtcd(cluster.endpoints)
    return ClusterCommits(CommitRecords(etcd, cluster), node, lambda name: 1), etcd


async def test_seals_are_recorded_in_batches_not_one_request_each(
        etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    node, etcd = commits(cluster, "n0")
    names = [f"__{i}_0.distcp" for i in range(600)]
    async with trio.open_nursery() as nursery:  # 600 closes at once, as 600 ranks' shards
        for entry in entries(names):
            nursery.start_soon(node.record_sealed, "run/step_1", [entry])
    assert sorted(await node.records.files("run/step_1")) == sorted(names)
    assert etcd.calls["kv/txn"] <= 20, etcd.calls


async def test_seals_one_after_another_are_gathered_into_few_requests(
        etcd_server: EtcdServer) -> None:
    """A save of many small files seals one every half millisecond or so: each batch gathers
    the seals of a while (SEAL_GATHER), not the one or two that came during the last
    request (one request per file or two made such a save 2.5x slower on a cluster node)."""
    cluster = new_cluster(etcd_server)
    node, etcd = commits(cluster, "n0")
    names = [f"t{i:05}.distcp" for i in range(400)]
    async with trio.open_nursery() as nursery:
        for entry in entries(names):
            nursery.start_soon(node.record_sealed, "run/step_1", [entry])
            await trio.sleep(0.0005)
    assert sorted(await node.records.files("run/step_1")) == sorted(names)
    assert etcd.calls["kv/txn"] <= 40, etcd.calls


async def test_publish_reads_the_step_once_and_drops_stale_records_in_batches(
        etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    node0, etcd = commits(cluster, "n0")
    node1, _etcd1 = commits(cluster, "n1")
    theirs = [f"__{i}_0.distcp" for i in range(1, 1500, 2)]
    mine = [f"__{i}_0.distcp" for i in range(0, 1500, 2)]
    stale = [f"tmp/{i}.part" for i in range(400)]
    await node1.records.record_files("s/step_1", {e.name: node1._record(e, 0)
                                                  for e in entries(theirs + stale)})
    etcd.calls.clear()
    await node0.publish(step_manifest("s/step_1", sorted(mine + theirs), "n0"), set(mine))
    calls = dict(etcd.calls)
    assert calls["kv/range"] == 2, calls  # the step's records: 2 pages, read once
    assert calls["kv/txn"] <= 12 and "kv/deleterange" not in calls, calls
    assert sorted(await node0.records.files("s/step_1")) == sorted(mine + theirs)
    assert (await node0.records.commit_of("s/step_1")).files == 1500


async def test_follow_does_not_read_this_nodes_own_commit_again(
        etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    node0, etcd = commits(cluster, "n0")
    node1, _etcd1 = commits(cluster, "n1")
    learned: list[tuple[str, list[str]]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node0.follow, lambda m, holders: learned.append((m.path, holders)))
        await wait_until_async(lambda: etcd.calls["kv/range"] >= 1)  # following
        await node0.publish(step_manifest("a/step_1", ["x"], "n0"), {"x"})
        await node1.publish(step_manifest("b/step_1", ["y"], "n1"), {"y"})
        await wait_until_async(lambda: learned)
        nursery.cancel_scope.cancel()
    assert learned == [("b/step_1", ["n1"])]  # its own commit a/step_1: not read again


async def test_publish_does_not_write_again_what_the_seals_recorded(
        etcd_server: EtcdServer) -> None:
    cluster = new_cluster(etcd_server)
    node0, etcd = commits(cluster, "n0")
    names = [f"__{i}_0.distcp" for i in range(1000)]
    await node0.record_sealed("s/step_2", entries(names))
    etcd.calls.clear()
    await node0.publish(step_manifest("s/step_2", names, "n0"), set(names))
    assert dict(etcd.calls) == {"kv/range": 1, "kv/txn": 1}  # one read, the commit
    assert (await node0.records.commit_of("s/step_2")).files == 1000


async def test_a_temp_file_sealed_before_the_commit_leaves_no_record_after_it(
        etcd_server: EtcdServer) -> None:
    """DCP's `.metadata.tmp` is sealed at its close, renamed to `.metadata`, and the step
    commits: its seal waits in the next batch while another batch is written, and the
    commit that follows drops it. The step's records are its files alone (the temp file's
    record was written after the commit had dropped it, and `sync-replicas` waited for
    copies of a file the step does not have)."""
    cluster = new_cluster(etcd_server)
    node0, _etcd = commits(cluster, "n0")
    names = ["__0_0.distcp", "__1_0.distcp", ".metadata"]
    for attempt in range(6):
        path = f"run/step_{attempt}"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node0.record_sealed, path, entries(names[:2]))
            await trio.testing.wait_all_tasks_blocked()  # that batch is being written
            nursery.start_soon(node0.record_sealed, path, entries([".metadata.tmp"]))
            await trio.testing.wait_all_tasks_blocked()  # the temp file waits for the next
            nursery.start_soon(node0.publish, step_manifest(path, names, "n0"), set(names))
        assert sorted(await node0.records.files(path)) == sorted(names), attempt


async def test_the_seals_of_a_step_saved_again_after_a_delete_are_recorded(
        etcd_server: EtcdServer) -> None:
    """A step committed here, deleted, and saved again at the same path (its versions start
    over): the new save's seals are recorded, for the node that commits it to find."""
    cluster = new_cluster(etcd_server)
    node0, _etcd = commits(cluster, "n0")
    names = ["__0_0.distcp", ".metadata"]
    first = step_manifest("run/step_1", names, "n0")
    await node0.record_sealed(first.path, list(first.files))
    await node0.publish(first, set(names))
    await node0.forget(first.path, first.version, first.committed_ns)
    assert await node0.records.files(first.path) == {}
    await node0.record_sealed(first.path, entries(["__0_0.distcp"]), base=0)
    assert sorted(await node0.records.files(first.path)) == ["__0_0.distcp"]


async def test_single_file_steps_are_made_again_from_their_records(
        etcd_server: EtcdServer) -> None:
    """A file step and a loose file (no step number in its name) come back from etcd's
    records alone, as what they are (no peer gives their manifest: the fallback)."""
    cluster = new_cluster(etcd_server)
    node0, _etcd = commits(cluster, "n0")
    node1 = ClusterCommits(CommitRecords(Etcd(cluster.endpoints), cluster), "n1",
                           lambda name: None)  # the directory pattern knows neither name
    for path, number in (("run/epoch=0-step=5.ckpt", 5), ("run/last.ckpt", mf.NO_STEP)):
        name = path.rpartition("/")[2]
        manifest = mf.StepManifest(path, number, 1, "n0", time.time_ns(),
                                   tuple(entries([name])), single_file=True)
        await node0.publish(manifest, {name})
        found = await node1.manifest_of(path)
        assert found is not None and found[0] == manifest


async def test_a_version_published_while_an_older_one_is_forgotten_keeps_its_records(
        etcd_server: EtcdServer) -> None:
    """A step renamed away and back at once (`mv run run_q; mv run_q run`): the writer's
    delete of the old version from etcd and its commit of the new one at the same path run
    at the same time. The new version keeps its commit record and every file record, and
    neither names a node that held only the old version (the delete removed the new
    version's file records, and the commit record took the old one's holders: the
    replicator saw no copy to make, and status counted a copy nobody had)."""
    cluster = new_cluster(etcd_server)
    node0, _etcd = commits(cluster, "n0")
    names = ["a", "b", "c"]
    for attempt in range(12):
        path = f"run/step_{attempt}"
        old = step_manifest(path, names, "n0")
        await node0.publish(old, set(names))
        await node0.add_holders(old, "n1", names)
        new = replace(old, version=3, committed_ns=time.time_ns())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node0.forget, path, old.version, old.committed_ns)
            nursery.start_soon(node0.publish, new, set(names))
        record = await node0.records.commit_of(path)
        assert record is not None and record.version == 3, (attempt, record)
        assert record.holders == ("n0",), (attempt, record)
        files = await node0.records.files(path)
        assert sorted(files) == names, (attempt, files)
        assert all(f.holders == ("n0",) for f in files.values()), (attempt, files)


async def a_losing_writes_record(etcd_server: EtcdServer) -> tuple[
        ClusterCommits, ClusterCommits, mf.StepManifest, mf.FileEntry, mf.FileEntry]:
    """n0 committed hf/checkpoint-6 with its trainer_state.json (`ours`); n1 wrote the same
    path with other bytes in the same save (`theirs`) and its seal landed after n0's commit,
    leaving the file's record with n1's bytes."""
    cluster = new_cluster(etcd_server)
    node0, _etcd0 = commits(cluster, "n0")
    node1, _etcd1 = commits(cluster, "n1")
    ours = mf.FileEntry("trainer_state.json", 10, f"{1:032x}", chunks=(f"{1:016x}",))
    theirs = mf.FileEntry("trainer_state.json", 11, f"{2:032x}", chunks=(f"{2:016x}",))
    manifest = mf.StepManifest("hf/checkpoint-6", 1, 1, "n0", time.time_ns(), (ours,))
    await node0.record_sealed(manifest.path, [ours])
    await node0.publish(manifest, {ours.name})
    await node1.record_sealed(manifest.path, [theirs])
    return node0, node1, manifest, ours, theirs


async def test_a_copy_of_the_committed_bytes_counts_over_a_record_of_a_losing_write(
        etcd_server: EtcdServer) -> None:
    """Two nodes wrote trainer_state.json with other bytes in the same save (HF's
    `save_on_each_node`) and committed at once; the cluster recorded n0's commit, and n1's
    seal left the file's record with n1's bytes. n0's copy to n1 is then counted: the record
    becomes the committed one (n0's bytes, held on n0 and n1). Before, every copy of it was
    refused ("etcd did not record the copies"), and the step stayed short of copies for good.
    A record of a later save (its `base` the committed version) is left as it is."""
    node0, node1, manifest, ours, theirs = await a_losing_writes_record(etcd_server)
    found = await node0.add_holders(manifest, "n1", [ours.name])
    assert found[ours.name].xxh3 == ours.xxh3 and found[ours.name].holders == ("n0", "n1")
    record = (await node0.records.files(manifest.path))[ours.name]
    assert (record.xxh3, record.holders) == (ours.xxh3, ("n0", "n1"))
    await node1.record_sealed(manifest.path, [theirs], base=1)  # a re-save over v1
    found = await node0.add_holders(manifest, "n1", [ours.name])
    assert found[ours.name].xxh3 == theirs.xxh3  # the later save's record stays


async def test_the_committer_copies_a_file_whose_record_a_losing_write_left(
        etcd_server: EtcdServer) -> None:
    """As above, but n1 lost its own bytes with the commit and holds no copy to count: the
    record with n1's bytes kept n0 from planning any copy of the file (its records named no
    node holding the committed bytes), and the step short of copies for good. The records
    n0's replicator reads make it this version's, held on n0, once n0 holds those bytes; a
    node that does not hold them, or a record of a later save, leaves it as it is."""
    node0, node1, manifest, ours, theirs = await a_losing_writes_record(etcd_server)

    def holds(xxh3: str) -> Callable[[str, str, str], bool]:
        return lambda path, name, found: (path, name, found) == (manifest.path, ours.name, xxh3)

    assert await node0.placements(manifest) == {}
    assert await node1.placements(manifest, holds(theirs.xxh3)) == {}
    found = await node0.placements(manifest, holds(ours.xxh3))
    assert found is not None and (found[ours.name].xxh3, found[ours.name].holders) == (
        ours.xxh3, ("n0",))
    await node1.record_sealed(manifest.path, [theirs], base=1)  # a re-save over v1
    assert await node0.placements(manifest, holds(ours.xxh3)) == {}
