"""The persistent tier as a read source: byte ranges of committed files, by the contract's
layout `<prefix>/<step path>/<file>`. A few quick retries ride out a blip; a longer outage
fails the read (EIO) instead of hanging the reader."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from tierfs import layout
from tierfs import manifest as mf
from tierfs.s3tier import holdings, segments
from tierfs.s3tier.interface import Backend, NotFound
from tierfs.s3tier.retry import POLICY, retry
from tierfs.s3tier.sending import send_file

T = TypeVar("T")

READ_ATTEMPTS = 4
READS = POLICY.limited(READ_ATTEMPTS)  # a reader waits: fail it (EIO) rather than hang it


class PersistentReader:
    name = "persist"

    def __init__(self, backend: Backend, limiter: trio.CapacityLimiter,
                 old_keys: Callable[[str], list[str]] = lambda _key: []) -> None:
        self.backend = backend
        self._limiter = limiter
        self._old_keys = old_keys  # a renamed file's old names, until its new one is stored
        self.requests = 0  # requests sent to the store, each attempt counted (status, tests)

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        """`step_path`: the directory the entry is relative to (`layout.data_dir`)."""
        key = layout.object_key(step_path, entry.name)
        try:
            return await self._read(key, entry, offset, length)
        except NotFound:
            for old in self._old_keys(key):  # the fetch checks the bytes against the entry
                with contextlib.suppress(NotFound):
                    return await self._read(old, entry, offset, length)
            raise

    async def _read(self, key: str, entry: mf.FileEntry, offset: int, length: int) -> bytes:
        if entry.segments:  # an appended loose file: its base and segments (s3tier.segments)
            return await segments.read_pieces(self._get_range, key, entry, offset, length)
        return await self._get_range(key, offset, length)

    async def _get_range(self, key: str, offset: int, length: int) -> bytes:
        return await self._attempts(f"read of {key} [{offset}, +{length})",
                                    self.backend.get_range, key, offset, length)

    async def read_object(self, key: str) -> bytes:
        """A whole object of the store (a pack, its index: `tierfs.s3tier.packs`); NotFound if
        there is none."""
        return await self._attempts(f"read of {key}", self.backend.get_bytes, key)

    async def _attempts(self, what: str, func: Callable[..., T], *args: object) -> T:
        """`func(*args)` in a worker thread, retried by the one policy, a few times at most."""
        def attempt() -> Awaitable[T]:
            self.requests += 1
            return trio.to_thread.run_sync(func, *args, limiter=self._limiter)

        return await retry(attempt, what, policy=READS)

    async def held_files(self, manifest: mf.StepManifest) -> set[str]:
        """The `StoreCheck` of the file system: the files of this version whose objects the
        store holds now at their sizes; none if its manifest is not there."""
        held = await self._attempts(f"listing of {manifest.path}", holdings.held_now,
                                    self.backend, manifest)
        return set(held.files) if held.manifest else set()

    # -- for `tierfs verify`: reading manifests back and replacing bad objects --------------

    async def rewrite(self, step_path: str, entry: mf.FileEntry, path: str) -> None:
        """Upload a verified local copy over the object of a committed file, each of its
        requests retried as a read is: a few times at most."""
        key = layout.object_key(step_path, entry.name)
        if entry.segments:
            await segments.send_pieces(self.backend, key, entry, path, 0, self._attempts,
                                       self._limiter, policy=READS)
            return
        await send_file(self.backend, key, path, entry.size, self._attempts, self._limiter,
                        policy=READS)

    async def stored_size(self, step_path: str, entry: mf.FileEntry) -> int | None:
        """The size of a committed file as the store holds it, None if an object of it is
        missing: of a file stored in segments, the entry's size if its base object holds at
        least the base and each segment object exactly its segment, else the sum of their
        sizes (a base object longer than the base is the whole file, uploaded again)."""
        if not entry.segments:
            return await self.object_size(step_path, entry.name)
        key = layout.object_key(step_path, entry.name)
        sizes = []
        for piece, (_offset, length) in zip(layout.piece_keys(key, entry.segments),
                                            entry.pieces(), strict=True):
            size = await self._size_of(piece)
            if size is None:
                return None
            sizes.append(size if sizes else min(size, length))  # the base may be longer
        return sum(sizes)

    async def object_size(self, step_path: str, name: str) -> int | None:
        """The size of a committed file's object, None if there is none."""
        return await self._size_of(layout.object_key(step_path, name))

    async def _size_of(self, key: str) -> int | None:
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
