"""A queue of committed steps for one background worker (uploads, replication): one entry per
step path, where a newer version replaces an older one still waiting and late events never put
an older version back, so the worker never does stale work. The version being worked on, put
again meanwhile, is worked on once more after the round running: what made it come again may
have come too late for that round."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import trio

from tierfs import manifest as mf


class StepQueue:
    def __init__(self) -> None:
        self.pending: dict[str, mf.StepManifest] = {}
        self._send, self._receive = trio.open_memory_channel[str](math.inf)
        self._settled = trio.Event()  # set (and replaced) whenever a step's work ends
        self._working: mf.StepManifest | None = None  # the version `serve`'s work runs on
        self._again = False  # ... put again meanwhile: once more after this round

    def put(self, manifest: mf.StepManifest) -> None:
        queued = manifest.path in self.pending
        if queued and self.pending[manifest.path].version > manifest.version:
            return
        if manifest is self._working:
            self._again = True
        self.pending[manifest.path] = manifest
        if not queued:
            self._send.send_nowait(manifest.path)

    async def serve(self, work: Callable[[mf.StepManifest], Awaitable[None]]) -> None:
        """Run `work` on each queued step, one at a time; `work` must not raise."""
        async for path in self._receive:
            manifest = self.pending.get(path)
            if manifest is not None:
                self._working, self._again = manifest, False
                try:
                    await work(manifest)
                finally:
                    self._working = None
            if self.pending.get(path) is manifest and not self._again:
                del self.pending[path]
                self._settled.set()
                self._settled = trio.Event()
            elif path in self.pending:  # a newer version came, or this one again: once more
                self._send.send_nowait(path)

    async def settled(self, path: str) -> None:
        """Until no version of `path` waits or is being worked on."""
        while path in self.pending:
            await self._settled.wait()
