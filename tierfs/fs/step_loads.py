"""Steps being loaded whole, as a DCP load does: it opens the step's `.metadata`, then reads the
shards it names, each from its start. Such a step's large files are worth bringing whole
before their opens return (then read by passthrough, at memory speed, instead of range by
range through the daemon), and the files after the one being read are fetched meanwhile
(`Residency.read_ahead_step`). Any other read of a large file not in RAM (one tensor of a
shard) fetches only what it touches (`fs.fetch`).

This module only keeps the books: which steps are being loaded, until when, and whether their
read-ahead runs; `Residency` fetches."""

from __future__ import annotations

import trio

from tierfs.fs.nodes import METADATA, Node, StepState

# How long a step counts as being loaded after its `.metadata` was opened, or after one of its
# files was brought whole for the load (a DCP load opens them one after the other).
LOAD_WINDOW = 30.0


class StepLoads:
    def __init__(self) -> None:
        self._until: dict[StepState, float] = {}  # trio time
        self._reading_ahead: set[StepState] = set()

    def opened(self, step_node: Node, node: Node) -> bool:
        """A file of the step, not in RAM, is opened for reading: whether that starts a load
        (it is the step's `.metadata`)."""
        if node.name != METADATA or node.parent is not step_node:
            return False
        self._forget_old()
        self._until[step_node.step] = trio.current_time() + LOAD_WINDOW
        return True

    def loading(self, step: StepState) -> bool:
        """Whether the step is being loaded (and stays so for another window)."""
        until = self._until.get(step)
        if until is None or until < trio.current_time():
            return False
        self._until[step] = trio.current_time() + LOAD_WINDOW
        return True

    def start_read_ahead(self, step: StepState) -> bool:
        """Whether a read-ahead of the step may start now (none runs)."""
        if step in self._reading_ahead:
            return False
        self._reading_ahead.add(step)
        return True

    def read_ahead_done(self, step: StepState) -> None:
        self._reading_ahead.discard(step)

    def _forget_old(self) -> None:
        now = trio.current_time()
        for step in [s for s, until in self._until.items() if until < now]:
            del self._until[step]
