"""A crash at any moment, in process: the RAM dir is copied (`cp -a`, hard links kept) just
before every rename, link, unlink and rmdir the daemon makes in it while steps are saved,
saved again, renamed and removed; each copy is what a kill -9 at that instant leaves on
tmpfs. Started from each, the namespace must show every step as the last acknowledged
operation left it, or as the operation under way would leave it: never a step lost after its
save returned, never a partial step shown committed, `latest` never naming a step that is not
committed. The start-up's own recovery of each copy is crashed the same way, at every
mutation it makes. The other tiers (tests/fakes.py's `MemoryTier`s: the store, the peers'
copies) are copied with each image: they are what survives the node."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

from tests.fakes import MemoryTier
from tests.harness import CTX, Harness, committed_step, dcp_save
from tests.waiting import wait_until_async
from tierfs.fs.model.nodes import Node
from tierfs.fs.tree.sealing import INLINE_HASH_BYTES

pytestmark = pytest.mark.core

MUTATIONS = ("rename", "replace", "link", "unlink", "rmdir")
Content = dict[str, bytes] | None  # a step's committed files; None: not a committed step
# (its name, its call, what each step it changes is once it returned)
Operation = tuple[str, Callable[[Harness], Awaitable[None]], dict[str, Content]]


@dataclass
class CrashImage:
    operation: str  # the operation under way
    acknowledged: bool  # its call had returned (its background still running)
    in_restart: bool  # taken while a restart recovered an earlier image
    call: str  # the mutation it was about to make
    path: Path
    remotes: tuple[MemoryTier, ...]  # the other tiers then


class CrashImages:
    """Copies of the RAM dir `ram` before each mutation in it, while `operation` is set."""

    def __init__(self, ram: Path, remotes: tuple[MemoryTier, ...], into: Path,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        self.ram, self.remotes, self.into = str(ram), remotes, into
        self.taken: list[CrashImage] = []
        self.operation: str | None = None
        self.acknowledged = self.in_restart = False
        for name in MUTATIONS:
            monkeypatch.setattr(os, name, self._before(name, getattr(os, name)))

    def _before(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def take_image_then_call(*args: Any, **kwargs: Any) -> Any:
            paths = [os.fsdecode(a) for a in args[:2] if isinstance(a, str | bytes | os.PathLike)]
            if self.operation and any(p.startswith(self.ram) for p in paths):
                image = self.into / f"crash-{len(self.taken)}"
                subprocess.run(["cp", "-a", self.ram, str(image)], check=True)
                self.taken.append(CrashImage(self.operation, self.acknowledged,
                                             self.in_restart, f"{name} {paths}", image,
                                             copy.deepcopy(self.remotes)))
            return call(*args, **kwargs)
        return take_image_then_call


async def committed_node(h: Harness, step: str) -> Node | None:
    """The node of `step` if it is a committed step, else None (not there, or not committed)."""
    try:
        node = h.ns.get(await h.inode(step))
    except pyfuse3.FUSEError:
        return None
    return node if node.step is not None and node.step.state == "committed" else None


async def committed_content(h: Harness, step: str) -> Content:
    node = await committed_node(h, step)
    if node is None:
        return None
    if node.is_file:  # a single-file step: its bytes under the name ""
        return {"": await h.read_file(step)}
    return await files_under(h, step, node)


async def latest_names_a_committed_step(h: Harness) -> bool:
    """`run/latest`, where the directory shows one, names a step committed here: a job that
    resumes from it after a crash never loads a partial step."""
    try:
        target = (await h.ops.readlink(await h.inode("run/latest"), CTX)).decode()
    except pyfuse3.FUSEError:
        return True  # no latest shown (nothing committed, or the saver's own)
    return await committed_node(h, f"run/{target}") is not None


async def files_under(h: Harness, path: str, node: Node) -> dict[str, bytes]:
    """Every file under the directory `node` at `path`, by its path relative to it."""
    found = {}
    for name, child in h.ns.list_dir(node):
        if child.is_file:
            found[name.decode()] = await h.read_file(f"{path}/{name.decode()}")
        else:
            below = await files_under(h, f"{path}/{name.decode()}", child)
            found |= {f"{name.decode()}/{rel}": data for rel, data in below.items()}
    return found


async def remove_step(h: Harness, step: str) -> None:
    """`rm -r` of a step directory of plain files."""
    step_inode = await h.inode(step)
    for name in [name for name, _child in h.ns.list_dir(h.ns.get(step_inode))]:
        await h.ops.unlink(step_inode, name, CTX)
    await h.ops.rmdir(await h.inode(os.path.dirname(step)), os.path.basename(step).encode(), CTX)


async def crash_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           start: Callable[[Path, tuple[MemoryTier, ...]], Harness],
                           remotes: tuple[MemoryTier, ...], operations: list[Operation]
                           ) -> None:
    """Run `operations` one after the other on `start`'s namespace over a RAM dir, the
    images taken; then start from each image (and each image of those starts) and compare
    every step with what the crash allows."""
    h = start(tmp_path / "ram", remotes)
    expected: dict[str, Content] = {step: None for *_, result in operations for step in result}
    before: dict[str, dict[str, Content]] = {}  # operation -> what each step was before it
    after: dict[str, dict[str, Content]] = {}
    images = CrashImages(h.root, remotes, tmp_path, monkeypatch)
    async with trio.open_nursery() as nursery:
        await nursery.start(h.ns.background.run)
        for name, call, result in operations:
            before[name] = dict(expected)
            expected.update(result)
            after[name] = dict(expected)
            images.operation, images.acknowledged = name, False
            await call(h)
            images.acknowledged = True
            await h.hashed()  # its background's part
            # (its bytes are read from the images: a read here could bring files back to RAM)
            assert {s for s in expected if await committed_node(h, s) is not None} == {
                s for s, content in expected.items() if content is not None}, name
        images.operation = None
        nursery.cancel_scope.cancel()
    h.close()
    assert {i.operation for i in images.taken} == {name for name, _, _ in operations}
    wrong = []
    for image in images.taken:  # grows while it runs: the restarts' own images
        # A restart must leave what the crash allowed, whenever it is cut short itself.
        images.ram, images.remotes, images.in_restart = str(image.path), image.remotes, True
        images.operation = None if image.in_restart else image.operation
        images.acknowledged = image.acknowledged
        restarted = start(image.path, image.remotes)
        images.operation = None
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(restarted.ns.background.run)
                for step in expected:
                    found = await committed_content(restarted, step)
                    allowed = [after[image.operation][step]]
                    if not image.acknowledged:
                        allowed.append(before[image.operation][step])
                    if found not in allowed:
                        wrong.append(
                            f"{step} after a crash in {image.operation!r} "
                            f"({'after' if image.acknowledged else 'before'} its return, "
                            f"{'in the restart, ' if image.in_restart else ''}"
                            f"at {image.call}): "
                            f"{sorted(found) if found is not None else 'not committed'}")
                if not await latest_names_a_committed_step(restarted):
                    wrong.append(f"run/latest after a crash in {image.operation!r} at "
                                 f"{image.call}: names a step not committed")
                nursery.cancel_scope.cancel()
        finally:
            restarted.close()
    assert not wrong, "\n".join(wrong)
    assert len(images.taken) > 10 and any(image.in_restart for image in images.taken)


def ram_only(ram: Path, _remotes: tuple[MemoryTier, ...]) -> Harness:
    return Harness(ram)


def late_hashes(step: str, files: dict[str, bytes]) -> Callable[[Harness], Awaitable[None]]:
    async def save(h: Harness) -> None:  # committed before its big files' hashes are in
        await h.ns.hold_hash_threads()
        await dcp_save(h, step, {k: v for k, v in files.items() if k != ".metadata"},
                       hashed=False)
        h.ns.release_hash_threads()
    return save


def torch_save(path: str, data: bytes) -> Callable[[Harness], Awaitable[None]]:
    async def save(h: Harness) -> None:  # a loose file, committed a moment after its close
        await h.write_file(path, data)
        await h.ns.commits.commit_quietly(h.ns.tree.find_step(path))
    return save


def quiet_save(step: str, files: dict[str, bytes]) -> Callable[[Harness], Awaitable[None]]:
    async def save(h: Harness) -> None:  # HF's Trainer: its files, committed once quiet
        for name, data in files.items():
            await h.write_file(f"{step}/{name}", data)
        await h.ns.commits.commit_quietly(h.ns.tree.find_step(step))
    return save


async def test_a_crash_at_any_moment_keeps_every_acknowledged_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big, other = os.urandom(3 * INLINE_HASH_BYTES), os.urandom(3 * INLINE_HASH_BYTES)
    first = {"x": b"x" * 100, ".metadata": b"meta"}
    v1 = {"a": big, "c": b"c, one", ".metadata": b"meta"}
    v2 = {"a": big, "c": b"c, two", "d": other, ".metadata": b"meta"}
    hf = {"model.safetensors": big, "config.json": b"{}", "tokenizer/vocab.json": b"{1}"}
    await crash_everywhere(tmp_path, monkeypatch, ram_only, (), [
        ("save step_1", lambda h: dcp_save(h, "run/step_1", {"x": first["x"]}, hashed=False),
         {"run/step_1": first}),
        ("save step_2", late_hashes("run/step_2", v1), {"run/step_2": v1}),
        ("save step_2 again", late_hashes("run/step_2", v2), {"run/step_2": v2}),
        ("rename step_2 to step_3", lambda h: h.rename("run/step_2", "run/step_3"),
         {"run/step_2": None, "run/step_3": v2}),
        ("save step_3 again, the same bytes", late_hashes("run/step_3", v2), {"run/step_3": v2}),
        ("remove step_1", lambda h: remove_step(h, "run/step_1"), {"run/step_1": None}),
        ("torch.save last.ckpt", torch_save("run/last.ckpt", big), {"run/last.ckpt": {"": big}}),
        ("torch.save last.ckpt again", torch_save("run/last.ckpt", other),
         {"run/last.ckpt": {"": other}}),
        ("save checkpoint-4 with a subdirectory", quiet_save("run/checkpoint-4", hf),
         {"run/checkpoint-4": hf}),
        ("write a tracker naming step_3", torch_save("run/latest_checkpointed_iteration.txt",
                                                     b"3"),
         {"run/latest_checkpointed_iteration.txt": {"": b"3"}}),
    ])


def with_store(ram: Path, remotes: tuple[MemoryTier, ...]) -> Harness:
    """A node whose committed steps leave RAM once the store holds them (keep_ram=0)."""
    [store] = remotes
    return Harness(ram, read_sources=[store], persist=store, store_check=store, keep_ram=0)


async def test_a_crash_at_any_moment_of_a_step_leaving_ram_and_coming_back_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryTier("s3")
    files = {"a": os.urandom(3 * INLINE_HASH_BYTES), "b": b"b" * 100}
    step = {**files, ".metadata": b"meta"}

    async def stored_and_evicted(h: Harness) -> None:  # as the uploader does, then eviction
        manifest = h.commits.receive_nowait()
        store.put_step(manifest, step)
        h.ns.tiers.mark_persisted(manifest)
        node = h.ns.tree.find_step("run/step_1")
        await wait_until_async(lambda: not node.step.resident, timeout=60)

    async def read_back(h: Harness) -> None:
        for name in step:
            await h.read_file(f"run/step_1/{name}")

    await crash_everywhere(tmp_path, monkeypatch, with_store, (store,), [
        ("save step_1", lambda h: dcp_save(h, "run/step_1", files), {"run/step_1": step}),
        ("store and evict step_1", stored_and_evicted, {"run/step_1": step}),
        ("read step_1 back", read_back, {"run/step_1": step}),
        ("save step_2 with step_1's bytes", lambda h: dcp_save(h, "run/step_2", files),
         {"run/step_2": step}),
        ("remove step_1", lambda h: remove_step(h, "run/step_1"), {"run/step_1": None}),
    ])


def with_peers_and_store(ram: Path, remotes: tuple[MemoryTier, ...]) -> Harness:
    """A node of a cluster: steps other nodes hold are read from them, then the store."""
    peers, store = remotes
    return Harness(ram, read_sources=[peers, store], persist=store, store_check=store)


async def test_a_crash_at_any_moment_of_a_peers_step_held_here_then_replaced_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another node's step, listed here (`learn`), its copies held here (`hold_files`, as the
    receiver does once the objects arrived), then a newer version of it found in the store
    (`adopt_persisted`: superseded)."""
    peers, store = MemoryTier("peers"), MemoryTier("s3")
    old = {"a": os.urandom(3 * INLINE_HASH_BYTES), ".metadata": b"meta"}
    new = {"a": os.urandom(3 * INLINE_HASH_BYTES), ".metadata": b"meta, two"}
    v1 = committed_step(tmp_path / "scratch", "run/step_1", old)
    v2 = dataclasses.replace(committed_step(tmp_path / "scratch", "run/step_1", new),
                             version=2, committed_ns=1)
    peers.put_step(v1, old)
    store.put_step(v2, new)

    async def learn(h: Harness) -> None:
        h.ns.tiers.learn(v1, ["n1"])

    async def hold(h: Harness) -> None:
        for entry in v1.files:  # as the receiver leaves them: checked objects
            h.store.object_path(entry.xxh3).write_bytes(old[entry.name])
        assert await h.ns.tiers.hold_files("run/step_1", 1, list(old), "n1") == list(old)

    async def newer_in_store(h: Harness) -> None:
        h.ns.tiers.adopt_persisted(v2)

    await crash_everywhere(tmp_path, monkeypatch, with_peers_and_store, (peers, store), [
        ("learn step_1 from n1", learn, {"run/step_1": old}),
        ("hold step_1's copies", hold, {"run/step_1": old}),
        ("a newer step_1 in the store", newer_in_store, {"run/step_1": new}),
    ])
