"""The replicator and the receiver in one process, each with its collaborators injected: two
endpoints on 127.0.0.1 (a PeerDirectory and Replicator for the sender, a PeerServer and
ReplicaReceiver for the receiver), members of a real etcd, no mount. A failure here is in the
peer layer."""

from __future__ import annotations

import collections
import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.conftest import free_port
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd as EtcdServer
from tierfs.fs.store.ram_store import RamFull
from tierfs.observe import Events
from tierfs.replication.coordination import membership as live_members
from tierfs.replication.coordination.commit_records import FileRecord
from tierfs.replication.coordination.etcd import Etcd, parse_cluster_url
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import ConnectionClosed, PeerChannel, connect
from tierfs.replication.peers.directory import PeerDirectory
from tierfs.replication.peers.peer_reader import PeerReader, RangeServer
from tierfs.replication.peers.protocol import ProtocolError
from tierfs.replication.peers.receiver import INCOMING_PREFIX, ReplicaReceiver
from tierfs.replication.peers.replicator import RETRY_LATER, SMALL_FILE, Replicator, deal
from tierfs.replication.peers.server import PeerServer

pytestmark = pytest.mark.store

TOKEN = b"layer-test-token"


class Space:
    """The RAM store's accounting, as the receiver sees it: bytes per incoming inode."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used: dict[int, int] = {}

    def grow(self, backing_ino: int, new_end: int) -> None:
        if sum(self.used.values()) - self.used.get(backing_ino, 0) + new_end > self.limit:
            raise RamFull(f"{new_end} bytes do not fit in {self.limit}")
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
    """Node b: the peer port with the receiver's handlers, holding every file of the known
    manifests whose object arrived (as `OtherTiers.hold_files` does)."""

    def __init__(self, tmp: Path, *manifests: mf.StepManifest, limit: int = 1 << 30,
                 batches: bool = True, **options: Any) -> None:
        self.objects = tmp / "b-objects"
        self.objects.mkdir()
        self.space = Space(limit)
        self.manifests = {(m.path, m.version): m for m in manifests}
        self.held: list[tuple[str, int, list[str], str]] = []
        self.receiver = ReplicaReceiver(self.objects, self.space, self._hold, **options)
        self.port = free_port()
        self.put_channels: set[int] = set()  # the connections PUTs came over
        self.messages: collections.Counter[str] = collections.Counter()  # PUT, PUT_FILES
        self.batches = batches  # False: as a daemon that does not know PUT_FILES

    async def _hold(self, path: str, version: int, names: list[str],
                    peer: str) -> list[str] | None:
        manifest = self.manifests.get((path, version))
        if manifest is None:
            return None
        here = [n for n in names if (entry := manifest.entry(n)) is not None
                and (self.objects / entry.xxh3).exists()]
        self.held.append((path, version, here, peer))
        return here

    async def _put(self, message: proto.Message, channel: PeerChannel) -> None:
        self.put_channels.add(id(channel))
        self.messages[message.type] += 1
        await self.receiver.put(message, channel)

    async def _put_files(self, message: proto.Message, channel: PeerChannel) -> None:
        self.messages[message.type] += 1
        await self.receiver.put_files(message, channel)

    async def start(self, nursery: trio.Nursery) -> None:
        handlers = {"PUT": self._put, "HOLD": self.receiver.hold}
        if self.batches:
            handlers["PUT_FILES"] = self._put_files
        server = PeerServer("b", TOKEN, {"a", "b"}, handlers, streamed={"PUT"})
        await nursery.start(server.run, "127.0.0.1", self.port)


def records_of(manifest: mf.StepManifest, holders: set[str]) -> dict[str, FileRecord]:
    """The step's file records as etcd would have them: written on a, held by `holders`."""
    return {e.name: FileRecord(manifest.node_id, e.size, e.xxh3, tuple(sorted(holders)))
            for e in manifest.files}


def a_replicator(membership: PeerDirectory, objects: Path, placements: Any,
                 on_held: Any, **options: Any) -> Replicator:
    """Node a's replicator (K = 1) over the objects in `objects`, every step current."""
    options.setdefault("on_placements", lambda *_: None)
    return Replicator(membership, 1, lambda xxh3: str(objects / xxh3),
                      is_current=lambda m: True, placements=placements, on_held=on_held,
                      events=Events(), **options)


async def members_a_and_b(nursery: trio.Nursery, etcd_server: EtcdServer,
                          b_port: int) -> PeerDirectory:
    """a's view of a two-node cluster {a, b} in a fresh prefix of the real etcd."""
    cluster = parse_cluster_url(etcd_server.cluster_url(f"layer/{uuid.uuid4().hex[:8]}"))
    etcd = Etcd(cluster.endpoints)
    live = {}
    for node_id, port in (("a", free_port()), ("b", b_port)):
        live[node_id] = live_members.Membership(etcd, cluster, node_id, f"127.0.0.1:{port}")
        await nursery.start(live[node_id].run)
    with trio.fail_after(10):
        while live["a"].ring != ["a", "b"]:
            await live["a"].changed.wait()
    return PeerDirectory(live["a"], TOKEN)


async def replicate_to_b(nursery: trio.Nursery, etcd_server: EtcdServer, b: Receiving,
                         objects: Path, placements: Any, on_held: Any,
                         *manifests: mf.StepManifest, **options: Any) -> Replicator:
    """b listening, a's replicator running with `manifests` submitted."""
    await b.start(nursery)
    membership = await members_a_and_b(nursery, etcd_server, b.port)
    replicator = a_replicator(membership, objects, placements, on_held, **options)
    nursery.start_soon(replicator.run)
    for manifest in manifests:
        replicator.submit(manifest)
    return replicator


async def replicate_all_to_b(etcd_server: EtcdServer, b: Receiving, objects: Path,
                             manifest: mf.StepManifest, timeout: float = 60) -> list[str]:
    """`manifest` replicated from a to b until b held every file of it (a's records of the
    holders as its `on_held` heard them); the names held."""
    held: list[str] = []
    done = trio.Event()

    async def placements(step: mf.StepManifest) -> dict[str, FileRecord]:
        return records_of(step, {"a", *held})

    async def on_held(_step: mf.StepManifest, _target: str, names: list[str]) -> bool:
        held.extend(names)
        if len(held) >= len(manifest.files):
            done.set()
        return True

    async with trio.open_nursery() as nursery:
        await replicate_to_b(nursery, etcd_server, b, objects, placements, on_held, manifest)
        with trio.fail_after(timeout):
            await done.wait()
        nursery.cancel_scope.cancel()
    return held


async def test_a_committed_step_arrives_whole_and_verified(tmp_path: Path,
                                                          etcd_server: EtcdServer) -> None:
    data = os.urandom(mf.CHUNK_SIZE + 12345)  # two chunks: offsets matter
    entry = committed_object(tmp_path / "a-objects", data, "shard")
    small = committed_object(tmp_path / "a-objects", b"m", ".metadata")
    manifest = mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry, small))
    b = Receiving(tmp_path, manifest)
    holders: set[str] = {"a"}
    replicated = trio.Event()

    async def placements(step: mf.StepManifest) -> dict[str, FileRecord]:
        return records_of(step, holders)

    async def on_held(done: mf.StepManifest, target: str, names: list[str]) -> bool:
        assert sorted(names) == [".metadata", "shard"]
        holders.add(target)
        replicated.set()
        return True

    async with trio.open_nursery() as nursery:
        await replicate_to_b(nursery, etcd_server, b, tmp_path / "a-objects",
                             placements, on_held, manifest)
        with trio.fail_after(20):
            await replicated.wait()
        nursery.cancel_scope.cancel()
    assert holders == {"a", "b"}
    assert (b.objects / entry.xxh3).read_bytes() == data
    assert (b.objects / small.xxh3).read_bytes() == b"m"
    assert b.held == [("run/step_1", 1, [".metadata", "shard"], "a")]
    assert sorted(os.listdir(b.objects)) == sorted([entry.xxh3, small.xxh3])  # no leftovers


async def test_a_tracker_goes_to_a_peer_only_once_it_holds_the_step_it_names(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    """Megatron-LM's tracker, committed and submitted before the iteration it names reached b:
    its copy waits (`may_copy`, from the file system's view of b's copies) and goes once the
    iteration's copies are done, with no new submission."""
    objects = tmp_path / "a-objects"
    step = mf.StepManifest("run/iter_0000150", 150, 1, "a", 0, (
        committed_object(objects, os.urandom(3 * mf.CHUNK_SIZE), "mp_rank_00/model.pt"),))
    tracker = mf.StepManifest("run/latest_checkpointed_iteration.txt", mf.NO_STEP, 1, "a", 0,
                              (committed_object(objects, b"150", "latest_checkpointed_"
                                                "iteration.txt"),), single_file=True)
    b = Receiving(tmp_path, step, tracker)
    holders: dict[str, set[str]] = {step.path: {"a"}, tracker.path: {"a"}}
    both = trio.Event()

    async def placements(manifest: mf.StepManifest) -> dict[str, FileRecord]:
        return records_of(manifest, holders[manifest.path])

    async def on_held(manifest: mf.StepManifest, target: str, _names: list[str]) -> bool:
        holders[manifest.path].add(target)
        if all(target in nodes for nodes in holders.values()):
            both.set()
        return True

    def may_copy(manifest: mf.StepManifest, peer: str, _wanted: int,
                 _up: Callable[[str], bool]) -> bool:
        return manifest is not tracker or peer in holders[step.path]

    async with trio.open_nursery() as nursery:
        await replicate_to_b(nursery, etcd_server, b, objects, placements, on_held,
                             tracker, step, may_copy=may_copy)
        with trio.fail_after(20):
            await both.wait()
        nursery.cancel_scope.cancel()
    assert [path for path, _v, _names, _peer in b.held] == [step.path, tracker.path]


async def test_a_waiting_tracker_goes_once_other_nodes_made_its_steps_copies(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    """The step a tracker names got its copies from other nodes (a multi-node save: none of
    them made by this replicator, so no step's copies end here): while the tracker waits, the
    step is planned again every RETRY_LATER seconds, which reads its records anew, and the
    tracker goes (it waited for good)."""
    objects = tmp_path / "a-objects"
    step = mf.StepManifest("run/iter_0000150", 150, 1, "a", 0, (
        committed_object(objects, os.urandom(1000), "mp_rank_00/model.pt"),))
    tracker = mf.StepManifest("run/latest_checkpointed_iteration.txt", mf.NO_STEP, 1, "a", 0,
                              (committed_object(objects, b"150", "latest_checkpointed_"
                                                "iteration.txt"),), single_file=True)
    b = Receiving(tmp_path, step, tracker)
    records = {step.path: {"a"}, tracker.path: {"a"}}
    seen: set[str] = set()  # the step's holders, as a's last plan of it read them
    tracker_held = trio.Event()

    async def placements(manifest: mf.StepManifest) -> dict[str, FileRecord]:
        return records_of(manifest, records[manifest.path])

    def on_placements(manifest: mf.StepManifest, holders: dict[str, set[str]],
                      _writers: dict[str, str]) -> None:
        if manifest is step:
            seen.update(*holders.values())

    async def on_held(manifest: mf.StepManifest, target: str, _names: list[str]) -> bool:
        assert manifest is tracker
        tracker_held.set()
        return True

    def may_copy(manifest: mf.StepManifest, peer: str, _wanted: int,
                 _up: Callable[[str], bool]) -> bool:
        return manifest is not tracker or peer in seen

    async with trio.open_nursery() as nursery:
        replicator = await replicate_to_b(
            nursery, etcd_server, b, objects, placements, on_held, tracker,
            may_copy=may_copy, on_placements=on_placements,
            named_step=lambda m: step if m is tracker else None)
        await wait_until_async(lambda: tracker.path in replicator._waiting, timeout=10)
        records[step.path].add("b")  # the step's copies, made by other nodes
        with trio.fail_after(RETRY_LATER + 10):
            await tracker_held.wait()
        nursery.cancel_scope.cancel()
    assert [path for path, _v, _names, _peer in b.held] == [tracker.path]


async def test_a_step_of_many_files_is_held_in_several_messages(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    """1,200 files: HOLD names at most MAX_NAMES at a time, so no message nears the cap."""
    objects = tmp_path / "a-objects"
    entries = tuple(committed_object(objects, b"%d" % i, f"rank{i:04d}/__{i}_0.distcp")
                    for i in range(1200))
    manifest = mf.StepManifest("run/step_2", 2, 1, "a", 0, entries)
    b = Receiving(tmp_path, manifest)
    held = await replicate_all_to_b(etcd_server, b, objects, manifest)
    assert [len(names) for _p, _v, names, _peer in b.held] == [proto.MAX_NAMES, 200]
    assert sorted(held) == sorted(e.name for e in entries)


async def test_small_files_go_many_to_a_message_and_a_thread_hop(
        tmp_path: Path, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of many small files: they go many to a PUT_FILES (SMALL_BATCH bytes at most),
    written and checked in one worker thread per message, each file's bytes its own (a PUT
    and its answer per file kept the receiver's loop busy about 330 us per file); a file
    larger than SMALL_FILE still goes by PUT."""
    objects = tmp_path / "a-objects"
    entries = tuple(committed_object(objects, os.urandom(512 + 13 * i), f"f{i:03d}")
                    for i in range(300)) + (committed_object(objects, b"", "empty"),
                                            committed_object(objects, b"", "empty too"))
    large = committed_object(objects, os.urandom(SMALL_FILE + 1), "large")
    manifest = mf.StepManifest("run/step_3", 3, 1, "a", 0, (*entries, large))
    b = Receiving(tmp_path, manifest)
    in_threads: collections.Counter[str] = collections.Counter()
    run_sync = trio.to_thread.run_sync

    async def counted(work: Callable[..., Any], *args: Any, **options: Any) -> Any:
        in_threads[work.__name__] += 1
        return await run_sync(work, *args, **options)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
    await replicate_all_to_b(etcd_server, b, objects, manifest)
    for entry in manifest.files:
        assert mf.hash_file(b.objects / entry.xxh3).xxh3 == entry.xxh3
    # 300 files of 0.5-4.4 KiB (0.7 MiB) over at most 4 connections, one message each
    assert 1 <= b.messages["PUT_FILES"] <= 4 and b.messages["PUT"] == 1, b.messages
    assert in_threads["_write_small"] == b.messages["PUT_FILES"], in_threads
    assert sorted(os.listdir(b.objects)) == sorted({e.xxh3 for e in manifest.files})
    assert sum(b.space.used.values()) == sum(e.size for e in {*entries, large})


async def test_a_peer_that_does_not_know_small_files_at_once_gets_them_one_by_one(
        tmp_path: Path, etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    """A daemon of an older version drops the connection at a PUT_FILES (an unknown message):
    the sender's next round sends it those files by PUT, and says so once."""
    objects = tmp_path / "a-objects"
    entries = tuple(committed_object(objects, b"%d" % i, f"f{i}") for i in range(20))
    manifest = mf.StepManifest("run/step_4", 4, 1, "a", 0, entries)
    b = Receiving(tmp_path, manifest, batches=False)
    held = await replicate_all_to_b(etcd_server, b, objects, manifest, timeout=30)
    assert sorted(held) == sorted(e.name for e in entries)
    assert b.messages == {"PUT": len(entries)}
    assert [r.message for r in caplog.records if "one by one" in r.message] == [
        "b closed the connection at small files sent many at once (a daemon of an older "
        "version?): they go one by one there for 600 s"]


async def send_small_files(channel: PeerChannel, files: dict[str, bytes],
                           digests: dict[str, str] | None = None) -> None:
    """A PUT_FILES of `files` (name -> bytes) under their xxh3-128, or `digests`."""
    digests = digests or {name: mf.hash_bytes(data) for name, data in files.items()}
    await channel.send("PUT_FILES", b"".join(files.values()), path="run/step_1",
                       names=list(files), digests=[digests[name] for name in files],
                       sizes=[len(data) for data in files.values()])


async def answer_to_small_files(b: Receiving, files: dict[str, bytes],
                                expect: str) -> proto.Message:
    """b's answer (of type `expect`) to a PUT_FILES of `files` from a."""
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await send_small_files(channel, files)
        answer = await channel.receive(expect)
        await channel.aclose()
        nursery.cancel_scope.cancel()
    return answer


async def test_small_files_whose_bytes_do_not_match_are_refused_the_others_kept(
        tmp_path: Path) -> None:
    """A PUT_FILES with one file whose bytes are not its digest's (a holder's bad copy): the
    answer is ERROR, that file is not kept, the others are (a second try finds them here)."""
    good = committed_object(tmp_path / "a-objects", b"the real bytes", "good")
    bad = committed_object(tmp_path / "a-objects", b"the bad bytes!", "bad")
    b = Receiving(tmp_path, mf.StepManifest("run/step_1", 1, 1, "a", 0, (good, bad)))
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await send_small_files(channel, {"good": b"the real bytes", "bad": b"other bytes!!!"},
                               {"good": good.xxh3, "bad": bad.xxh3})
        answer = await channel.receive("ERROR")
        assert answer["message"] == "checksum mismatch: 1 of 2 files"
        answer = await channel.request("HOLD", path="run/step_1", version=1,
                                       names=["good", "bad"], expect="HELD")
        assert answer["names"] == ["good"]
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert os.listdir(b.objects) == [good.xxh3]  # no incoming file left
    assert list(b.space.used.values()) == [good.size]


async def test_small_files_with_no_room_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    """A PUT_FILES whose files do not all fit the RAM tier: NO_ROOM, those that fit stay
    (charged), the rest leave no incoming file and no charge."""
    files = {"one": b"1" * 6, "two": b"2" * 6}
    b = Receiving(tmp_path, limit=10)
    answer = await answer_to_small_files(b, files, "NO_ROOM")
    assert "RAM tier is full" in answer["message"]
    assert os.listdir(b.objects) == [mf.hash_bytes(files["one"])]
    assert list(b.space.used.values()) == [6]


async def test_small_files_whose_sizes_are_not_the_payload_drop_the_connection(
        tmp_path: Path) -> None:
    b = Receiving(tmp_path)
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await channel.send("PUT_FILES", b"abc", path="run/step_1", names=["x"],
                           digests=[mf.hash_bytes(b"ab")], sizes=[2])
        with pytest.raises(ConnectionClosed):
            await channel.receive()
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert os.listdir(b.objects) == []


async def test_the_receiver_refuses_bytes_that_do_not_match_their_checksum(
        tmp_path: Path) -> None:
    entry = committed_object(tmp_path / "a-objects", b"the real bytes", "shard")
    b = Receiving(tmp_path, mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry,)))
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await channel.send("PUT", b"other bytes, same size", path="run/step_1",
                           name="shard", xxh3=entry.xxh3, size=22, offset=0)
        answer = await channel.receive("ERROR")
        assert "checksum mismatch" in answer["message"]
        # a HOLD naming a file that never arrived holds nothing
        answer = await channel.request("HOLD", path="run/step_1", version=1,
                                       names=["shard"], expect="HELD")
        assert answer["names"] == []
        # and one of a version this node cannot hold is refused
        await channel.send("HOLD", path="run/step_1", version=2, names=["shard"])
        answer = await channel.receive("ERROR")
        assert "is not held here" in answer["message"]
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert os.listdir(b.objects) == [] and b.space.used == {}


@pytest.mark.parametrize("accepted", [True, False])
async def test_a_chunk_written_again_out_of_order_is_checked_in_the_file(
        tmp_path: Path, accepted: bool) -> None:
    """The receiver hashes a file as its chunks arrive in order; a chunk sent again out of
    order breaks that running hash, and the whole file is read back: it counts only if the
    bytes it finally holds match its xxh3-128."""
    data = os.urandom(3 * mf.CHUNK_SIZE)
    entry = committed_object(tmp_path / "a-objects", data, "shard")
    b = Receiving(tmp_path, mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry,)))
    chunk = [data[i * mf.CHUNK_SIZE:(i + 1) * mf.CHUNK_SIZE] for i in range(3)]
    other = bytes(len(chunk[1]))  # same size, other bytes
    sent = [(0, chunk[0]), (1, other if accepted else chunk[1]),
            (1, chunk[1] if accepted else other), (2, chunk[2])]
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        for index, piece in sent:
            await channel.send("PUT", piece, path="run/step_1", name="shard", xxh3=entry.xxh3,
                               size=entry.size, offset=index * mf.CHUNK_SIZE)
            answer = await channel.receive("OK", "ERROR")
        assert answer.type == ("OK" if accepted else "ERROR")
        await channel.aclose()
        nursery.cancel_scope.cancel()
    target = b.objects / entry.xxh3
    assert target.exists() == accepted
    if accepted:
        assert target.read_bytes() == data


async def test_chunks_over_several_connections_in_any_order_make_the_file(
        tmp_path: Path) -> None:
    """A file's chunks come over three connections, the last first: the file is whole and
    verified once the last one is in, whatever the order; a chunk of a file that is already
    here is answered OK at once."""
    data = os.urandom(3 * mf.CHUNK_SIZE - 5)
    entry = committed_object(tmp_path / "a-objects", data, "shard")
    b = Receiving(tmp_path, mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry,)))
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channels = [await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
                    for _ in range(3)]
        for index, channel in zip((2, 0, 1), channels, strict=True):
            offset = index * mf.CHUNK_SIZE
            await channel.request("PUT", data[offset:offset + mf.CHUNK_SIZE],
                                  path="run/step_1", name="shard", xxh3=entry.xxh3,
                                  size=entry.size, offset=offset)
            assert (b.objects / entry.xxh3).exists() == (index == 1)
        await channels[0].request("PUT", data[:mf.CHUNK_SIZE], path="run/step_1",
                                  name="shard", xxh3=entry.xxh3, size=entry.size, offset=0)
        for channel in channels:
            await channel.aclose()
        nursery.cancel_scope.cancel()
    assert (b.objects / entry.xxh3).read_bytes() == data
    assert incoming_files(b.objects) == [] and b.receiver._incoming_files == {}


async def test_a_streamed_chunk_that_fails_its_tags_makes_the_file_count_for_nothing(
        tmp_path: Path) -> None:
    """A chunk's slices go into the incoming file as they arrive, its tags checked at its end:
    one altered in flight (its tags wrong) is refused, the connection dropped, and the file's
    whole transfer forgotten (its incoming file and RAM count too), although the good chunk
    before it was in; the file comes whole only when every chunk comes again, authentic."""
    data = os.urandom(2 * mf.CHUNK_SIZE)
    entry = committed_object(tmp_path / "a-objects", data, "shard")
    b = Receiving(tmp_path, mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry,)))
    put = {"path": "run/step_1", "name": "shard", "xxh3": entry.xxh3, "size": entry.size}
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await channel.request("PUT", data[:mf.CHUNK_SIZE], offset=0, **put)
        assert len(incoming_files(b.objects)) == 1 and b.space.used
        header, body = proto.encode("PUT", data[mf.CHUNK_SIZE:], offset=mf.CHUNK_SIZE, **put)
        forged = bytes(proto.tag_length(len(body)))  # an attacker's: not the key's tags
        await channel.wire.send_all(header + body + forged)
        with pytest.raises(proto.ProtocolError):
            await channel.receive("OK")
        await channel.aclose()
        await wait_until_async(lambda: not incoming_files(b.objects) and not b.space.used,
                               timeout=5)
        assert b.receiver._incoming_files == {} and not (b.objects / entry.xxh3).exists()
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        for offset in (mf.CHUNK_SIZE, 0):
            await channel.request("PUT", data[offset:offset + mf.CHUNK_SIZE], offset=offset,
                                  **put)
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert (b.objects / entry.xxh3).read_bytes() == data


async def test_running_hashes_of_abandoned_transfers_are_dropped(tmp_path: Path) -> None:
    """Senders killed after a file's first chunk leave its running hash behind: the receiver
    keeps at most `running_limit` of them, and drops any idle for `running_idle` seconds; a
    transfer after that is received and checked as usual."""
    entry = committed_object(tmp_path / "a-objects", b"a whole small file", "shard")
    b = Receiving(tmp_path, mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry,)),
                  running_limit=4, running_idle=1.0)
    chunk = bytes(mf.CHUNK_SIZE)
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        for i in range(10):
            channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
            await channel.request("PUT", chunk, path="run/step_1", name=f"big{i}",
                                  xxh3=f"{i:032x}", size=2 * mf.CHUNK_SIZE, offset=0)
            await channel.aclose()  # the sender is gone, its file half sent
        assert len(b.receiver._incoming_files) <= 4
        assert len(incoming_files(b.objects)) == 10
        await trio.sleep(1.1)  # the abandoned ones are idle for longer than running_idle
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await channel.request("PUT", b"a whole small file", path="run/step_1", name="shard",
                              xxh3=entry.xxh3, size=entry.size, offset=0)
        await channel.aclose()
        assert b.receiver._incoming_files == {}
        assert incoming_files(b.objects) == []  # nor their half-sent files, nor their RAM
        nursery.cancel_scope.cancel()
    assert (b.objects / entry.xxh3).read_bytes() == b"a whole small file"


def incoming_files(objects: Path) -> list[str]:
    return [p.name for p in objects.iterdir() if p.name.startswith(INCOMING_PREFIX)]


async def test_a_full_receiver_answers_no_room_and_keeps_nothing(tmp_path: Path) -> None:
    entry = committed_object(tmp_path / "a-objects", b"more than ten bytes", "shard")
    b = Receiving(tmp_path, mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry,)), limit=10)
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await channel.send("PUT", b"more than ten bytes", path="run/step_1", name="shard",
                           xxh3=entry.xxh3, size=entry.size, offset=0)
        answer = await channel.receive("NO_ROOM")
        assert "RAM tier is full" in answer["message"]
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert not (b.objects / entry.xxh3).exists()


async def test_steps_of_many_chunks_go_over_the_same_kept_alive_connections(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    """Chunks pipelined from the RAM store (sendfile), each file's spread over the directory's
    `connections` at once; two steps, one handshake per connection in all."""
    data = os.urandom(3 * mf.CHUNK_SIZE + 777)
    entries = [committed_object(tmp_path / "a-objects", data[i:], f"shard{i}") for i in (0, 1)]
    manifests = [mf.StepManifest(f"run/step_{i}", 1, 1, "a", 0, (e,))
                 for i, e in enumerate(entries)]
    b = Receiving(tmp_path, *manifests)
    done: list[str] = []

    async def placements(step: mf.StepManifest) -> dict[str, FileRecord]:
        return records_of(step, {"a", "b"} if step.path in done else {"a"})

    async def on_held(step: mf.StepManifest, target: str, names: list[str]) -> bool:
        done.append(step.path)
        return True

    async with trio.open_nursery() as nursery:
        replicator = await replicate_to_b(nursery, etcd_server, b, tmp_path / "a-objects",
                                          placements, on_held, *manifests)
        await wait_until_async(lambda: len(done) >= 2, timeout=20)
        nursery.cancel_scope.cancel()
    assert replicator.directory.pool.opened == replicator.directory.connections == 4
    assert len(b.put_channels) == 4
    for i, entry in enumerate(entries):
        assert (b.objects / entry.xxh3).read_bytes() == data[i:]


async def test_files_that_spread_evenly_go_whole_over_a_connection_each(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    """A step of four equal files over four connections: each file goes over one of them,
    its chunks in order, so that the receiver hashes every chunk from the bytes it just wrote
    and reads nothing back for the files' xxh3-128 (with chunks dealt out in turn, three in
    four came ahead of their file's order and were read back from the file)."""
    files = [os.urandom(3 * mf.CHUNK_SIZE + i) for i in range(4)]
    entries = tuple(committed_object(tmp_path / "a-objects", data, f"__{i}_0.distcp")
                    for i, data in enumerate(files))
    manifest = mf.StepManifest("run/step_1", 1, 1, "a", 0, entries)
    b = Receiving(tmp_path, manifest)
    done: list[str] = []

    async def placements(step: mf.StepManifest) -> dict[str, FileRecord]:
        return records_of(step, {"a", "b"} if done else {"a"})

    async def on_held(step: mf.StepManifest, target: str, names: list[str]) -> bool:
        done.append(step.path)
        return True

    async with trio.open_nursery() as nursery:
        await replicate_to_b(nursery, etcd_server, b, tmp_path / "a-objects", placements,
                             on_held, manifest)
        await wait_until_async(lambda: done, timeout=20)
        nursery.cancel_scope.cancel()
    assert len(b.put_channels) == 4
    for entry, data in zip(entries, files, strict=True):
        assert (b.objects / entry.xxh3).read_bytes() == data
    assert b.receiver.read_back == 0


def test_chunks_are_dealt_whole_files_to_a_connection_when_they_spread_evenly() -> None:
    """`deal`: files that spread evenly go whole to a connection each, in order; one large file
    (or unequal ones) is dealt out chunk by chunk over every connection."""
    def entry(name: str, size: int) -> mf.FileEntry:
        return mf.FileEntry(name, size, "0" * 32)

    equal = [entry(f"f{i}", 3 * mf.CHUNK_SIZE) for i in range(4)] + [entry(".metadata", 900)]
    shares = deal(equal, 4)
    assert len(shares) == 4
    for share in shares:
        for name in {e.name for e, _ in share}:
            offsets = [offset for e, offset in share if e.name == name]
            assert offsets == sorted(offsets) and len(offsets) == \
                max(1, -(-next(e.size for e in equal if e.name == name) // mf.CHUNK_SIZE))
    assert sorted(e.name for share in shares for e, _ in share if _ == 0) == \
        sorted(e.name for e in equal)
    one = [entry("model.pt", 10 * mf.CHUNK_SIZE)]
    shares = deal(one, 4)
    assert [len(share) for share in shares] == [3, 3, 2, 2]
    assert shares[0][:2] == [(one[0], 0), (one[0], 4 * mf.CHUNK_SIZE)]
    assert deal(one, 1) == [[(one[0], i * mf.CHUNK_SIZE) for i in range(10)]]
    unequal = [entry("big", 9 * mf.CHUNK_SIZE), entry("small", mf.CHUNK_SIZE)]
    assert [len(share) for share in deal(unequal, 2)] == [5, 5]


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


async def test_small_files_come_many_in_one_request_only_as_held(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    """A reader asks a holder for a step's small files in one GET_FILES per MAX_NAMES names
    and gets those the holder has in RAM, whole, by name; one it does not hold, or holds at
    another size than the reader's manifest says, is not among them (read one by one then)."""
    objects = tmp_path / "b-objects"
    files = {f"t{i:05}": i.to_bytes(4, "little") * 100 for i in range(proto.MAX_NAMES + 200)}
    entries = [committed_object(objects, data, name) for name, data in files.items()]
    entries.append(mf.FileEntry("missing", 5, "0" * 32, chunks=("0" * 16,)))
    resized = entries[7]
    entries[7] = mf.FileEntry(resized.name, resized.size + 1, resized.xxh3,
                              chunks=resized.chunks)
    ranges = RangeServer(objects, lambda path, name, digest: None)
    port = free_port()
    async with trio.open_nursery() as nursery:
        server = PeerServer("b", TOKEN, {"a", "b"}, {"GET_FILES": ranges.on_get_files})
        await nursery.start(server.run, "127.0.0.1", port)
        reader = PeerReader(await members_a_and_b(nursery, etcd_server, port),
                            lambda path, name: ["b"])
        got = await reader.read_files("run/step_1", entries)
        nursery.cancel_scope.cancel()
    assert {name: bytes(data) for name, data in got.items()} == \
        {name: data for name, data in files.items() if name != resized.name}
    assert ranges.served_requests == 2


async def test_holders_are_added_in_batches_and_none_is_lost_to_a_race(
        etcd_server: EtcdServer) -> None:
    """300 files (more than one transaction of 128), three targets recorded at once: every
    file ends with its writer and all three, the file not named untouched."""
    from tierfs.replication.coordination.commit_records import CommitRecords

    cluster = parse_cluster_url(etcd_server.cluster_url(f"layer/{uuid.uuid4().hex[:8]}"))
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    names = [f"rank{i:03d}/__{i}_0.distcp" for i in range(300)]
    await records.record_files("s", {n: FileRecord.sealed("a", 1, "0" * 32) for n in
                                     [*names, ".metadata"]})
    async with trio.open_nursery() as nursery:
        for target in ("b", "c", "d"):
            nursery.start_soon(records.add_holders, "s", target, dict.fromkeys(names, "0" * 32))
    files = await records.files("s")
    assert all(files[n].holders == ("a", "b", "c", "d") for n in names)
    assert files[".metadata"].holders == ("a",)
    again = await records.add_holders("s", "b", dict.fromkeys([*names[:2], "never-recorded"],
                                                              "0" * 32))
    assert sorted(again) == names[:2] and again[names[0]].holders == ("a", "b", "c", "d")


async def test_a_hold_of_an_older_content_never_counts_for_the_newer_one(
        etcd_server: EtcdServer) -> None:
    """Records are keyed by path: a copy of v5 verified after the writer sealed v6 (another
    xxh3) is not added to v6's record; a copy of the content recorded is."""
    from tierfs.replication.coordination.commit_records import CommitRecords

    cluster = parse_cluster_url(etcd_server.cluster_url(f"layer/{uuid.uuid4().hex[:8]}"))
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    await records.record_files("s", {"old": FileRecord.sealed("a", 1, "6" * 32),
                                     "same": FileRecord.sealed("a", 1, "5" * 32)})
    found = await records.add_holders("s", "b", {"old": "5" * 32, "same": "5" * 32})
    assert found["old"].holders == ("a",) and found["same"].holders == ("a", "b")
    files = await records.files("s")
    assert files["old"].holders == ("a",) and files["same"].holders == ("a", "b")
    dropped = await records.drop_holders("s", "b", dict.fromkeys(["old", "same"]))
    assert dropped["same"].holders == ("a",)
    assert (await records.files("s"))["same"].holders == ("a",)


async def test_holders_of_many_large_records_fit_etcds_request_limit(
        etcd_server: EtcdServer) -> None:
    """128 records of ~60 kB each (a 10 GB shard's chunk hashes) are more than one request of
    1.5 MiB: the compare-and-swap goes in several transactions, and every holder is added."""
    from tierfs.replication.coordination.commit_records import CommitRecords

    cluster = parse_cluster_url(etcd_server.cluster_url(f"layer/{uuid.uuid4().hex[:8]}"))
    records = CommitRecords(Etcd(cluster.endpoints), cluster)
    chunks = tuple(os.urandom(16).hex() for _ in range(1900))  # ~60 kB of JSON
    names = [f"__{i}_0.distcp" for i in range(128)]
    await records.record_files("s", {n: FileRecord.sealed("a", 1, "0" * 32,
                                                          ("f", n, chunks)) for n in names})
    found = await records.add_holders("s", "b", dict.fromkeys(names, "0" * 32))
    assert all(found[n].holders == ("a", "b") for n in names)
    assert all(r.holders == ("a", "b") for r in (await records.files("s")).values())


async def test_copies_etcd_did_not_record_are_sent_again_only_after_a_pause(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    """The target verified the copies but etcd did not record them: the round failed, so the
    replicator pauses and, after a few such rounds, sets the step aside (no hot loop)."""
    data = os.urandom(100)
    entry = committed_object(tmp_path / "a-objects", data, "shard")
    manifest = mf.StepManifest("run/step_3", 3, 1, "a", 0, (entry,))
    b = Receiving(tmp_path, manifest)
    rounds: list[float] = []

    async def placements(step: mf.StepManifest) -> dict[str, FileRecord]:
        return records_of(step, {"a"})

    async def on_held(step: mf.StepManifest, target: str, names: list[str]) -> bool:
        rounds.append(trio.current_time())
        return False  # etcd refused

    async with trio.open_nursery() as nursery:
        replicator = await replicate_to_b(nursery, etcd_server, b, tmp_path / "a-objects",
                                          placements, on_held, manifest)
        await wait_until_async(lambda: manifest.path in replicator._later, timeout=30)
        nursery.cancel_scope.cancel()
    assert 1 < len(rounds) <= 5  # each failed round paused before the next


async def test_a_chunk_the_ram_dir_has_no_room_for_is_refused_not_kept_short(
        tmp_path: Path, small_shm: Path) -> None:
    """A RAM dir on a /dev/shm that other processes fill (the RAM tier's own count has room):
    a chunk written only in part is answered NO_ROOM (the sender makes the copy elsewhere)
    and nothing of it is kept, never taken as the whole file because its bytes in memory
    matched their checksum."""
    data = os.urandom(3 << 20)
    entry = committed_object(tmp_path / "a-objects", data, "shard")
    b = Receiving(small_shm, mf.StepManifest("run/step_1", 1, 1, "a", 0, (entry,)))
    stats = os.statvfs(b.objects)
    (small_shm / "other-user").write_bytes(bytes(stats.f_bavail * stats.f_frsize - (1 << 20)))
    async with trio.open_nursery() as nursery:
        await b.start(nursery)
        channel = await connect("127.0.0.1", b.port, TOKEN, "a", {"a", "b"}, "b")
        await channel.send("PUT", data, path="run/step_1", name="shard", xxh3=entry.xxh3,
                           size=entry.size, offset=0)
        answer = await channel.receive("NO_ROOM")
        assert "no room" in answer["message"]
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert not (b.objects / entry.xxh3).exists()
    assert incoming_files(b.objects) == [] and b.space.used == {}


async def test_small_files_the_ram_dir_has_no_room_for_are_refused_not_kept_short(
        tmp_path: Path, small_shm: Path) -> None:
    """The same for small files at once: those written whole stay (charged), the one
    written in part is not kept, and the answer is NO_ROOM."""
    files = {"one": os.urandom(700 << 10), "two": os.urandom(700 << 10)}
    b = Receiving(small_shm)
    stats = os.statvfs(b.objects)
    (small_shm / "other-user").write_bytes(bytes(stats.f_bavail * stats.f_frsize - (1 << 20)))
    answer = await answer_to_small_files(b, files, "NO_ROOM")
    assert "no room on the file system of its RAM dir" in answer["message"]
    assert os.listdir(b.objects) == [mf.hash_bytes(files["one"])]
    assert list(b.space.used.values()) == [700 << 10]
