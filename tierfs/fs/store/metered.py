"""A read source that reports each range it delivers (bytes and time) to a meter: how the
operators' read-back events and metrics learn of reads from other tiers (`tierfs.observe.Events`
is the meter; the daemon wraps each read source it gives the namespace)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from tierfs import manifest as mf

if TYPE_CHECKING:
    from tierfs.fs.store.fetch import ReadSource, Store


class ReadMeter(Protocol):
    def read_range(self, step_path: str, where: str, nbytes: int, started: float) -> None:
        """`nbytes` of `step_path` read from `where`, the read begun at `started` (monotonic)."""


class MeteredSource:
    """`source`, reporting each range it delivers to `meter` as read from `where`."""

    def __init__(self, source: ReadSource, where: str, meter: ReadMeter) -> None:
        self.source = source
        self.name = source.name
        self.can_store = getattr(source, "can_store", False)
        self.where = where
        self._meter = meter

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        started = time.monotonic()
        data = await self.source.read_range(step_path, entry, offset, length)
        self._meter.read_range(step_path, self.where, len(data), started)
        return data

    async def read_into(self, step_path: str, entry: mf.FileEntry, offset: int,
                        buffer: memoryview) -> bytes | memoryview:
        """As the source's read_into (the bytes, perhaps in `buffer`), or its read_range."""
        read_into = getattr(self.source, "read_into", None)
        if read_into is None:
            return await self.read_range(step_path, entry, offset, len(buffer))
        started = time.monotonic()
        data = await read_into(step_path, entry, offset, buffer)
        self._meter.read_range(step_path, self.where, len(data), started)
        return data  # type: ignore[no-any-return]

    async def read_and_store(self, step_path: str, entry: mf.FileEntry, offset: int,
                             buffer: memoryview, store: Store
                             ) -> tuple[bytes | memoryview, bool]:
        """As the source's read_and_store (only where `can_store`)."""
        started = time.monotonic()
        data, good = await self.source.read_and_store(  # type: ignore[attr-defined]
            step_path, entry, offset, buffer, store)
        self._meter.read_range(step_path, self.where, len(data), started)
        return data, good

    async def read_files(self, step_path: str, entries: list[mf.FileEntry]
                         ) -> dict[str, memoryview]:
        """As the source's read_files (`fetch.FilesSource`), or none where it has none."""
        read_files = getattr(self.source, "read_files", None)
        if read_files is None:
            return {}
        started = time.monotonic()
        files: dict[str, memoryview] = await read_files(step_path, entries)
        if files:  # none came: no read-back to report
            self._meter.read_range(step_path, self.where, sum(map(len, files.values())),
                                   started)
        return files
