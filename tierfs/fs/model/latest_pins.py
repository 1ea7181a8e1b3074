"""Which step the virtual `latest` link names for each process.

`latest` names the newest committed step of its directory, and the kernel asks for its target
at every path lookup through it. A load through `latest` opens `.metadata` and then each shard
by path, so a commit landing mid-load would otherwise send the later opens to another step and
mix two checkpoints. So a process that opened a file through `latest` keeps seeing that step
while it has files of it open, and for `GRACE` seconds after it last closed one (`PLANNING`
seconds after a load's `.metadata`, while it has opened nothing else: the ranks plan the load
together before any opens a shard); then it sees the newest step again. A DCP load reads
`.metadata` once, first: a process that opens it again through the link with no file of its
step open starts a new load, and sees the newest step (its open is answered `ESTALE`, and the
kernel walks the path again, asking for the link's target anew), so a process that loads
`latest` again soon after a load, or after its own save, is not held on the older step. So does
a process whose last load through the link read one file, at the step's top, and opens that
file again with nothing of the step open (an evaluator polling `latest/model.pt`). A load that
failed (an open or a read of a file of its step answered with an error) holds nothing from then
on. A process that only looks at the link (`readlink`, a monitor), or opens the step's files by
the step's own name, always sees the newest step.
Other processes are not affected: each resolves on its own.

Processes are told apart by thread-group id: FUSE reports the thread, and a load's threads are
one reader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

GRACE = 10.0  # seconds a process keeps its target after its last use of it
# Seconds a load that has read its first file (`LOAD_STARTS`) and nothing else keeps its
# target: DCP reads `.metadata`, closes it, and plans the load with every other rank (a gather
# and a scatter) before it opens a shard, which takes seconds on a big job and as long as its
# slowest rank takes to read `.metadata`. A pin that lapsed there sent the shards' opens to a
# newer step: one load, two checkpoints.
PLANNING = 600.0
# An open of a file of the step asked for within this long after the same process resolved
# `latest` to it went through `latest` (the kernel asks for the link's target at every path
# lookup). Taken when the open is asked, not when it is answered: an open may wait seconds for
# its file to come from a peer or the store, and the pin holds meanwhile.
THROUGH_LINK = 1.0
# The file a load through `latest` opens first, and once (DCP's `dcp.load`): opened again, it
# is a new load. (HF Trainer reads its `trainer_state.json` more than once in one resume.)
LOAD_STARTS = b".metadata"


@dataclass
class Pin:
    key: tuple[int, int]  # (thread group, directory inode)
    target: bytes
    last_used: float
    resolved: float = 0.0  # when the process last asked for the link's target
    open_files: int = 0
    reading: bool = False  # it opened a file of `target` through the link (until it expires)
    load_started: bool = False  # it opened a load's first file (`LOAD_STARTS`) through the link
    first_file: bytes | None = None  # the first file at the step's top it opened through it
    other_files: bool = False  # it opened another file of `target` through the link

    def grace(self) -> float:
        """How long the pin outlives the process's last use of it: longer while a load has
        read its first file and nothing else (it is planning)."""
        return PLANNING if self.load_started and not self.other_files else GRACE


class LatestPins:
    """Per-process targets of `latest`, keyed by (thread group, directory inode)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pins: dict[tuple[int, int], Pin] = {}

    def resolve(self, pid: int, dir_ino: int, newest: bytes | None,
                still_committed: Callable[[bytes], bool]) -> bytes | None:
        """The target `latest` in directory `dir_ino` has for the process of thread `pid`."""
        now = self._clock()
        self._expire(now)
        key = (thread_group(pid), dir_ino)
        pin = self._pins.get(key)
        if (pin is not None and pin.reading and pin.target != newest
                and still_committed(pin.target)):
            pin.resolved = now
            log.debug("latest for %d (thread %d): %r, held (newest %r)", key[0], pid,
                      pin.target, newest)
            return pin.target
        if pin is not None and newest is not None:
            # The same object: open files point to it.
            if pin.target != newest:
                pin.first_file, pin.other_files = None, False
            pin.target, pin.last_used, pin.resolved = newest, now, now
            pin.reading = pin.open_files > 0
        elif newest is not None:
            self._pins[key] = Pin(key, newest, now, resolved=now)
        log.debug("latest for %d (thread %d): %r", key[0], pid, newest)
        return newest

    def opened(self, pid: int, dir_ino: int, step_name: bytes,
               file_name: bytes | None = None) -> Pin | None:
        """A process asks to open a file of step `step_name` (`file_name`: one at the step's
        top level): its pin, if the open came through the link, which holds while the open
        waits and then while the file is open. Returns the pin to pass to `closed` (and to
        `failed` if the open or a read fails)."""
        pin = self._through_link(pid, dir_ino, step_name)
        if pin is None:
            return None
        log.debug("%r/%r asked for through latest by thread %d", step_name, file_name, pid)
        pin.open_files += 1
        pin.reading = True
        if file_name == LOAD_STARTS:
            pin.load_started = True
        if pin.first_file is None and not pin.other_files and file_name is not None:
            pin.first_file = file_name
        elif file_name is None or file_name != pin.first_file:
            pin.other_files = True
        return pin

    def starts_again(self, pid: int, dir_ino: int, step_name: bytes, file_name: bytes,
                     newest: Callable[[], bytes | None]) -> bool:
        """A process is about to open `file_name` at the top of step `step_name`. True if that
        begins a new load through an older step than the newest (`newest()`), with nothing of
        the step open: the first file of a DCP load, `LOAD_STARTS`, read again through the
        link, or the one file the last load read through it: the pin ends, and the caller has
        the open walked again."""
        pin = self._through_link(pid, dir_ino, step_name)
        if pin is None or pin.open_files or not (
                (file_name == LOAD_STARTS and pin.load_started)
                or (file_name == pin.first_file and not pin.other_files)):
            if pin is not None:
                log.debug("%r/%r opened by thread %d, the same load (%d open, first %r, "
                          "others %s, began at %s)", step_name, file_name, pid,
                          pin.open_files, pin.first_file, pin.other_files, LOAD_STARTS
                          if pin.load_started else None)
            return False
        if newest() in (None, pin.target):
            return False
        log.debug("%r/%r opened again by thread %d: a new load", step_name, file_name, pid)
        del self._pins[pin.key]
        return True

    def failed(self, pin: Pin) -> None:
        """A file opened (or asked to be) through the link with `pin` could not be opened or
        read: the load failed and the pin ends, so that the process's next load, or look at
        the link, sees the newest step."""
        if self._pins.get(pin.key) is pin:
            log.debug("a load of %r by %d failed", pin.target, pin.key[0])
            del self._pins[pin.key]

    def _through_link(self, pid: int, dir_ino: int, step_name: bytes) -> Pin | None:
        """The process's pin, if a file of `step_name` it asks to open now comes through the
        link."""
        if not self._pins:
            return None
        pin = self._pins.get((thread_group(pid), dir_ino))
        now = self._clock()
        if pin is None or pin.target != step_name or not (
                pin.reading or now - pin.resolved <= THROUGH_LINK):
            if pin is not None and pin.target == step_name:
                log.debug("%r opened by thread %d %.3f s after it resolved latest to it: by "
                          "its own name", step_name, pid, now - pin.resolved)
            return None  # not through the link: a file of the step opened by its own name
        return pin

    def closed(self, pin: Pin) -> None:
        pin.open_files -= 1
        pin.last_used = self._clock()

    def _expire(self, now: float) -> None:
        for key in [k for k, p in self._pins.items()
                    if not p.open_files and now - p.last_used > p.grace()]:
            del self._pins[key]


def thread_group(pid: int) -> int:
    """The process (thread group) a thread belongs to; the thread itself if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pid
