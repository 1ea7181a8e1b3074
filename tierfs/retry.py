"""Retries in one place: one policy (jittered exponential backoff, log lines whose level rises
with the attempts) and one loop, used for the persistent tier (uploads, reads), replication and
etcd. Libraries' own retries are off (botocore in `s3tier.s3_backend`), so a request is retried
here and nowhere else: attempts do not multiply and every one is logged.

Callers differ in which errors are worth another attempt (`retryable`) and in how long the work
stays wanted: an upload retries until it succeeds or is superseded (no attempt limit); a read
someone waits on gives up after a few attempts (EIO rather than a hung reader); the replicator
caps its pause, since a membership change wakes it; etcd calls pause at most a second, so that
commits resume within about a second of etcd coming back.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import trio

log = logging.getLogger(__name__)

T = TypeVar("T")


class NoLongerWanted(Exception):
    """The work a retry loop was doing was superseded; stop without an error."""


@dataclass(frozen=True)
class RetryPolicy:
    first_delay: float = 0.2
    max_delay: float = 30.0
    attempts: int | None = None  # None: until the work is no longer wanted

    def limited(self, attempts: int) -> RetryPolicy:
        """The same backoff, giving up after `attempts` tries."""
        return replace(self, attempts=attempts)

    def capped(self, max_delay: float) -> RetryPolicy:
        """The same backoff, never pausing longer than `max_delay`."""
        return replace(self, max_delay=max_delay)

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number `attempt` (1, 2, ...), jittered so that many
        clients that failed together do not come back together."""
        return min(self.max_delay, self.first_delay * 2 ** attempt) * random.uniform(0.5, 1.0)

    def gives_up_after(self, attempt: int) -> bool:
        return self.attempts is not None and attempt >= self.attempts

    @staticmethod
    def level(attempt: int) -> int:
        """A blip is INFO; a service that stays away becomes a WARNING, then an ERROR."""
        return logging.INFO if attempt < 3 else logging.WARNING if attempt < 8 else logging.ERROR

    async def pause(self, attempt: int, *, wake: trio.Event | None = None) -> None:
        """Sleep the pause after `attempt`, or until `wake` is set (if given)."""
        with trio.move_on_after(self.delay(attempt)):
            if wake is None:
                await trio.sleep_forever()
            await wake.wait()


POLICY = RetryPolicy()
CATCH_UP_RETRIES = POLICY.capped(5.0)  # reading etcd after a start, until it answers
STORE_CHECK_RETRIES = POLICY.capped(1.0)  # the store at start, for the mount's patience at most


async def retry(call: Callable[[], Awaitable[T]], what: str, *,
                retryable: Callable[[Exception], bool], policy: RetryPolicy = POLICY,
                still_wanted: Callable[[], bool] = lambda: True) -> T:
    """`call()` until it succeeds, fails for good (an error `retryable` refuses), the policy
    gives up (the last error is raised) or the work is no longer wanted (NoLongerWanted)."""
    attempt = 0
    while True:
        try:
            result = await call()
        except Exception as exc:
            attempt += 1
            if not retryable(exc) or policy.gives_up_after(attempt):
                raise
            delay = policy.delay(attempt)
            log.log(policy.level(attempt), "%s failed (attempt %d), retrying in %.1f s: %s",
                    what, attempt, delay, exc)
            await trio.sleep(delay)
            if not still_wanted():
                raise NoLongerWanted(what) from None
            continue
        if attempt:
            log.info("%s succeeded after %d failed attempts", what, attempt)
        return result
