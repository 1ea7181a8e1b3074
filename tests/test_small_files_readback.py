"""A step of many small files read back after it left RAM (per-tensor savers, sharded optimizer
state): a small file fetched back brings its step's other small files with it, many requests
on their way at once instead of one request per file waited for at each open; large files
stay where they are (each rank of a multi-node DCP load reads only its own shards)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from tests.fakes import MemoryTier
from tests.harness import Harness
from tests.test_ports import persisted_and_evicted
from tests.waiting import wait_until_async
from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.lifecycle import fetch_back

pytestmark = pytest.mark.core

SMALL_FILES = 2000
FILES = {f"t{i:05}.distcp": i.to_bytes(8, "little") * 512 for i in range(SMALL_FILES)}


@contextlib.asynccontextmanager
async def evicted(tmp_path: Path, tier: MemoryTier,
                  files: dict[str, bytes] = FILES) -> AsyncIterator[Harness]:
    """A namespace whose step run/step_1 (`files`) is in `tier` only, its reads counted from
    then on."""
    h = Harness(tmp_path / "ram", read_sources=[tier], persist=tier, keep_ram=0)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            await persisted_and_evicted(h, tier, "run/step_1", files)
            tier.reads = 0
            yield h
            nursery.cancel_scope.cancel()
    finally:
        h.close()


class GatedTier(MemoryTier):
    """A store that answers no read until `at_once` reads wait on it together (then every read
    at once, from then on): a reader that asks one file at a time never gets an answer."""

    def __init__(self, at_once: int) -> None:
        super().__init__("s3")
        self.at_once = at_once
        self.waiting = 0
        self.most_waiting = 0
        self.opened = trio.Event()

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            if self.waiting >= self.at_once:
                self.opened.set()
            await self.opened.wait()
        finally:
            self.waiting -= 1
        return await super().read_range(step_path, entry, offset, length)


async def test_the_small_files_of_an_evicted_step_come_back_many_at_once(
        tmp_path: Path) -> None:
    """The small files of an evicted step come back many at once, in the background, when
    the first of them is read: the gated store sees several requests together, and the first
    read returns."""
    store = GatedTier(at_once=8)
    async with evicted(tmp_path, store) as h:
        with trio.fail_after(60):
            for name, data in FILES.items():
                assert await h.read_file(f"run/step_1/{name}") == data
            # the step's .metadata, last in the manifest, may still be on its way when the
            # reader has its last file
            step = h.ns.tree.find_step("run/step_1").step
            await wait_until_async(lambda: len(step.resident) == SMALL_FILES + 1, timeout=30)
        assert store.most_waiting >= 8
        # every file was asked for once: the reader's own and those that came with them
        # (the step's .metadata among them)
        assert store.reads == SMALL_FILES + 1
        assert h.ns.fetch_back.small_fetched >= SMALL_FILES // 2  # most, not the reader


class ManyAtOnceTier(MemoryTier):
    """A source that gives many small files of a step in one request, as a peer does
    (`fetch.FilesSource`), with a byte of one of them flipped on the way."""

    def __init__(self, flipped: str) -> None:
        super().__init__("peer")
        self.flipped = flipped
        self.requests = 0

    async def read_files(self, step_path: str, entries: list[mf.FileEntry]
                         ) -> dict[str, memoryview]:
        self.requests += 1
        got = {}
        for entry in entries:
            data = self.objects[layout.object_key(step_path, entry.name)]
            if entry.name == self.flipped:
                data = bytes([data[0] ^ 1]) + data[1:]
            got[entry.name] = memoryview(data)
        return got


async def test_small_files_come_many_in_one_request_each_checked(tmp_path: Path) -> None:
    """A source that gives many small files at once is asked once for hundreds of them; each
    file's bytes are checked as any fetch's, and one that does not match is read again on its
    own: the reader never sees it."""
    tier = ManyAtOnceTier(flipped="t01000.distcp")
    async with evicted(tmp_path, tier) as h:
        with trio.fail_after(60):
            assert await h.read_file("run/step_1/t00000.distcp") == FILES["t00000.distcp"]
            step = h.ns.tree.find_step("run/step_1").step
            await wait_until_async(lambda: len(step.resident) == SMALL_FILES + 1, timeout=30)
            for name, data in FILES.items():
                assert await h.read_file(f"run/step_1/{name}") == data
        # the reader's first file, and the flipped one again on its own
        assert tier.reads == 2
        assert tier.requests <= SMALL_FILES // fetch_back.SMALL_AT_ONCE + 1


async def test_large_files_do_not_come_with_a_small_one(tmp_path: Path) -> None:
    """Each rank of a multi-node DCP load reads only its own shards: reading a small file
    brings the step's other small files, never a large one."""
    large = {f"__{rank}_0.distcp": bytes([rank]) * (fetch_back.SMALL_FILE + 1)
             for rank in range(3)}
    small = {f"extra_{i}.pt": bytes([i]) * 1000 for i in range(20)}
    async with evicted(tmp_path, MemoryTier("s3"), {**large, **small}) as h:
        assert await h.read_file("run/step_1/extra_0.pt") == small["extra_0.pt"]
        step = h.ns.tree.find_step("run/step_1").step
        await wait_until_async(lambda: len(step.resident) >= len(small) + 1, timeout=30)
        await trio.testing.wait_all_tasks_blocked()
        assert step.resident == {*small, ".metadata"}
        assert not h.ns.fetch_back._small_running
