"""The core against its ports' contracts, in process, on the in-memory fakes of tests/fakes.py:
a tier that fails raises `TierError` and the core goes on to the next tier or reports it; an
error outside the contract is a bug, which surfaces instead of passing for a tier's failure."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.fakes import BuggySource, MemoryPeers, MemoryTier
from tests.test_namespace import Harness, dcp_save
from tierfs import manifest as mf
from tierfs.fs import residency

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
    with trio.fail_after(60):
        while node.step.resident:
            await trio.sleep(0.01)
    return manifest


async def test_a_copy_leaves_ram_only_for_a_store_seen_to_hold_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's word is asked at the moment a copy would leave RAM for it: a store that
    does not answer keeps the step in RAM, one that lacks it makes it not persisted (and
    hands it back for another upload), and only a store seen holding it lets it go."""
    monkeypatch.setattr(residency, "STORE_PAUSE", 0.0)  # the next check comes at once
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
            with trio.fail_after(10):
                while "the persistent tier cannot say" not in caplog.text:
                    await trio.sleep(0.01)
            assert node.step.resident == names and node.step.persisted

            store.down = False  # it answers: it holds nothing of the step
            h.ns.residency.enforce_keep_ram()
            with trio.fail_after(10):
                again = await h.ns.residency.lost_from_store.receive()
            assert again is manifest
            assert node.step.resident == names and not node.step.persisted

            store.put_step(manifest, {**FILES, ".metadata": b"meta"})  # uploaded again
            h.ns.tiers.mark_persisted(manifest)
            with trio.fail_after(10):
                while node.step.resident:
                    await trio.sleep(0.01)
            assert await h.read_file("run/step_1/__0_0.distcp") == FILES["__0_0.distcp"]
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
    """Before the ports declared their errors, any exception of a source was taken for "this
    tier cannot serve it" and the next one was asked: a bug in an adapter went unseen."""
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
        h.ns.tiers.versions.add_file_holder(step, "n1", [e.name for e in manifest.files])
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
