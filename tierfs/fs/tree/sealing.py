"""Seals off the writer's path: a file's xxh3-128 is computed after its last writer closed it,
in the background, so that the close returns at once and the saver goes on to its next file
while the previous one is hashed.

The promises stay those of a seal taken at close (`fs.tree.tree`, doc/SEMANTICS.md):

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
  tasks owned by the mount's `fs.lifecycle.background.Background`, cancelled at unmount).
* A big file (HASH_AT_COMMIT bytes or more) in a step directory is not hashed at its close but
  when its step commits (or anyone else needs its seal: `user.tierfs.xxh3`, the cluster's
  record of it): re-reading it while the saver still writes the step's other files takes
  memory bandwidth and CPU from the saver, and a commit no longer waits for hashes. Until then
  its hash counts as pending (`pending`), as a queued one does.
* A commit made before its files' hashes are in (`fs.model.pending_commits`) gets them from
  `hash_committed`: a file's own seal when it is still the committed bytes, else a hash of its
  snapshot; no byte is hashed twice for it.
* A hash steps aside for a save in progress (`writing`: a file of the mount is being written,
  under passthrough open for writing, one of them begun within `fs.tree.tree.SAVE_WINDOW`):
  a hash thread pauses after each chunk it hashed for YIELD_RATIO times as long as that chunk
  took, so hashes run at about 1 / (1 + YIELD_RATIO) of their speed beside a saver, and at
  full speed otherwise. Under passthrough the daemon does not see the writes themselves, only
  the opens and closes: a writer open is the one sign of a save it has. The hashes are never
  stopped: during a save a step is hashed, and so uploaded and replicated, at most
  1 + YIELD_RATIO times later (a log kept open alone stops counting); so are the hashes a
  `tierfs commit` or a quiet commit waits for while another file is written. `yielded` counts
  the seconds paused. Per-thread nice would not do this: the daemon runs in a session of its
  own, and with the kernel's autogroups a session's threads share one weight against the
  saver's, whatever their nice.
* `hold` takes every hash thread until `release` (the control socket's `hold_hashes`, for
  tests that need hashing observably slow: real hashes, merely late).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from tierfs import manifest as mf
from tierfs.fs.model.nodes import FsError, Node, RemoteAttrs, Seal

if TYPE_CHECKING:
    from tierfs.fs.model.ports import Spawner

log = logging.getLogger(__name__)

# Hash threads: two keep up with a saver on this project's two-core machine (xxh3 runs at
# memory speed; the cost is re-reading the file from tmpfs) without taking both cores from it.
HASH_THREADS = 2
# Files in a step directory at least this big are hashed when their step commits (see the
# module docstring); smaller ones at once (cheap, and a step of thousands of small files
# commits without a hash left to wait for).
HASH_AT_COMMIT = 1 << 20
# Files up to this size are hashed on the daemon's loop, not in a thread: handing a hash to a
# thread and back costs more than hashing 64 KiB (about 10 us), and a step of 10,000 small
# files paid that hand-off once per file.
INLINE_HASH_BYTES = 64 << 10
# While a file is being written, a hash thread pauses this many times as long as its last
# chunk took (see the module docstring): beside a saver a hash runs at a tenth of its speed.
# The 16-file save of doc/BENCHMARKS.md beside the previous step's hashes: 0.72x tmpfs with
# no pause, 0.82x with 4, 0.86x with 9.
YIELD_RATIO = 9


class Sealing:
    """The seals of one mount's files (see the module docstring)."""

    def __init__(self, backing: Callable[[Node], bytes],
                 stat: Callable[[Node], os.stat_result | RemoteAttrs],
                 spawner: Spawner | None = None, *, threads: int = HASH_THREADS,
                 settled: Callable[[Node], None] = lambda node: None,
                 writing: Callable[[], bool] = lambda: False) -> None:
        self._backing = backing  # `Tree.backing`
        self._stat = stat  # `Tree.stat`
        self._settled = settled  # `Tree.file_settled`: a seal came in with no writer left
        self._limiter = trio.CapacityLimiter(threads)
        self._running: dict[Node, tuple[int, trio.Event]] = {}
        self._queued: dict[Node, int] = {}  # started, not yet running: node -> its generation
        # Hashed when needed: node -> its generation; weak, so a file removed before its
        # step commits is not kept for it.
        self._at_commit: weakref.WeakKeyDictionary[Node, int] = weakref.WeakKeyDictionary()
        # The owner of background hashes; without one, files are sealed when first needed.
        self.spawner = spawner
        self._threads = threads
        self._holders: list[object] = []  # `hold`'s borrowers of the limiter's tokens
        self._writing = writing  # whether a file of the mount is being written (a save)
        self._yielded_lock = threading.Lock()
        self.yielded = 0.0  # seconds hash threads paused for a save in progress (status, tests)

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
                if node.open_for_writing and not self.describes_file(node)]

    def start(self, node: Node, *, at_commit: bool = False, size: int | None = None,
              opened: tuple[int, os.stat_result] | None = None) -> None:
        """The last writer of `node` is done: seal it in the background, or (`at_commit`)
        when it is needed (see the module docstring). A file of `size` up to
        INLINE_HASH_BYTES is sealed at once, on the loop: its hash there costs less than a
        task of its own (a step of 10,000 small files paid a task, its start and its turns of
        the loop, per file); through the writer's descriptor of its backing file and its fstat
        (`opened`), where given, instead of an open of its own."""
        if at_commit:
            self._at_commit[node] = node.gen
            return
        self._at_commit.pop(node, None)
        if self.spawner is not None and size is not None and size <= INLINE_HASH_BYTES \
                and not self._under_way(node):
            self._seal_now(node, node.gen, opened)
            return
        if self.spawner is not None:
            self._queued[node] = node.gen
            self.spawner.spawn(self._in_background, node, node.gen)

    def pending(self, node: Node) -> bool:
        """Whether a hash of the node's current bytes is running or about to run (a file
        whose hash is only queued is not hashed a second time at its RELEASE)."""
        return self._under_way(node) or self._at_commit.get(node) == node.gen

    def _under_way(self, node: Node) -> bool:
        """Whether a hash of the node's current bytes runs or is queued to run."""
        running = self._running.get(node)
        return ((running is not None and running[0] == node.gen)
                or self._queued.get(node) == node.gen)

    def start_all(self, nodes: list[Node]) -> None:
        """Hash these files in the background (a commit then joins each hash in turn, all
        the hash threads at work) unless sealed, being written, or hashed already."""
        for node in nodes:
            if (node.seal is None and not node.active_writers and node.remote is None
                    and not self._under_way(node)):
                self.start(node)

    async def seal(self, node: Node) -> None:
        """Seal `node` (join the hash of its current generation if one runs). The seal may
        still be absent afterwards: a writer came back meanwhile (callers check `node.seal`)."""
        running = self._running.get(node)
        if running is not None and running[0] == node.gen:
            await running[1].wait()
            return
        gen = node.gen
        self._at_commit.pop(node, None)
        done = trio.Event()
        self._running[node] = (gen, done)
        try:
            await self._hash(node, gen)
        finally:
            if self._running.get(node, (gen, None))[1] is done:
                del self._running[node]
            done.set()

    async def hash_committed(self, node: Node, gen: int, snapshot: bytes) -> mf.Digest:
        """The digest of `snapshot`, a pending commit's copy of `node` (its generation `gen`
        then): the node's seal, joining its hash, while the node is still the snapshot's
        inode at that generation (copy on write keeps that inode unwritten); else the
        snapshot hashed itself. A seal the node already has that describes the snapshot is
        taken as it is: in a cluster every file of a step is sealed at its close, for its
        record in etcd (`ClusterWrites.note_sealed`), and hashing it again here put a second
        pass over every byte between the saver's return and the first copy to a peer."""
        st = os.lstat(snapshot)
        ino = st.st_ino
        if node.gen == gen and node.seal is not None and node.seal.describes(st):
            return node.seal.digest
        if node.gen == gen:
            with contextlib.suppress(FsError, OSError):  # removed: the snapshot is hashed
                await self.seal(node)
            seal = node.seal
            if node.gen == gen and seal is not None and seal.backing_ino == ino:
                return seal.digest
        fd = os.open(snapshot, os.O_RDONLY)
        try:
            return await self._hash_fd(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    async def hold(self) -> None:
        """Take every hash thread: no hash runs until `release` (see the module docstring)."""
        while len(self._holders) < self._threads:
            borrower = object()
            await self._limiter.acquire_on_behalf_of(borrower)
            self._holders.append(borrower)

    def release(self) -> None:
        while self._holders:
            self._limiter.release_on_behalf_of(self._holders.pop())

    async def _hash_fd(self, fd: int, size: int) -> mf.Digest:
        """`mf.hash_fd` of a file of `size` bytes: on the loop up to INLINE_HASH_BYTES, else in
        a hash thread (the caller keeps `fd` open until it returns)."""
        if size <= INLINE_HASH_BYTES:
            return mf.hash_fd(fd)
        return await trio.to_thread.run_sync(self._hash_paced, fd, limiter=self._limiter)

    def _hash_paced(self, fd: int) -> mf.Digest:
        """`mf.hash_fd` in a hash thread, pausing between chunks while a file is being written
        (see the module docstring)."""
        last = time.monotonic()

        def between() -> None:
            nonlocal last
            now = time.monotonic()
            if self._writing():
                pause = (now - last) * YIELD_RATIO
                time.sleep(pause)
                with self._yielded_lock:
                    self.yielded += pause
                now = time.monotonic()
            last = now

        return mf.hash_fd(fd, between)

    async def _in_background(self, node: Node, gen: int) -> None:
        if self._queued.get(node) == gen:
            del self._queued[node]
        if node.gen != gen or node.seal is not None or node.active_writers:
            return  # written again since (its next close seals it), or sealed by a commit
        try:
            await self.seal(node)
        except (FsError, OSError) as exc:  # removed or evicted meanwhile: nothing to seal
            log.debug("background seal of inode %d skipped: %s", node.ino, exc)

    def _seal_now(self, node: Node, gen: int,
                  opened: tuple[int, os.stat_result] | None = None) -> None:
        """`start`'s seal of a small file, with no await: no other hash of it can run
        meanwhile. One that grew past INLINE_HASH_BYTES since its size was taken goes to the
        background as any other. `opened`: a descriptor of its backing file (read with
        pread, which leaves its offset) and its fstat a moment ago; a file unlinked
        meanwhile is not sealed, as where it is opened here."""
        before: os.stat_result | None = None
        own = True  # a descriptor opened here, closed here
        if opened is not None and node.parent is not None:
            (fd, before), own = opened, False
        else:
            try:
                fd = os.open(self._backing(node), os.O_RDONLY)
            except (FsError, OSError) as exc:  # removed or evicted meanwhile: nothing to seal
                log.debug("seal of inode %d skipped: %s", node.ino, exc)
                return
        try:
            if before is None:
                before = os.fstat(fd)
            if before.st_size > INLINE_HASH_BYTES:
                assert self.spawner is not None
                self._queued[node] = gen
                self.spawner.spawn(self._in_background, node, gen)
                return
            digest = mf.hash_fd(fd)
            after = os.fstat(fd)
        finally:
            if own:
                os.close(fd)
        self._keep(node, gen, digest, before, after)

    async def _hash(self, node: Node, gen: int) -> None:
        """Hash the node's content in a thread; keep the seal only if nothing wrote meanwhile."""
        try:
            fd = os.open(self._backing(node), os.O_RDONLY)
        except FsError:
            return
        try:
            before = os.fstat(fd)
            digest = await self._hash_fd(fd, before.st_size)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        self._keep(node, gen, digest, before, after)

    def _keep(self, node: Node, gen: int, digest: mf.Digest, before: os.stat_result,
              after: os.stat_result) -> None:
        """Keep the seal of a hash taken between `before` and `after` only if nothing wrote the
        file meanwhile."""
        seal = Seal(digest, after.st_ino, after.st_mtime_ns)
        if (node.gen == gen and node.active_writers == 0 and seal.describes(before)
                and seal.describes(after)):
            node.seal = seal
            if not node.open_for_writing:
                self._settled(node)
