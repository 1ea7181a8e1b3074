"""The request relay's read of /dev/fuse (`PassthroughDevice._read_request`): right after the
relay answered a request itself it retries its read for a bounded few microseconds before it
waits on epoll (a saver's next request comes that soon), and never when it was idle. A pipe
stands in for the device: the read is the same readv on a non-blocking descriptor."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

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
