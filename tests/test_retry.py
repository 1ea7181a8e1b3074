"""The one retry policy (tierfs.s3tier.retry): backoff bounds, attempt limits, what is retried
and what is not, and giving up when the work is no longer wanted."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tierfs.s3tier.interface import BackendError, NotFound
from tierfs.s3tier.retry import POLICY, NoLongerWanted, RetryPolicy, retry

pytestmark = pytest.mark.core

QUICK = RetryPolicy(first_delay=0.001, max_delay=0.004)


def test_the_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    for attempt in range(1, 12):
        full = min(POLICY.max_delay, POLICY.first_delay * 2 ** attempt)
        delays = [POLICY.delay(attempt) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays)
    assert POLICY.capped(2.0).delay(20) <= 2.0
    assert POLICY.limited(4).gives_up_after(4) and not POLICY.gives_up_after(10**6)


class Flaky:
    """Fails `times` times with `error`, then answers."""

    def __init__(self, times: int, error: BackendError) -> None:
        self.times = times
        self.error = error
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.times:
            raise self.error
        return "done"


async def test_temporary_failures_are_retried_until_success() -> None:
    call = Flaky(5, BackendError("503", temporary=True))
    assert await retry(call, "upload", policy=QUICK) == "done"
    assert call.calls == 6


async def test_a_final_failure_is_not_retried() -> None:
    call = Flaky(5, NotFound("run/step_1/x"))
    with pytest.raises(NotFound):
        await retry(call, "read", policy=QUICK)
    assert call.calls == 1


async def test_a_limited_policy_gives_up_with_the_last_error() -> None:
    call = Flaky(10, BackendError("timed out", temporary=True))
    with pytest.raises(BackendError, match="timed out"):
        await retry(call, "read", policy=QUICK.limited(3))
    assert call.calls == 3


async def test_work_no_longer_wanted_stops_the_retries() -> None:
    call = Flaky(10, BackendError("503", temporary=True))
    with pytest.raises(NoLongerWanted):
        await retry(call, "upload", policy=QUICK, still_wanted=lambda: call.calls < 2)
    assert call.calls == 2


async def test_a_pause_ends_early_when_woken() -> None:
    """The replicator's pause: a membership change ends it at once."""
    wake = trio.Event()
    long = RetryPolicy(first_delay=100, max_delay=100)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: long.pause(1, wake=wake))
            await trio.testing.wait_all_tasks_blocked()  # the pause has begun
            wake.set()
