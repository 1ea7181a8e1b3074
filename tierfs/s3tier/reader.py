"""The persistent tier as a read source: byte ranges of committed files, by the contract's
layout `<prefix>/<step path>/<file>`. A few quick retries ride out a blip; a longer outage
fails the read (EIO) instead of hanging the reader."""

from __future__ import annotations

import logging

import trio

from tierfs import manifest as mf
from tierfs.s3tier.backend import Backend, BackendError

log = logging.getLogger(__name__)

READ_ATTEMPTS = 4


class PersistentReader:
    name = "persist"

    def __init__(self, backend: Backend, limiter: trio.CapacityLimiter) -> None:
        self.backend = backend
        self._limiter = limiter

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        key = f"{step_path}/{entry.name}"
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                return await trio.to_thread.run_sync(self.backend.get_range, key, offset,
                                                     length, limiter=self._limiter)
            except BackendError as exc:
                if not exc.temporary or attempt == READ_ATTEMPTS:
                    raise
                log.info("read of %s [%d, +%d) failed (attempt %d), retrying: %s", key, offset,
                         length, attempt, exc)
                await trio.sleep(0.2 * 2 ** attempt)
        raise AssertionError("unreachable")
