"""The request relay's read of /dev/fuse (`PassthroughDevice._read_request`): right after the
relay answered a request itself it retries its read for a bounded few microseconds before it
waits on epoll (a saver's next request comes that soon), and never when it was idle; between
the retries it does the work its answers left (`after_answer`: a close's seal), and only a
GETATTR or LOOKUP of another inode is answered before that work. A pipe stands in for the
device: the read is the same readv on a non-blocking descriptor."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator

import pytest

from tierfs.fs.fuse import fuse_wire as wire
from tierfs.fs.fuse import passthrough
from tierfs.fs.fuse.passthrough import PassthroughDevice

pytestmark = pytest.mark.core


@pytest.fixture
def relay() -> Iterator[tuple[PassthroughDevice, int]]:
    """A relay whose device is the read end of a non-blocking pipe, and the write end."""
    read_end, write_end = os.pipe2(os.O_NONBLOCK)
    device = object.__new__(PassthroughDevice)  # only the read's state, no mount
    device.dev_fd = read_end
    device._request_buffer = memoryview(bytearray(64))
    device._request_buffers = [device._request_buffer]
    device._answered = False
    device._after_answers = deque()
    try:
        yield device, write_end
    finally:
        os.close(read_end)
        os.close(write_end)


def test_an_idle_relay_reads_once_and_waits(relay: tuple[PassthroughDevice, int]) -> None:
    device, _ = relay
    took = []
    for _ in range(20):
        started = time.perf_counter_ns()
        try:
            device._read_request()
        except BlockingIOError:
            took.append(time.perf_counter_ns() - started)
    # one readv, no retries: far less than the retry window (the quickest of 20, as the
    # machine may preempt any one of them)
    assert len(took) == 20 and min(took) < passthrough.SPIN_NS / 3


def test_after_an_answer_the_relay_retries_for_a_bounded_while_then_waits(
        relay: tuple[PassthroughDevice, int]) -> None:
    device, _ = relay
    device._answered = True
    started = time.perf_counter_ns()
    with pytest.raises(BlockingIOError):
        device._read_request()
    took = time.perf_counter_ns() - started
    assert passthrough.SPIN_NS <= took < 1_000_000_000  # bounded: it gave up and waits
    assert not device._answered  # the next miss, after the wait, is not retried


def test_a_request_there_is_read_at_once_whole(relay: tuple[PassthroughDevice, int]) -> None:
    device, write_end = relay
    for answered in (False, True):
        device._answered = answered
        os.write(write_end, b"request")
        assert device._read_request() == len(b"request")
        assert bytes(device._request_buffer[:7]) == b"request"


def test_the_work_an_answer_left_is_done_while_no_request_comes(
        relay: tuple[PassthroughDevice, int]) -> None:
    device, write_end = relay
    done: list[str] = []
    device._answered = True
    device.after_answer(5, lambda: done.append("flush"))
    device.after_answer(5, lambda: done.append("release"))
    with pytest.raises(BlockingIOError):
        device._read_request()
    assert done == ["flush", "release"]  # in order, before the relay waits on epoll

    # A request already there is read first: the saver waits for its answer, not the work.
    device._answered = True
    device.after_answer(5, lambda: done.append("seal"))
    os.write(write_end, b"request")
    assert device._read_request() == len(b"request")
    assert done == ["flush", "release"]
    device._finish_answered()
    assert done == ["flush", "release", "seal"]


def test_only_a_getattr_or_lookup_of_another_inode_comes_before_the_work_left(
        relay: tuple[PassthroughDevice, int]) -> None:
    device, _ = relay
    device.after_answer(5, lambda: None)  # a close of inode 5

    def message(opcode: int, nodeid: int) -> memoryview:
        return memoryview(wire.IN_HEADER.pack(40, opcode, 2, nodeid, 0, 0, 1, 0, 0))

    assert device._comes_before_pending(message(wire.Opcode.GETATTR, 1))  # its directory
    assert device._comes_before_pending(message(wire.Opcode.LOOKUP, 1))  # the next name
    assert not device._comes_before_pending(message(wire.Opcode.GETATTR, 5))  # its timeout
    unlink, rename, statfs = 10, 12, 17  # <linux/fuse.h>: requests the relay does not parse
    for opcode in (wire.Opcode.CREATE, wire.Opcode.OPEN, wire.Opcode.FLUSH,
                   wire.Opcode.RELEASE, wire.Opcode.GETXATTR, wire.Opcode.SETATTR,
                   unlink, rename, statfs):
        assert not device._comes_before_pending(message(opcode, 1)), opcode
