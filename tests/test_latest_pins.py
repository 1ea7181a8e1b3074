"""`latest` per process (tierfs.fs.model.latest_pins), driven by a clock the test moves."""

from __future__ import annotations

import os

import pytest

from tierfs.fs.model.latest_pins import GRACE, PLANNING, THROUGH_LINK, LatestPins

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

    def newer() -> bytes:
        return b"step_2"

    assert not pins.starts_again(me, 7, b"step_1", b".metadata", newer)  # a shard is open
    pins.closed(shard)
    assert not pins.starts_again(me, 7, b"step_1", b"__0_0.distcp", newer)
    assert not pins.starts_again(os.getppid(), 7, b"step_1", b".metadata", newer)  # another
    assert not pins.starts_again(me, 7, b"step_1", b".metadata", lambda: b"step_1")  # not older
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_1"
    assert pins.starts_again(me, 7, b"step_1", b".metadata", lambda: b"step_2")
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_2"


def test_an_open_answered_long_after_it_was_asked_came_through_the_link() -> None:
    """A load's `.metadata` that took longer than the grace to come from a peer or the store
    is still the load's first file, and the pin holds while the open waits: the shards come
    from its step, and the process's next load through the link starts anew on the newest
    step (before, the slow open counted as one by the step's own name, or found its pin
    lapsed meanwhile, the shards' quick opens pinned a step with no load begun, and the next
    load of the process read the older step)."""
    clock = Clock()
    pins = LatestPins(clock)
    me, committed = os.getpid(), {b"step_1", b"step_2"}
    alive = committed.__contains__
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_1"
    metadata = pins.opened(me, 7, b"step_1", b".metadata")  # asked now
    assert metadata is not None and metadata.load_started
    clock.now += 2 * GRACE  # the open waits for the file; another process looks at the link
    assert pins.resolve(os.getppid(), 7, b"step_2", alive) == b"step_2"
    pins.closed(metadata)
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_1"
    shard = pins.opened(me, 7, b"step_1", b"__0_0.distcp")
    assert shard is not None
    pins.closed(shard)
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_1"  # within the grace
    assert pins.starts_again(me, 7, b"step_1", b".metadata", lambda: b"step_2")  # the next load
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_2"
    clock.now += 2 * THROUGH_LINK
    assert pins.opened(me, 7, b"step_2") is None  # asked long after the link's answer


def test_the_one_file_a_load_read_opened_again_starts_a_new_load() -> None:
    """An evaluator polling `latest/model.pt`: its load read that one file, so opening it
    again with nothing of the step open is a new load; a load that read several files is
    not restarted by opening one of them again (HF reads trainer_state.json twice)."""
    clock = Clock()
    pins = LatestPins(clock)
    me, committed = os.getpid(), {b"step_1", b"step_2"}
    alive = committed.__contains__
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_1"
    model = pins.opened(me, 7, b"step_1", b"model.pt")
    assert model is not None
    pins.closed(model)
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_1"
    assert not pins.starts_again(me, 7, b"step_1", b"config.json", lambda: b"step_2")
    assert pins.starts_again(me, 7, b"step_1", b"model.pt", lambda: b"step_2")
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_2"
    for name in (b"trainer_state.json", b"model.safetensors"):
        opened = pins.opened(me, 7, b"step_2", name)
        assert opened is not None
        pins.closed(opened)
    committed.add(b"step_3")
    assert pins.resolve(me, 7, b"step_3", alive) == b"step_2"
    assert not pins.starts_again(me, 7, b"step_2", b"trainer_state.json", lambda: b"step_3")
    assert pins.resolve(me, 7, b"step_3", alive) == b"step_2"


def test_a_load_that_failed_holds_nothing() -> None:
    """A load whose shard could not be read (its holder cut off, the store away) failed: the
    process sees the newest step at once, also at a look at the link (before, it saw the
    step it failed to load for the grace)."""
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
    pins.closed(shard)
    pins.failed(shard)  # the shard's open failed
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_2"
    shard = pins.opened(me, 7, b"step_2", b"__0_0.distcp")
    assert shard is not None
    assert pins.resolve(os.getppid(), 7, b"step_1", alive) == b"step_1"
    other = pins.opened(os.getppid(), 7, b"step_1", b"__1_0.distcp")
    assert other is not None
    pins.failed(other)  # another process's failure: nothing here
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_2"
    pins.failed(shard)  # a read of the open shard failed
    pins.closed(shard)
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_1"


def test_a_load_planning_for_longer_than_the_grace_still_reads_its_step() -> None:
    """DCP reads `.metadata`, closes it, and plans with every other rank before it opens a
    shard: a rank that waits longer than GRACE there (a slow rank, a big job) still reads the
    shards of the step whose `.metadata` it read. Before, the pin lapsed: the shards came from
    the newer step (one load, two checkpoints), and the process's next load, its load not
    begun at `.metadata` as far as the pin knew, read the older step."""
    clock = Clock()
    pins = LatestPins(clock)
    me, committed = os.getpid(), {b"step_1", b"step_2"}
    alive = committed.__contains__
    assert pins.resolve(me, 7, b"step_1", alive) == b"step_1"
    metadata = pins.opened(me, 7, b"step_1", b".metadata")
    assert metadata is not None
    pins.closed(metadata)
    clock.now += 3 * GRACE  # the ranks plan; step_2 commits meanwhile
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_1"
    shard = pins.opened(me, 7, b"step_1", b"__0_0.distcp")
    assert shard is not None
    pins.closed(shard)
    clock.now += 2 * GRACE  # once the shards are read, the grace is the usual one
    assert pins.resolve(me, 7, b"step_2", alive) == b"step_2"
    metadata = pins.opened(me, 7, b"step_2", b".metadata")
    assert metadata is not None
    pins.closed(metadata)
    clock.now += 2 * PLANNING  # a `.metadata` read alone, long ago, holds nothing for good
    assert pins.resolve(me, 7, b"step_3", committed.__contains__) == b"step_3"
