"""FUSE passthrough: file data moves between the kernel and the RAM store without the daemon,
and the kernel's rule that concurrent opens of a file agree on one backing file holds.

The proof that data bypasses the daemon is the daemon's own I/O counters (/proc/PID/io): with
passthrough, writing and reading 64 MiB moves a small fraction of that through the daemon;
with --no-passthrough, all of it.
"""

from __future__ import annotations

import errno
import gzip
import os
import threading

import pytest
import xxhash

from tests.conftest import Mount, MountFactory, getxattr, wait_until

pytestmark = pytest.mark.fuse

SIZE = 64 << 20


def kernel_has_passthrough() -> bool:
    """Linux 6.9+ built with CONFIG_FUSE_PASSTHROUGH (the config may not be readable: then
    the version decides)."""
    release = os.uname().release
    major, minor = (int(n) for n in release.split(".")[:2])
    for config in (f"/boot/config-{release}", "/proc/config.gz"):
        if os.path.exists(config):
            opener = gzip.open if config.endswith(".gz") else open
            with opener(config, "rt") as f:
                return "CONFIG_FUSE_PASSTHROUGH=y" in f.read()
    return (major, minor) >= (6, 9)


def daemon_io(mnt: Mount) -> tuple[int, int]:
    """Bytes the daemon has read and written through syscalls (rchar, wchar)."""
    with open(f"/proc/{mnt.status()['pid']}/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


@pytest.mark.parametrize("passthrough", [True, False], ids=["passthrough", "through-daemon"])
def test_file_data_bypasses_the_daemon_only_with_passthrough(mounts: MountFactory,
                                                             passthrough: bool) -> None:
    mnt = mounts.mount() if passthrough else mounts.mount("--no-passthrough")
    if passthrough and not mnt.status()["passthrough"] and not kernel_has_passthrough():
        pytest.skip("this kernel has no FUSE passthrough (Linux 6.9+, CONFIG_FUSE_PASSTHROUGH)")
    assert mnt.status()["passthrough"] is passthrough
    data = os.urandom(SIZE)
    (mnt / "step_1").mkdir()
    read_before, written_before = daemon_io(mnt)
    with open(mnt / "step_1/shard", "wb") as f:
        for at in range(0, SIZE, 4 << 20):
            f.write(data[at:at + (4 << 20)])
    (mnt / "step_1/.metadata").write_bytes(b"m")
    assert (mnt / "step_1/shard").read_bytes() == data
    read_after, written_after = daemon_io(mnt)
    # The seal hashes the file once (reads SIZE); the data path itself adds nothing.
    moved = (read_after - read_before - SIZE) + (written_after - written_before)
    if passthrough:
        assert moved < SIZE // 8, moved
    else:
        assert moved >= 2 * SIZE, moved  # received and stored, then read and sent
    assert getxattr(mnt / "step_1", "user.tierfs.state") == "committed"


def test_a_committed_file_step_is_read_back_without_the_daemon(mnt: Mount) -> None:
    """torch.save then torch.load of one file (a file step, as the bench's torch rows do): once
    committed, each read-only open passes through to the RAM store's file; no READ reaches
    the daemon, however often the file is opened again."""
    if not mnt.status()["passthrough"] and not kernel_has_passthrough():
        pytest.skip("this kernel has no FUSE passthrough (Linux 6.9+, CONFIG_FUSE_PASSTHROUGH)")
    data = os.urandom(SIZE)
    (mnt / "run").mkdir()
    with open(mnt / "run/model_7.pt", "wb") as f:
        f.write(data)
    wait_until(lambda: (mnt.step("run/model_7.pt") or {}).get("state") == "committed")
    read_before, written_before = daemon_io(mnt)
    for _ in range(3):
        with open(mnt / "run/model_7.pt", "rb") as f:
            assert f.read() == data
    read_after, written_after = daemon_io(mnt)
    moved = (read_after - read_before) + (written_after - written_before)
    assert moved < SIZE // 8, moved


def test_concurrent_readers_share_one_backing_file(mnt: Mount) -> None:
    data = os.urandom(8 << 20)
    (mnt / "step_1").mkdir()
    (mnt / "step_1/shard").write_bytes(data)
    (mnt / "step_1/.metadata").write_bytes(b"m")
    results: list[bytes] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            with open(mnt / "step_1/shard", "rb") as f:
                results.append(f.read())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    handles = [open(mnt / "step_1/shard", "rb") for _ in range(4)]  # noqa: SIM115
    try:
        threads = [threading.Thread(target=read) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [h.read() for h in handles] == [data] * 4
    finally:
        for handle in handles:
            handle.close()
    assert not errors and results == [data] * 8


def test_a_reader_sees_what_an_open_writer_wrote(mnt: Mount) -> None:
    with open(mnt / "f", "wb") as writer:
        writer.write(b"x" * 4096)
        writer.flush()
        with open(mnt / "f", "rb") as reader:
            assert reader.read() == b"x" * 4096
            writer.write(b"y" * 10)
            writer.flush()
            assert reader.read() == b"y" * 10


def test_writing_a_committed_file_that_is_being_read_is_refused_not_mixed(mnt: Mount) -> None:
    (mnt / "step_1").mkdir()
    (mnt / "step_1/shard").write_bytes(b"committed" * 1000)
    (mnt / "step_1/.metadata").write_bytes(b"m")
    with open(mnt / "step_1/shard", "rb") as reader:
        with pytest.raises(OSError) as info:
            open(mnt / "step_1/shard", "r+b")  # noqa: SIM115 - must fail
        assert info.value.errno == errno.ETXTBSY
        assert reader.read() == b"committed" * 1000
    with open(mnt / "step_1/shard", "r+b") as writer:  # once the reader has gone
        writer.write(b"new")
    assert (mnt / "step_1/shard").read_bytes()[:12] == b"newmitted" + b"com"
    assert getxattr(mnt / "step_1", "user.tierfs.state") == "writing"


def test_a_closed_files_seal_is_there_as_its_close_returns(mnt: Mount) -> None:
    """A small file closed through passthrough is sealed when its close() returns: its
    `user.tierfs.xxh3` at once, then a rename, a re-read, a listing and its step's commit."""
    step = mnt / "run" / "step_1"
    step.mkdir(parents=True)
    for i in range(200):
        data = os.urandom(100 + i)
        path = step / f"f{i:03}"
        with open(path, "wb") as f:
            f.write(data)
        assert getxattr(path, "user.tierfs.xxh3") == xxhash.xxh3_128_hexdigest(data)
        if i % 2:
            os.rename(path, step / f"g{i:03}")
            path = step / f"g{i:03}"
        with open(path, "rb") as f:
            assert f.read() == data
    assert len(os.listdir(step)) == 200
    (step / ".metadata").write_bytes(b"m")
    wait_until(lambda: getxattr(step, "user.tierfs.state") == "committed", timeout=10)
