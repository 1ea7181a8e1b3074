"""`latest` per process (tierfs.fs.model.latest_pins), driven by a clock the test moves."""

from __future__ import annotations

import os

import pytest

from tierfs.fs.model.latest_pins import GRACE, THROUGH_LINK, LatestPins

pytestmark = pytest.mark.core


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_process_keeps_its_target_while_reading_and_for_a_grace_after() -> None:
    clock = Clock()
    pins = LatestPins(clock)
    me, committed = os.getpid(), {b"step_1", b"step_2"}
    alive = committed.__contains__
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_1"
    pin = pins.opened(me, 7, b"step_1")
    assert pin is not None
    clock.now += 10 * GRACE  # a long read of one file: the pin holds while it is open
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_1"
    pins.closed(pin)
    clock.now += GRACE / 2
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_1"
    clock.now += 2 * GRACE
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_2"


def test_a_process_that_only_looks_at_the_link_always_sees_the_newest_step() -> None:
    pins = LatestPins(Clock())
    me, committed = os.getpid(), {b"step_1", b"step_2"}
    assert pins.resolve(me, 7, b"step_1", committed.__contains__) == b"step_1"
    assert pins.resolve(me, 7, b"step_2", committed.__contains__) == b"step_2"


def test_a_file_opened_by_the_steps_own_name_pins_nothing() -> None:
    clock = Clock()
    pins = LatestPins(clock)
    me, committed = os.getpid(), {b"step_1", b"step_2"}
    assert pins.resolve(me, 7, b"step_1", committed.__contains__) == b"step_1"
    clock.now += 2 * THROUGH_LINK  # long after the link was looked at: not through it
    assert pins.opened(me, 7, b"step_1") is None
    assert pins.resolve(me, 7, b"step_2", committed.__contains__) == b"step_2"


def test_a_pinned_step_that_is_gone_gives_way_and_other_directories_are_apart() -> None:
    pins = LatestPins(Clock())
    me, committed = os.getpid(), {b"step_1"}
    assert pins.resolve(me, 7, b"step_1", committed.__contains__) == b"step_1"
    assert pins.opened(me, 7, b"step_1") is not None
    assert pins.resolve(me, 8, b"step_9", committed.__contains__) == b"step_9"
    committed.clear()
    assert pins.resolve(me, 7, b"step_2", committed.__contains__) == b"step_2"
    assert pins.opened(me, 7, b"step_1") is None  # a file of a step it no longer names


def test_the_first_file_of_a_load_opened_again_starts_a_new_load() -> None:
    """A DCP load opens `.metadata` once, first: opened again through the link with nothing
    of the step open, a new load begins, and it may see the newest step; opened again while
    a shard is open, or by a process that never read it, it is the same load."""
    clock = Clock()
    pins = LatestPins(clock)
    me, committed = os.getpid(), {b"step_1", b"step_2"}
    alive = committed.__contains__
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_1"
    metadata = pins.opened(me, 7, b"step_1", b".metadata")
    assert metadata is not None
    pins.closed(metadata)
    shard = pins.opened(me, 7, b"step_1", b"__0_0.distcp")
    assert shard is not None
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_1"  # step_2 committed mid-load
    assert not pins.starts_again(me, 7, b"step_1", b".metadata", b"step_2")  # a shard is open
    pins.closed(shard)
    assert not pins.starts_again(me, 7, b"step_1", b"__0_0.distcp", b"step_2")
    assert not pins.starts_again(os.getppid(), 7, b"step_1", b".metadata", b"step_2")  # another
    assert not pins.starts_again(me, 7, b"step_1", b".metadata", b"step_1")  # not older
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_1"
    assert pins.starts_again(me, 7, b"step_1", b".metadata", b"step_2")
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_2"


def test_an_open_answered_long_after_it_was_asked_came_through_the_link() -> None:
    """A load's `.metadata` that took seconds to come from a peer or the store is still the
    load's first file: the process's next load through the link starts anew on the newest
    step (before, the slow open counted as one by the step's own name, the shards' quick ones
    pinned the step, and every later load of the process read the older step)."""
    clock = Clock()
    pins = LatestPins(clock)
    me, committed = os.getpid(), {b"step_1", b"step_2"}
    alive = committed.__contains__
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_1"
    asked = clock.now
    clock.now += 5 * THROUGH_LINK  # the open waited for the file
    metadata = pins.opened(me, 7, b"step_1", b".metadata", asked_at=asked)
    assert metadata is not None and metadata.load_started
    pins.closed(metadata)
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_1"
    shard = pins.opened(me, 7, b"step_1", b"__0_0.distcp")
    assert shard is not None
    pins.closed(shard)
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_1"  # within the grace
    assert pins.starts_again(me, 7, b"step_1", b".metadata", b"step_2")  # the next load
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_2"
    clock.now += 5 * THROUGH_LINK
    assert pins.opened(me, 7, b"step_2", asked_at=clock.now - 2 * THROUGH_LINK) is None
