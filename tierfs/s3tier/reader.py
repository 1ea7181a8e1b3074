"""The persistent tier as a read source: byte ranges of committed files, by the contract's
layout `<prefix>/<step path>/<file>`. A few quick retries ride out a blip; a longer outage
fails the read (EIO) instead of hanging the reader."""

from __future__ import annotations

import logging

import trio

from tierfs import layout
from tierfs import manifest as mf
from tierfs.s3tier.backend import Backend, BackendError, NotFound

log = logging.getLogger(__name__)

READ_ATTEMPTS = 4


class PersistentReader:
    name = "persist"

    def __init__(self, backend: Backend, limiter: trio.CapacityLimiter) -> None:
        self.backend = backend
        self._limiter = limiter

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        """`step_path`: the directory the entry is relative to (`layout.data_dir`)."""
        key = layout.object_key(step_path, entry.name)
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

    async def _attempts(self, what: str, func, *args):  # type: ignore[no-untyped-def]
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                return await trio.to_thread.run_sync(func, *args, limiter=self._limiter)
            except BackendError as exc:
                if not exc.temporary or attempt == READ_ATTEMPTS:
                    raise
                log.info("%s failed (attempt %d), retrying: %s", what, attempt, exc)
                await trio.sleep(0.2 * 2 ** attempt)
        raise AssertionError("unreachable")

    # -- for `tierfs verify`: reading manifests back and replacing bad objects --------------

    async def rewrite(self, step_path: str, name: str, path: str) -> None:
        """Upload a verified local copy over the object of a committed file."""
        key = layout.object_key(step_path, name)
        await self._attempts(f"upload of {key}", self.backend.put_file, key, path)

    async def object_size(self, step_path: str, name: str) -> int | None:
        """The size of a committed file's object, None if there is none."""
        key = layout.object_key(step_path, name)
        found = await self._attempts(f"listing of {key}",
                                     lambda: [o for o in self.backend.list(key) if o.key == key])
        return found[0].size if found else None

    async def manifest(self, step_path: str, single_file: bool = False) -> bytes | None:
        key = layout.manifest_key(step_path, single_file)
        try:
            return await self._attempts(f"read of {key}", self.backend.get_bytes, key)
        except NotFound:
            return None

    async def write_manifest(self, step_path: str, data: bytes,
                             single_file: bool = False) -> None:
        key = layout.manifest_key(step_path, single_file)
        await self._attempts(f"upload of {key}", self.backend.put_bytes, key, data)
