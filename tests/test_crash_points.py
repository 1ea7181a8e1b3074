"""A crash at any moment, in process: the RAM dir is copied (`cp -a`, hard links kept) just
before every rename, link, unlink and rmdir the daemon makes in it while steps are saved,
saved again, renamed and removed; each copy is what a kill -9 at that instant leaves on
tmpfs. Started from each, the namespace must show every step as the last acknowledged
operation left it, or as the operation under way would leave it: never a step lost after its
save returned, never a partial step shown committed. The start-up's own recovery of each copy
is crashed the same way, at every mutation it makes."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

from tests.harness import CTX, Harness, dcp_save
from tierfs.fs.tree.sealing import INLINE_HASH_BYTES

pytestmark = pytest.mark.core

MUTATIONS = ("rename", "replace", "link", "unlink", "rmdir")
Content = dict[str, bytes] | None  # a step's committed files; None: not a committed step


@dataclass
class CrashImage:
    operation: str  # the operation under way
    acknowledged: bool  # its call had returned (its background still running)
    in_restart: bool  # taken while a restart recovered an earlier image
    call: str  # the mutation it was about to make
    path: Path


class CrashImages:
    """Copies of the RAM dir `ram` before each mutation in it, while `operation` is set."""

    def __init__(self, ram: Path, into: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ram, self.into = str(ram), into
        self.taken: list[CrashImage] = []
        self.operation: str | None = None
        self.acknowledged = self.in_restart = False
        for name in MUTATIONS:
            monkeypatch.setattr(os, name, self._before(name, getattr(os, name)))

    def _before(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def take_image_then_call(*args: Any, **kwargs: Any) -> Any:
            paths = [os.fsdecode(a) for a in args[:2] if isinstance(a, str | bytes)]
            if self.operation and any(p.startswith(self.ram) for p in paths):
                image = self.into / f"crash-{len(self.taken)}"
                subprocess.run(["cp", "-a", self.ram, str(image)], check=True)
                self.taken.append(CrashImage(self.operation, self.acknowledged,
                                             self.in_restart, f"{name} {paths}", image))
            return call(*args, **kwargs)
        return take_image_then_call


async def committed_content(h: Harness, step: str) -> Content:
    try:
        node = h.ns.get(await h.inode(step))
    except pyfuse3.FUSEError:
        return None  # not there
    if node.step is None or node.step.state != "committed":
        return None
    if node.is_file:  # a single-file step: its bytes under the name ""
        return {"": await h.read_file(step)}
    names = [name.decode() for name, _child in h.ns.list_dir(node)]
    return {name: await h.read_file(f"{step}/{name}") for name in names}


async def remove_step(h: Harness, step: str) -> None:
    """`rm -r` of a step directory of plain files."""
    step_inode = await h.inode(step)
    for name in [name for name, _child in h.ns.list_dir(h.ns.get(step_inode))]:
        await h.ops.unlink(step_inode, name, CTX)
    await h.ops.rmdir(await h.inode(os.path.dirname(step)), os.path.basename(step).encode(), CTX)


async def test_a_crash_at_any_moment_keeps_every_acknowledged_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path / "ram")
    big, other = os.urandom(3 * INLINE_HASH_BYTES), os.urandom(3 * INLINE_HASH_BYTES)
    first = {"x": b"x" * 100, ".metadata": b"meta"}
    v1 = {"a": big, "c": b"c, one", ".metadata": b"meta"}
    v2 = {"a": big, "c": b"c, two", "d": other, ".metadata": b"meta"}

    def late_hashes(step: str, files: dict[str, bytes]) -> Callable[[], Awaitable[None]]:
        async def save() -> None:  # committed before its big files' hashes are in
            await h.ns.hold_hash_threads()
            await dcp_save(h, step, {k: v for k, v in files.items() if k != ".metadata"},
                           hashed=False)
            h.ns.release_hash_threads()
        return save

    async def rename_step() -> None:
        await h.rename("run/step_2", "run/step_3")

    def torch_save(data: bytes) -> Callable[[], Awaitable[None]]:
        async def save() -> None:  # a loose file, committed a moment after its close
            await h.write_file("run/last.ckpt", data)
            await h.ns.commits.commit_quietly(h.ns.tree.find_step("run/last.ckpt"))
        return save

    # (operation, its call, what each step is once acknowledged)
    operations: list[tuple[str, Callable[[], Awaitable[None]], dict[str, Content]]] = [
        ("save step_1", lambda: dcp_save(h, "run/step_1", {"x": first["x"]}, hashed=False),
         {"run/step_1": first}),
        ("save step_2", late_hashes("run/step_2", v1), {"run/step_2": v1}),
        ("save step_2 again", late_hashes("run/step_2", v2), {"run/step_2": v2}),
        ("rename step_2 to step_3", rename_step, {"run/step_2": None, "run/step_3": v2}),
        ("remove step_1", lambda: remove_step(h, "run/step_1"), {"run/step_1": None}),
        ("torch.save last.ckpt", torch_save(big), {"run/last.ckpt": {"": big}}),
        ("torch.save last.ckpt again", torch_save(other), {"run/last.ckpt": {"": other}}),
    ]
    expected: dict[str, Content] = dict.fromkeys(
        ("run/step_1", "run/step_2", "run/step_3", "run/last.ckpt"))
    before: dict[str, dict[str, Content]] = {}  # operation -> what each step was before it
    after: dict[str, dict[str, Content]] = {}
    images = CrashImages(h.root, tmp_path, monkeypatch)
    async with trio.open_nursery() as nursery:
        await nursery.start(h.ns.background.run)
        for name, call, result in operations:
            before[name] = dict(expected)
            expected.update(result)
            after[name] = dict(expected)
            images.operation, images.acknowledged = name, False
            await call()
            images.acknowledged = True
            await h.hashed()  # its background's part
            assert {s: await committed_content(h, s) for s in expected} == expected, name
        images.operation = None
        nursery.cancel_scope.cancel()
    h.close()
    assert {i.operation for i in images.taken} == {name for name, _, _ in operations}
    wrong = []
    for image in images.taken:  # grows while it runs: the restarts' own images
        # A restart must leave what the crash allowed, whenever it is cut short itself.
        images.ram, images.in_restart = str(image.path), True
        images.operation = None if image.in_restart else image.operation
        images.acknowledged = image.acknowledged
        restarted = Harness(image.path)
        images.operation = None
        try:
            for step in expected:
                found = await committed_content(restarted, step)
                allowed = [after[image.operation][step]]
                if not image.acknowledged:
                    allowed.append(before[image.operation][step])
                if found not in allowed:
                    wrong.append(f"{step} after a crash in {image.operation!r} "
                                 f"({'after' if image.acknowledged else 'before'} its return, "
                                 f"{'in the restart, ' if image.in_restart else ''}"
                                 f"at {image.call}): "
                                 f"{sorted(found) if found is not None else 'not committed'}")
        finally:
            restarted.close()
    assert not wrong, "\n".join(wrong)
    assert len(images.taken) > 20 and any(image.in_restart for image in images.taken)
