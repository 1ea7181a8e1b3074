"""What an operator reads: one event line per step and tier in the daemon's log, and
`tierfs status --watch`."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import TIERFS, MountFactory, tierfs, wait_until
from tests.test_crash import save
from tierfs.mount_helper.cli import CLEAR_SCREEN
from tierfs.observe import event_line

pytestmark = pytest.mark.fuse

RATE = r"\(\d+(\.\d)? [kMG]?B, \d+(\.\d)? [kMG]?B/s\)"
TIME = r"\d+(\.\d)? (ms|s)"


def test_event_line_reads_like_the_operators_quote() -> None:
    assert event_line("step_240", "RAM commit", 12_400_000_000, 0.018) == \
        "Step step_240: RAM commit in 18 ms (12.4 GB, 689 GB/s)"
    assert event_line("run/step_240", "persisted to s3://b/p", 12_400_000_000, 41) == \
        "Step run/step_240: persisted to s3://b/p in 41 s (12.4 GB, 302 MB/s)"
    assert event_line("run/step_1", "replicated to node-b", 999, 3.21) == \
        "Step run/step_1: replicated to node-b in 3.2 s (999 B, 311 B/s)"


def test_one_line_per_step_and_tier(mounts: MountFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--keep-ram", "1")
    first = {"__0_0.distcp": os.urandom(3 << 20), ".metadata": b"meta"}
    save(mnt / "run/step_1", first)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    log = mnt.log()
    assert re.search(rf"Step run/step_1: RAM commit in {TIME} {RATE}", log), log
    assert re.search(rf"Step run/step_1: persisted to file://{store} in {TIME} {RATE}", log)
    assert log.count("Step run/step_1: RAM commit") == 1
    assert log.count("Step run/step_1: persisted") == 1

    # a second step pushes the first out of RAM (it is safe in the store); reading it back
    # is one line, once its reads stop
    save(mnt / "run/step_2", {"__0_0.distcp": os.urandom(1 << 20), ".metadata": b"m"})
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    wait_until(lambda: mnt.step("run/step_1")["ram"] is False)
    assert (mnt / "run/step_1/__0_0.distcp").read_bytes() == first["__0_0.distcp"]
    line = wait_until(lambda: re.search(
        rf"Step run/step_1: read back from file://{store} in {TIME} \(3.1 MB, .*", mnt.log()))
    assert mnt.log().count("Step run/step_1: read back") == 1, line


def with_ctrl_c() -> None:
    """Ctrl-C as on a terminal: a test run started in the background by a script has SIGINT
    ignored, and a child would inherit that (Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_status_watch_redraws_until_ctrl_c(mounts: MountFactory) -> None:
    mnt = mounts.mount()
    (mnt / "run/step_1").mkdir(parents=True)
    watch = subprocess.Popen([*TIERFS, "status", str(mnt.mountpoint), "--watch", "-n", "0.2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=with_ctrl_c)
    try:
        output = b""
        deadline = time.monotonic() + 20
        while output.count(b"tierfs at ") < 3 and time.monotonic() < deadline:
            if select.select([watch.stdout], [], [], 0.5)[0]:
                output += os.read(watch.stdout.fileno(), 65536)
        watch.send_signal(signal.SIGINT)
        rest, errors = watch.communicate(timeout=10)
    finally:
        watch.kill()
    snapshots = (output + rest).decode().split("\n\n")
    assert len(snapshots) >= 3, output
    assert all(s.startswith("tierfs at ") and "run/step_1" in s for s in snapshots[:3])
    assert watch.returncode == 0, errors
    assert b"Traceback" not in errors and b"KeyboardInterrupt" not in errors


def test_status_watch_redraws_a_terminal(mounts: MountFactory) -> None:
    mnt = mounts.mount()
    leader, follower = pty.openpty()
    watch = subprocess.Popen([*TIERFS, "status", str(mnt.mountpoint), "--watch", "-n", "0.2"],
                             stdout=follower, stderr=subprocess.PIPE, preexec_fn=with_ctrl_c)
    os.close(follower)
    try:
        output = b""
        deadline = time.monotonic() + 20
        while output.count(CLEAR_SCREEN.encode()) < 2 and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                output += os.read(leader, 65536)
        watch.send_signal(signal.SIGINT)
        _out, errors = watch.communicate(timeout=10)
    finally:
        watch.kill()
        os.close(leader)
    assert output.count(CLEAR_SCREEN.encode()) >= 2 and b"Ctrl-C to stop" in output
    assert watch.returncode == 0 and b"Traceback" not in errors


def test_status_watch_refuses_a_bad_interval(tmp_path: Path) -> None:
    done = tierfs("status", str(tmp_path), "--watch", "--interval", "0", check=False)
    assert done.returncode == 2 and "positive number of seconds" in done.stderr
