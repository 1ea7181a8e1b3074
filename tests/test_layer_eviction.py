"""Eviction, bad copies and start-up against the cluster's file records: a `Namespace` driven
through its Operations with no mount, whose `SealedCollector` is the real `ClusterCommits` on a
real etcd (one of the test's own where the test stops it). No daemon, no peer: another node's
part is played by writing its records directly."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from tests.harness import Harness, dcp_save
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd as EtcdServer
from tierfs.fs.model.nodes import StepState
from tierfs.replication.coordination.cluster_commit import ClusterCommits
from tierfs.replication.coordination.commit_records import CommitRecords, FileRecord
from tierfs.replication.coordination.etcd import ClusterUrl, Etcd, parse_cluster_url

pytestmark = pytest.mark.store


class EtcdHarness(Harness):
    """`Harness`, as node n0 of a cluster whose records are in etcd."""

    def __init__(self, root: Path, cluster: ClusterUrl, *, keep_ram: int = 1,
                 replicas: int = 0) -> None:
        self.records = CommitRecords(Etcd(cluster.endpoints, timeout=0.5), cluster)
        super().__init__(root, sealed_by=lambda core: ClusterCommits(
            self.records, "n0", core.tree.parts.identity.step_number),
            keep_ram=keep_ram, replicas=replicas)

    def step(self, path: str) -> StepState:
        node = self.ns.tree.find_step(path)
        assert node is not None
        return node.step

    def manifest(self, path: str) -> mf.StepManifest:
        return self.step(path).manifest

    async def recorded(self, path: str) -> dict[str, FileRecord]:
        return await self.records.files(path)


def new_cluster(server: EtcdServer) -> ClusterUrl:
    return parse_cluster_url(server.cluster_url(f"tierfs-test/{uuid.uuid4().hex[:10]}"))



async def wait_for_records(h: EtcdHarness, path: str, check: Callable[
        [dict[str, FileRecord]], bool], timeout: float = 10) -> dict[str, FileRecord]:
    async def matching() -> dict[str, FileRecord] | None:
        found = await h.recorded(path)
        return found if found and check(found) else None

    return await wait_until_async(matching, timeout=timeout, interval=0.05)  # type: ignore[no-any-return]


async def save_two_steps(h: EtcdHarness, first: dict[str, bytes]) -> None:
    """run/step_1 (`first`), recorded in etcd, then run/step_2: step_1 is beyond --keep-ram 1."""
    await dcp_save(h, "run/step_1", first)
    names = {e.name for e in h.manifest("run/step_1").files}
    await wait_for_records(h, "run/step_1", lambda r: set(r) == names)
    await dcp_save(h, "run/step_2", {"a": b"newer"})


async def test_a_persisted_step_leaves_ram_while_etcd_is_down_and_the_records_follow(
        tmp_path: Path) -> None:
    """etcd stops; step_1 is then persisted: its files leave RAM at once (the persistent tier
    holds them), not once etcd answers; when etcd is back, the records list n0 among those
    that left."""
    with EtcdServer(tmp_path / "etcd") as server:
        h = EtcdHarness(tmp_path / "ram", new_cluster(server))
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(h.ns.background.run)
                await save_two_steps(h, {"a": os.urandom(4096), "b": b"b" * 100})
                step = h.step("run/step_1")
                assert step.resident  # not persisted, no replica: it stays
                await trio.to_thread.run_sync(server.stop)
                h.ns.tiers.mark_persisted(step.manifest)
                await wait_until_async(lambda: not step.resident, timeout=5)
                await trio.to_thread.run_sync(server.start)
                await wait_for_records(h, "run/step_1", lambda r: all(
                    x.holders == () and x.left == ("n0",) for x in r.values()), timeout=20)
                nursery.cancel_scope.cancel()
        finally:
            h.close()


async def test_a_writer_keeps_its_copy_when_another_holder_dropped_itself(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """K = 1: n0 believes n1 and n2 hold step_1 (both verified their copies: K + 1 = 2 other
    copies, so n0's may leave), but n1 came back with an empty RAM dir and dropped itself
    from the record of "a". n0's eviction of "a" is refused (the records have one other
    holder): that copy stays in RAM and in the records; the other files leave, and n0 is no
    longer their holder (not one that `left`: the store does not hold them)."""
    h = EtcdHarness(tmp_path / "ram", new_cluster(etcd_server), replicas=1)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            await save_two_steps(h, {"a": os.urandom(4096), "b": b"b" * 100})
            manifest = h.manifest("run/step_1")
            names = [e.name for e in manifest.files]
            for peer in ("n1", "n2"):
                await h.records.add_holders("run/step_1", peer, {e.name: e.xxh3
                                                                  for e in manifest.files})
            await h.records.drop_holders("run/step_1", "n1", {"a": None})  # n1 lost "a"
            h.ns.tiers.mark_held(manifest, "n2", names)
            h.ns.tiers.mark_held(manifest, "n1", names)  # n0's view: both hold every file
            await wait_until_async(lambda: h.step("run/step_1").resident == {"a"})
            await wait_until_async(lambda: not h.ns.eviction._evictions)
            records = await h.recorded("run/step_1")
            assert records["a"].holders == ("n0", "n2") and records["a"].left == ()
            assert all(r.holders == ("n1", "n2") and r.left == ()
                       for name, r in records.items() if name != "a")
            nursery.cancel_scope.cancel()
    finally:
        h.close()


async def test_a_quarantined_copy_stops_being_counted(etcd_server: EtcdServer,
                                                      tmp_path: Path) -> None:
    """A RAM copy found bad is quarantined: the records stop counting n0 as its holder (not
    as one that left), so that the other holders restore it."""
    h = EtcdHarness(tmp_path / "ram", new_cluster(etcd_server))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            await dcp_save(h, "run/step_1", {"a": b"A" * 4096, "b": b"B" * 100})
            manifest = h.manifest("run/step_1")
            await wait_for_records(h, "run/step_1", lambda r: len(r) == len(manifest.files))
            entry = manifest.entry("a")
            assert entry is not None
            with open(h.store.object_path(entry.xxh3), "r+b") as obj:
                obj.write(b"X")  # a bad DIMM
            state = await h.ns.verifier.check_held_file("run/step_1", "a", entry.xxh3, True)
            assert state == "bad"
            records = await wait_for_records(h, "run/step_1",
                                             lambda r: r["a"].holders == ())
            assert records["a"].left == () and records["b"].holders == ("n0",)
            nursery.cancel_scope.cancel()
    finally:
        h.close()


async def test_start_says_whether_copies_may_have_been_lost(tmp_path: Path) -> None:
    """An empty RAM dir, or a committed step set aside, may have lost copies; a RAM dir whose
    steps all came back did not (the daemon then reads no records for lost copies)."""
    h = Harness(tmp_path / "ram")
    assert h.ns.recovered.may_have_lost_copies  # new: nothing committed here
    await dcp_save(h, "run/step_1", {"a": b"A" * 100})
    await dcp_save(h, "run/step_2", {"a": b"B" * 100})
    h.close()
    again = Harness(tmp_path / "ram")
    assert again.ns.recovered.steps == 2 and not again.ns.recovered.may_have_lost_copies
    lost = again.ns.tree.find_step("run/step_1").step.manifest.entry("a")
    again.close()
    os.unlink(tmp_path / "ram/objects" / lost.xxh3)  # type: ignore[union-attr]
    third = Harness(tmp_path / "ram")
    assert third.ns.recovered.set_aside == 1 and third.ns.recovered.may_have_lost_copies
    third.close()
    shutil.rmtree(tmp_path / "ram")
    emptied = Harness(tmp_path / "ram")
    assert emptied.ns.recovered.may_have_lost_copies
    emptied.close()


async def test_a_file_evicted_here_is_not_held_because_another_step_has_its_content(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """step_1 and step_2 have a file of the same content; step_1's left RAM (persisted) but
    the records still count n0 (that leave never reached etcd). At start n0 is dropped from
    step_1's record, though the object is here for step_2's file."""
    h = EtcdHarness(tmp_path / "ram", new_cluster(etcd_server))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            same = os.urandom(4096)
            await dcp_save(h, "run/step_1", {"a": same})
            manifest = h.manifest("run/step_1")
            await wait_for_records(h, "run/step_1", lambda r: len(r) == len(manifest.files))
            await dcp_save(h, "run/step_2", {"a": same, "b": b"b"})
            await wait_for_records(h, "run/step_2", lambda r: len(r) == 3)
            h.ns.tiers.mark_persisted(manifest)
            await wait_for_records(h, "run/step_1",
                                   lambda r: all(x.left == ("n0",) for x in r.values()))
            assert not h.step("run/step_1").resident
            entry = manifest.entry("a")
            assert entry is not None and h.store.object_path(entry.xxh3).exists()
            await h.records.add_holders("run/step_1", "n0", {"a": entry.xxh3})  # over-counted
            dropped = await h.sealed.drop_lost_copies(h.ns.view.holds_copy, h.ns.tiers.in_store)
            assert dropped == 1  # "a" only: the rest left as they should
            records = await h.recorded("run/step_1")
            assert records["a"].holders == () and records["a"].left == ()
            assert (await h.recorded("run/step_2"))["a"].holders == ("n0",)
            nursery.cancel_scope.cancel()
    finally:
        h.close()
