"""Fetching a committed file back from another tier, in one process: tierfs.fs.fetch with a real
RAM store in tmp and the persistent tier's read source over a file:// store, no mount. A failure
here is in the fetch layer (chunk checks, partial file, whole-file check), not in FUSE."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from tierfs import manifest as mf
from tierfs.fs.fetch import Fetch, FetchError, RemoteFile, fetch_chunk
from tierfs.fs.ram_store import RamFull, RamStore
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


def stored_file(tmp_path: Path, data: bytes, name: str = "shard") -> tuple[FileBackend,
                                                                           RemoteFile]:
    """A committed file that is only in the persistent tier."""
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    backend = FileBackend(root)
    backend.claim()
    backend.put_bytes(f"{STEP}/{name}", data)
    digest = mf.hash_file(root / STEP / name)
    entry = mf.FileEntry(name, digest.size, digest.xxh3, mode=0o640, chunks=digest.chunks)
    return backend, RemoteFile(STEP, entry)


def persist(backend: FileBackend) -> list[PersistentReader]:
    return [PersistentReader(backend, trio.CapacityLimiter(2))]


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
        for index in (3, 1, 2, 0):  # a reader jumping about, read-ahead off (in_flight)
            await fetch._ensure(persist(backend), index)
        assert fetch.complete and fetch.verify()
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
