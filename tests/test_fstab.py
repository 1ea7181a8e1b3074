"""Mounting like any file system: an /etc/fstab line and `mount -t fuse.tierfs` go through the
FUSE helper convention (tierfs.mount_helper.fuse_helper).

mount(8) runs /sbin/mount.fuse.tierfs with PATH removed from its environment, so the helper
cannot be found through the caller's PATH: the test links the `mount.fuse.tierfs` entry point
there for its duration, as an installation would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, pid_alive, tierfs, wait_until
from tierfs.mount_helper.cli import command_names
from tierfs.mount_helper.config import ConfigError
from tierfs.mount_helper.fuse_helper import is_helper_form, to_mount_argv
from tierfs.mount_helper.mounts import is_mounted

pytestmark = pytest.mark.fuse

HELPER_LINK = Path("/sbin/mount.fuse.tierfs")
WORKTREE = Path(__file__).resolve().parent.parent


@pytest.fixture
def helper_installed() -> Iterator[Path]:
    entry_point = Path(sys.executable).parent / "mount.fuse.tierfs"
    assert entry_point.exists(), f"{entry_point} is missing: `make install` makes it"
    if HELPER_LINK.is_symlink() and HELPER_LINK.resolve() == entry_point.resolve():
        yield HELPER_LINK  # already installed (by a run killed before its teardown)
        return
    if HELPER_LINK.exists() or HELPER_LINK.is_symlink():
        pytest.skip(f"{HELPER_LINK} is another program: not replaced by a test")
    HELPER_LINK.symlink_to(entry_point)
    try:
        yield HELPER_LINK
    finally:
        HELPER_LINK.unlink()


def _adopt(mounts: MountFactory, mountpoint: Path, ram_dir: Path, log_file: Path) -> Mount:
    """A mount made outside the factory, torn down by it all the same."""
    mnt = Mount(mountpoint, ram_dir, log_file)
    mounts.mounts.append(mnt)
    mounts.ram_dirs.append(ram_dir)
    mnt.pid = mnt.status()["pid"]
    return mnt


def test_an_fstab_line_mounts(helper_installed: Path, mounts: MountFactory,
                              tmp_path: Path) -> None:
    mountpoint, log_file = tmp_path / "ckpt", tmp_path / "tierfs.log"
    mountpoint.mkdir()
    ram_dir = mounts.new_ram_dir()
    fstab = tmp_path / "fstab"
    fstab.write_text(
        "# a test fstab\n"
        f"tierfs:{ram_dir} {mountpoint} fuse.tierfs defaults,noauto,_netdev,nosuid,nodev,"
        f"x-systemd.requires=network-online.target,log_file={log_file},keep-ram=2,"
        "no_passthrough,persist_every=1 0 0\n")
    env = {**os.environ, "PYTHONPATH": str(WORKTREE)}
    done = subprocess.run(["mount", "-T", str(fstab), str(mountpoint)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert is_mounted(mountpoint)
    mnt = _adopt(mounts, mountpoint, ram_dir, log_file)
    status = mnt.status()
    assert status["ram_dir"] == str(ram_dir) and status["passthrough"] is False
    (mnt / "run/step_1").mkdir(parents=True)
    (mnt / "run/step_1/w.bin").write_bytes(b"w" * 4096)
    tierfs("commit", str(mnt / "run/step_1"))
    tierfs("umount", str(mountpoint))
    assert not is_mounted(mountpoint)
    wait_until(lambda: not pid_alive(mnt.pid))


def test_mount_t_runs_tierfs_with_dash_o(mounts: MountFactory, tmp_path: Path) -> None:
    """What mount.fuse3 runs: `tierfs SOURCE DIR -o OPTIONS`."""
    mountpoint, log_file = tmp_path / "m", tmp_path / "t.log"
    mountpoint.mkdir()
    ram_dir = mounts.new_ram_dir()
    tierfs("none", str(mountpoint), "-o", f"rw,nosuid,nodev,ram_dir={ram_dir},"
           f"log-file={log_file},ram_limit=64M,dev,suid")
    mnt = _adopt(mounts, mountpoint, ram_dir, log_file)
    assert mnt.status()["ram"]["limit_bytes"] == 64 << 20
    bad = tierfs("none", str(tmp_path), "-o", "ram_dir=/dev/shm/x,colour=blue", check=False)
    assert bad.returncode == 1 and "unknown mount option -o colour" in bad.stderr


def test_helper_options_become_mount_arguments() -> None:
    argv = ["tierfs:/dev/shm/a", "/ckpt", "-o",
            r"rw,noauto,user,_netdev,x-mount.mkdir,cluster=etcd://h:1\,h:2/job,keep_ram=4,"
            "allow_other,insecure=0,no-passthrough=1", "-n", "-t", "fuse.tierfs"]
    assert is_helper_form(argv, command_names())
    assert to_mount_argv(argv) == ["mount", "/ckpt", "--cluster", "etcd://h:1,h:2/job",
                                   "--keep-ram", "4", "--allow-other", "--no-passthrough",
                                   "--ram-dir", "/dev/shm/a"]
    assert to_mount_argv(["none", "/c", "-oram_dir=/r"]) == ["mount", "/c", "--ram-dir", "/r"]
    assert not is_helper_form(["status", "/ckpt"], command_names())
    assert not is_helper_form(["mount", "/ckpt", "--foreground"], command_names())
    for options, message in (("ro", "read-only"), ("ram_dir", "needs a value"),
                             ("foreground=maybe", "is a flag"), ("nonsense=1", "unknown")):
        with pytest.raises(ConfigError, match=message):
            to_mount_argv(["none", "/c", "-o", options])
