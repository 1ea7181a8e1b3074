"""The uploader in one process against a file:// store in tmp, with its collaborators (the RAM
store's objects, the namespace's callbacks) injected: no mount, no S3. A failure here is in the
persistent tier's upload layer."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from tests.fakes import StepsForUploads
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.observe import Events
from tierfs.s3tier import packs
from tierfs.s3tier.backend import MANIFEST_KEY, BackendError, FileBackend
from tierfs.s3tier.reader import PersistentReader
from tierfs.s3tier.uploader import Uploader
from tierfs.trackers import TrackedStep, is_tracker_name

pytestmark = pytest.mark.store


def committed_step(objects: Path, path: str, files: dict[str, bytes]) -> mf.StepManifest:
    """A committed step as the namespace hands it over: objects named by their xxh3-128."""
    objects.mkdir(exist_ok=True)
    entries = []
    for name, data in files.items():
        staging = objects / "staging"
        staging.write_bytes(data)
        digest = mf.hash_file(staging)
        staging.rename(objects / digest.xxh3)
        entries.append(mf.FileEntry(name, digest.size, digest.xxh3, chunks=digest.chunks))
    step = int(re.sub(r"\D", "", path.rpartition("/")[2]))
    return mf.StepManifest(path, step, 1, "n", 0, tuple(entries))


class FailingFirst(FileBackend):
    """A file:// store whose first `failures` uploads fail as a temporary outage would."""

    def __init__(self, root: Path, failures: int) -> None:
        super().__init__(root)
        self.failures = failures

    def put_file(self, key: str, path: str | bytes | os.PathLike[str]) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise BackendError("503 Service Unavailable", temporary=True)
        super().put_file(key, path)


class Harness:
    """An Uploader wired to a store and to records of what it reported."""

    def __init__(self, tmp: Path, *, every: int = 1, keep: int = 0, failures: int = 0) -> None:
        self.objects = tmp / "objects"
        self.store = tmp / "store"
        self.store.mkdir()
        self.backend = FailingFirst(self.store, failures)
        self.backend.claim()
        self.current: set[str] = set()
        self.versions: dict[str, mf.StepManifest] = {}  # a tracker's current version
        self.persisted_paths: list[str] = []
        self.retired: list[str] = []
        self.steps = StepsForUploads(
            lambda xxh3: str(self.objects / xxh3), self._number,
            lambda m: m.path in self.current and self.versions.get(m.path, m) is m,
            self._on_persisted, self.retired.append, tracked_step=self._tracked)
        self.uploader = Uploader(self.backend, self.steps, persist_every=every,
                                 keep_persist=keep, events=Events())

    @staticmethod
    def _number(name: str) -> int | None:
        found = re.fullmatch(r"step_(\d+)", name)
        return int(found[1]) if found else None

    def _tracked(self, manifest: mf.StepManifest, content: bytes | None = None
                 ) -> TrackedStep | None:
        """A tracker names `run/step_<its content>` (as `OtherTiers.tracked_step` reads it:
        these bytes, else those of its object)."""
        if manifest.step != mf.NO_STEP or not is_tracker_name(manifest.path):
            return None
        if content is None:
            content = (self.objects / manifest.files[0].xxh3).read_bytes()
        number = int(content)
        path = f"run/step_{number}"
        return TrackedStep(number, path in self.current, path in self.persisted_paths)

    def tracker(self, names: int, version: int) -> mf.StepManifest:
        """Version `version` of run/latest_checkpointed_iteration.txt, naming step `names`."""
        path = "run/latest_checkpointed_iteration.txt"
        self.current.add(path)
        entry = committed_step(self.objects, "run/step_0", {
            "latest_checkpointed_iteration.txt": str(names).encode()}).files[0]
        manifest = mf.StepManifest(path, mf.NO_STEP, version, "n", 0, (entry,),
                                   single_file=True)
        self.versions[path] = manifest  # the tracker's current version from now on
        return manifest

    def _on_persisted(self, manifest: mf.StepManifest) -> None:
        self.persisted_paths.append(manifest.path)

    def step(self, path: str, files: dict[str, bytes]) -> mf.StepManifest:
        self.current.add(path)
        return committed_step(self.objects, path, files)

    async def persist(self, *manifests: mf.StepManifest,
                      until: Callable[[], bool] | None = None) -> None:
        """Submit the steps and run the uploader until it persisted those it wants (or until
        `until()` holds) and has nothing left to do."""
        wanted = [m.path for m in manifests if self.uploader.wanted(m)]
        for manifest in manifests:
            self.uploader.submit(manifest)
        condition = until or (lambda: all(p in self.persisted_paths for p in wanted))

        def done() -> bool:  # and no upload cut short by the end of the run
            return condition() and not self.uploader.queue.pending
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.uploader.run)
            await wait_until_async(done, timeout=20)
            nursery.cancel_scope.cancel()

    def stored(self) -> list[str]:
        return sorted(o.key for o in self.backend.list(""))


async def test_steps_go_up_as_plain_objects_with_their_manifest(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    data = os.urandom(3 << 20)
    manifest = h.step("run/step_1", {"shard": data, "sub/x": b"x", ".metadata": b"m"})
    await h.persist(manifest)
    assert h.persisted_paths == ["run/step_1"]
    assert h.stored() == [f"run/step_1/{n}" for n in sorted([".metadata", MANIFEST_KEY, "shard",
                                                            "sub/x"])]
    assert (h.store / "run/step_1/shard").read_bytes() == data
    assert mf.decode(h.backend.get_bytes(f"run/step_1/{MANIFEST_KEY}")) == manifest


async def test_persist_every_and_keep_persist(tmp_path: Path) -> None:
    h = Harness(tmp_path, every=2, keep=2)
    steps = [h.step(f"run/step_{n}", {"shard": f"{n}".encode()}) for n in (2, 3, 4, 6)]
    assert not h.uploader.wanted(steps[1])  # step 3: not a multiple of 2
    await h.persist(*steps, until=lambda: h.retired == ["run/step_2"])
    assert h.persisted_paths == ["run/step_2", "run/step_4", "run/step_6"]
    assert h.retired == ["run/step_2"]
    assert {k.rpartition("/")[0] for k in h.stored()} == {"run/step_4", "run/step_6"}


async def test_a_temporary_failure_is_retried_by_the_policy(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, failures=2)
    await h.persist(h.step("run/step_1", {"shard": b"data"}))
    assert h.persisted_paths == ["run/step_1"]
    assert (h.store / "run/step_1/shard").read_bytes() == b"data"
    assert caplog.text.count("failed (attempt") == 2


async def test_a_step_removed_during_an_outage_is_dropped(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, failures=10**6)
    manifest = h.step("run/step_1", {"shard": b"data"})
    h.uploader.submit(manifest)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.uploader.run)
        with trio.fail_after(10):
            await wait_until_async(lambda: "failed (attempt" in caplog.text, timeout=60)
            h.current.clear()  # the step was deleted: the next retry gives up
            await wait_until_async(lambda: "dropped" in caplog.text, timeout=60)
        nursery.cancel_scope.cancel()
    assert h.persisted_paths == [] and h.stored() == []


async def test_a_store_away_for_a_while_gets_the_step_once_back(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A file:// store whose directory is moved away (a volume unmounted) while a step commits:
    the upload fails as "the store is unavailable" (a line per attempt, no traceback), the
    reason and since when are there for `tierfs status`, and once the directory is back the
    step is persisted with no help."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path)
    away = tmp_path / "away"
    h.store.rename(away)
    manifest = h.step("run/step_1", {"shard": b"data", ".metadata": b"m"})
    h.uploader.submit(manifest)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.uploader.run)
        with trio.fail_after(20):
            # failed, and tried again
            await wait_until_async(lambda: h.uploader.waiting(manifest)[2] >= 2, timeout=60)
            reason, since_ns, _failures = h.uploader.waiting(manifest)
            assert reason == f"the store file://{h.store} is unavailable: {h.store} is missing"
            assert since_ns <= time.time_ns()
            away.rename(h.store)
            await wait_until_async(lambda: h.persisted_paths == ["run/step_1"], timeout=60)
        nursery.cancel_scope.cancel()
    assert (h.store / "run/step_1/shard").read_bytes() == b"data"
    assert h.uploader.troubles == {}
    assert "upload of run/step_1 v1 failed (attempt 2), retrying in" in caplog.text
    assert "Traceback" not in caplog.text


async def test_a_failing_step_does_not_hold_up_the_others(tmp_path: Path) -> None:
    """A step the store refuses for a reason of its own is tried again later, and the steps
    behind it go up meanwhile."""
    h = Harness(tmp_path)
    (h.store / "run").mkdir()
    (h.store / "run/step_1").write_bytes(b"a file where the step's directory must go")
    first = h.step("run/step_1", {"shard": b"one"})
    second = h.step("run/step_2", {"shard": b"two"})
    await h.persist(first, second, until=lambda: h.persisted_paths == ["run/step_2"]
                    and h.uploader.waiting(first)[2] >= 2)
    assert "Not a directory" in h.uploader.waiting(first)[0]


async def test_a_tracker_goes_up_only_after_the_step_it_names(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A tracker committed before the step it names is in the store waits for that step, then
    goes up; a version naming a step --persist-every skips is not due (the store keeps the
    version it has): the store's tracker never names a step the store lacks."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, every=2)
    tracker = "run/latest_checkpointed_iteration.txt"
    step_2 = h.step("run/step_2", {"shard": b"2"})  # committed, not yet in the store
    first = h.tracker(2, 1)
    await h.persist(first, until=lambda: f"{tracker} v1 waits for the step it names (2)"
                    in caplog.text)
    assert h.persisted_paths == [] and h.stored() == []
    await h.persist(step_2, until=lambda: tracker in h.persisted_paths)
    assert h.persisted_paths == ["run/step_2", tracker]
    assert (h.store / tracker).read_text() == "2"

    step_3 = h.step("run/step_3", {"shard": b"3"})  # never persisted with --persist-every 2
    second = h.tracker(3, 2)
    assert not h.uploader.wanted(second)
    assert not h.uploader.wanted(h.tracker(5, 2))  # no step 5 anywhere: not due either
    await h.persist(step_3, second, until=lambda: True)
    assert (h.store / tracker).read_text() == "2"
    step_4 = h.step("run/step_4", {"shard": b"4"})
    await h.persist(h.tracker(4, 3), step_4,
                    until=lambda: h.persisted_paths.count(tracker) == 2)
    assert h.persisted_paths[-2:] == ["run/step_4", tracker]
    assert (h.store / tracker).read_text() == "4"


async def test_the_stores_tracker_follows_its_steps_however_fast_the_saver_rewrites_it(
        tmp_path: Path) -> None:
    """Saves faster than uploads: the version naming a step is superseded before that step is
    in the store, by one naming a step --persist-every skips, or one not there yet. The store
    still gets a tracker naming the newest step it holds that a version named (it got none,
    or kept naming an old step)."""
    h = Harness(tmp_path, every=2)
    tracker = "run/latest_checkpointed_iteration.txt"
    step_2 = h.step("run/step_2", {"shard": b"2"})
    first = h.tracker(2, 1)
    second = h.tracker(3, 2)  # step 3: never in the store
    await h.persist(first, second, step_2,
                    until=lambda: (h.store / tracker).is_file())
    assert (h.store / tracker).read_text() == "2"
    assert mf.decode(h.backend.get_bytes(
        "run/.tierfs-file-latest_checkpointed_iteration.txt/.tierfs-manifest")).version == 1

    step_4, step_6 = (h.step(f"run/step_{n}", {"shard": str(n).encode()}) for n in (4, 6))
    third, fourth = h.tracker(4, 3), h.tracker(6, 4)  # step 6 follows step 4 up
    manifest_key = "run/.tierfs-file-latest_checkpointed_iteration.txt/.tierfs-manifest"

    def stored_version() -> int:
        try:
            return mf.decode(h.backend.get_bytes(manifest_key)).version
        except BackendError:
            return 0

    await h.persist(third, fourth, step_4, step_6, until=lambda: stored_version() == 4)
    assert (h.store / tracker).read_text() == "6"
    assert h.persisted_paths.index("run/step_6") < h.persisted_paths.index(tracker, 2)


async def test_retention_keeps_the_step_the_stores_tracker_names(tmp_path: Path) -> None:
    """--keep-persist 2 with a tracker in the store naming step 1 while steps 2 to 4 go up
    (the versions naming them not committed yet): step 1 stays, since a fresh node resumes
    from it (it was removed, and the store's tracker named a step it lacked)."""
    h = Harness(tmp_path, keep=2)
    tracker = "run/latest_checkpointed_iteration.txt"
    step_1 = h.step("run/step_1", {"shard": b"1"})
    await h.persist(step_1, h.tracker(1, 1), until=lambda: (h.store / tracker).is_file())
    later = [h.step(f"run/step_{n}", {"shard": str(n).encode()}) for n in (2, 3, 4)]
    await h.persist(*later, until=lambda: h.retired == ["run/step_2"])
    assert {k.split("/")[1] for k in h.stored() if "step_" in k} == {
        "step_1", "step_3", "step_4"}
    # once the store's tracker names a newer step, step 1 goes at the next retention
    await h.persist(h.tracker(4, 2), until=lambda: "run/step_1" in h.retired)
    assert (h.store / tracker).read_text() == "4"


async def test_packs_follow_each_version_of_a_step(tmp_path: Path) -> None:
    """A step of many small files gets packs beside its plain objects; a version with the same
    bytes keeps them as they are, one with other bytes gets new ones, one with too few small
    files none; the packs hold every small file's bytes where the index says."""
    h = Harness(tmp_path)

    def version(number: int, files: dict[str, bytes]) -> mf.StepManifest:
        manifest = h.step("run/step_1", files)
        return dataclasses.replace(manifest, version=number)

    def packed(files: dict[str, bytes]) -> None:
        index = packs.decode_index(h.backend.get_bytes("run/step_1/.tierfs-packs"))
        assert set(index.files) == set(files)
        for name, where in index.files.items():
            pack = h.backend.get_bytes(f"run/step_1/{where.pack}")
            assert pack[where.offset:where.offset + where.size] == files[name]
            assert (h.store / "run/step_1" / name).read_bytes() == files[name]  # plain too

    first = {f"t{i:03}": os.urandom(100 + i) for i in range(packs.MIN_FILES + 6)}
    await h.persist(version(1, first))
    packed(first)
    sent = h.uploader.pack_bytes_sent
    assert sent > sum(map(len, first.values()))

    h.persisted_paths.clear()  # the same bytes again (a change of modes): nothing new sent
    await h.persist(version(2, first))
    assert h.uploader.pack_bytes_sent == sent
    packed(first)

    h.persisted_paths.clear()
    second = {**first, "t000": b"other bytes"}
    del second["t001"]
    await h.persist(version(3, second))
    packed(second)

    h.persisted_paths.clear()
    few = dict(list(second.items())[:packs.MIN_FILES - 1])
    await h.persist(version(4, few))
    assert not [key for key in h.stored() if ".tierfs-pack" in key]


async def test_a_packed_step_reads_back_with_few_requests_and_never_wrong(
        tmp_path: Path) -> None:
    """`PackedReader` serves each small file from its pack (one request for the index, one for
    the pack); a pack with other bytes sends the step's reads to the plain objects."""
    h = Harness(tmp_path)
    files = {f"t{i:03}": os.urandom(4096) for i in range(200)}
    manifest = h.step("run/step_1", files)
    await h.persist(manifest)
    plain = PersistentReader(h.backend, trio.CapacityLimiter(4))
    reader = packs.PackedReader(plain)
    for entry in manifest.files:
        assert await reader.read_range("run/step_1", entry, 0, entry.size) == files[entry.name]
    assert plain.requests == 2 and reader.files_from_packs == len(files)

    pack = h.store / "run/step_1/.tierfs-pack-0"
    pack.write_bytes(bytes(b ^ 1 for b in pack.read_bytes()))
    plain = PersistentReader(h.backend, trio.CapacityLimiter(4))
    reader = packs.PackedReader(plain)
    for entry in manifest.files:
        assert await reader.read_range("run/step_1", entry, 0, entry.size) == files[entry.name]
    assert reader.files_from_packs == 0 and plain.requests == 2 + len(files)
