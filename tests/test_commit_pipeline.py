"""What follows a commit on this node (`mount_helper.daemon.commit_pipeline.CommitPipeline`),
in process, with an uploader and a replicator that only record what they are given: every
committed version goes to the replicator at once and to the uploader once its copies are made,
or after COPIES_FIRST seconds at most if they cannot be."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.mount_helper.daemon.commit_pipeline import COPIES_FIRST, CommitPipeline
from tierfs.step_queue import StepQueue

pytestmark = pytest.mark.core


def committed(path: str, version: int = 1) -> mf.StepManifest:
    entry = mf.FileEntry("model.pt", 1, "a" * 32, chunks=("0" * 16,))
    return mf.StepManifest(path, 1, version, "n0", 1, (entry,))


class RecordingUploader:
    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(self, manifest: mf.StepManifest) -> None:
        self.submitted.append(manifest.path)


class HeldReplicator:
    """Takes every version into its queue; its copies are made when the test says so."""

    def __init__(self) -> None:
        self.queue = StepQueue()
        self.submitted: list[str] = []
        self.copies_made = trio.Event()

    def submit(self, manifest: mf.StepManifest) -> None:
        self.submitted.append(manifest.path)
        self.queue.put(manifest)

    async def run(self) -> None:
        async def copy(_manifest: mf.StepManifest) -> None:
            await self.copies_made.wait()

        await self.queue.serve(copy)


@asynccontextmanager
async def running(pipeline: CommitPipeline, replicator: HeldReplicator | None = None
                  ) -> AsyncIterator[trio.MemorySendChannel[mf.StepManifest]]:
    """The pipeline (and the replicator's worker) running; the channel its commits come by."""
    send, receive = trio.open_memory_channel[mf.StepManifest](10)
    async with trio.open_nursery() as nursery:
        if replicator is not None:
            nursery.start_soon(replicator.run)
        nursery.start_soon(pipeline.run, receive)
        yield send
        nursery.cancel_scope.cancel()


async def test_the_upload_of_a_step_waits_for_its_peer_copies() -> None:
    uploader, replicator = RecordingUploader(), HeldReplicator()
    pipeline = CommitPipeline(uploader, replicator)  # type: ignore[arg-type]
    async with running(pipeline, replicator) as send:
        await send.send(committed("run/step_1"))
        await trio.testing.wait_all_tasks_blocked()
        assert replicator.submitted == ["run/step_1"] and uploader.submitted == []
        replicator.copies_made.set()
        await trio.testing.wait_all_tasks_blocked()
        assert uploader.submitted == ["run/step_1"] and pipeline.commits == 1


async def test_an_upload_waits_for_copies_that_cannot_be_made_only_so_long(
        autojump_clock: trio.testing.MockClock) -> None:
    uploader, replicator = RecordingUploader(), HeldReplicator()
    pipeline = CommitPipeline(uploader, replicator)  # type: ignore[arg-type]
    async with running(pipeline, replicator) as send:
        await send.send(committed("run/step_2"))
        started = trio.current_time()
        await wait_until_async(lambda: uploader.submitted, timeout=60, interval=0.5)
        assert COPIES_FIRST <= trio.current_time() - started <= COPIES_FIRST + 0.5


async def test_without_a_cluster_each_version_goes_straight_to_the_uploader() -> None:
    uploader = RecordingUploader()
    pipeline = CommitPipeline(uploader, None)  # type: ignore[arg-type]
    async with running(pipeline) as send:
        for version in (1, 2):
            await send.send(committed("run/step_3", version))
        await trio.testing.wait_all_tasks_blocked()
        assert uploader.submitted == ["run/step_3", "run/step_3"] and pipeline.commits == 2
