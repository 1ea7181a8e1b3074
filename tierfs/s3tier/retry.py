"""The persistent tier's use of the one retry policy (`tierfs.retry`): a backend error is worth
another attempt when the backend says it is temporary (timeouts, 5xx, SlowDown, a refused
connection), never when it is final (a missing bucket, wrong credentials, a missing object)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from tierfs.retry import POLICY, NoLongerWanted, RetryPolicy
from tierfs.retry import retry as retry_any
from tierfs.s3tier.interface import BackendError

__all__ = ["POLICY", "NoLongerWanted", "RetryPolicy", "is_temporary", "retry"]

T = TypeVar("T")


def is_temporary(exc: BaseException) -> bool:
    """Whether retrying can help: the backend's own judgement."""
    return isinstance(exc, BackendError) and exc.temporary


async def retry(call: Callable[[], Awaitable[T]], what: str, *, policy: RetryPolicy = POLICY,
                still_wanted: Callable[[], bool] = lambda: True) -> T:
    """`tierfs.retry.retry` for backend calls."""
    return await retry_any(call, what, retryable=is_temporary, policy=policy,
                           still_wanted=still_wanted)
