"""A non-resident file opened for reading with passthrough on: fetched whole into RAM before
the open returns (each chunk and the whole verified), then read by passthrough from the RAM
store, so its bytes never cross the daemon. Without room, or with a chunk that no tier has
intact, it is read range by range through the daemon as before (the bad range is EIO)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, getxattr, tierfs, wait_until
from tests.test_crash import save
from tests.test_passthrough import daemon_io, kernel_has_passthrough
from tierfs import manifest as mf

pytestmark = pytest.mark.fuse

SIZE = 2 * mf.CHUNK_SIZE + 12345  # three chunks, the last one short


def fresh_node(mounts: MountFactory, tmp_path: Path, data: bytes, *extra: str,
               corrupt_at: int | None = None) -> Mount:
    """A new node (empty RAM dir) on a file:// store that holds run/step_1/big.bin = data,
    with one byte flipped in the stored copy at `corrupt_at` if given."""
    store = tmp_path / "store"
    store.mkdir()
    first = mounts.mount("--persist", f"file://{store}")
    save(first / "run/step_1", {"big.bin": data, ".metadata": b"m"})
    tierfs("flush", str(first.mountpoint), "--timeout", "60")
    tierfs("umount", str(first.mountpoint))
    if corrupt_at is not None:
        shard = store / "run/step_1/big.bin"
        stored = bytearray(shard.read_bytes())
        stored[corrupt_at] ^= 0xFF
        shard.write_bytes(bytes(stored))
    fresh = mounts.mount("--persist", f"file://{store}", *extra)
    if not fresh.status()["passthrough"]:
        if kernel_has_passthrough():
            raise AssertionError("passthrough is off on a kernel that has it")
        pytest.skip("this kernel has no FUSE passthrough (Linux 6.9+, CONFIG_FUSE_PASSTHROUGH)")
    assert getxattr(fresh / "run/step_1/big.bin", "user.tierfs.tiers") == "persist"
    return fresh


def test_opened_for_reading_it_comes_in_whole_and_is_read_by_passthrough(
        mounts: MountFactory, tmp_path: Path) -> None:
    data = os.urandom(SIZE)
    mnt = fresh_node(mounts, tmp_path, data)
    path = mnt / "run/step_1/big.bin"
    with open(path, "rb") as f:
        assert getxattr(path, "user.tierfs.tiers") == "ram,persist"  # whole, before a read
        read_before, written_before = daemon_io(mnt)
        assert f.read() == data
        read_after, written_after = daemon_io(mnt)
    assert (read_after - read_before) + (written_after - written_before) < SIZE // 10
    assert mnt.log().count("run/step_1/big.bin is back in RAM") == 1


def test_concurrent_opens_share_one_fetch(mounts: MountFactory, tmp_path: Path) -> None:
    data = os.urandom(SIZE)
    mnt = fresh_node(mounts, tmp_path, data)
    got: list[bytes] = []
    readers = [threading.Thread(target=lambda: got.append(
        (mnt / "run/step_1/big.bin").read_bytes())) for _ in range(4)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=60)
    assert got == [data] * 4
    assert mnt.log().count("run/step_1/big.bin is back in RAM") == 1
    assert getxattr(mnt / "run/step_1/big.bin", "user.tierfs.tiers") == "ram,persist"


def test_a_corrupt_chunk_is_eio_and_the_good_ones_still_read(mounts: MountFactory,
                                                             tmp_path: Path) -> None:
    data = os.urandom(SIZE)
    mnt = fresh_node(mounts, tmp_path, data, corrupt_at=mf.CHUNK_SIZE + 5)
    path = mnt / "run/step_1/big.bin"
    with open(path, "rb") as f:  # the open falls back to reads through the daemon
        assert f.read(1 << 20) == data[:1 << 20]
        f.seek(mf.CHUNK_SIZE)
        with pytest.raises(OSError) as failed:
            f.read(1000)
        assert failed.value.errno == errno.EIO
        f.seek(2 * mf.CHUNK_SIZE)
        assert f.read() == data[2 * mf.CHUNK_SIZE:]
    assert "does not match its checksum" in mnt.log()
    assert getxattr(path, "user.tierfs.tiers") == "persist"


def test_without_room_for_the_whole_file_it_is_read_range_by_range(mounts: MountFactory,
                                                                   tmp_path: Path) -> None:
    data = os.urandom(SIZE)
    mnt = fresh_node(mounts, tmp_path, data, "--ram-limit", f"{mf.CHUNK_SIZE * 2 >> 20}M")
    path = mnt / "run/step_1/big.bin"
    with open(path, "rb") as f:
        assert getxattr(path, "user.tierfs.tiers") == "persist"
        assert f.read() == data
    assert getxattr(path, "user.tierfs.tiers") == "persist"


def fresh_node_with_step(mounts: MountFactory, tmp_path: Path,
                         files: dict[str, bytes]) -> Mount:
    """A new node (empty RAM dir) on a file:// store that holds run/step_1 = `files`."""
    store = tmp_path / "store"
    store.mkdir()
    first = mounts.mount("--persist", f"file://{store}")
    save(first / "run/step_1", files)
    tierfs("flush", str(first.mountpoint), "--timeout", "60")
    tierfs("umount", str(first.mountpoint))
    fresh = mounts.mount("--persist", f"file://{store}")
    if not fresh.status()["passthrough"]:
        pytest.skip("this kernel has no FUSE passthrough (Linux 6.9+, CONFIG_FUSE_PASSTHROUGH)")
    return fresh


def test_a_load_brings_the_next_shards_while_it_reads_one(mounts: MountFactory,
                                                         tmp_path: Path) -> None:
    """A DCP load (its `.metadata` opened, then a shard): the step's other large files (one
    writer) come into RAM in the background, verified, before the loader opens them; a shard
    opened without a load (no `.metadata` first) brings nothing else."""
    shards = {f"__0_{i}.distcp": os.urandom(2 * mf.BLOCK_SIZE + i) for i in range(3)}
    mnt = fresh_node_with_step(mounts, tmp_path, {**shards, ".metadata": b"m"})
    step = mnt / "run/step_1"
    assert (step / "__0_2.distcp").read_bytes() == shards["__0_2.distcp"]  # not a load
    assert getxattr(step / "__0_0.distcp", "user.tierfs.tiers") == "persist"
    assert (step / ".metadata").read_bytes() == b"m"  # a load starts
    with open(step / "__0_0.distcp", "rb") as f:
        assert f.read() == shards["__0_0.distcp"]
    wait_until(lambda: getxattr(step / "__0_1.distcp", "user.tierfs.tiers") == "ram,persist")
    assert mnt.log().count("run/step_1/__0_1.distcp is back in RAM (") == 1
    assert (step / "__0_1.distcp").read_bytes() == shards["__0_1.distcp"]
