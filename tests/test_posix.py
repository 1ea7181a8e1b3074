"""POSIX behaviour through a real mount: every operation a checkpoint writer or a shell uses,
with the errno of every refusal."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import stat
import subprocess
import tempfile
import termios
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FuseRequestTrace, Mount, MountFactory, getxattr, tierfs

pytestmark = pytest.mark.fuse


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


def test_symlinks_and_special_files_are_replaced_by_rename(mnt: Mount) -> None:
    """`ln -sfn step_2 latest` (a new link under a temporary name renamed over the old one),
    `mv` of a symlink or a FIFO: a rename of what is neither a file nor a directory (the
    rename failed with EIO)."""
    run = mnt / "run"
    (run / "step_1").mkdir(parents=True)
    (run / "step_2").mkdir()
    for target in ("step_1", "step_2"):
        subprocess.run(["ln", "-sfn", target, run / "latest"], check=True)
        assert os.readlink(run / "latest") == target
    os.mkfifo(mnt / "pipe")  # (not into a step: a FIFO is no step's data, SEMANTICS.md)
    (mnt / "elsewhere").mkdir()
    os.rename(mnt / "pipe", mnt / "elsewhere" / "pipe")
    os.rename(run / "latest", run / "step_2" / "latest")
    assert stat.S_ISFIFO(os.lstat(mnt / "elsewhere" / "pipe").st_mode)
    assert os.readlink(run / "step_2" / "latest") == "step_2"
    assert sorted(os.listdir(run)) == ["step_1", "step_2"]


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


def both_data_paths(mounts: MountFactory, passthrough: bool) -> Mount:
    mnt = mounts.mount() if passthrough else mounts.mount("--no-passthrough")
    assert mnt.status()["passthrough"] is passthrough
    return mnt


DATA_PATHS = pytest.mark.parametrize("passthrough", [True, False],
                                     ids=["passthrough", "through-daemon"])


def test_lookup_of_a_name_over_255_bytes_is_enametoolong(mnt: Mount) -> None:
    long_name = mnt / ("n" * 256)
    expect_errno(errno.ENAMETOOLONG, os.stat, long_name)
    (mnt / "d").mkdir()
    expect_errno(errno.ENAMETOOLONG, os.lstat, mnt / "d" / ("x" * 300))
    expect_errno(errno.ENAMETOOLONG, open, long_name, "rb")
    (mnt / ("n" * 255)).write_bytes(b"ok")  # 255 is fine
    assert os.stat(mnt / ("n" * 255)).st_size == 2


@DATA_PATHS
def test_fstat_of_an_open_unlinked_file_shows_no_link(mounts: MountFactory,
                                                      passthrough: bool) -> None:
    mnt = both_data_paths(mounts, passthrough)
    step = mnt / "step_1"
    step.mkdir()
    (step / "shard").write_bytes(b"s" * 5000)
    (step / ".metadata").write_bytes(b"m")  # committed: the file shares its inode
    (mnt / "replaced").write_bytes(b"old")
    with open(step / "shard", "rb") as shard, open(mnt / "replaced", "rb") as replaced, \
            open(mnt / "scratch", "wb+") as scratch:
        scratch.write(b"x" * 100)
        scratch.flush()
        for f in (shard, replaced, scratch):
            assert os.fstat(f.fileno()).st_nlink == 1
        os.unlink(step / "shard")
        os.unlink(mnt / "scratch")
        (mnt / "new").write_bytes(b"new")
        os.rename(mnt / "new", mnt / "replaced")
        for f in (shard, replaced, scratch):
            st = os.fstat(f.fileno())
            assert st.st_nlink == 0, f.name
        assert os.fstat(shard.fileno()).st_size == 5000
        scratch.seek(0)
        assert scratch.read() == b"x" * 100
    assert os.stat(mnt / "replaced").st_nlink == 1


@DATA_PATHS
def test_attributes_change_through_an_open_unlinked_file(mounts: MountFactory,
                                                         passthrough: bool) -> None:
    """fchmod, fchown and futimens through a descriptor whose name was unlinked or replaced
    by a rename (a writer's temporary file, a file saved again under its name) act on the
    open file, as on tmpfs, and leave the name's new file alone."""
    mnt = both_data_paths(mounts, passthrough)
    step = mnt / "step_1"
    step.mkdir()
    (step / "replaced").write_bytes(b"old")
    with open(step / "scratch", "wb+") as scratch, open(step / "replaced", "rb+") as replaced:
        scratch.write(b"x" * 100)
        scratch.flush()
        os.unlink(step / "scratch")
        (step / "new").write_bytes(b"new")
        os.rename(step / "new", step / "replaced")
        for f in (scratch, replaced):
            os.fchmod(f.fileno(), 0o600)
            os.fchown(f.fileno(), 1234, 5678)
            os.utime(f.fileno(), ns=(1_000_000_000, 2_000_000_000))
            st = os.fstat(f.fileno())
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) \
                == (0o600, 1234, 5678, 2_000_000_000), f.name
    st = os.stat(step / "replaced")
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o644, 0)
    assert (step / "replaced").read_bytes() == b"new"
    assert sorted(os.listdir(step)) == ["replaced"]


def test_fstat_of_an_open_removed_directory_answers(mounts: MountFactory) -> None:
    """shutil.rmtree opens each directory and fstat's it outside its error handling: a
    directory removed in between (another process's rmtree of the same tree, or a delete
    learned from another node) must answer as on a local file system, with no link."""
    mnt = mounts.mount()
    (mnt / "old").mkdir(mode=0o750)
    fd = os.open(mnt / "old", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(mnt / "old")
        st = os.fstat(fd)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o750
        assert st.st_nlink == 0
        assert os.listdir(fd) == []
    finally:
        os.close(fd)
    assert not (mnt / "old").exists()


def exchange_through_fifo(path: Path) -> bytes:
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(path.read_bytes()))
    reader.start()
    path.write_bytes(b"through the pipe")
    reader.join(timeout=10)
    return received[0]


def exchange_through_socket(path: Path) -> bytes:
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as client:
        server.bind(str(path))
        server.listen(1)
        client.connect(str(path))
        conn, _ = server.accept()
        with conn:
            client.sendall(b"through the socket")
            return conn.recv(100)


def test_fifos_sockets_and_mknod(mounts: MountFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    run = mnt / "run"
    run.mkdir()
    os.mkfifo(run / "pipe", 0o640)
    assert stat.S_ISFIFO(os.stat(run / "pipe").st_mode)
    assert stat.S_IMODE(os.stat(run / "pipe").st_mode) == 0o640
    assert exchange_through_fifo(run / "pipe") == b"through the pipe"
    assert exchange_through_socket(run / "sock") == b"through the socket"
    assert stat.S_ISSOCK(os.stat(run / "sock").st_mode)
    os.mknod(mnt / "plain", 0o600 | stat.S_IFREG)  # mknod of a regular file: an empty file
    assert (mnt / "plain").read_bytes() == b"" and stat.S_ISREG(os.stat(mnt / "plain").st_mode)
    expect_errno(errno.EPERM, os.mknod, mnt / "dev", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    # Not step data: refused inside a step directory, created or moved there.
    step = run / "step_1"
    step.mkdir()
    expect_errno(errno.EPERM, os.mkfifo, step / "pipe")
    expect_errno(errno.EPERM, exchange_through_socket, step / "sock")
    expect_errno(errno.EPERM, os.rename, run / "pipe", step / "pipe")
    # ... and never in a commit's way: a directory that holds one becomes a step and commits.
    staging = run / "staging"
    staging.mkdir()
    os.mkfifo(staging / "pipe")
    (staging / "shard").write_bytes(b"data")
    (step / "shard").write_bytes(b"one")
    (step / ".metadata").write_bytes(b"m")
    os.rename(staging, run / "step_2")
    assert mnt.step("run/step_2")["state"] == "committed"
    assert mnt.step("run/step_2")["files"] == 1
    assert os.readlink(run / "latest") == "step_2"
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert sorted(os.listdir(store / "run/step_2")) == [".tierfs-manifest", "shard"]
    # A restart keeps them where they were, and the steps committed.
    tierfs("umount", str(mnt.mountpoint), "--flush")  # "plain" commits at the unmount
    mnt = mounts.remount(mnt)
    assert stat.S_ISFIFO(os.lstat(run / "pipe").st_mode)
    assert stat.S_ISFIFO(os.lstat(run / "step_2/pipe").st_mode)
    assert mnt.step("run/step_2")["state"] == "committed"
    assert (run / "step_2/shard").read_bytes() == b"data"
    assert exchange_through_fifo(run / "pipe") == b"through the pipe"
    subprocess.run(["rm", "-r", str(run)], check=True)
    assert os.listdir(mnt) == ["plain"]


@pytest.mark.parametrize("passthrough", [True, False], ids=["relay", "daemon"])
def test_ls_l_asks_for_labels_and_acls_once_not_once_per_file(mounts: MountFactory,
                                                              fuse_trace: FuseRequestTrace,
                                                              passthrough: bool) -> None:
    """GNU `ls -l` asks each entry for its `security.selinux` and `system.posix_acl_access`,
    and FUSE forwards both: two round trips per file, most of an `ls -l` of a many-file step.
    tierfs supports neither (only `user.` attributes), and says so (ENOTSUP, as setxattr of
    them does): `ls` then stops asking for that file system. Counted with the kernel's
    `fuse_request_send` tracepoint, for this `ls` only."""
    mnt = mounts.mount(*([] if passthrough else ["--no-passthrough"]))
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    for i in range(300):
        (step / f"t{i:03}").write_bytes(b"x")
    fuse_trace.start()
    try:
        ls = subprocess.Popen(["ls", "-l", str(step)], stdout=subprocess.PIPE, text=True)
        listing, _ = ls.communicate(timeout=60)
    finally:
        fuse_trace.stop()
    assert ls.returncode == 0 and len(listing.splitlines()) == 301  # "total", every file
    own = fuse_trace.requests(ls.pid)
    assert "FUSE_READDIRPLUS" in own  # its requests are in the trace
    assert own.count("FUSE_GETXATTR") <= 4, own[:20]


@pytest.mark.parametrize("passthrough", [True, False], ids=["relay", "daemon"])
def test_an_ioctl_on_a_file_is_not_a_tty(mounts: MountFactory, passthrough: bool) -> None:
    """Python's `open()` asks `isatty` of every file; the relay answers it (ENOTTY) as
    libfuse does without it."""
    mnt = mounts.mount(*([] if passthrough else ["--no-passthrough"]))
    (mnt / "f").write_bytes(b"x")
    with open(mnt / "f", "rb") as f:
        assert not os.isatty(f.fileno())
        expect_errno(errno.ENOTTY, fcntl.ioctl, f.fileno(), termios.TCGETS, bytes(64))
        assert f.read() == b"x"


def test_user_xattrs_on_files_and_directories(mounts: MountFactory, tmp_path: Path) -> None:
    mnt = mounts.mount()
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    shard = step / "shard"
    shard.write_bytes(b"s" * 1000)
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)  # noqa: E731
    run("setfattr", "-n", "user.foo", "-v", "bar", str(shard))
    run("setfattr", "-n", "user.dir", "-v", "d", str(step))
    assert run("getfattr", "--only-values", "-n", "user.foo", str(shard)).stdout == "bar"
    assert getxattr(step, "user.dir") == "d"
    assert {"user.foo", "user.tierfs.tiers"} <= set(os.listxattr(shard))
    expect_errno(errno.EEXIST, os.setxattr, shard, "user.foo", b"x", os.XATTR_CREATE)
    expect_errno(errno.ENODATA, os.setxattr, shard, "user.new", b"x", os.XATTR_REPLACE)
    expect_errno(errno.ENODATA, os.getxattr, shard, "user.missing")
    expect_errno(errno.EROFS, os.setxattr, shard, "user.tierfs.xxh3", b"0")
    os.removexattr(step, "user.tierfs.state")  # derived: removing it changes nothing
    assert getxattr(step, "user.tierfs.state") == "writing"
    expect_errno(errno.EROFS, os.removexattr, step, "user.tierfs.other")
    expect_errno(errno.ENOTSUP, os.setxattr, shard, "trusted.foo", b"x")
    for not_kept in ("security.selinux", "system.posix_acl_access", "trusted.foo"):
        expect_errno(errno.ENOTSUP, os.getxattr, shard, not_kept)
        expect_errno(errno.ENOTSUP, os.getxattr, step, not_kept)
    os.setxattr(shard, "user.gone", b"1")
    os.removexattr(shard, "user.gone")
    expect_errno(errno.ENODATA, os.removexattr, shard, "user.gone")
    # Not step data: a commit ignores them and they stay; a rewrite (copy on write) keeps them.
    (step / ".metadata").write_bytes(b"m")
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert getxattr(shard, "user.foo") == "bar"
    with open(shard, "ab") as f:
        f.write(b"more")
    assert getxattr(shard, "user.foo") == "bar"
    (step / ".metadata").write_bytes(b"m2")
    assert getxattr(step, "user.tierfs.state") == "committed"
    # cp --preserve=all into the mount (an unlinked file keeps its own, through its handle).
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload")
    os.setxattr(src, "user.origin", b"disk")
    run("cp", "--preserve=all", str(src), str(mnt / "copy.bin"))
    assert getxattr(mnt / "copy.bin", "user.origin") == "disk"
    with open(mnt / "copy.bin", "rb") as f:
        os.unlink(mnt / "copy.bin")
        os.setxattr(f.fileno(), "user.late", b"1")
        assert os.getxattr(f.fileno(), "user.origin") == b"disk"
    # Kept in this node's RAM tier across a restart.
    mnt.kill9()
    mnt = mounts.remount(mnt)
    assert getxattr(mnt / "run/step_1/shard", "user.foo") == "bar"
    assert getxattr(mnt / "run/step_1", "user.dir") == "d"
    assert getxattr(mnt / "run/step_1", "user.tierfs.state") == "committed"


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10


def fallocate(fd: int, length: int, offset: int = 0, mode: int = 0) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.fallocate(fd, mode, ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def test_fallocate_sizes_files_and_punches_holes_that_commit(mounts: MountFactory,
                                                              tmp_path: Path) -> None:
    """fallocate(2) through the relay, with the modes the RAM dir's tmpfs has: `fallocate -l`
    sizes a new file, a punched hole reads as zeros, `rsync --preallocate` copies a step in,
    and a committed file sized again is the step's next version. Before, every fallocate was
    EOPNOTSUPP (pyfuse3 has no handler): `fallocate` failed and rsync printed an error."""
    mnt = mounts.mount()
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    subprocess.run(["fallocate", "-l", "1M", str(step / "reserved.bin")], check=True)
    assert (step / "reserved.bin").read_bytes() == bytes(1 << 20)
    data = os.urandom(1 << 16)
    (step / "shard.bin").write_bytes(data)
    fd = os.open(step / "shard.bin", os.O_RDWR)
    try:
        fallocate(fd, 4096, offset=8192, mode=FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)
        expect_errno(errno.EOPNOTSUPP, fallocate, fd, 4096, 0, FALLOC_FL_ZERO_RANGE)  # tmpfs
    finally:
        os.close(fd)
    punched = data[:8192] + bytes(4096) + data[12288:]
    assert (step / "shard.bin").read_bytes() == punched
    source = tmp_path / "step_2"
    source.mkdir()
    (source / "model.bin").write_bytes(data)
    copy = subprocess.run(["rsync", "-a", "--preallocate", str(source), str(mnt / "run")],
                          capture_output=True, text=True)
    assert copy.returncode == 0 and copy.stderr == "", copy.stderr
    assert (mnt / "run/step_2/model.bin").read_bytes() == data
    tierfs("commit", str(step))
    tierfs("commit", str(mnt / "run/step_2"))
    assert mnt.step("run/step_1")["files"] == 2
    version = mnt.step("run/step_2")["version"]
    subprocess.run(["fallocate", "-l", "128K", str(mnt / "run/step_2/model.bin")], check=True)
    tierfs("commit", str(mnt / "run/step_2"))
    assert mnt.step("run/step_2")["version"] == version + 1
    assert (mnt / "run/step_2/model.bin").read_bytes() == data + bytes(1 << 16)
    mnt.kill9()  # the RAM tier kept what was committed
    again = mounts.remount(mnt)
    assert (again / "run/step_1/shard.bin").read_bytes() == punched
    assert (again / "run/step_2/model.bin").read_bytes() == data + bytes(1 << 16)


@DATA_PATHS
def test_fallocate_and_seek_hole_data(mounts: MountFactory, passthrough: bool) -> None:
    """What doc/SEMANTICS.md promises: fallocate(2) works with passthrough (the relay answers
    it) and is EOPNOTSUPP without (pyfuse3 has no handler); glibc's posix_fallocate falls
    back to writing; SEEK_DATA/SEEK_HOLE see the whole file as data."""
    mnt = both_data_paths(mounts, passthrough)
    fd = os.open(mnt / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if passthrough:
            fallocate(fd, 50_000)
            assert os.fstat(fd).st_size == 50_000
        else:
            expect_errno(errno.EOPNOTSUPP, fallocate, fd, 1 << 20)
        os.posix_fallocate(fd, 0, 100_000)
        assert os.fstat(fd).st_size == 100_000
        os.pwrite(fd, b"end", (1 << 20) - 3)  # a file with a hole in the middle
        assert os.lseek(fd, 0, os.SEEK_DATA) == 0
        assert os.lseek(fd, 200_000, os.SEEK_DATA) == 200_000
        assert os.lseek(fd, 0, os.SEEK_HOLE) == 1 << 20
        expect_errno(errno.ENXIO, os.lseek, fd, 1 << 20, os.SEEK_DATA)
    finally:
        os.close(fd)
    assert (mnt / "f").read_bytes()[-3:] == b"end"


@pytest.fixture
def short_mountpoint() -> Iterator[Path]:
    """A mountpoint with a path shorter than the RAM dir's."""
    path = Path(tempfile.mkdtemp(prefix="m", dir="/tmp"))
    try:
        yield path
    finally:
        path.rmdir()


def test_paths_close_to_path_max_and_deeper(short_mountpoint: Path,
                                            mounts: MountFactory) -> None:
    """The daemon reaches the RAM store's files by paths that are longer than the user's (the
    RAM dir comes first), and a tree can be deeper than PATH_MAX when reached by relative paths:
    neither may fail, also across a commit and a restart."""
    mnt = mounts.mount(mountpoint=short_mountpoint)
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    deep = step
    while len(os.fsencode(deep)) < 4095 - 256:  # leaves room for a name of at most 255
        deep = deep / ("d" * 200)
    deep.mkdir(parents=True)
    name = "f" * (4095 - len(os.fsencode(deep)) - 1)
    assert len(os.fsencode(deep / name)) == 4095  # PATH_MAX, less the terminating NUL
    (deep / name).write_bytes(b"near PATH_MAX")
    old_cwd = os.getcwd()
    os.chdir(deep)
    try:  # deeper than PATH_MAX from the mount's root, reached relative to a directory
        Path("e" * 250, "g" * 250).mkdir(parents=True)
        Path("e" * 250, "g" * 250, "beyond").write_bytes(b"beyond PATH_MAX")
    finally:
        os.chdir(old_cwd)
    tierfs("commit", str(step))
    assert mnt.step("run/step_1")["files"] == 2
    tierfs("umount", str(mnt.mountpoint))
    mnt = mounts.remount(mnt)
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert (deep / name).read_bytes() == b"near PATH_MAX"
    os.chdir(deep)
    try:
        assert Path("e" * 250, "g" * 250, "beyond").read_bytes() == b"beyond PATH_MAX"
    finally:
        os.chdir(old_cwd)
    tierfs("verify", str(step), "--no-repair")
