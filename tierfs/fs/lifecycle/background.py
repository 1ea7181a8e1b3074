"""The owner of the file system's background work: evictions from RAM, pressure relief,
read-ahead of fetched chunks, removal of steps that left the last tier.

Work spawned before the daemon starts the owner (start-up adopts steps and may evict) waits
until it does. The daemon runs `Background.run` in its nursery, so every task is cancelled at
unmount with the rest of the daemon, instead of running on as a system task of the trio run.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger(__name__)

Work = Callable[..., Awaitable[object]]


class Background:
    """Runs background work in a nursery of its own (see the module docstring)."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None
        self._waiting: list[tuple[Work, tuple[object, ...]]] = []

    @property
    def running(self) -> bool:
        return self._nursery is not None

    def spawn(self, work: Work, *args: object) -> None:
        """Run `work(*args)` in the background; a failure is logged, never fatal."""
        if self._nursery is None:
            self._waiting.append((work, args))
        else:
            self._nursery.start_soon(self._guarded, work, *args)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the background work until cancelled (the daemon's nursery, at unmount)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                waiting, self._waiting = self._waiting, []
                for work, args in waiting:
                    nursery.start_soon(self._guarded, work, *args)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    @staticmethod
    async def _guarded(work: Work, *args: object) -> None:
        try:
            await work(*args)
        except Exception:
            log.exception("background work %s failed", getattr(work, "__name__", work))
