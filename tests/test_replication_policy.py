"""The cluster's rules that the daemon only wires, in process: the one replica-count rule
(`placement.copies_wanted`, as the writer sees it and as `tierfs status` and --sync-replicas
count), which file records count for a version (`recorded_copies`: only a record of the same
content), and which steps `CopyPlans` plans again (a step held here at the version listed; every
held step when members change), each with its share of the upload after its copies."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing

from tests.harness import Harness, dcp_save
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.replication.commit_order import CopyPlans
from tierfs.replication.coordination import placement
from tierfs.replication.coordination.commit_records import FileRecord
from tierfs.replication.recorded_copies import holders_by_file, of_content, recorded_holders_of
from tierfs.step_queue import StepQueue

pytestmark = pytest.mark.core


@pytest.mark.parametrize(("replicas", "nodes", "copies"), [
    (0, 1, 1), (0, 5, 1), (1, 1, 1), (1, 2, 2), (1, 5, 2), (2, 2, 2), (3, 12, 4), (2, 0, 0)])
def test_a_file_wants_its_writers_copy_and_k_more_or_one_on_each_node(
        replicas: int, nodes: int, copies: int) -> None:
    assert placement.copies_wanted(replicas, nodes) == copies
    # the writer's view of the same rule: the copies it makes on the others
    if nodes:
        assert placement.peer_copies_wanted(replicas, nodes - 1) == copies - 1


def test_restore_plan_counts_copies_by_the_same_rule() -> None:
    """Three live nodes and K = 5: a file held on one wants a copy on each of the two others
    (the rule caps K + 1 at the ring), not five."""
    files = {"a": placement.Placement(writer="n0", holders=frozenset({"n0"}))}
    plan = placement.restore_plan(files, ["n0", "n1", "n2"], 5)
    assert sorted(copy.target for copy in plan.copies) == ["n1", "n2"]


def manifest(*names: str) -> mf.StepManifest:
    entries = tuple(mf.FileEntry(name, 1, name * 32, chunks=("0" * 16,)) for name in names)
    return mf.StepManifest("run/step_1", 1, 2, "n0", 1, entries)


def record(xxh3: str, *holders: str) -> FileRecord:
    return FileRecord("n0", 1, xxh3, tuple(sorted(holders)))


def test_only_a_record_of_the_same_content_names_holders() -> None:
    step = manifest("a", "b", "c")
    records = {"a": record("a" * 32, "n0", "n1"), "b": record("0" * 32, "n0", "n2")}
    assert holders_by_file(step, records) == {"a": {"n0", "n1"}, "b": set(), "c": set()}
    assert of_content(records["a"], step.entry("a"))
    assert not of_content(records["b"], step.entry("b"))  # another save's content
    assert not of_content(None, step.entry("c")) and not of_content(records["a"], None)


def test_a_peer_counts_as_a_holder_only_where_etcd_took_it_for_this_content() -> None:
    step = manifest("a", "b", "c")
    found = {"a": record("a" * 32, "n0", "n1"), "b": record("0" * 32, "n1"),
             "c": record("c" * 32, "n0")}
    assert recorded_holders_of(step, "n1", ["a", "b", "c", "d"], found) == ["a"]


class Recorder:
    """The replicator and the uploader as `CopyPlans` sees them: what they were given."""

    def __init__(self, wanted: bool = True) -> None:
        self.queue = StepQueue()
        self.submitted: list[tuple[str, int]] = []
        self._wanted = wanted

    def submit(self, manifest: mf.StepManifest) -> None:
        self.submitted.append((manifest.path, manifest.version))

    def wanted(self, manifest: mf.StepManifest) -> bool:
        return self._wanted


async def test_copies_are_planned_again_for_a_step_held_here_at_the_listed_version(
        tmp_path: Path) -> None:
    h = Harness(tmp_path / "ram")
    try:
        await dcp_save(h, "run/step_1", {"a": b"A" * 100})
        held = h.commits.receive_nowait()
        replicator, uploader = Recorder(), Recorder()
        plans = CopyPlans(replicator, uploader, h.ns.tree.find_step, h.ns.tiers.held_manifests)
        async with trio.open_nursery() as nursery:
            plans.start(nursery)
            plans.learned(replace(held, version=held.version + 1))  # not the version here
            plans.learned(replace(held, path="run/step_2"))  # not a step here
            assert replicator.submitted == []
            plans.learned(held)
            assert replicator.submitted == [("run/step_1", held.version)]
            plans.members_changed()
            assert replicator.submitted == [("run/step_1", held.version)] * 2
            # the upload share of each goes once the replicator's queue settled
            await wait_until_async(lambda: len(uploader.submitted) >= 2, timeout=5)
            assert uploader.submitted == [("run/step_1", held.version)] * 2
    finally:
        h.close()


async def test_no_upload_share_of_a_step_the_uploader_does_not_want(tmp_path: Path) -> None:
    h = Harness(tmp_path / "ram")
    try:
        await dcp_save(h, "run/step_1", {"a": b"A" * 100})
        held = h.commits.receive_nowait()
        replicator, uploader = Recorder(), Recorder(wanted=False)
        plans = CopyPlans(replicator, uploader, h.ns.tree.find_step, h.ns.tiers.held_manifests)
        async with trio.open_nursery() as nursery:
            plans.start(nursery)
            plans.learned(held)
            await trio.testing.wait_all_tasks_blocked()
        assert replicator.submitted == [("run/step_1", held.version)]
        assert uploader.submitted == []
    finally:
        h.close()
