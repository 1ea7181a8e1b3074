"""The node's side of the cluster (`mount_helper.daemon.cluster_service`) in process: two nodes,
each a real namespace over a RAM dir in a temp dir with its real peer clients and peer port on
127.0.0.1, no mount; etcd and the members' leases are the in-memory fakes of tests/fakes.py
(`MemoryEtcd`, `StaticMembership`). What is shown: the peer port's handler table answering each
request, the lost-copies rule at start, the catch-up after a node was down, and the one-line
refusals of admission."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.conftest import free_port
from tests.fakes import MemoryEtcd, StaticMembership
from tests.harness import CTX, Harness, dcp_save
from tests.test_control_api import config
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.fs.fuse.operations import Operations
from tierfs.fs.lifecycle.deletes import Tombstone, peer_target
from tierfs.fs.model.ports import TierError
from tierfs.fs.namespace import Core, Namespace
from tierfs.fs.store.ram_store import RamStore
from tierfs.mount_helper.daemon import cluster_service
from tierfs.mount_helper.daemon.cluster_service import ClusterLinks, ClusterNode
from tierfs.mount_helper.daemon.commit_pipeline import delete_targets, delete_worker
from tierfs.mount_helper.daemon.startup import StartupError
from tierfs.observe import Events
from tierfs.replication.coordination.commit_records import CommitRecords, Deletion
from tierfs.replication.coordination.url import ClusterUrl, Endpoint
from tierfs.replication.peers.directory import PeerDirectory

pytestmark = pytest.mark.core

TOKEN = b"the cluster's token, 32 bytes.."
CLUSTER = ClusterUrl((Endpoint("127.0.0.1", 2379),), "tierfs-test")
FILES = {"__0_0.distcp": b"weights" * 5000, "__1_0.distcp": b"optimizer" * 3000}


class ClusterHarness(Harness):
    """One node as `assembly` wires it (the namespace given the cluster's clients, then the
    cluster service over both), on a shared in-memory etcd; its peer port is not open until
    `serve`."""

    def __init__(self, root: Path, node_id: str, etcd: MemoryEtcd, *, replicas: int = 1,
                 keep_ram: int = 3, token: bytes = TOKEN) -> None:
        self.root = root / node_id
        self.port = free_port()
        self.cfg = config(root / node_id, node_id=node_id, cluster=CLUSTER, token=token,
                          listen=("127.0.0.1", self.port), advertise=f"127.0.0.1:{self.port}",
                          replicas=replicas, keep_ram=keep_ram)
        self.etcd = etcd
        self.live = StaticMembership(etcd, node_id, f"127.0.0.1:{self.port}")
        self.directory = PeerDirectory(self.live, token)  # type: ignore[arg-type]
        self.store = RamStore(self.root, 1 << 30)
        self.store.acquire()
        core = Core(self.store, node_id=node_id, delete_targets=delete_targets(self.cfg),
                    liveness=self.directory)
        self.links = ClusterLinks(self.cfg, core, self.directory)
        self.send, self.commits = trio.open_memory_channel[mf.StepManifest](100)
        self.ns = Namespace(core, self.send, read_sources=[self.links.reader],
                            sealed=self.links.sealed, peers=self.links.verify,
                            keep_ram=keep_ram, replicas=replicas, events=Events(),
                            shards=self.links.files)
        self.ops = Operations(self.ns)
        self.node = ClusterNode(self.cfg, self.links, self.ns, self.store, Events())

    async def serve(self, nursery: trio.Nursery) -> None:
        """Open the peer port (the handler table `ClusterNode.start` serves)."""
        await nursery.start(self.node.peer_server().run, "127.0.0.1", self.port)


def members(*nodes: ClusterHarness) -> None:
    """Every node sees `nodes` as the live members."""
    addresses = {n.cfg.node_id: n.cfg.advertise for n in nodes}
    for node in nodes:
        node.live.set_members(addresses)  # type: ignore[arg-type]


@asynccontextmanager
async def cluster(tmp_path: Path, *node_ids: str, etcd: MemoryEtcd | None = None,
                  serve: bool = True, **options: Any
                  ) -> AsyncIterator[tuple[trio.Nursery, list[ClusterHarness]]]:
    """Nodes on one etcd, live members of each other, their background work running and
    (`serve`) their peer ports open; closed on the way out."""
    etcd = etcd or MemoryEtcd()
    nodes = [ClusterHarness(tmp_path, node_id, etcd, **options) for node_id in node_ids]
    async with AsyncExitStack() as stack:
        for node in nodes:
            stack.callback(node.close)
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await nursery.start(node.ns.background.run)
                if serve:
                    await node.serve(nursery)
            members(*nodes)
            yield nursery, nodes
            nursery.cancel_scope.cancel()


async def committed_on(node: ClusterHarness, step: str) -> mf.StepManifest:
    """A DCP save of `step` on `node`, committed there and in the cluster's records."""
    await dcp_save(node, step, FILES)
    manifest = node.commits.receive_nowait()
    record = await node.links.sealed.records.commit_of(step)
    assert record is not None and record.version == manifest.version
    return manifest


# -- the peer port's handler table ----------------------------------------------------------


async def test_a_step_committed_on_one_node_is_listed_read_and_verified_from_another(
        tmp_path: Path) -> None:
    """n1 learns n0's commit from the records (MANIFEST: the manifest from n0), reads a file of
    it from n0 (GET) and has n0 check its copies (VERIFY)."""
    async with cluster(tmp_path, "n0", "n1") as (_nursery, (n0, n1)):
        manifest = await committed_on(n0, "run/step_1")
        await n1.links.sealed.learn_all(n1.node.steps.learn)
        assert n1.links.sealed.manifests_from_peers == 1  # from n0's MANIFEST handler
        assert n0.node.manifests.served_parts == 1
        assert await n1.state("run/step_1") == "committed"
        assert await n1.read_file("run/step_1/__1_0.distcp") == FILES["__1_0.distcp"]
        # n0 counts a GET once its DATA is sent: after n1 has it
        await wait_until_async(lambda: n0.node.ranges.served_requests >= 1, timeout=5)
        entry = manifest.entry("__0_0.distcp")
        assert await n1.links.verify.verify("n0", "run/step_1", entry, False) == "good"
        (n0.root / "objects" / entry.xxh3).write_bytes(b"flipped" * 5000)
        assert await n1.links.verify.verify("n0", "run/step_1", entry, False) == "bad"


async def test_a_copy_sent_to_a_peer_is_held_there_and_counted_in_the_records(
        tmp_path: Path) -> None:
    """PUT and HOLD: n0's replicator sends its copies to n1, which holds them; both nodes and
    etcd's records then count n1 as a holder of every file."""
    async with cluster(tmp_path, "n0", "n1") as (nursery, (n0, n1)):
        nursery.start_soon(n0.node.replicator.run)
        manifest = await committed_on(n0, "run/step_2")
        n0.node.replicator.submit(manifest)
        with trio.fail_after(10):
            await n0.node.replicator.queue.settled(manifest.path)
        placements = await n0.links.sealed.placements(manifest)
        assert placements is not None
        assert {name: set(r.holders) for name, r in placements.items()} == \
            {e.name: {"n0", "n1"} for e in manifest.files}
        step = n0.ns.tree.find_step("run/step_2").step
        assert all(n0.ns.tree.parts.holdings.file_peers(step, e.name) == {"n1"}
                   for e in manifest.files)
        assert all((n1.root / "objects" / e.xxh3).exists() for e in manifest.files)
        assert await n1.node.recorded_holders(manifest) == \
            {e.name: {"n0", "n1"} for e in manifest.files}


async def test_a_delete_from_a_peer_removes_the_step_here(tmp_path: Path) -> None:
    async with cluster(tmp_path, "n0", "n1") as (_nursery, (n0, n1)):
        manifest = await committed_on(n0, "run/step_3")
        await n1.links.delete.delete(
            Tombstone("run/step_3", manifest.version, manifest.committed_ns), "n0")
        assert n0.ns.tree.find_step("run/step_3") is None
        assert n0.ns.deletes.covers(manifest)  # remembered: no copy brings it back


async def test_a_peer_says_which_files_of_a_step_being_written_it_has(tmp_path: Path) -> None:
    """FILES and HAVE: a committer whose records of shards are late asks the other nodes: n1
    has the shard its rank wrote for the save under way (recorded or not), not the files of a
    version already committed, nor files it does not have; a node that is down cannot
    answer, and may have them."""
    async with cluster(tmp_path, "n0", "n1") as (_nursery, (n0, n1)):
        await committed_on(n1, "run/step_5")
        await n1.write_file("run/step_6/__1_0.distcp", b"rank 1")
        names = {"__0_0.distcp", "__1_0.distcp", ".metadata"}
        asked = await n0.links.files.ask("run/step_6", names, trio.current_time() + 5)
        assert (asked.held, asked.unanswered) == ({"__1_0.distcp": "n1"}, set())
        asked = await n0.links.files.ask("run/step_5", names, trio.current_time() + 5)
        assert (asked.held, asked.unanswered) == ({}, set())  # committed: not being written
        n0.live.set_members({"n0": n0.cfg.advertise})  # n1 is down for n0
        asked = await n0.links.files.ask("run/step_6", names, trio.current_time() + 5)
        assert (asked.held, asked.unanswered) == ({}, {"n1"})


async def test_a_node_records_the_saves_it_writes_and_names_their_files_page_by_page(
        tmp_path: Path) -> None:
    """WRITTEN and WRITES, for a step saved on several nodes with no `.metadata`: n1 records
    in etcd that it writes `ds/global_step6` (over no committed version), and names, in pages
    of MAX_NAMES, the 2,100 files it wrote of it, the one still open among them, and the
    version it committed (none); asked every live peer while etcd cannot say who writes it.
    Once n1 committed the save it names no file and its version."""
    from tierfs.replication.peers.protocol import MAX_NAMES

    async with cluster(tmp_path, "n0", "n1") as (_nursery, (n0, n1)):
        names = [f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in range(2100)]
        for name in names[:-1]:
            await n1.write_file(f"ds/global_step6/{name}", b"z")
        held_open, _attrs = await n1.ops.create(await n1.inode("ds/global_step6"),
                                                names[-1].encode(), 0o644, os.O_WRONLY, CTX)
        deadline = trio.current_time() + 5
        assert await wait_until_async(
            lambda: n0.links.sealed.other_writers("ds/global_step6", 0, deadline)) == {"n1"}
        assert await n1.links.sealed.other_writers("ds/global_step6", 0, deadline) == set()
        for nodes in ({"n1"}, None):
            said = await n0.links.files.written("ds/global_step6", nodes, deadline)
            assert sorted(said.held) == sorted(names) and set(said.held.values()) == {"n1"}
            assert (said.writing, said.versions, said.unanswered) == \
                ({names[-1]: "n1"}, {"n1": 0}, set())
        assert len(names) > 2 * MAX_NAMES  # three pages
        await n1.ops.release(held_open.fh)
        await n1.ns.commits.commit_quietly(n1.ns.tree.find_step("ds/global_step6"))
        said = await n0.links.files.written("ds/global_step6", {"n1"}, deadline)
        assert (said.held, said.writing, said.versions) == ({}, {}, {"n1": 1})


async def test_the_directories_holding_a_nodes_files_come_with_them_page_by_page(
        tmp_path: Path) -> None:
    """WRITES names the directories inside the step that hold the files of its page, with
    their mode (what the committer's manifest records for them): 1,200 files, each in a
    directory of its own two levels down, come with all 2,400 directories, in pages that
    name at most MAX_NAMES of them (so 500 files a page here, not MAX_NAMES)."""
    from tierfs.replication.peers.peer_files import written_handler
    from tierfs.replication.peers.protocol import MAX_NAMES, Message

    async with cluster(tmp_path, "n0", "n1") as (_nursery, (n0, n1)):
        step = "mg/iter_0000010"
        await n1.ops.mkdir(await n1.mkdirs(step), b"rank_0007", 0o700, CTX)
        names = [f"rank_{i:04d}/part/x.pt" for i in range(1200)]
        for name in names:
            await n1.write_file(f"{step}/{name}", b"x")
        said = await n0.links.files.written(step, {"n1"}, trio.current_time() + 10)
        assert sorted(said.held) == names
        assert set(said.dirs) == {f"{step}/rank_{i:04d}{part}" for i in range(1200)
                                  for part in ("", "/part")}
        assert (said.dirs[f"{step}/rank_0007"].mode, said.dirs[f"{step}/rank_0008"].mode) \
            == (0o700, 0o755)

        pages: list[dict[str, Any]] = []

        class Answers:  # the channel WRITES goes back on
            async def send(self, _kind: str, **fields: Any) -> None:
                pages.append(fields)

        answer = written_handler(n1.ns.view.files_being_saved)
        after, more = "", True
        while more:
            await answer(Message("WRITTEN", {"path": step, "after": after}), Answers())
            after, more = pages[-1]["names"][-1], pages[-1]["more"]
        assert [len(p["names"]) for p in pages] == [MAX_NAMES // 2] * 2 + [200]
        assert all(len(p["dirs"]) <= MAX_NAMES for p in pages)


async def test_a_commit_waits_for_the_writers_of_the_step_saved_before_it(
        tmp_path: Path) -> None:
    """DeepSpeed's rank 0 writes `latest` without waiting for the other ranks: the commit of
    global_step4 on n0 waits until n1, which wrote global_step2, records that it writes
    global_step4 too; by the deadline without it, the commit goes on without it."""
    async with cluster(tmp_path, "n0", "n1") as (nursery, (n0, n1)):
        for node in (n0, n1):
            await node.links.sealed.note_writer("ds/global_step2", 0)
        sealed = n0.links.sealed

        async def n1_begins_later() -> None:
            await trio.sleep(0.3)
            await n1.links.sealed.note_writer("ds/global_step4", 0)

        nursery.start_soon(n1_begins_later)
        started = trio.current_time()
        assert await sealed.other_writers("ds/global_step4", 0, started + 5,
                                          "ds/global_step2") == {"n1"}
        assert trio.current_time() - started >= 0.3
        started = trio.current_time()
        assert await sealed.other_writers("ds/global_step6", 0, started + 0.5,
                                          "ds/global_step4") == set()
        assert trio.current_time() - started >= 0.5
        assert await sealed.other_writers("ds/global_step6", 0, started + 5) == set()


async def test_a_rank_that_wrote_after_another_node_committed_the_step_makes_its_next_version(
        tmp_path: Path) -> None:
    """n0 commits `ds/global_step2` (no `.metadata`) with its file alone; n1's rank wrote its
    file of the step after that commit and before n1 learned of it: n1 joins version 1 and
    keeps its file, written over it, and its next commit makes version 2 with both files (the
    step stayed `writing` there for good, its file in no version)."""
    async with cluster(tmp_path, "n0", "n1") as (_nursery, (n0, n1)):
        model, late = "mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        await n0.write_file(f"ds/global_step2/{model}", b"m")
        await n0.ns.commits.commit_quietly(n0.ns.tree.find_step("ds/global_step2"))
        first = n0.ns.tree.find_step("ds/global_step2").step.manifest
        assert [e.name for e in first.files] == [model]
        await n1.write_file(f"ds/global_step2/{late}", b"z")
        n1.ns.tiers.learn(first, ["n0"])
        step_node = n1.ns.tree.find_step("ds/global_step2")
        assert step_node.step.manifest is first and not step_node.step.committed
        await n1.ns.commits.commit_quietly(step_node)
        second = step_node.step.manifest
        assert second.version == 2 and sorted(e.name for e in second.files) == [model, late]
        record = await n1.links.sealed.records.commit_of("ds/global_step2")
        assert record is not None and record.version == 2


async def test_a_file_written_on_two_nodes_with_other_bytes_is_the_later_ones_next_version(
        tmp_path: Path) -> None:
    """HF's `save_on_each_node`: each node writes the whole checkpoint, trainer_state.json's
    bytes differing. n0 commits it; n1, whose copy was written as n0 committed, joins that
    version and commits its bytes as the next one at once (the writers of the checkpoint
    before have all written this one), as on one file system the last write wins. Before,
    n1 kept the step `writing` for good ("has other content")."""
    async with cluster(tmp_path, "n0", "n1") as (_nursery, (n0, n1)):
        step = "hf/checkpoint-4"
        for node in (n0, n1):
            await node.links.sealed.note_writer("hf/checkpoint-2", 0)
            await node.write_file(f"{step}/model.safetensors", b"same model" * 100)
        await n0.write_file(f"{step}/trainer_state.json", b'{"node": 0}')
        await n1.write_file(f"{step}/trainer_state.json", b'{"node": 1}')
        await n0.ns.commits.commit_quietly(n0.ns.tree.find_step(step))
        first = n0.ns.tree.find_step(step).step.manifest
        await n1.hashed()
        n1.ns.tiers.learn(first, ["n0"])
        step_node = n1.ns.tree.find_step(step)
        assert step_node.step.manifest is first and not step_node.step.committed
        started = trio.current_time()
        await n1.ns.commits.commit_quietly(step_node)
        assert trio.current_time() - started < 2  # no wait for n0 to begin it again
        second = step_node.step.manifest
        assert second.version == 2 and len(second.files) == 2
        assert await n1.read_file(f"{step}/trainer_state.json") == b'{"node": 1}'
        assert second.entry("model.safetensors").xxh3 == first.entry("model.safetensors").xxh3


async def test_two_nodes_that_commit_the_same_save_at_once_both_keep_the_one_etcd_took(
        tmp_path: Path) -> None:
    """HF Trainer's ranks on two nodes finish the next checkpoint at the same moment: both nodes
    commit it as version 1, and etcd takes one commit record. The node whose record etcd did
    not take takes the other's commit for its own (the same version, the same commit time),
    so a delete of it from either node (HF's rotation, on rank 0's) removes it on both.
    Before, n1 kept its own version 1, stamped a moment later, which n0's delete did not
    cover: the checkpoint the job rotated away stayed listed on n1."""
    async with cluster(tmp_path, "n0", "n1") as (nursery, (n0, n1)):
        step = "hf/checkpoint-2"
        await n0.write_file(f"{step}/model.safetensors", b"model" * 2000)
        await n1.write_file(f"{step}/rng_state_1.pth", b"rng" * 100)
        async with trio.open_nursery() as both:  # neither hears of the other's commit first
            for node in (n0, n1):
                both.start_soon(node.ns.commits.commit_quietly, node.ns.tree.find_step(step))
        ours = {node.cfg.node_id: node.ns.tree.find_step(step).step.manifest
                for node in (n0, n1)}
        assert all(m is not None and m.version == 1 for m in ours.values()), ours
        assert ours["n0"].committed_ns != ours["n1"].committed_ns  # two commits of version 1
        record = await n0.links.sealed.records.commit_of(step)
        assert record is not None
        for node in (n0, n1):
            nursery.start_soon(node.node.steps.follow)

        def one_commit() -> bool:
            manifests = [n.ns.tree.find_step(step).step.manifest for n in (n0, n1)]
            return all(m.committed_ns == record.committed_ns for m in manifests)

        await wait_until_async(one_commit, timeout=10)
        kept = n1.ns.tree.find_step(step).step.manifest
        assert sorted(e.name for e in kept.files) == ["model.safetensors", "rng_state_1.pth"]
        for node in (n0, n1):
            assert await node.read_file(f"{step}/rng_state_1.pth") == b"rng" * 100
            assert await node.state(step) == "committed"
        deleter, other = (n0, n1) if record.committer == "n0" else (n1, n0)
        deleted = deleter.ns.tree.find_step(step).step.manifest  # the deleter's DELETE
        await deleter.links.delete.delete(
            Tombstone(step, deleted.version, deleted.committed_ns), other.cfg.node_id)
        assert other.ns.tree.find_step(step) is None


async def test_a_commit_replaced_by_the_cluster_s_while_it_was_published_goes_no_further(
        tmp_path: Path) -> None:
    """Two nodes commit the same save at once (HF's `save_on_each_node`), and the one whose
    commit record etcd did not take hears of the other's while its own is being published: it
    takes the other's commit for its own, which goes to its copies (`CopyPlans.learned`). Its
    own commit must then go no further: it went to the copies and uploads after the other's,
    took its place in the replicator's queue (the same version), and was no longer current
    when its turn came, so no copy was made of the files only that node held; the checkpoint
    stayed at one copy of them for good (1 run in 3 of
    test_cluster_multi_writer::test_hugging_face_trainer_saving_on_each_node_...)."""
    async with cluster(tmp_path, "n0", "n1") as (nursery, (n0, n1)):
        step = "hf/checkpoint-2"
        await n0.write_file(f"{step}/model.safetensors", b"model" * 2000)
        await n1.write_file(f"{step}/rng_state_1.pth", b"rng" * 100)
        for node in (n0, n1):
            real = node.links.sealed.publish

            async def publish(manifest: mf.StepManifest, held_here: set[str],
                              deadline: float | None = None, node: ClusterHarness = node,
                              real: Any = real) -> None:
                await real(manifest, held_here, deadline)
                record = await node.links.sealed.records.commit_of(manifest.path)
                assert record is not None
                if record.committed_ns != manifest.committed_ns:  # the other's was taken
                    nursery.start_soon(node.node.steps.follow)  # and its watch event comes
                    await wait_until_async(
                        lambda: node.ns.tree.find_step(step).step.manifest is not manifest,
                        timeout=10)

            node.links.sealed.publish = publish  # type: ignore[method-assign]
        async with trio.open_nursery() as both:  # neither hears of the other's commit first
            for node in (n0, n1):
                both.start_soon(node.ns.commits.commit_quietly, node.ns.tree.find_step(step))
        record = await n0.links.sealed.records.commit_of(step)
        assert record is not None
        loser = n1 if record.committer == "n0" else n0
        kept = loser.ns.tree.find_step(step).step.manifest
        assert kept.committed_ns == record.committed_ns  # the winner's, taken
        assert loser.node.replicator.queue.pending.get(step) is kept  # its copies are due
        sent = []
        while True:
            try:
                sent.append(loser.commits.receive_nowait())
            except trio.WouldBlock:
                break
        assert sent == [], sent  # its own commit went no further


async def test_a_step_short_of_copies_that_no_event_planned_is_planned_again(
        tmp_path: Path) -> None:
    """Each copy due is planned by an event (a commit, a step listed, a member gone or come); one
    that an event missed (as the race of two commits of one save did) is planned by the check
    run every SHORT_CHECK seconds: n0's step, whose commit reached no replicator here, is
    planned, gets its copies on n1, and is planned no more once it has them."""
    async with cluster(tmp_path, "n0", "n1") as (nursery, (n0, n1)):
        manifest = await committed_on(n0, "run/step_1")  # to the test's channel: no copy planned
        assert n0.node.replicator.queue.pending == {}
        assert n0.node.plans.plan_short_again() == 1
        assert n0.node.replicator.queue.pending == {"run/step_1": manifest}
        nursery.start_soon(n0.node.replicator.run)
        await wait_until_async(lambda: not n0.ns.copies.short_of_copies(
            manifest, 1, n0.directory.is_up), timeout=10)
        assert all(n1.store.object_path(e.xxh3).exists() for e in manifest.files)
        assert n0.node.plans.plan_short_again() == 0
        assert [m.path for m in n1.ns.copies.held_manifests()] == ["run/step_1"]
        assert n1.node.plans.plan_short_again() == 0  # n1 holds copies: with n0's, enough


async def test_a_step_whose_writer_is_down_waits_for_it_saying_so_and_retries_ever_less_often(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """n1 wrote its rank's file of `ds/global_step2` (no `.metadata`) and went down before
    any commit: n0's commit of the step does not go without that file; status says it waits
    for the nodes that write it and names n1 (not etcd, which answers); its retries come
    ever less often (every PENDING_RETRY, 0.5 s, they read etcd and filled the log twice a
    second for as long as n1 stayed away) and are logged at the 1st, 2nd, 4th... failure;
    once n1 is back the step commits whole within the longest pause."""
    import logging

    from tierfs.fs.lifecycle.commits import COORDINATION_RETRY_MAX

    caplog.set_level(logging.DEBUG, logger="tierfs.fs.lifecycle.commits")
    async with cluster(tmp_path, "n0", "n1") as (nursery, (n0, n1)):
        nursery.start_soon(n0.ns.keep_committing)  # the retries, as the daemon runs them
        model, zero = "mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        await n1.write_file(f"ds/global_step2/{zero}", b"z")
        deadline = trio.current_time() + 5
        assert await wait_until_async(
            lambda: n0.links.sealed.other_writers("ds/global_step2", 0, deadline)) == {"n1"}
        await n0.write_file(f"ds/global_step2/{model}", b"m")
        n0.live.set_members({"n0": n0.cfg.advertise})  # n1 is down
        step_node = n0.ns.tree.find_step("ds/global_step2")
        caplog.clear()
        await n0.ns.commits.commit_quietly(step_node)
        step = step_node.step
        assert not step.committed and step.commit_pending
        assert step.waiting_for == ("the nodes that write it: n1 writes files of "
                                    "ds/global_step2 and did not say which (down, or "
                                    "unreachable?)")
        await trio.sleep(5)
        tries = [r for r in caplog.records if "commit of ds/global_step2 waits" in r.message]
        assert 3 <= len(tries) <= 5, [r.message for r in tries]  # at 0, 0.5, 1.5, 3.5 s
        assert [r.levelno for r in tries][:3] == [logging.INFO, logging.INFO, logging.DEBUG]
        assert not step.committed
        members(n0, n1)
        with trio.fail_after(COORDINATION_RETRY_MAX + 3):
            while not step_node.step.committed:
                await trio.sleep(0.1)
        assert sorted(e.name for e in step_node.step.manifest.files) == [model, zero]


async def test_the_peer_port_refuses_a_node_with_another_token(tmp_path: Path) -> None:
    etcd = MemoryEtcd()
    async with cluster(tmp_path, "n0", etcd=etcd) as (_nursery, (n0,)):
        stranger = ClusterHarness(tmp_path, "n9", etcd, token=b"another token, of 32 bytes...")
        try:
            members(n0, stranger)
            manifest = await committed_on(n0, "run/step_4")
            with pytest.raises(TierError, match="^n0: "):
                await stranger.links.verify.verify("n0", "run/step_4", manifest.files[0],
                                                   False)
            assert n0.node.manifests.served_parts == 0
        finally:
            stranger.close()


# -- the lost-copies rule at start ----------------------------------------------------------


async def holders_of(etcd: MemoryEtcd, step: str) -> tuple[set[str], dict[str, set[str]]]:
    """(the commit record's holders, each file's) as the records in `etcd` say."""
    reader = CommitRecords(etcd, CLUSTER)  # type: ignore[arg-type]
    commit = await reader.commit_of(step)
    assert commit is not None
    files = await reader.files(step)
    return set(commit.holders), {name: set(r.holders) for name, r in files.items()}


async def test_a_node_back_with_an_empty_ram_dir_leaves_the_records_of_the_copies_it_lost(
        tmp_path: Path) -> None:
    etcd = MemoryEtcd()
    async with cluster(tmp_path, "n0", "n1", etcd=etcd) as (nursery, (n0, n1)):
        nursery.start_soon(n0.node.replicator.run)
        manifest = await committed_on(n0, "run/step_5")
        n0.node.replicator.submit(manifest)
        with trio.fail_after(10):
            await n0.node.replicator.queue.settled(manifest.path)
        assert (await holders_of(etcd, "run/step_5"))[0] == {"n0", "n1"}
    # n1 comes back with a new, empty RAM dir: every copy the records list there is lost
    async with cluster(tmp_path / "again", "n1", etcd=etcd, serve=False) as (_nursery, (n1,)):
        assert n1.ns.recovered.may_have_lost_copies
        await n1.node._drop_lost_copies()
        commit_holders, file_holders = await holders_of(etcd, "run/step_5")
        assert commit_holders == {"n0"}
        assert file_holders == {e.name: {"n0"} for e in manifest.files}


async def test_a_node_that_kept_its_ram_dir_does_not_read_the_records_at_start(
        tmp_path: Path) -> None:
    etcd = MemoryEtcd()
    async with cluster(tmp_path, "n0", etcd=etcd, serve=False) as (_nursery, (n0,)):
        await committed_on(n0, "run/step_6")
    async with cluster(tmp_path, "n0", etcd=etcd, serve=False) as (_nursery, (n0,)):
        assert not n0.ns.recovered.may_have_lost_copies  # its step is still in RAM
        calls = etcd.calls
        await n0.node._drop_lost_copies()
        assert etcd.calls == calls


async def test_a_node_that_cannot_correct_the_records_of_its_lost_copies_does_not_join(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_service, "CHECK_PATIENCE", 0.3)
    etcd = MemoryEtcd()
    async with cluster(tmp_path, "n0", etcd=etcd, serve=False) as (_nursery, (n0,)):
        etcd.down = True
        with pytest.raises(StartupError, match=r"etcd is unreachable at memory:2379 .*to "
                                               r"correct the records of the copies this node "
                                               r"lost; --cluster etcd://"):
            await n0.node._drop_lost_copies()


# -- catching up after a node was down ------------------------------------------------------


async def test_catch_up_applies_deletes_made_meanwhile_and_publishes_commits_etcd_missed(
        tmp_path: Path) -> None:
    etcd = MemoryEtcd()
    async with cluster(tmp_path, "n0", etcd=etcd, serve=False) as (_nursery, (n0,)):
        deleted = await committed_on(n0, "run/step_7")
        missed = await committed_on(n0, "run/step_8")
    # while n0 was down: another node deleted step_7, and step_8's commit record is gone
    # from etcd (the daemon died between its commit and the record)
    records = n0.links.sealed.records
    await records.delete_step(Deletion("run/step_7", deleted.version, deleted.committed_ns))
    await etcd.delete(records.commit_key("run/step_8"))
    etcd.fail_next = 2  # and etcd does not answer at first: tried until it does
    async with cluster(tmp_path, "n0", etcd=etcd, serve=False) as (nursery, (n0,)):
        assert n0.ns.tree.find_step("run/step_7") is not None
        nursery.start_soon(n0.node.steps.publish_pending)
        await n0.node.steps.catch_up()
        assert etcd.fail_next == 0
        assert n0.ns.tree.find_step("run/step_7") is None
        with trio.fail_after(5):
            await n0.node.caught_up.wait()
        record = await records.commit_of("run/step_8")
        assert record is not None and record.version == missed.version


async def test_a_commit_of_another_node_is_listed_here_within_its_watch_event(
        tmp_path: Path) -> None:
    async with cluster(tmp_path, "n0", "n1") as (nursery, (n0, n1)):
        nursery.start_soon(n1.node.steps.follow)
        await trio.testing.wait_all_tasks_blocked()
        await committed_on(n0, "run/step_9")
        await wait_until_async(lambda: n1.ns.tree.find_step("run/step_9") is not None, timeout=10)
        assert await n1.state("run/step_9") == "committed"


# -- admission -------------------------------------------------------------------------------


async def test_a_node_whose_advertised_address_is_not_its_peer_port_is_refused(
        tmp_path: Path) -> None:
    async with cluster(tmp_path, "n0", "n1", serve=False) as (nursery, (n0, n1)):
        with pytest.raises(StartupError, match=r"^this node cannot reach itself at its "
                           r"advertised address 127\.0\.0\.1:\d+ \(.*failed\): "
                           r"--advertise must be"):
            await n0.node._admit()
        await n1.serve(nursery)
        n0.node.cfg = replace(n0.cfg, advertise=n1.cfg.advertise)  # another node answers there
        with pytest.raises(StartupError, match=r"is the peer port of node 'n1', not this "
                           r"node's \('n0'\)"):
            await n0.node._admit()
        assert not await n0.etcd.get(CLUSTER.key("token-check"))  # refused before etcd


async def test_a_node_joins_only_with_the_clusters_token_and_transport(tmp_path: Path) -> None:
    etcd = MemoryEtcd()
    async with cluster(tmp_path, "n0", etcd=etcd) as (_nursery, (n0,)):
        await n0.node._admit()  # the first node records the token's check and "no TLS"
        assert await etcd.get(CLUSTER.key("token-check")) is not None
        assert (await etcd.get(CLUSTER.key("peer-tls"))).value == b'{"tls": false}'
    async with cluster(tmp_path / "b", "n1", etcd=etcd, token=b"not the token of n0's mount"
                       ) as (_nursery, (n1,)):
        with pytest.raises(StartupError, match="^this node's token is not the cluster's"):
            await n1.node._admit()
    await etcd.put(CLUSTER.key("peer-tls"), b'{"tls": true}')
    async with cluster(tmp_path / "c", "n2", etcd=etcd) as (_nursery, (n2,)):
        with pytest.raises(StartupError, match="^the cluster's peers use TLS"):
            await n2.node._admit()


async def test_a_node_that_cannot_reach_etcd_to_check_the_token_is_refused_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_service, "CHECK_PATIENCE", 0.3)
    etcd = MemoryEtcd()
    async with cluster(tmp_path, "n0", etcd=etcd) as (_nursery, (n0,)):
        etcd.down = True
        with pytest.raises(StartupError, match=r"^etcd is unreachable at memory:2379 .*\(tried "
                           r"for 0 s to check the cluster's token; --cluster etcd://"):
            await n0.node._admit()
        assert not n0.live.registered


async def test_a_step_removed_here_after_another_node_committed_it_with_a_file_of_this_node(
        tmp_path: Path) -> None:
    """n1 wrote its file of `ds/global_step2`, n0 committed the step with it (the records name
    n1 as its holder), and n1's user removed the step (`rm -r`) before n1 learned of that
    commit. The delete came after the commit, so it deletes that commit: the step leaves n1,
    n0 and the records, as a delete of the committed step does. Before, n1 then learned a
    commit naming a file that was nowhere any more (EIO on read, copies short for good)."""
    async with cluster(tmp_path, "n0", "n1") as (nursery, (n0, n1)):
        n1.ns.deletes.targets.append(peer_target("n0"))  # as ClusterNode's member list has it
        nursery.start_soon(delete_worker(n1.ns, None, n1.links.delete, n1.links.sealed).run)
        step = "ds/global_step2"
        model, zero = "mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        await n1.write_file(f"{step}/{zero}", b"z" * 1000)
        records = n0.links.sealed.records
        with trio.fail_after(10):
            while zero not in await records.files(step):  # n1's seal, recorded
                await trio.sleep(0.01)
        await n0.write_file(f"{step}/{model}", b"m")
        await n0.ns.commits.commit_quietly(n0.ns.tree.find_step(step))
        committed = n0.ns.tree.find_step(step).step.manifest
        assert sorted(e.name for e in committed.files) == [model, zero]
        await n1.ops.unlink(await n1.inode(step), zero.encode(), CTX)
        await n1.ops.rmdir(await n1.inode("ds"), b"global_step2", CTX)
        n1.ns.tiers.learn(committed, ["n0"])
        assert n1.ns.tree.find_step(step) is None
        await wait_until_async(lambda: n0.ns.tree.find_step(step) is None, timeout=10)
        assert await records.commit_of(step) is None
        assert await records.files(step) == {}


async def test_a_directory_the_job_wrote_in_keeps_its_times_when_its_commit_is_learned_again(
        tmp_path: Path) -> None:
    """n1 made `run/step_2` for n0's commit; its job then wrote a file in it (a save of the
    step again here). The commit's record changing later (n1 now holds copies) is the same
    commit learned again: the directory keeps the times the job's write gave it. Before, it
    took the commit's recorded times again, older than the job's write (a CI flake of
    test_cluster_kernel_cache showed it: HF's rotation sorts by these times)."""
    async with cluster(tmp_path, "n0", "n1") as (_nursery, (n0, n1)):
        committed = await committed_on(n0, "run/step_2")
        n1.ns.tiers.learn(committed, ["n0"])
        backing = n1.ns.tree.backing(n1.ns.tree.find_step("run/step_2"))
        made = os.stat(backing).st_mtime_ns
        await trio.sleep(0.02)  # apart by more than the file system's time granularity
        await n1.write_file("run/step_2/b", b"b")
        written = os.stat(backing).st_mtime_ns
        assert written > made
        n1.ns.tiers.learn(committed, ["n0", "n1"])
        assert os.stat(backing).st_mtime_ns == written


async def test_a_late_record_of_an_older_version_leaves_a_step_saved_again_here_alone(
        tmp_path: Path) -> None:
    """DeepSpeed on n0 rewrites its tracker `latest` at each save, faster than the cluster's
    record events come back: n0 committed v1 and v2 and writes v3 when the change of v1's
    record (n1 now holds a copy) arrives. That is old news: the step keeps v2 as its
    committed version and commits v3 next. Before, n0 took v1 for another node's commit of
    the step it writes (`join_commit`), made a second v2 of its own beside the one in etcd,
    took the recorded one back without its bytes, and `latest` was incomplete: no copy of it
    reached n1 and a replaced n0 could not resume (a CI flake of test_cluster_resume)."""
    async with cluster(tmp_path, "n0", "n1") as (_nursery, (n0, _n1)):
        tree = n0.ns.tree
        versions = []
        for tag in (b"global_step2", b"global_step4"):
            await n0.write_file("ds/latest", tag)
            await n0.ns.commits.commit_quietly(tree.find_step("ds/latest"))
            versions.append(tree.find_step("ds/latest").step.manifest)
        assert [m.version for m in versions] == [1, 2]
        ops = n0.ops  # the next save's `latest`, being written
        info = await ops.open(await n0.inode("ds/latest"), os.O_WRONLY | os.O_TRUNC, CTX)
        await ops.write(info.fh, 0, b"global_step6")
        await ops.flush(info.fh)  # closed; its RELEASE (which commits it) still to come
        await n0.hashed()
        n0.ns.tiers.learn(versions[0], ["n0", "n1"])  # v1's record, now naming n1 too
        step = tree.find_step("ds/latest").step
        assert step.manifest is versions[1] and step.state == "writing"
        await ops.release(info.fh)  # a tracker commits at its close
        assert step.manifest.version == 3 and step.committed
        assert await n0.read_file("ds/latest") == b"global_step6"
        record = await n0.links.sealed.records.commit_of("ds/latest")
        assert record is not None and record.version == 3
