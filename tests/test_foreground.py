"""fs.lifecycle.foreground: background work waits for a pause in the mount users' requests, and
never longer than MOST_WAIT (a mount that is never quiet slows its uploads, never stops them)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tierfs.fs.lifecycle.foreground import BUSY_PASSES, MOST_WAIT, QUIET, Foreground

pytestmark = pytest.mark.core


async def _waited(foreground: Foreground) -> float:
    started = trio.current_time()
    await foreground.wait_quiet()
    return trio.current_time() - started


def run(test: object) -> None:
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def test_no_request_no_wait() -> None:
    async def test() -> None:
        assert await _waited(Foreground()) == 0

    run(test)


def test_a_pause_after_the_last_request() -> None:
    async def test() -> None:
        foreground = Foreground()
        foreground.request()
        await trio.sleep(QUIET / 5)
        assert await _waited(foreground) == pytest.approx(QUIET * 4 / 5)

    run(test)


def test_requests_that_never_pause_hold_it_back_at_most_most_wait() -> None:
    async def test() -> None:
        foreground = Foreground()

        async def user(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            foreground.request()
            task_status.started()
            while True:
                await trio.sleep(QUIET / 10)
                foreground.request()

        async with trio.open_nursery() as nursery:
            await nursery.start(user)
            assert await _waited(foreground) == pytest.approx(MOST_WAIT)
            assert await _waited(foreground) == pytest.approx(MOST_WAIT)
            nursery.cancel_scope.cancel()
        assert foreground.waited == pytest.approx(2 * MOST_WAIT)

    run(test)


def test_many_waiters_past_their_wait_go_a_few_per_most_wait() -> None:
    """The uploader's 32 workers for small files each waiting MOST_WAIT let 64 PUTs a second
    through beside a save: past their wait they go BUSY_PASSES per MOST_WAIT together, and
    all at once when the users pause."""
    async def test() -> None:
        writing = [True]  # a save that goes on
        foreground = Foreground(writing=lambda: writing[0])
        went: list[float] = []

        async def waiter() -> None:
            await foreground.wait_quiet()
            went.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for _ in range(32):
                nursery.start_soon(waiter)
            # (not at 2 * MOST_WAIT itself: a pass then and this task's wake-up come at the
            # same instant, in either order)
            await trio.sleep(2 * MOST_WAIT - MOST_WAIT / BUSY_PASSES / 2)
            assert went == pytest.approx(
                [MOST_WAIT + i * MOST_WAIT / BUSY_PASSES for i in range(BUSY_PASSES)])
            writing[0] = False  # the save is done: the others go at once
        assert len(went) == 32 and went[-1] <= 2 * MOST_WAIT + QUIET

    run(test)


def test_a_file_being_written_holds_it_back_until_it_closes() -> None:
    """A save under passthrough makes no requests while the kernel writes its files: a file
    being written counts as the users not being done, and its close lets the work go on."""
    async def test() -> None:
        writing = [True]
        foreground = Foreground(writing=lambda: writing[0])

        async def closes() -> None:
            await trio.sleep(MOST_WAIT / 2)
            writing[0] = False

        async with trio.open_nursery() as nursery:
            nursery.start_soon(closes)
            waited = await _waited(foreground)
        assert MOST_WAIT / 2 <= waited < MOST_WAIT
        writing[0] = True  # a writer that never closes: held back at most MOST_WAIT
        assert await _waited(foreground) == pytest.approx(MOST_WAIT)

    run(test)
