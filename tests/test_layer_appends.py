"""Appended loose files in the upload layer, in one process against a file:// store in tmp (the
uploader harness of test_layer_uploader): versions laid out by `fs.model.append_layout` go up as
segments, read back exactly through the read source and as a person concatenates them, and an
upload cut short at any request never leaves the store's manifest with wrong bytes."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import trio

from tests.test_layer_uploader import Harness
from tests.waiting import wait_until_async
from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.model.append_layout import MAX_SEGMENTS, lay_out
from tierfs.s3tier.backend import BackendError, FileBackend
from tierfs.s3tier.reader import PersistentReader

pytestmark = pytest.mark.store

PATH = "run/train.log"


def version(h: Harness, data: bytes, old: mf.StepManifest | None) -> mf.StepManifest:
    """The next committed version of run/train.log holding `data`, laid out as a commit does."""
    h.objects.mkdir(exist_ok=True)
    staging = h.objects / "staging"
    staging.write_bytes(data)
    digest = mf.hash_file(staging)
    staging.rename(h.objects / digest.xxh3)
    entry = mf.FileEntry("train.log", digest.size, digest.xxh3, chunks=digest.chunks)
    entry = lay_out(old, PATH, entry, str(h.objects / digest.xxh3))
    h.current = {PATH}
    return mf.StepManifest(PATH, mf.NO_STEP, old.version + 1 if old else 1, "n", 0, (entry,),
                           single_file=True)


def stored(h: Harness) -> mf.StepManifest:
    return mf.decode(h.backend.get_bytes(layout.manifest_key(PATH, True)))


def as_a_person_reads_it(h: Harness) -> bytes:
    """The object, then the `append.*` objects in key order, cut at the manifest's size."""
    data = (h.store / PATH).read_bytes()
    records = h.store / layout.records_dir(PATH, True)
    for name in sorted(os.listdir(records)):
        if name.startswith(layout.SEGMENT_PREFIX):
            data += (records / name).read_bytes()
    return data[:stored(h).files[0].size]


async def persisted_in_two_pieces(h: Harness, base: int, appended: int
                                  ) -> tuple[bytes, mf.StepManifest]:
    """run/train.log of `base` random bytes, then `appended` more, each version persisted."""
    data = os.urandom(base)
    manifest = version(h, data, None)
    await h.persist(manifest)
    data += os.urandom(appended)
    manifest = version(h, data, manifest)
    h.persisted_paths.clear()
    await h.persist(manifest)
    return data, manifest


async def read_back(h: Harness, entry: mf.FileEntry) -> bytes:
    reader = PersistentReader(h.backend, trio.CapacityLimiter(2))
    return await reader.read_range("run", entry, 0, entry.size)


def test_the_layout_of_versions() -> None:
    base = mf.FileEntry("train.log", 1000, "a" * 32, chunks=("0" * 16,))
    old = mf.StepManifest(PATH, mf.NO_STEP, 1, "n", 0, (base,), single_file=True)
    # attributes only: the layout stays
    assert lay_out(old, PATH, base, "/nonexistent").segments == ()
    # another path (renamed): one whole object
    assert lay_out(old, "run/other.log", base, "/nonexistent") == base


async def test_appended_versions_go_up_as_segments(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    data = os.urandom(100_000)
    manifest = version(h, data, None)
    await h.persist(manifest)
    sent = h.uploader.bytes_sent
    for number in range(5):
        data += os.urandom(100 + number)
        manifest = version(h, data, manifest)
        h.persisted_paths.clear()
        await h.persist(manifest)
    assert manifest.files[0].segments == (100_000, 100_100, 100_201, 100_303, 100_406)
    assert h.uploader.bytes_sent - sent == len(data) - 100_000  # only the appended bytes
    assert (h.store / PATH).stat().st_size == 100_000
    assert stored(h) == manifest
    assert as_a_person_reads_it(h) == data
    assert await read_back(h, manifest.files[0]) == data

    # Appended as much as the base: the next version is one object again, segments gone.
    data += os.urandom(100_000)
    manifest = version(h, data, manifest)
    assert manifest.files[0].segments == ()
    h.persisted_paths.clear()
    await h.persist(manifest)
    assert (h.store / PATH).read_bytes() == data
    assert not [n for n in os.listdir(h.store / layout.records_dir(PATH, True))
                if n.startswith(layout.SEGMENT_PREFIX)]


async def test_many_small_appends_become_one_object_after_max_segments(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    data = os.urandom(1 << 20)
    manifest = version(h, data, None)
    for _ in range(MAX_SEGMENTS):
        data += b"x"
        manifest = version(h, data, manifest)
    assert len(manifest.files[0].segments) == MAX_SEGMENTS
    data += b"x"
    assert version(h, data, manifest).files[0].segments == ()


class CutShort(FileBackend):
    """A file:// store whose manifest uploads fail for good while `refuse` is set: an upload
    cut short after its segments (as by a crash) and before its manifest."""

    refuse = False

    def put_bytes(self, key: str, data: bytes) -> None:
        if self.refuse and key.endswith(mf.MANIFEST_NAME):
            raise BackendError("cut short", temporary=False)
        super().put_bytes(key, data)


@pytest.mark.parametrize("rewritten", [False, True], ids=["appended", "rewritten"])
async def test_an_upload_cut_short_never_leaves_wrong_bytes(tmp_path: Path,
                                                            rewritten: bool) -> None:
    h = Harness(tmp_path)
    h.backend = CutShort(h.store)
    h.uploader.backend = h.backend
    data, manifest = await persisted_in_two_pieces(h, 50_000, 300)
    before = data
    # The next version's objects go up, its manifest does not.
    data = os.urandom(60_000) if rewritten else data + os.urandom(500)
    h.backend.refuse = True
    nxt = version(h, data, manifest)
    h.uploader.submit(nxt)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.uploader.run)
        await wait_until_async(lambda: PATH in h.uploader.troubles, timeout=20)
        nursery.cancel_scope.cancel()
    if rewritten:  # its manifest went first: the file is not listed at all (never wrong)
        with pytest.raises(BackendError):
            stored(h)
    else:  # the stored version is still whole and exact, the new segment after its end
        assert stored(h) == manifest
        assert as_a_person_reads_it(h) == before
        assert await read_back(h, stored(h).files[0]) == before
    h.backend.refuse = False
    h.persisted_paths.clear()
    await h.persist(nxt)
    assert as_a_person_reads_it(h) == data
    assert await read_back(h, stored(h).files[0]) == data


async def test_a_renamed_file_in_segments_is_copied_piece_by_piece(tmp_path: Path) -> None:
    """A file that left RAM and is renamed: the store copies each of its pieces (nothing is
    sent, nor could be: its bytes are not here), and reads fall back to the old name until
    then."""
    h = Harness(tmp_path)
    data, manifest = await persisted_in_two_pieces(h, 20_000, 700)
    entry = manifest.files[0]
    assert entry.segments
    (h.objects / entry.xxh3).unlink()  # evicted: only the store holds it
    moved = dataclasses.replace(entry, name="old.log")
    reader = PersistentReader(h.backend, trio.CapacityLimiter(2),
                              lambda key: [PATH] if key == "run/old.log" else [])
    assert await reader.read_range("run", moved, 0, moved.size) == data  # from the old name
    h.steps.copy_sources = lambda key: [(PATH, PATH)] if key == "run/old.log" else []
    renamed = mf.StepManifest("run/old.log", mf.NO_STEP, 1, "n", 0, (moved,), single_file=True)
    h.current.add("run/old.log")
    sent = h.uploader.bytes_sent
    h.persisted_paths.clear()
    await h.persist(renamed)
    assert h.uploader.bytes_sent == sent
    assert await PersistentReader(h.backend, trio.CapacityLimiter(2)).read_range(
        "run", moved, 0, moved.size) == data
