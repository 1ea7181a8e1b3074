"""The core against its ports' contracts, in process, on the in-memory fakes of tests/fakes.py:
a tier that fails raises `TierError` and the core goes on to the next tier or reports it; an
error outside the contract is a bug, which surfaces instead of passing for a tier's failure."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import trio

from tests.fakes import BuggySource, MemoryPeers, MemoryTier
from tests.harness import Harness, dcp_save
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.fs.lifecycle import eviction
from tierfs.fs.lifecycle.other_tiers import OtherTiers
from tierfs.fs.model.ports import StepCopies

pytestmark = pytest.mark.core

FILES = {"__0_0.distcp": b"weights" * 5000, "__1_0.distcp": b"optimizer" * 3000}


async def persisted_and_evicted(h: Harness, store: MemoryTier, step: str,
                                files: dict[str, bytes] = FILES) -> mf.StepManifest:
    """Save `step` (DCP's way: `files`, then .metadata), put it in `store` as the uploader
    would, and wait until it left RAM."""
    await dcp_save(h, step, files)
    manifest = h.commits.receive_nowait()
    store.put_step(manifest, {**files, ".metadata": b"meta"})
    h.ns.tiers.mark_persisted(manifest)  # keep_ram=0: it leaves RAM
    node = h.ns.tree.find_step(step)
    await wait_until_async(lambda: not node.step.resident, timeout=60)
    return manifest


async def test_a_copy_leaves_ram_only_for_a_store_seen_to_hold_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's word is asked at the moment a copy would leave RAM for it: a store that
    does not answer keeps the step in RAM, one that lacks it makes it not persisted (and
    hands it back for another upload), and only a store seen holding it lets it go."""
    monkeypatch.setattr(eviction, "STORE_PAUSE", 0.0)  # the next check comes at once
    store = MemoryTier("s3")
    h = Harness(tmp_path / "ram", read_sources=[store], persist=store, store_check=store,
                keep_ram=0)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            await dcp_save(h, "run/step_1", FILES)
            manifest = h.commits.receive_nowait()
            node = h.ns.tree.find_step("run/step_1")
            names = {entry.name for entry in manifest.files}
            store.down = True
            h.ns.tiers.mark_persisted(manifest)  # as the uploader does once it is up
            await wait_until_async(lambda: "the persistent tier cannot say" in caplog.text,
                                   timeout=10)
            assert node.step.resident == names and node.step.persisted

            store.down = False  # it answers: it holds nothing of the step
            h.ns.eviction.enforce_keep_ram()
            with trio.fail_after(10):
                again = await h.ns.eviction.lost_from_store.receive()
            assert again is manifest
            assert node.step.resident == names and not node.step.persisted

            store.put_step(manifest, {**FILES, ".metadata": b"meta"})  # uploaded again
            h.ns.tiers.mark_persisted(manifest)
            await wait_until_async(lambda: not node.step.resident, timeout=10)
            assert await h.read_file("run/step_1/__0_0.distcp") == FILES["__0_0.distcp"]
            nursery.cancel_scope.cancel()
    finally:
        h.close()


async def test_a_step_persisted_looks_at_its_own_run_directory_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a step is in the store, the steps of its run directory beyond --keep-ram leave RAM,
    and no other step is looked at: a walk of every step at the end of each upload made a
    mount holding 2,400 small steps flush at 30 steps a second against 140 for 600."""
    store = MemoryTier("s3")
    h = Harness(tmp_path / "ram", read_sources=[store], persist=store, keep_ram=1)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            manifests = {}

            async def saved(step: str) -> None:
                await dcp_save(h, step, FILES)
                manifests[step] = h.commits.receive_nowait()
                store.put_step(manifests[step], {**FILES, ".metadata": b"meta"})

            def resident(step: str) -> bool:
                return bool(h.ns.tree.find_step(step).step.resident)

            await saved("other/step_1")
            h.ns.tiers.mark_persisted(manifests["other/step_1"])  # the newest: it stays
            for step in ("other/step_2", "run/step_1", "run/step_2"):
                await saved(step)
            walks = []
            tree = h.ns.tree
            monkeypatch.setattr(tree, "steps", lambda under=None: walks.append(under) or
                                type(tree).steps(tree, under))
            for step in ("run/step_1", "run/step_2"):
                h.ns.tiers.mark_persisted(manifests[step])
            assert walks == []
            await wait_until_async(lambda: not resident("run/step_1"), timeout=10)
            assert resident("run/step_2")  # the newest stays
            # other/step_1 is beyond --keep-ram now, but nothing in its directory got safer
            assert resident("other/step_1")
            h.ns.tiers.mark_persisted(manifests["other/step_2"])
            await wait_until_async(lambda: not resident("other/step_1"), timeout=10)
            assert walks == []
            nursery.cancel_scope.cancel()
    finally:
        h.close()


async def test_a_read_goes_past_a_tier_that_is_down_to_one_that_has_the_file(
        tmp_path: Path) -> None:
    down, store = MemoryTier("peers"), MemoryTier("s3")
    down.down = True
    h = Harness(tmp_path / "ram", read_sources=[down, store], persist=store, keep_ram=0)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            await persisted_and_evicted(h, store, "run/step_1")
            assert await h.read_file("run/step_1/__0_0.distcp") == FILES["__0_0.distcp"]
            assert store.reads > 0
            nursery.cancel_scope.cancel()
    finally:
        h.close()


async def test_a_source_failing_outside_its_contract_is_a_bug_not_a_tier_failure(
        tmp_path: Path) -> None:
    """A read source raising outside its contract (not a TierError) is a bug: the read fails
    with it, instead of its passing for "this tier cannot serve it" while the next source is
    asked."""
    buggy, store = BuggySource("peers"), MemoryTier("s3")
    h = Harness(tmp_path / "ram", read_sources=[buggy, store], persist=store, keep_ram=0)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            await persisted_and_evicted(h, store, "run/step_1")
            node = h.ns.child(h.ns.tree.find_step("run/step_1"), b"__1_0.distcp")
            handle = await h.ns.open(node, 0)
            try:
                with pytest.raises(RuntimeError, match="a bug in a read source"):
                    await h.ns.read(handle, 0, 100)
            finally:
                await h.ns.release(handle)
            nursery.cancel_scope.cancel()
    finally:
        h.close()


async def test_verify_reports_an_unreachable_peer_and_a_store_that_is_down(
        tmp_path: Path) -> None:
    store = MemoryTier("s3")
    peers = MemoryPeers(holders=None)
    h = Harness(tmp_path / "ram", read_sources=[store], persist=store, peers=peers,
                     keep_ram=5)
    try:
        await dcp_save(h, "run/step_2", FILES)
        manifest = h.commits.receive_nowait()
        store.put_step(manifest, {**FILES, ".metadata": b"meta"})
        h.ns.tiers.mark_persisted(manifest)
        step = h.ns.tree.find_step("run/step_2")
        h.ns.versions.add_file_holder(step, "n1", [e.name for e in manifest.files])
        peers.unreachable.add("n1")
        store.down = True
        [report] = await h.ns.verifier.verify("run/step_2", repair=False)
        by_tier = {tier.tier: tier for tier in report.tiers}
        assert "could not ask n1" in by_tier["peer:n1"].unreachable
        persisted = next(t for name, t in by_tier.items() if name.startswith("persist"))
        assert "cannot read the persistent tier" in persisted.error
        assert not report.lost  # the RAM copies are good
    finally:
        h.close()


def uses_of_tiers(source: str) -> set[str]:
    """The members read of `<x>.tiers` in `source`, and of a name bound to such a value."""
    tree = ast.parse(source)
    names = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Attribute) and node.value.attr == "tiers"
             for target in node.targets if isinstance(target, ast.Name)}
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and ((isinstance(node.value, ast.Attribute) and node.value.attr == "tiers")
                 or (isinstance(node.value, ast.Name) and node.value.id in names))}


def test_other_tiers_is_the_step_copies_port() -> None:
    """`OtherTiers` implements each call of the inward port `StepCopies` as the port declares
    it, and the daemon, the replication and the persistent tier use it through those alone."""
    members = {name for name in vars(StepCopies) if not name.startswith("_")}
    assert "mark_persisted" in members and "recheck_wanted" in StepCopies.__annotations__
    for name in members:
        declared, implemented = getattr(StepCopies, name), getattr(OtherTiers, name)
        assert [(p.name, p.kind, p.default) for p in
                inspect.signature(declared).parameters.values()] == \
            [(p.name, p.kind, p.default) for p in
             inspect.signature(implemented).parameters.values()], name
        assert inspect.iscoroutinefunction(declared) == \
            inspect.iscoroutinefunction(implemented), name
    assert uses_of_tiers("t = ns.tiers\nt.learn(m)\nns.tiers.unlisted(p)\nx.append(1)") == {
        "learn", "unlisted"}
    package = Path(__file__).resolve().parent.parent / "tierfs"
    used = set().union(*(uses_of_tiers(path.read_text()) for path in package.rglob("*.py")
                         if path.relative_to(package).parts[0] != "fs"))
    assert used and used <= members | {"recheck_wanted"}, used - members
