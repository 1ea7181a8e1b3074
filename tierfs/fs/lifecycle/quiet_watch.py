"""The steps being written and when each is due to commit by itself: the Tree tells it of
every change (the `StepWatch` port of fs.model.ports), `QuietCommits`
(fs.lifecycle.quiet_commits) commits the due ones, `AppendSnapshots` (fs.lifecycle.appends)
reads which files are being appended. A module of its own, so that those two import it
without importing each other."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from tierfs.fs.model.nodes import Node


# Seconds a single file no one writes any more waits for the next change before it commits:
# a loose file written whole and closed (`Commits.commit_file_step`), the attributes set on a
# closed file step or loose file. `cp -p`, `tar x` and Python's `shutil.copy2` (Lightning's
# save of every checkpoint) set times and mode one call after another right after the close,
# which make one version, not one each; a temporary file is renamed or removed at once. No
# writer follows, so they need not wait --commit-idle (a node lost meanwhile lost the save,
# and the file showed `writing` that long after every save).
SETTLED = 0.5


class QuietWatch:
    """The steps being written and when each is due to commit (the Tree's `StepWatch`).

    `due` says when each watched step is due. A heap holds one entry per watched step (at the
    deadline it had when it went in, or an earlier one), so that the next due steps are found
    without a scan: an entry that comes up early for a step touched since goes back in at the
    step's deadline. Thousands of loose files being written cost O(log n) each, not O(n)."""

    def __init__(self, commit_idle: float = 5.0) -> None:
        self.commit_idle = commit_idle
        self.due: dict[Node, float] = {}
        self.wake = trio.Event()
        self._deadlines: list[tuple[float, int, Node]] = []
        self._entry: dict[Node, float] = {}  # a step's entry in the heap, at this deadline
        self._order = itertools.count()  # ties broken by insertion (nodes do not compare)
        # told of each step that begins to be watched: a save of it began here (in a cluster
        # the other nodes learn that this one writes it: `ClusterWrites.note_saving`)
        self.save_begun: Callable[[Node], None] | None = None

    def _set_due(self, step_node: Node, due: float) -> None:
        self.due[step_node] = due
        entry = self._entry.get(step_node)
        if entry is None or due < entry:  # a later deadline waits for the entry to come up
            self._entry[step_node] = due
            heapq.heappush(self._deadlines, (due, next(self._order), step_node))

    def touch(self, step_node: Node, *, settled: bool = False) -> None:
        """`step_node` changed: it commits `commit_idle` seconds after its last change, or
        `SETTLED` seconds (`settled`: a single file no writer has open any more, see there)."""
        new = step_node not in self.due
        if new or settled:
            self.wake.set()  # a new deadline: the watch may be asleep until a later one
        if new and self.save_begun is not None:
            self.save_begun(step_node)
        quiet = min(SETTLED, self.commit_idle) if settled else self.commit_idle
        self._set_due(step_node, time.monotonic() + quiet)

    def step_started(self, step_node: Node) -> None:
        """A saver made `step_node`: the older steps beside it that it was writing are done."""
        number = step_node.step.number
        for sibling in step_node.parent.children.values():
            if (sibling in self.due and sibling.is_dir and sibling.step is not None
                    and sibling.step.number < number):
                self._set_due(sibling, 0.0)
                self.wake.set()

    def rearm(self) -> trio.Event:
        """A fresh wake-up event, set by the next new deadline."""
        self.wake = trio.Event()
        return self.wake

    def due_steps(self, now: float) -> Iterator[Node]:
        """The watched steps due by `now`, each once (the caller commits or touches it)."""
        while (step_node := self._next_entry(now)) is not None:
            yield step_node

    def next_due(self) -> float:
        """When the next watched step is due (inf: none is watched)."""
        self._next_entry(-math.inf)  # settles the entries of steps touched or gone since
        return self._deadlines[0][0] if self._deadlines else math.inf

    def _next_entry(self, now: float) -> Node | None:
        """Take the heap's first entry if it is due by `now` and its step still is; entries of
        steps gone or superseded are dropped, those of steps touched since go back in."""
        deadlines = self._deadlines
        while deadlines:
            deadline, _order, step_node = deadlines[0]
            if self._entry.get(step_node) != deadline:
                heapq.heappop(deadlines)  # superseded by an earlier entry of the same step
                continue
            due = self.due.get(step_node)
            if due == deadline and deadline > now:
                return None  # the first entry is current and not due yet
            heapq.heappop(deadlines)
            del self._entry[step_node]
            if due is None:
                continue  # no longer watched
            if due <= now:
                return step_node
            self._set_due(step_node, due)  # touched since: back in at its deadline
        return None
