"""Permissions: without `allow_other` only the user who mounted reaches the mount; file modes
are enforced by the kernel (`default_permissions`); the RAM dir and the control socket are
private; a token file others may read is refused. (A world-readable token file is already
refused in tests/test_cluster.py::test_cluster_mistakes_are_one_line; here: group-only and
other-only bits, and the accepted 0400/0600.) Counts go to tests/faults/results/permissions.json.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import MountFactory, free_port, mount_options, tierfs
from tests.faults.conftest import report
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.faults

NOBODY = 65534
CHECKS: dict[str, int] = {"refusals_checked": 0, "accesses_checked": 0}


@pytest.fixture(scope="module", autouse=True)
def counts() -> Iterator[dict[str, int]]:
    yield CHECKS
    report("permissions", CHECKS)


def run_as(prefix: list[str], code: str) -> dict[str, str]:
    """Run `code` in a child (after `prefix`, e.g. setpriv); it prints `name=outcome` lines."""
    done = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.split())


PROBE = """
    import errno, os, sys
    def probe(name, call):
        try:
            call()
            print(f"{name}=ok")
        except OSError as exc:
            print(f"{name}={errno.errorcode[exc.errno]}")
"""


def test_only_the_mounting_user_reaches_the_mount(public_dir: Path,
                                                  mounts: MountFactory) -> None:
    mountpoint = public_dir / "mnt"
    mountpoint.mkdir(mode=0o755)
    mnt = mounts.mount(mountpoint=mountpoint)
    os.chmod(mnt.mountpoint, 0o777)  # the mount's root is open to all: only FUSE says no
    (mnt / "open.txt").write_bytes(b"world readable")
    os.chmod(mnt / "open.txt", 0o666)
    control = public_dir / "plain"
    control.mkdir(mode=0o777)
    (control / "open.txt").write_bytes(b"plain")
    (control / "open.txt").chmod(0o666)
    outcome = run_as([], PROBE + f"""
    os.setgroups([])
    os.setgid({NOBODY})
    os.setuid({NOBODY})
    probe("stat_mount", lambda: os.stat({str(mnt.mountpoint)!r}))
    probe("list_mount", lambda: os.listdir({str(mnt.mountpoint)!r}))
    probe("read_mount", lambda: open({str(mnt / 'open.txt')!r}, "rb").read())
    probe("create_mount", lambda: open({str(mnt / 'new.txt')!r}, "wb").close())
    probe("read_plain", lambda: open({str(control / 'open.txt')!r}, "rb").read())
    probe("list_plain", lambda: os.listdir({str(control)!r}))
    """)
    assert outcome == {"stat_mount": "EACCES", "list_mount": "EACCES", "read_mount": "EACCES",
                       "create_mount": "EACCES", "read_plain": "ok", "list_plain": "ok"}
    CHECKS["refusals_checked"] += 4
    CHECKS["accesses_checked"] += 2
    assert not (mnt / "new.txt").exists()
    assert "allow_other" not in mount_options(mnt.mountpoint)
    assert "default_permissions" in mount_options(mnt.mountpoint)


# A root process without the capabilities that bypass file modes: the mounting user (uid 0),
# so FUSE lets it in, and only the modes (checked by the kernel) stand in its way.
NO_OVERRIDE = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner,-chown",
               "--inh-caps", "-all"]


def test_file_modes_are_enforced_by_the_kernel(mounts: MountFactory) -> None:
    mnt = mounts.mount()
    other = 1000
    private, readonly, locked = mnt / "private.bin", mnt / "readonly.bin", mnt / "locked"
    private.write_bytes(b"secret")
    readonly.write_bytes(b"read me")
    locked.mkdir()
    for path, mode in ((private, 0o600), (readonly, 0o644), (locked, 0o555)):
        os.chown(path, other, other)
        os.chmod(path, mode)
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    assert os.stat(private).st_uid == other
    outcome = run_as(NO_OVERRIDE, PROBE + f"""
    probe("read_private", lambda: open({str(private)!r}, "rb").read())
    probe("read_readonly", lambda: open({str(readonly)!r}, "rb").read())
    probe("write_readonly", lambda: open({str(readonly)!r}, "ab").close())
    probe("chmod_not_owner", lambda: os.chmod({str(readonly)!r}, 0o666))
    probe("create_in_locked", lambda: open({str(locked / 'x')!r}, "wb").close())
    probe("mkdir_in_locked", lambda: os.mkdir({str(locked / 'd')!r}))
    probe("list_locked", lambda: os.listdir({str(locked)!r}))
    probe("create_in_root", lambda: open({str(mnt / 'mine.txt')!r}, "wb").close())
    """)
    assert outcome == {"read_private": "EACCES", "read_readonly": "ok",
                       "write_readonly": "EACCES", "chmod_not_owner": "EPERM",
                       "create_in_locked": "EACCES", "mkdir_in_locked": "EACCES",
                       "list_locked": "ok", "create_in_root": "ok"}, outcome
    CHECKS["refusals_checked"] += 5
    CHECKS["accesses_checked"] += 3
    assert stat.S_IMODE(os.stat(readonly).st_mode) == 0o644
    assert not (locked / "x").exists() and not (locked / "d").exists()


def test_ram_dir_and_control_socket_are_private(mounts: MountFactory) -> None:
    fresh = mounts.new_ram_dir()
    mnt = mounts.mount(ram_dir=fresh)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    sockets = [p for p in fresh.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
    assert sockets and all(stat.S_IMODE(p.lstat().st_mode) == 0o600 for p in sockets)
    # a RAM dir that exists with loose modes is made private when mounted
    mnt.kill9()
    os.chmod(fresh, 0o755)
    mounts.remount(mnt)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    CHECKS["refusals_checked"] += 2


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o444])
def test_token_file_readable_by_group_or_others_is_refused(mounts: MountFactory,
                                                           tmp_path: Path, mode: int) -> None:
    mountpoint = tmp_path / "mp"
    mountpoint.mkdir()
    token = tmp_path / "token"
    token.write_bytes(os.urandom(32).hex().encode())
    token.chmod(mode)
    done = tierfs("mount", str(mountpoint), "--ram-dir", str(mounts.new_ram_dir()),
                  "--node-id", "a", "--cluster", "etcd://127.0.0.1:2379/never-reached",
                  "--listen", f"127.0.0.1:{free_port()}", "--token-file", str(token),
                  check=False)
    assert done.returncode == 1 and "readable by others" in done.stderr, done.stderr
    assert f"{mode:o}" in done.stderr
    CHECKS["refusals_checked"] += 1


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_private_token_file_is_accepted(mounts: MountFactory, tmp_path: Path,
                                        mode: int, etcd_server: Etcd) -> None:
    token = tmp_path / "token"
    token.write_bytes(os.urandom(32).hex().encode())
    token.chmod(mode)
    mnt = mounts.mount("--node-id", "a", "--cluster",
                       etcd_server.cluster_url(f"test/{tmp_path.name}"),
                       "--listen", f"127.0.0.1:{free_port()}", "--token-file", str(token))
    assert mnt.status()["node_id"] == "a"
    CHECKS["accesses_checked"] += 1

