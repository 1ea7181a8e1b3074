"""The replicator and the receiver in one process, each with its collaborators injected: two
endpoints on 127.0.0.1 (a Membership and Replicator for the sender, a PeerServer and
ReplicaReceiver for the receiver), members of a real etcd, no mount. A failure here is in the
peer layer."""

from __future__ import annotations

import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from tests.conftest import free_port
from tierfs import manifest as mf
from tierfs.cluster import membership as live_members
from tierfs.cluster.etcd import Etcd, parse_cluster_url
from tierfs.devtools.etcd import Etcd as EtcdServer
from tierfs.replication.channel import connect
from tierfs.replication.membership import Membership
from tierfs.replication.peer_reader import RangeServer
from tierfs.replication.protocol import ProtocolError
from tierfs.replication.receiver import ReplicaReceiver
from tierfs.replication.replicator import Replicator
from tierfs.replication.server import PeerServer

TOKEN = b"layer-test-token"


class Space:
    """The RAM store's accounting, as the receiver sees it: bytes per incoming inode."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used: dict[int, int] = {}

    def grow(self, backing_ino: int, new_end: int) -> None:
        if sum(self.used.values()) - self.used.get(backing_ino, 0) + new_end > self.limit:
            raise OSError("full")
        self.used[backing_ino] = max(self.used.get(backing_ino, 0), new_end)

    def forget_inode(self, backing_ino: int) -> None:
        self.used.pop(backing_ino, None)


def committed_object(objects: Path, data: bytes, name: str) -> mf.FileEntry:
    """A committed file in a RAM store's objects/ dir, as the commit leaves it."""
    objects.mkdir(exist_ok=True)
    staging = objects / "staging"
    staging.write_bytes(data)
    digest = mf.hash_file(staging)
    staging.rename(objects / digest.xxh3)
    return mf.FileEntry(name, digest.size, digest.xxh3, chunks=digest.chunks)


class Receiving:
    """Node b: the peer port with the receiver's handlers, adopting every complete replica."""

    def __init__(self, tmp: Path, limit: int = 1 << 30) -> None:
        self.objects = tmp / "b-objects"
        self.objects.mkdir()
        self.space = Space(limit)
        self.adopted: list[tuple[mf.StepManifest, str]] = []
        self.receiver = ReplicaReceiver(self.objects, self.space, self._adopt)
        self.port = free_port()

    def _adopt(self, manifest: mf.StepManifest, peer: str) -> bool:
        self.adopted.append((manifest, peer))
        return True

    async def start(self, nursery: trio.Nursery) -> None:
        server = PeerServer("b", TOKEN, {"a", "b"}, {"PUT": self.receiver.put,
                                                    "PUT_MANIFEST": self.receiver.put_manifest})
        await nursery.start(server.run, "127.0.0.1", self.port)


async def test_a_committed_step_arrives_whole_and_verified(tmp_path: Path,
                                                          etcd_server: EtcdServer) -> None:
    data = os.urandom(mf.CHUNK_SIZE + 12345)  # two chunks: offsets matter
    entry = committed_object(tmp_path / "a-objects", data, "shard")
    small = committed_object(tmp_path / "a-objects", b"m", ".metadata")
    manifest = mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry, small))
    b = Receiving(tmp_path)
    holders: set[str] = set()
    replicated = trio.Event()

    def on_replicated(done: mf.StepManifest, target: str) -> None:
        holders.add(target)
        replicated.set()

    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        cluster = parse_cluster_url(etcd_server.cluster_url(f"layer/{uuid.uuid4().hex[:8]}"))
        etcd = Etcd(cluster.endpoints)
        live = {}
        for node_id, port in (("a", free_port()), ("b", b.port)):
            live[node_id] = live_members.Membership(etcd, cluster, node_id, f"127.0.0.1:{port}")
            await nursery.start(live[node_id].run)
        with trio.fail_after(10):
            while live["a"].ring != ["a", "b"]:
                await live["a"].changed.wait()
        membership = Membership(live["a"], TOKEN)
        replicator = Replicator(membership, 1, lambda xxh3: str(tmp_path / "a-objects" / xxh3),
                                is_current=lambda m: True, holders=lambda m: holders,
                                on_replicated=on_replicated)
        nursery.start_soon(replicator.run)
        replicator.submit(manifest)
        with trio.fail_after(20):
            await replicated.wait()
        nursery.cancel_scope.cancel()
    assert holders == {"b"}
    assert (b.objects / entry.xxh3).read_bytes() == data
    assert (b.objects / small.xxh3).read_bytes() == b"m"
    assert b.adopted == [(manifest, "a")]
    assert sorted(os.listdir(b.objects)) == sorted([entry.xxh3, small.xxh3])  # no leftovers


async def test_the_receiver_refuses_bytes_that_do_not_match_their_checksum(
        tmp_path: Path) -> None:
    b = Receiving(tmp_path)
    entry = committed_object(tmp_path / "a-objects", b"the real bytes", "shard")
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await channel.send("PUT", b"other bytes, same size", path="run/step_1",
                           name="shard", xxh3=entry.xxh3, size=22, offset=0)
        answer = await channel.receive("ERROR")
        assert "checksum mismatch" in answer["message"]
        # a manifest naming a file that never arrived is not adopted
        manifest = mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry,))
        await channel.send("PUT_MANIFEST", manifest=mf.encode(manifest))
        answer = await channel.receive("ERROR")
        assert "was not received" in answer["message"]
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert os.listdir(b.objects) == [] and b.adopted == [] and b.space.used == {}


async def test_a_full_receiver_answers_an_error_and_keeps_nothing(tmp_path: Path) -> None:
    b = Receiving(tmp_path, limit=10)
    entry = committed_object(tmp_path / "a-objects", b"more than ten bytes", "shard")
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await channel.send("PUT", b"more than ten bytes", path="run/step_1", name="shard",
                           xxh3=entry.xxh3, size=entry.size, offset=0)
        answer = await channel.receive("ERROR")
        assert "RAM tier full" in answer["message"]
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert not (b.objects / entry.xxh3).exists()


async def test_steps_of_many_chunks_go_over_one_kept_alive_connection(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    """Chunks pipelined from the RAM store (sendfile), two steps, one handshake in all."""
    data = os.urandom(3 * mf.CHUNK_SIZE + 777)
    entries = [committed_object(tmp_path / "a-objects", data[i:], f"shard{i}") for i in (0, 1)]
    manifests = [mf.StepManifest(f"run/step_{i}", 1, 1, "a", 0, (e,))
                 for i, e in enumerate(entries)]
    b = Receiving(tmp_path)
    done: list[str] = []
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        cluster = parse_cluster_url(etcd_server.cluster_url(f"layer/{uuid.uuid4().hex[:8]}"))
        etcd = Etcd(cluster.endpoints)
        live = {}
        for node_id, port in (("a", free_port()), ("b", b.port)):
            live[node_id] = live_members.Membership(etcd, cluster, node_id, f"127.0.0.1:{port}")
            await nursery.start(live[node_id].run)
        with trio.fail_after(10):
            while live["a"].ring != ["a", "b"]:
                await live["a"].changed.wait()
        membership = Membership(live["a"], TOKEN)
        replicator = Replicator(membership, 1, lambda xxh3: str(tmp_path / "a-objects" / xxh3),
                                is_current=lambda m: True,
                                holders=lambda m: {"b"} if m.path in done else set(),
                                on_replicated=lambda m, target: done.append(m.path))
        nursery.start_soon(replicator.run)
        for manifest in manifests:
            replicator.submit(manifest)
        with trio.fail_after(20):
            while len(done) < 2:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert membership.pool.opened == 1
    for i, entry in enumerate(entries):
        assert (b.objects / entry.xxh3).read_bytes() == data[i:]


async def test_ranges_are_served_from_the_ram_store_in_order(tmp_path: Path) -> None:
    """GETs pipelined on one connection, answered in order by sendfile from the object; a
    range past the end is short, as pread is; a missing object is an ERROR."""
    data = os.urandom(2 * mf.CHUNK_SIZE + 5)
    entry = committed_object(tmp_path / "b-objects", data, "shard")
    ranges = RangeServer(tmp_path / "b-objects", lambda path, name, digest: None)
    port = free_port()
    wanted = [(mf.CHUNK_SIZE, mf.CHUNK_SIZE), (0, mf.CHUNK_SIZE), (len(data) - 3, 100),
              (2 * mf.CHUNK_SIZE, mf.CHUNK_SIZE)]
    replies: list[bytes] = []
    async with trio.open_nursery() as nursery:
        server = PeerServer("b", TOKEN, {"a", "b"}, {"GET": ranges.on_get})
        await nursery.start(server.run, "127.0.0.1", port)
        channel = await connect("127.0.0.1", port, TOKEN, "a", {"a", "b"}, "b")

        def get(offset: int, length: int, digest: str = entry.xxh3
                ) -> Callable[[], Awaitable[None]]:
            return lambda: channel.send("GET", path="run/step_1", name="shard", xxh3=digest,
                                        offset=offset, length=length)

        await channel.pipeline([get(*r) for r in wanted], "DATA",
                               on_reply=lambda m: replies.append(bytes(m.payload)))
        with pytest.raises(ProtocolError, match="not in this node's RAM"):
            await channel.pipeline([get(0, 1), get(0, 1, "0" * 32)], "DATA")
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert replies == [data[o:o + n] for o, n in wanted]
    assert ranges.served_bytes == sum(len(r) for r in replies) + 1
