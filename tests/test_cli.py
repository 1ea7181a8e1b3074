"""The command line as a user meets it: one-line errors, the status table, umount, --help."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, tierfs
from tests.test_commit import write_step
from tierfs.mount_helper.mounts import is_mounted

pytestmark = pytest.mark.fuse


def assert_one_line_error(done, text: str) -> None:  # type: ignore[no-untyped-def]
    assert done.returncode != 0
    assert text in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_mount_refusals(mounts: MountFactory, tmp_path: Path) -> None:
    ram = str(mounts.new_ram_dir())
    assert_one_line_error(tierfs("mount", str(tmp_path / "nope"), "--ram-dir", ram, check=False),
                          "does not exist")
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert_one_line_error(tierfs("mount", str(a_file), "--ram-dir", ram, check=False),
                          "is not a directory")
    (tmp_path / "mp").mkdir()
    assert_one_line_error(tierfs("mount", str(tmp_path / "mp"), "--ram-dir", str(a_file / "x"),
                                 check=False), "is not writable")
    assert_one_line_error(tierfs("mount", str(tmp_path / "mp"), "--ram-dir", ram,
                                 "--ram-limit", "lots", check=False), "not a size")
    mnt = mounts.mount()
    assert_one_line_error(tierfs("mount", str(mnt.mountpoint), "--ram-dir",
                                 str(mounts.new_ram_dir()), check=False), "is busy")


def test_ram_dir_off_tmpfs_is_a_warning(mounts: MountFactory, tmp_path: Path) -> None:
    ram_dir = tmp_path / "disk-ram"
    mounts.ram_dirs.append(ram_dir)
    mountpoint = tmp_path / "mp"
    mountpoint.mkdir()
    done = tierfs("mount", str(mountpoint), "--ram-dir", str(ram_dir))
    assert "warning:" in done.stderr and "not tmpfs" in done.stderr
    mounts.mounts.append(Mount(mountpoint, ram_dir, ram_dir / "tierfs.log"))
    mounts.mounts[-1].pid = mounts.mounts[-1].status()["pid"]
    assert oct(ram_dir.stat().st_mode & 0o777) == "0o700"


def test_a_ram_limit_above_the_ram_dir_or_the_memory_is_a_warning(mounts: MountFactory,
                                                                   small_shm: Path) -> None:
    """A --ram-limit the RAM dir or the host cannot hold (64M on a small tmpfs, 999999T):
    the mount goes on (a small RAM dir may be meant), with one line saying the limit cannot
    hold."""
    said = []
    for number, (ram_dir, limit) in enumerate([(small_shm / "ram", "64M"),
                                               (mounts.new_ram_dir(), "999999T")]):
        mountpoint = mounts.tmp_path / f"limit{number}"
        mountpoint.mkdir()
        done = tierfs("mount", str(mountpoint), "--ram-dir", str(ram_dir), "--ram-limit", limit)
        mounts.mounts.append(Mount(mountpoint, ram_dir, ram_dir / "tierfs.log"))
        mounts.ram_dirs.append(ram_dir)
        mounts.mounts[-1].pid = mounts.mounts[-1].status()["pid"]
        warnings = [line for line in done.stderr.splitlines() if "--ram-limit" in line]
        assert len(warnings) == 1, done.stderr
        said.append(warnings[0])
    assert said[0] == (f"tierfs: warning: --ram-limit 64.0 MiB is more than the RAM dir's file "
                       f"system (4.0 MiB at {small_shm / 'ram'}): the RAM tier never reaches "
                       "it (writes fail with ENOSPC once the file system is full, or the host "
                       "runs out of memory first)")
    assert said[1].startswith("tierfs: warning: --ram-limit 999999.0 TiB is more than the RAM "
                              "dir's file system (")
    assert " and this host's memory (" in said[1]


def test_status_table_and_umount(mnt: Mount) -> None:
    write_step(mnt / "run/step_100", {"__0_0.distcp": b"x" * 3000})
    (mnt / "run/step_200").mkdir()
    table = tierfs("status", str(mnt.mountpoint)).stdout
    lines = table.splitlines()
    assert lines[0].startswith(f"tierfs at {mnt.mountpoint}") and f"pid {mnt.pid}" in lines[0]
    header = lines[2].split()
    assert header == ["PATH", "STEP", "STATE", "VERSION", "FILES", "SIZE", "AGE", "TIERS"]
    row = lines[3].split()
    assert row[:7] == ["run/step_100", "100", "committed", "1", "2", "2.9", "KiB"]
    assert re.fullmatch(r"\d+s", row[7]) and row[8:] == ["ram", "<-", "latest"]
    assert lines[4].split()[:3] == ["run/step_200", "200", "writing"]
    tierfs("umount", str(mnt.mountpoint))
    assert not is_mounted(mnt.mountpoint)
    assert_one_line_error(tierfs("status", str(mnt.mountpoint), check=False),
                          "is not on a tierfs mount")
    assert_one_line_error(tierfs("umount", str(mnt.mountpoint), check=False), "is not mounted")


def test_umount_of_busy_mount_says_so(mnt: Mount) -> None:
    (mnt / "open").write_bytes(b"x")
    with open(mnt / "open", "rb"):
        assert_one_line_error(tierfs("umount", str(mnt.mountpoint), check=False),
                              "cannot unmount")
    assert is_mounted(mnt.mountpoint)


def test_help_answers_questions() -> None:
    top = tierfs("--help").stdout
    for word in ("mount", "umount", "status", "commit", "demo", ".metadata", "latest"):
        assert word in top
    mount_help = tierfs("mount", "--help").stdout
    for word in ("--ram-dir", "--ram-limit", "--step-pattern", "TIERFS_", "--config"):
        assert word in mount_help


def test_the_command_line_starts_without_the_daemon_s_libraries() -> None:
    """`tierfs status` and friends must start fast and run where trio, pyfuse3 or boto3 are
    broken: the command line imports none of them (nor torch) until the daemon starts."""
    heavy = ("trio", "pyfuse3", "boto3", "torch")
    done = subprocess.run(
        [sys.executable, "-c", "import sys, tierfs.mount_helper.cli; "
         f"print([m for m in {heavy!r} if m in sys.modules])"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_daemon_takes_the_open_files_its_hard_limit_allows(mounts: MountFactory) -> None:
    """Started with the soft limit a service often gets (1,024; here 256) under a higher hard
    one, the daemon raises its soft limit to the hard one: uploads, copies and users' files
    are open at once."""
    mnt = mounts.mount(prefix=["prlimit", "--nofile=256:4096", "--"])
    with open(f"/proc/{mnt.pid}/limits") as limits:
        assert re.search(r"Max open files\s+4096\s+4096", limits.read())


def test_environment_variables_configure_the_mount(mounts: MountFactory, tmp_path: Path) -> None:
    env = dict(os.environ, TIERFS_RAM_LIMIT="32M", TIERFS_NODE_ID="envnode")
    mountpoint = tmp_path / "envmp"
    mountpoint.mkdir()
    ram_dir = mounts.new_ram_dir()
    tierfs("mount", str(mountpoint), "--ram-dir", str(ram_dir), env=env)
    mnt = Mount(mountpoint, ram_dir, ram_dir / "tierfs.log")
    mounts.mounts.append(mnt)
    status = mnt.status()
    mnt.pid = status["pid"]
    assert status["node_id"] == "envnode" and status["ram"]["limit_bytes"] == 32 << 20


def test_config_file_mistakes_are_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_bytes(b"\x00\xff binary")
    assert_one_line_error(tierfs("mount", str(tmp_path), "--config", str(config), check=False),
                          "is not valid TOML")
    config.write_text('foreground = "no"\n')
    assert_one_line_error(tierfs("mount", str(tmp_path), "--config", str(config), check=False),
                          "foreground must be true or false")


def test_flush_fails_naming_the_steps_that_are_not_committed(mounts: MountFactory,
                                                             tmp_path: Path) -> None:
    """A step still being written is in no tier but this node's RAM: `tierfs flush` does not
    exit 0 (an epilog would unmount on its word); with a file of it held open for writing
    waiting cannot end, so it exits 1 at once, naming the step and the file; once the step is
    committed and stored, the flush exits 0."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    write_step(mnt / "run/step_1", {"__0_0.distcp": b"shard"})
    (mnt / "run/step_2").mkdir()
    with open(mnt / "run/step_2/model.pt", "wb") as writer:  # a save still going on
        writer.write(b"weights")
        done = tierfs("flush", str(mnt.mountpoint), check=False)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "1 step is not committed" in done.stderr and \
        "run/step_2 (files open for writing: model.pt)" in done.stderr, done.stderr
    assert "run/step_1" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    tierfs("commit", str(mnt / "run/step_2"))
    done = tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert "not committed" not in done.stderr
    assert (store / "run/step_2/model.pt").read_bytes() == b"weights"
