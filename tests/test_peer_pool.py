"""Kept-alive peer connections (PeerDirectory.channel and its pool) against a real PeerServer on
127.0.0.1, members of a real etcd: how many connections (handshakes) requests cost, that a
connection left out of step with its peer is never lent again, that a peer's restart or
departure does not leave dead connections to lend, and that borrowers wait beyond PER_PEER."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import trio

from tests.conftest import free_port
from tests.waiting import wait_until_async
from tierfs.devtools.etcd import Etcd as EtcdServer
from tierfs.replication.coordination import membership as live_members
from tierfs.replication.coordination.etcd import Etcd, parse_cluster_url
from tierfs.replication.peers import pool
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import PeerChannel, connect
from tierfs.replication.peers.directory import PeerDirectory
from tierfs.replication.peers.server import PeerServer

pytestmark = pytest.mark.store

TOKEN = b"pool-test-token"


class Peer:
    """Node b: a PeerServer that answers PING, and VERIFY after `slow` seconds, counting the
    connections (handshakes) it served and the requests it has in progress at once."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections: dict[int, PeerChannel] = {}  # held: ids stay unique
        self.busy = 0
        self.most_busy = 0
        self.slow = 0.0
        self.scope = trio.CancelScope()

    async def _ping(self, message: proto.Message, channel: PeerChannel) -> None:
        self.connections[id(channel)] = channel
        await channel.send("PONG", node_id="b")

    async def _verify(self, message: proto.Message, channel: PeerChannel) -> None:
        self.connections[id(channel)] = channel
        self.busy += 1
        self.most_busy = max(self.most_busy, self.busy)
        try:
            await trio.sleep(self.slow)
        finally:
            self.busy -= 1
        await channel.send("VERIFIED", state="good")

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        server = PeerServer("b", TOKEN, {"a", "b"}, {"PING": self._ping, "VERIFY": self._verify})
        with self.scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run, "127.0.0.1", self.port)
                task_status.started()

    def stop(self) -> None:
        """Gone: the listener and every connection closed."""
        self.scope.cancel()
        self.scope = trio.CancelScope()


class Cluster:
    def __init__(self, etcd_server: EtcdServer) -> None:
        self.url = parse_cluster_url(etcd_server.cluster_url(f"pool/{uuid.uuid4().hex[:8]}"))
        self.etcd = Etcd(self.url.endpoints)
        self.b = Peer(free_port())
        self.b_scope = trio.CancelScope()
        self.a: PeerDirectory

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self.b.serve)
        live_a = live_members.Membership(self.etcd, self.url, "a", f"127.0.0.1:{free_port()}")
        await nursery.start(live_a.run)
        await nursery.start(self._b_member)
        with trio.fail_after(10):
            while live_a.ring != ["a", "b"]:
                await live_a.changed.wait()
        self.a = PeerDirectory(live_a, TOKEN)
        nursery.start_soon(self.a.run)
        # a's probe of b's handshake: the pool's first connection
        await wait_until_async(lambda: self.a.pool.idle_count() == 1, timeout=10)

    async def _b_member(self, task_status: trio.TaskStatus[None]) -> None:
        live_b = live_members.Membership(self.etcd, self.url, "b", f"127.0.0.1:{self.b.port}")
        with self.b_scope:
            await live_b.run(task_status=task_status)

    async def ping(self) -> None:
        async with self.a.channel("b") as channel:
            await channel.request("PING", node_id="a", expect="PONG")


@pytest.fixture
async def cluster(etcd_server: EtcdServer) -> AsyncIterator[Cluster]:
    cluster = Cluster(etcd_server)
    async with trio.open_nursery() as nursery:
        await cluster.start(nursery)
        yield cluster
        nursery.cancel_scope.cancel()


async def test_many_requests_share_one_connection(cluster: Cluster) -> None:
    for _ in range(20):
        await cluster.ping()
    assert len(cluster.b.connections) == 1 and cluster.a.pool.opened == 1


async def test_a_connection_out_of_step_is_never_lent_again(cluster: Cluster) -> None:
    await cluster.ping()
    cluster.b.slow = 30.0
    with trio.move_on_after(0.3):  # cancelled while the peer works on the request
        async with cluster.a.channel("b") as channel:
            await channel.request("VERIFY", path="run/step_1", name="f", xxh3="a" * 32,
                                  repair=False, expect="VERIFIED")
    cluster.b.slow = 0.0
    async with cluster.a.channel("b") as channel:  # a request left unanswered
        await channel.send("PING", node_id="a")
    with pytest.raises(proto.ProtocolError):  # the peer answers ERROR
        async with cluster.a.channel("b") as channel:
            await channel.request("VERIFY", path="run/step_1", name="f", xxh3="a" * 32,
                                  repair=False, expect="PONG")
    await cluster.ping()  # a late VERIFIED or PONG on a reused connection would fail this
    assert cluster.a.pool.opened == 4  # the first, then one after each of the three


async def test_a_dead_peers_idle_connection_is_replaced(cluster: Cluster) -> None:
    await cluster.ping()
    cluster.b.stop()
    async with trio.open_nursery() as nursery:  # back at the same address
        await nursery.start(cluster.b.serve)
        await cluster.ping()
        nursery.cancel_scope.cancel()
    assert cluster.a.pool.opened == 2


async def test_borrowers_beyond_per_peer_wait(cluster: Cluster) -> None:
    cluster.b.slow = 0.2

    async def verify() -> None:
        async with cluster.a.channel("b") as channel:
            await channel.request("VERIFY", path="run/step_1", name="f", xxh3="a" * 32,
                                  repair=False, expect="VERIFIED")

    async with trio.open_nursery() as nursery:
        for _ in range(3 * pool.PER_PEER):
            nursery.start_soon(verify)
    assert cluster.b.most_busy == pool.PER_PEER
    assert cluster.a.pool.opened == pool.PER_PEER == cluster.a.pool.idle_count()


async def test_idle_connections_close_when_the_peer_leaves(cluster: Cluster) -> None:
    await cluster.ping()
    assert cluster.a.pool.idle_count() == 1
    cluster.b_scope.cancel()  # b leaves the live members (its lease revoked)
    await wait_until_async(lambda: not cluster.a.pool.idle_count(), timeout=10, interval=0.02)
    with pytest.raises(OSError, match="not a live member"):
        await cluster.ping()


async def test_idle_connections_close_before_the_server_drops_them(cluster: Cluster) -> None:
    await cluster.ping()
    cluster.a.pool.max_idle = 0.1  # the server's IDLE_TIMEOUT, scaled down
    await trio.sleep(0.2)
    await cluster.a.pool.sweep(cluster.a._live_keys())
    assert cluster.a.pool.idle_count() == 0
    await cluster.ping()
    assert cluster.a.pool.opened == 2
    assert pool.MAX_IDLE + pool.SWEEP_EVERY < pool.IDLE_TIMEOUT


async def test_a_connection_under_this_nodes_own_id_may_only_ping() -> None:
    """The peer port lets this node's own id in for the check at mount that the node reaches
    itself at its advertised address: a PING. A second node started with the same id and the
    token must not store, read or delete anything through it."""
    token, port = b"t" * 32, free_port()
    asked: list[str] = []

    async def manifest(message: proto.Message, channel: PeerChannel) -> None:
        asked.append(message.type)

    async with trio.open_nursery() as nursery:
        await nursery.start(PeerServer("b", token, {"a", "b"}, {"MANIFEST": manifest}).run,
                            "127.0.0.1", port)
        channel = await connect("127.0.0.1", port, token, "b", {"a", "b"}, "b")
        await channel.request("PING", node_id="b", expect="PONG")
        await channel.send("MANIFEST", path="run/step_1", version=1, offset=0)
        with pytest.raises(proto.ProtocolError):  # the server drops the connection
            await channel.receive(timeout=5)
        await channel.aclose()
        assert asked == []
        nursery.cancel_scope.cancel()
