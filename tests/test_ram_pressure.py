"""A full RAM tier never wedges the mount: copies that are safe elsewhere leave RAM before a
write is refused, a half-written step stays as it is and only its own bytes count, and sparse
files count what they store."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, getxattr, tierfs
from tests.test_commit_hashes_later import hold_hashes
from tests.test_crash import save

pytestmark = pytest.mark.fuse

MiB = 1 << 20


def shards(seed: int, *sizes: int) -> dict[str, bytes]:
    """A DCP-shaped step: one shard per size (random bytes), then `.metadata`."""
    files = {f"__{i}_0.distcp": os.urandom(size) for i, size in enumerate(sizes)}
    return files | {".metadata": b"meta%d" % seed}


def persisting_mount(mounts: MountFactory, tmp_path: Path, *extra: str) -> Mount:
    store = tmp_path / "store"
    store.mkdir()
    return mounts.mount("--persist", f"file://{store}", *extra)


def used(mnt: Mount) -> int:
    return mnt.status()["ram"]["used_bytes"]


def test_read_back_copies_leave_ram_before_a_save_is_refused(mounts: MountFactory,
                                                             tmp_path: Path) -> None:
    mnt = persisting_mount(mounts, tmp_path, "--ram-limit", "64M", "--keep-ram", "1")
    saved = {n: shards(n, 4 * MiB, 4 * MiB, 4 * MiB) for n in range(1, 7)}
    for number, files in saved.items():
        save(mnt / f"run/step_{number}", files)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert [s["ram"] for s in mnt.status()["steps"]] == [False] * 5 + [True]
    for number in range(1, 6):  # loads of old steps bring them back into RAM, up to the limit
        for name, data in saved[number].items():
            assert (mnt / f"run/step_{number}" / name).read_bytes() == data
    assert used(mnt) > 56 * MiB

    # the saves go on: read-back copies (safe in the store) leave RAM to make room
    for number in range(7, 10):
        saved[number] = shards(number, 4 * MiB, 4 * MiB, 4 * MiB)
        save(mnt / f"run/step_{number}", saved[number])
        assert getxattr(mnt / f"run/step_{number}", "user.tierfs.state") == "committed"
    assert "evicted run/step_1" in mnt.log()
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    for number, files in saved.items():  # every step reads back whole, from RAM or the store
        for name, data in files.items():
            assert (mnt / f"run/step_{number}" / name).read_bytes() == data


def test_a_save_waits_for_room_that_steps_on_their_way_to_the_store_give_back(
        mounts: MountFactory, tmp_path: Path) -> None:
    """A commit does not wait for its files' hashes, and nothing leaves the node before them:
    a save that finds RAM full of committed steps still to be hashed and uploaded waits for
    them to be persisted and to leave RAM, instead of failing with ENOSPC (it did, when the
    hashes lagged behind the saves: a flaky run of the test above)."""
    mnt = persisting_mount(mounts, tmp_path, "--ram-limit", "32M", "--keep-ram", "1")
    hold_hashes(mnt, True)  # as a busy machine would: no hash, so no upload, for now
    first = shards(1, 8 * MiB, 8 * MiB)
    save(mnt / "run/step_1", first)
    save(mnt / "run/step_2", shards(2, 8 * MiB, 4 * MiB))
    assert not any(step["persisted"] for step in mnt.status()["steps"])
    hashes_back = threading.Timer(1.0, hold_hashes, (mnt, False))
    hashes_back.start()
    try:
        save(mnt / "run/step_3", shards(3, 8 * MiB))
    finally:
        hashes_back.join()
    assert getxattr(mnt / "run/step_3", "user.tierfs.state") == "committed"
    for name, data in first.items():  # the step that left RAM reads back from the store
        assert (mnt / "run/step_1" / name).read_bytes() == data


def test_persisted_steps_within_keep_ram_yield_to_a_save_and_a_half_step_stays(
        mounts: MountFactory, tmp_path: Path) -> None:
    mnt = persisting_mount(mounts, tmp_path, "--ram-limit", "32M", "--keep-ram", "2")
    for number in (1, 2):
        save(mnt / f"run/step_{number}", shards(number, 4 * MiB, 4 * MiB))
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert all(s["ram"] and s["persisted"] for s in mnt.status()["steps"])

    # a save that needs more than is free: the persisted steps leave RAM for it (they were
    # kept only by --keep-ram), and the saves after it work too
    big = shards(3, 12 * MiB, 12 * MiB, 1 * MiB)
    save(mnt / "run/step_3", big)
    save(mnt / "run/step_4", shards(4, 2 * MiB))
    assert [s["state"] for s in mnt.status()["steps"]] == ["committed"] * 4
    assert (mnt / "run/step_1/__0_0.distcp").stat().st_size == 4 * MiB  # still listed
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")

    # a save larger than the whole tier fails (ENOSPC at the write or at the next open) and
    # leaves a half-written step: it stays `writing`, with what was written, and is named in
    # the log line of the refusal; nothing else holds the room it took
    half = mnt / "run/step_5"
    with pytest.raises(OSError) as refused:
        save(half, shards(5, 40 * MiB, 1 * MiB))
    assert refused.value.errno == errno.ENOSPC
    assert getxattr(half, "user.tierfs.state") == "writing"
    assert mnt.step("run/step_5")["state"] == "writing"
    assert "run/step_5" in [line for line in mnt.log().splitlines()
                            if "RAM tier full" in line][-1]
    assert all(not s["ram"] for s in mnt.status()["steps"] if s["state"] == "committed")
    # removing it frees its space at once: the next save works without a remount
    subprocess.run(["rm", "-r", str(half)], check=True)
    save(mnt / "run/step_6", shards(6, 4 * MiB))
    assert getxattr(mnt / "run/step_6", "user.tierfs.state") == "committed"


def test_sparse_files_count_what_they_store(mounts: MountFactory) -> None:
    mnt = mounts.mount("--ram-limit", "16M")
    sparse = mnt / "sparse"
    subprocess.run(["truncate", "-s", "5G", str(sparse)], check=True, capture_output=True)
    assert sparse.stat().st_size == 5 << 30
    with open(sparse, "r+b") as f:
        f.seek(3 << 30)
        f.write(b"x" * MiB)  # a write into a hole stores only its own pages
        os.ftruncate(f.fileno(), 6 << 30)
    assert used(mnt) <= 2 * MiB
    with open(sparse, "rb") as f:
        f.seek(3 << 30)
        assert f.read(MiB) == b"x" * MiB
    (mnt / "dense").write_bytes(os.urandom(8 * MiB))  # the room is still there
    assert 8 * MiB <= used(mnt) <= 10 * MiB
