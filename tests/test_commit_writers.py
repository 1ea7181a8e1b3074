"""Commits that meet files of their step open for writing, while those files are rewritten.

In process (the Namespace harness of tests/test_namespace.py): a writer comes back while the
commit waits for a seal or for a private copy; the commit seals again or waits for it, and
nothing it made for itself (copies in objects/) is left behind, also when it gives up.

Through a real mount, in both passthrough modes: `tierfs commit` run back to back beside a
random-I/O writer that rewrites a file of the step (the reproducer of issue 30).
"""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing
import xxhash

from tests.conftest import TIERFS, Mount, MountFactory, getxattr, tierfs
from tests.harness import CTX, Harness
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs import reserved
from tierfs.fs.model.nodes import FsError, Node

pytestmark = pytest.mark.fuse

BIG = 32 << 20  # big enough that its hash (or its copy) is still running when the writer comes


@pytest.fixture
def harness(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = Harness(tmp_path / "ram")
    yield h
    h.close()


def node_of(h: Harness, path: str) -> Node:
    node = h.ns.root
    for part in path.split("/"):
        node = h.ns.child(node, part.encode())
    return node


async def objects(h: Harness) -> set[str]:
    """objects/, once the big files removed from it in a thread (the trash) are gone."""
    await wait_until_async(lambda: not any(n.startswith(reserved.TRASH)
                                           for n in os.listdir(h.root / "objects")), timeout=30)
    return set(os.listdir(h.root / "objects"))


def named_objects(h: Harness) -> set[str]:
    """The objects some committed manifest names."""
    names = set()
    for path in (h.root / "tree").rglob(mf.MANIFEST_NAME):
        names |= {entry.xxh3 for entry in mf.decode(path.read_bytes()).files}
    return names


async def commit_in_background(h: Harness, nursery: trio.Nursery, relpath: str
                               ) -> dict[str, object]:
    """Start `tierfs commit relpath` as the daemon runs it; the outcome lands in the dict."""
    outcome: dict[str, object] = {}

    async def commit() -> None:
        try:
            outcome["manifest"] = await h.ns.commits.commit_path(relpath)
        except Exception as exc:  # what the control socket would answer
            outcome["error"] = exc

    nursery.start_soon(commit)
    await trio.testing.wait_all_tasks_blocked()
    return outcome


async def settled(h: Harness, outcome: dict[str, object]) -> None:
    """Until the commit is done, or waits for a writer to close (the writer's next step)."""
    await wait_until_async(lambda: outcome or h.ns.tree.released.statistics().tasks_waiting,
                           timeout=30, interval=0.001)


async def test_a_writer_back_while_its_seal_is_computed_is_waited_for(harness: Harness) -> None:
    """The file is open for writing (not yet written) when the commit starts: the commit seals
    it, and the writer's first write lands while the hash runs. The commit must wait for that
    writer and commit what it wrote, not fail on the seal the write dropped."""
    await harness.write_file("run/step_7/f.bin", b"A" * BIG)
    node = node_of(harness, "run/step_7/f.bin")
    info = await harness.ops.open(node.ino, os.O_WRONLY, CTX)
    async with trio.open_nursery() as nursery:
        outcome = await commit_in_background(harness, nursery, "run/step_7")
        assert harness.ns.tree.parts.sealing.pending(node)  # the commit's hash is in its thread
        await harness.ops.write(info.fh, 0, b"B" * 4096)  # the writer comes back meanwhile
        await settled(harness, outcome)
        assert not outcome  # it waits for the writer's close
        await harness.ops.flush(info.fh)
        await harness.ops.release(info.fh)
    manifest = outcome.get("manifest")
    assert manifest is not None, outcome.get("error")
    assert manifest.entry("f.bin").xxh3 == xxhash.xxh3_128_hexdigest(
        b"B" * 4096 + b"A" * (BIG - 4096))
    assert await objects(harness) == named_objects(harness) == {
        manifest.entry("f.bin").xxh3}


async def test_a_copy_made_for_one_file_is_not_left_when_another_is_rewritten(
        harness: Harness) -> None:
    """Two files open for writing: the commit copies the first while the writer of the
    second comes back. The first copy must not be left in objects/, and the commit waits."""
    await harness.write_file("run/step_8/a.bin", b"a" * BIG)
    await harness.write_file("run/step_8/b.bin", b"b" * 4096)
    a, b = node_of(harness, "run/step_8/a.bin"), node_of(harness, "run/step_8/b.bin")
    info_a = await harness.ops.open(a.ino, os.O_WRONLY, CTX)
    info_b = await harness.ops.open(b.ino, os.O_WRONLY, CTX)
    for node in (a, b):
        await harness.ns.tree.seal(node)  # sealed: the commit goes straight to the copies
    async with trio.open_nursery() as nursery:
        outcome = await commit_in_background(harness, nursery, "run/step_8")
        await harness.ops.write(info_b.fh, 0, b"B" * 4096)
        await settled(harness, outcome)
        assert not outcome
        assert await objects(harness) == set()  # the copy of a is gone while the commit waits
        await harness.ops.flush(info_b.fh)
        await harness.ops.release(info_b.fh)
    manifest = outcome.get("manifest")
    assert manifest is not None, outcome.get("error")
    assert manifest.entry("b.bin").xxh3 == xxhash.xxh3_128_hexdigest(b"B" * 4096)
    assert await objects(harness) == named_objects(harness)
    await harness.ops.release(info_a.fh)


async def test_a_commit_that_gives_up_leaves_nothing_behind(harness: Harness) -> None:
    """`tierfs commit --timeout`: the writer never closes in time; the commit gives up with
    a line naming the open file, leaves no copy, and the step stays `writing` (objects/ holds
    what it held before: the object of b.bin, settled at its close, `RamStore.link_early`)."""
    await harness.write_file("run/step_9/a.bin", b"a" * 4096)
    await harness.write_file("run/step_9/b.bin", b"b" * 4096)
    a = node_of(harness, "run/step_9/a.bin")
    info_a = await harness.ops.open(a.ino, os.O_WRONLY, CTX)
    before = await objects(harness)
    info, _ = await harness.ops.create(await harness.inode("run/step_9"), b"c.bin", 0o644,
                                       os.O_WRONLY, CTX)
    await harness.ops.write(info.fh, 0, b"c")
    with pytest.raises(FsError) as given_up:
        await harness.ns.commits.commit_path("run/step_9", timeout=0.2)
    assert given_up.value.errno == errno.ETIMEDOUT
    assert "run/step_9/c.bin" in str(given_up.value)
    assert f"pid {os.getpid()}" in str(given_up.value)
    assert await objects(harness) == before
    assert await harness.state("run/step_9") == "writing"
    await harness.ops.release(info.fh)
    await harness.ops.release(info_a.fh)
    manifest = await harness.ns.commits.commit_path("run/step_9", timeout=math.inf)
    assert await objects(harness) == named_objects(harness) == {
        e.xxh3 for e in manifest.files}


REWRITE_SECONDS = 12  # per passthrough mode: long enough for dozens of commits to meet the writer
REWRITER = Path(__file__).parent / "rewriter.py"


@pytest.mark.parametrize("passthrough", [True, False], ids=["passthrough", "no-passthrough"])
def test_tierfs_commit_beside_a_writer_rewriting_the_step(mounts: MountFactory, tmp_path: Path,
                                                          passthrough: bool) -> None:
    """Every `tierfs commit` succeeds (or gives up with its documented line), every committed
    version holds the bytes of one of the writer's closes, and no copy is left behind."""
    mnt = mounts.mount(*(() if passthrough else ("--no-passthrough",)))
    step = mnt / "run/step_7"
    step.mkdir(parents=True)
    manifest_path = mnt.ram_dir / "tree/run/step_7" / mf.MANIFEST_NAME
    objects_dir = mnt.ram_dir / "objects"
    closes_file = tmp_path / "closes"
    writer = subprocess.Popen(
        [sys.executable, str(REWRITER), str(step / "f.bin"), str(REWRITE_SECONDS),
         str(closes_file)], stdout=subprocess.PIPE, text=True)
    committed: dict[int, str] = {}  # version -> xxh3 of f.bin
    failures = []
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        while writer.poll() is None:
            done = tierfs("commit", str(step), "--timeout", "30", check=False)
            if done.returncode != 0 and "gave up after 30 s" not in done.stderr:
                failures.append(f"exit {done.returncode}: {done.stderr.strip()}")
                continue
            if done.returncode != 0:
                continue
            manifest = mf.decode(manifest_path.read_bytes())
            entry = manifest.entry("f.bin")
            committed[manifest.version] = entry.xxh3
            try:  # the committed object, while no newer version has replaced it
                held = (objects_dir / entry.xxh3).read_bytes()
            except FileNotFoundError:
                continue
            assert xxhash.xxh3_128_hexdigest(held) == entry.xxh3, manifest.version
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait()
    assert writer.returncode == 0
    closes = set(closes_file.read_text().split())
    assert not failures, f"{len(failures)} failed commits, the first: {failures[0]}"
    # the commits did run against the writer (each `tierfs commit` is a new process: on two
    # busy cores, beside other tests, a dozen seconds gave fewer than 10 of them)
    assert len(committed) >= 5, committed
    not_closed = {v: d for v, d in committed.items() if d not in closes}
    assert not not_closed, f"versions whose bytes the writer never closed with: {not_closed}"
    # The writer is done: a last commit, then only what the manifest names is in objects/.
    tierfs("commit", str(step))
    final = mf.decode(manifest_path.read_bytes())
    assert final.entry("f.bin").xxh3 in closes
    tierfs("verify", str(step), "--no-repair")
    assert set(os.listdir(objects_dir)) == {e.xxh3 for e in final.files}
    assert "Traceback" not in mnt.log()


def test_tierfs_commit_says_what_it_waits_for_and_gives_up_at_its_timeout(mnt: Mount) -> None:
    """A file held open by a writer between two writes: `tierfs commit` names it and its pid
    after a second; with --timeout it gives up with one line and leaves the step as it was;
    without, it commits once the writer has closed the file."""
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    (step / "done.bin").write_bytes(b"d" * 5000)
    # A process of its own: a child of this one would close a duplicate of its descriptor.
    slow = subprocess.Popen(
        [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'wb'); f.write(b'first half ');"
         " f.flush(); print('ready', flush=True); sys.stdin.readline(); f.write(b'second half')",
         str(step / "slow.bin")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started = [slow]
    try:
        assert slow.stdout is not None and slow.stdout.readline() == "ready\n"
        waits_for = f"open writers: run/step_1/slow.bin (pid {slow.pid})"
        given_up = tierfs("commit", str(step), "--timeout", "2", check=False)
        assert given_up.returncode == 1
        assert given_up.stderr.splitlines() == [
            f"committing run/step_1: waiting for {waits_for}",
            f"tierfs: run/step_1: not committed: gave up after 2 s waiting for {waits_for}"]
        assert getxattr(step, "user.tierfs.state") == "writing"
        # Nothing made for it is left: objects/ holds only done.bin's own inode (a closed file
        # of a step is its object as soon as it is sealed: RamStore.link_early).
        tree_inodes = {p.stat().st_ino for p in (mnt.ram_dir / "tree/run/step_1").iterdir()}
        assert all(p.stat().st_ino in tree_inodes for p in (mnt.ram_dir / "objects").iterdir())
        waiting = subprocess.Popen([*TIERFS, "commit", str(step)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        started.append(waiting)
        assert waiting.stderr is not None
        assert waiting.stderr.readline() == f"committing run/step_1: waiting for {waits_for}\n"
        slow.communicate("go\n", timeout=30)  # it writes the rest and exits
        out, err = waiting.communicate(timeout=60)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert slow.returncode == 0 and waiting.returncode == 0, err
    assert out.startswith("committed run/step_1 version 1: 2 files") and err == ""
    assert mnt.step("run/step_1")["bytes"] == 5000 + len(b"first half second half")
