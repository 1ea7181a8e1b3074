"""Seals off the writer's path: a file's xxh3-128 is computed after its last writer closed it,
in the background, so that the close returns at once and the saver goes on to its next file
while the previous one is hashed.

The promises stay those of a seal taken at close (`fs.tree`, doc/SEMANTICS.md):

* A seal describes the bytes it was computed from. It is kept only if no writer became active
  while the hash ran (`Node.gen` did not move: every write through the daemon, and every open
  for writing under passthrough, moves it) and the backing file's inode, size and mtime are the
  same before and after the hash (`Seal.describes`: the kernel writes passthrough files without
  the daemon). A commit checks the seals of files still open for writing once more.
* Whoever needs a seal (a commit, `user.tierfs.xxh3`) joins the hash running for the file's
  current generation, or computes it itself when none runs. A step commits only with every file
  sealed, and only committed steps are replicated, uploaded or served to other nodes, so nothing
  leaves the node unverified.
* At most `HASH_THREADS` hashes run at once, in worker threads; the rest wait their turn (trio
  tasks owned by the mount's `fs.background.Background`, cancelled at unmount).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import trio

from tierfs import manifest as mf
from tierfs.fs.nodes import FsError, Node, RemoteAttrs, Seal
from tierfs.fs.ports import Spawner

log = logging.getLogger(__name__)

# Hash threads: two keep up with a saver on this project's two-core machine (xxh3 runs at
# memory speed; the cost is re-reading the file from tmpfs) without taking both cores from it.
HASH_THREADS = 2
# Files up to this size are hashed on the daemon's loop, not in a thread: handing a hash to a
# thread and back costs more than hashing 64 KiB (about 10 us), and a step of 10,000 small
# files paid that hand-off once per file.
INLINE_HASH_BYTES = 64 << 10


class Sealing:
    """The seals of one mount's files (see the module docstring)."""

    def __init__(self, backing: Callable[[Node], bytes],
                 stat: Callable[[Node], os.stat_result | RemoteAttrs],
                 spawner: Spawner | None = None, *, threads: int = HASH_THREADS) -> None:
        self._backing = backing  # `Tree.backing`
        self._stat = stat  # `Tree.stat`
        self._limiter = trio.CapacityLimiter(threads)
        self._running: dict[Node, tuple[int, trio.Event]] = {}
        self._queued: dict[Node, int] = {}  # started, not yet running: node -> its generation
        # The owner of background hashes; without one, files are sealed when first needed.
        self.spawner = spawner

    def describes_file(self, node: Node) -> bool:
        """Whether the node's seal still describes its backing file (see `Seal`)."""
        if node.seal is None:
            return False
        try:
            st = self._stat(node)
        except (FsError, OSError):
            return False
        return isinstance(st, os.stat_result) and node.seal.describes(st)

    def stale(self, files: list[tuple[str, Node]]) -> list[Node]:
        """Files whose bytes may have changed behind their seal: only a file open for writing
        can change without the daemon seeing it (passthrough), so only those are looked at."""
        return [node for _rel, node in files
                if any(h.writable for h in node.handles) and not self.describes_file(node)]

    def start(self, node: Node) -> None:
        """The last writer of `node` is done: seal it in the background."""
        if self.spawner is not None:
            self._queued[node] = node.gen
            self.spawner.spawn(self._in_background, node, node.gen)

    def pending(self, node: Node) -> bool:
        """Whether a hash of the node's current bytes is running or about to run (a file
        whose hash is only queued is not hashed a second time at its RELEASE)."""
        running = self._running.get(node)
        return ((running is not None and running[0] == node.gen)
                or self._queued.get(node) == node.gen)

    async def seal(self, node: Node) -> None:
        """Seal `node` (join the hash of its current generation if one runs). The seal may
        still be absent afterwards: a writer came back meanwhile (callers check `node.seal`)."""
        running = self._running.get(node)
        if running is not None and running[0] == node.gen:
            await running[1].wait()
            return
        gen = node.gen
        done = trio.Event()
        self._running[node] = (gen, done)
        try:
            await self._hash(node, gen)
        finally:
            if self._running.get(node, (gen, None))[1] is done:
                del self._running[node]
            done.set()

    async def _in_background(self, node: Node, gen: int) -> None:
        if self._queued.get(node) == gen:
            del self._queued[node]
        if node.gen != gen or node.seal is not None or node.active_writers:
            return  # written again since (its next close seals it), or sealed by a commit
        try:
            await self.seal(node)
        except (FsError, OSError) as exc:  # removed or evicted meanwhile: nothing to seal
            log.debug("background seal of inode %d skipped: %s", node.ino, exc)

    async def _hash(self, node: Node, gen: int) -> None:
        """Hash the node's content in a thread; keep the seal only if nothing wrote meanwhile."""
        try:
            fd = os.open(self._backing(node), os.O_RDONLY)
        except FsError:
            return
        try:
            before = os.fstat(fd)
            if before.st_size <= INLINE_HASH_BYTES:
                digest = mf.hash_fd(fd)
            else:
                digest = await trio.to_thread.run_sync(mf.hash_fd, fd, limiter=self._limiter)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        seal = Seal(digest, after.st_ino, after.st_mtime_ns)
        if (node.gen == gen and node.active_writers == 0 and seal.describes(before)
                and seal.describes(after)):
            node.seal = seal
