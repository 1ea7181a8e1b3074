"""Seals off the writer's path (`fs.tree.sealing`): the close of a file returns without waiting for
its hash, and the seal a commit uses still describes the committed bytes, whatever happened to
the file while it was being hashed."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest
import trio
import trio.testing
import xxhash

from tests.conftest import Mount, MountFactory, getxattr, tierfs
from tests.harness import CTX, Harness, dcp_save
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.fs.tree import tree as tree_module
from tierfs.fs.tree.sealing import HASH_AT_COMMIT, INLINE_HASH_BYTES

pytestmark = pytest.mark.fuse

BIG = 32 << 20  # big enough that its hash is still running when the next write comes


@pytest.fixture
def harness(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = Harness(tmp_path / "ram")
    yield h
    h.close()


def node_of(h: Harness, path: str):  # type: ignore[no-untyped-def]
    node = h.ns.root
    for part in path.split("/"):
        node = h.ns.child(node, part.encode())
    return node


async def test_close_returns_before_the_hash(harness: Harness) -> None:
    """The background owner has not run yet: the file (bigger than what is hashed at once, on
    the loop) is closed and still unsealed; the first one who needs the seal (the commit)
    computes it, with the digest of the bytes."""
    await harness.write_file("run/step_1/a", b"A" * (INLINE_HASH_BYTES + 1))
    assert node_of(harness, "run/step_1/a").seal is None
    await dcp_save(harness, "run/step_1", {"b": b"B" * 10})
    assert await harness.state("run/step_1") == "committed"
    manifest = harness.commits.receive_nowait()
    digests = {f.name: f.xxh3 for f in manifest.files}
    assert digests["a"] == xxhash.xxh3_128_hexdigest(b"A" * (INLINE_HASH_BYTES + 1))
    assert digests["b"] == xxhash.xxh3_128_hexdigest(b"B" * 10)


async def test_a_queued_background_hash_counts_as_pending(harness: Harness) -> None:
    """Between a writer's close (its FLUSH queues the hash) and its RELEASE, the hash may not
    have started yet: it counts as under way, so the RELEASE does not have the file hashed a
    second time (each small file of a many-file step was hashed twice, or three times; a file
    up to INLINE_HASH_BYTES is sealed at its close, on the loop)."""
    await harness.write_file("run/step_3/a", b"A" * (INLINE_HASH_BYTES + 1))
    node = node_of(harness, "run/step_3/a")
    assert node.seal is None and harness.ns.tree.parts.sealing.pending(node)
    node.gen += 1  # written again: the queued hash is of an older generation
    assert not harness.ns.tree.parts.sealing.pending(node)


async def test_background_seal_after_close(harness: Harness) -> None:
    """A file outside any step directory is hashed in the background after its close; a big
    one in a step directory only once its step commits (its hash counts as pending)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.ns.background.run)
        await harness.write_file("run/loose.bin", b"A" * BIG)
        node = node_of(harness, "run/loose.bin")
        await wait_until_async(lambda: node.seal is not None, timeout=30)
        assert node.seal.digest.xxh3 == xxhash.xxh3_128_hexdigest(b"A" * BIG)
        await harness.write_file("run/step_2/a", b"B" * BIG)
        in_step = node_of(harness, "run/step_2/a")
        await trio.testing.wait_all_tasks_blocked()
        assert in_step.seal is None and harness.ns.tree.parts.sealing.pending(in_step)
        await dcp_save(harness, "run/step_2", {})
        assert in_step.seal is not None
        assert in_step.seal.digest.xxh3 == xxhash.xxh3_128_hexdigest(b"B" * BIG)
        nursery.cancel_scope.cancel()


async def test_a_small_file_is_hashed_on_the_loop_and_a_large_one_in_a_thread(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of 10,000 small files handed each file's hash to a thread and back: two
    wake-ups across threads, which cost more than hashing 4 KiB. Small files are hashed
    where they are; a large file still leaves the loop (and the FUSE requests) free."""
    threaded: list[object] = []
    real = trio.to_thread.run_sync

    async def counted(func, *args, **kwargs):  # type: ignore[no-untyped-def]
        threaded.append(func)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.ns.background.run)
        for name, size in (("small", INLINE_HASH_BYTES), ("large", INLINE_HASH_BYTES + 1)):
            await harness.write_file(f"run/step_4/{name}", b"S" * size)
            node = node_of(harness, f"run/step_4/{name}")
            await wait_until_async(lambda n=node: n.seal is not None, timeout=30)
            assert node.seal.digest.xxh3 == xxhash.xxh3_128_hexdigest(b"S" * size)
            paced = harness.ns.tree.parts.sealing._hash_paced  # mf.hash_fd, in a hash thread
            assert threaded == ([] if name == "small" else [paced]), name
        nursery.cancel_scope.cancel()


async def test_write_during_the_hash_discards_its_seal(harness: Harness) -> None:
    """A writer that comes back while the hash of the previous bytes runs: that hash must not
    become the seal; the commit gets the digest of the final bytes."""
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.ns.background.run)
        await harness.write_file("run/step_3/a", b"A" * BIG)
        node = node_of(harness, "run/step_3/a")
        await trio.testing.wait_all_tasks_blocked()  # the hash is in its thread (or done)
        final = b"Z" * BIG  # same size: only the generation tells the bytes apart
        info = await harness.ops.open(node.ino, os.O_WRONLY, CTX)
        await harness.ops.write(info.fh, 0, final)
        assert node.seal is None
        await harness.ops.flush(info.fh)
        await harness.ops.release(info.fh)
        await dcp_save(harness, "run/step_3", {})
        manifest = harness.commits.receive_nowait()
        assert {f.name: f.xxh3 for f in manifest.files}["a"] == xxhash.xxh3_128_hexdigest(final)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("passthrough", [True, False], ids=["passthrough", "daemon"])
def test_rewrites_right_after_close_never_keep_a_stale_seal(mounts: MountFactory,
                                                            passthrough: bool) -> None:
    """Each file is closed and at once rewritten in place (same size, other bytes) while its
    hash may still run: the xxh3 reported and committed is always that of the final bytes."""
    mnt: Mount = mounts.mount() if passthrough else mounts.mount("--no-passthrough")
    step = mnt / "run/step_4"
    step.mkdir(parents=True)
    expected = {}
    for i in range(4):
        path = step / f"__{i}_0.distcp"
        path.write_bytes(bytes([i]) * BIG)
        with open(path, "r+b") as f:  # no truncate: size stays, mtime may not move on tmpfs
            f.write(bytes([100 + i]) * (BIG // 2))
        expected[path.name] = xxhash.xxh3_128_hexdigest(
            bytes([100 + i]) * (BIG // 2) + bytes([i]) * (BIG - BIG // 2))
    (step / ".metadata").write_bytes(b"meta")  # commits the step, waiting for the seals
    assert getxattr(step, "user.tierfs.state") == "committed"
    for name, digest in expected.items():
        assert getxattr(step / name, "user.tierfs.xxh3") == digest
    tierfs("verify", str(step), "--no-repair")
    manifest = mf.decode(next(Path(mnt.ram_dir).rglob(".tierfs-manifest")).read_bytes())
    assert {f.name: f.xxh3 for f in manifest.files if f.name in expected} == expected


async def test_a_saver_commit_does_not_wait_for_the_hashes(harness: Harness) -> None:
    """Every hash thread taken: the `.metadata` rename commits the step at once, and nothing
    is announced (no manifest for peers or the store) until the hashes are in; a rewrite of a
    file meanwhile is a new version, and the committed one keeps the saved bytes."""
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.ns.background.run)
        sealing = harness.ns.tree.parts.sealing
        await sealing.hold()
        with trio.fail_after(10):  # a commit waiting for the hashes would wait for ever
            await dcp_save(harness, "run/step_6", {"a": b"A" * BIG}, hashed=False)
        assert await harness.state("run/step_6") == "committed"
        with pytest.raises(trio.WouldBlock):
            harness.commits.receive_nowait()
        await harness.write_file("run/step_6/a", b"B" * BIG)
        assert await harness.state("run/step_6") == "writing"
        sealing.release()
        with trio.fail_after(30):
            manifest = await harness.commits.receive()
        digest = xxhash.xxh3_128_hexdigest(b"A" * BIG)
        assert manifest.version == 1 and manifest.entry("a").xxh3 == digest
        assert harness.store.object_path(digest).read_bytes() == b"A" * BIG
        assert await harness.read_file("run/step_6/a") == b"B" * BIG
        nursery.cancel_scope.cancel()


async def test_a_big_file_removed_before_its_step_commits_is_not_kept(harness: Harness) -> None:
    """A file of HASH_AT_COMMIT bytes or more in a step is hashed when its step commits; one
    removed before that is gone from memory once the kernel forgets it (the sealing's books
    kept it, and its node, for the daemon's life)."""
    await harness.write_file("run/step_6/big", b"x" * HASH_AT_COMMIT)
    node = node_of(harness, "run/step_6/big")
    assert node.seal is None and harness.ns.tree.parts.sealing.pending(node)
    ino, lookups, gone = node.ino, node.lookups, weakref.ref(node)
    del node
    await harness.ops.unlink(await harness.inode("run/step_6"), b"big", CTX)
    await harness.ops.forget([(ino, lookups)])
    gc.collect()
    assert gone() is None


async def test_a_file_sealed_before_its_step_commits_is_not_hashed_again(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a cluster each file of a step is sealed at its close, for its record in etcd: the
    step's commit, made while another file's hash is still to come, takes that seal and
    hashes none of its bytes a second time (it did: every byte of a cluster's step was hashed
    at its close and again after the commit, before any copy to a peer could start)."""
    hashed: list[int] = []
    real = mf.hash_fd

    def counted(fd: int, between: object = None) -> mf.Digest:
        hashed.append(os.fstat(fd).st_size)
        return real(fd, between)  # type: ignore[arg-type]

    monkeypatch.setattr(mf, "hash_fd", counted)
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.ns.background.run)
        sealing = harness.ns.tree.parts.sealing
        await harness.write_file("run/step_7/a", b"A" * BIG)
        node = node_of(harness, "run/step_7/a")
        await harness.ns.tree.seal(node)  # as the cluster's record of it does at its close
        assert node.seal is not None and hashed == [BIG]
        await sealing.hold()  # b's hash comes after the commit: the commit is pending
        await dcp_save(harness, "run/step_7", {"b": b"B" * (BIG + 1)}, hashed=False)
        sealing.release()
        with trio.fail_after(30):
            manifest = await harness.commits.receive()
        assert manifest.entry("a").xxh3 == xxhash.xxh3_128_hexdigest(b"A" * BIG)
        assert manifest.entry("b").xxh3 == xxhash.xxh3_128_hexdigest(b"B" * (BIG + 1))
        assert hashed.count(BIG) == 1 and hashed.count(BIG + 1) == 1
        nursery.cancel_scope.cancel()


async def test_hashes_step_aside_while_a_file_is_open_for_writing(harness: Harness) -> None:
    """A save in progress (a file open for writing: under passthrough the daemon sees only the
    opens) has the background hashes pause between chunks, so the saver keeps the cores; they
    still finish, with the right digest, and run without pausing once the writer closed."""
    sealing = harness.ns.tree.parts.sealing
    data = b"P" * (3 * mf.CHUNK_SIZE)  # a few chunks: pauses come between them
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.ns.background.run)
        await harness.mkdirs("run/step_9")
        writer, _attrs = await harness.ops.create(await harness.inode("run/step_9"), b"open",
                                                  0o644, os.O_WRONLY, CTX)
        await harness.write_file("data/paced", data)
        node = node_of(harness, "data/paced")
        await wait_until_async(lambda: node.seal is not None, timeout=60)
        assert node.seal.digest.xxh3 == xxhash.xxh3_128_hexdigest(data)
        paused = sealing.yielded
        assert paused > 0  # it stepped aside for the writer, and still finished
        await harness.ops.flush(writer.fh)
        await harness.ops.release(writer.fh)
        await harness.write_file("data/unpaced", data)
        node = node_of(harness, "data/unpaced")
        await wait_until_async(lambda: node.seal is not None, timeout=60)
        assert node.seal.digest.xxh3 == xxhash.xxh3_128_hexdigest(data)
        assert sealing.yielded == paused  # no writer left: no pause
        nursery.cancel_scope.cancel()


async def test_a_file_kept_open_for_writing_alone_does_not_hold_the_hashes_back(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file held open for writing long after it began (a log) is no save in progress: once
    SAVE_WINDOW has passed since a file began to be written, the hashes run without pausing."""
    monkeypatch.setattr(tree_module, "SAVE_WINDOW", 0.0)  # every writer began "long ago"
    sealing = harness.ns.tree.parts.sealing
    data = b"L" * (3 * mf.CHUNK_SIZE)
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.ns.background.run)
        await harness.mkdirs("logs")
        log_file, _attrs = await harness.ops.create(await harness.inode("logs"), b"train.log",
                                                    0o644, os.O_WRONLY, CTX)
        await harness.ops.write(log_file.fh, 0, b"step 1\n")
        await harness.write_file("data/unpaced", data)
        node = node_of(harness, "data/unpaced")
        await wait_until_async(lambda: node.seal is not None, timeout=60)
        assert node.seal.digest.xxh3 == xxhash.xxh3_128_hexdigest(data)
        assert sealing.yielded == 0  # the log open for writing held nothing back
        await harness.ops.release(log_file.fh)
        nursery.cancel_scope.cancel()
