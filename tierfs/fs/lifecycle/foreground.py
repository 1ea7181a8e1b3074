"""The mount's users first: background work that competes with their requests for the daemon's
loop and its GIL waits while those requests keep coming.

A step of 10,000 small files uploads as 10,000 PUTs, each about 1.5-2 ms of boto3's Python
under the GIL, beside the loop that answers FUSE requests: an `ls -l` of the step while it
uploaded took 6-14x tmpfs's time against 2-4x once it was persisted (doc/BENCHMARKS.md). So
each request the daemon answers is noted here (`request`), and the uploader asks before each
file (`wait_quiet`) for a pause of QUIET seconds in them. It waits at most MOST_WAIT per
file: a mount that is never quiet (a job reading through it all the time) slows its uploads
down, and never stops them. Past that wait, the waiters go one at a time, BUSY_PASSES per
MOST_WAIT, however many wait: the uploader's 32 workers for small files each went after
MOST_WAIT, 64 PUTs a second beside a save (a 10,000-file save beside the previous step's
upload took 13-22 % longer than alone, against 0-5 % with 4 workers; ad hoc).

A save under passthrough makes almost no requests (the kernel writes its files without the
daemon), so a file being written (`writing`: `Tree.writing`) also counts as the users not
being done: the next file of an upload starts once the save's files are closed, or after
MOST_WAIT."""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

QUIET = 0.05  # seconds without a request: the users are done for now
MOST_WAIT = 0.5  # the longest one piece of background work waits for such a pause
# Pieces of background work that go per MOST_WAIT while the users are not done: as many as
# the uploader's workers did when they were 4.
BUSY_PASSES = 4


class Foreground:
    """When the mount's users last made a request (see the module docstring)."""

    def __init__(self, writing: Callable[[], bool] = lambda: False) -> None:
        self._writing = writing  # whether a file of the mount is being written (a save)
        self._last = -math.inf
        self._next_pass = -math.inf  # trio time: when a waiter past its wait may go next
        self.waited = 0.0  # seconds background work waited for the users (status, tests)

    def request(self) -> None:
        """A request of a user's is being answered (the daemon's loop)."""
        self._last = trio.current_time()

    async def wait_quiet(self) -> None:
        """Return once no request came for QUIET seconds and no file is being written, or
        after MOST_WAIT, when no other waiter went so less than MOST_WAIT / BUSY_PASSES ago."""
        started = trio.current_time()
        deadline = started + MOST_WAIT
        while True:
            now = trio.current_time()
            idle = now - self._last
            if idle >= QUIET and not self._writing():
                break
            turn = max(deadline, self._next_pass)  # when it may go with the users busy
            if now >= turn:
                self._next_pass = now + MOST_WAIT / BUSY_PASSES
                break
            # until the requests have paused long enough; while only a file is being written,
            # look again a QUIET later
            await trio.sleep(min(QUIET - idle if idle < QUIET else QUIET, turn - now))
        self.waited += trio.current_time() - started
