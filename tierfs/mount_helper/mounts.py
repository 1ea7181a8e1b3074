"""Facts about mount points and their daemons, read from /proc so that nothing touches a
possibly hung FUSE mount: a stat of a mount whose daemon is stopped blocks until it resumes.

A tierfs mount names its RAM dir in its source (`tierfs:/dev/shm/tierfs`, what `df` and
/proc/self/mountinfo show), so the command line finds the daemon (the holder of the RAM dir's
lock, in /proc/locks) and its state without asking the mount anything.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

TIERFS_TYPE = "fuse.tierfs"
SOURCE_PREFIX = "tierfs:"
PATIENCE = 3.0  # seconds a command waits for a mount to answer before saying what is wrong

T = TypeVar("T")


class MountEntry(NamedTuple):
    mountpoint: str
    fstype: str
    source: str
    owner: int | None = None  # a FUSE mount's user (its `user_id` option): who may unmount it


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as octal.
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))


def mount_table() -> list[MountEntry]:
    """Every mount this process sees, in mount order."""
    table = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, source, options = (right.split() + ["", "", ""])[:3]
            owner = next((int(option[len("user_id="):]) for option in options.split(",")
                          if option.startswith("user_id=")), None)
            table.append(MountEntry(_unescape(left.split()[4]), fstype, _unescape(source),
                                    owner))
    return table


def mount_at(path: str | os.PathLike[str]) -> MountEntry | None:
    """The mount whose mount point is exactly `path` (the top one if mounts are stacked)."""
    target = os.path.abspath(path)
    found = [entry for entry in mount_table() if entry.mountpoint == target]
    return found[-1] if found else None


def is_mounted(path: str | os.PathLike[str]) -> bool:
    return mount_at(path) is not None


def tierfs_on_top(path: str | os.PathLike[str], ram_dir: Path) -> bool:
    """The newest mount at `path` is the tierfs mount of this RAM dir (not, once that is
    unmounted, the mount it was made over: a container's volume, a bind mount)."""
    entry = mount_at(path)
    return entry is not None and entry.fstype == TIERFS_TYPE and \
        entry.source == mount_source(ram_dir)


def real_path(path: str | os.PathLike[str]) -> str:
    """os.path.realpath, except for a mount point (never a symbolic link itself): that is not
    touched, since a stat of a mount whose daemon is stopped blocks until it resumes."""
    target = os.path.abspath(path)
    return target if is_mounted(target) else os.path.realpath(target)


def enclosing_mount(path: str | os.PathLike[str]) -> MountEntry | None:
    """The mount holding `path` (the longest mount point that contains it), without stat."""
    target = os.path.abspath(path)
    best: MountEntry | None = None
    for entry in mount_table():
        inside = target == entry.mountpoint or \
            target.startswith(entry.mountpoint.rstrip("/") + "/")
        if inside and (best is None or len(entry.mountpoint) >= len(best.mountpoint)):
            best = entry
    return best


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """Type of the file system holding `path`."""
    entry = enclosing_mount(os.path.realpath(path))
    return entry.fstype if entry else "unknown"


def mount_source(ram_dir: Path) -> str:
    """The source a mount on `ram_dir` gets: plain `tierfs` when the path cannot be written into
    a mount option list (a comma or backslash in it); such a mount is found through its xattr."""
    text = str(ram_dir)
    if "," in text or "\\" in text or not text.isprintable():
        return "tierfs"
    return SOURCE_PREFIX + text


def ram_dir_of(entry: MountEntry) -> Path | None:
    if entry.fstype != TIERFS_TYPE or not entry.source.startswith(SOURCE_PREFIX):
        return None
    return Path(entry.source[len(SOURCE_PREFIX):])


class DaemonState(NamedTuple):
    pid: int | None  # None: no process holds the RAM dir (the daemon is gone)
    state: str  # "running", "stopped", "gone", or "unknown" (the RAM dir cannot be read)


def daemon_state(ram_dir: Path) -> DaemonState:
    """Which process holds `ram_dir`'s lock, and whether it is stopped (SIGSTOP, a debugger)."""
    try:
        st = os.stat(ram_dir / "lock")
    except OSError:
        return DaemonState(None, "unknown")
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        holders = [int(fields[4]) for fields in map(str.split, f)
                   if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == device]
    if not holders:
        return DaemonState(None, "gone")
    return DaemonState(holders[0], process_state(holders[0]))


def process_state(pid: int) -> str:
    """"running", "stopped" (SIGSTOP, a debugger: it cannot exit before it is resumed) or
    "gone" (no such process, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rpartition(") ")[2][:1]
    except OSError:
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(letter, "running")


def describe_daemon(ram_dir: Path | None) -> str:
    """What is wrong with the daemon of a mount that does not answer, with the command that
    helps, as a clause: 'its daemon (pid 12) is stopped: `kill -CONT 12` resumes it'."""
    found = daemon_state(ram_dir) if ram_dir is not None else DaemonState(None, "unknown")
    if found.state == "stopped":
        return f"its daemon (pid {found.pid}) is stopped: `kill -CONT {found.pid}` resumes it"
    if found.state == "gone":
        return "its daemon is gone"
    if found.pid is not None:
        return f"its daemon (pid {found.pid}) is busy or hung"
    return "its daemon is busy, hung or stopped"


def dead_mount_hint(mountpoint: str) -> str:
    return (f"`tierfs umount {mountpoint}` removes the dead mount; `tierfs mount` on it "
            "recovers it")


def with_patience(call: Callable[[], T], seconds: float = PATIENCE) -> T:
    """`call()` in a worker thread, so that a hung mount cannot hang the caller: TimeoutError
    after `seconds` (the thread stays blocked until the mount answers or the process exits)."""
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
