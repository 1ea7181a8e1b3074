"""Retries in one place: jittered exponential backoff for temporary backend failures, with log
lines whose level rises with the attempts, and no limit while the work is still wanted."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from tierfs.s3tier.backend import BackendError

log = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_DELAY = 0.2
MAX_DELAY = 30.0


class NoLongerWanted(Exception):
    """The work a retry loop was doing was superseded; stop without an error."""


async def retry(call: Callable[[], Awaitable[T]], what: str, *,
                still_wanted: Callable[[], bool] = lambda: True) -> T:
    attempt = 0
    while True:
        try:
            return await call()
        except BackendError as exc:
            if not exc.temporary:
                raise
            attempt += 1
            delay = min(MAX_DELAY, FIRST_DELAY * 2 ** attempt) * random.uniform(0.5, 1.0)
            level = (logging.INFO if attempt < 3 else
                     logging.WARNING if attempt < 8 else logging.ERROR)
            log.log(level, "%s failed (attempt %d), retrying in %.1f s: %s", what, attempt,
                    delay, exc)
            await trio.sleep(delay)
            if not still_wanted():
                raise NoLongerWanted(what) from None
