"""The RAM dir's file system full while the RAM tier's own count (--ram-limit) has room: a
small or shared /dev/shm that other processes fill (the `small_shm` fixture). What tierfs
writes there beside the user's bytes (delete records, manifests, ...) may then fail: the user
gets ENOSPC with nothing changed, the daemon's workers live on, and once space comes back the
work proceeds. In-process, over a real tmpfs; no mount."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyfuse3
import pytest
import trio

from tests.conftest import fill
from tests.test_namespace import Harness, dcp_save
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.fs.lifecycle.deletes import PERSIST, Deletes, DeleteWorker, Tombstone

pytestmark = pytest.mark.core

PAGE = 4096


def leave_one_page(shm: Path) -> None:
    """Fill `shm` but for one page: room for one small record, not two."""
    spare = shm / "spare"
    spare.write_bytes(bytes(PAGE))
    fill(shm / "other-user")
    spare.unlink()


async def test_a_rename_with_no_room_for_its_records_moves_no_step_in_any_tier(
        small_shm: Path) -> None:
    """`mv run run-old` over two committed steps, with room for the record of one move only:
    ENOSPC, and no record of either move, on disk or in memory (before, the first step's move
    was recorded: the delete worker would have removed `run/step_1` from the store and the
    peers although the rename failed and the step stayed, committed, under that name)."""
    h = Harness(small_shm / "ram")
    h.ns.deletes.targets = [PERSIST]
    for number in (1, 2):
        await dcp_save(h, f"run/step_{number}", {"shard": os.urandom(100_000)})
    leave_one_page(small_shm)
    with pytest.raises(pyfuse3.FUSEError) as refused:
        await h.rename("run", "run-old")
    assert refused.value.errno == errno.ENOSPC
    assert h.ns.deletes.pending() == []
    assert os.listdir(small_shm / "ram/deleted") == []  # no record, no temporary file
    assert await h.state("run/step_1") == await h.state("run/step_2") == "committed"

    (small_shm / "other-user").unlink()
    await h.rename("run", "run-old")
    assert sorted(t.moved_to or "" for t in Deletes(small_shm / "ram/deleted").pending()) == [
        "run-old/step_1", "run-old/step_2"]
    h.close()


async def test_the_delete_worker_lives_on_when_its_records_have_no_room(
        small_shm: Path) -> None:
    """A tier cleaned while the RAM dir is full: its record cannot be updated. The worker goes
    on (before, the OSError ended it, and the daemon with it) and writes the record once there
    is room."""
    deletes = Deletes(small_shm / "deleted", [PERSIST])
    deletes.record("run/step_1", 1, 10)
    cleaned: list[str] = []

    async def clean(tomb: Tombstone, _where: str) -> None:
        cleaned.append(tomb.path)

    fill(small_shm / "other-user")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(DeleteWorker(deletes, {PERSIST: clean}).run)
        await wait_until_async(lambda: cleaned, timeout=10)
        assert deletes.pending() == []
        assert [t.pending for t in Deletes(small_shm / "deleted").pending()] == [{PERSIST}]
        (small_shm / "other-user").unlink()
        await wait_until_async(lambda: not Deletes(small_shm / "deleted").pending(), timeout=10,
                               interval=0.05)
        nursery.cancel_scope.cancel()
    assert cleaned == ["run/step_1"]
    assert [n.endswith(".json") for n in os.listdir(small_shm / "deleted")] == [True]


@pytest.mark.parametrize("path", ["run/step_2", "run/epoch=0-step=2.ckpt"])
async def test_a_stored_step_with_no_room_for_its_records_is_not_hidden_by_an_empty_one(
        tmp_path: Path, small_shm: Path, path: str) -> None:
    """A fresh node shows a step of the persistent tier (a directory, a single file) with no
    room for its records: the error is raised with nothing left, no directory made for it
    (an empty step directory, `writing`, would hide the stored step from then on, after a
    restart too, since a step a node has is never adopted again)."""
    single_file = not path.endswith("step_2")
    name = path.rpartition("/")[2] if single_file else "shard"
    (tmp_path / name).write_bytes(b"stored bytes")
    digest = mf.hash_file(tmp_path / name)
    entry = mf.FileEntry(name, digest.size, digest.xxh3, mode=0o644, chunks=digest.chunks)
    manifest = mf.StepManifest(path, 2, 1, "other", 10, (entry,), single_file=single_file)
    h = Harness(small_shm / "ram")
    fill(small_shm / "other-user")
    with pytest.raises(OSError) as refused:
        h.ns.tiers.adopt_persisted(manifest)
    assert refused.value.errno == errno.ENOSPC
    assert os.listdir(small_shm / "ram/tree") == [] and h.ns.tree.find_step(path) is None

    (small_shm / "other-user").unlink()
    assert h.ns.tiers.adopt_persisted(manifest)
    step = h.ns.tree.find_step(path)
    assert step is not None and step.step.manifest == manifest
    h.close()
