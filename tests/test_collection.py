"""The daemon's full garbage collections run on their timer, never in the middle of a burst of
allocations (a commit of a step of 10,000 files: issue 25)."""

from __future__ import annotations

import gc

import pytest
import trio
import trio.testing

from tests.waiting import wait_until_async
from tierfs.mount_helper.daemon.collection import run_full_collections

pytestmark = pytest.mark.core


async def test_a_burst_of_allocations_runs_no_full_collection_and_the_timer_does() -> None:
    passes: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    gc.callbacks.append(note)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_full_collections, 3600.0)
            await trio.testing.wait_all_tasks_blocked()
            kept = [[i] for i in range(300_000)]  # survivors, as a commit's entries are
            assert 2 not in passes, "a full collection ran during the allocations"
            assert 0 in passes  # the young generations are still collected as they were
            nursery.cancel_scope.cancel()
        del kept
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_full_collections, 0.01)
            await wait_until_async(lambda: 2 in passes, timeout=60)  # the timer's pass
            nursery.cancel_scope.cancel()
    finally:
        gc.callbacks.remove(note)
    assert gc.get_threshold()[2] < 1000  # put back when cancelled
