"""The queue of committed steps a background worker (uploads, replication) takes its work from:
a newer version replaces an older one waiting, and a version put again while it is worked on
is worked on once more."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tierfs import manifest as mf
from tierfs.step_queue import StepQueue

pytestmark = pytest.mark.core


def committed(path: str, version: int = 1) -> mf.StepManifest:
    entry = mf.FileEntry("model.pt", 1, "a" * 32, chunks=("0" * 16,))
    return mf.StepManifest(path, 1, version, "n0", 1, (entry,))


async def worked_on(queue: StepQueue, path: str, work) -> None:  # type: ignore[no-untyped-def]
    """Serve `queue` with `work` until nothing of `path` waits or is being worked on."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.serve, work)
        with trio.fail_after(5):
            await queue.settled(path)
        nursery.cancel_scope.cancel()


async def test_a_version_put_again_while_it_is_worked_on_is_worked_on_once_more() -> None:
    """The uploader puts a tracker's current version again while it works on it (an older
    version went up, and the current one's step reached the store meanwhile): that put was
    dropped, and the store kept the older tracker until some other step got there."""
    queue = StepQueue()
    step = committed("run/latest")
    rounds: list[int] = []

    async def work(manifest: mf.StepManifest) -> None:
        rounds.append(manifest.version)
        if len(rounds) == 1:
            queue.put(manifest)  # something changed that this round may have missed

    queue.put(step)
    await worked_on(queue, step.path, work)
    assert rounds == [1, 1]


async def test_a_newer_version_replaces_a_waiting_one_and_an_older_one_is_ignored() -> None:
    queue = StepQueue()
    seen: list[int] = []
    gate = trio.Event()

    async def work(manifest: mf.StepManifest) -> None:
        seen.append(manifest.version)
        await gate.wait()

    queue.put(committed("run/step_1", 1))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.serve, work)
        await trio.testing.wait_all_tasks_blocked()
        queue.put(committed("run/step_1", 3))  # waits while v1 is worked on
        queue.put(committed("run/step_1", 2))  # late: older than the one waiting
        gate.set()
        with trio.fail_after(5):
            await queue.settled("run/step_1")
        nursery.cancel_scope.cancel()
    assert seen == [1, 3]
