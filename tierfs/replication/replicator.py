"""Sending committed steps to the next K live nodes on the ring, and restoring K copies when a
holder is lost (every holder checks its steps when membership changes).

One step at a time per target, each file streamed in chunks from the RAM store's immutable
committed objects, one chunk in flight (the peer's OK is the backpressure); the manifest goes
last, and a step counts as replicated on a peer only once that peer has verified every file and
answered the manifest. Failures retry while the step is still the current version.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable

import trio

from tierfs import manifest as mf
from tierfs.observe import Events
from tierfs.replication import protocol as proto
from tierfs.replication.membership import Membership
from tierfs.retry import POLICY
from tierfs.step_queue import StepQueue

log = logging.getLogger(__name__)

# The one retry policy, pausing at most RETRY_DELAY: a membership change (a peer back, a new
# node) ends the pause at once anyway, and each failure is logged by _send_step.
RETRY_DELAY = 2.0
RETRIES = POLICY.capped(RETRY_DELAY)


class Replicator:
    def __init__(
        self,
        membership: Membership,
        replicas: int,
        object_path: Callable[[str], str],
        *,
        is_current: Callable[[mf.StepManifest], bool],
        holders: Callable[[mf.StepManifest], set[str]],
        on_replicated: Callable[[mf.StepManifest, str], None],
        events: Events | None = None,
    ) -> None:
        self.membership = membership
        self._events = events or Events()
        self.replicas = replicas
        self._object_path = object_path
        self._is_current = is_current
        self._holders = holders
        self._on_replicated = on_replicated
        self.queue = StepQueue()
        self._threads = trio.CapacityLimiter(2)

    def submit(self, manifest: mf.StepManifest) -> None:
        if self.replicas > 0:
            self.queue.put(manifest)

    async def run(self) -> None:
        await self.queue.serve(self._replicate_or_log)

    async def _replicate_or_log(self, manifest: mf.StepManifest) -> None:
        try:
            await self._replicate(manifest)
        except Exception:  # never let one step stop the replicator
            log.exception("replication of %s failed", manifest.path)

    async def _replicate(self, manifest: mf.StepManifest) -> None:
        """Send the step until it has K live copies or is no longer the current version."""
        if not all(os.path.exists(self._object_path(e.xxh3)) for e in manifest.files):
            # a multi-node step: its other files stay with the nodes that wrote them
            log.info("%s v%d is held here in part: not replicated as a whole", manifest.path,
                     manifest.version)
            return
        failures = 0
        while self._is_current(manifest):
            holders = self._holders(manifest)
            live = 1 + sum(self.membership.is_up(h) for h in holders)
            wanted = self.replicas + 1 - live
            targets = [n for n in self.membership.successors(len(self.membership.members))
                       if n not in holders][:max(0, wanted)]
            if not targets:
                break
            results = []
            for target in targets:
                results.append(await self._send_step(manifest, target))
            if all(results):
                failures = 0
                continue  # the holders changed: check whether more copies are due
            failures += 1
            await RETRIES.pause(failures, wake=self.membership.changed)

    async def _send_step(self, manifest: mf.StepManifest, target: str) -> bool:
        started = time.monotonic()
        try:
            async with self.membership.channel(target) as channel:
                for entry in manifest.files:
                    await self._send_file(channel, manifest, entry)
                await channel.request("PUT_MANIFEST", manifest=mf.encode(manifest))
        except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
            log.warning("replication of %s v%d to %s failed, will retry: %s", manifest.path,
                        manifest.version, target, exc or "timed out")
            return False
        self._events.replicated(manifest, target, time.monotonic() - started)
        self._on_replicated(manifest, target)
        return True

    async def _send_file(self, channel, manifest: mf.StepManifest,  # type: ignore[no-untyped-def]
                         entry: mf.FileEntry) -> None:
        """The file's chunks as PUTs, sent from the RAM store's object by the kernel
        (sendfile), several in flight (channel.pipeline): the peer's OKs pace the sender."""
        fd = os.open(self._object_path(entry.xxh3), os.O_RDONLY)

        def put(offset: int) -> Callable[[], Awaitable[None]]:
            return lambda: channel.send_file(
                "PUT", fd, offset, min(mf.CHUNK_SIZE, entry.size - offset), path=manifest.path,
                name=entry.name, xxh3=entry.xxh3, size=entry.size, offset=offset)

        try:
            await channel.pipeline(map(put, range(0, max(entry.size, 1), mf.CHUNK_SIZE)), "OK")
        finally:
            os.close(fd)
