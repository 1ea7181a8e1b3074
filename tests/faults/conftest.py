"""Fixtures and helpers of the fault suite: the run size (quick sample by default, the full run
with TIERFS_FAULTS=full), a training process that saves and loads real DCP checkpoints on
command, verification of steps under a mount against the hashes the training process saved,
and the counts each module reports in tests/faults/results/<name>.json."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from tests.conftest import Mount, getxattr
from tests.faults.results_io import FULL, pick, write_results  # noqa: F401  (FULL: for the modules)

# One switch and one place for the counts, shared with the other fault modules.
scale = pick
report = write_results


# The events that answer each command, in the order the trainer writes them (trainer.py).
EVENTS = {"ready": ("ready",), "save": ("child", "start", "shards", "done"),
          "load": ("child", "done")}


class Trainer:
    """The training process (tests/faults/trainer.py): torch imported once, every save or load
    in a forked child whose pid is known, so either it or the daemon can be killed mid-save.

    Its events are read strictly in order and matched to the command by id: waiting for one
    event passes over only the events of that command that come before it (a caller may not
    care about `shards`), so an event can never be consumed unseen, and one out of order is an
    error that says so."""

    def __init__(self, log_path: Path) -> None:
        script = Path(__file__).with_name("trainer.py")
        self.log_path = log_path
        # stderr to a file: torch's warnings would fill a pipe nobody reads and block a save
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True,
                                         bufsize=1)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.child = 0
        self.command_id = 0  # the command being answered; 0: the trainer's start
        self.op = "ready"
        self.seen: list[str] = []  # the events of that command read so far
        self.expect("ready", timeout=120)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                self.events.put({"event": "noise", "line": line})
        self.events.put({"event": "eof"})

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def command(self, op: str, **fields: Any) -> None:
        """Send a command; the events read from now on answer it."""
        self.command_id += 1
        self.op = op
        self.seen = []
        self.child = 0  # known from the command's `child` event
        self.send(json.dumps({"op": op, "id": self.command_id, **fields}))

    def expect(self, name: str, timeout: float = 120) -> dict[str, Any]:
        """The current command's event `name`, once the ones before it (noise skipped); fails
        on eof, timeout, or an event out of the protocol's order."""
        order = EVENTS[self.op]
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"trainer: no {name} within {timeout} s (command "
                                     f"{self.command_id}, seen {self.seen})") from None
            kind = event["event"]
            if kind == "noise":
                continue
            if kind == "eof":
                err = self.log_path.read_text()
                raise AssertionError(f"trainer exited while waiting for {name}: {err[-2000:]}")
            if event.get("id") != self.command_id:
                if event.get("id", -1) < self.command_id and kind == "done" \
                        and event.get("killed"):
                    continue  # kill_child() hit a save that had just reported done: its 2nd
                raise AssertionError(f"trainer: {event} while command {self.command_id} "
                                     f"waits for {name}")
            if kind not in order or (self.seen and order.index(kind) <= order.index(
                    self.seen[-1])):
                raise AssertionError(f"trainer: {kind} out of order after {self.seen}: {event}")
            self.seen.append(kind)
            if kind == "child":
                self.child = event["pid"]
            if kind == name:
                return event
            if order.index(kind) > order.index(name):
                if kind == "done":
                    raise AssertionError(f"trainer finished early while waiting for {name}: "
                                         f"{event}")
                raise AssertionError(f"trainer: {kind} came, {name} never did: {event}")

    def start_save(self, path: Path, seed: int, mib: float, pause: bool = False) -> None:
        self.command("save", path=str(path), seed=seed, mib=mib, pause=pause)
        self.expect("start")

    def save(self, path: Path, seed: int, mib: float) -> dict[str, str]:
        """A save that must succeed; the hashes of the files as read back right after it."""
        self.start_save(path, seed, mib)
        done = self.expect("done")
        assert done["ok"], done
        return done["files"]

    def load_matches(self, path: Path, seed: int, mib: float) -> tuple[bool, str]:
        self.command("load", path=str(path), seed=seed, mib=mib)
        done = self.expect("done")
        return done["ok"], done.get("error", "")

    def kill_child(self) -> None:
        """SIGKILL the current save's process, if it still is the trainer's child (a reaped
        pid may belong to someone else by now)."""
        try:
            with open(f"/proc/{self.child}/stat") as f:
                parent = int(f.read().rsplit(") ", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            return  # gone (between the open and the read: ESRCH), or not a pid
        if self.child and parent == self.proc.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGKILL)

    def close(self) -> None:
        self.kill_child()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[Trainer]:
    process = Trainer(tmp_path / "trainer.log")
    try:
        yield process
    finally:
        process.close()


def file_hash(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            hasher.update(block)
    return hasher.hexdigest()


def step_problems(mnt: Mount | Path, relpath: str, files: dict[str, str]) -> list[str]:
    """What is wrong with a step that must be committed with exactly these files and hashes:
    its state, its file list, the bytes read through the mount, the manifest's xxh3 xattr."""
    step_dir = Path(mnt) / relpath
    try:
        state = getxattr(step_dir, "user.tierfs.state")
        if state != "committed":
            return [f"{relpath} is {state}"]
        names = sorted(os.listdir(step_dir))
        if names != sorted(files):
            return [f"{relpath} holds {names}, expected {sorted(files)}"]
        problems = []
        for name, expected in files.items():
            found = file_hash(step_dir / name)
            recorded = getxattr(step_dir / name, "user.tierfs.xxh3")
            if not found == recorded == expected:
                problems.append(f"{relpath}/{name}: read {found}, manifest {recorded}, "
                                f"saved {expected}")
        return problems
    except OSError as exc:
        return [f"{relpath}: {exc}"]
