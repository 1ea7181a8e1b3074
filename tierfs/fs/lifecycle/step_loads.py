"""Steps being loaded, as a DCP load does: it opens the step's `.metadata`, then reads each
shard it needs from its start; `cp -r` and other readers of whole files read one file after
another from its first byte. Such a step's large files are worth bringing whole before their
opens return (then read by passthrough, at memory speed, instead of range by range through the
daemon). Any other read of a large file not in RAM (one tensor of a shard) fetches only what it
touches (`fs.store.fetch`).

Beside the files a load opens, only the step's files written by the same node are read ahead
(`FetchBack._read_ahead`): each rank of a multi-rank load reads its own shards only, and a
read-ahead of the whole step would bring every shard to every node.

This module only keeps the books: which steps are being loaded, and until when; `FetchBack`
fetches."""

from __future__ import annotations

import trio

from tierfs.fs.model.nodes import METADATA, Node, StepState

# How long a step counts as being loaded after its `.metadata` was opened, or after one of its
# files was brought whole for the load (a DCP load opens them one after the other).
LOAD_WINDOW = 30.0


class StepLoads:
    def __init__(self) -> None:
        self._until: dict[StepState, float] = {}  # trio time

    def opened(self, step_node: Node, node: Node) -> bool:
        """A file of the step is opened for reading: if it is the step's `.metadata`, a load
        starts (whether it did)."""
        if node.name != METADATA or node.parent is not step_node:
            return False
        self.read_through(step_node.step)
        return True

    def read_through(self, step: StepState) -> None:
        """A file of the step is read back to back from its first byte (`cp -r`,
        `torch.load`, a loader of its own): the step is being loaded, as at a `.metadata`
        open, and the next files it opens come whole before their opens return."""
        self._forget_old()
        self._until[step] = trio.current_time() + LOAD_WINDOW

    def loading(self, step: StepState) -> bool:
        """Whether the step is being loaded (and stays so for another window)."""
        until = self._until.get(step)
        if until is None or until < trio.current_time():
            return False
        self._until[step] = trio.current_time() + LOAD_WINDOW
        return True

    def _forget_old(self) -> None:
        now = trio.current_time()
        for step in [s for s, until in self._until.items() if until < now]:
            del self._until[step]
