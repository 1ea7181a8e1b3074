"""Fetching a committed file back from another tier, in one process: tierfs.fs.store.fetch with a
real RAM store in tmp and the persistent tier's read source over a file:// store, no mount. A
failure here is in the fetch layer (chunk checks, partial file, whole-file check), not in FUSE."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from tierfs import manifest as mf
from tierfs.fs.store.fetch import (
    SEQUENTIAL_RUN,
    Fetch,
    FetchError,
    RemoteFile,
    Slots,
    fetch_chunk,
)
from tierfs.fs.store.ram_store import RamFull, RamStore
from tierfs.s3tier.backend import FileBackend
from tierfs.s3tier.reader import PersistentReader

pytestmark = pytest.mark.core

STEP = "run/step_1"


@pytest.fixture
def ram(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = RamStore(tmp_path / "ram", 1 << 30)
    store.acquire()
    yield store
    store.release()


def stored_file(tmp_path: Path, data: bytes, name: str = "shard", *,
                blocks: bool = False) -> tuple[FileBackend, RemoteFile]:
    """A committed file that is only in the persistent tier (its entry with block digests if
    `blocks`, as sealed now; without, as in older manifests)."""
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    backend = FileBackend(root)
    backend.claim()
    backend.put_bytes(f"{STEP}/{name}", data)
    digest = mf.hash_file(root / STEP / name)
    entry = mf.FileEntry(name, digest.size, digest.xxh3, mode=0o640, chunks=digest.chunks,
                         blocks=digest.blocks if blocks else b"")
    return backend, RemoteFile(STEP, entry)


def persist(backend: FileBackend) -> list[PersistentReader]:
    return [PersistentReader(backend, trio.CapacityLimiter(2))]


class CountedReader(PersistentReader):
    """The persistent tier's read source, counting the bytes it delivers."""

    delivered = 0

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        data = await super().read_range(step_path, entry, offset, length)
        self.delivered += len(data)
        return data


async def test_a_file_comes_back_whole_and_verified(tmp_path: Path, ram: RamStore) -> None:
    data = os.urandom(2 * mf.CHUNK_SIZE + 777)  # three chunks, the last one short
    backend, remote = stored_file(tmp_path, data)
    fetch = Fetch(ram, remote)
    try:
        middle = await fetch.read(persist(backend), mf.CHUNK_SIZE - 10, 20)  # spans two chunks
        assert middle == data[mf.CHUNK_SIZE - 10:mf.CHUNK_SIZE + 10]
        await fetch.fill(persist(backend))
        assert fetch.complete and fetch.verify()
        assert Path(os.fsdecode(fetch.path)).read_bytes() == data
        assert os.stat(fetch.path).st_mode & 0o777 == 0o640  # as committed
        assert ram.used_bytes == len(data)
    finally:
        fetch.discard()
    assert ram.used_bytes == 0


async def test_a_corrupt_or_missing_object_is_an_error_never_data(tmp_path: Path) -> None:
    data = os.urandom(1000)
    backend, remote = stored_file(tmp_path, data)
    corrupt = bytearray(data)
    corrupt[500] ^= 1
    backend.put_bytes(f"{STEP}/shard", bytes(corrupt))
    with pytest.raises(FetchError, match="does not match its checksum"):
        await fetch_chunk(persist(backend), remote, 0)
    backend.delete([f"{STEP}/shard"])
    with pytest.raises(FetchError, match="no object"):
        await fetch_chunk(persist(backend), remote, 0)


async def test_without_room_the_chunk_is_returned_but_not_kept(tmp_path: Path) -> None:
    store = RamStore(tmp_path / "ram", 100)
    store.acquire()
    data = os.urandom(1000)
    backend, remote = stored_file(tmp_path, data)
    fetch = Fetch(store, remote)
    try:
        assert await fetch.read(persist(backend), 0, 1000) == data
        assert not fetch.complete and store.used_bytes == 0
        with pytest.raises(RamFull):
            await fetch.fill(persist(backend))
    finally:
        fetch.discard()
        store.release()


async def test_missing_bytes_and_a_check_of_a_discarded_fetch(tmp_path: Path,
                                                              ram: RamStore) -> None:
    data = os.urandom(mf.CHUNK_SIZE + 100)
    backend, remote = stored_file(tmp_path, data)
    fetch = Fetch(ram, remote)
    assert fetch.missing_bytes == len(data)
    await fetch.read(persist(backend), mf.CHUNK_SIZE, 1)  # the short last chunk only
    assert fetch.missing_bytes == mf.CHUNK_SIZE
    await fetch.fill(persist(backend), in_flight=8)
    assert fetch.missing_bytes == 0
    fetch.discard()
    assert not fetch.verify()  # nothing to adopt


def no_rereads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a whole-file re-read for the check an error: the check must come from the bytes
    as they were stored."""
    def reread(fd: int) -> mf.Digest:
        raise AssertionError("the fetched file was read again to check it")
    monkeypatch.setattr(mf, "hash_fd", reread)


async def test_a_file_fetched_in_order_is_checked_as_it_is_stored(
        tmp_path: Path, ram: RamStore, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(3 * mf.CHUNK_SIZE + 5)
    backend, remote = stored_file(tmp_path, data)
    no_rereads(monkeypatch)
    fetch = Fetch(ram, remote)
    try:
        await fetch.fill(persist(backend), in_flight=1)
        assert fetch.verify()
    finally:
        fetch.discard()


async def test_chunks_stored_out_of_order_still_make_the_whole_files_check(
        tmp_path: Path, ram: RamStore, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(4 * mf.CHUNK_SIZE)
    backend, remote = stored_file(tmp_path, data)
    no_rereads(monkeypatch)
    fetch = Fetch(ram, remote)
    try:
        for index in (3, 1, 2, 0):  # a reader jumping about: no read-ahead
            await fetch.read(persist(backend), index * mf.CHUNK_SIZE, 1)
        assert fetch.complete and fetch.verify()
    finally:
        fetch.discard()


class IntoReader(PersistentReader):
    """The persistent tier's read source receiving into the fetch's buffer, as a peer does
    (`read_into`)."""

    async def read_into(self, step_path: str, entry: mf.FileEntry, offset: int,
                        buffer: memoryview) -> memoryview:
        data = await self.read_range(step_path, entry, offset, len(buffer))
        buffer[:len(data)] = data
        return buffer[:len(data)]


@pytest.mark.parametrize("flipped", [None, 2], ids=["intact", "a-chunk-ahead-flipped"])
async def test_chunks_ahead_of_the_order_are_hashed_from_their_buffers_not_read_back(
        tmp_path: Path, ram: RamStore, flipped: int | None) -> None:
    """Chunks received into the fetch's buffers ahead of the file's order are hashed for the
    whole-file check from those buffers once the chunks before them are in (none is read
    back from the partial file), and a chunk that does not match is still refused."""
    data = os.urandom(4 * mf.CHUNK_SIZE - 3)
    backend, remote = stored_file(tmp_path, data)
    if flipped is not None:
        bad = bytearray(data)
        bad[flipped * mf.CHUNK_SIZE + 99] ^= 1
        backend.put_bytes(f"{STEP}/shard", bytes(bad))
    source = [IntoReader(backend, trio.CapacityLimiter(2))]
    fetch = Fetch(ram, remote)
    try:
        for index in (3, 1, 2, 0):  # a reader jumping about: no read-ahead
            if index == flipped:
                with pytest.raises(FetchError, match="does not match its checksum"):
                    await fetch.read(source, index * mf.CHUNK_SIZE, 1)
            else:
                assert await fetch.read(source, index * mf.CHUNK_SIZE, 10) == \
                    data[index * mf.CHUNK_SIZE:index * mf.CHUNK_SIZE + 10]
        assert fetch._whole.read_back == 0
        if flipped is None:
            assert fetch.complete and fetch.verify()
            assert Path(os.fsdecode(fetch.path)).read_bytes() == data
        else:
            assert not fetch.complete and not fetch.verify()
    finally:
        fetch.discard()


async def test_a_whole_that_does_not_match_its_manifest_is_never_adopted(
        tmp_path: Path, ram: RamStore) -> None:
    """Every chunk matches its own checksum, the whole does not match the manifest's xxh3-128
    (a manifest whose whole-file checksum is not of these bytes): not adopted."""
    data = os.urandom(2 * mf.CHUNK_SIZE + 1)
    backend, remote = stored_file(tmp_path, data)
    wrong = RemoteFile(STEP, mf.FileEntry(remote.entry.name, remote.entry.size, "0" * 32,
                                          mode=0o640, chunks=remote.entry.chunks))
    fetch = Fetch(ram, wrong)
    try:
        await fetch.fill(persist(backend))
        assert fetch.complete and not fetch.verify()
    finally:
        fetch.discard()


async def test_a_read_of_a_few_bytes_fetches_the_blocks_it_touches(tmp_path: Path,
                                                                   ram: RamStore) -> None:
    """An entry with block digests: a read here and there (a tensor of a large shard) moves
    its blocks, checked one by one, not whole chunks, and leaves the file partial."""
    data = os.urandom(4 * mf.CHUNK_SIZE + 99)
    backend, remote = stored_file(tmp_path, data, blocks=True)
    reader = CountedReader(backend, trio.CapacityLimiter(2))
    fetch = Fetch(ram, remote)
    try:
        assert await fetch.read([reader], 0, 8) == data[:8]  # a safetensors header's length
        assert reader.delivered == mf.BLOCK_SIZE
        at = 2 * mf.CHUNK_SIZE + 3 * mf.BLOCK_SIZE - 100  # 2 MiB across three blocks
        assert await fetch.read([reader], at, 2 << 20) == data[at:at + (2 << 20)]
        assert reader.delivered == 4 * mf.BLOCK_SIZE
        assert not fetch.complete and not fetch.wants_whole
        assert fetch.stored_bytes == ram.used_bytes == 4 * mf.BLOCK_SIZE
        await fetch.fill([reader])  # the rest, not what is in already
        assert reader.delivered == len(data)
        assert fetch.complete and fetch.verify()
    finally:
        fetch.discard()


async def test_a_corrupt_block_is_an_error_and_the_others_still_read(tmp_path: Path,
                                                                    ram: RamStore) -> None:
    data = os.urandom(mf.CHUNK_SIZE + 5)
    backend, remote = stored_file(tmp_path, data, blocks=True)
    corrupt = bytearray(data)
    corrupt[3 * mf.BLOCK_SIZE + 7] ^= 1
    backend.put_bytes(f"{STEP}/shard", bytes(corrupt))
    fetch = Fetch(ram, remote)
    try:
        with pytest.raises(FetchError, match="does not match its checksum"):
            await fetch.read(persist(backend), 3 * mf.BLOCK_SIZE + 5, 10)
        assert await fetch.read(persist(backend), mf.BLOCK_SIZE, 10) == \
            data[mf.BLOCK_SIZE:mf.BLOCK_SIZE + 10]
        with pytest.raises(FetchError):  # the chunk, whole, does not match either
            await fetch.fill(persist(backend))
        assert not fetch.complete
    finally:
        fetch.discard()


async def test_a_file_read_back_to_back_from_its_start_asks_to_be_fetched_whole(
        tmp_path: Path, ram: RamStore) -> None:
    data = os.urandom(3 * mf.CHUNK_SIZE)
    backend, remote = stored_file(tmp_path, data, blocks=True)
    reader = CountedReader(backend, trio.CapacityLimiter(2))
    fetch = Fetch(ram, remote, spawn=lambda *_args: None)  # no read-ahead: count the reads
    try:
        step = 128 << 10  # the kernel's requests
        for offset in range(0, SEQUENTIAL_RUN, step):
            assert not fetch.wants_whole
            assert await fetch.read([reader], offset, step) == data[offset:offset + step]
        assert fetch.wants_whole
        assert reader.delivered == mf.CHUNK_SIZE  # once sequential: whole chunks
    finally:
        fetch.discard()


class CorruptReader(PersistentReader):
    """The persistent tier's read source, with one byte of every range it delivers flipped."""

    name = "corrupt"

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        data = bytearray(await super().read_range(step_path, entry, offset, length))
        data[len(data) // 2] ^= 1
        return bytes(data)


@pytest.mark.parametrize("blocks", [False, True])
async def test_a_range_that_fails_its_check_leaves_nothing_behind(
        tmp_path: Path, ram: RamStore, blocks: bool) -> None:
    """Each range comes first from a source that corrupts it, then from a good one: the bad
    bytes (stored as they were checked) are neither counted in the RAM tier nor in the
    whole-file hash, and the file is adopted as it is."""
    data = os.urandom(3 * mf.CHUNK_SIZE + 5)
    backend, remote = stored_file(tmp_path, data, blocks=blocks)
    limiter = trio.CapacityLimiter(2)
    sources = [CorruptReader(backend, limiter), PersistentReader(backend, limiter)]
    fetch = Fetch(ram, remote)
    try:
        if blocks:  # single blocks first: the first in order, then one ahead of the order
            for at in (7, 2 * mf.BLOCK_SIZE + 7):
                assert await fetch.read(sources, at, 10) == data[at:at + 10]
            assert ram.used_bytes == 2 * mf.BLOCK_SIZE
        await fetch.fill(sources, in_flight=2)
        assert fetch.complete and fetch.verify()
        assert Path(os.fsdecode(fetch.path)).read_bytes() == data
        assert ram.used_bytes == len(data)
    finally:
        fetch.discard()
    fetch = Fetch(ram, remote)
    try:
        with pytest.raises(FetchError, match="does not match its checksum"):
            await fetch.fill([CorruptReader(backend, limiter)])
        assert ram.used_bytes == 0 and fetch.missing_bytes == len(data)
    finally:
        fetch.discard()


@pytest.mark.parametrize("blocks", [False, True], ids=["by-chunk", "by-block"])
async def test_with_the_ram_dirs_file_system_full_the_bytes_are_returned_not_kept(
        tmp_path: Path, small_shm: Path, blocks: bool) -> None:
    """The RAM dir on a /dev/shm that other processes fill while the RAM tier's own count has
    room: the verified bytes go to the reader all the same (before, the read failed with
    ENOSPC), nothing of them is counted as kept, and once there is room the file comes whole."""
    data = os.urandom(3 * mf.BLOCK_SIZE // 2)  # a short single chunk, two blocks
    backend, remote = stored_file(tmp_path, data, blocks=blocks)
    store = RamStore(small_shm / "ram", 1 << 30)
    store.acquire()
    stats = os.statvfs(small_shm)
    (small_shm / "other-user").write_bytes(bytes(stats.f_bavail * stats.f_frsize - (300 << 10)))
    fetch = Fetch(store, remote)
    try:
        # by block: one block, checked and stored slice by slice; by chunk: the whole chunk
        size = mf.BLOCK_SIZE if blocks else len(data)
        assert await fetch.read(persist(backend), 0, size) == data[:size]
        assert not fetch.complete and store.used_bytes == 0
        with pytest.raises(RamFull):
            await fetch.fill(persist(backend))
        (small_shm / "other-user").unlink()
        await fetch.fill(persist(backend))
        assert fetch.complete and fetch.verify()
        assert Path(os.fsdecode(fetch.path)).read_bytes() == data
    finally:
        fetch.discard()
        store.release()


class GatedReader(PersistentReader):
    """The persistent tier's read source, each request held until the test lets it go:
    which ranges were asked for, in what order, and how many are on their way at once."""

    def __init__(self, backend: FileBackend) -> None:
        super().__init__(backend, trio.CapacityLimiter(8))
        self.asked: list[tuple[str, int]] = []
        self.gates: dict[tuple[str, int], trio.Event] = {}
        self.in_flight = self.most_in_flight = 0

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        key = (entry.name, offset // mf.CHUNK_SIZE)
        self.asked.append(key)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.gates.setdefault(key, trio.Event()).wait()
            return await super().read_range(step_path, entry, offset, length)
        finally:
            self.in_flight -= 1

    def let_go(self, name: str, index: int) -> None:
        self.gates.setdefault((name, index), trio.Event()).set()


async def until(condition: object) -> None:
    with trio.fail_after(10):
        while not condition():  # type: ignore[operator]
            await trio.sleep(0.005)


async def test_fills_sharing_a_limiter_overlap_in_order_and_say_when_all_is_on_its_way(
        tmp_path: Path, ram: RamStore) -> None:
    """A step's read-ahead fills its files one after another over one limiter: each fill asks
    for its chunks in the file's order and says (`underway`) once its last chunk is on its
    way, before the file is whole, so that the next file starts while the last chunks of the
    one before come; the chunks in flight never exceed the limiter's, and both files come
    whole and verified."""
    first_data, second_data = os.urandom(3 * mf.CHUNK_SIZE), os.urandom(2 * mf.CHUNK_SIZE - 5)
    backend, first_remote = stored_file(tmp_path, first_data, "first")
    _backend, second_remote = stored_file(tmp_path, second_data, "second")
    source = GatedReader(backend)
    first, second = Fetch(ram, first_remote), Fetch(ram, second_remote)
    limiter = trio.CapacityLimiter(2)
    first_underway, second_underway = trio.Event(), trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: first.fill([source], limiter=limiter,
                                                  underway=first_underway))
            await until(lambda: len(source.asked) == 2)
            assert not first_underway.is_set()  # its third chunk waits for a place
            source.let_go("first", 0)
            await first_underway.wait()
            assert not first.complete  # the last chunks are still on their way
            nursery.start_soon(lambda: second.fill([source], limiter=limiter,
                                                   underway=second_underway))
            await trio.sleep(0.05)
            assert ("second", 0) not in source.asked  # the places are the first file's
            for name, index in [("first", 1), ("first", 2), ("second", 0), ("second", 1)]:
                source.let_go(name, index)
        assert second_underway.is_set()
        assert source.asked == [("first", 0), ("first", 1), ("first", 2), ("second", 0),
                                ("second", 1)]
        assert source.most_in_flight == 2
        assert first.complete and first.verify() and second.complete and second.verify()
        assert Path(os.fsdecode(first.path)).read_bytes() == first_data
        assert Path(os.fsdecode(second.path)).read_bytes() == second_data
    finally:
        first.discard()
        second.discard()


class OrderedReader(PersistentReader):
    """The persistent tier's read source, noting which file each range it is asked for is of,
    in the order asked."""

    def __init__(self, backend: FileBackend) -> None:
        super().__init__(backend, trio.CapacityLimiter(2))
        self.asked: list[str] = []

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        self.asked.append(entry.name)
        return await super().read_range(step_path, entry, offset, length)


async def test_a_read_ahead_gives_way_to_a_reader_waiting_for_another_file(
        tmp_path: Path, ram: RamStore) -> None:
    """A step's read-ahead fills its files over shared `Slots`; a reader's open waits for
    another file whole (a DCP load opens its files in its plan's order, not the listing's):
    while it waits, no chunk of the read-ahead starts, so the file waited for gets the
    bandwidth; then the read-ahead goes on, and both files come whole and verified."""
    ahead_data, opened_data = os.urandom(6 * mf.CHUNK_SIZE), os.urandom(4 * mf.CHUNK_SIZE)
    backend, ahead_remote = stored_file(tmp_path, ahead_data, "ahead")
    _, opened_remote = stored_file(tmp_path, opened_data, "opened")
    reader = OrderedReader(backend)
    ahead, opened = Fetch(ram, ahead_remote), Fetch(ram, opened_remote)
    slots = Slots(2)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(ahead.fill, [reader], limiter=slots))
            await wait_all_tasks_blocked()  # the read-ahead's first chunks on their way
            before = len(reader.asked)
            assert 2 <= before < 6 and set(reader.asked) == {"ahead"}
            with slots.urgent():
                await opened.fill([reader], 8)
                while_waiting = reader.asked[before:]
        assert while_waiting == ["opened"] * 4
        assert reader.asked[before + 4:] == ["ahead"] * (6 - before)
        for fetch, data in ((ahead, ahead_data), (opened, opened_data)):
            assert fetch.complete and fetch.verify()
            assert Path(os.fsdecode(fetch.path)).read_bytes() == data
    finally:
        ahead.discard()
        opened.discard()
