"""Every file the daemon creates has a deliberate mode: nothing in a RAM dir or a file:// store
is writable by group or others (the daemon runs with umask 0, so a file opened without an
explicit mode would be 0666), after a save, a delete and a restart."""

from __future__ import annotations

import os
import shutil
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
