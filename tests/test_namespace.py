"""The namespace and Operations without a mount: commit detection, copy on write, recovery at
start-up and the error boundary, driven through the same calls pyfuse3 makes."""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
import trio
import trio.testing

from tests.harness import CTX, Harness, dcp_save
from tierfs import manifest as mf
from tierfs.fs.fuse import fuse_wire as wire
from tierfs.fs.lifecycle.background import Background
from tierfs.fs.lifecycle.quiet_watch import SETTLED
from tierfs.fs.model.nodes import ROOT_INODE
from tierfs.fs.model.tombstones import Tombstone
from tierfs.trackers import TrackedStep

pytestmark = pytest.mark.core

@pytest.fixture
def harness(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = Harness(tmp_path / "ram")
    yield h
    h.close()


async def test_metadata_commits_and_announces(harness: Harness) -> None:
    await dcp_save(harness, "run/step_10", {"a": b"A" * 100, "b": b"B"})
    assert await harness.state("run/step_10") == "committed"
    event = harness.commits.receive_nowait()
    assert (event.path, event.step, event.version, event.node_id) == ("run/step_10", 10, 1, "n0")
    assert [f.name for f in event.files] == [".metadata", "a", "b"]
    on_disk = (harness.root / "tree/run/step_10/.tierfs-manifest").read_bytes()
    assert mf.decode(on_disk) == event
    for entry in event.files:
        assert (harness.root / "objects" / entry.xxh3).stat().st_size == entry.size
    # the hidden manifest is not an entry of the directory
    names = [name for name, _node in harness.ns.list_dir(harness.ns.child(
        harness.ns.child(harness.ns.root, b"run"), b"step_10"))]
    assert b".tierfs-manifest" not in names


async def test_commit_waits_for_writer_then_commits_on_its_close(harness: Harness) -> None:
    step_ino = await harness.mkdirs("run/step_1")
    info, _ = await harness.ops.create(step_ino, b"slow", 0o644, os.O_WRONLY, CTX)
    await harness.ops.write(info.fh, 0, b"part one")
    await dcp_save(harness, "run/step_1", {"fast": b"fast"})
    assert await harness.state("run/step_1") == "writing"
    await harness.ops.write(info.fh, 8, b" part two")
    await harness.ops.flush(info.fh)
    await harness.ops.release(info.fh)
    assert await harness.state("run/step_1") == "committed"
    event = harness.commits.receive_nowait()
    assert event.entry("slow").size == len(b"part one part two")


async def test_writing_a_committed_file_copies_it_first(harness: Harness) -> None:
    await dcp_save(harness, "step_2", {"shard": b"committed bytes"})
    manifest = harness.commits.receive_nowait()
    obj = harness.root / "objects" / manifest.entry("shard").xxh3
    info = await harness.ops.open(await harness.inode("step_2/shard"), os.O_WRONLY | os.O_TRUNC,
                                  CTX)
    await harness.ops.write(info.fh, 0, b"new")
    await harness.ops.release(info.fh)
    assert obj.read_bytes() == b"committed bytes"
    assert await harness.read_file("step_2/shard") == b"new"
    assert await harness.state("step_2") == "writing"
    info = await harness.ops.open(await harness.inode("step_2/.metadata"), os.O_RDWR, CTX)
    await harness.ops.write(info.fh, 0, b"M")  # keeps the rest of the file: copied, not emptied
    await harness.ops.release(info.fh)
    assert await harness.read_file("step_2/.metadata") == b"Meta"


async def test_restart_restores_committed_step_and_removes_leftovers(tmp_path: Path) -> None:
    first = Harness(tmp_path / "ram")
    await dcp_save(first, "run/step_3", {"shard": b"v1"})
    await first.write_file("run/step_3/shard", b"uncommitted v2")
    await first.write_file("run/step_4/partial", b"interrupted save")
    first.close()
    (tmp_path / "ram/objects" / ("f" * 32)).write_bytes(b"linked, manifest never written")
    (tmp_path / "ram/tree/run/.tierfs-tmp-1-2").write_bytes(b"temp")

    second = Harness(tmp_path / "ram")
    assert await second.state("run/step_3") == "committed"
    assert await second.read_file("run/step_3/shard") == b"v1"
    assert await second.state("run/step_4") == "writing"
    assert await second.read_file("run/step_4/partial") == b"interrupted save"
    assert not (tmp_path / "ram/objects" / ("f" * 32)).exists()
    assert not (tmp_path / "ram/tree/run/.tierfs-tmp-1-2").exists()
    second.close()


async def test_restart_removes_a_step_directory_set_aside_for_removal(tmp_path: Path) -> None:
    # A step that left the last tier is renamed aside and removed in a thread; a crash in
    # between leaves the directory, which the next start removes.
    first = Harness(tmp_path / "ram")
    first.close()
    aside = tmp_path / "ram/tree/.tierfs-tmp-1-3"
    (aside / "sub").mkdir(parents=True)
    (aside / "sub/shard").write_bytes(b"x" * 5000)

    second = Harness(tmp_path / "ram")
    assert not aside.exists()
    assert second.store.used_bytes == 0
    second.close()


async def test_background_work_waits_for_its_owner_and_ends_with_it() -> None:
    background = Background()
    started, cancelled = trio.Event(), trio.Event()

    async def work(tag: str) -> None:
        assert tag == "evict"
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    background.spawn(work, "evict")  # before the daemon starts its owner: it waits
    await trio.testing.wait_all_tasks_blocked()
    assert not started.is_set()
    async with trio.open_nursery() as nursery:
        await nursery.start(background.run)
        await started.wait()
        nursery.cancel_scope.cancel()  # unmount
    assert cancelled.is_set()


async def test_unreadable_manifest_is_set_aside(tmp_path: Path) -> None:
    first = Harness(tmp_path / "ram")
    await dcp_save(first, "step_5", {"a": b"a"})
    first.close()
    (tmp_path / "ram/tree/step_5/.tierfs-manifest").write_bytes(b"\x00garbage")
    second = Harness(tmp_path / "ram")
    assert await second.state("step_5") == "writing"
    assert (tmp_path / "ram/tree/step_5/.tierfs-manifest.damaged").exists()
    second.close()


async def test_errors_cross_the_boundary_as_errno(harness: Harness) -> None:
    with pytest.raises(pyfuse3.FUSEError) as info:
        await harness.ops.lookup(ROOT_INODE, b"missing", CTX)
    assert info.value.errno == errno.ENOENT
    with pytest.raises(pyfuse3.FUSEError) as info:
        await harness.ops.read(9999, 0, 10)
    assert info.value.errno == errno.EBADF
    with pytest.raises(pyfuse3.FUSEError) as info:
        await harness.ops.mkdir(ROOT_INODE, b".tierfs-x", 0o755, CTX)
    assert info.value.errno == errno.EPERM


async def test_ram_limit_refuses_with_enospc(tmp_path: Path) -> None:
    page = 4096  # the tier counts what files store: whole pages
    h = Harness(tmp_path / "ram", limit=3 * page)
    info, _ = await h.ops.create(ROOT_INODE, b"f", 0o644, os.O_WRONLY, CTX)
    await h.ops.write(info.fh, 0, b"x" * 2 * page)
    with pytest.raises(pyfuse3.FUSEError) as err:
        await h.ops.write(info.fh, 2 * page, b"x" * 2 * page)
    assert err.value.errno == errno.ENOSPC
    await h.ops.write(info.fh, 0, b"y" * 2 * page)  # overwriting in place needs no new space
    await h.ops.release(info.fh)
    assert h.store.used_bytes == 2 * page
    await h.ops.unlink(ROOT_INODE, b"f", CTX)
    assert h.store.used_bytes == 0
    h.close()


async def test_handle_open_before_commit_never_writes_into_committed_object(
        harness: Harness) -> None:
    await harness.write_file("step_1/a", b"AAAA")
    info = await harness.ops.open(await harness.inode("step_1/a"), os.O_RDWR, CTX)
    await dcp_save(harness, "step_1", {})
    manifest = harness.commits.receive_nowait()
    await harness.ops.write(info.fh, 0, b"XXXX")  # the handle predates the commit
    await harness.ops.release(info.fh)
    obj = harness.root / "objects" / manifest.entry("a").xxh3
    assert obj.read_bytes() == b"AAAA"
    assert await harness.read_file("step_1/a") == b"XXXX"
    assert await harness.state("step_1") == "writing"


async def test_step_renamed_away_and_back_is_committed_only_again(harness: Harness) -> None:
    await dcp_save(harness, "step_1", {"a": b"A"})
    await harness.rename("step_1", "tmp")
    info = await harness.ops.open(await harness.inode("tmp/a"), os.O_WRONLY | os.O_TRUNC, CTX)
    await harness.ops.write(info.fh, 0, b"half")
    await harness.rename("tmp", "step_1")
    assert await harness.state("step_1") == "writing"  # a writer is still at work
    await harness.ops.release(info.fh)
    assert await harness.state("step_1") == "committed"


async def test_restart_keeps_what_is_no_longer_a_step_and_clears_the_way(
        tmp_path: Path) -> None:
    first = Harness(tmp_path / "ram")
    await dcp_save(first, "step_1", {"a": b"A"})
    await first.rename("step_1", "backup")  # no longer a step: its files are plain files
    await first.write_file("backup/notes.txt", b"keep me")
    await dcp_save(first, "step_4", {"model": b"M"})
    await first.ops.unlink(await first.inode("step_4"), b"model", CTX)
    await first.ops.mkdir(await first.inode("step_4"), b"model", 0o755, CTX)  # in its place
    await first.ops.symlink(await first.inode("step_4"), b"link", b"model", CTX)
    first.close()
    second = Harness(tmp_path / "ram")
    assert await second.read_file("backup/notes.txt") == b"keep me"
    assert await second.read_file("backup/a") == b"A"
    assert await second.read_file("step_4/model") == b"M"
    assert await second.state("step_4") == "committed"
    assert os.path.islink(tmp_path / "ram/tree/step_4/link")
    second.close()


async def test_pending_commit_runs_when_its_last_writer_leaves(harness: Harness) -> None:
    step_ino = await harness.mkdirs("run/step_2")
    info, _ = await harness.ops.create(step_ino, b"slow", 0o644, os.O_WRONLY, CTX)
    await harness.ops.write(info.fh, 0, b"x")
    await dcp_save(harness, "run/step_2", {})
    assert await harness.state("run/step_2") == "writing"
    await harness.ops.unlink(step_ino, b"slow", CTX)  # the straggler's file is dropped
    assert await harness.state("run/step_2") == "committed"
    await harness.ops.release(info.fh)


async def test_space_of_a_file_unlinked_while_open_returns_at_close(harness: Harness) -> None:
    info, _ = await harness.ops.create(ROOT_INODE, b"f", 0o644, os.O_WRONLY, CTX)
    await harness.ops.write(info.fh, 0, b"x" * 1000)
    await harness.ops.unlink(ROOT_INODE, b"f", CTX)
    await harness.ops.write(info.fh, 1000, b"x" * 1000)
    assert harness.store.used_bytes == 4096  # one page holds both writes
    await harness.ops.release(info.fh)
    assert harness.store.used_bytes == 0


async def test_names_must_be_utf8(harness: Harness) -> None:
    with pytest.raises(pyfuse3.FUSEError) as info:
        await harness.ops.create(ROOT_INODE, b"\xff", 0o644, os.O_WRONLY, CTX)
    assert info.value.errno == errno.EILSEQ


async def test_fifos_and_sockets_are_kept_across_a_restart_and_never_in_a_step(
        tmp_path: Path) -> None:
    h = Harness(tmp_path / "ram")
    run_ino = await h.mkdirs("run")
    step_ino = await h.mkdirs("run/step_1")
    for name, kind in [(b"pipe", stat.S_IFIFO), (b"sock", stat.S_IFSOCK)]:
        attrs = await h.ops.mknod(run_ino, name, kind | 0o644, 0, CTX)
        assert stat.S_IFMT(attrs.st_mode) == kind
        with pytest.raises(pyfuse3.FUSEError) as info:
            await h.ops.mknod(step_ino, name, kind | 0o644, 0, CTX)
        assert info.value.errno == errno.EPERM
    with pytest.raises(pyfuse3.FUSEError) as info:
        await h.ops.mknod(run_ino, b"null", stat.S_IFCHR | 0o644, os.makedev(1, 3), CTX)
    assert info.value.errno == errno.EPERM
    h.close()
    h = Harness(tmp_path / "ram")  # a restart
    try:
        for name, kind in [("pipe", stat.S_IFIFO), ("sock", stat.S_IFSOCK)]:
            attrs = await h.ops.getattr(await h.inode(f"run/{name}"), CTX)
            assert stat.S_IFMT(attrs.st_mode) == kind
        await h.ops.unlink(await h.inode("run"), b"pipe", CTX)
        assert not (tmp_path / "ram/tree/run/pipe").exists()
    finally:
        h.close()


async def test_a_tracker_names_its_step_for_the_store_and_the_peers(harness: Harness) -> None:
    """What the uploader and the replicator ask of a tracker (OtherTiers): the step its content
    names in its directory (by name for DeepSpeed, by number for Megatron-LM), whether it is in
    the store, and whether a peer holds every file of it or each file has its K + 1 copies."""
    ns = harness.ns
    await dcp_save(harness, "ckpt/iter_0000150", {"model.pt": b"w"})
    await harness.write_file("ckpt/latest_checkpointed_iteration.txt", b"150\n")
    await dcp_save(harness, "ds/global_step4", {"model.pt": b"w"})
    await harness.write_file("ds/latest", b"global_step4")
    await harness.write_file("ds/latest_universal", b"release")  # names no step
    await harness.write_file("ds/notes.txt", b"150")  # not a tracker's name
    manifests = {}
    for path in ("ckpt/latest_checkpointed_iteration.txt", "ds/latest", "ds/latest_universal",
                 "ds/notes.txt"):
        node = ns.tree.find_step(path)
        await ns.commits.commit_quietly(node)
        manifests[path] = node.step.manifest
    tracker = manifests["ckpt/latest_checkpointed_iteration.txt"]
    assert ns.tiers.tracked_step(tracker) == TrackedStep(150, made_here=True, persisted=False)
    assert ns.tiers.tracked_step(manifests["ds/latest"]) == TrackedStep(4, True, False)
    assert ns.tiers.tracked_step(manifests["ds/latest_universal"]) is None
    assert ns.tiers.tracked_step(manifests["ds/notes.txt"]) is None

    def may_copy(manifest: mf.StepManifest, peer: str,
                 up: Callable[[str], bool] = lambda _node: True) -> bool:
        return ns.tiers.may_copy(manifest, peer, 2, up)  # K = 1

    assert may_copy(manifests["ds/notes.txt"], "b")
    assert not may_copy(tracker, "b")  # no other node holds a file of iter_0000150 yet
    step_node = ns.tree.find_step("ckpt/iter_0000150")
    ns.versions.add_file_holder(step_node, "c", [".metadata"])
    assert not may_copy(tracker, "b")  # model.pt is in RAM here alone
    ns.versions.add_file_holder(step_node, "b", ["model.pt"])
    # two copies of each file (a multi-node save's spread) though no other node holds both
    assert may_copy(tracker, "d")
    assert not may_copy(tracker, "d", up=lambda node: node != "c")  # c's copy while c is up
    ns.versions.add_file_holder(step_node, "b", [".metadata"])
    assert may_copy(tracker, "b", up=lambda _node: False)  # b holds every file
    assert ns.tiers.named_step(tracker) is step_node.step.manifest
    assert ns.tiers.named_step(manifests["ds/notes.txt"]) is None
    ns.tiers.mark_persisted(step_node.step.manifest)
    assert ns.tiers.tracked_step(tracker) == TrackedStep(150, True, True)
    assert may_copy(tracker, "c", up=lambda _node: False)  # c can read it from the store
    # a tracker that commits before the step it names (still being written): it waits for it
    await harness.write_file("ds/global_step6/model.pt", b"w")
    await harness.write_file("ds/latest", b"global_step6")
    node = ns.tree.find_step("ds/latest")
    await ns.commits.commit_quietly(node)
    assert ns.tiers.tracked_step(node.step.manifest) == TrackedStep(6, True, False)
    assert not may_copy(node.step.manifest, "b")


async def test_a_create_is_made_with_no_await_where_the_tier_has_room_else_by_the_handler(
        tmp_path: Path) -> None:
    """The relay has the daemon make a new file on its own turn of the loop
    (`Operations.create_now`) as `create` would: its mode after the umask, its owner, its
    entry, its errors. Where the RAM tier has no room for the file's first byte, the open may
    have to make room first (evict, wait for copies on their way, refuse it with ENOSPC:
    `Eviction.make_room`): it is left to the handler, with nothing made."""
    page = 4096
    h = Harness(tmp_path / "ram", limit=2 * page)
    step = await h.mkdirs("run/step_1")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    ctx = SimpleNamespace(uid=CTX.uid, gid=CTX.gid, umask=0o027, pid=CTX.pid)
    made = h.ops.create_now(step, b"a", 0o100666, flags, 0o027, ctx.uid, ctx.gid, ctx.pid)
    assert isinstance(made, tuple)
    fh, entry = made
    info, expected = await h.ops.create(step, b"b", 0o100666, flags, ctx)
    for attrs in (entry, expected):
        assert (attrs.st_mode, attrs.st_uid, attrs.st_gid, attrs.st_size, attrs.st_nlink) == (
            stat.S_IFREG | 0o640, ctx.uid, ctx.gid, 0, 1)
        assert (attrs.entry_timeout, attrs.attr_timeout) == (expected.entry_timeout,
                                                             expected.attr_timeout)
    assert entry.st_ino == await h.inode("run/step_1/a")
    assert h.ns.handle(fh).writable and h.ns.handle(fh).active  # writing, as after `create`
    assert h.ops.create_now(step, b"a", 0o100644, flags, 0, ctx.uid, ctx.gid, 1) == errno.EEXIST
    assert h.ops.create_now(entry.st_ino, b"x", 0o100644, flags, 0, 0, 0, 1) == errno.ENOTDIR
    assert h.ops.create_now(step, b".tierfs-x", 0o100644, flags, 0, 0, 0, 1) == errno.EPERM
    assert h.ops.create_now(step, b"x" * 256, 0o100644, flags, 0, 0, 0, 1) == errno.ENAMETOOLONG

    await h.ops.write(fh, 0, b"A" * 2 * page)  # the tier is full
    assert h.ops.create_now(step, b"c", 0o100644, flags, 0, ctx.uid, ctx.gid, 1) is None
    assert h.ops.lookup_absent(step, b"c") == errno.ENOENT  # nothing made
    for handle in (fh, info.fh):
        assert h.ops.flush_now(handle) == 0
        assert h.ops.release_now(handle) == 0
    h.close()


async def test_closes_that_commit_nothing_are_done_with_no_await_the_others_by_the_handlers(
        harness: Harness) -> None:
    """The relay has the daemon answer a LOOKUP of an absent name, and the FLUSH and RELEASE of
    a file whose close commits nothing, on its own turn of the loop (`Operations.lookup_absent`,
    `flush_now`, `release_now`); a close that may commit a step (its `.metadata`, the last
    writer of a pending commit, a file step) is left to the handlers, which may wait."""
    ops = harness.ops
    step = await harness.mkdirs("run/step_1")
    assert ops.lookup_absent(step, b"a") == errno.ENOENT
    assert ops.lookup_absent(step, b"x" * 256) == errno.ENAMETOOLONG
    shard, _ = await ops.create(step, b"a", 0o644, os.O_WRONLY, CTX)
    assert ops.lookup_absent(step, b"a") is None  # there: `lookup` answers with its entry
    assert ops.lookup_absent(await harness.inode("run/step_1/a"), b"b") == errno.ENOTDIR
    await ops.write(shard.fh, 0, b"A" * 4096)
    assert ops.flush_now(shard.fh) == 0
    assert ops.release_now(shard.fh) == 0
    assert ops.release_now(shard.fh) == errno.EBADF  # released: its handle is gone
    assert harness.ns.child(harness.ns.get(step), b"a").active_writers == 0

    slow, _ = await ops.create(step, b"slow", 0o644, os.O_WRONLY, CTX)
    await ops.write(slow.fh, 0, b"part one")
    metadata, _ = await ops.create(step, b".metadata", 0o644, os.O_WRONLY, CTX)
    await ops.write(metadata.fh, 0, b"m")
    assert ops.flush_now(metadata.fh) is None  # the saver's close: it commits
    await ops.flush(metadata.fh)
    assert ops.release_now(metadata.fh) is None
    await ops.release(metadata.fh)
    assert await harness.state("run/step_1") == "writing"  # waits for `slow`
    assert ops.flush_now(slow.fh) is None  # its last writer's close commits it
    await ops.flush(slow.fh)
    await ops.release(slow.fh)
    assert await harness.state("run/step_1") == "committed"
    event = harness.commits.receive_nowait()
    assert [(f.name, f.size) for f in event.files] == [
        (".metadata", 1), ("a", 4096), ("slow", len(b"part one"))]


async def test_a_setattr_of_mode_owner_or_times_is_done_with_no_await_where_it_needs_none(
        harness: Harness) -> None:
    """The relay has the daemon set a mode, an owner and times on its own turn of the loop
    (`Operations.setattr_now`), as `setattr` would: `tar x` and `rsync -a` set all three on
    every file they write, each a round trip through libfuse before. A file whose bytes are
    elsewhere (a step a peer holds) is left to `setattr`, which brings it back first."""
    ops = harness.ops
    await harness.write_file("run/step_1/a", b"x")
    a = await harness.inode("run/step_1/a")
    change = wire.SetattrIn(None, stat.S_IFREG | 0o600, 1234, 5678, 1_000_000_007,
                            2_000_000_009)
    attrs = ops.setattr_now(a, change)
    assert isinstance(attrs, pyfuse3.EntryAttributes)
    st = os.lstat(harness.root / "tree/run/step_1/a")
    for seen in (attrs, st):
        assert (seen.st_mode, seen.st_uid, seen.st_gid, seen.st_atime_ns, seen.st_mtime_ns) == (
            stat.S_IFREG | 0o600, 1234, 5678, 1_000_000_007, 2_000_000_009)
    assert ops.setattr_now(999_999, change) == errno.ENOENT
    entries = (mf.FileEntry("f", 1, "0" * 32),)
    harness.ns.tiers.learn(mf.StepManifest("run/step_2", 2, 1, "n1", 1, entries), ["n1"])
    remote = await harness.inode("run/step_2/f")
    assert ops.setattr_now(remote, change) is None
    assert (await ops.getattr(remote, CTX)).st_uid != 1234  # nothing done


async def test_a_loose_file_written_whole_commits_a_moment_after_its_close(
        harness: Harness) -> None:
    """A loose file (no step number: Lightning's `last.ckpt`, `torch.save(m, "best.pt")`,
    `config.json`) that its writer's open created or truncated is complete at that writer's
    close: it is due `SETTLED` after it (a node lost seconds after such a save kept nothing of
    it when it waited --commit-idle). One opened without truncation (appended, changed in
    place) may be written again at once: it waits to be quiet."""
    ns, due = harness.ns, harness.core.watch.due

    def settles(path: str) -> bool:
        node = ns.tree.find_step(path)
        return node.step.state == "writing" and due[node] - time.monotonic() <= SETTLED

    await harness.write_file("run/last.ckpt", b"saved once")  # created
    assert settles("run/last.ckpt")
    await ns.commits.commit_quietly(ns.tree.find_step("run/last.ckpt"))  # (as the watch does)
    await harness.write_file("run/last.ckpt", b"saved again")  # truncated at its open
    assert settles("run/last.ckpt")
    info = await harness.ops.open(await harness.inode("run/last.ckpt"),
                                  os.O_WRONLY | os.O_APPEND, CTX)
    await harness.ops.write(info.fh, 11, b", appended")
    await harness.ops.flush(info.fh)
    await harness.ops.release(info.fh)
    assert not settles("run/last.ckpt")


async def test_a_loose_file_moved_into_a_step_leaves_its_old_name_once_that_step_commits(
        harness: Harness) -> None:
    """`mv staging step_2` of a directory whose loose file committed: the file's old name may
    leave the tiers once the step it now lies in is committed (`OtherTiers.move_done`).
    Before, asking killed the daemon (it looked for steps below a file); and a directory
    moved into a step directory had none below it, so its old names could go at once."""
    await harness.write_file("run/staging/shard", b"data")
    loose = harness.ns.tree.find_step("run/staging/shard")
    await harness.ns.commits.commit_quietly(loose)  # (as the quiet watch does)
    committed_ns = loose.step.manifest.committed_ns
    await harness.mkdirs("run/step_2/inner")
    await harness.write_file("run/step_2/.metadata", b"m")
    await harness.write_file("run/other/shard", b"data")
    await harness.rename("run/staging", "run/step_3")  # the directory becomes a step
    await harness.rename("run/other", "run/step_2/inner/other")  # moved into a step
    await harness.hashed()
    moved = Tombstone("run/staging/shard", 1, committed_ns, moved_to="run/step_3/shard")
    into = Tombstone("run/other/shard", 1, committed_ns,
                     moved_to="run/step_2/inner/other/shard")
    assert harness.ns.tiers.move_done(moved, None)
    assert not harness.ns.tiers.move_done(into, None)  # step_2 is written again meanwhile
    await harness.ns.commits.commit_quietly(harness.ns.tree.find_step("run/step_2"))
    await harness.hashed()
    assert harness.ns.tiers.move_done(into, None)


async def test_attributes_set_on_a_closed_single_file_commit_within_a_moment(
        harness: Harness) -> None:
    """`shutil.copy2` (Lightning's save of each checkpoint), `cp -p`, `tar x`: a file's times
    and mode are set right after its writer closed it. For a file step or loose file no one
    writes, no change can follow: the version of new attributes is due within `SETTLED`, not
    --commit-idle (its file showed `writing`, with no copies, that long after every save).
    A file of a step directory still waits for its step to be quiet (more files may come)."""
    ns = harness.ns
    await harness.write_file("run/epoch=0-step=2.ckpt", b"saved")
    await harness.write_file("run/step_4/model.pt", b"saved")
    file_step, step_dir = ns.tree.find_step("run/epoch=0-step=2.ckpt"), \
        ns.tree.find_step("run/step_4")
    for node in (file_step, step_dir.children[b"model.pt"]):
        await ns.setattr(node, None, mode=0o600, mtime_ns=1)
    assert file_step.step.state == "writing"
    due = harness.core.watch.due
    assert due[file_step] - time.monotonic() <= SETTLED
    assert due[step_dir] - time.monotonic() > SETTLED


async def test_a_step_being_committed_by_the_watch_is_said_to_commit_now(
        harness: Harness) -> None:
    """While the quiet watch commits a due step (hashing its files), the step is still
    `writing`: its outlook says it commits now. It said `never` ("left being written by an
    earlier run of the daemon") in that window, and a `tierfs flush` that asked then gave up
    on a step committing under it (seen in CI)."""
    ns = harness.ns
    await harness.write_file("run/step_5/model.pt", os.urandom(4 << 20))
    step = ns.tree.find_step("run/step_5")
    await harness.mkdirs("run/step_6")  # the saver went on: step_5 is due at once
    kinds = set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.quiet.run)
        with trio.fail_after(10):
            while step.step.state == "writing":
                kinds.add(ns.commit_outlook(step).kind)
                await trio.sleep(0)
        nursery.cancel_scope.cancel()
    assert kinds == {"due"}  # asked at least once while it was being written


async def test_a_directory_held_open_answers_getattr_after_it_is_removed(
        harness: Harness) -> None:
    """`fstat` of a directory's descriptor answers once the directory is gone, as on a local
    file system: shutil.rmtree (HF's checkpoint rotation) opens a directory and fstat's it
    outside its error handling, so an ENOENT there failed a save whose rotation raced a
    delete of the same checkpoint on another node."""
    await dcp_save(harness, "run/step_1", {"a": b"A"})
    run = await harness.inode("run")
    for gone_by in ("rmdir", "a peer"):
        await harness.mkdirs("run/empty")
        ino = await harness.inode("run/empty" if gone_by == "rmdir" else "run/step_1")
        before = await harness.ops.getattr(ino, CTX)
        handle = await harness.ops.opendir(ino, CTX)
        if gone_by == "rmdir":
            await harness.ops.rmdir(run, b"empty", CTX)
        else:
            step = harness.ns.tree.find_step("run/step_1").step
            harness.ns.tiers.delete_from_peer("run/step_1", 1, step.manifest.committed_ns,
                                              "n1")
        with pytest.raises(pyfuse3.FUSEError):
            await harness.inode("run/empty" if gone_by == "rmdir" else "run/step_1")
        after = await harness.ops.getattr(ino, CTX)
        assert stat.S_ISDIR(after.st_mode) and after.st_nlink == 0
        assert (after.st_uid, after.st_gid, stat.S_IMODE(after.st_mode)) == (
            before.st_uid, before.st_gid, stat.S_IMODE(before.st_mode))
        await harness.ops.releasedir(handle)
