"""The commit of a step of many small files (a file per tensor): no await between its check and
its change, while every FUSE request waits, so its cost per file is counted here in system
calls (a timing would say nothing on a shared machine). A file settled before the commit (sealed,
no writer left: `Tree.file_settled`) is its object already and carries its manifest entry, so
the commit links and stats none of them; one sealed by the commit itself gets one link, and no
look at objects/ before it (a link that finds the object there says so itself). The objects
linked early go with their files when those go before any commit counted them."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import trio
import xxhash

from tests.harness import CTX, Harness, dcp_save
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.fs.model.nodes import Node
from tierfs.fs.store.ram_store import RamStore
from tierfs.fs.tree.sealing import INLINE_HASH_BYTES

pytestmark = pytest.mark.core

FILES = 500


async def test_a_commit_makes_one_link_per_file_and_no_stat_of_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit of many files links each file's object once, without first looking for it
    (no stat of objects/<xxh3>)."""
    harness = Harness(tmp_path / "ram")
    try:
        await commit_many(harness, monkeypatch)
    finally:
        harness.close()


async def test_a_step_of_settled_files_commits_with_no_link_and_no_stat_of_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the daemon runs: each file hashed after its close, in the background. The commit
    neither links a file into objects/ nor stats it for its entry's mode, owner and mtime (two
    system calls per file with every FUSE request waiting would be most of a 10,000-file
    commit)."""
    harness = Harness(tmp_path / "ram")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.ns.background.run)
            names = [f"t{i:05}.distcp" for i in range(FILES)]
            for name in names:
                await harness.write_file(f"run/step_3/{name}", name.encode() * 100)
            await harness.write_file("run/step_3/.metadata.tmp", b"meta")
            await settled(harness, "run/step_3", [*names, ".metadata.tmp"])
            calls = Counter[str]()

            def counted(name: str, real):  # type: ignore[no-untyped-def]
                def call(*args, **kwargs):  # type: ignore[no-untyped-def]
                    calls[name] += 1
                    return real(*args, **kwargs)
                return call

            for name in ("stat", "lstat", "link"):
                monkeypatch.setattr(os, name, counted(name, getattr(os, name)))
            await harness.rename("run/step_3/.metadata.tmp", "run/step_3/.metadata")
            monkeypatch.undo()
            assert await harness.state("run/step_3") == "committed"
            manifest = harness.commits.receive_nowait()
            assert [f.name for f in manifest.files] == [".metadata", *names]
            assert manifest.entry(names[7]).xxh3 == xxhash.xxh3_128_hexdigest(
                names[7].encode() * 100)
            assert calls["link"] + calls["stat"] + calls["lstat"] < 20, calls
            for entry in manifest.files:
                assert (harness.root / "objects" / entry.xxh3).stat().st_nlink == 2
            nursery.cancel_scope.cancel()
    finally:
        harness.close()


async def test_an_object_linked_early_goes_with_its_file_before_a_commit(
        tmp_path: Path) -> None:
    """A settled file of a step is its object at once (a second link of its inode); removed,
    or rewritten (a copy on write), before a commit counted it, the object goes too, and the
    RAM tier counts its bytes no more. The commit then names the new bytes."""
    harness = Harness(tmp_path / "ram")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.ns.background.run)
            used = harness.store.used_bytes
            objects = harness.root / "objects"
            await harness.write_file("run/step_4/gone", b"G" * 50_000)
            await harness.write_file("run/step_4/kept", b"1" * 50_000)
            await settled(harness, "run/step_4", ["gone", "kept"])
            first = xxhash.xxh3_128_hexdigest(b"1" * 50_000)
            assert sorted(p.name for p in objects.iterdir()) == sorted(
                [xxhash.xxh3_128_hexdigest(b"G" * 50_000), first])
            assert (harness.root / "tree/run/step_4/kept").stat().st_nlink == 2
            await harness.ops.unlink(await harness.inode("run/step_4"), b"gone", CTX)
            assert [p.name for p in objects.iterdir()] == [first]
            await harness.write_file("run/step_4/kept", b"2" * 40_000)
            await settled(harness, "run/step_4", ["kept"])
            second = xxhash.xxh3_128_hexdigest(b"2" * 40_000)
            assert [p.name for p in objects.iterdir()] == [second]
            assert harness.store.used_bytes - used == 40_960
            await harness.rename("run/step_4/kept", "run/step_4/.metadata")  # its commit
            manifest = harness.commits.receive_nowait()
            assert [(f.name, f.xxh3) for f in manifest.files] == [(".metadata", second)]
            nursery.cancel_scope.cancel()
    finally:
        harness.close()


async def test_a_settled_file_changed_in_attributes_only_commits_them(
        tmp_path: Path) -> None:
    """chmod, chown and utime of a settled file move what its entry says (the commit takes
    the settled entry, with no stat of its own)."""
    harness = Harness(tmp_path / "ram")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.ns.background.run)
            await harness.write_file("run/step_5/a", b"A" * 100)
            await settled(harness, "run/step_5", ["a"])
            node = harness.ns.tree.find_step("run/step_5").children[b"a"]
            await harness.ns.setattr(node, None, mode=0o600, uid=1234, gid=5678,
                                     mtime_ns=1_000_000_000_123)
            await harness.rename("run/step_5/a", "run/step_5/.metadata")
            entry = harness.commits.receive_nowait().entry(".metadata")
            assert (entry.mode, entry.uid, entry.gid, entry.mtime_ns) == (
                0o600, 1234, 5678, 1_000_000_000_123)
            nursery.cancel_scope.cancel()
    finally:
        harness.close()


async def settled(harness: Harness, step: str, names: list[str]) -> None:
    """Until each file of `step` named is sealed with its manifest entry, as the background
    does after the close."""
    step_node = harness.ns.tree.find_step(step)
    assert step_node is not None
    nodes: list[Node] = [step_node.children[name.encode()] for name in names]
    await wait_until_async(lambda: all(n.seal is not None and n.seal.settled is not None
                                       for n in nodes), timeout=30)


async def commit_many(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {f"t{i:05}.distcp": i.to_bytes(8, "little") * 512 for i in range(FILES)}
    objects = os.fsencode(harness.root / "objects")
    calls: Counter[str] = Counter()

    def counted(name: str, real):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            if any(isinstance(arg, str | bytes | Path) and os.fsencode(arg).startswith(objects)
                   for arg in args):
                calls[name] += 1
            return real(*args, **kwargs)
        return call

    for name in ("stat", "lstat", "link"):
        monkeypatch.setattr(os, name, counted(name, getattr(os, name)))
    # Counted from the first write: a small file sealed by its close is linked as its object
    # then (`RamStore.link_early`), the others by the commit; once each either way.
    for name, data in files.items():
        await harness.write_file(f"run/step_2/{name}", data)
    await harness.write_file("run/step_2/.metadata.tmp", b"meta")  # DCP's last file
    await harness.rename("run/step_2/.metadata.tmp", "run/step_2/.metadata")  # its commit
    monkeypatch.undo()
    assert await harness.state("run/step_2") == "committed"
    manifest = harness.commits.receive_nowait()
    assert len(manifest.files) == FILES + 1
    assert calls["link"] == FILES + 1, calls
    assert calls["stat"] + calls["lstat"] == 0, calls


def test_room_is_taken_back_from_objects_linked_early_whose_file_went_unseen(
        tmp_path: Path) -> None:
    """A tree file removed with no word to the store (a step directory set aside and removed
    whole) leaves its early object alone: the first want of room removes it."""
    store = RamStore(tmp_path / "ram", limit_bytes=100_000)
    store.acquire()
    try:
        tree_file = store.tree / "f"
        tree_file.write_bytes(b"x" * 60_000)
        ino = store.account_path(tree_file)
        store.link_early("ab" * 16, os.fsencode(tree_file), ino)
        assert store.object_path("ab" * 16).stat().st_ino == ino
        tree_file.unlink()
        assert store.used_bytes == 61_440  # the object holds the bytes
        assert store.room_for(50_000)
        assert store.used_bytes == 0 and not store.object_path("ab" * 16).exists()
    finally:
        store.release()


async def test_a_restart_keeps_objects_linked_early_and_counts_no_lost_copy(
        tmp_path: Path) -> None:
    """A node stopped with a step being written: each closed file of it is its object already
    (linked early). The start keeps those objects (they hold no RAM of their own) and does not
    count them as lost copies (none "removed" at start): a node that did would drop itself from
    the cluster's holders of its own shards, and a multi-node step waiting for them would never
    become whole. Removed after the restart, the file takes its object with it."""
    harness = Harness(tmp_path / "ram")
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.ns.background.run)
        await dcp_save(harness, "run/step_1", {"a": b"A" * 100})
        await harness.write_file("run/step_2/__1_0.distcp", b"S" * 50_000)
        await settled(harness, "run/step_2", ["__1_0.distcp"])
        nursery.cancel_scope.cancel()
    harness.close()
    digest = xxhash.xxh3_128_hexdigest(b"S" * 50_000)
    again = Harness(tmp_path / "ram")
    try:
        assert again.ns.recovered.objects_removed == 0
        assert not again.ns.recovered.may_have_lost_copies
        tree_file = tmp_path / "ram/tree/run/step_2/__1_0.distcp"
        assert again.store.object_path(digest).stat().st_ino == tree_file.stat().st_ino
        await again.ops.unlink(await again.inode("run/step_2"), b"__1_0.distcp", CTX)
        assert not again.store.object_path(digest).exists()
    finally:
        again.close()


async def test_a_small_file_is_sealed_at_its_close_without_a_task_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small file (up to INLINE_HASH_BYTES) is sealed and becomes its object as its writer
    ends, on the loop: no background task for it (a step of 10,000 small files paid a task, its
    start and its turns of the loop, per file). A bigger one is still hashed in the
    background, off the writer's path."""
    harness = Harness(tmp_path / "ram")
    spawned: list[str] = []
    spawn = harness.ns.background.spawn

    def counted(work, *args):  # type: ignore[no-untyped-def]
        spawned.append(getattr(work, "__name__", repr(work)))
        spawn(work, *args)

    monkeypatch.setattr(harness.ns.background, "spawn", counted)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.ns.background.run)
            small = b"s" * INLINE_HASH_BYTES
            await harness.write_file("run/step_4/small.distcp", small)
            node = harness.ns.tree.find_step("run/step_4").children[b"small.distcp"]
            assert node.seal is not None and node.seal.settled is not None
            assert (tmp_path / "ram/objects" / xxhash.xxh3_128_hexdigest(small)).exists()
            assert "_in_background" not in spawned, spawned
            await harness.write_file("run/step_4/bigger.distcp", b"b" * (INLINE_HASH_BYTES + 1))
            assert spawned.count("_in_background") == 1, spawned
            await settled(harness, "run/step_4", ["small.distcp", "bigger.distcp"])
            nursery.cancel_scope.cancel()
    finally:
        harness.close()


async def test_a_hold_of_some_files_of_a_large_step_looks_only_at_those(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's replicas of a step of many files are held a batch at a time (HOLD names up to
    1,000): each batch looks for the objects of the files it names, not of every file of the
    step not held yet (a 20,000-file step's twenty batches took 0.35 s each)."""
    harness = Harness(tmp_path / "ram")
    try:
        files = {f"f{i:05}": i.to_bytes(8, "little") * 64 for i in range(2000)}
        entries = tuple(mf.FileEntry(name, len(data), xxhash.xxh3_128_hexdigest(data))
                        for name, data in files.items())
        manifest = mf.StepManifest("run/step_5", 5, 1, "n1", 1, entries)
        harness.ns.tiers.learn(manifest, ["n1"])
        sent = [e.name for e in entries[:100]]
        for entry in entries[:300]:  # 200 more arrived, held in a later batch
            harness.store.object_path(entry.xxh3).write_bytes(files[entry.name])
        objects = os.fsencode(harness.root / "objects")
        looks: Counter[str] = Counter()
        stat = os.stat

        def counted(path: object, *args: object, **kwargs: object) -> os.stat_result:
            if isinstance(path, str | bytes | Path) and os.fsencode(path).startswith(objects):
                looks["stat"] += 1
            return stat(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "stat", counted)
        held = await harness.ns.tiers.hold_files("run/step_5", 1, sent, "n1")
        monkeypatch.undo()
        assert held == sent
        assert looks["stat"] <= len(sent), looks
        step = harness.ns.tree.find_step("run/step_5")
        assert step is not None and step.step.resident == set(sent)
        for name in sent:
            assert (harness.root / "tree/run/step_5" / name).read_bytes() == files[name]
    finally:
        harness.close()
