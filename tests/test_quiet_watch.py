"""The watch of steps being written (`fs.lifecycle.quiet_watch.QuietWatch`): which steps are due
to commit by themselves, found without a scan of every watched step (a run dir of thousands of
loose files being written made each change cost a pass over all of them)."""

from __future__ import annotations

import math
import stat

import pytest

from tierfs.fs.lifecycle.quiet_watch import QuietWatch
from tierfs.fs.model.nodes import Node, StepState

pytestmark = pytest.mark.core


def steps(count: int) -> tuple[Node, list[Node]]:
    parent = Node(1, stat.S_IFDIR, b"run", None)
    made = []
    for number in range(count):
        node = Node(number + 2, stat.S_IFDIR, b"step_%d" % number, parent)
        node.step = StepState(number)
        parent.children[node.name] = node
        made.append(node)
    return parent, made


def test_due_steps_come_in_deadline_order_once_each(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    clock = [100.0]
    monkeypatch.setattr("tierfs.fs.lifecycle.quiet_commits.time.monotonic", lambda: clock[0])
    watch = QuietWatch(commit_idle=5.0)
    _parent, (a, b, c) = steps(3)
    assert watch.next_due() == math.inf and list(watch.due_steps(1e9)) == []
    watch.touch(a)
    clock[0] = 101.0
    watch.touch(b)
    clock[0] = 102.0
    watch.touch(c)
    watch.touch(a)  # written again: due 5 s after this change, not the first one
    assert watch.next_due() == 106.0  # b's
    assert list(watch.due_steps(106.5)) == [b]
    del watch.due[b]  # committed by the caller
    assert watch.next_due() == 107.0
    assert list(watch.due_steps(107.0)) == [c, a]
    del watch.due[c], watch.due[a]
    assert watch.next_due() == math.inf and list(watch.due_steps(1e9)) == []


def test_a_newer_step_makes_the_older_ones_due_at_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("tierfs.fs.lifecycle.quiet_commits.time.monotonic", lambda: 50.0)
    watch = QuietWatch(commit_idle=5.0)
    _parent, (old, new) = steps(2)
    watch.touch(old)
    watch.touch(new)
    watch.rearm()
    watch.step_started(new)
    assert watch.wake.is_set() and watch.next_due() == 0.0
    assert list(watch.due_steps(50.0)) == [old]
    watch.touch(old)  # still written (an open file): it waits for its own deadline again
    assert list(watch.due_steps(50.0)) == [] and watch.next_due() == 55.0


def test_thousands_of_watched_steps_each_come_up_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    clock = [0.0]
    monkeypatch.setattr("tierfs.fs.lifecycle.quiet_commits.time.monotonic", lambda: clock[0])
    watch = QuietWatch(commit_idle=1.0)
    _parent, made = steps(5000)
    for index, node in enumerate(made):
        clock[0] = index / 1000
        watch.touch(node)
        watch.touch(node)  # every file of a step touches it: one heap entry still
    assert len(watch._deadlines) == len(made)
    clock[0] = 10.0
    due = list(watch.due_steps(clock[0]))
    assert due == made
