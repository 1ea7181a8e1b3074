"""Which directories and files are steps: a step number from a name (`--step-pattern`,
`--file-step-pattern`), nothing inside a step being a step, and a node's step identity changed
by a rename (it becomes a step, or a single-file step, or stops being one). Part of the tree's
core (see `fs.tree.tree`): each change is one synchronous method; `fs.lifecycle.commits` decides
when."""

from __future__ import annotations

import os
import re
import weakref
from typing import TYPE_CHECKING

from tierfs import layout, reserved, trackers
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import NAME_MAX, Node, StepState
from tierfs.fs.tree.dir_attributes import times_kept

if TYPE_CHECKING:
    from tierfs.fs.model.ports import ManifestReader, StepWatch
    from tierfs.fs.tree.tree_primitives import StepRemoval, TreePrimitives

NAMED_STEP_MARK = reserved.NAMED_STEP.encode()


def named_number(name: str) -> int:
    """The number of a step directory that has no step name: the last number in its name
    (`mytag_5`: 5), 0 if it holds none."""
    found = re.findall(r"[0-9]+", name)
    return int(found[-1]) if found else 0


def marked_number(path: bytes) -> int | None:
    """The number a directory's mark of a named step records (`become_named_step`), if any."""
    try:
        with open(os.path.join(path, NAMED_STEP_MARK)) as mark:
            return int(mark.read().strip())
    except (OSError, ValueError):
        return None


class StepIdentity:
    """The steps of one mount's tree (see the module docstring)."""

    def __init__(self, tree: TreePrimitives, watch: StepWatch, step_pattern: str,
                 file_step_pattern: str, *, records: ManifestReader,
                 removals: StepRemoval) -> None:
        self.tree = tree
        self._records = records
        self._removals = removals
        self._watch = watch
        self.pattern = re.compile(step_pattern)
        self.file_pattern = re.compile(file_step_pattern)
        # tracker node -> (its generation and seal when read, the step directory it named):
        # `latest` asks at every lookup, the tracker's bytes are read once per version
        self._tracked: weakref.WeakKeyDictionary[Node, tuple[object, Node | None]] = \
            weakref.WeakKeyDictionary()

    def step_number_at(self, parent: Node | None, name: bytes | str) -> int | None:
        """The step number of a directory `name` in `parent`: a step is a directory whose name
        matches the step pattern and that is not inside a step (whatever its name, a directory
        inside a step, such as Megatron's `mp_rank_00/`, is part of that step)."""
        if tree_walk.in_a_step(parent):
            return None
        return self.step_number(name)

    def single_file_step(self, parent: Node, name: bytes) -> StepState | None:
        """A regular file `name` in `parent` is a single-file step unless it is inside a step
        directory (then it is part of that step): a file step if its name carries a number
        (the file step pattern), else a loose file (no number). A name too long for its
        records directory beside it is a plain file, never persisted."""
        if (tree_walk.in_a_step(parent)
                or len(layout.records_name(name)) > NAME_MAX):
            return None
        return StepState(self.step_number(name, self.file_pattern))

    def step_number(self, name: bytes | str, pattern: re.Pattern[str] | None = None
                    ) -> int | None:
        """The step number a directory name (or with the file pattern, a file name) carries,
        or None if it is not a step name."""
        match = (pattern or self.pattern).match(os.fsdecode(name))
        if match is None:
            return None
        try:
            return int(match.group(1))
        except (IndexError, TypeError, ValueError):
            return None

    # -- trackers (tierfs.trackers) ----------------------------------------------------------

    def is_tracker(self, node: Node) -> bool:
        """Whether `node` is a tracker file: a loose file named `latest`,
        `latest_checkpointed_iteration.txt`, ... (a file inside a step is part of it)."""
        return (node.is_file and node.step is not None and node.step.number is None
                and trackers.is_tracker_name(os.fsdecode(node.name)))

    def tracked_number(self, dir_node: Node) -> int | None:
        """The number of the step that the tracker in `dir_node` names (the highest, if it
        holds several trackers), None if none names one (or its bytes are not in RAM here)."""
        numbers = []
        for name in trackers.TRACKER_NAMES:
            node = dir_node.children.get(name.encode())
            if node is None or not self.is_tracker(node) or node.remote is not None:
                continue
            key = (node.gen, node.seal, node.active_writers)
            cached = self._tracked.get(node)
            if cached is None or cached[0] != key:
                cached = self._tracked[node] = (key, self.tracked_dir(node))
            named = cached[1]
            if named is not None and named.step is not None and named.parent is dir_node \
                    and named.step.number is not None:
                numbers.append(named.step.number)
        return max(numbers, default=None)

    def tracked_dir(self, tracker: Node, *, adopt: bool = False) -> Node | None:
        """The step directory beside `tracker` that its bytes in RAM name (a name, or a step
        number), or None (no such directory, or content that names none). `adopt`: a
        directory it names by a name that is no step name becomes a step (its saver's tracker
        says it is one: `become_named_step`)."""
        try:
            with open(self.tree.backing(tracker), "rb") as f:
                named = trackers.named_step(f.read(trackers.MAX_BYTES + 1))
        except OSError:
            return None
        parent = tracker.parent
        if parent is None or named is None:
            return None
        if isinstance(named, str):
            node = parent.children.get(os.fsencode(named))
            if adopt and node is not None and node.is_dir and node.step is None:
                self.become_named_step(node)
        else:
            node = next((n for n in parent.children.values()
                         if n.is_dir and n.step is not None and n.step.number == named), None)
        return node if node is not None and node.is_dir and node.step is not None else None

    def become_named_step(self, node: Node, number: int | None = None) -> None:
        """A directory that a tracker names is a step, whatever its name (DeepSpeed's
        `save_checkpoint(dir, tag="mytag_5")`): numbered by the last number in its name (0 if
        none), recorded in it (a restart and `fs.lifecycle.recovery` find it a step), its files
        part of it from now on (not single-file steps), and being written: it commits next. Not a
        directory inside a step, nor one holding step directories. `number`: the one its
        manifest gives it (a step from another tier)."""
        if tree_walk.in_a_step(node.parent) or any(
                below.step is not None for below in tree_walk.dirs_under(node)):
            return
        if number is None:
            number = named_number(os.fsdecode(node.name))
        path = self.tree.backing(node)
        with times_kept(path):  # tierfs's mark, no change of the job's
            fd = os.open(os.path.join(path, NAMED_STEP_MARK), os.O_WRONLY | os.O_CREAT
                         | os.O_TRUNC, 0o600)
            try:
                os.write(fd, f"{number}\n".encode())
            finally:
                os.close(fd)
        for _rel, file_node in list(tree_walk.files_under(node)):
            if file_node.step is not None:
                self._removals.joins_step(file_node)
        node.step = StepState(number)
        self._watch.touch(node)

    # -- a step's identity after a rename --------------------------------------------------

    def become_step(self, node: Node, number: int) -> None:
        """A directory renamed onto a step name: a step being written (it commits once more)."""
        if node.step is None:
            node.step = StepState(number, self._records.read_manifest(self.tree.backing(node)))
        node.step.number = number
        node.step.dirty = True  # whatever it held before, it is committed only once more
        self._watch.touch(node)

    def restep(self, node: Node, number: int | None) -> None:
        """After a rename above it: a directory with a step name and no step above becomes a
        step (a directory inside a step is part of that step)."""
        if number is not None and node.step is None:
            node.step = StepState(number, self._records.read_manifest(self.tree.backing(node)))
            self._watch.touch(node)

    def stop_being_step(self, node: Node) -> None:
        """A directory stops being a step, or a file moved into a step directory stops being
        a single-file step (part of that step from now on): its files (all resident) stay,
        its manifest or records go."""
        self._removals.no_longer_step(node)

    def become_single_file(self, node: Node, state: StepState) -> None:
        """A file moved (with a directory above it) to where it is a single-file step: one
        being written again, at its new path (it commits once more)."""
        if node.step is None:
            node.step = state
        node.step.number = state.number
        node.step.dirty = True
        self._watch.touch(node)

    def touch_enclosing(self, node: Node | None, *, settled: bool = False) -> None:
        """Its steps commit `commit_idle` seconds after this (fs.lifecycle.quiet_commits), or
        sooner (`settled`: `QuietWatch.touch`)."""
        for step_node in tree_walk.enclosing_steps(node):
            self._watch.touch(step_node, settled=settled)
