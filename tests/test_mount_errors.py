"""What a user meets when something around the mount is wrong: a stopped or killed daemon, a
busy, non-empty or symlinked mountpoint, a peer port in use, a closed pipe, a path they may not
read; and the modes of everything tierfs creates outside the mount."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import TIERFS, Mount, MountFactory, fill, pid_alive, tierfs, wait_until
from tests.test_cli import assert_one_line_error
from tests.test_commit import write_step
from tierfs.mount_helper.mounts import PATIENCE, is_mounted, mount_table

pytestmark = pytest.mark.fuse


def last_line_error(done: subprocess.CompletedProcess[str], text: str) -> None:
    """A failed mount: warnings may come first, then exactly one error line, no traceback."""
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert text in lines[-1], done.stderr
    assert all(line.startswith("tierfs: warning:") for line in lines[:-1]), done.stderr
    assert "Traceback" not in done.stderr


def processes_naming(word: str) -> list[int]:
    """Pids whose command line holds `word`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if word.encode() in f.read().split(b"\0"):
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def refused_mount(mounts: MountFactory, mountpoint: Path, *extra: str,
                  ) -> subprocess.CompletedProcess[str]:
    """`tierfs mount` that should fail; if it mounts after all, it is torn down with the rest."""
    ram_dir = mounts.new_ram_dir()
    done = tierfs("mount", str(mountpoint), "--ram-dir", str(ram_dir), *extra, check=False)
    if done.returncode != 0:
        # Gone by the time the command returns: a refused daemon still exiting may hold the
        # mountpoint busy (its probe of a mount that does not answer), so an umount right
        # after failed with EBUSY.
        assert not processes_naming(str(ram_dir)), "the refused daemon outlived `tierfs mount`"
    if done.returncode == 0:
        made = Mount(Path(os.path.realpath(mountpoint)), ram_dir, ram_dir / "tierfs.log")
        mounts.mounts.append(made)
        made.pid = made.status()["pid"]
    return done


def test_stopped_daemon_status_mount_and_umount_answer_at_once(mounts: MountFactory) -> None:
    mnt = mounts.mount()
    os.kill(mnt.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        done = tierfs("status", str(mnt.mountpoint), check=False, timeout=30)
        assert_one_line_error(done, f"its daemon (pid {mnt.pid}) is stopped: "
                                    f"`kill -CONT {mnt.pid}` resumes it")
        assert time.monotonic() - started < 8
        started = time.monotonic()
        done = refused_mount(mounts, mnt.mountpoint)
        last_line_error(done, f"mountpoint {mnt.mountpoint} is busy: the fuse.tierfs mount there "
                              f"does not answer (its daemon (pid {mnt.pid}) is stopped")
        # Refused from /proc, without a probe of the mount (which would wait PATIENCE s, then
        # hold the mount busy until the refused daemon had exited: the umount below failed)
        assert time.monotonic() - started < PATIENCE
        started = time.monotonic()
        done = tierfs("umount", str(mnt.mountpoint), check=False, timeout=30)
        assert_one_line_error(done, f"unmounted {mnt.mountpoint}, but its daemon (pid "
                                    f"{mnt.pid}) is stopped")
        assert time.monotonic() - started < 8
        assert not is_mounted(mnt.mountpoint)
    finally:
        os.kill(mnt.pid, signal.SIGCONT)
    wait_until(lambda: not pid_alive(mnt.pid), timeout=30)  # resumed, it finds itself unmounted


def test_mount_over_the_dead_mount_of_a_killed_daemon_recovers_it(mounts: MountFactory) -> None:
    mnt = mounts.mount()
    write_step(mnt / "run/step_1", {"shard": b"kept"})
    os.kill(mnt.pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(mnt.pid))
    assert is_mounted(mnt.mountpoint)  # nobody lazy-unmounted it: every access is ENOTCONN
    done = tierfs("status", str(mnt.mountpoint), check=False)
    assert_one_line_error(done, f"the tierfs mount {mnt.mountpoint} is dead (its daemon is "
                                f"gone): `tierfs umount {mnt.mountpoint}` removes the dead mount")

    again = mounts.remount(mnt)
    assert f"removed the dead tierfs mount at {mnt.mountpoint}" in again.log()
    assert (again / "run/step_1/shard").read_bytes() == b"kept"
    assert sum(e.mountpoint == str(mnt.mountpoint) for e in mount_table()) == 1  # not stacked

    os.kill(again.pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(again.pid))
    done = tierfs("umount", str(mnt.mountpoint))
    assert "removed the dead mount" in done.stderr
    assert not is_mounted(mnt.mountpoint)


def test_mountpoint_must_be_empty_unless_allowed(mounts: MountFactory, tmp_path: Path) -> None:
    mountpoint = tmp_path / "full"
    mountpoint.mkdir()
    (mountpoint / "data.txt").write_text("hidden by a mount")
    done = refused_mount(mounts, mountpoint)
    last_line_error(done, f"mountpoint {mountpoint} is not empty")
    assert "--allow-non-empty" in done.stderr and not is_mounted(mountpoint)
    mnt = mounts.mount("--allow-non-empty", mountpoint=mountpoint)
    assert os.listdir(mnt.mountpoint) == []


def test_a_mountpoint_that_is_a_mount_itself_is_mounted_over(mounts: MountFactory,
                                                            tmp_path: Path) -> None:
    """A container's volume is a bind mount (the DaemonSet's hostPath /checkpoints): tierfs
    mounts over it as over any directory (it was refused as busy); what is in it is what
    counts, as for a directory."""
    mountpoint = tmp_path / "volume"
    mountpoint.mkdir()
    subprocess.run(["mount", "--bind", str(mountpoint), str(mountpoint)], check=True)
    try:
        mnt = mounts.mount(mountpoint=mountpoint)
        stacked = [e.fstype for e in mount_table() if e.mountpoint == str(mountpoint)]
        assert stacked[-1] == "fuse.tierfs" and len(stacked) == 2, stacked
        (mnt / "run").mkdir()
        assert os.listdir(mnt.mountpoint) == ["run"]
        tierfs("umount", str(mountpoint))
        assert [e.fstype for e in mount_table() if e.mountpoint == str(mountpoint)] == \
            stacked[:1]
        (mountpoint / "data.txt").write_text("hidden by a mount")
        done = refused_mount(mounts, mountpoint)
        last_line_error(done, f"mountpoint {mountpoint} is not empty")
    finally:
        for _ in [e for e in mount_table() if e.mountpoint == str(mountpoint)]:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


def test_mount_through_a_symlink_to_a_mount_is_refused(mounts: MountFactory,
                                                       tmp_path: Path) -> None:
    mnt = mounts.mount()
    link = tmp_path / "link"
    link.symlink_to(mnt.mountpoint)
    done = refused_mount(mounts, link)
    last_line_error(done, f"mountpoint {mnt.mountpoint} is busy: tierfs is already mounted "
                          f"there (daemon pid {mnt.pid}")
    assert sum(e.mountpoint == str(mnt.mountpoint) for e in mount_table()) == 1


def test_peer_port_in_use_or_unknown_host_is_one_line(mounts: MountFactory,
                                                      tmp_path: Path) -> None:
    mountpoint = tmp_path / "mp"
    mountpoint.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for me, reason in ((f"127.0.0.1:{port}", "Address already in use"),
                           ("no-such-host.invalid:7070", "cannot listen for peers on "
                                                         "no-such-host.invalid:7070")):
            done = refused_mount(mounts, mountpoint, "--node-id", "a", "--cluster",
                                 "etcd://127.0.0.1:9/unused", "--listen", me, "--insecure")
            last_line_error(done, reason)
            assert "nursery" not in done.stderr
            assert not is_mounted(mountpoint)


def test_status_into_a_closed_pipe_is_quiet(mnt: Mount) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `tierfs status | head -0`: the reader is gone before the table
    try:
        done = subprocess.run([*TIERFS, "status", str(mnt.mountpoint)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 141


def test_a_path_the_user_may_not_read_is_not_called_missing(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    (locked / "inside").mkdir(parents=True)
    locked.chmod(0)
    # root without the capabilities that bypass file modes, so the mode stands in its way
    no_override = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                   "--inh-caps", "-all"]
    try:
        done = subprocess.run([*no_override, *TIERFS, "status", str(locked / "inside")],
                              capture_output=True, text=True, timeout=60)
    finally:
        locked.chmod(0o700)
    assert_one_line_error(done, f"{locked / 'inside'}: permission denied")
    assert_one_line_error(tierfs("status", str(tmp_path / "missing"), check=False),
                          "no such file or directory")


def _group_or_other_writable(root: Path, users_file: str) -> list[str]:
    """Entries under `root` that group or others may write, except the user's file named
    `users_file` (and its hard links: committed objects share the user's inode)."""
    stats = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(dirpath, name)
            with contextlib.suppress(FileNotFoundError):  # a temporary file renamed meanwhile
                stats[path] = path.lstat()
    users = {st.st_ino for path, st in stats.items() if path.name == users_file}
    return [f"{path.relative_to(root)} {st.st_mode & 0o777:o}" for path, st in stats.items()
            if st.st_ino not in users and not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022]


def test_nothing_tierfs_creates_is_writable_by_others(mounts: MountFactory,
                                                      tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    assert stat.S_IMODE(os.stat(mnt.mountpoint).st_mode) == 0o755
    (mnt / "run/step_1/sub").mkdir(parents=True)
    (mnt / "run/step_1/sub/nested").write_bytes(b"nested")
    long_name = "n" * 250  # with a suffix added, a temporary name would pass NAME_MAX
    old_umask = os.umask(0)
    try:  # a mode a user asks for is theirs to ask, inside the mount
        os.close(os.open(mnt / "run/step_1/shared", os.O_CREAT | os.O_WRONLY, 0o666))
    finally:
        os.umask(old_umask)
    write_step(mnt / "run/step_1", {long_name: b"long", "shard": os.urandom(1 << 20)})
    tierfs("flush", str(mnt.mountpoint), "--timeout", "30")
    assert (store / "run/step_1" / long_name).read_bytes() == b"long"
    assert stat.S_IMODE(os.stat(mnt / "run/step_1/shared").st_mode) == 0o666
    assert _group_or_other_writable(store, "shared") == []
    assert _group_or_other_writable(mnt.ram_dir, "shared") == []

    fresh = mounts.mount("--persist", f"file://{store}")  # reads the step back from the store
    assert (fresh / "run/step_1/sub/nested").read_bytes() == b"nested"
    assert _group_or_other_writable(fresh.ram_dir, "shared") == []


def test_a_log_file_that_was_there_becomes_the_daemon_s_own(mounts: MountFactory) -> None:
    """An existing --log-file becomes the daemon's own, mode 0600 like its other files, its
    older lines kept; a device given as the log is left as it is."""
    log_file = mounts.tmp_path / f"tierfs{len(mounts.mounts)}.log"  # the one mount() gives
    log_file.write_text("an older log\n")
    log_file.chmod(0o644)
    mnt = mounts.mount()
    assert mnt.log_file == log_file and mnt.log().startswith("an older log\n")
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
    null_mode = os.stat("/dev/null").st_mode
    mounts.mount("--log-file", "/dev/null")
    assert os.stat("/dev/null").st_mode == null_mode


def test_a_ram_dir_whose_file_system_is_full_is_one_line(small_shm: Path,
                                                         mounts: MountFactory) -> None:
    """A /dev/shm that other processes filled: the mount fails with one line that says so
    (before: 'the daemon exited with status 1', and a traceback)."""
    fill(small_shm / "other-user")
    mountpoint = mounts.tmp_path / "mnt"
    mountpoint.mkdir()
    done = tierfs("mount", str(mountpoint), "--ram-dir", str(small_shm / "ram"), check=False)
    last_line_error(done, "No space left on device")
    assert str(small_shm / "ram") in done.stderr
