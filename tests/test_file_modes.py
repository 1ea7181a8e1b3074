"""Every file the daemon creates has a deliberate mode: nothing in a RAM dir or a file:// store
is writable by group or others (the daemon runs with umask 0, so a file opened without an
explicit mode would be 0666), after a save, a delete and a restart."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.conftest import MountFactory, tierfs, wait_until
from tests.test_deletes import deletes_done, files, save_step

pytestmark = pytest.mark.fuse


def writable_by_others(root: Path) -> dict[str, str]:
    found = {}
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if not os.path.islink(path) and mode & 0o022:
            found[str(path.relative_to(root))] = f"{mode & 0o7777:o}"
    return found


def test_no_file_of_the_daemon_is_writable_by_others(mounts: MountFactory,
                                                     tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    mnt = mounts.mount("--persist", f"file://{store}")
    for number in (1, 2):
        save_step(mnt / f"run/step_{number}", files(number))
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    shutil.rmtree(mnt / "run/step_1")
    wait_until(lambda: deletes_done(mnt), timeout=30)
    assert list((mnt.ram_dir).rglob("deleted/*.json")), "the delete left no record to check"
    assert writable_by_others(mnt.ram_dir) == {}
    assert writable_by_others(store) == {}

    mnt.kill9()
    again = mounts.remount(mnt)
    save_step(again / "run/step_3", files(3))
    tierfs("flush", str(again.mountpoint), "--timeout", "60")
    assert writable_by_others(again.ram_dir) == {}
    assert writable_by_others(store) == {}


def test_a_file_store_lets_no_more_users_read_a_file_than_the_mount_does(
        mounts: MountFactory, tmp_path: Path) -> None:
    """Files saved 0600, 0640 (group 4321) and 0644 are stored readable by the same users:
    the daemon's (the store's owner), the file's group and others as the file's mode says (a
    0600 file was stored 0644 under a 0755 store: any local user read the checkpoint there);
    a chmod after the upload reaches the store's object too, with no byte sent again."""
    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    mnt = mounts.mount("--persist", f"file://{store}", "--commit-idle", "1")
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    for name, mode in (("secret.pt", 0o600), ("group.pt", 0o640), ("public.pt", 0o644)):
        (step / name).write_bytes(os.urandom(1000))
        os.chmod(step / name, mode)
    os.chown(step / "group.pt", -1, 4321)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")

    def stored() -> dict[str, tuple[int, int]]:
        return {name: (stat.S_IMODE(st.st_mode), st.st_gid) for name in
                ("secret.pt", "group.pt", "public.pt")
                for st in [os.stat(store / "run/step_1" / name)]}

    wait_until(lambda: mnt.step("run/step_1")["persisted"], timeout=15)
    assert stored() == {"secret.pt": (0o600, 0), "group.pt": (0o640, 4321),
                        "public.pt": (0o644, 0)}
    sent = mnt.status()["persist"]["sent_bytes"]
    os.chmod(step / "public.pt", 0o600)
    wait_until(lambda: mnt.step("run/step_1")["version"] == 2, timeout=15)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert stored()["public.pt"] == (0o600, 0)
    assert mnt.status()["persist"]["sent_bytes"] == sent
