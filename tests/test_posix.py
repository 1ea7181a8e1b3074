"""POSIX behaviour through a real mount: every operation a checkpoint writer or a shell uses,
with the errno of every refusal."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Mount


def expect_errno(code: int, func, *args) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OSError) as info:
        func(*args)
    assert info.value.errno == code, f"expected {errno.errorcode[code]}, got {info.value!r}"


def test_files_directories_and_their_errors(mnt: Mount) -> None:
    d = mnt / "a/b/c"
    d.mkdir(parents=True)
    expect_errno(errno.EEXIST, os.mkdir, d)
    expect_errno(errno.ENOENT, os.mkdir, mnt / "missing/x")
    f = d / "data.bin"
    f.write_bytes(b"x" * 1000)
    expect_errno(errno.ENOTDIR, os.mkdir, f / "sub")
    expect_errno(errno.ENOTEMPTY, os.rmdir, mnt / "a/b")
    expect_errno(errno.EISDIR, os.unlink, d)
    expect_errno(errno.ENOTDIR, os.rmdir, f)
    expect_errno(errno.EISDIR, open, d, "rb")
    expect_errno(errno.EEXIST, os.open, f, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    expect_errno(errno.ENOENT, os.stat, mnt / "nope")
    expect_errno(errno.ENAMETOOLONG, open, mnt / ("n" * 256), "wb")
    expect_errno(errno.EPERM, os.link, f, mnt / "hard")
    os.unlink(f)
    expect_errno(errno.ENOENT, os.unlink, f)
    os.rmdir(d)
    assert sorted(os.listdir(mnt / "a/b")) == []


def test_random_writes_reads_truncate_and_sparse(mnt: Mount) -> None:
    path = mnt / "random.bin"
    model = bytearray(300_000)
    with open(path, "wb+") as f:
        for offset, size in [(0, 1000), (250_000, 50_000), (4095, 70_000), (100, 3)]:
            chunk = os.urandom(size)
            f.seek(offset)
            f.write(chunk)
            model[offset:offset + size] = chunk
        f.flush()
        os.fsync(f.fileno())
        f.seek(4000)
        assert f.read(200) == bytes(model[4000:4200])
    assert path.read_bytes() == bytes(model)
    os.truncate(path, 5000)
    assert path.read_bytes() == bytes(model[:5000])
    with open(path, "r+b") as f:
        f.truncate(10_000)
    assert path.read_bytes() == bytes(model[:5000]) + bytes(5000)
    with open(path, "ab") as f:
        f.write(b"tail")
    assert path.read_bytes()[-4:] == b"tail" and path.stat().st_size == 10_004


def test_attributes_chmod_chown_utime(mnt: Mount) -> None:
    path = mnt / "attrs.txt"
    path.write_text("hello")
    os.chmod(path, 0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    os.chown(path, 1234, 5678)
    st = path.stat()
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.utime(path, ns=(1_000_000_000_000_000_000, 1_500_000_000_123_456_789))
    assert path.stat().st_mtime_ns == 1_500_000_000_123_456_789
    assert path.stat().st_nlink == 1 and path.stat().st_size == 5


def test_rename_is_atomic_and_replaces(mnt: Mount) -> None:
    (mnt / "old").write_bytes(b"old")
    (mnt / "new").write_bytes(b"new")
    os.rename(mnt / "new", mnt / "old")
    assert (mnt / "old").read_bytes() == b"new" and not (mnt / "new").exists()
    (mnt / "d1/sub").mkdir(parents=True)
    (mnt / "d1/sub/f").write_bytes(b"f")
    (mnt / "d2").mkdir()
    os.rename(mnt / "d1", mnt / "d2")  # replaces an empty directory
    assert (mnt / "d2/sub/f").read_bytes() == b"f"
    (mnt / "d3").mkdir()
    (mnt / "d3/x").write_bytes(b"")
    expect_errno(errno.ENOTEMPTY, os.rename, mnt / "d2", mnt / "d3")
    expect_errno(errno.ENOTDIR, os.rename, mnt / "d2", mnt / "old")
    expect_errno(errno.EISDIR, os.rename, mnt / "old", mnt / "d3")
    expect_errno(errno.EINVAL, os.rename, mnt / "d2", mnt / "d2/sub/inside")
    os.rename(mnt / "old", mnt / "d2/sub/moved")
    assert (mnt / "d2/sub/moved").read_bytes() == b"new"


def test_unlinked_file_stays_readable_through_open_handle(mnt: Mount) -> None:
    path = mnt / "gone.bin"
    data = os.urandom(100_000)
    path.write_bytes(data)
    with open(path, "rb") as f:
        os.unlink(path)
        assert not path.exists()
        assert f.read() == data
        assert os.fstat(f.fileno()).st_size == len(data)


def test_symlinks(mnt: Mount) -> None:
    (mnt / "target.txt").write_text("t")
    os.symlink("target.txt", mnt / "link")
    assert os.readlink(mnt / "link") == "target.txt"
    assert (mnt / "link").read_text() == "t"
    assert stat.S_ISLNK(os.lstat(mnt / "link").st_mode)
    os.unlink(mnt / "link")
    assert (mnt / "target.txt").exists()


def test_reserved_names_are_refused_and_hidden(mnt: Mount) -> None:
    expect_errno(errno.EPERM, open, mnt / ".tierfs-manifest", "wb")
    expect_errno(errno.ENOENT, os.stat, mnt / ".tierfs-manifest")


def test_shell_tools_ls_cp_du_df_mv_rm(mnt: Mount, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "deep/er").mkdir(parents=True)
    for i in range(20):
        (src / "deep/er" / f"f{i}").write_bytes(os.urandom(10_000 + i))
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)  # noqa: E731
    run("cp", "-r", str(src), str(mnt / "copy"))
    run("diff", "-r", str(src), str(mnt / "copy"))
    listing = run("ls", "-l", str(mnt / "copy/deep/er")).stdout
    assert "f19" in listing and "10019" in listing
    used_kib = int(run("du", "-sk", str(mnt / "copy")).stdout.split()[0])
    assert used_kib >= 200
    df = run("df", "-B1", str(mnt.mountpoint)).stdout.splitlines()[1].split()
    assert int(df[1]) > 0
    run("mv", str(mnt / "copy"), str(mnt / "moved"))
    run("diff", "-r", str(src), str(mnt / "moved"))
    run("rm", "-r", str(mnt / "moved"))
    assert os.listdir(mnt) == []


def test_statfs_reports_the_ram_tier(mounts) -> None:  # type: ignore[no-untyped-def]
    mnt = mounts.mount("--ram-limit", "64M")
    st = os.statvfs(mnt.mountpoint)
    assert st.f_blocks * st.f_frsize == 64 << 20
    (mnt / "f").write_bytes(b"x" * (8 << 20))
    st = os.statvfs(mnt.mountpoint)
    assert st.f_bfree * st.f_frsize == (64 - 8) << 20


def test_large_directory_of_2000_files(mnt: Mount) -> None:
    d = mnt / "many"
    d.mkdir()
    for i in range(2000):
        (d / f"shard_{i:05d}.bin").write_bytes(i.to_bytes(4, "little"))
    names = os.listdir(d)
    assert len(names) == 2000 and len(set(names)) == 2000
    assert (d / "shard_01999.bin").read_bytes() == (1999).to_bytes(4, "little")
    assert subprocess.run(["ls", "-l", str(d)], capture_output=True, text=True,
                          check=True).stdout.count("shard_") == 2000


def test_ram_limit_gives_enospc_and_keeps_committed_data(mounts) -> None:  # type: ignore[no-untyped-def]
    mnt = mounts.mount("--ram-limit", "16M")
    step = mnt / "step_1"
    step.mkdir()
    committed = os.urandom(4 << 20)
    (step / "shard").write_bytes(committed)
    (step / ".metadata").write_bytes(b"m")
    # Writes through the daemon are refused one by one; passthrough writes (which the daemon
    # does not see) are refused at the next open once the tier is full.
    with pytest.raises(OSError) as info:
        for i in range(32):
            with open(mnt / f"big{i}", "wb") as f:
                f.write(os.urandom(1 << 20))
    assert info.value.errno == errno.ENOSPC
    assert "RAM tier full" in mnt.log()
    for name in os.listdir(mnt.mountpoint):
        if name.startswith("big"):
            os.unlink(mnt / name)
    (mnt / "after").write_bytes(b"y" * (4 << 20))  # space is back once the file is gone
    assert (step / "shard").read_bytes() == committed
    assert mnt.step("step_1")["state"] == "committed"
