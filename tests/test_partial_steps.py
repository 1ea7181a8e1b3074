"""Steps left half-made never become the newest checkpoint: a committed step whose `rm -r` was
cut short is no new version (every tier keeps its last whole one, `latest` moves back), and
empty step directories (`cp -al` of a run, whose hard links are refused, or a `mkdir` a saver
never filled) settle as `empty` instead of being written for ever."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import MountFactory, getxattr, tierfs, wait_until
from tierfs import manifest as mf

pytestmark = pytest.mark.fuse


def test_an_interrupted_rm_of_a_step_is_no_new_version(mounts: MountFactory,
                                                        tmp_path: Path) -> None:
    """`rm -rf step_2` of a 3,000-file committed step, killed part way: step_2 is not
    committed again with the files left (it became v2 and `latest`, and the store was pruned
    to match), the store keeps v1 whole and `latest` names step_1; once the removal is done,
    step_2 is gone from every tier."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--commit-idle", "1")
    (mnt / "run/step_1").mkdir(parents=True)
    (mnt / "run/step_1/model.pt").write_bytes(b"one")
    step_2 = mnt / "run/step_2"
    step_2.mkdir()
    for i in range(3000):
        (step_2 / f"shard_{i:04d}").write_bytes(b"%d" % i)
    wait_until(lambda: (mnt.step("run/step_2") or {}).get("state") == "committed", timeout=30)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")

    rm = subprocess.Popen(["rm", "-rf", str(step_2)])
    try:
        wait_until(lambda: len(os.listdir(step_2)) < 2900, timeout=30, interval=0.005)
    finally:
        rm.send_signal(signal.SIGKILL)
        rm.wait()
    left = len(os.listdir(step_2))
    assert 0 < left < 3000
    wait_until(lambda: "run/step_2: the end of its removal" in mnt.log(), timeout=15)
    status = mnt.step("run/step_2")
    assert status["state"] == "writing" and status["version"] == 1
    assert f"{3000 - left} of its 3000 files removed" in status["waiting_for"]
    assert getxattr(step_2, "user.tierfs.state") == "writing"
    assert os.readlink(mnt / "run/latest") == "step_1"
    assert "Step run/step_2 v2" not in mnt.log()
    stored = mf.decode((store / "run/step_2/.tierfs-manifest").read_bytes())
    assert stored.version == 1 and len(stored.files) == 3000
    assert len([n for n in os.listdir(store / "run/step_2") if n.startswith("shard_")]) == 3000

    subprocess.run(["rm", "-rf", str(step_2)], check=True)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    wait_until(lambda: not (store / "run/step_2").exists(), timeout=15)
    assert [s["path"] for s in mnt.status()["steps"]] == ["run/step_1"]


def test_empty_step_directories_settle_as_empty(mounts: MountFactory, tmp_path: Path) -> None:
    """`cp -al` of a run (its hard links refused: EPERM) leaves the step directories it made
    empty, and so does a `mkdir` a saver never filled: once quiet they are `empty`, nothing
    only in RAM, named by no warning, flush or unmount, also after a restart (they stayed
    `writing` for ever, under a standing warning); a file written into one makes it a step
    being written again, which commits."""
    store = tmp_path / "store"
    store.mkdir()
    args = ("--persist", f"file://{store}", "--commit-idle", "1")
    mnt = mounts.mount(*args)
    for number in (1, 2):
        (mnt / f"run/step_{number}").mkdir(parents=True)
        (mnt / f"run/step_{number}/model.pt").write_bytes(b"%d" % number)
    wait_until(lambda: all(s["state"] == "committed" for s in mnt.status()["steps"])
               and len(mnt.status()["steps"]) == 2, timeout=15)
    copied = subprocess.run(["cp", "-al", str(mnt / "run"), str(mnt / "run2")],
                            capture_output=True, text=True)
    assert copied.returncode == 1 and "Operation not permitted" in copied.stderr
    (mnt / "other/step_5").mkdir(parents=True)
    empty = ["other/step_5", "run2/step_1", "run2/step_2"]
    wait_until(lambda: [s["path"] for s in mnt.status()["steps"] if s["state"] == "empty"]
               == empty, timeout=15)
    assert getxattr(mnt / "run2/step_1", "user.tierfs.state") == "empty"
    human = tierfs("status", str(mnt.mountpoint)).stdout
    assert "warning" not in human, human
    flushed = tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert "not committed" not in flushed.stderr, flushed.stderr
    tierfs("umount", str(mnt.mountpoint))
    again = mounts.remount(mnt, *args)
    assert [s["path"] for s in again.status()["steps"] if s["state"] == "empty"] == empty

    (again / "run2/step_2/model.pt").write_bytes(b"again")
    assert again.step("run2/step_2")["state"] == "writing"
    wait_until(lambda: again.step("run2/step_2")["state"] == "committed", timeout=15)
    assert os.readlink(again / "run2/latest") == "step_2"
