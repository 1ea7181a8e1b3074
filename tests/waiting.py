"""Waiting for a condition instead of for a fixed time: `wait_until` from a plain thread (a test
driving a mount) and `wait_until_async` from a trio task (a test driving the namespace in
process) poll a predicate until it holds, and fail the test if it does not within `timeout`."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio


def wait_until(predicate: Any, timeout: float = 10, interval: float = 0.02,
               explain: Callable[[], object] | None = None) -> Any:
    """`predicate()`'s first true value, asked every `interval` seconds; `explain()`, if
    given, says what the failure saw instead (the state a flaky wait found)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s"
                                 + (f": {explain()}" if explain is not None else ""))
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], object | Awaitable[object]],
                           timeout: float = 10, interval: float = 0.01) -> Any:
    """`predicate()`'s first true value (awaited, if it is awaitable), asked every `interval`
    seconds while the other tasks run."""
    with trio.move_on_after(timeout):
        while True:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await trio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")
