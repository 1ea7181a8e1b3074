"""Sending a file to the persistent tier request by request, for the uploader and for `tierfs
verify`'s repairs alike: a file no larger than the backend's part is one `put_file`; a larger
one goes up in parts, each part a request of its own retried alone by the caller's policy.
Retrying a whole file instead needs every one of its requests to pass at once, which under
steady throttling (SlowDown) a file of many parts never does.

An upload the store no longer knows (UploadGone: aborted by a lifecycle rule, or completed by a
request whose reply was lost) is sent again from the start; one given up (refused for good, or
no longer wanted) is aborted, so that its parts do not stay in the store."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from tierfs.retry import POLICY, RetryPolicy, retry
from tierfs.s3tier.interface import Backend, BackendError, UploadGone

# call(what, func, *args): func(*args) in a worker thread, retried by the caller's policy.
Call = Callable[..., Awaitable[Any]]

# Seconds to drop the parts of an upload given up: one request, and only good manners (a
# stopping daemon waits for it, so it stays short when the store does not answer).
ABANDON_TIMEOUT = 5.0


async def send_file(backend: Backend, key: str, path: str, size: int, call: Call,
                    limiter: trio.CapacityLimiter, *, policy: RetryPolicy = POLICY,
                    still_wanted: Callable[[], bool] = lambda: True) -> None:
    """Store the `size` bytes of the file at `path` under `key`."""
    if backend.part_size is None or size <= backend.part_size:
        await call(f"upload of {key}", backend.put_file, key, path)
        return
    await retry(lambda: _send_in_parts(backend, key, path, size, call, limiter),
                f"upload of {key}", retryable=lambda exc: isinstance(exc, UploadGone),
                policy=policy, still_wanted=still_wanted)


async def send_range(backend: Backend, key: str, path: str, offset: int, length: int,
                     call: Call, limiter: trio.CapacityLimiter, *, policy: RetryPolicy = POLICY,
                     still_wanted: Callable[[], bool] = lambda: True) -> None:
    """Store the `length` bytes of the file at `path` from `offset` under `key` (a piece of a
    file stored in segments: `tierfs.s3tier.segments`)."""
    if backend.part_size is None or length <= backend.part_size:
        await call(f"upload of {key}", backend.put_range, key, path, offset, length)
        return
    await retry(lambda: _send_in_parts(backend, key, path, length, call, limiter, offset),
                f"upload of {key}", retryable=lambda exc: isinstance(exc, UploadGone),
                policy=policy, still_wanted=still_wanted)


async def _send_in_parts(backend: Backend, key: str, path: str, size: int, call: Call,
                         limiter: trio.CapacityLimiter, start: int = 0) -> None:
    """The `size` bytes of `path` from `start` on, in parts."""
    upload_id = await call(f"start of the upload of {key}", backend.start_parts, key)
    parts = backend.parts(size)
    receipts: list[object] = [None] * len(parts)

    async def send(number: int, offset: int, length: int) -> None:
        receipts[number - 1] = await call(f"upload of {key} part {number}/{len(parts)}",
                                          backend.put_part, key, upload_id, number, path,
                                          start + offset, length)

    gone = False
    try:
        try:
            async with trio.open_nursery() as nursery:
                for part in parts:
                    nursery.start_soon(send, *part)
        except* UploadGone:
            gone = True
        if not gone:
            await call(f"completion of the upload of {key}", backend.finish_parts, key,
                       upload_id, receipts)
    except BaseException:
        # not wanted any more, refused for good, or cancelled (the daemon stops; no upload is
        # ever resumed): the parts are dropped, or the bucket keeps them until a lifecycle
        # rule removes them. Shielded, as a cancellation would skip it; bounded all the same.
        with trio.CancelScope(shield=True), trio.move_on_after(ABANDON_TIMEOUT), \
                contextlib.suppress(BackendError):
            await trio.to_thread.run_sync(backend.abandon_parts, key, upload_id,
                                          limiter=limiter, abandon_on_cancel=True)
        raise
    if gone:
        raise UploadGone(f"{key}: the store lost the upload in parts")
